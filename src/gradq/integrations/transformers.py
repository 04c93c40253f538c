"""gradq in the Hugging Face Transformers ``Trainer``: a callback registered after the Trainer builds DDP.

    from transformers import Trainer, TrainingArguments
    from gradq.integrations.transformers import register

    trainer = Trainer(model=model, args=TrainingArguments(..., ddp_backend="gloo"), train_dataset=ds)
    register(trainer, "qsgd:bits=4,bucket=512")
    trainer.train()                                   # or trainer.train(resume_from_checkpoint=...)

The Trainer wraps the model in DDP itself, when training starts, so the hook can only be registered
then: the callback does it at ``on_train_begin``. It writes every rank's gradq state (step, seed,
error-feedback residuals) as ``gradq_state.pt`` into each ``checkpoint-N`` folder, restores it when
training resumes from such a folder (a resumed run without it raises, unless ``strict=False``: error
feedback would silently restart), and adds the hook's figures (``gradq/bits_per_coord``,
``gradq/bytes_sent``…) to every ``logs`` dict, so the Trainer's reporting callbacks (TensorBoard, W&B…)
receive them. :func:`register` puts the callback first, so the reporters see those figures, and
notes the checkpoint that ``trainer.train`` resumes from.

Needs ``transformers``; imported only by this module.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

import torch
from transformers import TrainerCallback

from ..ddp import GradqState
from ..ddp import register as _register
from . import RankStates, find_ddp, step_metrics

__all__ = ["register", "GradqTrainerCallback", "STATE_FILE"]

#: the file each checkpoint folder gets
STATE_FILE = "gradq_state.pt"


class GradqTrainerCallback(TrainerCallback):
    """The callback :func:`register` adds (see the module docstring).

    Args:
        trainer: the ``Trainer`` whose DDP model gets the hook.
        spec: a gradq spec or quantizer.
        strict: raise when a resumed run's checkpoint has no gradq state (default True).
        **register_kw: :func:`gradq.register`'s keyword arguments.
    """

    def __init__(self, trainer: Any, spec: Any, *, strict: bool = True, **register_kw: Any) -> None:
        self.trainer = trainer
        self.spec = spec
        self.strict = bool(strict)
        self.register_kw = register_kw
        self.state: Optional[GradqState] = None
        self.resume_dir: Optional[str] = None
        self._ranks = RankStates()

    def resume_from(self, checkpoint: Any) -> None:
        """Note the checkpoint ``trainer.train(resume_from_checkpoint=checkpoint)`` resumes from."""
        if checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            checkpoint = get_last_checkpoint(self.trainer.args.output_dir)
        self.resume_dir = str(checkpoint) if checkpoint else None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.state is None:
            ddp = find_ddp(self.trainer.model_wrapped)
            if ddp is None:
                if args.world_size > 1:
                    raise TypeError("gradq needs the Trainer to run DDP; this one wraps the model in "
                                    f"{type(self.trainer.model_wrapped).__name__} (FSDP and DeepSpeed run no DDP hook)")
                return   # one process: nothing is communicated
            self.state = _register(ddp, self.spec, **self.register_kw)
            self._ranks.group = self.state.process_group
            self._ranks.attach(self.state)
        if state.global_step > 0:   # resumed
            folder = self.resume_dir or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            path = os.path.join(folder, STATE_FILE)
            if os.path.exists(path):
                self._ranks.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
            elif self.strict:
                raise FileNotFoundError(f"resuming at step {state.global_step} but {path} does not exist: gradq's "
                                        "state (error-feedback residuals, step) would restart; pass strict=False "
                                        "to register() to accept that")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.state is None:
            return
        saved = self._ranks.state_dict()   # a collective: the Trainer calls on_save on every rank
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(saved, os.path.join(folder, STATE_FILE))

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
        if logs is not None and self.state is not None:
            logs.update(step_metrics(self.state))


def register(trainer: Any, spec: Any, *, strict: bool = True, **register_kw: Any) -> GradqTrainerCallback:
    """Add gradq to ``trainer`` (before ``trainer.train()``); returns the callback, whose ``state`` is
    the hook's :class:`~gradq.ddp.GradqState` once training starts. ``register_kw`` are
    :func:`gradq.register`'s."""
    cb = GradqTrainerCallback(trainer, spec, strict=strict, **register_kw)
    trainer.callback_handler.callbacks.insert(0, cb)   # before the reporters: they see gradq's figures
    train = trainer.train

    @functools.wraps(train)
    def train_noting_resume(resume_from_checkpoint: Any = None, *args: Any, **kw: Any) -> Any:
        cb.resume_from(resume_from_checkpoint)
        return train(resume_from_checkpoint, *args, **kw)

    trainer.train = train_noting_resume
    return cb
