"""Fast Elias streams of QSGD codes held as uint8 fields ``c + s`` (``s ≤ 127``).

The stream format is :mod:`gradq.codecs.qsgd_stream`'s, byte for byte; only the work differs. The
fixed-width kernels write the codes as one byte per value, and this module streams those bytes
without widening them:

* **Lengths.** One pass in parallel over chunks finds both layouts' sizes. Each chunk sums the dense
  bits and the sparse bits of its values, leaving out the first gap, and keeps its first and last
  nonzero positions. The gaps across chunks are added in order afterwards.
* **Writing.** Table-driven: the bits of each field's "sign + omega(|c|)" (sparse) or "omega(|c| + 1)
  + sign" (dense) come from 256-entry tables, and those of a gap from :mod:`gradq.codecs.elias`'s
  table. They are shifted into a 64-bit accumulator and flushed 32 bits at a time.
* **Reading.** Table-driven too: one look-up in a 4,096-entry table decodes a whole item that fits
  12 bits (a sparse item's gap, sign and magnitude; a dense item's magnitude and sign). Other items
  go code by code (a 12-bit table, then :func:`gradq.codecs.elias.read_omega` for longer codes).
  Every bound of the strict decoder is checked: truncation, gaps past ``n``, ``|c| > s``, non-zero
  padding and extra bytes.

:func:`gradq.codecs.qsgd_stream.encode_fields_stream` and ``decode_fields_stream`` call these.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .elias import (_OMEGA_CODE, _OMEGA_LEN, _SMALL, ERR_CODE, ERR_GAP, ERR_NNZ, ERR_TRUNCATED, OK, check_tail,
                    flush, omega_len, omega_pieces, read_omega)

try:
    import numba as _numba

    _jit = _numba.njit(cache=True, nogil=True)
    _pjit = _numba.njit(cache=True, nogil=True, parallel=True)
    prange = _numba.prange
except ImportError:  # pragma: no cover - the plain-Python fallback of gradq.codecs.elias
    def _jit(fn):
        return fn

    _pjit = _jit
    prange = range

__all__ = ["field_tables", "item_tables", "fields_lengths", "write_fields_sparse", "write_fields_dense",
           "read_fields_fast"]

_CHUNK = 1 << 18


@lru_cache(maxsize=None)
def field_tables(s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per uint8 field ``f`` (code ``c = f − s``): ``(sparse code, sparse bits, dense code, dense
    bits)``, right-aligned. Sparse: the sign bit (1 = negative) then omega(|c|), for ``c ≠ 0``.
    Dense: omega(|c| + 1) then, for ``c ≠ 0``, the sign bit. Fields above ``2s`` have 0 bits."""
    sc = np.zeros(256, np.int64)
    sl = np.zeros(256, np.int64)
    dc = np.zeros(256, np.int64)
    dl = np.zeros(256, np.int64)
    for f in range(2 * s + 1):
        c = f - s
        m = abs(c)
        neg = 1 if c < 0 else 0
        if m:
            sc[f] = (neg << int(_OMEGA_LEN[m])) | int(_OMEGA_CODE[m])
            sl[f] = 1 + int(_OMEGA_LEN[m])
            dc[f] = (int(_OMEGA_CODE[m + 1]) << 1) | neg
            dl[f] = int(_OMEGA_LEN[m + 1]) + 1
        else:
            dc[f] = int(_OMEGA_CODE[1])
            dl[f] = int(_OMEGA_LEN[1])
    return sc, sl, dc, dl


#: bits of the decoding window (a 4,096-entry table of 3 bytes an entry stays in the L1 cache)
_WIN = 12


def _decode_table() -> tuple[np.ndarray, np.ndarray]:
    """For every ``_WIN``-bit window: the value of the omega code at its top bit and the code's
    length, or length 0 when the code is longer than the window."""
    vals = np.zeros(1 << _WIN, np.int16)
    lens = np.zeros(1 << _WIN, np.int8)
    for w in range(1 << _WIN):
        n, p = 1, 0
        while p < _WIN:
            if (w >> (_WIN - 1 - p)) & 1 == 0:
                vals[w], lens[w] = n, p + 1
                break
            width = n + 1
            if p + width > _WIN:
                break
            n = (w >> (_WIN - p - width)) & ((1 << width) - 1)
            p += width
    return vals, lens


_DEC_VAL, _DEC_LEN = _decode_table()


@_jit
def _olen(k: int) -> int:
    return _OMEGA_LEN[k] if k < _SMALL else omega_len(k)


