"""Run directories of the convex experiments, in the format :mod:`gradq.train.report` reads.

A run directory holds

* ``config.json`` — the run's settings: at least ``label`` (display name; runs sharing a label are the
  seeds of one group), ``compressor`` (a gradq spec or ``"fp32"``), ``experiment``
  (``tradeoff`` / ``qsvrg`` / ``async`` / ``gd``), ``problem``, ``workers``, ``seed``, ``lr``, the
  experiment's own settings, and ``torch_version`` / ``gradq_version`` (added here when absent);
* ``log.jsonl`` — one JSON object per line: ``kind`` (``step`` / ``epoch`` / ``summary``),
  ``compressor`` (added here from the config when absent), ``suboptimality`` ``f(x) − f*`` and the
  cumulative ``bits`` sent by all workers on logged rows, ``iteration`` (1-based) on ``step`` rows,
  ``epoch`` (1-based) on ``epoch`` rows, and one final ``summary`` row with the headline numbers.

Non-finite floats (``nan``, ``inf``) are written as ``null`` so every line is standard JSON; tensors and
numpy scalars are converted to Python numbers.

    with RunLog(run_subdir(out, "QSGD s=4", seed=0), config) as log:
        log.row(kind="step", iteration=1, suboptimality=0.3, bits=1234)
        log.summary(iterations_to_eps=120)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import GradqError

__all__ = ["DivergedError", "RunLog", "NullLog", "open_log", "run_subdir", "jsonable", "load_summaries",
           "group_by_label", "summary_groups", "format_table", "check_out_dir", "parse_seeds"]

_REQUIRED = ("label", "compressor", "experiment")


class DivergedError(GradqError, FloatingPointError):
    """An iteration left the finite range; the message names the run and the flag to lower (``--lr``)."""


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data: tensors/numpy scalars to numbers or lists, nan/inf to ``None``."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    elif hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (TypeError, ValueError):
            pass
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


class RunLog:
    """Write one run's ``config.json`` and ``log.jsonl`` (see the module docstring).

    Use as a context manager: entering creates the directory, writes ``config.json`` and starts a fresh
    ``log.jsonl`` (an existing one is overwritten; refusing a non-empty output folder is the caller's
    job); leaving closes the file. :meth:`row` outside a ``with`` block opens the log on first use.
    ``config`` must contain ``label``, ``compressor`` and ``experiment``.
    """

    def __init__(self, run_dir: str | os.PathLike, config: dict[str, Any]) -> None:
        missing = [k for k in _REQUIRED if k not in config]
        if missing:
            raise ValueError(f"run config lacks {', '.join(missing)}; a convex run config needs at least "
                             f"{', '.join(_REQUIRED)}")
        from .. import __version__

        self.dir = Path(run_dir)
        self.config: dict[str, Any] = dict(config)
        self.config.setdefault("torch_version", torch.__version__)
        self.config.setdefault("gradq_version", __version__)
        self._file: Optional[Any] = None
        self.rows_written = 0

    @property
    def compressor(self) -> str:
        return str(self.config["compressor"])

    def open(self) -> "RunLog":
        """Create the directory, write ``config.json``, start ``log.jsonl`` (idempotent)."""
        if self._file is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "config.json").write_text(json.dumps(jsonable(self.config), indent=2) + "\n")
            self._file = open(self.dir / "log.jsonl", "w", encoding="utf-8")
        return self

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "RunLog":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def row(self, **fields: Any) -> None:
        """Append one JSON line; ``compressor`` is filled in from the config when absent."""
        if "kind" not in fields:
            raise ValueError("a log row needs kind='step', 'epoch' or 'summary'")
        self.open()
        fields.setdefault("compressor", self.compressor)
        self._file.write(json.dumps(jsonable(fields)) + "\n")
        self._file.flush()
        self.rows_written += 1

    def summary(self, **fields: Any) -> None:
        """Append the final ``kind="summary"`` row."""
        fields.pop("kind", None)
        self.row(kind="summary", **fields)


class NullLog:
    """Stands in for :class:`RunLog` when a run is not written to disk (every call does nothing)."""

    def __enter__(self) -> "NullLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def row(self, **fields: Any) -> None:
        pass

    def summary(self, **fields: Any) -> None:
        pass


def open_log(run_dir: Optional[str | os.PathLike], config: dict[str, Any]) -> RunLog | NullLog:
    """``RunLog(run_dir, config)``, or a :class:`NullLog` when ``run_dir`` is ``None``; use with ``with``."""
    return NullLog() if run_dir is None else RunLog(run_dir, config)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "=.+-" else "_" for c in str(text)).strip("_")[:80] or "run"


def run_subdir(out: str | os.PathLike, label: str, seed: Optional[int] = None) -> Path:
    """``out/<label slug>`` (``out/<label slug>-s<seed>`` when ``seed`` is given): a filesystem-safe name
    keeping letters, digits and ``= . + -``, everything else becomes ``_``."""
    name = _slug(label)
    if seed is not None:
        name += f"-s{int(seed)}"
    return Path(out) / name


def load_summaries(out: str | os.PathLike) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(config, summary row)`` of every finished run under ``out`` (sorted by directory name); runs
    without a summary row (interrupted) are skipped."""
    found = []
    for log in sorted(Path(out).rglob("log.jsonl")):
        conf_path = log.parent / "config.json"
        config = json.loads(conf_path.read_text()) if conf_path.exists() else {}
        summary = None
        for line in log.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("kind") == "summary":
                    summary = row
        if summary is not None:
            found.append((config, summary))
    return found


