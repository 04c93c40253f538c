"""Elias streams of uint8 QSGD fields written and read in parallel, by chunks of :data:`CHUNK` values.

The stream is :mod:`gradq.codecs.qsgd_stream`'s, bit for bit. What makes the work parallel is a small
**chunk index** beside it (a payload field of its own, ``index``: int64, 3 entries per chunk after
the first, so nothing for up to :data:`CHUNK` values). For chunk ``c ≥ 1`` (values
``[c·CHUNK, (c+1)·CHUNK)``) its row holds:

* the bit at which the chunk's first item starts (a sparse item: the gap's code, its sign and
  magnitude; a dense item: one value's code), or, for a sparse chunk without a nonzero, the bit where
  the next item starts (the end of the stream after the last one);
* the number of items before the chunk (nonzeros for the sparse layout, ``c·CHUNK`` for the dense);
* the 1-based position of the last item before the chunk (0 when there is none; ``c·CHUNK`` dense).

**Writing** (``encode_fields``). Each chunk writes its sparse items into a scratch area of its own,
without the first item's gap (which depends on the chunks before), and counts the dense layout's bits
on the way. Once every chunk's length is known, the chunks are copied into the stream at their bit
offsets, the first gap put in front of each, again in parallel; the bytes that two chunks share are
OR-ed together afterwards. The layout is chosen on exact lengths as before (the dense layout, when it
is shorter, is written by a second parallel pass straight into the stream: its lengths were counted).
The scratch is reserved at 2 bytes a value but only the written part is touched.

**Reading** is :mod:`gradq.codecs.qsgd_chunks_read`.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from .elias import _OMEGA_CODE, _OMEGA_LEN, flush, omega_len, omega_pieces
from .qsgd_fields import _CHUNK, _jit, _pjit, _put_pieces, field_tables, prange

__all__ = ["CHUNK", "index_len", "encode_fields"]

#: values per chunk: the index's granularity (about 100 chunks for 25M values)
CHUNK = _CHUNK
_COLS = 3


def index_len(n: int) -> int:
    """Entries of the chunk index of ``n`` values (0 up to :data:`CHUNK` values)."""
    return _COLS * max(0, -(-n // CHUNK) - 1)


# -- writing ---------------------------------------------------------------------------------------
#: gaps below this are written together with the item that follows them, from one table
_NEAR = 16


@lru_cache(maxsize=None)
def item_code_table(s: int) -> np.ndarray:
    """Per ``(gap, field)`` with ``gap < 16`` and ``field ≤ 2s + 1``, index ``gap·(2s + 2) + field``: the
    sparse item (the gap's omega code, the sign, omega(|c|)) as ``code << 5 | length``, right-aligned;
    0 (no bits) for the zero field ``s``, for ``2s + 1`` (which stands for every invalid field) and for
    gap 0. int32, so that the table stays in the L1 cache (1 KiB for 4 bits, 16 KiB for 8)."""
    sc, sl, _, _ = field_tables(s)
    w = 2 * s + 2
    table = np.zeros(_NEAR * w, np.int32)
    for g in range(1, _NEAR):
        for v in range(2 * s + 1):
            if v != s:
                code = (int(_OMEGA_CODE[g]) << int(sl[v])) | int(sc[v])
                table[g * w + v] = (code << 5) | (int(_OMEGA_LEN[g]) + int(sl[v]))
    return table


@_jit
def _sparse_chunk(f: np.ndarray, e0: int, e1: int, s: int, sc: np.ndarray, sl: np.ndarray, dl: np.ndarray,
                  table: np.ndarray, scratch: np.ndarray, o0: int):
    """One chunk's sparse items from ``scratch[o0]``, the first one without its gap: ``(bits, first
    nonzero, last nonzero, nonzeros, dense bits, largest field)``.

    Every value goes through the same steps, zeros included (they add 0 bits from ``table``, see
    :func:`item_code_table`), so that nothing branches on whether a value is zero, which is
    unpredictable in QSGD codes; only a nonzero after a gap of 16 or more takes a branch (to write the
    gap from its pieces). The first nonzero is found by a loop of its own."""
    fst = e0
    while fst < e1 and np.int64(f[fst]) == s:
        fst += 1
    if fst == e1:
        return 0, -1, -1, 0, (e1 - e0) * dl[s], s
    v = np.int64(f[fst])
    acc = sc[v]
    nacc = sl[v]
    d = (fst - e0) * dl[s] + dl[v]
    top = v
    o = o0
    last = fst
    z = 1
    w = 2 * s + 2
    for i in range(fst + 1, e1):
        v = np.int64(f[i])
        nz = v != s
        g = i - last
        d += dl[v]
        top = v if v > top else top
        if g >= _NEAR and nz:   # a long gap: its pieces, then the item
            o, acc, nacc = _put_pieces(scratch, o, acc, nacc, omega_pieces(g))
            acc = (acc << sl[v]) | sc[v]
            nacc += sl[v]
        else:
            e = np.int64(table[(g if g < _NEAR else _NEAR - 1) * w + (v if v < w else w - 1)])
            ln = e & 31
            acc = (acc << ln) | (e >> 5)
            nacc += ln
        last = i if nz else last
        z += nz
        if nacc >= 32:
            nacc -= 32
            x = acc >> nacc
            scratch[o] = (x >> 24) & 0xFF
            scratch[o + 1] = (x >> 16) & 0xFF
            scratch[o + 2] = (x >> 8) & 0xFF
            scratch[o + 3] = x & 0xFF
            o += 4
            acc &= (1 << nacc) - 1
    bits = (o - o0) * 8 + nacc
    flush(scratch, o, acc, nacc)
    return bits, fst, last, z, d, top


@_jit
def _dense_chunk(f: np.ndarray, e0: int, e1: int, s: int, dl: np.ndarray):
    """``(dense bits, fields above 2s)`` of ``f[e0:e1]``."""
    d = 0
    b = 0
    top = 2 * s
    for i in range(e0, e1):
        v = np.int64(f[i])
        d += dl[v]
        b += v > top
    return d, b


@_pjit
def _sparse_bodies(f: np.ndarray, s: int, sc: np.ndarray, sl: np.ndarray, dl: np.ndarray, table: np.ndarray,
                   scratch: np.ndarray, stride: int):
    """Per chunk, into ``scratch[c·stride:]``: its sparse items without the first one's gap. Returns
    per chunk ``(body bits, first nonzero, last nonzero, nonzeros, dense bits, fields above 2s)``."""
    n = f.shape[0]
    nch = (n + _CHUNK - 1) // _CHUNK
    nbits = np.zeros(nch, np.int64)
    first = np.full(nch, -1, np.int64)
    last = np.full(nch, -1, np.int64)
    count = np.zeros(nch, np.int64)
    dense = np.zeros(nch, np.int64)
    bad = np.zeros(nch, np.int64)
    for c in prange(nch):
        e0 = c * _CHUNK
        e1 = min(n, e0 + _CHUNK)
        nbits[c], first[c], last[c], count[c], dense[c], top = _sparse_chunk(f, e0, e1, s, sc, sl, dl, table,
                                                                             scratch, c * stride)
        bad[c] = top > 2 * s   # (a field above 2s: counted again exactly to report it)
    return nbits, first, last, count, dense, bad


@_pjit
def _dense_counts(f: np.ndarray, s: int, dl: np.ndarray):
    """Per chunk ``(dense bits, fields above 2s)``."""
    n = f.shape[0]
    nch = (n + _CHUNK - 1) // _CHUNK
    dense = np.zeros(nch, np.int64)
    bad = np.zeros(nch, np.int64)
    for c in prange(nch):
        dense[c], bad[c] = _dense_chunk(f, c * _CHUNK, min(n, (c + 1) * _CHUNK), s, dl)
    return dense, bad


@_jit
def _head(buf: np.ndarray, flag: int, value: int):
    """The flag bit, then (``value > 0``) Elias(value), from bit 0: ``(bits, the partial last byte)``."""
    acc = flag
    nacc = 1
    o = 0
    if value > 0:
        o, acc, nacc = _put_pieces(buf, 0, acc, nacc, omega_pieces(value))
    bits = o * 8 + nacc
    while nacc >= 8:
        nacc -= 8
        buf[o] = (acc >> nacc) & 0xFF
        o += 1
    return bits, ((acc << (8 - nacc)) & 0xFF) if nacc else 0


@_jit
def _end_chunk(buf: np.ndarray, o: int, acc: int, nacc: int) -> int:
    """Write the whole pending bytes; return the partial last one, left-aligned (0 when none)."""
    while nacc >= 8:
        nacc -= 8
        buf[o] = (acc >> nacc) & 0xFF
        o += 1
    return ((acc << (8 - nacc)) & 0xFF) if nacc else 0


@_jit
def _place(body: np.ndarray, nb: int, gap: int, st: int, buf: np.ndarray) -> int:
    """The omega code of ``gap`` and the ``nb`` bits of ``body`` at bit ``st`` of ``buf``: the whole
    bytes (the first holds zeros before bit ``st``); returns the partial last byte, left-aligned (0 when
    none). The body is shifted into place a byte at a time with no carried state, a loop the compiler
    vectorizes."""
    o = st >> 3
    acc = 0
    nacc = st & 7
    o, acc, nacc = _put_pieces(buf, o, acc, nacc, omega_pieces(gap))
    while nacc >= 8:
        nacc -= 8
        buf[o] = (acc >> nacc) & 0xFF
        o += 1
    r = nacc                       # the body starts r bits into byte o, after the r bits of ``head``
    head = (acc << (8 - r)) & 0xFF
    m = (nb + 7) >> 3              # body bytes (the last one zero-padded)
    total = r + nb
    full = total >> 3              # whole output bytes from o
    if full:
        buf[o] = head | (np.int64(body[0]) >> r)
        if r:
            for j in range(1, full):
                buf[o + j] = ((np.int64(body[j - 1]) << (8 - r)) | (np.int64(body[j]) >> r)) & 0xFF
        else:
            buf[o + 1:o + full] = body[1:full]
    if total & 7 == 0:
        return 0
    cur = np.int64(body[full]) >> r if full < m else 0
    if full:
        t = ((np.int64(body[full - 1]) << (8 - r)) & 0xFF) | cur
    else:
        t = head | cur
    return t & ((0xFF << (8 - (total & 7))) & 0xFF)


@_pjit
def _assemble(scratch: np.ndarray, stride: int, nbits: np.ndarray, gaps: np.ndarray, starts: np.ndarray,
              buf: np.ndarray, tails: np.ndarray) -> None:
    """Chunk ``c``'s first gap (``gaps[c] > 0``; 0: no nonzero, no bits) and body at bit ``starts[c]``
    of ``buf`` (:func:`_place`), its partial last byte into ``tails[c]``."""
    for c in prange(nbits.shape[0]):
        t = 0
        if gaps[c]:
            t = _place(scratch[c * stride:(c + 1) * stride], nbits[c], gaps[c], starts[c], buf)
        tails[c] = t


@_jit
def _dense_chunk_write(f: np.ndarray, e0: int, e1: int, dc: np.ndarray, dl: np.ndarray, st: int,
                       buf: np.ndarray) -> int:
    """The dense codes of ``f[e0:e1]`` at bit ``st``, as :func:`_place` places a chunk: returns the
    partial last byte."""
    o = st >> 3
    acc = 0
    nacc = st & 7
    for i in range(e0, e1):
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
    return _end_chunk(buf, o, acc, nacc)


@_pjit
def _write_dense(f: np.ndarray, dc: np.ndarray, dl: np.ndarray, starts: np.ndarray, buf: np.ndarray,
                 tails: np.ndarray) -> None:
    """Chunk ``c``'s dense codes at bit ``starts[c]`` (:func:`_dense_chunk_write`)."""
    n = f.shape[0]
    for c in prange(starts.shape[0]):
        tails[c] = _dense_chunk_write(f, c * _CHUNK, min(n, (c + 1) * _CHUNK), dc, dl, starts[c], buf)


