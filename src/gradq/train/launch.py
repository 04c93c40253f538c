"""Run :class:`~gradq.train.runner.TrainConfig` runs: local worker processes, or in place under torchrun.

``run_all(configs, out)`` trains each config in turn into ``out/NN-<label>-s<seed>/``:

* launched by ``torchrun`` (``WORLD_SIZE`` and ``RANK`` in the environment) — every process runs the
  same sequence in place, one node or many, on the backend of the config (gloo, or NCCL with GPUs);
* otherwise — it starts ``cfg.workers`` local processes on ``127.0.0.1`` (gloo; or one per emulated host
  when given a :class:`gradq.netem.EmulatedNetwork`), each with ``cores // workers`` threads, and kills
  the others if one fails.

A run directory whose log already ends with a ``summary`` row for the same settings is kept and
skipped (so an interrupted sweep resumes where it stopped); one holding another run's log is refused
unless ``force=True``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from .runner import TrainConfig, baseline_kind, run_dir_name, train_worker

__all__ = ["run_all", "under_torchrun", "finished"]

#: settings that do not change a run's result (a finished run is reused whatever they say)
_COSMETIC = ("progress", "comm_timeout", "tensorboard")  # settings that do not change what a run computes


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "GRADQ_LAUNCHED" not in os.environ


def _same(cfg: TrainConfig, saved: dict[str, Any]) -> bool:
    want = {k: v for k, v in cfg.to_json().items() if k not in _COSMETIC}
    defaults = TrainConfig().to_json()   # a setting added after the run was written: its default then
    return all(saved.get(k, defaults.get(k)) == v for k, v in want.items())


def finished(run_dir: Path, cfg: TrainConfig) -> Optional[bool]:
    """``True``: a complete run of ``cfg`` is there; ``False``: the directory holds something else
    (another config, or an unfinished log); ``None``: no run there yet."""
    conf, log = run_dir / "config.json", run_dir / "log.jsonl"
    if not conf.exists() and not log.exists():
        return None
    try:
        saved = json.loads(conf.read_text())
        last = log.read_text().strip().splitlines()[-1]
        return _same(cfg, saved) and json.loads(last).get("kind") == "summary"
    except (OSError, ValueError, IndexError):
        return False


def _check_local_devices(cfg: TrainConfig) -> None:
    """Refuse, before anything runs, a GPU backend that the local workers cannot have."""
    if cfg.backend == "gloo":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise RuntimeError(f"--backend {cfg.backend} needs a GPU, and this machine has none")
    if cfg.backend == "nccl" and cfg.workers > gpus:
        raise RuntimeError(f"--backend nccl runs one process per GPU: {cfg.workers} workers for {gpus} GPU(s) "
                           f"(NCCL refuses two ranks on one GPU); use --workers {gpus}, or --backend cuda:gloo "
                           "to share a GPU")


def _precompile(configs: Iterable[TrainConfig]) -> None:
    """Compile the CPU kernels of the gradq specs about to run on local CPU workers, once, here
    (:func:`gradq.precompile.precompile`): on a cold cache, ranks started together would each compile
    them at once on the same cores. About a second when the cache already holds them."""
    specs = [c.compressor for c in configs if c.backend == "gloo" and baseline_kind(c.compressor)[0] == "gradq"]
    if specs:
        from ..precompile import precompile

        precompile(dict.fromkeys(specs), progress=True)


def _local(cfg: TrainConfig, run_dir: Path, net: Any, timeout: Optional[float]) -> None:
    from ..netem import launch


    cmd = [sys.executable, "-m", "gradq.train.launch", "--worker", json.dumps(cfg.to_json()), str(run_dir)]
    threads = max(1, (os.cpu_count() or 1) // cfg.workers)
    env = dict(os.environ, GRADQ_LAUNCHED="1")
    launch([cmd] * cfg.workers, net=net, env=env, timeout=timeout, threads=threads)


def run_all(configs: Sequence[TrainConfig], out: str | os.PathLike, *, force: bool = False,
            net: Any = None, timeout: Optional[float] = None, echo: bool = True) -> list[Path]:
    """Train every config in turn (see the module docstring); returns the run directories."""
    out = Path(out)
    dirs = [out / run_dir_name(i, cfg) for i, cfg in enumerate(configs)]
    todo = []
    for cfg, d in zip(configs, dirs):  # refuse before training anything
        state = finished(d, cfg)
        if state is False and not force:
            raise FileExistsError(f"{d} holds a different or unfinished run; remove it, choose another "
                                  "--out, or pass --force to overwrite it")
        todo.append(state is not True)
    torchrun = under_torchrun()
    if not torchrun:
        for cfg, run in zip(configs, todo):
            if run:
                _check_local_devices(cfg)
    if torchrun:
        import torch.distributed as dist

        from ..comm import lifecycle

        from datetime import timedelta

        lifecycle.before_init()
        limit = timedelta(seconds=configs[0].comm_timeout if configs else 300.0)
        dist.init_process_group(configs[0].backend if configs else "gloo", timeout=limit)
    if not torchrun:
        _precompile(cfg for cfg, run in zip(configs, todo) if run)
    rank0 = not torchrun or int(os.environ.get("RANK", "0")) == 0
    try:
        for i, (cfg, d, run) in enumerate(zip(configs, dirs, todo)):
            if echo and rank0:
                what = "training" if run else "already done, kept"
                print(f"[{i + 1}/{len(configs)}] {cfg.label} (seed {cfg.seed}): {what} -> {d}", flush=True)
            if not run:
                continue
            if torchrun:
                train_worker(cfg, d)
            else:
                _local(cfg, d, net, timeout)
    finally:
        if torchrun:
            from ..comm import lifecycle

            lifecycle.teardown()
    return dirs


def _worker_main(argv: Sequence[str]) -> int:
    import torch

    from ..errors import CommunicationError

    cfg = TrainConfig(**json.loads(argv[0]))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        train_worker(cfg, argv[1])
    except CommunicationError as exc:  # a peer died or stalled: one clear line, not a traceback
        print(f"gradq: rank {os.environ.get('RANK', '?')}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2:]))
    print("usage: python -m gradq.train.launch --worker CONFIG_JSON RUN_DIR (started by gradq train)",
          file=sys.stderr)
    sys.exit(2)
