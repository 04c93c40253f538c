"""The numba paths of :func:`gradq.kernels.random_subset` (RandK's and GlobalRandK's shared random
subset) and :func:`gradq.kernels.topk_select` (Top-K), driving the kernels of
:mod:`gradq.kernels.cpu_subset`.

- The random subset: one pass of candidates for ``k`` up to about ``n/16``, a selection by a
  histogram of the draws' top 16 bits otherwise or where the candidates cannot decide. Same indices
  as :func:`gradq.kernels.reference.random_subset`.
- Top-K: two histogram passes over the magnitudes' bits find the ``k``-th largest exactly, a third
  writes the indices in increasing order with their values. Same indices as
  :func:`gradq.kernels.reference.topk_indices`, with no input-sized temporary (the reference sorts
  ``n`` int64 keys)."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from .numba_ops import _cpu

_SUB = None


def _sub():
    global _SUB
    if _SUB is None:
        _cpu()
        from .numba_cache import keyed_cache

        with keyed_cache():
            from . import cpu_subset
        _SUB = cpu_subset
    return _SUB


def random_subset(n: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """As :func:`gradq.kernels.reference.random_subset`: one pass of candidates where they decide
    (:func:`_subset_below`), else a selection by a histogram of the keys' top bits
    (:func:`_subset_by_histogram`); keys wider than 32 bits (``n > 2**32``) go to the reference."""
    from ..random import RandomStream
    from . import reference

    if k < 0 or k > n:
        raise ValueError(f"cannot choose k={k} coordinates out of n={n}")
    if k == 0 or k == n or reference.subset_index_bits(n) > 32:
        return reference.random_subset(n, k, seed, device)
    import numba

    mod = _sub()
    st = RandomStream(seed)
    base, k2h = np.uint32(st.k1 & 0xFFFFFFFF), np.uint32(st.k2 & 0xFFFFFFFF)   # the run of counters 0..n−1
    part = max(1 << 18, -(-n // (4 * numba.get_num_threads())))
    parts = -(-n // part)
    out = _subset_below(mod, n, k, base, k2h, part, parts)
    if out is None:
        out = _subset_by_histogram(mod, n, k, base, k2h, part, parts)
    return out if torch.device(device).type == "cpu" else out.to(device)


_CANDIDATE_SIGMAS = 10   # the candidates' threshold: this many standard deviations past the k-th draw


def _candidate_limit(n: int, k: int) -> Optional[int]:
    """A threshold on ``u`` below which ``k + σ·√k + 64`` draws lie on average (σ =
    :data:`_CANDIDATE_SIGMAS`), or ``None`` where that exceeds ``n/16`` (the histogram path then
    needs less room)."""
    mean = k + _CANDIDATE_SIGMAS * math.sqrt(k) + 64
    if mean > n / 16:
        return None
    return min((1 << 32) - 1, math.ceil(mean * (1 << 32) / n))


def _candidate_room(per: float) -> int:
    """Room for one part's candidates, ``per`` of them expected: as many standard deviations again."""
    return int(per + _CANDIDATE_SIGMAS * math.sqrt(per) + 64)


def _subset_below(mod, n: int, k: int, base, k2h, part: int, parts: int) -> Optional[torch.Tensor]:
    """The ``k`` smallest keys among the candidates of one pass (:func:`cpu_subset.gather_below`), or
    ``None`` where the candidates cannot decide (too few, or a part's share past its room)."""
    limit = _candidate_limit(n, k)
    if limit is None:
        return None
    cap = _candidate_room(part * limit / (1 << 32))
    keys = np.empty(parts * cap, dtype=np.uint32)
    idx = np.empty(parts * cap, dtype=np.int64)
    counts = np.zeros(parts, dtype=np.int64)
    mod.gather_below(n, base, k2h, part, np.uint32(limit), cap, keys, idx, counts)
    if counts.sum() < k or (counts > cap).any():
        return None
    take = np.concatenate([np.arange(p * cap, p * cap + counts[p]) for p in range(parts)])
    keys, idx = keys[take], idx[take]                          # index order, part after part
    key64 = (keys.astype(np.uint64) << np.uint64(32)) | idx.astype(np.uint64)   # (u, i): i < 2**32 here
    last = np.partition(key64, k - 1)[k - 1]
    return torch.from_numpy(idx[key64 <= last])


