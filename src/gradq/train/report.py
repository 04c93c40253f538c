"""Turn training run logs (``config.json`` + ``log.jsonl``) into a markdown table and figures.

A run directory holds ``config.json`` and ``log.jsonl`` (one JSON object per line with ``"kind"`` in
``step`` / ``epoch`` / ``summary``; convex runs add ``"suboptimality"``). Runs that share a label — the
same compressor trained with several seeds — form one group: tables show mean ± sample standard
deviation over the seeds and figures draw the mean as a line with a shaded min–max band.

    from gradq.train.report import write_report
    md_path, figures = write_report(["runs/"], target=0.9)

Figures need matplotlib (``pip install 'gradq[plots]'``); without it :func:`make_figures` returns ``[]``.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from ..errors import GradqError

__all__ = ["ReportError", "Run", "load_runs", "group_runs", "summary_rows", "markdown_table",
           "format_console_table", "make_figures", "write_report"]

PHASES = (("compute_s", "compute"), ("encode_s", "encode"), ("comm_s", "communicate"), ("decode_s", "decode"))
_PLOTS_HINT = "matplotlib is not installed (pip install 'gradq[plots]')"
_TEXT_COLUMNS = ("Label", "Compressor")


class ReportError(GradqError, ValueError):
    """Run logs cannot be found or read; the message names the path (and line) and how to fix it."""


@dataclass
class Run:
    """One training run: its directory, its ``config.json`` (``{}`` if absent) and its log rows."""

    path: Path
    config: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def step_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("kind") == "step"]

    @property
    def epoch_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("kind") == "epoch"]

    @property
    def theory_rows(self) -> list[dict[str, Any]]:
        """Rows of convex/theory runs: any row with a ``suboptimality`` value."""
        return [r for r in self.rows if r.get("suboptimality") is not None]

    @property
    def compressor(self) -> str:
        """``config["compressor"]``, else the first row's ``compressor``, else the directory name."""
        if self.config.get("compressor"):
            return str(self.config["compressor"])
        return next((str(r["compressor"]) for r in self.rows if r.get("compressor")), self.path.name)

    @property
    def label(self) -> str:
        """``config["label"]``, falling back to :attr:`compressor`."""
        return str(self.config.get("label") or self.compressor)

    @property
    def seed(self) -> Any:
        return self.config.get("seed")


def _read_json_lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ReportError(f"{path}:{n}: malformed JSON ({e.msg}, column {e.colno}); fix or delete "
                                  "that line (a run killed mid-write can leave a truncated last line)") from None
            if not isinstance(obj, dict):
                raise ReportError(f"{path}:{n}: expected one JSON object per line, got {type(obj).__name__}")
            rows.append(obj)
    return rows


