"""Numba CPU kernel for ORQ's greedy rounds on sixteen buckets at once, one a lane, straight from the
sorted lanes of :func:`gradq.kernels.cpu_sort_lanes.sort_lanes` (``T[p]`` lane ``l`` = element ``p``
of bucket ``l`` in sorted order).

It gives the levels of :func:`gradq.kernels.cpu_orq_rows._orq_levels` (and so of the reference's
``orq_levels``) bit for bit, with the same rules:

* every value in fixed point, ``G = ⌊g·2^sh⌋`` (int64, exact, ``sh`` from the lane's largest
  magnitude and ``⌈log2 m⌉``), kept here as prefix sums along each lane (``PS[p]`` = the sum of
  the first ``p``), so that a segment's total is a difference of two of them;
* segment ``[s, e)`` between levels ``a < b``: its interior run starts after the copies of ``a``
  and stops before those of ``b``; the split is the value of rank ``max(⌈R/(B − A)⌉, 1)``
  (``R = (e − s)·B − Σ G``), moved up to the interior run, and ``minimum(maximum(0.5·a + 0.5·b, a),
  b)`` in float32 where that leaves the run or the run is empty;
* a split's segment starts at the first copy of its value.

Sixteen buckets take each step together: a search is a binary search with gathers, a fixed number
of halvings for the sixteen lanes, and it runs only when some lane needs it — a value's neighbours
usually settle the bounds of a segment and the first copy of a split without one.

Compiled code is cached in the kernels' keyed directory (:mod:`gradq.kernels.numba_cache`).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_W = 16
MAX_LEVELS = 17   # 2^4 + 1: the most levels the lanes' state arrays hold (ORQ takes L ≤ 17)

_inline = njit(inline="always", cache=True, error_model="numpy")


class _IR:
    """Types, constants and the gathers of one intrinsic's code (16-lane vectors)."""

    def __init__(self, builder):
        self.b = builder
        self.i1, self.i32, self.i64 = ir.IntType(1), ir.IntType(32), ir.IntType(64)
        self.f32, self.f64 = ir.FloatType(), ir.DoubleType()
        self.vb = ir.VectorType(self.i1, _W)
        self.vi = ir.VectorType(self.i32, _W)
        self.vq = ir.VectorType(self.i64, _W)
        self.vf = ir.VectorType(self.f32, _W)
        self.vd = ir.VectorType(self.f64, _W)
        self.lane = ir.Constant(self.vi, list(range(_W)))

    def ci(self, v):
        return ir.Constant(self.vi, [v] * _W)

    def cq(self, v):
        return ir.Constant(self.vq, [v] * _W)

    def vload(self, ptr, vty, row):
        """Vector ``row`` (an i64 value) of a ``16 × …`` array at ``ptr``."""
        p = self.b.gep(ptr, [self.b.mul(row, ir.Constant(self.i64, _W))])
        return self.b.load(self.b.bitcast(p, vty.as_pointer()), align=4)

    def vstore(self, val, ptr, row):
        p = self.b.gep(ptr, [self.b.mul(row, ir.Constant(self.i64, _W))])
        self.b.store(val, self.b.bitcast(p, val.type.as_pointer()), align=4)

    def gather(self, ptr, ety, vty, pos, mask, passthru):
        """Lane ``l`` of the result: ``ptr[16·pos_l + l]`` where ``mask_l``, else ``passthru_l``
        (``llvm.masked.gather``: one AVX-512 gather, scalar loads on narrower machines)."""
        b = self.b
        idx = b.add(b.shl(pos, self.ci(4)), self.lane)
        # a GEP with a vector of indices gives a vector of pointers, a type llvmlite's builder does
        # not infer: the instruction is made with its element type and given that type by hand
        gep = ir.instructions.GEPInstr(b.block, ptr, [idx], inbounds=True, name="", source_etype=ety)
        gep.type = ir.VectorType(ety.as_pointer(), _W)
        b._insert(gep)
        fn = cgutils.get_or_insert_function(
            b.module, ir.FunctionType(vty, [gep.type, self.i32, self.vb, vty]),
            f"llvm.masked.gather.v16{'f32' if ety == self.f32 else 'i64'}.v16p0{'f32' if ety == self.f32 else 'i64'}")
        return b.call(fn, [gep, ir.Constant(self.i32, 4 if ety == self.f32 else 8), mask, passthru])

    def any(self, mask):
        return self.b.icmp_unsigned("!=", self.b.bitcast(mask, ir.IntType(_W)), ir.Constant(ir.IntType(_W), 0))

    def imax(self, x, y):
        return self.b.select(self.b.icmp_signed(">", x, y), x, y)


