"""Shared-scale integer all-reduce (ALGORITHMS.md §6, second bullet): summable quantizers only.

Steps, for ``M`` workers holding ``g^m``:

1. every worker computes ``q.shared_stats(g^m)``; each stat is all-reduced with its op
   (``max`` → ``ReduceOp.MAX``, e.g. the scale ``w = max_m ‖g^m‖``; ``min`` → ``MIN``, e.g. the
   multiscale indices ``s_i* = min_m s_i*^m``; ``sum`` → ``SUM``);
2. every worker encodes integer codes ``c^m = q.encode_codes(g^m, shared=reduced)``, ``|c^m_i| ≤ s``;
3. the codes are SUM all-reduced in the narrowest integer dtype that cannot overflow for ``M·s``
   (:func:`code_dtype`: int8 only when ``M·s ≤ 127``) — float casts (``none``/``fp16``/``bf16``, whose
   ``max_code`` is ``None``) are summed in their own dtype;
4. ``q.decode_codes(Σ_m c^m, shared=reduced, count=M)`` is the average of the workers' decodes
   (e.g. QSGDMaxNorm: ``w·Σ_m c^m/(s·M)``, paper 002 §3.1).

Fast path (MaxNorm, TernGrad on CPU): the codes come from the fused kernel as uint8 *fields*
``c + s`` (:meth:`SummableQuantizer.encode_fields`, the same codes); the SUM of ``M`` workers' fields is
``Σc + M·s`` and is sent as uint8 when ``2·M·s ≤ 255`` (the same bound as int8 codes, ``M·s ≤ 127``),
otherwise widened; the decode of the sum subtracts ``M·s`` and scales per bucket in one kernel pass.
The average then differs from ``decode_codes``'s by float rounding only (``Σc·w/(M·s)`` in one product).

Backend note (measured with torch 2.13): gloo's ``all_reduce`` accepts int8, uint8, int32, int64,
float16, bfloat16, float32 but rejects int16 ("Invalid scalar type"); NCCL has no int16 type either.
So on gloo and NCCL an int16 choice is sent as int32 (:func:`reduce_dtype`); the pure rule
:func:`code_dtype` still reports int16.

Traffic per worker (ring all-reduce of ``n`` codes of ``b`` bytes): ``2(M−1)/M · n·b`` bytes, plus the
same formula for the (small) shared stats. A vector of at most ``SMALL_SUM_BYTES / M`` bytes (the
stats, the codes of a small tensor) goes through one all-to-all instead and is combined locally
(:func:`gradq.comm._util.reduce_over_ranks`: one round instead of ``2(M−1)``, for ``(M−1)·n·b``
bytes); ``info["bytes_sent"]`` counts what was really sent.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..quantizers.base import Quantizer
from ._util import check_inputs, phase, reduce_over_ranks

__all__ = ["shared_scale_allreduce", "code_dtype", "reduce_dtype", "allreduce_bytes_per_worker"]

_OPS = ("max", "min", "sum")
#: dtypes a backend's all_reduce cannot take, and what to send instead
_PROMOTE = {"gloo": {torch.int16: torch.int32}, "nccl": {torch.int16: torch.int32}}


def code_dtype(world_size: int, max_code: int) -> torch.dtype:
    """The narrowest signed integer dtype holding any sum of ``world_size`` codes in ``[−s, s]``:
    int8 when ``M·s ≤ 127``, int16 when ``≤ 32767``, int32 when ``≤ 2³¹−1``, else int64."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(max_code, bool) or not isinstance(max_code, int) or max_code < 0:
        raise ValueError(f"max_code must be a non-negative int, got {max_code!r}")
    bound = world_size * max_code
    for dt in (torch.int8, torch.int16, torch.int32):
        if bound <= torch.iinfo(dt).max:
            return dt
    if bound <= torch.iinfo(torch.int64).max:
        return torch.int64
    raise OverflowError(f"{world_size}·{max_code} exceeds int64")


def reduce_dtype(dtype: torch.dtype, backend: str) -> torch.dtype:
    """``dtype``, or the next wider one where ``backend``'s all_reduce does not support it
    (int16 → int32 on gloo and NCCL)."""
    name = str(backend).lower()  # "gloo", "nccl", or a device-qualified spelling such as "cuda:gloo"
    for key, table in _PROMOTE.items():
        if key in name:
            return table.get(dtype, dtype)
    return dtype


def allreduce_bytes_per_worker(numel: int, world_size: int, dtype: torch.dtype) -> int:
    """Bytes one worker sends in a ring all-reduce of ``numel`` values of ``dtype``:
    ``2(M−1)/M · numel · itemsize`` (rounded down)."""
    item = torch.empty((), dtype=dtype).element_size()
    return (2 * (world_size - 1) * numel * item) // world_size


