"""Numba CPU kernels for ORQ-L / Linear-L: per-bucket levels, fused with rounding and packing.

They reproduce, bit for bit, :func:`gradq.kernels.reference.orq_levels` / ``linear_levels`` (the
plain-torch references, one bucket per row) followed by ``round_to_levels`` and ``pack_bits``:

* **Sorting.** Each bucket is sorted as the reference sorts it: buckets of a power of two from 16
  to 512 values sixteen at a time, one a lane, by :mod:`gradq.kernels.cpu_sort_lanes`, and their
  levels read from the lanes (Linear's positions; ORQ's rounds by
  :mod:`gradq.kernels.cpu_orq_lanes`, sixteen buckets a step); the others, and a bucket the lanes
  cannot take, by :mod:`gradq.kernels.cpu_sort` (a bitonic network on 16-lane vectors, or a radix
  sort on the order-preserving integer keys), one bucket at a time.
* **ORQ rounds**: :mod:`gradq.kernels.cpu_orq_rows` for one sorted row (its docstring has the
  rules), :mod:`gradq.kernels.cpu_orq_lanes` for sixteen lanes.
* **Linear**: ``sorted[pos_i]`` at the reference's positions (computed by the caller in torch).
* **Rounding**: ``hi`` = number of ``lv[0 … L−2]`` below ``v``, ``lo = max(hi − 1, 0)``,
  ``p = (v − lv[lo]) / (lv[hi] − lv[lo])`` (0 for a zero gap), index ``hi if u < p else lo``, with
  ``u`` the uniform of counter ``ctr0 + i`` (the random-number IR of :mod:`gradq.kernels.cpu`),
  then :mod:`gradq.kernels.cpu`'s packing. The rounding asks for the next group's input one cache
  line a step (where a group's lines asked for in bursts had waited for the core's fill buffers).

Parallelism: :func:`run` processes a range of independent tasks (chunks of whole buckets, a
multiple of 8 elements so that every chunk starts on a byte, or groups of buckets) with the GIL
released; :mod:`gradq.kernels.levels` spreads the ranges over threads. No result depends on the
thread count. (A ``prange`` kernel re-optimizes every callee inside its parallel region, which more
than doubled the first-call compile time of this module.) :func:`run` works on borrowed views of its
arrays and of one workspace (:func:`gradq.kernels.numba_common._borrowed`): numba counts references to
every array passed to a function it does not inline and to every slice, and with owned arrays those
atomic counts took about a fifth of the time, on one input shared by two threads. Buckets are
sorted in :func:`_levels_range`, where the sorts and the levels are inlined, sixteen buckets a call.

Compiled code is cached in a directory keyed by the sources of every kernel module
(:mod:`gradq.kernels.numba_cache`), so an edit of a helper in :mod:`gradq.kernels.cpu` recompiles
this module too.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu_orq_lanes import MAX_LEVELS, orq_lanes
from .cpu_orq_rows import _orq_levels
from .cpu_sort import _FLAG_NONFINITE, _VSORT_MAX, _W, _pad_size, _sort_row, _sorted_at
from .cpu_sort_lanes import LANES_MAX, sort_lanes
from .numba_common import (_borrowed, _fill_uniform, _ir_counters, _ir_prefetch, _ir_splat, _ir_target_features,
                           _ir_uniform, _ir_vectors, _keep, _prefetch, _round_any, _run_end, _run_keys, _uniform)
from .numba_pack import _pack

_ZERO32 = np.float32(0.0)

_inline = njit(inline="always", cache=True, error_model="numpy")
_func = njit(cache=True, error_model="numpy")


# -- one bucket: sort, levels -------------------------------------------------------------------------


@_inline
def _aligned32(size):
    """``size`` float32 starting on a 64-byte boundary, so the sort's 16-lane loads never straddle
    two cache lines."""
    w = np.empty(size + 16, np.float32)
    a0 = (-(w.ctypes.data // 4)) % 16
    return w[a0:a0 + size]


@_inline
def _lanes_ok(mode, d, L):
    """Whether buckets of ``d`` values go through :mod:`gradq.kernels.cpu_sort_lanes` sixteen at a
    time: ``d`` a power of two from 16 to ``LANES_MAX``, for Linear (``mode`` 1) or for ORQ with at
    most :data:`cpu_orq_lanes.MAX_LEVELS` levels."""
    return 16 <= d <= LANES_MAX and d & (d - 1) == 0 and (mode == 1 or L <= MAX_LEVELS)


@_inline
def _group_size(mode, d, L):
    """Buckets per levels-only task and per step of the encode: sixteen where they are sorted one a
    lane, else eight (the encode sorts a group, then rounds it, while its input is in the L1 cache;
    ORQ's encodes of 25M values through the row sort ran 0–5 % slower in groups of sixteen)."""
    return 16 if _lanes_ok(mode, d, L) else 8


@_inline
def _workspace(d, L):
    """Scratch for buckets of up to ``d`` values: the sort's buffer and output, the values in fixed
    point, the next round's levels, the segment starts (twice) and the segments' totals (twice);
    for buckets of up to :data:`LANES_MAX`, the sixteen-lane network's vectors (room for 256 of
    them: its strided passes touch 256 even in shorter rows) and the state of ORQ's rounds on the
    lanes (:func:`cpu_orq_lanes.orq_lanes`: the prefix sums, the scales, the levels and segment
    starts, twice)."""
    npad = _pad_size(d) if d <= _VSORT_MAX else d
    lanes = 16 <= d <= LANES_MAX
    nl = 16 * max(d, 256) if lanes else 16
    nps = 16 * (d + 1) if lanes else 16
    return (_aligned32(npad), _aligned32(npad), np.empty(npad, np.int64),
            np.empty(L, np.float32), np.empty(L, np.int64), np.empty(L, np.int64), np.empty((2, L), np.int64),
            _aligned32(nl), np.empty(nps, np.int64), np.empty(16, np.float64),
            np.empty((2, 16 * MAX_LEVELS), np.float32), np.empty((2, 16 * MAX_LEVELS), np.int32))


@_inline
def _borrowed_workspace(ws):
    """Views of :func:`_workspace`'s arrays that cost no reference counting (:func:`_borrowed`)."""
    return (_borrowed(ws[0]), _borrowed(ws[1]), _borrowed(ws[2]), _borrowed(ws[3]), _borrowed(ws[4]),
            _borrowed(ws[5]), _borrowed(ws[6]), _borrowed(ws[7]), _borrowed(ws[8]), _borrowed(ws[9]),
            _borrowed(ws[10]), _borrowed(ws[11]))


@_inline
def _bucket_levels(x, xi, b, bucket, mode, L, rounds, pos_full, pos_tail, levels, buf, srt, fix, nlv, starts, nst,
                   tt):
    """Levels of bucket ``b`` into ``levels[b·L : (b + 1)·L]``; returns the sort's flags."""
    bs = b * bucket
    be = min(x.size, bs + bucket)
    m = be - bs
    _prefetch(x, bs + 2 * bucket, min(x.size, bs + 3 * bucket))
    flags = _sort_row(x[bs:be], xi[bs:be], buf, srt, mode != 1)   # Linear reads L positions
    if flags & _FLAG_NONFINITE:
        return flags
    lv = levels[b * L:(b + 1) * L]
    if mode == 1:
        pos = pos_full if m == bucket else pos_tail
        for i in range(L):
            lv[i] = _sorted_at(buf, srt, m, flags, pos[i])
    else:
        _orq_levels(srt, fix, m, rounds, lv, nlv, starts, nst, tt[0], tt[1])
    return flags & 7


@_func
def _levels_range(x, xi, b0, b1, mode, L, rounds, pos_full, pos_tail, bucket, out, ws, ahead):
    """Levels of buckets ``b0 … b1 − 1`` (``ws``: :func:`_workspace`); returns the OR of their flags.
    The one place that sorts a bucket: the sorts and the levels are inlined here, so the loop over
    buckets makes no calls that count references. Whole groups of sixteen :func:`_lanes_ok` buckets
    are sorted together, one bucket a lane, and their levels come from the lanes (Linear's
    positions; ORQ's rounds, :func:`cpu_orq_lanes.orq_lanes`); a bucket the lanes cannot take (a
    NaN, an infinity, zeros of both signs) and every other bucket is sorted on its own."""
    buf, srt, fix, nlv, starts, nst, tt, lt, ps, p2, olv, ost = ws
    flags = 0
    lanes = _lanes_ok(mode, bucket, L)
    n = x.size
    g0 = g1 = b0          # the buckets in the lanes now; `bad`: those of them to sort on their own
    bad = 0
    for b in range(b0, b1):
        if lanes and b >= g1 and b + 16 <= b1 and (b + 16) * bucket <= n:
            g0, g1 = b, b + 16
            bad = sort_lanes(x, b * bucket, bucket, lt)
            if mode == 0:
                orq_lanes(lt, bucket, rounds, ps, p2, olv[0], ost[0], olv[1], ost[1])
        if b < g1:
            if ahead:
                _prefetch(x, (b + 16) * bucket, min(n, (b + 17) * bucket))
            if not (bad >> (b - g0)) & 1:
                if mode == 1:
                    for i in range(L):   # Linear's positions, straight from the lanes
                        out[b * L + i] = lt[pos_full[i] * 16 + (b - g0)]
                else:
                    for i in range(L):
                        out[b * L + i] = olv[0, i * 16 + (b - g0)]
                continue
        # one place for the row sort, so that it is compiled once
        flags |= _bucket_levels(x, xi, b, bucket, mode, L, rounds, pos_full, pos_tail, out, buf, srt, fix, nlv,
                                starts, nst, tt)
        if flags & _FLAG_NONFINITE:
            break
    return flags


# -- rounding onto sorted levels (16 lanes, random numbers computed in the loop) --------------------
def _ir_level_permute(context, builder, scalars, const):
    """For ``L ≥ 9`` levels on AVX-512, a function giving ``lv[idx]`` for a 16-lane index vector (every
    index below ``L``): one permute per 16 levels, a select between two for 17; else ``None``.
    (Rounding onto 9 and 17 levels ran 3 % and 14 % faster with it; onto 5, 7 % slower than the
    select chain.)"""
    L = len(scalars)
    if L < 9 or "avx512f" not in _ir_target_features(context):
        return None
    _, vi, vf, _, _ = _ir_vectors()
    perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vi]),
                                          "llvm.x86.avx512.permvar.sf.512")
    tabs = []
    for k in range(0, L, _W):
        t = ir.Constant(vf, ir.Undefined)
        for j in range(k, min(L, k + _W)):
            t = builder.insert_element(t, scalars[j], ir.Constant(ir.IntType(32), j - k))
        tabs.append(t)

    def permute(idx):
        r = builder.call(perm, [tabs[0], idx])
        for k in range(1, len(tabs)):
            r = builder.select(builder.icmp_signed(">", idx, const(k * _W - 1)), builder.call(perm, [tabs[k], idx]), r)
        return r
    return permute


