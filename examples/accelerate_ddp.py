"""gradq in Hugging Face Accelerate: DDP on CPU (gloo) or GPU, checkpointed with the accelerator.

    torchrun --nproc_per_node 2 examples/accelerate_ddp.py --spec qsgd:bits=4,bucket=512 --out runs/acc
    torchrun --nproc_per_node 2 examples/accelerate_ddp.py --resume runs/acc/ckpt --out runs/acc2

The run saves its state (model, optimizer, gradq's state) half way, in ``OUT/ckpt``; ``--resume`` loads
such a state and finishes the run exactly. With ``--tensorboard`` the per-step figures
(``gradq/bits_per_coord``, ``gradq/bytes_sent``…) go to TensorBoard under ``OUT``. Rank 0 writes
``OUT/result.json`` and the final parameters ``OUT/params.pt``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradq.integrations.accelerate import log_stats, register  # (before accelerate starts the group)

from accelerate import Accelerator  # noqa: E402


def batch(step: int, rank: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of step ``step``: a pure function of both, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 32, generator=g)
    return x, x[:, :10].argmax(1)


def use_gpu() -> bool:
    """CUDA when every local process gets a GPU of its own (NCCL refuses two ranks on one GPU)."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="onebit", help="gradq spec (default onebit: 1 bit, error feedback)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--resume", help="a state directory written by accelerator.save_state")
    ap.add_argument("--out", default="runs/accelerate")
    ap.add_argument("--tensorboard", action="store_true", help="log to TensorBoard (needs tensorboard)")
    args = ap.parse_args()
    accelerator = Accelerator(cpu=not use_gpu(), project_dir=args.out,
                              log_with="tensorboard" if args.tensorboard else None)
    if args.tensorboard:
        accelerator.init_trackers("gradq")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    state = register(accelerator, model, args.spec, min_numel=0, keep_1d_fp32=False)
    start = 0
    if args.resume:
        accelerator.load_state(args.resume)
        start = state.step if state is not None else 0
    rank = accelerator.process_index
    for step in range(start, args.steps):
        x, y = batch(step, rank)
        x, y = x.to(accelerator.device), y.to(accelerator.device)
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        log_stats(accelerator, state, step=step)
        if step + 1 == args.steps // 2 and not args.resume:
            accelerator.save_state(os.path.join(args.out, "ckpt"))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    same = True
    if dist.is_initialized():
        every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(every, flat)
        same = all(torch.equal(every[0], e) for e in every)
    if accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)
        torch.save(flat, os.path.join(args.out, "params.pt"))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"replicas_equal": same, "gradq_step": None if state is None else state.step,
                       "last_stats": {} if state is None else {k: v for k, v in state.last_stats.items()
                                                               if isinstance(v, (int, float, str, bool))}}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
