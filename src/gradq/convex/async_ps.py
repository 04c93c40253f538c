"""Asynchronous QSGD on a parameter server (QSGD [QSGD-full], appendix D; docs/algorithms.md).

The model of appendix D (after Lian et al. 2015, section 3): a star network, a server holding ``x``, and
workers that read a consistent copy of ``x``, compute a stochastic gradient and push it while other
workers' updates land. The paper derives its ergodic rate from Lian et al.'s Theorem 1 with the
gradient's second-moment bound enlarged by the quantizer: the unbiased ``Q_s`` (Lemma 3.1,
``E‖Q_s(g) − g‖² ≤ min(n/s², √n/s)·‖g‖²``) changes only that constant, provided the step shrinks with
the largest delay.

Here the server is rank 0 of a gloo process group and the ``K`` workers are ranks ``1..K``, each with a
disjoint shard of the samples (:func:`gradq.convex.problems.shard`). A worker loops: receive
``(x_v, v)`` (the parameters after ``v`` updates, the *version*), draw a minibatch ``B`` from its shard,
send ``Q_s(∇f_B(x_v))`` — a gradq payload, by default ``qsgd:levels=s,norm=l2,bucket=none`` — tagged
with ``v``. The server applies each push as it arrives, ``x ← x − η·decode(payload)``, increments its
version ``t`` and replies to that worker alone. The **staleness** of the push is ``τ = t − v`` (``t``
before this update): the number of other updates applied since its gradient's parameters were read.

Bookkeeping identity (a check, and a caution when reading results): every update delays the one
gradient in flight at each of the other ``K − 1`` workers by one, so over ``U`` updates
``Σ τ + D = (K − 1)·U``, ``D`` being the staleness the ``K − 1`` pushes discarded at the end had
reached. The *mean* staleness is therefore ``≈ K − 1`` whatever the speeds; slow workers show in the
per-worker means, the histogram and the maximum.

The **synchronous baseline** runs through the same code: the server waits for one push from every
worker, applies their mean (rank order) and replies to all, so every staleness is 0; each of its
``updates`` costs ``K`` pushes. ``delay_ms`` makes worker ``r`` sleep ``(r − 1)·delay_ms`` ms before each
gradient (worker 1 at full speed). A run stops after ``updates`` server updates; the pushes still in
flight are then received, not applied, and answered with *stop*.

Wire: a push is one uint8 tensor of ``8 + B`` bytes (the int64 version, then ``payload.to_bytes()``, ``B =
payload.nbytes`` fixed by the spec); a reply is ``dim + 1`` float64 values (version, ``−1`` = stop, then
``x``). ``bits`` counts ``8·B`` per applied push (payload only, as in every gradq experiment).

Processes: ``torch.multiprocessing.start_processes`` (from a fork server that has imported torch once,
else spawned — a calling script needs the usual ``if __name__ == "__main__":`` guard), one thread each,
a gloo group on a ``FileStore`` in a temporary folder with a timeout on every wait. The parent polls the
children; when one fails the others are terminated and :class:`AsyncRunError` carries its traceback.
The server writes the run directory (:class:`gradq.convex.runlog.RunLog`): ``step`` rows
(``iteration`` = update number, ``suboptimality``, cumulative ``bits``, ``staleness``, ``worker``,
``wall_s``) and a ``summary`` row (``staleness_mean``/``max``, ``staleness_hist``, per-worker means,
``initial``/``final_suboptimality``, ``updates_per_s``, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..errors import GradqError
from .problems import PROBLEMS, ConvexProblem, make_problem, shard
from .runlog import DivergedError, RunLog, parse_seeds, run_subdir

__all__ = ["AsyncRunError", "run_async_experiment", "add_async_arguments", "run_async", "format_table",
           "qsgd_spec", "DEFAULT_LEVELS", "DEFAULT_LR_SCALE", "DEFAULT_UPDATES"]

#: default number of QSGD levels ``s`` (``--levels``)
DEFAULT_LEVELS = 4
#: default step ``η = DEFAULT_LR_SCALE / L``: small enough for the delays of a few workers (``η·L·τ < 1``)
DEFAULT_LR_SCALE = 0.25
#: default number of server updates per run (``--updates``)
DEFAULT_UPDATES = 1000
_STOP = -1.0
_KERNEL_MIN_DIM = 4096


class AsyncRunError(GradqError, RuntimeError):
    """A server or worker process of an asynchronous run failed; the message holds its traceback."""


def qsgd_spec(levels: int) -> str:
    """The default quantizer of the experiment: ``qsgd:levels=s,norm=l2,bucket=none`` (fixed-width codes)."""
    return f"qsgd:levels={int(levels)},norm=l2,bucket=none"


# ------------------------------------------------------------------------------------------ processes
def _entry(rank: int, cfg: dict[str, Any], problem: dict[str, Any], store: str, run_dir: str) -> None:
    """Body of process ``rank`` (0 = server); started by :func:`torch.multiprocessing.start_processes`.
    Every process rebuilds the (seeded, deterministic) problem from ``problem``, the arguments of
    :func:`make_problem`, rather than receiving its tensors through shared memory."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    prob = make_problem(**problem)
    _one_kernel_thread(prob.dim)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=cfg["workers"] + 1,
                            timeout=timedelta(seconds=cfg["timeout_s"]))
    try:
        if rank == 0:
            _server(cfg, prob, Path(run_dir))
        else:
            _worker(rank, cfg, prob)
    finally:
        from ..comm import lifecycle

        lifecycle.teardown()


