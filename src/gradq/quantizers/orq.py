"""Optimal random-rounding levels: ORQ-L and its naive baseline Linear-L (paper 003, §4 of ALGORITHMS.md).

**Rounding between levels.** For sorted levels ``b_0 ≤ … ≤ b_{L−1}`` of a bucket (``b_0 = min``,
``b_{L−1} = max``, so every value lies between two adjacent levels), a value ``g ∈ [b_{i−1}, b_i]`` is
rounded to ``b_i`` with probability ``(g − b_{i−1})/(b_i − b_{i−1})``, else to ``b_{i−1}``. This is
unbiased, with variance ``(b_i − g)(g − b_{i−1})``.

**ORQ-L** ([reconstructed] Theorem 1 and Algorithm 1; the paper's equations were lost). The total
rounding variance of an interval ``[a, b]`` split at ``c``,

    V(c) = Σ_{a≤g<c} (c − g)(g − a) + Σ_{c≤g≤b} (b − g)(g − c),

is continuous, convex and piecewise linear in ``c``, with slope

    h(c) = Σ_{a≤g<c} (g − a) − Σ_{c≤g≤b} (b − g),

which jumps up by ``b − a`` at every data value. Its minimizer is the sorted data value ``g_k`` at
which the slope on ``(g_k, g_{k+1})`` — left set ``{g ≤ g_k}`` — first becomes ``≥ 0``: the discrete
form of the optimality condition ``Σ_{a≤g<c}(g − a) = Σ_{c≤g≤b}(b − g)``. The greedy recursion starts
from ``{min, max}`` and, ``log2(L − 1)`` times, inserts that ``c`` into every current interval (the
midpoint ``(a + b)/2`` when no value lies strictly inside ``(a, b)``), giving ``L ∈ {3, 5, 9, 17}``
levels. All buckets and intervals of a round are handled at once: values are sorted per bucket,
assigned to intervals with ``searchsorted``, the segment sums come from global cumulative sums minus
the cumulative sum at the segment's start, and a ``scatter_reduce(amin)`` picks each interval's ``c``.

**Linear-L** (the paper's naive baseline): levels at the bucket's empirical quantiles ``i/(L − 1)``,
``b_i = sorted[round(i·(d − 1)/(L − 1))]`` (``b_0 = min``, ``b_{L−1} = max``), same rounding.

Both are unbiased. A constant bucket gets ``L`` equal levels and decodes exactly.

Wire: ``ceil(n·w/8)`` bytes of packed level indices, ``w = ceil(log2 L)`` bits (3 levels → 2 bits,
5 → 3, 9 → 4, 17 → 5), then ``L`` float32 levels per bucket (``4·L·⌈n/bucket⌉`` bytes), plus the
payload header. The last partial bucket has its own min, max and levels.

On CPU tensors (when :func:`gradq.kernels.available`) the encode runs in numba
(:mod:`gradq.kernels.levels`: sort, levels, rounding and packing per bucket) with the same bytes as
the torch code here, which stays the reference and the path for other devices.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

from ..codecs.bitpack import pack_bits, packed_nbytes, unpack_bits
from ..errors import PayloadError
from ..random import RandomStream
from ..spec import ChoiceParam, IntParam, register
from .base import EncodeContext, Quantizer
from .. import kernels
from ..kernels import levels as level_kernels
from ._common import bucket_chunks, code_width, fast_cpu, num_buckets

__all__ = ["ORQ", "Linear", "orq_levels", "linear_levels", "round_to_levels", "bucket_index"]

LEVELS_L = ChoiceParam("levels", 5, "number of levels L per bucket (2^k + 1)", choices=(3, 5, 9, 17))
BUCKET = IntParam("bucket", 512, "bucket size (none = whole tensor)", allow_none=True, lo=1)


def _check_matrix(mat: torch.Tensor, L: int) -> None:
    if mat.dim() != 2 or mat.shape[1] == 0:
        raise ValueError(f"expected a (buckets, d) matrix with d >= 1, got shape {tuple(mat.shape)}")
    if L < 2 or (L - 1) & (L - 2):
        raise ValueError(f"L must be 2^k + 1 (3, 5, 9, 17, ...), got {L}")


def orq_levels(mat: torch.Tensor, L: int) -> torch.Tensor:
    """ORQ's ``L`` levels for each row of ``mat`` (a ``(nb, d)`` float matrix): an ``(nb, L)`` float32
    matrix with sorted rows, first column the row minimum and last the maximum (see module docstring)."""
    _check_matrix(mat, L)
    nb, d = mat.shape
    srt = mat.to(torch.float32).sort(dim=1).values
    g64 = srt.to(torch.float64)
    inf = torch.tensor(math.inf, dtype=torch.float32, device=mat.device)
    lv = torch.stack([srt[:, 0], srt[:, -1]], dim=1)
    pos = torch.arange(d, device=mat.device).expand(nb, d)
    for _ in range(int(round(math.log2(L - 1)))):
        m = lv.shape[1]
        # interval of every sorted value: [lv[j], lv[j+1]); the maximum goes to the last interval
        ids = (torch.searchsorted(lv, srt, right=True) - 1).clamp_(0, m - 2)
        a = lv.gather(1, ids)
        b = lv.gather(1, ids + 1)
        left_terms = g64 - a.to(torch.float64)    # (g - a) >= 0
        right_terms = b.to(torch.float64) - g64   # (b - g) >= 0
        cum_l = left_terms.cumsum(dim=1)
        cum_r = right_terms.cumsum(dim=1)
        # first and last position of every value's segment (ids are non-decreasing along a row)
        change = ids[:, 1:] != ids[:, :-1]
        first = torch.cat([torch.ones_like(ids[:, :1], dtype=torch.bool), change], dim=1)
        last = torch.cat([change, torch.ones_like(ids[:, :1], dtype=torch.bool)], dim=1)
        start = torch.where(first, pos, torch.zeros_like(pos)).cummax(dim=1).values
        end = torch.where(last, pos, torch.full_like(pos, d - 1)).flip(1).cummin(dim=1).values.flip(1)
        # slope on (g_p, g_{p+1}) with left set = segment positions <= p
        left = cum_l - (cum_l - left_terms).gather(1, start)
        right = cum_r.gather(1, end) - cum_r
        slope = left - right
        ok = (srt > a) & (srt < b) & (slope >= 0)
        cand = torch.where(ok, srt, inf)
        c = torch.full((nb, m - 1), math.inf, dtype=torch.float32, device=mat.device)
        c = c.scatter_reduce(1, ids, cand, reduce="amin", include_self=True)
        # halves first (no overflow), then clamp: with equal odd denormal ends 0.5a + 0.5a can leave [a, b]
        mid = torch.minimum(torch.maximum(0.5 * lv[:, :-1] + 0.5 * lv[:, 1:], lv[:, :-1]), lv[:, 1:])
        c = torch.where(torch.isinf(c), mid, c)
        lv = torch.cat([torch.stack([lv[:, :-1], c], dim=2).reshape(nb, -1), lv[:, -1:]], dim=1)
    return lv


def linear_levels(mat: torch.Tensor, L: int) -> torch.Tensor:
    """Linear-L's levels per row: ``sorted[round(i·(d − 1)/(L − 1))]`` for ``i = 0 … L−1``."""
    _check_matrix(mat, L)
    d = mat.shape[1]
    srt = mat.to(torch.float32).sort(dim=1).values
    pos = torch.round(torch.arange(L, dtype=torch.float64, device=mat.device) * ((d - 1) / (L - 1)))
    return srt[:, pos.to(torch.int64)]


