"""All-gather of payloads (ALGORITHMS.md §6, first bullet): works with ANY quantizer.

Every worker encodes its gradient, serializes the payload (:meth:`Payload.to_bytes`), the byte buffers
are all-gathered (zero-padded to the largest, after an exchange of sizes when the quantizer's size is
data-dependent), and every worker decodes all ``M`` payloads and averages them in rank order 0..M−1 —
so every rank computes bit-identical results.

Traffic per worker (ring all-gather of ``B``-byte payloads): sends and receives ``(M−1)·B`` bytes,
``B = payload.nbytes ≈ n·bits/8 + header``; plus ``8(M−1)`` bytes of sizes for variable-length codes.
It grows linearly with ``M``, unlike :func:`scatter_allgather`'s ``≈ 2(M−1)/M · n·bits/8``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..quantizers.base import Quantizer
from ._util import (all_gather_bytes, check_inputs, decode_bytes, mean_in_order, note_damage, phase, raise_if_damaged,
                    seal_bytes, sealed_payload, unseal)

__all__ = ["allgather_mean", "allgather_bytes_per_worker"]


def allgather_bytes_per_worker(payload_nbytes: int, world_size: int) -> int:
    """Bytes one worker sends in the payload all-gather: ``(M−1)·B`` (ring all-gather)."""
    return (world_size - 1) * payload_nbytes


def allgather_mean(x: torch.Tensor, q: Quantizer, *, group: Any = None, seed: int,
                   name: Optional[str] = None, info: Optional[dict] = None,
                   verify: bool = True, checksum: bool = True, defer_damage: bool = False) -> torch.Tensor:
    """Average over the group's workers of ``q.decode(q.encode(x_m))``, identical on every rank.

    Args:
        x: this worker's gradient (any floating dtype and shape; same numel on every rank).
        q: any quantizer (equal spec on every rank); an :class:`ErrorFeedback` keeps its memory under ``name``.
        group: process group (``None`` = the default group).
        seed: base seed common to all ranks; this rank encodes with ``derive_seed(seed, rank, "encode")``
            (and, for ``needs_shared_seed`` schemes, ``shared_seed=derive_seed(seed, None, "shared")``).
        name: the tensor's name (error-feedback key, error messages).
        info: optional dict filled with ``payload_nbytes`` (this rank's), ``bytes_sent`` (the formula)
            and the seconds spent in ``encode_s``, ``comm_s`` and ``decode_s``.
        checksum, defer_damage: a CRC-32 trailer on every payload, as in :func:`scatter_allgather`
            (a damaged payload counts as zeros in the average and the call is refused).
    Returns:
        a tensor of ``x``'s shape and dtype.
    """
    from . import derive_seed

    rank, world = check_inputs("allgather_mean", x, q, group, verify=verify)
    shared_seed = derive_seed(seed, None, "shared") if q.needs_shared_seed else None
    info = {} if info is None else info
    trailer = seal_bytes(x.device, checksum)
    with phase(info, "encode"):
        buf = sealed_payload(q.encode(x, seed=derive_seed(seed, rank, "encode"), shared_seed=shared_seed,
                                      name=name), trailer)
    fixed = q.expected_nbytes(x.numel())
    with phase(info, "comm"):
        bufs = all_gather_bytes(buf, None if fixed is None else fixed + trailer, group)
    with phase(info, "decode"):
        parts = []
        for m, sealed in enumerate(bufs):
            body, ok = unseal(sealed, trailer)
            if not ok:
                note_damage(info, f"payload from rank {m}")
            parts.append(decode_bytes(q, body, x.shape, x.dtype) if ok else x.new_zeros(x.shape))
        out = mean_in_order(parts).reshape(x.shape).to(x.dtype)
    info.update(payload_nbytes=int(buf.numel()),
                bytes_sent=allgather_bytes_per_worker(max(b.numel() for b in bufs), world))
    raise_if_damaged("allgather_mean", info, defer_damage)
    return out
