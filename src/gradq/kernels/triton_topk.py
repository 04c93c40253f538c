"""The Triton path of :func:`gradq.kernels.topk_select` (Top-K): the ``k`` largest magnitudes of a
float32 vector, in increasing index order, with no input-sized temporary and no host read.

The reference (:func:`gradq.kernels.reference.topk_indices`) makes an int64 key a coordinate, its
magnitude bits above its complemented index, and takes the ``k`` largest with ``torch.topk``, then
sorts the indices: about 24 bytes a coordinate of temporaries (400× a 1 % payload). Here the keys
stay implicit:

* **The k-th largest magnitude.** A coordinate's magnitude bits ``m_i = bits(x_i) & 0x7FFFFFFF``
  order as ``|x_i|`` (NaN above +Inf), so with ``u_i = 0x7FFFFFFF − m_i`` the ``k`` largest
  magnitudes are the ``k`` smallest ``u``. A radix select finds the ``k``-th smallest ``u``, ``t``,
  six bits at a time (``TUNING["topk_bins"]``): a pass over ``x`` counts each program's values with the bits picked so far
  in a histogram of the next bits (``tl.histogram`` in registers, then one atomic add a bin a
  program into the global histogram), and a one-program pass picks the bin that holds the
  ``k``-th on the device (:func:`gradq.kernels.triton_randk._randk_pick_kernel`, shared with
  RandK's subset). Three levels cover the 31 bits; the state they leave holds ``t`` and how many
  of the values equal to ``t`` are kept (``need``).
* **Ties to the lower index.** A pass counts, per program, the values below ``t`` and those equal
  to it; a one-program pass turns the counts into each program's first position and its share of
  the ``need`` ties (the first ones in index order, as the reference's complemented index has it).
* **The output.** A last pass writes each kept index and its value at its program's position plus
  the kept before it in the program: sorted by index without a sort.

Nine launches and no host read: ``t`` and the counts stay on the device. Memory: the histogram
(8 KB), two int32 a program and the output (``k`` values and ``k`` indices). Bytes equal the
reference's for every input (NaN, ±Inf, both zeros, denormals, any number of ties). Where ``k`` is
0 or ``n``, for ``n`` past ``2³¹ − 2²⁰`` (int32 counts and positions) and with
``TUNING["topk_path"]`` 2 (to time the two), the caller takes the reference.

``x`` must not change during the call (the kernels run in order on one stream; another stream
writing to it meanwhile could make the passes disagree): the write pass never stores past the
output, but the result would then be wrong.
"""

from __future__ import annotations

import torch

from .triton_common import TUNING, _flat, _grid, _jit, _launch, tl
from .triton_randk import _levels, _randk_pick_kernel

_MAG_BITS = 31    # bits of a magnitude pattern (the sign bit dropped)
_SCAN = 1024      # program counts a step of the one-program plan
_SUB = 1024       # values a step of the other programs' loops
#: the largest ``n`` taken here: positions and counts are int32, with room for a program past ``n``
MAX_N = (1 << 31) - (1 << 20)


@_jit
def _complement(x_ptr, first, off, live):
    """``u = 0x7FFFFFFF − (bits(x) & 0x7FFFFFFF)`` (int32, ≥ 0) and the values of lanes ``first + off``
    (lanes not ``live`` read nothing: callers mask them out)."""
    v = tl.load(x_ptr + first + off, mask=live, other=0.0)
    return 0x7FFFFFFF - (v.to(tl.int32, bitcast=True) & 0x7FFFFFFF), v


