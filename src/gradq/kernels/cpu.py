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

from .numba_common import (_LANES, _ONE, _PREFETCH, _ZERO, F32, _bits_to_f32, _bucket_max, _count_above, _inline,
                           _ir_counters, _ir_max_lane, _ir_splat, _ir_uniform, _ir_vectors, _kernel, _maxabs_bits,
                           _run_end, _run_keys, _uniform)
from .numba_pack import _pack, _pack_trits, _unpack, _unpack_trits

from .reference import FLOAT32_MAX as _FLOAT32_MAX  # noqa: E402  (numba reads it as a constant)


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
    """Per bucket: ``float32(sqrt(Σ float64(x)²))`` (saturating at the largest float32 when the
    input is finite), the bucket cut into parts of ``part`` values summed in parallel (16 float64
    lanes each, added in lane order), the parts added in order. The order of a float64 sum does not
    change the float32 norm (:func:`gradq.kernels.reference.bucket_norms`); this one vectorizes,
    where eight scalar accumulators ran 5× slower."""
    n = x.size
    nb = (n + bucket - 1) // bucket
    nparts = (bucket + part - 1) // part
    tmp = np.zeros(nb * nparts, np.float64)
    top = np.zeros(nb * nparts, np.float64)   # the largest |x| of each part, which _sum16 also gives
    for t in prange(nb * nparts):
        b = t // nparts
        a = b * bucket + (t % nparts) * part
        e = min(min(n, (b + 1) * bucket), a + part)
        tmp[t] = _sum16(x[a:e], 0.0, True, top[t:t + 1])
    for b in prange(nb):
        tot = 0.0
        for p in range(nparts):
            tot += tmp[b * nparts + p]
        out[b] = _l2_root(tot)


