"""Numba CPU kernels that select ``k`` of ``n`` coordinates by a key without sorting ``n`` keys: the
shared random subset of RandK and GlobalRandK (:func:`gradq.kernels.reference.random_subset`, the
``k`` smallest keys ``(bits32_i, i)``) and Top-K's largest magnitudes
(:func:`gradq.kernels.reference.topk_indices`, the ``k`` largest ``|x_i|``, ties to the lower index).

``u_i = bits32_i ^ 2³¹`` orders as the signed draw does. For ``k`` up to about ``n/16`` one pass
gathers the candidates, every ``(u_i, i)`` with ``u_i`` below a threshold set about ten standard
deviations above the ``k``-th smallest draw's expected value, in index order per part of the vector
(:func:`gather_below`); the caller takes the ``k`` smallest of those. Where the candidates are too few
or a part's share overflows its room (about e⁻⁵⁰ for uniform draws), and for larger ``k``, the
histogram path runs: one pass counts the top 16 bits of every ``u_i`` per part of the vector; the
bin ``T`` where the running count reaches ``k`` holds the boundary.
A second pass gathers that bin's ``(u_i, i)`` (about ``n/65536`` of them), whose ``r``-th smallest
is the last key selected. A last pass writes every selected ``i`` in increasing order at its part's
offset, so the output is sorted without sorting, and does not depend on the thread count. The random
bits are recomputed in each pass rather than stored: no input-sized temporary.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from .numba_common import _LANES, _fill_hash, _inline, _ir_splat, _kernel

_FLIP = np.uint32(0x80000000)
_MAG = np.uint32(0x7FFFFFFF)
_BLOCK = 4096   # random bits made 16 lanes at a time into a block, then scanned
_PHI = 0x9E3779B9


@_inline
def _block(buf, a, end, base, k2h):
    """``u_i`` of ``i = a … a + m − 1`` into ``buf[:m]``, ``m = min(block, end − a)``; returns ``m``."""
    m = min(_BLOCK, end - a)
    _fill_hash(buf[:m], np.uint32((base + a * _PHI) & 0xFFFFFFFF), k2h)
    for j in range(m):
        buf[j] ^= _FLIP
    return m


@_kernel
def histogram(n, base, k2h, part, hist):
    """``hist[p, b]`` = how many ``i`` of part ``p`` have ``u_i >> 16 == b``."""
    for p in prange(hist.shape[0]):
        h = hist[p]
        buf = np.empty(_BLOCK, dtype=np.uint32)
        end = min(n, (p + 1) * part)
        for a in range(p * part, end, _BLOCK):
            for j in range(_block(buf, a, end, base, k2h)):
                h[buf[j] >> 16] += 1


@_kernel
def gather_bin(n, base, k2h, part, top, offsets, keys, idx):
    """``(u_i, i)`` of every ``i`` with ``u_i >> 16 == top``, part ``p``'s from ``offsets[p]`` on."""
    for p in prange(offsets.size):
        o = offsets[p]
        buf = np.empty(_BLOCK, dtype=np.uint32)
        end = min(n, (p + 1) * part)
        for a in range(p * part, end, _BLOCK):
            for j in range(_block(buf, a, end, base, k2h)):
                u = buf[j]
                if (u >> 16) == top:
                    keys[o] = u
                    idx[o] = a + j
                    o += 1


@_kernel
def write_selected(n, base, k2h, part, top, ulast, ilast, offsets, out):
    """Every ``i`` whose key ``(u_i, i)`` is at most ``(ulast, ilast)`` (which lies in bin ``top``),
    in increasing order, part ``p``'s from ``offsets[p]`` on."""
    for p in prange(offsets.size):
        o = offsets[p]
        buf = np.empty(_BLOCK, dtype=np.uint32)
        end = min(n, (p + 1) * part)
        for a in range(p * part, end, _BLOCK):
            for j in range(_block(buf, a, end, base, k2h)):
                u = buf[j]
                hi = u >> 16
                if hi < top or (hi == top and (u < ulast or (u == ulast and a + j <= ilast))):
                    out[o] = a + j
                    o += 1


@_kernel
def gather_below(n, base, k2h, part, limit, cap, keys, idx, counts):
    """Part ``p``'s ``(u_i, i)`` with ``u_i < limit``, in index order, into ``keys``/``idx`` from
    ``p·cap`` on (at most ``cap`` of them); ``counts[p]`` = how many there were (more than ``cap``:
    the caller takes the histogram path)."""
    for p in prange(counts.size):
        o = p * cap
        c = 0
        buf = np.empty(_BLOCK, dtype=np.uint32)
        end = min(n, (p + 1) * part)
        for a in range(p * part, end, _BLOCK):
            for j in range(_block(buf, a, end, base, k2h)):
                u = buf[j]
                if u < limit:
                    if c < cap:
                        keys[o + c] = u
                        idx[o + c] = a + j
                    c += 1
        counts[p] = c


# -- Top-K: the k largest magnitudes -------------------------------------------------------------
# ``m_i = bits(x_i) & 0x7FFFFFFF`` orders as ``|x_i|`` does (NaN above +Inf, as in the reference's
# keys). The passes test 64 values at a time with vector compares into a 64-bit mask
# (:func:`_mag_mask64`) and visit only its set bits, so a pass costs about a read of ``x`` plus a
# little per value it keeps or gathers.

