"""Rand-K's and the RandK variants' primitives on their subset, dispatched like the rest of
:mod:`gradq.kernels`.

``indices`` gives ``random_subset(n, k, seed)`` on the tensor's device (the quantizer keeps its last
selection). The Triton backend does not call it where its implicit subset decides
(:mod:`gradq.kernels.triton_randk` and :mod:`gradq.kernels.triton_randk_values`: no index and no
gathered value is ever stored); the other backends gather, run the package's primitives on the
``k`` values and scatter.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from . import (RngLike, backend_for, l2_scales, maxabs_scales, multiscale_decode, multiscale_encode,
               uniform_decode, uniform_encode)


def _randk() -> Any:
    from . import triton_randk
    return triton_randk


def _randk_values() -> Any:
    from . import triton_randk_values
    return triton_randk_values


def subset_gather(x: torch.Tensor, k: int, seed: int, indices: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Rand-K's values: the ``k`` coordinates ``random_subset(x.numel(), k, seed)`` of ``x`` in
    increasing position, as a float32 tensor of their own."""
    if x.numel() and backend_for(x) == "triton":
        got = _randk_values().subset_gather(x, k, seed)
        if got is not None:
            return got
    return x.reshape(-1)[indices()].contiguous()


def subset_scatter(values: torch.Tensor, k: int, seed: int, n: int, rescale: bool,
                   indices: Callable[[], torch.Tensor], out: Optional[torch.Tensor] = None,
                   subtract: bool = False) -> torch.Tensor:
    """Rand-K's decode: the ``n`` float32 values whose coordinates ``random_subset(n, k, seed)`` hold
    the ``k`` ``values`` (each times ``float32(n/k)`` with ``rescale``) and whose others are zero, in
    ``out`` or a new tensor. With ``subtract`` (``out`` given): ``out`` minus that decode, in place,
    bit for bit, touching only the ``k`` coordinates (error feedback's ``u − decode``)."""
    if k and k < n and backend_for(values) == "triton":
        got = _randk_values().subset_scatter(values, k, seed, n, rescale, out, subtract)
        if got is not None:
            return got
    if not subtract:
        return _scatter_into(values, n, k, rescale, indices(), out)
    if out is None:
        raise ValueError("subtract needs out=")
    if k:
        idx = indices()
        flat = out.view(-1)
        flat[idx] = flat[idx] - (values * (n / k) if rescale else values).to(device=out.device, dtype=torch.float32)
    return out


def subset_norm(x: torch.Tensor, k: int, seed: int, norm: str,
                indices: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The one-bucket ``maxabs_scales`` (``norm="max"``) or ``l2_scales`` of ``x``'s ``k`` coordinates
    ``random_subset(x.numel(), k, seed)``: a float32 tensor of one element."""
    if x.numel() and backend_for(x) == "triton":
        got = _randk().subset_norm(x, k, seed, norm)
        if got is not None:
            return got
    sub = x.reshape(-1)[indices()]
    return maxabs_scales(sub, None) if norm == "max" else l2_scales(sub, None)


def subset_uniform_encode(x: torch.Tensor, k: int, seed: int, scale: torch.Tensor, s: int, width: int,
                          rng: RngLike, indices: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``uniform_encode`` of those ``k`` coordinates of ``x`` (in increasing position) under one
    shared ``scale``: MaxNorm's codes field of the sub-vector."""
    if x.numel() and backend_for(x) == "triton":
        got = _randk().subset_uniform_encode(x, k, seed, scale, s, width, rng)
        if got is not None:
            return got
    return uniform_encode(x.reshape(-1)[indices()], scale, s, None, width, rng)


def subset_uniform_decode(packed: torch.Tensor, scale: torch.Tensor, s: int, width: int, k: int, seed: int,
                          n: int, rescale: bool, indices: Callable[[], torch.Tensor],
                          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``n`` float32 values whose coordinates ``random_subset(n, k, seed)`` hold the ``k`` values
    ``uniform_decode(packed, scale, s, None, width, k)`` (each times ``float32(n/k)`` with
    ``rescale``) and whose others are zero, in ``out`` (checked before it is touched) or a new
    tensor."""
    if k and k < n and backend_for(packed) == "triton":
        got = _randk().subset_uniform_decode(packed, scale, s, width, k, seed, n, rescale, out)
        if got is not None:
            return got
    sub = uniform_decode(packed, scale, s, None, width, k)
    return _scatter_into(sub, n, k, rescale, indices(), out)


def _scatter_into(sub: torch.Tensor, n: int, k: int, rescale: bool, idx: torch.Tensor,
                  out: Optional[torch.Tensor]) -> torch.Tensor:
    res = torch.empty(n, dtype=torch.float32, device=sub.device) if out is None else out
    res.zero_()
    if k:
        res[idx] = (sub * (n / k) if rescale else sub).to(res.device)
    return res


def subset_multiscale_encode(x: torch.Tensor, k: int, seed: int, scale: torch.Tensor, levels: Sequence[int],
                             width: int, index_width: int, rng: RngLike,
                             indices: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``multiscale_encode`` of those ``k`` coordinates of ``x`` under one shared ``scale``, each
    value under its own scale index: MultiScale's codes and index fields of the sub-vector."""
    if x.numel() and backend_for(x) == "triton":
        got = _randk().subset_multiscale_encode(x, k, seed, scale, levels, width, index_width, rng)
        if got is not None:
            return got
    return multiscale_encode(x.reshape(-1)[indices()], scale, None, levels, None, width, index_width, rng)


def subset_multiscale_decode(codes: torch.Tensor, index: Optional[torch.Tensor], scale: torch.Tensor,
                             levels: Sequence[int], width: int, index_width: int, k: int, seed: int, n: int,
                             rescale: bool, indices: Callable[[], torch.Tensor],
                             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`subset_uniform_decode`, for MultiScale's fields (``multiscale_decode`` of the ``k``
    values, corrupt indices refused before ``out`` is touched)."""
    if k and k < n and backend_for(codes) == "triton":
        got = _randk().subset_multiscale_decode(codes, index, scale, levels, width, index_width, k, seed, n,
                                                 rescale, out)
        if got is not None:
            return got
    sub = multiscale_decode(codes, index, scale, levels, None, width, index_width, k)
    return _scatter_into(sub, n, k, rescale, indices(), out)