def round_to_levels(mat: torch.Tensor, levels: torch.Tensor, rng: RandomStream) -> torch.Tensor:
    """Unbiased stochastic rounding of every entry of ``mat`` (``(nb, d)``) onto its row of sorted
    ``levels`` (``(nb, L)``, covering the row's range); returns int64 level indices in ``[0, L−1]``."""
    L = levels.shape[1]
    x = mat.to(torch.float32).contiguous()
    hi = torch.searchsorted(levels.contiguous(), x).clamp_(max=L - 1)
    lo = (hi - 1).clamp_(min=0)
    l_hi = levels.gather(1, hi)
    l_lo = levels.gather(1, lo)
    gap = l_hi - l_lo
    p = torch.where(gap > 0, (x - l_lo) / torch.where(gap > 0, gap, torch.ones_like(gap)),
                    torch.zeros_like(gap))
    u = rng.uniform(x.numel(), x.device).view(x.shape)
    return torch.where(u < p, hi, lo)


def bucket_index(n: int, bucket: Optional[int], device: torch.device) -> torch.Tensor:
    """Bucket number (int64) of every coordinate ``0 … n−1``."""
    if bucket is None:
        return torch.zeros(n, dtype=torch.int64, device=device)
    return torch.arange(n, dtype=torch.int64, device=device) // bucket


