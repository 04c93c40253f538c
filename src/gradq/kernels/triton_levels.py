"""Triton kernels of the schemes with per-bucket levels: ORQ and Linear (level rounding and its
decode, the levels themselves from a sort in registers), and the one-bit family (SignSGD, 1BitSGD,
BinGrad-b and -pb: statistics, bits and decode).

Part of the Triton backend (:mod:`gradq.kernels.triton_ops`, which exports these functions); every
function has the signature and the result of its namesake in :mod:`gradq.kernels.reference`.

* **Level rounding** (``_levels_encode_kernel``): each value's interval among its bucket's sorted
  levels, then the reference's stochastic rounding between the two ends.
* **Linear's levels**: each bucket sorted in registers by its order-preserving integer keys
  (``_bitonic_rows``, ``_order_key``).
* **ORQ's levels** (up to 17): the same sort, then the reference's rounds, whose sums are integers
  (fixed point), so a GPU's parallel reductions give the CPU's levels bit for bit.
* **BinGrad-pb's level**: the same sort, then the reference's float64 running sums in sorted order
  (``tl.cumsum``). Under the interpreter a scan runs in order, as on the CPU; on a GPU it is a
  parallel scan, whose sums may differ in their last bits (as torch's CUDA cumsum does too).
* Buckets above ``_SORT_MAX`` values and more ORQ levels take the reference.
* **The one-bit statistics**: whole power-of-two buckets per program, summed in the reference's
  pairwise order (``_fold_rows``); a partial last bucket in one more program.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import PayloadError
from . import reference
from ._args import RngLike, _bucket, _nbuckets, _stream, _width
from .triton_common import (TUNING, _counter_halves, _fast, _flat, _grid, _groups, _jit, _launch, _load8, _out,
                           _pack8_tail, _payload, _row_of, _store8, _uniform_at, _unpack8, _vector, tl)


@_jit
def _level_field(x, lv_ptr, row, u, L: tl.constexpr):
    """Stochastic rounding of ``x`` onto the sorted row ``row`` of L levels: ``hi`` = the number of
    levels below x (torch.searchsorted on a sorted row), ``p = (x − l_lo)/(l_hi − l_lo)``, ``hi if u < p``."""
    lv = lv_ptr + row * L
    hi = tl.zeros(x.shape, tl.int32)
    for j in tl.static_range(L):
        hi += (tl.load(lv + j) < x).to(tl.int32)
    hi = tl.minimum(hi, L - 1)
    lo = tl.maximum(hi - 1, 0)
    l_hi = tl.load(lv + hi)
    l_lo = tl.load(lv + lo)
    gap = l_hi - l_lo
    p = tl.where(gap > 0.0, tl.math.div_rn(x - l_lo, tl.where(gap > 0.0, gap, 1.0)), 0.0)
    return tl.where(u < p, hi, lo).to(tl.uint32)


@_jit
def _levels_encode_body(x_ptr, levels_ptr, out_ptr, first, rem, nbytes, bucket, b0, k1, k2, lo0, hi0,
                        L: tl.constexpr, W: tl.constexpr, G: tl.constexpr, WIDE: tl.constexpr, FAST: tl.constexpr):
    base = tl.arange(0, G) * 8
    v0, v1, v2, v3, v4, v5, v6, v7 = _load8(x_ptr + first, base, rem, FAST)
    f0 = _level_field(v0, levels_ptr, _row_of(first, base, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base, k1, k2, FAST), L)
    f1 = _level_field(v1, levels_ptr, _row_of(first, base + 1, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 1, k1, k2, FAST), L)
    f2 = _level_field(v2, levels_ptr, _row_of(first, base + 2, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 2, k1, k2, FAST), L)
    f3 = _level_field(v3, levels_ptr, _row_of(first, base + 3, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 3, k1, k2, FAST), L)
    f4 = _level_field(v4, levels_ptr, _row_of(first, base + 4, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 4, k1, k2, FAST), L)
    f5 = _level_field(v5, levels_ptr, _row_of(first, base + 5, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 5, k1, k2, FAST), L)
    f6 = _level_field(v6, levels_ptr, _row_of(first, base + 6, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 6, k1, k2, FAST), L)
    f7 = _level_field(v7, levels_ptr, _row_of(first, base + 7, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 7, k1, k2, FAST), L)
    _pack8_tail(f0, f1, f2, f3, f4, f5, f6, f7, out_ptr, first, base, rem, nbytes, W, WIDE, FAST)


@_jit
def _levels_encode_kernel(x_ptr, levels_ptr, out_ptr, n, nbytes, bucket, k1, k2, ctr0,
                          L: tl.constexpr, W: tl.constexpr, G: tl.constexpr, WIDE: tl.constexpr):
    """Level indices (:func:`_level_field`) of every value, packed in W bits: a group of eight a
    thread; a whole program inside one bucket whose counters do not pass a multiple of 2**32 runs
    unmasked with its levels' row as scalars."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    lo0, hi0, nowrap = _counter_halves(ctr0, first, 8 * G)
    if fast & nowrap:
        _levels_encode_body(x_ptr, levels_ptr, out_ptr, first, rem, nbytes, bucket, b0, k1, k2, lo0, hi0, L, W, G,
                            WIDE, True)
    else:
        _levels_encode_body(x_ptr, levels_ptr, out_ptr, first, rem, nbytes, bucket, b0, k1, k2, lo0, hi0, L, W, G,
                            WIDE, False)


@_jit
def _level_value(f, lv_ptr, row, L, over, o, rem, FAST: tl.constexpr):
    """The level of index ``f`` in row ``row`` (index 0 where it is out of range) and ``over`` plus
    whether it is out of range (counted only below offset ``rem`` unless FAST)."""
    bad = f >= L
    if not FAST:
        bad = bad & (o < rem)
    return tl.load(lv_ptr + row * L + tl.where(f >= L, 0, f)), over + bad.to(tl.int32)


