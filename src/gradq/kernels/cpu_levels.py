"""Numba CPU kernels for ORQ-L / Linear-L: per-bucket levels, fused with rounding and packing.

They reproduce, bit for bit, :func:`gradq.kernels.reference.orq_levels` / ``linear_levels`` (the
plain-torch references, one bucket per row) followed by ``round_to_levels`` and ``pack_bits``:

* **Sorting.** Each bucket is sorted as the reference sorts it by :mod:`gradq.kernels.cpu_sort`
  (a bitonic network on 16-lane vectors, or a radix sort on the order-preserving integer keys).
* **ORQ rounds**, the reference's float64 operations in its order: segment ``j`` holds the sorted
  values ``g`` with ``lv_j ≤ g < lv_{j+1}`` (``searchsorted(right) − 1`` clamped, so the maximum
  joins the last one), ``lt = g − a``, ``rt = b − g``, running sums ``cl``, ``cr`` over the *whole*
  row (``cumsum``), ``left = cl_p − (cl_s − lt_s)``, ``right = cr_{e−1} − cr_p``; the split is the
  first ``g_p`` strictly inside ``(a, b)`` with ``left − right ≥ 0``, else
  ``minimum(maximum(0.5·a + 0.5·b, a), b)`` in float32 (ties to the first argument, as torch's
  scalar loop for ``L ≤ 17``). Every step is monotone in its inputs and the terms are ``≥ 0``, so
  the computed slope is non-decreasing along a segment: the split is located from an interpolated
  guess (the slope grows by about ``b − a`` per element) and confirmed, or found by bisection,
  with the exact test. A split's value starts the next round's segment at its first copy.
  Eight buckets advance together: lane ``k`` of 8-wide float64 vectors carries bucket ``k``'s sums,
  each lane in the reference's order.
* **Linear**: ``sorted[pos_i]`` at the reference's positions (computed by the caller in torch).
* **Rounding**: ``hi`` = number of ``lv[0 … L−2]`` below ``v``, ``lo = max(hi − 1, 0)``,
  ``p = (v − lv[lo]) / (lv[hi] − lv[lo])`` (0 for a zero gap), index ``hi if u < p else lo``, with
  ``u`` the uniform of counter ``ctr0 + i`` (the random-number IR of :mod:`gradq.kernels.cpu`),
  then :mod:`gradq.kernels.cpu`'s packing.

Parallelism: :func:`run` processes a range of independent tasks (chunks of whole buckets, a
multiple of 8 elements so that every chunk starts on a byte, or groups of buckets) with the GIL
released; :mod:`gradq.kernels.levels` spreads the ranges over threads. No result depends on the
thread count. (A ``prange`` kernel re-optimizes every callee inside its parallel region, which more
than doubled the first-call compile time of this module.)

Compiled code is cached in a directory keyed by the sources of every kernel module
(:mod:`gradq.kernels.numba_cache`), so an edit of a helper in :mod:`gradq.kernels.cpu` recompiles
this module too.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu_sort import _FLAG_NONFINITE, _VSORT_MAX, _W, _pad_size, _sort_row
from .numba_common import (_fill_uniform, _ir_counters, _ir_splat, _ir_transpose, _ir_uniform, _ir_vectors, _pack,
                           _round_any, _run_end, _run_keys, _uniform)

_HALF = np.float32(0.5)
_ZERO32 = np.float32(0.0)

_inline = njit(inline="always", cache=True, error_model="numpy")
_func = njit(cache=True, error_model="numpy")


# -- one bucket: levels from its sorted row ---------------------------------------------------------
@_inline
def _upper_bound(srt, lo, hi, v):
    """First position in ``[lo, hi)`` of the sorted ``srt`` whose value is above ``v`` (branch-free
    halving: the loop count depends on ``hi − lo`` only)."""
    n = hi - lo
    while n > 1:
        half = n >> 1
        lo = lo + half if not (srt[lo + half - 1] > v) else lo
        n -= half
    return lo + 1 if n == 1 and not (srt[lo] > v) else lo


@_inline
def _lower_bound(srt, lo, hi, v):
    """First position in ``[lo, hi)`` of the sorted ``srt`` whose value is not below ``v``."""
    n = hi - lo
    while n > 1:
        half = n >> 1
        lo = lo + half if srt[lo + half - 1] < v else lo
        n -= half
    return lo + 1 if n == 1 and srt[lo] < v else lo


@_inline
def _slope_ok(cl, cr, q, t, r):
    """The reference's test ``left − right ≥ 0`` at the flat index ``q``."""
    return (cl[q] - t) - (r - cr[q]) >= 0.0