def _round_intrinsic(L):
    """Level indices of ``16·nvec`` values onto the sorted ``lv[:L]``, as ``round_to_levels``:
    ``hi`` = number of ``lv[0 … L−2]`` below ``v`` (torch.searchsorted on a sorted row, clamped),
    ``lo = max(hi − 1, 0)``, ``p = (v − lv[lo]) / (lv[hi] − lv[lo])`` (0 for a zero gap), index
    ``hi if u < p else lo`` with ``u`` the uniform of the element's counter. Each step also asks for
    the cache line ``ahead`` elements further on (the input of the next group of buckets): one line
    a step keeps the misses in flight few, where a bucket's 32 lines asked at once waited for the
    core's fill buffers."""
    @intrinsic
    def _impl(typingctx, xs, ts, nvec, lv, base, k2h, ahead):
        sig = types.void(xs, ts, nvec, lv, types.uint32, types.uint32, types.intp)

        def codegen(context, builder, signature, args):
            xptr = context.make_array(signature.args[0])(context, builder, args[0]).data
            tptr = context.make_array(signature.args[1])(context, builder, args[1]).data
            lptr = context.make_array(signature.args[3])(context, builder, args[3]).data
            count, b, k = args[2], args[4], args[5]
            i32, vi, vf, const, inv24 = _ir_vectors()
            vb = ir.VectorType(ir.IntType(8), _W)
            scalars = [builder.load(builder.gep(lptr, [ir.Constant(ir.IntType(64), j)])) for j in range(L)]
            levels = [_ir_splat(builder, vf, lv) for lv in scalars]
            look = _ir_level_permute(context, builder, scalars, const)
            zero = ir.Constant(vf, [0.0] * _W)
            one = ir.Constant(vf, [1.0] * _W)
            izero = const(0)
            state = _ir_counters(builder, vi, b)
            kv = _ir_splat(builder, vi, k)
            with cgutils.for_range(builder, count) as loop:
                off = builder.mul(loop.index, ir.Constant(loop.index.type, _W))
                v = builder.load(builder.bitcast(builder.gep(xptr, [off]), vf.as_pointer()), align=4)
                _ir_prefetch(builder, builder.gep(xptr, [builder.add(off, args[6])]))
                h = builder.load(state)
                u = _ir_uniform(builder, h, kv, const, vf, inv24)
                # levels are sorted: the last j with lv[j] < v gives hi = j + 1, lv[lo] = lv[j] and
                # lv[hi] = lv[j + 1]; none gives hi = 0 and lv[0] for both
                hi, l_lo, l_hi = izero, levels[0], levels[0]
                for j in range(L - 1):
                    below = builder.fcmp_ordered("<", levels[j], v)
                    hi = builder.select(below, const(j + 1), hi)
                    if look is None:
                        l_lo = builder.select(below, levels[j], l_lo)
                        l_hi = builder.select(below, levels[j + 1], l_hi)
                lo = builder.select(builder.icmp_signed(">", hi, izero), builder.sub(hi, const(1)), izero)
                if look is not None:
                    l_lo, l_hi = look(lo), look(hi)
                gap = builder.fsub(l_hi, l_lo)
                pos = builder.fcmp_ordered(">", gap, zero)
                prob = builder.select(pos, builder.fdiv(builder.fsub(v, l_lo), builder.select(pos, gap, one)), zero)
                code = builder.select(builder.fcmp_ordered("<", u, prob), hi, lo)
                builder.store(builder.trunc(code, vb), builder.bitcast(builder.gep(tptr, [off]), vb.as_pointer()),
                              align=1)
                builder.store(builder.add(h, const(_W * 0x9E3779B9)), state)
            return context.get_dummy_value()

        return sig, codegen

    return _impl