@_jit
def _topk_hist_kernel(x_ptr, hist_ptr, state_ptr, n, shift, width, BLOCK: tl.constexpr, SUB: tl.constexpr,
                      BINS: tl.constexpr):
    """Count this program's values whose ``u`` has the state's prefix above bit ``shift + width``, in
    bins of its next ``width`` bits: a histogram in registers, added to the global one bin by bin."""
    prefix = tl.load(state_ptr).to(tl.int32)
    first = tl.program_id(0).to(tl.int64) * BLOCK
    rem = n - first
    acc = tl.zeros((BINS,), tl.int32)
    for c in range(BLOCK // SUB):
        off = c * SUB + tl.arange(0, SUB)
        live = off < rem
        u, _ = _complement(x_ptr, first, off, live)
        keep = live & ((u >> (shift + width)) == prefix)
        b = (u >> shift) & ((1 << width) - 1)
        acc += tl.histogram(b, BINS, mask=keep)
    bins = tl.arange(0, BINS)
    tl.atomic_add(hist_ptr + bins, acc, mask=acc > 0)


@_jit
def _topk_count_kernel(x_ptr, cnt_ptr, state_ptr, n, m, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Per program: the values with ``u < t`` (at ``cnt[pid]``) and with ``u == t`` (at
    ``cnt[m + pid]``), ``t`` the state's prefix after the last level."""
    t = tl.load(state_ptr).to(tl.int32)
    first = tl.program_id(0).to(tl.int64) * BLOCK
    rem = n - first
    below = tl.zeros((), tl.int32)
    equal = tl.zeros((), tl.int32)
    for c in range(BLOCK // SUB):
        off = c * SUB + tl.arange(0, SUB)
        live = off < rem
        u, _ = _complement(x_ptr, first, off, live)
        below += tl.sum((live & (u < t)).to(tl.int32), axis=0)
        equal += tl.sum((live & (u == t)).to(tl.int32), axis=0)
    tl.store(cnt_ptr + tl.program_id(0), below)
    tl.store(cnt_ptr + m + tl.program_id(0), equal)


@_jit
def _topk_plan_kernel(cnt_ptr, state_ptr, m, CH: tl.constexpr):
    """One program, in place over the ``m`` programs' counts: each program's share of the ``need``
    ties (the first in index order, at ``cnt[m + i]``) and its first output position (the kept
    before it, at ``cnt[i]``)."""
    need = tl.load(state_ptr + 1).to(tl.int32)
    ties = tl.zeros((), tl.int32)
    kept = tl.zeros((), tl.int32)
    start = tl.zeros((), tl.int32)
    while start < m:
        i = start + tl.arange(0, CH)
        live = i < m
        below = tl.load(cnt_ptr + i, mask=live, other=0)
        equal = tl.load(cnt_ptr + m + i, mask=live, other=0)
        before = ties + tl.cumsum(equal, axis=0) - equal
        share = tl.minimum(tl.maximum(need - before, 0), equal)
        mine = below + share
        tl.store(cnt_ptr + i, kept + tl.cumsum(mine, axis=0) - mine, mask=live)
        tl.store(cnt_ptr + m + i, share, mask=live)
        ties += tl.sum(equal, axis=0)
        kept += tl.sum(mine, axis=0)
        start += CH


@_jit
def _topk_write_kernel(x_ptr, cnt_ptr, state_ptr, idx_ptr, val_ptr, n, m, k, BLOCK: tl.constexpr,
                       SUB: tl.constexpr):
    """Each kept value (``u < t``, or ``u == t`` among the program's share of the ties) and its
    index, at the program's first position plus the kept before it; nothing past ``k``."""
    t = tl.load(state_ptr).to(tl.int32)
    pid = tl.program_id(0)
    pos = tl.load(cnt_ptr + pid)
    share = tl.load(cnt_ptr + m + pid)
    first = pid.to(tl.int64) * BLOCK
    rem = n - first
    seen = tl.zeros((), tl.int32)
    for c in range(BLOCK // SUB):
        off = c * SUB + tl.arange(0, SUB)
        live = off < rem
        u, v = _complement(x_ptr, first, off, live)
        eq = live & (u == t)
        rank = seen + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        sel = (live & (u < t)) | (eq & (rank < share))
        j = pos + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        ok = sel & (j < k)
        tl.store(idx_ptr + j, (first + off).to(idx_ptr.dtype.element_ty), mask=ok)
        tl.store(val_ptr + j, v, mask=ok)
        pos += tl.sum(sel.to(tl.int32), axis=0)
        seen += tl.sum(eq.to(tl.int32), axis=0)


def takes(n: int, k: int) -> bool:
    """True when :func:`topk_select` handles ``(n, k)``; the caller takes the reference otherwise."""
    return 0 < k < n <= MAX_N and TUNING["topk_path"] == 1


def topk_select(x: torch.Tensor, k: int, index_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.topk_select` for a float32 ``x`` with :func:`takes` true:
    ``(x[idx], idx)``, ``idx`` the sorted indices of the ``k`` largest ``|x_i|`` (ties to the lower
    index) as ``index_dtype`` (int32 or int64). The module docstring has the passes."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    if not takes(n, k):
        raise ValueError(f"the Triton Top-K takes 0 < k < n <= {MAX_N} (topk_path 1), got n={n}, k={k}")
    if index_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
    dev = xv.device
    block, warps = TUNING["topk_elems"], TUNING["topk_warps"]
    sub = min(block, _SUB)
    bits = TUNING["topk_bins"].bit_length() - 1
    grid = _grid(n, block)
    m = grid[0]
    hist = torch.zeros(1 << bits, dtype=torch.int32, device=dev)
    state = torch.zeros(4, dtype=torch.int64, device=dev)   # (prefix, need, short, count: the pick's)
    shift = _MAG_BITS
    for w in _levels(_MAG_BITS, bits):
        shift -= w
        _launch(_topk_hist_kernel, grid, xv, hist, state, n, shift, w, BLOCK=block, SUB=sub, BINS=1 << bits,
                num_warps=warps)
        _launch(_randk_pick_kernel, (1,), hist, state, w, k if shift + w == _MAG_BITS else 0, BINS=1 << bits,
                num_warps=4)
    del hist
    cnt = torch.empty(2 * m, dtype=torch.int32, device=dev)
    _launch(_topk_count_kernel, grid, xv, cnt, state, n, m, BLOCK=block, SUB=sub, num_warps=warps)
    _launch(_topk_plan_kernel, (1,), cnt, state, m, CH=_SCAN, num_warps=4)
    idx = torch.empty(k, dtype=index_dtype, device=dev)
    values = torch.empty(k, dtype=torch.float32, device=dev)
    _launch(_topk_write_kernel, grid, xv, cnt, state, idx, values, n, m, k, BLOCK=block, SUB=sub, num_warps=warps)
    return values, idx


__all__ = ["MAX_N", "takes", "topk_select"]
