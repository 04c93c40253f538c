"""Protocols that move quantized gradients between ``M`` workers over ``torch.distributed``.

A quantizer never touches the network; these functions do. Each takes a flat (or any-shaped) floating
tensor ``x`` holding this worker's gradient, a quantizer ``q`` (equal on every rank) and a process group,
and returns, on every rank, the same tensor: the AVERAGE over workers of the decoded gradients
(docs/algorithms.md):

* :func:`allgather_mean` — any quantizer; payloads all-gathered, every rank decodes all ``M``.
* :func:`shared_scale_allreduce` — summable quantizers; integer codes summed inside an all-reduce.
* :func:`scatter_allgather` — any quantizer; chunked all-to-all, per-chunk average, re-encode, all-gather.
* :func:`parameter_server_mean` — gather at a server, average, broadcast (full precision or re-encoded).

Randomness: every encode draws its seed from :func:`derive_seed` applied to one base ``seed`` that all
ranks pass (e.g. the training step mixed with a run seed). Per-rank randomness uses the rank; randomness
that must be common to all ranks (Rand-K coordinates) uses ``rank=None``. Nothing is recorded globally.
"""

from __future__ import annotations

import zlib
from typing import Optional, Union

__all__ = ["derive_seed", "allreduce_", "choose_protocol", "average", "PROTOCOLS", "allgather_mean", "shared_scale_allreduce", "code_dtype", "reduce_dtype",
           "allreduce_bytes_per_worker", "scatter_allgather", "parameter_server_mean"]

_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def derive_seed(seed: int, rank: Optional[int], tag: Union[int, str]) -> int:
    """A 63-bit seed for one encode, a pure function of ``(seed, rank, tag)``.

    ``rank=None`` gives the seed *shared* by all ranks (e.g. the Rand-K coordinates); an integer rank
    gives that rank's independent stream. ``tag`` (an int or a string) separates the encodes of one
    call (e.g. ``"encode"``, ``"chunk3"``). Different inputs give unrelated seeds (SplitMix64 chain).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"rank must be a non-negative int or None (shared), got {rank!r}")
    t = zlib.crc32(tag.encode("utf-8")) | (1 << 40) if isinstance(tag, str) else int(tag) & _M64
    h = _splitmix64(seed & _M64)
    h = _splitmix64(h ^ (0xA5A5_5A5A_0000_0001 if rank is None else (rank + 2)))
    h = _splitmix64(h ^ t)
    return h & ((1 << 63) - 1)


from .allgather import allgather_mean  # noqa: E402
from .allreduce import allreduce_bytes_per_worker, code_dtype, reduce_dtype, shared_scale_allreduce  # noqa: E402
from .scatter import scatter_allgather  # noqa: E402
from .ps import parameter_server_mean  # noqa: E402
from .api import PROTOCOLS, allreduce_, average, choose_protocol  # noqa: E402
