"""The wire format of :class:`gradq.fsdp.GradqReduceScatter`: one rank's payloads for the
all-to-all, and the decode and reduction of the payloads it receives.

A payload for block ``j`` holds, in order: the byte lengths of its compressed parts (int32 each, only
when the scheme's sizes depend on the data), the compressed parts (one for the whole compressed
range, or one per layer for layer-wise schemes), the full-precision values as raw bytes of FSDP's
reduce dtype, the sender's count of non-finite values (:data:`FLAG` bytes, int32), and on CPU tensors
a CRC-32 trailer (:func:`gradq.comm._util.seal`)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .comm import derive_seed
from .comm._util import decoded_or_zeros, note_damage, refused_later, seal, seal_bytes, unseal
from .errors import NonFiniteError, PayloadError
from .fsdp_layout import Plan, screen
from .quantizers.base import Quantizer

__all__ = ["encode_rows", "decode_sum", "shared_seeds", "FLAG"]

#: bytes per payload carrying the sender's count of non-finite values (int32)
FLAG = 4


def _part_keys(call: int, owner: int, n_parts: int) -> list[str]:
    """The keys the seeds of call ``call``'s payloads for ``owners`` block derive from, one a part."""
    tag = f"rs{call}:{owner}"
    return [tag] if n_parts == 1 else [f"{tag}:{i}" for i in range(n_parts)]


def shared_seeds(q: Quantizer, seed: int, call: int, owner: int, n_parts: int) -> list[Optional[int]]:
    """The shared seeds of call ``call``'s payloads for ``owner``'s block, one a part: common to
    every sender, so that the owner decodes with them instead of reading each payload's seed field
    (a host wait on a GPU). ``None`` for schemes without ``needs_shared_seed``."""
    return [derive_seed(seed, None, pk) if q.needs_shared_seed else None for pk in _part_keys(call, owner, n_parts)]


def encode_rows(q: Quantizer, rows: torch.Tensor, plan: Plan, owners: list[int], rank: int, key: str, bad: Any, *,
                seed: int, call: int, checksum: bool,
                screened: Optional[bool] = None) -> tuple[list[torch.Tensor], Optional[int], Any]:
    """Row ``j``'s payload for ``owners[j]``: [part lengths when variable] compressed parts, raw
    full-precision values, the non-finite count (int32), [CRC-32]. Returns the payloads, their
    common size (``None`` when data-dependent) and the count. ``bad=None``: the quantizer's own
    screen finds non-finite values (it raises before encoding anything); the rows are then
    counted, cleaned and encoded again. ``screened`` (default: ``bad`` is not None): the rows were
    cleaned here, so the quantizer may skip its own check (on a GPU, a host read per payload)."""
    if screened is None:
        screened = bad is not None
    if bad is None:
        n_bad, _ = screen(plan.split(rows)[1])   # the raw values: no quantizer looks at them
        if n_bad:
            bad, rows = screen(rows)
        else:
            try:
                return encode_rows(q, rows, plan, owners, rank, key, 0, seed=seed, call=call, checksum=checksum,
                                   screened=False)
            except NonFiniteError:
                bad, rows = screen(rows)
        screened = True
    trailer = seal_bytes(rows.device, checksum)
    comp, full = plan.split(rows)
    comp = comp.to(torch.float32)
    full = full.contiguous()
    raw = full.element_size() * plan.n_full
    fixed_parts = [q.expected_nbytes(b - a) for a, b in plan.parts]
    variable = any(f is None for f in fixed_parts)
    head = 4 * len(plan.parts) if variable else 0
    if isinstance(bad, torch.Tensor):
        flag = bad.clamp(max=2 ** 31 - 1).to(torch.int32).reshape(1).view(torch.uint8)
    else:
        flag = torch.tensor([min(int(bad), 2 ** 31 - 1)], dtype=torch.int32).view(torch.uint8)
    bufs = []
    for j, owner in enumerate(owners):
        keys = _part_keys(call, owner, len(plan.parts))
        seeds = shared_seeds(q, seed, call, owner, len(plan.parts))
        payloads = [q.encode(comp[j, a:b], seed=derive_seed(seed, rank, pk), shared_seed=ss,
                             name=f"{key}:{owner}:{i}", check_finite=not screened)
                    for i, ((a, b), pk, ss) in enumerate(zip(plan.parts, keys, seeds))]
        buf = torch.empty(head + sum(p.nbytes for p in payloads) + raw + FLAG + trailer, dtype=torch.uint8,
                          device=rows.device)
        if variable:
            buf[:head].copy_(torch.tensor([p.nbytes for p in payloads], dtype=torch.int32).view(torch.uint8))
        pos = head
        for p in payloads:
            p.to_bytes(out=buf[pos:pos + p.nbytes])
            pos += p.nbytes
        if raw:
            buf[pos:pos + raw].copy_(full[j].view(torch.uint8))
            pos += raw
        buf[pos:pos + FLAG].copy_(flag)
        seal(buf, trailer)
        bufs.append(buf)
    fixed = None if variable else head + sum(fixed_parts) + raw + FLAG + trailer  # type: ignore[arg-type]
    return bufs, fixed, bad

