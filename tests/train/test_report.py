"""The report generator: loading run logs, grouping over seeds, tables and figures."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from gradq.train.report import (ReportError, format_console_table, load_runs, make_figures, markdown_table,
                                summary_rows, write_report)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CURVE_FIGURES = ["loss_vs_epoch.png", "test_accuracy_vs_epoch.png", "loss_vs_time.png",
                 "test_accuracy_vs_time.png", "time_breakdown.png"]

# Hand-chosen test accuracies per epoch, by (compressor, seed); epoch time is 2 s for qsgd, 1 s for fp32.
ACC = {("qsgd:bits=4", 0): [0.50, 0.80, 0.90], ("qsgd:bits=4", 1): [0.60, 0.70, 0.86],
       ("fp32", 0): [0.70, 0.92, 0.95], ("fp32", 1): [0.75, 0.90, 0.93]}
LOSS = {("qsgd:bits=4", 0): 0.30, ("qsgd:bits=4", 1): 0.40, ("fp32", 0): 0.20, ("fp32", 1): 0.25}


def _write_run(d: Path, config: dict | None, rows: list[dict]) -> Path:
    d.mkdir(parents=True)
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    (d / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _fake_run(d: Path, compressor: str, seed: int, *, rel_error: bool = False, label: str | None = None,
              steps_per_epoch: int = 4) -> Path:
    """A run following the log schema: step rows, epoch rows and a summary row."""
    epoch_s = 2.0 if compressor != "fp32" else 1.0
    bits = 32.0 if compressor == "fp32" else 4.5
    config = {"label": label or compressor, "compressor": compressor, "model": "mlp", "data": "digits",
              "workers": 2, "epochs": 3, "batch_size": 32, "optimizer": "sgd", "lr": 0.1, "seed": seed}
    rows, step = [], 0
    accs = ACC[(compressor, seed)]
    for e, acc in enumerate(accs, 1):
        for i in range(steps_per_epoch):
            step += 1
            rows.append({"kind": "step", "compressor": compressor, "epoch": e, "step": step,
                         "loss": 2.0 / step, "wall_s": (e - 1) * epoch_s + (i + 1) * epoch_s / steps_per_epoch,
                         "compute_s": 0.2 * epoch_s / steps_per_epoch, "encode_s": 0.1 * epoch_s / steps_per_epoch,
                         "comm_s": 0.6 * epoch_s / steps_per_epoch, "decode_s": 0.1 * epoch_s / steps_per_epoch,
                         "bytes_sent": 250_000, "bits_per_coordinate": bits,
                         "rel_error": 0.5 / step if rel_error else None})
        rows.append({"kind": "epoch", "compressor": compressor, "epoch": e, "step": step,
                     "loss": LOSS[(compressor, seed)] * (4 - e), "train_accuracy": acc, "test_accuracy": acc,
                     "test_loss": 1 - acc, "wall_s": e * epoch_s, "epoch_s": epoch_s,
                     "compute_s": 0.2 * epoch_s, "encode_s": 0.1 * epoch_s, "comm_s": 0.6 * epoch_s,
                     "decode_s": 0.1 * epoch_s, "bytes_sent": 1_000_000, "bits_per_coordinate": bits,
                     "rel_error": 0.5 / e if rel_error else None})
    rows.append({"kind": "summary", "compressor": compressor, "final_test_accuracy": accs[-1]})
    return _write_run(d, config, rows)


def _convex_run(d: Path, compressor: str, rate: float) -> Path:
    rows = [{"kind": "step", "compressor": compressor, "iteration": t, "suboptimality": rate ** t,
             "bits": 100 * t} for t in range(1, 41)]
    return _write_run(d, {"label": f"convex {compressor}", "compressor": compressor, "seed": 0}, rows)


@pytest.fixture()
def runs_dir(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for comp in ("qsgd:bits=4", "fp32"):
        for seed in (0, 1):
            _fake_run(root / f"{comp.split(':')[0]}-s{seed}", comp, seed)
    return root


def test_load_parent_and_individual_dirs(runs_dir: Path):
    runs = load_runs([runs_dir])
    # sorted directory names: fp32-s0, fp32-s1, qsgd-s0, qsgd-s1
    assert [r.path.name for r in runs] == ["fp32-s0", "fp32-s1", "qsgd-s0", "qsgd-s1"]
    assert [r.label for r in runs] == ["fp32", "fp32", "qsgd:bits=4", "qsgd:bits=4"]
    assert [r.seed for r in runs] == [0, 1, 0, 1]
    assert len(runs[0].step_rows) == 12 and len(runs[0].epoch_rows) == 3
    one = load_runs([runs_dir / "qsgd-s1", runs_dir / "fp32-s0"])
    assert [r.path.name for r in one] == ["qsgd-s1", "fp32-s0"]  # order given is kept
    assert len(load_runs([runs_dir, runs_dir / "fp32-s0"])) == 4  # duplicates are dropped


def test_missing_paths_and_config_less_run(tmp_path: Path):
    with pytest.raises(ValueError, match="no run directories found") as e:
        load_runs([tmp_path])
    assert str(tmp_path) in str(e.value)
    with pytest.raises(ValueError, match="no such file"):
        load_runs([tmp_path / "nope"])
    _write_run(tmp_path / "bare", None, [{"kind": "epoch", "compressor": "terngrad", "epoch": 1, "loss": 1.0}])
    (run,) = load_runs([tmp_path / "bare"])
    assert run.config == {} and run.label == "terngrad" and run.seed is None


def test_malformed_line_names_file_and_line(tmp_path: Path):
    d = _write_run(tmp_path / "r", {"label": "x"}, [{"kind": "step", "step": 1}])
    with open(d / "log.jsonl", "a") as f:
        f.write('{"kind": "step", "step": 2}\n\n{"kind": "epo')  # truncated 4th line after a blank one
    with pytest.raises(ReportError, match=r"log\.jsonl:4: malformed JSON"):
        load_runs([d])


def test_grouping_mean_and_sample_std(runs_dir: Path):
    rows = summary_rows(load_runs([runs_dir]))
    assert [r["label"] for r in rows] == ["fp32", "qsgd:bits=4"] and [r["runs"] for r in rows] == [2, 2]
    fp32, qsgd = rows
    # qsgd finals 0.90 and 0.86: mean 0.88, sample std |a-b|/sqrt(2)
    assert math.isclose(qsgd["final_test_accuracy"], 0.88, rel_tol=1e-12)
    assert math.isclose(qsgd["final_test_accuracy_std"], 0.04 / math.sqrt(2), rel_tol=1e-9)
    assert math.isclose(fp32["best_test_accuracy"], (0.95 + 0.93) / 2, rel_tol=1e-12)
    # final epoch loss = LOSS * 1 -> 0.30 and 0.40
    assert math.isclose(qsgd["final_train_loss"], 0.35) and math.isclose(qsgd["final_train_loss_std"],
                                                                        statistics.stdev([0.3, 0.4]))
    assert qsgd["bits_per_coordinate"] == 4.5 and fp32["bits_per_coordinate"] == 32.0
    assert qsgd["mb_per_epoch"] == 1.0 and qsgd["epoch_s"] == 2.0 and fp32["epoch_s"] == 1.0
    assert math.isclose(qsgd["comm_s"], 1.2) and math.isclose(fp32["compute_s"], 0.2)
    assert qsgd["rel_error"] is None and qsgd["final_suboptimality"] is None
    # a single run has no std
    (single,) = summary_rows(load_runs([runs_dir / "qsgd-s0"]))
    assert single["final_test_accuracy"] == 0.90 and single["final_test_accuracy_std"] is None


def test_step_rows_fill_in_missing_epoch_totals(tmp_path: Path):
    """Without epoch rows, bytes and phase times are summed over each epoch's steps."""
    rows = [{"kind": "step", "compressor": "q", "epoch": e, "step": s, "bytes_sent": 500_000, "comm_s": 0.25,
             "rel_error": 0.1 * s, "loss": 1.0 / s} for e in (1, 2) for s in (2 * e - 1, 2 * e)]
    (row,) = summary_rows(load_runs([_write_run(tmp_path / "r", None, rows)]))
    assert row["mb_per_epoch"] == 1.0 and row["comm_s"] == 0.5 and row["final_train_loss"] == 0.25
    assert math.isclose(row["rel_error"], 0.25)  # mean of 0.1, 0.2, 0.3, 0.4


