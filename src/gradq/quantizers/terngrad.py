"""TernGrad: stochastic ternary gradients with a shared scaler (paper 001, Wen et al.).

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

from ..codecs.bitpack import pack_bits, pack_trits, packed_nbytes, trit_nbytes, unpack_bits, unpack_trits
from ..errors import PayloadError
from ..spec import ChoiceParam, FloatParam, IntParam, register
from .base import EncodeContext, SharedStat, SummableQuantizer
from .. import kernels
from ._common import fast_cpu, bucket_norms, bucket_view, num_buckets
from .maxnorm import check_shared_scale
from .qsgd import uniform_codes, uniform_decode

__all__ = ["TernGrad", "clip_by_std", "population_std"]


def clip_by_std(v: torch.Tensor, c: Optional[float]) -> torch.Tensor:
    """Eq. 21 on a flat float32 vector: ``clamp(v, −c·σ, c·σ)`` with ``σ`` the population standard
    deviation of ``v``. ``c=None``, an empty or one-element vector, or ``σ = 0`` return ``v`` unchanged."""
    if c is None or v.numel() <= 1:
        return v
    sigma = population_std(v)
    bound = c * sigma
    # sigma == 0 (constant vector): no clipping, see the module docstring.
    bound = torch.where(sigma > 0, bound, torch.full_like(bound, float("inf")))
    return torch.clamp(v, -bound, bound)


def population_std(v: torch.Tensor) -> torch.Tensor:
    """σ of a flat float32 vector, computed in float64 (two passes) and rounded once to float32.

    [decided] Float64 makes σ the correctly rounded value on any data (a float32 pass can be an ulp off
    when ``|mean|/σ`` is large) and lets the fused kernel (:func:`gradq.kernels.population_std`) agree
    with this reference bit for bit, except when the exact σ lies within float64 rounding (~1e-13
    relative) of a float32 rounding tie."""
    v64 = v.to(torch.float64)
    return torch.sqrt(((v64 - v64.mean()) ** 2).mean()).to(torch.float32)


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

    def _shared_stats(self, v: torch.Tensor, shared_seed: Optional[int]) -> dict[str, SharedStat]:
        return {"scale": SharedStat(bucket_norms(self._clipped_matrix(v), "max"), "max")}

    def _own_stats(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, SharedStat]:
        if fast_cpu(v):  # σ, clip bound and clipped max-abs in one pass; the bound is kept for _encode
            bound, scales = kernels.terngrad_stats(v, self.clip, self.bucket)
            ctx.scratch["bound"] = bound
            return {"scale": SharedStat(scales, "max")}
        return self._shared_stats(v, ctx.shared_seed)

    def _codes(self, v: torch.Tensor, ctx: EncodeContext) -> torch.Tensor:
        mat = self._clipped_matrix(v)
        scale = ctx.shared["scale"]
        check_shared_scale(self.name, scale, ctx.own["scale"].value)
        # With s = 1 level, floor(|g|/scale + u) is exactly Bernoulli(|g|/scale).
        return uniform_codes(mat, scale, 1, ctx.rng).reshape(-1)[: v.numel()]

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        if "bound" in ctx.scratch:  # the fused kernels (see _own_stats)
            scale = ctx.shared["scale"].to(torch.float32)
            check_shared_scale(self.name, scale, ctx.own["scale"].value)
            bound = ctx.scratch["bound"]
            if self.pack == "trit":
                packed = kernels.uniform_encode_trits(v, scale, self.bucket, ctx.rng, clip=bound)
            else:
                packed = kernels.uniform_encode(v, scale, 1, self.bucket, 2, ctx.rng, clip=bound)
            return {"codes": packed, "scales": scale}
        shifted = self._codes(v, ctx) + 1
        packed = pack_trits(shifted) if self.pack == "trit" else pack_bits(shifted, 2)
        return {"codes": packed, "scales": ctx.shared["scale"].to(torch.float32)}

    def _decode_into(self, fields: Mapping[str, torch.Tensor], numel: int, out: torch.Tensor) -> bool:
        if not fast_cpu(out):
            return False
        if self.pack == "trit":
            kernels.uniform_decode_trits(fields["codes"], fields["scales"], self.bucket, numel, out=out)
        else:
            kernels.uniform_decode(fields["codes"], fields["scales"], 1, self.bucket, 2, numel, max_field=2, out=out)
        return True

    def _decode_mean_into(self, fields: Sequence[Mapping[str, torch.Tensor]], numel: int,
                          out: torch.Tensor) -> bool:
        if not fast_cpu(out):
            return False
        codes, scales = [f["codes"] for f in fields], [f["scales"] for f in fields]
        if self.pack == "trit":
            kernels.uniform_decode_trits_mean(codes, scales, self.bucket, numel, out=out)
        else:
            kernels.uniform_decode_mean(codes, scales, 1, self.bucket, 2, numel, max_field=2, out=out)
        return True

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        if fast_cpu(fields["codes"]):
            if self.pack == "trit":
                return kernels.uniform_decode_trits(fields["codes"], fields["scales"], self.bucket, numel)
            return kernels.uniform_decode(fields["codes"], fields["scales"], 1, self.bucket, 2, numel, max_field=2)
        if self.pack == "trit":
            codes = unpack_trits(fields["codes"], numel) - 1
        else:
            codes = unpack_bits(fields["codes"], 2, numel) - 1
            if codes.numel() and int(codes.max()) > 1:
                raise PayloadError(f"{self.name}: corrupt codes (2-bit field value 3 is not a trit)")
        return uniform_decode(codes, fields["scales"], 1, numel, self.bucket)

    def _fields(self, v: torch.Tensor, ctx: EncodeContext) -> Optional[torch.Tensor]:
        if "bound" not in ctx.scratch:  # no fused kernels here (see _own_stats)
            return None
        scale = ctx.shared["scale"].to(torch.float32)
        check_shared_scale(self.name, scale, ctx.own["scale"].value)
        return kernels.uniform_encode(v, scale, 1, self.bucket, 8, ctx.rng, clip=ctx.scratch["bound"])

    def _decode_field_sum(self, total: torch.Tensor, shared: Mapping[str, torch.Tensor], count: int,
                          numel: int) -> Optional[torch.Tensor]:
        if not fast_cpu(total):
            return None
        return kernels.uniform_decode(total, shared["scale"].to(torch.float32), count, self.bucket, 8, numel)

    def _decode_codes(self, codes: torch.Tensor, shared: Mapping[str, torch.Tensor], numel: int,
                      shared_seed: Optional[int]) -> torch.Tensor:
        return uniform_decode(codes, shared["scale"], 1, numel, self.bucket)
