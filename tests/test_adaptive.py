"""The adaptive mode: its schedule and decisions (a fake clock, no processes), then the DDP hook with it on
2 gloo processes (one spawn; a fake clock decides, so the decisions and the results are reproducible)."""

from __future__ import annotations

import io

import gradq_testing
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradq
from gradq.adaptive import FP32, NEVER, SPEC, AdaptiveController, fp32_threshold


class FakeClock:
    """Steps take ``cost[mode]`` seconds: the controller reads the clock once per step start."""

    def __init__(self, cost: dict[str, float]):
        self.cost = cost
        self.now = 0.0
        self.mode = FP32

    def __call__(self) -> float:
        return self.now

    def advance(self) -> None:
        self.now += self.cost[self.mode]


def run(ctrl: AdaptiveController, clock: FakeClock, steps: int, agree=lambda v: v) -> list[str]:
    modes = []
    for step in range(steps):
        clock.mode = ctrl.start_step(step, agree)
        modes.append(clock.mode)
        clock.advance()
    return modes


def test_probe_then_runs_the_faster_mode():
    clock = FakeClock({FP32: 1.0, SPEC: 0.5})
    ctrl = AdaptiveController(probe_steps=3, settle=2, reprobe_every=100, clock=clock)
    modes = run(ctrl, clock, 20)
    assert modes[:8] == [FP32] * 2 + [FP32, SPEC] * 3   # settling steps, then the two modes in turn
    assert modes[8:] == [SPEC] * 12
    assert ctrl.decisions[0]["chosen"] == SPEC and ctrl.medians == {FP32: 1.0, SPEC: 0.5}
    clock = FakeClock({FP32: 1.0, SPEC: 0.99})       # within the margin: float32 (always safe)
    ctrl = AdaptiveController(probe_steps=3, settle=2, clock=clock)
    assert run(ctrl, clock, 12)[8:] == [FP32] * 4


def test_the_settling_steps_are_not_counted():
    """The first steps of a run are slow (caches, DDP's bucket rebuild, first calls): not samples."""
    clock = FakeClock({FP32: 1.0, SPEC: 0.5})
    ctrl = AdaptiveController(probe_steps=2, settle=2, clock=clock)
    for step in range(7):
        clock.mode = ctrl.start_step(step, lambda v: v)
        clock.advance()
        if step < 2:
            clock.now += 50.0                       # two slow first steps
    ctrl.start_step(7, lambda v: v)
    assert ctrl.medians == {FP32: 1.0, SPEC: 0.5}


def test_periodic_reprobe_and_drift():
    clock = FakeClock({FP32: 1.0, SPEC: 0.5})
    ctrl = AdaptiveController(probe_steps=2, settle=1, reprobe_every=30, check_every=10, drift=0.25, clock=clock)
    modes = run(ctrl, clock, 5 + 30 + 5)
    assert modes[35:39] == [FP32, SPEC, FP32, SPEC]   # probed again 30 steps after the decision (no settling)
    assert len(ctrl.decisions) == 2 and modes[39] == SPEC
    # the spec's steps become slow (the network changed): a drift check starts a probe at once
    clock = FakeClock({FP32: 1.0, SPEC: 0.5})
    ctrl = AdaptiveController(probe_steps=2, settle=1, reprobe_every=1000, check_every=10, clock=clock)
    run(ctrl, clock, 25)                             # decided at step 5; the steady baseline taken at step 10
    assert ctrl.baseline == 0.5
    clock.cost[SPEC] = 2.0
    modes = []
    for step in range(25, 60):
        clock.mode = ctrl.start_step(step, lambda v: v)
        modes.append(clock.mode)
        clock.advance()
    assert any(d.get("reprobe") for d in ctrl.decisions)
    assert modes[-1] == FP32 and ctrl.chosen == FP32


def test_every_rank_takes_the_slowest_ranks_view():
    """The medians are MAX-reduced: a rank that finds the spec faster still follows the slowest rank."""
    clock = FakeClock({FP32: 1.0, SPEC: 0.5})
    ctrl = AdaptiveController(probe_steps=2, settle=1, clock=clock)
    run(ctrl, clock, 7, agree=lambda v: [max(v[0], 1.0), max(v[1], 1.2)] if len(v) == 2 else v)
    assert ctrl.chosen == FP32 and ctrl.medians == {FP32: 1.0, SPEC: 1.2}