def _run_dirs(p: Path) -> list[Path]:
    if not p.exists():
        raise ReportError(f"{p}: no such file or directory; pass run directories (holding log.jsonl) "
                          "or a folder that contains them")
    if p.is_file():
        if p.name == "log.jsonl":
            return [p.parent]
        raise ReportError(f"{p}: not a run directory; pass the folder that holds config.json and log.jsonl")
    if (p / "log.jsonl").is_file():
        return [p]
    found = sorted(q.parent for q in p.rglob("log.jsonl") if q.is_file())
    if not found:
        raise ReportError(f"{p}: no run directories found (no log.jsonl in it or below it); a run "
                          "directory is the output folder of `gradq train`")
    return found


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    """Load runs from run directories or parents searched recursively (sorted), in the order given.

    Raises :class:`ReportError` (a ``ValueError``) naming the path when nothing is found, and naming
    ``file:line`` for a malformed log line. A run without ``config.json`` loads with ``config == {}``.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise ReportError("no paths given; pass one or more run directories")
    dirs: dict[Path, None] = {}
    for p in paths:
        for d in _run_dirs(Path(p)):
            dirs.setdefault(d, None)
    runs = []
    for d in dirs:
        cfg = d / "config.json"
        try:
            config = json.loads(cfg.read_text(encoding="utf-8")) if cfg.is_file() else {}
        except json.JSONDecodeError as e:
            raise ReportError(f"{cfg}:{e.lineno}: malformed JSON ({e.msg}); fix or delete config.json") from None
        if not isinstance(config, dict):
            raise ReportError(f"{cfg}: expected a JSON object, got {type(config).__name__}")
        runs.append(Run(d, config, _read_json_lines(d / "log.jsonl")))
    return runs


def group_runs(runs: Iterable[Run]) -> dict[str, list[Run]]:
    """Runs grouped by :attr:`Run.label`, groups and runs in first-seen order."""
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.label, []).append(r)
    return groups


# ----------------------------------------------------------------------------------------- statistics
def _vals(xs: Iterable[Any]) -> list[float]:
    return [float(x) for x in xs if x is not None]


def _mean(xs: Iterable[Any]) -> Optional[float]:
    v = _vals(xs)
    return statistics.fmean(v) if v else None


def _put(row: dict[str, Any], key: str, xs: Iterable[Any]) -> None:
    """``row[key]`` = mean, ``row[key + "_std"]`` = sample std (None with fewer than two values)."""
    v = _vals(xs)
    row[key] = statistics.fmean(v) if v else None
    row[key + "_std"] = statistics.stdev(v) if len(v) > 1 else None


def _last(rows: Sequence[dict[str, Any]], key: str) -> Any:
    return next((r[key] for r in reversed(rows) if r.get(key) is not None), None)


def _per_epoch(run: Run, key: str) -> list[float]:
    """Epoch totals of ``key``: from epoch rows, else summed over each epoch's step rows."""
    v = _vals(r.get(key) for r in run.epoch_rows)
    if v:
        return v
    sums: dict[Any, float] = {}
    for r in run.step_rows:
        if r.get(key) is not None and r.get("epoch") is not None:
            sums[r["epoch"]] = sums.get(r["epoch"], 0.0) + float(r[key])
    return list(sums.values())


def _epoch_times(run: Run) -> list[float]:
    v = _vals(r.get("epoch_s") for r in run.epoch_rows)
    if v:
        return v
    walls = _vals(r.get("wall_s") for r in run.epoch_rows)
    return [b - a for a, b in zip([0.0] + walls, walls)]


def summary_rows(runs: Sequence[Run], *, target: Optional[float] = None) -> list[dict[str, Any]]:
    """One dict per label group (first-seen order) with mean (``key``) and sample std (``key_std``).

    Keys: label, compressor, runs, seeds, final/best_test_accuracy, final_train_loss,
    final_suboptimality and final_bits (theory runs, instead of accuracies), bits_per_coordinate,
    mb_per_epoch (MB sent per worker per epoch), epoch_s (median), compute_s / encode_s / comm_s /
    decode_s (mean seconds per epoch), rel_error, and with ``target`` (a fraction, default None):
    time_to_target (mean wall_s of the first epoch reaching it, None unless every run reached it),
    target_reached (how many runs did) and target.
    """
    if target is not None and not 0 < target <= 1:
        raise ReportError(f"target={target!r}: give the target accuracy as a fraction in (0, 1], e.g. 0.9")
    out = []
    for label, group in group_runs(runs).items():
        row: dict[str, Any] = {"label": label, "compressor": ", ".join(dict.fromkeys(r.compressor for r in group)),
                               "runs": len(group), "seeds": [r.seed for r in group]}
        theory = any(r.theory_rows for r in group)
        _put(row, "final_suboptimality", [_last(r.theory_rows, "suboptimality") for r in group] if theory else [])
        row["final_bits"] = _mean(_last(r.theory_rows, "bits") for r in group)
        accs = [] if theory else [_vals(x.get("test_accuracy") for x in r.epoch_rows) for r in group]
        _put(row, "final_test_accuracy", [a[-1] for a in accs if a])
        _put(row, "best_test_accuracy", [max(a) for a in accs if a])
        _put(row, "final_train_loss", [_last(r.epoch_rows, "loss") if r.epoch_rows else _last(r.step_rows, "loss")
                                       for r in group])
        for key in ("bits_per_coordinate", "rel_error"):  # epoch means, else step values
            row[key] = _mean(v for r in group for v in (_vals(x.get(key) for x in r.epoch_rows)
                                                        or _vals(x.get(key) for x in r.step_rows)))
        mb = [b / 1e6 for r in group for b in _per_epoch(r, "bytes_sent")]
        row["mb_per_epoch"] = statistics.fmean(mb) if mb else None
        times = [t for r in group for t in _epoch_times(r)]
        row["epoch_s"] = statistics.median(times) if times else None
        for key, _ in PHASES:
            row[key] = _mean(t for r in group for t in _per_epoch(r, key))
        row["target"] = target
        row["time_to_target"] = row["target_reached"] = None
        if target is not None and any(accs):
            hits = [next((x.get("wall_s") for x in r.epoch_rows if x.get("test_accuracy") is not None
                          and x["test_accuracy"] >= target), None) for r in group]
            row["target_reached"] = sum(h is not None for h in hits)
            row["time_to_target"] = _mean(hits) if row["target_reached"] == len(group) else None
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------- tables
def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if abs(s) < 1 else f"{s:.2f} s" if abs(s) < 100 else f"{s:.0f} s"


