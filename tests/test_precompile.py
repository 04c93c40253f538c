"""gradq.precompile and ``gradq compile``: the CPU kernels compiled once, before ranks need them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gradq.precompile as pre
from gradq import SpecError
from gradq.train import launch
from gradq.train.runner import TrainConfig


def test_a_bad_spec_is_refused_before_anything_compiles(monkeypatch):
    ran = []
    monkeypatch.setattr(pre, "_exercise", lambda spec, numel: ran.append(spec))
    with pytest.raises(SpecError):
        pre.precompile(["qsgd:bits=4", "qsgd:bits=99"])
    assert ran == []
    assert list(pre.precompile(["terngrad", "qsgd:bits=4"])) == ["terngrad", "qsgd:bits=4"] == ran


def test_every_default_spec_runs_each_entry_point():
    """Each of SPECS through encode, decode, decode_mean and (summable ones) the code sums, for real."""
    took = pre.precompile()
    assert list(took) == list(pre.SPECS)
    assert all(t >= 0 for t in took.values())


def test_local_runs_compile_their_cpu_specs_once_first(monkeypatch, tmp_path):
    calls, started = [], []
    monkeypatch.setattr(pre, "precompile", lambda specs, progress: calls.append(list(specs)))
    monkeypatch.setattr(launch, "_local", lambda cfg, run_dir, net, timeout: started.append(cfg.compressor))
    monkeypatch.delenv("RANK", raising=False)
    cfgs = [TrainConfig(compressor=c, workers=2, epochs=1)
            for c in ("fp32", "qsgd:bits=4", "powersgd", "terngrad", "qsgd:bits=4")]
    launch.run_all(cfgs, tmp_path, echo=False)
    assert calls == [["qsgd:bits=4", "terngrad"]]  # before any worker started, each spec once
    assert started == [c.compressor for c in cfgs]
    calls.clear()
    launch.run_all([TrainConfig(compressor="fp32", workers=2, epochs=1)], tmp_path / "b", echo=False)
    assert calls == []  # nothing of gradq's to compile


@pytest.mark.skipif(os.environ.get("GRADQ_KERNELS", "").strip().lower() in ("0", "torch", "triton"),
                    reason="the numba kernels are not the CPU backend here")
def test_training_after_gradq_compile_compiles_nothing(tmp_path):
    """``gradq compile -c SPEC`` into an empty cache, then 2-rank training with that spec: the ranks
    (and the launcher) load every kernel they run; not one compiled file is added."""
    pytest.importorskip("numba")
    pytest.importorskip("sklearn")
    spec = "signsgd"  # the one-bit kernels: among the quickest to compile (about 11 s on 2 cores)
    env = dict(os.environ, GRADQ_NUMBA_CACHE=str(tmp_path / "cache"), NUMBA_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "GRADQ_LAUNCHED"):
        env.pop(k, None)

    def compiled() -> set[str]:
        return {p.name for p in (tmp_path / "cache").rglob("*.nbc")}

    gradq_cli = [sys.executable, "-m", "gradq.cli"]
    res = subprocess.run(gradq_cli + ["compile", "-c", spec], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert spec in res.stdout and "cache:" in res.stdout
    assert "numba is compiling" not in res.stderr   # (its own progress says so; no note on top)
    before = compiled()
    assert before  # it compiled something
    res = subprocess.run(gradq_cli + ["train", "--workers", "2", "--model", "mlp", "--data", "digits", "--epochs", "1",
                                      "--min-numel", "1000", "--out", str(tmp_path / "runs"), "-c", spec],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert compiled() == before and "numba is compiling" not in res.stderr
    assert Path(tmp_path / "runs").is_dir()
