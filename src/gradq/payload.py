"""What crosses the wire: a :class:`Payload` of named tensors plus a small fixed header.

A payload is the output of :meth:`gradq.Quantizer.encode`. Its ``fields`` hold every tensor that a
worker would send (packed code bytes, per-bucket scales, quantization levels, indices, seeds) and its
:attr:`Payload.nbytes` counts exactly the bytes of :meth:`Payload.to_bytes`, the serialized form:

======================  =====================================================================
bytes                   content
======================  =====================================================================
2                       magic ``b"GQ"``
1                       format version (1)
1                       number of fields ``F``
4                       CRC-32 of the quantizer's canonical spec (catches decoding with the wrong spec)
8                       number of coordinates ``n`` (little-endian unsigned)
``5·F``                 per field: dtype code (1 byte) and element count (4 bytes, little-endian)
field bytes             the fields' raw little-endian bytes, in order
======================  =====================================================================

So the header is ``16 + 5·F`` bytes (26 bytes for the usual two fields). The tensor's shape, dtype and
device are *not* sent: like every ``torch.distributed`` collective, the receiver already holds a tensor
of the right shape (the gradient it is reducing) and passes it as ``like=``/``shape=`` when needed.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch

from .errors import PayloadError

__all__ = ["Payload", "HEADER_BYTES", "FIELD_HEADER_BYTES", "spec_crc"]

MAGIC = b"GQ"
VERSION = 1
HEADER_BYTES = 16
FIELD_HEADER_BYTES = 5

_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.uint8: 1,
    torch.int8: 2,
    torch.int16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.float16: 6,
    torch.bfloat16: 7,
    torch.float32: 8,
    torch.float64: 9,
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


_HEADERS: dict[tuple, torch.Tensor] = {}


def _header(spec: str, numel: int, fields: tuple[tuple[torch.dtype, int], ...], device: torch.device) -> torch.Tensor:
    """The header bytes of a payload, built once per (spec, size, fields, device) and kept: on a GPU a
    fresh host-to-device copy per payload would make the host wait for the stream."""
    key = (spec, numel, fields, device)
    head = _HEADERS.get(key)
    if head is None:
        raw = bytearray(MAGIC) + bytes([VERSION, len(fields)]) + spec_crc(spec).to_bytes(4, "little")
        raw += numel.to_bytes(8, "little")
        for dt, cnt in fields:
            raw += bytes([_DTYPE_CODES[dt]]) + cnt.to_bytes(4, "little")
        head = torch.frombuffer(raw, dtype=torch.uint8).to(device)
        if len(_HEADERS) > 4096:  # many distinct sizes (variable-length codes): keep the cache bounded
            _HEADERS.clear()
        _HEADERS[key] = head
    return head


def spec_crc(spec: str) -> int:
    """CRC-32 of a canonical spec string, as stored in the payload header."""
    return zlib.crc32(spec.encode("utf-8")) & 0xFFFFFFFF


@dataclass
class Payload:
    """The encoded form of one tensor.

    Attributes:
        spec: canonical spec of the quantizer that made it (``str(quantizer)``).
        shape: shape of the original tensor (local metadata, not sent).
        dtype: dtype of the original tensor (local metadata, not sent).
        numel: number of coordinates (sent in the header).
        fields: ordered mapping of wire tensors; every one of them crosses the network.
    """

    spec: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def header_nbytes(self) -> int:
        """Bytes of the fixed header and the per-field descriptors."""
        return HEADER_BYTES + FIELD_HEADER_BYTES * len(self.fields)

    @property
    def data_nbytes(self) -> int:
        """Bytes of the fields alone."""
        return sum(t.numel() * t.element_size() for t in self.fields.values())

    @property
    def nbytes(self) -> int:
        """Every byte that crosses the network: header plus fields (``== len(self.to_bytes())``)."""
        return self.header_nbytes + self.data_nbytes

    @property
    def bits_per_coordinate(self) -> float:
        """``8 · nbytes / numel`` (``inf`` for an empty tensor)."""
        return 8.0 * self.nbytes / self.numel if self.numel else float("inf")

    @property
    def device(self) -> torch.device:
        for t in self.fields.values():
            return t.device
        return torch.device("cpu")

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.fields[name]
        except KeyError:
            raise PayloadError(
                f"payload of {self.spec!r} has no field {name!r} (fields: {list(self.fields)})"
            ) from None

    def to(self, device: torch.device | str) -> "Payload":
        """A copy with every field moved to ``device``."""
        return Payload(self.spec, self.shape, self.dtype, self.numel,
                       {k: v.to(device) for k, v in self.fields.items()})

    # -- serialization -----------------------------------------------------------------------------
    def to_bytes(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Serialize to one flat ``uint8`` tensor (on the payload's device) of exactly ``nbytes``.

        ``out``: a 1-D uint8 tensor of that many bytes to write into (e.g. this payload's slice of a
        send buffer; saves a second copy), returned."""
        if len(self.fields) > 255:
            raise PayloadError("a payload holds at most 255 fields")
        for name, t in self.fields.items():
            if t.dtype not in _DTYPE_CODES:
                raise PayloadError(f"field {name!r} has unsupported dtype {t.dtype}")
        dev = self.device
        parts = [_header(self.spec, int(self.numel), tuple((t.dtype, int(t.numel())) for t in self.fields.values()),
                         dev)]
        for t in self.fields.values():
            parts.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
        if out is None:
            return torch.cat(parts)
        total = sum(int(t.numel()) for t in parts)
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != total:
            raise ValueError(f"out= must be a 1-D uint8 tensor of {total} bytes, got "
                             f"{out.dtype} {tuple(out.shape)}")
        return torch.cat(parts, out=out)

    @classmethod
    def parse(cls, buf: torch.Tensor | bytes | bytearray, *, names: Sequence[str],
              layout: Optional[Mapping[str, tuple[torch.dtype, int]]], spec: str, shape: Sequence[int],
              dtype: torch.dtype, copy: bool = True,
              check: Optional[Callable[["Payload"], None]] = None) -> "Payload":
        """Parse wire bytes where they lie: a buffer on a device whose fields have a fixed ``layout``
        is viewed by :meth:`from_layout` (no header read on the host; its fields are the layout's by
        construction); anything else is read by :meth:`from_bytes`, header and all (``names``: the
        fields in wire order), then passed to ``check`` (which raises on fields it does not expect)."""
        if layout is not None and isinstance(buf, torch.Tensor) and buf.device.type != "cpu":
            return cls.from_layout(buf, layout, spec=spec, shape=shape, dtype=dtype)
        p = cls.from_bytes(buf, names=names, spec=spec, shape=shape, dtype=dtype, copy=copy)
        if check is not None:
            check(p)
        return p

    @classmethod
    def from_layout(cls, buf: torch.Tensor, layout: Mapping[str, tuple[torch.dtype, int]], *, spec: str,
                    shape: Sequence[int], dtype: torch.dtype) -> "Payload":
        """Views of the fields of ``buf`` at the offsets a fixed ``layout`` (name → (dtype, count), in
        wire order) puts them, without reading the header — so no device-to-host copy (the DDP hook on
        CUDA parses payloads this way; the sizes were already agreed). Only the total length is checked:
        a CUDA payload's header is not validated (CPU payloads go through :meth:`from_bytes` and a CRC-32)."""
        numel = 1
        for s_ in shape:
            numel *= int(s_)
        pos = HEADER_BYTES + FIELD_HEADER_BYTES * len(layout)
        need = pos + sum(count * torch.empty((), dtype=dt).element_size() for dt, count in layout.values())
        if buf.numel() != need:
            raise PayloadError(f"payload has {buf.numel()} bytes, the layout of {spec!r} needs {need}")
        fields: dict[str, torch.Tensor] = {}
        for name, (dt, count) in layout.items():
            item = torch.empty((), dtype=dt).element_size()
            raw = buf[pos: pos + count * item]
            if (buf.data_ptr() + pos) % item:
                raw = raw.clone()
            fields[name] = raw.view(dt)
            pos += count * item
        return cls(spec, tuple(int(s_) for s_ in shape), dtype, numel, fields)

    @classmethod
    def from_bytes(
        cls,
        buf: torch.Tensor | bytes | bytearray,
        *,
        names: Sequence[str],
        spec: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        copy: bool = True,
    ) -> "Payload":
        """Parse :meth:`to_bytes` output. ``names`` are the field names in wire order.

        ``copy=False`` makes each field a view of ``buf`` where its alignment allows (a field of a
        wider dtype at a misaligned offset is still copied): no copy, but the payload then changes
        if ``buf`` does — for buffers the caller owns, such as a receive buffer.

        Raises :class:`gradq.PayloadError` on a wrong magic, version, spec checksum, field count,
        element count or any length mismatch; never reads outside ``buf``.
        """
        if isinstance(buf, (bytes, bytearray)):
            buf = (torch.frombuffer(bytearray(buf), dtype=torch.uint8) if len(buf)
                   else torch.empty(0, dtype=torch.uint8))
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise PayloadError("payload bytes must be a 1-D uint8 tensor")
        total = buf.numel()
        if total < HEADER_BYTES:
            raise PayloadError(f"payload truncated: {total} bytes, header needs {HEADER_BYTES}")
        head = bytes(buf[:HEADER_BYTES].cpu().tolist())
        if head[:2] != MAGIC:
            raise PayloadError("not a gradq payload (bad magic bytes)")
        if head[2] != VERSION:
            raise PayloadError(f"unsupported payload format version {head[2]} (this gradq reads {VERSION})")
        nfields = head[3]
        crc = int.from_bytes(head[4:8], "little")
        if crc != spec_crc(spec):
            raise PayloadError(f"payload was made by a different quantizer spec than {spec!r}")
        numel = int.from_bytes(head[8:16], "little")
        expect_numel = 1
        for s in shape:
            expect_numel *= int(s)
        if numel != expect_numel:
            raise PayloadError(f"payload holds {numel} coordinates, expected {expect_numel} for shape {tuple(shape)}")
        if nfields != len(names):
            raise PayloadError(f"payload has {nfields} fields, {spec!r} expects {len(names)}")
        desc_end = HEADER_BYTES + FIELD_HEADER_BYTES * nfields
        if total < desc_end:
            raise PayloadError("payload truncated inside the field descriptors")
        desc = bytes(buf[HEADER_BYTES:desc_end].cpu().tolist())
        fields: dict[str, torch.Tensor] = {}
        pos = desc_end
        for i, name in enumerate(names):
            code = desc[5 * i]
            count = int.from_bytes(desc[5 * i + 1: 5 * i + 5], "little")
            if code not in _CODE_DTYPES:
                raise PayloadError(f"field {name!r} has unknown dtype code {code}")
            dt = _CODE_DTYPES[code]
            size = count * torch.empty((), dtype=dt).element_size()
            if pos + size > total:
                raise PayloadError(f"payload truncated inside field {name!r}")
            raw = buf[pos: pos + size]
            if copy or (buf.data_ptr() + pos) % torch.empty((), dtype=dt).element_size():
                raw = raw.clone()
            fields[name] = raw.view(dt) if size else torch.empty(0, dtype=dt, device=buf.device)
            pos += size
        if pos != total:
            raise PayloadError(f"payload has {total - pos} trailing bytes")
        return cls(spec, tuple(int(s) for s in shape), dtype, numel, fields)

    def same_bytes(self, other: "Payload") -> bool:
        """True when both payloads would put identical bytes on the wire."""
        return torch.equal(self.to_bytes().cpu(), other.to_bytes().cpu())

    def describe(self) -> Mapping[str, object]:
        """A small summary for logs: spec, coordinates, bytes, bits per coordinate, field sizes."""
        return {
            "spec": self.spec,
            "numel": self.numel,
            "nbytes": self.nbytes,
            "bits_per_coordinate": self.bits_per_coordinate,
            "fields": {k: (str(v.dtype).replace("torch.", ""), v.numel()) for k, v in self.fields.items()},
        }
