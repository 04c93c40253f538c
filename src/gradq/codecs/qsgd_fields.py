"""Fast Elias streams of QSGD codes held as uint8 fields ``c + s`` (``s ≤ 127``).

The stream format is :mod:`gradq.codecs.qsgd_stream`'s, byte for byte; only the work differs. The
fixed-width kernels write the codes as one byte per value, and this module streams those bytes
without widening them:

* **Tables.** The bits of each field's "sign + omega(|c|)" (sparse) or "omega(|c| + 1) + sign" (dense)
  come from 256-entry tables (:func:`field_tables`), and those of a gap from
  :mod:`gradq.codecs.elias`'s table; the writers (:mod:`gradq.codecs.qsgd_chunks`) shift them into a
  64-bit accumulator and flush 32 bits at a time.
* **Reading.** Table-driven too: one look-up in a 4,096-entry table decodes a whole item that fits
  12 bits (a sparse item's gap, sign and magnitude; a dense item's magnitude and sign). Other items
  go code by code (a 12-bit table, then :func:`gradq.codecs.elias.read_omega` for longer codes).
  Every bound of the strict decoder is checked: truncation, gaps past ``n``, ``|c| > s``, non-zero
  padding and extra bytes. :func:`read_sparse` and :func:`read_dense` read a range of items, which is
  what the chunk-parallel reader of :mod:`gradq.codecs.qsgd_chunks` runs per chunk.

:func:`gradq.codecs.qsgd_stream.encode_fields_stream` and ``decode_fields_stream`` call these.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .elias import (_OMEGA_CODE, _OMEGA_LEN, ERR_CODE, ERR_GAP, ERR_INDEX, ERR_NNZ, ERR_TRUNCATED, OK,
                    check_tail, read_omega)

try:
    import numba as _numba

    from ..kernels.numba_cache import keyed_njit

    # (cached by a hash of the codecs' sources, as gradq.codecs.elias's functions)
    _jit = keyed_njit("codecs", nogil=True)
    _inline = keyed_njit("codecs", nogil=True, inline="always")   # inlined in numba's IR (constant flags fold)
    _pjit = keyed_njit("codecs", nogil=True, parallel=True)
    prange = _numba.prange
except ImportError:  # pragma: no cover - the plain-Python fallback of gradq.codecs.elias
    def _jit(fn):
        return fn

    _pjit = _inline = _jit
    prange = range

__all__ = ["field_tables", "item_tables", "wide_dense_table", "WIDE", "WIDE_FROM", "read_sparse", "read_dense",
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


#: bits of the wide dense window (:func:`wide_dense_table`): most dense items of 8-bit fields fit it
WIDE = 16
#: dense streams of fields with ``s`` above this read ``WIDE``-bit windows (their items mostly pass 12 bits)
WIDE_FROM = 15


@lru_cache(maxsize=None)
def wide_dense_table(s: int) -> np.ndarray:
    """:func:`item_tables`' dense table for a :data:`WIDE`-bit window (256 KiB): every item of up to
    16 bits, ``len | field << 5``, 0 for longer or invalid ones. At 8 bits (``s = 127``) nearly every
    dense item is 11 to 15 bits, past the 12-bit window."""
    _, _, dc, dl = field_tables(s)
    table = np.zeros(1 << WIDE, np.int32)
    for f in range(2 * s + 1):
        n = int(dl[f])
        if n <= WIDE:
            lo = int(dc[f]) << (WIDE - n)
            table[lo:lo + (1 << (WIDE - n))] = n | (f << 5)
    return table


@_jit
def _peek(pad: np.ndarray, p: int) -> int:
    """The ``_IWIN`` bits at bit ``p``."""
    i = p >> 3
    w = (np.int64(pad[i]) << 16) | (np.int64(pad[i + 1]) << 8) | np.int64(pad[i + 2])
    return (w >> (24 - _IWIN - (p & 7))) & ((1 << _IWIN) - 1)


@_jit
def read_sparse(buf: np.ndarray, pad: np.ndarray, p: int, end: int, pos: int, count: int, lo: int, hi: int, s: int,
                tab: np.ndarray, out: np.ndarray):
    """``count`` sparse items from bit ``p`` (bits below ``end``), after the nonzero at 1-based
    position ``pos``; each lands in ``(lo, hi]`` (1-based) and writes its field to ``out``:
    ``(err, bit position, last position)``. One table look-up per item where the item fits the window;
    any other item (long gaps, large magnitudes, damage) goes through the exact per-code path
    (:func:`_omega`), which reports the strict decoder's errors and positions."""
    k = 0
    while k < count:
        e = np.int64(tab[_peek(pad, p)])
        ln = e & 31
        if ln and p + ln <= end:
            gap = e >> 13
            if gap <= hi - pos:
                pos += gap
                out[pos - 1] = (e >> 5) & 0xFF
                p += ln
                k += 1
                if pos <= lo:   # (only the first item can land before the range)
                    return ERR_INDEX, p, pos
                continue
        gap, p, err = _omega(buf, pad, p, end)
        if err != OK:
            return err, p, pos
        if gap > hi - pos:
            return ERR_GAP, p, pos
        pos += gap
        if pos <= lo:
            return ERR_INDEX, p, pos
        if p >= end:
            return ERR_TRUNCATED, p, pos
        neg = (np.int64(pad[p >> 3]) >> (7 - (p & 7))) & 1
        mag, p, err = _omega(buf, pad, p + 1, end)
        if err != OK:
            return err, p, pos
        if mag > s:
            return ERR_CODE, p, pos
        out[pos - 1] = s - mag if neg else s + mag
        k += 1
    return OK, p, pos


@_jit
def read_dense(buf: np.ndarray, pad: np.ndarray, p: int, end: int, lo: int, hi: int, s: int, tab: np.ndarray,
               out: np.ndarray):
    """The dense items of values ``lo … hi − 1`` from bit ``p`` (bits below ``end``) into ``out``:
    ``(err, bit position)``; table-driven as :func:`read_sparse`."""
    i = lo
    while i < hi:
        e = np.int64(tab[_peek(pad, p)])
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
        else:
            out[i] = s
        i += 1
    return OK, p


@_jit
def read_fields_fast(buf: np.ndarray, pad: np.ndarray, n: int, s: int, sparse_tab: np.ndarray,
                     dense_tab: np.ndarray, out: np.ndarray):
    """Decode a whole stream (no index) as ``c + s`` into ``out[:n]``, which holds ``s`` everywhere:
    ``(err, bit position)``, on one thread."""
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
        err, p, pos = read_sparse(buf, pad, p, end, 0, nnz, 0, n, s, sparse_tab, out)
    else:
        err, p = read_dense(buf, pad, p, end, 0, n, s, dense_tab, out)
    if err != OK:
        return err, p
    return check_tail(buf, p), p
