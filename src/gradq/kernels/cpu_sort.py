"""Numba CPU sort of one bucket in the order of the reference: the first stage of ORQ's and Linear's
levels (:mod:`gradq.kernels.cpu_levels`).

:func:`gradq.kernels.reference.sort_rows` sorts each bucket in the order of its order-preserving
integer keys (``−0.0`` before ``+0.0``). Float32 values that compare equal are bitwise equal except
the two zeros, so any correct sort gives the reference's row unless the bucket holds zeros of both
signs. :func:`_sort_row` takes rows of up to :data:`_VSORT_MAX` values with one sign of zero through
a bitonic network on 16-lane vectors (LLVM IR, padded with ``+inf``), and longer rows and rows with
both zeros through an LSD radix sort on those integer keys. It reports what it saw (flags: +0, −0, a
non-finite value; a row with a non-finite value is left unsorted).

Compiled code is cached in the kernels' keyed directory (:mod:`gradq.kernels.numba_cache`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .numba_common import _ir_transpose

_INF = np.float32(np.inf)
_NEG0 = -2147483648            # int32 bit pattern of -0.0
_EXP = 0x7F800000
_VSORT_MAX = 2048              # longest row for the bitonic network (padded to a power of two)
_FLAG_POS0, _FLAG_NEG0, _FLAG_NONFINITE = 1, 2, 4
_FLAG_COLUMNS = 8              # the sorted row was left in the network's layout (see _sort_row)

_inline = njit(inline="always", cache=True, error_model="numpy")
_func = njit(cache=True, error_model="numpy")


# -- bitonic network on 16-lane vectors (LLVM IR) ---------------------------------------------------
# A padded row of N = 16·V values (V a power of two) lives in V vectors; element ``e`` of the network
# is lane ``e // V`` of vector ``e % V`` (column-major), so an exchange at distance ``j < V`` pairs
# the same lane of vectors ``v`` and ``v ^ j`` (a plain vector min/max, no shuffle) and only
# distances ``≥ V`` need lane permutations. Each merge of size ``k`` is a mirror stage (partner
# ``e ^ (k − 1)``) followed by half-cleaners (partner ``e ^ j``, ``j = k/4 … 1``); every exchange
# is ascending. Stages inside a group of up to 16 vectors run in registers, and so do the stages of
# a merge that follow its mirror across lanes: the half-cleaners inside lanes always, and the first
# one between vectors too in rows of 32 vectors or more (four vectors at a time), so each such group
# of stages loads and stores the row once. The sorted row is then
# transposed to the usual order. An exchange gives the lower slot ``x < y ? x : y`` and the upper
# ``y > x ? y : x`` (x86 min/max), which keeps the bit patterns a permutation even for ±0.
_W = 16


def _irtypes():
    return (ir.VectorType(ir.FloatType(), _W), ir.VectorType(ir.IntType(32), _W),
            ir.VectorType(ir.IntType(1), _W))


def _vec_ptr(context, builder, arrty, arr, idx, idx_ty):
    vf = _irtypes()[0]
    data = context.make_array(arrty)(context, builder, arr).data
    i = context.cast(builder, idx, idx_ty, types.intp)
    return builder.bitcast(builder.gep(data, [builder.mul(i, ir.Constant(i.type, _W))]), vf.as_pointer())


def _ir_min(builder, x, y):
    return builder.select(builder.fcmp_ordered("<", x, y), x, y)


def _ir_max(builder, x, y):
    return builder.select(builder.fcmp_ordered(">", x, y), x, y)


def _ir_perm(builder, v, idx):
    vf, vi, _ = _irtypes()
    return builder.shuffle_vector(v, ir.Constant(vf, ir.Undefined), ir.Constant(vi, idx))


def _ir_lane_stage(builder, v, mask):
    """Exchange lane ``l`` with lane ``l ^ mask``; the lower lane keeps the smaller value."""
    _, _, vb = _irtypes()
    sh = _ir_perm(builder, v, [i ^ mask for i in range(_W)])
    low = ir.Constant(vb, [int(i < (i ^ mask)) for i in range(_W)])
    return builder.select(low, _ir_min(builder, v, sh), _ir_max(builder, v, sh))


def _ir_vertical(regs, builder, masks):
    """Vertical stages on a list of vectors: for each mask, vector ``i`` (lower) against ``i ^ mask``."""
    for m in masks:
        for i in range(len(regs)):
            p = i ^ m
            if p > i:
                x, y = regs[i], regs[p]
                regs[i], regs[p] = _ir_min(builder, x, y), _ir_max(builder, y, x)
    return regs


def _network_masks(g):
    """(mirror, half-cleaner …) masks of the full bitonic sort of ``g`` elements."""
    out = []
    k = 2
    while k <= g:
        out.append(k - 1)
        j = k // 4
        while j >= 1:
            out.append(j)
            j //= 2
        k *= 2
    return out


def _group_intrinsic(g, masks, stride=0):
    """Load vectors ``[i·g, (i+1)·g)`` (with a ``stride``: vectors ``i + stride·t``, ``t < g``), apply
    the vertical stages ``masks``, store them back."""
    @intrinsic
    def _impl(typingctx, buf, i):
        sig = types.void(buf, i)

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            base = context.cast(builder, args[1], signature.args[1], types.intp)
            first = base if stride else builder.mul(base, ir.Constant(i64, g))
            ptr = _vec_ptr(context, builder, signature.args[0], args[0], first, types.intp)
            ptrs = [builder.gep(ptr, [ir.Constant(i64, t * (stride or 1))]) for t in range(g)]
            regs = [builder.load(q, align=4) for q in ptrs]
            regs = _ir_vertical(regs, builder, masks)
            for q, r in zip(ptrs, regs):
                builder.store(r, q, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return _impl


# (numba resolves globals by name, so every variant gets its own)
_gsort2, _gsort4, _gsort8, _gsort16 = (_group_intrinsic(g, _network_masks(g)) for g in (2, 4, 8, 16))
_gfinish2, _gfinish4, _gfinish8, _gfinish16 = (_group_intrinsic(g, [g >> t for t in range(1, g.bit_length())])
                                               for g in (2, 4, 8, 16))


def _lanes_intrinsic(masks):
    """In-lane stages ``masks`` on vector ``i``."""
    @intrinsic
    def _impl(typingctx, buf, i):
        sig = types.void(buf, i)

        def codegen(context, builder, signature, args):
            ptr = _vec_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
            v = builder.load(ptr, align=4)
            for m in masks:
                v = _ir_lane_stage(builder, v, m)
            builder.store(v, ptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return _impl


def _cleaners(lm):
    """The in-lane half-cleaners that follow a mirror across lanes ``l ^ lm`` in the same merge:
    lane distances ``(lm + 1)/4, …, 1``."""
    top = (lm + 1) // 4
    return [top >> s for s in range(top.bit_length())]


_lone1, _lone3, _lone7, _lone15 = (_lanes_intrinsic([m] + _cleaners(m)) for m in (1, 3, 7, 15))


@intrinsic
def _vx(typingctx, buf, i, j):
    """Vectors ``i`` (lower) and ``j``: element-wise min / max."""
    sig = types.void(buf, i, j)

    def codegen(context, builder, signature, args):
        pa = _vec_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        pb = _vec_ptr(context, builder, signature.args[0], args[0], args[2], signature.args[2])
        x = builder.load(pa, align=4)
        y = builder.load(pb, align=4)
        builder.store(_ir_min(builder, x, y), pa, align=4)
        builder.store(_ir_max(builder, y, x), pb, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _ir_mirror(builder, x, y, lm):
    """Lane ``l`` of ``x`` against lane ``l ^ lm`` of ``y``; the element with the lower lane gets
    the minimum. Then the merge's in-lane half-cleaners (:func:`_cleaners`) on both."""
    _, _, vb = _irtypes()
    hb = 1 << (lm.bit_length() - 1)
    low = ir.Constant(vb, [int((t & hb) == 0) for t in range(_W)])
    perm = [t ^ lm for t in range(_W)]
    y = _ir_perm(builder, y, perm)
    lo = builder.select(low, _ir_min(builder, x, y), _ir_max(builder, x, y))
    hi = _ir_perm(builder, builder.select(low, _ir_max(builder, y, x), _ir_min(builder, y, x)), perm)
    for m in _cleaners(lm):
        lo, hi = _ir_lane_stage(builder, lo, m), _ir_lane_stage(builder, hi, m)
    return lo, hi


