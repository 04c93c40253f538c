"""The CRC-32 of payload fields and Elias-coded QSGD's primitives, dispatched like the rest of
:mod:`gradq.kernels`: on the Triton backend the stream is written, read and checksummed on the device
(:mod:`gradq.kernels.triton_elias`, :mod:`gradq.kernels.triton_elias_read`,
:mod:`gradq.kernels.triton_crc`); elsewhere by the host's codecs (:mod:`gradq.codecs.qsgd_stream`,
:mod:`gradq.codecs.ans`).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import RngLike, _triton, backend_for, l2_uniform_encode, maxabs_uniform_encode, uniform_decode


def crc32_field(*parts: torch.Tensor) -> torch.Tensor:
    """zlib's CRC-32 of the parts' bytes, in order, as one int32 (the unsigned checksum's bits) on the
    first part's device. With the Triton backend it is computed there, with no copy to the host
    (:mod:`gradq.kernels.triton_crc`); elsewhere zlib runs on the host
    (:func:`gradq.codecs.ans.crc_field`)."""
    if not parts:
        raise ValueError("crc32_field needs at least one tensor")
    device = parts[0].device
    if backend_for(parts[0]) == "triton" and all(t.device == device for t in parts):
        from . import triton_crc
        return triton_crc.crc32_field(parts)
    from ..codecs.ans import crc_field
    return crc_field(*parts).to(device)


def elias_stream_fields(stream: torch.Tensor, n: int, s: int, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``n`` uint8 fields ``c + s`` of an Elias stream of QSGD codes (``1 ≤ s ≤ 127``), on the
    stream's device, as :func:`gradq.codecs.qsgd_stream.decode_fields_stream` reads them (with the
    chunk ``index``, its chunks in parallel). The Triton backend reads the stream on the device
    (:mod:`gradq.kernels.triton_elias_read`) and hands anything it does not accept to that host
    reader, which raises the error of a corrupt stream; other backends read it on the host."""
    from ..codecs.qsgd_stream import decode_fields_stream  # numba-compiled; loaded on first use

    if backend_for(stream) == "triton" and stream.dtype == torch.uint8 and stream.dim() == 1 and stream.numel():
        from . import triton_elias_read

        got = triton_elias_read.decode_fields_stream(stream, n, s)
        if got is not None:
            return got
    return decode_fields_stream(stream, n, s, index=index).to(stream.device)


def elias_fields_stream(fields: torch.Tensor, s: int, layout: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The Elias stream of QSGD codes ``fields − s`` (uint8 fields, ``1 ≤ s ≤ 127``) and its chunk
    index, on the fields' device, byte for byte :func:`gradq.codecs.qsgd_stream.encode_fields_stream`
    (``layout``: ``auto``, ``sparse`` or ``dense``). CPU tensors take that serial writer (numba);
    the Triton backend builds it in two passes over the fields
    (:mod:`gradq.kernels.triton_elias`); other devices take tensor operations
    (:mod:`gradq.codecs.qsgd_stream_torch`)."""
    b = "torch" if fields.numel() == 0 else backend_for(fields)
    if b == "triton" and hasattr(_triton().tl, "gather"):
        from . import triton_elias

        return triton_elias.encode_fields_stream(fields, s, layout)
    if fields.device.type == "cpu":
        from ..codecs.qsgd_stream import encode_fields_stream  # numba-compiled; loaded on first use

        return encode_fields_stream(fields, s, layout, index=True)
    from ..codecs.qsgd_stream_torch import encode_fields_stream_torch

    return encode_fields_stream_torch(fields, s, layout, index=True)


def elias_encode(x: torch.Tensor, s: int, bucket: Optional[int], norm: str, rng: RngLike,
                 layout: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QSGD's codes of ``x`` with the ``norm`` (``"max"`` or ``"l2"``) of each ``bucket`` and
    ``1 ≤ s ≤ 127`` levels, as an Elias stream: ``(stream, index, scales)`` on ``x``'s device.

    The codes are the fixed-width encode's uint8 fields ``c + s`` (the same randomness, so the same
    codes as a fixed-width payload of the seed), streamed by :func:`elias_fields_stream` without
    widening them. On the CPU the fields go to this thread's reusable buffer
    (:func:`gradq.codecs.qsgd_chunks.field_buffer`): they live only until they are streamed."""
    if norm not in ("max", "l2"):
        raise ValueError(f"norm must be 'max' or 'l2', got {norm!r}")
    out = None
    if x.device.type == "cpu":
        from ..codecs.qsgd_chunks import field_buffer

        out = field_buffer(x.numel())
    fused = maxabs_uniform_encode if norm == "max" else l2_uniform_encode
    fields, scales = fused(x, s, bucket, 8, rng, out=out)
    stream, index = elias_fields_stream(fields, s, layout)
    return stream, index, scales


def elias_decode(stream: torch.Tensor, index: Optional[torch.Tensor], scales: torch.Tensor, s: int,
                 bucket: Optional[int], n: int, out: torch.Tensor) -> torch.Tensor:
    """Decode an Elias stream of ``n`` QSGD codes (``1 ≤ s ≤ 127``, per-bucket ``scales``) into
    ``out`` (flat, contiguous float32) and return it. The caller checks the stream's CRC first.

    A float32 CPU ``out`` (with numba's or torch's kernels) is filled chunk by chunk, decoded and
    dequantized in one go (:func:`gradq.codecs.qsgd_stream.decode_stream_values`), so no array of
    fields as large as the input is made; elsewhere the fields are read by :func:`elias_stream_fields`
    (on the device, with the Triton backend) and dequantized by :func:`uniform_decode`."""
    if (out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
            and scales.device.type == "cpu" and n > 0 and backend_for(out) != "triton"):
        from ..codecs.qsgd_stream import decode_stream_values  # numba-compiled; loaded on first use

        decode_stream_values(stream, n, s, index, scales, bucket, out.reshape(-1))
        return out
    uniform_decode(elias_stream_fields(stream, n, s, index).to(out.device), scales, s, bucket, 8, n, out=out)
    return out
