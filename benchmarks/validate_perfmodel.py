"""Predicted against measured time per iteration for training runs on an emulated network.

    python benchmarks/validate_perfmodel.py RUN_DIR... [--floor-from FAST_RUN_DIR] [--latency-us 100] [--skip-epochs 1]

Each run directory comes from ``gradq train --network RATE`` (``benchmarks/netem_training.sh``). From
its own logs the model is given what was measured on the workers — the median per-step compute time,
encode and decode time, and the bytes each worker sent — and the link rate of the emulated network;
it then predicts the time of one iteration with the ring all-reduce's α–β cost for those bytes
(``gradq.perfmodel``, formula ``ring``, no overlap). A ring all-reduce of S bytes sends
``2(W−1)/W·S`` per worker, so the measured ``bytes_sent`` per step gives ``S = bytes_sent·W/(2(W−1))``.
The measured figure is the median step time (steps of the first ``--skip-epochs`` epochs excluded:
they include the first-step setup). Prints the markdown validation table.

``--floor-from FAST_RUN_DIR`` calibrates the model's communication floor (``comm_floor_ms``) on other
runs — the same compressors, model and workers on a faster link (e.g. 10 Gbit/s) — and validates on
RUN_DIR: each compressor's floor is its median measured communication time per step there, matched by
label. Calibration and validation runs are disjoint, so the agreement is not fitted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def _load(run: Path, skip_epochs: int) -> tuple[dict, list[dict]]:
    conf = json.loads((run / "config.json").read_text())
    steps = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r.get("kind") == "step" and r["epoch"] > skip_epochs]
    if not steps:
        raise SystemExit(f"{run}: no step rows after epoch {skip_epochs}")
    return conf, steps


def _label(conf: dict) -> str:
    return conf.get("label") or conf["compressor"]


def run_dirs(paths: list[Path]) -> list[Path]:
    dirs: list[Path] = []
    for p in paths:
        dirs += [p] if (p / "log.jsonl").exists() else sorted(d.parent for d in p.rglob("log.jsonl"))
    return dirs


def floors_from(paths: list[Path], skip_epochs: int) -> dict[str, float]:
    """Median measured communication ms per step of each run, by label (the calibration runs)."""
    out = {}
    for d in run_dirs(paths):
        conf, steps = _load(d, skip_epochs)
        out[_label(conf)] = 1e3 * statistics.median(float(r["comm_s"]) for r in steps)
    return out


def rows_from_run(run: Path, skip_epochs: int, latency_us: float) -> dict:
    conf, steps = _load(run, skip_epochs)
    if not conf.get("network"):
        raise SystemExit(f"{run}: not an emulated-network run (config.json has no 'network')")
    med = lambda key: statistics.median(float(r[key]) for r in steps)  # noqa: E731
    world = int(conf["world_size"])
    per_step = [r["compute_s"] + r["encode_s"] + r["comm_s"] + r["decode_s"] for r in steps]
    payload = med("bytes_sent") * world / (2 * (world - 1))
    # "32bit": a compressor of exactly 32 bits, so that the measured codec times are counted (the
    # model gives its "none" no codec); the bytes are the measured ones
    return {"label": _label(conf), "workers": world, "compressor": "32bit",
            "gradient_bytes": payload, "compute_ms": 1e3 * med("compute_s"),
            "encode_ms": 1e3 * med("encode_s"), "decode_ms": 1e3 * med("decode_s"),
            "bandwidth": conf["network"], "latency_us": latency_us, "gpus_per_node": 1,
            "protocol": "allreduce", "measured_ms": 1e3 * statistics.median(per_step),
            "measured_comm_ms": 1e3 * med("comm_s")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (or folders holding them)")
    ap.add_argument("--latency-us", type=float, default=100.0,
                    help="per-message latency α of the emulated links (default 100 µs)")
    ap.add_argument("--skip-epochs", type=int, default=1)
    ap.add_argument("--floor-from", type=Path, action="append", default=[], metavar="FAST_RUN_DIR",
                    help="calibrate each compressor's communication floor on these runs (a faster link)")
    args = ap.parse_args()
    from gradq.perfmodel import validate

    rows = [rows_from_run(d, args.skip_epochs, args.latency_us) for d in run_dirs(args.runs)]
    if args.floor_from:
        floors = floors_from(args.floor_from, args.skip_epochs)
        missing = sorted({r["label"] for r in rows} - set(floors))
        if missing:
            raise SystemExit(f"no calibration run for {', '.join(missing)} under "
                             f"{', '.join(map(str, args.floor_from))}")
        for r in rows:
            r["comm_floor_ms"] = floors[r["label"]]
    res = validate(rows)
    print(res.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
