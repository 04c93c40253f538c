"""``gradq perfmodel``: predicted time per iteration and throughput, for one configuration or a sweep
over GPU counts, as text, JSON, a markdown table and a PNG.

Wire it into a command line with :func:`add_arguments` and :func:`run`; :func:`main` does both
(``python -m gradq.perfmodel ...``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from ..errors import GradqError
from .core import DEFAULT_OVERLAP_FRACTION, DEFAULT_SWEEP, FORMULAS, PROTOCOLS, predict_config
from .presets import CLUSTERS, NETWORKS, describe_presets
from .report import format_table, plot_sweep
from .units import PerfModelError

__all__ = ["add_arguments", "run", "main", "parse_workers"]

_SWEEP_TEXT = ",".join(str(w) for w in DEFAULT_SWEEP)


def parse_workers(text: str) -> list[int]:
    """GPU counts from ``"1,2,4,8"`` or a doubling range ``"1..512"`` (1, 2, 4, …, 512)."""
    t = str(text).strip()
    try:
        if ".." in t:
            lo, hi = (int(x) for x in t.split(".."))
            if lo < 1 or hi < lo:
                raise ValueError
            out = []
            while lo <= hi:
                out.append(lo)
                lo *= 2
            return out
        out = [int(x) for x in t.split(",") if x.strip()]
    except ValueError:
        raise PerfModelError(f"cannot read GPU counts {text!r}; write e.g. '1,2,4,8' or '1..512'") from None
    if not out or min(out) < 1:
        raise PerfModelError(f"GPU counts must be integers >= 1, got {text!r}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``perfmodel`` options to ``parser`` (every default is stated in its help)."""
    m = parser.add_argument_group("model (a preset, overridable, or a custom size)")
    m.add_argument("--network", choices=sorted(NETWORKS), help="preset network (see --list-presets)")
    size = m.add_mutually_exclusive_group()
    size.add_argument("--gradient-mb", type=float, help="fp32 gradient size in MB (10^6 bytes)")
    size.add_argument("--gradient-bytes", type=float, help="fp32 gradient size in bytes")
    size.add_argument("--params", type=int, help="number of gradient coordinates")
    m.add_argument("--compute-ms", type=float, help="measured forward+backward ms of one iteration on one GPU "
                                                    "(default: the preset's, else 0)")
    m.add_argument("--batch-size", type=int, help="samples per GPU per iteration; gives throughput in samples/s "
                                                  "(default: the preset's, else iterations/s)")
    m.add_argument("--messages", type=int, help="collective calls per iteration, each paying the latency "
                                                "(default: the preset's tensor count, else 1)")
    c = parser.add_argument_group("cluster (a preset, overridable, or a flat network)")
    c.add_argument("--cluster", choices=sorted(CLUSTERS), help="preset cluster (see --list-presets)")
    c.add_argument("--bandwidth", help="inter-node bandwidth per node, e.g. 1gbit, 10gbit, 100mbit, 125MB/s "
                                       "(required without --cluster)")
    c.add_argument("--latency-us", type=float, help="inter-node latency per message in µs (default: preset's, else 0)")
    c.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: preset's, else 1)")
    c.add_argument("--intra-bandwidth", help="intra-node GPU-to-GPU bandwidth, e.g. 10GB/s "
                                             "(required with more than one GPU per node)")
    c.add_argument("--intra-latency-us", type=float, help="intra-node latency per message in µs "
                                                          "(default: preset's, else 0)")
    q = parser.add_argument_group("compressor and protocol")
    q.add_argument("--compressor", "-c", action="append", metavar="SPEC",
                   help="'none' (fp32), a width such as '4bit', or a fixed-width gradq spec; repeat to compare "
                        "(default: none)")
    q.add_argument("--sum-bits", type=float, help="bits per coordinate inside a SUM all-reduce (widened "
                                                  "integer codes, e.g. 8 or 32; default: the packed width)")
    q.add_argument("--encode-ms", type=float, help="measured ms of one encode of the gradient (default 0)")
    q.add_argument("--decode-ms", type=float, help="measured ms of one decode of the gradient (default 0)")
    q.add_argument("--encode-ms-per-mb", type=float, help="measured encode ms per MB of fp32 gradient (default 0)")
    q.add_argument("--decode-ms-per-mb", type=float, help="measured decode ms per MB of fp32 gradient (default 0)")
    q.add_argument("--codec-times", default="default", metavar="FILE",
                   help="measured encode/decode speeds per spec: the JSON of `python benchmarks/bench_codecs.py "
                        "--memory --json FILE`; 'default' (the default) is the CPU measurement shipped with gradq, "
                        "'h100' and 'h200' the GPU ones (Triton kernels), 'none' charges no codec time; --encode-ms... flags override it")
    q.add_argument("--protocol", choices=PROTOCOLS, default="allreduce", help="default: allreduce")
    q.add_argument("--formula", choices=FORMULAS, default="ring",
                   help="ring: two-level ring α–β (default); paper002: [Vineeth]'s tree formula")
    q.add_argument("--ps-requantize", action="store_true", help="ps: the server sends the average re-encoded "
                                                                "(default: fp32)")
    q.add_argument("--ps-pull-bits", metavar="BITS|summed",
                   help="ps: bits per coordinate the server sends back (overrides --ps-requantize); 'summed' is "
                        "TernGrad's exchange, the sum of M shared-scale codes in log2(2Ms+1) bits")
    q.add_argument("--ps-servers", type=int, default=1, help="ps: servers sharing the gradient (default 1)")
    q.add_argument("--overlap", action="store_true", help="overlap communication with the backward pass "
                                                          "(default off)")
    q.add_argument("--overlap-fraction", type=float, default=DEFAULT_OVERLAP_FRACTION,
                   help="share of compute that can hide communication (default 2/3, the backward pass)")
    q.add_argument("--comm-floor-ms", type=float, default=0.0,
                   help="measured floor of one iteration's communication: its time on a link so fast the bytes "
                        "cost nothing (communication = max(alpha-beta time, floor); default 0)")
    o = parser.add_argument_group("output")
    o.add_argument("--workers", "-w", type=int, default=1, help="number of GPUs for one prediction (default 1)")
    o.add_argument("--sweep", nargs="?", const=_SWEEP_TEXT, metavar="COUNTS",
                   help=f"predict for these GPU counts instead of --workers (default {_SWEEP_TEXT}; "
                        "also '1..512')")
    o.add_argument("--plot", metavar="FILE.png", help="write a PNG of time per iteration and throughput vs GPUs "
                                                      "(implies --sweep)")
    o.add_argument("--title", help="plot title (default: describes the configuration)")
    o.add_argument("--speedup", action="store_true", help="also report speedup over fp32 (same protocol)")
    o.add_argument("--break-even", action="store_true",
                   help="also report the break-even inter-node bandwidth: compression pays below it, fp32 above")
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    o.add_argument("--list-presets", action="store_true", help="list preset networks and clusters, then exit")


