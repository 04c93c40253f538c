"""Numba CPU kernels for the one-bit quantizers (:mod:`gradq.quantizers.binary`).

Every function works on 1-D NumPy arrays (zero-copy views of torch CPU tensors, see
:mod:`gradq.kernels.binary`) and reproduces the plain-torch reference bit for bit:

* **fixed-order sums** (BinGrad-b, 1BitSGD, scaled SignSGD): every float64 bucket sum is the
  pairwise order of :func:`gradq.kernels.reference.pairwise_row_sum` — blocks of ``block``
  elements, each folded in half repeatedly (``a[i] += a[i + h]``, an odd last entry kept), then the
  block sums folded the same way; contiguous halves, so every fold is a plain vector add. Masked sums
  add ``+0.0`` where the mask is off, as ``torch.where(mask, x, 0)`` does.
* **BinGrad-pb** (its level ``b`` and its bits): :mod:`gradq.kernels.cpu_pb`, whose kernel this
  module exports.
* randomness: the helpers of :mod:`gradq.kernels.cpu` (element ``i`` of the vector uses counter
  ``ctr0 + i``); bits packed 8 per byte, first bit least significant.

BinGrad-b's Lloyd steps stop early, with the same result, once a step leaves the side ``{x ≥ t}``
unchanged (then every later step repeats it).

Parallelism: ``prange`` over chunks of whole buckets (statistics, fused with the bits when the
chunk is a multiple of 8) or over chunks of a multiple of 40 elements (bits for given levels, where
buckets are too long to fit a chunk); the boundaries depend on ``n`` and ``bucket`` only, so the
output does not depend on the number of threads. A single bucket is reduced by one thread.

Helpers are imported from :mod:`gradq.kernels.cpu` and inlined here; the compiled code is cached in a
directory keyed by the sources of every kernel module (:mod:`gradq.kernels.numba_cache`), so an edit
of a helper there recompiles this module too.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .numba_common import _ir_splat, _threshold_bits

# fastmath stays off. Large per-bucket helpers are ordinary (called) functions, compiled once, which
# keeps the first compile short; small ones are inlined. nogil: a communication thread may run
# meanwhile (as in gradq.kernels.cpu).
_inline = njit(inline="always", cache=True, error_model="numpy")
_func = njit(cache=True, error_model="numpy", nogil=True)
_kernel = njit(parallel=True, cache=True, error_model="numpy", nogil=True)

F32 = np.float32
F64 = np.float64
_ABS = 0x7FFFFFFF
_LANES = 16

# statistics (``mode``) of :func:`binary_encode`
SIGN = 0      # scaled SignSGD: mean |x|
ONEBIT = 1    # 1BitSGD: means of the negatives and of the non-negatives
BINGRAD_B = 2  # BinGrad-b: threshold at the mean, side means, Lloyd iterations

_SUM, _ABSSUM, _SPLIT = 0, 1, 2


@_inline
def _pack_bits(tmp, out):
    """Bits ``tmp`` (0/1) eight per byte, first bit least significant (``pack_bits(·, 1)``)."""
    m = tmp.size
    for j in range(m // 8):
        k = 8 * j
        out[j] = (tmp[k] | (tmp[k + 1] << 1) | (tmp[k + 2] << 2) | (tmp[k + 3] << 3)
                  | (tmp[k + 4] << 4) | (tmp[k + 5] << 5) | (tmp[k + 6] << 6) | (tmp[k + 7] << 7))
    if m & 7:
        acc = 0
        for k in range(m & ~7, m):
            acc |= np.int64(tmp[k]) << (k & 7)
        out[m // 8] = acc


# -- pairwise sums ---------------------------------------------------------------------------------
@_inline
def _fold(buf, m):
    """Sum of ``buf[:m]`` (``m ≥ 1``) folded in place: ``buf[i] += buf[i + h]`` for ``i < h = m // 2``,
    an odd last entry moved to ``buf[h]``, until one entry is left."""
    while m > 1:
        h = m >> 1
        for i in range(h):
            buf[i] = buf[i] + buf[i + h]
        if m & 1:
            buf[h] = buf[m - 1]
        m = h + (m & 1)
    return buf[0]


@_inline
def _fold2(lo, hi, m):
    """:func:`_fold` of ``lo[:m]`` and ``hi[:m]`` together (the same steps, in one loop)."""
    while m > 1:
        h = m >> 1
        for i in range(h):
            lo[i] = lo[i] + lo[i + h]
            hi[i] = hi[i] + hi[i + h]
        if m & 1:
            lo[h] = lo[m - 1]
            hi[h] = hi[m - 1]
        m = h + (m & 1)
    return lo[0], hi[0]


@_inline
def _first_fold(xs, t, kind, lo, hi):
    """The first fold of one block ``xs`` (float32, length ≥ 1) into ``lo`` (and ``hi``) as float64:
    ``kind`` ``_SUM``: x; ``_ABSSUM``: |x|; ``_SPLIT``: ``lo`` gets x where x < t, ``hi`` x where
    x ≥ t (``+0.0`` elsewhere). Returns the number of entries written and (``_SPLIT``) the number
    of x ≥ t."""
    m = xs.size
    h = m >> 1
    c = 0
    if kind == _SUM:
        for i in range(h):
            lo[i] = F64(xs[i]) + F64(xs[i + h])
        if m & 1:
            lo[h] = F64(xs[m - 1])
    elif kind == _ABSSUM:
        for i in range(h):
            lo[i] = abs(F64(xs[i])) + abs(F64(xs[i + h]))
        if m & 1:
            lo[h] = abs(F64(xs[m - 1]))
    else:
        for i in range(h):
            a = F64(xs[i])
            b = F64(xs[i + h])
            ua = a >= t
            ub = b >= t
            lo[i] = (0.0 if ua else a) + (0.0 if ub else b)
            hi[i] = (a if ua else 0.0) + (b if ub else 0.0)
            c += ua + ub
        if m & 1:
            a = F64(xs[m - 1])
            ua = a >= t
            lo[h] = 0.0 if ua else a
            hi[h] = a if ua else 0.0
            c += ua
    return h + (m & 1), c


_FOLD_M = 512   # the bucket length whose sums one vector fold computes (the binary schemes' default)


def _fold_intrinsic(kind):
    """:func:`_first_fold` and :func:`_fold` of one bucket of exactly ``_FOLD_M`` values, in
    registers: ``lo[0]`` (and for ``_SPLIT`` ``lo[1]``) get the sums, the count of ``x ≥ t`` is
    returned. The same additions in the same order (each fold adds the upper half of the vector to
    the lower), so the same bits; the loops with a trip count known only at run time, and their
    scratch stores, ran 2–3× slower."""
    @intrinsic
    def _impl(typingctx, xs, t, lo):
        sig = types.int64(xs, types.float64, lo)

        def codegen(context, builder, signature, args):
            xptr = context.make_array(signature.args[0])(context, builder, args[0]).data
            lptr = context.make_array(signature.args[2])(context, builder, args[2]).data
            f32, f64, i32, i64 = ir.FloatType(), ir.DoubleType(), ir.IntType(32), ir.IntType(64)
            h = _FOLD_M // 2
            vd = ir.VectorType(f64, h)

            def part(vec, start, count):
                return builder.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined),
                                              ir.Constant(ir.VectorType(i32, count), list(range(start, start + count))))

            v = builder.load(builder.bitcast(xptr, ir.VectorType(f32, _FOLD_M).as_pointer()), align=4)
            a, b = builder.fpext(part(v, 0, h), vd), builder.fpext(part(v, h, h), vd)
            count = ir.Constant(i64, 0)
            if kind == _SUM:
                sums = [builder.fadd(a, b)]
            elif kind == _ABSSUM:
                fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vd, [vd]), f"llvm.fabs.v{h}f64")
                sums = [builder.fadd(builder.call(fabs, [a]), builder.call(fabs, [b]))]
            else:
                zero = ir.Constant(vd, [0.0] * h)
                tv = _ir_splat(builder, vd, args[1])
                ua, ub = builder.fcmp_ordered(">=", a, tv), builder.fcmp_ordered(">=", b, tv)
                sums = [builder.fadd(builder.select(ua, zero, a), builder.select(ub, zero, b)),
                        builder.fadd(builder.select(ua, a, zero), builder.select(ub, b, zero))]
                vc = ir.VectorType(ir.IntType(16), h)
                both = builder.add(builder.zext(ua, vc), builder.zext(ub, vc))
                reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(16), [vc]),
                                                        f"llvm.vector.reduce.add.v{h}i16")
                count = builder.zext(builder.call(reduce, [both]), i64)
            for k, acc in enumerate(sums):
                m = h
                while m > 1:
                    m //= 2
                    acc = builder.fadd(part(acc, 0, m), part(acc, m, m))
                builder.store(builder.extract_element(acc, ir.Constant(i32, 0)),
                              builder.gep(lptr, [ir.Constant(i64, k)]))
            return count

        return sig, codegen

    return _impl


_fold_sum, _fold_abssum, _fold_split = (_fold_intrinsic(k) for k in (_SUM, _ABSSUM, _SPLIT))


@_func
def _bucket_sums(xs, t, kind, block, lo, hi, blo, bhi):
    """Sums of a bucket in the order of :func:`gradq.kernels.reference.pairwise_row_sum` (blocks of
    ``block`` elements folded, then the block sums folded) and the count of x ≥ t: ``(s, ·, ·)``
    for ``_SUM`` / ``_ABSSUM``, ``(s_lower, s_upper, count)`` for ``_SPLIT``. Scratch: ``lo``/``hi``
    hold ``block // 2`` values, ``blo``/``bhi`` one per block."""
    d = xs.size
    split = kind == _SPLIT
    if d == _FOLD_M and block >= _FOLD_M:
        if kind == _SUM:
            c = _fold_sum(xs, t, lo)
        elif kind == _ABSSUM:
            c = _fold_abssum(xs, t, lo)
        else:
            c = _fold_split(xs, t, lo)
        return lo[0], (lo[1] if split else 0.0), c
    if d <= block:
        r, c = _first_fold(xs, t, kind, lo, hi)
        if split:
            s0, s1 = _fold2(lo, hi, r)
            return s0, s1, c
        return _fold(lo, r), 0.0, c
    nblk = (d + block - 1) // block
    c = 0
    for k in range(nblk):
        r, ck = _first_fold(xs[k * block:min(d, (k + 1) * block)], t, kind, lo, hi)
        c += ck
        if split:
            blo[k], bhi[k] = _fold2(lo, hi, r)
        else:
            blo[k] = _fold(lo, r)
    if split:
        s0, s1 = _fold2(blo, bhi, nblk)
        return s0, s1, c
    return _fold(blo, nblk), 0.0, c


