"""Fast CPU paths (numba) for ORQ-L and Linear-L: per-bucket levels, and levels + rounding + packing.

Each function takes and returns torch CPU tensors and gives **the same bits** as the plain-torch
reference in :mod:`gradq.kernels.reference`, on any number of threads:

=================  ==============================================================================
kernel             plain-torch reference
=================  ==============================================================================
orq_levels         ``torch.cat([orq_levels(m, L) for m in bucket_chunks(x, bucket)])``
linear_levels      the same with ``linear_levels``
orq_encode         ``(pack_bits(cat(round_to_levels(m, lv_m, rng)), width), levels)`` per chunk
linear_encode      the same with Linear's levels
=================  ==============================================================================

``x`` is a float32 vector cut into buckets of ``bucket`` (``None``: one bucket; the last one may be
shorter and gets its own levels), or, for the ``*_levels`` functions, a ``(rows, d)`` matrix whose
rows are the buckets. Levels come back as an ``(num_buckets, L)`` float32 matrix.

The reference sorts each bucket with ``−0.0`` before ``+0.0`` (``reference.sort_rows``), as the
kernels do (see :mod:`gradq.kernels.cpu_levels`), so that a level that is a zero has one sign on
every device. ORQ is
supported for ``L ∈ {2, 3, 5, 9, 17}`` — the tie-breaking of torch's ``maximum``/``minimum`` on ``±0``
in the midpoint rule changes with the SIMD width for more levels; Linear for any ``L = 2^k + 1`` up
to 257 (up to ``2^width`` when encoding). Inputs must be finite (the quantizers check this): a NaN
or infinity raises ``ValueError``.

Randomness: element ``i`` uses counter ``rng.offset + i``; ``rng`` advances by ``n`` like the
reference's ``round_to_levels`` calls. Wire sizes are unchanged: ``ceil(n·width/8)`` bytes of
indices and ``L`` float32 levels per bucket.

Threads: the work is cut into independent tasks (chunks of whole buckets, or groups of buckets) and
contiguous task ranges run on up to ``numba.get_num_threads()`` threads (numba code with the GIL
released); the bytes never depend on the number of threads. Buckets longer than 8192 get their
levels one bucket per task, then :func:`gradq.kernels.levels_encode` does the rounding.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from ..errors import NonFiniteError
from .numba_ops import RngLike, _bucket, _cpu, _nbuckets, _out, _stream, _vec, _width
from .numba_ops import levels_encode as _round_encode
from .reference import linear_positions

__all__ = ["orq_levels", "linear_levels", "orq_encode", "linear_encode", "ORQ_LEVELS"]

ORQ_LEVELS = (2, 3, 5, 9, 17)
_FUSED_MAX = 8192   # longest bucket handled by the fused kernel (longer: levels, then rounding)
_MOD = None
_NO_BYTES = np.zeros(1, np.uint8)
_POOL: Optional[ThreadPoolExecutor] = None
_POOL_PID = -1       # the pool's threads do not survive a fork: a child makes its own
_POOL_LOCK = threading.Lock()
_MIN_WORK = 1 << 16   # elements per thread below which one thread does it all


def _mod():
    """The numba module (imported on first use, after :mod:`gradq.kernels.cpu` loads)."""
    global _MOD
    if _MOD is None:
        _cpu()
        from .numba_cache import keyed_cache

        with keyed_cache():
            from . import cpu_levels
        _MOD = cpu_levels
    return _MOD


def _check_L(L: int, mode: int) -> int:
    if isinstance(L, bool) or not isinstance(L, int) or L < 2 or (L - 1) & (L - 2):
        raise ValueError(f"L must be 2^k + 1 (3, 5, 9, 17, ...), got {L!r}")
    if mode == 0 and L not in ORQ_LEVELS:
        raise ValueError(f"the ORQ kernel supports L in {ORQ_LEVELS}, got {L}")
    if mode == 1 and L > 257:
        raise ValueError(f"the Linear kernel supports L up to 257, got {L}")
    return L


def _positions(d: int, L: int) -> np.ndarray:
    """Linear's quantile positions (:func:`gradq.kernels.reference.linear_positions`)."""
    return linear_positions(d, L).numpy()