_round3, _round5, _round9, _round17 = (_round_intrinsic(L) for L in (3, 5, 9, 17))


@_inline
def _round_tail(xr, tr, lv, L, i0, base, k2h):
    """The same as the vector loop for elements ``i0 …`` of the run, one at a time."""
    for i in range(i0, xr.size):
        v = xr[i]
        hi = 0
        for j in range(L - 1):
            hi += lv[j] < v
        lo = max(hi - 1, 0)
        l_lo = lv[lo]
        gap = lv[hi] - l_lo
        prob = (v - l_lo) / gap if gap > _ZERO32 else _ZERO32
        tr[i] = hi if _uniform(base, i, k2h) < prob else lo


@_inline
def _round_fast(xr, tr, lv, L, base, k2h, ahead):
    """Level indices of the run ``xr`` (counters from ``base``) onto sorted ``lv``, L in 3/5/9/17,
    asking for the input ``ahead`` elements on as it goes."""
    full = xr.size // _W
    if L == 3:
        _round3(xr, tr, full, lv, base, k2h, ahead)
    elif L == 5:
        _round5(xr, tr, full, lv, base, k2h, ahead)
    elif L == 9:
        _round9(xr, tr, full, lv, base, k2h, ahead)
    else:
        _round17(xr, tr, full, lv, base, k2h, ahead)
    _round_tail(xr, tr, lv, L, full * _W, base, k2h)