@_inline
def _means(mode, d, s0, s1, c1):
    """``(t, v0, v1)`` of SIGN and ONEBIT (see :func:`_stats`) from a bucket's sums."""
    if mode == SIGN:
        return 0.0, s0 / F64(d), 0.0
    c0 = d - c1
    return 0.0, (s0 / F64(c0) if c0 > 0 else 0.0), (s1 / F64(c1) if c1 > 0 else 0.0)


@_func
def _stats(xs, mode, iters, block, lo, hi, blo, bhi):
    """``(t, v0, v1)`` of one bucket: SIGN ``(0, mean|x|, ·)``, ONEBIT ``(0, mean{x<0}, mean{x≥0})``
    (0 for an empty side), BINGRAD_B ``(t, b0, b1)`` after ``iters`` Lloyd steps (``t`` for an empty
    side) — float64, as :mod:`gradq.quantizers.binary` computes them."""
    d = xs.size
    df = F64(d)
    # (kinds chosen at run time: one compiled _bucket_sums serves all three)
    kind = _ABSSUM if mode == SIGN else (_SPLIT if mode == ONEBIT else _SUM)
    s0, s1, c1 = _bucket_sums(xs, 0.0, kind, block, lo, hi, blo, bhi)
    if mode != BINGRAD_B:
        return _means(mode, d, s0, s1, c1)
    t = s0 / df
    b0 = t
    b1 = t
    c1 = -1
    kind = _SPLIT if kind == _SUM else kind
    for step in range(iters + 1):
        if step:
            t_new = 0.5 * (b0 + b1)
            if 0 < c1 < d and (t_new == t or _count_ge(xs, t_new) == c1):
                # the sides {x ≥ t} and {x ≥ t_new} are nested and equally large, so equal: the same
                # sums and means follow, t_new again, and so on for every remaining step
                return t_new, b0, b1
            t = t_new
        s0, s1, c1 = _bucket_sums(xs, t, kind, block, lo, hi, blo, bhi)
        c0 = d - c1
        b0 = s0 / F64(c0) if c0 > 0 else t
        b1 = s1 / F64(c1) if c1 > 0 else t
    return t, b0, b1


