"""All-reduce-compatible quantizers of [Vineeth] (Vineeth S): QSGDMaxNorm (§3.1).

**QSGDMaxNorm.** Every worker scales by the same ``w = max_m ‖g^m‖`` (a MAX all-reduce of the
per-bucket norms; in one process, the vector's own norm), so its codes

    c_i = sgn(v_i) · ξ_i,   ξ_i = |v_i|·s/w stochastically rounded to an integer in [0, s]

can be summed across workers: the average is ``w·(Σ_m c^m)/(s·M)``. Unbiased, with
``E‖Q(v) − v‖² ≤ min(n/s², √n/s)·w²`` for the L2 norm (Lemma 1 states the looser ``(1 + …)·w²``).
The paper analyses the L2 norm; its public code uses max-abs, our default.

Wire per worker: packed ``width``-bit codes + one float32 ``w`` per bucket; inside a SUM all-reduce
the codes travel as integers of the narrowest type that holds ``±M·s``.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from ..codecs.bitpack import packed_nbytes
from ..spec import IntParam, register
from .base import EncodeContext, SharedStat
from .summable import SummableQuantizer, check_shared_scale
from .. import kernels
from ._common import bucket_view, code_width, num_buckets
from .qsgd import BITS, LEVELS, NORM, levels_spec_items, resolve_levels, uniform_codes, uniform_decode

__all__ = ["MaxNorm", "check_shared_scale"]


@register("maxnorm")
class MaxNorm(SummableQuantizer):
    """QSGDMaxNorm: QSGD with a scale shared by all workers, so codes can be summed.

    Spec: ``maxnorm:bits=4,bucket=none,norm=max`` (defaults). Shared: ``scale`` (MAX).
    """

    params = (BITS, LEVELS, IntParam("bucket", None, "bucket size (none = whole tensor)", allow_none=True, lo=1),
              NORM)
    unbiased = True

    def __init__(self, bits: Optional[int] = None, levels: Optional[int] = None, bucket: Optional[int] = None,
                 norm: str = "max") -> None:
        super().__init__(bits=bits, levels=levels, bucket=bucket, norm=norm)
        self.s = resolve_levels(self.name, self.bits, self.levels)
        self.width = code_width(2 * self.s + 1)

    @property
    def max_code(self) -> int:
        return self.s

    def _spec_items(self) -> list[tuple[str, str]]:
        return levels_spec_items(self.s) + [(k, v) for k, v in super()._spec_items() if k not in ("bits", "levels")]

    def field_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"codes": (torch.uint8, packed_nbytes(numel, self.width)),
                "scales": (torch.float32, num_buckets(numel, self.bucket))}

    def _nonfinite_witness(self, x: torch.Tensor, shared: Optional[Mapping[str, torch.Tensor]]) -> Optional[str]:
        # with its own scale (no shared one given), the scales field is the bucket's max or L2 norm,
        # NaN/Inf exactly when the bucket holds one, and every backend only does arithmetic on NaN/Inf
        return "scales" if shared is None and x.dtype == torch.float32 else None

    def stat_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"scale": (torch.float32, num_buckets(numel, self.bucket))}

    def _shared_stats(self, v: torch.Tensor, shared_seed: Optional[int]) -> dict[str, SharedStat]:
        norms = kernels.maxabs_scales if self.norm == "max" else kernels.l2_scales
        return {"scale": SharedStat(norms(v, self.bucket), "max")}

    def _shared_scale(self, ctx: EncodeContext) -> torch.Tensor:
        scale = ctx.shared["scale"].to(torch.float32)
        self._check_scale(ctx, scale)
        return scale

    def _codes(self, v: torch.Tensor, ctx: EncodeContext) -> torch.Tensor:
        scale = ctx.shared["scale"]
        self._check_scale(ctx, scale)
        return uniform_codes(bucket_view(v, self.bucket), scale, self.s, ctx.rng).reshape(-1)[: v.numel()]

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        scale = self._shared_scale(ctx)
        return {"codes": kernels.uniform_encode(v, scale, self.s, self.bucket, self.width, ctx.rng), "scales": scale}

    def _decode_into(self, fields: Mapping[str, torch.Tensor], numel: int, out: torch.Tensor) -> bool:
        kernels.uniform_decode(fields["codes"], fields["scales"], self.s, self.bucket, self.width, numel, out=out)
        return True

    def _decode_mean_into(self, fields: Sequence[Mapping[str, torch.Tensor]], numel: int,
                          out: torch.Tensor) -> bool:
        kernels.uniform_decode_mean([f["codes"] for f in fields], [f["scales"] for f in fields], self.s,
                                    self.bucket, self.width, numel, out=out)
        return True

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        return kernels.uniform_decode(fields["codes"], fields["scales"], self.s, self.bucket, self.width, numel)

    def _fields(self, v: torch.Tensor, ctx: EncodeContext, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        return kernels.uniform_encode(v, self._shared_scale(ctx), self.s, self.bucket, 8, ctx.rng, out=out)

    def _decode_field_sum(self, total: torch.Tensor, shared: Mapping[str, torch.Tensor], count: int,
                          numel: int, shared_seed: Optional[int],
                          out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        # Σ fields − M·s = Σ codes; the kernel's scale/(M·s) per bucket gives the average directly
        scale = shared["scale"].to(torch.float32)
        if total.dtype != torch.uint8:   # (a sum wider than a byte: 2·M·s > 255)
            return kernels.uniform_decode_sum(total, scale, count * self.s, self.bucket, numel, out=out)
        return kernels.uniform_decode(total, scale, count * self.s, self.bucket, 8, numel, out=out)

    def _decode_codes(self, codes: torch.Tensor, shared: Mapping[str, torch.Tensor], numel: int,
                      shared_seed: Optional[int]) -> torch.Tensor:
        return uniform_decode(codes, shared["scale"], self.s, numel, self.bucket)
