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

**Writing** (``encode_fields``). Each chunk writes its items into a scratch area of its own, the
sparse ones without the first item's gap (which depends on the chunks before). Once every chunk's
length is known, the chunks are copied into the stream at their bit offsets, the first gap put in
front of each, again in parallel; the bytes that two chunks share are OR-ed together afterwards.
Fields of up to 4 bits are written two at a time from one table (:func:`pair_code_table`), which
also gives the dense layout's bits. For wider fields the dense codes are written first, with a
lower bound of the sparse bits that usually settles a dense win before any sparse item is written.
The layout is chosen on exact lengths. The scratch is reserved at 2 bytes a value but only the
written part is touched.

**Reading** is :mod:`gradq.codecs.qsgd_chunks_read`.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from .elias import _OMEGA_CODE, _OMEGA_LEN, flush, omega_len, omega_pieces
from .qsgd_fields import _CHUNK, _inline, _jit, _pjit, _put_pieces, field_tables, prange

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
def item_code_table(s: int) -> tuple[np.ndarray, int]:
    """``(table, shift)``: per ``(gap, field)`` with ``gap < 16`` and ``field ≤ 2s``, at index ``gap <<
    shift | field`` (a row is the power of two above ``2s``), the sparse item (the gap's omega code,
    the sign, omega(|c|)) as ``code << 5 | length``, right-aligned; 0 (no bits) for the zero field
    ``s`` and for gap 0. int32, so that the table stays in the L1 cache (1 KiB for 4 bits, 16 KiB
    for 8)."""
    shift = (2 * s).bit_length()
    table = np.zeros(_NEAR << shift, np.int32)
    for g in range(1, _NEAR):
        for v in range(2 * s + 1):
            if v != s:
                code, ln = _item_bits(s, g, v)
                table[g << shift | v] = (code << 5) | ln
    return table, shift


def _item_bits(s: int, g: int, v: int) -> tuple[int, int]:
    """``(code, length)`` of the sparse item of the nonzero field ``v`` after a gap of ``g``: the
    gap's omega code, the sign, omega(|c|)."""
    sc, sl, _, _ = field_tables(s)
    return (int(_OMEGA_CODE[g]) << int(sl[v])) | int(sc[v]), int(_OMEGA_LEN[g]) + int(sl[v])


#: the pair writer's gaps: below this (and a field row of at most ``1 << _PAIR_SHIFT``), two values take
#: one look-up
_PAIR_GAPS = 15
_PAIR_SHIFT = 4
_NO_PAIRS = np.zeros(0, np.int32)


@lru_cache(maxsize=None)
def pair_code_table(s: int) -> np.ndarray:
    """Per ``(gap, field, next field)``, index ``gap << 2·shift | field << shift | next`` (``shift``
    as :func:`item_code_table`'s, at most 4; ``1 ≤ gap < 15``): the sparse items of the two values
    (the first one's gap is ``gap``, the second's 1 after a nonzero, ``gap + 1`` after a zero) as
    ``dense << 27 | code << 5 | length``: at most 22 bits of code, and the two values' bits in the
    dense layout (at most 16) on top (15 KiB for 4 bits)."""
    dl = field_tables(s)[3]
    shift = (2 * s).bit_length()
    if shift > _PAIR_SHIFT:
        raise ValueError(f"pair tables are for fields of up to {_PAIR_SHIFT} bits, got s={s}")
    table = np.zeros(_PAIR_GAPS << (2 * shift), np.int32)
    for g in range(1, _PAIR_GAPS):
        for a in range(2 * s + 1):
            for b in range(2 * s + 1):
                code, ln = _item_bits(s, g, a) if a != s else (0, 0)
                if b != s:
                    c2, l2 = _item_bits(s, 1 if a != s else g + 1, b)
                    code, ln = (code << l2) | c2, ln + l2
                dense = int(dl[a]) + int(dl[b])
                assert ln <= 22 and dense < 32   # (the entry's fields: 5, 22 and 5 bits)
                table[g << (2 * shift) | a << shift | b] = np.int32(np.uint32((dense << 27) | (code << 5) | ln))
    return table


@_jit
def _bswap32(w: int) -> int:
    """The 32-bit word ``w`` with its bytes reversed (compiles to one instruction)."""
    return ((w >> 24) & 0xFF) | ((w >> 8) & 0xFF00) | ((w << 8) & 0xFF0000) | ((w << 24) & 0xFF000000)


@_jit
def _first_nonzero(f: np.ndarray, e0: int, e1: int, s: int) -> int:
    """The first position in ``[e0, e1)`` whose field is not ``s`` (``e1`` when none)."""
    fst = e0
    while fst < e1 and np.int64(f[fst]) == s:
        fst += 1
    return fst


