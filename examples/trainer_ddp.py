"""gradq in the Hugging Face Transformers Trainer: DDP on CPU (gloo) or GPU.

    torchrun --nproc_per_node 2 examples/trainer_ddp.py --spec qsgd:bits=4,bucket=512 --out runs/hf
    torchrun --nproc_per_node 2 examples/trainer_ddp.py --resume runs/hf/checkpoint-4 --out runs/hf2

Checkpoints every 4 steps (``OUT/checkpoint-N``, each with ``gradq_state.pt``); ``--resume`` finishes
from one exactly. The Trainer's logs carry ``gradq/bits_per_coord``, ``gradq/bytes_sent``… (and go to
TensorBoard with ``--report-to tensorboard``). Rank 0 writes ``OUT/result.json`` and ``OUT/params.pt``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradq.integrations.transformers import register  # (before the Trainer starts the process group)

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402


class LoggedKeys(TrainerCallback):
    """Records the keys the Trainer's reporters receive (a stand-in for TensorBoard or W&B)."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.keys |= set(logs or {})


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def dataset(n: int = 256) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    return [{"x": x[i], "labels": x[i, :10].argmax()} for i in range(n)]


def use_gpu() -> bool:
    """CUDA when every local process gets a GPU of its own (NCCL refuses two ranks on one GPU)."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="onebit", help="gradq spec (default onebit: 1 bit, error feedback)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--resume", help="a checkpoint-N folder written by an earlier run")
    ap.add_argument("--out", default="runs/trainer")
    ap.add_argument("--report-to", default="none")
    args = ap.parse_args()
    targs = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=16,
                              learning_rate=0.1, lr_scheduler_type="constant", optim="sgd", save_steps=4,
                              logging_steps=1, report_to=args.report_to, use_cpu=not use_gpu(),
                              ddp_backend="gloo" if not torch.cuda.is_available() else None, seed=0,
                              data_seed=0, disable_tqdm=True)
    model = Net()
    seen = LoggedKeys()
    trainer = Trainer(model=model, args=targs, train_dataset=dataset(), callbacks=[seen],
                      data_collator=lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]})
    gradq_cb = register(trainer, args.spec, min_numel=0, keep_1d_fp32=False)
    trainer.train(resume_from_checkpoint=args.resume)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    same = True
    if dist.is_initialized():
        every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(every, flat)
        same = all(torch.equal(every[0], e) for e in every)
    if trainer.is_world_process_zero():
        st = gradq_cb.state
        torch.save(flat, os.path.join(args.out, "params.pt"))
        logged = sorted(k for k in seen.keys if k.startswith("gradq/"))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"replicas_equal": same, "global_step": trainer.state.global_step,
                       "gradq_step": None if st is None else st.step, "logged": logged,
                       "last_stats": {} if st is None else {k: v for k, v in st.last_stats.items()
                                                            if isinstance(v, (int, float, str, bool))}}, f)


if __name__ == "__main__":
    main()
