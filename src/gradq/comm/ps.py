"""Parameter server (docs/algorithms.md, fourth bullet; [TernGrad], [OptQuant]), synchronous variant.

Every rank of the group is a worker (the server too): each encodes its gradient, the payloads are
gathered at rank ``server`` (zero-padded to the largest after a gather of sizes when the size is
data-dependent), the server decodes them and averages in rank order 0..M−1, and broadcasts the average
— in float32 (``requantize=False``), or re-encoded with ``q`` (without its error feedback; seed
``derive_seed(seed, server, "server")``), which every rank, the server included, decodes from the
broadcast bytes. Either way every rank ends with identical values.

Traffic: each worker pushes ``B = payload.nbytes ≈ n·bits/8 + header`` bytes; the server receives
``(M−1)·B`` and sends the average to each worker: ``4n`` bytes in float32, or ``B'`` re-encoded
(a tree/ring broadcast spreads that sending over the workers; a star sends ``(M−1)·4n``).
The asynchronous variant (stale parameters) is a training-loop concern and is not implemented here.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..quantizers.base import Quantizer
from ._util import (check_inputs, collective, decode_bytes, decoded_or_zeros, mean_in_order, note_damage, phase, plain,
                    raise_if_damaged, refused_later, seal_bytes, sealed_payload, unseal)

__all__ = ["parameter_server_mean"]


def _global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def parameter_server_mean(x: torch.Tensor, q: Quantizer, *, group: Any = None, seed: int, server: int = 0,
                          requantize: bool = False, name: Optional[str] = None,
                          info: Optional[dict] = None, verify: bool = True, checksum: bool = True,
                          defer_damage: bool = False, check_finite: bool = True) -> torch.Tensor:
    """Average over workers of the decoded gradients, computed at ``server`` and broadcast.

    Args:
        x: this worker's gradient (any floating dtype/shape, same numel on every rank).
        q: any quantizer (equal on every rank); an ErrorFeedback ``q`` keeps its memory under ``name``.
        group: process group (``None`` = default); ``server`` is a rank in this group.
        seed: base seed common to all ranks; this rank encodes with ``derive_seed(seed, rank, "encode")``.
        requantize: broadcast the average re-encoded by ``q`` instead of in float32.
        name: tensor name (error-feedback key).
        info: optional dict filled with ``push_nbytes`` and ``pull_nbytes`` (per worker).
        checksum, defer_damage: a CRC-32 trailer on every payload pushed (and on the re-encoded average
            pulled), as in :func:`gradq.comm.scatter_allgather`; the float32 average carries none.
        check_finite: ``False`` where the caller screened ``x`` for NaN/Inf itself (the DDP hook):
            the encodes skip their own check where the scheme allows it (see
            :meth:`gradq.Quantizer.encode`), which on a GPU saves a host read per payload.
    Returns:
        a tensor of ``x``'s shape and dtype.
    """
    from . import derive_seed

    rank, world = check_inputs("parameter_server_mean", x, q, group, [server, int(bool(requantize))],
                               verify=verify)
    if not 0 <= server < world:
        raise ValueError(f"parameter_server_mean: server={server} is not a rank of a group of {world}")
    src = _global(group, server)
    dev = x.device
    shared_seed = derive_seed(seed, None, "shared") if q.needs_shared_seed else None
    info = {} if info is None else info
    trailer = seal_bytes(dev, checksum)
    with phase(info, "encode"):
        buf = sealed_payload(q.encode(x, seed=derive_seed(seed, rank, "encode"), shared_seed=shared_seed,
                                      name=name, check_finite=check_finite), trailer)
    t_comm = time.perf_counter()

    fixed = q.expected_nbytes(x.numel())
    fixed = None if fixed is None else fixed + trailer
    if fixed is not None:
        if buf.numel() != fixed:
            raise RuntimeError(f"{q.spec}: payload has {buf.numel()} bytes, promised {fixed}")
        sizes, width = [fixed] * world, fixed
    else:
        n_t = torch.tensor([buf.numel()], dtype=torch.int64, device=dev)
        got = [torch.empty_like(n_t) for _ in range(world)] if rank == server else None
        collective("the gather of the payload sizes at the server", dist.gather, n_t, got, dst=src, group=group)
        # only the server knows the sizes; workers pad to their own (the server pads nothing it receives)
        sizes = [int(t) for t in torch.cat(got).tolist()] if got is not None else []
        w_t = torch.tensor([max(sizes) if sizes else 0], dtype=torch.int64, device=dev)
        collective("the broadcast of the payload width", dist.broadcast, w_t, src=src, group=group)
        width = int(w_t)
    send = buf if buf.numel() == width else torch.cat([buf, buf.new_zeros(width - buf.numel())])
    recv = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(world)] if rank == server else None
    collective("the gather of the payloads at the server", dist.gather, send, recv, dst=src, group=group)

    q2 = plain(q)
    if rank == server:
        parts = []
        with refused_later(info):   # (corrupt codes: refused with the damaged payloads, after the broadcast)
            for m, (b, sz) in enumerate(zip(recv, sizes)):
                body, ok = unseal(b[:sz], trailer)
                if not ok:
                    note_damage(info, f"payload pushed by rank {m}")
                parts.append(decoded_or_zeros(info, lambda body=body: decode_bytes(q, body, x.shape, x.dtype,
                                                                                   shared_seed),
                                              lambda: x.new_zeros(x.shape), f"payload pushed by rank {m}")
                             if ok else x.new_zeros(x.shape))
        avg = mean_in_order(parts)
    if not requantize:
        out = avg if rank == server else torch.empty(x.numel(), dtype=torch.float32, device=dev)
        collective("the broadcast of the average", dist.broadcast, out, src=src, group=group)
        pull = 4 * x.numel()
    else:
        fixed2 = q2.expected_nbytes(x.numel())
        fixed2 = None if fixed2 is None else fixed2 + trailer
        if rank == server:
            b2 = sealed_payload(q2.encode(avg.reshape(x.shape), seed=derive_seed(seed, server, "server")), trailer)
        if fixed2 is None:
            size = torch.tensor([b2.numel() if rank == server else 0], dtype=torch.int64, device=dev)
            collective("the broadcast of the average's size", dist.broadcast, size, src=src, group=group)
            fixed2 = int(size)
        if rank != server:
            b2 = torch.empty(fixed2, dtype=torch.uint8, device=dev)
        collective("the broadcast of the re-encoded average", dist.broadcast, b2, src=src, group=group)
        body, ok = unseal(b2, trailer)
        if not ok:
            note_damage(info, "the re-encoded average from the server")
        with refused_later(info):
            zeros = lambda: x.new_zeros(x.shape).reshape(-1)  # noqa: E731
            ss2 = q2.implied_shared_seed(derive_seed(seed, server, "server")) if q2.needs_shared_seed else None
            out = decoded_or_zeros(info, lambda: decode_bytes(q2, body, x.shape, x.dtype, ss2), zeros,
                                   "the re-encoded average from the server") if ok else zeros()
        pull = fixed2
    # the server's decode and re-encode count as waiting for the others
    info["comm_s"] = info.get("comm_s", 0.0) + time.perf_counter() - t_comm
    info.update(push_nbytes=int(buf.numel()), pull_nbytes=int(pull))
    raise_if_damaged("parameter_server_mean", info, defer_damage)
    return out.reshape(x.shape).to(x.dtype)
