"""What the payload checksum costs: the scatter/all-gather protocol with and without CRC-32 trailers.

Two gloo ranks on loopback (one thread each) average an ``--numel``-value float32 gradient through
``scatter_allgather`` with ``--spec``; the two settings alternate call by call, so drift of a shared
machine hits both alike. Prints the median seconds per call of each and their ratio.

    python benchmarks/bench_checksum.py [--numel 16777216] [--spec qsgd:bits=4,bucket=512] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, tmp: str, numel: int, spec: str, repeats: int) -> None:
    import torch.distributed as dist

    import gradq
    from gradq.comm import lifecycle, scatter_allgather

    torch.set_num_threads(1)
    lifecycle.before_init()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world)
    q = gradq.build(spec)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(repeats + 1):  # the first round warms up kernels and buffers
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            dist.barrier()
            t = time.perf_counter()
            scatter_allgather(x, q, seed=i, checksum=mode == "on", verify=False)
            if i:
                times[mode].append(time.perf_counter() - t)
    if rank == 0:
        with open(os.path.join(tmp, "times.json"), "w") as f:
            json.dump(times, f)
    lifecycle.teardown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--spec", default="qsgd:bits=4,bucket=512")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, tmp, args.numel, args.spec, args.repeats), nprocs=2, join=True)
        with open(os.path.join(tmp, "times.json")) as f:
            times = json.load(f)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"scatter_allgather, 2 gloo ranks on loopback, {args.numel} values, {args.spec}, {args.repeats} calls each")
    print(f"  with CRC-32 trailers:    {on * 1e3:8.1f} ms (median)")
    print(f"  without:                 {off * 1e3:8.1f} ms (median)")
    print(f"  ratio with / without:    {on / off:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
