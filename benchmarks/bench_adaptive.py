"""The adaptive mode against its two choices, in one run: float32 DDP, the spec alone, and the spec with
``--adaptive``, each a ``gradq train`` run of the same model, data and workers.

For each run it reads the per-step times from ``log.jsonl`` (a step's forward, backward, hook wait
and optimizer step) and prints medians over the steps after the adaptive run's first decision:

* **adaptive ÷ fp32** and **adaptive ÷ spec**: the adaptive run should match the faster of the two.
  The issue's targets are ≤ 1.05 against fp32 on loopback, and ≤ 1.05 against the spec at 1 Gbit/s.
* **probe cost**: the probing steps' time above what the chosen mode would have taken for them, as a
  share of a 1000-step run at the chosen mode's median. It counts every probe of the run (the first,
  and any periodic or drift-triggered ones).

    python benchmarks/bench_adaptive.py [--network 1gbit] [--model mlp] [--data digits] [--workers 4]
        [--spec qsgd:bits=4,bucket=512] [--steps 400] [--out DIR]

``--network`` needs root (emulated links, ``gradq.netem``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any


def steps_of(run_dir: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "log.jsonl"))]
    steps = [r for r in rows if r.get("kind") == "step"]
    summary = next((r for r in rows if r.get("kind") == "summary"), {})
    return steps, summary


def dt(row: dict[str, Any]) -> float:
    return sum(float(row[k]) for k in ("compute_s", "encode_s", "comm_s", "decode_s"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--network", default=None, help="emulated link rate (e.g. 1gbit; needs root)")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--data", default="digits")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--spec", default="qsgd:bits=4,bucket=512")
    ap.add_argument("--steps", type=int, default=400, help="at least this many training steps per run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the spec alone and the adaptive mode this many times, alternating, and report each "
                         "round's ratio and their median (runs one after another see different machine states)")
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="bench-adaptive-")
    probe = [sys.executable, "-c", "import gradq.train.data as d, sys; ds = d.load_dataset(sys.argv[1], seed=0); "
             "print(ds.x_train.shape[0])", args.data]
    n_train = int(subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip())
    per_epoch = max(1, n_train // (args.workers * args.batch_size))
    epochs = max(1, math.ceil(args.steps / per_epoch))
    common = ["--model", args.model, "--data", args.data, "--workers", str(args.workers), "--batch-size",
              str(args.batch_size), "--epochs", str(epochs), "--lr", "0.05"]
    if args.network:
        common += ["--network", args.network]
    runs = {"fp32": ["-c", "fp32"]}
    for r in range(args.rounds):
        sfx = "" if r == 0 else f"-{r + 1}"
        runs["spec" + sfx] = ["-c", args.spec]
        runs["adaptive" + sfx] = ["-c", args.spec, "--adaptive"]
    dirs = {}
    for name, extra in runs.items():
        d = os.path.join(out, name)
        cmd = [sys.executable, "-m", "gradq.cli", "train", *common, *extra, "--out", d]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        dirs[name] = os.path.join(d, sorted(e for e in os.listdir(d) if os.path.isdir(os.path.join(d, e)))[0])
    data = {k: steps_of(v) for k, v in dirs.items()}
    decisions = data["adaptive"][1].get("adaptive_decisions", [])
    if not decisions or any(not data[k][1].get("adaptive_decisions") for k in data if k.startswith("adaptive")):
        print("an adaptive run made no decision: give it more --steps")
        return 1
    first = max(int(data[k][1]["adaptive_decisions"][0]["step"]) for k in data if k.startswith("adaptive"))
    med = {k: statistics.median(dt(r) for r in rows[first:]) for k, (rows, _) in data.items()}
    chosen = data["adaptive"][1]["adaptive_chosen"]
    rows = data["adaptive"][0]
    probe_steps = [r for r in rows if r.get("mode") is not None and _in_probe(r)]
    extra = sum(dt(r) for r in probe_steps) - len(probe_steps) * med["adaptive"]
    print(f"\n### {args.workers} workers, {args.network or 'loopback'}, model {args.model} on {args.data}, "
          f"{args.spec}, {len(rows)} steps\n")
    print("| run | median step after the first decision (ms) |")
    print("|---|---:|")
    for k in ("fp32", "spec", "adaptive"):
        print(f"| {k} | {1e3 * med[k]:.2f} |")
    print(f"\n- adaptive chose **{chosen}** at step {first} (medians agreed over the ranks: "
          + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in decisions[0].items() if k.endswith("_s")) + ")")
    print(f"- adaptive ÷ fp32 = **{med['adaptive'] / med['fp32']:.3f}**, adaptive ÷ spec = "
          f"**{med['adaptive'] / med['spec']:.3f}**")
    print(f"- probing: {len(probe_steps)} steps, {1e3 * extra:.1f} ms above the chosen mode's median: "
          f"**{100 * extra / (1000 * med['adaptive']):.2f} %** of a 1000-step run")
    print(f"- decisions: {decisions}")
    if args.rounds > 1:
        ratios = [med["adaptive" + s] / med["spec" + s] for s in [""] + [f"-{r + 1}" for r in range(1, args.rounds)]]
        print("- adaptive ÷ spec per round (alternating runs): " + ", ".join(f"{x:.3f}" for x in ratios)
              + f"; median **{statistics.median(ratios):.3f}**")
    return 0


def _in_probe(row: dict[str, Any]) -> bool:
    """Whether a step ran during a probe: its mode differs from the choice in force, or no choice yet."""
    return row.get("adaptive_medians") == {} or row.get("mode") != row.get("adaptive_chosen")


if __name__ == "__main__":
    sys.exit(main())