def _prepare(x: torch.Tensor, L: int, bucket: Optional[int], mode: int, matrix_ok: bool):
    """``(flat float32 array, bucket length d ≤ n, positions for full and tail buckets)``."""
    _check_L(L, mode)
    if matrix_ok and isinstance(x, torch.Tensor) and x.dim() == 2:
        if x.shape[1] == 0:
            raise ValueError(f"expected a (buckets, d) matrix with d >= 1, got shape {tuple(x.shape)}")
        bucket = int(x.shape[1])
    xv = _vec(x, "x", torch.float32)
    n = xv.size
    d = min(_bucket(n, bucket), max(n, 1))
    tail = n - (n // d) * d if n else 0
    pos_full = _positions(d, L) if mode == 1 else np.zeros(1, np.int64)
    pos_tail = _positions(tail, L) if mode == 1 and tail else pos_full
    return xv, d, pos_full, pos_tail


def _threads() -> int:
    """Threads to use: numba's setting for this thread (``NUMBA_NUM_THREADS``, ``set_num_threads``)."""
    import numba
    return max(1, int(numba.get_num_threads()))


def _run(ntask: int, work: int, *args) -> int:
    """:func:`cpu_levels.run` over tasks ``0 … ntask − 1``, the range cut into contiguous parts over
    the threads (results are independent of the cut). Returns the OR of the flags."""
    global _POOL, _POOL_PID
    mod = _mod()
    nthr = min(_threads(), ntask, max(1, work // _MIN_WORK))
    if nthr <= 1:
        return int(mod.run(args[0], 0, ntask, *args[1:]))
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != os.getpid():
            import numba
            _POOL = ThreadPoolExecutor(max_workers=max(2, numba.config.NUMBA_NUM_THREADS),
                                       thread_name_prefix="gradq-levels")
            _POOL_PID = os.getpid()
        pool = _POOL
    cuts = [ntask * i // nthr for i in range(nthr + 1)]
    futs = [pool.submit(mod.run, args[0], cuts[i], cuts[i + 1], *args[1:]) for i in range(nthr)]
    flags = 0
    for f in futs:
        flags |= int(f.result())
    return flags


def _check_flags(flags: int) -> None:
    if flags & 4:
        raise NonFiniteError("x holds NaN or Inf (the level kernels do not handle them)")


def _levels(x, L, bucket, mode, matrix_ok=True) -> torch.Tensor:
    xv, d, pos_full, pos_tail = _prepare(x, L, bucket, mode, matrix_ok)
    nb = _nbuckets(xv.size, d)
    res = torch.empty(nb, L, dtype=torch.float32)
    if nb:
        rounds = (L - 1).bit_length() - 1 if mode == 0 else 0
        task = 1 if d <= _FUSED_MAX else 2
        group = _mod()._group_size(mode, d, L)    # buckets per task 1
        ntask = (nb + group - 1) // group if task == 1 else nb
        _check_flags(_run(ntask, xv.size, task, xv, xv.view(np.int32), mode, L, rounds, pos_full, pos_tail, d, 1,
                          0, 0, 0, 1, res.view(-1).numpy(), _NO_BYTES))
    return res


def orq_levels(x: torch.Tensor, L: int, bucket: Optional[int] = None) -> torch.Tensor:
    """ORQ's ``L`` levels of every bucket of ``x`` (or of every row of a 2-D ``x``): ``(nb, L)``."""
    return _levels(x, L, bucket, 0)


def linear_levels(x: torch.Tensor, L: int, bucket: Optional[int] = None) -> torch.Tensor:
    """Linear's ``L`` quantile levels of every bucket of ``x`` (or of every row of a 2-D ``x``)."""
    return _levels(x, L, bucket, 1)


def _encode(x, L, bucket, width, rng, mode, out):
    xv, d, pos_full, pos_tail = _prepare(x, L, bucket, mode, False)
    n = xv.size
    if L > (1 << _width(width)):
        raise ValueError(f"{L} level indices do not fit in {width} bits")
    nb = _nbuckets(n, d)
    if d > _FUSED_MAX:   # long buckets: their levels in parallel over buckets, then the rounding
        levels = _levels(x, L, d, mode, False)
        return _round_encode(x, levels, d, width, rng, out=out), levels
    packed = _out(out, (n * width + 7) // 8, torch.uint8)
    levels = torch.empty(nb, L, dtype=torch.float32)
    k1, k2, ctr0 = _stream(rng, n)
    if n:
        unit = d * 8 // math.gcd(d, 8)
        chunk = unit * max(1, 65536 // unit)
        rounds = (L - 1).bit_length() - 1 if mode == 0 else 0
        _check_flags(_run((n + chunk - 1) // chunk, n, 0, xv, xv.view(np.int32), mode, L, rounds, pos_full,
                          pos_tail, d, width, k1, k2, ctr0, chunk, levels.view(-1).numpy(), packed.numpy()))
    return packed, levels


def orq_encode(x: torch.Tensor, L: int, bucket: Optional[int], width: int, rng: RngLike,
               out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ORQ-L encode of a float32 vector: ``(packed width-bit level indices, (nb, L) levels)``."""
    return _encode(x, L, bucket, width, rng, 0, out)


def linear_encode(x: torch.Tensor, L: int, bucket: Optional[int], width: int, rng: RngLike,
                  out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear-L encode of a float32 vector: ``(packed width-bit level indices, (nb, L) levels)``."""
    return _encode(x, L, bucket, width, rng, 1, out)