class _LevelQuantizer(Quantizer):
    """Shared machinery: per-bucket levels, stochastic rounding to them, packed indices + levels."""

    params = (LEVELS_L, BUCKET)
    unbiased = True

    def __init__(self, levels: int = 5, bucket: Optional[int] = 512) -> None:
        super().__init__(levels=levels, bucket=bucket)
        self.width = code_width(self.levels)

    def _levels(self, mat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _fast_encode(self, v: torch.Tensor, rng: RandomStream) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed indices, (nb, L) levels)`` from the numba kernels (same bytes as the torch path)."""
        raise NotImplementedError

    def field_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"codes": (torch.uint8, packed_nbytes(numel, self.width)),
                "levels": (torch.float32, num_buckets(numel, self.bucket) * self.levels)}

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        if fast_cpu(v) and v.numel():  # sort, levels, rounding and packing per bucket in numba
            codes, lv = self._fast_encode(v, ctx.rng)
            return {"codes": codes, "levels": lv.reshape(-1)}
        codes, levels = [], []
        for mat in bucket_chunks(v, self.bucket):
            lv = self._levels(mat)
            codes.append(round_to_levels(mat, lv, ctx.rng).reshape(-1))
            levels.append(lv.reshape(-1))
        if not codes:
            return {"codes": pack_bits(v.new_zeros(0, dtype=torch.int64), self.width),
                    "levels": v.new_zeros(0)}
        return {"codes": pack_bits(torch.cat(codes), self.width), "levels": torch.cat(levels)}

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        if fast_cpu(fields["codes"]) and numel:
            lv = fields["levels"].view(-1, self.levels)
            return kernels.levels_decode(fields["codes"], lv, self.bucket, self.width, numel)
        levels = fields["levels"].to(torch.float32)
        codes = unpack_bits(fields["codes"], self.width, numel).to(torch.int64)
        if bool((codes >= self.levels).any()):
            raise PayloadError(f"{self.name}: level index out of range [0, {self.levels - 1}]")
        idx = bucket_index(numel, self.bucket, levels.device) * self.levels + codes.to(levels.device)
        return levels[idx]


@register("orq")
class ORQ(_LevelQuantizer):
    """ORQ-L: greedy optimal random-rounding levels per bucket ([reconstructed] paper 003, Algorithm 1).

    Spec: ``orq:levels=5,bucket=512`` (defaults; ``levels`` ∈ {3, 5, 9, 17}). Unbiased.
    Wire: ``ceil(log2 L)`` bits per coordinate + ``L`` float32 levels per bucket.
    """

    def _levels(self, mat: torch.Tensor) -> torch.Tensor:
        return orq_levels(mat, self.levels)

    def _fast_encode(self, v: torch.Tensor, rng: RandomStream) -> tuple[torch.Tensor, torch.Tensor]:
        return level_kernels.orq_encode(v, self.levels, self.bucket, self.width, rng)


@register("linear")
class Linear(_LevelQuantizer):
    """Linear-L: levels at the bucket's empirical quantiles ``i/(L−1)`` (paper 003's naive baseline).

    Spec: ``linear:levels=5,bucket=512`` (defaults; ``levels`` ∈ {3, 5, 9, 17}). Unbiased.
    Wire: ``ceil(log2 L)`` bits per coordinate + ``L`` float32 levels per bucket.
    """

    def _levels(self, mat: torch.Tensor) -> torch.Tensor:
        return linear_levels(mat, self.levels)

    def _fast_encode(self, v: torch.Tensor, rng: RandomStream) -> tuple[torch.Tensor, torch.Tensor]:
        return level_kernels.linear_encode(v, self.levels, self.bucket, self.width, rng)