def _search(g, T, lo, hi, v, right_of, steps):
    """Per lane, the first position in ``[lo, hi)`` of the sorted lane that is not ``right_of`` ``v``
    (``right_of(t, v)``: the value ``t`` lies before the answer), by ``steps`` halvings (enough for
    ``hi − lo ≤ 2^steps``) and a last look, as :func:`cpu_orq_rows._lower_bound`."""
    b = g.b
    lo_a = cgutils.alloca_once_value(b, lo)
    n_a = cgutils.alloca_once_value(b, b.sub(hi, lo))
    zero = ir.Constant(g.vf, [0.0] * _W)
    with cgutils.for_range(b, steps):
        lo_c, n = b.load(lo_a), b.load(n_a)
        half = b.ashr(n, g.ci(1))
        act = b.icmp_signed(">", half, g.ci(0))
        t = g.gather(T, g.f32, g.vf, b.sub(b.add(lo_c, half), g.ci(1)), act, zero)
        go = b.and_(act, right_of(t, v))
        b.store(b.select(go, b.add(lo_c, half), lo_c), lo_a)
        b.store(b.sub(n, half), n_a)
    lo_c, n = b.load(lo_a), b.load(n_a)
    act = b.icmp_signed("==", n, g.ci(1))
    t = g.gather(T, g.f32, g.vf, lo_c, act, zero)
    return b.select(b.and_(act, right_of(t, v)), b.add(lo_c, g.ci(1)), lo_c)


def _settle(g, fast, need, slow):
    """``fast``, unless some lane is flagged in ``need``: then ``slow()`` (a search over all
    lanes) for the flagged lanes and ``fast`` for the others."""
    b = g.b
    res = cgutils.alloca_once_value(b, fast)
    with b.if_then(g.any(need), likely=False):
        b.store(b.select(need, slow(), fast), res)
    return b.load(res)


def _fixed(g, v, p2):
    """``⌊v·2^sh⌋`` as int64 lanes (``p2 = 2^sh`` as doubles); a lane whose product is not a number
    below 2^62 in magnitude (a bucket the caller sorts on its own) gets 0."""
    b = g.b
    floor = cgutils.get_or_insert_function(b.module, ir.FunctionType(g.vd, [g.vd]), "llvm.floor.v16f64")
    d = b.call(floor, [b.fmul(b.fpext(v, g.vd), p2)])
    lim = ir.Constant(g.vd, [2.0 ** 62] * _W)
    ok = b.and_(b.fcmp_ordered("<", d, lim), b.fcmp_ordered(">", d, b.fneg(lim)))
    return b.fptosi(b.select(ok, d, ir.Constant(g.vd, [0.0] * _W)), g.vq)


@intrinsic
def _prefix(typingctx, T, m, lg, PS, P2):
    """``P2`` = each lane's ``2^sh`` (``sh = 61 − E − lg``, ``E = max(e, 1) − 126`` for the float32
    exponent field ``e`` of its largest magnitude, as ``cpu_orq_rows._orq_scale``), and ``PS[p]`` (``p ≤
    m``) = the sum of the lane's first ``p`` values in fixed point (:func:`_fixed`)."""
    sig = types.void(T, m, lg, PS, P2)

    def codegen(context, builder, signature, args):
        g = _IR(builder)
        b = builder
        tp, pp, p2p = (context.make_array(signature.args[k])(context, builder, args[k]).data for k in (0, 3, 4))
        m = context.cast(builder, args[1], signature.args[1], types.int64)
        lg = context.cast(builder, args[2], signature.args[2], types.int64)
        mn = g.vload(tp, g.vf, ir.Constant(g.i64, 0))
        mx = g.vload(tp, g.vf, b.sub(m, ir.Constant(g.i64, 1)))
        absmask = g.ci(0x7FFFFFFF)
        am, ax = (b.and_(b.bitcast(v, g.vi), absmask) for v in (mn, mx))
        top = b.select(b.icmp_unsigned(">", am, ax), am, ax)          # magnitudes order as their bits
        e = g.imax(b.lshr(top, g.ci(23)), g.ci(1))
        sh = b.sub(b.sub(g.ci(61 + 126), e), _splat_i32(g, b.trunc(lg, g.i32)))   # 61 − E − lg
        bits = b.shl(b.zext(b.add(sh, g.ci(1023)), g.vq), g.cq(52))
        p2 = b.bitcast(bits, g.vd)
        b.store(p2, b.bitcast(p2p, g.vd.as_pointer()), align=8)
        g.vstore(g.cq(0), pp, ir.Constant(g.i64, 0))
        acc = cgutils.alloca_once_value(b, g.cq(0))
        with cgutils.for_range(b, m) as loop:
            s = b.add(b.load(acc), _fixed(g, g.vload(tp, g.vf, loop.index), p2))
            b.store(s, acc)
            g.vstore(s, pp, b.add(loop.index, ir.Constant(g.i64, 1)))
        return context.get_dummy_value()

    return sig, codegen


