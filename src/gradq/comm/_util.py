"""Helpers shared by the protocols: validation, rank-ordered averaging, variable-size byte exchange."""

from __future__ import annotations

import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..payload import Payload
from ..quantizers.base import Quantizer
from ..transforms import ErrorFeedback

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_inputs(fn: str, x: torch.Tensor, q: Quantizer, group, extra: Sequence[int] = ()) -> tuple[int, int]:
    """Validate ``x``/``q`` and check, with ONE small MAX all-reduce, that every rank passes the same
    number of coordinates, the same quantizer spec and the same ``extra`` integers.
    Returns ``(rank, world_size)`` in ``group``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{fn}: torch.distributed is not initialized (call init_process_group first)")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"{fn}: expected a floating-point tensor, got {x.dtype}")
    if not isinstance(q, Quantizer):
        raise TypeError(f"{fn}: expected a gradq Quantizer, got {type(q).__name__}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    vals = [x.numel(), zlib.crc32(q.spec.encode("utf-8")), *[int(e) for e in extra]]
    t = torch.tensor(vals + [-v for v in vals], dtype=torch.int64, device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    hi, neg_lo = t[: len(vals)].tolist(), t[len(vals):].tolist()
    what = ["numel", "quantizer spec", *[f"argument {i}" for i in range(len(extra))]]
    for i, w in enumerate(what):
        if hi[i] != -neg_lo[i]:
            raise ValueError(f"{fn}: ranks disagree on {w} (this rank: {vals[i]}, range over ranks "
                             f"{-neg_lo[i]}..{hi[i]}); every rank must pass the same size and quantizer")
    return rank, world


def plain(q: Quantizer) -> Quantizer:
    """``q`` without its error-feedback wrapper (for re-encoding an average, which has no memory)."""
    return q.inner if isinstance(q, ErrorFeedback) else q


def mean_in_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(p_0 + p_1 + … + p_{M-1}) / M`` in float32, summed left to right (bit-reproducible)."""
    acc = parts[0].detach().reshape(-1).to(torch.float32).clone()
    for p in parts[1:]:
        acc += p.detach().reshape(-1).to(torch.float32)
    return acc / len(parts)


def decode_bytes(q: Quantizer, buf: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Decode one serialized payload (``Payload.to_bytes`` output, unpadded)."""
    return q.decode(q.payload_from_bytes(buf, shape, dtype))


def all_gather_bytes(buf: torch.Tensor, fixed: Optional[int], group) -> list[torch.Tensor]:
    """All-gather 1-D uint8 buffers of possibly different lengths; returns one per rank (unpadded).

    ``fixed``: the byte length every rank's buffer is known to have (skips the size exchange)."""
    world = dist.get_world_size(group)
    if fixed is not None:
        if buf.numel() != fixed:
            raise RuntimeError(f"payload has {buf.numel()} bytes, its quantizer promised {fixed}")
        sizes = [fixed] * world
    else:
        n = torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device)
        got = [torch.empty_like(n) for _ in range(world)]
        dist.all_gather(got, n, group=group)
        sizes = [int(s) for s in torch.cat(got).tolist()]
    width = max(sizes)
    send = buf if buf.numel() == width else torch.cat([buf, buf.new_zeros(width - buf.numel())])
    out = [torch.empty(width, dtype=torch.uint8, device=buf.device) for _ in range(world)]
    dist.all_gather(out, send, group=group)
    return [o[:s] for o, s in zip(out, sizes)]


def payload_bytes(p: Payload) -> torch.Tensor:
    return p.to_bytes().reshape(-1)
