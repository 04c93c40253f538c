"""A whole DDP training step with gradq's hook against its parts measured alone, in one run.

For ``--world`` gloo ranks (loopback, or with ``--network RATE`` and root one network namespace per
rank on emulated links, ``gradq.netem``), on a model (``--model``), each rank measures, as medians over
``--repeats`` steps after warm-up (every time is the MAX over ranks, gathered after the timing):

* ``compute``   the local forward + backward pass, no DDP, no communication;
* ``protocol``  the raw call of the protocol the hook uses (``gradq.comm.average``; ``--protocol`` for
                another) on the same gradient, flattened into one tensor (what a sequential
                "compute, then communicate" step costs);
* ``allreduce`` gloo's float32 ``all_reduce`` of that flat gradient;
* ``sequence``  ``compute`` then ``protocol``, timed as one sequence after one barrier (a sequential
                step as training would run it: the ranks reach the protocol at their own times, as
                they reach the hook's collectives inside a DDP step);
* ``step ddp``  a DDP step (forward + backward) with DDP's own float32 averaging;
* ``step hook`` a DDP step with ``gradq.register(ddp, SPEC)``;
* ``step idle`` a DDP step whose hook leaves the bucket as it is (DDP's own machinery, no
                communication): ``step hook − step idle`` is what the hook costs the step, to set
                against ``protocol``.

The cases are interleaved (one of each per repeat, each after a barrier), so that a drift of the
machine or of the emulated link affects all of them alike.

It prints ``step hook / (compute + protocol)`` (below 1: the hook hides communication behind the
backward pass) beside DDP's own ``step ddp / (compute + allreduce)`` (what DDP's machinery adds to a
bare all-reduce), the speed-ups of the hook's step and of the protocol over their float32 counterparts,
and the communication each step adds to ``compute`` (``step − compute``): the hook's against DDP's.

    python benchmarks/bench_hook_step.py [--network 1gbit] [--world 2] [--model deep|wide|demo]
        [--spec qsgd:bits=4,bucket=512] [--bucket-mb MB] [--repeats 20] [--json FILE]

Models: ``deep`` (5 layers 1024 wide, 4.2M parameters, batch 32), ``wide`` (gradq's ``mlp-wide``,
784-2048-2048-10, 5.8M parameters, batch 16) and ``demo`` (the ``make demo`` MLP on digits, batch 32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

HERE = os.path.abspath(__file__)


def _model(name: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if name == "deep":
        layers: list[torch.nn.Module] = []
        for _ in range(5):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        m: torch.nn.Module = torch.nn.Sequential(*layers[:-1])
        x, y = torch.randn(32, 1024), torch.randint(0, 1024, (32,))
        return m, x, y
    from gradq.train.models import build_model

    if name == "wide":
        m = build_model("mlp-wide", 784, 10, None, seed=0)
        return m, torch.randn(16, 784), torch.randint(0, 10, (16,))
    if name == "demo":
        m = build_model("mlp", 64, 10, None, seed=0)
        return m, torch.randn(32, 64), torch.randint(0, 10, (32,))
    raise SystemExit(f"unknown --model {name!r} (deep, wide, demo)")


def _median_over_ranks(times: list[float]) -> float:
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def worker(args: argparse.Namespace) -> None:
    from gradq.comm import lifecycle

    lifecycle.before_init()
    dist.init_process_group("gloo")
    try:
        _measure(args)
    finally:
        lifecycle.teardown()


def _measure(args: argparse.Namespace) -> None:
    import gradq
    from gradq.comm.api import average
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    loss_fn = torch.nn.functional.cross_entropy
    model, x, y = _model(args.model)
    q = gradq.build(args.spec)
    cap = {} if args.bucket_mb is None else {"bucket_cap_mb": args.bucket_mb}
    base, _, _ = _model(args.model)
    ddp_base = DDP(base, **cap)
    hooked, _, _ = _model(args.model)
    ddp = DDP(hooked, **cap)
    state = gradq.register(ddp, args.spec)
    idle, _, _ = _model(args.model)
    ddp_idle = DDP(idle, **cap)  # DDP's machinery alone: a hook that leaves the bucket as it is

    def no_comm(_, bucket):  # (unannotated: DDP checks real annotations, and this module's are strings)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp_idle.register_comm_hook(None, no_comm)
    # the raw call of the protocol the hook uses (with 2 ranks it all-gathers what choose_protocol
    # would scatter), or the one asked for
    protocol = args.protocol or state._resolve_strategy(world)
    seed = [0]
    stats: list[dict[str, Any]] = []

    def local_step() -> None:
        model.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()

    local_step()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    def proto() -> None:
        seed[0] += 1
        average(flat.clone(), q, protocol, seed=seed[0], verify=False)

    def sequence() -> None:  # compute, then communicate: the sequential step the hook is set against
        local_step()
        seed[0] += 1
        average(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), q, protocol, seed=seed[0], verify=False)

    def step(m: DDP) -> Callable[[], None]:
        def run() -> None:
            m.zero_grad(set_to_none=False)
            loss_fn(m(x), y).backward()
            if m is ddp:
                stats.append(dict(state.last_stats))
        return run

    cases = {"compute_s": local_step, "protocol_s": proto, "allreduce_s": lambda: dist.all_reduce(flat.clone()),
             "sequence_s": sequence,
             "step_ddp_s": step(ddp_base), "step_hook_s": step(ddp), "step_idle_s": step(ddp_idle)}
    for fn in cases.values():  # warm-up (the hook's first step also learns its groups)
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleaved, so that a drift of the machine or the link hits every case
        for k, fn in cases.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    res = {k: _median_over_ranks(v) for k, v in times.items()}
    phases = {k: statistics.median(s_.get(k, 0.0) for s_ in stats[-args.repeats:])
              for k in ("seconds", "wait_seconds", "encode_seconds", "comm_seconds", "decode_seconds")}
    if rank == 0:
        res.update(model=args.model, spec=args.spec, world=world, protocol=protocol,
                   parameters=sum(p.numel() for p in model.parameters()), bucket_mb=args.bucket_mb,
                   hook_groups=state.last_stats.get("groups"), hook_bits_per_coord=state.last_stats["bits_per_coord"],
                   hook_phases_rank0=phases)
        with open(args.results, "w") as f:
            json.dump(res, f)


def table(r: dict[str, Any], title: str) -> str:
    ms = lambda k: f"{1e3 * r[k]:.1f}"  # noqa: E731
    seq = r["compute_s"] + r["protocol_s"]
    comm_hook = max(r["step_hook_s"] - r["compute_s"], 0.0)
    comm_ddp = max(r["step_ddp_s"] - r["compute_s"], 0.0)
    lines = [f"### {title}", "",
             "| compute | protocol | fp32 all_reduce | step, DDP no communication | step, DDP fp32 | step, gradq hook |",
             "|---:|---:|---:|---:|---:|---:|",
             f"| {ms('compute_s')} | {ms('protocol_s')} | {ms('allreduce_s')} | {ms('step_idle_s')} | {ms('step_ddp_s')} "
             f"| {ms('step_hook_s')} |",
             "", "(median ms, max over ranks)", "",
             f"- hook step / (compute + protocol) = {r['step_hook_s']:.4f} / {seq:.4f} = **{r['step_hook_s'] / seq:.2f}**"
             f" (DDP's own, step / (compute + fp32 all_reduce): "
             f"{r['step_ddp_s'] / (r['compute_s'] + r['allreduce_s']):.2f})",
             f"- hook step / (compute, then protocol, timed as one sequence) = {r['step_hook_s']:.4f} / "
             f"{r['sequence_s']:.4f} = **{r['step_hook_s'] / r['sequence_s']:.2f}**",
             f"- hook step − DDP step without communication = {1e3 * (r['step_hook_s'] - r['step_idle_s']):.1f} ms "
             f"against the protocol's {ms('protocol_s')} ms: "
             f"**{(r['step_hook_s'] - r['step_idle_s']) / r['protocol_s']:.2f}×** (DDP's own against the fp32 "
             f"all_reduce: {(r['step_ddp_s'] - r['step_idle_s']) / r['allreduce_s']:.2f}×)",
             f"- step speed-up over DDP fp32 = {r['step_ddp_s'] / r['step_hook_s']:.2f}×; protocol speed-up over "
             f"the fp32 all_reduce = {r['allreduce_s'] / r['protocol_s']:.2f}×",
             f"- communication added to compute: hook {1e3 * comm_hook:.1f} ms, DDP {1e3 * comm_ddp:.1f} ms "
             f"(ratio {comm_hook / comm_ddp if comm_ddp > 0 else float('inf'):.2f})",
             "- the hook on rank 0 (median s): " + ", ".join(f"{k} {v:.4f}" for k, v in r["hook_phases_rank0"].items())
             + f"; {r['hook_groups']} groups"]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--network", default=None, help="emulate links of this rate (e.g. 1gbit; needs root)")
    ap.add_argument("--world", type=int, default=2, help="number of ranks (default 2)")
    ap.add_argument("--model", default="deep", help="deep (default), wide or demo")
    ap.add_argument("--spec", default="qsgd:bits=4,bucket=512", help="gradq spec (default 4-bit QSGD)")
    ap.add_argument("--repeats", type=int, default=20, help="timed steps per case (default 20)")
    ap.add_argument("--threads", type=int, default=None, help="threads per rank (default cores / world)")
    ap.add_argument("--protocol", default=None, choices=["scatter", "allgather", "allreduce", "ps"],
                    help="the raw protocol timed against the hook (default: the one the hook uses)")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="DDP's bucket_cap_mb for both DDP steps (default DDP's 25; smaller buckets overlap more)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are stopped")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.world < 2 or args.repeats < 1:
        ap.error("--world must be at least 2 and --repeats at least 1")
    from gradq.netem import launch_on

    threads = args.threads or max(1, (os.cpu_count() or 1) // args.world)
    with tempfile.TemporaryDirectory() as tmp:
        res = os.path.join(tmp, "rank0.json")
        cmd = [sys.executable, HERE, "--worker", "--results", res, "--model", args.model, "--spec", args.spec,
               "--repeats", str(args.repeats)] + ([] if args.bucket_mb is None else ["--bucket-mb", str(args.bucket_mb)]) \
            + ([] if args.protocol is None else ["--protocol", args.protocol])
        why = launch_on([cmd] * args.world, args.network, timeout=args.timeout, threads=threads)
        if why is not None:
            print(f"bench_hook_step: cannot emulate {args.network}: {why}; nothing measured")
            return 0
        with open(res) as f:
            r = json.load(f)
    r["network"] = args.network or "loopback"
    print(table(r, f"{args.world} ranks, {r['network']}, model {r['model']} ({r['parameters']:,} parameters), "
                   f"{r['spec']} via {r['protocol']} (torch {torch.__version__})"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
