"""All-gather of payloads (docs/algorithms.md, first bullet): works with ANY quantizer.

Every worker encodes its gradient, serializes the payload (:meth:`Payload.to_bytes`), the byte buffers
are all-gathered (zero-padded to the largest, after an exchange of sizes when the quantizer's size is
data-dependent), and every worker decodes all ``M`` payloads and averages them in rank order 0..M−1 —
so every rank computes bit-identical results.

Traffic per worker (ring all-gather of ``B``-byte payloads): sends and receives ``(M−1)·B`` bytes,
``B = payload.nbytes ≈ n·bits/8 + header``; plus ``8(M−1)`` bytes of sizes for variable-length codes.
It grows linearly with ``M``, unlike :func:`scatter_allgather`'s ``≈ 2(M−1)/M · n·bits/8``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..quantizers.base import Quantizer
from ._util import (all_gather_bytes, check_inputs, decode_bytes, decoded_or_zeros, decoding, mean_in_order,
                    note_damage, phase, raise_if_damaged, seal_bytes, sealed_payload, unseal)

__all__ = ["allgather_mean", "allgather_bytes_per_worker", "AllgatherPipeline"]


def allgather_bytes_per_worker(payload_nbytes: int, world_size: int) -> int:
    """Bytes one worker sends in the payload all-gather: ``(M−1)·B`` (ring all-gather)."""
    return (world_size - 1) * payload_nbytes


def allgather_mean(x: torch.Tensor, q: Quantizer, *, group: Any = None, seed: int,
                   name: Optional[str] = None, info: Optional[dict] = None,
                   verify: bool = True, checksum: bool = True, defer_damage: bool = False,
                   check_finite: bool = True) -> torch.Tensor:
    """Average over the group's workers of ``q.decode(q.encode(x_m))``, identical on every rank.

    Args:
        x: this worker's gradient (any floating dtype and shape; same numel on every rank).
        q: any quantizer (equal spec on every rank); an :class:`ErrorFeedback` keeps its memory under ``name``.
        group: process group (``None`` = the default group).
        seed: base seed common to all ranks; this rank encodes with ``derive_seed(seed, rank, "encode")``
            (and, for ``needs_shared_seed`` schemes, ``shared_seed=derive_seed(seed, None, "shared")``).
        name: the tensor's name (error-feedback key, error messages).
        info: optional dict filled with ``payload_nbytes`` (this rank's), ``bytes_sent`` (the formula)
            and the seconds spent in ``encode_s``, ``comm_s`` and ``decode_s``.
        checksum, defer_damage: a CRC-32 trailer on every payload, as in :func:`scatter_allgather`
            (a damaged payload counts as zeros in the average and the call is refused).
        check_finite: ``False`` where the caller screened ``x`` for NaN/Inf itself (the DDP hook):
            the encodes skip their own check where the scheme allows it (see
            :meth:`gradq.Quantizer.encode`), which on a GPU saves a host read per payload.
    Returns:
        a tensor of ``x``'s shape and dtype.
    """
    from . import derive_seed

    rank, world = check_inputs("allgather_mean", x, q, group, verify=verify)
    shared_seed = derive_seed(seed, None, "shared") if q.needs_shared_seed else None
    info = {} if info is None else info
    trailer = seal_bytes(x.device, checksum)
    with phase(info, "encode"):
        buf = sealed_payload(q.encode(x, seed=derive_seed(seed, rank, "encode"), shared_seed=shared_seed,
                                      name=name, check_finite=check_finite), trailer)
    fixed = q.expected_nbytes(x.numel())
    with phase(info, "comm"):
        bufs = all_gather_bytes(buf, None if fixed is None else fixed + trailer, group)
    with decoding(info):
        out = _mean_of_payloads(q, bufs, trailer, x, info, name=None, shared_seed=shared_seed)
    info.update(payload_nbytes=int(buf.numel()),
                bytes_sent=allgather_bytes_per_worker(max(b.numel() for b in bufs), world))
    raise_if_damaged("allgather_mean", info, defer_damage)
    return out


class AllgatherPipeline:
    """:func:`allgather_mean` as a two-stage pipeline over a stream of segments (the DDP hook feeds it
    as gradients arrive): ``encode`` a segment and queue its all-gather on the comm lane, then, while
    the next segment is encoded, ``finish`` the previous one (decode-and-average every rank's payload
    into its output in one fused pass). The lane receives the all-gathers in the same order on every
    rank. With 2 ranks it sends what the scatter protocol sends, ``(M−1)·B``, with a third less
    encoding, one exchange per segment instead of two and no re-quantization of the average.
    Interface as :class:`gradq.comm.scatter.ScatterPipeline` (``add``, ``flush``, ``sent``)."""

    def __init__(self, q: Quantizer, *, group: Any = None, checksum: bool = True, info: Optional[dict] = None,
                 pipelined: bool = True, device: Optional[torch.device] = None, check_finite: bool = True) -> None:
        import torch.distributed as dist

        from .scatter import _Inline, _lane

        self.q = q
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.checksum = checksum
        self.check_finite = check_finite
        self.info = {} if info is None else info
        self.pipelined = pipelined and (device is None or torch.device(device).type == "cpu")
        self.lane: Any = _lane() if self.pipelined else _Inline
        self.sent = 0
        self._stages: list[tuple[dict[str, Any], Any]] = []

    def add(self, flat: torch.Tensor, out: torch.Tensor, *, seed: int, name: Optional[str],
            segment: Optional[int] = None) -> None:
        """Average the float32 vector ``flat`` into ``out`` (may be ``flat``), in segments of ``segment``
        values (seeds and keys per segment as the scatter pipeline's)."""
        from . import derive_seed
        from .scatter import SEGMENT_NUMEL

        seg = SEGMENT_NUMEL if segment is None else segment
        n = flat.numel()
        nseg = max(1, -(-n // seg))
        for k in range(nseg):
            a, b = k * seg, min(n, (k + 1) * seg)
            sd, key = (seed, name) if nseg == 1 else (derive_seed(seed, None, f"segment{k}"), f"{name}@{k}")
            self._stages.append(self._encode(flat[a:b], out[a:b], sd, key))
            while len(self._stages) > 1:
                self._finish(*self._stages.pop(0))

    def flush(self) -> None:
        while self._stages:
            self._finish(*self._stages.pop(0))

    def _encode(self, x: torch.Tensor, out: torch.Tensor, seed: int, name: Optional[str]) -> tuple[dict, Any]:
        from . import derive_seed

        q = self.q
        trailer = seal_bytes(x.device, self.checksum)
        ss = derive_seed(seed, None, "shared") if q.needs_shared_seed else None
        with phase(self.info, "encode"):
            buf = sealed_payload(q.encode(x, seed=derive_seed(seed, self.rank, "encode"), shared_seed=ss, name=name,
                                          check_finite=self.check_finite), trailer)
        fixed = q.expected_nbytes(x.numel())
        fixed = None if fixed is None else fixed + trailer
        self.sent += (self.world - 1) * int(buf.numel())
        group = self.group
        if self.pipelined:
            fut = self.lane.submit(lambda: all_gather_bytes(buf, fixed, group))
        else:
            with phase(self.info, "comm"):
                fut = self.lane.submit(lambda: all_gather_bytes(buf, fixed, group))
        return {"out": out, "n": x.numel(), "trailer": trailer, "name": name, "shared_seed": ss}, fut

    def _finish(self, st: dict[str, Any], fut: Any) -> None:
        with phase(self.info, "comm"):
            bufs = fut.result()
        with decoding(self.info):
            _mean_of_payloads(self.q, bufs, st["trailer"], st["out"], self.info, name=st["name"], out=st["out"],
                              shared_seed=st["shared_seed"])


def _mean_of_payloads(q: Quantizer, bufs: list[torch.Tensor], trailer: int, like: torch.Tensor, info: dict,
                      *, name: Optional[str], out: Optional[torch.Tensor] = None,
                      shared_seed: Optional[int] = None) -> torch.Tensor:
    """The average, in rank order, of the decodes of every rank's sealed payload (shape and dtype of
    ``like``): one fused pass where the scheme has a kernel (bit-identical to decoding each and adding);
    a payload whose checksum fails is noted in ``info`` and counts as zeros (the step will be refused).
    ``shared_seed``: the one every payload was encoded under (no read of their seed fields)."""
    prefix = f"{name}: " if name else ""
    where = prefix + "payload from rank {}"
    bodies = []
    for m, sealed in enumerate(bufs):
        body, ok = unseal(sealed, trailer)
        if not ok:
            note_damage(info, where.format(m))
        bodies.append(body if ok else None)
    # (a payload that does not parse or decode counts as zeros too, and is refused with the damaged ones)
    zeros = lambda: like.new_zeros(like.shape)  # noqa: E731
    if like.dtype == torch.float32 and all(b is not None for b in bodies):
        parsed = [decoded_or_zeros(info, lambda b=b: q.payload_from_bytes(b, like.shape, like.dtype, copy=False),
                                   lambda: None, where.format(m)) for m, b in enumerate(bodies)]
        if all(p is not None for p in parsed):
            return decoded_or_zeros(info, lambda: q.decode_mean(parsed, out=out, shared_seed=shared_seed),
                                    lambda: zeros() if out is None else out.zero_(),
                                    prefix + "the payloads' mean")
        bodies = [b if p is not None else None for b, p in zip(bodies, parsed)]   # (counted once, above)
    parts = [decoded_or_zeros(info, lambda b=b: decode_bytes(q, b, like.shape, like.dtype, shared_seed), zeros,
                              where.format(m))
             if b is not None else zeros() for m, b in enumerate(bodies)]
    mean = mean_in_order(parts).reshape(like.shape).to(like.dtype)
    return mean if out is None else out.copy_(mean)
