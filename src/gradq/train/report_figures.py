"""Figures of a training report (matplotlib, Agg canvas; never pyplot's global state).

Loss and test accuracy against epochs and training time, the time per epoch split into compute /
encode / communicate / decode (the QSGD paper's figure 2), the relative quantization error over
training (the ORQ paper's figure 2), and suboptimality against iterations and bits for convex runs.
Runs sharing a label are drawn as their mean with a shaded min–max band. Each figure is skipped when
its data is absent. Used by :func:`gradq.train.report.write_report`.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .report import PHASES, Run, group_runs, summary_rows

__all__ = ["make_figures", "have_matplotlib"]

Series = dict[Any, tuple[float, float]]  # alignment key (epoch, step, iteration) -> (x, y)


def _series(rows: Sequence[dict[str, Any]], xkey: str, ykey: str, align: Sequence[str] = ("epoch",),
            scale: float = 1.0) -> Series:
    out: Series = {}
    for i, r in enumerate(rows):
        if r.get(xkey) is not None and r.get(ykey) is not None:
            key = next((r[a] for a in align if r.get(a) is not None), i)
            out[key] = (float(r[xkey]), float(r[ykey]) * scale)
    return out


def _aggregate(series: Sequence[Series]) -> tuple[list[float], list[float], list[float], list[float]]:
    """Align runs of one group by key: mean x, mean y, min y, max y, sorted by x."""
    pts = []
    for k in set().union(*series):
        xs, ys = [s[k][0] for s in series if k in s], [s[k][1] for s in series if k in s]
        pts.append((statistics.fmean(xs), statistics.fmean(ys), min(ys), max(ys)))
    pts.sort()
    x, m, lo, hi = (list(c) for c in zip(*pts))
    return x, m, lo, hi


def _qerr_series(run: Run) -> Series:
    """Epoch rows' rel_error; else step rows' rel_error, moving-averaged, at fractional epochs."""
    s = _series(run.epoch_rows, "epoch", "rel_error")
    if s:
        return s
    steps = [r for r in run.step_rows if r.get("rel_error") is not None and r.get("epoch") is not None]
    per_epoch, seen, out = Counter(r["epoch"] for r in steps), Counter(), {}
    w = max(1, len(steps) // 50)  # trailing moving average over ~2% of the run
    for i, r in enumerate(steps):
        seen[r["epoch"]] += 1
        y = statistics.fmean(float(q["rel_error"]) for q in steps[max(0, i - w + 1): i + 1])
        out[r.get("step", i)] = (r["epoch"] - 1 + seen[r["epoch"]] / per_epoch[r["epoch"]], y)
    return out


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _axes(figsize: tuple[float, float] = (6.4, 4.2)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig, ax, path: Path, title: str, xlabel: str, ylabel: str, **legend: Any) -> Path:
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", **legend)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _plot_curves(groups: dict[str, list[Run]], path: Path, get: Callable[[Run], Series], title: str,
                 xlabel: str, ylabel: str, *, logy: Any = False, hline: Optional[float] = None) -> Optional[Path]:
    """One line per group (mean over its runs, min–max band when several); None when there is no data."""
    curves = []
    for label, runs in groups.items():
        series = [s for s in map(get, runs) if s]
        if series:
            curves.append((label, len(series), _aggregate(series)))
    if not curves:
        return None
    fig, ax = _axes()
    for label, n, (x, m, lo, hi) in curves:
        (line,) = ax.plot(x, m, label=label + (f" (mean of {n})" if n > 1 else ""),
                          marker="o" if len(x) <= 30 else None, markersize=3)
        if n > 1:
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1, label=f"target {hline:g}%")
    if logy == "auto":
        pos = [v for _, _, c in curves for v in c[2] + c[3] if v > 0]
        logy = bool(pos) and max(pos) > 10 * min(pos)
    if logy:
        ax.set_yscale("log", nonpositive="mask")
    return _save(fig, ax, path, title, xlabel, ylabel)


def _plot_breakdown(rows: Sequence[dict[str, Any]], path: Path) -> Optional[Path]:
    rows = [r for r in rows if any(r.get(k) for k, _ in PHASES)]
    if not rows:
        return None
    fig, ax = _axes((6.4, 1.4 + 0.5 * len(rows)))
    left = [0.0] * len(rows)
    ys = list(range(len(rows)))
    for key, name in PHASES:
        width = [r.get(key) or 0.0 for r in rows]
        ax.barh(ys, width, left=left, label=name, height=0.6)
        left = [a + b for a, b in zip(left, width)]
    ax.set_yticks(ys, [r["label"] for r in rows])
    ax.invert_yaxis()
    return _save(fig, ax, path, "Time per epoch by phase (mean over epochs and seeds)", "Seconds per epoch (s)", "",
                 loc="center left", bbox_to_anchor=(1.01, 0.5))


def make_figures(runs: Sequence[Run], out_dir: str | Path, *, target: Optional[float] = None) -> list[Path]:
    """Write PNG figures into ``out_dir`` (created if needed) and return their paths.

    loss_vs_epoch, test_accuracy_vs_epoch, loss_vs_time, test_accuracy_vs_time, time_breakdown,
    quantization_error, suboptimality, suboptimality_vs_bits — each only when its data is present.
    ``target`` (fraction, default None) draws a dashed line on the accuracy plots. Returns ``[]`` when
    matplotlib is not installed.
    """
    if not have_matplotlib():
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs)
    hline = None if target is None else 100 * target
    theory = [r for r in runs if r.theory_rows]
    xkey = "iteration" if any(q.get("iteration") is not None for r in theory for q in r.theory_rows) else "epoch"
    specs = [
        ("loss_vs_epoch.png", lambda r: _series(r.epoch_rows, "epoch", "loss"),
         "Training loss", "Epoch", "Mean training loss", {}),
        ("test_accuracy_vs_epoch.png", lambda r: _series(r.epoch_rows, "epoch", "test_accuracy", scale=100),
         "Test accuracy", "Epoch", "Test accuracy (%)", {"hline": hline}),
        ("loss_vs_time.png", lambda r: _series(r.epoch_rows, "wall_s", "loss"),
         "Training loss against training time", "Training time (s)", "Mean training loss", {}),
        ("test_accuracy_vs_time.png", lambda r: _series(r.epoch_rows, "wall_s", "test_accuracy", scale=100),
         "Test accuracy against training time", "Training time (s)", "Test accuracy (%)", {"hline": hline}),
        ("time_breakdown.png", None, "", "", "", {}),
        ("quantization_error.png", _qerr_series, "Relative quantization error ‖Q(g) − g‖ / ‖g‖", "Epoch",
         "Relative error (ratio)", {"logy": "auto"}),
        ("suboptimality.png", lambda r: _series(r.theory_rows, xkey, "suboptimality", (xkey,)),
         "Suboptimality f(x) − f*", xkey.capitalize(), "f(x) − f* (log scale)", {"logy": True}),
        ("suboptimality_vs_bits.png",
         lambda r: _series(r.theory_rows, "bits", "suboptimality", ("iteration", "epoch", "step")),
         "Suboptimality against communication", "Cumulative bits sent (bits)", "f(x) − f* (log scale)",
         {"logy": True}),
    ]
    written = []
    for name, get, title, xlabel, ylabel, kw in specs:
        if get is None:
            p = _plot_breakdown(summary_rows(runs), out / name)
        else:
            p = _plot_curves(groups, out / name, get, title, xlabel, ylabel, **kw)
        if p is not None:
            written.append(p)
    return written


# --------------------------------------------------------------------------------------------- report
