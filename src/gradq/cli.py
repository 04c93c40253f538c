"""The ``gradq`` command.

* ``gradq train --workers 4 --model mlp --data digits --compressor SPEC [--compressor SPEC ...] --out DIR``
  — data-parallel training (local gloo workers, or in place under torchrun) with each compressor in
  turn; JSONL logs and configs per run, a summary table at the end (:mod:`gradq.train.runner`).
* ``gradq report RUN_DIR...`` — figures (PNG) and a markdown table from run logs.
* ``gradq demo`` — 4 workers on the embedded digits data: fp32 against eight compressors and PyTorch's
  PowerSGD hook; prints the table and writes the figures.
* ``gradq perfmodel ...`` — projected time per iteration and throughput against the number of GPUs
  (:mod:`gradq.perfmodel`).
* ``gradq convex tradeoff|qsvrg|async|gd`` — the QSGD paper's convex experiments on problems with a known
  optimum (:mod:`gradq.convex`).
* ``gradq list`` — every scheme with its parameters and defaults.
* ``gradq compile [--compressor SPEC ...]`` — compile the CPU kernels into numba's on-disk cache once
  per machine, before a ``torchrun`` of many ranks (:mod:`gradq.precompile`).
* ``gradq compare --compressor SPEC ... | --all`` — quantize one real model's gradients with each spec
  and print bits/coordinate, relative error and bias (no training).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

from . import __version__
from .errors import GradqError
from .factory import build, registry

__all__ = ["main", "COMPARE_SPECS", "DEMO_COMPRESSORS"]

#: what ``gradq demo`` trains: fp32 against the papers' main schemes and PyTorch's PowerSGD hook
DEMO_COMPRESSORS = [
    "fp32", "qsgd:bits=4,bucket=512", "qsgd:bits=8,bucket=512", "terngrad", "maxnorm:bits=4",
    "multiscale:bits=2+6", "orq:levels=5", "bingrad-b", "powersgd:rank=1",
]

#: every scheme, at the settings the papers used where they name one (``gradq compare --all``)
COMPARE_SPECS = [
    "none", "fp16", "bf16",
    "qsgd:bits=8,bucket=512", "qsgd:bits=4,bucket=512", "qsgd:bits=2,bucket=128", "qsgd:bits=4,norm=l2",
    "terngrad", "terngrad:clip=none",
    "maxnorm:bits=8", "maxnorm:bits=4", "maxnorm:bits=2", "multiscale:bits=2+6", "multiscale:bits=4+8",
    "randk-maxnorm:ratio=0.1", "randk-multiscale:ratio=0.1",
    "orq:levels=3", "orq:levels=5", "orq:levels=9", "linear:levels=5",
    "bingrad-pb", "bingrad-b", "signsgd", "onebit",
    "topk:ratio=0.01", "randk:ratio=0.01,rescale=1",
]


def _cmd_list(args: argparse.Namespace) -> int:
    for name, cls in sorted(registry().items()):
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"{name:18s} {doc}")
        q = build(name)
        print(f"{'':18s}   default: {q}")
    print("\nwrapper: ef(SPEC) or SPEC,ef=1 adds error feedback")
    return 0


def _cmd_compare(args: argparse.Namespace, specs: Sequence[str]) -> int:
    from .train import build_model, load_dataset, model_gradients
    from .train.gradients import compare_quantizers, format_table

    for s in specs:  # fail fast on a typo, before any work
        build(s)
    data = load_dataset(args.data, seed=args.seed)
    model = build_model(args.model, data.num_features, data.num_classes, data.image_shape, seed=args.seed)
    grads = model_gradients(model, data, warm_steps=args.warm_steps, seed=args.seed)
    n = sum(v.numel() for _, v in grads)
    print(f"gradients of {args.model} on {data.name} after {args.warm_steps} SGD steps: {len(grads)} tensors, "
          f"{n} coordinates; {args.trials} encodes per scheme ('<x': bias below what the trials resolve)", flush=True)
    done = [0]

    def progress(row):
        done[0] += 1
        print(f"\r[{done[0]}/{len(specs)}] {row['compressor'][:60]:60s}", end="", file=sys.stderr, flush=True)

    rows = compare_quantizers(specs, grads, trials=args.trials, progress=progress if sys.stderr.isatty() else None)
    if sys.stderr.isatty():
        print("\r" + " " * 72 + "\r", end="", file=sys.stderr)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"rows written to {args.json}")
    return 0


def _add_train_args(c: argparse.ArgumentParser, demo: bool) -> None:
    if not demo:
        c.add_argument("--compressor", "-c", action="append", metavar="SPEC",
                       help="fp32, powersgd[:rank=R,start=S] or a gradq spec such as qsgd:bits=4,bucket=512 "
                            "(repeatable: the runs go one after another into --out; default fp32)")
        c.add_argument("--model", default="mlp", help="logreg, mlp, mlp-wide, lenet, resnet20 or vgg (default mlp)")
        c.add_argument("--data", default="digits",
                       help="digits (default, embedded), mnist[:PATH], cifar10[:PATH] or synthetic[:n=...,...]")
        c.add_argument("--epochs", type=int, default=10)
        c.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
        c.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
        c.add_argument("--lr", type=float, default=0.1)
        c.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
        c.add_argument("--weight-decay", type=float, default=0.0)
        c.add_argument("--schedule", default="constant", choices=["constant", "cosine", "step"])
        c.add_argument("--warmup-epochs", type=float, default=0.0, help="linear learning-rate warm-up")
        c.add_argument("--seeds", default="0", help="comma-separated seeds; each compressor runs once per seed")
        c.add_argument("--measure-error", action="store_true",
                       help="log the relative quantization error of the averaged gradient (one extra fp32 all-reduce)")
        c.add_argument("--strategy", default="auto", choices=["auto", "allreduce", "scatter", "allgather", "ps"])
        c.add_argument("--min-numel", type=_min_numel, default=10_000, help="smaller tensors stay fp32 (default 10000; 'auto': measured at the first step from the link and the codec)")
        c.add_argument("--hook-warmup-steps", type=int, default=0, help="first steps averaged in fp32")
        c.add_argument("--adaptive", action="store_true",
                       help="time whole steps with fp32 averaging and with each spec, run the faster, probe again "
                            "every 500 steps and when step time drifts (gradq.adaptive)")
        c.add_argument("--uncompressed", action="append", default=[], metavar="NAME",
                       help="a parameter name left uncompressed (repeatable)")
        c.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "cuda:gloo"],
                       help="gloo (CPU, default), nccl (one GPU per process), or cuda:gloo (gloo on GPU tensors: "
                            "several processes may share one GPU; for testing)")
        c.add_argument("--log-every", type=int, default=1, help="write a step row every N steps")
        c.add_argument("--tensorboard", action="store_true",
                       help="also write TensorBoard event files into each run's directory (tensorboard/; view with "
                            "`tensorboard --logdir OUT`; needs the tensorboard package)")
        c.add_argument("--comm-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="seconds a collective may wait for the other ranks before the run fails with an "
                            "error naming the step (default 300: a dead rank is noticed at once, a stalled "
                            "one after this)")
        c.add_argument("--fsdp", action="store_true",
                       help="shard the model with FSDP2 (fully_shard) instead of DDP: fp32 is stock FSDP2, a gradq "
                            "spec gets gradq's compressed reduce-scatter (gradq.fsdp)")
        c.add_argument("--target", type=float, default=None,
                       help="test accuracy (fraction) for the time-to-target column")
        c.add_argument("--force", action="store_true", help="overwrite run directories that hold other runs")
        c.add_argument("--network", default=None, metavar="RATE",
                       help="as root: one worker per network namespace, links limited to RATE (e.g. 1gbit, "
                            "100mbit) with tbf, as in NETWORK.md; torn down afterwards")
    c.add_argument("--workers", type=int, default=4, help="local worker processes (ignored under torchrun)")
    c.add_argument("--out", default="runs/demo" if demo else None, required=not demo, metavar="DIR",
                   help="directory for the run directories" + (" (default runs/demo)" if demo else ""))
    c.add_argument("--timeout", type=float, default=None, help="seconds one run may take (default: no limit)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradq", description="Gradient quantization for data-parallel PyTorch.")
    p.add_argument("--version", action="version", version=f"gradq {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list every scheme with its default spec")
    k = sub.add_parser("compile", help="compile the CPU kernels once per machine (before torchrun starts many ranks)")
    k.add_argument("--compressor", "-c", action="append", metavar="SPEC",
                   help="compile what this spec uses (repeatable; default: every scheme's kernels)")
    _add_train_args(sub.add_parser("train", help="train data-parallel with one or more compressors"), demo=False)
    _add_train_args(sub.add_parser("demo", help="4 workers on digits: fp32 vs eight compressors and PowerSGD"),
                    demo=True)
    from .perfmodel import add_arguments as perfmodel_arguments

    perfmodel_arguments(sub.add_parser("perfmodel", help="projected time per iteration and throughput vs GPUs"))
    from .convex.cli import add_arguments as convex_arguments

    convex_arguments(sub.add_parser("convex", help="the QSGD paper's convex experiments (trade-off, QSVRG, async, GD)"))
    r = sub.add_parser("report", help="figures and a markdown table from run directories")
    r.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories, or folders holding them")
    r.add_argument("--out", default=None, metavar="DIR", help="where report.md and the PNGs go")
    r.add_argument("--target", type=float, default=None, help="test accuracy (fraction) for time-to-target")
    r.add_argument("--title", default=None)
    c = sub.add_parser("compare", help="quantize a real model's gradients with the given specs (no training)")
    g = c.add_mutually_exclusive_group(required=True)
    g.add_argument("--compressor", "-c", action="append", metavar="SPEC",
                   help="a quantizer spec, e.g. qsgd:bits=4,bucket=512 (repeatable)")
    g.add_argument("--all", action="store_true", help="every scheme at the papers' settings")
    c.add_argument("--data", default="digits", help="digits (default), mnist[:PATH] or synthetic")
    c.add_argument("--model", default="mlp", help="logreg, mlp or lenet (default mlp)")
    c.add_argument("--trials", type=int, default=16, help="encodes per scheme (default 16)")
    c.add_argument("--warm-steps", type=int, default=50, help="SGD steps before taking gradients")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", metavar="FILE", help="also write the rows as JSON lines")
    return p


def _configs(args: argparse.Namespace, compressors: Sequence[str], **fixed: Any) -> list:
    from .train.runner import TrainConfig

    try:
        seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    except ValueError:
        raise GradqError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not seeds:
        raise GradqError("--seeds names no seed")
    keys = ("model", "data", "epochs", "batch_size", "optimizer", "lr", "momentum", "weight_decay", "schedule",
            "warmup_epochs", "measure_error", "strategy", "min_numel", "hook_warmup_steps", "adaptive", "uncompressed",
            "backend", "log_every", "workers", "network", "comm_timeout", "tensorboard", "fsdp")
    base = {k: getattr(args, k) for k in keys if hasattr(args, k)}
    base.update(fixed)
    return [TrainConfig(compressor=c, seed=s, **base) for c in compressors for s in seeds]


def _finish(dirs: list, out: str, target: Optional[float], figures: bool, title: Optional[str] = None) -> None:
    from .train.report import format_console_table, load_runs, summary_rows, write_report

    rows = summary_rows(load_runs(dirs), target=target)
    print(format_console_table(rows))
    if figures:
        md, figs = write_report(dirs, out, target=target, title=title)
        print(f"report: {md}" + (f" ({len(figs)} figures)" if figs else " (figures skipped: matplotlib missing)"))


def _cmd_compile(args: argparse.Namespace) -> int:
    import time

    from .kernels.numba_cache import cache_dir
    from .precompile import precompile

    t0 = time.perf_counter()
    took = precompile(args.compressor, progress=True)
    for spec, seconds in took.items():
        print(f"{spec:36s} {seconds:6.1f} s")
    print(f"compiled in {time.perf_counter() - t0:.1f} s; cache: {cache_dir()}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from .train.launch import run_all

    import os

    from .train.launch import under_torchrun

    cfgs = _configs(args, args.compressor or ["fp32"])
    if args.network:
        from .netem import EmulatedNetwork, can_emulate, parse_rate

        parse_rate(args.network)  # a typo fails before anything else
        if under_torchrun():
            raise GradqError("--network builds its own local workers; it cannot run under torchrun")
        ok, why = can_emulate()
        if not ok:
            print(f"gradq train: cannot emulate a {args.network} network here ({why}); nothing was run")
            return 0
        with EmulatedNetwork(args.workers, args.network) as net:
            dirs = run_all(cfgs, args.out, force=args.force, timeout=args.timeout, net=net)
    else:
        dirs = run_all(cfgs, args.out, force=args.force, timeout=args.timeout)
    if not under_torchrun() or os.environ.get("RANK") == "0":
        _finish(dirs, args.out, args.target, figures=False)
        print(f"logs in {args.out}; figures: gradq report {args.out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """The main job: the compressors against fp32 on loopback, then, where links can be emulated (root),
    fp32, 4-bit QSGD and the adaptive mode on a communication-heavy model at 1 Gbit/s; ends with a
    two-line verdict (what compression gained at 1 Gbit/s, what the adaptive mode chose)."""
    import dataclasses
    import os

    from .train.launch import run_all

    args.seeds = "0"
    cfgs = _configs(args, DEMO_COMPRESSORS, model="mlp", data="digits", epochs=8, batch_size=32, optimizer="sgd",
                    lr=0.1, momentum=0.9, weight_decay=0.0, schedule="constant", warmup_epochs=0.0,
                    measure_error=True, strategy="auto", min_numel=10_000, hook_warmup_steps=0,
                    uncompressed=[], backend="gloo", log_every=1)
    qsgd4 = next(c for c in cfgs if c.compressor == DEMO_ADAPTIVE)
    cfgs.append(dataclasses.replace(qsgd4, adaptive=True, label=None, measure_error=False))
    print(f"gradq demo: {len(cfgs)} runs of an MLP on the embedded digits data, {args.workers} workers, "
          f"8 epochs each, into {args.out}", flush=True)
    dirs = run_all(cfgs, args.out, force=True, timeout=args.timeout)
    _finish(dirs, args.out, 0.9, figures=True, title="gradq demo: MLP on digits, 4 workers")
    loop_choice = _adaptive_choice(dirs[-1])
    verdict = [f"loopback: the adaptive mode chose {loop_choice or 'nothing (too few steps)'} for "
               f"{DEMO_ADAPTIVE} on this model"]
    from .netem import EmulatedNetwork, can_emulate

    ok, why = can_emulate()
    if ok:
        data = _demo_network_data()
        net_cfgs = _configs(args, ["fp32", DEMO_ADAPTIVE], model="mlp-wide", data=data, epochs=1, batch_size=16,
                            optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=0.0, schedule="constant",
                            warmup_epochs=0.0, measure_error=False, strategy="auto", min_numel=10_000,
                            hook_warmup_steps=0, uncompressed=[], backend="gloo", log_every=1, network="1gbit")
        net_cfgs.append(dataclasses.replace(net_cfgs[1], adaptive=True, label=None))
        out = os.path.join(args.out, "1gbit")
        print(f"\ngradq demo: {len(net_cfgs)} runs of the wide MLP (784-2048-2048-10) on {data} over emulated "
              f"1 Gbit/s links, {args.workers} workers, into {out}", flush=True)
        with EmulatedNetwork(args.workers, "1gbit") as net:
            net_dirs = run_all(net_cfgs, out, force=True, timeout=args.timeout, net=net)
        rows = _finish_rows(net_dirs)
        t32, tq = rows[0].get("epoch_s"), rows[1].get("epoch_s")
        if t32 and tq:
            verdict.insert(0, f"1 Gbit/s: {DEMO_ADAPTIVE} trained {t32 / tq:.2f}x faster per epoch than fp32 "
                              f"({tq:.2f} s against {t32:.2f} s); the adaptive mode chose "
                              f"{_adaptive_choice(net_dirs[-1]) or 'nothing (too few steps)'}")
    else:
        verdict.insert(0, f"1 Gbit/s: not run ({why}); `gradq train --network 1gbit` needs root")
    print("\nverdict:\n  " + "\n  ".join(verdict))
    return 0


def _min_numel(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--min-numel takes an integer or 'auto', got {text!r}") from None


#: the spec the demo runs alone and under the adaptive mode
DEMO_ADAPTIVE = "qsgd:bits=4,bucket=512"


def _demo_network_data() -> str:
    """The shared MNIST digits when present next to the checkout, else the embedded digits."""
    from .train.data import DataError, load_dataset

    try:
        load_dataset("mnist")
        return "mnist"
    except (DataError, OSError, ValueError):
        return "digits"


def _finish_rows(dirs: list) -> list:
    from .train.report import format_console_table, load_runs, summary_rows

    rows = summary_rows(load_runs(dirs))
    print(format_console_table(rows))
    return rows


def _adaptive_choice(run_dir: Any) -> Optional[str]:
    """What an adaptive run chose, and from which agreed medians, read from its log's summary."""
    import json
    import os

    path = os.path.join(str(run_dir), "log.jsonl")
    if not os.path.exists(path):
        return None
    summary = next((json.loads(l) for l in open(path) if '"kind": "summary"' in l), None)
    if not summary or not summary.get("adaptive_decisions"):
        return None
    d = summary["adaptive_decisions"][0]
    what = "compression" if summary["adaptive_chosen"] == "spec" else "fp32 averaging"
    return (f"{what} (its probe measured steps of {1e3 * d.get('fp32_s', 0):.1f} ms with fp32 averaging "
            f"against {1e3 * d.get('spec_s', 0):.1f} ms compressed)")


def _cmd_report(args: argparse.Namespace) -> int:
    from .train.report import format_console_table, load_runs, summary_rows, write_report

    print(format_console_table(summary_rows(load_runs(args.runs), target=args.target)))
    md, figs = write_report(args.runs, args.out, target=args.target, title=args.title)
    print(f"report: {md}" + (f" ({len(figs)} figures)" if figs else " (figures skipped: matplotlib missing)"))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "list":
            return _cmd_list(args)
        if args.command == "compile":
            return _cmd_compile(args)
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "demo":
            return _cmd_demo(args)
        if args.command == "report":
            return _cmd_report(args)
        if args.command == "perfmodel":
            from .perfmodel import run as perfmodel_run

            return perfmodel_run(args)
        if args.command == "convex":
            from .convex.cli import run as convex_run

            return convex_run(args)
        if args.trials < 2:
            raise GradqError("--trials must be at least 2 (the bias estimate needs several encodes)")
        return _cmd_compare(args, COMPARE_SPECS if args.all else args.compressor)
    except KeyboardInterrupt:
        print("gradq: interrupted", file=sys.stderr)
        return 130
    except (GradqError, ValueError, RuntimeError, OSError) as e:
        print(f"gradq: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