def _one_kernel_thread(dim: int) -> None:
    """Small vectors take the plain-torch quantizer path (same bytes as the numba kernels; loading numba
    costs each process ~1 s of CPU); large ones keep one numba thread (waking a thread pool per encode
    costs milliseconds on a busy machine)."""
    from .. import kernels

    if dim < _KERNEL_MIN_DIM:
        kernels.set_enabled(False)
    elif kernels.available():
        import numba

        numba.set_num_threads(1)


def _worker(rank: int, cfg: dict[str, Any], prob: ConvexProblem) -> None:
    """Worker ``rank``: read ``(v, x_v)``, sleep ``(rank − 1)·delay_ms``, push ``Q(∇f_B(x_v))`` tagged ``v``;
    until the server answers stop."""
    import torch.distributed as dist

    from .. import build
    from ..comm import derive_seed
    from ..errors import NonFiniteError

    q = build(cfg["compressor"])
    nbytes = q.expected_nbytes(prob.dim)
    mine = shard(prob.n_samples, cfg["workers"], rank - 1)
    gen = torch.Generator().manual_seed(derive_seed(cfg["seed"], rank, "batch"))
    sleep_s = (rank - 1) * cfg["delay_ms"] / 1000.0
    reply = torch.empty(prob.dim + 1, dtype=torch.float64)
    msg = torch.empty(8 + nbytes, dtype=torch.uint8)
    dist.recv(reply, src=0)
    step = 0
    while reply[0].item() != _STOP:
        version = int(reply[0].item())
        if sleep_s > 0:
            time.sleep(sleep_s)
        idx = mine[torch.randint(mine.numel(), (min(cfg["batch_size"], mine.numel()),), generator=gen)]
        g = prob.grad(reply[1:], idx)
        try:
            payload = q.encode(g, seed=derive_seed(cfg["seed"], rank, step))
        except NonFiniteError as e:
            raise DivergedError(
                f"worker {rank}: the gradient at server version {version} is not finite, so the run diverged; "
                f"lower the step size (lr={cfg['lr']:g}, 1/L={1 / prob.L:g})") from e
        msg[:8] = torch.tensor([version], dtype=torch.int64).view(torch.uint8)
        payload.to_bytes(out=msg[8:])
        dist.send(msg, dst=0)
        dist.recv(reply, src=0)
        step += 1


