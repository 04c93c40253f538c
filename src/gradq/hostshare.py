"""Ranks that share a machine's cores: find them at the first step, and warn when their thread pools
add up to more threads than the cores they share.

torchrun gives each worker ``OMP_NUM_THREADS=1`` unless the user set it, but ranks started another way
(``torch.multiprocessing.spawn``, a hand-written launcher) start with torch's pool and numba's pool as
wide as the machine, in every rank. On a CPU their pools then contend for the same cores, and a step
can take twice as long or more (measured in ``docs/reliability.md``, "Ranks that spun against each
other").

Which ranks share cores is found with no extra message: each rank writes a key of its machine and CPU
set into its own slot of a vector (:func:`host_slots`) that rides in the first step's settings check,
a MAX all-reduce, so every rank reads every rank's key (:func:`thread_share_warning`). Ranks pinned to
cores of their own (different CPU sets) are not counted together.
"""

from __future__ import annotations

import logging
import os
import sys
import zlib
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__name__)

#: a slot that no rank wrote (keys are CRC-32 values, so never negative)
EMPTY = -1

_WARNED = False


def _cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def host_key() -> int:
    """A key equal for two processes exactly when they run on one machine (one booted kernel: containers on
    a host share it) with the same set of usable CPUs."""
    machine = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            machine = f.read().strip()
    except OSError:
        pass
    if not machine:
        import socket

        machine = socket.gethostname()
    return zlib.crc32(f"{machine}|{_cpus()}".encode("utf-8"))


def host_slots(rank: int, world: int) -> list[int]:
    """``world`` slots holding this process's :func:`host_key` at ``rank`` and :data:`EMPTY` elsewhere:
    after a MAX all-reduce every slot holds its rank's key."""
    slots = [EMPTY] * world
    slots[rank] = host_key()
    return slots


def pool_threads() -> dict[str, int]:
    """The threads of this process's compute pools: torch's intra-op pool and, once loaded, numba's (as
    the calling thread uses it once its pool runs; before, the pool's size, without starting it)."""
    pools = {"torch": torch.get_num_threads()}
    if "numba" in sys.modules:
        import numba
        from numba.np.ufunc import parallel

        started = getattr(parallel, "_is_initialized", True)   # (get_num_threads starts the pool)
        pools["numba"] = int(numba.get_num_threads() if started else numba.config.NUMBA_NUM_THREADS)
    return pools


def thread_share_warning(keys: Sequence[int], rank: int, *, cpus: Optional[int] = None,
                         pools: Optional[dict[str, int]] = None) -> Optional[str]:
    """The warning for ``rank`` given every rank's :func:`host_key` (``keys``), or ``None``.

    A warning is due when more than one rank shares this rank's cores and their pools hold more threads
    than those cores, wider than each rank's share (``cores ÷ ranks``, at least 1): ranks that outnumber
    the cores with one thread each (``gradq train`` emulating more workers than cores) have nothing to
    give back. Only the lowest rank of the ones sharing gives it, so a machine says it once."""
    mine = keys[rank]
    sharing = [r for r, k in enumerate(keys) if k == mine]
    if len(sharing) < 2 or sharing[0] != rank:
        return None
    cpus = len(_cpus()) if cpus is None else cpus
    pools = pool_threads() if pools is None else pools
    widest = max(pools.values())
    share = max(1, cpus // len(sharing))
    if widest <= share:   # (a pool wider than its share makes the ranks' threads outnumber the cores)
        return None
    each = ", ".join(f"{name} {n}" for name, n in pools.items())
    return (f"gradq: {len(sharing)} ranks share the {cpus} CPUs of this machine and each rank's thread pools "
            f"are {widest} wide ({each}): the pools contend for the cores, which can make every step several "
            f"times slower. Give each rank its share: set OMP_NUM_THREADS={share} in the environment before "
            "the ranks start (torchrun does this; with torch.multiprocessing.spawn, set os.environ in the "
            "parent before spawning).")


def warn_once(keys: Sequence[int], rank: int, device: torch.device) -> Optional[str]:
    """Log :func:`thread_share_warning` for ranks that compute on the CPU, once per process; return it."""
    global _WARNED
    if _WARNED or device.type != "cpu":
        return None
    msg = thread_share_warning(keys, rank)
    if msg is not None:
        _WARNED = True
        logger.warning(msg)
    return msg
