"""Rand-K's values on the Triton backend, on the implicit subset of :mod:`gradq.kernels.triton_randk`.

Rand-K sends the ``k`` values of ``x`` at ``random_subset(n, k, seed)`` in increasing position.
Done literally, an encode holds the ``k`` sorted int64 indices (twice the values' bytes) and the
candidates' keys and their sort (about ``24·k`` bytes) before it gathers, and a decode holds the
indices again before it scatters. Here the subset stays implicit, as it does for the GlobalRandK
variants: the selection is the ``k``-th smallest draw and the running sums of the selected counters
per program, and one pass over the counters gathers, scatters or subtracts each selected value at
its position in the sub-vector.

* :func:`subset_gather` writes ``x[o]`` of every selected coordinate ``o`` at its position ``j``:
  the payload's values, and nothing else the size of ``k`` or ``n``.
* :func:`subset_indices` writes ``o`` of every selected coordinate at its position: the sorted
  indices themselves, for the callers that need them (:func:`gradq.kernels.random_subset`), with
  no host read.
* :func:`subset_scatter` writes every coordinate of ``out``: ``values[j]`` (times ``float32(n/k)``
  with ``rescale``) at the selected, ``+0.0`` elsewhere; or, with ``subtract``, ``out[o] −
  values[j]`` (rescaled first) at the selected and nothing elsewhere (``u − 0.0`` is ``u``), which
  is error feedback's ``u − decode`` bit for bit.

Both return None where the implicit subset does not apply (:func:`gradq.kernels.triton_randk.selection`),
and the caller then takes the indices.
"""

from __future__ import annotations

from typing import Optional

import torch

from .triton_common import TUNING, _flat, _grid, _jit, _launch, _out, tl
from .triton_randk import _factor, _places, _selected, _start, _sub, selection


@_jit
def _randk_gather_kernel(x_ptr, vals_ptr, incl_ptr, n, k1, k2, t_ptr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """``vals[j] = x[o]`` for each selected counter ``o`` at its position ``j``."""
    before = _start(incl_ptr)
    for c in range(BLOCK // SUB):
        o, sel = _selected(n, k1, k2, t_ptr, c, BLOCK, SUB)
        j, before = _places(sel, before)
        tl.store(vals_ptr + j, tl.load(x_ptr + o, mask=sel, other=0.0), mask=sel)


@_jit
def _randk_index_kernel(idx_ptr, incl_ptr, n, k1, k2, t_ptr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """``idx[j] = o`` for each selected counter ``o`` at its position ``j``: the sorted indices."""
    before = _start(incl_ptr)
    for c in range(BLOCK // SUB):
        o, sel = _selected(n, k1, k2, t_ptr, c, BLOCK, SUB)
        j, before = _places(sel, before)
        tl.store(idx_ptr + j, o.to(tl.int64), mask=sel)


@_jit
def _randk_scatter_kernel(vals_ptr, out_ptr, incl_ptr, n, k1, k2, t_ptr, factor, RESCALE: tl.constexpr,
                          SUBTRACT: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Each selected counter's value ``vals[j]`` (times ``factor`` with RESCALE) into ``out[o]``, the
    others zero; with SUBTRACT, ``out[o] − value`` at the selected and the others untouched."""
    before = _start(incl_ptr)
    for c in range(BLOCK // SUB):
        o, sel = _selected(n, k1, k2, t_ptr, c, BLOCK, SUB)
        j, before = _places(sel, before)
        val = tl.load(vals_ptr + j, mask=sel, other=0.0)
        if RESCALE:
            val = val * factor
        if SUBTRACT:
            tl.store(out_ptr + o, tl.load(out_ptr + o, mask=sel, other=0.0) - val, mask=sel)
        else:
            tl.store(out_ptr + o, tl.where(sel, val, 0.0), mask=o < n)


def subset_gather(x: torch.Tensor, k: int, seed: int) -> Optional[torch.Tensor]:
    """``x.reshape(-1)[random_subset(n, k, seed)]`` as a new float32 tensor of ``k`` values; None
    where the caller must take the indices."""
    xv = _flat(x, "x", torch.float32)
    sel = selection(xv.numel(), k, seed, xv.device)
    if sel is None:
        return None
    vals = torch.empty(k, dtype=torch.float32, device=xv.device)
    _launch(_randk_gather_kernel, _grid(sel.n, sel.block), xv, vals, sel.incl, *sel.args(), BLOCK=sel.block,
            SUB=_sub(sel.block), num_warps=TUNING["randk_warps"])
    return vals


def subset_indices(n: int, k: int, seed: int, device: torch.device | str) -> Optional[torch.Tensor]:
    """``random_subset(n, k, seed)`` (the sorted int64 indices) written from the implicit subset:
    no host read, and nothing beside the ``8·k`` bytes of the result but the selection's small
    state; None where the implicit subset does not apply."""
    sel = selection(n, k, seed, torch.device(device))
    if sel is None:
        return None
    idx = torch.empty(k, dtype=torch.int64, device=device)
    _launch(_randk_index_kernel, _grid(n, sel.block), idx, sel.incl, *sel.args(), BLOCK=sel.block,
            SUB=_sub(sel.block), num_warps=TUNING["randk_warps"])
    return idx


def subset_scatter(values: torch.Tensor, k: int, seed: int, n: int, rescale: bool,
                   out: Optional[torch.Tensor] = None, subtract: bool = False) -> Optional[torch.Tensor]:
    """The ``k`` float32 ``values`` at ``random_subset(n, k, seed)`` of ``out`` (a new tensor where
    None) and zeros elsewhere, each times ``float32(n/k)`` with ``rescale``; with ``subtract``,
    ``out`` minus that decode, in place (module docstring). None where the caller must take the
    indices (``out`` then untouched)."""
    vals = _flat(values, "values", torch.float32)
    if vals.numel() != k:
        raise ValueError(f"expected {k} values, got {vals.numel()}")
    if subtract and out is None:
        raise ValueError("subtract needs out=")
    sel = selection(n, k, seed, vals.device)
    if sel is None:
        return None
    res = _out(out, n, torch.float32, vals.device)
    _launch(_randk_scatter_kernel, _grid(n, sel.block), vals, res, sel.incl, *sel.args(), _factor(n, k, rescale),
            RESCALE=bool(rescale), SUBTRACT=bool(subtract), BLOCK=sel.block, SUB=_sub(sel.block),
            num_warps=TUNING["randk_warps"])
    return res