@_jit
def _join(buf: np.ndarray, head_bits: int, pend: int, starts: np.ndarray, lengths: np.ndarray,
          tails: np.ndarray) -> None:
    """OR the partial bytes that consecutive chunks share (in order, after the parallel writes) and
    write the stream's last byte."""
    for c in range(starts.shape[0]):
        if lengths[c] == 0:
            continue
        st = starts[c]
        if (st + lengths[c]) >> 3 > st >> 3:   # the chunk completed its first byte: the pending bits go there
            buf[st >> 3] |= pend
            pend = tails[c]
        else:
            pend |= tails[c]
    end = head_bits + lengths.sum()
    if end & 7:
        buf[end >> 3] = pend


def _dense_stream(f: np.ndarray, dc: np.ndarray, dl: np.ndarray, dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    nch = dense.shape[0]
    starts = 1 + np.concatenate(([0], np.cumsum(dense)[:-1])) if nch else np.zeros(0, np.int64)
    total = 1 + int(dense.sum())
    buf = np.empty((total + 7) // 8, np.uint8)
    tails = np.zeros(nch, np.int64)
    _write_dense(f, dc, dl, starts.astype(np.int64), buf, tails)
    _join(buf, 1, 0x80, starts.astype(np.int64), dense, tails)
    idx = np.empty((max(0, nch - 1), _COLS), np.int64)
    if nch > 1:
        idx[:, 0] = starts[1:]
        idx[:, 1] = idx[:, 2] = np.arange(1, nch, dtype=np.int64) * CHUNK
    return buf, idx.reshape(-1)


_LOCAL = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """This thread's scratch area of at least ``nbytes``, kept between calls: a fresh one per call cost
    more than the writing itself (the first touch of each page; 80 ms against 71 ms at 25M values).
    Only the bytes written are resident: about the stream's size."""
    buf = getattr(_LOCAL, "scratch", None)
    if buf is None or buf.shape[0] < nbytes:
        buf = _LOCAL.scratch = np.empty(nbytes, np.uint8)
    return buf


def encode_fields(f: np.ndarray, s: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """The stream (uint8) and its chunk index (int64) of the uint8 fields ``f`` (``c + s``)."""
    sc, sl, dc, dl = field_tables(s)
    nch = -(-f.shape[0] // CHUNK)
    if layout == "dense":
        dense, bad = _dense_counts(f, s, dl)
        _check_bad(int(bad.sum()), s)
        return _dense_stream(f, dc, dl, dense)
    stride = 2 * CHUNK + 16   # ≤ 15.5 bits a value: 1.5 for gaps, 14 for a sign and omega(|c| ≤ 127)
    scratch = _scratch(nch * stride)
    nbits, first, last, count, dense, bad = _sparse_bodies(f, s, sc, sl, dl, item_code_table(s), scratch, stride)
    if bad.any():
        _check_bad(int(_dense_counts(f, s, dl)[1].sum()), s)
    nnz = int(count.sum())
    # each chunk's first gap: from the last nonzero of the chunks before (1-based; 0 = no nonzero)
    has = first >= 0
    prev_last = np.maximum.accumulate(np.where(has, last, -1)) if nch else last
    before = np.concatenate(([-1], prev_last[:-1])) if nch else prev_last
    gaps = np.where(has, first - before, 0).astype(np.int64)
    gbits = np.array([omega_len(int(g)) if g else 0 for g in gaps], np.int64)
    lengths = gbits + nbits
    sparse_body = omega_len(nnz + 1) + int(lengths.sum())
    if layout == "auto" and sparse_body > int(dense.sum()):
        return _dense_stream(f, dc, dl, dense)
    buf = np.empty((1 + sparse_body + 7) // 8, np.uint8)
    head_bits, pend = _head(buf, 0, nnz + 1)
    starts = head_bits + np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64) if nch else lengths
    tails = np.zeros(nch, np.int64)
    _assemble(scratch, stride, nbits, gaps, starts, buf, tails)
    _join(buf, head_bits, pend, starts, lengths, tails)
    idx = np.empty((max(0, nch - 1), _COLS), np.int64)
    if nch > 1:
        idx[:, 0] = starts[1:]
        idx[:, 1] = np.cumsum(count)[:-1]
        idx[:, 2] = before[1:] + 1
    return buf, idx.reshape(-1)


def _check_bad(bad: int, s: int) -> None:
    if bad:
        raise ValueError(f"QSGD codes must lie in [-{s}, {s}], got {bad} fields above {2 * s}")