@_func
def _count_ge(xs, t):
    """#{x : float64(x) ≥ t}."""
    c = 0
    for i in range(xs.size):
        c += F64(xs[i]) >= t
    return c


@_kernel
def binary_encode(x, bucket, mode, iters, block, chunk, bits, t_out, lv_out, out):
    """Per-bucket thresholds ``t_out`` (float64; bit = ``float64(x) ≥ t``) and float32 levels
    ``lv_out`` (one per bucket for SIGN, ``(lower, upper)`` pairs otherwise); with ``bits``, also the
    bits packed 8 per byte into ``out``, fused per chunk of ``chunk`` elements (a multiple of
    ``bucket``, and of 8 when ``bits``) while the chunk is in cache: each bucket's bits straight
    into ``out`` when buckets are a multiple of 16 long, else through a byte per bit."""
    n = x.size
    half = max(1, block // 2)
    nblk = (min(bucket, n) + block - 1) // block
    direct = bucket % _LANES == 0   # every bucket starts on a whole pair of bytes: bits straight to out
    for c in prange((n + chunk - 1) // chunk):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        tmp = np.empty(e1 - e0 if bits and not direct else 0, np.uint8)
        lo = np.empty(half, F64)
        hi = np.empty(half, F64)
        blo = np.empty(nblk, F64)
        bhi = np.empty(nblk, F64)
        first = e0 // bucket
        if bucket == _FOLD_M and block >= _FOLD_M and (mode != BINGRAD_B or iters == 0):
            # whole buckets of the default length: folded in registers, a loop for each mode (one
            # loop choosing between the two folds, or calling a function a bucket, ran 1.5-2x slower)
            whole = first + (e1 - e0) // _FOLD_M
            sums = np.empty(2, F64)
            if mode == SIGN:
                for b in range(first, whole):
                    xs = x[b * _FOLD_M:(b + 1) * _FOLD_M]
                    _fold_abssum(xs, 0.0, sums)
                    t_out[b] = 0.0
                    lv_out[b] = F32(_means(SIGN, _FOLD_M, sums[0], 0.0, 0)[1])
                    if bits:
                        _threshold_bits(xs, 0.0, out[b * (_FOLD_M // 8):])
            elif mode == ONEBIT:
                for b in range(first, whole):
                    xs = x[b * _FOLD_M:(b + 1) * _FOLD_M]
                    c1 = _fold_split(xs, 0.0, sums)
                    _, v0, v1 = _means(ONEBIT, _FOLD_M, sums[0], sums[1], c1)
                    t_out[b] = 0.0
                    lv_out[2 * b] = F32(v0)
                    lv_out[2 * b + 1] = F32(v1)
                    if bits:
                        _threshold_bits(xs, 0.0, out[b * (_FOLD_M // 8):])
            else:   # BinGrad-b without Lloyd steps: threshold at the mean, then the side means (_stats)
                for b in range(first, whole):
                    xs = x[b * _FOLD_M:(b + 1) * _FOLD_M]
                    _fold_sum(xs, 0.0, sums)
                    t = sums[0] / F64(_FOLD_M)
                    c1 = _fold_split(xs, t, sums)
                    c0 = _FOLD_M - c1
                    t_out[b] = t
                    lv_out[2 * b] = F32(sums[0] / F64(c0) if c0 > 0 else t)
                    lv_out[2 * b + 1] = F32(sums[1] / F64(c1) if c1 > 0 else t)
                    if bits:
                        _threshold_bits(xs, t, out[b * (_FOLD_M // 8):])
            first = whole
        for b in range(first, (e1 + bucket - 1) // bucket):
            p = b * bucket
            q = min(n, p + bucket)
            xs = x[p:q]
            t, v0, v1 = _stats(xs, mode, iters, block, lo, hi, blo, bhi)
            t_out[b] = t
            if mode == SIGN:
                lv_out[b] = F32(v0)
            else:
                lv_out[2 * b] = F32(v0)
                lv_out[2 * b + 1] = F32(v1)
            if bits and direct:
                _threshold_bits(xs, t, out[p // 8:])
            elif bits:
                tr = tmp[p - e0:q - e0]
                for i in range(q - p):
                    tr[i] = F64(xs[i]) >= t
        if bits and not direct:
            _pack_bits(tmp, out[e0 // 8:])


# -- BinGrad-pb (in a module of its own; imported last: it takes the constants and helpers above) ---
from .cpu_pb import bingrad_pb_encode  # noqa: E402,F401