def test_time_to_target(runs_dir: Path):
    rows = summary_rows(load_runs([runs_dir]), target=0.9)
    fp32, qsgd = rows
    # fp32 reaches 0.9 at epoch 2 in both seeds (wall 2 s); qsgd seed 0 at epoch 3 (6 s), seed 1 never
    assert fp32["time_to_target"] == 2.0 and fp32["target_reached"] == 2
    assert qsgd["time_to_target"] is None and qsgd["target_reached"] == 1
    rows = summary_rows(load_runs([runs_dir]), target=0.8)
    assert rows[1]["time_to_target"] == (4.0 + 6.0) / 2  # epoch 2 (4 s) and epoch 3 (6 s)
    assert summary_rows(load_runs([runs_dir]), target=0.99)[0]["target_reached"] == 0
    with pytest.raises(ValueError, match="fraction"):
        summary_rows(load_runs([runs_dir]), target=90)


def test_markdown_columns_and_units(runs_dir: Path):
    rows = summary_rows(load_runs([runs_dir]), target=0.9)
    md = markdown_table(rows)
    lines = md.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:3] == ["Label", "Runs", "Final test acc."]  # compressor == label: column dropped
    assert "Time to 90%" in header and "MB/epoch/worker" in header
    # no run measured rel_error or suboptimality: those columns are dropped
    assert "Rel. quant. error" not in header and "Final suboptimality" not in header
    assert all(len(line.strip("|").split("|")) == len(header) for line in lines)
    assert "88.00 ± 2.83%" in md  # 0.04/sqrt(2) = 2.83 points
    assert "2.00 s" in md and "1/2 reached" in md and "1.000 MB" in md and "200.0 ms" in md
    single = markdown_table(summary_rows(load_runs([runs_dir / "qsgd-s0"])))
    assert "90.00%" in single and "±" not in single and "Time to" not in single
    console = format_console_table(rows)
    assert "88.00 +- 2.83%" in console and len({len(line) for line in console.splitlines()[:2]}) == 1


