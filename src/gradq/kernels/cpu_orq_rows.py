"""Numba CPU kernel for ORQ's greedy rounds on one sorted bucket (a row): the levels of the buckets
that :mod:`gradq.kernels.cpu_orq_lanes` does not take (a length that is not a power of two from 16
to 512, a short last bucket, a bucket with zeros of both signs), inlined into
:mod:`gradq.kernels.cpu_levels`. The rules, as the reference's ``orq_levels``:

* segment ``j`` holds the sorted values ``g`` with ``lv_j ≤ g < lv_{j+1}``
  (``searchsorted(right) − 1`` clamped, so the maximum joins the last one);
* its split is the value of rank ``max(⌈R/(B − A)⌉, 1)`` in the segment, ``R = Σ (B − G)``, with
  every value in fixed point (``G = ⌊g·2^sh⌋``, int64, exact and in any order), moved up past the
  values equal to ``a``;
* where that reaches the values equal to ``b``, or the segment is empty, the split is
  ``minimum(maximum(0.5·a + 0.5·b, a), b)`` in float32 (ties to the first argument, as torch's
  scalar loop for ``L ≤ 17``);
* a split's value starts the next round's segment at its first copy.

Compiled code is cached in the kernels' keyed directory (:mod:`gradq.kernels.numba_cache`).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu_sort import _W
from .numba_common import _ir_splat

_HALF = np.float32(0.5)

_inline = njit(inline="always", cache=True, error_model="numpy")


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
def _orq_scale(srt, m):
    """``2^sh`` (float64) for the sorted row ``srt[:m]``, ``sh`` as :func:`reference.orq_shift`:
    ``61 − E − ⌈log2 m⌉`` with ``E = max(e, 1) − 126`` for the float32 exponent field ``e`` of the
    largest magnitude (``frexp``'s exponent for a normal value; ``−125`` for a denormal or zero)."""
    top = max(abs(np.float64(srt[0])), abs(np.float64(srt[m - 1])))
    e = -125
    if top > 0.0:
        e = max(math.frexp(top)[1], -125)
    lg = 0
    while (1 << lg) < m:
        lg += 1
    return math.ldexp(1.0, 61 - e - lg)


@_inline
def _fixed(v, p2):
    """``⌊v·2^sh⌋`` as int64 (``p2 = 2^sh``; exact, as :func:`reference.orq_fixed`)."""
    return np.int64(np.floor(np.float64(v) * p2))


@intrinsic
def _fixed_vec(typingctx, srt, fix, nvec, p2):
    """:func:`_fixed` of ``srt[:16·nvec]`` into ``fix``, returning their sum: the same float64 product,
    floor and conversion, on explicit 16-lane vectors (numba's vectorizer stops at four doubles)."""
    sig = types.int64(srt, fix, nvec, types.float64)

    def codegen(context, builder, signature, args):
        sptr = context.make_array(signature.args[0])(context, builder, args[0]).data
        fptr = context.make_array(signature.args[1])(context, builder, args[1]).data
        vf = ir.VectorType(ir.FloatType(), _W)
        vd, vq = ir.VectorType(ir.DoubleType(), _W), ir.VectorType(ir.IntType(64), _W)
        floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vd, [vd]), "llvm.floor.v16f64")
        scale = _ir_splat(builder, vd, args[3])
        acc = cgutils.alloca_once_value(builder, ir.Constant(vq, [0] * _W))
        with cgutils.for_range(builder, args[2]) as loop:
            off = builder.mul(loop.index, ir.Constant(loop.index.type, _W))
            v = builder.load(builder.bitcast(builder.gep(sptr, [off]), vf.as_pointer()), align=4)
            g = builder.fptosi(builder.call(floor, [builder.fmul(builder.fpext(v, vd), scale)]), vq)
            builder.store(g, builder.bitcast(builder.gep(fptr, [off]), vq.as_pointer()), align=8)
            builder.store(builder.add(builder.load(acc), g), acc)
        tot = builder.load(acc)
        total = builder.extract_element(tot, ir.Constant(ir.IntType(32), 0))
        for j in range(1, _W):
            total = builder.add(total, builder.extract_element(tot, ir.Constant(ir.IntType(32), j)))
        return total

    return sig, codegen


