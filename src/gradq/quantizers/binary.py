"""One-bit quantizers: BinGrad-pb, BinGrad-b, scaled SignSGD (paper 003) and 1BitSGD (Seide et al.).

All four send one bit per coordinate (packed 8 to a byte) plus one or two float32 per bucket; every
per-bucket statistic uses the bucket's real size (the last partial bucket is not zero-padded).

**BinGrad-pb** ([reconstructed] paper 003, ALGORITHMS.md §4): levels ``±b``. Values with ``|g| ≤ b`` are
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

**BinGrad-b** ([reconstructed] paper 003, deterministic): threshold ``t`` = bucket mean; ``b_0 = mean{g < t}``,
``b_1 = mean{g ≥ t}``; each value maps to its side's level. ``iters`` optional Lloyd iterations
``t ← (b_0 + b_1)/2`` then recompute ``b_0, b_1`` (never increase the squared error). An empty side's
level is ``t``. Biased, minimal error among these. Wire: 1 bit + 2 float32 ``(b_0, b_1)``.

**Scaled SignSGD** ([reconstructed] paper 003's baseline): ``(‖g‖₁/d)·sign(g)``, ``sign(0)`` read as ``+`` (a zero
bucket has scale 0, so zeros still decode to zero). Biased. Wire: 1 bit + 1 float32.

**1BitSGD** (Seide et al., compared in paper 004; ALGORITHMS.md §5): bit ``g ≥ 0``; the two
reconstruction values are the means of the entries with bit 1 (non-negative, zero included) and with
bit 0 (negative). **[decided]**: an empty group's value is 0 (never decoded). Error feedback is on by
default: ``build("onebit")`` is ``ErrorFeedback(OneBit)``; ``onebit:ef=0`` is the bare quantizer.
Wire: 1 bit + 2 float32 ``(mean of negatives, mean of non-negatives)``.

**Sums**: every float64 bucket sum of BinGrad-b, SignSGD and 1BitSGD (means, masked means) is taken in
the fixed pairwise order of :func:`pairwise_row_sum`, not by ``torch.sum``/``mean``, whose order
depends on the CPU's vector width and thread count. The order is part of the result: it is what the
CPU kernels reproduce (BinGrad-pb's sorted sequential sums are matched as they are).

**CPU path**: on CPU tensors with the numba kernels available (:func:`._common.fast_cpu`) the encode
runs :mod:`gradq.kernels.binary` (statistics and packing fused per bucket), which gives the same bytes
as the torch code here; the torch code stays the reference and the path for every other device.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..codecs.bitpack import pack_bits, packed_nbytes, unpack_bits
from ..spec import IntParam, register
from .base import EncodeContext, Quantizer
from .. import kernels
from ..kernels import binary as binary_kernels
from ..kernels.binary import SUM_BLOCK
from ._common import bucket_chunks, fast_cpu, num_buckets
from .orq import bucket_index

__all__ = ["BinGradPB", "BinGradB", "SignSGD", "OneBit", "bingrad_pb_threshold", "bingrad_b_levels",
           "pairwise_row_sum"]

BUCKET = IntParam("bucket", 512, "bucket size (none = whole tensor)", allow_none=True, lo=1)


def _fold(mat: torch.Tensor) -> torch.Tensor:
    """Fold the columns in half until one is left: column ``i + h`` is added to column ``i``
    (``h = ⌊w/2⌋``); an odd last column moves to position ``h``."""
    while mat.shape[1] > 1:
        w = mat.shape[1]
        h = w // 2
        s = mat[:, :h] + mat[:, h:2 * h]
        mat = torch.cat([s, mat[:, 2 * h:]], dim=1) if w % 2 else s
    return mat[:, 0]


def pairwise_row_sum(mat: torch.Tensor) -> torch.Tensor:
    """Per-row sum of ``mat`` (``(k, d)``) in a fixed pairwise order: each run of ``SUM_BLOCK``
    (4096) consecutive entries (the last run may be shorter) is folded in half repeatedly (entry
    ``i + h`` added to entry ``i``, an odd last entry kept), then the run sums are folded the same way.

    Every float64 bucket sum of this module goes through here, so the order is part of the result.
    It replaces ``torch.sum``, whose order depends on the CPU's vector width and, for a single long
    row, on the thread count, so the CPU kernels (:mod:`gradq.kernels.binary`) could not reproduce
    it; this order they reproduce bit for bit. It is as accurate (error ``O(log d)`` ulps) and gives
    the same bits on every device and thread count (it is made of elementwise additions only)."""
    if mat.dim() != 2:
        raise ValueError(f"expected a (rows, d) matrix, got shape {tuple(mat.shape)}")
    k, d = mat.shape
    if d == 0:
        return mat.new_zeros(k)
    if d <= SUM_BLOCK:
        return _fold(mat)
    q, r = divmod(d, SUM_BLOCK)
    parts = [_fold(mat[:, :q * SUM_BLOCK].reshape(k * q, SUM_BLOCK)).view(k, q)]
    if r:
        parts.append(_fold(mat[:, q * SUM_BLOCK:]).unsqueeze(1))
    return _fold(torch.cat(parts, dim=1))


def _masked_mean(mat64: torch.Tensor, mask: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """Per-row mean of the entries of ``mat64`` where ``mask``; ``empty`` where no entry is selected.
    The sum runs over the whole row (``+0.0`` where the mask is off) in :func:`pairwise_row_sum`'s order."""
    cnt = mask.sum(dim=1)
    tot = pairwise_row_sum(torch.where(mask, mat64, torch.zeros_like(mat64)))
    return torch.where(cnt > 0, tot / cnt.clamp(min=1), empty)


