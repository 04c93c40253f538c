"""Numba CPU kernels for the shared random subset of RandK and GlobalRandK
(:func:`gradq.kernels.reference.random_subset`): the ``k`` coordinates of ``range(n)`` whose keys
``(bits32_i, i)`` are smallest, found by selection instead of a sort of ``n`` keys.

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
from numba import prange

from .numba_common import _fill_hash, _inline, _kernel

_FLIP = np.uint32(0x80000000)
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
