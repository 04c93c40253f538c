"""QSGD: stochastic uniform quantization with ``s`` levels per sign (papers 000/004, Alistarh et al.).

For a bucket ``v`` of ``d`` coordinates with norm ``‖v‖`` (L2, or max-abs as in the paper's
experiments — the default here), each coordinate becomes the integer code

    c_i = sgn(v_i) · ξ_i,   ξ_i = |v_i|·s/‖v‖ stochastically rounded to an integer in [0, s]

and decodes to ``‖v‖·c_i/s``. Stochastic rounding makes the result unbiased. For the L2 norm, Lemma 3.1
bounds the variance per bucket by ``E‖Q(v) − v‖² ≤ min(d/s², √d/s)·‖v‖²``.

Bits (ALGORITHMS.md §0): ``bits=b`` means ``s = 2^(b−1) − 1`` (2 bits: ternary; 4 bits: s = 7;
8 bits: s = 127), stored as ``b``-bit offset-binary fields ``c + s``; ``levels=s`` may be given instead
(field width ``ceil(log2(2s+1))``).

Wire: ``ceil(n·width/8)`` bytes of packed codes + one float32 scale per bucket (+ the payload header).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..codecs.bitpack import pack_bits, packed_nbytes, unpack_bits
from ..errors import SpecError
from ..spec import ChoiceParam, IntParam, register
from .base import EncodeContext, Quantizer
from ._common import bucket_norms, bucket_view, code_width, levels_from_bits, num_buckets, stochastic_round

__all__ = ["QSGD", "uniform_codes", "uniform_decode", "resolve_levels"]

BITS = IntParam("bits", None, "bits per coordinate (s = 2^(bits-1) - 1); default 4", allow_none=True, lo=2, hi=8)
LEVELS = IntParam("levels", None, "number of levels s per sign, instead of bits", allow_none=True, lo=1, hi=127)
NORM = ChoiceParam("norm", "max", "bucket norm: max-abs (paper's experiments) or l2 (analysed)",
                   choices=("max", "l2"))


def resolve_levels(name: str, bits: Optional[int], levels: Optional[int], default_bits: int = 4) -> int:
    """The number of levels ``s`` from ``bits`` or ``levels`` (at most one may be given)."""
    if bits is not None and levels is not None:
        raise SpecError(f"{name}: give bits= or levels=, not both")
    if levels is not None:
        return levels
    return levels_from_bits(bits if bits is not None else default_bits)


def levels_spec_items(s: int) -> list[tuple[str, str]]:
    """Canonical spelling of ``s``: ``bits=b`` when ``s = 2^(b-1)-1``, else ``levels=s``."""
    for b in range(2, 9):
        if levels_from_bits(b) == s:
            return [("bits", str(b))]
    return [("levels", str(s))]


def uniform_codes(mat: torch.Tensor, scales: torch.Tensor, s: int, rng) -> torch.Tensor:
    """Signed integer codes in ``[-s, s]`` of a bucket matrix under per-row ``scales``:
    ``sgn(v)·round_stochastic(|v|·s/scale)``; a zero scale gives zero codes."""
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    a = mat.abs() * (s / safe)
    mag = stochastic_round(a, rng).clamp_(max=s)
    return (torch.sign(mat) * mag).to(torch.int32)


def uniform_decode(codes: torch.Tensor, scales: torch.Tensor, s: float, n: int,
                   bucket: Optional[int]) -> torch.Tensor:
    """``scale·c/s`` per bucket for flat ``codes`` of length ``n`` (codes may be sums over workers)."""
    mat = bucket_view(codes.to(torch.float32), bucket)
    return (mat * (scales.to(torch.float32) / s).unsqueeze(1)).reshape(-1)[:n]


@register("qsgd")
class QSGD(Quantizer):
    """QSGD with ``s`` levels, per-bucket norm scaling and packed fixed-width codes.

    Spec: ``qsgd:bits=4,bucket=512,norm=max`` (defaults). Unbiased; not summable (each worker's
    scale is its own — see ``maxnorm`` for the shared-scale variant).
    """

    params = (BITS, LEVELS, IntParam("bucket", 512, "bucket size (none = whole tensor)", allow_none=True, lo=1),
              NORM)
    unbiased = True

    def __init__(self, bits: Optional[int] = None, levels: Optional[int] = None, bucket: Optional[int] = 512,
                 norm: str = "max") -> None:
        super().__init__(bits=bits, levels=levels, bucket=bucket, norm=norm)
        self.s = resolve_levels(self.name, self.bits, self.levels)
        self.width = code_width(2 * self.s + 1)

    def _spec_items(self) -> list[tuple[str, str]]:
        return levels_spec_items(self.s) + [(k, v) for k, v in super()._spec_items() if k not in ("bits", "levels")]

    def field_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"codes": (torch.uint8, packed_nbytes(numel, self.width)),
                "scales": (torch.float32, num_buckets(numel, self.bucket))}

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        mat = bucket_view(v, self.bucket)
        scales = bucket_norms(mat, self.norm)
        codes = uniform_codes(mat, scales, self.s, ctx.rng).reshape(-1)[: v.numel()]
        return {"codes": pack_bits(codes + self.s, self.width), "scales": scales}

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        codes = unpack_bits(fields["codes"], self.width, numel) - self.s
        return uniform_decode(codes, fields["scales"], self.s, numel, self.bucket)
