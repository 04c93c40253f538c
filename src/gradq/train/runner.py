"""Data-parallel training with a chosen compressor: the engine of ``gradq train`` and ``gradq demo``.

One run = one compressor, one seed: DDP over ``torch.distributed`` (gloo on CPU, NCCL on GPUs), the
gradient averaged by

* ``fp32`` — DDP's own float32 all-reduce (``allreduce_hook``, asynchronous, overlapping the backward);
* ``powersgd[:rank=R,start=S]`` — PyTorch's ``powerSGD_hook`` (rank ``R``, default 1; compression from
  iteration ``S``, default 2, with PyTorch's error feedback and warm start), each bucket waited for
  before the next starts (on gloo, PowerSGD's chained collectives of two buckets could otherwise be
  issued in different orders on different ranks);
* any gradq spec — ``gradq.register(ddp_model, spec, ...)`` (synchronous hook; see :mod:`gradq.ddp`).

With ``fsdp=True`` (``gradq train --fsdp``) the model is sharded with FSDP2 instead of wrapped in DDP:
every submodule that holds parameters, then the root, goes through ``fully_shard``; ``fp32`` is stock
FSDP2 (its own reduce-scatter, timed), a gradq spec installs :class:`gradq.fsdp.GradqReduceScatter`, and
the test set is evaluated on every rank (a sharded forward needs them all; rank 0 writes it). Its
reduce-scatter is synchronous, so its encode/communicate/decode seconds are the step's own.

Every rank trains on its own shard of each epoch's permutation (drawn from the seed and the epoch, so
every run with the same seed sees the same batches); the last incomplete global batch is dropped so all
ranks take the same number of steps. Rank 0 writes the run directory:

* ``config.json`` — every setting of :class:`TrainConfig`, the world size and library versions;
* ``log.jsonl`` — ``step`` rows (every ``log_every`` steps), ``epoch`` rows, and a final ``summary`` row,
  in the schema :mod:`gradq.train.report` reads.

Time per step: ``encode_s`` / ``decode_s`` come from the gradq hook's own clocks and ``comm_s`` is the
rest of the hook's time (its collectives — quantized payloads, float32 tensors, the ranks' NaN agreement,
and with ``measure_error`` the exact all-reduce used for the error — and waits). For the
asynchronous ``fp32`` and ``powersgd`` hooks ``comm_s`` is the time from a bucket's hook call to its
future's completion (the union over buckets), which may overlap backward computation. ``compute_s`` is
the step's wall time minus those. ``bytes_sent`` is the gradq hook's count of bytes this worker sent;
for ``fp32`` it is the ring all-reduce's ``2(W−1)/W·4`` bytes per coordinate, and for ``powersgd`` the
same formula applied to the P and Q factors of every compressed matrix plus the float32 tensors.
``loss`` on a step row is rank 0's minibatch loss; epoch rows average loss and accuracy over all ranks'
training batches (``train_accuracy`` is measured on the fly, with the weights changing during the
epoch) and evaluate ``test_*`` on the full test set on rank 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..comm._util import collective

__all__ = ["TrainConfig", "train_worker", "baseline_kind", "run_dir_name"]

OPTIMIZERS = ("sgd", "adam")
#: process-group backends whose tensors live on the GPU: NCCL, and gloo over CUDA tensors ("cuda:gloo",
#: which runs several ranks on one GPU — the test harness, since NCCL refuses that)
CUDA_BACKENDS = ("nccl", "cuda:gloo")
BACKENDS = ("gloo",) + CUDA_BACKENDS
SCHEDULES = ("constant", "cosine", "step")


@dataclass
class TrainConfig:
    """Settings of one training run (all recorded in ``config.json``)."""

    compressor: str = "fp32"
    label: Optional[str] = None
    model: str = "mlp"
    data: str = "digits"
    workers: int = 4
    epochs: int = 10
    batch_size: int = 32  # per worker
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup_epochs: float = 0.0  # linear learning-rate warm-up
    seed: int = 0
    backend: str = "gloo"
    measure_error: bool = False
    strategy: str = "auto"
    min_numel: int | str = 10_000  # or "auto": measured at the first step (gradq.adaptive.fp32_threshold)
    hook_warmup_steps: int = 0  # gradq hook: first steps averaged in float32
    adaptive: bool = False  # gradq hook: time float32 and the spec, run the faster (gradq.adaptive)
    uncompressed: list[str] = field(default_factory=list)
    log_every: int = 1
    test_fraction: float = 0.2
    network: Optional[str] = None  # the emulated link rate the workers ran on (recorded; set by the launcher)
    progress: bool = True
    tensorboard: bool = False  # also write TensorBoard event files into the run directory's tensorboard/
    comm_timeout: float = 300.0  # seconds a collective may wait for the other ranks (hook and runner)
    fsdp: bool = False  # shard the model with FSDP2 (fully_shard); gradients are reduce-scattered

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("workers", "epochs", "batch_size", "log_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.comm_timeout > 0:
            raise ValueError(f"comm_timeout must be positive, got {self.comm_timeout!r}")
        if self.warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {self.warmup_epochs!r}")
        kind = baseline_kind(self.compressor)[0]  # a bad compressor fails here, before any process starts
        if self.fsdp:
            bad = [name for name, on in (("powersgd", kind == "powersgd"), ("adaptive", self.adaptive),
                                         ("measure_error", self.measure_error),
                                         ("hook_warmup_steps", self.hook_warmup_steps > 0),
                                         ("strategy", self.strategy != "auto"),
                                         ("min_numel='auto'", self.min_numel == "auto")) if on]
            if bad:
                raise ValueError(f"fsdp=True does not combine with {', '.join(bad)} (DDP-hook features; "
                                 "FSDP2 gradients are reduce-scattered by gradq.fsdp)")
        if self.label is None:
            adaptive = self.adaptive and baseline_kind(self.compressor)[0] == "gradq"
            self.label = self.compressor + (" (adaptive)" if adaptive else "") + (" (fsdp)" if self.fsdp else "")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def baseline_kind(compressor: str) -> tuple[str, dict[str, int]]:
    """``("fp32", {})``, ``("powersgd", {"rank": R, "start": S})`` or ``("gradq", {})`` (a gradq spec,
    checked by building it)."""
    text = compressor.strip()
    if text in ("fp32", "ddp"):
        return "fp32", {}
    if text == "powersgd" or text.startswith("powersgd:"):
        opts = {"rank": 1, "start": 2}
        for item in filter(None, text.partition(":")[2].split(",")):
            key, eq, val = item.partition("=")
            if key not in opts or not eq or not val.strip().isdigit():
                raise ValueError(f"bad powersgd option {item!r}: use powersgd:rank=R,start=S (integers)")
            opts[key] = int(val)
        if opts["rank"] < 1:
            raise ValueError("powersgd rank must be at least 1")
        return "powersgd", opts
    from ..factory import build

    build(text)
    return "gradq", {}


def run_dir_name(index: int, cfg: TrainConfig) -> str:
    """``NN-<label slug>-s<seed>``: sortable, readable, unique per (compressor, seed)."""
    slug = "".join(c if c.isalnum() or c in "=.+-" else "_" for c in str(cfg.label)).strip("_")[:60]
    return f"{index:02d}-{slug}-s{cfg.seed}"


def _lr_at(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """Learning rate for (0-based) ``step``: linear warm-up, then constant / cosine / step decay."""
    total = cfg.epochs * steps_per_epoch
    warm = cfg.warmup_epochs * steps_per_epoch
    if warm > 0 and step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1.0, total - warm)
    if cfg.schedule == "cosine":
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))
    if cfg.schedule == "step":  # ×0.1 at 50 % and at 75 % of training
        return cfg.lr * (0.1 ** (int(frac >= 0.5) + int(frac >= 0.75)))
    return cfg.lr


class _HookClock:
    """Wraps a DDP hook: records, per step, the union of [call, completion] intervals.

    ``hook`` is the function to register (unannotated: DDP checks annotations it can read, and this
    module's are strings). ``sync=True`` waits for each bucket's future inside the hook, so a hook that
    issues further collectives from its future's callbacks (PowerSGD) cannot interleave two buckets'
    collectives in a different order on different ranks — which gloo, unlike NCCL's ordered streams,
    turns into a size mismatch or a hang."""

    def __init__(self, inner: Callable, sync: bool = False) -> None:
        self.spans: list[tuple[float, float]] = []
        self.sync = sync

        def hook(state, bucket):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()

            def done(f):  # noqa: ANN001, ANN202
                self.spans.append((t0, time.perf_counter()))
                return f.value()
            fut = inner(state, bucket)
            if sync:
                fut.wait()
                self.spans.append((t0, time.perf_counter()))
                return fut
            return fut.then(done)
        self.hook = hook

    def take(self) -> float:
        """Seconds of the step spent waiting for communication, since the last call.

        A synchronous hook blocks the backward pass for its whole call: the intervals' union (overlaps
        counted once). An asynchronous one (DDP's all-reduce) runs beside the backward pass; only what
        is left once the last bucket has been handed over adds to the step: from the last call to the
        last completion — the same "exposed" measure as gradq's ``wait_seconds``."""
        spans, self.spans = sorted(self.spans), []
        if not spans:
            return 0.0
        if not self.sync:
            return max(0.0, max(b for _, b in spans) - max(a for a, _ in spans))
        total, end = 0.0, -math.inf
        for a, b in spans:
            if b > end:
                total += b - max(a, end)
                end = b
        return total


def _ring_bytes(numel: int, world: int) -> int:
    return 2 * (world - 1) * 4 * numel // world


def _powersgd_numel(model: nn.Module, rank: int, min_rate: float = 2.0) -> int:
    """Coordinates PowerSGD all-reduces per step once compressing: ``r(n+m)`` for a matrix it
    compresses (when that is at least ``min_rate``× smaller than ``n·m``), ``numel`` otherwise."""
    total = 0
    for p in model.parameters():
        if p.dim() <= 1:
            total += p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(rank, n, m)
        total += r * (n + m) if (n + m) * r * min_rate < n * m else p.numel()
    return total


def _shard(n: int, cfg: TrainConfig, world: int, rank: int, epoch: int) -> list[torch.Tensor]:
    """This rank's batches of ``epoch``: a permutation from (seed, epoch), dealt round-robin."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)
    perm = torch.randperm(n, generator=g)
    steps = n // (world * cfg.batch_size)
    b = cfg.batch_size
    return [perm[(s * world + rank) * b:(s * world + rank + 1) * b] for s in range(steps)]


@torch.no_grad()
def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1024) -> tuple[float, float]:
    was = model.training
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, x.shape[0], batch):
        out = model(x[i:i + batch])
        loss += float(nn.functional.cross_entropy(out, y[i:i + batch], reduction="sum"))
        correct += int((out.argmax(1) == y[i:i + batch]).sum())
    model.train(was)
    n = max(1, x.shape[0])
    return loss / n, correct / n


def _install(ddp: nn.parallel.DistributedDataParallel, cfg: TrainConfig, world: int):
    """Register the run's communication; returns (gradq state or None, clock or None, fixed bytes/step fn)."""
    kind, opts = baseline_kind(cfg.compressor)
    numel = sum(p.numel() for p in ddp.module.parameters())
    if kind == "gradq":
        import gradq

        state = gradq.register(ddp, cfg.compressor, cfg.strategy, seed=cfg.seed, min_numel=cfg.min_numel,
                               warmup_steps=cfg.hook_warmup_steps, uncompressed=cfg.uncompressed,
                               measure_error=cfg.measure_error, timeout=cfg.comm_timeout, adaptive=cfg.adaptive)
        # load the scheme's compiled kernels now, not inside the first timed step
        q = gradq.build(cfg.compressor)
        p = q.encode(torch.randn(4096, generator=torch.Generator().manual_seed(0)), seed=0)
        q.decode_mean([p, p])
        return state, None, None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if kind == "fp32":
        clock = _HookClock(default_hooks.allreduce_hook)
        ddp.register_comm_hook(None, clock.hook)
        return None, clock, lambda step: _ring_bytes(numel, world)
    st = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=opts["rank"],
                                     start_powerSGD_iter=opts["start"], random_seed=cfg.seed)
    clock = _HookClock(powerSGD_hook.powerSGD_hook, sync=True)
    ddp.register_comm_hook(st, clock.hook)
    compressed = _powersgd_numel(ddp.module, opts["rank"])
    return None, clock, lambda step: _ring_bytes(numel if step < opts["start"] else compressed, world)


