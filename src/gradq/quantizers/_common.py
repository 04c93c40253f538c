"""Helpers shared by the quantizer families: code widths and level counts.

The bucket helpers (views, chunks, norms, stochastic rounding) live with the other primitives in
:mod:`gradq.kernels.reference`; they are re-exported here for the families that use them.
"""

from __future__ import annotations

import math

from ..kernels.reference import bucket_chunks, bucket_index, bucket_norms, bucket_view, num_buckets, stochastic_round

__all__ = ["num_buckets", "bucket_chunks", "bucket_index", "bucket_view", "bucket_norms", "stochastic_round",
           "code_width", "levels_from_bits"]


def code_width(num_values: int) -> int:
    """Bits needed to store ``num_values`` distinct codes (at least 1)."""
    return max(1, math.ceil(math.log2(num_values))) if num_values > 1 else 1


def levels_from_bits(bits: int) -> int:
    """Sign-magnitude convention of docs/algorithms.md: ``bits=b`` gives ``s = 2**(b-1) - 1`` levels."""
    return (1 << (bits - 1)) - 1
