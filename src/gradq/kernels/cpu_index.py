"""Numba CPU kernels for index codes: stochastic rounding onto given levels and its decode by
table look-up (ORQ, Linear), and one-bit codes (threshold bits and their two-value decode).

The conventions are those of :mod:`gradq.kernels.cpu` (counter-based randomness, little-endian bit
fields, chunks of a multiple of 40 elements, the same bytes on any number of threads), which
re-exports these kernels. Compiled code is cached in the kernels' keyed directory
(:mod:`gradq.kernels.numba_cache`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .numba_common import (_LANES, F32, _count_above, _fill_uniform, _ir_max_lane, _ir_splat, _ir_target_features,
                           _ir_vectors, _kernel, _round_any, _round_sorted, _run_end, _run_keys, _threshold_bits)
from .numba_pack import _pack, _unpack


# -- rounding onto given levels (ORQ / Linear) ---------------------------------------------------
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


def _lookup_intrinsic(T):
    """``os[i] = table[ts[i]]`` for the first ``16·nvec`` fields (each below ``T``, 16 or 32;
    ``table`` holds ``T`` float32); returns their largest field. The table is cut into pieces of 16
    (AVX-512) or 8 (AVX2) entries, each looked up by one permute, and the pieces chosen by selects on
    the field; other CPUs take a chain of ``T − 1`` selects."""
    @intrinsic
    def _impl(typingctx, ts, os, nvec, table):
        sig = types.uint8(ts, os, nvec, table)

        def codegen(context, builder, signature, args):
            tptr = context.make_array(signature.args[0])(context, builder, args[0]).data
            optr = context.make_array(signature.args[1])(context, builder, args[1]).data
            lptr = context.make_array(signature.args[3])(context, builder, args[3]).data
            i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
            vb = ir.VectorType(i8, _LANES)
            _, vi, vf, const, _ = _ir_vectors()
            feats = _ir_target_features(context)
            lanes, name = (16, "llvm.x86.avx512.permvar.sf.512") if "avx512f" in feats else (
                (8, "llvm.x86.avx2.permps") if "avx2" in feats else (0, ""))

            def piece(v, start, count):  # lanes start … start + count − 1 of a vector
                return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                              ir.Constant(ir.VectorType(i32, count), list(range(start, start + count))))

            if lanes:
                vfp, vip = ir.VectorType(f32, lanes), ir.VectorType(i32, lanes)
                perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vfp, [vfp, vip]), name)
                tabs = [builder.load(builder.bitcast(builder.gep(lptr, [ir.Constant(ir.IntType(64), k)]),
                                                     vfp.as_pointer()), align=4) for k in range(0, T, lanes)]

                def look(idx):
                    parts = []
                    for h in range(0, _LANES, lanes):
                        ih = idx if lanes == _LANES else piece(idx, h, lanes)
                        r = builder.call(perm, [tabs[0], ih])
                        for k in range(1, len(tabs)):
                            above = builder.icmp_unsigned(">", ih, ir.Constant(vip, [k * lanes - 1] * lanes))
                            r = builder.select(above, builder.call(perm, [tabs[k], ih]), r)
                        parts.append(r)
                    return parts[0] if len(parts) == 1 else builder.shuffle_vector(
                        parts[0], parts[1], ir.Constant(vi, list(range(_LANES))))
            else:
                entries = [_ir_splat(builder, vf, builder.load(builder.gep(lptr, [ir.Constant(ir.IntType(64), j)])))
                           for j in range(T)]

                def look(idx):
                    v = entries[0]
                    for j in range(1, T):
                        v = builder.select(builder.icmp_unsigned("==", idx, const(j)), entries[j], v)
                    return v

            top = cgutils.alloca_once_value(builder, ir.Constant(vb, [0] * _LANES))
            with cgutils.for_range(builder, args[2]) as loop:
                off = builder.mul(loop.index, ir.Constant(loop.index.type, _LANES))
                f = builder.load(builder.bitcast(builder.gep(tptr, [off]), vb.as_pointer()), align=1)
                m = builder.load(top)
                builder.store(builder.select(builder.icmp_unsigned(">", f, m), f, m), top)
                builder.store(look(builder.zext(f, vi)),
                              builder.bitcast(builder.gep(optr, [off]), vf.as_pointer()), align=4)
            return _ir_max_lane(builder, builder.load(top))

        return sig, codegen

    return _impl


_lookup16, _lookup32 = _lookup_intrinsic(16), _lookup_intrinsic(32)


@_kernel
def levels_decode(data, levels, L, bucket, width, chunk, out):
    """``out[i] = levels[b·L + index_i]``; returns the number of indices ``≥ L`` (decoded as 0).
    Indices of up to 5 bits look their bucket's row up in a table of 16 or 32 entries (the row,
    then ``levels[b·L]`` for the indices it does not have), 16 at a time."""
    n = out.size
    nch = (n + chunk - 1) // chunk
    bad = np.zeros(nch, np.int64)
    tsize = 16 if width <= 4 else 32
    for c in prange(nch):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        tmp = np.empty(e1 - e0, np.uint8)
        table = np.empty(tsize, np.float32)
        _unpack(data[(e0 * width) // 8:], width, tmp)
        nbad = 0
        p = e0
        while p < e1:
            b = p // bucket
            q = min((b + 1) * bucket, e1)
            lv = levels[b * L:(b + 1) * L]
            ts = tmp[p - e0:q - e0]
            os = out[p:q]
            if width <= 5:
                for j in range(tsize):
                    table[j] = lv[j] if j < L else lv[0]
                full = (q - p) // _LANES
                if tsize == 16:
                    mx = _lookup16(ts, os, full, table)
                else:
                    mx = _lookup32(ts, os, full, table)
                for i in range(full * _LANES, q - p):
                    f = ts[i]
                    mx = max(mx, f)
                    os[i] = table[f]
            else:
                mx = np.uint8(0)
                for i in range(q - p):
                    f = ts[i]
                    mx = max(mx, f)
                    os[i] = lv[f if f < L else 0]
            if mx >= L:
                nbad += _count_above(ts, L - 1)
            p = q
        bad[c] = nbad
    return bad.sum()


# -- one bit -------------------------------------------------------------------------------------
@_kernel
def threshold_encode(x, thresholds, bucket, chunk, out):
    """Bits ``float64(x) >= thresholds[b]`` packed 8 per byte; straight into ``out``, 16 at a
    time, when buckets and chunks start on whole pairs of bytes (both multiples of 16 long)."""
    n = x.size
    direct = bucket % _LANES == 0 and chunk % _LANES == 0
    for c in prange((n + chunk - 1) // chunk):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        tmp = np.empty(0 if direct else e1 - e0, np.uint8)
        p = e0
        while p < e1:
            b = p // bucket
            q = min((b + 1) * bucket, e1)
            t = thresholds[b]
            xr = x[p:q]
            if direct:
                _threshold_bits(xr, t, out[p // 8:])
            else:
                tr = tmp[p - e0:q - e0]
                for i in range(q - p):
                    tr[i] = np.float64(xr[i]) >= t
            p = q
        if not direct:
            _pack(tmp, 1, out[e0 // 8:])


@intrinsic
def _select16_vec(typingctx, bits, nvec, lo, hi, os):
    """``os[i] = hi`` where bit ``i`` of ``bits`` is set, else ``lo``, for the first ``16·nvec``
    values: two bytes of the payload select 16 lanes."""
    sig = types.void(bits, nvec, types.float32, types.float32, os)

    def codegen(context, builder, signature, args):
        bptr = context.make_array(signature.args[0])(context, builder, args[0]).data
        optr = context.make_array(signature.args[4])(context, builder, args[4]).data
        _, _, vf, _, _ = _ir_vectors()
        i16 = ir.IntType(16)
        vlo, vhi = _ir_splat(builder, vf, args[2]), _ir_splat(builder, vf, args[3])
        with cgutils.for_range(builder, args[1]) as loop:
            word = builder.load(builder.bitcast(builder.gep(bptr, [builder.mul(loop.index, ir.Constant(
                loop.index.type, 2))]), i16.as_pointer()), align=1)
            mask = builder.bitcast(word, ir.VectorType(ir.IntType(1), _LANES))
            off = builder.mul(loop.index, ir.Constant(loop.index.type, _LANES))
            builder.store(builder.select(mask, vhi, vlo), builder.bitcast(builder.gep(optr, [off]),
                                                                            vf.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@_kernel
def bit_decode(data, levels, per_bucket, bucket, chunk, out):
    """``per_bucket == 2``: ``out[i] = levels[2b + bit]``; ``per_bucket == 1``:
    ``out[i] = levels[b]·float32(2·bit − 1)`` (both products taken once a bucket). Where buckets
    and chunks are multiples of 16 long, 16 bits at a time select between the bucket's two values
    straight from the payload, with no byte per bit."""
    n = out.size
    direct = bucket % _LANES == 0 and chunk % _LANES == 0
    for c in prange((n + chunk - 1) // chunk):
        e0 = c * chunk
        e1 = min(n, e0 + chunk)
        tmp = np.empty(0 if direct else e1 - e0, np.uint8)
        if not direct:
            _unpack(data[e0 // 8:], 1, tmp)
        p = e0
        while p < e1:
            b = p // bucket
            q = min((b + 1) * bucket, e1)
            if per_bucket == 2:
                lo = levels[2 * b]
                hi = levels[2 * b + 1]
            else:
                sc = levels[b]
                lo = sc * F32(-1)
                hi = sc * F32(1)
            os = out[p:q]
            if direct:
                full = (q - p) // _LANES
                _select16_vec(data[p // 8:], full, lo, hi, os)
                for i in range(full * _LANES, q - p):
                    os[i] = hi if (data[(p + i) >> 3] >> ((p + i) & 7)) & 1 else lo
            else:
                ts = tmp[p - e0:q - e0]
                for i in range(q - p):
                    os[i] = hi if ts[i] else lo
            p = q
