"""Kernels: one home per primitive, with one backend per kind of device, chosen in one place.

Every primitive the fixed-width quantizers need (per-bucket norms, uniform codes packed into bit
fields or trits, level rounding, one-bit codes, and their decodes, including the fused mean of M
payloads) is a function of this module. It hands the call to one of three backends, which give
**the same bytes and the same floats** for the same seed:

=========  ==========================================================================================
backend    what and where
=========  ==========================================================================================
torch      :mod:`gradq.kernels.reference` — eager torch, any device: the specification and the oracle
numba      :mod:`gradq.kernels.numba_ops` (+ ``binary``, ``levels``) — fused CPU kernels, the CPU default
triton     :mod:`gradq.kernels.triton_ops` — fused GPU kernels, the CUDA default when triton imports
=========  ==========================================================================================

:func:`backend_for` decides by the tensor's device and ``GRADQ_KERNELS`` (``auto``, the default;
``torch`` or ``0`` for the reference everywhere; ``numba``; ``triton`` to force Triton on every
tensor — on CPU tensors through Triton's interpreter, which is how the suite tests the Triton kernels
on machines without a GPU). :func:`set_backend` changes it for the process. The quantizers call the
functions below and never test the device.

Randomness: ``rng`` is a :class:`gradq.random.RandomStream` (or an int seed for a fresh one). Element
``i`` uses counter ``rng.offset + i`` and the stream advances by exactly as many numbers as the
reference draws (``num_buckets·bucket`` for the zero-padded uniform schemes, ``n`` for levels), so
later draws from the same stream agree too. Wire sizes: ``ceil(n·width/8)`` bytes of packed fields
(``ceil(n/5)`` for trits).

Corrupt payloads: a decode refuses fields no encode writes (:class:`gradq.PayloadError`), on every
backend; inside :func:`deferred_checks` it counts them on the device instead, for one look later
(:mod:`gradq.kernels.checks`: what the DDP hook does, so that a GPU decode waits for nothing).

Threads: the numba kernels take this process's share of the cores (:func:`process_threads`).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from ..random import RandomStream
from . import numba_ops, reference, subset
from .checks import DeferredChecks, deferred_checks
from . import binary as _numba_binary
from . import levels as _numba_levels

__all__ = ["available", "triton_available", "set_enabled", "set_backend", "get_backend", "backend_for",
           "process_threads", "maxabs_scales", "l2_scales", "uniform_encode", "uniform_encode_trits",
           "maxabs_uniform_encode", "l2_uniform_encode", "uniform_decode", "uniform_decode_sum", "uniform_decode_trits",
           "uniform_decode_mean",
           "uniform_decode_trits_mean", "population_std", "terngrad_stats", "levels_encode", "levels_decode",
           "orq_encode", "linear_encode", "threshold_encode", "sign_encode", "bit_decode", "sign_scale_encode",
           "onebit_encode", "bingrad_b_encode", "bingrad_pb_encode", "multiscale_indices", "multiscale_encode",
           "multiscale_decode", "random_subset", "topk_select", "sparse_mean_zero_signs", "subset_norm",
           "subset_gather", "subset_scatter", "subset_uniform_encode", "subset_uniform_decode",
           "subset_multiscale_encode", "subset_multiscale_decode", "elias_fields_stream", "elias_stream_fields",
           "elias_encode", "elias_decode", "witness_is_finite", "crc32_field",
           "deferred_checks", "DeferredChecks"]

RngLike = Union[RandomStream, int]


def process_threads(env: Optional[dict] = None, cpus: Optional[int] = None) -> Optional[int]:
    """Kernel threads for this process when ``NUMBA_NUM_THREADS`` is not set: its share of the machine.

    The first that applies: ``OMP_NUM_THREADS`` (what torchrun and most launchers give each process,
    1 with several processes per node), then the usable cores divided by ``LOCAL_WORLD_SIZE`` (the
    processes on this node). ``None`` when neither is set (or ``NUMBA_NUM_THREADS`` is: an explicit
    setting always wins), so a lone process keeps one thread per core. Without this, every rank's
    pool spans every core and ranks sharing a machine slow each other down several times over."""
    env = os.environ if env is None else env
    if str(env.get("NUMBA_NUM_THREADS", "")).strip():
        return None
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)
    for key, per_process in (("OMP_NUM_THREADS", lambda v: v), ("LOCAL_WORLD_SIZE", lambda v: cpus // v)):
        raw = str(env.get(key, "")).strip()
        if raw.isdigit() and int(raw) >= 1:
            return max(1, min(cpus, per_process(int(raw))))
    return None


def _share_threads() -> None:
    """Apply :func:`process_threads` before numba starts its pool (numba reads the variable once,
    at import); if numba was imported already, cap this thread's count instead."""
    import sys

    n = process_threads()
    if n is None:
        return
    if "numba" not in sys.modules:
        os.environ["NUMBA_NUM_THREADS"] = str(n)
        return
    import numba

    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


