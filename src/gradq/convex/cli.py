"""``gradq convex tradeoff|qsvrg|async|gd``: the QSGD paper's convex experiments from the command line.

* ``tradeoff`` — SGD with ``Q_s`` for ``s = 1, 2, 4, …`` and fp32: iterations and bits to reach ε, and the
  measured variance blow-up against Lemma 3.1's ``min(n/s², √n/s)`` (:mod:`gradq.convex.tradeoff`).
* ``qsvrg`` — QSVRG's linear convergence against plain QSGD on the same gradient budget
  (:mod:`gradq.convex.qsvrg`).
* ``async`` — asynchronous parameter-server QSGD (:mod:`gradq.convex.async_ps`, its own options).
* ``gd`` — gradient descent with appendix F's top-component sign quantizer against plain GD
  (:mod:`gradq.convex.gd`).

Each command writes one run directory per run under ``--out`` (default ``runs/convex/<experiment>``;
an existing non-empty folder is refused unless ``--force``), prints a table of the results and writes
``report.md`` with figures there (:func:`gradq.train.report.write_report`). Every default finishes in
well under a minute on two cores.

    gradq convex tradeoff --levels 1,2,4,8 --eps 1e-3
    gradq convex qsvrg --epochs 15
    gradq convex gd --problem logreg-synthetic
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from ..errors import GradqError
from .problems import PROBLEMS, make_problem
from .runlog import check_out_dir, format_table, parse_seeds

__all__ = ["add_arguments", "run", "parse_levels", "parse_seeds"]

EXPERIMENTS = ("tradeoff", "qsvrg", "async", "gd")
_ASYNC_IMPORT_ERROR: Optional[BaseException] = None


def parse_levels(text: Optional[str]) -> Optional[list[int]]:
    """Levels from ``"1,2,4,8"``; ``None`` or ``"auto"`` gives ``None`` (powers of two up to ≈ √n)."""
    if text is None or str(text).strip().lower() == "auto":
        return None
    try:
        levels = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise GradqError(f"--levels must be 'auto' or comma-separated integers such as 1,2,4,8; got {text!r}") from None
    if not levels or min(levels) < 1:
        raise GradqError(f"--levels needs integers >= 1 (the number of QSGD levels s), got {text!r}")
    return levels


def _common(p: argparse.ArgumentParser, experiment: str, workers: int, seeds: str) -> None:
    g = p.add_argument_group("problem and output")
    g.add_argument("--problem", default="lsq-synthetic", choices=PROBLEMS,
                   help="convex problem (default lsq-synthetic)")
    g.add_argument("--samples", type=int, default=None,
                   help="number of samples (default: 512 synthetic, all 1797 digits)")
    g.add_argument("--dim", type=int, default=None, help="dimension n of a synthetic problem (default 32)")
    g.add_argument("--reg", type=float, default=None, help="L2 weight (default 1e-3 lsq, 1e-2 logreg)")
    g.add_argument("--problem-seed", type=int, default=0, help="seed of the problem's data (default 0)")
    if experiment == "gd":
        g.add_argument("--workers", type=int, default=1, help="must be 1: appendix F's method is single-machine "
                                                              "gradient descent (default 1)")
    else:
        g.add_argument("--workers", type=int, default=workers, help=f"simulated workers K (default {workers})")
        g.add_argument("--seeds", default=seeds, help=f"comma-separated run seeds, averaged (default {seeds})")
    g.add_argument("--out", default=f"runs/convex/{experiment}", metavar="DIR",
                   help=f"folder for the run directories and report.md (default runs/convex/{experiment})")
    g.add_argument("--force", action="store_true", help="replace the runs in a non-empty --out")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``convex`` sub-commands to ``parser`` (every default is stated in its help)."""
    global _ASYNC_IMPORT_ERROR
    sub = parser.add_subparsers(dest="experiment", required=True, metavar="{" + ",".join(EXPERIMENTS) + "}")
    t = sub.add_parser("tradeoff", help="iterations and bits to reach eps against the number of QSGD levels")
    _common(t, "tradeoff", 4, "0,1,2")
    e = t.add_argument_group("experiment")
    e.add_argument("--levels", default="auto", help="QSGD levels s, e.g. 1,2,4,8 (default auto: powers of two "
                                                    "up to the first >= sqrt(n))")
    e.add_argument("--eps", type=float, default=1e-3, help="target suboptimality f(x) - f* (default 1e-3)")
    e.add_argument("--lr", type=float, default=None, help="largest step size (default 0.5/L)")
    e.add_argument("--schedule", choices=("decay", "constant"), default="decay",
                   help="step min(lr, 2/(mu t)) or constant lr (default decay)")
    e.add_argument("--batch", type=int, default=8, help="samples per worker per iteration (default 8)")
    e.add_argument("--max-iters", type=int, default=5000, help="iteration cap per run (default 5000)")
    e.add_argument("--coding", choices=("elias", "fixed"), default="elias", help="QSGD wire coding (default elias)")
    e.add_argument("--no-fp32", action="store_true", help="skip the unquantized baseline")
    e.add_argument("--log-every", type=int, default=10, help="log every N iterations (default 10)")

    q = sub.add_parser("qsvrg", help="QSVRG (linear convergence) against plain QSGD on the same gradient budget")
    _common(q, "qsvrg", 4, "0,1")
    e = q.add_argument_group("experiment")
    e.add_argument("--epochs", type=int, default=15, help="epochs (default 15)")
    e.add_argument("--inner", type=int, default=None, help="inner steps per epoch T (default: shard size)")
    e.add_argument("--lr", type=float, default=None, help="step size eta (default 0.2/L)")
    e.add_argument("--levels", type=int, default=None, help="levels of Q~ (default ceil(sqrt(n)))")
    e.add_argument("--coding", choices=("elias", "fixed"), default="elias", help="QSGD wire coding (default elias)")
    e.add_argument("--schedule", choices=("decay", "constant"), default="decay",
                   help="plain QSGD's step: min(lr, 2/(mu t)) or constant (default decay)")
    e.add_argument("--no-plain", action="store_true", help="skip the plain QSGD comparison")
    e.add_argument("--floor", type=float, default=1e-12,
                   help="suboptimality below which epochs are left out of the contraction fit (default 1e-12)")

    a = sub.add_parser("async", help="asynchronous parameter-server QSGD (staleness, convergence)")
    try:
        from .async_ps import add_async_arguments

        add_async_arguments(a)
    except Exception as exc:  # reported when the command is used, so the other commands keep working
        _ASYNC_IMPORT_ERROR = exc
        a.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    d = sub.add_parser("gd", help="gradient descent with appendix F's top-component sign quantizer vs plain GD")
    _common(d, "gd", 1, "0")
    e = d.add_argument_group("experiment")
    e.add_argument("--eps", type=float, default=1e-10, help="target suboptimality (default 1e-10)")
    e.add_argument("--lr", type=float, default=None,
                   help="step size of both runs (default 1/(L sqrt(n)) quantized, 1/L plain)")
    e.add_argument("--max-iters", type=int, default=20000, help="iteration cap (default 20000)")
    e.add_argument("--no-fp32", action="store_true", help="skip plain GD")
    e.add_argument("--log-every", type=int, default=1, help="log every N iterations (default 1)")