def test_state_dict_continues_the_schedule():
    clock = FakeClock({FP32: 1.0, SPEC: 0.5})
    ctrl = AdaptiveController(probe_steps=2, reprobe_every=20, clock=clock)
    run(ctrl, clock, 5)                              # mid-probe
    again = AdaptiveController(probe_steps=2, reprobe_every=20, clock=clock)
    again.load_state_dict(ctrl.state_dict())
    assert again.state_dict() == ctrl.state_dict()
    with pytest.raises(ValueError, match="adaptive settings differ"):
        AdaptiveController(probe_steps=3).load_state_dict(ctrl.state_dict())
    with pytest.raises(ValueError):
        AdaptiveController(probe_steps=0)


def test_fp32_threshold_rule():
    """n* = fixed cost / (transfer saved per value − codec cost per value); never where the codec costs
    more than the transfer it saves (a fast link)."""
    kw = dict(world=4, wire_bits=4.06, protocol="scatter", alpha_s=1e-3, codec_s_per_value=2e-9, call_s=50e-6)
    saved = (4 * 1.5 - 4.06 / 8 * 1.5) / 1.25e8          # 1 Gbit/s, 4 ranks: 1.5 = 2(M−1)/M
    assert fp32_threshold(bandwidth=1.25e8, own_call=False, **kw) == pytest.approx(50e-6 / (saved - 2e-9), rel=1e-6, abs=1)
    assert fp32_threshold(bandwidth=1.25e8, own_call=True, **kw) == pytest.approx(1.05e-3 / (saved - 2e-9), rel=1e-6, abs=1)
    assert fp32_threshold(bandwidth=5e9, own_call=False, **kw) == NEVER          # loopback: the codec costs more
    assert fp32_threshold(bandwidth=1.25e8, own_call=False, **dict(kw, world=1)) == NEVER
    # an all-gather sends (M−1)·payload: at 16 ranks a 4-bit payload saves less than at 4
    ag = dict(kw, protocol="allgather")
    assert fp32_threshold(bandwidth=1.25e8, own_call=False, **ag) > fp32_threshold(bandwidth=1.25e8, own_call=False, **kw)


# -- the DDP hook with adaptive=True on 2 gloo processes -------------------------------------------------------
def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def train(model, state, clock, rank, steps, opt):
    modes = []
    for s in steps:
        opt.zero_grad()
        x, y = batch(rank, s)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        modes.append(state.last_stats["mode"])
        clock.mode = FP32 if state.last_stats["mode"] == "fp32" else SPEC
        clock.advance()
    return modes