@_jit
def _levels_decode_body(data_ptr, levels_ptr, out_ptr, bad_ptr, first, rem, nbytes, bucket, b0, L,
                        W: tl.constexpr, G: tl.constexpr, WIDE: tl.constexpr, FAST: tl.constexpr):
    g = tl.arange(0, G)
    base = g * 8
    bfirst = first // 8 * W
    f0, f1, f2, f3, f4, f5, f6, f7 = _unpack8(data_ptr + bfirst, g, nbytes - bfirst, W, WIDE and FAST)
    over = tl.zeros((G,), tl.int32)
    v0, over = _level_value(f0, levels_ptr, _row_of(first, base, rem, bucket, b0, FAST), L, over, base, rem, FAST)
    v1, over = _level_value(f1, levels_ptr, _row_of(first, base + 1, rem, bucket, b0, FAST), L, over, base + 1, rem,
                            FAST)
    v2, over = _level_value(f2, levels_ptr, _row_of(first, base + 2, rem, bucket, b0, FAST), L, over, base + 2, rem,
                            FAST)
    v3, over = _level_value(f3, levels_ptr, _row_of(first, base + 3, rem, bucket, b0, FAST), L, over, base + 3, rem,
                            FAST)
    v4, over = _level_value(f4, levels_ptr, _row_of(first, base + 4, rem, bucket, b0, FAST), L, over, base + 4, rem,
                            FAST)
    v5, over = _level_value(f5, levels_ptr, _row_of(first, base + 5, rem, bucket, b0, FAST), L, over, base + 5, rem,
                            FAST)
    v6, over = _level_value(f6, levels_ptr, _row_of(first, base + 6, rem, bucket, b0, FAST), L, over, base + 6, rem,
                            FAST)
    v7, over = _level_value(f7, levels_ptr, _row_of(first, base + 7, rem, bucket, b0, FAST), L, over, base + 7, rem,
                            FAST)
    _store8(out_ptr + first, base, rem, v0, v1, v2, v3, v4, v5, v6, v7, FAST)
    tl.store(bad_ptr + tl.program_id(0), tl.sum(over, axis=0))


@_jit
def _levels_decode_kernel(data_ptr, levels_ptr, out_ptr, bad_ptr, n, nbytes, bucket, L,
                          W: tl.constexpr, G: tl.constexpr, WIDE: tl.constexpr):
    """Each value's level by its W-bit index, and per program the number of indices ``≥ L``."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    if fast:
        _levels_decode_body(data_ptr, levels_ptr, out_ptr, bad_ptr, first, rem, nbytes, bucket, b0, L, W, G, WIDE,
                            True)
    else:
        _levels_decode_body(data_ptr, levels_ptr, out_ptr, bad_ptr, first, rem, nbytes, bucket, b0, L, W, G, WIDE,
                            False)


@_jit
def _threshold_body(x_ptr, t_ptr, out_ptr, first, rem, nbytes, bucket, b0, G: tl.constexpr, FAST: tl.constexpr):
    base = tl.arange(0, G) * 8
    v0, v1, v2, v3, v4, v5, v6, v7 = _load8(x_ptr + first, base, rem, FAST)
    f0 = (v0.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base, rem, bucket, b0, FAST))).to(tl.uint32)
    f1 = (v1.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 1, rem, bucket, b0, FAST))).to(tl.uint32)
    f2 = (v2.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 2, rem, bucket, b0, FAST))).to(tl.uint32)
    f3 = (v3.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 3, rem, bucket, b0, FAST))).to(tl.uint32)
    f4 = (v4.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 4, rem, bucket, b0, FAST))).to(tl.uint32)
    f5 = (v5.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 5, rem, bucket, b0, FAST))).to(tl.uint32)
    f6 = (v6.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 6, rem, bucket, b0, FAST))).to(tl.uint32)
    f7 = (v7.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 7, rem, bucket, b0, FAST))).to(tl.uint32)
    _pack8_tail(f0, f1, f2, f3, f4, f5, f6, f7, out_ptr, first, base, rem, nbytes, 1, False, FAST)


@_jit
def _threshold_kernel(x_ptr, t_ptr, out_ptr, n, nbytes, bucket, G: tl.constexpr):
    """Bits ``float64(x) >= t[bucket]`` packed 8 per byte (bit i of byte g = element 8g + i)."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    if fast:
        _threshold_body(x_ptr, t_ptr, out_ptr, first, rem, nbytes, bucket, b0, G, True)
    else:
        _threshold_body(x_ptr, t_ptr, out_ptr, first, rem, nbytes, bucket, b0, G, False)


@_jit
def _pb_bit(x, b, u):
    """BinGrad-pb's bit ``u < clamp((x + b)/(2·b), 0, 1)`` (1 where ``b = 0``)."""
    safe = tl.where(b > 0.0, b, 1.0)
    p = tl.math.div_rn(x + b, 2.0 * safe)
    p = tl.minimum(tl.maximum(p, 0.0), 1.0)
    p = tl.where(b > 0.0, p, 1.0)
    return (u < p).to(tl.uint32)