@_inline
def _fixed_sum(fix, s, e):
    """``Σ fix[s:e]`` (int64; the slice indexes from 0, so no wrap-around test per element and the
    loop vectorizes)."""
    seg = fix[s:e]
    tot = np.int64(0)
    for p in range(seg.size):
        tot += seg[p]
    return tot


@_inline
def _orq_split(srt, tot, s, e, a32, b32, p2):
    """Position of the reference's split of segment ``[s, e)`` (interval ``[a32, b32]``, fixed-point
    total ``tot``) of the sorted row ``srt``, ``−1`` when no value lies strictly inside: the value of
    rank ``⌈R/(B − A)⌉`` in the segment (``R = Σ (B − G)``), moved up past the values equal to ``a``;
    none if that reaches the values equal to ``b``."""
    lo, hi = _segment_bounds(srt, s, e, a32, b32)
    if lo >= hi:
        return -1
    b_fix = _fixed(b32, p2)
    gap = b_fix - _fixed(a32, p2)
    need = (e - s) * b_fix - tot
    k = 1
    if gap > 0:
        k = max(1, need // gap + (1 if need % gap else 0))
    p = max(s + k - 1, lo)
    return p if p < hi else -1


@_inline
def _midpoint(a32, b32):
    """``minimum(maximum(0.5·a + 0.5·b, a), b)`` in float32, ties going to the first argument."""
    t = _HALF * a32 + _HALF * b32
    t = a32 if t < a32 else t
    return b32 if b32 < t else t


@_inline
def _next_levels(srt, fix, m, lv, cnt, p2, starts, tots, nlv, nst, ntot):
    """One greedy round for one row (``starts[j]`` = first position of segment ``j``, ``tots[j]`` its
    fixed-point total): new levels into ``lv[:2·cnt − 1]``, their segment starts and totals into
    ``starts`` and ``tots`` (an old level keeps its start; a split's is the first copy of its value;
    the shorter half is summed, the other is the rest)."""
    for j in range(cnt - 1):
        a32 = lv[j]
        b32 = lv[j + 1]
        s = starts[j]
        e = starts[j + 1]
        z = -1
        if s < e:
            z = _orq_split(srt, tots[j], s, e, a32, b32, p2)
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
        if st - s <= e - st:
            left = _fixed_sum(fix, s, st)
        else:
            left = tots[j] - _fixed_sum(fix, st, e)
        nlv[2 * j] = a32
        nlv[2 * j + 1] = c
        nst[2 * j] = s
        nst[2 * j + 1] = st
        ntot[2 * j] = left
        ntot[2 * j + 1] = tots[j] - left
    nlv[2 * (cnt - 1)] = lv[cnt - 1]
    nst[2 * (cnt - 1)] = m
    for j in range(2 * cnt - 1):
        lv[j] = nlv[j]
        starts[j] = nst[j]
        tots[j] = ntot[j]


@_inline
def _orq_levels(srt, fix, m, rounds, lv, nlv, starts, nst, tots, ntot):
    """ORQ levels of the sorted row ``srt[:m]`` into ``lv[:2**rounds + 1]`` (``fix``: scratch for
    ``m`` int64; ``tots``, ``ntot``: for ``2**rounds`` int64)."""
    p2 = _orq_scale(srt, m)
    full = m // _W
    tot = _fixed_vec(srt, fix, full, p2)
    for p in range(full * _W, m):
        g = _fixed(srt[p], p2)
        fix[p] = g
        tot += g
    lv[0] = srt[0]
    lv[1] = srt[m - 1]
    starts[0] = 0
    starts[1] = m
    tots[0] = tot
    cnt = 2
    for _ in range(rounds):
        _next_levels(srt, fix, m, lv, cnt, p2, starts, tots, nlv, nst, ntot)
        cnt = 2 * cnt - 1
