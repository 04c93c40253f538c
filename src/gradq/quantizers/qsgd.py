"""QSGD: stochastic uniform quantization with ``s`` levels per sign ([QSGD], [QSGD-full], Alistarh et al.).

For a bucket ``v`` of ``d`` coordinates with norm ``‖v‖`` (L2, or max-abs as in the paper's
experiments — the default here), each coordinate becomes the integer code

    c_i = sgn(v_i) · ξ_i,   ξ_i = |v_i|·s/‖v‖ stochastically rounded to an integer in [0, s]

and decodes to ``‖v‖·c_i/s``. Stochastic rounding makes the result unbiased. For the L2 norm, Lemma 3.1
bounds the variance per bucket by ``E‖Q(v) − v‖² ≤ min(d/s², √d/s)·‖v‖²``.

Bits (docs/algorithms.md): ``bits=b`` means ``s = 2^(b−1) − 1`` (2 bits: ternary; 4 bits: s = 7;
8 bits: s = 127), stored as ``b``-bit offset-binary fields ``c + s``; ``levels=s`` may be given instead
(field width ``ceil(log2(2s+1))``).

Wire (``coding=fixed``, the default): ``ceil(n·width/8)`` bytes of packed codes + one float32 scale per
bucket (+ the 26-byte payload header).

**Elias coding** (section 3.1, Theorem 3.2, Corollary 3.3; docs/algorithms.md): ``coding=elias-sparse``
writes the paper's sparse layout (Elias-coded gaps, signs, magnitudes), ``coding=elias-dense`` the
``s ≈ √n`` layout (Elias(|c|+1) and a sign per coordinate), ``coding=elias`` the shorter of the two per
payload (one flag bit) — see :mod:`gradq.codecs.qsgd_stream`. The codes are exactly those of the fixed
coding for the same seed; only their wire form differs. Fields: ``stream`` (uint8, variable length),
``index`` (int64, the chunk index of :mod:`gradq.codecs.qsgd_chunks` **[decided]**: 3 entries per 2^18
values after the first chunk, so that the stream is written and read by chunks in parallel; checked
against the stream), ``scales`` (float32 per bucket), ``crc`` (one int32: CRC-32 of the stream and
index bytes **[decided]**, so any truncation, extension or bit flip is detected; the stream decoder is
strict on its own too). Wire size ``36 + len(stream) + 8·len(index) + 4·B + 4`` bytes for ``B``
buckets; Theorem 3.2 bounds the expected
stream length for ``norm=l2`` by ``(3 + 1.5·log(2(s² + d)/(s(s + √d))))·s(s + √d)`` bits per bucket of
``d`` coordinates.

**ANS coding** (``coding=ans`` **[decided]**, not in the papers; needs the optional ``constriction``
package): the same codes, range-coded (rANS) under their own histogram, which the payload carries as
the Elias-omega-coded ``count + 1`` of every value in ``[lo, lo + K)``. Fields ``ans`` (the coder's 32-bit
words as bytes), ``model``, ``range`` (int32 ``lo, K``), ``scales``, ``crc`` (CRC-32 of ans, model and
range); wire size ``41 + len(ans) + len(model) + 8 + 4·B + 4`` bytes — within a few percent of
``n·H(codes)`` on large tensors (docs/performance.md).

With an Elias or ANS coding ``levels`` may go up to ``2**20`` (the ``s = √n`` regime); fixed-width fields
hold at most 8 bits (``levels ≤ 127``).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from ..codecs.ans import ans_decode_codes, ans_encode_codes, constriction_module, crc_field
from ..codecs.bitpack import packed_nbytes
from ..errors import PayloadError, SpecError
from ..spec import ChoiceParam, IntParam, register
from .base import EncodeContext, Quantizer
from .. import kernels
from ..kernels.reference import dequantize_uniform as uniform_decode, uniform_codes
from ._common import bucket_norms, bucket_view, code_width, levels_from_bits, num_buckets

__all__ = ["QSGD", "uniform_codes", "uniform_decode", "resolve_levels"]

BITS = IntParam("bits", None, "bits per coordinate (s = 2^(bits-1) - 1); default 4", allow_none=True, lo=2, hi=8)
LEVELS = IntParam("levels", None, "number of levels s per sign, instead of bits", allow_none=True, lo=1, hi=127)
NORM = ChoiceParam("norm", "max", "bucket norm: max-abs (paper's experiments) or l2 (analysed)",
                   choices=("max", "l2"))
#: most levels an Elias-coded QSGD accepts (s = √n for n up to 2**40)
MAX_ELIAS_LEVELS = 1 << 20
_QSGD_LEVELS = IntParam("levels", None, "number of levels s per sign, instead of bits (above 127: coding=elias)",
                        allow_none=True, lo=1, hi=MAX_ELIAS_LEVELS)
CODING = ChoiceParam("coding", "fixed",
                     "wire form of the codes: fixed-width fields, or an Elias omega stream (elias = the "
                     "shorter of the sparse and dense layouts, per payload), or rANS under the codes' histogram "
                     "(ans; optional package constriction)",
                     choices=("fixed", "elias", "elias-sparse", "elias-dense", "ans"))
_LAYOUT = {"elias": "auto", "elias-sparse": "sparse", "elias-dense": "dense"}
_STREAM_FIELDS = ("stream", "index", "scales", "crc")
_ANS_FIELDS = ("ans", "model", "range", "scales", "crc")


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


@register("qsgd")
class QSGD(Quantizer):
    """QSGD with ``s`` levels, per-bucket norm scaling and packed fixed-width or entropy-coded codes.

    Spec: ``qsgd:bits=4,bucket=512,norm=max`` (defaults; ``coding=fixed`` is not printed), e.g.
    ``qsgd:bits=2,bucket=none,norm=l2,coding=elias-sparse`` for the paper's Elias-coded scheme,
    ``qsgd:levels=1000,bucket=none,norm=l2,coding=elias-dense`` for ``s ≈ √n``, or ``coding=ans`` (needs
    the optional ``constriction`` package). Unbiased; not summable (each worker's scale is its own — see
    ``maxnorm`` for the shared-scale variant).
    """

    params = (BITS, _QSGD_LEVELS,
              IntParam("bucket", 512, "bucket size (none = whole tensor)", allow_none=True, lo=1), NORM, CODING)
    unbiased = True

    def __init__(self, bits: Optional[int] = None, levels: Optional[int] = None, bucket: Optional[int] = 512,
                 norm: str = "max", coding: str = "fixed") -> None:
        super().__init__(bits=bits, levels=levels, bucket=bucket, norm=norm, coding=coding)
        self.s = resolve_levels(self.name, self.bits, self.levels)
        if self.coding == "fixed" and self.s > 127:
            raise SpecError(f"{self.name}: levels={self.s} is too many for fixed-width fields (at most 8 bits, "
                            "levels <= 127); levels above 127 need coding=elias")
        if self.coding == "ans":
            constriction_module()
        self.width = code_width(2 * self.s + 1)

    def _spec_items(self) -> list[tuple[str, str]]:
        rest = [(k, v) for k, v in super()._spec_items()
                if k not in ("bits", "levels") and not (k == "coding" and v == "fixed")]
        return levels_spec_items(self.s) + rest

    def field_layout(self, numel: int) -> Optional[dict[str, tuple[torch.dtype, int]]]:
        if self.coding != "fixed":
            return None  # the stream's length depends on the data
        return {"codes": (torch.uint8, packed_nbytes(numel, self.width)),
                "scales": (torch.float32, num_buckets(numel, self.bucket))}

    def wire_fields(self, numel: int) -> tuple[str, ...]:
        if self.coding == "fixed":
            return super().wire_fields(numel)
        return _ANS_FIELDS if self.coding == "ans" else _STREAM_FIELDS

    def _check_fields(self, payload) -> None:
        if self.coding == "fixed":
            return super()._check_fields(payload)
        from ..codecs.qsgd_chunks import index_len as stream_index_len

        f, names = payload.fields, self.wire_fields(payload.numel)
        if tuple(f) != names:
            raise PayloadError(f"{self.name}: payload fields {list(f)} != expected {list(names)}")
        fixed = {"scales": (torch.float32, num_buckets(payload.numel, self.bucket)), "crc": (torch.int32, 1),
                 "range": (torch.int32, 2), "stream": (torch.uint8, None), "ans": (torch.uint8, None),
                 "model": (torch.uint8, None), "index": (torch.int64, stream_index_len(payload.numel))}
        for k in names:
            dt, cnt = fixed[k]
            if f[k].dtype != dt or (cnt is not None and f[k].numel() != cnt):
                raise PayloadError(f"{self.name}: field {k!r} is {f[k].dtype}[{f[k].numel()}], expected "
                                   f"{dt}[{'any' if cnt is None else cnt}]")
        if "stream" in f and f["stream"].numel() < 1:
            raise PayloadError(f"{self.name}: field 'stream' is empty (every stream holds a layout flag bit)")

    def _nonfinite_witness(self, x: torch.Tensor, shared: Optional[Mapping[str, torch.Tensor]]) -> Optional[str]:
        # every backend only does arithmetic on NaN/Inf; a bucket's L2 or max norm is NaN/Inf
        # exactly when the bucket holds one
        return "scales" if self.coding == "fixed" and x.dtype == torch.float32 else None

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        if self.coding == "fixed":
            fused = kernels.maxabs_uniform_encode if self.norm == "max" else kernels.l2_uniform_encode
            packed, scales = fused(v, self.s, self.bucket, self.width, ctx.rng)   # norm, quantize, pack per bucket
            return {"codes": packed, "scales": scales}
        if self.coding != "ans" and self.s <= 127:
            # the fixed-width kernels' uint8 fields c + s (the same randomness), streamed without widening
            stream, index, scales = kernels.elias_encode(v, self.s, self.bucket, self.norm, ctx.rng,
                                                         _LAYOUT[self.coding])
            return self._stream_payload(stream, index, scales, v.device)
        mat = bucket_view(v, self.bucket)
        scales = bucket_norms(mat, self.norm)
        codes = uniform_codes(mat, scales, self.s, ctx.rng).reshape(-1)[: v.numel()]
        if self.coding == "ans":
            out = ans_encode_codes(codes)
            crc = crc_field(out["ans"], out["model"], out["range"])
            out = {k: t.to(v.device) for k, t in out.items()}
            return {**out, "scales": scales, "crc": crc.to(v.device)}
        from ..codecs.qsgd_stream import encode_stream  # numba-compiled; loaded on first use

        stream, index = encode_stream(codes, self.s, _LAYOUT[self.coding], index=True)
        return self._stream_payload(stream, index, scales, v.device)

    @staticmethod
    def _stream_payload(stream: torch.Tensor, index: torch.Tensor, scales: torch.Tensor,
                        device: torch.device) -> dict[str, torch.Tensor]:
        stream, index = stream.to(device), index.to(device)
        return {"stream": stream, "index": index, "scales": scales, "crc": kernels.crc32_field(stream, index)}

    def _decode_into(self, fields: Mapping[str, torch.Tensor], numel: int, out: torch.Tensor) -> bool:
        if self.coding == "fixed":
            kernels.uniform_decode(fields["codes"], fields["scales"], self.s, self.bucket, self.width, numel, out=out)
            return True
        if self.coding == "ans" or self.s > 127:
            return False
        self._check_crc(fields, numel)
        kernels.elias_decode(fields["stream"], fields["index"], fields["scales"], self.s, self.bucket, numel, out)
        return True

    def _stream_fields(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        """The uint8 fields ``c + s`` of an Elias-coded payload (its CRC checked first), on the
        stream's device."""
        self._check_crc(fields, numel)
        return kernels.elias_stream_fields(fields["stream"], numel, self.s, fields["index"])

    def _check_crc(self, fields: Mapping[str, torch.Tensor], numel: int) -> None:
        names = [k for k in self.wire_fields(numel) if k not in ("scales", "crc")]
        got = kernels.crc32_field(*(fields[k] for k in names))
        if not torch.equal(got, fields["crc"].to(got.device)):   # (one host read, on the device's result)
            raise PayloadError(f"{self.name}: corrupt payload: the CRC-32 of the coded codes does not match "
                               "(truncated, extended or altered bytes)")

    def _decode_mean_into(self, fields: Sequence[Mapping[str, torch.Tensor]], numel: int,
                          out: torch.Tensor) -> bool:
        if self.coding != "fixed":
            return False
        kernels.uniform_decode_mean([f["codes"] for f in fields], [f["scales"] for f in fields], self.s,
                                    self.bucket, self.width, numel, out=out)
        return True

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        if self.coding == "fixed":
            return kernels.uniform_decode(fields["codes"], fields["scales"], self.s, self.bucket, self.width, numel)
        if self.coding != "ans" and self.s <= 127:
            f8 = self._stream_fields(fields, numel)
            return kernels.uniform_decode(f8.to(fields["scales"].device), fields["scales"], self.s, self.bucket, 8,
                                          numel)
        self._check_crc(fields, numel)
        if self.coding == "ans":
            codes = ans_decode_codes(fields, numel, self.s)
        else:
            from ..codecs.qsgd_stream import decode_stream

            codes = decode_stream(fields["stream"], numel, self.s, index=fields["index"])
        return uniform_decode(codes.to(fields["scales"].device), fields["scales"], self.s, numel, self.bucket)
