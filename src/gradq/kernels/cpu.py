"""Numba CPU kernels: fused quantize+pack and unpack+dequantize for the fixed-width schemes.

Every function here works on 1-D NumPy arrays (zero-copy views of torch CPU tensors, see
:mod:`gradq.kernels`) and reproduces a plain-torch reference bit for bit:

* randomness: element ``i`` uses counter ``off + i`` of :class:`gradq.random.RandomStream`
  (``h = mix32(mix32(lo·φ + k1) ^ k2 ^ hi)``, ``u = (h >> 8)·2⁻²⁴``), in wrapping uint32 arithmetic;
* uniform codes (QSGD, MaxNorm, TernGrad): ``r = float32(1/scale)·s`` (what torch computes for
  ``s / scale``; a zero scale reads as 1), ``a = |x|·r``, ``m = min(floor(a + u), s)``, field
  ``s ± m`` — all float32, no FMA (fastmath stays off);
* level rounding (ORQ, Linear): ``hi`` = torch.searchsorted(levels, x) (its binary search, exactly),
  ``p = (x − l_lo)/(l_hi − l_lo)``, index ``hi if u < p else lo``;
* packing as :mod:`gradq.codecs.bitpack`: little-endian ``width``-bit fields, trits base 3 five per byte.

Parallelism: ``prange`` over chunks of ``chunk`` elements, ``chunk`` a multiple of 40 (so every
chunk starts on a byte boundary for any width and for trits) and, where the bucket is small, of
whole buckets. Chunk boundaries depend only on ``n`` and ``bucket``, never on the thread count, and
every random number is a pure function of its counter, so the bytes are identical on any number of
threads. A bucket that straddles a chunk boundary has its max-abs recomputed by both chunks (same
value; only the chunk holding the bucket's first element writes it).

Compiled code is cached on disk in a directory keyed by a hash of this file and the modules that
inline its helpers (:mod:`gradq.kernels.numba_cache`), so an edit of any of them starts afresh.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

U32 = np.uint32
F32 = np.float32
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_ABS = 0x7FFFFFFF
_M32 = 0xFFFFFFFF

# fastmath stays off (no FMA contraction, IEEE float32 everywhere); error_model="numpy" lets a float
# division follow IEEE (no ZeroDivisionError branch), which keeps the loops vectorizable.
_inline = njit(inline="always", cache=True, error_model="numpy")
_kernel = njit(parallel=True, cache=True, error_model="numpy", nogil=True)  # nogil: a comm thread runs meanwhile


# -- random numbers (LLVM IR) ----------------------------------------------------------------------
# numba widens uint32 arithmetic to 64 bits, which vectorizes as slow 64-bit multiplies, and its loop
# vectorizer picks 8 lanes on AVX-512 machines; the hash loops are therefore written as 32-bit LLVM
# IR on explicit 16-lane vectors (LLVM splits them on narrower hardware). Every operation is the
# plain IEEE / wrapping-integer one, in the reference's order.
_LANES = 16
_PREFETCH = 512  # elements (2 KiB, one bucket of 512) ahead
_INV24 = 2.0 ** -24


def _ir_mix32(builder, x, const):
    """lowbias32 on an i32 value or vector; ``const(v)`` builds a constant of the same type."""
    for shift, mult in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = builder.xor(x, builder.lshr(x, const(shift)))
        x = builder.mul(x, const(mult))
    return builder.xor(x, builder.lshr(x, const(16)))


def _ir_uniform(builder, x, k2h, const, fty, inv24):
    """``(mix32(mix32(x) ^ k2h) >> 8)·2⁻²⁴`` as float32 (scalar or vector)."""
    h = _ir_mix32(builder, builder.xor(_ir_mix32(builder, x, const), k2h), const)
    return builder.fmul(builder.uitofp(builder.lshr(h, const(8)), fty), inv24)


def _ir_splat(builder, vty, val):
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), val, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined), ir.Constant(
        ir.VectorType(ir.IntType(32), vty.count), [0] * vty.count))


def _ir_vectors():
    i32, f32 = ir.IntType(32), ir.FloatType()
    vi, vf = ir.VectorType(i32, _LANES), ir.VectorType(f32, _LANES)

    def const(v):
        return ir.Constant(vi, [v & 0xFFFFFFFF] * _LANES)

    return i32, vi, vf, const, ir.Constant(vf, [_INV24] * _LANES)


def _ir_counters(builder, vi, base):
    """Counter hashes of lanes 0..15: ``base + lane·φ`` (the state advances by ``16·φ`` a step)."""
    lanes = ir.Constant(vi, [(j * 0x9E3779B9) & 0xFFFFFFFF for j in range(_LANES)])
    return cgutils.alloca_once_value(builder, builder.add(_ir_splat(builder, vi, base), lanes))


@intrinsic
def _uniform(typingctx, base, i, k2h):
    """Uniform float32 of element ``i`` of a run (``base``, ``k2h`` uint32 from :func:`_run_keys`)."""
    sig = types.float32(types.uint32, i, types.uint32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        b, idx, k = args
        if idx.type.width != 32:
            idx = builder.trunc(idx, i32) if idx.type.width > 32 else builder.zext(idx, i32)
        x = builder.add(b, builder.mul(idx, ir.Constant(i32, 0x9E3779B9)))
        return _ir_uniform(builder, x, k, lambda v: ir.Constant(i32, v & 0xFFFFFFFF), ir.FloatType(),
                           ir.Constant(ir.FloatType(), _INV24))

    return sig, codegen


@intrinsic
def _fill_uniform_vec(typingctx, arr, nvec, base, k2h):
    """``arr[j]`` = uniform of element ``j`` of the run, for ``j < 16·nvec``."""
    sig = types.void(arr, nvec, types.uint32, types.uint32)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        count, b, k = args[1], args[2], args[3]
        i32, vi, vf, const, inv24 = _ir_vectors()
        state = _ir_counters(builder, vi, b)
        kv = _ir_splat(builder, vi, k)
        with cgutils.for_range(builder, count) as loop:
            x = builder.load(state)
            ptr = builder.gep(data, [builder.mul(loop.index, ir.Constant(loop.index.type, _LANES))])
            builder.store(_ir_uniform(builder, x, kv, const, vf, inv24), builder.bitcast(ptr, vf.as_pointer()),
                          align=4)
            builder.store(builder.add(x, const(_LANES * 0x9E3779B9)), state)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _uniform_fields_vec(typingctx, xs, ts, nvec, r, s, clip, base, k2h):
    """The loop of :func:`_uniform_fields` for its first ``16·nvec`` elements: clamp to ``±clip``,
    ``a = |v|·r`` (0 for v = 0), ``t = a + u``, ``min(t, s)``, truncation, field ``s ± mag``."""
    sig = types.void(xs, ts, nvec, types.float32, types.int32, types.float32, types.uint32, types.uint32)

    def codegen(context, builder, signature, args):
        xptr = context.make_array(signature.args[0])(context, builder, args[0]).data
        tptr = context.make_array(signature.args[1])(context, builder, args[1]).data
        count, rr, ss, cl, b, k = args[2:]
        i32, vi, vf, const, inv24 = _ir_vectors()
        vb = ir.VectorType(ir.IntType(8), _LANES)
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [xptr.type, i32, i32, i32]), "llvm.prefetch.p0")
        zero = ir.Constant(vf, [0.0] * _LANES)
        rv, sv, cv = _ir_splat(builder, vf, rr), _ir_splat(builder, vi, ss), _ir_splat(builder, vf, cl)
        sfv, ncv = builder.sitofp(sv, vf), builder.fneg(cv)
        state = _ir_counters(builder, vi, b)
        kv = _ir_splat(builder, vi, k)
        with cgutils.for_range(builder, count) as loop:
            off = builder.mul(loop.index, ir.Constant(loop.index.type, _LANES))
            v = builder.load(builder.bitcast(builder.gep(xptr, [off]), vf.as_pointer()), align=4)
            # fetch the data one bucket ahead (whose max-abs pass comes next) while the multipliers
            # work; a prefetch never faults, even past the end of the array
            builder.call(prefetch, [builder.gep(xptr, [builder.add(off, ir.Constant(off.type, _PREFETCH))]),
                                    ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            v = builder.select(builder.fcmp_ordered(">", v, cv), cv, v)
            v = builder.select(builder.fcmp_ordered("<", v, ncv), ncv, v)
            av = builder.bitcast(builder.and_(builder.bitcast(v, vi), const(0x7FFFFFFF)), vf)
            a = builder.select(builder.fcmp_ordered(">", av, zero), builder.fmul(av, rv), zero)
            x = builder.load(state)
            t = builder.fadd(a, _ir_uniform(builder, x, kv, const, vf, inv24))
            t = builder.select(builder.fcmp_ordered(">", t, sfv), sfv, t)
            mag = builder.fptosi(t, vi)
            q = builder.select(builder.fcmp_ordered("<", v, zero), builder.sub(sv, mag), builder.add(sv, mag))
            builder.store(builder.trunc(q, vb), builder.bitcast(builder.gep(tptr, [off]), vb.as_pointer()),
                          align=1)
            builder.store(builder.add(x, const(_LANES * 0x9E3779B9)), state)
        return context.get_dummy_value()

    return sig, codegen


@_inline
def _fill_uniform(u, base, k2h):
    """``u[i]`` = uniform of element ``i`` of the run ``(base, k2h)``, for all of ``u``."""
    full = u.size // _LANES
    _fill_uniform_vec(u, full, base, k2h)
    for i in range(full * _LANES, u.size):
        u[i] = _uniform(base, i, k2h)


@_inline
def _run_keys(ctr, k1, k2):
    """``(base, k2 ^ hi)`` for a run of counters starting at ``ctr`` that stays below the next
    multiple of 2**32: element ``i`` of the run hashes ``base + i·φ``."""
    base = U32((((ctr & _M32) * 0x9E3779B9) + k1) & _M32)
    return base, U32((k2 ^ (ctr >> 32)) & _M32)


@_inline
def _run_end(ctr, p, q):
    """End of the run from element ``p`` (counter ``ctr``) to ``q`` cut at the next 2**32 counter."""
    nxt = ((ctr >> 32) + 1) << 32
    return min(q, p + (nxt - ctr))


# -- packing (all helpers take slices that start at element / byte 0: offset indexing would add a
# negative-index check per access and stop the loops from vectorizing) ----------------------------
@_inline
def _pack_groups(tmp, out, w):
    """Whole groups of 8 fields of ``w`` bits (a literal, so the inner loops unroll) -> ``w`` bytes."""
    for g in range(tmp.size // 8):
        word = 0
        for k in range(8):
            word |= np.int64(tmp[8 * g + k]) << (k * w)
        for b in range(w):
            out[g * w + b] = (word >> (8 * b)) & 0xFF


@_inline
def _unpack_groups(data, tmp, w):
    """Inverse of :func:`_pack_groups` for the whole groups of 8 fields in ``tmp``."""
    mask = (1 << w) - 1
    for g in range(tmp.size // 8):
        word = 0
        for b in range(w):
            word |= np.int64(data[g * w + b]) << (8 * b)
        for k in range(8):
            tmp[8 * g + k] = (word >> (k * w)) & mask


@_inline
def _pack(tmp, width, out):
    """Pack ``tmp`` (values < 2**width) into ``out`` as little-endian ``width``-bit fields."""
    m = tmp.size
    if width == 8:
        for i in range(m):
            out[i] = tmp[i]
        return
    if width == 4:
        for j in range(m // 2):
            out[j] = tmp[2 * j] | (tmp[2 * j + 1] << 4)
    elif width == 2:
        for j in range(m // 4):
            out[j] = tmp[4 * j] | (tmp[4 * j + 1] << 2) | (tmp[4 * j + 2] << 4) | (tmp[4 * j + 3] << 6)
    elif width == 1:
        for j in range(m // 8):
            k = 8 * j
            out[j] = (tmp[k] | (tmp[k + 1] << 1) | (tmp[k + 2] << 2) | (tmp[k + 3] << 3)
                      | (tmp[k + 4] << 4) | (tmp[k + 5] << 5) | (tmp[k + 6] << 6) | (tmp[k + 7] << 7))
    elif width == 3:
        _pack_groups(tmp, out, 3)
    elif width == 5:
        _pack_groups(tmp, out, 5)
    elif width == 6:
        _pack_groups(tmp, out, 6)
    else:
        _pack_groups(tmp, out, 7)
    # the last partial group of 8 fields (only in the last chunk): bit by bit, zero padded
    start = (m // 8) * 8
    if width in (4, 2):
        start = (m // (8 // width)) * (8 // width)
    if start < m:
        acc = 0
        for k in range(start, m):
            acc |= np.int64(tmp[k]) << ((k - start) * width)
        byte0 = (start * width) // 8
        for b in range(((m - start) * width + 7) // 8):
            out[byte0 + b] = (acc >> (8 * b)) & 0xFF


@_inline
def _unpack(data, width, tmp):
    """Inverse of :func:`_pack`: ``tmp.size`` fields from ``data`` into ``tmp``."""
    m = tmp.size
    if width == 8:
        for i in range(m):
            tmp[i] = data[i]
        return
    if width == 4:
        for i in range(m):
            tmp[i] = (data[i >> 1] >> ((i & 1) * 4)) & 15
        return
    if width == 2:
        for i in range(m):
            tmp[i] = (data[i >> 2] >> ((i & 3) * 2)) & 3
        return
    if width == 1:
        for i in range(m):
            tmp[i] = (data[i >> 3] >> (i & 7)) & 1
        return
    if width == 3:
        _unpack_groups(data, tmp, 3)
    elif width == 5:
        _unpack_groups(data, tmp, 5)
    elif width == 6:
        _unpack_groups(data, tmp, 6)
    else:
        _unpack_groups(data, tmp, 7)
    mask = (1 << width) - 1
    for i in range((m // 8) * 8, m):
        bit = i * width
        word = np.int64(data[bit >> 3])
        if (bit & 7) + width > 8:
            word |= np.int64(data[(bit >> 3) + 1]) << 8
        tmp[i] = (word >> (bit & 7)) & mask


@_inline
def _pack_trits(tmp, out):
    """Values in {0, 1, 2} five per byte, base 3, first value least significant."""
    m = tmp.size
    full = m // 5
    for j in range(full):
        k = 5 * j
        out[j] = tmp[k] + 3 * tmp[k + 1] + 9 * tmp[k + 2] + 27 * tmp[k + 3] + 81 * tmp[k + 4]
    if full * 5 < m:
        acc = 0
        pw = 1
        for k in range(full * 5, m):
            acc += np.int64(tmp[k]) * pw
            pw *= 3
        out[full] = acc


@_inline
def _div3(b):
    return (b * 171) >> 9  # b // 3 for 0 <= b < 768


@_inline
def _unpack_trits(data, tmp):
    """Trits of ``data`` into ``tmp``; returns the number of bytes above 242 (3**5 − 1)."""
    m = tmp.size
    bad = 0
    full = m // 5
    for j in range(full):
        b = np.int32(data[j])
        bad += b > 242
        q1 = _div3(b)
        q2 = _div3(q1)
        q3 = _div3(q2)
        q4 = _div3(q3)
        tmp[5 * j] = b - 3 * q1
        tmp[5 * j + 1] = q1 - 3 * q2
        tmp[5 * j + 2] = q2 - 3 * q3
        tmp[5 * j + 3] = q3 - 3 * q4
        tmp[5 * j + 4] = q4 - 3 * _div3(q4)
    if full * 5 < m:
        b = np.int32(data[full])
        bad += b > 242
        for k in range(full * 5, m):
            tmp[k] = b % 3
            b //= 3
    return bad


# -- max-abs norms -------------------------------------------------------------------------------
@_inline
def _maxabs_bits(xs):
    """Largest ``|x|`` over ``xs`` (int32 view of float32 data) as its bit pattern: for non-NaN
    floats the integer order of the magnitude bits is the order of ``|x|``."""
    m = 0
    for i in range(xs.size):
        v = xs[i] & _ABS
        m = v if v > m else m
    return m


@_inline
def _bits_to_f32(m):
    return np.int32(m).view(np.float32)


@_inline
def _bucket_max(xi, a, b, clip):
    s = _bits_to_f32(_maxabs_bits(xi[a:b]))
    return s if s < clip else clip


@_kernel
def maxabs_scales(xi, bucket, clip, out):
    """``out[b] = min(max |x| over bucket b, clip)`` (``xi``: int32 view of the data). Buckets of
    more than 65536 elements are reduced in parallel parts; max is exact, so order does not matter."""
    n = xi.size
    nb = out.size
    part = 65536
    if bucket <= part:
        per = max(1, part // bucket)
        for g in prange((nb + per - 1) // per):
            for b in range(g * per, min(nb, (g + 1) * per)):
                out[b] = _bucket_max(xi, b * bucket, min(n, (b + 1) * bucket), clip)
        return
    ppb = (bucket + part - 1) // part
    partial = np.zeros(nb * ppb, np.int64)
    for k in prange(nb * ppb):
        b = k // ppb
        lo = b * bucket + (k % ppb) * part
        hi = min(n, (b + 1) * bucket, lo + part)
        if lo < hi:
            partial[k] = _maxabs_bits(xi[lo:hi])
    for b in range(nb):
        s = _bits_to_f32(partial[b * ppb:(b + 1) * ppb].max())
        out[b] = s if s < clip else clip


# -- mean / standard deviation (TernGrad's clip) ------------------------------------------------
@intrinsic
def _sum16_vec(typingctx, xs, nvec, shift, square, mx):
    """``Σ_k lane_k`` for the first ``16·nvec`` values, where lane ``k`` sums ``d = float64(x) −
    shift`` (or ``d²`` when ``square``) over the elements ``16g + k`` in order, and the 16 lanes
    are added up in lane order: one fixed association, whatever the hardware. Also stores the
    largest ``|x|`` seen into ``mx[0]`` (max is exact, so its order does not matter)."""
    sig = types.float64(xs, nvec, types.float64, types.boolean, mx)

    def codegen(context, builder, signature, args):
        xptr = context.make_array(signature.args[0])(context, builder, args[0]).data
        mptr = context.make_array(signature.args[4])(context, builder, args[4]).data
        count, sh, sq = args[1], args[2], args[3]
        f32, f64 = ir.FloatType(), ir.DoubleType()
        vf = ir.VectorType(f32, _LANES)
        vd = ir.VectorType(f64, _LANES)
        vi = ir.VectorType(ir.IntType(32), _LANES)
        shv = _ir_splat(builder, vd, sh)
        acc = cgutils.alloca_once_value(builder, ir.Constant(vd, [0.0] * _LANES))
        top = cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * _LANES))
        with cgutils.for_range(builder, count) as loop:
            off = builder.mul(loop.index, ir.Constant(loop.index.type, _LANES))
            v = builder.load(builder.bitcast(builder.gep(xptr, [off]), vf.as_pointer()), align=4)
            d = builder.fsub(builder.fpext(v, vd), shv)
            d = builder.select(sq, builder.fmul(d, d), d)
            builder.store(builder.fadd(builder.load(acc), d), acc)
            av = builder.bitcast(builder.and_(builder.bitcast(v, vi), ir.Constant(vi, [0x7FFFFFFF] * _LANES)), vf)
            t = builder.load(top)
            builder.store(builder.select(builder.fcmp_unordered(">", av, t), av, t), top)  # NaN wins
        vec = builder.load(acc)
        tv = builder.load(top)
        tot = ir.Constant(f64, 0.0)
        m = builder.load(mptr)
        for k in range(_LANES):
            tot = builder.fadd(tot, builder.extract_element(vec, ir.Constant(ir.IntType(32), k)))
            e = builder.fpext(builder.extract_element(tv, ir.Constant(ir.IntType(32), k)), m.type)
            m = builder.select(builder.fcmp_unordered(">", e, m), e, m)
        builder.store(m, mptr)
        return tot

    return sig, codegen


@_kernel
def sumsq_norms(x, bucket, part, out):
    """Per bucket: ``float32(sqrt(Σ float64(x)²))``, the bucket cut into parts of ``part`` values
    summed in parallel (8 interleaved float64 accumulators each), the parts added in order."""
    n = x.size
    nb = (n + bucket - 1) // bucket
    nparts = (bucket + part - 1) // part
    tmp = np.zeros(nb * nparts, np.float64)
    for t in prange(nb * nparts):
        b = t // nparts
        a = b * bucket + (t % nparts) * part
        e = min(min(n, (b + 1) * bucket), a + part)
        acc = np.zeros(8, np.float64)
        i = a
        while i + 8 <= e:
            for k in range(8):
                v = np.float64(x[i + k])
                acc[k] += v * v
            i += 8
        while i < e:
            v = np.float64(x[i])
            acc[0] += v * v
            i += 1
        tmp[t] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
    for b in prange(nb):
        tot = 0.0
        for p in range(nparts):
            tot += tmp[b * nparts + p]
        out[b] = np.float32(np.sqrt(tot))


@_inline
def _sum16(xs, shift, square, mx):
    full = xs.size // _LANES
    tot = _sum16_vec(xs, full, shift, square, mx)
    for i in range(full * _LANES, xs.size):
        d = np.float64(xs[i]) - shift
        tot += d * d if square else d
        a = np.float64(abs(xs[i]))
        mx[0] = a if not (a <= mx[0]) else mx[0]
    return tot


@_kernel
def moments(x, chunk, parts):
    """Per chunk of ``x``: ``parts[c] = (count, mean, Σ(x − mean)², max |x|)`` in float64, each
    chunk summed in two passes while it is in cache (:func:`_sum16_vec`: a fixed association)."""
    n = x.size
    for c in prange((n + chunk - 1) // chunk):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        xs = x[e0:e1]
        mx = np.zeros(1, np.float64)
        mean = _sum16(xs, 0.0, False, mx) / (e1 - e0)
        parts[c, 0] = e1 - e0
        parts[c, 1] = mean
        parts[c, 3] = mx[0]
        parts[c, 2] = _sum16(xs, mean, True, mx)


@njit(cache=True, error_model="numpy")
def combine_moments(parts):
    """Merge the chunk moments in chunk order (Chan et al.'s pairwise update): ``(σ² population,
    max |x|)``."""
    cnt = 0.0
    mean = 0.0
    m2 = 0.0
    mx = 0.0
    for c in range(parts.shape[0]):
        nb = parts[c, 0]
        tot = cnt + nb
        delta = parts[c, 1] - mean
        mean += delta * (nb / tot)
        m2 += parts[c, 2] + delta * delta * (cnt * nb / tot)
        cnt = tot
        mx = max(mx, parts[c, 3])
    return m2 / cnt, mx


# -- uniform (QSGD / MaxNorm / TernGrad) ---------------------------------------------------------
@_inline
def _uniform_fields(xs, ts, scale, s, clip, ctr, k1, k2):
    """Fields ``s + sgn(x)·min(floor(|x|·r + u), s)`` of ``xs`` (counters from ``ctr``) into ``ts``:
    16-lane vector code for the bulk, the same operations in scalar code for the tail."""
    safe = scale if scale > _ZERO else _ONE
    sf = F32(s)
    r = (_ONE / safe) * sf
    su = np.int32(s)
    p = 0
    m = xs.size
    while p < m:
        e = _run_end(ctr + p, p, m)
        base, k2h = _run_keys(ctr + p, k1, k2)
        full = (e - p) // _LANES
        _uniform_fields_vec(xs[p:e], ts[p:e], full, r, su, clip, base, k2h)
        for i in range(full * _LANES, e - p):
            v = xs[p + i]
            v = clip if v > clip else v
            v = -clip if v < -clip else v
            av = abs(v)
            a = av * r
            a = a if av > _ZERO else _ZERO  # 0·inf would be NaN for a denormal scale
            t = a + _uniform(base, i, k2h)
            mag = np.int32(sf if t > sf else t)
            ts[p + i] = su - mag if v < _ZERO else su + mag
        p = e


@_kernel
def uniform_encode(x, xi, scales, compute, s, bucket, width, clip, k1, k2, ctr0, chunk, out):
    """Quantize ``x`` with per-bucket ``scales`` (or compute them when ``compute``: max-abs, written
    to ``scales``) and pack the fields ``c + s``; ``width`` 1..8 bits, or 0 for trits."""
    n = x.size
    for c in prange((n + chunk - 1) // chunk):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        tmp = np.empty(e1 - e0, np.uint8)
        p = e0
        while p < e1:
            b = p // bucket
            bs = b * bucket
            be = min(n, bs + bucket)
            q = min(be, e1)
            if compute:
                sc = _bucket_max(xi, bs, be, clip)
                if bs >= e0:
                    scales[b] = sc
            else:
                sc = scales[b]
            _uniform_fields(x[p:q], tmp[p - e0:q - e0], sc, s, clip, ctr0 + p, k1, k2)
            p = q
        if width == 0:
            _pack_trits(tmp, out[e0 // 5:])
        else:
            _pack(tmp, width, out[(e0 * width) // 8:])


@_kernel
def uniform_decode_mean(data, offs, nbytes, scales, s, bucket, width, max_field, chunk, out):
    """Unpack + dequantize, and average over ``M`` payloads: payload ``j``'s fields are
    ``data[offs[j]:offs[j] + nbytes]`` with scales ``scales[j]``, its decode
    ``d_j = float32(field − s)·(scale_b / s)``, and ``out = (((d_0 + d_1) + d_2) + …) / M`` in float32,
    added in payload order (bit for bit what decoding each and adding left to right gives) in one
    pass that keeps each chunk of ``out`` in cache; ``M = 1`` is the plain decode. Returns the number
    of fields above ``max_field`` (trits, ``width == 0``: of bytes above 242)."""
    n = out.size
    m = offs.size
    nch = (n + chunk - 1) // chunk
    bad = np.zeros(nch, np.int64)
    sf = F32(s)
    mf = F32(m)
    for c in prange(nch):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        tmp = np.empty(e1 - e0, np.uint8)
        nbad = 0
        for j in range(m):
            row = data[offs[j]:offs[j] + nbytes]
            if width == 0:
                nbad += _unpack_trits(row[e0 // 5:], tmp)
            else:
                _unpack(row[(e0 * width) // 8:], width, tmp)
            p = e0
            while p < e1:
                b = p // bucket
                q = min((b + 1) * bucket, e1)
                mult = scales[j, b] / sf
                ts = tmp[p - e0:q - e0]
                os = out[p:q]
                if j == 0:
                    for i in range(q - p):
                        f = np.int32(ts[i])
                        nbad += f > max_field
                        os[i] = F32(f - s) * mult
                else:
                    for i in range(q - p):
                        f = np.int32(ts[i])
                        nbad += f > max_field
                        os[i] = os[i] + F32(f - s) * mult
                p = q
        if m > 1:
            os = out[e0:e1]
            for i in range(e1 - e0):
                os[i] = os[i] / mf
        bad[c] = nbad
    return bad.sum()


# -- rounding onto given levels (ORQ / Linear) ---------------------------------------------------
@_inline
def _round_sorted(xr, tr, u, lv, L):
    """Level indices for a bucket whose levels are sorted: the searchsorted position is then the
    number of levels below ``v``. ``L`` is a literal, so the loops over levels unroll into compares
    and selects (no gathers, no branches) and the element loop vectorizes."""
    for i in range(xr.size):
        v = xr[i]
        cnt = 0
        for j in range(L):
            cnt += lv[j] < v
        hi = min(cnt, L - 1)
        lo = max(hi - 1, 0)
        l_hi = lv[0]
        l_lo = lv[0]
        for j in range(1, L):
            l_hi = lv[j] if hi >= j else l_hi
            l_lo = lv[j] if lo >= j else l_lo
        gap = l_hi - l_lo
        prob = (v - l_lo) / gap if gap > _ZERO else _ZERO
        tr[i] = hi if u[i] < prob else lo


@_inline
def _round_any(xr, tr, u, lv, L):
    """Level indices by torch.searchsorted's lower-bound binary search, step for step (also right for
    rows that are not sorted, e.g. midpoints of equal denormal levels)."""
    for i in range(xr.size):
        v = xr[i]
        a = 0
        z = L
        while a < z:
            mid = a + ((z - a) >> 1)
            if not (lv[mid] >= v):
                a = mid + 1
            else:
                z = mid
        hi = min(a, L - 1)
        lo = max(hi - 1, 0)
        l_lo = lv[lo]
        gap = lv[hi] - l_lo
        prob = (v - l_lo) / gap if gap > _ZERO else _ZERO
        tr[i] = hi if u[i] < prob else lo


@_kernel
def levels_encode(x, levels, L, bucket, width, k1, k2, ctr0, chunk, out):
    """Stochastic rounding of ``x`` onto its bucket's row ``levels[b·L:(b+1)·L]`` (as
    ``round_to_levels``: ``u < (v − l_lo)/(l_hi − l_lo)`` picks the upper level); packs the level
    indices in ``width`` bits."""
    n = x.size
    for c in prange((n + chunk - 1) // chunk):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        tmp = np.empty(e1 - e0, np.uint8)
        ubuf = np.empty(1024, np.float32)
        p = e0
        while p < e1:
            b = p // bucket
            q = min((b + 1) * bucket, e1)
            lv = levels[b * L:(b + 1) * L]
            ok = True
            for j in range(L - 1):
                ok = ok and lv[j] <= lv[j + 1]
            while p < q:
                e = min(_run_end(ctr0 + p, p, q), p + ubuf.size)
                base, k2h = _run_keys(ctr0 + p, k1, k2)
                u = ubuf[:e - p]
                _fill_uniform(u, base, k2h)
                xr = x[p:e]
                tr = tmp[p - e0:e - e0]
                if ok and L == 3:
                    _round_sorted(xr, tr, u, lv, 3)
                elif ok and L == 5:
                    _round_sorted(xr, tr, u, lv, 5)
                elif ok and L == 9:
                    _round_sorted(xr, tr, u, lv, 9)
                elif ok and L == 17:
                    _round_sorted(xr, tr, u, lv, 17)
                else:
                    _round_any(xr, tr, u, lv, L)
                p = e
        _pack(tmp, width, out[(e0 * width) // 8:])


@_kernel
def levels_decode(data, levels, L, bucket, width, chunk, out):
    """``out[i] = levels[b·L + index_i]``; returns the number of indices ``≥ L`` (decoded as 0)."""
    n = out.size
    nch = (n + chunk - 1) // chunk
    bad = np.zeros(nch, np.int64)
    for c in prange(nch):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        tmp = np.empty(e1 - e0, np.uint8)
        _unpack(data[(e0 * width) // 8:], width, tmp)
        nbad = 0
        p = e0
        while p < e1:
            b = p // bucket
            q = min((b + 1) * bucket, e1)
            lv = levels[b * L:(b + 1) * L]
            ts = tmp[p - e0:q - e0]
            os = out[p:q]
            for i in range(q - p):
                f = np.int64(ts[i])
                ok = f < L
                nbad += not ok
                os[i] = lv[f if ok else 0]
            p = q
        bad[c] = nbad
    return bad.sum()


# -- one bit -------------------------------------------------------------------------------------
@_kernel
def threshold_encode(x, thresholds, bucket, chunk, out):
    """Bits ``float64(x) >= thresholds[b]`` packed 8 per byte."""
    n = x.size
    for c in prange((n + chunk - 1) // chunk):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        tmp = np.empty(e1 - e0, np.uint8)
        p = e0
        while p < e1:
            b = p // bucket
            q = min((b + 1) * bucket, e1)
            t = thresholds[b]
            xr = x[p:q]
            tr = tmp[p - e0:q - e0]
            for i in range(q - p):
                tr[i] = np.float64(xr[i]) >= t
            p = q
        _pack(tmp, 1, out[e0 // 8:])


@_kernel
def bit_decode(data, levels, per_bucket, bucket, chunk, out):
    """``per_bucket == 2``: ``out[i] = levels[2b + bit]``; ``per_bucket == 1``:
    ``out[i] = levels[b]·float32(2·bit − 1)``."""
    n = out.size
    for c in prange((n + chunk - 1) // chunk):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        tmp = np.empty(e1 - e0, np.uint8)
        _unpack(data[e0 // 8:], 1, tmp)
        p = e0
        while p < e1:
            b = p // bucket
            q = min((b + 1) * bucket, e1)
            ts = tmp[p - e0:q - e0]
            os = out[p:q]
            if per_bucket == 2:
                lo = levels[2 * b]
                hi = levels[2 * b + 1]
                for i in range(q - p):
                    os[i] = hi if ts[i] else lo
            else:
                sc = levels[b]
                for i in range(q - p):
                    os[i] = sc * F32(2 * np.int32(ts[i]) - 1)
            p = q