def _with_std(row: dict[str, Any], key: str, fmt: Callable[[float], str], pm: str, unit: str = "") -> str:
    m = row.get(key)
    if m is None:
        return ""
    s = row.get(key + "_std")
    return fmt(m) + (f" {pm} {fmt(s)}" if s is not None else "") + unit


def _ttt(row: dict[str, Any]) -> str:
    if row.get("target") is None or row.get("target_reached") is None:  # no target, or no accuracy logged
        return ""
    if row.get("time_to_target") is not None:
        return _fmt_time(row["time_to_target"])
    return "never" if not row.get("target_reached") else f"{row['target_reached']}/{row['runs']} reached"


def _cells(rows: Sequence[dict[str, Any]], pm: str) -> tuple[list[str], list[list[str]]]:
    """Headers and cell text of the table, columns empty in every row left out."""
    pct = lambda v: f"{100 * v:.2f}"  # noqa: E731
    opt = lambda key, fmt: lambda r: fmt(r[key]) if r.get(key) is not None else ""  # noqa: E731
    target = next((r["target"] for r in rows if r.get("target") is not None), None)
    cols: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("Label", lambda r: str(r["label"])),
        ("Compressor", lambda r: r["compressor"] if any(x["compressor"] != x["label"] for x in rows) else ""),
        ("Runs", lambda r: str(r["runs"])),
        ("Final test acc.", lambda r: _with_std(r, "final_test_accuracy", pct, pm, "%")),
        ("Best test acc.", lambda r: _with_std(r, "best_test_accuracy", pct, pm, "%")),
        ("Final train loss", lambda r: _with_std(r, "final_train_loss", lambda v: f"{v:.4f}", pm)),
        ("Final suboptimality", lambda r: _with_std(r, "final_suboptimality", lambda v: f"{v:.3g}", pm)),
        ("Bits sent", opt("final_bits", lambda v: f"{v:.4g}")),
        ("Bits/coord.", opt("bits_per_coordinate", lambda v: f"{v:.2f}")),
        ("MB/epoch/worker", opt("mb_per_epoch", lambda v: f"{v:.3f} MB")),
        ("Epoch time (median)", opt("epoch_s", _fmt_time)),
    ] + [(f"{name.capitalize()}/epoch", opt(key, _fmt_time)) for key, name in PHASES] + [
        ("Rel. quant. error", opt("rel_error", lambda v: f"{v:.4f}")),
        (f"Time to {100 * target:g}%" if target is not None else "Time to target", _ttt),
    ]
    table = [(name, [fn(r) for r in rows]) for name, fn in cols]
    table = [(name, cells) for name, cells in table if any(cells)]
    return [name for name, _ in table], [list(cells) for cells in zip(*(c for _, c in table))]


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """A GitHub markdown table of :func:`summary_rows` output (accuracy in %, MB, ms or s; ± sample std
    over seeds where a group has several runs). Columns empty for every row are dropped; ``""`` if no rows."""
    if not rows:
        return ""
    headers, body = _cells(rows, "±")
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join(":---" if h in _TEXT_COLUMNS else "---:" for h in headers) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def format_console_table(rows: Sequence[dict[str, Any]]) -> str:
    """The same table as plain aligned text (ASCII ``+-`` for ±), for printing at the end of training."""
    if not rows:
        return ""
    headers, body = _cells(rows, "+-")
    widths = [max(len(x) for x in col) for col in zip(headers, *body)]
    fmt = lambda cells: "  ".join(c.ljust(w) if h in _TEXT_COLUMNS else c.rjust(w)  # noqa: E731
                                  for h, c, w in zip(headers, cells, widths)).rstrip()
    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(r) for r in body]) + "\n"