@_inline
def _first_ok(cl, cr, stride, off, t, r, lo, hi):
    """First position in ``[lo, hi)`` whose slope is ``≥ 0``, given that the one at ``hi − 1`` is."""
    n = hi - lo
    while n > 1:
        half = n >> 1
        lo = lo + half if not _slope_ok(cl, cr, (lo + half - 1) * stride + off, t, r) else lo
        n -= half
    return lo


@_inline
def _segment_bounds(srt, s, e, a32, b32):
    """Interior run ``[lo, hi)`` (values strictly inside ``(a32, b32)``) of segment ``[s, e)``:
    values equal to ``a`` lead it, values equal to ``b`` (the maximum) can only trail it."""
    lo = s + 1 if not (srt[s] > a32) else s
    if lo < e and not (srt[lo] > a32):
        lo = _upper_bound(srt, lo, e, a32)
    hi = e - 1 if not (srt[e - 1] < b32) else e
    if hi > lo and not (srt[hi - 1] < b32):
        hi = _lower_bound(srt, lo, hi, b32)
    return lo, max(lo, hi)


@_inline
def _orq_split(srt, cl, cr, stride, off, s, e, a32, b32):
    """Position of the reference's split of segment ``[s, e)`` (interval ``[a32, b32]``) of the
    sorted row ``srt``, whose running sums are ``cl[p·stride + off]``, ``cr[…]``; ``−1`` when no
    value lies strictly inside. The slope is non-decreasing along the segment and grows by about
    ``b − a`` per element, so the first guess is interpolated; the exact test decides."""
    a = np.float64(a32)
    t = cl[s * stride + off] - (np.float64(srt[s]) - a)
    r = cr[(e - 1) * stride + off]
    lo, hi = _segment_bounds(srt, s, e, a32, b32)
    if lo >= hi:
        return -1
    # at hi - 1 the right sum is empty or zeros and the left one >= 0, so its slope is >= 0
    if not _slope_ok(cl, cr, (hi - 1) * stride + off, t, r):
        return -1
    q = lo * stride + off
    s_lo = (cl[q] - t) - (r - cr[q])
    if s_lo >= 0.0:
        return lo
    k = np.ceil(-s_lo / (np.float64(b32) - a))
    p = lo + 1
    if k > 1.0:
        p = hi - 1 if k >= np.float64(hi - 1 - lo) else lo + np.int64(k)
    if _slope_ok(cl, cr, p * stride + off, t, r):
        if p == lo + 1 or not _slope_ok(cl, cr, (p - 1) * stride + off, t, r):
            return p
        return _first_ok(cl, cr, stride, off, t, r, lo + 1, p)
    if _slope_ok(cl, cr, (p + 1) * stride + off, t, r):
        return p + 1
    return _first_ok(cl, cr, stride, off, t, r, p + 2, hi)


@_inline
def _midpoint(a32, b32):
    """``minimum(maximum(0.5·a + 0.5·b, a), b)`` in float32, ties going to the first argument."""
    t = _HALF * a32 + _HALF * b32
    t = a32 if t < a32 else t
    return b32 if b32 < t else t