def _tag(buf: torch.Tensor) -> int:
    """The version a push was computed on: its first 8 bytes, an int64."""
    return int(buf[:8].clone().view(torch.int64).item())


def _server(cfg: dict[str, Any], prob: ConvexProblem, run_dir: Path) -> None:
    """Rank 0: hold ``x`` (from 0), apply pushes (each as it comes, or the mean of all ``K`` in sync mode),
    log every update and the summary into ``run_dir``, and stop every worker after ``updates`` updates."""
    import torch.distributed as dist
    from tqdm import tqdm

    from .. import build

    q = build(cfg["compressor"])
    K, n, lr, updates, sync = cfg["workers"], prob.dim, cfg["lr"], cfg["updates"], cfg["synchronous"]
    nbytes = q.expected_nbytes(n)
    x = torch.zeros(n, dtype=torch.float64)
    reply = torch.empty(n + 1, dtype=torch.float64)
    bufs = [torch.empty(8 + nbytes, dtype=torch.uint8) for _ in range(K + 1)]
    stale: list[int] = []
    by_worker: dict[int, list[int]] = {r: [] for r in range(1, K + 1)}
    version, bits = 0, 0
    sub0 = prob.suboptimality(x)

    def send(r: int, v: float) -> None:
        reply[0] = v
        reply[1:] = x
        dist.send(reply, dst=r)

    def unpack(buf: torch.Tensor) -> tuple[int, torch.Tensor]:
        v = _tag(buf)
        if not 0 <= v <= version:
            raise RuntimeError(f"server: a push is tagged with version {v}, the server is at {version}")
        return v, q.decode(q.payload_from_bytes(buf[8:], (n,), torch.float32)).to(torch.float64)

    config = {k: v for k, v in cfg.items() if k != "progress"}
    bar_cm = tqdm(total=updates, desc=cfg["label"], leave=False, disable=None) if cfg["progress"] else nullcontext()
    with RunLog(run_dir, config) as log, bar_cm as bar:
        t0 = time.perf_counter()
        for r in range(1, K + 1):
            send(r, 0.0)
        while version < updates:
            if sync:  # one push from every worker, all computed on x_version; their mean is applied
                grads = []
                for r in range(1, K + 1):
                    dist.recv(bufs[r], src=r)
                    v, g = unpack(bufs[r])
                    grads.append(g)
                    stale.append(version - v)
                    by_worker[r].append(stale[-1])
                step_g, tau, who = torch.stack(grads).mean(dim=0), max(stale[-K:]), None
                bits += 8 * nbytes * K
            else:
                who = int(dist.recv(bufs[0]))
                v, step_g = unpack(bufs[0])
                tau = version - v
                stale.append(tau)
                by_worker[who].append(tau)
                bits += 8 * nbytes
            x -= lr * step_g
            version += 1
            log.row(kind="step", iteration=version, suboptimality=prob.suboptimality(x), bits=bits,
                    staleness=tau, worker=who, wall_s=time.perf_counter() - t0)
            if bar is not None:
                bar.update(1)
            done = version >= updates
            for r in (range(1, K + 1) if sync else [who]):
                send(r, _STOP if done else float(version))
        wall = time.perf_counter() - t0
        dropped = []  # every other worker has one push in flight: take it (not applied), answer stop
        for _ in range(0 if sync else K - 1):
            r = int(dist.recv(bufs[0]))
            dropped.append(version - _tag(bufs[0]))
            send(r, _STOP)
        hist = Counter(stale)
        final = prob.suboptimality(x)
        log.summary(label=cfg["label"], seed=cfg["seed"], mode="sync" if sync else "async",
                    workers=K, lr=lr, updates=version, gradients_applied=len(stale),
                    pushes_discarded=len(dropped), staleness_discarded=dropped, push_bytes=nbytes, bits=bits,
                    initial_suboptimality=sub0, final_suboptimality=final,
                    reduction=sub0 / final if final > 0 else None,
                    staleness_mean=sum(stale) / len(stale), staleness_max=max(stale),
                    staleness_hist={str(k): hist[k] for k in sorted(hist)},
                    staleness_mean_by_worker={str(r): (sum(s) / len(s) if s else None) for r, s in by_worker.items()},
                    pushes_by_worker={str(r): len(s) for r, s in by_worker.items()},
                    wall_s=wall, updates_per_s=version / wall if wall > 0 else None)


