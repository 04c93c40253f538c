"""Argument checks shared by every backend of :mod:`gradq.kernels` (pure Python, no numba)."""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from ..random import RandomStream

RngLike = Union[RandomStream, int]
_INF32 = np.float32(np.inf)


def _bucket(n: int, bucket: Optional[int]) -> int:
    if bucket is None:
        return max(n, 1)
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise ValueError(f"bucket must be a positive int or None, got {bucket!r}")
    return bucket


def _nbuckets(n: int, d: int) -> int:
    return (n + d - 1) // d


def _width(width: int) -> int:
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 8:
        raise ValueError(f"width must be an int in [1, 8], got {width!r}")
    return width


def _levels_s(s: int, width: Optional[int]) -> int:
    if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        raise ValueError(f"s must be a positive int, got {s!r}")
    if width is not None and 2 * s >= (1 << width):
        raise ValueError(f"fields c + s up to {2 * s} do not fit in {width} bits")
    return s


def _clip(clip: Optional[float]) -> np.float32:
    if clip is None:
        return _INF32
    c = float(clip)
    if not c >= 0:
        raise ValueError(f"clip must be >= 0 or None, got {clip!r}")
    return np.float32(c + 0.0)   # (−0.0 is the clip 0.0, as in the reference)


def _stream(rng: RngLike, advance: int) -> tuple[int, int, int]:
    """``(k1, k2, first counter)`` of ``rng``, advancing it by ``advance`` like the reference."""
    if isinstance(rng, RandomStream):
        start = rng.offset
        rng.offset += advance
        return rng.k1, rng.k2, start
    if isinstance(rng, bool) or not isinstance(rng, int):
        raise TypeError(f"rng must be a RandomStream or an int seed, got {type(rng).__name__}")
    st = RandomStream(rng)
    return st.k1, st.k2, 0
