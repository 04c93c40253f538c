"""Numba CPU sort of sixteen buckets at once, one bucket a lane: the first stage of Linear's and ORQ's
levels (:mod:`gradq.kernels.cpu_levels`, :mod:`gradq.kernels.cpu_orq_lanes`) for buckets of 16 to
512 values, a power of two.

:mod:`gradq.kernels.cpu_sort` sorts one bucket in 16-lane vectors, so half of its network's stages
cross lanes (a shuffle each, on the one port that runs them) and the sorted row is transposed at the
end. Here the vectors hold one position of sixteen buckets: ``T[p]`` (``p < P``) has element ``p`` of
bucket ``b`` in lane ``b``. The same bitonic network (mirror stages, then half-cleaners, every
exchange ascending) then runs only between vectors, a minimum and a maximum per exchange serving
sixteen buckets, and each lane ends up sorted:

* positions ``16q … 16q + 15`` are sorted and finished in registers (``cpu_sort``'s group
  intrinsics, which treat a vector as a unit);
* a merge's mirror stage pairs block ``a`` of 16 vectors with the reversed partner block
  (:func:`_mirror_blocks`);
* its half-cleaners at distances of 16 or more run on the 16 vectors ``f + 16u`` in registers
  (:func:`_strided`), those below 16 inside each block.

An exchange gives the lower slot ``x < y ? x : y`` and the upper ``y > x ? y : x``, as in
``cpu_sort``, so every lane is a permutation of its bucket's bit patterns and equal to the
reference's order unless the bucket holds zeros of both signs; such a bucket, and one with a NaN or
an infinity, is reported in the returned lane mask for the caller to sort on its own.

Compiled code is cached in the kernels' keyed directory (:mod:`gradq.kernels.numba_cache`).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu_sort import _EXP, _NEG0, _group_finish, _group_intrinsic, _group_sort, _ir_max, _ir_min
from .numba_common import _ir_transpose

_W = 16
LANES_MAX = 512   # longest bucket sorted here: the half-cleaners at distances ≥ 16 fit one strided pass

_inline = njit(inline="always", cache=True, error_model="numpy")


def _vf():
    return ir.VectorType(ir.FloatType(), _W)


def _vec_ptrs(context, builder, arrty, arr, positions):
    """Pointers to the vectors at ``positions`` (intp values) of the float32 array ``arr``."""
    i64 = ir.IntType(64)
    data = context.make_array(arrty)(context, builder, arr).data
    return [builder.bitcast(builder.gep(data, [builder.mul(p, ir.Constant(i64, _W))]), _vf().as_pointer())
            for p in positions]


@intrinsic
def _lanes_in(typingctx, x, first, P, T):
    """``T[p]`` lane ``b`` = ``x[first + b·P + p]`` for ``p < P`` (``P`` a multiple of 16), by 16 × 16
    transposes; returns the lanes (bit ``b``) whose bucket holds a NaN or an infinity, or zeros of
    both signs."""
    sig = types.int64(x, first, P, T)

    def codegen(context, builder, signature, args):
        i64, i32 = ir.IntType(64), ir.IntType(32)
        vf, vi = _vf(), ir.VectorType(i32, _W)
        vb = ir.VectorType(ir.IntType(1), _W)
        xptr = context.make_array(signature.args[0])(context, builder, args[0]).data
        first = context.cast(builder, args[1], signature.args[1], types.intp)
        P = context.cast(builder, args[2], signature.args[2], types.intp)
        ptrs = _vec_ptrs(context, builder, signature.args[3], args[3], [ir.Constant(i64, 0)])
        tbase = builder.bitcast(ptrs[0], vf.as_pointer())
        none = ir.Constant(vb, [0] * _W)
        acc = [cgutils.alloca_once_value(builder, none) for _ in range(3)]   # non-finite, +0, −0
        exp, neg0 = ir.Constant(vi, [_EXP] * _W), ir.Constant(vi, [_NEG0] * _W)
        zero = ir.Constant(vi, [0] * _W)
        with cgutils.for_range(builder, builder.sdiv(P, ir.Constant(i64, _W))) as loop:
            c16 = builder.mul(loop.index, ir.Constant(i64, _W))
            regs = []
            for b in range(_W):
                off = builder.add(builder.add(first, builder.mul(ir.Constant(i64, b), P)), c16)
                regs.append(builder.load(builder.bitcast(builder.gep(xptr, [off]), vf.as_pointer()), align=4))
            regs = _ir_transpose(builder, regs)
            bad, pz, nz = (builder.load(a) for a in acc)
            for t in range(_W):
                bits = builder.bitcast(regs[t], vi)
                bad = builder.or_(bad, builder.icmp_unsigned("==", builder.and_(bits, exp), exp))
                pz = builder.or_(pz, builder.icmp_unsigned("==", bits, zero))
                nz = builder.or_(nz, builder.icmp_unsigned("==", bits, neg0))
                builder.store(regs[t], builder.gep(tbase, [builder.add(c16, ir.Constant(i64, t))]), align=64)
            for a, v in zip(acc, (bad, pz, nz)):
                builder.store(v, a)
        bad, pz, nz = (builder.load(a) for a in acc)
        mask = builder.bitcast(builder.or_(bad, builder.and_(pz, nz)), ir.IntType(_W))
        return builder.zext(mask, i64)

    return sig, codegen


@intrinsic
def _mirror_blocks(typingctx, T, a, b):
    """The mirror exchange of block ``a`` (vectors ``16a …``, the lower) with block ``b`` reversed:
    ``T[16a + t]`` against ``T[16b + 15 − t]``."""
    sig = types.void(T, a, b)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        a16 = builder.mul(context.cast(builder, args[1], signature.args[1], types.intp), ir.Constant(i64, _W))
        b16 = builder.mul(context.cast(builder, args[2], signature.args[2], types.intp), ir.Constant(i64, _W))
        pa = _vec_ptrs(context, builder, signature.args[0], args[0],
                       [builder.add(a16, ir.Constant(i64, t)) for t in range(_W)])
        pb = _vec_ptrs(context, builder, signature.args[0], args[0],
                       [builder.add(b16, ir.Constant(i64, _W - 1 - t)) for t in range(_W)])
        xs = [builder.load(q, align=64) for q in pa]
        ys = [builder.load(q, align=64) for q in pb]
        for t in range(_W):
            builder.store(_ir_min(builder, xs[t], ys[t]), pa[t], align=64)
            builder.store(_ir_max(builder, ys[t], xs[t]), pb[t], align=64)
        return context.get_dummy_value()

    return sig, codegen


# vectors ``f + 16u`` (``u < 16``): the vertical stages at ``u``-distances ``top, …, 2, 1``
_strided1, _strided2, _strided4, _strided8 = (_group_intrinsic(_W, [t >> s for s in range(t.bit_length())], _W)
                                              for t in (1, 2, 4, 8))


@_inline
def _strided(T, f, top):
    if top == 8:
        _strided8(T, f)
    elif top == 4:
        _strided4(T, f)
    elif top == 2:
        _strided2(T, f)
    else:
        _strided1(T, f)


@_inline
def _network(T, P):
    """Sort every lane of ``T[:P]`` (``P`` a power of two, 16 … :data:`LANES_MAX`)."""
    nblk = P // _W
    for i in range(nblk):
        _group_sort(T, i, _W)
    k = 2 * _W
    while k <= P:
        kb = k // _W                          # blocks in a merge of k
        for a in range(nblk):
            r = a % kb
            if r < kb // 2:
                _mirror_blocks(T, a, a - r + kb - 1 - r)
        top = k // (4 * _W)                   # the half-cleaners at distances k/4 … 16, as u-distances
        if top >= 1:
            for w0 in range(0, nblk, _W):
                for r in range(_W):
                    _strided(T, w0 * _W + r, top)
        for i in range(nblk):
            _group_finish(T, i, _W)
        k *= 2


@_inline
def sort_lanes(x, first, P, T):
    """Sort buckets ``x[first + b·P : first + (b + 1)·P]``, ``b < 16``, into the lanes of ``T[:P]``;
    returns the lanes whose bucket must be sorted on its own (NaN, infinity, or both zeros)."""
    bad = _lanes_in(x, first, P, T)
    _network(T, P)
    return bad