@_inline
def _next_levels(srt, m, lv, cnt, cl, cr, stride, off, starts, nlv, nst):
    """One greedy round for one row (running sums already in ``cl``/``cr``; ``starts[j]`` = first
    position of segment ``j``): new levels into ``lv[:2·cnt − 1]``, their segment starts into
    ``starts`` (an old level keeps its start; a split's is the first copy of its value)."""
    for j in range(cnt - 1):
        a32 = lv[j]
        b32 = lv[j + 1]
        s = starts[j]
        e = starts[j + 1]
        z = -1
        if s < e:
            z = _orq_split(srt, cl, cr, stride, off, s, e, a32, b32)
        if z >= 0:
            c = srt[z]
            st = z
            while st > s and st > z - 4 and not (srt[st - 1] < c):
                st -= 1
            if st > s and not (srt[st - 1] < c):
                st = _lower_bound(srt, s, st, c)
        else:
            c = _midpoint(a32, b32)
            st = _lower_bound(srt, s, e, c)
        nlv[2 * j] = a32
        nlv[2 * j + 1] = c
        nst[2 * j] = s
        nst[2 * j + 1] = st
    nlv[2 * (cnt - 1)] = lv[cnt - 1]
    nst[2 * (cnt - 1)] = m
    for j in range(2 * cnt - 1):
        lv[j] = nlv[j]
        starts[j] = nst[j]


@_func
def _orq_levels(srt, m, rounds, lv, nlv, starts, nst, cl, cr):
    """ORQ levels of the sorted row ``srt[:m]`` into ``lv[:2**rounds + 1]`` (one row at a time)."""
    lv[0] = srt[0]
    lv[1] = srt[m - 1]
    starts[0] = 0
    starts[1] = m
    cnt = 2
    for _ in range(rounds):
        acc_l = 0.0
        acc_r = 0.0
        for j in range(cnt - 1):
            a = np.float64(lv[j])
            b = np.float64(lv[j + 1])
            for p in range(starts[j], starts[j + 1]):
                g = np.float64(srt[p])
                acc_l += g - a
                acc_r += b - g
                cl[p] = acc_l
                cr[p] = acc_r
        _next_levels(srt, m, lv, cnt, cl, cr, 1, 0, starts, nlv, nst)
        cnt = 2 * cnt - 1


# -- eight rows in lockstep: the running sums as 8-lane float64 vectors -------------------------------
_LANES8 = 8


def _chain_intrinsic(cnt):
    """For ``p < 8·nblk``: ``g`` = element ``p`` of the 8 rows of ``srt2`` (row stride ``stride``;
    lane ``k`` = row ``k``, read in 8×8 blocks and transposed), ``a, b`` = the lane's interval around
    ``g`` among ``cnt`` sorted levels ``LV[j]`` (the reference's ``searchsorted(right) − 1`` clamped
    to ``[0, cnt − 2]``), ``cl += g − a``, ``cr += b − g`` in float64, stored as ``CL[p]``, ``CR[p]``."""
    @intrinsic
    def _impl(typingctx, srt2, stride, nblk, lv, cl, cr):
        sig = types.void(srt2, stride, nblk, lv, cl, cr)

        def codegen(context, builder, signature, args):
            vd = ir.VectorType(ir.DoubleType(), _LANES8)
            vf8 = ir.VectorType(ir.FloatType(), _LANES8)
            i64 = ir.IntType(64)

            def data(k):
                return context.make_array(signature.args[k])(context, builder, args[k]).data

            sp = data(0)
            lp, clp, crp = (builder.bitcast(data(k), vd.as_pointer()) for k in (3, 4, 5))
            st = context.cast(builder, args[1], signature.args[1], types.intp)
            levels = [builder.load(builder.gep(lp, [ir.Constant(i64, j)]), align=8) for j in range(cnt)]
            zero = ir.Constant(vd, [0.0] * _LANES8)
            acc_l = cgutils.alloca_once_value(builder, zero)
            acc_r = cgutils.alloca_once_value(builder, zero)
            n = context.cast(builder, args[2], signature.args[2], types.intp)
            with cgutils.for_range(builder, n) as loop:
                p0 = builder.mul(loop.index, ir.Constant(i64, _LANES8))
                rows = []
                for k in range(_LANES8):
                    q = builder.gep(sp, [builder.add(builder.mul(st, ir.Constant(i64, k)), p0)])
                    rows.append(builder.load(builder.bitcast(q, vf8.as_pointer()), align=4))
                cols = _ir_transpose(builder, rows)
                nl = builder.load(acc_l)
                nr = builder.load(acc_r)
                for i in range(_LANES8):
                    gv = builder.fpext(cols[i], vd)
                    a, b = levels[0], levels[1]
                    for j in range(1, cnt - 1):
                        le = builder.fcmp_ordered("<=", levels[j], gv)
                        a = builder.select(le, levels[j], a)
                        b = builder.select(le, levels[j + 1], b)
                    nl = builder.fadd(nl, builder.fsub(gv, a))
                    nr = builder.fadd(nr, builder.fsub(b, gv))
                    pi = builder.add(p0, ir.Constant(i64, i))
                    builder.store(nl, builder.gep(clp, [pi]), align=8)
                    builder.store(nr, builder.gep(crp, [pi]), align=8)
                builder.store(nl, acc_l)
                builder.store(nr, acc_r)
            return context.get_dummy_value()

        return sig, codegen

    return _impl