def _install_fsdp(model: nn.Module, cfg: TrainConfig) -> tuple[Any, Any]:
    """gradq's reduce-scatter (returns its instance) or stock FSDP2's, timed (returns the clock)."""
    from ..fsdp import StockReduceScatter

    if baseline_kind(cfg.compressor)[0] == "gradq":
        import gradq

        comm = gradq.register(model, cfg.compressor, seed=cfg.seed, min_numel=int(cfg.min_numel),
                              uncompressed=cfg.uncompressed)
        q = gradq.build(cfg.compressor)   # load the scheme's compiled kernels now, not inside the first step
        q.decode(q.encode(torch.randn(4096, generator=torch.Generator().manual_seed(0)), seed=0))
        return comm, None
    return None, StockReduceScatter().install(model)


def train_worker(cfg: TrainConfig, out_dir: str | os.PathLike) -> Optional[dict[str, Any]]:
    """Train one run as this rank of the (already or about to be) initialised default process group.

    Returns the summary row on rank 0 (``None`` elsewhere). Rank 0 writes ``out_dir``."""
    from .. import __version__
    from .data import load_dataset
    from .models import build_model

    from ..comm import lifecycle

    own_group = not dist.is_initialized()
    if own_group:
        lifecycle.before_init()
        dist.init_process_group(cfg.backend, timeout=timedelta(seconds=cfg.comm_timeout))
    try:
        return _train(cfg, Path(out_dir), load_dataset, build_model, __version__)
    finally:
        # the run's DDP model and hook state are out of scope now: stop gradq's threads, collect them,
        # and (when this call made the group) destroy it while the interpreter is alive
        lifecycle.teardown(destroy=own_group)