@_inline
def _sparse_chunk(f: np.ndarray, e0: int, e1: int, s: int, sc: np.ndarray, sl: np.ndarray, dl: np.ndarray,
                  table: np.ndarray, shift: int, pairs: np.ndarray, scratch: np.ndarray, o0: int, paired: bool):
    """One chunk's sparse items into ``scratch`` from byte ``o0`` (a multiple of 4), the first one
    without its gap: ``(bits, first nonzero, last nonzero, nonzeros, dense bits)``; the dense layout's
    bits are counted only when ``paired`` (0 otherwise). Every field must be ``≤ 2s``.

    * With ``paired`` (fields of at most 4 bits), two values take one look-up in ``pairs``
      (:func:`pair_code_table`) while the gap is short; after a run of zeros, a value at a time.
    * A value at a time, every value goes through the same steps, zeros included (they add 0 bits
      from ``table``, see :func:`item_code_table`), so that nothing branches on whether a value is
      zero, which is unpredictable in QSGD codes; only a nonzero after a gap of 16 or more takes a
      branch (to write the gap from its pieces).
    * Nor is there a branch on whether a word is complete: the word that would be flushed is stored
      every time (big-endian), and the writer moves on by ``pending >> 5`` words (a store that is not
      kept is overwritten by the next one).

    Indices and fields are unsigned: numba adds no wrap-around to unsigned indices, and it would
    compare a uint64 field with the int64 zero field in floating point."""
    fst = _first_nonzero(f, e0, e1, s)
    if fst == e1:
        return 0, -1, -1, 0, (e1 - e0) * dl[s] if paired else 0
    words = scratch.view(np.uint32)
    su = np.uint64(s)
    v = np.uint64(f[fst])
    d = (fst - e0) * dl[s] + dl[v]
    acc = sc[v]
    nacc = sl[v]
    o = np.uint64(o0 >> 2)
    last = fst
    z = 1
    sh = np.uint64(shift)
    sh2 = np.uint64(2 * shift)
    i = fst + 1
    while i < e1:
        g = i - last
        if paired and g < _PAIR_GAPS and i + 1 < e1:
            v = np.uint64(f[np.uint64(i)])
            v2 = np.uint64(f[np.uint64(i + 1)])
            e = np.int64(np.uint32(pairs[(np.uint64(g) << sh2) | (v << sh) | v2]))
            ln = e & 31
            acc = (acc << ln) | ((e >> 5) & 0x3FFFFF)
            nacc += ln
            d += e >> 27
            nz = v != su
            nz2 = v2 != su
            last = i + 1 if nz2 else (i if nz else last)
            z += nz + nz2
            i += 2
        else:
            v = np.uint64(f[np.uint64(i)])
            nz = v != su
            if g >= _NEAR and nz:   # a long gap: its pieces, then the item
                ob, acc, nacc = _put_pieces(scratch, np.int64(o) * 4, acc, nacc, omega_pieces(g))
                o = np.uint64(ob >> 2)
                acc = (acc << sl[v]) | sc[v]
                nacc += sl[v]
            else:
                e = np.int64(table[(np.uint64(g if g < _NEAR else _NEAR - 1) << sh) | v])
                ln = e & 31
                acc = (acc << ln) | (e >> 5)
                nacc += ln
            last = i if nz else last
            z += nz
            if paired:
                d += dl[v]
            i += 1
        words[o] = _bswap32((acc >> (nacc & 31)) & 0xFFFFFFFF)
        o += np.uint64(nacc >> 5)
        nacc &= 31
    ob = np.int64(o) * 4
    flush(scratch, ob, acc, nacc)
    return (ob - o0) * 8 + nacc, fst, last, z, d if paired else 0


# :func:`_sparse_chunk` compiled twice, its flag a constant in each (a flag read in the loop cost up
# to a third of its speed)
@_jit
def _sparse_pairs(f, e0, e1, s, sc, sl, dl, table, shift, pairs, scratch, o0):
    return _sparse_chunk(f, e0, e1, s, sc, sl, dl, table, shift, pairs, scratch, o0, True)


@_jit
def _sparse_single(f, e0, e1, s, sc, sl, dl, table, shift, pairs, scratch, o0):
    return _sparse_chunk(f, e0, e1, s, sc, sl, dl, table, shift, pairs, scratch, o0, False)