def _child(rank: int, world: int, tmp: str) -> None:
    gradq_testing.init_gloo(tmp, rank, world)
    try:
        out = {}
        for name, cost in (("spec_wins", {FP32: 1.0, SPEC: 0.5}), ("fp32_wins", {FP32: 1.0, SPEC: 3.0})):
            model = DDP(net(), bucket_cap_mb=0.01)
            st = gradq.register(model, "qsgd:bits=4", min_numel=100, adaptive={"probe_steps": 2, "reprobe_every": 50})
            clock = FakeClock(cost)
            st.adaptive.clock = clock
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            out[f"{name}|modes"] = train(model, st, clock, rank, range(10), opt)
            out[f"{name}|stats"] = dict(st.last_stats)
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            got = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(got, flat)
            out[f"{name}|same"] = all(torch.equal(got[0], g) for g in got[1:])
        # float32 steps average exactly as DDP's own all-reduce does
        a, b = DDP(net(), bucket_cap_mb=0.01), DDP(net(), bucket_cap_mb=0.01)
        st = gradq.register(a, "qsgd:bits=4", adaptive={"probe_steps": 2})
        st.adaptive.clock = FakeClock({FP32: 1.0, SPEC: 1.0})
        for m in (a, b):
            x, y = batch(rank, 0)
            torch.nn.functional.cross_entropy(m(x), y).backward()
        out["fp32_equal"] = all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
        out["fp32_stats"] = dict(st.last_stats)
        # checkpoint after the decision, resume into a fresh model: the same parameters as without a break
        def fresh():
            m = DDP(net(), bucket_cap_mb=0.01)
            s_ = gradq.register(m, "qsgd:bits=4", min_numel=100, adaptive={"probe_steps": 2, "reprobe_every": 50})
            c = FakeClock({FP32: 1.0, SPEC: 0.5})
            s_.adaptive.clock = c
            return m, s_, c, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        m1, s1, c1, o1 = fresh()
        train(m1, s1, c1, rank, range(12), o1)
        m2, s2, c2, o2 = fresh()
        train(m2, s2, c2, rank, range(8), o2)
        buf = io.BytesIO()
        torch.save({"model": m2.module.state_dict(), "opt": o2.state_dict(), "hook": s2.state_dict()}, buf)
        buf.seek(0)
        ck = torch.load(buf, weights_only=False)
        m3, s3, c3, o3 = fresh()
        m3.module.load_state_dict(ck["model"])
        o3.load_state_dict(ck["opt"])
        s3.load_state_dict(ck["hook"])
        c3.now = c2.now
        out["resume_modes"] = train(m3, s3, c3, rank, range(8, 12), o3)
        out["resume_exact"] = all(torch.equal(p, q) for p, q in zip(m1.parameters(), m3.parameters()))
        # min_numel="auto": measured at the first step, the same on every rank, kept by a checkpoint
        m4 = DDP(net(), bucket_cap_mb=0.01)
        s4 = gradq.register(m4, "qsgd:bits=4", min_numel="auto")
        o4 = torch.optim.SGD(m4.parameters(), lr=0.1)
        for st_ in range(2):
            o4.zero_grad()
            x, y = batch(rank, st_)
            torch.nn.functional.cross_entropy(m4(x), y).backward()
            o4.step()
        mine = torch.tensor([float(min(s4.min_numel, 2**53))])
        both = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(both, mine)
        out["auto_agree"] = bool(both[0] == both[1])
        out["auto_value"] = s4.min_numel
        out["auto_calibration"] = dict(s4.calibration)
        out["auto_stats"] = dict(s4.last_stats)
        m5 = DDP(net(), bucket_cap_mb=0.01)
        s5 = gradq.register(m5, "qsgd:bits=4", min_numel="auto")
        s5.load_state_dict(s4.state_dict())
        out["auto_resumed"] = s5.min_numel
        torch.save(out, f"{tmp}/out{rank}.pt")
    finally:
        gradq_testing.teardown()


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("adaptive"))
    gradq_testing.spawn_ranks(_child, (2, tmp), 2)
    return [torch.load(f"{tmp}/out{r}.pt") for r in range(2)]


def test_hook_probes_then_keeps_the_faster_mode(outs):
    for r in outs:
        probe = ["fp32"] * 2 + ["fp32", "spec"] * 2     # settle 2, then probe_steps 2 of each in turn
        assert r["spec_wins|modes"] == probe + ["spec"] * 4
        assert r["fp32_wins|modes"] == probe + ["fp32"] * 4
        for name in ("spec_wins", "fp32_wins"):
            assert r[f"{name}|same"], name                  # replicas identical through the switches
        st = r["spec_wins|stats"]
        assert st["adaptive_chosen"] == "spec" and st["adaptive_phase"] == "run" and 0 < st["bits_per_coord"] < 32
        st = r["fp32_wins|stats"]
        assert st["mode"] == "fp32" and st["quantized_coords"] == 0
        assert st["adaptive_medians"] == {"fp32": 1.0, "spec": 3.0}


def test_float32_steps_are_ddps_own_average(outs):
    for r in outs:
        assert r["fp32_equal"]
        st = r["fp32_stats"]
        assert st["mode"] == "fp32" and st["bytes_sent"] == 4 * st["coords"]   # 2(M−1)/M·4 bytes, M = 2


def test_resume_continues_exactly(outs):
    for r in outs:
        assert r["resume_modes"] == ["spec"] * 4
        assert r["resume_exact"]


def test_min_numel_auto_is_measured_agreed_and_checkpointed(outs):
    for r in outs:
        assert r["auto_agree"] and isinstance(r["auto_value"], int) and r["auto_value"] >= 1
        cal = r["auto_calibration"]
        assert cal["min_numel"] == r["auto_value"] and cal["alpha_s"] > 0 and cal["bandwidth_Bps"] > 0
        assert r["auto_stats"]["min_numel"] == r["auto_value"]
        assert r["auto_resumed"] == r["auto_value"]
    assert outs[0]["auto_value"] == outs[1]["auto_value"]