def _subset_by_histogram(mod, n: int, k: int, base, k2h, part: int, parts: int) -> torch.Tensor:
    """The selection by a histogram of the keys' top 16 bits (any ``k``)."""
    hist = np.zeros((parts, 65536), dtype=np.int64)
    mod.histogram(n, base, k2h, part, hist)
    total = hist.sum(axis=0)
    cum = np.cumsum(total)
    top = int(np.searchsorted(cum, k))            # first bin whose running count reaches k
    below = int(cum[top - 1]) if top else 0
    in_bin = hist[:, top]
    offsets = np.concatenate(([0], np.cumsum(in_bin)[:-1])).astype(np.int64)
    keys = np.empty(int(total[top]), dtype=np.uint32)
    idx = np.empty(int(total[top]), dtype=np.int64)
    mod.gather_bin(n, base, k2h, part, top, offsets, keys, idx)
    last = np.argsort(keys, kind="stable")[k - below - 1]   # stable: equal draws in index order
    ulast, ilast = keys[last], int(idx[last])
    chosen = (keys < ulast) | ((keys == ulast) & (idx <= ilast))
    per_part = hist[:, :top].sum(axis=1) + np.bincount(idx[chosen] // part, minlength=parts)
    offsets = np.concatenate(([0], np.cumsum(per_part)[:-1])).astype(np.int64)
    out = torch.empty(k, dtype=torch.int64)
    mod.write_selected(n, base, k2h, part, top, np.uint32(ulast), ilast, offsets, out.numpy())
    return out


#: the least coordinates a part of Top-K's passes takes (tests lower it to give small vectors parts)
TOPK_MIN_PART = 1 << 18
#: Top-K's sample of the magnitudes (every ``n // TOPK_SAMPLE``-th value), which sets its window
TOPK_SAMPLE = 1 << 16
_TOPK_SIGMAS = 4   # the window's half-width about the k-th largest: this many standard deviations


def topk_select(x: torch.Tensor, k: int, index_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.topk_select` for a contiguous float32 CPU vector ``x``
    (``0 < k < n ≤ 2**32``; the caller handles the rest): ``(x[idx], idx)``, ``idx`` the sorted
    indices of the ``k`` largest ``|x_i|`` (ties to the lower index) as ``index_dtype``.

    The ``k``-th largest magnitude ``t`` comes from one pass over a window of magnitudes that a
    strided sample places about it (:func:`_topk_by_window`), or where the window cannot decide
    (flat data, many equal values, an unlucky sample) from two histogram passes
    (:func:`_topk_by_histogram`). A last pass writes the selection."""
    import numba

    mod = _sub()
    n = x.numel()
    xs = x.detach().reshape(-1).numpy()
    bits = xs.view(np.uint32)
    part = max(TOPK_MIN_PART, -(-n // (4 * numba.get_num_threads())))
    parts = -(-n // part)
    plan = _topk_by_window(mod, bits, k, part, parts)
    t, ties, per_part = plan if plan is not None else _topk_by_histogram(mod, bits, k, part, parts)
    ends = np.cumsum(per_part).astype(np.int64)
    if ends[-1] != k:   # pragma: no cover - the plans count k by construction
        raise RuntimeError(f"topk_select: the selection counted {ends[-1]} values, not k={k}")
    at = ends - per_part
    idx = torch.empty(k, dtype=index_dtype)
    values = torch.empty(k, dtype=torch.float32)
    mod.write_largest(bits, xs, part, np.uint32(t), ties.astype(np.int64), at, ends, idx.numpy(), values.numpy())
    if not np.array_equal(at, ends):
        raise RuntimeError("topk_select: the vector changed while its k largest values were selected")
    return values, idx


# Both plans return ``(t, ties, per_part)``: the k-th largest magnitude's bits ``t``; per part, how
# many of its values equal to ``t`` are kept (the first ones in index order) and how many it keeps.

def _topk_by_window(mod, bits: np.ndarray, k: int, part: int, parts: int):
    """The plan from the magnitudes in a window ``[lo, hi]`` that the sample says holds the ``k``-th
    largest about ``±TOPK_SIGMAS`` standard deviations wide: one pass counts those above ``hi`` and
    gathers the window's ``(m_i, i)`` per part; the ``k``-th largest key among them decides. ``None``
    where it cannot: a window past ``n/8`` values, a part's share past its room, or a ``k``-th
    largest outside the window."""
    n = bits.size
    stride = max(1, n // TOPK_SAMPLE)
    sample = bits[::stride] & np.uint32(0x7FFFFFFF)
    size = sample.size
    r = k * size / n                                       # the k-th largest's expected rank in the sample
    d = _TOPK_SIGMAS * math.sqrt(r) + 16
    jh, jl = math.ceil(r - d), math.floor(r + d) + 1      # ranks from the top of the window's ends
    at = np.partition(sample, sorted({size - min(max(jh, 1), size), size - min(jl, size)}))
    hi = 0x7FFFFFFF if jh < 1 else int(at[size - jh])
    lo = 0 if jl > size else int(at[size - jl])
    inside = np.flatnonzero((sample >= lo) & (sample <= hi))
    seen = np.bincount(inside * stride // part, minlength=parts)      # the window's sample, per part
    if inside.size * stride > n / 8:
        return None
    caps = _window_room(seen, stride)
    starts = np.concatenate(([0], np.cumsum(caps)[:-1])).astype(np.int64)
    keys = np.empty(int(caps.sum()), dtype=np.uint32)
    idx = np.empty(int(caps.sum()), dtype=np.int64)
    above = np.zeros(parts, dtype=np.int64)
    counts = np.zeros(parts, dtype=np.int64)
    mod.gather_window(bits, part, np.uint32(lo), np.uint32(hi - lo), starts, caps, keys, idx, above, counts)
    need, total = k - int(above.sum()), int(counts.sum())
    if (counts > caps).any() or not 1 <= need <= total:
        return None
    take = np.concatenate([np.arange(starts[p], starts[p] + counts[p]) for p in range(parts)])
    keys, idx, owner = keys[take], idx[take], np.repeat(np.arange(parts), counts)
    key64 = (keys.astype(np.uint64) << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - idx.astype(np.uint64))
    last = np.partition(key64, total - need)[total - need]   # the k-th largest key: ties to the lower index
    kept = key64 >= last
    t = int(last >> np.uint64(32))
    ties = np.bincount(owner[kept & (keys == t)], minlength=parts)
    return t, ties, above + np.bincount(owner[kept], minlength=parts)


def _window_room(seen: np.ndarray, stride: int) -> np.ndarray:
    """Room for each part's window values, ``seen`` of them in the sample: that count as a Poisson
    count, ``TOPK_SIGMAS`` standard deviations up, times the sample's stride."""
    return ((seen + _TOPK_SIGMAS * np.sqrt(seen + 1) + 8) * stride).astype(np.int64)


def _topk_by_histogram(mod, bits: np.ndarray, k: int, part: int, parts: int):
    """The plan from a histogram of the magnitudes' top 16 bits per part, then one of the low 16
    bits of the boundary bin's values (any data)."""
    hist = np.zeros((parts, 1 << 15), dtype=np.int32)   # (a part holds < 2**31 values)
    mod.magnitude_histogram(bits, part, hist)
    top, need = _bin_of_kth_largest(hist.sum(axis=0, dtype=np.int64), k)   # need: how many of bin `top` are kept
    low = np.zeros((parts, 1 << 16), dtype=np.int32)
    mod.magnitude_histogram_in_bin(bits, part, top, low)
    sub, ties = _bin_of_kth_largest(low.sum(axis=0, dtype=np.int64), need)  # ties: how many equal to t are kept
    above = hist[:, top + 1:].sum(axis=1, dtype=np.int64) + low[:, sub + 1:].sum(axis=1, dtype=np.int64)
    equal = low[:, sub].astype(np.int64)
    kept = np.minimum(equal, np.maximum(0, ties - (np.cumsum(equal) - equal)))   # the first ties in index order
    return (top << 16) | sub, kept, above + kept


def _bin_of_kth_largest(counts: np.ndarray, k: int) -> tuple[int, int]:
    """``(b, r)``: the bin ``b`` that holds the ``k``-th largest value counted in ``counts`` (value
    ``b`` in bin ``b``), and how many of its values are among the ``k`` largest (``1 ≤ r ≤ counts[b]``)."""
    from_top = np.cumsum(counts[::-1])                 # from_top[j]: values in the top j + 1 bins
    j = int(np.searchsorted(from_top, k))              # first j with from_top[j] ≥ k
    b = counts.size - 1 - j
    return b, k - (int(from_top[j - 1]) if j else 0)