@intrinsic
def _mag_mask64(typingctx, bits, a, lo, span):
    """Bit ``j`` of the uint64 result: whether ``(bits[a + j] & 0x7FFFFFFF) − lo ≤ span`` (unsigned,
    32 bits: the magnitude lies in ``[lo, lo + span]``), for ``j < 64``; four 16-lane compares."""
    sig = types.uint64(bits, a, lo, span)

    def codegen(context, builder, signature, args):
        ptr = context.make_array(signature.args[0])(context, builder, args[0]).data
        v16 = ir.VectorType(ir.IntType(32), _LANES)
        i64 = ir.IntType(64)
        lov = _ir_splat(builder, v16, context.cast(builder, args[2], signature.args[2], types.uint32))
        spv = _ir_splat(builder, v16, context.cast(builder, args[3], signature.args[3], types.uint32))
        mag = ir.Constant(v16, [0x7FFFFFFF] * _LANES)
        acc = ir.Constant(i64, 0)
        for q in range(4):
            at = builder.add(args[1], ir.Constant(args[1].type, _LANES * q))
            v = builder.load(builder.bitcast(builder.gep(ptr, [at]), v16.as_pointer()), align=4)
            hit = builder.icmp_unsigned("<=", builder.sub(builder.and_(v, mag), lov), spv)
            word = builder.zext(builder.bitcast(hit, ir.IntType(_LANES)), i64)
            acc = builder.or_(acc, builder.shl(word, ir.Constant(i64, _LANES * q)))
        return acc

    return sig, codegen


@intrinsic
def _low_bit(typingctx, mask):
    """The position of the lowest set bit of a non-zero uint64."""
    sig = types.int64(mask)

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return sig, codegen


@intrinsic
def _ones(typingctx, mask):
    """How many bits of a uint64 are set."""
    sig = types.int64(mask)

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return sig, codegen


@_kernel
def magnitude_histogram(bits, part, hist):
    """``hist[p, b]`` = how many ``i`` of part ``p`` have ``m_i >> 16 == b``."""
    n = bits.size
    for p in prange(hist.shape[0]):
        h = hist[p]
        for i in range(p * part, min(n, (p + 1) * part)):
            h[(bits[i] & _MAG) >> 16] += 1


@_kernel
def magnitude_histogram_in_bin(bits, part, top, hist):
    """``hist[p, b]`` = how many ``i`` of part ``p`` have ``m_i == (top << 16) | b``."""
    n = bits.size
    lo = np.uint32(top << 16)
    for p in prange(hist.shape[0]):
        h = hist[p]
        a = p * part
        end = min(n, (p + 1) * part)
        while a + 64 <= end:
            mask = _mag_mask64(bits, a, lo, 0xFFFF)
            while mask:
                h[bits[a + _low_bit(mask)] & 0xFFFF] += 1
                mask &= mask - np.uint64(1)
            a += 64
        for i in range(a, end):
            m = bits[i] & _MAG
            if (m >> 16) == top:
                h[m & 0xFFFF] += 1


@_kernel
def gather_window(bits, part, lo, span, starts, caps, keys, idx, above, counts):
    """Part ``p``: ``above[p]`` = how many of its ``m_i`` exceed ``lo + span``; ``counts[p]`` = how
    many lie in ``[lo, lo + span]``, whose ``(m_i, i)`` go, in index order, into ``keys``/``idx``
    from ``starts[p]`` on (at most ``caps[p]`` of them; more: the caller takes the histogram path)."""
    n = bits.size
    hi = lo + span
    rest = _MAG - lo
    for p in prange(counts.size):
        o = starts[p]
        cap = caps[p]
        c = 0
        ab = 0
        a = p * part
        end = min(n, (p + 1) * part)
        while a + 64 <= end:
            mask = _mag_mask64(bits, a, lo, span)
            ab += _ones(_mag_mask64(bits, a, lo, rest)) - _ones(mask)   # (at or above lo) − (in the window)
            while mask:
                i = a + _low_bit(mask)
                if c < cap:
                    keys[o + c] = bits[i] & _MAG
                    idx[o + c] = i
                c += 1
                mask &= mask - np.uint64(1)
            a += 64
        for i in range(a, end):
            m = bits[i] & _MAG
            if m > hi:
                ab += 1
            elif m >= lo:
                if c < cap:
                    keys[o + c] = m
                    idx[o + c] = i
                c += 1
        above[p] = ab
        counts[p] = c


@_inline
def _keep(m, t, left):
    """Whether a magnitude ``m ≥ t`` is kept, with ``left`` values equal to ``t`` still to keep."""
    return m > t or left > 0


@_kernel
def write_largest(bits, x, part, t, ties, offsets, ends, idx, values):
    """Every ``i`` with ``m_i > t``, and part ``p``'s first ``ties[p]`` with ``m_i == t``, in
    increasing order with ``x[i]``, part ``p``'s from ``offsets[p]`` on, never at or past
    ``ends[p]``; ``offsets[p]`` becomes where part ``p`` stopped (the caller checks it reached
    ``ends[p]``: a vector changed by another thread between the passes is refused, not written
    past)."""
    n = bits.size
    rest = _MAG - t
    for p in prange(offsets.size):
        o = offsets[p]
        stop = ends[p]
        left = ties[p]
        a = p * part
        end = min(n, (p + 1) * part)
        while a + 64 <= end:
            mask = _mag_mask64(bits, a, t, rest)
            while mask:
                i = a + _low_bit(mask)
                m = bits[i] & _MAG
                if _keep(m, t, left) and o < stop:
                    left -= m == t
                    idx[o] = i
                    values[o] = x[i]
                    o += 1
                mask &= mask - np.uint64(1)
            a += 64
        for i in range(a, end):
            m = bits[i] & _MAG
            if m >= t and _keep(m, t, left) and o < stop:
                left -= m == t
                idx[o] = i
                values[o] = x[i]
                o += 1
        offsets[p] = o
