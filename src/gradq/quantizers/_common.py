"""Helpers shared by the quantizer families: buckets, stochastic rounding, code widths."""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch

from ..random import RandomStream

__all__ = ["fast_cpu", "num_buckets", "bucket_chunks", "bucket_view", "stochastic_round", "code_width",
           "levels_from_bits", "bucket_norms"]


def fast_cpu(t: torch.Tensor) -> bool:
    """Whether the fused CPU kernels (:mod:`gradq.kernels`) should handle ``t``: a CPU tensor and
    kernels available (numba loads, and neither ``GRADQ_KERNELS=0`` nor ``set_enabled(False)``).
    They give the same bytes as the plain-torch code they replace, which stays the reference and the
    path for every other device."""
    if t.device.type != "cpu":
        return False
    from .. import kernels

    return kernels.available()


def num_buckets(n: int, bucket: Optional[int]) -> int:
    """Number of buckets of size ``bucket`` (``None`` = one bucket for the whole tensor)."""
    if n == 0:
        return 0
    if bucket is None:
        return 1
    return (n + bucket - 1) // bucket


def bucket_view(v: torch.Tensor, bucket: Optional[int]) -> torch.Tensor:
    """``v`` as an ``(num_buckets, d)`` matrix, the last bucket zero-padded.

    Zero padding is harmless for norms and for any rounding where a zero stays a zero; schemes that
    look at the bucket's minimum, quantiles or counts use :func:`bucket_chunks` instead."""
    n = v.numel()
    d = n if bucket is None else bucket
    nb = num_buckets(n, bucket)
    if nb == 0:
        return v.new_zeros(0, max(d, 1))
    pad = nb * d - n
    if pad:
        v = torch.cat([v, v.new_zeros(pad)])
    return v.view(nb, d)


def bucket_chunks(v: torch.Tensor, bucket: Optional[int]) -> Iterator[torch.Tensor]:
    """Yield at most two matrices covering ``v`` in order, without padding: the full buckets as a
    ``(k, bucket)`` matrix and the last partial bucket as a ``(1, r)`` matrix."""
    n = v.numel()
    if n == 0:
        return
    if bucket is None or bucket >= n:
        yield v.view(1, n)
        return
    full = (n // bucket) * bucket
    if full:
        yield v[:full].view(-1, bucket)
    if full < n:
        yield v[full:].view(1, n - full)


def bucket_norms(mat: torch.Tensor, norm: str) -> torch.Tensor:
    """Per-row L2 (``"l2"``) or max-abs (``"max"``) norm of a bucket matrix."""
    if mat.numel() == 0:
        return mat.new_zeros(mat.shape[0])
    if norm == "l2":
        return torch.linalg.vector_norm(mat, dim=1)
    return mat.abs().amax(dim=1)


def stochastic_round(a: torch.Tensor, rng: RandomStream) -> torch.Tensor:
    """Round non-negative ``a`` to ``floor(a)`` or ``floor(a)+1`` with probability of the latter
    ``a - floor(a)`` (unbiased): ``floor(a + u)`` with ``u`` uniform on [0, 1)."""
    u = rng.uniform(a.numel(), a.device).view(a.shape)
    return torch.floor(a + u)


def code_width(num_values: int) -> int:
    """Bits needed to store ``num_values`` distinct codes (at least 1)."""
    return max(1, math.ceil(math.log2(num_values))) if num_values > 1 else 1


def levels_from_bits(bits: int) -> int:
    """Sign-magnitude convention of ALGORITHMS.md §0: ``bits=b`` gives ``s = 2**(b-1) - 1`` levels."""
    return (1 << (bits - 1)) - 1