def bingrad_pb_threshold(mat: torch.Tensor) -> torch.Tensor:
    """BinGrad-pb's optimal ``b`` per row of ``mat`` (``(nb, d)``), as float32 (module docstring)."""
    if mat.dim() != 2 or mat.shape[1] == 0:
        raise ValueError(f"expected a (buckets, d) matrix with d >= 1, got shape {tuple(mat.shape)}")
    d = mat.shape[1]
    a = mat.to(torch.float32).abs().sort(dim=1).values.to(torch.float64)   # a_1 .. a_d
    tail = a.flip(1).cumsum(dim=1).flip(1)                                  # tail[:, k] = S_k, k < d
    # first k in 0..d with d*a_{k+1} >= S_k (k = d always qualifies); the test is monotone in k
    k = (d * a < tail).sum(dim=1, keepdim=True)
    s_k = torch.cat([tail, torch.zeros_like(tail[:, :1])], dim=1).gather(1, k)
    a_k = torch.cat([torch.zeros_like(a[:, :1]), a], dim=1).gather(1, k)
    return torch.maximum(s_k / d, a_k).squeeze(1).to(torch.float32)


def bingrad_b_levels(mat: torch.Tensor, iters: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BinGrad-b per row of ``mat``: ``(t, b0, b1)`` after ``iters`` Lloyd iterations (float64);
    a value ``g`` maps to ``b1`` if ``g ≥ t`` else ``b0``."""
    m64 = mat.to(torch.float64)
    t = pairwise_row_sum(m64) / mat.shape[1]
    for step in range(iters + 1):
        if step:
            t = 0.5 * (b0 + b1)
        upper = m64 >= t.unsqueeze(1)
        b0 = _masked_mean(m64, ~upper, t)
        b1 = _masked_mean(m64, upper, t)
    return t, b0, b1


class _OneBit(Quantizer):
    """1 bit per coordinate (``bit = 1`` ↔ the upper level) + ``per_bucket`` float32 values."""

    params: tuple = (BUCKET,)
    per_bucket = 1

    def field_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"codes": (torch.uint8, packed_nbytes(numel, 1)),
                "levels": (torch.float32, num_buckets(numel, self.bucket) * self.per_bucket)}

    def _threshold_levels(self, mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-bucket float64 thresholds ``(k,)`` (bit = ``float64(g) >= t``) and values ``(k, per_bucket)``."""
        raise NotImplementedError

    def _chunk(self, mat: torch.Tensor, ctx: EncodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Bits (bool ``(k, d)``) and per-bucket values (``(k, per_bucket)``) of a bucket matrix."""
        t, lv = self._threshold_levels(mat)
        return mat.to(torch.float64) >= t.unsqueeze(1), lv

    def _fast_encode(self, v: torch.Tensor, ctx: EncodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The numba path (:mod:`gradq.kernels.binary`): ``(packed bits, float32 levels)``, the same
        bytes as the torch code below."""
        raise NotImplementedError

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        if fast_cpu(v) and v.numel():
            codes, vals = self._fast_encode(v, ctx)
            return {"codes": codes, "levels": vals}
        bits, vals = [], []
        for mat in bucket_chunks(v, self.bucket):
            b, lv = self._chunk(mat, ctx)
            bits.append(b.reshape(-1))
            vals.append(lv.to(torch.float32).reshape(-1))
        if not bits:
            return {"codes": pack_bits(v.new_zeros(0, dtype=torch.int64), 1), "levels": v.new_zeros(0)}
        return {"codes": pack_bits(torch.cat(bits).to(torch.int64), 1), "levels": torch.cat(vals)}

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        levels = fields["levels"].to(torch.float32)
        if fast_cpu(fields["codes"]) and numel:
            lv = levels.view(-1, 2) if self.per_bucket == 2 else levels
            return kernels.bit_decode(fields["codes"], lv, self.bucket, numel)
        bits = unpack_bits(fields["codes"], 1, numel).to(device=levels.device, dtype=torch.int64)
        bidx = bucket_index(numel, self.bucket, levels.device)
        if self.per_bucket == 2:   # (lower, upper) per bucket
            return levels[bidx * 2 + bits]
        return levels[bidx] * (2 * bits - 1).to(torch.float32)


@register("bingrad-pb")
class BinGradPB(_OneBit):
    """BinGrad-pb: levels ``±b`` with the error-minimizing ``b``, stochastic inside, clipped outside.

    Spec: ``bingrad-pb:bucket=512`` (default). [reconstructed] paper 003. Biased (clipping).
    Wire: 1 bit per coordinate + 1 float32 per bucket.
    """

    def __init__(self, bucket: Optional[int] = 512) -> None:
        super().__init__(bucket=bucket)

    def _fast_encode(self, v: torch.Tensor, ctx: EncodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        return binary_kernels.bingrad_pb_encode(v, self.bucket, ctx.rng)

    def _chunk(self, mat: torch.Tensor, ctx: EncodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        b = bingrad_pb_threshold(mat).unsqueeze(1)
        safe = torch.where(b > 0, b, torch.ones_like(b))
        p_up = ((mat + b) / (2 * safe)).clamp(0.0, 1.0)   # 1 above +b, 0 below -b: the clip
        p_up = torch.where(b > 0, p_up, torch.ones_like(p_up))   # b = 0: decode +0, not -0
        u = ctx.rng.uniform(mat.numel(), mat.device).view(mat.shape)
        return u < p_up, b


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

    def _fast_encode(self, v: torch.Tensor, ctx: EncodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        return binary_kernels.bingrad_b_encode(v, self.bucket, self.iters)

    def _threshold_levels(self, mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, b0, b1 = bingrad_b_levels(mat, self.iters)
        return t, torch.stack([b0, b1], dim=1)


@register("signsgd")
class SignSGD(_OneBit):
    """Scaled SignSGD: ``(‖g‖₁/d)·sign(g)`` per bucket (paper 003's baseline).

    Spec: ``signsgd:bucket=512`` (default). Biased. Wire: 1 bit per coordinate + 1 float32 per bucket.
    """

    def __init__(self, bucket: Optional[int] = 512) -> None:
        super().__init__(bucket=bucket)

    def _fast_encode(self, v: torch.Tensor, ctx: EncodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        return binary_kernels.sign_scale_encode(v, self.bucket)

    def _threshold_levels(self, mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (pairwise_row_sum(mat.to(torch.float64).abs()) / mat.shape[1]).unsqueeze(1)
        return scale.new_zeros(mat.shape[0]), scale  # bit = g >= 0


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

    def _fast_encode(self, v: torch.Tensor, ctx: EncodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        return binary_kernels.onebit_encode(v, self.bucket)

    def _threshold_levels(self, mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m64 = mat.to(torch.float64)
        upper = mat >= 0
        zero = m64.new_zeros(mat.shape[0])
        return zero, torch.stack([_masked_mean(m64, ~upper, zero), _masked_mean(m64, upper, zero)], dim=1)
