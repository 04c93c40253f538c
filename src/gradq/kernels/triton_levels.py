"""Triton kernels of the schemes with per-bucket levels, ORQ and Linear: level rounding and its decode,
and the levels themselves from a sort in registers (the sort that BinGrad-pb's level in
:mod:`gradq.kernels.triton_binary` takes too).

Part of the Triton backend (:mod:`gradq.kernels.triton_ops`, which exports these functions); every
function has the signature and the result of its namesake in :mod:`gradq.kernels.reference`.

* **Level rounding** (``_levels_encode_kernel``): each value's interval among its bucket's sorted
  levels, then the reference's stochastic rounding between the two ends.
* **Linear's levels**: each bucket sorted in registers by its order-preserving integer keys
  (``_bitonic_rows``, ``_order_key``).
* **ORQ's levels** (up to 17): the same sort, then the reference's rounds, whose sums are integers
  (fixed point), so a GPU's parallel reductions give the CPU's levels bit for bit.
* Buckets above ``_SORT_MAX`` values and more ORQ levels take the reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import reference
from ._args import RngLike, _bucket, _nbuckets, _stream, _width
from .checks import refuse_invalid
from .triton_common import (TUNING, _counter_halves, _fast, _flat, _grid, _groups, _jit, _launch, _load8, _out,
                           _pack8_tail, _payload, _row_of, _store8, _uniform_at, _unpack8, tl)


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
        bad = torch.empty(grid[0], dtype=torch.int32, device=data.device)   # (every program writes its count)
        _launch(_levels_decode_kernel, grid, data, lv, res, bad, n, nbytes, d, L, W=width, G=_groups(),
                WIDE=data.data_ptr() % 4 == 0)
        refuse_invalid(bad, lambda k: f"level index out of range [0, {L - 1}]", f"level indices above {L - 1}")
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


def _rows_per_program(most: int, rows: int) -> int:
    """Whole buckets per program: ``most`` (a power of two, at least 1), fewer when there are fewer
    rows than that (a power of two covering them), so that no program is mostly masked."""
    return max(1, min(most, 1 << max(rows - 1, 0).bit_length()))