# ---------------------------------------------------------------------------------------------- parent
def _check(workers: int, lr: Optional[float], updates: int, delay_ms: float, batch_size: int,
           timeout_s: float, start_method: str) -> None:
    for name, v in (("workers", workers), ("updates", updates), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive finite step size (or None for {DEFAULT_LR_SCALE}/L), got {lr!r}")
    if not (isinstance(delay_ms, (int, float)) and math.isfinite(delay_ms) and delay_ms >= 0):
        raise ValueError(f"delay_ms must be a finite number of milliseconds >= 0, got {delay_ms!r}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    if start_method not in (None, "spawn", "forkserver"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn' (or None for the default), got "
                         f"{start_method!r}; 'fork' is not offered: a forked child of a process that has run "
                         "multithreaded kernels can deadlock")


def _label(spec: str, synchronous: bool, delay_ms: float) -> str:
    """Display name: ``"async QSGD s=4"`` for the default quantizer, else ``"async <spec>"``; plus the delay."""
    from .. import build

    q = build(spec)
    s = q.get_params().get("levels") if q.name == "qsgd" else None
    name = f"QSGD s={s}" if s and q.spec == build(qsgd_spec(s)).spec else q.spec
    return f"{'sync' if synchronous else 'async'} {name}" + (f", delay {delay_ms:g} ms" if delay_ms else "")


def run_async_experiment(problem_name: str, *, workers: int = 4, spec: Optional[str] = None,
                         lr: Optional[float] = None, updates: int = DEFAULT_UPDATES, seed: int = 0,
                         delay_ms: float = 0.0, synchronous: bool = False, out: Optional[str | os.PathLike] = None,
                         batch_size: int = 16, n_samples: Optional[int] = None, dim: Optional[int] = None,
                         label: Optional[str] = None, force: bool = False, progress: bool = False,
                         timeout_s: float = 60.0, start_method: Optional[str] = None) -> dict[str, Any]:
    """Run QSGD on a parameter server with ``workers`` worker processes; returns the summary row.

    Args:
        problem_name: one of :data:`gradq.convex.problems.PROBLEMS` (built with ``seed``, ``n_samples``, ``dim``).
        workers: number of worker processes ``K`` (default 4); the server is one more process.
        spec: gradq spec of the quantizer (default ``qsgd:levels=4,norm=l2,bucket=none``); its payload
            size must be fixed (``coding=fixed``).
        lr: step size ``η`` (default ``0.25/L``).
        updates: server updates before stopping (default 1000); in sync mode each averages ``K`` pushes.
        seed: seeds the problem data, the minibatches and the quantizer's randomness.
        delay_ms: worker ``r`` sleeps ``(r−1)·delay_ms`` ms before each gradient (default 0).
        synchronous: the baseline: wait for all ``K`` pushes and apply their mean (staleness 0).
        out: parent folder of the run directory ``out/<label>-s<seed>`` (default: a temporary folder,
            deleted afterwards; ``run_dir`` in the result is then ``None``).
        batch_size: samples per stochastic gradient (default 16).
        label: display name (default e.g. ``"async QSGD s=4"``).
        force: overwrite a run directory that already holds a log (default: refuse).
        progress: tqdm bar of the server's updates (default off).
        timeout_s: longest wait on any message before a process gives up (default 60 s).
        start_method: ``forkserver`` (default where the platform has it, else ``spawn``) or ``spawn``.
            The fork server imports torch once and forks clean children from it, so later runs start in
            a fraction of a second; plain ``fork`` is refused (children of a parent that has run
            multithreaded kernels can deadlock).
    Returns:
        the summary row (see the module docstring) plus ``run_dir``.
    Raises:
        ValueError: a bad argument (the message says which and what is allowed).
        FileExistsError: the run directory holds a log and ``force`` is false.
        AsyncRunError: a process failed (its traceback is in the message) or hung past ``timeout_s``.
    """
    import torch.multiprocessing as mp

    from .. import build

    _check(workers, lr, updates, delay_ms, batch_size, timeout_s, start_method)
    if problem_name not in PROBLEMS:
        raise ValueError(f"unknown convex problem {problem_name!r}; choose one of: {', '.join(PROBLEMS)}")
    problem = dict(name=problem_name, seed=seed, n_samples=n_samples, dim=dim)
    prob = make_problem(**problem)
    if prob.n_samples < workers:
        raise ValueError(f"{problem_name} has {prob.n_samples} samples, fewer than workers={workers}")
    spec = spec or qsgd_spec(DEFAULT_LEVELS)
    q = build(spec)
    if q.expected_nbytes(prob.dim) is None:
        raise ValueError(f"{q.spec}: the payload size depends on the data; the parameter server needs a fixed "
                         "size (use coding=fixed)")
    lr = DEFAULT_LR_SCALE / prob.L if lr is None else float(lr)
    label = label or _label(spec, synchronous, delay_ms)
    tmp = Path(tempfile.mkdtemp(prefix="gradq-async-"))
    run_dir = tmp / "run" if out is None else run_subdir(out, label, seed=seed)
    if out is not None and (run_dir / "log.jsonl").exists() and not force:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileExistsError(f"{run_dir} already holds a run; remove it, choose another out, or pass force=True "
                              "(--force)")
    cfg = dict(label=label, compressor=q.spec, experiment="async", problem=problem_name, workers=workers, seed=seed,
               lr=lr, updates=updates, delay_ms=float(delay_ms), synchronous=bool(synchronous), batch_size=batch_size,
               n_samples=prob.n_samples, dim=prob.dim, L=prob.L, mu=prob.mu, timeout_s=float(timeout_s),
               progress=bool(progress))  # all but "progress" go to config.json
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method == "forkserver":  # the fork server imports torch and this module once, not per run
        mp.get_context("forkserver").set_forkserver_preload(["torch", __name__])
    ctx = None
    try:
        ctx = mp.start_processes(_entry, args=(cfg, problem, str(tmp / "store"), str(run_dir)), nprocs=workers + 1,
                                 join=False, start_method=start_method)
        try:
            while not ctx.join(timeout=0.1):
                pass
        except mp.ProcessRaisedException as e:
            who = "server" if e.error_index == 0 else f"worker {e.error_index}"
            last = str(e).strip().splitlines()[-1] if str(e).strip() else "?"
            if "Timed out" in last:
                last += f" (a message took longer than timeout_s={timeout_s:g} s; raise it or lower delay_ms)"
            raise AsyncRunError(f"async run {label!r}: the {who} failed: {last}\n\n{e}") from None
        except mp.ProcessExitedException as e:
            who = "server" if e.error_index == 0 else f"worker {e.error_index}"
            raise AsyncRunError(f"async run {label!r}: the {who} exited with code {e.exit_code}") from None
        lines = (run_dir / "log.jsonl").read_text(encoding="utf-8").strip().splitlines()
        summary = json.loads(lines[-1])
        summary["run_dir"] = None if out is None else str(run_dir)
        return summary
    finally:
        if ctx is not None:
            stop_processes(ctx.processes)   # (only after a failure: the others may wait on the failed one)
        shutil.rmtree(tmp, ignore_errors=True)


def stop_processes(processes: Sequence[Any], grace: float = 5.0) -> None:
    """Stop the processes still alive: SIGTERM, ``grace`` seconds to exit, then SIGKILL for any that
    ignored it, so that no process is left behind."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    for p in alive:
        p.join(grace)
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(grace)


# ------------------------------------------------------------------------------------------------- CLI
def add_async_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``gradq convex async`` options to ``parser`` (every default is in its help)."""
    parser.add_argument("--problem", default="lsq-synthetic", choices=PROBLEMS,
                        help="convex problem (default lsq-synthetic)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes K (default 4)")
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--levels", type=int, default=None,
                   help=f"QSGD levels s, i.e. qsgd:levels=s,norm=l2,bucket=none (default {DEFAULT_LEVELS})")
    g.add_argument("--spec", default=None, help="any gradq spec with a fixed payload size, instead of --levels")
    parser.add_argument("--lr", type=float, default=None, help=f"step size (default {DEFAULT_LR_SCALE}/L)")
    parser.add_argument("--updates", type=int, default=DEFAULT_UPDATES,
                        help=f"server updates per run (default {DEFAULT_UPDATES})")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per stochastic gradient (default 16)")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="worker r sleeps (r-1)*DELAY ms before each gradient (default 0)")
    parser.add_argument("--sync", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the synchronous baseline (mean of K pushes per update); "
                             "--no-sync skips it (default: on)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--out", default="runs/convex/async", metavar="DIR",
                        help="folder for the run directories and report.md (default runs/convex/async)")
    parser.add_argument("--force", action="store_true", help="overwrite run directories that hold logs")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or per-run lines")


