"""The gradq command: list, compare (the demo's engine) and error handling."""

from __future__ import annotations

import json

import pytest
import torch

from gradq.cli import COMPARE_SPECS, DEMO_COMPRESSORS, main
import gradq


def test_list_shows_every_scheme(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in gradq.available():
        assert name in out


def test_compare_specs_all_build():
    for s in COMPARE_SPECS:
        gradq.build(s)
    names = {gradq.build(s).spec.split(":")[0].removeprefix("ef(") for s in COMPARE_SPECS}
    assert set(gradq.available()) <= names


def test_compare_prints_a_table_and_writes_rows(capsys, tmp_path):
    pytest.importorskip("sklearn")
    out_file = tmp_path / "rows.jsonl"
    rc = main(["compare", "-c", "none", "-c", "qsgd:bits=2,bucket=128", "-c", "signsgd", "--trials", "3",
               "--warm-steps", "2", "--json", str(out_file)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "bits/coord" in text and "qsgd:bits=2,bucket=128,norm=max" in text
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["compressor"] for r in rows] == ["none", "qsgd:bits=2,bucket=128,norm=max", "signsgd:bucket=512"]
    none, q2, sign = rows
    assert none["rel_error"] == 0 and none["bits_per_coord"] > 32
    assert 2.0 < q2["bits_per_coord"] < 2.6 and q2["rel_error"] > 0
    assert sign["rel_bias"] > q2["rel_bias"]  # signs are biased, QSGD is not
    # QSGD's bias estimate stays within the 3-sigma noise level the trials resolve; the sign's does not
    assert q2["rel_bias"] <= q2["bias_noise"] and sign["rel_bias"] > 3 * sign["bias_noise"]


def test_bad_spec_fails_fast_with_a_clear_message(capsys):
    assert main(["compare", "-c", "qsgd:bits=99"]) == 2
    assert "bits=99 is out of range" in capsys.readouterr().err


def test_missing_data_is_a_clear_error(capsys):
    assert main(["compare", "-c", "none", "--data", "mnist:/nope"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_demo_compressors_are_valid():
    from gradq.train.runner import baseline_kind

    kinds = [baseline_kind(c)[0] for c in DEMO_COMPRESSORS]
    assert kinds[0] == "fp32" and "powersgd" in kinds and kinds.count("gradq") == 7


def test_train_refuses_a_bad_compressor_before_starting(capsys, tmp_path):
    assert main(["train", "-c", "qsgd:bits=99", "--out", str(tmp_path / "r")]) == 2
    assert "bits=99 is out of range" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    assert main(["train", "-c", "powersgd:rank=x", "--out", str(tmp_path / "r")]) == 2
    assert "powersgd:rank=R" in capsys.readouterr().err
    assert main(["train", "--seeds", "a,b", "--out", str(tmp_path / "r")]) == 2
    assert "--seeds" in capsys.readouterr().err


def test_train_network_without_root_says_so_and_runs_nothing(capsys, tmp_path, monkeypatch):
    import gradq.netem as netem

    monkeypatch.setattr(netem, "can_emulate", lambda: (False, "needs root"))
    assert main(["train", "-c", "fp32", "--network", "1gbit", "--out", str(tmp_path / "r")]) == 0
    assert "cannot emulate a 1gbit network here (needs root); nothing was run" in capsys.readouterr().out
    assert not (tmp_path / "r").exists()
    assert main(["train", "-c", "fp32", "--network", "fast", "--out", str(tmp_path / "r")]) == 2
    assert "fast" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_backends_refuse_clearly_without_a_gpu(tmp_path, capsys):
    from gradq.cli import main

    for backend in ("nccl", "cuda:gloo"):
        rc = main(["train", "--workers", "1", "--backend", backend, "--epochs", "1", "--out", str(tmp_path / "x"),
                   "-c", "fp32"])
        err = capsys.readouterr()
        assert rc != 0 and "needs a GPU" in err.err and "training" not in err.out  # refused before any run


def test_adaptive_flag_reaches_the_run_and_labels_it():
    from gradq.train.runner import TrainConfig

    cfg = TrainConfig(compressor="qsgd:bits=4", adaptive=True)
    assert cfg.adaptive and cfg.label == "qsgd:bits=4 (adaptive)"
    assert TrainConfig(compressor="fp32", adaptive=True).label == "fp32"   # nothing to adapt
    assert TrainConfig.from_json(cfg.to_json()).adaptive if hasattr(TrainConfig, "from_json") else True
