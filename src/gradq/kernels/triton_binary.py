"""Triton kernels of the one-bit schemes (scaled SignSGD, 1BitSGD, BinGrad-b and -pb): their per-bucket
statistics, their bits and their decode.

Part of the Triton backend (:mod:`gradq.kernels.triton_ops`, which exports these functions); every
function has the signature and the result of its namesake in :mod:`gradq.kernels.reference`.

* **The statistics** (``_binary_stats_kernel``): whole power-of-two buckets per program, summed in
  the reference's pairwise order (``_fold_rows``), a partial last bucket in the same launch's last
  program; for
  buckets of 8 to 4,096 values the same pass writes the bits from the tile it has loaded.
* **Bits for given thresholds** (``_threshold_kernel``) and **BinGrad-pb's bits**
  (``_pb_bits_kernel``, the reference's stochastic rounding onto ``±b``).
* **BinGrad-pb's level** (``_pb_level_kernel``): each bucket's ``|x|`` sorted in registers by the
  sort of :mod:`gradq.kernels.triton_levels`, then the reference's float64 running sums in sorted
  order (``tl.cumsum``). Under the interpreter a scan runs in order, as on the CPU; on a GPU it is a
  parallel scan, whose sums may differ in their last bits (as torch's CUDA cumsum does too).
* **The decode** (``_bit_decode_kernel``): one bit a value, onto the bucket's one or two levels.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import reference
from ._args import RngLike, _bucket, _nbuckets, _stream
from .triton_common import (TUNING, _counter_halves, _fast, _flat, _grid, _groups, _jit, _launch, _load8, _out,
                           _pack8_tail, _payload, _row_of, _store8, _uniform_at, _unpack8, _vector, tl)
from .triton_levels import _SORT_MAX, _bitonic_rows, _rows_per_program


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
def _binary_stats_rows(x_ptr, t_ptr, lv_ptr, buf_ptr, bits_ptr, row, ok, w, MODE: tl.constexpr,
                       ITERS: tl.constexpr, D: tl.constexpr, LOG: tl.constexpr, ROWS: tl.constexpr,
                       TAIL: tl.constexpr, BITS: tl.constexpr):
    """The one-bit statistics of the buckets ``row`` (``ROWS`` of them, those ``ok`` live) of ``w``
    values each, as :func:`gradq.kernels.reference.one_bit_stats`: float64 thresholds into ``t_ptr``
    and float32 levels into ``lv_ptr`` (MODE 0, SignSGD: ``mean |x|``; 1, 1BitSGD: the means of
    ``x < 0`` and ``x ≥ 0``; 2, BinGrad-b: ``(b0, b1)`` after ``ITERS`` Lloyd steps). Either whole
    buckets of ``w = D = 2**LOG`` values, or (``TAIL``) one bucket of any ``w ≤ D``, whose folds go
    through the scratch ``buf_ptr`` (``w`` float64). With ``BITS`` (``D ≥ 8``) the same read writes
    the bits ``float64(x) ≥ t`` into ``bits_ptr`` (``threshold_encode``'s, whose bucket starts at a
    byte) instead of the thresholds, so that the encode reads ``x`` once and holds no threshold
    array."""
    col = tl.arange(0, D)
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
def _binary_stats_kernel(x_ptr, t_ptr, lv_ptr, buf_ptr, bits_ptr, nrows, w, rem, MODE: tl.constexpr,
                         ITERS: tl.constexpr, D: tl.constexpr, LOG: tl.constexpr, ROWS: tl.constexpr,
                         TAIL: tl.constexpr, BITS: tl.constexpr):
    """:func:`_binary_stats_rows` of ``nrows`` whole buckets of ``w = D`` values, ``ROWS`` a program;
    with TAIL, the grid's last program takes the partial bucket of ``rem`` values after them (bucket
    ``nrows``, its folds through ``buf_ptr``), so that one launch covers the vector."""
    pid = tl.program_id(0)
    if TAIL and pid == tl.num_programs(0) - 1:
        last = tl.zeros((1,), tl.int64) + nrows
        _binary_stats_rows(x_ptr, t_ptr, lv_ptr, buf_ptr, bits_ptr, last, last <= nrows, rem, MODE, ITERS, D, LOG,
                           1, True, BITS)
    else:
        row = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        _binary_stats_rows(x_ptr, t_ptr, lv_ptr, buf_ptr, bits_ptr, row, row < nrows, w, MODE, ITERS, D, LOG,
                           ROWS, False, BITS)


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


# == the kernel API ===============================================================================
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


def _stats_in_triton(n: int, d: int) -> bool:
    """Whether :func:`_binary_stats` runs its Triton kernels: a full bucket or more, of a power of two
    up to ``reference.SUM_BLOCK`` values."""
    return n >= d > 0 and not d & (d - 1) and d <= reference.SUM_BLOCK


def _binary_stats(xv: torch.Tensor, bucket: Optional[int], mode: int, iters: int, stats,
                  bits: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """Per-bucket ``(float64 thresholds, flat float32 levels)`` as ``reference.one_bit_stats(xv,
    bucket, stats)``. Full buckets of a power-of-two size up to ``reference.SUM_BLOCK`` take one
    Triton pass (whole buckets per program, each read once, nothing input-sized allocated; a
    partial last bucket in the same launch's last program); buckets of other sizes take the
    reference in torch. With ``bits`` (a Triton pass, buckets of 8 values or more) the same pass
    writes the bits of ``threshold_encode(xv, thresholds, bucket)`` there instead, and the
    thresholds are None."""
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
    w = n - nfull * d   # a partial last bucket: a last program, its folds through w float64
    scratch = torch.empty(w, dtype=torch.float64, device=xv.device) if w else t
    args = (xv, t, lv, scratch, out, nfull, d, w)
    meta = dict(MODE=mode, ITERS=iters, D=d, LOG=log, BITS=fused)
    grid = _grid(nfull, rows)[0]
    if w and TUNING["stats_tail"] == 2:   # (the last program in a launch of its own, at the default warps)
        _launch(_binary_stats_kernel, (grid,), *args, ROWS=rows, TAIL=False, num_warps=TUNING["stats_warps"], **meta)
        _launch(_binary_stats_kernel, (1,), *args, ROWS=1, TAIL=True, **meta)
    else:
        _launch(_binary_stats_kernel, (grid + (1 if w else 0),), *args, ROWS=rows, TAIL=bool(w),
                num_warps=TUNING["stats_warps"], **meta)
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
