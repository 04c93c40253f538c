"""gradq in PyTorch Lightning: DDP on CPU (gloo) or GPU, gradients compressed by a callback.

    torchrun --nproc_per_node 2 examples/lightning_ddp.py --spec qsgd:bits=4,bucket=512 --out runs/pl
    torchrun --nproc_per_node 2 examples/lightning_ddp.py --resume runs/pl/ckpt/epoch=0.ckpt --out runs/pl2

Each epoch ends with a checkpoint (gradq's state included); ``--resume`` continues one exactly. The
per-step figures (``gradq/bits_per_coord``, ``gradq/bytes_sent``…) go to ``OUT/metrics.csv``. Rank 0
writes ``OUT/result.json`` and the final parameters ``OUT/params.pt``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from gradq.integrations.lightning import GradqCallback  # (before lightning starts the process group)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def dataset(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, x[:, :10].argmax(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="onebit", help="gradq spec (default onebit: 1 bit, error feedback)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--resume", help="a checkpoint written by an earlier run")
    ap.add_argument("--out", default="runs/lightning")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gradq_cb = GradqCallback(args.spec, min_numel=0, keep_1d_fp32=False)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                         num_nodes=max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
                         strategy="ddp" if world > 1 else "auto", max_epochs=args.epochs,
                         callbacks=[gradq_cb, ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"),
                                                              filename="{epoch}", every_n_epochs=1, save_top_k=-1)],
                         logger=CSVLogger(args.out, name="", version=""), log_every_n_steps=1,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    model = Net()
    trainer.fit(model, DataLoader(dataset(), batch_size=16, shuffle=False), ckpt_path=args.resume)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    same = True
    if dist.is_initialized():
        every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(every, flat)
        same = all(torch.equal(every[0], e) for e in every)
    if trainer.global_rank == 0:
        st = gradq_cb.state
        torch.save(flat, os.path.join(args.out, "params.pt"))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"replicas_equal": same, "global_step": trainer.global_step,
                       "gradq_step": None if st is None else st.step,
                       "last_stats": {} if st is None else {k: v for k, v in st.last_stats.items()
                                                            if isinstance(v, (int, float, str, bool))},
                       "logged": sorted(k for k in trainer.logged_metrics if k.startswith("gradq/"))}, f)


if __name__ == "__main__":
    main()
