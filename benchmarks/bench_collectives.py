"""Time of averaging a large fp32 gradient over W gloo ranks: gradq's protocols, the raw primitives,
and PyTorch's own DDP communication hooks, each as a ratio to gloo's fp32 ``all_reduce`` measured in
the same run.

The launcher starts ``--world`` ranks of this script on loopback, or — with ``--network RATE`` and root —
one rank per network namespace on emulated links of that rate (``gradq.netem``; the namespaces are
always removed, also on Ctrl-C). Without root, ``--network`` says so and exits 0.

Every rank holds its own ``N(0,1)`` gradient of ``--mb`` megabytes (float32). A case is timed from a
barrier to the moment the rank has its averaged result; the case's time for one repeat is the MAX over
ranks (the slowest rank decides when training can go on); the table shows the median over ``--repeats``
repeats after one warm-up, with min and max, and the ratio ``fp32 all_reduce / case`` (> 1: faster).

Cases:

* ``prim:*`` — the stock gloo primitives on packed 4-bit-sized buffers (``mb/8`` bytes in all), and the
  point-to-point ring all-gather gradq uses; the fp32 ``all_reduce`` of the whole gradient is the baseline.
* ``gradq:PROTOCOL SPEC`` — ``gradq.comm`` called on the flat gradient (one tensor).
* ``hook:NAME`` — one DDP training step on a model whose gradient is the same size (four ``(k, k)``
  matrices, DDP's default 25 MB buckets; its backward pass only copies the gradients in). PyTorch's
  hooks: their time summed over the step's buckets, each future waited for inside the timing (PowerSGD
  issues collectives from its callbacks, which gloo cannot interleave). gradq's hook completes its
  buckets' futures together at the step's end, so it is timed as the whole step (forward, backward and
  every bucket), which also counts the near-free forward and backward passes and DDP's copies of the
  gradients into its buckets and back; ``hook:DDP default, whole step`` is DDP's own averaging timed
  the same way, and ``hook:no communication, whole step`` the step under ``no_sync``: the lines under
  the table compare the communication each step adds (whole step minus that), gradq's against DDP's.
  The whole-step rows use ``gradient_as_bucket_view=True`` (no copies between gradients and buckets). ``hook:allreduce`` is DDP's default averaging; PyTorch's
  ``fp16_compress_hook``, ``quantization_pertensor_hook`` and ``powerSGD_hook`` (rank 1 and 4, error
  feedback and warm start on, compressing from its 2nd step) run next to ``gradq.register``.

``bytes/worker`` is what one worker sends per step: the protocol's own count for gradq (headers and
shared statistics included), and ring-model formulas for the PyTorch hooks and primitives.

    python benchmarks/bench_collectives.py [--network 1gbit] [--world 4] [--mb 100] [--repeats 5]
        [--bits 2,4,8] [--only SUBSTRING ...] [--json FILE]
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


# ---------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------
def _timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Warm-up call, then ``repeats`` timed calls; each time is the max over ranks."""
    fn()
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        e = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        out.append(float(e))
    return out


