"""Numba CPU kernels for MultiScale (QSGDMaxNormMultiScale): scale indices, encode and decode.

They reproduce :mod:`gradq.kernels.reference`'s ``multiscale_*`` functions bit for bit, in float32:

* ``r = |x| / safe`` (IEEE division; ``safe`` the bucket's scale, 1 where it is 0);
* index = the number of scales ``s_j`` (``j ≥ 1``) with ``float32(s_j)·r ≤ s_1`` (Eq. 11);
* ``a = float32(s_idx)·r``, ``mag = min(floor(a + u), s_1)``, field ``s_1 ± mag`` (``−`` for x < 0),
  ``u`` the uniform of counter ``offset + i``;
* decode ``(float32(field − s_1) / float32(s_idx))·scale``.

Parallel over chunks of a multiple of 8 values (every chunk starts on a byte for any field width),
so the bytes do not depend on the thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .numba_common import _count_above, _fill_uniform, _inline, _kernel, _run_end, _run_keys
from .numba_pack import _pack, _unpack

F32 = np.float32


@_inline
def _safe(w, b):
    sc = w[b]
    return sc if sc > F32(0.0) else F32(1.0)


@_inline
def _allowed(r, levels):
    if levels.size == 2:  # the common case (bits=2+6), unswitched so that the loops vectorize
        return np.int64(levels[1] * r <= levels[0])
    k = 0
    for j in range(1, levels.size):
        if levels[j] * r <= levels[0]:
            k += 1
    return k


@njit(cache=True, error_model="numpy")
def _limit(safe, lj, l0):
    """The bit pattern (int32) of the largest float32 ``a ≥ 0`` with ``lj·float32(a / safe) ≤ l0`` (bisection over the bit
    patterns of the non-negative floats). The test is monotone in ``a`` (correctly rounded division
    and multiplication are), so ``|x| ≤ limit`` is exactly the reference's test on ``|x|``, with no
    division per value; NaN fails both."""
    top = np.int32(0x7F7FFFFF)
    if lj * (top.view(np.float32) / safe) <= l0:
        return top
    lo = 0  # a = 0 always passes (l0 >= 1)
    hi = 0x7F7FFFFF
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if lj * (np.int32(mid).view(np.float32) / safe) <= l0:
            lo = mid
        else:
            hi = mid
    return np.int32(lo)


@_inline
def _frac_table(levels):
    """``float32(c) / float32(s_k)`` for every scale ``k`` and field ``c + s_1`` (IEEE division, as
    the reference): a decode looks its quotient up instead of dividing per value."""
    s1 = np.int32(levels[0])
    tab = np.empty((levels.size, 2 * s1 + 1), np.float32)
    for k in range(levels.size):
        for f in range(2 * s1 + 1):
            tab[k, f] = F32(f - s1) / levels[k]
    return tab


@_kernel
def indices(x, xi, w, bucket, levels, chunk, out):
    """``out[i]`` = the index of the largest scale that keeps element ``i``'s code in range (``xi``:
    the int32 view of ``x``)."""
    n = x.size
    for c in prange((n + chunk - 1) // chunk):
        p = c * chunk
        e1 = min(n, p + chunk)
        while p < e1:  # bucket by bucket: one scale per run, no division by the bucket per value
            b = p // bucket
            q = min((b + 1) * bucket, e1)
            safe = _safe(w, b)
            xs = x[p:q]  # (slices from 0: no negative-index checks in the loops, which then vectorize)
            os = out[p:q]
            if levels.size == 2:  # |x| <= limit on the bit patterns (NaN's are above every limit)
                lim = _limit(safe, levels[1], levels[0])
                xis = xi[p:q]
                for i in range(q - p):
                    os[i] = np.uint8(1) if (xis[i] & 0x7FFFFFFF) <= lim else np.uint8(0)
            else:
                for i in range(q - p):
                    os[i] = _allowed(abs(xs[i]) / safe, levels)
            p = q


@_kernel
def encode(x, w, idx, bucket, levels, width, iwidth, k1, k2, ctr0, chunk, codes, index_out):
    """Fields ``s_1 ± mag`` under the shared indices ``idx`` (packed ``width`` bits) and the indices
    (packed ``iwidth`` bits, when ``iwidth > 0``); returns how many shared indices exceed this
    worker's own (they must be the MIN over workers). An empty ``idx`` stands for each value's own
    index, computed here a chunk at a time (no input-sized array of them)."""
    n = x.size
    own = idx.size == 0
    nch = (n + chunk - 1) // chunk
    bad = np.zeros(nch, np.int64)
    s1f = levels[0]
    s1 = np.int32(levels[0])
    top = levels.size - 1
    for c in prange(nch):
        e0 = c * chunk
        m = min(n, e0 + chunk) - e0
        u = np.empty(m, np.float32)
        p = 0
        while p < m:
            e = _run_end(ctr0 + e0 + p, p, m)
            base, k2h = _run_keys(ctr0 + e0 + p, k1, k2)
            _fill_uniform(u[p:e], base, k2h)
            p = e
        tmp = np.empty(m, np.uint8)
        kown = np.empty(m if own else 0, np.uint8)
        nbad = 0
        g = e0
        while g < e0 + m:
            b = g // bucket
            q = min((b + 1) * bucket, e0 + m)
            safe = _safe(w, b)
            xs = x[g:q]
            us = u[g - e0:q - e0]
            ts = tmp[g - e0:q - e0]
            if own:
                ks = kown[g - e0:q - e0]
            else:
                ks = idx[g:q]
            if levels.size == 2:  # two scales (the default): selects instead of gathers, so it vectorizes
                l1 = levels[1]
                lim = np.int32(_limit(safe, l1, s1f)).view(np.float32)
                if own:
                    for i in range(q - g):
                        ks[i] = np.uint8(abs(xs[i]) <= lim)
                for i in range(q - g):
                    v = xs[i]
                    r = abs(v) / safe
                    k = np.int64(ks[i])
                    nbad += k > np.int64(abs(v) <= lim)
                    t = (l1 if k > 0 else s1f) * r + us[i]
                    mag = np.int32(s1f if t > s1f else t)
                    ts[i] = s1 - mag if v < F32(0.0) else s1 + mag
            else:
                if own:
                    for i in range(q - g):
                        ks[i] = np.uint8(_allowed(abs(xs[i]) / safe, levels))
                for i in range(q - g):
                    v = xs[i]
                    r = abs(v) / safe
                    k = np.int64(ks[i])
                    nbad += k > _allowed(r, levels)
                    t = levels[min(k, top)] * r + us[i]
                    mag = np.int32(s1f if t > s1f else t)
                    ts[i] = s1 - mag if v < F32(0.0) else s1 + mag
            g = q
        _pack(tmp, width, codes[(e0 * width) // 8:])
        if iwidth > 0:
            if own:
                _pack(kown, iwidth, index_out[(e0 * iwidth) // 8:])
            else:
                _pack(idx[e0:e0 + m], iwidth, index_out[(e0 * iwidth) // 8:])
        bad[c] = nbad
    return bad.sum()


@_kernel
def decode(codes, index, w, bucket, levels, width, iwidth, n, chunk, out):
    """``(float32(field − s_1) / s_idx)·scale``; returns the number of indices ``≥ len(levels)``
    (each decoded as index 0)."""
    nch = (n + chunk - 1) // chunk
    bad = np.zeros(nch, np.int64)
    nlev = levels.size
    tab = _frac_table(levels)
    top = tab.shape[1] - 1
    s1 = np.int32(levels[0])
    l0 = levels[0]
    l1 = levels[1] if nlev > 1 else levels[0]
    for c in prange(nch):
        e0 = c * chunk
        m = min(n, e0 + chunk) - e0
        tmp = np.empty(m, np.uint8)
        itmp = np.zeros(m, np.uint8)
        _unpack(codes[(e0 * width) // 8:], width, tmp)
        if iwidth > 0:
            _unpack(index[(e0 * iwidth) // 8:], iwidth, itmp)
        nbad = 0
        g = e0
        while g < e0 + m:
            b = g // bucket
            q = min((b + 1) * bucket, e0 + m)
            sc = w[b]
            ks = itmp[g - e0:q - e0]
            fs = tmp[g - e0:q - e0]
            os = out[g:q]
            if nlev == 2:  # two scales: a select and a division (vectorized) instead of a table lookup
                mx = np.uint8(0)
                for i in range(q - g):
                    k = ks[i]
                    mx = max(mx, k)
                    os[i] = (F32(np.int32(fs[i]) - s1) / (l1 if k == 1 else l0)) * sc
                if mx >= 2:
                    nbad += _count_above(ks, 1)
            else:
                for i in range(q - g):
                    k = np.int64(ks[i])
                    if k >= nlev:
                        nbad += 1
                        k = 0
                    os[i] = tab[k, min(np.int64(fs[i]), top)] * sc
            g = q
        bad[c] = nbad
    return bad.sum()
