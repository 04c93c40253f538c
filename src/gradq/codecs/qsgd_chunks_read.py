"""Reading the chunk-parallel Elias streams of :mod:`gradq.codecs.qsgd_chunks` with their chunk index.

Each thread reads two chunks in lockstep, each from its index row: decoding an item waits on the item
before it (its bit position comes from the previous item's length), so two independent chains keep a
core busy while each waits (:func:`_sparse_pair`). Every row is checked: each chunk must end exactly
where the next begins, with exactly the items and the last position that the next row says, and every
item must fall inside its chunk, so a stream and an index that decode are exactly what the writer makes
(otherwise :class:`gradq.PayloadError`). Given float32 ``values``, each chunk is dequantized from a
chunk-sized buffer, so no field array of the input's size exists.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .elias import ERR_INDEX, ERR_NNZ, ERR_TRUNCATED, OK, check_tail, raise_for_error
from .qsgd_chunks import _COLS, CHUNK, index_len
from .qsgd_fields import (_CHUNK, _IWIN, WIDE, WIDE_FROM, _jit, _omega, _pjit, item_tables, prange, read_dense,
                          read_sparse, wide_dense_table)

__all__ = ["decode_fields"]


_NO_TABLE = np.zeros(0, np.int32)


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


@_jit
def _upeek(pad: np.ndarray, p: int, win: int) -> np.uint64:
    """The ``win ≤ 17`` bits at bit ``p`` (:func:`gradq.codecs.qsgd_fields._peek`'s window, of any
    width), with unsigned indices (``p ≥ 0``: numba then adds no wrap-around for negative ones)."""
    i = np.uint64(p) >> np.uint64(3)
    one = np.uint64(1)
    w = (np.uint64(pad[i]) << np.uint64(16)) | (np.uint64(pad[i + one]) << np.uint64(8)) | np.uint64(pad[i + one + one])
    return (w >> np.uint64(24 - win - (p & 7))) & np.uint64((1 << win) - 1)


@_jit
def _sparse_pair(buf: np.ndarray, pad: np.ndarray, s: int, tab: np.ndarray,
                 pa: int, ea: int, qa: int, na: int, ha: int, oa: np.ndarray,
                 pb: int, eb: int, qb: int, nb: int, hb: int, ob: np.ndarray):
    """Two chunks' sparse items read in lockstep (bit ``p``, end bit ``e``, last position ``q``, items
    ``n``, positions up to ``h``, output ``o``; after each chunk's first item): decoding one item waits
    on the item before, so two independent chains keep the core busy while each waits. Returns
    ``(err, p, q)`` of each; an item the table cannot take goes through :func:`read_sparse`."""
    ka = 0
    kb = 0
    low = -(1 << 62)   # (the first items were read already: no lower bound left to check)
    while ka < na and kb < nb:
        xa = np.int64(tab[_upeek(pad, pa, _IWIN)])
        xb = np.int64(tab[_upeek(pad, pb, _IWIN)])
        la = xa & 31
        lb = xb & 31
        ga = xa >> 13
        gb = xb >> 13
        if la and pa + la <= ea and ga <= ha - qa:
            qa += ga
            oa[np.uint64(qa - 1)] = (xa >> 5) & 0xFF
            pa += la
        else:
            err, pa, qa = read_sparse(buf, pad, pa, ea, qa, 1, low, ha, s, tab, oa)
            if err != OK:
                return err, pa, qa, OK, pb, qb
        ka += 1
        if lb and pb + lb <= eb and gb <= hb - qb:
            qb += gb
            ob[np.uint64(qb - 1)] = (xb >> 5) & 0xFF
            pb += lb
        else:
            err, pb, qb = read_sparse(buf, pad, pb, eb, qb, 1, low, hb, s, tab, ob)
            if err != OK:   # (the first chunk is read to its end: its own error is the one to report)
                erra, pa, qa = read_sparse(buf, pad, pa, ea, qa, na - ka, low, ha, s, tab, oa)
                return erra, pa, qa, err, pb, qb
        kb += 1
    erra, pa, qa = read_sparse(buf, pad, pa, ea, qa, na - ka, low, ha, s, tab, oa)
    errb, pb, qb = read_sparse(buf, pad, pb, eb, qb, nb - kb, low, hb, s, tab, ob)
    return erra, pa, qa, errb, pb, qb


@_jit
def _dense_pair(buf: np.ndarray, pad: np.ndarray, s: int, tab: np.ndarray, wide: np.ndarray, pa: int, ea: int,
                ha: int, oa: np.ndarray, pb: int, eb: int, hb: int, ob: np.ndarray):
    """:func:`_sparse_pair` for the dense layout (values ``0 … h − 1`` of each output). The look-ups
    use ``wide`` (a :data:`gradq.codecs.qsgd_fields.WIDE`-bit window) when it is not empty, else
    ``tab``; an item neither takes goes through :func:`read_dense` (which uses ``tab``)."""
    win = WIDE if wide.size else _IWIN
    fast = wide if wide.size else tab
    ia = 0
    ib = 0
    while ia < ha and ib < hb:
        xa = np.int64(fast[_upeek(pad, pa, win)])
        xb = np.int64(fast[_upeek(pad, pb, win)])
        la = xa & 31
        lb = xb & 31
        if la and pa + la <= ea:
            oa[ia] = xa >> 5
            pa += la
        else:
            err, pa = read_dense(buf, pad, pa, ea, ia, ia + 1, s, tab, oa)
            if err != OK:
                return err, pa, OK, pb
        ia += 1
        if lb and pb + lb <= eb:
            ob[ib] = xb >> 5
            pb += lb
        else:
            err, pb = read_dense(buf, pad, pb, eb, ib, ib + 1, s, tab, ob)
            if err != OK:
                erra, pa = read_dense(buf, pad, pa, ea, ia, ha, s, tab, oa)
                return erra, pa, err, pb
        ib += 1
    erra, pa = read_dense(buf, pad, pa, ea, ia, ha, s, tab, oa)
    errb, pb = read_dense(buf, pad, pb, eb, ib, hb, s, tab, ob)
    return erra, pa, errb, pb


@_jit
def _dequantize(f: np.ndarray, lo: int, s: int, scales: np.ndarray, bucket: int, out: np.ndarray) -> None:
    """``out[lo + i] = float32(f[i] − s)·(scale_b / s)``: gradq.kernels' uniform decode, bit for bit.
    (Each bucket's run is a pair of slices, so that the loop carries no offset and vectorizes.)"""
    sf = np.float32(s)
    hi = lo + f.shape[0]
    p = lo
    while p < hi:
        b = p // bucket
        q = min((b + 1) * bucket, hi)
        mult = scales[b] / sf
        src = f[p - lo:q - lo]
        dst = out[p:q]
        for j in range(src.shape[0]):
            dst[j] = np.float32(np.int32(src[j]) - s) * mult
        p = q


@_jit
def _row(idx: np.ndarray, c: int, nch: int, n: int, start: int, end: int, nnz: int):
    """Chunk ``c``'s ``(lo, hi, first bit, end bit, last position before, items, last position after)``
    (positions 1-based, relative to ``lo``)."""
    lo = c * _CHUNK
    hi = min(n, lo + _CHUNK)
    p0 = start if c == 0 else idx[_COLS * (c - 1)]
    k0 = 0 if c == 0 else idx[_COLS * (c - 1) + 1]
    l0 = 0 if c == 0 else idx[_COLS * (c - 1) + 2]
    last = c == nch - 1
    p1 = end if last else idx[_COLS * c]
    k1 = nnz if last else idx[_COLS * c + 1]
    l1 = 0 if last else idx[_COLS * c + 2]
    return lo, hi, p0, p1, l0 - lo, k1 - k0, l1 - lo


@_jit
def _read_pair(buf: np.ndarray, pad: np.ndarray, n: int, s: int, tab: np.ndarray, wide: np.ndarray, idx: np.ndarray,
               sparse: bool,
               start: int, nnz: int, out: np.ndarray, values: np.ndarray, scales: np.ndarray, bucket: int, nch: int,
               ca: int, cb: int):
    """Chunks ``ca`` and ``cb`` (``cb == ca`` for an odd last chunk, read once) from their index rows:
    ``(error code, bit position)`` of each. (A function of its own: numba compiles a ``prange`` body
    several times slower than a plain function.)"""
    end = buf.shape[0] * 8
    loa, hia, pa, ea, qa, na, ra = _row(idx, ca, nch, n, start, end, nnz)
    lob, hib, pb, eb, qb, nb, rb = _row(idx, cb, nch, n, start, end, nnz)
    da = np.empty(hia - loa, np.uint8) if values.shape[0] else out[loa:hia]
    db = np.empty(hib - lob, np.uint8) if values.shape[0] else out[lob:hib]
    if sparse:
        da[:] = s
        db[:] = s
        # each chunk's first item on its own (it alone may land before the chunk), then both in step
        erra, pa, qa = read_sparse(buf, pad, pa, ea, qa, min(na, 1), 0, hia - loa, s, tab, da)
        errb, pb, qb = read_sparse(buf, pad, pb, eb, qb, min(nb, 1), 0, hib - lob, s, tab, db)
        if erra == OK and errb == OK and cb != ca:
            erra, pa, qa, errb, pb, qb = _sparse_pair(buf, pad, s, tab, pa, ea, qa, na - min(na, 1), hia - loa,
                                                      da, pb, eb, qb, nb - min(nb, 1), hib - lob, db)
        else:
            if erra == OK:
                erra, pa, qa = read_sparse(buf, pad, pa, ea, qa, na - min(na, 1), 0, hia - loa, s, tab, da)
            if errb == OK and cb != ca:
                errb, pb, qb = read_sparse(buf, pad, pb, eb, qb, nb - min(nb, 1), 0, hib - lob, s, tab, db)
        oka = erra == OK and (ca == nch - 1 or (pa == ea and qa == ra))
        okb = errb == OK and (cb == nch - 1 or (pb == eb and qb == rb))
    else:
        if cb != ca:
            erra, pa, errb, pb = _dense_pair(buf, pad, s, tab, wide, pa, ea, hia - loa, da, pb, eb, hib - lob, db)
        else:
            erra, pa = read_dense(buf, pad, pa, ea, 0, hia - loa, s, tab, da)
            errb, pb = erra, pa
        oka = erra == OK and (ca == nch - 1 or pa == ea)
        okb = errb == OK and (cb == nch - 1 or pb == eb)
    erra = ERR_INDEX if erra == OK and not oka else erra
    errb = ERR_INDEX if errb == OK and not okb else errb
    if erra == OK and ca == nch - 1:
        erra = check_tail(buf, pa)
    if errb == OK and cb == nch - 1:
        errb = check_tail(buf, pb)
    if erra == OK and values.shape[0]:
        _dequantize(da, loa, s, scales, bucket, values)
    if errb == OK and values.shape[0] and cb != ca:
        _dequantize(db, lob, s, scales, bucket, values)
    if cb == ca:
        return erra, pa, erra, pa
    return erra, pa, errb, pb


@_pjit
def _read_chunks(buf: np.ndarray, pad: np.ndarray, n: int, s: int, tab: np.ndarray, wide: np.ndarray, idx: np.ndarray,
                 sparse: bool,
                 start: int, nnz: int, out: np.ndarray, values: np.ndarray, scales: np.ndarray, bucket: int,
                 errs: np.ndarray, where: np.ndarray) -> None:
    """The chunks from their index rows, two per thread step (:func:`_read_pair`), into ``out[lo:hi]``
    (fields) or, when ``values`` is not empty, through chunk-sized buffers (in cache) dequantized into
    ``values[lo:hi]``. Each chunk's error code and bit position go to ``errs`` and ``where``."""
    nch = errs.shape[0]
    for j in prange((nch + 1) // 2):
        ca = 2 * j
        cb = min(ca + 1, nch - 1)
        erra, pa, errb, pb = _read_pair(buf, pad, n, s, tab, wide, idx, sparse, start, nnz, out, values, scales, bucket,
                                        nch, ca, cb)
        errs[ca] = erra
        where[ca] = pa
        errs[cb] = errb
        where[cb] = pb


def decode_fields(buf: np.ndarray, n: int, s: int, idx: np.ndarray, out: Optional[np.ndarray], *,
                  values: Optional[np.ndarray] = None, scales: Optional[np.ndarray] = None,
                  bucket: Optional[int] = None) -> None:
    """Decode the stream ``buf`` with its chunk index ``idx`` into ``out[:n]`` (uint8 fields ``c + s``),
    or, given ``values`` (float32), straight into the dequantized values under the per-bucket
    ``scales`` (float32; ``bucket=None``: one bucket). Raises :class:`gradq.PayloadError` on any
    malformed stream or index."""
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
    if values is None:
        values, scales, bucket = np.empty(0, np.float32), np.empty(0, np.float32), 1
    else:
        out = np.empty(0, np.uint8)
        bucket = n if bucket is None else int(bucket)
    # dense items of wide fields mostly pass 12 bits: a 16-bit window for them (its table lives in L2)
    wide = wide_dense_table(s) if not sparse and s > WIDE_FROM else _NO_TABLE
    _read_chunks(buf, pad, n, s, sparse_tab if sparse else dense_tab, wide, idx, sparse, start, nnz, out, values,
                 scales, bucket, errs, where)
    bad = np.flatnonzero(errs)
    if bad.size:
        c = int(bad[0])
        raise_for_error(int(errs[c]), int(where[c]), what)
