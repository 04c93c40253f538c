"""Where the time of one scatter/all-gather call goes: encode, waiting for the network, decode.

Four gloo ranks (one per emulated host with ``--network RATE`` as root, loopback otherwise) average a
``--mb`` MB float32 gradient with ``gradq.comm.api.average(..., "scatter", out=buf)``, decoding into a
preallocated buffer as the DDP hook does. Rank 0 prints the medians over ``--repeats`` calls (after one
warm-up) of the call's wall time and of the protocol's own ``encode_s`` / ``comm_s`` (time spent
waiting for exchanges the pipeline could not hide) / ``decode_s`` figures.

    python benchmarks/bench_scatter_phases.py [--network 1gbit] [--spec qsgd:bits=4,bucket=512]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import gradq
    from gradq.comm.api import average

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x = torch.randn(int(args.mb * 1e6 / 4), generator=torch.Generator().manual_seed(rank))
    out = torch.empty_like(x)
    q = gradq.build(args.spec)
    rows = []
    for it in range(args.repeats + 1):
        info: dict = {}
        dist.barrier()
        c0, t0 = _cpu_seconds(), time.perf_counter()
        average(x, q, "scatter", seed=it, name="g", rank=rank, out=out, info=info)
        wall, cpu = time.perf_counter() - t0, torch.tensor([_cpu_seconds() - c0], dtype=torch.float64)
        dist.all_reduce(cpu)  # CPU seconds of all ranks (every thread, user + system)
        rows.append((wall, info["encode_s"], info["comm_s"], info["decode_s"], float(cpu)))
    if rank == 0:
        world = dist.get_world_size()
        print(f"{args.spec}, {world} ranks, {args.mb:g} MB, {args.network or 'loopback'}, "
              f"{os.cpu_count()} cores")
        for k, name in enumerate(["call", "encode", "comm (wait)", "decode", "CPU, all ranks"]):
            print(f"  {name:14s} {1e3 * statistics.median(r[k] for r in rows[1:]):7.1f} ms")
        cpu = statistics.median(r[4] for r in rows[1:])
        print(f"  the cores bound the call at >= {1e3 * cpu / min(world, os.cpu_count() or 1):.1f} ms "
              f"(CPU of all ranks / cores in use)")
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--network", default=None)
    ap.add_argument("--spec", default="qsgd:bits=4,bucket=512")
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    from gradq.netem import launch_on

    cmd = [sys.executable, __file__, "--worker", "--spec", args.spec, "--mb", str(args.mb),
           "--repeats", str(args.repeats)] + (["--network", args.network] if args.network else [])
    why = launch_on([cmd] * args.world, args.network, timeout=600)
    if why is not None:
        print(f"bench_scatter_phases: cannot emulate {args.network}: {why}; nothing measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
