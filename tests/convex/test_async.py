"""Asynchronous QSGD on a parameter server (gradq.convex.async_ps): convergence, staleness, the
synchronous baseline, failure handling and argument checks. Tiny least squares (256 samples, 16
coordinates), 2 worker processes, a few hundred updates per run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gradq.convex.async_ps import (AsyncRunError, add_async_arguments, qsgd_spec, run_async,
                                   run_async_experiment)
from gradq.errors import GradqError

TINY = dict(n_samples=256, dim=16, batch_size=16, timeout_s=30.0)
DELAY_MS = 20.0  # worker 2 sleeps 20 ms per gradient; worker 1 runs at full speed


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("async")
    summary = run_async_experiment("lsq-synthetic", workers=2, spec=qsgd_spec(4), updates=300, seed=0,
                                   delay_ms=DELAY_MS, out=out, **TINY)
    return summary


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def test_async_converges(async_run):
    # Stale but unbiased quantized gradients still make SGD converge (paper 004, appendix D): with
    # η = 0.25/L the suboptimality falls from ≈4.5 to its noise floor ≈1e-2 (300-700× over repeated
    # runs); 20× leaves a wide margin for the scheduling-dependent order of the updates.
    assert async_run["mode"] == "async"
    assert async_run["final_suboptimality"] < async_run["initial_suboptimality"] / 20


def test_async_staleness_recorded(async_run):
    run_dir = Path(async_run["run_dir"])
    config = json.loads((run_dir / "config.json").read_text())
    assert config["experiment"] == "async" and config["workers"] == 2 and config["delay_ms"] == DELAY_MS
    rows = _rows(run_dir)
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["iteration"] for r in steps] == list(range(1, 301))
    assert all(r["staleness"] >= 0 for r in steps)
    bits = [r["bits"] for r in steps]  # one push of a fixed-size payload per update
    assert bits == [8 * async_run["push_bytes"] * i for i in range(1, 301)]
    assert rows[-1]["kind"] == "summary"
    hist = {int(k): v for k, v in async_run["staleness_hist"].items()}
    assert sum(hist.values()) == 300 and min(hist) >= 0 and max(hist) == async_run["staleness_max"]
    assert async_run["staleness_mean"] == pytest.approx(sum(r["staleness"] for r in steps) / 300)
    # With cycle times t1 (fast worker) and t2 = t1 + 20 ms (slowed worker), the slowed worker's push is
    # overtaken by ≈ t2/t1 ≥ 1 updates of the fast one, the fast worker's by ≈ t1/t2 < 1.
    # (The overall mean stays ≈ K - 1 = 1 whatever the speeds: see the identity below.)
    by_worker = async_run["staleness_mean_by_worker"]
    assert async_run["staleness_mean"] > 0
    assert by_worker["2"] >= 1.0 and by_worker["2"] > by_worker["1"]
    assert async_run["pushes_by_worker"]["1"] > async_run["pushes_by_worker"]["2"]
    assert async_run["pushes_discarded"] == 1  # the push still in flight when the run stopped
    # Each update delays the gradient in flight at the other worker by one, so the staleness of the
    # applied pushes plus that reached by the discarded one is exactly (K - 1)·U (module docstring).
    total = sum(r["staleness"] for r in steps) + sum(async_run["staleness_discarded"])
    assert total == (2 - 1) * 300


def test_sync_baseline_has_no_staleness(tmp_path):
    summary = run_async_experiment("lsq-synthetic", workers=2, updates=60, seed=0, synchronous=True,
                                   out=tmp_path, **TINY)
    again = run_async_experiment("lsq-synthetic", workers=2, updates=60, seed=0, synchronous=True, **TINY)
    # the synchronous run is a fixed sequence of seeded computations: the same seed, the same iterates
    assert again["final_suboptimality"] == summary["final_suboptimality"] and again["run_dir"] is None
    assert summary["mode"] == "sync" and summary["pushes_discarded"] == 0
    # every update averages one push per worker, all computed on the current parameters
    assert summary["staleness_max"] == 0 and summary["staleness_hist"] == {"0": 120}
    assert summary["gradients_applied"] == 120 and summary["bits"] == 120 * 8 * summary["push_bytes"]
    # 60 averaged steps of η = 0.25/L take ≈4.5 down to ≈0.03 (≈140×); 10× is the stated margin
    assert summary["final_suboptimality"] < summary["initial_suboptimality"] / 10
    steps = [r for r in _rows(tmp_path / "sync_QSGD_s=4-s0") if r["kind"] == "step"]
    assert len(steps) == 60 and all(r["staleness"] == 0 for r in steps)


def test_worker_error_surfaces_in_parent():
    # A step size 1e6 times too large makes x blow up within a few updates; the worker that meets the
    # non-finite gradient raises, and the parent must raise with its message instead of hanging.
    with pytest.raises(AsyncRunError, match=r"worker \d.*diverged"):
        run_async_experiment("lsq-synthetic", workers=2, updates=500, lr=1e6, **TINY)


def test_stuck_worker_times_out_instead_of_hanging():
    # Worker 2 sleeps 5 s before its first gradient; the synchronous server waits for it, and with a
    # 1 s limit on every message the run must fail within seconds, naming the timeout.
    with pytest.raises(AsyncRunError, match="Timed out.*timeout_s=1"):
        run_async_experiment("lsq-synthetic", workers=2, updates=10, synchronous=True, delay_ms=5000.0,
                             **{**TINY, "timeout_s": 1.0})


def _ignore_sigterm_and_wait(ready) -> None:
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(60)


def _wait(ready) -> None:
    import time

    ready.set()
    time.sleep(60)


def test_processes_left_after_a_failure_are_stopped_even_if_they_ignore_sigterm():
    """After a failure the run stops the other processes: SIGTERM first, SIGKILL after the grace
    period for one that ignores SIGTERM (which join(grace) alone would leave running)."""
    import multiprocessing

    from gradq.convex.async_ps import stop_processes

    ctx = multiprocessing.get_context("spawn")
    ready = [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=_ignore_sigterm_and_wait, args=(ready[0],)),
             ctx.Process(target=_wait, args=(ready[1],))]
    for p in procs:
        p.start()
    assert all(r.wait(60) for r in ready)
    stop_processes(procs, grace=0.5)
    assert not any(p.is_alive() for p in procs)
    assert procs[0].exitcode == -9 and procs[1].exitcode == -15   # killed; terminated


@pytest.mark.parametrize("kwargs, message", [
    (dict(workers=0), "workers must be an integer >= 1"),
    (dict(updates=0), "updates must be an integer >= 1"),
    (dict(lr=-0.1), "lr must be a positive"),
    (dict(lr=float("nan")), "lr must be a positive"),
    (dict(delay_ms=-1.0), "delay_ms must be"),
    (dict(batch_size=0), "batch_size must be"),
    (dict(start_method="fork"), "'fork' is not offered"),
    (dict(spec="qsgd:levels=200,norm=l2,bucket=none,coding=elias"), "fixed size"),
    (dict(workers=300), "fewer than workers=300"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_async_experiment("lsq-synthetic", **{**TINY, **kwargs})


def test_unknown_problem_and_existing_run(tmp_path):
    with pytest.raises(ValueError, match="unknown convex problem 'lsq-nope'"):
        run_async_experiment("lsq-nope")
    (tmp_path / "async_QSGD_s=4-s0").mkdir()
    (tmp_path / "async_QSGD_s=4-s0" / "log.jsonl").write_text("{}\n")
    with pytest.raises(FileExistsError, match="force"):
        run_async_experiment("lsq-synthetic", out=tmp_path, **TINY)


def test_cli_arguments():
    p = argparse.ArgumentParser()
    add_async_arguments(p)
    a = p.parse_args([])
    assert (a.problem, a.workers, a.levels, a.spec, a.lr, a.delay_ms, a.sync, a.seeds) == \
        ("lsq-synthetic", 4, None, None, None, 0.0, True, "0")
    assert p.parse_args(["--no-sync", "--levels", "8"]).sync is False
    with pytest.raises(SystemExit):  # --levels and --spec exclude each other
        p.parse_args(["--levels", "8", "--spec", "qsgd:levels=8,norm=l2,bucket=none"])
    with pytest.raises(ValueError, match="--levels must be in 1..127"):
        run_async(p.parse_args(["--levels", "0"]))
    with pytest.raises(GradqError, match="--seeds must be comma-separated integers"):
        run_async(p.parse_args(["--seeds", "1,x"]))


def test_cli_runs_async_and_sync_and_writes_report(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_async_arguments(p)
    args = p.parse_args(["--workers", "2", "--updates", "30", "--out", str(tmp_path), "--quiet"])
    assert run_async(args) == 0
    printed = capsys.readouterr().out
    assert "async QSGD s=4" in printed and "sync QSGD s=4" in printed and "report:" in printed
    assert (tmp_path / "report.md").is_file()
    assert sorted(d.name for d in tmp_path.iterdir() if (d / "log.jsonl").is_file()) == \
        ["async_QSGD_s=4-s0", "sync_QSGD_s=4-s0"]
    with pytest.raises(FileExistsError, match="--force"):  # refused before anything runs
        run_async(args)