def _primitive_cases(n: int, world: int, rank: int) -> list[tuple[str, Callable[[], Any], int]]:
    from gradq.comm._util import gather_into, ring_all_gather

    packed = n // 2  # bytes of 4-bit codes of the whole gradient
    chunk = packed // world
    base = torch.zeros(n, dtype=torch.float32)
    mine = torch.full((chunk,), rank, dtype=torch.uint8)
    a2a_in = torch.zeros(chunk * world, dtype=torch.uint8)
    a2a_out = torch.empty_like(a2a_in)
    gather_out = torch.empty(chunk * world, dtype=torch.uint8)
    gather_list = [torch.empty(chunk, dtype=torch.uint8) for _ in range(world)]
    ring_bytes = (world - 1) * chunk
    return [
        ("prim:all_reduce fp32 (baseline)", lambda: dist.all_reduce(base), 2 * (world - 1) * 4 * n // world),
        ("prim:all_gather uint8", lambda: dist.all_gather(gather_list, mine), ring_bytes),
        ("prim:all_gather_single uint8", lambda: gather_into(gather_out, mine, None), ring_bytes),
        ("prim:p2p ring all-gather uint8", lambda: ring_all_gather(mine, None), ring_bytes),
        ("prim:all_to_all_single uint8", lambda: dist.all_to_all_single(a2a_out, a2a_in), ring_bytes),
    ]


def _protocol_cases(x: torch.Tensor, bits: list[int]) -> list[tuple[str, Callable[[], Any], Callable[[], int]]]:
    import gradq
    from gradq.comm.api import average

    cases = []
    step = [0]

    def case(protocol: str, spec: str):
        q = gradq.build(spec)
        info = {"bytes": 0}

        def run():
            step[0] += 1
            _, info["bytes"] = average(x, q, protocol, seed=step[0], name="g", rank=dist.get_rank())
        cases.append((f"gradq:{protocol} {spec}", run, lambda: info["bytes"]))

    for b in bits:
        case("scatter", f"qsgd:bits={b},bucket=512")
    for b in bits:
        case("allreduce", f"maxnorm:bits={b}")
    case("scatter", "terngrad:bucket=512,pack=2bit")
    case("allreduce", "terngrad")
    case("scatter", "orq:levels=5,bucket=512")
    case("allgather", "qsgd:bits=4,bucket=512")
    case("ps", "qsgd:bits=4,bucket=512")
    return cases


class _Wide(torch.nn.Module):
    """Four ``(k, k)`` weights; ``forward(g)`` returns ``Σ_i <W_i, g_i>``, so the gradient of W_i is g_i."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(k, k)) for _ in range(4)])

    def forward(self, g: list[torch.Tensor]) -> torch.Tensor:
        return sum((w * gi).sum() for w, gi in zip(self.w, g))


def _hook_cases(n: int, world: int, rank: int) -> list[tuple[str, Callable[[], Any], Callable[[], int]]]:
    import gradq
    from gradq.ddp import gradq_hook
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook, quantization_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    k = int((n / 4) ** 0.5)
    gen = torch.Generator().manual_seed(1000 + rank)
    grads = [torch.randn(k, k, generator=gen) for _ in range(4)]
    numel = 4 * k * k
    cases = []

    def make(name: str, install: Callable[[DDP], tuple[Any, Callable]], nbytes: Callable[[Any], int],
             whole_step: bool = False):
        model = DDP(_Wide(k), gradient_as_bucket_view=whole_step)
        hook_state, hook = install(model)
        times: list[float] = []

        def timed(s, bucket):
            t0 = time.perf_counter()
            fut = hook(s, bucket)
            fut.wait()
            times.append(time.perf_counter() - t0)
            return fut
        if whole_step:
            model.register_comm_hook(hook_state, hook)
        else:
            model.register_comm_hook(hook_state, timed)

        def run():
            times.clear()
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=False)
            model(grads).backward()
            return time.perf_counter() - t0 if whole_step else sum(times)
        cases.append((f"hook:{name}", run, lambda: nbytes(hook_state)))
        if whole_step and not any(c[0] == "hook:no communication, whole step" for c in cases):
            def local():  # the same step without averaging: what the whole-step rows also count
                t0 = time.perf_counter()
                model.zero_grad(set_to_none=False)
                with model.no_sync():
                    model(grads).backward()
                return time.perf_counter() - t0
            cases.append(("hook:no communication, whole step", local, lambda: 0))

    ring = lambda item: 2 * (world - 1) * item * numel // world  # noqa: E731
    make("allreduce (DDP default)", lambda m: (None, default_hooks.allreduce_hook), lambda s: ring(4))
    make("DDP default, whole step", lambda m: (None, default_hooks.allreduce_hook), lambda s: ring(4),
         whole_step=True)
    make("fp16_compress_hook", lambda m: (None, default_hooks.fp16_compress_hook), lambda s: ring(2))
    make("quantization_pertensor_hook", lambda m: (None, quantization_hooks.quantization_pertensor_hook),
         lambda s: (world - 1) * (numel + 8 * 4))

    def psgd(r: int):
        def install(m):
            st = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                             start_powerSGD_iter=2, random_seed=0)
            return st, powerSGD_hook.powerSGD_hook
        make(f"powerSGD_hook rank {r}", install, lambda s: 2 * (world - 1) * 4 * 4 * 2 * k * r // world)
    psgd(1)
    psgd(4)
    for spec in ("qsgd:bits=4,bucket=512", "qsgd:bits=2,bucket=512", "maxnorm:bits=4"):
        # what gradq.register(model, spec) installs
        make(f"gradq {spec}", lambda m, spec=spec: (gradq.GradqState(spec, module=m), gradq_hook),
             lambda s: int(s.last_stats.get("bytes_sent", 0)), whole_step=True)
    return cases


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    n = int(args.mb * 1e6 / 4)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(n, generator=gen)
    bits = [int(b) for b in args.bits.split(",")]

    cases: list[tuple[str, Callable[[], Any], Any]] = []
    cases += _primitive_cases(n, world, rank)
    cases += _protocol_cases(x, bits)
    cases += _hook_cases(n, world, rank)
    want = lambda name: (not args.only or any(s in name for s in args.only) or "baseline" in name)  # noqa: E731
    rows = []
    for name, fn, nbytes in cases:
        if not want(name):
            continue
        try:
            if name.startswith("hook:"):
                # a DDP step: time = the hooks' time (the backward pass itself is not counted)
                fn()
                fn()  # DDP rebuilds buckets after its first step; PowerSGD compresses from its 2nd
                ts = []
                for _ in range(args.repeats):
                    dist.barrier()
                    e = torch.tensor([fn()], dtype=torch.float64)
                    dist.all_reduce(e, op=dist.ReduceOp.MAX)
                    ts.append(float(e))
            else:
                ts = _timed(fn, args.repeats)
        except Exception as exc:  # e.g. a PyTorch hook that fails on gloo: every rank fails alike
            msg = str(exc).strip().splitlines()
            err = next((ln for ln in msg if "Error" in ln), msg[0] if msg else type(exc).__name__)
            rows.append({"case": name, "times": [], "bytes_per_worker": 0, "error": err[:160]})
            if rank == 0:
                print(f"  {name:48s} FAILED: {err[:160]}", file=sys.stderr, flush=True)
            dist.barrier()
            continue
        b = nbytes() if callable(nbytes) else int(nbytes)
        rows.append({"case": name, "times": ts, "bytes_per_worker": int(b)})
        if rank == 0:
            print(f"  {name:48s} {1e3 * statistics.median(ts):9.1f} ms", file=sys.stderr, flush=True)
    if rank == 0:
        with open(args.results, "w") as f:
            json.dump({"world": world, "mb": args.mb, "numel": n, "rows": rows}, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# launcher side
# ---------------------------------------------------------------------------------------------------
def table(result: dict[str, Any], title: str) -> str:
    rows = result["rows"]
    base = next((r for r in rows if "baseline" in r["case"]), None)
    t_base = statistics.median(base["times"]) if base else float("nan")
    out = [f"### {title}", "",
           "| case | bytes/worker | median ms | min–max ms | × fp32 all_reduce |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        if not r["times"]:
            out.append(f"| {r['case']} | – | fails: {r.get('error', '?')} | | |")
            continue
        med = statistics.median(r["times"])
        out.append(f"| {r['case']} | {r['bytes_per_worker'] / 1e6:.2f} MB | {1e3 * med:.1f} | "
                   f"{1e3 * min(r['times']):.1f}–{1e3 * max(r['times']):.1f} | {t_base / med:.2f} |")
    med = {r["case"]: statistics.median(r["times"]) for r in rows if r["times"]}
    step = med.get("hook:DDP default, whole step")
    local = med.get("hook:no communication, whole step", 0.0)
    if step:
        out.append("")
        out.append(f"Communication per step (whole step − the same step without averaging, {1e3 * local:.1f} ms):")
        for case, t in med.items():
            if case.startswith("hook:gradq "):
                spec = case[len("hook:gradq "):]
                proto = med.get(f"gradq:scatter {spec}")
                also = f"; the protocol alone: {t_base / proto:.2f}× the fp32 all_reduce" if proto else ""
                out.append(f"- {case}: {(step - local) / (t - local):.2f}× DDP's{also}")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--network", default=None, help="emulate links of this rate (e.g. 1gbit; needs root)")
    ap.add_argument("--world", type=int, default=4, help="number of ranks (default 4)")
    ap.add_argument("--mb", type=float, default=100.0, help="gradient size in MB of float32 (default 100)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per case (default 5)")
    ap.add_argument("--bits", default="2,4,8", help="bit widths for the QSGD/MaxNorm cases (default 2,4,8)")
    ap.add_argument("--only", nargs="*", default=None, help="run only cases whose name contains one of these")
    ap.add_argument("--json", default=None, help="also write the raw times here")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are stopped")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.world < 2:
        ap.error("--world must be at least 2")
    if args.mb <= 0 or args.repeats < 1:
        ap.error("--mb must be positive and --repeats at least 1")

    from gradq.netem import launch_on

    with tempfile.TemporaryDirectory() as tmp:
        res = os.path.join(tmp, "rank0.json")
        cmd = [sys.executable, HERE, "--worker", "--results", res, "--mb", str(args.mb),
               "--repeats", str(args.repeats), "--bits", args.bits]
        if args.only:
            cmd += ["--only", *args.only]
        where = f"emulated {args.network} links" if args.network else "loopback"
        print(f"bench_collectives: {args.world} gloo ranks on {where}, {args.mb:g} MB fp32 gradient, "
              f"{args.repeats} repeats", file=sys.stderr)
        why = launch_on([cmd] * args.world, args.network, timeout=args.timeout)
        if why is not None:
            print(f"bench_collectives: cannot emulate {args.network}: {why}; nothing measured")
            return 0
        with open(res) as f:
            result = json.load(f)
    result["network"] = args.network or "loopback"
    print(table(result, f"{args.world} ranks, {args.mb:g} MB, {result['network']} (torch {torch.__version__})"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