def shared_scale_allreduce(x: torch.Tensor, q: Quantizer, *, group: Any = None, seed: int,
                           shared_seed: Optional[int] = None, name: Optional[str] = None,
                           info: Optional[dict] = None, verify: bool = True) -> torch.Tensor:
    """Average over workers of the decoded gradients via an integer SUM all-reduce (module docstring).

    Args:
        x: this worker's gradient (any floating dtype/shape, same numel on every rank).
        q: a summable quantizer (``q.summable``), possibly wrapped in error feedback.
        group: process group (``None`` = default).
        seed: base seed common to all ranks; codes use ``derive_seed(seed, rank, "encode")``.
        shared_seed: seed common to all ranks for ``needs_shared_seed`` schemes (Rand-K coordinates);
            default ``derive_seed(seed, None, "shared")``. Checked to be equal on all ranks.
        name: tensor name (error-feedback key).
        info: optional dict filled with ``code_dtype`` (the rule), ``wire_dtype`` (what was sent) and
            ``bytes_sent`` (:func:`allreduce_bytes_per_worker` for the codes).
    Raises:
        TypeError: ``q`` is not summable (use :func:`allgather_mean` or :func:`scatter_allgather`).
    """
    from . import derive_seed

    if not getattr(q, "summable", False):
        raise TypeError(f"shared_scale_allreduce (shared-scale integer all-reduce) needs a summable "
                        f"quantizer; {getattr(q, 'spec', q)!r} is not (its codes cannot be added across "
                        "workers). Use gradq.comm.allgather_mean or gradq.comm.scatter_allgather instead.")
    if q.needs_shared_seed and shared_seed is None:
        shared_seed = derive_seed(seed, None, "shared")
    extra = [] if shared_seed is None else [int(shared_seed) & ((1 << 63) - 1)]
    rank, world = check_inputs("shared_scale_allreduce", x, q, group, extra, verify=verify)
    backend = dist.get_backend(group)

    with phase(info, "encode"):
        stats = q.shared_stats(x, shared_seed=shared_seed, name=name)
    reduced: dict[str, torch.Tensor] = {}
    sent = 0
    for key in sorted(stats):
        value, op = stats[key]
        if op not in _OPS:
            raise ValueError(f"{q.spec}: shared stat {key!r} has unknown reduction {op!r}")
        wire = reduce_dtype(value.dtype, backend)
        t = value.detach().to(wire).contiguous().clone()
        with phase(info, "comm"):
            if t.numel():
                t, b = reduce_over_ranks(t, group, op=op, what=f"the all-reduce of the shared statistic {key!r}")
                sent += b
        reduced[key] = t.to(value.dtype)

    max_code = q.max_code  # type: ignore[attr-defined]
    seed_r = derive_seed(seed, rank, "encode")
    fields = None
    with phase(info, "encode"):
        if max_code is not None and hasattr(q, "encode_fields"):
            fields = q.encode_fields(x, shared=reduced, seed=seed_r, shared_seed=shared_seed, name=name)
    if fields is not None:
        # fast path: one byte c + s per coordinate from the fused kernel; Σ_m fields fits uint8 when 2Ms ≤ 255
        rule = code_dtype(world, int(max_code))
        wide = 2 * world * int(max_code) > 255
        wire = reduce_dtype(code_dtype(world, 2 * int(max_code)), backend) if wide else torch.uint8
        total = fields.to(wire) if wide else fields
        with phase(info, "comm"):
            if total.numel():
                total, b = reduce_over_ranks(total, group, what="the integer all-reduce of the codes")
                sent += b
        with phase(info, "decode"):
            out = q.decode_field_sum(total, shared=reduced, count=world, like=x)
    else:
        with phase(info, "encode"):
            codes = q.encode_codes(x, shared=reduced, seed=seed_r,  # type: ignore[attr-defined]
                                   shared_seed=shared_seed, name=name)
        rule = codes.dtype if max_code is None else code_dtype(world, int(max_code))
        wire = reduce_dtype(rule, backend)
        total = codes.to(wire).contiguous()
        with phase(info, "comm"):
            if total.numel():
                total, b = reduce_over_ranks(total, group, what="the integer all-reduce of the codes")
                sent += b
        with phase(info, "decode"):
            out = q.decode_codes(total, shared=reduced, count=world, like=x,  # type: ignore[attr-defined]
                                 shared_seed=shared_seed)
    if info is not None:
        info.update(code_dtype=rule, wire_dtype=wire, bytes_sent=sent)
    return out