_chain2, _chain3, _chain5, _chain9 = (_chain_intrinsic(c) for c in (2, 3, 5, 9))


@_inline
def _chain(cnt, srt2, stride, nblk, lv, cl, cr):
    if cnt == 2:
        _chain2(srt2, stride, nblk, lv, cl, cr)
    elif cnt == 3:
        _chain3(srt2, stride, nblk, lv, cl, cr)
    elif cnt == 5:
        _chain5(srt2, stride, nblk, lv, cl, cr)
    else:
        _chain9(srt2, stride, nblk, lv, cl, cr)


@_inline
def _lane_splits(srt2, nk, cnt, lvw, st2, CL, CR, ZP, TT, RR, LO, HI):
    """The split position of every (lane, segment) pair of a round into ``ZP`` (``−1``: none), each
    phase over all pairs at once so that their independent memory reads overlap: bounds and the
    interpolated guess, then the exact test at the guess, then (rarely) a bisection."""
    npair = nk * (cnt - 1)
    for i in range(npair):
        k = i % nk
        j = i // nk
        row = srt2[k]
        s = st2[k, j]
        e = st2[k, j + 1]
        ZP[i] = -1
        HI[i] = -1
        if s >= e:
            continue
        a32 = lvw[k, j]
        b32 = lvw[k, j + 1]
        a = np.float64(a32)
        t = CL[s * _LANES8 + k] - (np.float64(row[s]) - a)
        r = CR[(e - 1) * _LANES8 + k]
        lo, hi = _segment_bounds(row, s, e, a32, b32)
        TT[i] = t
        RR[i] = r
        LO[i] = lo
        if lo >= hi:
            continue
        HI[i] = hi
        q = lo * _LANES8 + k
        s_lo = (CL[q] - t) - (r - CR[q])
        g = np.ceil(-s_lo / (np.float64(b32) - a))
        p = lo
        if s_lo < 0.0:
            p = hi - 1 if not (g < np.float64(hi - 1 - lo)) else lo + max(np.int64(g), 1)
        ZP[i] = p
    for i in range(npair):
        p = ZP[i]
        if p < 0:
            continue
        k = i % nk
        lo = LO[i]
        t = TT[i]
        r = RR[i]
        ok_p = _slope_ok(CL, CR, p * _LANES8 + k, t, r)
        ok_prev = p > lo and _slope_ok(CL, CR, (p - 1) * _LANES8 + k, t, r)
        if ok_p and not ok_prev:
            continue
        if ok_p:
            ZP[i] = _first_ok(CL, CR, _LANES8, k, t, r, lo, p)
        else:
            ZP[i] = _first_ok(CL, CR, _LANES8, k, t, r, p + 1, HI[i])