# -- backends ------------------------------------------------------------------------------------
_share_threads()
#: every name GRADQ_KERNELS accepts, and the mode it selects
_MODES = {"": "auto", "1": "auto", "auto": "auto", "on": "auto", "0": "torch", "off": "torch", "torch": "torch",
          "numba": "numba", "triton": "triton"}


def _mode_from_env() -> str:
    raw = os.environ.get("GRADQ_KERNELS", "").strip().lower()
    if raw not in _MODES:
        raise ValueError(f"GRADQ_KERNELS={raw!r} is not one of auto (default), torch (or 0), numba, triton")
    return _MODES[raw]


_MODE = _mode_from_env()
_TRITON: Any = None          # the imported gradq.kernels.triton_ops module, once loaded
_TRITON_ERROR: Optional[BaseException] = None


def _triton() -> Any:
    """The Triton backend module, or None when triton cannot be imported."""
    global _TRITON, _TRITON_ERROR
    if _TRITON is None and _TRITON_ERROR is None:
        try:
            from . import triton_ops as _mod
            _TRITON = _mod
        except Exception as exc:  # triton missing or broken: the other backends remain
            _TRITON_ERROR = exc
    return _TRITON


def available() -> bool:
    """True when the numba kernels serve CPU tensors: numba imports, and neither ``GRADQ_KERNELS``
    nor :func:`set_enabled`/:func:`set_backend` chose another backend."""
    return _MODE in ("auto", "numba") and numba_ops.loads()


def triton_available() -> bool:
    """True when the Triton backend imports (``pip install triton``; on a machine without a GPU its
    kernels run under Triton's interpreter, for tests)."""
    return _triton() is not None


def set_enabled(flag: bool) -> None:
    """Switch the fast kernels on (``True``: the default choice per device) or off (``False``:
    the plain-torch reference everywhere) for this process."""
    set_backend("auto" if flag else "torch")


def set_backend(mode: str) -> None:
    """Choose the backends for this process, as ``GRADQ_KERNELS`` does at start-up: ``"auto"``
    (numba for CPU tensors, Triton for CUDA tensors, torch where neither loads), ``"torch"`` (the
    reference everywhere), ``"numba"`` (numba on CPU, torch elsewhere) or ``"triton"`` (Triton for
    every tensor: on CPU tensors through Triton's interpreter, which is slow and meant for tests)."""
    global _MODE
    if mode not in ("auto", "torch", "numba", "triton"):
        raise ValueError(f"unknown kernel backend {mode!r}: auto, torch, numba or triton")
    if mode == "triton" and not triton_available():
        raise RuntimeError(f"the Triton backend needs triton, which failed to import: {_TRITON_ERROR!r}")
    _MODE = mode


def get_backend() -> str:
    """The mode :func:`set_backend` or ``GRADQ_KERNELS`` selected."""
    return _MODE


def backend_for(t: torch.Tensor) -> str:
    """The backend that handles a tensor on ``t``'s device: ``"numba"``, ``"triton"`` or ``"torch"``.

    The one place where gradq picks kernels by device: quantizers call the primitives below and
    never test the device themselves."""
    dev = t.device.type
    if _MODE == "torch":
        return "torch"
    if _MODE == "triton":
        if not triton_available():
            raise RuntimeError(f"GRADQ_KERNELS=triton, but triton failed to import: {_TRITON_ERROR!r}")
        if dev == "cuda" or _triton().INTERPRETED:
            return "triton"  # (CPU tensors only under the interpreter, on machines without a GPU)
    if dev == "cpu":
        return "numba" if _MODE in ("auto", "numba") and numba_ops.loads() else "torch"
    if dev == "cuda" and _MODE == "auto" and triton_available():
        return "triton"
    return "torch"