@_jit
def _pb_bits_body(x_ptr, b_ptr, out_ptr, first, rem, nbytes, bucket, b0, k1, k2, lo0, hi0, G: tl.constexpr,
                  FAST: tl.constexpr):
    base = tl.arange(0, G) * 8
    v0, v1, v2, v3, v4, v5, v6, v7 = _load8(x_ptr + first, base, rem, FAST)
    f0 = _pb_bit(v0, tl.load(b_ptr + _row_of(first, base, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base, k1, k2, FAST))
    f1 = _pb_bit(v1, tl.load(b_ptr + _row_of(first, base + 1, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 1, k1, k2, FAST))
    f2 = _pb_bit(v2, tl.load(b_ptr + _row_of(first, base + 2, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 2, k1, k2, FAST))
    f3 = _pb_bit(v3, tl.load(b_ptr + _row_of(first, base + 3, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 3, k1, k2, FAST))
    f4 = _pb_bit(v4, tl.load(b_ptr + _row_of(first, base + 4, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 4, k1, k2, FAST))
    f5 = _pb_bit(v5, tl.load(b_ptr + _row_of(first, base + 5, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 5, k1, k2, FAST))
    f6 = _pb_bit(v6, tl.load(b_ptr + _row_of(first, base + 6, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 6, k1, k2, FAST))
    f7 = _pb_bit(v7, tl.load(b_ptr + _row_of(first, base + 7, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 7, k1, k2, FAST))
    _pack8_tail(f0, f1, f2, f3, f4, f5, f6, f7, out_ptr, first, base, rem, nbytes, 1, False, FAST)


@_jit
def _pb_bits_kernel(x_ptr, b_ptr, out_ptr, n, nbytes, bucket, k1, k2, ctr0, G: tl.constexpr):
    """BinGrad-pb's bits (:func:`_pb_bit`) packed 8 per byte."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    lo0, hi0, nowrap = _counter_halves(ctr0, first, 8 * G)
    if fast & nowrap:
        _pb_bits_body(x_ptr, b_ptr, out_ptr, first, rem, nbytes, bucket, b0, k1, k2, lo0, hi0, G, True)
    else:
        _pb_bits_body(x_ptr, b_ptr, out_ptr, first, rem, nbytes, bucket, b0, k1, k2, lo0, hi0, G, False)


@_jit
def _bit_value(bit, lv_ptr, row, PER: tl.constexpr):
    """A one-bit code's value: level ``bit`` of the bucket's two (PER = 2), else ``±`` its scale."""
    if PER == 2:
        return tl.load(lv_ptr + 2 * row + bit)
    else:
        return tl.load(lv_ptr + row) * (2 * bit - 1).to(tl.float32)


@_jit
def _bit_decode_body(data_ptr, levels_ptr, out_ptr, first, rem, nbytes, bucket, b0, PER: tl.constexpr,
                     G: tl.constexpr, FAST: tl.constexpr):
    g = tl.arange(0, G)
    base = g * 8
    f0, f1, f2, f3, f4, f5, f6, f7 = _unpack8(data_ptr + first // 8, g, nbytes - first // 8, 1, False)
    v0 = _bit_value(f0, levels_ptr, _row_of(first, base, rem, bucket, b0, FAST), PER)
    v1 = _bit_value(f1, levels_ptr, _row_of(first, base + 1, rem, bucket, b0, FAST), PER)
    v2 = _bit_value(f2, levels_ptr, _row_of(first, base + 2, rem, bucket, b0, FAST), PER)
    v3 = _bit_value(f3, levels_ptr, _row_of(first, base + 3, rem, bucket, b0, FAST), PER)
    v4 = _bit_value(f4, levels_ptr, _row_of(first, base + 4, rem, bucket, b0, FAST), PER)
    v5 = _bit_value(f5, levels_ptr, _row_of(first, base + 5, rem, bucket, b0, FAST), PER)
    v6 = _bit_value(f6, levels_ptr, _row_of(first, base + 6, rem, bucket, b0, FAST), PER)
    v7 = _bit_value(f7, levels_ptr, _row_of(first, base + 7, rem, bucket, b0, FAST), PER)
    _store8(out_ptr + first, base, rem, v0, v1, v2, v3, v4, v5, v6, v7, FAST)


@_jit
def _bit_decode_kernel(data_ptr, levels_ptr, out_ptr, n, nbytes, bucket, PER: tl.constexpr, G: tl.constexpr):
    """Every value of one-bit codes (:func:`_bit_value`)."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    if fast:
        _bit_decode_body(data_ptr, levels_ptr, out_ptr, first, rem, nbytes, bucket, b0, PER, G, True)
    else:
        _bit_decode_body(data_ptr, levels_ptr, out_ptr, first, rem, nbytes, bucket, b0, PER, G, False)


@_jit
def _fold_rows(v, ROWS: tl.constexpr, D: tl.constexpr, LOG: tl.constexpr):
    """:func:`gradq.kernels.reference.pairwise_row_sum` of every row of ``v`` (``[ROWS, D]``,
    ``D = 2**LOG ≤ SUM_BLOCK``): column ``i + D/2`` added to column ``i``, repeatedly. Each step
    sums an axis of two, one addition, so the order is the reference's. A reduction may start from
    ``+0.0``, which changes nothing but the sign of a zero, and only where the reference's sum is
    ``−0.0``: that is where every entry is ``−0.0`` (``x + (−x)`` is ``+0.0``), set at the end."""
    negzero = (v == 0.0) & (v.to(tl.int64, bitcast=True) < 0)
    allneg = tl.sum(tl.where(negzero, 0, 1), axis=1) == 0
    for j in tl.static_range(LOG):
        v = tl.sum(tl.reshape(v, (ROWS, 2, D >> (j + 1))), axis=1)
    bits = tl.reshape(v, (ROWS,)).to(tl.int64, bitcast=True)
    return tl.where(allneg, bits | (-9223372036854775807 - 1), bits).to(tl.float64, bitcast=True)   # sign bit


@_jit
def _fold_tail(v, w, buf_ptr, P: tl.constexpr):
    """:func:`gradq.kernels.reference.pairwise_row_sum` of one row of ``w ≤ P`` values (``v``,
    float64 ``[1, P]``), any ``w ≤ SUM_BLOCK``: the reference's folds (``h = ⌊w/2⌋``, column
    ``i + h`` added to column ``i``, an odd last column moved to ``h``) through the scratch
    ``buf_ptr`` (``P`` float64). Returns ``[1]``."""
    i = tl.arange(0, P)
    v = tl.reshape(v, (P,))
    while w > 1:
        tl.store(buf_ptr + i, v, mask=i < w)
        tl.debug_barrier()
        h = w // 2
        a = tl.load(buf_ptr + i, mask=i < h, other=0.0)
        b = tl.load(buf_ptr + i + h, mask=i < h, other=0.0)
        last = tl.load(buf_ptr + 2 * h + i * 0, mask=(i == h) & (w % 2 == 1), other=0.0)
        v = tl.where(i < h, a + b, last)
        tl.debug_barrier()
        w = h + w % 2
    tl.store(buf_ptr + i, v, mask=i < 1)
    tl.debug_barrier()
    r = tl.load(buf_ptr + tl.arange(0, 1))
    tl.debug_barrier()
    return r


@_jit
def _fold(v, w, buf_ptr, ROWS: tl.constexpr, D: tl.constexpr, LOG: tl.constexpr, TAIL: tl.constexpr):
    if TAIL:
        return _fold_tail(v, w, buf_ptr, D)
    else:
        return _fold_rows(v, ROWS, D, LOG)


@_jit
def _masked_mean(x, mask, empty, w, buf_ptr, ROWS: tl.constexpr, D: tl.constexpr, LOG: tl.constexpr,
                 TAIL: tl.constexpr):
    """:func:`gradq.kernels.reference.masked_mean` of the rows of ``x`` (float64 ``[ROWS, D]``)."""
    cnt = tl.sum(mask.to(tl.int64), axis=1)
    tot = _fold(tl.where(mask, x, 0.0), w, buf_ptr, ROWS, D, LOG, TAIL)
    safe = tl.where(cnt > 0, cnt, 1).to(tl.float64)
    return tl.where(cnt > 0, tot / safe, empty)   # float64 '/' is div.rn.f64


@_jit
def _pack_rows(bits, bits_ptr, row, ok, w, ROWS: tl.constexpr, D: tl.constexpr):
    """The bits ``[ROWS, D]`` (0/1 int32, ``D`` a multiple of 8) of whole rows packed eight a byte,
    bit ``i`` of byte ``g`` = column ``8g + i`` (``threshold_encode``'s layout), into ``bits_ptr``
    at ``D/8`` bytes a row: the bytes that hold one of the first ``w`` columns of the live rows."""
    byte = tl.sum(tl.reshape(bits, (ROWS, D // 8, 8)) << tl.arange(0, 8)[None, None, :], axis=2)
    g = tl.arange(0, D // 8)
    keep = ok[:, None] & (g[None, :] < (w + 7) // 8)
    tl.store(bits_ptr + row[:, None] * (D // 8) + g[None, :], byte.to(tl.uint8), mask=keep)


@_jit
def _binary_stats_kernel(x_ptr, t_ptr, lv_ptr, buf_ptr, bits_ptr, nrows, w, MODE: tl.constexpr,
                         ITERS: tl.constexpr, D: tl.constexpr, LOG: tl.constexpr, ROWS: tl.constexpr,
                         TAIL: tl.constexpr, BITS: tl.constexpr):
    """The one-bit statistics of buckets of ``w`` values, as
    :func:`gradq.kernels.reference.one_bit_stats`: float64 thresholds into ``t_ptr`` and float32
    levels into ``lv_ptr`` (MODE 0, SignSGD: ``mean |x|``; 1, 1BitSGD: the means of ``x < 0`` and
    ``x ≥ 0``; 2, BinGrad-b: ``(b0, b1)`` after ``ITERS`` Lloyd steps). Either ``ROWS`` full
    buckets of ``w = D = 2**LOG`` values a program, or (``TAIL``) one bucket of any ``w ≤ D``,
    whose folds go through the scratch ``buf_ptr`` (``w`` float64). With ``BITS`` (``D ≥ 8``) the
    same read writes the bits ``float64(x) ≥ t`` into ``bits_ptr`` (``threshold_encode``'s, whose
    bucket starts at a byte: its first bucket's) instead of the thresholds, so that the encode
    reads ``x`` once and holds no threshold array."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, D)
    ok = row < nrows
    ok2 = ok[:, None] & (col[None, :] < w)
    x32 = tl.load(x_ptr + row[:, None] * D + col[None, :], mask=ok2, other=0.0)
    x = x32.to(tl.float64)
    dd = tl.zeros((ROWS,), tl.float64) + w.to(tl.float64)
    zero = tl.zeros((ROWS,), tl.float64)
    if MODE == 0:
        if not BITS:
            tl.store(t_ptr + row, zero, mask=ok)
        lv = _fold(tl.abs(x), w, buf_ptr, ROWS, D, LOG, TAIL) / dd
        tl.store(lv_ptr + row, lv.to(tl.float32), mask=ok)
        if BITS:
            _pack_rows((ok2 & (x >= 0.0)).to(tl.int32), bits_ptr, row, ok, w, ROWS, D)
    else:
        if MODE == 1:
            t = zero
            up = ok2 & (x32 >= 0.0)
            b0 = _masked_mean(x, ok2 & (up == 0), zero, w, buf_ptr, ROWS, D, LOG, TAIL)
            b1 = _masked_mean(x, up, zero, w, buf_ptr, ROWS, D, LOG, TAIL)
        else:
            t = _fold(x, w, buf_ptr, ROWS, D, LOG, TAIL) / dd
            b0 = t
            b1 = t
            for step in tl.static_range(ITERS + 1):
                if step > 0:
                    t = 0.5 * (b0 + b1)
                upper = ok2 & (x >= t[:, None])
                b0 = _masked_mean(x, ok2 & (upper == 0), t, w, buf_ptr, ROWS, D, LOG, TAIL)
                b1 = _masked_mean(x, upper, t, w, buf_ptr, ROWS, D, LOG, TAIL)
        if not BITS:
            tl.store(t_ptr + row, t, mask=ok)
        tl.store(lv_ptr + 2 * row, b0.to(tl.float32), mask=ok)
        tl.store(lv_ptr + 2 * row + 1, b1.to(tl.float32), mask=ok)
        if BITS:
            _pack_rows((ok2 & (x >= t[:, None])).to(tl.int32), bits_ptr, row, ok, w, ROWS, D)


@_jit
def _bitonic_rows(v, ROWS: tl.constexpr, P: tl.constexpr, LOG: tl.constexpr):
    """Every row of ``v`` (integers, ``[ROWS, P]``, ``P = 2**LOG``) sorted ascending by a bitonic
    network: merges of blocks of ``2**s``, exchanges at distance ``2**(s − 1 − t)``, a block sorted
    downwards where bit ``s`` of the position is set. An exchange views the row as ``(…, 2, j)`` and
    takes the minimum and maximum over the axis of two."""
    side = tl.reshape(tl.arange(0, 2), (1, 1, 2, 1))
    for s in tl.static_range(1, LOG + 1):
        for t in tl.static_range(s):
            y = tl.reshape(v, (ROWS, P >> (s - t), 2, 1 << (s - 1 - t)))
            lo = tl.min(y, axis=2, keep_dims=True)
            hi = tl.max(y, axis=2, keep_dims=True)
            down = (tl.reshape(tl.arange(0, P >> (s - t)), (1, P >> (s - t), 1, 1)) >> t) & 1
            v = tl.reshape(tl.where(side == down, lo, hi), (ROWS, P))
    return v


@_jit
def _order_key(b):
    """The signed order-preserving key of int32 float bit patterns ``b`` (``−0.0`` below ``+0.0``);
    the map is its own inverse."""
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@_jit
def _linear_levels_kernel(x_ptr, pos_ptr, lv_ptr, n, bucket, nrows, L: tl.constexpr, P: tl.constexpr,
                          LOG: tl.constexpr, ROWS: tl.constexpr):
    """Linear's levels of buckets (``bucket ≤ P`` values; the last may be shorter): each row sorted
    by the order-preserving integer keys of its values (``reference.sort_rows``: ``−0.0`` before
    ``+0.0``), padded with the largest key, and its values at the positions ``pos_ptr[0:L]`` (a
    full bucket) or ``pos_ptr[L:2L]`` (a shorter last one)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, P)
    start = row * bucket
    width = tl.minimum(n - start, bucket)
    live = row < nrows
    ok = live[:, None] & (col[None, :] < width[:, None])
    b = tl.load(x_ptr + start[:, None] + col[None, :], mask=ok, other=0.0).to(tl.int32, bitcast=True)
    key = tl.where(ok, _order_key(b), 0x7FFFFFFF)
    srt = _bitonic_rows(key, ROWS, P, LOG)
    tail = tl.where(width < bucket, L, 0)
    for j in tl.static_range(L):
        p = tl.load(pos_ptr + tail + j, mask=live, other=0)
        k = tl.sum(tl.where(col[None, :] == p[:, None], srt, 0), axis=1)   # the one key at p
        v = _order_key(k).to(tl.float32, bitcast=True)
        tl.store(lv_ptr + row * L + j, v, mask=live)


@_jit
def _orq_levels_kernel(x_ptr, lv_ptr, n, bucket, LG_FULL, LG_TAIL, L: tl.constexpr, LP: tl.constexpr,
                       ITER: tl.constexpr, P: tl.constexpr, LOG: tl.constexpr):
    """ORQ's ``L`` levels of one bucket a program (``bucket ≤ P`` values; the last may be shorter), as
    :func:`gradq.kernels.reference.orq_levels`: the values sorted by their order-preserving integer
    keys, the least and greatest as the first two levels, then ``ITER`` rounds that split every
    interval at the value of rank ``max(⌈R/(B − A)⌉, at_lo + 1)`` in its segment (``R = Σ (B − G)``,
    every value in fixed point ``G = ⌊g·2^sh⌋``, int64), or at the clamped midpoint where that rank
    reaches the values equal to the interval's top. Integer sums do not depend on their order, so the
    GPU's parallel reductions give the CPU's levels.

    Every sorted value carries the index of its interval (``ids``, non-decreasing along the row).
    After a round the index becomes ``2·ids + (value ≥ new level)``, which is the reference's
    ``searchsorted(right) − 1`` against the interleaved levels: a new level lies inside its
    interval. Segment counts and starts come from histograms of the indices (no scan with an
    operator of its own, which the interpreter runs element by element). A segment is a run of the
    sorted row, so its fixed-point total is the difference of two running sums of the row (one
    ``cumsum`` before the rounds, two gathers a round; int64 sums wrap exactly and every true
    total fits), not a ``[P, LP]`` sum a round. Levels are kept as bit patterns in ``[LP]``
    (``LP ≥ L``, a power of two) and moved with gathers, never rounded. ``LG_FULL``/``LG_TAIL``:
    ``⌈log2 d⌉`` of a full and of the last bucket."""
    r = tl.program_id(0).to(tl.int64)
    start = r * bucket
    width = tl.minimum(n - start, bucket).to(tl.int32)
    col = tl.arange(0, P)
    ok = col < width
    b = tl.load(x_ptr + start + col, mask=ok, other=0.0).to(tl.int32, bitcast=True)
    key = tl.where(ok, _order_key(b), 0x7FFFFFFF)
    srtk = _order_key(tl.reshape(_bitonic_rows(tl.reshape(key, (1, P)), 1, P, LOG), (P,)))   # float bits
    srt = srtk.to(tl.float32, bitcast=True)
    j = tl.arange(0, LP)
    lo_bits = tl.sum(tl.where(col == 0, srtk, 0), axis=0)
    hi_bits = tl.sum(tl.where(col == width - 1, srtk, 0), axis=0)
    # the fixed point of reference.orq_shift / orq_fixed: 2^sh built from its bits
    top = tl.maximum(lo_bits & 0x7FFFFFFF, hi_bits & 0x7FFFFFFF)
    e = tl.maximum((top >> 23) & 0xFF, 1) - 126
    sh = 61 - e - tl.where(width == bucket, LG_FULL, LG_TAIL)
    p2 = ((sh + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)
    fix = tl.where(ok, tl.floor(srt.to(tl.float64) * p2).to(tl.int64), 0)
    run = tl.cumsum(fix, 0)                    # a segment's total: a difference of two of these
    lvk = tl.where(j == 0, lo_bits, tl.where(j == 1, hi_bits, 0))      # 2 levels so far
    ids = tl.zeros([P], dtype=tl.int32)
    for it in tl.static_range(ITER):
        lv = lvk.to(tl.float32, bitcast=True)
        hi = tl.gather(lv, tl.minimum(j + 1, LP - 1), 0)
        a = tl.gather(lv, ids, 0)
        bb = tl.gather(lv, ids + 1, 0)
        # per segment (the padding counts as one more interval): its count, first position, values
        # equal to either end, and fixed-point total
        seg = tl.where(ok, ids, LP)
        cnt = tl.histogram(seg, 2 * LP)
        first = tl.cumsum(cnt, 0) - cnt
        at_lo = tl.histogram(tl.where(ok & (srt == a), ids, LP), 2 * LP)
        at_hi = tl.histogram(tl.where(ok & (srt == bb), ids, LP), 2 * LP)
        cnt = tl.gather(cnt, j, 0).to(tl.int64)
        first = tl.gather(first, j, 0)
        at_lo = tl.gather(at_lo, j, 0)
        at_hi = tl.gather(at_hi, j, 0)
        end = tl.gather(run, tl.minimum(tl.maximum(first + cnt.to(tl.int32) - 1, 0), P - 1), 0)
        head = tl.gather(run, tl.maximum(first - 1, 0), 0)
        total = tl.where(cnt > 0, end - tl.where(first > 0, head, 0), 0)
        a_fix = tl.floor(lv.to(tl.float64) * p2).to(tl.int64)
        b_fix = tl.floor(hi.to(tl.float64) * p2).to(tl.int64)
        gap = b_fix - a_fix
        need = cnt * b_fix - total                    # R = Σ (b − g) >= 0
        safe = tl.maximum(gap, 1)
        k = tl.where(gap > 0, need // safe + (need % safe > 0).to(tl.int64), 1)
        rank = tl.maximum(tl.maximum(k, 1), (at_lo + 1).to(tl.int64))
        found = rank <= cnt - at_hi
        c_bits = tl.gather(srtk, tl.minimum(tl.maximum(first + rank.to(tl.int32) - 1, 0), P - 1), 0)
        # no split: the midpoint, halves first (no overflow), clamped into the interval
        mid = 0.5 * lv + 0.5 * hi
        mid = tl.where(mid > hi, hi, tl.where(mid < lv, lv, mid))
        c_bits = tl.where(found, c_bits, mid.to(tl.int32, bitcast=True))
        if it + 1 < ITER:
            ids = 2 * ids + (srt >= tl.gather(c_bits.to(tl.float32, bitcast=True), ids, 0)).to(tl.int32)
        # interleave: level k of the next round is old level k/2 (k even) or new level (k − 1)/2 (k odd)
        lvk = tl.where(j % 2 == 0, tl.gather(lvk, j // 2, 0), tl.gather(c_bits, tl.maximum(j - 1, 0) // 2, 0))
    tl.store(lv_ptr + r * L + j, lvk.to(tl.float32, bitcast=True), mask=j < L)


@_jit
def _pb_level_kernel(x_ptr, b_ptr, n, bucket, nrows, P: tl.constexpr, LOG: tl.constexpr, ROWS: tl.constexpr):
    """BinGrad-pb's ``b`` of whole buckets (``bucket ≤ P`` values; the last may be shorter), in the
    operations of :func:`gradq.kernels.reference.bingrad_pb_threshold`: each row's ``|x|`` sorted
    (their bit patterns order as their values), float64 tail sums ``S_k``, the first ``k`` with
    ``d·a_{k+1} ≥ S_k``, and ``max(S_k/d, a_k)``."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, P)
    start = row * bucket
    width = tl.maximum(tl.minimum(n - start, bucket), 1)
    live = row < nrows
    ok = live[:, None] & (col[None, :] < width[:, None])
    bits = tl.load(x_ptr + start[:, None] + col[None, :], mask=ok, other=0.0).to(tl.int32, bitcast=True)
    key = tl.where(ok, bits & 0x7FFFFFFF, 0x7FFFFFFF)
    a = tl.where(ok, _bitonic_rows(key, ROWS, P, LOG).to(tl.float32, bitcast=True).to(tl.float64), 0.0)
    tail = tl.cumsum(a, 1, reverse=True)                 # S_k = a_{k+1} + … + a_d; the padding adds +0.0
    dd = width.to(tl.float64)
    k = tl.sum((ok & (dd[:, None] * a < tail)).to(tl.int32), axis=1)
    s_k = tl.sum(tl.where(col[None, :] == k[:, None], tail, 0.0), axis=1)       # 0 where k = d
    a_k = tl.sum(tl.where(col[None, :] == k[:, None] - 1, a, 0.0), axis=1)      # 0 where k = 0
    tl.store(b_ptr + row, tl.maximum(s_k / dd, a_k).to(tl.float32), mask=live)


# -- ORQ / Linear --------------------------------------------------------------------------------
def _level_matrix(levels: torch.Tensor, nb: int, device: torch.device) -> tuple[torch.Tensor, int]:
    if not isinstance(levels, torch.Tensor) or levels.dim() != 2 or levels.shape[0] != nb:
        raise ValueError(f"levels must be a ({nb}, L) float32 tensor, one row per bucket")
    L = int(levels.shape[1])
    if not 2 <= L <= 256:
        raise ValueError(f"the number of levels must be in [2, 256], got {L}")
    return _flat(levels, "levels", torch.float32).to(device), L


def levels_encode(x: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], width: int, rng: RngLike,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.levels_encode`."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    lv, L = _level_matrix(levels, _nbuckets(n, d), xv.device)
    if L > (1 << _width(width)):
        raise ValueError(f"{L} level indices do not fit in {width} bits")
    nbytes = (n * width + 7) // 8
    packed = _out(out, nbytes, torch.uint8, xv.device)
    k1, k2, ctr0 = _stream(rng, n)
    if n:
        _launch(_levels_encode_kernel, _grid(-(-n // 8), _groups()), xv, lv, packed, n, nbytes, d, k1, k2, ctr0,
                L=L, W=width, G=_groups(), WIDE=packed.data_ptr() % 4 == 0)
    return packed


def levels_decode(packed: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], width: int, n: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.levels_decode`."""
    nbytes = (n * _width(width) + 7) // 8
    data = _payload(packed, nbytes, f"{width}-bit indices")
    d = _bucket(n, bucket)
    lv, L = _level_matrix(levels, _nbuckets(n, d), data.device)
    res = _out(out, n, torch.float32, data.device)
    if n:
        grid = _grid(-(-n // 8), _groups())
        bad = torch.zeros(grid[0], dtype=torch.int32, device=data.device)
        _launch(_levels_decode_kernel, grid, data, lv, res, bad, n, nbytes, d, L, W=width, G=_groups(),
                WIDE=data.data_ptr() % 4 == 0)
        if int(bad.sum()):
            raise PayloadError(f"level index out of range [0, {L - 1}]")
    return res


_SORT_MAX = 4096       # longest bucket sorted in a Triton program (Linear's, ORQ's and BinGrad-pb's levels)
_ORQ_LEVELS_MAX = 17   # most ORQ levels built in a Triton program (more take the reference in torch)
_POSITIONS: dict = {}


def _positions(d: int, tail: int, L: int, device: torch.device) -> torch.Tensor:
    """Linear's sorted positions ``round(i·(m − 1)/(L − 1))`` (as ``reference.linear_levels``
    computes them) for a full bucket ``m = d`` and a last bucket ``m = tail``, made once per device."""
    key = (d, tail, L, str(device))
    if key not in _POSITIONS:
        _POSITIONS[key] = torch.cat([reference.linear_positions(m, L) for m in (d, max(tail, 1))]).to(device)
    return _POSITIONS[key]


def _torch_levels(xv: torch.Tensor, L: int, bucket: Optional[int], make_levels) -> torch.Tensor:
    """``(nb, L)`` levels of every bucket chunk of ``xv`` by the reference's ``make_levels``, in torch."""
    chunks = list(reference.bucket_chunks(xv, bucket))
    return torch.cat([make_levels(m, L) for m in chunks]) if chunks else xv.new_zeros(0, L)


def linear_levels(x: torch.Tensor, L: int, bucket: Optional[int]) -> torch.Tensor:
    """Linear's ``(nb, L)`` levels of every bucket of ``x``, as ``reference.linear_levels`` per bucket
    chunk: one Triton pass for buckets of up to ``_SORT_MAX`` values, torch for longer ones."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    reference.check_level_count(L)
    nb = _nbuckets(n, d)
    if d > _SORT_MAX:
        return _torch_levels(xv, L, bucket, reference.linear_levels)
    levels = torch.empty(nb, L, dtype=torch.float32, device=xv.device)
    if nb:
        p = max(16, 1 << (d - 1).bit_length())
        rows = _rows_per_program(max(1, TUNING["sort_elems"] // p), nb)
        _launch(_linear_levels_kernel, _grid(nb, rows), xv, _positions(d, n - (nb - 1) * d, L, xv.device), levels,
                n, d, nb, L=L, P=p, LOG=p.bit_length() - 1, ROWS=rows, num_warps=TUNING["sort_warps"])
    return levels


def orq_levels(x: torch.Tensor, L: int, bucket: Optional[int]) -> torch.Tensor:
    """ORQ's ``(nb, L)`` levels of every bucket of ``x``, as ``reference.orq_levels`` per bucket
    chunk: one Triton program a bucket for buckets of up to ``_SORT_MAX`` values and up to
    ``_ORQ_LEVELS_MAX`` levels, torch otherwise (and with a Triton that lacks ``tl.gather``)."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    reference.check_level_count(L)
    nb = _nbuckets(n, d)
    if d > _SORT_MAX or L > _ORQ_LEVELS_MAX or not hasattr(tl, "gather"):
        return _torch_levels(xv, L, bucket, reference.orq_levels)
    levels = torch.empty(nb, L, dtype=torch.float32, device=xv.device)
    if nb:
        p = max(16, 1 << (d - 1).bit_length())
        warps = min(32, max(1, p // TUNING["orq_warp_elems"]))
        tail = n - (nb - 1) * d
        _launch(_orq_levels_kernel, (nb,), xv, levels, n, d, (d - 1).bit_length(), (tail - 1).bit_length(),
                L=L, LP=1 << (L - 1).bit_length(),
                ITER=(L - 1).bit_length() - 1, P=p, LOG=p.bit_length() - 1, num_warps=warps)
    return levels


def orq_encode(x: torch.Tensor, L: int, bucket: Optional[int], width: int, rng: RngLike,
               out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.orq_encode`: two passes, the levels and then the codes."""
    xv = _flat(x, "x", torch.float32)
    levels = orq_levels(xv, L, bucket)
    return levels_encode(xv, levels, bucket, width, rng, out), levels


def linear_encode(x: torch.Tensor, L: int, bucket: Optional[int], width: int, rng: RngLike,
                  out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.linear_encode`: two passes, the levels and then the codes."""
    xv = _flat(x, "x", torch.float32)
    levels = linear_levels(xv, L, bucket)
    return levels_encode(xv, levels, bucket, width, rng, out), levels


# -- one bit per element -------------------------------------------------------------------------
def threshold_encode(x: torch.Tensor, thresholds: torch.Tensor, bucket: Optional[int],
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.threshold_encode`."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    t = _vector(thresholds, _nbuckets(n, d), "thresholds", torch.float64, xv.device)
    nbytes = (n + 7) // 8
    packed = _out(out, nbytes, torch.uint8, xv.device)
    if n:
        _launch(_threshold_kernel, _grid(-(-n // 8), _groups()), xv, t, packed, n, nbytes, d, G=_groups())
    return packed


def sign_encode(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.sign_encode`."""
    xv = _flat(x, "x", torch.float32)
    zero = torch.zeros(1 if xv.numel() else 0, dtype=torch.float64, device=xv.device)
    return threshold_encode(xv, zero, None, out=out)


def bit_decode(packed: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], n: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.bit_decode`."""
    nbytes = (n + 7) // 8
    data = _payload(packed, nbytes, "bits")
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    per = 2 if levels.dim() == 2 and levels.shape[1] == 2 else 1
    lv = _flat(levels, "levels", torch.float32).to(data.device)
    if lv.numel() != nb * per:
        raise ValueError(f"expected {nb * per} levels ({per} per bucket), got {lv.numel()}")
    res = _out(out, n, torch.float32, data.device)
    if n:
        _launch(_bit_decode_kernel, _grid(-(-n // 8), _groups()), data, lv, res, n, nbytes, d, PER=per, G=_groups())
    return res


def _rows_per_program(most: int, rows: int) -> int:
    """Whole buckets per program: ``most`` (a power of two, at least 1), fewer when there are fewer
    rows than that (a power of two covering them), so that no program is mostly masked."""
    return max(1, min(most, 1 << max(rows - 1, 0).bit_length()))


def _stats_in_triton(n: int, d: int) -> bool:
    """Whether :func:`_binary_stats` runs its Triton kernels: a full bucket or more, of a power of two
    up to ``reference.SUM_BLOCK`` values."""
    return n >= d > 0 and not d & (d - 1) and d <= reference.SUM_BLOCK


def _binary_stats(xv: torch.Tensor, bucket: Optional[int], mode: int, iters: int, stats,
                  bits: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """Per-bucket ``(float64 thresholds, flat float32 levels)`` as ``reference.one_bit_stats(xv,
    bucket, stats)``. Full buckets of a power-of-two size up to ``reference.SUM_BLOCK`` take one
    Triton pass (whole buckets per program, each read once, nothing input-sized allocated), a
    partial last bucket one more launch; buckets of other sizes take the reference in torch. With
    ``bits`` (a Triton pass, buckets of 8 values or more) the same pass writes the bits of
    ``threshold_encode(xv, thresholds, bucket)`` there instead, and the thresholds are None."""
    n = xv.numel()
    d = _bucket(n, bucket)
    if not _stats_in_triton(n, d):
        return reference.one_bit_stats(xv, bucket, stats)
    nfull = n // d
    per = 1 if mode == 0 else 2
    nb = _nbuckets(n, d)
    lv = torch.empty(nb * per, dtype=torch.float32, device=xv.device)
    fused = bits is not None
    # (with the bits, the kernels write no thresholds: any pointer stands for them)
    t = lv if fused else torch.empty(nb, dtype=torch.float64, device=xv.device)
    out = bits if fused else t
    rows = _rows_per_program(max(1, TUNING["stats_elems"] // d), nfull)
    log = d.bit_length() - 1
    _launch(_binary_stats_kernel, _grid(nfull, rows), xv, t, lv, t, out, nfull, d, MODE=mode, ITERS=iters, D=d,
            LOG=log, ROWS=rows, TAIL=False, BITS=fused, num_warps=TUNING["stats_warps"])
    w = n - nfull * d
    if w:   # the partial last bucket: one program, its folds through a scratch row of w values
        scratch = torch.empty(w, dtype=torch.float64, device=xv.device)
        _launch(_binary_stats_kernel, (1,), xv[nfull * d:], t if fused else t[nfull:], lv[nfull * per:], scratch,
                out[nfull * d // 8:] if fused else t, 1, w, MODE=mode, ITERS=iters, D=d, LOG=log, ROWS=1, TAIL=True,
                BITS=fused)
    return (None if fused else t), lv


def _one_bit(x: torch.Tensor, bucket: Optional[int], mode: int, iters: int,
             stats) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistics (:func:`_binary_stats`) and the bits: in the statistics' own read of ``x``
    (``TUNING["stats_passes"] = 1``, buckets of 8 values or more), else by ``threshold_encode``."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    if TUNING["stats_passes"] == 1 and d >= 8 and _stats_in_triton(n, d):
        packed = torch.empty((n + 7) // 8, dtype=torch.uint8, device=xv.device)
        return packed, _binary_stats(xv, bucket, mode, iters, stats, packed)[1]
    t, lv = _binary_stats(xv, bucket, mode, iters, stats)
    return threshold_encode(xv, t, bucket), lv


def sign_scale_encode(x: torch.Tensor, bucket: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.sign_scale_encode`."""
    return _one_bit(x, bucket, 0, 0, reference.sign_scale_stats)


def onebit_encode(x: torch.Tensor, bucket: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.onebit_encode`."""
    return _one_bit(x, bucket, 1, 0, reference.onebit_stats)


def bingrad_b_encode(x: torch.Tensor, bucket: Optional[int], iters: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.bingrad_b_encode`."""
    return _one_bit(x, bucket, 2, iters, lambda mat: reference.bingrad_b_stats(mat, iters))


def bingrad_pb_levels(x: torch.Tensor, bucket: Optional[int]) -> torch.Tensor:
    """BinGrad-pb's float32 ``b`` of every bucket of ``x``, as ``reference.bingrad_pb_threshold`` per
    bucket chunk: whole buckets of up to ``_SORT_MAX`` values sorted in Triton programs, torch for
    longer ones."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    if d > _SORT_MAX:
        chunks = list(reference.bucket_chunks(xv, bucket))
        return torch.cat([reference.bingrad_pb_threshold(m) for m in chunks]) if chunks else xv.new_zeros(0)
    levels = torch.empty(nb, dtype=torch.float32, device=xv.device)
    if nb:
        p = max(16, 1 << (d - 1).bit_length())
        rows = _rows_per_program(max(1, TUNING["sort_elems"] // p), nb)
        _launch(_pb_level_kernel, _grid(nb, rows), xv, levels, n, d, nb, P=p, LOG=p.bit_length() - 1, ROWS=rows,
                num_warps=TUNING["sort_warps"])
    return levels


def bingrad_pb_encode(x: torch.Tensor, bucket: Optional[int], rng: RngLike) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.bingrad_pb_encode`: two passes, the level and then the bits."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    levels = bingrad_pb_levels(xv, bucket)
    nbytes = (n + 7) // 8
    packed = torch.empty(nbytes, dtype=torch.uint8, device=xv.device)
    k1, k2, ctr0 = _stream(rng, n)
    if n:
        _launch(_pb_bits_kernel, _grid(-(-n // 8), _groups()), xv, levels, packed, n, nbytes, d, k1, k2, ctr0,
                G=_groups())
    return packed, levels
