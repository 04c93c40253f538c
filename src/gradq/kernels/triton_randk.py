"""GlobalRandK-MaxNorm and -MultiScale on the Triton backend without materialising their subset.

The RandK variants keep the ``k`` coordinates of ``range(n)`` with the smallest keys
(:func:`gradq.kernels.reference.random_subset`) and apply MaxNorm or MultiScale, with one shared
scale, to that sub-vector in increasing position. Done literally, an encode holds the ``k`` sorted
int64 indices and the ``k`` gathered float32 values before it writes a byte (12 bytes a selected
value, 24× a 4-bit payload of them), and MultiScale a scale index byte a value besides. Here the
subset stays implicit:

* **The k-th draw.** A coordinate's key is its draw ``u_i`` (``bits32_i ^ 2³¹``, which orders as
  the reference's signed draw) and then its index. No two counters below 2³² share a draw (a
  counter's hash is a composition of bijections of 32-bit words), so the index never breaks a
  tie, and the subset is the coordinates with ``u_i ≤ t`` for the ``k``-th smallest draw ``t``.
  A radix select finds ``t`` on the device, ``BITS`` bits at a time from the top: each level is
  a pass that hashes the counters in registers (no memory read) and counts the draws with the
  bits picked so far in a histogram of their next bits, and a one-program pass that picks the bin
  holding the ``k``-th (shared with Top-K). The top level, where every draw counts, makes each
  program's histogram in registers (``tl.histogram``) and adds it bin by bin; below it about one
  draw in ``2^BITS`` matches, and each of those adds itself. The levels cover all 32 bits and
  count every draw, so the pick never runs short, and the last bin is one draw value. ``t`` stays
  in the selection's state on the device: the kernels that follow read it there, and the host
  reads nothing, so a new shared seed each step (the DDP hook's) never makes the host wait for
  the device.
* **Positions.** A pass counts the selected coordinates of each block of counters, and a
  one-program scan turns the counts into running sums in place: a selected coordinate's position
  in the sub-vector is its block's start plus the selected before it in the block.
* **Statistics, codes, values.** The scale pass reads only the selected values (a masked load),
  the encode quantizes them at their positions (the sub-vector's random counters) and ORs each
  field into its 32-bit word of the zeroed payload with an atomic OR (fields of one byte may come
  from two programs, and OR does not depend on their order), and the decode writes every
  coordinate of ``out`` once: the selected ones from their fields, the rest zero.

MultiScale computes each selected value's own scale index as it encodes (its fields: the code and
the index, each OR-ed into its words), and its decode refuses an index that names no scale before
it writes ``out``.

Memory: the histogram (``4·2^BITS`` bytes), one int32 a program of counters and a few scalars,
besides the payload. Bytes and floats equal the reference's composition (indices, gather, the
scheme's primitives, scatter). Where there is nothing to choose (``k`` 0 or ``n``), for
``n ≥ 2³¹``, and with ``TUNING["subset_path"]`` or ``TUNING["randk_path"]`` 2 (to time the two),
the functions return None and the caller takes that composition.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..random import RandomStream
from ._args import RngLike, _stream
from .checks import refuse_invalid
from .triton_common import TUNING, _flat, _grid, _jit, _launch, _out, _payload, _uniform_at, _vector, tl
from .triton_multiscale import _ms_code, _ms_levels, _ms_quotients, _ms_value
from .triton_ops import _field_r, _recip_s
from .triton_subset import _draw

_SCAN = 1024      # block counts a step of the one-program scan
_SUB = 1024       # counters a step of the other programs' loops
_DRAW_BITS = 32   # bits of a draw u_i


@_jit
def _randk_hist_kernel(hist_ptr, state_ptr, n, k1, k2, shift, width, BLOCK: tl.constexpr, SUB: tl.constexpr,
                       BINS: tl.constexpr, FIRST: tl.constexpr):
    """Count this program's draws whose bits above ``shift + width`` equal the state's prefix, in
    bins of their next ``width`` bits. FIRST (the top level, where every draw counts): a histogram
    in registers, added to the global one bin by bin (one atomic add a bin a program); below it,
    where about one draw in ``BINS`` matches, an atomic add a matching draw."""
    prefix = tl.load(state_ptr)
    if FIRST:
        acc = tl.zeros((BINS,), tl.int32)
    for c in range(BLOCK // SUB):
        o = tl.program_id(0) * BLOCK + c * SUB + tl.arange(0, SUB)
        u = _draw(o, k1, k2).to(tl.int64)
        keep = (o < n) & ((u >> (shift + width)) == prefix)
        b = ((u >> shift) & ((1 << width) - 1)).to(tl.int32)
        if FIRST:
            acc += tl.histogram(b, BINS, mask=keep)
        else:
            tl.atomic_add(hist_ptr + b, keep.to(tl.int32), mask=keep)
    if FIRST:
        tl.atomic_add(hist_ptr + tl.arange(0, BINS), acc, mask=acc > 0)


@_jit
def _randk_pick_kernel(hist_ptr, state_ptr, width, need0, BINS: tl.constexpr):
    """One program: the bin that holds the ``need``-th draw. State (int64): the prefix (bits kept so
    far), ``need`` (its rank among the draws with that prefix, from 1; ``need0`` at the first level),
    a failure flag (fewer draws than ``need``) and the picked bin's count. Zeroes the histogram for
    the next level."""
    i = tl.arange(0, BINS)
    h = tl.load(hist_ptr + i)
    c = tl.cumsum(h, axis=0).to(tl.int64)
    need = tl.load(state_ptr + 1)
    if need0 > 0:   # the first level: the state is zeros, and the rank is k
        need = need0.to(tl.int64)
    below = c < need
    b = tl.sum(below.to(tl.int64), axis=0)
    less = tl.sum(tl.where(below, h, 0).to(tl.int64), axis=0)
    eq = tl.sum(tl.where(i == b, h, 0).to(tl.int64), axis=0)
    short = (tl.sum(h.to(tl.int64), axis=0) < need).to(tl.int64)
    tl.store(state_ptr, (tl.load(state_ptr) << width) | b)
    tl.store(state_ptr + 1, need - less)
    tl.store(state_ptr + 2, tl.load(state_ptr + 2) | short)
    tl.store(state_ptr + 3, eq)
    tl.store(hist_ptr + i, tl.zeros((BINS,), tl.int32))


@_jit
def _selected(n, k1, k2, t_ptr, c, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Chunk ``c`` (SUB counters) of this program's BLOCK counters, and which of them the subset
    holds: the draws up to the ``k``-th smallest, read from the selection's state on the device
    (``t_ptr``: its first entry), so that no host reads it."""
    o = tl.program_id(0) * BLOCK + c * SUB + tl.arange(0, SUB)
    return o, (o < n) & (_draw(o, k1, k2).to(tl.int64) <= tl.load(t_ptr))