@_func
def _orq_group(srt2, ms, nk, rounds, lvw, CL, CR, LVD, nlv, st2, nst, ZP, TT, RR, LO, HI):
    """ORQ levels of the sorted rows ``srt2[k, :ms[k]]``, ``k < nk ≤ 8``, into ``lvw[k]``: the
    running sums of all rows advance together (lane ``k`` = row ``k``), each lane in the reference's
    order. Rows are padded in place to a multiple of 8 with their maximum (positions past a row's
    end never feed back into it); unused lanes copy row 0."""
    mmax = 0
    for k in range(nk):
        mmax = max(mmax, ms[k])
    nblk = (mmax + _LANES8 - 1) // _LANES8
    top = nblk * _LANES8
    for k in range(_LANES8):
        if k < nk:
            mk = ms[k]
            row = srt2[k]
            for p in range(mk, top):
                row[p] = row[mk - 1]
        else:
            srt2[k, :top] = srt2[0, :top]
        kk = k if k < nk else 0
        lvw[k, 0] = srt2[kk, 0]
        lvw[k, 1] = srt2[kk, ms[kk] - 1]
        st2[k, 0] = 0
        st2[k, 1] = ms[kk]
    cnt = 2
    for _ in range(rounds):
        for j in range(cnt):
            for k in range(_LANES8):
                LVD[j * _LANES8 + k] = np.float64(lvw[k, j])
        _chain(cnt, srt2, srt2.shape[1], nblk, LVD, CL, CR)
        _lane_splits(srt2, nk, cnt, lvw, st2, CL, CR, ZP, TT, RR, LO, HI)
        for k in range(nk):
            row = srt2[k]
            for j in range(cnt - 1):
                a32 = lvw[k, j]
                s = st2[k, j]
                z = ZP[j * nk + k]
                if z >= 0:
                    c = row[z]
                    st = z
                    while st > s and st > z - 4 and not (row[st - 1] < c):
                        st -= 1
                    if st > s and not (row[st - 1] < c):
                        st = _lower_bound(row, s, st, c)
                else:
                    c = _midpoint(a32, lvw[k, j + 1])
                    st = _lower_bound(row, s, st2[k, j + 1], c)
                nlv[2 * j] = a32
                nlv[2 * j + 1] = c
                nst[2 * j] = s
                nst[2 * j + 1] = st
            nlv[2 * (cnt - 1)] = lvw[k, cnt - 1]
            nst[2 * (cnt - 1)] = ms[k]
            for j in range(2 * cnt - 1):
                lvw[k, j] = nlv[j]
                st2[k, j] = nst[j]
        cnt = 2 * cnt - 1