def run_async(args: argparse.Namespace) -> int:
    """``gradq convex async``: the asynchronous run and (unless ``--no-sync``) the synchronous baseline
    for every seed, a table of the summaries, and ``report.md`` with figures in ``--out``."""
    from ..train.report import write_report

    if args.levels is not None and not 1 <= args.levels <= 127:
        raise ValueError(f"--levels must be in 1..127 for fixed-width codes, got {args.levels}")
    spec = args.spec or qsgd_spec(args.levels if args.levels is not None else DEFAULT_LEVELS)
    plan = [(sync, seed) for sync in ([False, True] if args.sync else [False]) for seed in parse_seeds(args.seeds, [])]
    for sync, seed in plan:  # refuse before running anything
        d = run_subdir(args.out, _label(spec, sync, args.delay_ms), seed=seed)
        if (d / "log.jsonl").exists() and not args.force:
            raise FileExistsError(f"{d} already holds a run; remove it, choose another --out, or pass --force")
    results = []
    for i, (sync, seed) in enumerate(plan):
        if not args.quiet:
            print(f"[{i + 1}/{len(plan)}] {_label(spec, sync, args.delay_ms)} on {args.problem}, {args.workers} "
                  f"workers, seed {seed}", flush=True)
        results.append(run_async_experiment(
            args.problem, workers=args.workers, spec=spec, lr=args.lr, updates=args.updates, seed=seed,
            delay_ms=args.delay_ms, synchronous=sync, out=args.out, batch_size=args.batch_size, force=True,
            progress=not args.quiet))
    print(format_table(results))
    md, figs = write_report([args.out], target=None)
    print(f"report: {md}" + (f" ({len(figs)} figures)" if figs else ""))
    return 0


def format_table(results: list[dict[str, Any]]) -> str:
    """Plain-text table of summary rows: label, seed, updates, pushes applied, suboptimality before and
    after, staleness mean/max, server updates per second and megabits pushed."""
    def num(v: Any, fmt: str) -> str:
        return "nan" if v is None else format(v, fmt)

    head = ("label", "seed", "updates", "pushes", "subopt. start", "subopt. final", "stale mean", "stale max",
            "updates/s", "Mbit pushed")
    rows = [(str(r["label"]), str(r["seed"]), str(r["updates"]), str(r["gradients_applied"]),
             num(r["initial_suboptimality"], ".3g"), num(r["final_suboptimality"], ".3g"),
             num(r["staleness_mean"], ".2f"), str(r["staleness_max"]), num(r["updates_per_s"], ".0f"),
             num(r["bits"] / 1e6, ".3f")) for r in results]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) if j == 0 else c.rjust(w)  # noqa: E731
                                   for j, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])
