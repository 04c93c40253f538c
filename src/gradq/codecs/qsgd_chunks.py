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

**Reading** (``decode_fields``). Each chunk is decoded from its row by its own thread. Every row is
checked: each chunk must end exactly where the next begins, with exactly the items and the last
position that the next row says, and every item must fall inside its chunk, so a stream and an index
that decode are exactly what the writer makes (otherwise :class:`gradq.PayloadError`).
"""

from __future__ import annotations

import threading

import numpy as np

from .elias import (_OMEGA_CODE, _OMEGA_LEN, _SMALL, ERR_INDEX, ERR_NNZ, ERR_TRUNCATED, OK, check_tail, flush,
                    omega_len, omega_pieces, raise_for_error)
from .qsgd_fields import _CHUNK, _jit, _omega, _pjit, _put_pieces, field_tables, item_tables, prange, read_dense, \
    read_sparse

__all__ = ["CHUNK", "index_len", "encode_fields", "decode_fields"]

#: values per chunk: the index's granularity (about 100 chunks for 25M values)
CHUNK = _CHUNK
_COLS = 3


def index_len(n: int) -> int:
    """Entries of the chunk index of ``n`` values (0 up to :data:`CHUNK` values)."""
    return _COLS * max(0, -(-n // CHUNK) - 1)


# -- writing ---------------------------------------------------------------------------------------
@_jit
def _sparse_chunk(f: np.ndarray, e0: int, e1: int, s: int, sc: np.ndarray, sl: np.ndarray, scratch: np.ndarray,
                  o0: int):
    """One chunk's sparse items from ``scratch[o0]``, the first one without its gap: ``(bits, first
    nonzero, last nonzero, nonzeros)``. (The first nonzero is found by a loop of its own so that the
    writing loop is the plain one: a test for "first item" inside it made it 1.4x slower.)"""
    fst = e0
    while fst < e1 and np.int64(f[fst]) == s:
        fst += 1
    if fst == e1:
        return 0, -1, -1, 0
    v = np.int64(f[fst])
    acc = sc[v]
    nacc = sl[v]
    o = o0
    last = fst
    z = 1
    for i in range(fst + 1, e1):
        v = np.int64(f[i])
        if v == s:
            continue
        g = i - last
        last = i
        z += 1
        if g < _SMALL:
            acc = (acc << _OMEGA_LEN[g]) | _OMEGA_CODE[g]
            nacc += _OMEGA_LEN[g]
        else:  # a gap past the table (rare): its pieces
            o, acc, nacc = _put_pieces(scratch, o, acc, nacc, omega_pieces(g))
        if nacc >= 32:
            nacc -= 32
            w = acc >> nacc
            scratch[o] = (w >> 24) & 0xFF
            scratch[o + 1] = (w >> 16) & 0xFF
            scratch[o + 2] = (w >> 8) & 0xFF
            scratch[o + 3] = w & 0xFF
            o += 4
            acc &= (1 << nacc) - 1
        acc = (acc << sl[v]) | sc[v]
        nacc += sl[v]
        if nacc >= 32:
            nacc -= 32
            w = acc >> nacc
            scratch[o] = (w >> 24) & 0xFF
            scratch[o + 1] = (w >> 16) & 0xFF
            scratch[o + 2] = (w >> 8) & 0xFF
            scratch[o + 3] = w & 0xFF
            o += 4
            acc &= (1 << nacc) - 1
    bits = (o - o0) * 8 + nacc
    flush(scratch, o, acc, nacc)
    return bits, fst, last, z


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
def _sparse_bodies(f: np.ndarray, s: int, sc: np.ndarray, sl: np.ndarray, dl: np.ndarray, scratch: np.ndarray,
                   stride: int):
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
        nbits[c], first[c], last[c], count[c] = _sparse_chunk(f, e0, e1, s, sc, sl, scratch, c * stride)
        dense[c], bad[c] = _dense_chunk(f, e0, e1, s, dl)
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


@_pjit
def _assemble(scratch: np.ndarray, stride: int, nbits: np.ndarray, gaps: np.ndarray, starts: np.ndarray,
              buf: np.ndarray, tails: np.ndarray) -> None:
    """Chunk ``c``'s first gap (``gaps[c] > 0``) and body at bit ``starts[c]`` of ``buf``: its whole bytes,
    its partial last byte into ``tails[c]`` (its first byte holds zeros before its first bit)."""
    for c in prange(nbits.shape[0]):
        if gaps[c] == 0:  # no nonzero: no bits
            tails[c] = 0
            continue
        st = starts[c]
        o = st >> 3
        acc = 0
        nacc = st & 7
        o, acc, nacc = _put_pieces(buf, o, acc, nacc, omega_pieces(gaps[c]))
        base = c * stride
        nb = nbits[c]
        full = nb >> 3
        j = 0
        while j + 4 <= full:  # 32 bits in, one 32-bit word out (nacc < 32 stays)
            w = ((np.int64(scratch[base + j]) << 24) | (np.int64(scratch[base + j + 1]) << 16)
                 | (np.int64(scratch[base + j + 2]) << 8) | np.int64(scratch[base + j + 3]))
            acc = (acc << 32) | w
            out = acc >> nacc
            buf[o] = (out >> 24) & 0xFF
            buf[o + 1] = (out >> 16) & 0xFF
            buf[o + 2] = (out >> 8) & 0xFF
            buf[o + 3] = out & 0xFF
            o += 4
            acc &= (1 << nacc) - 1
            j += 4
        while j < full:
            acc = (acc << 8) | np.int64(scratch[base + j])
            nacc += 8
            if nacc >= 32:
                nacc -= 32
                w = acc >> nacc
                buf[o] = (w >> 24) & 0xFF
                buf[o + 1] = (w >> 16) & 0xFF
                buf[o + 2] = (w >> 8) & 0xFF
                buf[o + 3] = w & 0xFF
                o += 4
                acc &= (1 << nacc) - 1
            j += 1
        r = nb & 7
        if r:
            acc = (acc << r) | (np.int64(scratch[base + full]) >> (8 - r))
            nacc += r
        tails[c] = _end_chunk(buf, o, acc, nacc)


@_pjit
def _write_dense(f: np.ndarray, dc: np.ndarray, dl: np.ndarray, starts: np.ndarray, buf: np.ndarray,
                 tails: np.ndarray) -> None:
    """Chunk ``c``'s dense codes at bit ``starts[c]``, as :func:`_assemble` places a chunk."""
    n = f.shape[0]
    for c in prange(starts.shape[0]):
        st = starts[c]
        o = st >> 3
        acc = 0
        nacc = st & 7
        for i in range(c * _CHUNK, min(n, (c + 1) * _CHUNK)):
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
        tails[c] = _end_chunk(buf, o, acc, nacc)


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
    nbits, first, last, count, dense, bad = _sparse_bodies(f, s, sc, sl, dl, scratch, stride)
    _check_bad(int(bad.sum()), s)
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


