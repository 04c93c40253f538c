"""The numba path of :func:`gradq.kernels.random_subset` (RandK's and GlobalRandK's shared random
subset), driving the kernels of :mod:`gradq.kernels.cpu_subset`: one pass of candidates for ``k`` up
to about ``n/16``, a selection by a histogram of the draws' top 16 bits otherwise or where the
candidates cannot decide. Same indices as :func:`gradq.kernels.reference.random_subset`."""

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
