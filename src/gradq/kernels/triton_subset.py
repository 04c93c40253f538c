"""The Triton path of :func:`gradq.kernels.random_subset` (RandK's and GlobalRandK's shared random
subset): the reference's ``k`` smallest keys without making a key for every coordinate.

The reference (:func:`gradq.kernels.reference.random_subset`) builds ``n`` int64 keys
``(bits32_i << 32) | i`` and takes the ``k`` smallest with ``torch.topk``: about a hundred device
operations and ``8·n`` bytes of keys. Here one kernel hashes the counters ``0 … n − 1`` in
registers and keeps only the candidates, the ``(u_i, i)`` with ``u_i = bits32_i ^ 2³¹`` (which
orders as the signed draw does) below the threshold of the numba path
(:func:`gradq.kernels.subset._candidate_limit`: about ten standard deviations past the ``k``-th
draw's expected value). Each program appends its candidates at a position taken from an atomic
counter, so their order in the buffer depends on scheduling, but their set does not. The host
reads the count (one synchronization), sorts the candidates' keys, and sorts the first ``k``
keys' indices: the reference's sorted indices, bit for bit, whatever the order of the programs.

It falls back to the reference where the candidates cannot decide (fewer than ``k`` of them, or
more than the buffer's room: both about e⁻⁵⁰ for uniform draws), for ``k`` past about ``n/16``
(where the reference's keys are not much larger than the result) and for ``n ≥ 2³¹`` (counters past
int32), and where ``TUNING["subset_path"]`` is 2 (to time the two against each other). Memory: the candidates' keys and their sort, about ``24·k`` bytes at once, against
``8·n`` and more for the reference.
"""

from __future__ import annotations

import torch

from ..random import RandomStream
from . import reference
from .subset import _candidate_limit, _candidate_room
from .triton_common import TUNING, _grid, _jit, _launch, _mix32, tl

_LOW32 = 0xFFFFFFFF


@_jit
def _draw(o, k1, k2):
    """``u_i = bits32_i ^ 2³¹`` of the counters ``o`` (int32, from 0) of the stream ``(k1, k2)``:
    uint32, ordered as the reference's signed draws are."""
    h = _mix32(_mix32(o.to(tl.uint32) * tl.full((), 0x9E3779B9, tl.uint32) + k1.to(tl.uint32)) ^ k2.to(tl.uint32))
    return h ^ tl.full((), 0x80000000, tl.uint32)


@_jit
def _subset_candidates_kernel(keys_ptr, count_ptr, n, k1, k2, lo, limit, cap, BLOCK: tl.constexpr):
    """Append ``(u_i << 32) | i`` for every ``i < n`` of this program's block with ``lo ≤ u_i < limit``
    at the positions an atomic counter hands out; positions past ``cap`` are counted, not stored."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = _draw(o, k1, k2)
    w = u.to(tl.int64)
    keep = (o < n) & (w >= lo) & (w < limit)
    one = keep.to(tl.int32)
    total = tl.sum(one, axis=0)
    first = tl.atomic_add(count_ptr, total)
    at = first + tl.cumsum(one, axis=0) - 1
    key = (u.to(tl.int64) << 32) | o.to(tl.int64)
    tl.store(keys_ptr + at, key, mask=keep & (at < cap))


def random_subset(n: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """As :func:`gradq.kernels.reference.random_subset`: the sorted int64 indices of the ``k``
    smallest keys, from the candidates below a threshold (module docstring), or from the reference
    where they cannot decide."""
    if k < 0 or k > n:
        raise ValueError(f"cannot choose k={k} coordinates out of n={n}")
    use = 0 < k < n < (1 << 31) and TUNING["subset_path"] == 1
    limit = _candidate_limit(n, k) if use else None
    if limit is None:
        return reference.random_subset(n, k, seed, device)
    st = RandomStream(seed)
    cap = _candidate_room(n * limit / (1 << 32))
    keys = torch.empty(cap, dtype=torch.int64, device=device)
    count = torch.zeros(1, dtype=torch.int32, device=device)
    block = TUNING["subset_elems"]
    _launch(_subset_candidates_kernel, _grid(n, block), keys, count, n, st.k1, st.k2,
            0, limit, cap, BLOCK=block, num_warps=TUNING["subset_warps"])
    got = int(count.item())
    if got < k or got > cap:
        return reference.random_subset(n, k, seed, device)
    smallest = torch.sort(keys[:got]).values[:k]
    del keys
    return torch.sort(smallest.bitwise_and_(_LOW32)).values