_CONFIG_FROM_ARGS = ("network", "params", "gradient_mb", "gradient_bytes", "compute_ms", "batch_size", "messages",
                     "cluster", "bandwidth", "latency_us", "gpus_per_node", "intra_bandwidth", "intra_latency_us",
                     "sum_bits", "encode_ms", "decode_ms", "encode_ms_per_mb", "decode_ms_per_mb", "protocol",
                     "formula", "overlap", "overlap_fraction", "ps_requantize", "ps_servers", "comm_floor_ms",
                     "speedup", "codec_times", "break_even", "ps_pull_bits")


def run(args: argparse.Namespace) -> int:
    """Carry out ``gradq perfmodel`` for parsed ``args``; returns the exit status (0).

    One configuration (``--workers``) prints a summary or, with ``--json``, one JSON object with the
    :class:`~gradq.perfmodel.Prediction` fields (``comm_ms``, ``iteration_ms``, ``throughput``…) and
    ``config``. ``--sweep``/``--plot`` or several ``--compressor`` print a markdown table, or with
    ``--json`` an object ``{"config": …, "rows": [prediction, …]}``.

    Raises:
        PerfModelError: a bad input (the message says how to fix it).
    """
    if getattr(args, "list_presets", False):
        print(describe_presets())
        return 0
    base = {k: getattr(args, k, None) for k in _CONFIG_FROM_ARGS}
    compressors = args.compressor or ["none"]
    many = args.sweep is not None or args.plot is not None
    counts = parse_workers(args.sweep if args.sweep is not None else _SWEEP_TEXT) if many else [args.workers]
    preds = [predict_config({**base, "compressor": c, "workers": w}) for c in compressors for w in counts]
    config = {k: v for k, v in base.items() if v not in (None, False)}
    config["compressors"] = compressors
    config["workers"] = counts if many else args.workers
    if not many and len(preds) == 1:
        p = preds[0]
        if args.json:
            print(json.dumps({**p.to_dict(), "config": config}, indent=2))
        else:
            print(format_table(preds))
            print(f"\nper worker: {p.bytes_per_worker / 1e6:.4g} MB sent per iteration; busiest link "
                  f"{p.node_bytes / 1e6:.4g} MB; comm = {p.intra_comm_ms:.4g} ms intra-node + "
                  f"{p.inter_comm_ms:.4g} ms inter-node")
    elif args.json:
        print(json.dumps({"config": config, "rows": [p.to_dict() for p in preds]}, indent=2))
    else:
        print(format_table(preds))
    if not args.json:
        sources: dict[str, list[str]] = {}
        for p in preds:
            if p.codec_source and p.compressor not in sources.setdefault(p.codec_source, []):
                sources[p.codec_source].append(p.compressor)
        for src, names in sources.items():
            print(f"codec time of {', '.join(names)}: {src}")
    if args.plot:
        title = args.title or _title(base, preds[0])
        path = plot_sweep(preds, args.plot, title=title)
        if not args.json:
            print(f"plot: {path}")
    return 0


def _title(base: dict, p) -> str:
    what = base.get("network") or (f"{base['gradient_mb']:g} MB gradient" if base.get("gradient_mb")
                                   else "custom model")
    where = base.get("cluster") or "flat network"
    if base.get("bandwidth"):
        where += f", {base['bandwidth']}"
    return f"{what} on {where} — {p.protocol}" + ("" if p.formula == "ring" else f" ({p.formula})") + \
        (", overlap" if p.overlap else "")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Stand-alone entry: parse ``argv``, :func:`run`, print errors as ``gradq perfmodel: error: …`` (exit 2)."""
    parser = argparse.ArgumentParser(prog="gradq perfmodel", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (GradqError, ValueError, OSError) as e:
        print(f"gradq perfmodel: error: {e}", file=sys.stderr)
        return 2
