"""Numba CPU kernel of BinGrad-pb (:mod:`gradq.quantizers.binary`): its level ``b`` per bucket and its
bits. :mod:`gradq.kernels.cpu_binary` exports the kernel, :func:`bingrad_pb_encode`; the conventions
(NumPy views, chunks of whole buckets, counters, bit order) are that module's.

* **BinGrad-pb's level** ``b`` (reference: sort ``|x|``, sequential float64 tail sums ``S_k`` from
  the largest value down, ``k = #{j : d·a_{j+1} < S_j}``, ``b = max(S_k/d, a_k)``): instead of
  sorting, a few vectorized passes bracket the crossing of ``φ(p) = d·p − Σ_{|x| ≥ p} |x|`` — the
  first at the previous bucket's ``b``, the second a fixed-point step ``U(p)/d`` (which lands on the
  other side of the crossing and, for similar buckets, within a few values of it) that also gathers
  the values in between; then secant steps over those values only — and the handful left are sorted
  and walked exactly. The result is then *certified*: when every value that enters ``S_{k−1}`` is a
  multiple of the ulp ``u`` of ``a_k`` and ``S_{k−1} < 2^53·u``, every partial sum the reference
  forms is exact, so its sums equal ours whatever the order; together with ``d·a_k < S_{k−1}`` and
  ``d·a_{k+1} ≥ S_k`` (and the monotonicity of the reference's test in ``j``) this proves that the
  reference finds the same ``k``. A bucket that cannot be certified (values above the level adding
  up to more than ~2^30 times it, e.g. 1e-30 next to 1.0: never for ordinary buckets, where the
  ratio is about ``d``) takes the reference's own algorithm: full sort and sequential tail sums. The
  hint and every steering sum only decide how fast the answer is found, never what it is.
* BinGrad-pb's bits: ``u < (x + b)/(2b)`` in float32 (all ones where ``b = 0``); the reference's
  clamp of the probability to ``[0, 1]`` does not change the test for ``u`` in ``[0, 1)``.

Helpers are imported from :mod:`gradq.kernels.cpu_binary` and :mod:`gradq.kernels.numba_common`;
the compiled code is cached in a directory keyed by the sources of every kernel module
(:mod:`gradq.kernels.numba_cache`), so an edit of a helper there recompiles this module too.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu_binary import F32, F64, _ABS, _LANES, _pack_bits
from .numba_common import (_borrowed, _ir_counters, _ir_splat, _ir_uniform, _ir_vectors, _keep, _run_end, _run_keys,
                           _uniform)

# as in cpu_binary: fastmath off, large per-bucket helpers called (compiled once), small ones inlined
_inline = njit(inline="always", cache=True, error_model="numpy")
_func = njit(cache=True, error_model="numpy", nogil=True)
_kernel = njit(parallel=True, cache=True, error_model="numpy", nogil=True)

_NO_ELEMENT = 0x7FFFFFFF   # above every finite |x| bit pattern: "no element" in a minimum
_INF_BITS = 0x7F800000
_MAX_BRACKET = 16   # values left in the bracket before the exact walk
_MAX_PASSES = 120   # pivot passes before giving up on a bucket (then: full sort)


def _splat_i32(builder, val):
    vi = ir.VectorType(ir.IntType(32), _LANES)
    one = builder.insert_element(ir.Constant(vi, ir.Undefined), val, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vi, ir.Undefined), ir.Constant(vi, [0] * _LANES))


def _ir_fold(builder, vec, op):
    """Reduce a vector by folding it in half (``op(lanes[:h], lanes[h:])``) down to one lane. The
    sums reduced this way only steer the search or are exact (see the module docstring), so their
    association does not matter; a tree is just shorter than a chain."""
    n = vec.type.count
    i32 = ir.IntType(32)
    while n > 1:
        h = n // 2
        lo = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(i32, h), list(range(h))))
        hi = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(i32, h), list(range(h, n))))
        vec = op(lo, hi)
        n = h
    return builder.extract_element(vec, ir.Constant(i32, 0))


def _pass_codegen(gather):
    """Code of :func:`_pass_vec` (``gather=False``) and :func:`_pass_gather_vec` (``gather=True``)."""

    def codegen(context, builder, signature, args):
        xptr = context.make_array(signature.args[0])(context, builder, args[0]).data
        fptr = context.make_array(signature.args[3])(context, builder, args[3]).data
        iptr = context.make_array(signature.args[4])(context, builder, args[4]).data
        count = args[1]
        i1, i16, i32, i64 = ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64)
        f32, f64 = ir.FloatType(), ir.DoubleType()
        vi = ir.VectorType(i32, _LANES)
        vf = ir.VectorType(f32, _LANES)
        vd = ir.VectorType(f64, _LANES)

        def const(v):
            return ir.Constant(vi, [v & 0xFFFFFFFF] * _LANES)

        pv = _splat_i32(builder, args[2])
        zero = ir.Constant(vd, [0.0] * _LANES)
        acc = cgutils.alloca_once_value(builder, zero)
        cnt = cgutils.alloca_once_value(builder, const(0))
        below = cgutils.alloca_once_value(builder, const(-1))
        above = cgutils.alloca_once_value(builder, const(_NO_ELEMENT))
        if gather:
            optr = context.make_array(signature.args[7])(context, builder, args[7]).data
            lov, hiv = _splat_i32(builder, args[5]), _splat_i32(builder, args[6])
            compress = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [vi, optr.type, ir.VectorType(i1, _LANES)]),
                "llvm.masked.compressstore.v16i32")
            popcnt = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16, [i16]), "llvm.ctpop.i16")
            pos = cgutils.alloca_once_value(builder, ir.Constant(i64, 0))
        with cgutils.for_range(builder, count) as loop:
            off = builder.mul(loop.index, ir.Constant(loop.index.type, _LANES))
            v = builder.load(builder.bitcast(builder.gep(xptr, [off]), vi.as_pointer()), align=4)
            v = builder.and_(v, const(_ABS))
            ge = builder.icmp_signed(">=", v, pv)
            fd = builder.fpext(builder.bitcast(v, vf), vd)
            builder.store(builder.fadd(builder.load(acc), builder.select(ge, fd, zero)), acc)
            builder.store(builder.sub(builder.load(cnt), builder.sext(ge, vi)), cnt)
            b = builder.load(below)
            builder.store(builder.select(ge, b, builder.select(builder.icmp_signed(">", v, b), v, b)), below)
            a = builder.load(above)
            builder.store(builder.select(ge, builder.select(builder.icmp_signed("<", v, a), v, a), a), above)
            if gather:
                sel = builder.and_(builder.icmp_signed(">=", v, lov), builder.icmp_signed("<", v, hiv))
                p = builder.load(pos)
                builder.call(compress, [v, builder.gep(optr, [p]), sel])
                builder.store(builder.add(p, builder.zext(builder.call(popcnt, [builder.bitcast(sel, i16)]), i64)),
                              pos)
        smax = lambda x, y: builder.select(builder.icmp_signed(">", x, y), x, y)  # noqa: E731
        smin = lambda x, y: builder.select(builder.icmp_signed("<", x, y), x, y)  # noqa: E731
        builder.store(_ir_fold(builder, builder.load(acc), builder.fadd), fptr)
        builder.store(builder.sext(_ir_fold(builder, builder.load(cnt), builder.add), i64), iptr)
        builder.store(builder.sext(_ir_fold(builder, builder.load(below), smax), i64),
                      builder.gep(iptr, [ir.Constant(i32, 1)]))
        builder.store(builder.sext(_ir_fold(builder, builder.load(above), smin), i64),
                      builder.gep(iptr, [ir.Constant(i32, 2)]))
        if gather:
            return builder.load(pos)
        return context.get_dummy_value()

    return codegen


@intrinsic
def _pass_vec(typingctx, xi, nvec, pb, res_f, res_i):
    """Over the first ``16·nvec`` entries of ``xi`` (int32 bit patterns; ``|x|`` = ``xi & 0x7FFFFFFF``,
    whose integer order is the float order): ``res_f[0]`` = float64 sum of the ``|x|`` with bits
    ``≥ pb`` (16 lanes, then folded), ``res_i[0]`` their count, ``res_i[1]`` the largest bits below
    ``pb`` (−1: none), ``res_i[2]`` the smallest bits ``≥ pb`` (0x7FFFFFFF: none)."""
    return types.void(xi, nvec, types.int32, res_f, res_i), _pass_codegen(False)


@intrinsic
def _pass_gather_vec(typingctx, xi, nvec, pb, res_f, res_i, lo, hi, out):
    """:func:`_pass_vec`, and the bits in ``[lo, hi)`` written to ``out`` in order (a compress-store
    per 16 lanes); returns how many."""
    sig = types.int64(xi, nvec, types.int32, res_f, res_i, types.int32, types.int32, out)
    return sig, _pass_codegen(True)


@_inline
def _f32(bits):
    return np.int32(bits).view(F32)


@_func
def _pass(xi, pb, res_f, res_i):
    """``(sum, count, largest below, smallest at or above)`` of the ``|x|`` bits ``≥ pb`` in ``xi``."""
    full = xi.size // _LANES
    _pass_vec(xi, full, np.int32(pb), res_f, res_i)
    return _pass_tail(xi, full * _LANES, pb, res_f, res_i)


@_func
def _pass_tail(xi, start, pb, res_f, res_i):
    s = res_f[0]
    c = res_i[0]
    below = res_i[1]
    above = res_i[2]
    for i in range(start, xi.size):   # (branch-free: the outcomes are data-dependent)
        v = np.int64(xi[i] & _ABS)
        ge = v >= pb
        s += F64(_f32(v)) if ge else 0.0
        c += ge
        above = min(above, v if ge else _NO_ELEMENT)
        below = max(below, -1 if ge else v)
    return s, c, below, above


@_func
def _pass_gather(xi, pb, lo, hi, out, res_f, res_i):
    """:func:`_pass` and ``m``: the bits of ``xi`` in ``[lo, hi)`` written to ``out`` in order."""
    full = xi.size // _LANES
    m = _pass_gather_vec(xi, full, np.int32(pb), res_f, res_i, np.int32(lo), np.int32(hi), out)
    for i in range(full * _LANES, xi.size):
        v = xi[i] & _ABS
        out[m] = v
        m += (v >= lo) & (v < hi)
    s, c, below, above = _pass_tail(xi, full * _LANES, pb, res_f, res_i)
    return s, c, below, above, m


@_inline
def _ulp_scale(bits):
    """``2^53·ulp`` of the positive float32 with these bits, as float64."""
    e = bits >> 23
    return math.ldexp(1.0, (e if e > 0 else 1) - 150 + 53)


@_func
def _pb_reference(xi, df, work, tail):
    """The reference algorithm verbatim: sort |x|, sequential float64 tail sums from the top."""
    d = xi.size
    a = work[:d]
    for i in range(d):
        a[i] = _f32(xi[i] & _ABS)
    a.sort()
    acc = 0.0
    for j in range(d - 1, -1, -1):
        acc += F64(a[j])
        tail[j] = acc
    k = 0
    for j in range(d):
        k += df * F64(a[j]) < tail[j]
    s_k = tail[k] if k < d else 0.0
    a_k = F64(a[k - 1]) if k >= 1 else 0.0
    return F32(max(s_k / df, a_k))


@_inline
def _insertion_sort(v, m):
    for i in range(1, m):
        key = v[i]
        j = i - 1
        while j >= 0 and v[j] > key:
            v[j + 1] = v[j]
            j -= 1
        v[j + 1] = key


@_inline
def _round_bits(p, up):
    """Bits of the float32 nearest ``p ≥ 0`` on the side ``up`` (at or above ``p``) or below."""
    f = np.float32(p)
    bits = np.int64(f.view(np.int32))
    if up and F64(f) < p:
        bits += 1
    elif not up and F64(f) > p:
        bits -= 1
    return bits


@_func
def _pb_level(xi, sub, suf, res_f, res_i, hint):
    """BinGrad-pb's ``b`` of one bucket (``xi``: int32 view of its float32 values), or −1.0 when the
    result cannot be certified (the caller then runs :func:`_pb_reference`). ``hint`` (the previous
    bucket's ``b``, or 0) only steers the search.

    Bracket ``[lo, hi)`` of bit patterns with ``φ(lo) < 0 ≤ φ(hi)`` (as far as our sums tell):
    ``c_*`` = #{|x| ≥ *}, ``u_*`` = Σ_{|x| ≥ *} |x|, ``below_*`` / ``first_*`` = the largest bits
    below / the smallest bits at or above ``*``. The first pass is at ``hint`` (or counts the
    positives); from a point ``p`` on one side, ``U(p)/d`` lies on the other side (a fixed-point
    step: ``φ(U(p)/d) = U(p) − U(U(p)/d)``), so the second pass also gathers the values between the
    two into ``sub``; later passes (secant steps, bisection when a step gains little) run over those
    only, and the last few are sorted and walked exactly."""
    d = xi.size
    df = F64(d)
    minpos = np.int64(-1)          # smallest positive bits; found when needed
    lo, c_lo, u_lo, below_lo, first_lo = 0, d, -1.0, -1, 0   # u_lo < 0: the total is not known yet
    hi, c_hi, u_hi, first_hi = _INF_BITS, 0, 0.0, _NO_ELEMENT
    below_hi = _INF_BITS - 1       # not known yet: any bound above the data does
    hint_bits = _round_bits(F64(hint), True) if hint > F32(0.0) else 0
    if hint_bits > 0 and hint_bits < _INF_BITS:
        u, c, below, above = _pass(xi, hint_bits, res_f, res_i)
        if df * F64(_f32(hint_bits)) < u:
            lo, c_lo, u_lo, below_lo, first_lo = hint_bits, c, u, below, above
        else:
            hi, c_hi, u_hi, below_hi, first_hi = hint_bits, c, u, below, above
    else:
        total, npos, _, minpos = _pass(xi, np.int64(1), res_f, res_i)
        if npos == 0:
            return F32(0.0)   # all zeros: k = 0, S_0 = 0
        u_lo = total
        first_lo = 0 if npos < d else minpos
    arr = xi[:d]               # the values searched: the bucket, then the bracket's values
    gathered = False
    c_base, u_base, below_base, above_base = 0, 0.0, -1, _NO_ELEMENT
    passes = 0
    last_m = 2 * d + 2
    secant = False
    g_lo, g_hi, cnt = -1, -1, 0
    while True:
        m = c_lo - c_hi
        if m <= _MAX_BRACKET or first_lo >= below_hi:
            break
        passes += 1
        if passes > _MAX_PASSES:
            return F32(-1.0)
        lo_v = F64(_f32(lo))
        bisect = secant and 2 * m > last_m   # the last secant step did not halve the bracket
        secant = False
        side = 0                   # +1 / -1: a fixed-point step from lo / hi
        if hi == _INF_BITS:
            pb = _round_bits(u_lo / df, True)
            side = 1
        elif u_lo < 0.0:
            pb = _round_bits(u_hi / df, False)
            side = -1
        elif bisect and passes & 1:  # bisect the values, or the bit patterns
            pb = _round_bits(0.5 * (lo_v + F64(_f32(hi))), True)
        elif bisect:
            pb = (first_lo + below_hi + 1) >> 1
        else:
            hi_v = F64(_f32(hi))
            phi_lo = df * lo_v - u_lo
            phi_hi = df * hi_v - u_hi
            pb = _round_bits(lo_v + (hi_v - lo_v) * (-phi_lo / (phi_hi - phi_lo)), True)
            secant = True
        pb = min(max(pb, first_lo + 1), below_hi)   # both sides of the pivot hold bracket values
        last_m = m
        if gathered:
            u, c, below, above = _pass(arr, pb, res_f, res_i)
            u += u_base
            c += c_base
            below = max(below, below_base)
            above = min(above, above_base)
        elif side != 0:
            # after a fixed-point step the new bracket lies between the pivot and the known end:
            # this pass also collects the values there
            g_lo = pb if side < 0 else lo
            g_hi = pb if side > 0 else hi
            u, c, below, above, cnt = _pass_gather(xi, pb, g_lo, g_hi, sub, res_f, res_i)
        else:
            u, c, below, above = _pass(arr, pb, res_f, res_i)
        if df * F64(_f32(pb)) < u:
            lo, c_lo, u_lo, below_lo, first_lo = pb, c, u, below, above
        else:
            hi, c_hi, u_hi, below_hi, first_hi = pb, c, u, below, above
        if not gathered and side != 0 and lo == g_lo and hi == g_hi:   # (else: the rounding of our
            if cnt != c_lo - c_hi:                                        # sums fooled the step)
                return F32(-1.0)
            arr = sub[:cnt]
            gathered = True
            c_base, u_base, below_base, above_base = c_hi, u_hi, below_lo, first_hi
    if not gathered:
        arr = sub[:_pass_gather(xi, hi, lo, hi, sub, res_f, res_i)[4]]
    # the values in [lo, hi), sorted: sorted positions base .. base + m - 1
    m = 0
    for i in range(arr.size):   # in place (m <= i), branch-free
        v = arr[i]
        sub[m] = v
        m += (v >= lo) & (v < hi)
    if m != c_lo - c_hi:
        return F32(-1.0)
    _insertion_sort(sub, m)
    base = d - c_lo
    if m + 1 > suf.size:   # (a long run of tied values)
        suf = np.empty(m + 1, F64)
    suf[m] = u_hi
    for i in range(m - 1, -1, -1):
        suf[i] = suf[i + 1] + F64(_f32(sub[i]))
    kr = 0
    while kr < m and df * F64(_f32(sub[kr])) < suf[kr]:
        kr += 1
    if kr == m and c_hi > 0 and df * F64(_f32(first_hi)) < u_hi:
        return F32(-1.0)   # the test still holds above the bracket
    k = base + kr
    s_k = suf[kr]
    if k == 0:
        a_k = 0.0
        s_prev = suf[0]
        unit = -1
    else:
        if kr > 0:
            a_bits = np.int64(sub[kr - 1])
            s_prev = suf[kr - 1]
        else:
            a_bits = below_lo
            s_prev = suf[0] + F64(_f32(a_bits))
            if not (df * F64(_f32(a_bits)) < s_prev):
                return F32(-1.0)   # the test fails below the bracket
        a_k = F64(_f32(a_bits))
        unit = a_bits if a_bits > 0 else -1
    if unit < 0:   # the smallest positive value enters S_{k-1}
        unit = minpos if minpos >= 0 else _pass(xi, np.int64(1), res_f, res_i)[3]
    # exactness: every value in S_{k-1} is a multiple of ulp(unit) and their total is below
    # 2^53·ulp (with a 2^-20 margin for the rounding of our own sum), so every partial sum is exact
    if not (s_prev <= _ulp_scale(unit) * (1.0 - 2.0 ** -20)):
        return F32(-1.0)
    return F32(max(s_k / df, a_k))


@_func
def _pb_bucket(xs, sub, suf, res_f, res_i, hint):
    """``(b, whether the full sort was needed)`` of one bucket (``hint``: see :func:`_pb_level`)."""
    lv = _pb_level(xs, sub, suf, res_f, res_i, hint)
    if lv >= F32(0.0):
        return lv, False
    return _pb_reference(xs, F64(xs.size), np.empty(xs.size, F32), np.empty(xs.size, F64)), True


@intrinsic
def _pb_bits_vec(typingctx, xs, ts, nvec, lv, den, base, k2h):
    """The first ``16·nvec`` bits of :func:`_pb_bits`: ``u < (x + lv)/den`` as bytes 0/1, ``u`` the
    uniform of element ``j`` of the run ``(base, k2h)``; plain IEEE float32 operations."""
    sig = types.void(xs, ts, nvec, types.float32, types.float32, types.uint32, types.uint32)

    def codegen(context, builder, signature, args):
        xptr = context.make_array(signature.args[0])(context, builder, args[0]).data
        tptr = context.make_array(signature.args[1])(context, builder, args[1]).data
        count, lvs, dens, b, k = args[2:]
        i32, vi, vf, const, inv24 = _ir_vectors()
        vb = ir.VectorType(ir.IntType(8), _LANES)
        lvv, denv = _ir_splat(builder, vf, lvs), _ir_splat(builder, vf, dens)
        state = _ir_counters(builder, vi, b)
        kv = _ir_splat(builder, vi, k)
        with cgutils.for_range(builder, count) as loop:
            off = builder.mul(loop.index, ir.Constant(loop.index.type, _LANES))
            v = builder.load(builder.bitcast(builder.gep(xptr, [off]), vf.as_pointer()), align=4)
            x = builder.load(state)
            u = _ir_uniform(builder, x, kv, const, vf, inv24)
            q = builder.fdiv(builder.fadd(v, lvv), denv)
            bit = builder.zext(builder.fcmp_ordered("<", u, q), vb)
            builder.store(bit, builder.bitcast(builder.gep(tptr, [off]), vb.as_pointer()), align=1)
            builder.store(builder.add(x, const(_LANES * 0x9E3779B9)), state)
        return context.get_dummy_value()

    return sig, codegen


@_func
def _pb_bits(xs, tr, lv, ctr, k1, k2):
    """Bits ``u < (x + b)/(2b)`` of ``xs`` into ``tr`` (all 1 for ``b = 0``); counters from ``ctr``.
    (``u < clamp(p, 0, 1)``, the reference's test, is ``u < p`` for ``u`` in [0, 1), NaN included.)"""
    if not lv > F32(0.0):
        for i in range(xs.size):
            tr[i] = 1
        return
    den = F32(2.0) * lv
    p = 0
    m = xs.size
    while p < m:
        e = _run_end(ctr + p, p, m)
        base, k2h = _run_keys(ctr + p, k1, k2)
        full = (e - p) // _LANES
        _pb_bits_vec(xs[p:e], tr[p:e], full, lv, den, base, k2h)
        for i in range(full * _LANES, e - p):
            tr[p + i] = _uniform(base, i, k2h) < (xs[p + i] + lv) / den
        p = e


@_kernel
def bingrad_pb_encode(x, xi, bucket, k1, k2, ctr0, chunk, compute, bits, levels, fallback, out):
    """BinGrad-pb per chunk of ``chunk`` elements: with ``compute``, the level ``b`` of every bucket
    (``chunk`` a multiple of ``bucket``; ``fallback[b] = 1`` where the full sort was needed), else the
    given ``levels``; with ``bits``, the bits ``u < (x + b)/(2b)`` (``u`` the uniform of counter
    ``ctr0 + i``) packed 8 per byte (``chunk`` a multiple of 8)."""
    n = x.size
    width = min(bucket, n)
    # borrowed views (numba_common._borrowed): the per-bucket calls and slices then count no
    # references on arrays that the threads share
    x, xi, levels, fallback, out = _borrowed(x), _borrowed(xi), _borrowed(levels), _borrowed(fallback), _borrowed(out)
    for c in prange((n + chunk - 1) // chunk):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        own = (np.empty(e1 - e0 if bits else 0, np.uint8), np.empty(width if compute else 0, np.int32),
               np.empty(_MAX_BRACKET + 1, F64), np.empty(1, F64), np.empty(3, np.int64))
        tmp, sub, suf = _borrowed(own[0]), _borrowed(own[1]), _borrowed(own[2])
        res_f, res_i = _borrowed(own[3]), _borrowed(own[4])
        lv = F32(0.0)
        p = e0
        while p < e1:
            b = p // bucket
            q = min((b + 1) * bucket, e1)
            if compute:   # (whole buckets; the previous one's level is the search's hint)
                lv, fb = _pb_bucket(xi[p:q], sub, suf, res_f, res_i, lv)
                levels[b] = lv
                fallback[b] = fb
            else:
                lv = levels[b]
            if bits:
                _pb_bits(x[p:q], tmp[p - e0:q - e0], lv, ctr0 + p, k1, k2)
            p = q
        if bits:
            _pack_bits(tmp, out[e0 // 8:])
        _keep(own)
