"""Tables, plots and validation of performance-model predictions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from .core import CONFIG_KEYS, Prediction, predict_config
from .units import PerfModelError, format_rate

__all__ = ["format_table", "plot_sweep", "validate", "Validation"]


def _num(x: Optional[float], digits: int = 4) -> str:
    if x is None:
        return "—"
    if x == 0:
        return "0"
    return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"


def _rate(bw: Optional[float]) -> str:
    """A break-even bandwidth for the table: ``—`` (not asked, fp32, one node), ``never``, ``always``."""
    if bw is None:
        return "—"
    if bw == 0:
        return "never"
    if math.isinf(bw):
        return "always"
    return format_rate(bw)


def format_table(predictions: Sequence[Prediction]) -> str:
    """A markdown table, one row per prediction: compressor, GPUs, nodes, protocol, bits per
    coordinate, compute / codec / communication / iteration ms, throughput (and speedup vs fp32 when
    predicted)."""
    if not predictions:
        raise PerfModelError("no predictions to tabulate")
    unit = predictions[0].throughput_unit
    speed = any(p.speedup_vs_fp32 is not None for p in predictions)
    even = any(p.break_even_bandwidth is not None for p in predictions)
    head = ["compressor", "GPUs", "nodes", "protocol", "bits/coord", "compute ms", "codec ms", "comm ms",
            "iteration ms", f"throughput ({unit})"] + (["speedup vs fp32"] if speed else []) + \
        (["pays below"] if even else [])
    rows = []
    for p in predictions:
        proto = p.protocol + ("" if p.formula == "ring" else f" ({p.formula})")
        r = [p.compressor, str(p.workers), str(p.nodes), proto,
             f"{p.bits:.3f}", _num(p.compute_ms), _num(p.encode_ms + p.decode_ms), _num(p.comm_ms),
             _num(p.iteration_ms), _num(p.throughput)]
        if speed:
            r.append("—" if p.speedup_vs_fp32 is None else f"{p.speedup_vs_fp32:.2f}×")
        if even:
            r.append(_rate(p.break_even_bandwidth))
        rows.append(r)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    left = {0, 3}

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i in left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 2)) if i in left else ("-" * (w + 1) + ":") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def plot_sweep(predictions: Sequence[Prediction], path: str | Path, *, title: Optional[str] = None) -> Path:
    """Write a PNG with two panels against the number of GPUs (log₂ axis): time per iteration (ms) and
    throughput, one line per compressor, plus ideal linear scaling of the first series' smallest
    configuration (dashed). Uses matplotlib's Agg canvas (no pyplot, no display). Returns the path.

    Raises:
        PerfModelError: no predictions, or matplotlib missing (``pip install 'gradq[plots]'``).
    """
    if not predictions:
        raise PerfModelError("no predictions to plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PerfModelError("plotting needs matplotlib: pip install 'gradq[plots]' (or matplotlib)") from None
    series: dict[str, list[Prediction]] = {}
    for p in predictions:
        series.setdefault(p.compressor, []).append(p)
    fig = Figure(figsize=(11, 4.3))
    FigureCanvasAgg(fig)
    ax_t, ax_h = fig.subplots(1, 2)
    counts = sorted({p.workers for p in predictions})
    for name, ps in series.items():
        ps = sorted(ps, key=lambda p: p.workers)
        ax_t.plot([p.workers for p in ps], [p.iteration_ms for p in ps], marker="o", ms=3, label=name)
        pts = [(p.workers, p.throughput) for p in ps if p.throughput is not None]
        if pts:
            ax_h.plot(*zip(*pts), marker="o", ms=3, label=name)
    first = [p for p in sorted(next(iter(series.values())), key=lambda p: p.workers) if p.throughput]
    if first:
        w0, t0 = first[0].workers, first[0].throughput
        ax_h.plot(counts, [t0 * w / w0 for w in counts], ls="--", color="0.6", lw=1, label="linear scaling")
    unit = predictions[0].throughput_unit
    for ax, ylabel in ((ax_t, "time per iteration (ms)"), (ax_h, f"throughput ({unit})")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(counts)
        ax.set_xticklabels([str(c) for c in counts])
        ax.set_xlabel("number of GPUs")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
    ax_h.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, format="png")
    return out


@dataclass(frozen=True)
class Validation:
    """Predicted against measured: one dict per row, a markdown table and the error summary
    (relative error = (predicted − measured) / measured)."""

    rows: list[dict[str, Any]]
    markdown: str
    mean_abs_rel_error: float
    max_abs_rel_error: float


def validate(measured_rows: Sequence[Mapping[str, Any]], defaults: Optional[Mapping[str, Any]] = None, *,
             strict: bool = True) -> Validation:
    """Compare the model with measured per-iteration times.

    Args:
        measured_rows: dicts, each a configuration (keys of :data:`gradq.perfmodel.CONFIG_KEYS`, e.g.
            ``workers``, ``compressor``, ``bandwidth``, ``gradient_mb``, ``compute_ms``, ``encode_ms``)
            plus ``measured_ms`` (required: measured time of one iteration) and optionally
            ``measured_comm_ms`` (measured communication time) and ``label``.
        defaults: configuration keys shared by every row (a row's own values win). Default none.
        strict: unknown keys are an error (default); ``False`` ignores them (e.g. a run directory).

    Returns:
        :class:`Validation` whose rows hold ``label``, ``workers``, ``compressor``, ``protocol``,
        ``predicted_ms``, ``measured_ms``, ``rel_error`` and, where measured, ``predicted_comm_ms``,
        ``measured_comm_ms``, ``comm_rel_error``.
    """
    if not measured_rows:
        raise PerfModelError("validate() needs at least one measured row")
    extra = {"measured_ms", "measured_comm_ms", "label"}
    out: list[dict[str, Any]] = []
    for i, row in enumerate(measured_rows):
        cfg = {**(defaults or {}), **row}
        unknown = sorted(set(cfg) - set(CONFIG_KEYS) - extra)
        if unknown and strict:
            raise PerfModelError(f"row {i}: unknown key(s) {unknown}; valid: {', '.join(CONFIG_KEYS)}, "
                                 "measured_ms, measured_comm_ms, label (or pass strict=False)")
        meas = cfg.get("measured_ms")
        if isinstance(meas, bool) or not isinstance(meas, (int, float)) or not meas > 0 or not math.isfinite(meas):
            raise PerfModelError(f"row {i}: measured_ms must be a positive number, got {meas!r}")
        pred = predict_config({k: v for k, v in cfg.items() if k in CONFIG_KEYS})
        r: dict[str, Any] = {
            "label": cfg.get("label") or f"{pred.compressor} M={pred.workers}", "workers": pred.workers,
            "compressor": pred.compressor, "protocol": pred.protocol, "predicted_ms": pred.iteration_ms,
            "measured_ms": float(meas), "rel_error": (pred.iteration_ms - meas) / meas,
        }
        mc = cfg.get("measured_comm_ms")
        if mc is not None:
            r["predicted_comm_ms"] = pred.comm_ms
            r["measured_comm_ms"] = float(mc)
            r["comm_rel_error"] = (pred.comm_ms - mc) / mc if mc > 0 else None
        out.append(r)
    errs = [abs(r["rel_error"]) for r in out]
    comm = any("measured_comm_ms" in r for r in out)
    lines = ["| configuration | GPUs | predicted ms | measured ms | rel. error |"
             + (" predicted comm ms | measured comm ms | comm rel. error |" if comm else ""),
             "|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if comm else "")]
    for r in out:
        s = (f"| {r['label']} | {r['workers']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | "
             f"{100 * r['rel_error']:+.1f}% |")
        if comm:
            if "measured_comm_ms" in r:
                ce = r["comm_rel_error"]
                s += (f" {r['predicted_comm_ms']:.1f} | {r['measured_comm_ms']:.1f} | "
                      f"{'—' if ce is None else f'{100 * ce:+.1f}%'} |")
            else:
                s += " — | — | — |"
        lines.append(s)
    mean, worst = sum(errs) / len(errs), max(errs)
    lines.append(f"\nmean |relative error| {100 * mean:.1f}%, max {100 * worst:.1f}% over {len(out)} configurations")
    return Validation(out, "\n".join(lines), mean, worst)