# -- reading ---------------------------------------------------------------------------------------
@_jit
def _check_index(idx: np.ndarray, n: int, nch: int, sparse: bool, start: int, end: int, nnz: int) -> bool:
    """The rows are in range and in order (what the readers rely on before they check the stream)."""
    p0, k0, l0 = start, 0, 0
    for c in range(1, nch):
        p, k, lst = idx[_COLS * (c - 1)], idx[_COLS * (c - 1) + 1], idx[_COLS * (c - 1) + 2]
        if p < p0 or p > end or k < k0 or lst < l0 or lst > c * _CHUNK:
            return False
        if sparse:
            if k > nnz or k - k0 > lst - l0 or (k == k0) != (lst == l0):
                return False
        elif k != c * _CHUNK or lst != c * _CHUNK:
            return False
        p0, k0, l0 = p, k, lst
    return True


@_pjit
def _read_chunks(buf: np.ndarray, pad: np.ndarray, n: int, s: int, tab: np.ndarray, idx: np.ndarray, sparse: bool,
                 start: int, nnz: int, out: np.ndarray, errs: np.ndarray, where: np.ndarray) -> None:
    nch = errs.shape[0]
    end = buf.shape[0] * 8
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(n, lo + _CHUNK)
        p0 = start if c == 0 else idx[_COLS * (c - 1)]
        k0 = 0 if c == 0 else idx[_COLS * (c - 1) + 1]
        l0 = 0 if c == 0 else idx[_COLS * (c - 1) + 2]
        last = c == nch - 1
        p1 = end if last else idx[_COLS * c]
        k1 = nnz if last else idx[_COLS * c + 1]
        l1 = 0 if last else idx[_COLS * c + 2]
        if sparse:
            out[lo:hi] = s
            err, p, pos = read_sparse(buf, pad, p0, p1, l0, k1 - k0, lo, hi, s, tab, out)
            if err == OK and not last and (p != p1 or pos != l1):
                err = ERR_INDEX
        else:
            err, p = read_dense(buf, pad, p0, p1, lo, hi, s, tab, out)
            if err == OK and not last and p != p1:
                err = ERR_INDEX
        if err == OK and last:
            err = check_tail(buf, p)
        errs[c] = err
        where[c] = p


def decode_fields(buf: np.ndarray, n: int, s: int, idx: np.ndarray, out: np.ndarray) -> None:
    """Decode the stream ``buf`` with its chunk index ``idx`` into ``out[:n]`` (uint8 fields ``c + s``);
    raises :class:`gradq.PayloadError` on any malformed stream or index."""
    what = "QSGD stream"
    nch = -(-n // CHUNK)
    if idx.shape[0] != index_len(n):
        raise_for_error(ERR_INDEX, 0, what)
    end = buf.shape[0] * 8
    if end == 0:
        raise_for_error(ERR_TRUNCATED, 0, what)   # not even the flag bit
    sparse = not (int(buf[0]) >> 7) & 1
    pad = np.zeros(buf.size + 3, np.uint8)  # (the table-driven readers look 3 bytes ahead)
    pad[:buf.size] = buf
    start, nnz = 1, n
    if sparse:
        v, start, err = _omega(buf, pad, 1, end)
        raise_for_error(int(err), int(start), what)
        nnz = int(v) - 1
        if nnz > n:
            raise_for_error(ERR_NNZ, int(start), what)
    if nch == 0:
        if sparse and nnz:
            raise_for_error(ERR_NNZ, int(start), what)
        raise_for_error(int(check_tail(buf, start)), int(start), what)
        return
    if not _check_index(idx, n, nch, sparse, start, end, nnz):
        raise_for_error(ERR_INDEX, int(start), what)
    errs = np.zeros(nch, np.int64)
    where = np.zeros(nch, np.int64)
    sparse_tab, dense_tab = item_tables(s)
    _read_chunks(buf, pad, n, s, sparse_tab if sparse else dense_tab, idx, sparse, start, nnz, out, errs, where)
    bad = np.flatnonzero(errs)
    if bad.size:
        c = int(bad[0])
        raise_for_error(int(errs[c]), int(where[c]), what)