def _essentials(run: Run, base: Path) -> str:
    c = run.config
    try:
        where = Path(os.path.relpath(run.path, base)).as_posix()
    except ValueError:  # another drive on Windows
        where = str(run.path)
    bits = [f"{k} {c[k]}" for k in ("model", "data", "workers", "epochs", "seed") if c.get(k) is not None]
    if run.compressor != run.label:
        bits.insert(0, f"compressor `{run.compressor}`")
    return f"- `{where}` — **{run.label}**" + (": " + ", ".join(bits) if bits else " (no config.json)")


def write_report(paths: Sequence[str | Path] | str | Path, out_dir: Optional[str | Path] = None, *,
                 target: Optional[float] = None, title: Optional[str] = None) -> tuple[Path, list[Path]]:
    """Load runs from ``paths``, write ``out_dir/report.md`` and its figures; return (md path, figures).

    ``out_dir`` defaults to the single path given, or else to the common parent of the run directories.
    ``target`` (fraction, default None) adds a time-to-target column; ``title`` defaults to
    "gradq training report".
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    runs = load_runs(paths)
    if out_dir is None:
        single = Path(paths[0])
        out_dir = single if len(paths) == 1 and single.is_dir() else \
            Path(os.path.commonpath([str(r.path.resolve()) for r in runs]))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(runs, target=target)
    from .report_figures import have_matplotlib, make_figures

    figures = make_figures(runs, out, target=target)
    n_groups = len(rows)
    lines = [f"# {title or 'gradq training report'}", "",
             f"{len(runs)} run{'s' * (len(runs) != 1)} in {n_groups} group{'s' * (n_groups != 1)}; "
             "groups with several runs show mean ± sample standard deviation over seeds."
             + (f" Target test accuracy: {100 * target:g}%." if target is not None else ""), "",
             markdown_table(rows),
             "Times per phase are means per epoch; epoch time is the median over epochs and seeds; "
             "MB are 10^6 bytes sent by one worker.", "", "## Runs", ""]
    lines += [_essentials(r, out) for r in runs] + ["", "## Figures", ""]
    if figures:
        for f in figures:
            lines += [f"![{f.stem.replace('_', ' ')}]({f.relative_to(out).as_posix()})", ""]
    elif not have_matplotlib():
        lines += [f"Figures skipped: {_PLOTS_HINT}.", ""]
    else:
        lines += ["No figure: the logs hold no plottable data.", ""]
    md = out / "report.md"
    md.write_text("\n".join(lines), encoding="utf-8")
    return md, figures


def __getattr__(name: str) -> Any:
    """``make_figures`` and ``have_matplotlib`` live in :mod:`.report_figures`, which imports this module;
    they are fetched on first use so that either module can be imported first."""
    if name in ("make_figures", "have_matplotlib"):
        from . import report_figures

        return getattr(report_figures, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