@_jit
def _dense_chunk(f: np.ndarray, e0: int, e1: int, s: int, pk: np.ndarray, dc: np.ndarray, scratch: np.ndarray,
                 o0: int):
    """The dense codes of ``f[e0:e1]`` into ``scratch`` from byte ``o0`` (a multiple of 4), a word
    stored for every value as :func:`_sparse_chunk` does (fields above ``2s`` write nothing), and
    ``(dense bits, sparse bits without gaps, nonzeros, nonzeros after a zero, fields above 2s)`` (at
    ``e0 = 0`` the first value has a gap of 1, as after a nonzero); ``pk[v]`` packs the dense bits
    and (from bit 24) the sparse sign and magnitude bits of field ``v``."""
    words = scratch.view(np.uint32)
    o = np.uint64(o0 >> 2)
    w = 0
    nacc = 0
    acc = 0
    z = 0
    r = 0
    b = 0
    top = np.uint64(2 * s)
    su = np.uint64(s)
    prev = np.int64(f[e0 - 1]) != s if e0 else True
    for i in range(e0, e1):
        v = np.uint64(f[np.uint64(i)])
        nz = v != su
        t = pk[v]
        acc += t
        z += nz
        r += nz and not prev
        prev = nz
        b += v > top
        w = (w << (t & 0xFFFFFF)) | dc[v]
        nacc += t & 0xFFFFFF
        words[o] = _bswap32((w >> (nacc & 31)) & 0xFFFFFFFF)
        o += np.uint64(nacc >> 5)
        nacc &= 31
    flush(scratch, np.int64(o) * 4, w, nacc)
    return acc & 0xFFFFFF, acc >> 24, z, r, b


@_pjit
def _chunk_bodies(f: np.ndarray, s: int, sc: np.ndarray, sl: np.ndarray, dl: np.ndarray, table: np.ndarray,
                  shift: int, pairs: np.ndarray, scratch: np.ndarray, stride: int):
    """Per chunk, into ``scratch[c·stride:]``: its sparse items without the first one's gap
    (:func:`_sparse_pairs` when ``pairs`` is not empty, else :func:`_sparse_chunk`). Returns per chunk
    ``(sparse bits, first nonzero, last nonzero, nonzeros, dense bits)``; the dense bits are counted
    by the pair writer only (0 otherwise)."""
    n = f.shape[0]
    nch = (n + _CHUNK - 1) // _CHUNK
    sparse = np.zeros(nch, np.int64)
    first = np.full(nch, -1, np.int64)
    last = np.full(nch, -1, np.int64)
    count = np.zeros(nch, np.int64)
    dense = np.zeros(nch, np.int64)
    for c in prange(nch):
        e0 = c * _CHUNK
        e1 = min(n, e0 + _CHUNK)
        args = (f, e0, e1, s, sc, sl, dl, table, shift, pairs, scratch, c * stride)
        sparse[c], first[c], last[c], count[c], dense[c] = _sparse_pairs(*args) if pairs.size else _sparse_single(*args)
    return sparse, first, last, count, dense


def _packed_bits(sl: np.ndarray, dl: np.ndarray) -> np.ndarray:
    """``dl | sl << 24`` per field: both sums of a chunk (under 2**22 each) in one integer."""
    return dl | (sl << 24)


@_pjit
def _dense_bodies(f: np.ndarray, s: int, pk: np.ndarray, dc: np.ndarray, scratch: np.ndarray, stride: int):
    """Per chunk, its dense codes into ``scratch[c·stride:]`` and (:func:`_dense_chunk`) ``(dense
    bits, sparse bits without gaps, nonzeros, nonzeros after a zero, fields above 2s)``."""
    n = f.shape[0]
    nch = (n + _CHUNK - 1) // _CHUNK
    out = np.zeros((5, nch), np.int64)
    for c in prange(nch):
        e0 = c * _CHUNK
        out[0, c], out[1, c], out[2, c], out[3, c], out[4, c] = _dense_chunk(f, e0, min(n, e0 + _CHUNK), s, pk, dc,
                                                                             scratch, c * stride)
    return out


def _sparse_floor(counts: np.ndarray) -> int:
    """A lower bound of the sparse layout's bits (without the flag) from :func:`_dense_bodies`: every
    gap takes at least 1 bit, and one after a zero (a gap of 2 or more) at least 3."""
    nnz = int(counts[2].sum())
    return omega_len(nnz + 1) + int(counts[1].sum()) + nnz + 2 * int(counts[3].sum())


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
def _place(body: np.ndarray, nb: int, gap: int, st: int, buf: np.ndarray) -> int:
    """The omega code of ``gap`` (none for 0) and the ``nb`` bits of ``body`` at bit ``st`` of ``buf``:
    the whole bytes (the first holds zeros before bit ``st``); returns the partial last byte,
    left-aligned (0 when none). The body is shifted into place a byte at a time with no carried state,
    a loop the compiler vectorizes."""
    o = st >> 3
    acc = 0
    nacc = st & 7
    if gap:
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
    """Chunk ``c``'s first gap (``gaps[c] > 0``; none for 0) and body (``nbits[c]`` bits from
    ``scratch[c·stride:]``) at bit ``starts[c]`` of ``buf`` (:func:`_place`), its partial last byte
    into ``tails[c]``. A chunk with neither writes nothing."""
    for c in prange(nbits.shape[0]):
        t = 0
        if gaps[c] or nbits[c]:
            t = _place(scratch[c * stride:(c + 1) * stride], nbits[c], gaps[c], starts[c], buf)
        tails[c] = t


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