def _impl(name: str, t: torch.Tensor) -> Callable[..., Any]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    b = "torch" if t.numel() == 0 else backend_for(t)  # nothing to compute: the reference's empties
    if b == "numba":
        mod: Any = numba_ops if hasattr(numba_ops, name) else (_numba_binary if name in _BINARY else _numba_levels)
    elif b == "triton":
        mod = _triton()
    else:
        mod = reference
    return getattr(mod, name)


_BINARY = ("sign_scale_encode", "onebit_encode", "bingrad_b_encode", "bingrad_pb_encode")


# -- max-abs norms and uniform codes (QSGD, MaxNorm, TernGrad) -----------------------------------
def maxabs_scales(x: torch.Tensor, bucket: Optional[int], clip: Optional[float] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-bucket ``max |x|`` (float32, one per bucket; ``bucket=None``: the whole tensor). With
    ``clip``, the max of ``clamp(x, −clip, clip)``, i.e. ``min(max |x|, clip)`` (TernGrad)."""
    return _impl("maxabs_scales", x)(x, bucket, clip, out)


def l2_scales(x: torch.Tensor, bucket: Optional[int], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-bucket L2 norm, ``float32(sqrt(Σ float64(x)²))`` (float32, one per bucket): the same on
    every backend (see :func:`gradq.kernels.reference.bucket_norms`)."""
    return _impl("l2_scales", x)(x, bucket, out)


def uniform_encode(x: torch.Tensor, scales: torch.Tensor, s: int, bucket: Optional[int], width: int,
                   rng: RngLike, clip: Optional[float] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """QSGD-style codes ``c = sgn(x)·min(floor(|x|·s/scale + u), s)`` under the given per-bucket
    ``scales`` (MaxNorm's shared scale), packed as ``width``-bit fields ``c + s``; ``clip`` clamps x
    first (TernGrad). Returns ``ceil(n·width/8)`` uint8 bytes."""
    return _impl("uniform_encode", x)(x, scales, s, bucket, width, rng, clip, out)


def maxabs_uniform_encode(x: torch.Tensor, s: int, bucket: Optional[int], width: int, rng: RngLike,
                          clip: Optional[float] = None,
                          out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`maxabs_scales` and :func:`uniform_encode` fused (QSGD with ``norm=max``): each bucket's
    norm, codes and bytes in one pass where the backend can. Returns ``(packed, scales)``."""
    return _impl("maxabs_uniform_encode", x)(x, s, bucket, width, rng, clip, out)


def l2_uniform_encode(x: torch.Tensor, s: int, bucket: Optional[int], width: int, rng: RngLike,
                      out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`l2_scales` and :func:`uniform_encode` fused (QSGD with ``norm=l2``): each bucket's norm,
    codes and bytes in one pass where the backend can (Triton: power-of-two buckets of 8 to 4096
    values). Returns ``(packed, scales)``."""
    return _impl("l2_uniform_encode", x)(x, s, bucket, width, rng, out)


def uniform_encode_trits(x: torch.Tensor, scales: torch.Tensor, bucket: Optional[int], rng: RngLike,
                         clip: Optional[float] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TernGrad's codes ``{−1, 0, 1}`` (``s = 1``) as trits ``c + 1``, five per byte (``ceil(n/5)``
    bytes); ``clip`` is TernGrad's bound ``c·σ``. For ``pack=2bit`` use :func:`uniform_encode` with
    ``s=1, width=2``."""
    return _impl("uniform_encode_trits", x)(x, scales, bucket, rng, clip, out)


def uniform_decode(packed: torch.Tensor, scales: torch.Tensor, s: int, bucket: Optional[int], width: int,
                   n: int, max_field: Optional[int] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``float32(field − s)·(scale_b/s)`` for ``n`` packed ``width``-bit fields. With ``max_field``,
    a field above it raises :class:`PayloadError` (TernGrad 2-bit: ``max_field=2``)."""
    return _impl("uniform_decode", packed)(packed, scales, s, bucket, width, n, max_field, out)


def uniform_decode_sum(total: torch.Tensor, scales: torch.Tensor, s: int, bucket: Optional[int], n: int,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`uniform_decode` of integer fields wider than a byte (the all-reduce's sum of fields at
    ``2·M·s > 255``): ``float32(t − s)·(scale_b/s)``, bit for bit as a byte's. One implementation, in
    torch on every device: three element-wise passes in place in ``out``."""
    return reference.uniform_decode_sum(total, scales, s, bucket, n, out)


def uniform_decode_trits(packed: torch.Tensor, scales: torch.Tensor, bucket: Optional[int], n: int,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TernGrad ``pack=trit`` decode: ``(trit − 1)·scale_b``; a byte above 242 raises PayloadError."""
    return _impl("uniform_decode_trits", packed)(packed, scales, bucket, n, out)


def _first(packed: Sequence[torch.Tensor]) -> torch.Tensor:
    if not packed:
        raise ValueError("need at least one payload")
    return packed[0]


def uniform_decode_mean(packed: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], s: int,
                        bucket: Optional[int], width: int, n: int, max_field: Optional[int] = None,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The mean of :func:`uniform_decode` over several payloads (``packed[j]`` with ``scales[j]``),
    added in list order in float32 and divided by their count — bit for bit the plain loop, in one
    pass (what the reducing rank of scatter/all-gather does with the M chunks it receives)."""
    return _impl("uniform_decode_mean", _first(packed))(packed, scales, s, bucket, width, n, max_field, out)


def uniform_decode_trits_mean(packed: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                              bucket: Optional[int], n: int,
                              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`uniform_decode_mean` for TernGrad's trits (five per byte)."""
    return _impl("uniform_decode_trits_mean", _first(packed))(packed, scales, bucket, n, out)


# -- TernGrad's clipping statistics ----------------------------------------------------------------
def population_std(x: torch.Tensor) -> torch.Tensor:
    """``torch.std(x, correction=0)`` (0-dim float32) computed in float64 and rounded once; NaN for
    an empty tensor (see :func:`gradq.kernels.reference.population_std` for the agreement between
    backends)."""
    return _impl("population_std", x)(x)


def terngrad_stats(x: torch.Tensor, clip: Optional[float], bucket: Optional[int]
                   ) -> tuple[Optional[Union[float, torch.Tensor]], torch.Tensor]:
    """TernGrad's ``(bound, scales)``: ``bound = float32(clip)·σ`` as in ``clip_by_std`` (None when
    ``clip`` is None, ``n ≤ 1`` or ``σ = 0``: no clipping) and the per-bucket max-abs of the clipped
    vector, ``min(max |x|, bound)``. Pass ``bound`` as ``clip=`` to :func:`uniform_encode_trits` /
    :func:`uniform_encode` of the same backend: the Triton backend keeps it on the device (a
    one-element float32 tensor, inf for no clipping), so the encode reads nothing on the host."""
    return _impl("terngrad_stats", x)(x, clip, bucket)


# -- ORQ / Linear: rounding onto given levels ----------------------------------------------------
def levels_encode(x: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], width: int, rng: RngLike,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Unbiased stochastic rounding of every element onto its bucket's sorted row of ``levels``
    (``(num_buckets, L)``, rows covering their bucket's range), packed as ``width``-bit indices."""
    return _impl("levels_encode", x)(x, levels, bucket, width, rng, out)


def levels_decode(packed: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], width: int, n: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``levels[b, index]`` for ``n`` packed indices; an index ``≥ L`` raises PayloadError."""
    return _impl("levels_decode", packed)(packed, levels, bucket, width, n, out)


def orq_encode(x: torch.Tensor, L: int, bucket: Optional[int], width: int, rng: RngLike,
               out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ORQ-L encode of a float32 vector: ``(packed width-bit level indices, (nb, L) levels)``."""
    return _impl("orq_encode", x)(x, L, bucket, width, rng, out)


def linear_encode(x: torch.Tensor, L: int, bucket: Optional[int], width: int, rng: RngLike,
                  out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear-L encode of a float32 vector: ``(packed width-bit level indices, (nb, L) levels)``."""
    return _impl("linear_encode", x)(x, L, bucket, width, rng, out)


# -- one bit per element -------------------------------------------------------------------------
def threshold_encode(x: torch.Tensor, thresholds: torch.Tensor, bucket: Optional[int],
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bits ``float64(x) >= thresholds[b]`` (float64, one per bucket; BinGrad-b) packed 8 per byte."""
    return _impl("threshold_encode", x)(x, thresholds, bucket, out)


def sign_encode(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bits ``x >= 0`` (−0.0 gives 1) packed 8 per byte: the code of SignSGD and 1BitSGD."""
    return _impl("sign_encode", x)(x, out)


def bit_decode(packed: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], n: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode one bit per element. ``levels`` of shape ``(nb, 2)``: ``levels[b, bit]`` (1BitSGD,
    BinGrad-b); of shape ``(nb,)`` or ``(nb, 1)``: ``levels[b]·float32(2·bit − 1)`` (SignSGD, BinGrad-pb)."""
    return _impl("bit_decode", packed)(packed, levels, bucket, n, out)


def sign_scale_encode(x: torch.Tensor, bucket: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled SignSGD: ``(bits x ≥ 0 packed, float32 mean |x| per bucket)``."""
    return _impl("sign_scale_encode", x)(x, bucket)


def onebit_encode(x: torch.Tensor, bucket: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """1BitSGD: ``(bits x ≥ 0 packed, float32 (mean{x < 0}, mean{x ≥ 0}) per bucket, flattened)``."""
    return _impl("onebit_encode", x)(x, bucket)


def bingrad_b_encode(x: torch.Tensor, bucket: Optional[int], iters: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """BinGrad-b: ``(bits float64(x) ≥ t packed, float32 (b0, b1) per bucket, flattened)``."""
    return _impl("bingrad_b_encode", x)(x, bucket, iters)


def bingrad_pb_encode(x: torch.Tensor, bucket: Optional[int], rng: RngLike) -> tuple[torch.Tensor, torch.Tensor]:
    """BinGrad-pb: ``(packed bits, float32 b per bucket)``; bit ``u < (x + b)/(2b)`` (all ones in a
    bucket with ``b = 0``), ``u`` the uniforms of ``rng`` (advanced by ``n``)."""
    return _impl("bingrad_pb_encode", x)(x, bucket, rng)


# -- MultiScale ----------------------------------------------------------------------------------
def multiscale_indices(x: torch.Tensor, scales: torch.Tensor, levels: Sequence[int],
                       bucket: Optional[int]) -> torch.Tensor:
    """MultiScale's per-coordinate scale indices (uint8, Eq. 11) of ``x`` under per-bucket ``scales``."""
    return _impl("multiscale_indices", x)(x, scales, levels, bucket)


def multiscale_encode(x: torch.Tensor, scales: torch.Tensor, index: Optional[torch.Tensor], levels: Sequence[int],
                      bucket: Optional[int], width: int, index_width: int,
                      rng: RngLike, check: bool = True,
                      out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """MultiScale's ``(packed fields, packed indices or None)`` under the shared scales and indices
    (``index=None``: each value's own, computed as it is encoded, with no input-sized temporary).
    ``check=False``: a shared index above this worker's own is not refused (its code saturates), for
    a caller that made the MIN over workers itself; the check is a host read on a GPU. ``out``: a
    contiguous uint8 tensor for the packed fields."""
    return _impl("multiscale_encode", x)(x, scales, index, levels, bucket, width, index_width, rng, check, out)


def multiscale_decode(codes: torch.Tensor, index: Optional[torch.Tensor], scales: torch.Tensor,
                      levels: Sequence[int], bucket: Optional[int], width: int, index_width: int, n: int,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MultiScale's decode: ``(float32(field − s_1) / s_idx)·scale``."""
    return _impl("multiscale_decode", codes)(codes, index, scales, levels, bucket, width, index_width, n, out)


def random_subset(n: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """RandK's and GlobalRandK's shared selection: ``k`` of ``range(n)`` by the smallest random keys,
    sorted int64 on ``device``, the same on every device (:func:`gradq.kernels.reference.random_subset`).
    On the CPU a numba selection; with the Triton backend the indices written from the implicit
    subset (:func:`gradq.kernels.triton_randk_values.subset_indices`: no host read), or where that
    declines a candidate pass on the device (:mod:`gradq.kernels.triton_subset`: one host read);
    elsewhere the reference (torch's ``topk`` on the device)."""
    if k < 0 or k > n:
        raise ValueError(f"cannot choose k={k} coordinates out of n={n}")
    b = backend_for(torch.empty(0, device=device))
    if b == "triton":
        from . import triton_randk_values, triton_subset
        got = triton_randk_values.subset_indices(n, k, seed, device)
        return got if got is not None else triton_subset.random_subset(n, k, seed, device)
    return (subset if b == "numba" else reference).random_subset(n, k, seed, device)


def topk_select(x: torch.Tensor, k: int, index_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K's fields of a float32 vector: ``(x[idx], idx)``, ``idx`` the sorted indices of its ``k``
    largest magnitudes, ties to the lower index, as ``index_dtype`` (int32 or int64), the same on
    every device (:func:`gradq.kernels.reference.topk_indices`). On the CPU a numba selection in
    three passes with no input-sized temporary; with the Triton backend a radix select on the
    device with no host read (:mod:`gradq.kernels.triton_topk`); elsewhere the reference (one
    ``torch.topk`` of ``n`` int64 keys)."""
    n = x.numel()
    if k < 0 or k > n:
        raise ValueError(f"cannot keep k={k} of n={n} coordinates")
    if x.dtype == torch.float32 and index_dtype in (torch.int32, torch.int64) and 0 < k < n:
        b = backend_for(x)
        if b == "numba" and n <= 1 << 32 and x.is_contiguous():
            return subset.topk_select(x, k, index_dtype)
        if b == "triton":
            from . import triton_topk
            if triton_topk.takes(n, k):
                return triton_topk.topk_select(x, k, index_dtype)
    return reference.topk_select(x, k, index_dtype)


def sparse_mean_zero_signs(out: torch.Tensor, idxs: Sequence[torch.Tensor], vals: Sequence[torch.Tensor]) -> None:
    """The sparse mean's signed zeros (:func:`gradq.kernels.reference.sparse_mean_zero_signs`, in
    place in ``out``): with the Triton backend (a GPU) without a host read
    (:func:`~gradq.kernels.reference.sparse_mean_zero_signs_on_device`), elsewhere with one, which
    is free on the CPU and usually finds nothing to do."""
    if backend_for(out) == "triton":
        reference.sparse_mean_zero_signs_on_device(out, idxs, vals)
    else:
        reference.sparse_mean_zero_signs(out, idxs, vals)


def witness_is_finite(t: torch.Tensor) -> bool:
    """False where a small field (a value per bucket: a payload's non-finite witness) may hold NaN
    or Inf; one host read. True is exact; False may also mean finite values whose sum overflows,
    which costs the caller an exact screen.

    A float32/float64 CPU field is summed by NumPy on the calling thread: a torch reduction of more
    than 32K values there starts torch's OpenMP workers, which then spin on the cores that the next
    call's kernels want. On the Triton backend with ``TUNING["witness_path"] = 2`` a kernel tests
    the values' exponent bits (:func:`gradq.kernels.triton_ops.field_is_finite`); elsewhere torch
    sums them."""
    if t.numel() and backend_for(t) == "triton" and _triton().TUNING["witness_path"] == 2:
        return _triton().field_is_finite(t)
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) and t.is_contiguous():
        with np.errstate(over="ignore", invalid="ignore"):   # an overflow is an answer here
            return math.isfinite(float(t.detach().numpy().sum()))
    return math.isfinite(float(t.sum()))


# the CRC-32 of payload fields and Elias-coded QSGD's primitives, and the RandK variants' primitives on
# their subset (modules of their own: the package stays one screen of dispatch per family)
from .elias_ops import crc32_field, elias_decode, elias_encode, elias_fields_stream, elias_stream_fields  # noqa: E402
from .subset_ops import (subset_gather, subset_multiscale_decode, subset_multiscale_encode,  # noqa: E402
                         subset_norm, subset_scatter, subset_uniform_decode, subset_uniform_encode)
