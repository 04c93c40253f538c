"""Numba helpers shared by every CPU kernel module: the counter hash as 16-lane LLVM IR, max-abs bit
patterns and rounding onto levels (bit-field and trit packing: :mod:`gradq.kernels.numba_pack`).

The kernel modules (:mod:`gradq.kernels.cpu`, ``cpu_index``, ``cpu_levels``, ``cpu_binary``, ``cpu_pb``,
``cpu_multiscale``) import them from here and numba inlines them. Compiled code is cached in a directory keyed by the
sources of all those modules and this one (:mod:`gradq.kernels.numba_cache`), so an edit here
recompiles every kernel that inlines it.

Every operation is the plain IEEE float32 or wrapping-integer one, in the reference's order: fastmath
stays off, so no FMA contraction.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
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


def _ir_target_features(context) -> frozenset:
    """The CPU features numba compiles for (``+avx2`` and so on, ``NUMBA_CPU_FEATURES`` included),
    so that an intrinsic emits an instruction only where the code it goes into may use it. Numba's
    on-disk cache is keyed by the same features, so code built for one CPU is not loaded on another."""
    feats = getattr(context.codegen(), "_tm_features", "") or ""
    return frozenset(f[1:] for f in feats.split(",") if f.startswith("+"))


def _ir_vectors():
    i32, f32 = ir.IntType(32), ir.FloatType()
    vi, vf = ir.VectorType(i32, _LANES), ir.VectorType(f32, _LANES)

    def const(v):
        return ir.Constant(vi, [v & 0xFFFFFFFF] * _LANES)

    return i32, vi, vf, const, ir.Constant(vf, [_INV24] * _LANES)


def _ir_transpose(builder, regs):
    """Transpose of ``w`` vectors of ``w`` lanes each (``w`` a power of two), as block swaps of
    ``w/2, …, 2, 1`` lanes: two shuffles a pair of vectors and a step."""
    w = len(regs)
    vi = ir.VectorType(ir.IntType(32), w)
    regs = list(regs)
    t = w // 2
    while t:
        for r in range(w):
            if r & t:
                continue
            lo = [c if not c & t else w + c - t for c in range(w)]
            hi = [c + t if not c & t else w + c for c in range(w)]
            a, b = regs[r], regs[r + t]
            regs[r] = builder.shuffle_vector(a, b, ir.Constant(vi, lo))
            regs[r + t] = builder.shuffle_vector(a, b, ir.Constant(vi, hi))
        t //= 2
    return regs


def _ir_max_lane(builder, m):
    """The largest lane of the unsigned integer vector ``m`` (after a loop that kept a running
    lane-wise maximum of some fields: the corrupt-field checks of the decodes)."""
    res = builder.extract_element(m, ir.Constant(ir.IntType(32), 0))
    for j in range(1, m.type.count):
        e = builder.extract_element(m, ir.Constant(ir.IntType(32), j))
        res = builder.select(builder.icmp_unsigned(">", e, res), e, res)
    return res


def _ir_counters(builder, vi, base):
    """Counter hashes of lanes 0..15: ``base + lane·φ`` (the state advances by ``16·φ`` a step)."""
    lanes = ir.Constant(vi, [(j * 0x9E3779B9) & 0xFFFFFFFF for j in range(_LANES)])
    return cgutils.alloca_once_value(builder, builder.add(_ir_splat(builder, vi, base), lanes))


@intrinsic
def _borrowed(typingctx, arr):
    """A view of ``arr`` that numba does not reference-count (no owner). Passing an owned array to a
    function that is not inlined, or slicing it, costs an atomic increment and decrement of its
    owner's count, which two threads working on one input fight over; a borrowed view costs neither.
    The caller keeps the owner alive (:func:`_keep`) for as long as the view is used."""
    if not isinstance(arr, types.Array):
        return None
    sig = arr(arr)

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0])
        dst = context.make_array(signature.return_type)(context, builder)
        for field in ("data", "shape", "strides", "itemsize", "nitems"):
            setattr(dst, field, getattr(src, field))
        dst.meminfo = cgutils.get_null_value(dst.meminfo.type)
        dst.parent = cgutils.get_null_value(dst.parent.type)
        return dst._getvalue()

    return sig, codegen


@intrinsic
def _keep(typingctx, arr):
    """Nothing, but a use of ``arr``: numba releases an array after its last use, so a call at the
    end of a function keeps the owner of :func:`_borrowed` views alive until then."""
    return types.void(arr), lambda context, builder, signature, args: context.get_dummy_value()


def _ir_prefetch(builder, ptr):
    """Ask for the cache line at ``ptr`` (a hint: it never faults, even past the end of an array)."""
    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


@intrinsic
def _prefetch_line(typingctx, arr, i):
    """Ask for the cache line holding ``arr[i]`` (a hint: it never faults, even past the end)."""
    sig = types.void(arr, types.intp)

    def codegen(context, builder, signature, args):
        _ir_prefetch(builder, builder.gep(context.make_array(signature.args[0])(context, builder, args[0]).data,
                                          [args[1]]))
        return context.get_dummy_value()

    return sig, codegen


@_inline
def _prefetch(arr, lo, hi):
    """Ask for the cache lines of ``arr[lo:hi]`` (float32 or int32: 16 elements a line)."""
    for i in range(lo, hi, 16):
        _prefetch_line(arr, i)


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
def _hash32(typingctx, base, i, k2h):
    """The 32 random bits of element ``i`` of a run (``base``, ``k2h`` uint32 from :func:`_run_keys`):
    ``mix32(mix32(base + i·φ) ^ k2h)``, what :meth:`gradq.random.RandomStream.bits32` gives."""
    sig = types.uint32(types.uint32, i, types.uint32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        b, idx, k = args
        if idx.type.width != 32:
            idx = builder.trunc(idx, i32) if idx.type.width > 32 else builder.zext(idx, i32)
        x = builder.add(b, builder.mul(idx, ir.Constant(i32, 0x9E3779B9)))

        def const(v):
            return ir.Constant(i32, v & 0xFFFFFFFF)
        return _ir_mix32(builder, builder.xor(_ir_mix32(builder, x, const), k), const)

    return sig, codegen


def _fill_intrinsic(uniform: bool):
    """An intrinsic ``(arr, nvec, base, k2h)`` that fills ``arr[j]``, ``j < 16·nvec``, with element
    ``j`` of the run, 16 lanes at a time: its float32 uniform, or (``uniform=False``) its 32 bits."""
    @intrinsic
    def _impl(typingctx, arr, nvec, base, k2h):
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
                if uniform:
                    val, vty = _ir_uniform(builder, x, kv, const, vf, inv24), vf
                else:
                    val, vty = _ir_mix32(builder, builder.xor(_ir_mix32(builder, x, const), kv), const), vi
                builder.store(val, builder.bitcast(ptr, vty.as_pointer()), align=4)
                builder.store(builder.add(x, const(_LANES * 0x9E3779B9)), state)
            return context.get_dummy_value()

        return sig, codegen

    return _impl


#: ``arr[j]`` = the uniform of element ``j`` of the run, for ``j < 16·nvec``
_fill_uniform_vec = _fill_intrinsic(True)
#: ``arr[j]`` = the 32 random bits (:func:`_hash32`) of element ``j`` of the run, for ``j < 16·nvec``
_fill_hash_vec = _fill_intrinsic(False)


@_inline
def _fill_hash(u, base, k2h):
    """``u[i]`` = :func:`_hash32` of element ``i`` of the run ``(base, k2h)``, for all of ``u``."""
    full = u.size // _LANES
    _fill_hash_vec(u, full, base, k2h)
    for i in range(full * _LANES, u.size):
        u[i] = _hash32(base, i, k2h)


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


# -- max-abs norms -------------------------------------------------------------------------------
@intrinsic
def _bits16_vec(typingctx, xs, nvec, t, out):
    """Bits ``float64(x) ≥ t`` of the first ``16·nvec`` values of ``xs`` into ``2·nvec`` bytes of
    ``out``, first value in the least significant bit (``pack_bits(·, 1)``): a compare and a
    mask store per 16 values."""
    sig = types.void(xs, nvec, types.float64, out)

    def codegen(context, builder, signature, args):
        xptr = context.make_array(signature.args[0])(context, builder, args[0]).data
        optr = context.make_array(signature.args[3])(context, builder, args[3]).data
        vf = ir.VectorType(ir.FloatType(), _LANES)
        vd = ir.VectorType(ir.DoubleType(), _LANES)
        i16 = ir.IntType(16)
        tv = _ir_splat(builder, vd, args[2])
        with cgutils.for_range(builder, args[1]) as loop:
            off = builder.mul(loop.index, ir.Constant(loop.index.type, _LANES))
            v = builder.load(builder.bitcast(builder.gep(xptr, [off]), vf.as_pointer()), align=4)
            mask = builder.bitcast(builder.fcmp_ordered(">=", builder.fpext(v, vd), tv), i16)
            dst = builder.gep(optr, [builder.mul(loop.index, ir.Constant(loop.index.type, 2))])
            builder.store(mask, builder.bitcast(dst, i16.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@_inline
def _threshold_bits(xs, t, out):
    """Bits ``float64(x) ≥ t`` of ``xs`` packed into ``out`` (whole bytes, the last one zero padded)."""
    full = xs.size // _LANES
    _bits16_vec(xs, full, t, out)
    for j in range(2 * full, (xs.size + 7) // 8):
        acc = 0
        for k in range(8 * j, min(xs.size, 8 * j + 8)):
            acc |= np.int64(np.float64(xs[k]) >= t) << (k - 8 * j)
        out[j] = acc


@_inline
def _maxabs_bits(xs):
    """Largest ``|x|`` over ``xs`` (int32 view of float32 data) as its bit pattern: for non-NaN
    floats the integer order of the magnitude bits is the order of ``|x|``. In int32 throughout:
    with an int64 accumulator each value was widened first, a quarter slower."""
    m = np.int32(0)
    mask = np.int32(_ABS)
    for i in range(xs.size):
        v = xs[i] & mask
        m = v if v > m else m
    return m


@_inline
def _count_above(ts, limit):
    """How many of the fields ``ts`` exceed ``limit``: the slow path of a decode whose fields'
    maximum (a reduction that vectorizes) exceeded it, so it runs on corrupt payloads only."""
    k = 0
    for i in range(ts.size):
        k += ts[i] > limit
    return k


@_inline
def _bits_to_f32(m):
    return np.int32(m).view(np.float32)


@_inline
def _bucket_max(xi, a, b, clip):
    s = _bits_to_f32(_maxabs_bits(xi[a:b]))
    return s if s < clip else clip


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
