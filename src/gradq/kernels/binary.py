"""Fast CPU paths (numba) for the one-bit quantizers: per-bucket statistics fused with the bit packing.

Each function takes and returns torch CPU tensors and gives **the same bytes and the same floats**
as the plain-torch reference in :mod:`gradq.kernels.reference`, on any number of threads:

==========================  =========================================================================
kernel                      plain-torch reference
==========================  =========================================================================
sign_scale_encode           SignSGD: ``pairwise_row_sum(|x|)/d`` per bucket, bits ``x ≥ 0``
onebit_encode               1BitSGD: ``masked_mean`` of ``x < 0`` and ``x ≥ 0``, bits ``x ≥ 0``
bingrad_b_encode            ``bingrad_b_levels(mat, iters)``, bits ``float64(x) ≥ t``
binary_stats                the statistics of the three above without the bits
bingrad_pb_levels           ``bingrad_pb_threshold(mat)`` per bucket chunk
bingrad_pb_encode           BinGrad-pb's level and its stochastic bits ``u < (x + b)/(2b)``
==========================  =========================================================================

Sums: the float64 bucket sums of SignSGD, 1BitSGD and BinGrad-b are in the fixed pairwise order
of :func:`gradq.kernels.reference.pairwise_row_sum`, which the torch path uses too (torch's own
``sum``/``mean`` order depends on the CPU's vector width and, for a single row, on the thread count,
so no kernel could match it in general). BinGrad-pb keeps torch's reference unchanged: its sorted
sequential tail sums are matched exactly (see :mod:`gradq.kernels.cpu_binary` for how).

Randomness (BinGrad-pb): element ``i`` uses counter ``rng.offset + i``; the stream advances by ``n``,
as the reference's draws over its bucket chunks do.

Wire sizes: ``ceil(n/8)`` bytes of bits plus one (SignSGD, BinGrad-pb) or two float32 per bucket.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .reference import SUM_BLOCK
from .numba_ops import _PART, _bucket, _chunk, _nbuckets, _stream, _vec, RngLike, threshold_encode

__all__ = ["SUM_BLOCK", "SIGN", "ONEBIT", "BINGRAD_B", "binary_stats", "sign_scale_encode", "onebit_encode",
           "bingrad_b_encode", "bingrad_pb_levels", "bingrad_pb_encode"]

SIGN, ONEBIT, BINGRAD_B = 0, 1, 2
_MODES = {SIGN: 1, ONEBIT: 2, BINGRAD_B: 2}   # float32 levels per bucket

_MOD = None


def _cpu():
    global _MOD
    if _MOD is None:
        from .numba_ops import _cpu as _load_base
        _load_base()   # raises a clear error when numba is missing
        from .numba_cache import keyed_cache

        with keyed_cache():
            from . import cpu_binary
        _MOD = cpu_binary
    return _MOD


def _mode(mode: int, iters: int) -> int:
    if mode not in _MODES:
        raise ValueError(f"mode must be SIGN, ONEBIT or BINGRAD_B, got {mode!r}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"iters must be a non-negative int, got {iters!r}")
    if iters and mode != BINGRAD_B:
        raise ValueError("iters applies to BINGRAD_B only")
    return mode


def binary_stats(x: torch.Tensor, bucket: Optional[int], mode: int,
                 iters: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-bucket ``(thresholds, levels)``: float64 thresholds (the bit is ``float64(x) ≥ t``; 0 for
    SIGN and ONEBIT) and float32 levels — SIGN: ``mean |x|`` (one per bucket); ONEBIT: ``(mean of
    the negatives, mean of the rest)``, 0 for an empty group; BINGRAD_B: ``(b0, b1)`` after ``iters``
    Lloyd steps, ``t`` for an empty side."""
    xv = _vec(x, "x", torch.float32)
    n = xv.size
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    mode = _mode(mode, iters)
    t = torch.empty(nb, dtype=torch.float64)
    lv = torch.empty(nb * _MODES[mode], dtype=torch.float32)
    if n:
        _cpu().binary_encode(xv, d, mode, iters, SUM_BLOCK, d * max(1, _PART // d), False, t.numpy(),
                             lv.numpy(), np.empty(0, np.uint8))
    return t, lv


def _encode(x: torch.Tensor, bucket: Optional[int], mode: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    xv = _vec(x, "x", torch.float32)
    n = xv.size
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    mode = _mode(mode, iters)
    chunk = _chunk(d)
    if n == 0 or chunk % d:   # buckets straddle the packing chunks: statistics first, then the bits
        t, lv = binary_stats(x, bucket, mode, iters)
        return threshold_encode(x, t, bucket), lv
    t = np.empty(nb, np.float64)
    lv = torch.empty(nb * _MODES[mode], dtype=torch.float32)
    packed = torch.empty((n + 7) // 8, dtype=torch.uint8)
    _cpu().binary_encode(xv, d, mode, iters, SUM_BLOCK, chunk, True, t, lv.numpy(), packed.numpy())
    return packed, lv


def sign_scale_encode(x: torch.Tensor, bucket: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled SignSGD: ``(bits x ≥ 0 packed, float32 mean |x| per bucket)``."""
    return _encode(x, bucket, SIGN, 0)


def onebit_encode(x: torch.Tensor, bucket: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """1BitSGD: ``(bits x ≥ 0 packed, float32 (mean{x < 0}, mean{x ≥ 0}) per bucket, flattened)``."""
    return _encode(x, bucket, ONEBIT, 0)


def bingrad_b_encode(x: torch.Tensor, bucket: Optional[int],
                     iters: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """BinGrad-b: ``(bits float64(x) ≥ t packed, float32 (b0, b1) per bucket, flattened)``."""
    return _encode(x, bucket, BINGRAD_B, iters)


def bingrad_pb_levels(x: torch.Tensor, bucket: Optional[int],
                      return_fallback: bool = False):
    """BinGrad-pb's optimal level ``b`` per bucket (float32), as ``bingrad_pb_threshold`` of each
    bucket chunk. With ``return_fallback``, also a bool tensor marking the buckets that needed the
    full sort (for tests and diagnostics)."""
    xv = _vec(x, "x", torch.float32)
    n = xv.size
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    out = torch.empty(nb, dtype=torch.float32)
    fb = np.zeros(nb, np.uint8)
    if n:
        _cpu().bingrad_pb_encode(xv, xv.view(np.int32), d, 0, 0, 0, d * max(1, _PART // d), True, False,
                                 out.numpy(), fb, np.empty(0, np.uint8))
    if return_fallback:
        return out, torch.from_numpy(fb.astype(bool))
    return out


def bingrad_pb_encode(x: torch.Tensor, bucket: Optional[int],
                      rng: RngLike) -> tuple[torch.Tensor, torch.Tensor]:
    """BinGrad-pb: ``(packed bits, float32 b per bucket)``; bit ``u < (x + b)/(2b)`` (all ones in a
    bucket with ``b = 0``), ``u`` the uniforms of ``rng`` (advanced by ``n``)."""
    xv = _vec(x, "x", torch.float32)
    n = xv.size
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    packed = torch.empty((n + 7) // 8, dtype=torch.uint8)
    k1, k2, ctr0 = _stream(rng, n)
    chunk = _chunk(d)
    if n == 0:
        return packed, torch.empty(0, dtype=torch.float32)
    if chunk % d:   # buckets straddle the packing chunks: all levels first, then the bits
        levels = bingrad_pb_levels(x, bucket)
        _cpu().bingrad_pb_encode(xv, xv.view(np.int32), d, k1, k2, ctr0, chunk, False, True, levels.numpy(),
                                 np.empty(0, np.uint8), packed.numpy())
        return packed, levels
    levels = torch.empty(nb, dtype=torch.float32)
    _cpu().bingrad_pb_encode(xv, xv.view(np.int32), d, k1, k2, ctr0, chunk, True, True, levels.numpy(),
                             np.zeros(nb, np.uint8), packed.numpy())
    return packed, levels