def _mirror_intrinsic(lm):
    """Vectors ``i`` and ``j``: :func:`_ir_mirror` in registers."""
    @intrinsic
    def _impl(typingctx, buf, i, j):
        sig = types.void(buf, i, j)

        def codegen(context, builder, signature, args):
            pa = _vec_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
            pb = _vec_ptr(context, builder, signature.args[0], args[0], args[2], signature.args[2])
            a, b = _ir_mirror(builder, builder.load(pa, align=4), builder.load(pb, align=4), lm)
            builder.store(a, pa, align=4)
            builder.store(b, pb, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return _impl


_mirror1, _mirror3, _mirror7, _mirror15 = (_mirror_intrinsic(m) for m in (1, 3, 7, 15))


def _mirror4_intrinsic(lm):
    """Vectors ``a, b, c, d`` = ``v, h−1−v, h+v, 2h−1−v`` of a row of ``2h`` vectors: the mirror
    across lanes of ``a`` with ``d`` and of ``b`` with ``c`` with its in-lane half-cleaners
    (:func:`_ir_mirror`), then the next stage of the merge, between vectors ``h`` apart
    (``a`` with ``c``, ``b`` with ``d``), all in registers."""
    @intrinsic
    def _impl(typingctx, buf, ia, ib, ic, id_):
        sig = types.void(buf, ia, ib, ic, id_)

        def codegen(context, builder, signature, args):
            ptrs = [_vec_ptr(context, builder, signature.args[0], args[0], args[t], signature.args[t])
                    for t in range(1, 5)]
            regs = [builder.load(q, align=4) for q in ptrs]
            a, d = _ir_mirror(builder, regs[0], regs[3], lm)
            b, c = _ir_mirror(builder, regs[1], regs[2], lm)
            a, c = _ir_min(builder, a, c), _ir_max(builder, c, a)
            b, d = _ir_min(builder, b, d), _ir_max(builder, d, b)
            for q, r in zip(ptrs, (a, b, c, d)):
                builder.store(r, q, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return _impl


_mirror4_1, _mirror4_3, _mirror4_7, _mirror4_15 = (_mirror4_intrinsic(m) for m in (1, 3, 7, 15))


@intrinsic
def _transpose16(typingctx, src, i, dst, stride):
    """Vectors ``16i … 16i+15`` of ``src`` as a 16×16 block, transposed: row ``l`` (lane ``l`` of each)
    stored at ``dst[l·stride + 16i …]``."""
    sig = types.void(src, i, dst, stride)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        vf, _, _ = _irtypes()
        base = context.cast(builder, args[1], signature.args[1], types.intp)
        first = builder.mul(base, ir.Constant(i64, 16))
        ptr = _vec_ptr(context, builder, signature.args[0], args[0], first, types.intp)
        regs = _ir_transpose(builder, [builder.load(builder.gep(ptr, [ir.Constant(i64, t)]), align=4)
                                       for t in range(16)])
        ddata = context.make_array(signature.args[2])(context, builder, args[2]).data
        st = context.cast(builder, args[3], signature.args[3], types.intp)
        off = builder.mul(base, ir.Constant(i64, 16))
        for t in range(16):
            q = builder.gep(ddata, [builder.add(builder.mul(st, ir.Constant(i64, t)), off)])
            builder.store(regs[t], builder.bitcast(q, vf.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@_inline
def _group_sort(buf, i, g):
    if g == 16:
        _gsort16(buf, i)
    elif g == 8:
        _gsort8(buf, i)
    elif g == 4:
        _gsort4(buf, i)
    elif g == 2:
        _gsort2(buf, i)


@_inline
def _group_finish(buf, i, g):
    if g == 16:
        _gfinish16(buf, i)
    elif g == 8:
        _gfinish8(buf, i)
    elif g == 4:
        _gfinish4(buf, i)
    elif g == 2:
        _gfinish2(buf, i)


@_inline
def _mirror(buf, i, j, lm):
    if i == j:
        if lm == 15:
            _lone15(buf, i)
        elif lm == 7:
            _lone7(buf, i)
        elif lm == 3:
            _lone3(buf, i)
        else:
            _lone1(buf, i)
    elif lm == 15:
        _mirror15(buf, i, j)
    elif lm == 7:
        _mirror7(buf, i, j)
    elif lm == 3:
        _mirror3(buf, i, j)
    else:
        _mirror1(buf, i, j)


@_inline
def _mirror4(buf, a, b, c, d, lm):
    if lm == 15:
        _mirror4_15(buf, a, b, c, d)
    elif lm == 7:
        _mirror4_7(buf, a, b, c, d)
    elif lm == 3:
        _mirror4_3(buf, a, b, c, d)
    else:
        _mirror4_1(buf, a, b, c, d)


@_inline
def _bitonic(buf, nvec, out, transpose=True):
    """Sort ``buf[:16·nvec]`` (``nvec`` a power of two; ``buf`` is scrambled) into ``out``; without
    ``transpose``, leave it in ``buf`` in the network's layout: element ``e`` of the sorted row is
    ``buf[(e % nvec)·16 + e // nvec]``."""
    g = min(nvec, 16)
    ngrp = nvec // g
    for i in range(ngrp):
        _group_sort(buf, i, g)
    k = 2 * g
    while k <= 16 * nvec:
        if k <= nvec:                      # mirror stage between vectors v and v ^ (k - 1)
            h = k // 2
            for v in range(nvec):
                if v & h == 0:
                    _vx(buf, v, v ^ (k - 1))
            j = k // 4
        else:                              # ... between lanes: vectors v and nvec - 1 - v, with the
            lm = k // nvec - 1             # half-cleaners across lanes that follow it
            h = nvec // 2
            if h >= g:                     # ... and the next stage, between vectors h apart
                for v in range(h // 2):
                    _mirror4(buf, v, h - 1 - v, h + v, nvec - 1 - v, lm)
                j = h // 2
            else:
                for v in range((nvec + 1) // 2):
                    _mirror(buf, v, nvec - 1 - v, lm)
                j = h
        while j >= g:                      # ... across groups of vectors
            for v in range(nvec):
                if v & j == 0:
                    _vx(buf, v, v + j)
            j //= 2
        if g >= 2:                         # ... inside each group, in registers
            for i in range(ngrp):
                _group_finish(buf, i, g)
        k *= 2
    if not transpose:
        return
    if nvec >= 16:
        for i in range(nvec // 16):
            _transpose16(buf, i, out, nvec)
    else:
        for lane in range(16):
            for v in range(nvec):
                out[lane * nvec + v] = buf[v * 16 + lane]


# -- LSD radix sort for long rows ------------------------------------------------------------------
@_func
def _radix_sort(a, n):
    """Sort ``a[:n]`` (finite float32; ``−0.0`` before ``+0.0``) by 4 byte-wide LSD passes on keys
    ``bits ^ (sign ? 0xFFFFFFFF : 0x80000000)``; passes whose byte is constant are skipped."""
    bits = a[:n].view(np.uint32)
    k0 = np.empty(n, np.uint32)
    k1 = np.empty(n, np.uint32)
    hist = np.zeros((4, 256), np.int64)
    for i in range(n):
        b = bits[i]
        k = b ^ (np.uint32(0xFFFFFFFF) if b >> np.uint32(31) else np.uint32(0x80000000))
        k0[i] = k
        for d in range(4):
            hist[d, (k >> np.uint32(8 * d)) & np.uint32(255)] += 1
    src, dst = k0, k1
    for d in range(4):
        h = hist[d]
        single = False
        for v in range(256):
            if h[v] == n:
                single = True
        if single:
            continue
        tot = 0
        for v in range(256):
            c = h[v]
            h[v] = tot
            tot += c
        sh = np.uint32(8 * d)
        for i in range(n):
            k = src[i]
            v = (k >> sh) & np.uint32(255)
            dst[h[v]] = k
            h[v] += 1
        src, dst = dst, src
    for i in range(n):
        k = src[i]
        bits[i] = k ^ (np.uint32(0x80000000) if k >> np.uint32(31) else np.uint32(0xFFFFFFFF))


# -- one bucket: copy, pad, sort --------------------------------------------------------------------
@intrinsic
def _copy_flags16(typingctx, xi, buf, nvec):
    """``buf[:16·nvec]`` = the float32 values whose bits are ``xi[:16·nvec]``; returns the flags of
    :func:`_copy_pad` for them. Written on 16-lane int32 vectors: the same loop in numba widens the
    flags to 64-bit lanes and runs at half the speed of the copy alone."""
    sig = types.int64(xi, buf, nvec)

    def codegen(context, builder, signature, args):
        _, vi, vb = _irtypes()
        i64 = ir.IntType(64)
        src = builder.bitcast(context.make_array(signature.args[0])(context, builder, args[0]).data, vi.as_pointer())
        dst = builder.bitcast(context.make_array(signature.args[1])(context, builder, args[1]).data, vi.as_pointer())
        count = context.cast(builder, args[2], signature.args[2], types.intp)

        def splat(v):
            return ir.Constant(vi, [v & 0xFFFFFFFF] * _W)

        zero = splat(0)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(3)]
        with cgutils.for_range(builder, count) as loop:
            v = builder.load(builder.gep(src, [loop.index]), align=4)
            builder.store(v, builder.gep(dst, [loop.index]), align=4)
            tests = (builder.icmp_signed("==", v, zero), builder.icmp_signed("==", v, splat(_NEG0)),
                     builder.icmp_signed("==", builder.and_(v, splat(_EXP)), splat(_EXP)))
            for acc, t in zip(accs, tests):
                builder.store(builder.or_(builder.load(acc), builder.sext(t, vi)), acc)
        flags = ir.Constant(i64, 0)
        for acc, bit in zip(accs, (_FLAG_POS0, _FLAG_NEG0, _FLAG_NONFINITE)):
            seen = builder.bitcast(builder.icmp_signed("!=", builder.load(acc), zero), ir.IntType(_W))
            hit = builder.icmp_unsigned("!=", seen, ir.Constant(ir.IntType(_W), 0))
            flags = builder.or_(flags, builder.select(hit, ir.Constant(i64, bit), ir.Constant(i64, 0)))
        return flags

    return sig, codegen


@_inline
def _copy_pad(xs, xi, buf, npad):
    """``buf[:m] = xs``, ``+inf`` up to ``npad``; flags: +0 seen, −0 seen, non-finite seen."""
    m = xs.size
    full = m // _W
    flags = _copy_flags16(xi, buf, full)
    pz = 0
    nz = 0
    bad = 0
    for i in range(full * _W, m):
        v = xi[i]
        pz |= v == 0
        nz |= v == _NEG0
        bad |= (v & _EXP) == _EXP
        buf[i] = xs[i]
    for i in range(m, npad):
        buf[i] = _INF
    return flags | pz * _FLAG_POS0 | nz * _FLAG_NEG0 | bad * _FLAG_NONFINITE


@_inline
def _pad_size(m):
    p = 16
    while p < m:
        p *= 2
    return p


@_inline
def _sort_row(xs, xi, buf, srt, transpose=True):
    """``srt[:xs.size]`` = the bucket ``xs`` sorted as ``reference.sort_rows`` orders it (``−0.0``
    before ``+0.0``); returns the flags. Without ``transpose``, a row that went through the network
    may instead be left in ``buf`` in its layout (:func:`_bitonic`), flagged :data:`_FLAG_COLUMNS`
    (for a caller that reads a few positions: :func:`_sorted_at`)."""
    m = xs.size
    if m <= _VSORT_MAX:
        npad = _pad_size(m)
        flags = _copy_pad(xs, xi, buf, npad)
        if (flags & 3) != 3:
            if not flags & _FLAG_NONFINITE:
                _bitonic(buf, npad // _W, srt, transpose)
                if not transpose:
                    flags |= _FLAG_COLUMNS
            return flags
    flags = _copy_pad(xs, xi, srt, m)
    if flags & _FLAG_NONFINITE:
        return flags
    _radix_sort(srt, m)
    return flags


@_inline
def _sorted_at(buf, srt, m, flags, e):
    """Element ``e`` of the sorted row of ``m`` values that :func:`_sort_row` gave with ``flags``."""
    if flags & _FLAG_COLUMNS:
        nvec = _pad_size(m) // _W
        return buf[(e % nvec) * _W + e // nvec]
    return srt[e]
