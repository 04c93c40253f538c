"""Long run of the DDP hook: flat memory over thousands of steps, and a bit-exact checkpoint/resume.

Two gloo ranks on the CPU (``file://`` rendezvous in a temporary directory, one torch and one numba
thread per rank) train a small MLP, 64-256-256-10, with momentum SGD through
``gradq.register(model, spec, min_numel=...)``. With the default ``min_numel=10000`` the two large
weights (16 384 and 65 536 values) are quantized and the classifier (2 560) and the biases stay
float32. The default spec, ``ef(qsgd:bits=4,bucket=512)``, has error feedback, so the hook state in
the checkpoint carries residuals. Each rank draws its own synthetic batch from a seed fixed by
(rank, step): 32 inputs ``x ~ N(0, I_64)`` labelled by a fixed random linear teacher.

Two runs, one after the other in the same two processes:

a. **uninterrupted**: ``--steps`` steps. Each rank reads its resident set size (``/proc/self/statm``,
   after a ``gc.collect()``) when ``--warmup`` steps are done (the baseline: allocator pools, numba
   code and DDP's rebuilt buckets are in place by then), every ``--sample-every`` steps after that,
   and at the end. Growth = RSS at the end − RSS at warm-up; max growth = the largest sample − RSS at
   warm-up (MB = 10^6 bytes). The time per step after warm-up and the hook's share of it
   (``GradqState.totals``) are reported too.
b. **resumed**: the same run stopped after ``--checkpoint-at`` steps; model, optimizer (with its
   momentum buffers) and ``GradqState.state_dict()`` (step and residuals) go to a file with
   ``torch.save``; the DDP model, the hook state and the optimizer are dropped, fresh ones are built
   on the same process group, the checkpoint is loaded and the run continues to ``--steps``.

Each rank then checks with ``torch.equal`` that its final parameters of (b) equal those of (a), and,
by an ``all_gather`` of the flat parameter vector, that both ranks hold identical parameters after
(a) and after (b). The ranks write their figures to JSON files in the temporary directory; the parent
prints the table and exits 1 if the resume is not bit-exact, the replicas differ, or (with
``--max-growth-mb``) the memory grew more than allowed.

Each rank starts and ends as gradq.comm.lifecycle asks (``before_init()`` before the group,
``gradq.teardown()`` at the end), for a clean exit.

    python benchmarks/long_run.py [--steps 2000] [--warmup 200] [--checkpoint-at 1000]
        [--spec "ef(qsgd:bits=4,bucket=512)"] [--sample-every 250] [--json FILE]

``run(...)`` is the reusable part (tests/test_long_run.py runs a short version through it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD = 2
BATCH = 32
SIZES = (64, 256, 256, 10)
DEFAULT_SPEC = "ef(qsgd:bits=4,bucket=512)"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# ---------------------------------------------------------------------------------------------------
# helpers (run inside each rank)
# ---------------------------------------------------------------------------------------------------
def rss_mb() -> float:
    """This process's current resident set size in MB (10^6 bytes), from ``/proc/self/statm``.

    Where /proc is missing, falls back to ``ru_maxrss`` — the PEAK resident size, which can only
    overstate the growth, never hide it."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 1e6
    except OSError:
        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e6


def net() -> torch.nn.Module:
    """The MLP 64-256-256-10 with ReLUs, initialised from seed 0 (same on every rank)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(a, b))
    return torch.nn.Sequential(*layers)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: a pure function of (rank, step), so runs can be replayed."""
    teacher = torch.randn(SIZES[0], SIZES[-1], generator=torch.Generator().manual_seed(12345))
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    x = torch.randn(BATCH, SIZES[0], generator=g)
    return x, (x @ teacher).argmax(1)