def _exposed(stats: dict[str, Any]) -> tuple[float, float, float]:
    """The hook's share of a step's wall time, as (encode, communicate, decode) seconds.

    The hook works beside the backward pass; only the time the step then waited for it
    (``wait_seconds``) adds to the step. That exposed time is apportioned to the three phases in the
    proportion the hook's jobs spent in each (what ran hidden behind the backward pass counts as
    compute, since the step would have taken that long without communicating)."""
    exposed = float(stats.get("wait_seconds", 0.0))
    parts = [float(stats["encode_seconds"]), float(stats["comm_seconds"]), float(stats["decode_seconds"])]
    total = sum(parts)
    if total <= 0:
        return 0.0, exposed, 0.0
    enc, com, dec = (exposed * p / total for p in parts)
    return enc, com, dec


def _train(cfg: TrainConfig, out: Path, load_dataset, build_model, version: str) -> Optional[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if cfg.backend in CUDA_BACKENDS:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    data = load_dataset(cfg.data, seed=cfg.seed, test_fraction=cfg.test_fraction)
    model = build_model(cfg.model, data.num_features, data.num_classes, data.image_shape, seed=cfg.seed).to(device)
    numel = sum(p.numel() for p in model.parameters())
    rs_clock: Any = None
    if cfg.fsdp:
        from ..fsdp import shard

        ddp: nn.Module = shard(model)
        state, rs_clock = _install_fsdp(ddp, cfg)
        clock = fixed_bytes = None
    else:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        state, clock, fixed_bytes = _install(ddp, cfg, world)
    params = [p for p in ddp.parameters()]
    if cfg.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                                                     weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    x_tr, y_tr = data.x_train.to(device), data.y_train.to(device)
    x_te, y_te = data.x_test.to(device), data.y_test.to(device)
    steps_per_epoch = x_tr.shape[0] // (world * cfg.batch_size)
    if steps_per_epoch < 1:
        raise ValueError(f"{x_tr.shape[0]} training examples are fewer than one global batch of "
                         f"{world}×{cfg.batch_size}; lower --batch-size or --workers")
    log = None
    bar = None
    board = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if cfg.tensorboard:
            board = _tensorboard(out / "tensorboard")
        conf = dict(cfg.to_json(), world_size=world, parameters=numel, train_examples=int(x_tr.shape[0]),
                    test_examples=int(x_te.shape[0]), steps_per_epoch=steps_per_epoch,
                    torch_version=torch.__version__, gradq_version=version, device=str(device))
        (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
        log = open(out / "log.jsonl", "w")
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.epochs * steps_per_epoch, desc=str(cfg.label)[:40], unit="step",
                       leave=False, dynamic_ncols=True, disable=None)  # None: off when not a terminal

    def write(row: dict[str, Any]) -> None:
        if log is not None:
            log.write(json.dumps(dict(row, compressor=cfg.compressor)) + "\n")
            log.flush()
        if board is not None:
            _board_row(board, row)

    wall = 0.0
    step = 0
    total_bytes = 0
    summary: Optional[dict[str, Any]] = None
    try:
        for epoch in range(1, cfg.epochs + 1):
            acc = {"compute_s": 0.0, "encode_s": 0.0, "comm_s": 0.0, "decode_s": 0.0, "bytes_sent": 0.0}
            bits, errs = [], []
            # loss·n, correct, n over this rank's batches; on the model's device, since a collective on a
            # CPU tensor fails on NCCL (float64: NCCL and gloo both sum it)
            sums = torch.zeros(3, dtype=torch.float64, device=device)
            t_epoch = time.perf_counter()
            for idx in _shard(x_tr.shape[0], cfg, world, rank, epoch):
                lr = _lr_at(cfg, step, steps_per_epoch)
                for gr in opt.param_groups:
                    gr["lr"] = lr
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=False)
                out_b = ddp(x_tr[idx])
                loss = nn.functional.cross_entropy(out_b, y_tr[idx])
                loss.backward()
                if state is None or not state.last_stats.get("skipped"):
                    opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                step += 1
                wall += dt
                if rs_clock is not None:   # stock FSDP2: its reduce-scatter is the step's communication
                    com, sent = rs_clock.take()
                    enc, dec, bpc, rel = 0.0, 0.0, 8.0 * sent / max(1, (world - 1) * numel // world), None
                elif state is not None:
                    ls = state.last_stats
                    # FSDP2's reduce-scatter is synchronous: all its time is the step's
                    enc, com, dec = ((ls["encode_seconds"], ls["comm_seconds"], ls["decode_seconds"]) if cfg.fsdp
                                     else _exposed(ls))
                    sent, bpc = int(ls["bytes_sent"]), float(ls["bits_per_coord"])
                    rel = ls.get("rel_error")
                else:
                    enc, com, dec = 0.0, clock.take(), 0.0
                    sent = fixed_bytes(step - 1)
                    bpc, rel = 8.0 * sent / numel, None
                comp = max(0.0, dt - enc - com - dec)
                for k, v in (("compute_s", comp), ("encode_s", enc), ("comm_s", com), ("decode_s", dec),
                             ("bytes_sent", sent)):
                    acc[k] += v
                total_bytes += sent
                bits.append(bpc)
                if rel is not None:
                    errs.append(rel)
                lv = float(loss.detach())
                sums += torch.tensor([lv * len(idx), float((out_b.argmax(1) == y_tr[idx]).sum()), len(idx)],
                                     dtype=torch.float64, device=device)
                if step % cfg.log_every == 0:
                    extra = {}
                    if getattr(state, "adaptive", None) is not None:  # the mode of this step, and decisions
                        extra = {"mode": state.last_stats.get("mode"), "adaptive_chosen": state.adaptive.chosen,
                                 "adaptive_medians": dict(state.adaptive.medians)}
                    write({"kind": "step", "epoch": epoch, "step": step, "loss": lv, "lr": lr, "wall_s": wall,
                           "compute_s": comp, "encode_s": enc, "comm_s": com, "decode_s": dec,
                           "bytes_sent": sent, "bits_per_coordinate": bpc, "rel_error": rel, **extra})
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{lv:.3f}", refresh=False)
            epoch_s = time.perf_counter() - t_epoch
            collective(f"the all-reduce of epoch {epoch}'s training statistics", dist.all_reduce, sums)  # (a few bytes)
            row = {"kind": "epoch", "epoch": epoch, "step": step, "loss": float(sums[0] / sums[2]),
                   "train_accuracy": float(sums[1] / sums[2]), "wall_s": wall, "epoch_s": epoch_s, **acc,
                   "bits_per_coordinate": sum(bits) / len(bits),
                   "rel_error": sum(errs) / len(errs) if errs else None}
            if cfg.fsdp:   # a sharded forward needs every rank
                row["test_loss"], row["test_accuracy"] = _evaluate(ddp, x_te, y_te)
            if rank == 0:
                if not cfg.fsdp:
                    row["test_loss"], row["test_accuracy"] = _evaluate(ddp.module, x_te, y_te)
                write(row)
                if bar is not None:
                    bar.set_postfix(loss=f"{row['loss']:.3f}", test_acc=f"{row['test_accuracy']:.3f}")
            collective(f"the barrier after epoch {epoch} (rank 0 evaluates)", dist.barrier)
            summary = row
        if rank == 0 and summary is not None:
            summary = {"kind": "summary", "epochs": cfg.epochs, "steps": step, "wall_s": wall,
                       "final_loss": summary["loss"], "final_test_accuracy": summary["test_accuracy"],
                       "bytes_sent": total_bytes}
            if getattr(state, "adaptive", None) is not None:
                summary["adaptive_decisions"] = [dict(d) for d in state.adaptive.decisions]
                summary["adaptive_chosen"] = state.adaptive.chosen
            if getattr(state, "min_numel_auto", False):
                summary["min_numel"] = state.min_numel
                summary["calibration"] = dict(state.calibration)
            write(summary)
            return summary
        return None
    finally:
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
        if board is not None:
            board.close()


#: log.jsonl fields written to TensorBoard, by row kind: (field, tag)
_BOARD = {"step": (("loss", "train/loss"), ("lr", "train/lr"), ("bits_per_coordinate", "gradq/bits_per_coord"),
                   ("bytes_sent", "gradq/bytes_sent"), ("encode_s", "gradq/encode_seconds"),
                   ("comm_s", "gradq/comm_seconds"), ("decode_s", "gradq/decode_seconds"),
                   ("compute_s", "train/compute_seconds"), ("rel_error", "gradq/rel_error")),
          "epoch": (("loss", "epoch/train_loss"), ("train_accuracy", "epoch/train_accuracy"),
                    ("test_loss", "epoch/test_loss"), ("test_accuracy", "epoch/test_accuracy"),
                    ("epoch_s", "epoch/seconds"), ("bits_per_coordinate", "epoch/bits_per_coord"))}


def _tensorboard(path: Path) -> Any:
    """A TensorBoard ``SummaryWriter`` on ``path`` (``gradq train --tensorboard``)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ValueError(f"--tensorboard needs the tensorboard package (pip install tensorboard): {e}") from None
    return SummaryWriter(str(path))


def _board_row(board: Any, row: dict[str, Any]) -> None:
    """One log.jsonl row's numbers as TensorBoard scalars at the row's step (wall time in seconds of
    training, so runs compare on a time axis too)."""
    for key, tag in _BOARD.get(row.get("kind"), ()):
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            board.add_scalar(tag, float(v), global_step=int(row["step"]), walltime=float(row.get("wall_s", 0.0)))