def _problem(args: argparse.Namespace) -> Any:
    return make_problem(args.problem, seed=args.problem_seed, n_samples=args.samples, dim=args.dim, reg=args.reg)


def _finish(out: Any, table: list[dict[str, Any]], title: str) -> int:
    from ..train.report import write_report

    print(format_table(table))
    md, figs = write_report([out], target=None, title=title)
    print(f"report: {md}" + (f" ({len(figs)} figures)" if figs else " (figures skipped: matplotlib missing)"))
    return 0


def _prepare(cfg: Any, args: argparse.Namespace, what: str) -> Path:
    """Validate ``cfg``, check (or with ``--force`` clear) ``--out``, say what runs where; returns ``--out``."""
    cfg.validate()
    out = check_out_dir(args.out, force=args.force)
    if not args.quiet:
        print(f"{what} -> {out}", flush=True)
    return out


def _check_workers(problem: Any, workers: int) -> None:
    if not 1 <= workers <= problem.n_samples:
        raise GradqError(f"--workers must be between 1 and the number of samples ({problem.n_samples}), got {workers}")


def run(args: argparse.Namespace) -> int:
    """Carry out ``gradq convex <experiment>`` for parsed ``args``; returns the exit status (0)."""
    exp = args.experiment
    if exp == "async":
        if _ASYNC_IMPORT_ERROR is not None:
            raise GradqError(f"gradq convex async is unavailable: gradq.convex.async_ps could not be imported "
                             f"({type(_ASYNC_IMPORT_ERROR).__name__}: {_ASYNC_IMPORT_ERROR})")
        from .async_ps import run_async

        return run_async(args)
    progress = not args.quiet
    problem = _problem(args)
    if exp == "tradeoff":
        from .tradeoff import TradeoffConfig, plot_tradeoff, run_tradeoff, tradeoff_table

        _check_workers(problem, args.workers)
        cfg = TradeoffConfig(problem=args.problem, workers=args.workers, batch=args.batch,
                             levels=parse_levels(args.levels), fp32=not args.no_fp32, eps=args.eps, lr=args.lr,
                             schedule=args.schedule, max_iters=args.max_iters,
                             seeds=parse_seeds(args.seeds, [0]), coding=args.coding,
                             problem_seed=args.problem_seed, log_every=args.log_every)
        out = _prepare(cfg, args, f"tradeoff on {problem!r}, {cfg.workers} workers, eps {cfg.eps:g}, seeds {cfg.seeds}")
        run_tradeoff(cfg, out, progress=progress, problem=problem)
        table = tradeoff_table(out)
        fig = plot_tradeoff(table, Path(out) / "bits_to_eps_vs_s.png")
        if fig is not None:
            print(f"figure: {fig}")
        return _finish(out, table, f"QSGD communication/convergence trade-off on {args.problem}")
    if exp == "qsvrg":
        from .qsvrg import QSVRGConfig, qsvrg_table, run_qsvrg

        _check_workers(problem, args.workers)
        cfg = QSVRGConfig(problem=args.problem, workers=args.workers, epochs=args.epochs, inner=args.inner,
                          lr=args.lr, levels=args.levels, coding=args.coding, schedule=args.schedule,
                          seeds=parse_seeds(args.seeds, [0]), floor=args.floor, problem_seed=args.problem_seed,
                          plain=not args.no_plain)
        out = _prepare(cfg, args,
                       f"qsvrg on {problem!r}, {cfg.workers} workers, {cfg.epochs} epochs, seeds {cfg.seeds}")
        run_qsvrg(cfg, out, progress=progress, problem=problem)
        return _finish(out, qsvrg_table(out), f"QSVRG against plain QSGD on {args.problem}")
    if exp == "gd":
        from .gd import GDConfig, gd_table, run_gd

        if args.workers != 1:
            raise GradqError("gradq convex gd runs appendix F's single-machine gradient descent; use --workers 1 "
                             "(the tradeoff and qsvrg experiments simulate several workers)")
        cfg = GDConfig(problem=args.problem, lr=args.lr, eps=args.eps, max_iters=args.max_iters,
                       fp32=not args.no_fp32, problem_seed=args.problem_seed, log_every=args.log_every)
        out = _prepare(cfg, args, f"gd on {problem!r}, eps {cfg.eps:g}")
        run_gd(cfg, out, progress=progress, problem=problem)
        return _finish(out, gd_table(out), f"Quantized gradient descent (appendix F) on {args.problem}")
    raise GradqError(f"unknown convex experiment {exp!r}; choose one of {', '.join(EXPERIMENTS)}")


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m gradq.convex.cli ...`` (the same as ``gradq convex ...``)."""
    parser = argparse.ArgumentParser(prog="gradq convex", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