def group_by_label(pairs: list[tuple[dict[str, Any], dict[str, Any]]]
                   ) -> dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Group ``(config, summary)`` pairs by ``config["label"]`` in first-seen order (seeds of one setting)."""
    groups: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for config, summary in pairs:
        groups.setdefault(str(config.get("label", "?")), []).append((config, summary))
    return groups


def summary_groups(source: str | os.PathLike | list[dict[str, Any]], experiment: str
                   ) -> dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """The summaries an experiment's table is built from, grouped by label: from a run folder (only the
    runs whose config names ``experiment``) or from the rows a ``run_*`` function returned (each with a
    ``label``)."""
    if isinstance(source, (str, os.PathLike)):
        pairs = [(c, s) for c, s in load_summaries(source) if c.get("experiment") == experiment]
    else:
        pairs = [({"label": r["label"]}, r) for r in source]
    return group_by_label(pairs)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(rows: list[dict[str, Any]], columns: Optional[list[str]] = None, *,
                 markdown: bool = False) -> str:
    """Rows (dicts) as an aligned text table, or a markdown table with ``markdown=True``.

    ``columns`` defaults to the keys of the first row; floats print with 4 significant digits, ``None``
    as ``-``."""
    if not rows:
        return "(no runs)"
    columns = list(columns or rows[0].keys())
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def check_out_dir(out: str | os.PathLike, *, force: bool = False) -> Path:
    """Refuse an existing non-empty ``out`` unless ``force``; with ``force``, delete the run directories
    already in it (sub-folders holding a ``log.jsonl``) so that no stale run mixes into the new report;
    other files are left alone. Returns ``out`` as a Path."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; choose another output folder with --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} is not empty; remove it, choose another --out, or pass --force to "
                              "overwrite the runs in it")
    if out.is_dir() and force:
        import shutil

        for log in list(out.rglob("log.jsonl")):
            if log.parent != out and log.parent.exists():
                shutil.rmtree(log.parent)
    return out


def parse_seeds(text: Optional[str], default: list[int]) -> list[int]:
    """Seeds from ``"0,1,2"`` (``None`` gives ``default``)."""
    if text is None:
        return list(default)
    try:
        seeds = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise GradqError(f"--seeds must be comma-separated integers such as 0,1,2; got {text!r}") from None
    if not seeds:
        raise GradqError("--seeds names no seed; give e.g. --seeds 0,1,2")
    return seeds