@_inline
def _l2_root(tot):
    """``float32(sqrt(tot))``; a finite norm above the largest float32 saturates at it
    (:func:`gradq.kernels.reference.saturate_norm`)."""
    root = np.sqrt(tot)
    if root < np.inf:
        root = min(root, _FLOAT32_MAX)
    return np.float32(root)


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
    """Quantize ``x`` with per-bucket ``scales`` and pack the fields ``c + s``; ``width`` 1..8
    bits, or 0 for trits. ``compute`` 1 or 2: each bucket's scale is computed first while it is in
    cache (1: max-abs; 2: the L2 norm, as :func:`sumsq_norms`) and written to ``scales``."""
    n = x.size
    for c in prange((n + chunk - 1) // chunk):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        tmp = np.empty(e1 - e0, np.uint8)
        top = np.zeros(1, np.float64)
        p = e0
        while p < e1:
            b = p // bucket
            bs = b * bucket
            be = min(n, bs + bucket)
            q = min(be, e1)
            if compute:
                sc = _bucket_max(xi, bs, be, clip) if compute == 1 else _l2_root(_sum16(x[bs:be], 0.0, True, top))
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


def _dequant_intrinsic(width, add):
    """Fields of ``width`` ∈ {2, 4, 8} bits read straight from the payload, 16 a step (``16·width/8``
    bytes), as :func:`uniform_decode_mean`'s loop computes them: ``float32(field − s)·mult``, stored
    (``add``: added to what ``out`` holds, a separate IEEE add). Returns the largest field."""
    @intrinsic
    def _impl(typingctx, row, nvec, s, mult, out):
        sig = types.uint8(row, nvec, types.int32, types.float32, out)

        def codegen(context, builder, signature, args):
            i32, vi, vf, const, _ = _ir_vectors()
            i8 = ir.IntType(8)
            vb = ir.VectorType(i8, _LANES)
            per = _LANES * width // 8                      # payload bytes a step
            vin = ir.VectorType(i8, per)
            rptr = builder.bitcast(context.make_array(signature.args[0])(context, builder, args[0]).data,
                                   vin.as_pointer())
            optr = builder.bitcast(context.make_array(signature.args[4])(context, builder, args[4]).data,
                                   vf.as_pointer())
            count = context.cast(builder, args[1], signature.args[1], types.intp)
            sv, mv = _ir_splat(builder, vi, args[2]), _ir_splat(builder, vf, args[3])
            k = 8 // width                                 # fields a byte, the lowest bits first
            spread = ir.Constant(vi, [lane // k for lane in range(_LANES)])
            shifts = ir.Constant(vb, [(lane % k) * width for lane in range(_LANES)])
            mask = ir.Constant(vb, [(1 << width) - 1] * _LANES)
            top = cgutils.alloca_once_value(builder, ir.Constant(vb, [0] * _LANES))
            with cgutils.for_range(builder, count) as loop:
                raw = builder.load(builder.gep(rptr, [loop.index]), align=1)
                if width == 8:
                    f = raw
                else:
                    wide = builder.shuffle_vector(raw, ir.Constant(vin, ir.Undefined), spread)
                    f = builder.and_(builder.lshr(wide, shifts), mask)
                m = builder.load(top)
                builder.store(builder.select(builder.icmp_unsigned(">", f, m), f, m), top)
                v = builder.fmul(builder.sitofp(builder.sub(builder.zext(f, vi), sv), vf), mv)
                q = builder.gep(optr, [loop.index])
                if add:
                    v = builder.fadd(builder.load(q, align=4), v)
                builder.store(v, q, align=4)
            return _ir_max_lane(builder, builder.load(top))

        return sig, codegen

    return _impl


_deq2, _deq4, _deq8, _deq2_add, _deq4_add, _deq8_add = (_dequant_intrinsic(w, a) for a in (False, True)
                                                        for w in (2, 4, 8))


@_inline
def _dequant_vec(row, nvec, width, s, mult, out, add):
    """:func:`_dequant_intrinsic` for this ``width`` and ``add``."""
    if add:
        if width == 4:
            return _deq4_add(row, nvec, s, mult, out)
        if width == 2:
            return _deq2_add(row, nvec, s, mult, out)
        return _deq8_add(row, nvec, s, mult, out)
    if width == 4:
        return _deq4(row, nvec, s, mult, out)
    if width == 2:
        return _deq2(row, nvec, s, mult, out)
    return _deq8(row, nvec, s, mult, out)


@_inline
def _dequant_bytes(ts, os, s, mult, first, max_field):
    """``os = float32(field − s)·mult`` (``first``) or ``os += …`` for the byte-a-field ``ts``;
    returns how many fields exceed ``max_field``. The largest field rides along (a max reduction
    vectorizes; a count in the loop did not); fields are counted only where there are some."""
    mx = np.uint8(0)
    if first:
        for i in range(ts.size):
            f = ts[i]
            mx = max(mx, f)
            os[i] = F32(np.int32(f) - s) * mult
    else:
        for i in range(ts.size):
            f = ts[i]
            mx = max(mx, f)
            os[i] = os[i] + F32(np.int32(f) - s) * mult
    return _count_above(ts, max_field) if mx > max_field else 0


@_kernel
def uniform_decode_mean(data, offs, nbytes, scales, s, bucket, width, max_field, chunk, out):
    """Unpack + dequantize, and average over ``M`` payloads: payload ``j``'s fields are
    ``data[offs[j]:offs[j] + nbytes]`` with scales ``scales[j]``, its decode
    ``d_j = float32(field − s)·(scale_b / s)``, and ``out = (((d_0 + d_1) + d_2) + …) / M`` in float32,
    added in payload order (bit for bit what decoding each and adding left to right gives) in one
    pass that keeps each chunk of ``out`` in cache; ``M = 1`` is the plain decode. Returns the number
    of fields above ``max_field`` (trits, ``width == 0``: of bytes above 242).

    Fields of 2, 4 or 8 bits in buckets a multiple of 16 long are read straight from the payload
    into 16-lane vectors (:func:`_dequant_intrinsic`), with no byte per field in between; a bucket's
    last ``< 16`` fields, and other widths, are unpacked first."""
    n = out.size
    m = offs.size
    nch = (n + chunk - 1) // chunk
    bad = np.zeros(nch, np.int64)
    sf = F32(s)
    mf = F32(m)
    # every bucket (and chunk) starts on a 16-field step: 2-, 4- and 8-bit fields go straight into lanes
    direct = (width == 2 or width == 4 or width == 8) and bucket % _LANES == 0 and chunk % _LANES == 0
    for c in prange(nch):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        tmp = np.empty(e1 - e0, np.uint8)
        nbad = 0
        for j in range(m):
            row = data[offs[j]:offs[j] + nbytes]
            if direct:   # fields read straight from the payload; a bucket's tail through tmp
                p = e0
                while p < e1:
                    b = p // bucket
                    q = min((b + 1) * bucket, e1)
                    mult = scales[j, b] / sf
                    full = (q - p) // _LANES
                    mx = _dequant_vec(row[(p * width) // 8:], full, width, s, mult, out[p:q], j > 0)
                    r = p + full * _LANES
                    if mx > max_field:
                        _unpack(row[(p * width) // 8:], width, tmp[:r - p])
                        nbad += _count_above(tmp[:r - p], max_field)
                    if r < q:
                        _unpack(row[(r * width) // 8:], width, tmp[:q - r])
                        nbad += _dequant_bytes(tmp[:q - r], out[r:q], s, mult, j == 0, max_field)
                    p = q
                continue
            if width == 0:
                nbad += _unpack_trits(row[e0 // 5:], tmp)
            else:
                _unpack(row[(e0 * width) // 8:], width, tmp)
            p = e0
            while p < e1:
                b = p // bucket
                q = min((b + 1) * bucket, e1)
                mult = scales[j, b] / sf
                nbad += _dequant_bytes(tmp[p - e0:q - e0], out[p:q], s, mult, j == 0, max_field)
                p = q
        if m > 1:
            os = out[e0:e1]
            for i in range(e1 - e0):
                os[i] = os[i] / mf
        bad[c] = nbad
    return bad.sum()


# the index codes (ORQ / Linear level indices, one-bit codes) live in cpu_index; loaded with this module
from .cpu_index import bit_decode, levels_decode, levels_encode, threshold_encode  # noqa: E402,F401  (re-exported)
