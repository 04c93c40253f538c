"""The ``gradq`` command.

* ``gradq list`` — every scheme with its parameters and defaults.
* ``gradq compare --compressor SPEC ... [--data digits|mnist:PATH|synthetic] [--model mlp|lenet|logreg]``
  — quantize a real model's gradients with each spec and print bits/coordinate, relative error and bias.
* ``gradq demo`` — ``compare`` with every scheme at the papers' settings on the embedded digits data.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from . import __version__
from .errors import GradqError
from .spec import build, registry

__all__ = ["main", "DEMO_SPECS"]

#: every scheme, at the settings the papers used where they name one
DEMO_SPECS = [
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradq", description="Gradient quantization for data-parallel PyTorch.")
    p.add_argument("--version", action="version", version=f"gradq {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list every scheme with its default spec")
    for name, helptext in (("compare", "quantize a real model's gradients with the given specs"),
                           ("demo", "compare every scheme on the embedded digits data")):
        c = sub.add_parser(name, help=helptext)
        if name == "compare":
            c.add_argument("--compressor", "-c", action="append", required=True, metavar="SPEC",
                           help="a quantizer spec, e.g. qsgd:bits=4,bucket=512 (repeatable)")
        c.add_argument("--data", default="digits", help="digits (default), mnist:PATH or synthetic")
        c.add_argument("--model", default="mlp", choices=["mlp", "lenet", "logreg"])
        c.add_argument("--trials", type=int, default=16, help="encodes per scheme (default 16)")
        c.add_argument("--warm-steps", type=int, default=50, help="SGD steps before taking gradients")
        c.add_argument("--seed", type=int, default=0)
        c.add_argument("--json", metavar="FILE", help="also write the rows as JSON lines")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "list":
            return _cmd_list(args)
        if args.trials < 2:
            raise GradqError("--trials must be at least 2 (the bias estimate needs several encodes)")
        specs = DEMO_SPECS if args.command == "demo" else args.compressor
        return _cmd_compare(args, specs)
    except (GradqError, ValueError, RuntimeError) as e:
        print(f"gradq: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
