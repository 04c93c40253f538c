"""The training runner: settings, schedules, sharding, timing helpers, and end-to-end runs on 2 local
gloo workers (tiny: logistic regression on the digits data, two epochs)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gradq.train.launch import finished, run_all
from gradq.train.runner import (TrainConfig, _HookClock, _lr_at, _powersgd_numel, _ring_bytes, _shard,
                                baseline_kind, run_dir_name)

pytest.importorskip("sklearn")  # the digits data


# -- settings ------------------------------------------------------------------------------------
def test_baseline_kinds():
    assert baseline_kind("fp32") == ("fp32", {})
    assert baseline_kind("ddp") == ("fp32", {})
    assert baseline_kind("powersgd") == ("powersgd", {"rank": 1, "start": 2})
    assert baseline_kind("powersgd:rank=4,start=10") == ("powersgd", {"rank": 4, "start": 10})
    assert baseline_kind("qsgd:bits=4") == ("gradq", {})
    for bad in ("powersgd:rank=0", "powersgd:rnk=2", "powersgd:rank=2.5", "qsgd:bits=99", "nonsense"):
        with pytest.raises(Exception):
            baseline_kind(bad)


def test_config_validation_and_label():
    assert TrainConfig(compressor="terngrad").label == "terngrad"
    for kw in ({"optimizer": "rmsprop"}, {"schedule": "linear"}, {"epochs": 0}, {"workers": 0},
               {"batch_size": 0}, {"lr": 0.0}, {"warmup_epochs": -1.0}):
        with pytest.raises(ValueError):
            TrainConfig(**kw)
    name = run_dir_name(3, TrainConfig(compressor="qsgd:bits=4,bucket=512", seed=7))
    assert name == "03-qsgd_bits=4_bucket=512-s7"


def test_learning_rate_schedules():
    spe = 10  # steps per epoch; 4 epochs = 40 steps
    c = TrainConfig(lr=0.4, epochs=4)
    assert [_lr_at(c, s, spe) for s in (0, 39)] == [0.4, 0.4]
    w = TrainConfig(lr=0.4, epochs=4, warmup_epochs=1.0)  # 10 warm-up steps: 0.04, 0.08, ..., 0.4
    assert [_lr_at(w, s, spe) for s in (0, 4, 9, 10)] == pytest.approx([0.04, 0.2, 0.4, 0.4])
    cos = TrainConfig(lr=0.4, epochs=4, schedule="cosine")
    assert _lr_at(cos, 0, spe) == pytest.approx(0.4)
    assert _lr_at(cos, 20, spe) == pytest.approx(0.2)  # half-way: cos(pi/2) = 0
    assert _lr_at(cos, 39, spe) == pytest.approx(0.2 * (1 + math.cos(math.pi * 39 / 40)))
    step = TrainConfig(lr=0.4, epochs=4, schedule="step")
    assert [_lr_at(step, s, spe) for s in (19, 20, 29, 30)] == pytest.approx([0.4, 0.04, 0.04, 0.004])


def test_shards_are_disjoint_equal_and_reproducible():
    cfg = TrainConfig(batch_size=8, seed=3)
    n, world = 203, 4  # 203 // 32 = 6 steps; 11 examples dropped
    shards = [_shard(n, cfg, world, r, epoch=1) for r in range(world)]
    assert all(len(s) == 6 and all(len(b) == 8 for b in s) for s in shards)
    seen = torch.cat([b for s in shards for b in s])
    assert seen.unique().numel() == 6 * 32  # no example twice in an epoch
    assert all(torch.equal(a, b) for a, b in zip(shards[1], _shard(n, cfg, world, 1, epoch=1)))
    assert not torch.equal(shards[0][0], _shard(n, cfg, world, 0, epoch=2)[0])  # a new permutation


def test_hook_clock_counts_what_the_step_waited_for():
    spans = [(0.0, 1.0), (0.5, 2.0), (3.0, 3.5), (3.1, 3.2)]
    c = _HookClock(lambda s, b: None, sync=True)  # a blocking hook: every span, overlaps once
    c.spans = list(spans)
    assert c.take() == pytest.approx(2.5)
    assert c.take() == 0.0
    c = _HookClock(lambda s, b: None)  # an asynchronous one: from the last call to the last completion
    c.spans = list(spans)
    assert c.take() == pytest.approx(3.5 - 3.1)


def test_exposed_time_is_apportioned_to_the_phases():
    from gradq.train.runner import _exposed

    st = {"wait_seconds": 0.1, "encode_seconds": 0.02, "comm_seconds": 0.06, "decode_seconds": 0.02}
    assert _exposed(st) == pytest.approx((0.02, 0.06, 0.02))
    st = {"wait_seconds": 0.05, "encode_seconds": 0.1, "comm_seconds": 0.2, "decode_seconds": 0.1}
    assert sum(_exposed(st)) == pytest.approx(0.05) and _exposed(st)[1] == pytest.approx(0.025)
    assert _exposed({"wait_seconds": 0.01, "encode_seconds": 0, "comm_seconds": 0, "decode_seconds": 0}) == (0, 0.01, 0)


def test_hook_clock_wraps_hooks_async_and_sync():
    def inner(state, bucket):
        f = torch.futures.Future()
        f.set_result(torch.ones(3))
        return f
    for sync in (False, True):
        c = _HookClock(inner, sync=sync)
        fut = c.hook(None, None)
        assert torch.equal(fut.wait(), torch.ones(3))
        assert len(c.spans) == 1 and c.take() >= 0.0 and c.spans == []


def test_byte_models():
    assert _ring_bytes(1000, 4) == 2 * 3 * 4 * 1000 // 4
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Linear(50, 3))
    # rank 2: 100x50 weight (stored 50x100) -> 2*(50+100) = 300 < 5000/2; bias 50; 3x50 weight: 2*53=106,
    # 106*2 >= 150 so it stays whole (150); bias 3
    assert _powersgd_numel(model, 2) == 300 + 50 + 150 + 3


# -- end to end ----------------------------------------------------------------------------------
def _cfg(**kw) -> TrainConfig:
    base = dict(model="logreg", data="digits", workers=2, epochs=2, batch_size=32, lr=0.2, min_numel=0,
                progress=False, measure_error=True)
    base.update(kw)
    return TrainConfig(**base)


def _rows(d):
    return [json.loads(line) for line in (d / "log.jsonl").read_text().splitlines()]


def test_two_workers_fp32_and_qsgd(tmp_path):
    cfgs = [_cfg(compressor="fp32"), _cfg(compressor="qsgd:bits=4,bucket=128")]
    dirs = run_all(cfgs, tmp_path, echo=False, timeout=300)
    steps_per_epoch = 1437 // 64  # digits: 1797 examples, 20 % held out; 2 workers x 32
    fin = {}
    for cfg, d in zip(cfgs, dirs):
        conf = json.loads((d / "config.json").read_text())
        assert conf["compressor"] == cfg.compressor and conf["world_size"] == 2
        assert conf["steps_per_epoch"] == steps_per_epoch
        rows = _rows(d)
        steps = [r for r in rows if r["kind"] == "step"]
        epochs = [r for r in rows if r["kind"] == "epoch"]
        assert [r["step"] for r in steps] == list(range(1, 2 * steps_per_epoch + 1))
        assert [r["epoch"] for r in epochs] == [1, 2] and rows[-1]["kind"] == "summary"
        for r in epochs:
            assert 0 <= r["train_accuracy"] <= 1 and 0 <= r["test_accuracy"] <= 1
            parts = r["compute_s"] + r["encode_s"] + r["comm_s"] + r["decode_s"]
            assert parts == pytest.approx(sum(s["compute_s"] + s["encode_s"] + s["comm_s"] + s["decode_s"]
                                              for s in steps if s["epoch"] == r["epoch"]))
        assert rows[-1]["bytes_sent"] == sum(s["bytes_sent"] for s in steps)
        fin[cfg.compressor] = rows
        # logistic regression on digits learns quickly: well above chance (10 %) after two epochs
        assert epochs[-1]["test_accuracy"] > 0.8
    fp, q = fin["fp32"], fin["qsgd:bits=4,bucket=128"]
    # fp32: ring all-reduce of 650 coordinates (640 weights + 10 biases), 2(W-1)/W*4 bytes each
    assert fp[0]["bytes_sent"] == 650 * 4 and fp[0]["bits_per_coordinate"] == 32.0
    assert fp[0]["rel_error"] is None
    # 4-bit codes for the 640 weights, fp32 biases: well under a quarter of fp32's bytes
    assert q[0]["bytes_sent"] < fp[0]["bytes_sent"] / 3 and 0 < q[0]["rel_error"] < 1
    assert q[0]["encode_s"] > 0 and q[0]["decode_s"] > 0

    # a finished run is kept, not retrained
    before = (dirs[0] / "log.jsonl").stat().st_mtime_ns
    assert finished(dirs[0], cfgs[0]) is True
    run_all(cfgs[:1], tmp_path, echo=False)
    assert (dirs[0] / "log.jsonl").stat().st_mtime_ns == before
    # another config in the same directory is refused, untouched, unless forced
    other = _cfg(compressor="fp32", lr=0.05)
    assert finished(dirs[0], other) is False
    with pytest.raises(FileExistsError, match="--force"):
        run_all([other], tmp_path, echo=False)
    assert (dirs[0] / "log.jsonl").stat().st_mtime_ns == before


def test_same_seed_same_run_and_powersgd(tmp_path):
    """Two runs with one seed see the same batches and the same initial weights: fp32's losses agree
    to float rounding (gloo's all-reduce order is fixed for 2 ranks); PowerSGD trains and sends less."""
    a, b = run_all([_cfg(compressor="fp32", epochs=1)], tmp_path / "a", echo=False, timeout=300)[0], \
        run_all([_cfg(compressor="fp32", epochs=1)], tmp_path / "b", echo=False, timeout=300)[0]
    la = [r["loss"] for r in _rows(a) if r["kind"] == "step"]
    lb = [r["loss"] for r in _rows(b) if r["kind"] == "step"]
    assert la == pytest.approx(lb, rel=1e-6)
    p = run_all([_cfg(compressor="powersgd:rank=1,start=2", model="mlp", epochs=1)], tmp_path / "p",
                echo=False, timeout=300)[0]
    steps = [r for r in _rows(p) if r["kind"] == "step"]
    assert steps[0]["bits_per_coordinate"] == 32.0 and steps[-1]["bits_per_coordinate"] < 4


def test_in_place_under_a_launcher_like_torchrun(tmp_path):
    """With RANK/WORLD_SIZE set by an outside launcher, every process runs the sequence in place."""
    from gradq.netem import launch

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        from gradq.train.runner import TrainConfig
        from gradq.train.launch import run_all
        cfgs = [TrainConfig(compressor=c, model="logreg", epochs=1, workers=99, min_numel=0, progress=False)
                for c in ("fp32", "terngrad")]
        run_all(cfgs, {str(tmp_path / 'out')!r}, echo=False)
    """))
    env = {k: v for k, v in os.environ.items() if k != "GRADQ_LAUNCHED"}
    assert launch([[sys.executable, str(script)]] * 2, env=env, timeout=300) == [0, 0]
    for name in ("00-fp32-s0", "01-terngrad-s0"):
        d = tmp_path / "out" / name
        assert json.loads((d / "config.json").read_text())["world_size"] == 2
        assert _rows(d)[-1]["kind"] == "summary"


def test_launch_module_usage_message():
    r = subprocess.run([sys.executable, "-m", "gradq.train.launch"], capture_output=True, text=True)
    assert r.returncode == 2 and "started by gradq train" in r.stderr


def test_tensorboard_events_mirror_the_log(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (d,) = run_all([_cfg(compressor="qsgd:bits=4,bucket=128", epochs=1, tensorboard=True)], tmp_path, echo=False,
                   timeout=300)
    acc = EventAccumulator(str(d / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "gradq/bits_per_coord", "gradq/bytes_sent", "gradq/encode_seconds",
            "epoch/test_accuracy"} <= tags
    steps = [r for r in _rows(d) if r["kind"] == "step"]
    bits = acc.Scalars("gradq/bits_per_coord")
    assert [e.step for e in bits] == [r["step"] for r in steps]
    assert [e.value for e in bits] == pytest.approx([r["bits_per_coordinate"] for r in steps], rel=1e-6)


def test_fsdp_runs_compare_stock_fsdp2_and_gradq(tmp_path):
    """gradq train --fsdp: stock FSDP2 (its reduce-scatter timed) and gradq's compressed one, logged alike."""
    pytest.importorskip("torch.distributed.fsdp")
    cfgs = [_cfg(compressor=c, fsdp=True, measure_error=False) for c in ("fp32", "qsgd:bits=4,bucket=128")]
    dirs = run_all(cfgs, tmp_path, echo=False, timeout=300)
    fp, q = (_rows(d) for d in dirs)
    assert json.loads((dirs[1] / "config.json").read_text())["fsdp"] is True
    # logreg: a 10x64 weight and 10 biases; each rank's shard is half of each, 325 float32 values sent
    # to the other rank per step (a ring reduce-scatter on 2 ranks)
    assert fp[0]["bytes_sent"] == 325 * 4 and fp[0]["bits_per_coordinate"] == 32.0 and fp[0]["comm_s"] > 0
    assert q[0]["bytes_sent"] < fp[0]["bytes_sent"] / 3 and q[0]["encode_s"] > 0 and q[0]["decode_s"] > 0
    assert 4.0 < q[0]["bits_per_coordinate"] < 6.0
    for rows in (fp, q):
        ep = [r for r in rows if r["kind"] == "epoch"]
        assert ep[-1]["test_accuracy"] > 0.8 and rows[-1]["kind"] == "summary"   # as the DDP runs above
        assert rows[-1]["bytes_sent"] == sum(r["bytes_sent"] for r in rows if r["kind"] == "step")
    for bad in ({"compressor": "powersgd"}, {"adaptive": True}, {"min_numel": "auto"}):
        with pytest.raises(ValueError, match="fsdp"):
            TrainConfig(fsdp=True, **bad)