@_pjit
def fields_lengths(f: np.ndarray, s: int, sl: np.ndarray, dl: np.ndarray):
    """``(sparse body bits, dense body bits, number of fields above 2s, number of nonzero codes)`` of
    the fields ``f``."""
    n = f.shape[0]
    nch = (n + _CHUNK - 1) // _CHUNK
    dense = np.zeros(nch, np.int64)
    sparse = np.zeros(nch, np.int64)
    nnz = np.zeros(nch, np.int64)
    first = np.full(nch, -1, np.int64)
    last = np.full(nch, -1, np.int64)
    bad = np.zeros(nch, np.int64)
    top = 2 * s
    for c in prange(nch):
        e0 = c * _CHUNK
        e1 = min(n, e0 + _CHUNK)
        d = 0
        sp = 0
        z = 0
        fst = -1
        lst = -1
        b = 0
        for i in range(e0, e1):  # (selects, not branches, on v != s: the branch would mispredict)
            v = np.int64(f[i])
            b += v > top
            d += dl[v]
            nz = v != s
            g = i - lst
            gl = _OMEGA_LEN[g] if g < _SMALL else omega_len(g)
            sp += (sl[v] + (gl if lst >= 0 else 0)) if nz else 0
            fst = i if (nz and fst < 0) else fst
            z += nz
            lst = i if nz else lst
        dense[c] = d
        sparse[c] = sp
        nnz[c] = z
        first[c] = fst
        last[c] = lst
        bad[c] = b
    total_sparse = 0
    total_nnz = 0
    prev = -1
    for c in range(nch):
        total_sparse += sparse[c]
        total_nnz += nnz[c]
        if first[c] >= 0:
            total_sparse += _olen(first[c] - prev)
            prev = last[c]
    return total_sparse + omega_len(total_nnz + 1), dense.sum(), bad.sum(), total_nnz


@_jit
def _put_pieces(buf: np.ndarray, o: int, acc: int, nacc: int, p):
    """Append up to three ``(code, bits)`` pieces of :func:`omega_pieces` to the accumulator,
    flushing whole 32-bit words; ``(o, acc, nacc)`` after. For the rare long codes only: the hot
    loops flush inline (numba keeps their state in registers that way)."""
    for j in range(3):
        nb = p[2 * j + 1]
        if nb:
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
    return o, acc, nacc


# The writers flush whole 32-bit words inline, as gradq.codecs.qsgd_stream's do: the same block in a
# helper returning (o, acc, nacc), even inlined, made the sparse writer 1.7x slower (measured: 25M
# values, 147 ms against 253 ms).
@_jit
def write_fields_sparse(f: np.ndarray, s: int, sc: np.ndarray, sl: np.ndarray, nnz: int, buf: np.ndarray) -> int:
    """Flag 0, Elias(nnz + 1), then per nonzero Elias(gap), its sign and Elias(|c|); returns the
    bytes written."""
    # the flag bit (0 = sparse), then Elias(nnz + 1)
    o, acc, nacc = _put_pieces(buf, 0, 0, 1, omega_pieces(nnz + 1))
    last = -1
    for i in range(f.shape[0]):
        v = np.int64(f[i])
        if v == s:
            continue
        g = i - last
        last = i
        if g < _SMALL:
            acc = (acc << _OMEGA_LEN[g]) | _OMEGA_CODE[g]
            nacc += _OMEGA_LEN[g]
        else:  # a gap past the table (rare): its pieces
            o, acc, nacc = _put_pieces(buf, o, acc, nacc, omega_pieces(g))
        if nacc >= 32:
            nacc -= 32
            w = acc >> nacc
            buf[o] = (w >> 24) & 0xFF
            buf[o + 1] = (w >> 16) & 0xFF
            buf[o + 2] = (w >> 8) & 0xFF
            buf[o + 3] = w & 0xFF
            o += 4
            acc &= (1 << nacc) - 1
        acc = (acc << sl[v]) | sc[v]
        nacc += sl[v]
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
def write_fields_dense(f: np.ndarray, dc: np.ndarray, dl: np.ndarray, buf: np.ndarray) -> int:
    """Flag 1, then per value Elias(|c| + 1) and, for ``c ≠ 0``, the sign; returns the bytes written."""
    o = 0
    acc = 1  # the flag bit, 1 = dense
    nacc = 1
    for i in range(f.shape[0]):
        v = np.int64(f[i])
        acc = (acc << dl[v]) | dc[v]
        nacc += dl[v]
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
def _window(pad: np.ndarray, p: int) -> int:
    """The ``_WIN`` bits at bit ``p`` (``pad`` holds the stream and 3 zero bytes)."""
    i = p >> 3
    w = (np.int64(pad[i]) << 16) | (np.int64(pad[i + 1]) << 8) | np.int64(pad[i + 2])
    return (w >> (24 - _WIN - (p & 7))) & ((1 << _WIN) - 1)


@_jit
def _omega(buf: np.ndarray, pad: np.ndarray, p: int, end: int):
    """One omega code at bit ``p``: ``(value, next p, err)``; table-driven up to ``_WIN`` bits."""
    w = _window(pad, p)
    ln = np.int64(_DEC_LEN[w])
    if ln:
        if p + ln > end:
            return 0, p, ERR_TRUNCATED
        return np.int64(_DEC_VAL[w]), p + ln, OK
    return read_omega(buf, p, end)