def _placed_dense(scratch: np.ndarray, stride: int, dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The dense stream and its index from the chunks' dense codes in ``scratch`` (``dense[c]`` bits
    from ``scratch[c·stride:]``, :func:`_dense_bodies`), placed after the flag bit."""
    nch = dense.shape[0]
    starts = 1 + np.concatenate(([0], np.cumsum(dense)[:-1])).astype(np.int64) if nch else dense
    buf = np.empty((1 + int(dense.sum()) + 7) // 8, np.uint8)
    tails = np.zeros(nch, np.int64)
    _assemble(scratch, stride, dense, np.zeros(nch, np.int64), starts, buf, tails)
    _join(buf, 1, 0x80, starts, dense, tails)
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


def field_buffer(n: int):
    """This thread's buffer of ``n`` uint8 fields (a CPU tensor), kept between calls like the
    scratch area: the fields the quantizer hands to :func:`encode_fields` live only for one encode,
    and writing them into pages already mapped saves faulting 1 byte a value in each call. The
    tensor is overwritten by the next call on this thread: copy what must outlive it."""
    import torch

    buf = getattr(_LOCAL, "fields", None)
    if buf is None or buf.numel() < n:
        buf = _LOCAL.fields = torch.empty(n, dtype=torch.uint8)
    return buf[:n]


def encode_fields(f: np.ndarray, s: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """The stream (uint8) and its chunk index (int64) of the uint8 fields ``f`` (``c + s``).

    Either layout goes to a scratch area by chunks, then into place. For ``auto`` the exact lengths
    decide. With fields of up to 4 bits the pair writer counts the dense bits while it writes the
    sparse items (QSGD at 2 to 4 bits is usually shorter sparse). With wider ones the dense codes are
    written first, counting a lower bound of the sparse bits on the way (:func:`_sparse_floor`),
    which usually settles a dense win without writing the sparse items (QSGD at 8 bits). The other
    layout is written only when the one written first turns out the longer."""
    sc, sl, dc, dl = field_tables(s)
    pk = _packed_bits(sl, dl)
    n = f.shape[0]
    nch = -(-n // CHUNK)
    table, shift = item_code_table(s)
    pairs = pair_code_table(s) if shift <= _PAIR_SHIFT and layout != "dense" else _NO_PAIRS
    stride = 2 * CHUNK + 16   # ≤ 16 bits a value: a sparse item (1.5 for gaps, 14 for a sign and omega(|c| ≤ 127))
    scratch = _scratch(nch * stride)   # or a dense one (omega(|c| + 1) and a sign: at most 15)
    dense = None
    if layout == "dense" or (layout == "auto" and not pairs.size):
        counts = _dense_bodies(f, s, pk, dc, scratch, stride)
        _check_bad(int(counts[4].sum()), s)
        dense = counts[0]
        if layout == "dense" or _sparse_floor(counts) > dense.sum():
            return _placed_dense(scratch, stride, dense)
    elif n and int(f.max()) > 2 * s:
        _check_bad(int(_dense_bodies(f, s, pk, dc, scratch, stride)[4].sum()), s)
    nbits, first, last, count, tally = _chunk_bodies(f, s, sc, sl, dl, table, shift, pairs, scratch, stride)
    if layout == "auto" and pairs.size:
        dense = tally
    nnz = int(count.sum())
    # each chunk's first gap: from the last nonzero of the chunks before (1-based; 0 = no nonzero)
    has = first >= 0
    prev_last = np.maximum.accumulate(np.where(has, last, -1)) if nch else last
    before = np.concatenate(([-1], prev_last[:-1])) if nch else prev_last
    gaps = np.where(has, first - before, 0).astype(np.int64)
    gbits = np.array([omega_len(int(g)) if g else 0 for g in gaps], np.int64)
    lengths = gbits + nbits
    sparse_body = omega_len(nnz + 1) + int(lengths.sum())
    if dense is not None and sparse_body > int(dense.sum()):   # (the sparse items took the scratch)
        _dense_bodies(f, s, pk, dc, scratch, stride)
        return _placed_dense(scratch, stride, dense)
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
