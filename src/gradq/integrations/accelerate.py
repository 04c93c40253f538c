"""gradq in Hugging Face Accelerate: register on the prepared model, checkpoint with the accelerator.

    from accelerate import Accelerator
    from gradq.integrations.accelerate import register, log_stats

    accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = register(accelerator, model, "qsgd:bits=4,bucket=512")   # before load_state on a resume
    ...
    accelerator.backward(loss); opt.step(); log_stats(accelerator, state, step=i)
    accelerator.save_state("ckpt")      # gradq's state goes with it; load_state("ckpt") restores it

``DistributedDataParallelKwargs(comm_hook=...)`` accepts only PyTorch's built-in hooks (fp16, bf16,
PowerSGD), so a custom hook is registered on the model ``prepare`` returned. :func:`register` does that
and adds every rank's gradq state to the accelerator's checkpoint
(``accelerator.register_for_checkpointing``): ``save_state`` writes it, ``load_state`` restores it.
Register in the same order on a resumed run (Accelerate matches custom objects by position).

Needs ``accelerate``; imported only by this module.
"""

from __future__ import annotations

from typing import Any, Optional

from ..ddp import GradqState
from ..ddp import register as _register
from . import RankStates, find_ddp, step_metrics

__all__ = ["register", "log_stats"]


def register(accelerator: Any, model: Any, spec: Any, **register_kw: Any) -> Optional[GradqState]:
    """Register gradq on ``model`` (as returned by ``accelerator.prepare``) and join its checkpoints.

    Returns the hook's :class:`~gradq.ddp.GradqState`, or ``None`` with one process (the model is not
    wrapped in DDP: nothing is communicated). ``register_kw`` are :func:`gradq.register`'s.

    Raises:
        TypeError: several processes but the model is not DDP (e.g. FSDP or DeepSpeed prepared it).
    """
    ddp = find_ddp(model)
    if ddp is None:
        if getattr(accelerator, "num_processes", 1) > 1:
            raise TypeError(f"gradq.integrations.accelerate.register needs a model prepared with DDP; got "
                            f"{type(model).__name__} (FSDP and DeepSpeed do not run DDP communication hooks)")
        return None
    state = _register(ddp, spec, **register_kw)
    accelerator.register_for_checkpointing(RankStates(state, state.process_group))
    return state


def log_stats(accelerator: Any, state: Optional[GradqState], step: Optional[int] = None,
              prefix: str = "gradq/") -> dict[str, float]:
    """Send the last step's figures (:func:`gradq.integrations.step_metrics`) to the accelerator's
    trackers (``accelerator.log``; only the main process writes) and return them."""
    metrics = {} if state is None else step_metrics(state, prefix)
    if metrics:
        accelerator.log(metrics, step=step)
    return metrics
