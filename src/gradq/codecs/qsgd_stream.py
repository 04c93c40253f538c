"""Variable-length bit streams of QSGD codes ``c_i ∈ [−s, s]`` built on Elias omega (docs/algorithms.md).

Every stream starts with one **layout flag bit** (0 = sparse, 1 = dense) **[decided: explicit layouts
carry it too, so every stream is self-describing]**, then one of two bodies, MSB-first (see
:mod:`gradq.codecs.elias` for the bit order), the last byte zero-padded:

* **sparse** (the paper's, section 3.1 / Theorem 3.2): ``Elias(nnz + 1)`` **[decided, so the decoder knows
  where to stop]**, then for each nonzero in increasing position ``Elias(gap)`` (1-based distance from the
  previous nonzero; the first one's 1-based position), one sign bit (1 = negative), ``Elias(|c_i|)``.
  Theorem 3.2 bounds the expected length of a QSGD-quantized bucket of ``n`` coordinates (L2 norm) by
  ``(3 + 1.5·log(2(s² + n)/(s(s + √n))))·s(s + √n)`` bits plus the 32-bit scale (o(1) terms dropped).
* **dense** (the ``s ≈ √n`` regime, Corollary 3.3): per coordinate ``Elias(|c_i| + 1)``, followed by a
  sign bit when ``c_i ≠ 0``; the paper's bound is ``2.8n + 32`` bits with the scale (lower-order terms
  dropped, so it is measured, not asserted).
* ``layout="auto"`` writes the shorter body (sparse on a tie).

The per-bucket float32 scales are *not* part of the stream, nor is the chunk index that lets the
fields codec work by chunks in parallel (:mod:`gradq.codecs.qsgd_chunks`; ``index=True`` on the
encoders, ``index=`` on the decoders, which check it). The decoder is strict: exactly ``n``
coordinates, gaps never past ``n``, ``nnz ≤ n``, ``|c| ≤ s``, and after the last code only zero padding
bits in the final byte and no further bytes ("extended stream"). Every valid stream is the unique
encoding of its codes under its flag's layout (Elias codes are prefix-free and canonical), so a stream
that decodes re-encodes to the same bytes. Malformed input raises :class:`gradq.PayloadError`; it never
hangs, reads out of bounds or returns a wrong-sized tensor.

Wire size: ``ceil((1 + body bits)/8)`` bytes; :func:`stream_nbits` gives the bits without writing.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from ..errors import PayloadError
from .elias import (_OMEGA_LEN, _SMALL, ERR_CODE, ERR_GAP, ERR_INDEX, ERR_NNZ, ERR_TRUNCATED, MAX_VALUE, OK, _jit,
                    check_tail, flush, omega_len, omega_pieces, raise_for_error, read_omega)

__all__ = ["encode_stream", "decode_stream", "encode_fields_stream", "decode_fields_stream", "stream_nbits",
           "layout_nbits", "LAYOUTS"]

LAYOUTS = ("auto", "sparse", "dense")
Codes = Union[np.ndarray, torch.Tensor]


@_jit
def _olen(k: int) -> int:
    """``omega_len`` with the table inlined (0 for ``k ≤ 0``, which only overflowed input produces)."""
    return _OMEGA_LEN[k] if 0 <= k < _SMALL else (omega_len(k) if k > 0 else 0)


@_jit
def _lengths(codes: np.ndarray):
    """One pass: ``(sparse body bits, dense body bits, max |c|)`` (flag bit excluded; ``max |c| = −1``
    when a magnitude reaches 2**62 or overflows). Written with selects instead of branches on
    ``c == 0``, which is unpredictable for dense codes."""
    sparse = 0
    dense = 0
    nnz = 0
    last = 0
    big = 0
    bad = False
    for i in range(codes.shape[0]):
        c = int(codes[i])
        m = c if c > 0 else -c
        bad |= m < 0
        big = m if m > big else big
        nz = 1 if m != 0 else 0
        g = i + 1 - last if nz else 1
        dense += _olen(m + 1) + nz
        sparse += (_olen(g) + 1 + _olen(m)) * nz
        nnz += nz
        last = i + 1 if nz else last
    if bad or big >= MAX_VALUE:
        return 0, 0, -1
    return sparse + omega_len(nnz + 1), dense, big


# Writers: up to 31 pending bits wait in ``acc`` (``nacc`` of them) and whole 32-bit words go out
# big-endian. The word step is written inline: numba keeps it in registers that way (a helper function
# threading ``(o, acc, nacc)`` through calls made the loop ~6x slower). Every value written is below
# 2**60 (magnitudes ≤ s < 2**31, gaps ≤ n), as ``omega_pieces`` requires.
@_jit
def _write_sparse(codes: np.ndarray, buf: np.ndarray) -> int:
    """Flag 0, Elias(nnz+1), then per nonzero Elias(gap), sign, Elias(|c|); returns bytes written."""
    nnz = 0
    for i in range(codes.shape[0]):
        nnz += 1 if codes[i] != 0 else 0
    o = 0
    acc = 0  # the flag bit, 0 = sparse
    nacc = 1
    last = -1  # position (0-based) of the previous nonzero; -1 before the first, so gap = i - last
    for i in range(-1, codes.shape[0]):
        if i == -1:
            p = omega_pieces(nnz + 1) + (0, 0, 0, 0, 0, 0)  # the header: no magnitude pieces
        else:
            c = int(codes[i])
            if c == 0:
                continue
            m = omega_pieces(c if c > 0 else -c)
            # the sign bit goes in front of the magnitude's first piece
            p = omega_pieces(i - last) + ((1 if c < 0 else 0) << m[1] | m[0], m[1] + 1) + m[2:]
            last = i
        for j in range(6):
            nb = p[2 * j + 1]
            if nb == 0:
                continue
            acc = (acc << nb) | p[2 * j]
            nacc += nb
            if nacc >= 32:
                nacc -= 32
                w = acc >> nacc
                buf[o] = (w >> 24) & 0xFF
                buf[o + 1] = (w >> 16) & 0xFF
                buf[o + 2] = (w >> 8) & 0xFF
                buf[o + 3] = w & 0xFF
                o += 4
                acc &= (1 << nacc) - 1
    return flush(buf, o, acc, nacc)


@_jit
def _write_dense(codes: np.ndarray, buf: np.ndarray) -> int:
    """Flag 1, then per coordinate Elias(|c|+1) and a sign bit when c != 0; returns bytes written."""
    o = 0
    acc = 1  # the flag bit, 1 = dense
    nacc = 1
    for i in range(codes.shape[0]):
        c = int(codes[i])
        m = c if c > 0 else -c
        nz = 1 if m != 0 else 0
        p = omega_pieces(m + 1)
        for j in range(3):
            code = p[2 * j]
            nb = p[2 * j + 1]
            if j == 2:  # the sign bit follows the last piece (no branch on the sign or on zero)
                code = (code << nz) | (1 if c < 0 else 0)
                nb += nz
            if nb == 0:
                continue
            # the 32-bit flush below is written out in both writers on purpose: moving it into a
            # helper returning (acc, nacc, o) made numba's loop 3-4x slower (measured)
            acc = (acc << nb) | code
            nacc += nb
            if nacc >= 32:
                nacc -= 32
                w = acc >> nacc
                buf[o] = (w >> 24) & 0xFF
                buf[o + 1] = (w >> 16) & 0xFF
                buf[o + 2] = (w >> 8) & 0xFF
                buf[o + 3] = w & 0xFF
                o += 4
                acc &= (1 << nacc) - 1
    return flush(buf, o, acc, nacc)


@_jit
def _read(buf: np.ndarray, n: int, s: int, out: np.ndarray):
    """Decode into the zeroed ``out[:n]``; return ``(err, bit position, layout flag)``."""
    end = buf.shape[0] * 8
    if end == 0:
        return ERR_TRUNCATED, 0, -1
    flag = (int(buf[0]) >> 7) & 1
    p = 1
    if flag == 0:
        v, p, err = read_omega(buf, p, end)
        if err != OK:
            return err, p, flag
        nnz = v - 1
        if nnz > n:
            return ERR_NNZ, p, flag
        pos = 0
        for _ in range(nnz):
            gap, p, err = read_omega(buf, p, end)
            if err != OK:
                return err, p, flag
            if gap > n - pos:
                return ERR_GAP, p, flag
            pos += gap
            if p >= end:
                return ERR_TRUNCATED, p, flag
            neg = (int(buf[p >> 3]) >> (7 - (p & 7))) & 1
            p += 1
            mag, p, err = read_omega(buf, p, end)
            if err != OK:
                return err, p, flag
            if mag > s:
                return ERR_CODE, p, flag
            out[pos - 1] = -mag if neg else mag
    else:
        for i in range(n):
            v, p, err = read_omega(buf, p, end)
            if err != OK:
                return err, p, flag
            mag = v - 1
            if mag > s:
                return ERR_CODE, p, flag
            if mag != 0:
                if p >= end:
                    return ERR_TRUNCATED, p, flag
                neg = (int(buf[p >> 3]) >> (7 - (p & 7))) & 1
                p += 1
                out[i] = -mag if neg else mag
    return check_tail(buf, p), p, flag


def _as_codes(codes: Codes) -> np.ndarray:
    """A contiguous int32 or int64 numpy view of integer codes (copied only when needed)."""
    if isinstance(codes, torch.Tensor):
        if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
            raise TypeError(f"QSGD codes must be integers, got {codes.dtype}")
        codes = codes.detach().cpu().reshape(-1)
        if codes.dtype not in (torch.int32, torch.int64):
            codes = codes.to(torch.int64)
        return codes.contiguous().numpy()
    arr = np.asarray(codes).reshape(-1)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"QSGD codes must be integers, got {arr.dtype}")
    if arr.dtype not in (np.int32, np.int64):
        arr = arr.astype(np.int64)
    return np.ascontiguousarray(arr)


def _measure(codes: Codes) -> tuple[np.ndarray, int, int, int]:
    arr = _as_codes(codes)
    sparse, dense, big = _lengths(arr)
    if big < 0:
        raise ValueError("QSGD codes must have magnitudes below 2**62")
    return arr, int(sparse), int(dense), int(big)


def layout_nbits(codes: Codes) -> tuple[int, int]:
    """``(sparse, dense)`` body bits of ``codes`` (without the flag bit or padding)."""
    _, sparse, dense, _ = _measure(codes)
    return sparse, dense


def stream_nbits(codes: Codes, layout: str = "auto") -> int:
    """Exact bits of :func:`encode_stream` ``(codes, layout)`` before padding: flag + body."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not valid; expected one of {', '.join(LAYOUTS)}")
    _, sparse, dense, _ = _measure(codes)
    return 1 + {"sparse": sparse, "dense": dense, "auto": min(sparse, dense)}[layout]


