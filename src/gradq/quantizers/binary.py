"""One-bit quantizers: BinGrad-pb, BinGrad-b, scaled SignSGD ([OptQuant]) and 1BitSGD (Seide et al.).

All four send one bit per coordinate (packed 8 to a byte) plus one or two float32 per bucket; every
per-bucket statistic uses the bucket's real size (the last partial bucket is not zero-padded).

**BinGrad-pb** ([reconstructed] [OptQuant], docs/algorithms.md): levels ``±b``. Values with ``|g| ≤ b`` are
rounded stochastically between ``−b`` and ``+b`` (``P(+b) = (g + b)/(2b)``, unbiased there), larger ones
are clipped to ``sign(g)·b``. ``b`` minimizes the expected squared error

    F(b) = Σ_{|g|≤b} (b² − g²) + Σ_{|g|>b} (|g| − b)²,

a convex function whose optimality condition is ``b·#{|g| ≤ b} = Σ_{|g|>b} (|g| − b)``. With ``|g|``
sorted ascending ``a_1 ≤ … ≤ a_d`` (``a_0 = 0``) and ``S_k = Σ_{j>k} a_j``, on ``[a_k, a_{k+1}]`` the
condition reads ``d·b = S_k`` and ``F'(b)/2 = d·b − S_k`` there; the slope only jumps up at the ``a_j``.
We take the first ``k`` with ``d·a_{k+1} ≥ S_k`` (the minimizer lies in that piece) and
``b = max(S_k/d, a_k)``. **[decided]**: when no piece holds a root (the slope changes sign at a kink
``a_k``, which happens for real data, e.g. always when ``d = 1``), the minimizer of ``F`` is that data
value ``b = a_k`` and the condition holds as the subgradient inequality
``b·#{|g| < b} ≤ Σ_{|g|>b}(|g| − b) ≤ b·#{|g| ≤ b}``. Biased (clipping). Wire: 1 bit + 1 float32 ``b``.

**BinGrad-b** ([reconstructed] [OptQuant], deterministic): threshold ``t`` = bucket mean; ``b_0 = mean{g < t}``,
``b_1 = mean{g ≥ t}``; each value maps to its side's level. ``iters`` optional Lloyd iterations
``t ← (b_0 + b_1)/2`` then recompute ``b_0, b_1`` (never increase the squared error). An empty side's
level is ``t``. Biased, minimal error among these. Wire: 1 bit + 2 float32 ``(b_0, b_1)``.

**Scaled SignSGD** ([reconstructed] [OptQuant]'s baseline): ``(‖g‖₁/d)·sign(g)``, ``sign(0)`` read as ``+`` (a zero
bucket has scale 0, so zeros still decode to zero). Biased. Wire: 1 bit + 1 float32.

**1BitSGD** (Seide et al., compared in [QSGD-full]; docs/algorithms.md): bit ``g ≥ 0``; the two
reconstruction values are the means of the entries with bit 1 (non-negative, zero included) and with
bit 0 (negative). **[decided]**: an empty group's value is 0 (never decoded). Error feedback is on by
default: ``build("onebit")`` is ``ErrorFeedback(OneBit)``; ``onebit:ef=0`` is the bare quantizer.
Wire: 1 bit + 2 float32 ``(mean of negatives, mean of non-negatives)``.

**Sums**: every float64 bucket sum of BinGrad-b, SignSGD and 1BitSGD (means, masked means) is taken in
the fixed pairwise order of :func:`pairwise_row_sum`, not by ``torch.sum``/``mean``, whose order
depends on the CPU's vector width and thread count. The order is part of the result: it is what the
CPU kernels reproduce (BinGrad-pb's sorted sequential sums are matched as they are).

**Kernels**: the encode and decode go through :mod:`gradq.kernels` (numba on CPU tensors, Triton on
CUDA tensors, the plain-torch reference in :mod:`gradq.kernels.reference` elsewhere), which give the same
bytes on every backend; the statistics above are defined there.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..codecs.bitpack import packed_nbytes
from ..spec import IntParam, register
from .base import EncodeContext, Quantizer
from .. import kernels
from ..kernels.reference import bingrad_b_levels, bingrad_pb_threshold, pairwise_row_sum
from ._common import num_buckets

__all__ = ["BinGradPB", "BinGradB", "SignSGD", "OneBit", "bingrad_pb_threshold", "bingrad_b_levels",
           "pairwise_row_sum"]

BUCKET = IntParam("bucket", 512, "bucket size (none = whole tensor)", allow_none=True, lo=1)


class _OneBit(Quantizer):
    """1 bit per coordinate (``bit = 1`` ↔ the upper level) + ``per_bucket`` float32 values."""

    params: tuple = (BUCKET,)
    per_bucket = 1
    #: the bucket's levels are means over groups that together hold every value, so a NaN or Inf in
    #: a bucket makes one of its levels NaN or Inf (sums in float64 cannot overflow on float32 input)
    levels_witness = True

    def _nonfinite_witness(self, x: torch.Tensor, shared: Optional[Mapping[str, torch.Tensor]]) -> Optional[str]:
        return "levels" if self.levels_witness and x.dtype == torch.float32 else None

    def field_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"codes": (torch.uint8, packed_nbytes(numel, 1)),
                "levels": (torch.float32, num_buckets(numel, self.bucket) * self.per_bucket)}

    def _encode_bits(self, v: torch.Tensor, ctx: EncodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed bits, float32 levels)``: the scheme's primitive in :mod:`gradq.kernels`."""
        raise NotImplementedError

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        codes, vals = self._encode_bits(v, ctx)
        return {"codes": codes, "levels": vals}

    def _levels(self, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
        levels = fields["levels"].to(torch.float32)
        return levels.view(-1, 2) if self.per_bucket == 2 else levels

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        return kernels.bit_decode(fields["codes"], self._levels(fields), self.bucket, numel)

    def _decode_into(self, fields: Mapping[str, torch.Tensor], numel: int, out: torch.Tensor) -> bool:
        kernels.bit_decode(fields["codes"], self._levels(fields), self.bucket, numel, out=out)
        return True


@register("bingrad-pb")
class BinGradPB(_OneBit):
    """BinGrad-pb: levels ``±b`` with the error-minimizing ``b``, stochastic inside, clipped outside.

    Spec: ``bingrad-pb:bucket=512`` (default). [reconstructed] [OptQuant]. Biased (clipping).
    Wire: 1 bit per coordinate + 1 float32 per bucket.
    """

    #: its level is chosen from the sorted magnitudes and may clip an Inf away: the up-front screen stays
    levels_witness = False

    def __init__(self, bucket: Optional[int] = 512) -> None:
        super().__init__(bucket=bucket)

    def _encode_bits(self, v: torch.Tensor, ctx: EncodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.bingrad_pb_encode(v, self.bucket, ctx.rng)


@register("bingrad-b")
class BinGradB(_OneBit):
    """BinGrad-b: deterministic two-level quantizer, threshold at the bucket mean, levels the side means.

    Spec: ``bingrad-b:bucket=512,iters=0`` (defaults; ``iters`` Lloyd iterations, 0–100). Paper 003.
    Biased. Wire: 1 bit per coordinate + 2 float32 per bucket.
    """

    params = (BUCKET, IntParam("iters", 0, "Lloyd iterations t <- (b0 + b1)/2", lo=0, hi=100))
    per_bucket = 2

    def __init__(self, bucket: Optional[int] = 512, iters: int = 0) -> None:
        super().__init__(bucket=bucket, iters=iters)

    def _encode_bits(self, v: torch.Tensor, ctx: EncodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.bingrad_b_encode(v, self.bucket, self.iters)


@register("signsgd")
class SignSGD(_OneBit):
    """Scaled SignSGD: ``(‖g‖₁/d)·sign(g)`` per bucket ([OptQuant]'s baseline).

    Spec: ``signsgd:bucket=512`` (default). Biased. Wire: 1 bit per coordinate + 1 float32 per bucket.
    """

    def __init__(self, bucket: Optional[int] = 512) -> None:
        super().__init__(bucket=bucket)

    def _encode_bits(self, v: torch.Tensor, ctx: EncodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.sign_scale_encode(v, self.bucket)


@register("onebit")
class OneBit(_OneBit):
    """1BitSGD (Seide et al.): sign bit, reconstruction values = means of the two sign groups.

    Spec: ``onebit:bucket=512`` (default), wrapped in error feedback by default (``onebit:ef=0`` is
    the bare quantizer). Biased. Wire: 1 bit per coordinate + 2 float32 per bucket.
    """

    default_ef = True
    per_bucket = 2

    def __init__(self, bucket: Optional[int] = 512) -> None:
        super().__init__(bucket=bucket)

    def _encode_bits(self, v: torch.Tensor, ctx: EncodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.onebit_encode(v, self.bucket)