def _splat_i32(g, val):
    one = g.b.insert_element(ir.Constant(g.vi, ir.Undefined), val, ir.Constant(g.i32, 0))
    return g.b.shuffle_vector(one, ir.Constant(g.vi, ir.Undefined), ir.Constant(g.vi, [0] * _W))


@intrinsic
def _round(typingctx, T, PS, P2, LV, ST, NLV, NST, cnt, m, lg):
    """One greedy round for the sixteen lanes: the ``cnt`` levels ``LV[:cnt]`` and segment starts
    ``ST[:cnt]`` (``ST[cnt − 1] = m``) become ``2·cnt − 1`` of each in ``NLV`` / ``NST``."""
    sig = types.void(T, PS, P2, LV, ST, NLV, NST, cnt, m, lg)

    def codegen(context, builder, signature, args):
        g = _IR(builder)
        b = builder
        tp, pp, p2p, lvp, stp, nlvp, nstp = (context.make_array(signature.args[k])(context, builder, args[k]).data
                                             for k in range(7))
        cnt = context.cast(builder, args[7], signature.args[7], types.int64)
        m = context.cast(builder, args[8], signature.args[8], types.int64)
        lg = context.cast(builder, args[9], signature.args[9], types.int64)
        p2 = b.load(b.bitcast(p2p, g.vd.as_pointer()), align=8)
        one64 = ir.Constant(g.i64, 1)
        zf = ir.Constant(g.vf, [0.0] * _W)
        zq = g.cq(0)
        half = ir.Constant(g.vf, [0.5] * _W)

        def above(t, v):        # the copies of a: t ≤ v lies before the first value above v
            return b.not_(b.fcmp_ordered(">", t, v))

        def below(t, v):        # t < v lies before the first value not below v
            return b.fcmp_ordered("<", t, v)

        with cgutils.for_range(b, b.sub(cnt, one64)) as loop:
            j = loop.index
            a, bv = g.vload(lvp, g.vf, j), g.vload(lvp, g.vf, b.add(j, one64))
            s, e = g.vload(stp, g.vi, j), g.vload(stp, g.vi, b.add(j, one64))
            some = b.icmp_signed("<", s, e)
            # the interior run [lo, hi): after the copies of a, before those of b
            t = g.gather(tp, g.f32, g.vf, s, some, zf)
            lo_f = b.select(b.and_(some, above(t, a)), b.add(s, g.ci(1)), s)
            more = b.icmp_signed("<", lo_f, e)
            t = g.gather(tp, g.f32, g.vf, lo_f, more, zf)
            lo = _settle(g, lo_f, b.and_(more, above(t, a)), lambda: _search(g, tp, s, e, a, above, lg))
            t = g.gather(tp, g.f32, g.vf, b.sub(e, g.ci(1)), some, zf)
            hi_f = b.select(b.and_(some, b.not_(below(t, bv))), b.sub(e, g.ci(1)), e)
            more = b.icmp_signed(">", hi_f, lo)
            t = g.gather(tp, g.f32, g.vf, b.sub(hi_f, g.ci(1)), more, zf)
            hi = _settle(g, hi_f, b.and_(more, b.not_(below(t, bv))), lambda: _search(g, tp, lo, hi_f, bv, below, lg))
            hi = g.imax(hi, lo)
            # the rank of the split, max(⌈R/(B − A)⌉, 1) with R = (e − s)·B − Σ G, exactly in int64
            all_ = ir.Constant(g.vb, [1] * _W)
            tot = b.sub(g.gather(pp, g.i64, g.vq, e, all_, zq), g.gather(pp, g.i64, g.vq, s, all_, zq))
            bf = _fixed(g, bv, p2)
            gap = b.sub(bf, _fixed(g, a, p2))
            pos = b.icmp_signed(">", gap, zq)
            gs = b.select(pos, gap, g.cq(1))
            need = b.sub(b.mul(b.sext(b.sub(e, s), g.vq), bf), tot)
            floor = cgutils.get_or_insert_function(b.module, ir.FunctionType(g.vd, [g.vd]), "llvm.floor.v16f64")
            qd = b.call(floor, [b.fdiv(b.sitofp(need, g.vd), b.sitofp(gs, g.vd))])
            qd = b.select(b.fcmp_ordered(">", qd, ir.Constant(g.vd, [0.0] * _W)), qd, ir.Constant(g.vd, [0.0] * _W))
            lim = ir.Constant(g.vd, [4096.0] * _W)
            q = b.fptosi(b.select(b.fcmp_ordered("<", qd, lim), qd, lim), g.vq)
            r = b.sub(need, b.mul(q, gs))                       # one step either way makes it exact
            neg = b.icmp_signed("<", r, zq)
            q, r = b.select(neg, b.sub(q, g.cq(1)), q), b.select(neg, b.add(r, gs), r)
            over = b.icmp_signed(">=", r, gs)
            q, r = b.select(over, b.add(q, g.cq(1)), q), b.select(over, b.sub(r, gs), r)
            k = b.add(q, b.zext(b.icmp_signed("!=", r, zq), g.vq))
            k = b.select(b.and_(pos, b.icmp_signed(">", k, g.cq(1))), k, g.cq(1))
            p = g.imax(b.add(b.sext(s, g.vq), b.sub(k, g.cq(1))), b.sext(lo, g.vq))
            found = b.icmp_signed("<", p, b.sext(hi, g.vq))
            z = b.select(found, b.trunc(p, g.vi), g.ci(0))
            # the split: a value of the run, or the midpoint; its segment starts at its first copy
            mid = b.fadd(b.fmul(half, a), b.fmul(half, bv))
            mid = b.select(b.fcmp_ordered("<", mid, a), a, mid)
            mid = b.select(b.fcmp_ordered("<", bv, mid), bv, mid)
            c = b.select(found, g.gather(tp, g.f32, g.vf, z, found, zf), mid)
            back = b.and_(found, b.icmp_signed(">", z, s))
            t = g.gather(tp, g.f32, g.vf, b.sub(z, g.ci(1)), back, zf)
            need_st = b.or_(b.and_(back, b.not_(below(t, c))), b.and_(b.not_(found), some))
            st_f = b.select(found, z, s)
            top = b.select(found, b.add(z, g.ci(1)), e)
            st = _settle(g, st_f, need_st, lambda: _search(g, tp, s, top, c, below, lg))
            j2 = b.mul(j, ir.Constant(g.i64, 2))
            g.vstore(a, nlvp, j2)
            g.vstore(c, nlvp, b.add(j2, one64))
            g.vstore(s, nstp, j2)
            g.vstore(st, nstp, b.add(j2, one64))
        last = b.sub(cnt, one64)
        g.vstore(g.vload(lvp, g.vf, last), nlvp, b.mul(last, ir.Constant(g.i64, 2)))
        g.vstore(_splat_i32(g, b.trunc(m, g.i32)), nstp, b.mul(last, ir.Constant(g.i64, 2)))
        return context.get_dummy_value()

    return sig, codegen


@_inline
def workspace_size(m):
    """int64 elements of the prefix sums for lanes of ``m`` values."""
    return (m + 1) * _W


@_inline
def orq_lanes(T, m, rounds, PS, P2, LV, ST, NLV, NST):
    """ORQ levels of the sixteen sorted lanes ``T[:m]`` (``m`` a power of two) after ``rounds``
    rounds: lane ``l`` of ``LV[i]`` is level ``i`` of bucket ``l`` (``PS``: ``(m + 1)·16`` int64,
    ``P2``: 16 float64, ``LV``/``NLV``: ``17·16`` float32, ``ST``/``NST``: ``17·16`` int32)."""
    lg = 0
    while (1 << lg) < m:
        lg += 1
    _prefix(T, m, lg, PS, P2)
    for i in range(_W):
        LV[i] = T[i]
        LV[_W + i] = T[(m - 1) * _W + i]
        ST[i] = 0
        ST[_W + i] = m
    cnt = 2
    for _ in range(rounds):
        _round(T, PS, P2, LV, ST, NLV, NST, cnt, m, lg)
        cnt = 2 * cnt - 1
        for i in range(cnt * _W):
            LV[i] = NLV[i]
            ST[i] = NST[i]
