"""Optimal random-rounding levels: ORQ-L and its naive baseline Linear-L ([OptQuant], §4 of docs/algorithms.md).

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
levels.

Because every value of the segment is in exactly one of the two sums of ``h``, the slope after the
first ``k`` sorted values is ``k·(b − a) − Σ_{segment}(b − g)``: the split is simply the value of rank
``⌈Σ(b − g)/(b − a)⌉`` in the segment (moved up past values equal to ``a``). That sum and ``b − a``
are computed exactly, in int64 fixed point (each value as ``⌊g·2^sh⌋``, ``sh`` from the bucket's
largest magnitude and length so that no sum overflows), so the level does not depend on the order of
any summation and every backend, a GPU's parallel reductions included, finds the same one. All
buckets and intervals of a round are handled at once: values are sorted per bucket, assigned to
intervals with ``searchsorted``, and per-interval counts and totals come from ``scatter_add``.

**Linear-L** (the paper's naive baseline): levels at the bucket's empirical quantiles ``i/(L − 1)``,
``b_i = sorted[round(i·(d − 1)/(L − 1))]`` (``b_0 = min``, ``b_{L−1} = max``), same rounding.

Both are unbiased. A constant bucket gets ``L`` equal levels and decodes exactly.

Wire: ``ceil(n·w/8)`` bytes of packed level indices, ``w = ceil(log2 L)`` bits (3 levels → 2 bits,
5 → 3, 9 → 4, 17 → 5), then ``L`` float32 levels per bucket (``4·L·⌈n/bucket⌉`` bytes), plus the
payload header. The last partial bucket has its own min, max and levels.

The encode and decode go through :mod:`gradq.kernels` (numba on CPU tensors: sort, levels, rounding
and packing per bucket; Triton on CUDA tensors; the plain-torch reference, where ``orq_levels`` and
``linear_levels`` are defined, elsewhere), with the same bytes on every backend.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..codecs.bitpack import packed_nbytes
from ..random import RandomStream
from ..spec import ChoiceParam, IntParam, register
from .base import EncodeContext, Quantizer
from .. import kernels
from ..kernels.reference import bucket_index, linear_levels, orq_levels, round_to_levels
from ._common import code_width, num_buckets

__all__ = ["ORQ", "Linear", "orq_levels", "linear_levels", "round_to_levels", "bucket_index"]

LEVELS_L = ChoiceParam("levels", 5, "number of levels L per bucket (2^k + 1)", choices=(3, 5, 9, 17))
BUCKET = IntParam("bucket", 512, "bucket size (none = whole tensor)", allow_none=True, lo=1)


class _LevelQuantizer(Quantizer):
    """Shared machinery: per-bucket levels, stochastic rounding to them, packed indices + levels."""

    params = (LEVELS_L, BUCKET)
    unbiased = True

    def __init__(self, levels: int = 5, bucket: Optional[int] = 512) -> None:
        super().__init__(levels=levels, bucket=bucket)
        self.width = code_width(self.levels)

    def _encode_levels(self, v: torch.Tensor, rng: RandomStream) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed indices, (nb, L) levels)``: the scheme's primitive in :mod:`gradq.kernels`."""
        raise NotImplementedError

    def field_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"codes": (torch.uint8, packed_nbytes(numel, self.width)),
                "levels": (torch.float32, num_buckets(numel, self.bucket) * self.levels)}

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        codes, lv = self._encode_levels(v, ctx.rng)  # levels, rounding and packing per bucket
        return {"codes": codes, "levels": lv.reshape(-1)}

    def _nonfinite_witness(self, x: torch.Tensor, shared: Optional[Mapping[str, torch.Tensor]]) -> Optional[str]:
        # a bucket's first and last levels are its least and greatest values in the order of the
        # integer keys (reference.sort_rows), where every NaN and Inf sorts to one end or the other;
        # ORQ's fixed-point sums of such a bucket are garbage but harmless (integer arithmetic, a
        # divisor of at least 1, clamped gathers), and the CPU kernel raises on its own
        return "levels" if x.dtype == torch.float32 else None

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        lv = fields["levels"].to(torch.float32).view(-1, self.levels)
        return kernels.levels_decode(fields["codes"], lv, self.bucket, self.width, numel)

    def _decode_into(self, fields: Mapping[str, torch.Tensor], numel: int, out: torch.Tensor) -> bool:
        lv = fields["levels"].to(torch.float32).view(-1, self.levels)
        kernels.levels_decode(fields["codes"], lv, self.bucket, self.width, numel, out=out)
        return True


@register("orq")
class ORQ(_LevelQuantizer):
    """ORQ-L: greedy optimal random-rounding levels per bucket ([reconstructed] [OptQuant], Algorithm 1).

    Spec: ``orq:levels=5,bucket=512`` (defaults; ``levels`` ∈ {3, 5, 9, 17}). Unbiased.
    Wire: ``ceil(log2 L)`` bits per coordinate + ``L`` float32 levels per bucket.
    """

    def _encode_levels(self, v: torch.Tensor, rng: RandomStream) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.orq_encode(v, self.levels, self.bucket, self.width, rng)


@register("linear")
class Linear(_LevelQuantizer):
    """Linear-L: levels at the bucket's empirical quantiles ``i/(L−1)`` ([OptQuant]'s naive baseline).

    Spec: ``linear:levels=5,bucket=512`` (defaults; ``levels`` ∈ {3, 5, 9, 17}). Unbiased.
    Wire: ``ceil(log2 L)`` bits per coordinate + ``L`` float32 levels per bucket.
    """

    def _encode_levels(self, v: torch.Tensor, rng: RandomStream) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.linear_encode(v, self.levels, self.bucket, self.width, rng)
