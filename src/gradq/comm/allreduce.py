"""Shared-scale integer all-reduce (docs/algorithms.md, second bullet): summable quantizers only.

Steps, for ``M`` workers holding ``g^m``:

1. every worker computes ``q.shared_stats(g^m)``; each stat is all-reduced with its op
   (``max`` → ``ReduceOp.MAX``, e.g. the scale ``w = max_m ‖g^m‖``; ``min`` → ``MIN``, e.g. the
   multiscale indices ``s_i* = min_m s_i*^m``; ``sum`` → ``SUM``);
2. every worker encodes integer codes ``c^m = q.encode_codes(g^m, shared=reduced)``, ``|c^m_i| ≤ s``;
3. the codes are SUM all-reduced in the narrowest integer dtype that cannot overflow for ``M·s``
   (:func:`code_dtype`: int8 only when ``M·s ≤ 127``) — float casts (``none``/``fp16``/``bf16``, whose
   ``max_code`` is ``None``) are summed in their own dtype;
4. ``q.decode_codes(Σ_m c^m, shared=reduced, count=M)`` is the average of the workers' decodes
   (e.g. QSGDMaxNorm: ``w·Σ_m c^m/(s·M)``, [Vineeth] §3.1).

Fast path (MaxNorm, TernGrad on CPU): the codes come from the fused kernel as uint8 *fields*
``c + s`` (:meth:`SummableQuantizer.encode_fields`, the same codes); the SUM of ``M`` workers' fields is
``Σc + M·s`` and is sent as uint8 when ``2·M·s ≤ 255`` (the same bound as int8 codes, ``M·s ≤ 127``),
otherwise widened; the decode of the sum subtracts ``M·s`` and scales per bucket in one kernel pass.
The average then differs from ``decode_codes``'s by float rounding only (``Σc·w/(M·s)`` in one product).

Backend note (measured with torch 2.13): gloo's ``all_reduce`` accepts int8, uint8, int32, int64,
float16, bfloat16, float32 but rejects int16 ("Invalid scalar type"); NCCL has no int16 type either.
So on gloo and NCCL an int16 choice is sent as int32 (:func:`reduce_dtype`); the pure rule
:func:`code_dtype` still reports int16.

Traffic per worker (ring all-reduce of ``n`` codes of ``b`` bytes): ``2(M−1)/M · n·b`` bytes, plus the
same formula for the (small) shared stats. A small vector (the stats, the codes of a small tensor:
at most ``SMALL_SUM_BYTES / M`` bytes, and at most ``SMALL_EXTRA_BYTES`` more sent than by the ring)
goes through one all-to-all instead and is combined locally
(:func:`gradq.comm._util.reduce_over_ranks`: one round instead of ``2(M−1)``, for ``(M−1)·n·b``
bytes); ``info["bytes_sent"]`` counts what was really sent.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..quantizers.base import Quantizer
from ._util import check_inputs, decoding, one_round_fits, phase, raise_if_damaged, reduce_segments

__all__ = ["shared_scale_allreduce", "shared_scale_allreduce_many", "code_dtype", "reduce_dtype",
           "allreduce_bytes_per_worker", "summed_nbytes"]

_OPS = ("max", "min", "sum")
#: dtypes a backend's all_reduce cannot take, and what to send instead
_PROMOTE = {"gloo": {torch.int16: torch.int32}, "nccl": {torch.int16: torch.int32}}


def summed_itemsize(world_size: int, max_code: int, fields: bool, backend: str = "gloo") -> int:
    """Bytes per coordinate that :func:`shared_scale_allreduce` sums at ``world_size`` workers: one
    byte of fields ``c + s`` while ``2·M·s ≤ 255`` (schemes with a fields path), else the integer
    type of the sum, as the backend can add it (:func:`reduce_dtype`)."""
    if fields and 2 * world_size * max_code <= 255:
        return 1
    return torch.empty(0, dtype=reduce_dtype(code_dtype(world_size, (2 if fields else 1) * max_code), backend)
                       ).element_size()


def summed_nbytes(q: Any, numel: int, world_size: int, backend: str = "gloo") -> int:
    """Bytes of the vectors one worker reduces in :func:`shared_scale_allreduce` for a tensor of
    ``numel`` values: its shared statistics (MultiScale's include a byte of scale index a code) and
    its codes, each code :func:`summed_itemsize` wide (a GlobalRandK variant sums its ``K``
    selected codes only). A ring all-reduce sends ``2(M−1)/M`` of it."""
    stats = sum(count * torch.empty((), dtype=reduce_dtype(dt, backend)).element_size()
                for dt, count in q.stat_layout(numel).values())
    mc = q.max_code
    if mc is None:   # (a cast: its values in the wire dtype)
        return stats + q.num_codes(numel) * torch.empty((), dtype=q.field_layout(1)["values"][0]).element_size()
    return stats + q.num_codes(numel) * summed_itemsize(world_size, int(mc), bool(q.has_fields), backend)


def code_dtype(world_size: int, max_code: int) -> torch.dtype:
    """The narrowest signed integer dtype holding any sum of ``world_size`` codes in ``[−s, s]``:
    int8 when ``M·s ≤ 127``, int16 when ``≤ 32767``, int32 when ``≤ 2³¹−1``, else int64."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(max_code, bool) or not isinstance(max_code, int) or max_code < 0:
        raise ValueError(f"max_code must be a non-negative int, got {max_code!r}")
    bound = world_size * max_code
    for dt in (torch.int8, torch.int16, torch.int32):
        if bound <= torch.iinfo(dt).max:
            return dt
    if bound <= torch.iinfo(torch.int64).max:
        return torch.int64
    raise OverflowError(f"{world_size}·{max_code} exceeds int64")


def reduce_dtype(dtype: torch.dtype, backend: str) -> torch.dtype:
    """``dtype``, or the next wider one where ``backend``'s all_reduce does not support it
    (int16 → int32 on gloo and NCCL)."""
    name = str(backend).lower()  # "gloo", "nccl", or a device-qualified spelling such as "cuda:gloo"
    for key, table in _PROMOTE.items():
        if key in name:
            return table.get(dtype, dtype)
    return dtype


def allreduce_bytes_per_worker(numel: int, world_size: int, dtype: torch.dtype) -> int:
    """Bytes one worker sends in a ring all-reduce of ``numel`` values of ``dtype``:
    ``2(M−1)/M · numel · itemsize`` (rounded down)."""
    item = torch.empty((), dtype=dtype).element_size()
    return (2 * (world_size - 1) * numel * item) // world_size


def shared_scale_allreduce(x: torch.Tensor, q: Quantizer, *, group: Any = None, seed: int,
                           shared_seed: Optional[int] = None, name: Optional[str] = None,
                           info: Optional[dict] = None, verify: bool = True, check_finite: bool = True,
                           defer_damage: bool = False) -> torch.Tensor:
    """Average over workers of the decoded gradients via an integer SUM all-reduce (module docstring).

    Args:
        x: this worker's gradient (any floating dtype/shape, same numel on every rank).
        q: a summable quantizer (``q.summable``), possibly wrapped in error feedback.
        group: process group (``None`` = default).
        seed: base seed common to all ranks; codes use ``derive_seed(seed, rank, "encode")``.
        shared_seed: seed common to all ranks for ``needs_shared_seed`` schemes (Rand-K coordinates);
            default ``derive_seed(seed, None, "shared")``. Checked to be equal on all ranks.
        name: tensor name (error-feedback key).
        info: optional dict filled with ``code_dtype`` (the rule), ``wire_dtype`` (what was sent) and
            ``bytes_sent`` (:func:`allreduce_bytes_per_worker` for the codes).
        check_finite: ``False`` where the caller screened ``x`` for NaN/Inf itself (the DDP hook):
            the statistics and codes skip their own screen where the scheme allows it (see
            :meth:`gradq.Quantizer.encode`): one pass over ``x`` less each, and on a GPU a host read.
        defer_damage: a sum whose decode finds codes no encode writes (MultiScale's scale index of
            no scale) is counted in ``info["invalid"]`` and left to the caller to refuse (the DDP
            hook, on every rank at the step's end), instead of raising :class:`gradq.PayloadError`
            here; on a GPU that saves the decode's host read.
    Raises:
        TypeError: ``q`` is not summable (use :func:`allgather_mean` or :func:`scatter_allgather`).
        PayloadError: the summed codes do not decode (a damaged exchange), unless ``defer_damage``.
    """
    from . import derive_seed

    if not getattr(q, "summable", False):
        raise TypeError(f"shared_scale_allreduce (shared-scale integer all-reduce) needs a summable "
                        f"quantizer; {getattr(q, 'spec', q)!r} is not (its codes cannot be added across "
                        "workers). Use gradq.comm.allgather_mean or gradq.comm.scatter_allgather instead.")
    if q.needs_shared_seed and shared_seed is None:
        shared_seed = derive_seed(seed, None, "shared")
    extra = [] if shared_seed is None else [int(shared_seed) & ((1 << 63) - 1)]
    check_inputs("shared_scale_allreduce", x, q, group, extra, verify=verify)
    return shared_scale_allreduce_many([x], q, group=group, seeds=[seed], shared_seeds=[shared_seed], names=[name],
                                       info=info, check_finite=check_finite, defer_damage=defer_damage)[0]


def _merged_reduce(items: list[tuple[Any, torch.Tensor, str]], group: Any, what: str,
                   owned: bool = False) -> tuple[dict, int]:
    """Reduce several tensors of one dtype, each with its op (``(key, tensor, op)``), with one exchange
    when they are small (:func:`reduce_segments`): concatenated, reduced, split back by key. ``owned``:
    the tensors are the caller's scratch, and where they lie back to back in one buffer (the fields)
    they are reduced there, with no concatenation."""
    flat = _span([t for _, t, _ in items]) if owned else None
    if flat is None:
        flat = torch.cat([t.reshape(-1) for _, t, _ in items])
    if not flat.numel():
        return {k: t for k, t, _ in items}, 0
    total, sent = reduce_segments(flat, [(t.numel(), op) for _, t, op in items], group, what=what)
    parts = torch.split(total, [t.numel() for _, t, _ in items])
    return {k: part.view_as(t) for (k, t, _), part in zip(items, parts)}, sent


def _span(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One 1-D view of ``tensors`` where they lie back to back, in order, in one storage (contiguous,
    one dtype); None otherwise."""
    first = tensors[0]
    at, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.data_ptr() != at
                or t.untyped_storage().data_ptr() != storage):
            return None
        at += t.numel() * t.element_size()
    return first.as_strided((sum(t.numel() for t in tensors),), (1,))


def shared_scale_allreduce_many(xs: Sequence[torch.Tensor], q: Quantizer, *, group: Any = None,
                                seeds: Sequence[int], shared_seeds: Optional[Sequence[Optional[int]]] = None,
                                names: Optional[Sequence[Optional[str]]] = None,
                                info: Optional[dict] = None, extra: Optional[torch.Tensor] = None,
                                check_finite: bool = True, defer_damage: bool = False,
                                outs: Optional[Sequence[Optional[torch.Tensor]]] = None) -> list[torch.Tensor]:
    """:func:`shared_scale_allreduce` of several tensors at once, each quantized on its own (layer-wise
    schemes keep one scale per tensor) with its own seed, name and shared seed, but with ONE exchange
    per wire dtype for all their shared statistics (whatever their reduction ops, while small; else one
    per op) and ONE per wire dtype for all their codes — the same values as separate calls (integer
    sums, MAX and MIN do not depend on the order), for far fewer collectives when the tensors are small.
    No cross-rank check (callers check once).

    ``extra``: a 1-D float32 vector to SUM over ranks along with the statistics (in their exchange:
    the hook's float32 tensors and its agreement values ride there instead of taking a round of their
    own); its sum is left in ``info["extra_sum"]`` (``info`` is then required). ``check_finite`` and
    ``defer_damage``: as in :func:`shared_scale_allreduce`.

    ``outs``: where to write each average (``None`` entries: a new tensor), for instance ``xs``
    themselves, which the encodes have read by then (the DDP hook's bucket views). Schemes with a
    fields path decode the sum straight into a float32 one (no input-sized allocation, whose page
    faults cost a CPU about four times the decode); the codes' decodes divide into it."""
    from . import derive_seed

    n = len(xs)
    names = list(names) if names is not None else [None] * n
    shared_seeds = list(shared_seeds) if shared_seeds is not None else [None] * n
    shared_seeds = [derive_seed(sd, None, "shared") if q.needs_shared_seed and ss is None else ss
                    for sd, ss in zip(seeds, shared_seeds)]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    backend = dist.get_backend(group)
    sent = 0

    if extra is not None and (info is None or extra.dim() != 1 or extra.dtype != torch.float32):
        raise ValueError("extra must be a 1-D float32 tensor, and its sum needs an info dict")

    # 1. every tensor's shared statistics, one exchange per wire dtype (and the extra, summed beside them)
    with phase(info, "encode"):
        stats = [q.shared_stats(x, shared_seed=ss, name=nm, check_finite=check_finite)
                 for x, ss, nm in zip(xs, shared_seeds, names)]
    batches: dict[str, list[tuple[Any, torch.Tensor, str]]] = {}
    for i, st in enumerate(stats):
        for key in sorted(st):
            value, op = st[key].value, st[key].op
            if op not in _OPS:
                raise ValueError(f"{q.spec}: shared stat {key!r} has unknown reduction {op!r}")
            wire = reduce_dtype(value.dtype, backend)
            batches.setdefault(str(wire), []).append(((i, key), value.detach().to(wire).contiguous(), op))
    if extra is not None:
        # beside the float32 statistics while that stays one all-to-all; else an exchange of its own
        # (a large extra must not push the few statistics onto a ring's 2(M−1) rounds)
        f32 = batches.get(str(torch.float32), [])
        both = 4 * (extra.numel() + sum(t.numel() for _, t, _ in f32))
        label = str(torch.float32) if not f32 or one_round_fits(both, world) else "~extra"
        batches.setdefault(label, []).append(("extra", extra, "sum"))
    reduced_all: dict[Any, torch.Tensor] = {}
    with phase(info, "comm"):
        for label in sorted(batches):
            what = "the float32 all-reduce" if label == "~extra" else "the all-reduce of the shared statistics"
            got, b = _merged_reduce(batches[label], group, what)
            reduced_all.update(got)
            sent += b
    reduced = [{key: reduced_all[(i, key)].to(stats[i][key][0].dtype) for key in stats[i]} for i in range(n)]
    if extra is not None:
        info["extra_sum"] = reduced_all["extra"]  # type: ignore[index]

    # 2. every tensor's codes, one exchange per wire dtype
    max_code = q.max_code  # type: ignore[attr-defined]
    totals: list[tuple[torch.Tensor, bool]] = []
    rule = wire = None
    slots: list[Optional[torch.Tensor]] = [None] * n
    pooled = n > 0 and max_code is not None and getattr(q, "has_fields", False) and 2 * world * int(max_code) <= 255 \
        and len({x.device for x in xs}) == 1
    if pooled:
        # the fields of every tensor in one buffer, in order: reduced there, with no concatenation
        counts = [q.num_codes(x.numel()) for x in xs]  # type: ignore[attr-defined]
        slots = list(torch.split(torch.empty(sum(counts), dtype=torch.uint8, device=xs[0].device), counts))
    for i, x in enumerate(xs):
        seed_r = derive_seed(seeds[i], rank, "encode")
        fields = None
        with phase(info, "encode"):
            if max_code is not None and hasattr(q, "encode_fields"):
                # (own: the statistics reduced[i] was reduced from, so the encode neither computes
                # them again nor checks the reduction against them: a host read on a GPU)
                fields = q.encode_fields(x, shared=reduced[i], seed=seed_r, shared_seed=shared_seeds[i], name=names[i],
                                         check_finite=check_finite, own=stats[i], out=slots[i])
            if fields is not None:
                # fast path: one byte c + s per coordinate; Σ_m fields fits uint8 when 2Ms ≤ 255
                rule = code_dtype(world, int(max_code))
                wide = 2 * world * int(max_code) > 255
                wire = reduce_dtype(code_dtype(world, 2 * int(max_code)), backend) if wide else torch.uint8
                totals.append((fields.to(wire) if wide else fields, True))
            else:
                codes = q.encode_codes(x, shared=reduced[i], seed=seed_r,  # type: ignore[attr-defined]
                                       shared_seed=shared_seeds[i], name=names[i], check_finite=check_finite,
                                       own=stats[i])
                rule = codes.dtype if max_code is None else code_dtype(world, int(max_code))
                wire = reduce_dtype(rule, backend)
                totals.append((codes.to(wire).contiguous(), False))
    by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    for i, (t, _) in enumerate(totals):
        by_dtype.setdefault(t.dtype, []).append((i, t))
    summed: dict[int, torch.Tensor] = {}
    with phase(info, "comm"):
        for dt in sorted(by_dtype, key=str):
            got, b = _merged_reduce([(i, t, "sum") for i, t in by_dtype[dt]], group,
                                    "the integer all-reduce of the codes",
                                    owned=dt == torch.uint8 and pooled)   # (our fields buffer)
            summed.update(got)
            sent += b
    res = []
    into = list(outs) if outs is not None else [None] * n
    if len(into) != n:
        raise ValueError(f"outs must hold one entry a tensor ({n}), got {len(into)}")
    counts = {} if info is None else info   # (decodes that find codes no encode writes are counted here)
    with decoding(counts):
        for i, x in enumerate(xs):
            o = into[i]
            direct = o is not None and o.dtype == torch.float32 == x.dtype and o.is_contiguous() \
                and o.numel() == x.numel() and o.device == summed[i].device
            if totals[i][1]:
                avg = q.decode_field_sum(summed[i], shared=reduced[i], count=world, like=x,
                                         shared_seed=shared_seeds[i], out=o if direct else None)
            else:
                avg = q.decode_codes(summed[i], shared=reduced[i], count=world, like=x,  # type: ignore[attr-defined]
                                     shared_seed=shared_seeds[i], out=o if direct else None)
            if o is not None and not direct:
                avg = o.copy_(avg.reshape(o.shape))
            res.append(avg)
    if info is not None:
        info.update(code_dtype=rule, wire_dtype=wire, bytes_sent=sent)
    raise_if_damaged("shared_scale_allreduce", counts, defer_damage)
    return res