# -- buckets in groups of eight: sort, levels -------------------------------------------------------
@_inline
def _lane_arrays(d):
    """Two ``8·d`` float64 arrays (``CL``, ``CR``) cut from one buffer, 64-byte aligned and 2 KiB
    apart modulo 4 KiB, so stores to both in one loop do not stall on 4K-aliased addresses."""
    size = _LANES8 * (d + _LANES8)
    page = 512                                  # float64 elements per 4 KiB
    step = ((size + page - 1) // page) * page
    w = np.empty(2 * step + 2 * page, np.float64)
    a0 = (-(w.ctypes.data // 8)) % 8            # first 64-byte aligned element
    return w[a0:a0 + size], w[a0 + step + 256:a0 + step + 256 + size]


@_inline
def _workspace(d, L):
    npad = _pad_size(d) if d <= _VSORT_MAX else d
    CL, CR = _lane_arrays(d)
    width = ((npad + _LANES8 - 1) // _LANES8) * _LANES8
    npair = _LANES8 * L
    return (np.empty(npad, np.float32), np.empty((_LANES8, width), np.float32), np.empty(_LANES8, np.int64),
            CL, CR, np.empty(_LANES8 * L, np.float64), np.empty((_LANES8, L), np.float32),
            np.empty(L, np.float32), np.empty((_LANES8, L), np.int64), np.empty(L, np.int64),
            (np.empty(npair, np.int64), np.empty(npair, np.float64), np.empty(npair, np.float64),
             np.empty(npair, np.int64), np.empty(npair, np.int64)))


@_func
def _group_levels(x, xi, g0, g1, bucket, mode, L, rounds, pos_full, pos_tail, levels,
                  buf, srt2, ms, CL, CR, LVD, lvw, nlv, st2, nst, sp):
    """Levels of buckets ``g0 … g1 − 1`` (at most 8) into ``levels``; returns the OR of the flags."""
    n = x.size
    nk = g1 - g0
    flags = 0
    for k in range(nk):
        bs = (g0 + k) * bucket
        be = min(n, bs + bucket)
        flags |= _sort_row(x[bs:be], xi[bs:be], buf, srt2[k])
        if flags & _FLAG_NONFINITE:
            return flags
        ms[k] = be - bs
    if mode == 1:
        for k in range(nk):
            pos = pos_full if ms[k] == bucket else pos_tail
            for i in range(L):
                levels[(g0 + k) * L + i] = srt2[k, pos[i]]
        return flags
    _orq_group(srt2, ms, nk, rounds, lvw, CL, CR, LVD, nlv, st2, nst, sp[0], sp[1], sp[2], sp[3], sp[4])
    for k in range(nk):
        for i in range(L):
            levels[(g0 + k) * L + i] = lvw[k, i]
    return flags


@_func
def _levels_group(x, xi, g, mode, L, rounds, pos_full, pos_tail, bucket, out):
    nb = (x.size + bucket - 1) // bucket
    buf, srt2, ms, CL, CR, LVD, lvw, nlv, st2, nst, sp = _workspace(bucket, L)
    return _group_levels(x, xi, g * _LANES8, min(nb, (g + 1) * _LANES8), bucket, mode, L, rounds, pos_full,
                         pos_tail, out, buf, srt2, ms, CL, CR, LVD, lvw, nlv, st2, nst, sp)


@_func
def _levels_one(x, xi, b, mode, L, rounds, pos_full, pos_tail, bucket, out):
    """Levels of bucket ``b`` alone (long buckets: the running sums one row at a time)."""
    n = x.size
    bs = b * bucket
    be = min(n, bs + bucket)
    m = be - bs
    npad = _pad_size(m) if m <= _VSORT_MAX else m
    srt = np.empty(npad, np.float32)
    flags = _sort_row(x[bs:be], xi[bs:be], np.empty(npad, np.float32), srt)
    if flags & _FLAG_NONFINITE:
        return flags
    lv = out[b * L:(b + 1) * L]
    if mode == 1:
        pos = pos_full if m == bucket else pos_tail
        for i in range(L):
            lv[i] = srt[pos[i]]
    else:
        _orq_levels(srt, m, rounds, lv, np.empty(L, np.float32), np.empty(L, np.int64), np.empty(L, np.int64),
                    np.empty(m, np.float64), np.empty(m, np.float64))
    return flags


# -- rounding onto sorted levels (16 lanes, random numbers computed in the loop) --------------------
def _round_intrinsic(L):
    """Level indices of ``16·nvec`` values onto the sorted ``lv[:L]``, as ``round_to_levels``:
    ``hi`` = number of ``lv[0 … L−2]`` below ``v`` (torch.searchsorted on a sorted row, clamped),
    ``lo = max(hi − 1, 0)``, ``p = (v − lv[lo]) / (lv[hi] − lv[lo])`` (0 for a zero gap), index
    ``hi if u < p else lo`` with ``u`` the uniform of the element's counter."""
    @intrinsic
    def _impl(typingctx, xs, ts, nvec, lv, base, k2h):
        sig = types.void(xs, ts, nvec, lv, types.uint32, types.uint32)

        def codegen(context, builder, signature, args):
            xptr = context.make_array(signature.args[0])(context, builder, args[0]).data
            tptr = context.make_array(signature.args[1])(context, builder, args[1]).data
            lptr = context.make_array(signature.args[3])(context, builder, args[3]).data
            count, b, k = args[2], args[4], args[5]
            i32, vi, vf, const, inv24 = _ir_vectors()
            vb = ir.VectorType(ir.IntType(8), _W)
            levels = [_ir_splat(builder, vf, builder.load(builder.gep(lptr, [ir.Constant(ir.IntType(64), j)])))
                      for j in range(L)]
            zero = ir.Constant(vf, [0.0] * _W)
            one = ir.Constant(vf, [1.0] * _W)
            izero = const(0)
            state = _ir_counters(builder, vi, b)
            kv = _ir_splat(builder, vi, k)
            with cgutils.for_range(builder, count) as loop:
                off = builder.mul(loop.index, ir.Constant(loop.index.type, _W))
                v = builder.load(builder.bitcast(builder.gep(xptr, [off]), vf.as_pointer()), align=4)
                h = builder.load(state)
                u = _ir_uniform(builder, h, kv, const, vf, inv24)
                # levels are sorted: the last j with lv[j] < v gives hi = j + 1, lv[lo] = lv[j] and
                # lv[hi] = lv[j + 1]; none gives hi = 0 and lv[0] for both
                hi, l_lo, l_hi = izero, levels[0], levels[0]
                for j in range(L - 1):
                    below = builder.fcmp_ordered("<", levels[j], v)
                    hi = builder.select(below, const(j + 1), hi)
                    l_lo = builder.select(below, levels[j], l_lo)
                    l_hi = builder.select(below, levels[j + 1], l_hi)
                gap = builder.fsub(l_hi, l_lo)
                pos = builder.fcmp_ordered(">", gap, zero)
                prob = builder.select(pos, builder.fdiv(builder.fsub(v, l_lo), builder.select(pos, gap, one)), zero)
                lo = builder.select(builder.icmp_signed(">", hi, izero), builder.sub(hi, const(1)), izero)
                code = builder.select(builder.fcmp_ordered("<", u, prob), hi, lo)
                builder.store(builder.trunc(code, vb), builder.bitcast(builder.gep(tptr, [off]), vb.as_pointer()),
                              align=1)
                builder.store(builder.add(h, const(_W * 0x9E3779B9)), state)
            return context.get_dummy_value()

        return sig, codegen

    return _impl


_round3, _round5, _round9, _round17 = (_round_intrinsic(L) for L in (3, 5, 9, 17))


@_inline
def _round_tail(xr, tr, lv, L, i0, base, k2h):
    """The same as the vector loop for elements ``i0 …`` of the run, one at a time."""
    for i in range(i0, xr.size):
        v = xr[i]
        hi = 0
        for j in range(L - 1):
            hi += lv[j] < v
        lo = max(hi - 1, 0)
        l_lo = lv[lo]
        gap = lv[hi] - l_lo
        prob = (v - l_lo) / gap if gap > _ZERO32 else _ZERO32
        tr[i] = hi if _uniform(base, i, k2h) < prob else lo


@_inline
def _round_fast(xr, tr, lv, L, base, k2h):
    """Level indices of the run ``xr`` (counters from ``base``) onto sorted ``lv``, L in 3/5/9/17."""
    full = xr.size // _W
    if L == 3:
        _round3(xr, tr, full, lv, base, k2h)
    elif L == 5:
        _round5(xr, tr, full, lv, base, k2h)
    elif L == 9:
        _round9(xr, tr, full, lv, base, k2h)
    else:
        _round17(xr, tr, full, lv, base, k2h)
    _round_tail(xr, tr, lv, L, full * _W, base, k2h)


@_func
def _encode_chunk(x, xi, e0, e1, mode, L, rounds, pos_full, pos_tail, bucket, width, k1, k2, ctr0, levels, out):
    """Levels of the buckets of ``x[e0:e1]`` (whole buckets), eight at a time, then the rounding of
    their elements and the packing of the chunk's indices. Returns the OR of the bucket flags."""
    n = x.size
    nb = (n + bucket - 1) // bucket
    tmp = np.empty(e1 - e0, np.uint8)
    ubuf = np.empty(1024, np.float32)
    buf, srt2, ms, CL, CR, LVD, lvw, nlv, st2, nst, sp = _workspace(bucket, L)
    fl = 0
    b1 = min(nb, (e1 + bucket - 1) // bucket)
    for g0 in range(e0 // bucket, b1, _LANES8):
        g1 = min(b1, g0 + _LANES8)
        fl |= _group_levels(x, xi, g0, g1, bucket, mode, L, rounds, pos_full, pos_tail, levels,
                            buf, srt2, ms, CL, CR, LVD, lvw, nlv, st2, nst, sp)
        if fl & _FLAG_NONFINITE:
            return fl
        for b in range(g0, g1):
            lv = levels[b * L:(b + 1) * L]
            ok = True
            for j in range(L - 1):
                ok = ok and lv[j] <= lv[j + 1]
            p = b * bucket
            q = min(n, p + bucket)
            fast = ok and (L == 3 or L == 5 or L == 9 or L == 17)
            while p < q:
                e = _run_end(ctr0 + p, p, q)
                if not fast:
                    e = min(e, p + ubuf.size)
                base, k2h = _run_keys(ctr0 + p, k1, k2)
                if fast:
                    _round_fast(x[p:e], tmp[p - e0:e - e0], lv, L, base, k2h)
                else:
                    u = ubuf[:e - p]
                    _fill_uniform(u, base, k2h)
                    _round_any(x[p:e], tmp[p - e0:e - e0], u, lv, L)
                p = e
    _pack(tmp, width, out[(e0 * width) // 8:])
    return fl


@njit(cache=True, error_model="numpy", nogil=True)
def run(task, t0, t1, x, xi, mode, L, rounds, pos_full, pos_tail, bucket, width, k1, k2, ctr0, chunk, levels, out):
    """Tasks ``t0 … t1 − 1`` (the caller spreads task ranges over threads; the GIL is released).
    ``task``:

    * 0 — encode: per chunk of ``chunk`` elements (whole buckets, ``bucket ≤ 8192``) the levels of
      its buckets (into ``levels``), the stochastic rounding of its elements onto them
      (``u < (v − l_lo)/(l_hi − l_lo)`` picks the upper level) and the packed ``width``-bit indices
      (into ``out``);
    * 1 — levels of every bucket, eight buckets per task (``bucket ≤ 8192``);
    * 2 — levels of every bucket, one per task (long buckets).

    Tasks touch disjoint outputs, so the result does not depend on how ranges are spread. Returns
    the OR of the bucket flags (4: a non-finite value was seen; the outputs are then incomplete)."""
    n = x.size
    acc = 0
    for t in range(t0, t1):
        if task == 0:
            acc |= _encode_chunk(x, xi, t * chunk, min(n, (t + 1) * chunk), mode, L, rounds, pos_full,
                                 pos_tail, bucket, width, k1, k2, ctr0, levels, out)
        elif task == 1:
            acc |= _levels_group(x, xi, t, mode, L, rounds, pos_full, pos_tail, bucket, levels)
        else:
            acc |= _levels_one(x, xi, t, mode, L, rounds, pos_full, pos_tail, bucket, levels)
    return acc