@_func
def _encode_chunk(x, xi, e0, e1, mode, L, rounds, pos_full, pos_tail, bucket, width, k1, k2, ctr0, levels, out, ws,
                  ahead):
    """Levels of the buckets of ``x[e0:e1]`` (whole buckets), sixteen buckets at a time, then the
    rounding of their elements, then the packing of the chunk's indices. Returns the OR of the
    bucket flags. (Sorting and rounding bucket by bucket instead ran about 10 % slower: the two
    large loops then take turns in the instruction caches every 512 values.)"""
    n = x.size
    nb = (n + bucket - 1) // bucket
    own = (np.empty(e1 - e0, np.uint8), np.empty(1024, np.float32))
    tmp, ubuf = _borrowed(own[0]), _borrowed(own[1])
    fl = 0
    b1 = min(nb, (e1 + bucket - 1) // bucket)
    grp = _group_size(mode, bucket, L)
    for g0 in range(e0 // bucket, b1, grp):
        g1 = min(b1, g0 + grp)
        fl |= _levels_range(x, xi, g0, g1, mode, L, rounds, pos_full, pos_tail, bucket, levels, ws, ahead)
        if fl & _FLAG_NONFINITE:
            return fl
        for b in range(g0, g1):
            lv = levels[b * L:(b + 1) * L]
            ok = True
            for j in range(L - 1):
                ok = ok and lv[j] <= lv[j + 1]
            p = b * bucket
            q = min(n, p + bucket)
            fast = ok and (L == 3 or L == 5 or L == 9 or L == 17)
            while p < q:
                e = _run_end(ctr0 + p, p, q)
                if not fast:
                    e = min(e, p + ubuf.size)
                base, k2h = _run_keys(ctr0 + p, k1, k2)
                if fast:
                    _round_fast(x[p:e], tmp[p - e0:e - e0], lv, L, base, k2h, grp * bucket)
                else:
                    u = ubuf[:e - p]
                    _fill_uniform(u, base, k2h)
                    _round_any(x[p:e], tmp[p - e0:e - e0], u, lv, L)
                    _prefetch(x, p + grp * bucket, min(n, e + grp * bucket))
                p = e
    _pack(tmp, width, out[(e0 * width) // 8:])
    _keep(own)
    return fl


@njit(cache=True, error_model="numpy", nogil=True)
def run(task, t0, t1, x, xi, mode, L, rounds, pos_full, pos_tail, bucket, width, k1, k2, ctr0, chunk, levels, out):
    """Tasks ``t0 … t1 − 1`` (the caller spreads task ranges over threads; the GIL is released).
    ``task``:

    * 0 — encode: per chunk of ``chunk`` elements (whole buckets, ``bucket ≤ 8192``) the levels of
      its buckets (into ``levels``), the stochastic rounding of its elements onto them
      (``u < (v − l_lo)/(l_hi − l_lo)`` picks the upper level) and the packed ``width``-bit indices
      (into ``out``);
    * 1 — levels of every bucket, sixteen buckets per task (``bucket ≤ 8192``);
    * 2 — levels of every bucket, one per task (long buckets).

    Tasks touch disjoint outputs, so the result does not depend on how ranges are spread. Returns
    the OR of the bucket flags (4: a non-finite value was seen; the outputs are then incomplete)."""
    n = x.size
    x, xi, pos_full, pos_tail = _borrowed(x), _borrowed(xi), _borrowed(pos_full), _borrowed(pos_tail)
    levels, out = _borrowed(levels), _borrowed(out)
    own = _workspace(bucket, L)
    ws = _borrowed_workspace(own)
    acc = 0
    # who asks for the next group of buckets: a levels-only task while it stores the levels of the
    # lanes, the encode while it rounds (a runtime flag: a literal one would compile the level
    # loop twice)
    ahead = task != 0
    for t in range(t0, t1):
        if task == 0:
            acc |= _encode_chunk(x, xi, t * chunk, min(n, (t + 1) * chunk), mode, L, rounds, pos_full,
                                 pos_tail, bucket, width, k1, k2, ctr0, levels, out, ws, ahead)
        else:
            per = _group_size(mode, bucket, L) if task == 1 else 1
            nb = (n + bucket - 1) // bucket
            acc |= _levels_range(x, xi, t * per, min(nb, (t + 1) * per), mode, L, rounds, pos_full, pos_tail,
                                 bucket, levels, ws, ahead)
    _keep(own)
    return acc
