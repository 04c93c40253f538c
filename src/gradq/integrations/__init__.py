"""gradq inside training frameworks: PyTorch Lightning, Hugging Face Accelerate and Transformers' Trainer.

Each framework is imported only by its own submodule, so gradq never depends on one:

* :mod:`gradq.integrations.lightning` — :class:`~gradq.integrations.lightning.GradqCallback`, a
  Lightning callback that registers gradq on the DDP model of any ``DDPStrategy`` (on CPU/gloo too,
  where ``DDPStrategy(ddp_comm_hook=...)`` is silently ignored), logs the hook's statistics with
  ``self.log`` and keeps gradq's state in Lightning's checkpoints.
* :mod:`gradq.integrations.accelerate` — :func:`~gradq.integrations.accelerate.register` for a model
  returned by ``accelerator.prepare`` (``DistributedDataParallelKwargs(comm_hook=...)`` accepts only
  PyTorch's built-in hooks), joining ``accelerator.save_state``/``load_state``, and
  :func:`~gradq.integrations.accelerate.log_stats` for Accelerate's trackers.
* :mod:`gradq.integrations.transformers` — :func:`~gradq.integrations.transformers.register` adds a
  ``Trainer`` callback that registers gradq once the Trainer has built DDP, writes gradq's state into
  every ``checkpoint-N`` folder, restores it on resume, and puts the hook's figures in the logs.

Runnable scripts for each: ``examples/`` (``torchrun --nproc_per_node 2 examples/lightning_ddp.py``).

Shared pieces, here: :class:`RankStates` (a checkpoint that one process writes must hold every rank's
gradq state, because error-feedback residuals differ per rank) and :func:`step_metrics` (the per-step
figures these users plot).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ..comm import lifecycle
from ..ddp import GradqState

__all__ = ["RankStates", "step_metrics", "find_ddp", "FORMAT"]

lifecycle.before_init()   # the frameworks create the process group after this import: see gradq.comm.lifecycle

#: the checkpoint format of :meth:`RankStates.state_dict`
FORMAT = "gradq-rank-states/1"
#: the figures :func:`step_metrics` reports, from ``GradqState.last_stats``
_METRICS = ("bits_per_coord", "bytes_sent", "encode_seconds", "comm_seconds", "decode_seconds", "wait_seconds",
            "rel_error")


def find_ddp(model: Any) -> Optional[torch.nn.parallel.DistributedDataParallel]:
    """The :class:`~torch.nn.parallel.DistributedDataParallel` module ``model`` is or wraps (through
    ``.module`` attributes, as frameworks wrap), or ``None``."""
    seen = 0
    while model is not None and seen < 8:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        model = getattr(model, "module", None)
        seen += 1
    return None


class RankStates:
    """Checkpoint adapter for a :class:`~gradq.ddp.GradqState` in a framework where one process writes
    the checkpoint: :meth:`state_dict` gathers every rank's state (a collective: every rank must call
    it, as Lightning and Accelerate do), :meth:`load_state_dict` restores this rank's.

    Args:
        state: this rank's gradq state, or ``None`` until the hook is registered; a state loaded before
            then is kept and applied by :meth:`attach`.
        group: the process group (default: the default group).
    """

    def __init__(self, state: Optional[GradqState] = None, group: Any = None) -> None:
        self.state = state
        self.group = group
        self._pending: Optional[dict[str, Any]] = None

    def _rank_world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.group), dist.get_world_size(self.group)
        return 0, 1

    def state_dict(self) -> dict[str, Any]:
        """``{"format", "world_size", "ranks": [rank 0's state_dict, …]}`` (empty ``ranks`` before the
        hook exists)."""
        rank, world = self._rank_world()
        mine = None if self.state is None else self.state.state_dict()
        if world > 1:
            every: list[Any] = [None] * world
            dist.all_gather_object(every, mine, group=self.group)
        else:
            every = [mine]
        if any(s is None for s in every):
            every = []
        return {"format": FORMAT, "world_size": world, "ranks": every}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore this rank's entry of a :meth:`state_dict` (now, or at :meth:`attach`).

        Raises:
            ValueError: not this format, or written by another number of ranks (residuals are per rank).
        """
        if not isinstance(saved, Mapping) or saved.get("format") != FORMAT:
            raise ValueError(f"not a gradq checkpoint entry (format {FORMAT!r})")
        rank, world = self._rank_world()
        ranks = list(saved.get("ranks") or [])
        if not ranks:
            return   # saved before the hook existed: nothing to restore
        if len(ranks) != world:
            raise ValueError(f"the gradq state was saved by {len(ranks)} ranks and is loaded by {world}; "
                             "error-feedback residuals and steps are per rank, so resume with the same world size")
        self._pending = dict(ranks[rank])
        if self.state is not None:
            self.attach(self.state)

    def attach(self, state: GradqState) -> None:
        """Use ``state`` from now on, restoring a state loaded earlier into it."""
        self.state = state
        if self._pending is not None:
            pending, self._pending = self._pending, None
            state.load_state_dict(pending)


def step_metrics(state: GradqState, prefix: str = "gradq/") -> dict[str, float]:
    """The last step's figures as floats, keyed ``prefix + name``: bits per coordinate, bytes sent,
    encode / communicate / decode / wait seconds, ``rel_error`` when measured, and the total steps.
    Empty before the first step."""
    last = state.last_stats
    if not last:
        return {}
    out = {prefix + k: float(last[k]) for k in _METRICS if isinstance(last.get(k), (int, float))
           and not isinstance(last.get(k), bool)}
    out[prefix + "step"] = float(state.step)
    return out