@_jit
def _randk_count_kernel(cnt_ptr, n, k1, k2, t_ptr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    total = tl.zeros((), tl.int32)
    for c in range(BLOCK // SUB):
        _, sel = _selected(n, k1, k2, t_ptr, c, BLOCK, SUB)
        total += tl.sum(sel.to(tl.int32), axis=0)
    tl.store(cnt_ptr + tl.program_id(0), total)


@_jit
def _randk_scan_kernel(cnt_ptr, m, CH: tl.constexpr):
    """One program: the inclusive running sums of ``m`` int32 counts, in place."""
    carry = tl.zeros((), tl.int32)
    start = tl.zeros((), tl.int32)
    while start < m:
        i = start + tl.arange(0, CH)
        c = tl.load(cnt_ptr + i, mask=i < m, other=0)
        tl.store(cnt_ptr + i, carry + tl.cumsum(c, axis=0), mask=i < m)
        carry += tl.sum(c, axis=0)
        start += CH


@_jit
def _randk_norm_kernel(x_ptr, acc_ptr, n, k1, k2, t_ptr, L2: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Of the selected values: the sum of float64 squares (L2), or the largest ``|x|`` bit pattern
    capped at inf's (a NaN reads as inf, as :func:`gradq.kernels.reference.maxabs_scales` has it)."""
    if L2:
        acc = tl.zeros((), tl.float64)
    else:
        acc = tl.zeros((), tl.int32)
    for c in range(BLOCK // SUB):
        o, sel = _selected(n, k1, k2, t_ptr, c, BLOCK, SUB)
        v = tl.load(x_ptr + o, mask=sel, other=0.0)
        if L2:
            w = v.to(tl.float64)
            acc += tl.sum(w * w, axis=0)
        else:
            acc = tl.maximum(acc, tl.max(tl.minimum(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x7F800000), axis=0))
    if L2:
        tl.atomic_add(acc_ptr, acc)
    else:
        tl.atomic_max(acc_ptr, acc)


@_jit
def _or_field(words_ptr, j, f, sel, W: tl.constexpr):
    """OR the W-bit fields ``f`` (uint32) of the selected lanes into bits ``j·W …`` of the words."""
    bit = j.to(tl.int64) * W
    word = bit >> 5
    sh = (bit & 31).to(tl.uint32)
    tl.atomic_or(words_ptr + word, (f << sh).to(tl.int32, bitcast=True), mask=sel)
    if 32 % W != 0:   # a field across two words
        over = sel & (sh + W > 32)
        tl.atomic_or(words_ptr + word + 1, (f >> (32 - tl.where(over, sh, 1))).to(tl.int32, bitcast=True),
                     mask=over)


@_jit
def _field_at(data_ptr, j, sel, nbytes, W: tl.constexpr):
    """The W-bit field at position ``j`` of packed bytes (W ≤ 8), for the selected lanes."""
    bit = j.to(tl.int64) * W
    byte = bit >> 3
    lo = tl.load(data_ptr + byte, mask=sel, other=0).to(tl.int32)
    hi = tl.load(data_ptr + byte + 1, mask=sel & (byte + 1 < nbytes), other=0).to(tl.int32)
    return (((hi << 8) | lo) >> (bit & 7).to(tl.int32)) & ((1 << W) - 1)


@_jit
def _places(sel, before):
    """The positions of a step's selected counters after the ``before`` selected ahead of it, and the
    count after the step."""
    one = sel.to(tl.int32)
    return before + tl.cumsum(one, axis=0) - 1, before + tl.sum(one, axis=0)


@_jit
def _start(incl_ptr):
    """The position of this program's first selected counter: the running sum before it."""
    pid = tl.program_id(0)
    return tl.load(incl_ptr + pid - 1, mask=pid > 0, other=0)


@_jit
def _randk_encode_kernel(x_ptr, words_ptr, incl_ptr, scale_ptr, n, k1, k2, t_ptr, s, rk1, rk2, lo0, hi0,
                         W: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """MaxNorm's field ``s ± min(floor(|v|·r + u), s)`` of each selected value at its position ``j``
    (``u`` the sub-vector's counter ``j``), OR-ed into bits ``j·W …`` of the zeroed words."""
    r = _recip_s(tl.load(scale_ptr), s)
    lo, hi = lo0.to(tl.uint32), hi0.to(tl.uint32)
    before = _start(incl_ptr)
    for c in range(BLOCK // SUB):
        o, sel = _selected(n, k1, k2, t_ptr, c, BLOCK, SUB)
        j, before = _places(sel, before)
        v = tl.load(x_ptr + o, mask=sel, other=0.0)
        f = _field_r(v, r, s, 0.0, _uniform_at(lo, hi, tl.where(sel, j, 0), rk1, rk2, False), False).to(tl.uint32)
        _or_field(words_ptr, j, f, sel, W)


@_jit
def _randk_decode_kernel(codes_ptr, out_ptr, incl_ptr, scale_ptr, n, nbytes, k1, k2, t_ptr, s, factor,
                         W: tl.constexpr, RESCALE: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Every coordinate of ``out``: ``(f − s)·(scale/s)`` (times ``factor`` with RESCALE) for the
    selected, from the field at their position, zero for the others."""
    m = tl.math.div_rn(tl.load(scale_ptr), s.to(tl.float32))
    before = _start(incl_ptr)
    for c in range(BLOCK // SUB):
        o, sel = _selected(n, k1, k2, t_ptr, c, BLOCK, SUB)
        j, before = _places(sel, before)
        f = _field_at(codes_ptr, j, sel, nbytes, W)
        val = (f - s).to(tl.float32) * m
        if RESCALE:
            val = val * factor
        tl.store(out_ptr + o, tl.where(sel, val, 0.0), mask=o < n)


@_jit
def _randk_ms_encode_kernel(x_ptr, w_ptr, lv_ptr, codes_ptr, index_ptr, incl_ptr, n, k1, k2, t_ptr, rk1, rk2, lo0,
                            hi0, L: tl.constexpr, W: tl.constexpr, IW: tl.constexpr, BLOCK: tl.constexpr,
                            SUB: tl.constexpr):
    """MultiScale's fields of each selected value under its own scale index (:func:`_ms_code`) at
    its position ``j``: the code OR-ed into bits ``j·W …`` of the zeroed code words and, with
    IW > 0, the index into bits ``j·IW …`` of the zeroed index words."""
    w = tl.load(w_ptr)
    lo, hi = lo0.to(tl.uint32), hi0.to(tl.uint32)
    before = _start(incl_ptr)
    for c in range(BLOCK // SUB):
        o, sel = _selected(n, k1, k2, t_ptr, c, BLOCK, SUB)
        j, before = _places(sel, before)
        v = tl.load(x_ptr + o, mask=sel, other=0.0)
        u = _uniform_at(lo, hi, tl.where(sel, j, 0), rk1, rk2, False)
        f, _, ix = _ms_code(v, w, j, lv_ptr, u, o, n, j, L, True, True)   # (OWN: no ix read, no count)
        _or_field(codes_ptr, j, f, sel, W)
        if IW > 0:
            _or_field(index_ptr, j, ix.to(tl.uint32), sel, IW)


@_jit
def _randk_ms_check_kernel(index_ptr, bad_ptr, k, ibytes, L: tl.constexpr, IW: tl.constexpr,
                           BLOCK: tl.constexpr):
    """Count the IW-bit indices of the ``k`` fields that name no scale (``≥ L``)."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = j < k
    ix = _field_at(index_ptr, j, live, ibytes, IW)
    tl.atomic_add(bad_ptr, tl.sum((live & (ix >= L)).to(tl.int32), axis=0))


@_jit
def _randk_ms_decode_kernel(codes_ptr, index_ptr, w_ptr, q_ptr, out_ptr, incl_ptr, n, nbytes, ibytes, k1, k2, t_ptr,
                            factor, L: tl.constexpr, W: tl.constexpr, IW: tl.constexpr, RESCALE: tl.constexpr,
                            BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Every coordinate of ``out``: MultiScale's value of the selected (:func:`_ms_value`, times
    ``factor`` with RESCALE) from the fields at their position, zero for the others."""
    w = tl.load(w_ptr)
    before = _start(incl_ptr)
    for c in range(BLOCK // SUB):
        o, sel = _selected(n, k1, k2, t_ptr, c, BLOCK, SUB)
        j, before = _places(sel, before)
        f = _field_at(codes_ptr, j, sel, nbytes, W)
        if IW > 0:
            ix = _field_at(index_ptr, j, sel, ibytes, IW)
        else:
            ix = tl.zeros((SUB,), tl.int32)
        val, _ = _ms_value(f, ix, w, q_ptr, o, n, j, L, W, True)   # (the bad count: the check before)
        if RESCALE:
            val = val * factor
        tl.store(out_ptr + o, tl.where(sel, val, 0.0), mask=o < n)


# -- the selection -----------------------------------------------------------------------------------
class Selection:
    """The subset of one ``(n, k, seed)``: the seed's hash keys, the device state whose first entry
    is the ``k``-th smallest draw ``t`` (int64; never read on the host), and the running sums of
    the selected counters per program of ``block`` counters."""

    __slots__ = ("n", "k", "k1", "k2", "state", "incl", "block")

    def __init__(self, n: int, k: int, k1: int, k2: int, state: torch.Tensor, incl: torch.Tensor,
                 block: int) -> None:
        self.n, self.k, self.k1, self.k2, self.state, self.incl, self.block = n, k, k1, k2, state, incl, block

    def args(self) -> tuple:
        return (self.n, self.k1, self.k2, self.state)


_LAST: Optional[tuple] = None   # (key, Selection or None): one entry, replaced whole


def _sub(block: int) -> int:
    """Counters a step of a program's loop (its registers: 8 a thread at 4 warps)."""
    return min(block, _SUB)


def _levels(bits: int, width: int) -> list[int]:
    """The widths of the histogram levels that cover ``bits`` bits, ``width`` at most each."""
    out = [width] * (bits // width)
    if bits % width:
        out.append(bits % width)
    return out


def _bin_bits(k: int) -> int:
    """Bits a histogram level: the more, the fewer levels (two launches each) cover a draw's 32
    bits, but the top level's register histogram costs about its bins a draw, so at most
    ``TUNING["randk_bins"]``; and few enough that the histogram stays small beside a payload of
    ``k`` fields (64 bins, six levels, below ``k`` ≈ 2¹³)."""
    top = max(6, TUNING["randk_bins"].bit_length() - 1)
    return max(6, min(top, k.bit_length() - 7))


def selection(n: int, k: int, seed: int, device: torch.device) -> Optional[Selection]:
    """The implicit subset of ``(n, k, seed)`` on ``device``, or None where the caller must take
    the indices (module docstring). The host reads nothing; a new ``(n, k, seed)`` queues the
    selection's passes, the same one again reuses them (one entry is kept)."""
    global _LAST
    block = TUNING["randk_elems"]
    key = (n, k, int(seed), torch.device(device), block, TUNING["subset_path"], TUNING["randk_path"],
           TUNING["randk_bins"])
    last = _LAST
    if last is not None and last[0] == key:
        return last[1]
    sel = _select(n, k, int(seed), torch.device(device), block)
    _LAST = (key, sel)
    return sel


def _select(n: int, k: int, seed: int, device: torch.device, block: int) -> Optional[Selection]:
    if not (0 < k < n < (1 << 31) and TUNING["subset_path"] == 1 and TUNING["randk_path"] == 1):
        return None
    st = RandomStream(seed)
    k1, k2 = st.k1, st.k2
    width = _bin_bits(k)
    hist = torch.zeros(1 << width, dtype=torch.int32, device=device)
    state = torch.zeros(4, dtype=torch.int64, device=device)   # (prefix, need, short, count: the pick's)
    grid = _grid(n, block)
    warps = TUNING["randk_warps"]
    shift = _DRAW_BITS
    for w in _levels(_DRAW_BITS, width):
        shift -= w
        _launch(_randk_hist_kernel, grid, hist, state, n, k1, k2, shift, w, BLOCK=block, SUB=_sub(block),
                BINS=1 << width, FIRST=shift + w == _DRAW_BITS, num_warps=warps)
        _launch(_randk_pick_kernel, (1,), hist, state, w, k if shift + w == _DRAW_BITS else 0, BINS=1 << width,
                num_warps=4)
    del hist
    # the prefix is now the k-th smallest draw: the levels counted every draw (k < n of them, so the
    # pick never runs short) and no two draws are equal (so the last bin holds exactly that one)
    m = grid[0]
    incl = torch.empty(m, dtype=torch.int32, device=device)
    _launch(_randk_count_kernel, grid, incl, n, k1, k2, state, BLOCK=block, SUB=_sub(block), num_warps=warps)
    _launch(_randk_scan_kernel, (1,), incl, m, CH=_SCAN, num_warps=4)
    return Selection(n, k, k1, k2, state, incl, block)


def _scale(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    return _vector(scale, 1, "scale", torch.float32, device)   # (the one bucket's)


def _factor(n: int, k: int, rescale: bool) -> float:
    """``float32(n/k)`` (the reference multiplies by the Python float, in float32), or 1; rounded
    on the host (no tensor: nothing for a device to wait on)."""
    return float(np.float32(n / k)) if rescale else 1.0


# -- the primitives --------------------------------------------------------------------
def subset_norm(x: torch.Tensor, k: int, seed: int, norm: str) -> Optional[torch.Tensor]:
    """As ``maxabs_scales`` (``norm="max"``) or ``l2_scales`` of ``x[random_subset(n, k, seed)]`` with
    one bucket: a float32 tensor of one element; None where the caller must take the indices."""
    xv = _flat(x, "x", torch.float32)
    sel = selection(xv.numel(), k, seed, xv.device)
    if sel is None:
        return None
    l2 = norm == "l2"
    acc = torch.zeros(1, dtype=torch.float64 if l2 else torch.int32, device=xv.device)
    _launch(_randk_norm_kernel, _grid(sel.n, sel.block), xv, acc, *sel.args(), L2=l2, BLOCK=sel.block,
            SUB=_sub(sel.block), num_warps=TUNING["randk_warps"])
    return acc.sqrt_().to(torch.float32) if l2 else acc.view(torch.float32)


def subset_uniform_encode(x: torch.Tensor, k: int, seed: int, scale: torch.Tensor, s: int, width: int,
                          rng: RngLike) -> Optional[torch.Tensor]:
    """As ``uniform_encode(x[random_subset(n, k, seed)], scale, s, None, width, rng)``; None where
    the caller must take the indices."""
    xv = _flat(x, "x", torch.float32)
    sel = selection(xv.numel(), k, seed, xv.device)
    if sel is None:
        return None
    nbytes = (k * width + 7) // 8
    words = torch.zeros(-(-nbytes // 4), dtype=torch.int32, device=xv.device)
    rk1, rk2, ctr0 = _stream(rng, k)
    _launch(_randk_encode_kernel, _grid(sel.n, sel.block), xv, words, sel.incl, _scale(scale, xv.device),
            *sel.args(), s, rk1, rk2,
            ctr0 & 0xFFFFFFFF, ctr0 >> 32, W=width, BLOCK=sel.block, SUB=_sub(sel.block),
            num_warps=TUNING["randk_warps"])
    return words.view(torch.uint8)[:nbytes]


def subset_uniform_decode(packed: torch.Tensor, scale: torch.Tensor, s: int, width: int, k: int, seed: int,
                          n: int, rescale: bool, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """As ``uniform_decode(packed, scale, s, None, width, k)`` scattered to ``random_subset(n, k,
    seed)`` of a zero vector of ``n`` (each value times ``float32(n/k)`` with ``rescale``); None
    where the caller must take the indices (``out`` then untouched)."""
    data = _payload(packed, (k * width + 7) // 8, f"{width}-bit codes")
    sel = selection(n, k, seed, data.device)
    if sel is None:
        return None
    res = _out(out, n, torch.float32, data.device)
    _launch(_randk_decode_kernel, _grid(n, sel.block), data, res, sel.incl, _scale(scale, data.device), n,
            data.numel(), sel.k1, sel.k2, sel.state, s, _factor(n, k, rescale),
            W=width, RESCALE=bool(rescale), BLOCK=sel.block, SUB=_sub(sel.block), num_warps=TUNING["randk_warps"])
    return res


def subset_multiscale_encode(x: torch.Tensor, k: int, seed: int, scale: torch.Tensor, levels, width: int,
                             index_width: int, rng: RngLike) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """As ``multiscale_encode(x[random_subset(n, k, seed)], scale, None, levels, None, width,
    index_width, rng)`` (each value's own scale index); None where the caller must take the indices."""
    xv = _flat(x, "x", torch.float32)
    sel = selection(xv.numel(), k, seed, xv.device)
    if sel is None:
        return None
    lv = _ms_levels(levels, xv.device)
    nbytes, ibytes = (k * width + 7) // 8, (k * index_width + 7) // 8
    codes = torch.zeros(-(-nbytes // 4), dtype=torch.int32, device=xv.device)
    index = torch.zeros(-(-ibytes // 4), dtype=torch.int32, device=xv.device) if index_width else None
    rk1, rk2, ctr0 = _stream(rng, k)
    _launch(_randk_ms_encode_kernel, _grid(sel.n, sel.block), xv, _scale(scale, xv.device), lv, codes,
            codes if index is None else index, sel.incl, *sel.args(), rk1, rk2, ctr0 & 0xFFFFFFFF, ctr0 >> 32,
            L=lv.numel(), W=width, IW=index_width, BLOCK=sel.block, SUB=_sub(sel.block),
            num_warps=TUNING["randk_warps"])
    return codes.view(torch.uint8)[:nbytes], None if index is None else index.view(torch.uint8)[:ibytes]


def subset_multiscale_decode(codes: torch.Tensor, index: Optional[torch.Tensor], scale: torch.Tensor, levels,
                             width: int, index_width: int, k: int, seed: int, n: int, rescale: bool,
                             out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """As ``multiscale_decode(codes, index, scale, levels, None, width, index_width, k)`` scattered to
    ``random_subset(n, k, seed)`` of a zero vector of ``n`` (times ``float32(n/k)`` with
    ``rescale``); corrupt indices raise PayloadError before ``out`` is touched (counted instead inside
    :func:`gradq.kernels.checks.deferred_checks`); None where the
    caller must take the indices (``out`` then untouched)."""
    cv = _payload(codes, (k * width + 7) // 8, f"{width}-bit codes")
    ibytes = (k * index_width + 7) // 8
    iv = _payload(index, ibytes, f"{index_width}-bit indices") if index_width else cv
    sel = selection(n, k, seed, cv.device)
    if sel is None:
        return None
    q = _ms_quotients(levels, width, cv.device)
    L = q.shape[0]
    if index_width and L < (1 << index_width):   # (an index can name no scale: checked first)
        bad = torch.zeros(1, dtype=torch.int32, device=cv.device)
        _launch(_randk_ms_check_kernel, _grid(k, _SUB), iv, bad, k, ibytes, L=L, IW=index_width, BLOCK=_SUB)
        # (a host read, as the decode of all values makes, unless deferred: then the decode below
        # reads the first scale for an index that names none)
        refuse_invalid(bad, lambda _: f"multiscale: corrupt scale index (>= {L} scales)",
                       f"scale indices above {L - 1}")
    res = _out(out, n, torch.float32, cv.device)
    _launch(_randk_ms_decode_kernel, _grid(n, sel.block), cv, iv, _scale(scale, cv.device), q, res, sel.incl, n,
            cv.numel(), ibytes, sel.k1, sel.k2, sel.state, _factor(n, k, rescale), L=L, W=width, IW=index_width,
            RESCALE=bool(rescale), BLOCK=sel.block, SUB=_sub(sel.block), num_warps=TUNING["randk_warps"])
    return res


__all__ = ["Selection", "selection", "subset_norm", "subset_uniform_encode", "subset_uniform_decode",
           "subset_multiscale_encode", "subset_multiscale_decode"]
