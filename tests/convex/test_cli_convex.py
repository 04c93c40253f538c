"""``gradq convex ...`` end to end on tiny problems, and the run-directory format (RunLog)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

import gradq
from gradq.train.report_figures import have_matplotlib
from gradq.cli import main
from gradq.convex import cli as convex_cli
from gradq.convex.runlog import (RunLog, check_out_dir, format_table, group_by_label, load_summaries, open_log,
                                 run_subdir)
from gradq.errors import GradqError

TINY = ["--samples", "96", "--dim", "9", "--quiet"]
REQUIRED_CONFIG = ("label", "compressor", "experiment", "problem", "workers", "seed", "lr", "torch_version",
                   "gradq_version")


def _runs(out: Path) -> list[tuple[dict, list[dict]]]:
    found = []
    for log in sorted(out.rglob("log.jsonl")):
        conf = json.loads((log.parent / "config.json").read_text())
        found.append((conf, [json.loads(x) for x in log.read_text().splitlines()]))
    return found


def _check_contract(out: Path, experiment: str, xkey: str) -> None:
    runs = _runs(out)
    assert runs
    for conf, rows in runs:
        assert all(k in conf for k in REQUIRED_CONFIG) and conf["experiment"] == experiment
        assert conf["gradq_version"] == gradq.__version__
        assert rows[-1]["kind"] == "summary" and sum(r["kind"] == "summary" for r in rows) == 1
        body = rows[:-1]
        assert body and all(r["compressor"] == conf["compressor"] for r in rows)
        assert all(isinstance(r[xkey], int) and r[xkey] >= 1 and math.isfinite(r["suboptimality"])
                   and r["bits"] >= 0 for r in body)
        assert [r["bits"] for r in body] == sorted(r["bits"] for r in body)  # cumulative
    assert (out / "report.md").exists() and (out / "suboptimality.png").exists()
    assert (out / "suboptimality_vs_bits.png").exists()


def test_gd_command(tmp_path, capsys):
    out = tmp_path / "gd"
    assert main(["convex", "gd", "--out", str(out), "--eps", "1e-8", *TINY]) == 0
    text = capsys.readouterr().out
    assert "QGD top-sign" in text and "GD fp32" in text and f"report: {out / 'report.md'}" in text
    _check_contract(out, "gd", "iteration")


def test_tradeoff_command(tmp_path, capsys):
    out = tmp_path / "t"
    args = ["convex", "tradeoff", "--out", str(out), "--levels", "1,3", "--seeds", "0,1", "--eps", "1e-2",
            "--max-iters", "300", "--workers", "2", *TINY]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "QSGD s=3" in text and "fp32" in text and "iters_to_eps" in text
    _check_contract(out, "tradeoff", "iteration")
    assert len(_runs(out)) == 3 * 2
    if have_matplotlib():  # the bits-to-eps-against-s figure, drawn when some quantized setting reached eps
        reached = any(r.get("reached") for c, rows in _runs(out) if c["levels"] for r in rows
                      if r["kind"] == "summary")
        assert (out / "bits_to_eps_vs_s.png").exists() == reached and reached
    # a second run into the same folder is refused ...
    assert main(args) == 2
    assert "--force" in capsys.readouterr().err
    # ... unless --force, which replaces the old runs (a stale setting does not survive)
    assert main([*args[:5], "2", *args[6:], "--force"]) == 0
    labels = {c["label"] for c, _ in _runs(out)}
    assert labels == {"fp32", "QSGD s=2"}


def test_qsvrg_command(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["convex", "qsvrg", "--out", str(out), "--epochs", "3", "--seeds", "0", "--workers", "2", *TINY]) == 0
    text = capsys.readouterr().out
    assert "QSVRG s=3" in text and "contraction" in text
    _check_contract(out, "qsvrg", "epoch")


@pytest.mark.parametrize("argv,message", [
    (["convex", "tradeoff", "--eps", "0"], "eps must be > 0"),
    (["convex", "tradeoff", "--levels", "0,2"], "--levels needs integers >= 1"),
    (["convex", "tradeoff", "--levels", "two"], "--levels must be 'auto' or comma-separated"),
    (["convex", "tradeoff", "--seeds", "a"], "--seeds must be comma-separated integers"),
    (["convex", "tradeoff", "--workers", "0"], "--workers must be between 1"),
    (["convex", "qsvrg", "--epochs", "0"], "epochs must be >= 1"),
    (["convex", "gd", "--workers", "2"], "use --workers 1"),
    (["convex", "gd", "--problem", "lsq-digits", "--dim", "5"], "fixed dimension"),
])
def test_bad_input_is_a_clear_error(tmp_path, capsys, argv, message):
    assert main([*argv, "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing was written


def test_divergence_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    # a step 1000x too large blows up within a few iterations: exit status 2 and a hint, no traceback
    argv = ["convex", "tradeoff", "--levels", "1", "--seeds", "0", "--lr", "1000", "--no-fp32",
            "--out", str(tmp_path / "d"), *TINY]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "diverged" in err and "lower --lr" in err and "Traceback" not in err


def test_unknown_problem_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["convex", "gd", "--problem", "lsq-mnist"])
    assert "invalid choice" in capsys.readouterr().err


def test_async_reports_a_missing_module(monkeypatch):
    monkeypatch.setattr(convex_cli, "_ASYNC_IMPORT_ERROR", ImportError("no module named async_ps"))
    with pytest.raises(GradqError, match="gradq convex async is unavailable.*async_ps"):
        convex_cli.run(argparse.Namespace(experiment="async"))


def test_runlog_contract(tmp_path):
    with pytest.raises(ValueError, match="lacks compressor, experiment"):
        RunLog(tmp_path / "r", {"label": "x"})
    d = run_subdir(tmp_path, "QSGD s=4 (decay/step)", seed=2)
    assert d.name == "QSGD_s=4__decay_step-s2" and d.parent == tmp_path
    with RunLog(d, {"label": "QSGD s=4", "compressor": "qsgd:levels=4", "experiment": "tradeoff"}) as log:
        log.row(kind="step", iteration=1, suboptimality=float("nan"), bits=10)
        log.summary(final=float("inf"), reached=True)
        with pytest.raises(ValueError, match="kind="):
            log.row(iteration=2)
    conf = json.loads((d / "config.json").read_text())
    assert conf["torch_version"] and conf["gradq_version"] == gradq.__version__
    rows = [json.loads(x) for x in (d / "log.jsonl").read_text().splitlines()]
    assert rows[0] == {"kind": "step", "iteration": 1, "suboptimality": None, "bits": 10,
                       "compressor": "qsgd:levels=4"}
    assert rows[1]["kind"] == "summary" and rows[1]["final"] is None
    pairs = load_summaries(tmp_path)
    assert len(pairs) == 1 and list(group_by_label(pairs)) == ["QSGD s=4"]
    with open_log(None, {}) as nothing:  # a run that is not written anywhere
        nothing.row(kind="step")


def test_check_out_dir_and_format_table(tmp_path):
    assert check_out_dir(tmp_path / "new") == tmp_path / "new"
    run = tmp_path / "old" / "run"
    run.mkdir(parents=True)
    (run / "log.jsonl").write_text("{}\n")
    (tmp_path / "old" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="--force"):
        check_out_dir(tmp_path / "old")
    check_out_dir(tmp_path / "old", force=True)
    assert not run.exists() and (tmp_path / "old" / "notes.txt").exists()
    text = format_table([{"a": 1.23456789, "b": None, "c": True}])
    assert text.splitlines()[2].split() == ["1.235", "-", "yes"]
    md = format_table([{"a": 1}], markdown=True)
    assert md.splitlines()[:2] == ["| a |", "|---|"]
    assert format_table([]) == "(no runs)"