def build(spec: str, min_numel: int) -> tuple[DDP, Any, torch.optim.Optimizer]:
    """A fresh DDP model with the gradq hook registered and its momentum-SGD optimizer."""
    import gradq

    model = DDP(net())
    state = gradq.register(model, spec, min_numel=min_numel, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, state, opt


def train_step(model: DDP, opt: torch.optim.Optimizer, rank: int, step: int) -> float:
    """One step: zero the gradients, forward, backward through the hook, optimizer step; the loss."""
    x, y = batch(rank, step)
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def flat_params(model: DDP) -> torch.Tensor:
    """A copy of all parameters, concatenated in model order."""
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def replicas_identical(flat: torch.Tensor) -> bool:
    """Whether every rank holds this exact vector (all_gather, then torch.equal)."""
    got = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(got, flat)
    return all(torch.equal(got[0], g) for g in got[1:])


def _sample(samples: list[tuple[int, float]], step: int) -> float:
    gc.collect()
    mb = rss_mb()
    samples.append((step, mb))
    return mb


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """One rank: run (a), run (b), compare, write ``result{rank}.json`` into ``cfg['tmpdir']``."""
    import gradq
    from gradq.comm import lifecycle

    torch.set_num_threads(1)
    tmp = cfg["tmpdir"]
    lifecycle.before_init()  # torch._dynamo before the group, so that teardown joins gloo's threads
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world)
    steps, warmup, split = cfg["steps"], cfg["warmup"], cfg["checkpoint_at"]
    spec, min_numel, every = cfg["spec"], cfg["min_numel"], cfg["sample_every"]
    leak: list[bytearray] = []  # only with cfg["leak_bytes_per_step"] > 0: a deliberate leak (self-test)
    res: dict[str, Any] = {"rank": rank}

    # (a) uninterrupted, with RSS samples
    model, state, opt = build(spec, min_numel)
    samples: list[tuple[int, float]] = []
    losses = []
    dist.barrier()
    t0 = time.perf_counter()
    for s in range(steps):
        losses.append(train_step(model, opt, rank, s))
        if cfg["leak_bytes_per_step"]:
            leak.append(bytearray(b"\1" * cfg["leak_bytes_per_step"]))
        done = s + 1
        if done == warmup:
            t_warm, hook_warm = time.perf_counter(), dict(state.totals)
        if done == warmup or (done > warmup and ((done - warmup) % every == 0 or done == steps)):
            _sample(samples, done)
    t_end = time.perf_counter()
    seconds = t_end - t0
    base = samples[0][1]
    res.update(seconds=seconds, rss_samples=samples, rss_warmup_mb=base, rss_end_mb=samples[-1][1],
               growth_mb=samples[-1][1] - base, max_growth_mb=max(mb for _, mb in samples) - base,
               loss_first=losses[0], loss_last50=sum(losses[-50:]) / len(losses[-50:]),
               quantized_coords=state.last_stats["quantized_coords"], coords=state.last_stats["coords"],
               bits_per_coord=state.last_stats["bits_per_coord"], strategy=state.strategy_used,
               hook_step_a=state.step)
    # time per step after warm-up (numba's first calls and DDP's bucket rebuild excluded), and the
    # hook's share of it (GradqState.totals: time in the hook, of which encode / waiting / decode)
    n = steps - warmup
    res["ms_per_step_after_warmup"] = 1e3 * (t_end - t_warm) / n if n else float("nan")
    res["hook_ms_per_step_after_warmup"] = {
        k.replace("_seconds", ""): 1e3 * (state.totals[k] - hook_warm.get(k, 0.0)) / n if n else float("nan")
        for k in ("seconds", "encode_seconds", "comm_seconds", "decode_seconds")}
    final_a = flat_params(model)
    res["replicas_identical_a"] = replicas_identical(final_a)
    del model, state, opt
    leak.clear()
    gc.collect()

    # (b) stop at the checkpoint, tear down, rebuild, load, continue
    model, state, opt = build(spec, min_numel)
    for s in range(split):
        train_step(model, opt, rank, s)
    path = os.path.join(tmp, f"ckpt{rank}.pt")
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, path)
    del model, state, opt
    gc.collect()
    ck = torch.load(path)
    res["checkpoint_step"] = ck["hook"]["step"]
    res["checkpoint_residuals"] = {k: v.numel() for k, v in ck["hook"]["residuals"].items()}
    res["checkpoint_residual_norm"] = float(sum(float(v.double().square().sum())
                                                for v in ck["hook"]["residuals"].values()) ** 0.5)
    model, state, opt = build(spec, min_numel)
    model.module.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["hook"])
    del ck
    for s in range(split, steps):
        train_step(model, opt, rank, s)
    final_b = flat_params(model)
    res["hook_step_b"] = state.step
    res["resume_bit_exact"] = torch.equal(final_a, final_b)
    res["resume_max_abs_diff"] = float((final_a - final_b).abs().max())
    res["replicas_identical_b"] = replicas_identical(final_b)
    res["rss_after_b_mb"] = rss_mb()
    with open(os.path.join(tmp, f"result{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    del model, state, opt
    gradq.teardown()  # gradq's threads, garbage, then the group: a clean exit (gradq.comm.lifecycle)


# ---------------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------------
def run(steps: int = 2000, warmup: int = 200, checkpoint_at: Optional[int] = None, spec: str = DEFAULT_SPEC,
        tmpdir: Optional[str] = None, *, sample_every: int = 250, min_numel: int = 10_000,
        leak_bytes_per_step: int = 0) -> dict[str, Any]:
    """Spawn the two ranks, run (a) and (b), and return the figures.

    Returns ``{"steps", "warmup", "checkpoint_at", "spec", "wall_seconds", "seconds" (run (a), the
    slower rank), "steps_per_s", "ranks": [per-rank dicts], "growth_mb" / "max_growth_mb" (the larger
    over the ranks), "resume_bit_exact", "replicas_identical" (all ranks, runs (a) and (b))}``.
    ``tmpdir`` must be empty or new (the rendezvous file goes there); ``None``: a temporary directory.
    ``leak_bytes_per_step`` makes every rank keep that many extra bytes per step of run (a), to check
    that the measurement sees a leak. NUMBA_NUM_THREADS and OMP_NUM_THREADS are set to 1 for the ranks
    (and restored afterwards in this process).
    """
    checkpoint_at = steps // 2 if checkpoint_at is None else checkpoint_at
    if not 0 < warmup <= steps:
        raise ValueError(f"need 0 < warmup <= steps, got warmup={warmup}, steps={steps}")
    if not 0 < checkpoint_at < steps:
        raise ValueError(f"need 0 < checkpoint_at < steps, got checkpoint_at={checkpoint_at}, steps={steps}")
    if sample_every <= 0:
        raise ValueError("sample_every must be positive")
    with tempfile.TemporaryDirectory(prefix="gradq-long-run-") as own:
        tmp = tmpdir or own
        os.makedirs(tmp, exist_ok=True)
        cfg = {"steps": steps, "warmup": warmup, "checkpoint_at": checkpoint_at, "spec": spec, "tmpdir": tmp,
               "sample_every": sample_every, "min_numel": min_numel, "leak_bytes_per_step": leak_bytes_per_step}
        saved = {k: os.environ.get(k) for k in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")}
        os.environ.update(NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")
        t0 = time.perf_counter()
        try:
            mp.spawn(_worker, args=(WORLD, cfg), nprocs=WORLD, join=True)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        wall = time.perf_counter() - t0
        ranks = []
        for r in range(WORLD):
            with open(os.path.join(tmp, f"result{r}.json")) as f:
                ranks.append(json.load(f))
    seconds = max(r["seconds"] for r in ranks)
    return {"steps": steps, "warmup": warmup, "checkpoint_at": checkpoint_at, "spec": spec,
            "min_numel": min_numel, "world": WORLD, "torch": torch.__version__, "cores": os.cpu_count(),
            "wall_seconds": wall, "seconds": seconds, "steps_per_s": steps / seconds, "ranks": ranks,
            "growth_mb": max(r["growth_mb"] for r in ranks),
            "max_growth_mb": max(r["max_growth_mb"] for r in ranks),
            "resume_bit_exact": all(r["resume_bit_exact"] for r in ranks),
            "replicas_identical": all(r["replicas_identical_a"] and r["replicas_identical_b"] for r in ranks)}


def table(res: dict[str, Any]) -> str:
    """The figures of :func:`run` as a short text table (one row per rank, then the verdicts)."""
    r0 = res["ranks"][0]
    yn = {True: "yes", False: "NO"}
    lines = [f"long run: {res['spec']}, {res['world']} gloo ranks (CPU, 1 thread each), MLP "
             f"{'-'.join(map(str, SIZES))}, min_numel={res['min_numel']}, strategy {r0['strategy']}, "
             f"{r0['quantized_coords']}/{r0['coords']} coords quantized, {r0['bits_per_coord']:.2f} bits/coord; "
             f"torch {res['torch']}, {res['cores']} cores",
             f"  steps {res['steps']}, warm-up {res['warmup']}, checkpoint at {res['checkpoint_at']}; "
             f"run (a) {res['seconds']:.1f} s = {res['steps_per_s']:.0f} steps/s; "
             f"both runs + spawn {res['wall_seconds']:.1f} s; loss {r0['loss_first']:.3f} -> "
             f"{r0['loss_last50']:.3f} (rank 0, mean of last 50)",
             f"  after warm-up: {r0['ms_per_step_after_warmup']:.1f} ms/step (rank 0), of which the hook "
             + "{seconds:.1f} ms (encode {encode:.1f}, waiting for the other rank {comm:.1f}, decode {decode:.1f})"
             .format(**r0["hook_ms_per_step_after_warmup"]),
             "",
             "| rank | RSS at warm-up (MB) | RSS at end (MB) | growth (MB) | max growth (MB) | samples |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in res["ranks"]:
        lines.append(f"| {r['rank']} | {r['rss_warmup_mb']:.2f} | {r['rss_end_mb']:.2f} | {r['growth_mb']:+.2f} "
                     f"| {r['max_growth_mb']:+.2f} | {len(r['rss_samples'])} |")
    res_keys = sorted(r0["checkpoint_residuals"])
    lines += ["",
              f"  checkpoint at step {r0['checkpoint_step']}: residuals {res_keys} "
              f"({sum(r0['checkpoint_residuals'].values())} values, norm {r0['checkpoint_residual_norm']:.3g})",
              f"  resume bit-exact: {yn[res['resume_bit_exact']]} (max |diff| "
              f"{max(r['resume_max_abs_diff'] for r in res['ranks']):.3g})",
              f"  replicas identical: {yn[res['replicas_identical']]}"]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    ap.add_argument("--warmup", type=int, default=200, help="steps before the RSS baseline (default 200)")
    ap.add_argument("--checkpoint-at", type=int, default=None, help="step of the checkpoint (default steps//2)")
    ap.add_argument("--spec", default=DEFAULT_SPEC, help=f"gradq spec (default {DEFAULT_SPEC})")
    ap.add_argument("--min-numel", type=int, default=10_000, help="tensors below this stay fp32 (default 10000)")
    ap.add_argument("--sample-every", type=int, default=250, help="RSS sample period after warm-up (default 250)")
    ap.add_argument("--max-growth-mb", type=float, default=None,
                    help="also exit 1 if the RSS of a rank grew more than this after warm-up")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    try:
        res = run(args.steps, args.warmup, args.checkpoint_at, args.spec, sample_every=args.sample_every,
                  min_numel=args.min_numel)
    except ValueError as e:  # bad step counts: say so like any other bad option
        ap.error(str(e))
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    ok = res["resume_bit_exact"] and res["replicas_identical"]
    if args.max_growth_mb is not None and res["max_growth_mb"] > args.max_growth_mb:
        print(f"long_run: RSS grew {res['max_growth_mb']:.2f} MB > --max-growth-mb {args.max_growth_mb}")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
