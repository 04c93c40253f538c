"""Casts: ``none`` (float32, the uncompressed baseline), ``fp16`` and ``bf16``.

A cast is deterministic round-to-nearest, so ``fp16``/``bf16`` are slightly biased; ``none`` is exact
for float32 input (float64 input is sent as float32). Cast values add up directly, so all three are
summable: a worker's "codes" are the cast values themselves, summed in their own dtype.

Wire: ``n·4`` (none) or ``n·2`` (fp16, bf16) bytes.
"""

from __future__ import annotations

from typing import ClassVar, Mapping, Optional

import torch

from ..spec import register
from .base import EncodeContext
from .summable import SummableQuantizer

__all__ = ["Cast", "NoCompression", "FP16", "BF16"]


class Cast(SummableQuantizer):
    """Send every coordinate in ``wire_dtype``."""

    wire_dtype: ClassVar[torch.dtype] = torch.float32
    #: a cast only carries a NaN or Inf: a caller that screened ``x`` (``check_finite=False``, the
    #: DDP hook) saves the screen's pass, and on a GPU its host read
    runs_on_nonfinite = True

    @property
    def max_code(self) -> Optional[int]:
        """``None``: cast codes are floating-point values, not bounded integers."""
        return None

    def field_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"values": (self.wire_dtype, numel)}

    def _codes(self, v: torch.Tensor, ctx: EncodeContext) -> torch.Tensor:
        if self.wire_dtype == torch.float16 and v.numel():
            big = float(v.abs().max())
            if torch.finfo(torch.float16).max < big < float("inf"):   # (NaN/Inf: only unscreened input)
                raise ValueError(f"{self.name}: a value of magnitude {big:.3g} overflows float16 "
                                 f"(max {torch.finfo(torch.float16).max:.0f}); use bf16 or none")
        return v.to(self.wire_dtype)

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        return {"values": self._codes(v, ctx)}

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        return fields["values"].to(torch.float32)

    def _decode_codes(self, codes: torch.Tensor, shared: Mapping[str, torch.Tensor], numel: int,
                      shared_seed: Optional[int]) -> torch.Tensor:
        return codes.to(torch.float32).reshape(-1)[:numel]


@register("none")
class NoCompression(Cast):
    """No compression: float32 on the wire (4 bytes per coordinate). Unbiased (exact)."""

    unbiased = True
    wire_dtype = torch.float32


@register("fp16")
class FP16(Cast):
    """IEEE half precision on the wire (2 bytes per coordinate); raises on values beyond ±65504."""

    wire_dtype = torch.float16


@register("bf16")
class BF16(Cast):
    """bfloat16 on the wire (2 bytes per coordinate): float32's range, 8 bits of mantissa."""

    wire_dtype = torch.bfloat16
