"""FSDP2 with gradq's compressed reduce-scatter against stock FSDP2: time of the gradient
reduce-scatter phase, of a whole step, and test accuracy against time.

    python benchmarks/bench_fsdp.py [--network 1gbit] [--world 4] [--epochs 2] [--ranks-per-node 2]
                                    [--specs SPEC ...] [--hierarchical SPEC ...]

Each rank runs every case one after another on the same data: stock FSDP2 (its own reduce-scatter,
timed through a wrapper that only calls it) and ``gradq.register(model, spec)`` for each of ``--specs``
(default 2-, 4- and 8-bit QSGD, bucket 512), then each of ``--hierarchical`` with
``intra_node="fp32"``. With ``--ranks-per-node L`` the emulated network has hosts of ``L`` ranks (they
talk over the host's loopback and share its link), as nodes of several GPUs. The ``residual MB``
column is what error feedback holds per rank (a spec with ``ef``), against the sharded parameters'
float32 bytes; ``agreement ms`` is gradq's small all-reduce at each step's end (its ``agree_seconds``:
the ranks agree on damaged payloads and non-finite flags), which includes waiting for the slowest rank. The model is the wide MLP (784-2048-2048-10 on 28×28 inputs, 5.8M parameters;
the digits are upsampled to 28×28 when the shared MNIST is absent, so the size matches), every
Linear and the root sharded with ``fully_shard``. Medians over the steps after the first epoch's first
5; ratios are to stock FSDP2 in the same run. With ``--network RATE`` (root) each rank gets its own
network namespace and a link of that rate (``gradq.netem``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.abspath(__file__)
SPECS = ["qsgd:bits=2,bucket=512", "qsgd:bits=4,bucket=512", "qsgd:bits=8,bucket=512"]


def _data(rank: int, world: int):
    from gradq.train.data import load_dataset

    ds = load_dataset("mnist" if os.path.isdir(os.path.join(os.path.dirname(HERE), "..", "..", "shared", "data"))
                      else "digits", seed=0)
    x_tr, x_te = ds.x_train, ds.x_test
    if x_tr.shape[1] != 784:   # the embedded 8×8 digits: upsample to the wide MLP's 28×28 input
        up = lambda x: F.interpolate(x.reshape(-1, 1, 8, 8), size=(28, 28), mode="bilinear",  # noqa: E731
                                     align_corners=False).reshape(-1, 784)
        x_tr, x_te = up(x_tr), up(x_te)
    return x_tr, ds.y_train, x_te, ds.y_test


def _case(name: str, spec: Optional[str], data, epochs: int, batch: int, rank: int, world: int,
          **kw: Any) -> dict[str, Any]:
    import gradq
    from gradq.fsdp import StockReduceScatter, shard
    from gradq.train.models import build_model

    x_tr, y_tr, x_te, y_te = data
    model = shard(build_model("mlp-wide", 784, 10, (28, 28), seed=0))   # every Linear, then the root
    if spec is None:
        comm: Any = StockReduceScatter().install(model)
        rs_seconds = lambda: comm.seconds  # noqa: E731
    else:
        comm = gradq.register(model, spec, seed=0, **kw)
        rs_seconds = lambda: sum(comm.totals[k] for k in ("encode_seconds", "comm_seconds", "decode_seconds"))  # noqa: E731
    agree_seconds = (lambda: 0.0) if spec is None else (lambda: comm.totals["agree_seconds"])  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    per = x_tr.shape[0] // (world * batch)
    steps, rs, agree, curve = [], [], [], []
    wall = 0.0
    for epoch in range(epochs):
        for i in range(per):
            idx = torch.arange(batch) + (i * world + rank) * batch
            dist.barrier()
            t0, r0, a0 = time.perf_counter(), rs_seconds(), agree_seconds()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            wall += dt
            steps.append(dt)
            rs.append(rs_seconds() - r0)
            agree.append(agree_seconds() - a0)
        with torch.no_grad():
            acc = float((model(x_te).argmax(1) == y_te).float().mean())
        curve.append((wall, acc))
    warm = 5
    out = {"case": name, "step_ms": 1e3 * statistics.median(steps[warm:]), "rs_ms": 1e3 * statistics.median(rs[warm:]),
           "agree_ms": 1e3 * statistics.median(agree[warm:]), "curve": curve, "steps": len(steps)}
    out["param_mb"] = sum(p.to_local().numel() * 4 for p in model.parameters()) / 2 ** 20
    if spec is not None:
        out["bits_per_coord"] = comm.last_stats.get("bits_per_coord")
        out["residual_mb"] = comm.residual_bytes / 2 ** 20
    return out


def worker(args: argparse.Namespace) -> None:
    from gradq.comm import lifecycle

    lifecycle.before_init()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    data = _data(rank, world)
    rows = [_case("fp32 FSDP2", None, data, args.epochs, args.batch_size, rank, world)]
    rows += [_case(s, s, data, args.epochs, args.batch_size, rank, world) for s in args.specs]
    rows += [_case(f"{s}, intra_node=fp32", s, data, args.epochs, args.batch_size, rank, world, intra_node="fp32",
                   ranks_per_node=args.ranks_per_node) for s in args.hierarchical]
    if rank == 0:
        with open(args.results, "w") as f:
            json.dump(rows, f)
    lifecycle.teardown()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--network", default=None, help="emulate links of this rate (e.g. 1gbit; needs root)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--ranks-per-node", type=int, default=1, help="emulated hosts of this many ranks (default 1)")
    ap.add_argument("--specs", nargs="*", default=SPECS, help="gradq specs, flat exchange (default: QSGD 2/4/8 bits)")
    ap.add_argument("--hierarchical", nargs="*", default=[], help="gradq specs with intra_node='fp32'")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from gradq.netem import launch_on

    with tempfile.TemporaryDirectory() as tmp:
        res = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, HERE, "--worker", "--results", res, "--epochs", str(args.epochs),
               "--batch-size", str(args.batch_size), "--specs", *args.specs, "--hierarchical", *args.hierarchical]
        if args.world % args.ranks_per_node:
            ap.error(f"--ranks-per-node {args.ranks_per_node} does not divide --world {args.world}")
        if args.hierarchical and args.ranks_per_node == 1:
            ap.error("--hierarchical needs --ranks-per-node (the ranks of one node)")
        cmd += ["--ranks-per-node", str(args.ranks_per_node)]
        why = launch_on([cmd] * args.world, args.network, timeout=args.timeout, ranks_per_host=args.ranks_per_node)
        if why is not None:
            print(f"bench_fsdp: cannot emulate {args.network}: {why}; nothing measured")
            return 0
        with open(res) as f:
            rows = json.load(f)
    base = rows[0]
    where = f"emulated {args.network}" if args.network else "loopback"
    if args.ranks_per_node > 1:
        where += f", {args.world // args.ranks_per_node} hosts of {args.ranks_per_node} ranks"
    print(f"\n### FSDP2, {args.world} gloo ranks on {where}, wide MLP (5.8M parameters), batch {args.batch_size} per rank, "
          f"{args.epochs} epochs ({base['steps']} steps)\n")
    print("| case | bits/coord | reduce-scatter ms (median) | × fp32 | step ms (median) | × fp32 | agreement ms "
          "(% of step) | test accuracy | training s | residual MB (params MB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        bits = r.get("bits_per_coord")
        agree = "—" if bits is None else f"{r['agree_ms']:.2f} ({100 * r['agree_ms'] / r['step_ms']:.1f} %)"
        print(f"| {r['case']} | {'32' if bits is None else f'{bits:.2f}'} | {r['rs_ms']:.1f} | "
              f"{base['rs_ms'] / r['rs_ms']:.2f} | {r['step_ms']:.1f} | {base['step_ms'] / r['step_ms']:.2f} | "
              f"{agree} | {r['curve'][-1][1]:.3f} | {r['curve'][-1][0]:.1f} | {r.get('residual_mb', 0.0):.1f} "
              f"({r['param_mb']:.1f}) |")
    print("\naccuracy after each epoch (seconds of training, accuracy):")
    for r in rows:
        print(f"- {r['case']}: " + ", ".join(f"{w:.1f} s {a:.3f}" for w, a in r["curve"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