@_jit
def _codes_index(codes: np.ndarray, sparse: bool, start: int, chunk: int) -> np.ndarray:
    """The chunk index (:mod:`gradq.codecs.qsgd_chunks`) of the stream of ``codes`` whose items start
    at bit ``start``."""
    n = codes.shape[0]
    nch = (n + chunk - 1) // chunk
    idx = np.empty(3 * max(0, nch - 1), np.int64)
    p = start
    k = 0
    last = 0
    for i in range(n):
        if i > 0 and i % chunk == 0:
            r = 3 * (i // chunk - 1)
            idx[r] = p
            idx[r + 1] = k
            idx[r + 2] = last
        c = int(codes[i])
        m = c if c > 0 else -c
        if sparse:
            if m:
                p += omega_len(i + 1 - last) + 1 + omega_len(m)
                k += 1
                last = i + 1
        else:
            p += omega_len(m + 1) + (1 if m else 0)
            k += 1
            last = i + 1
    return idx


def _index_of(arr: np.ndarray, sparse: bool) -> np.ndarray:
    from .qsgd_chunks import CHUNK

    start = 1 + (omega_len(int(np.count_nonzero(arr)) + 1) if sparse else 0)
    return _codes_index(arr, sparse, start, CHUNK)


def encode_stream(codes: Codes, s: int, layout: str = "auto", *, index: bool = False):
    """Encode integer codes in ``[−s, s]`` (any shape, flattened) as a CPU ``uint8`` stream; with
    ``index=True``, ``(stream, chunk index)`` (int64, see :mod:`gradq.codecs.qsgd_chunks`).

    >>> encode_stream(torch.tensor([0, 0, -1, 0, 2]), s=2, layout="sparse").tolist()
    [86, 144]
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not valid; expected one of {', '.join(LAYOUTS)}")
    if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s < (1 << 31):
        raise ValueError(f"s must be an integer in [1, 2**31), got {s!r}")
    arr, sparse_bits, dense_bits, big = _measure(codes)
    if big > s:
        raise ValueError(f"QSGD codes must lie in [-{s}, {s}], got |c| up to {big}")
    sparse = layout == "sparse" or (layout == "auto" and sparse_bits <= dense_bits)
    nbits = 1 + (sparse_bits if sparse else dense_bits)
    buf = np.zeros((nbits + 7) // 8, dtype=np.uint8)
    end = _write_sparse(arr, buf) if sparse else _write_dense(arr, buf)
    assert end == buf.shape[0], "internal error: stream length mismatch"
    if index:
        return torch.from_numpy(buf), torch.from_numpy(_index_of(arr, sparse))
    return torch.from_numpy(buf)


def decode_stream(stream: Union[torch.Tensor, np.ndarray, bytes], n: int, s: int, *,
                  index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exactly ``n`` int32 codes in ``[−s, s]`` from an :func:`encode_stream` stream (CPU tensor).

    Raises :class:`PayloadError` (naming the cause and bit position) on any malformed stream, or when
    ``index`` is given and is not the stream's chunk index (this reader is serial: it checks the index
    and does not use it)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s < (1 << 31):
        raise ValueError(f"s must be an integer in [1, 2**31), got {s!r}")
    if isinstance(stream, (bytes, bytearray)):
        buf = np.frombuffer(bytes(stream), dtype=np.uint8)
    elif isinstance(stream, torch.Tensor):
        if stream.dtype != torch.uint8:
            raise PayloadError(f"a QSGD stream must be uint8 bytes, got {stream.dtype}")
        buf = stream.detach().cpu().reshape(-1).numpy()
    else:
        buf = np.asarray(stream)
        if buf.dtype != np.uint8:
            raise PayloadError(f"a QSGD stream must be uint8 bytes, got {buf.dtype}")
    buf = np.ascontiguousarray(buf.reshape(-1))
    out = np.zeros(n, dtype=np.int32)
    err, pos, flag = _read(buf, n, s, out)
    raise_for_error(int(err), int(pos), "QSGD stream")
    if index is not None and not np.array_equal(_index_array(index), _index_of(out, flag == 0)):
        raise_for_error(ERR_INDEX, 0, "QSGD stream")
    return torch.from_numpy(out)


def _index_array(index: torch.Tensor) -> np.ndarray:
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int64:
        raise PayloadError("a QSGD stream's chunk index must be an int64 tensor")
    return np.ascontiguousarray(index.detach().cpu().reshape(-1).numpy())


def encode_fields_stream(fields: torch.Tensor, s: int, layout: str = "auto", *, index: bool = False):
    """:func:`encode_stream` of the codes ``fields − s``, given as uint8 fields ``c + s`` (``s ≤
    127``: what the fixed-width kernels write at 8 bits), without widening them to integers; written
    in parallel by chunks (:mod:`gradq.codecs.qsgd_chunks`). With ``index=True``, ``(stream, chunk
    index)``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not valid; expected one of {', '.join(LAYOUTS)}")
    if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= 127:
        raise ValueError(f"s must be an integer in [1, 127] for uint8 fields, got {s!r}")
    if not isinstance(fields, torch.Tensor) or fields.dtype != torch.uint8:
        raise TypeError("fields must be a uint8 tensor")
    from .qsgd_chunks import encode_fields

    arr = fields.detach().cpu().reshape(-1).contiguous().numpy()
    buf, idx = encode_fields(arr, s, layout)
    return (torch.from_numpy(buf), torch.from_numpy(idx)) if index else torch.from_numpy(buf)


def decode_fields_stream(stream: torch.Tensor, n: int, s: int, out: Optional[torch.Tensor] = None, *,
                         index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`decode_stream` as uint8 fields ``c + s`` (``s ≤ 127``), into ``out`` when given. With the
    stream's chunk ``index``, the chunks are decoded in parallel and the index is checked against the
    stream; without it, on one thread."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= 127:
        raise ValueError(f"s must be an integer in [1, 127] for uint8 fields, got {s!r}")
    if not isinstance(stream, torch.Tensor) or stream.dtype != torch.uint8:
        raise PayloadError("a QSGD stream must be uint8 bytes")
    buf = np.ascontiguousarray(stream.detach().cpu().reshape(-1).numpy())
    res = torch.empty(n, dtype=torch.uint8) if out is None else out
    arr = res.numpy()
    if index is not None:
        from .qsgd_chunks_read import decode_fields

        decode_fields(buf, n, s, _index_array(index), arr)
        return res
    from .qsgd_fields import item_tables, read_fields_fast

    pad = np.zeros(buf.size + 3, np.uint8)  # (the table-driven reader looks 3 bytes ahead)
    pad[:buf.size] = buf
    arr.fill(s)
    err, pos = read_fields_fast(buf, pad, n, s, *item_tables(s), arr)
    raise_for_error(int(err), int(pos), "QSGD stream")
    return res


def decode_stream_values(stream: torch.Tensor, n: int, s: int, index: torch.Tensor, scales: torch.Tensor,
                         bucket: Optional[int], out: torch.Tensor) -> torch.Tensor:
    """Decode an Elias stream of uint8-field codes (``s ≤ 127``) with its chunk index straight into
    float32 values ``float32(c)·(scale_b / s)`` (``out``: a contiguous float32 CPU tensor of ``n``
    values), chunk by chunk in parallel: the fields never exist as a whole. The same values as
    :func:`decode_fields_stream` followed by ``gradq.kernels.uniform_decode``."""
    if not isinstance(stream, torch.Tensor) or stream.dtype != torch.uint8:
        raise PayloadError("a QSGD stream must be uint8 bytes")
    from .qsgd_chunks_read import decode_fields

    buf = np.ascontiguousarray(stream.detach().cpu().reshape(-1).numpy())
    sc = np.ascontiguousarray(scales.detach().cpu().reshape(-1).numpy())
    decode_fields(buf, n, s, _index_array(index), None, values=out.numpy(), scales=sc, bucket=bucket)
    return out
