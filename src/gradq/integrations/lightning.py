"""gradq in PyTorch Lightning: a callback for any ``DDPStrategy``, on CPU and GPU alike.

    import lightning.pytorch as pl
    from gradq.integrations.lightning import GradqCallback

    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2,
                         callbacks=[GradqCallback("qsgd:bits=4,bucket=512")])
    trainer.fit(model)                  # resume: trainer.fit(model, ckpt_path=...) restores gradq too

Why a callback and not ``DDPStrategy(ddp_comm_hook=...)``: Lightning registers that hook only when the
strategy runs on CUDA, so on CPU/gloo it is silently dropped; and it knows nothing of gradq's state.
The callback registers :func:`gradq.register` on the strategy's DDP model when fitting starts (the
model is wrapped by then), logs the hook's figures every optimizer step with ``pl_module.log_dict``
(``gradq/bits_per_coord``, ``gradq/bytes_sent``, ``gradq/encode_seconds``…, to whatever logger the
trainer has), and keeps every rank's gradq state (step, seed, error-feedback residuals) in the
checkpoint under the callback's state, so a resumed fit continues bit for bit.

Needs ``lightning`` (``pip install lightning``); imported only by this module.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl

from ..ddp import GradqState, register
from . import RankStates, find_ddp, step_metrics

__all__ = ["GradqCallback"]


class GradqCallback(pl.Callback):
    """Register gradq on the DDP model of the trainer's strategy, log its figures, checkpoint its state.

    Args:
        spec: a gradq spec or quantizer (as for :func:`gradq.register`).
        log: log the per-step figures with ``pl_module.log_dict`` (default True).
        prog_bar: also show bits per coordinate in the progress bar (default False).
        **register_kw: :func:`gradq.register`'s keyword arguments (``strategy``, ``seed``, ``min_numel``,
            ``adaptive``…).

    Attributes:
        state: the hook's :class:`~gradq.ddp.GradqState` once fitting started (``None`` before, or
            when the trainer runs a single process: there is no gradient averaging to compress).
    """

    def __init__(self, spec: Any, *, log: bool = True, prog_bar: bool = False, **register_kw: Any) -> None:
        super().__init__()
        self.spec = spec
        self.log = bool(log)
        self.prog_bar = bool(prog_bar)
        self.register_kw = register_kw
        self.state: Optional[GradqState] = None
        self._ranks = RankStates()
        self._logged_step = -1

    @property
    def state_key(self) -> str:
        return f"GradqCallback[{getattr(self.spec, 'spec', self.spec)}]"

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.state is not None:
            return
        ddp = find_ddp(trainer.strategy.model)
        if ddp is None:
            if trainer.world_size > 1:
                raise TypeError(f"GradqCallback needs a DDP strategy (strategy='ddp' or DDPStrategy(...)); this "
                                f"trainer's {type(trainer.strategy).__name__} does not average gradients with DDP")
            return   # one process: nothing is communicated
        self.state = register(ddp, self.spec, **self.register_kw)
        self._ranks.group = self.state.process_group
        self._ranks.attach(self.state)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if not self.log or self.state is None or self.state.step == self._logged_step:
            return   # no hook, or no averaging since the last log (gradient accumulation)
        self._logged_step = self.state.step
        metrics = step_metrics(self.state)
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, logger=True, prog_bar=False,
                               sync_dist=False, batch_size=1)
            if self.prog_bar and "gradq/bits_per_coord" in metrics:
                pl_module.log("bits", metrics["gradq/bits_per_coord"], on_step=True, on_epoch=False,
                              prog_bar=True, logger=False, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's gradq state (a collective: Lightning calls it on every rank when saving)."""
        return self._ranks.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's gradq state, applied when the hook is registered (restoring comes first)."""
        self._ranks.load_state_dict(state_dict)