def test_theory_run_reports_suboptimality(tmp_path: Path):
    _convex_run(tmp_path / "a", "qsgd:bits=2", 0.9)
    _convex_run(tmp_path / "b", "fp32", 0.8)
    rows = summary_rows(load_runs([tmp_path]))
    assert math.isclose(rows[0]["final_suboptimality"], 0.9 ** 40) and rows[0]["final_test_accuracy"] is None
    md = markdown_table(rows)
    assert "Final suboptimality" in md and "Compressor" in md and "test acc" not in md
    # a target accuracy means nothing for runs without test accuracy: no time-to-target column
    assert "Time to" not in markdown_table(summary_rows(load_runs([tmp_path]), target=0.9))


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 5000, path


def test_figures_written_and_skipped(tmp_path: Path, runs_dir: Path):
    pytest.importorskip("matplotlib")
    _fake_run(runs_dir / "qerr", "qsgd:bits=4", 0, rel_error=True, label="qsgd measured")
    _convex_run(tmp_path / "convex" / "c1", "qsgd:bits=2", 0.9)
    figs = make_figures(load_runs([runs_dir, tmp_path / "convex"]), tmp_path / "figs", target=0.9)
    assert [f.name for f in figs] == CURVE_FIGURES + ["quantization_error.png", "suboptimality.png",
                                                        "suboptimality_vs_bits.png"]
    for f in figs:
        _check_png(f)
    # without rel_error or suboptimality, those figures are not drawn
    figs = make_figures(load_runs([runs_dir / "fp32-s0", runs_dir / "qsgd-s1"]), tmp_path / "plain")
    assert [f.name for f in figs] == CURVE_FIGURES
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == sorted(CURVE_FIGURES)
    # quantization error from step rows only
    d = _write_run(tmp_path / "steps", None, [{"kind": "step", "compressor": "q", "epoch": 1 + s // 10,
                                               "step": s + 1, "rel_error": 0.3} for s in range(30)])
    assert [f.name for f in make_figures(load_runs([d]), tmp_path / "f3")] == ["quantization_error.png"]


def test_write_report_links_figures(runs_dir: Path):
    pytest.importorskip("matplotlib")
    md_path, figs = write_report([runs_dir], target=0.9, title="Digits sweep")
    assert md_path == runs_dir / "report.md"
    text = md_path.read_text(encoding="utf-8")
    assert text.startswith("# Digits sweep") and "| Label |" in text and "Time to 90%" in text
    for f in figs:
        assert f.parent == runs_dir and f"]({f.name})" in text
    assert "- `qsgd-s1` — **qsgd:bits=4**: model mlp, data digits, workers 2, epochs 3, seed 1" in text


def test_write_report_without_matplotlib(runs_dir: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    md_path, figs = write_report([runs_dir / "fp32-s0"])
    assert md_path == runs_dir / "fp32-s0" / "report.md"  # the single path given
    assert figs == [] and "Figures skipped: matplotlib is not installed" in md_path.read_text(encoding="utf-8")
    # several run dirs: the report goes to their common parent; out_dir can be set
    assert write_report([runs_dir / "fp32-s0", runs_dir / "qsgd-s1"])[0] == runs_dir / "report.md"
    out = runs_dir.parent / "out"
    md_path, _ = write_report([runs_dir / "fp32-s0"], out)
    assert md_path == out / "report.md" and "- `../runs/fp32-s0` — **fp32**" in md_path.read_text(encoding="utf-8")


def test_either_report_module_imports_first():
    # report.py and report_figures.py import each other; a fresh interpreter must accept either first
    for first in ("from gradq.train.report_figures import have_matplotlib",
                  "from gradq.train.report import make_figures, have_matplotlib"):
        done = subprocess.run([sys.executable, "-c", first], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
