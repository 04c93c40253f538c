"""Choosing a protocol, and the hook-free entry point ``gradq.allreduce_`` for custom training loops.

:func:`choose_protocol` is the ``"auto"`` rule shared by the DDP hook and :func:`allreduce_`: the
shared-scale integer all-reduce for summable quantizers while the sum of ``M`` codes fits one byte
(``M·max_code ≤ 127``: wider sums would cost 4 bytes per coordinate on gloo and NCCL, which have no
int16), scatter-reduce/all-gather for fixed-width ones (and for summable ones beyond that bound) (packed codes travel inside the collective at their own width), all-gather for variable-size
payloads (Top-K, Elias/ANS streams), and a local encode/decode when there is one worker.
:func:`average` runs one protocol by name and returns the average and the bytes this worker sent.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..errors import CommunicationError, PayloadError
from ..quantizers.base import Quantizer
from ..factory import build
from . import derive_seed
from .allgather import allgather_mean
from .allreduce import shared_scale_allreduce
from ._util import check_timeout, collective, phase, time_limit
from .ps import parameter_server_mean
from .scatter import scatter_allgather

__all__ = ["PROTOCOLS", "choose_protocol", "average", "allreduce_"]

#: protocols by name (plus "local" for a single worker)
PROTOCOLS = ("allreduce", "scatter", "allgather", "ps")


def choose_protocol(q: Quantizer, world_size: int) -> str:
    """The ``"auto"`` protocol for quantizer ``q`` on ``world_size`` workers (see the module docstring)."""
    if world_size == 1:
        return "local"
    mc = getattr(q, "max_code", None) if q.summable else None
    if q.summable and (mc is None or world_size * int(mc) <= 127):
        return "allreduce"
    if q.field_layout(1024) is not None:
        return "scatter"
    return "allgather"


def average(x: torch.Tensor, q: Quantizer, protocol: str, *, group: Any = None, seed: int,
            name: Optional[str] = None, rank: Optional[int] = None,
            out: Optional[torch.Tensor] = None, info: Optional[dict] = None,
            verify: bool = True, checksum: bool = True, defer_damage: bool = False,
            check_finite: bool = True) -> tuple[torch.Tensor, int]:
    """Average ``x`` over the group through ``protocol``; returns ``(average, bytes this worker sent)``.

    ``"local"`` (one worker) encodes and decodes in place of communicating, so the result carries the
    same quantization error as a multi-worker run; it sends nothing. ``out`` (``x``'s shape and dtype,
    may be ``x``) receives the average and is returned; the scatter protocol decodes straight into it.
    ``info``: a dict that receives the protocol's figures (``encode_s``, ``comm_s``, ``decode_s``…).
    ``verify=False`` skips the protocols' cross-rank check of size and spec (one small all-reduce per
    call) for callers that guarantee them, as the DDP hook does after its first-step check.
    ``checksum`` / ``defer_damage``: the payload CRC-32 trailers of the scatter, all-gather and
    parameter-server protocols (:func:`scatter_allgather`); the integer all-reduce moves no payload.
    ``check_finite=False``: the caller screened ``x`` for NaN/Inf (as :meth:`gradq.Quantizer.encode`)."""
    info = {} if info is None else info
    safe = {"checksum": checksum, "defer_damage": defer_damage, "check_finite": check_finite}
    if out is not None:
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"out= must have x's shape {tuple(x.shape)} and dtype {x.dtype}")
        if protocol == "scatter":
            res = scatter_allgather(x, q, group=group, seed=seed, name=name, info=info, out=out, verify=verify,
                                    **safe)
            return res, int(info["bytes_sent"])
        res, nbytes = average(x, q, protocol, group=group, seed=seed, name=name, rank=rank, info=info,
                              verify=verify, **safe)
        return out.copy_(res.reshape(out.shape)), nbytes
    if protocol == "local":
        r = 0 if rank is None else rank
        ss = derive_seed(seed, None, "shared") if q.needs_shared_seed else None
        with phase(info, "encode"):
            p = q.encode(x, seed=derive_seed(seed, r, "encode"), shared_seed=ss, name=name, check_finite=check_finite)
        with phase(info, "decode"):
            res = q.decode(p, shared_seed=ss)
        return res, 0
    if protocol == "allreduce":
        out = shared_scale_allreduce(x, q, group=group, seed=seed, name=name, info=info, verify=verify,
                                     check_finite=check_finite)
    elif protocol == "scatter":
        out = scatter_allgather(x, q, group=group, seed=seed, name=name, info=info, verify=verify, **safe)
    elif protocol == "allgather":
        out = allgather_mean(x, q, group=group, seed=seed, name=name, info=info, verify=verify, **safe)
    elif protocol == "ps":
        out = parameter_server_mean(x, q, group=group, seed=seed, name=name, info=info, verify=verify, **safe)
        info["bytes_sent"] = info["push_nbytes"]  # what a worker sends; the server's broadcast is extra
    else:
        raise ValueError(f"unknown protocol {protocol!r}; valid: auto, {', '.join(PROTOCOLS)}")
    return out, int(info["bytes_sent"])


def allreduce_(tensors: Union[torch.Tensor, Sequence[torch.Tensor]], quantizer: Union[str, Quantizer], *,
               group: Any = None, protocol: str = "auto", seed: int = 0,
               names: Optional[Sequence[str]] = None, timeout: Optional[float] = 300.0,
               checksum: bool = True) -> dict[str, Any]:
    """Replace every tensor, in place, by its quantized average over the workers of ``group``.

    For custom loops without DDP: call it on the gradients after ``backward()`` on every rank, with the
    same quantizer, protocol and ``seed`` everywhere (vary ``seed`` per step, e.g. the step number, so
    the rounding noise is fresh). Each tensor is quantized on its own (layer-wise schemes see layers);
    ``names`` key per-tensor state such as error-feedback residuals (default ``"0"``, ``"1"``, …).

    ``timeout``: seconds each collective may wait for the other ranks (default 300; ``None``: the
    group's own limit); a rank that died or stalled makes the others raise
    :class:`gradq.CommunicationError` naming the tensor and the collective.

    ``checksum``: payloads carry a CRC-32 trailer; if one arrives damaged on any rank, every rank
    raises :class:`gradq.PayloadError` after the last tensor (one small all-reduce agrees on it), so
    no rank keeps an average the others refuse (the tensors then hold unusable values). A payload
    whose codes no encode writes (found by the decode, with or without checksums) is refused the same
    way; the agreement runs with more than one rank unless the protocol is the integer all-reduce.

    Returns ``{"protocol", "bytes_sent", "numel"}`` for this call.

    >>> # for p in model.parameters(): ...   (after loss.backward())
    >>> # gradq.allreduce_([p.grad for p in model.parameters()], "qsgd:bits=4", seed=step)
    """
    q = build(quantizer)
    ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if names is None:
        names = [str(i) for i in range(len(ts))]
    if len(names) != len(ts):
        raise ValueError(f"{len(names)} names for {len(ts)} tensors")
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and protocol == "auto":
        protocol = choose_protocol(q, world)
    elif world == 1:
        protocol = "local"
    elif protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; valid: auto, {', '.join(PROTOCOLS)}")
    timeout = check_timeout(timeout)
    rank = dist.get_rank(group) if world > 1 else 0
    sent = numel = damaged = 0
    invalid: Any = 0     # payloads with codes no encode writes (an int, or a count on the tensors' device)
    where: list[str] = []
    for t, name in zip(ts, names):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"allreduce_ needs floating-point tensors; {name!r} is "
                            f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
    for t, name in zip(ts, names):
        try:
            with time_limit(group if world > 1 else None, timeout if world > 1 else None):
                info: dict = {}
                _, b = average(t, q, protocol, group=group, seed=derive_seed(seed, None, name), name=name,
                               rank=rank, out=t, info=info, checksum=checksum, defer_damage=True)
                damaged += info.get("damaged", 0)
                invalid = invalid + info.get("invalid", 0)
                where += [f"{name!r}: {w}" for w in info.get("damaged_what", []) + info.get("invalid_what", [])]
        except CommunicationError as exc:
            raise exc.within(f"allreduce_: tensor {name!r}") from exc
        sent += b
        numel += t.numel()
    if world > 1 and protocol != "allreduce":
        # (with or without checksums: a decode that finds codes no encode writes counts them too)
        flag = torch.zeros(2, dtype=torch.int64, device=ts[0].device if ts else None)
        flag[0] = damaged
        flag[1] += invalid
        with time_limit(group, timeout):
            collective("the agreement on damaged payloads", dist.all_reduce, flag, group=group)
        n_damaged, n_invalid = (int(v) for v in flag.tolist())
        if n_damaged or n_invalid:
            mine = f"; on this rank: {', '.join(where[:4])}" if where else ""
            what = (f"{n_damaged} payload(s) arrived damaged (CRC-32 mismatch)" if n_damaged else
                    f"{n_invalid} payload(s) arrived corrupt (codes no encode writes, or bytes that do not decode)")
            raise PayloadError(f"allreduce_: {what}{mine}; the average is refused on every rank")
    return {"protocol": protocol, "bytes_sent": sent, "numel": numel}