# -- the fast reader: whole items from one table look-up ----------------------------------------------
#: bits of the item window: a 4,096-entry int32 table (16 KiB) per ``s``
_IWIN = 12


@lru_cache(maxsize=None)
def item_tables(s: int) -> tuple[np.ndarray, np.ndarray]:
    """Per ``_IWIN``-bit window, the whole item at its top bit, packed as ``len | value << 5`` (0
    when the item is longer than the window or invalid). Sparse: ``Elias(gap)``, sign,
    ``Elias(|c|)`` with the value ``(gap << 8) | field``; dense: ``Elias(|c| + 1)`` and, for ``c ≠ 0``,
    the sign, with the value the field ``c + s``."""
    def omega_at(w: int, p: int):
        n = 1
        while p < _IWIN:
            if (w >> (_IWIN - 1 - p)) & 1 == 0:
                return n, p + 1
            width = n + 1
            if p + width > _IWIN:
                return None
            n = (w >> (_IWIN - p - width)) & ((1 << width) - 1)
            p += width
        return None

    sparse = np.zeros(1 << _IWIN, np.int32)
    dense = np.zeros(1 << _IWIN, np.int32)
    for w in range(1 << _IWIN):
        g = omega_at(w, 0)
        if g is not None and g[1] < _IWIN:
            gap, p = g
            neg = (w >> (_IWIN - 1 - p)) & 1
            m = omega_at(w, p + 1)
            if m is not None and m[0] <= s and gap < (1 << 16):
                sparse[w] = m[1] | (((gap << 8) | (s - m[0] if neg else s + m[0])) << 5)
        d = omega_at(w, 0)
        if d is not None and d[0] - 1 <= s:
            mag, p = d[0] - 1, d[1]
            if mag == 0:
                dense[w] = p | (s << 5)
            elif p < _IWIN:
                neg = (w >> (_IWIN - 1 - p)) & 1
                dense[w] = (p + 1) | ((s - mag if neg else s + mag) << 5)
    return sparse, dense


@_jit
def _peek(pad: np.ndarray, p: int) -> int:
    """The ``_IWIN`` bits at bit ``p``."""
    i = p >> 3
    w = (np.int64(pad[i]) << 16) | (np.int64(pad[i + 1]) << 8) | np.int64(pad[i + 2])
    return (w >> (24 - _IWIN - (p & 7))) & ((1 << _IWIN) - 1)


@_jit
def read_fields_fast(buf: np.ndarray, pad: np.ndarray, n: int, s: int, sparse_tab: np.ndarray,
                     dense_tab: np.ndarray, out: np.ndarray):
    """Decode ``c + s`` into ``out[:n]``, which holds ``s`` everywhere: ``(err, bit position)``. One
    table look-up per item where the item fits the window; any other item (long gaps, large
    magnitudes, damage) goes through the exact per-code path (:func:`_omega`), which reports the
    strict decoder's errors and positions."""
    end = buf.shape[0] * 8
    if end == 0:
        return ERR_TRUNCATED, 0
    flag = (np.int64(buf[0]) >> 7) & 1
    p = 1
    if flag == 0:
        v, p, err = _omega(buf, pad, p, end)
        if err != OK:
            return err, p
        nnz = v - 1
        if nnz > n:
            return ERR_NNZ, p
        pos = 0
        k = 0
        while k < nnz:
            e = np.int64(sparse_tab[_peek(pad, p)])
            ln = e & 31
            if ln and p + ln <= end:
                gap = e >> 13
                if gap <= n - pos:
                    pos += gap
                    out[pos - 1] = (e >> 5) & 0xFF
                    p += ln
                    k += 1
                    continue
            gap, p, err = _omega(buf, pad, p, end)
            if err != OK:
                return err, p
            if gap > n - pos:
                return ERR_GAP, p
            pos += gap
            if p >= end:
                return ERR_TRUNCATED, p
            neg = (np.int64(pad[p >> 3]) >> (7 - (p & 7))) & 1
            mag, p, err = _omega(buf, pad, p + 1, end)
            if err != OK:
                return err, p
            if mag > s:
                return ERR_CODE, p
            out[pos - 1] = s - mag if neg else s + mag
            k += 1
    else:
        i = 0
        while i < n:
            e = np.int64(dense_tab[_peek(pad, p)])
            ln = e & 31
            if ln and p + ln <= end:
                out[i] = e >> 5
                p += ln
                i += 1
                continue
            v, p, err = _omega(buf, pad, p, end)
            if err != OK:
                return err, p
            mag = v - 1
            if mag > s:
                return ERR_CODE, p
            if mag != 0:
                if p >= end:
                    return ERR_TRUNCATED, p
                neg = (np.int64(pad[p >> 3]) >> (7 - (p & 7))) & 1
                p += 1
                out[i] = s - mag if neg else s + mag
            i += 1
    return check_tail(buf, p), p
