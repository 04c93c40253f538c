"""TernGrad: stochastic ternary gradients with a shared scaler ([TernGrad], Wen et al.).

Per layer (one tensor per call; optional buckets), TernGrad first clips the gradient (Eq. 21)

    g_k ← clamp(g_k, −c·σ, c·σ),    σ = standard deviation of the whole tensor, c = 2.5 by default,

then takes the scaler ``s = max_k |g_k|`` of the *clipped* gradient (Eq. 2, per bucket) and sends

    g̃_k = s · sgn(g_k) · b_k,    b_k ~ Bernoulli(|g_k| / s)    (Eq. 1),

i.e. the integer code ``sgn(g_k)·b_k ∈ {−1, 0, 1}``. ``E[g̃] = clip(g)``: the scheme is unbiased with
respect to the clipped gradient (:meth:`TernGrad.clipped` returns it), and unbiased with respect to the
gradient itself only with ``clip=none``.

**Scaler sharing** (Eq. 4): with ``s`` replaced by the MAX over workers of their scalers (the shared stat
``scale``), the workers' ternary codes add up to integers in ``[−M, M]`` and the average is
``s·(Σ_m code^m)/M``. Clipping stays per worker (each with its own σ), as in the paper.

Wire: the codes ``code + 1 ∈ {0, 1, 2}`` packed five per byte (``pack=trit``: ``ceil(n/5)`` bytes,
1.6 bits per element) or as 2-bit fields (``pack=2bit``: ``ceil(n/4)`` bytes), plus one float32 scaler
per bucket (+ the payload header). Both packings carry the same codes, so they decode identically.

Decisions where the paper is silent (**[decided]**): σ is the population standard deviation
(``correction=0``) of the tensor, also when it is bucketed; when σ = 0 (a constant tensor, including
tensors of at most one element) clipping is skipped, since clamping to ``[0, 0]`` would erase a
constant gradient instead of limiting its outliers.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from ..codecs.bitpack import packed_nbytes, trit_nbytes
from ..spec import ChoiceParam, FloatParam, IntParam, register
from .base import EncodeContext, SharedStat
from .summable import SummableQuantizer
from .. import kernels
from ..kernels.reference import clip_by_std, dequantize_uniform as uniform_decode, population_std, uniform_codes
from ._common import bucket_view, num_buckets

__all__ = ["TernGrad", "clip_by_std", "population_std"]


def bound_of(stats: Mapping[str, SharedStat]) -> Optional[torch.Tensor]:
    """The clip bound TernGrad's statistics carry (:meth:`SharedStat.carrying`), or None where they
    carry none (statistics made elsewhere)."""
    return getattr(stats.get("scale"), "aux", None)


@register("terngrad")
class TernGrad(SummableQuantizer):
    """TernGrad: ternary codes ``{−1, 0, 1}`` times a per-bucket scaler, after gradient clipping.

    Spec: ``terngrad:clip=2.5,bucket=none,pack=trit`` (defaults). ``clip=none`` disables clipping
    (then unbiased); ``bucket=none`` means one scaler for the whole layer; ``pack`` chooses base-3
    packing (1.6 bits/element) or 2-bit fields. Shared: ``scale`` (MAX), the per-bucket scalers of
    the clipped gradient. Layer-wise: meant to see one parameter tensor per call.
    """

    params = (
        FloatParam("clip", 2.5, "clip at c standard deviations of the layer (none = no clipping)",
                   allow_none=True, lo=0.0, lo_open=True),
        IntParam("bucket", None, "bucket size (none = whole tensor, the paper's per-layer scaler)",
                 allow_none=True, lo=1),
        ChoiceParam("pack", "trit", "wire packing: trit (5 per byte) or 2bit", choices=("trit", "2bit")),
    )
    layerwise = True

    def __init__(self, clip: Optional[float] = 2.5, bucket: Optional[int] = None, pack: str = "trit") -> None:
        super().__init__(clip=clip, bucket=bucket, pack=pack)

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        """True only without clipping; with clipping, E[decode] is :meth:`clipped` ``(x)``."""
        return self.clip is None

    @property
    def max_code(self) -> int:
        return 1

    def clipped(self, x: torch.Tensor) -> torch.Tensor:
        """The clipped tensor (Eq. 21) whose unbiased estimate TernGrad sends; same shape and dtype as
        ``x``. Equal to ``x`` when ``clip=none``."""
        v = self._flatten(x, None)
        return clip_by_std(v, self.clip).reshape(x.shape).to(x.dtype)

    # -- wire --------------------------------------------------------------------------------------
    def _code_bytes(self, numel: int) -> int:
        return trit_nbytes(numel) if self.pack == "trit" else packed_nbytes(numel, 2)

    def field_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"codes": (torch.uint8, self._code_bytes(numel)),
                "scales": (torch.float32, num_buckets(numel, self.bucket))}

    # -- math --------------------------------------------------------------------------------------
    def _clipped_matrix(self, v: torch.Tensor) -> torch.Tensor:
        return bucket_view(clip_by_std(v, self.clip), self.bucket)

    def _nonfinite_witness(self, x: torch.Tensor, shared: Optional[Mapping[str, torch.Tensor]]) -> Optional[str]:
        # with its own scale: a NaN/Inf makes σ NaN (no clipping then) and its bucket's max-abs NaN or
        # Inf, so that bucket's scale is NaN or Inf; every backend only does arithmetic on them
        return "scales" if shared is None and x.dtype == torch.float32 else None

    def stat_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"scale": (torch.float32, num_buckets(numel, self.bucket))}

    def _shared_stats(self, v: torch.Tensor, shared_seed: Optional[int]) -> dict[str, SharedStat]:
        # σ, clip bound and clipped max-abs (one pass where the backend fuses them); the bound rides
        # along unreduced, for this worker's encode of the same tensor (own=)
        bound, scales = kernels.terngrad_stats(v, self.clip, self.bucket)
        return {"scale": SharedStat.carrying(scales, "max", bound)}

    def _own_stats(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, SharedStat]:
        own = self._shared_stats(v, ctx.shared_seed)
        ctx.scratch["bound"] = bound_of(own)
        return own

    def _take_own(self, own: Mapping[str, SharedStat], ctx: EncodeContext) -> Optional[dict[str, SharedStat]]:
        bound = bound_of(own)
        if bound is None:   # (statistics made elsewhere: computed again)
            return None
        ctx.scratch["bound"] = bound
        return dict(own)

    def _shared_scale(self, ctx: EncodeContext) -> torch.Tensor:
        scale = ctx.shared["scale"].to(torch.float32)
        self._check_scale(ctx, scale)
        return scale

    def _codes(self, v: torch.Tensor, ctx: EncodeContext) -> torch.Tensor:
        mat = self._clipped_matrix(v)
        scale = ctx.shared["scale"]
        self._check_scale(ctx, scale)
        # With s = 1 level, floor(|g|/scale + u) is exactly Bernoulli(|g|/scale).
        return uniform_codes(mat, scale, 1, ctx.rng).reshape(-1)[: v.numel()]

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        scale = self._shared_scale(ctx)
        bound = ctx.scratch["bound"]
        if self.pack == "trit":
            packed = kernels.uniform_encode_trits(v, scale, self.bucket, ctx.rng, clip=bound)
        else:
            packed = kernels.uniform_encode(v, scale, 1, self.bucket, 2, ctx.rng, clip=bound)
        return {"codes": packed, "scales": scale}

    def _decode_into(self, fields: Mapping[str, torch.Tensor], numel: int, out: torch.Tensor) -> bool:
        if self.pack == "trit":
            kernels.uniform_decode_trits(fields["codes"], fields["scales"], self.bucket, numel, out=out)
        else:
            kernels.uniform_decode(fields["codes"], fields["scales"], 1, self.bucket, 2, numel, max_field=2, out=out)
        return True

    def _decode_mean_into(self, fields: Sequence[Mapping[str, torch.Tensor]], numel: int,
                          out: torch.Tensor) -> bool:
        codes, scales = [f["codes"] for f in fields], [f["scales"] for f in fields]
        if self.pack == "trit":
            kernels.uniform_decode_trits_mean(codes, scales, self.bucket, numel, out=out)
        else:
            kernels.uniform_decode_mean(codes, scales, 1, self.bucket, 2, numel, max_field=2, out=out)
        return True

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        if self.pack == "trit":
            return kernels.uniform_decode_trits(fields["codes"], fields["scales"], self.bucket, numel)
        return kernels.uniform_decode(fields["codes"], fields["scales"], 1, self.bucket, 2, numel, max_field=2)

    def _fields(self, v: torch.Tensor, ctx: EncodeContext, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        return kernels.uniform_encode(v, self._shared_scale(ctx), 1, self.bucket, 8, ctx.rng, clip=ctx.scratch["bound"],
                                      out=out)

    def _decode_field_sum(self, total: torch.Tensor, shared: Mapping[str, torch.Tensor], count: int,
                          numel: int, shared_seed: Optional[int],
                          out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        scale = shared["scale"].to(torch.float32)
        if total.dtype != torch.uint8:   # (a sum wider than a byte: more than 127 workers)
            return kernels.uniform_decode_sum(total, scale, count, self.bucket, numel, out=out)
        return kernels.uniform_decode(total, scale, count, self.bucket, 8, numel, out=out)

    def _decode_codes(self, codes: torch.Tensor, shared: Mapping[str, torch.Tensor], numel: int,
                      shared_seed: Optional[int]) -> torch.Tensor:
        return uniform_decode(codes, shared["scale"], 1, numel, self.bucket)