def decode_sum(q: Quantizer, recv: torch.Tensor, recv_sizes: list[int], plan: Plan, dtype: torch.dtype,
               device: torch.device, key: str, divide: Optional[int], factor: float, *,
               checksum: bool, info: Optional[dict] = None,
               seeds: Optional[list[Optional[int]]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode the received payloads and reduce them, summed in rank order: divided by ``divide``
    (AVG), else times ``factor``. Returns ``(result, non-finite count over the senders)`` (the count
    a device tensor). ``dtype``: the full-precision values' (FSDP's reduce dtype). The mean of the
    compressed values is one fused pass (``decode_mean``) when every rank's payload is here.
    ``seeds``: the parts' shared seeds (:func:`shared_seeds` for this rank's block), which the
    decodes use and compare with the payloads' seed fields instead of reading them.

    With ``info`` nothing raises on a payload this rank received damaged: one that failed its
    checksum is counted in ``info["damaged"]``, and one that does not parse or decode (an entropy-coded
    stream whose own CRC fails) in ``info["invalid"]``; the result is then zeros. Fields that no
    encode writes are counted in ``info["invalid"]`` by the decode (a device tensor where a GPU
    counted them). The
    caller refuses the step on every rank (:class:`gradq.fsdp.GradqReduceScatter` agrees on the counts
    at the step's end). Without ``info`` each raises :class:`gradq.PayloadError` here."""
    trailer = seal_bytes(device, checksum)
    fixed_parts = [q.expected_nbytes(b - a) for a, b in plan.parts]
    variable = any(f is None for f in fixed_parts)
    head = 4 * len(plan.parts) if variable else 0
    parts: list[list[Any]] = [[] for _ in plan.parts]
    raws, flags = [], []
    for i, buf in enumerate(torch.split(recv, recv_sizes)):
        body, intact = unseal(buf, trailer)
        what = f"the payload from rank {i} of module {key!r}"
        if not intact:
            if info is None:
                raise PayloadError(f"GradqReduceScatter: {what} failed its checksum")
            note_damage(info, f"{what} failed its checksum")
            continue

        def parse(body: torch.Tensor = body) -> tuple[list[Any], int]:
            # (a received payload may start at any byte: views of wider types go through a copy)
            lens = body[:head].clone().view(torch.int32).tolist() if variable else fixed_parts
            got, pos = [], head
            for (a, b), ln in zip(plan.parts, lens):
                got.append(q.payload_from_bytes(body[pos:pos + ln], (b - a,), torch.float32, copy=False))
                pos += ln
            return got, pos

        parsed = parse() if info is None else decoded_or_zeros(info, parse, lambda: None, what)
        if parsed is None:   # (bytes that do not parse, counted in info)
            continue
        for k, p in enumerate(parsed[0]):
            parts[k].append(p)
        raws.append(body[parsed[1]:body.numel() - FLAG])
        flags.append(body[body.numel() - FLAG:])

    def zeros() -> tuple[torch.Tensor, torch.Tensor]:   # (a damaged payload: the step will be refused)
        return (torch.zeros(plan.S, dtype=torch.float32, device=device),
                torch.zeros((), dtype=torch.int64, device=device))

    if len(flags) < len(recv_sizes):   # nothing of a damaged payload is decoded
        return zeros()
    seeds = seeds if seeds is not None else [None] * len(plan.parts)
    if info is None:
        return _reduce(q, parts, raws, flags, plan, dtype, device, divide, factor, seeds)
    with refused_later(info):   # (and a stream that does not read, such as an Elias stream's own CRC)
        return decoded_or_zeros(info, lambda: _reduce(q, parts, raws, flags, plan, dtype, device, divide, factor,
                                                      seeds),
                                zeros, f"the payloads of module {key!r}")


def _reduce(q: Quantizer, parts: list[list[Any]], raws: list[torch.Tensor], flags: list[torch.Tensor], plan: Plan,
            dtype: torch.dtype, device: torch.device, divide: Optional[int], factor: float,
            seeds: list[Optional[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_sum`'s reduction of the parsed payloads."""
    K = len(flags)
    total = torch.empty(plan.S, dtype=torch.float32, device=device)
    if plan.n_comp:
        one = len(plan.comp) == 1
        cv = total[plan.comp[0][0]:plan.comp[0][1]] if one else torch.empty(plan.n_comp, device=device)
        for (a, b), pls, ss in zip(plan.parts, parts, seeds):
            if divide == K:   # ((d_0 + d_1) + …)/M in one pass, bit for bit the sum then the division
                q.decode_mean(pls, out=cv[a:b], shared_seed=ss)
                continue
            acc = q.decode(pls[0], out=cv[a:b], shared_seed=ss)
            tmp = torch.empty(b - a, dtype=torch.float32, device=device)
            for p in pls[1:]:
                acc.add_(q.decode(p, out=tmp, shared_seed=ss))
            if divide is not None:
                acc.div_(divide)
            elif factor != 1.0:
                acc.mul_(factor)
        if not one:
            plan.scatter_into(total, plan.comp, cv)
    if plan.n_full:
        fv = raws[0].clone().view(dtype).to(torch.float32)
        for r in raws[1:]:
            fv.add_(r.clone().view(dtype).to(torch.float32))
        if divide is not None:
            fv.div_(divide)
        elif factor != 1.0:
            fv.mul_(factor)
        plan.scatter_into(total, plan.full, fv)
    bad_total = torch.stack([f.clone().view(torch.int32)[0] for f in flags]).to(torch.int64).sum()
    return total, bad_total
