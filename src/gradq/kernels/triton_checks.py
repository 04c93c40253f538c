"""Triton kernel of a checked encode's look at its non-finite witness (``TUNING["witness_path"]`` 2):
whether a small field (a value per bucket) holds NaN or Inf, from the values' exponent bits.

Part of the Triton backend (:mod:`gradq.kernels.triton_ops`, which exports :func:`field_is_finite`;
:func:`gradq.kernels.witness_is_finite` chooses it).
"""

from __future__ import annotations

import math

import torch

from .triton_common import _grid, _jit, _launch, tl


@_jit
def _nonfinite_kernel(bits_ptr, flags_ptr, n, EXP: tl.constexpr, BLOCK: tl.constexpr):
    """``flags[program]`` = 1 where one of the program's BLOCK values (as bit patterns) is NaN or
    ±Inf (every exponent bit set: ``EXP``), else 0: nothing to zero first, no atomics."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    b = tl.load(bits_ptr + idx, mask=idx < n, other=0)
    tl.store(flags_ptr + tl.program_id(0), tl.max(((b & EXP) == EXP).to(tl.int32), axis=0))


_NONFINITE_BLOCK = 4096
#: the integer view and the exponent mask of the float types whose bits the kernel reads
_EXPONENT = {torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}


def field_is_finite(t: torch.Tensor) -> bool:
    """Whether every value of a small float32/float64 field (a value per bucket: a payload's
    non-finite witness) is finite: one launch and one host read of a flag per 4,096 values (no
    reduction kernel; ``TUNING["witness_path"]`` 2). Other dtypes: ``isfinite`` of their sum."""
    v = t.detach().reshape(-1)
    if t.dtype not in _EXPONENT or v.numel() == 0:
        return math.isfinite(float(v.sum()))
    view, exp = _EXPONENT[t.dtype]
    grid = _grid(v.numel(), _NONFINITE_BLOCK)
    flags = torch.empty(grid[0], dtype=torch.int32, device=v.device)
    _launch(_nonfinite_kernel, grid, v.contiguous().view(view), flags, v.numel(), EXP=exp, BLOCK=_NONFINITE_BLOCK)
    return not any(flags.tolist())
