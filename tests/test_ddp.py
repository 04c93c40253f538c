"""gradq.ddp on 2 gloo processes: ONE spawn runs every check, each rank saves its results, the tests read them.

Model: Linear(32,128) → Linear(128,64) → Linear(64,10) with ``min_numel=1000``, so the weights of the
first two layers (4096 and 8192 values) are quantized and the last weight (640) and every bias stay
float32. ``bucket_cap_mb=0.02`` (≈5000 floats) spreads the parameters over several buckets. Each rank
draws different data (seed depends on the rank).
"""

from __future__ import annotations

import io
import os
import pickle

import pytest
import gradq_testing
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradq
from gradq.ddp import GradqState, gradq_hook

SPECS = ["qsgd:bits=4", "terngrad", "maxnorm:bits=2", "topk:ratio=0.1,ef=1", "multiscale"]
# (2 ranks: the hook all-gathers what choose_protocol would scatter — the same bytes, one exchange)
EXPECT_AUTO = {"qsgd:bits=4": "allgather", "terngrad": "allreduce", "maxnorm:bits=2": "allreduce",
               "topk:ratio=0.1,ef=1": "allgather", "multiscale": "allreduce"}
KW = {"min_numel": 1000}
QUANTIZED = 4096 + 8192


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 10))


def data(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def ddp(group=None) -> DDP:
    return DDP(net(), bucket_cap_mb=0.02, process_group=group)


def backward(model, rank: int, step: int) -> None:
    x, y = data(rank, step)
    torch.nn.functional.cross_entropy(model(x), y).backward()


def train(model, opt, rank: int, steps) -> list[bool]:
    same = []
    for s in steps:
        opt.zero_grad()
        backward(model, rank, s)
        opt.step()
        same.append(all_equal(model))
    return same


def all_equal(model) -> bool:
    """Whether every rank holds bit-identical parameters (all_gather of the flat parameter vector)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    got = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(got, flat)
    return all(torch.equal(got[0], g) for g in got[1:])


def params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()])


def nan_on(model, name: str):
    """Make ``name``'s gradient NaN on this rank (a tensor hook runs before DDP sees the gradient)."""
    p = dict(model.module.named_parameters())[name]
    return p.register_hook(lambda g: torch.full_like(g, float("nan")))


def resume_run(spec: str, kw: dict, rank: int, split: int, total: int):
    """An uninterrupted run of ``total`` momentum-SGD steps through the hook, and the same run
    checkpointed after ``split`` steps (model, optimizer and hook state through ``torch.save``) and
    resumed in fresh objects. Returns (uninterrupted params, resumed params, the checkpoint, the saved
    hook state, the resumed hook state)."""
    def fresh():
        m = ddp()
        return m, gradq.register(m, spec, **kw), torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    a, _, opt_a = fresh()
    train(a, opt_a, rank, range(total))
    b, st_b, opt_b = fresh()
    train(b, opt_b, rank, range(split))
    buf = io.BytesIO()
    torch.save({"model": b.module.state_dict(), "opt": opt_b.state_dict(), "hook": st_b.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf)
    c, st_c, opt_c = fresh()
    c.module.load_state_dict(ck["model"])
    st_c.load_state_dict(ck["hook"])
    opt_c.load_state_dict(ck["opt"])
    train(c, opt_c, rank, range(split, total))
    return params(a), params(c), ck, st_b, st_c


def _child(rank: int, world: int, tmp: str) -> None:
    gradq_testing.init_gloo(tmp, rank, world)
    res: dict = {}
    shared = gradq_testing.keep_warnings("gradq.hostshare")   # what it says about ranks sharing cores

    # 1. `none` through the hook == DDP without a hook (two steps: the second uses rebuilt buckets)
    plain, hooked = ddp(), ddp()
    st = gradq.register(hooked, "none", **KW)
    res["none_diff"] = []
    for s in range(2):
        for m in (plain, hooked):
            m.zero_grad()
            backward(m, rank, s)
        res["none_diff"].append(float((grads(plain) - grads(hooked)).abs().max()))
    res["none_scale"] = float(grads(plain).abs().max())
    res["none_stats"] = dict(st.last_stats)

    # 2. each quantizer trains with identical replicas after every step
    for spec in SPECS:
        m = ddp()
        st = gradq.register(m, spec, **KW)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        res[f"same|{spec}"] = train(m, opt, rank, range(3))
        res[f"stats|{spec}"] = dict(st.last_stats)
        res[f"moved|{spec}"] = not torch.equal(params(m), params(ddp()))
    for strategy in ("allgather", "ps", "scatter"):
        m = ddp()
        st = gradq.register(m, "qsgd:bits=4", strategy, **KW)
        res[f"same|{strategy}"] = train(m, torch.optim.SGD(m.parameters(), lr=0.1), rank, range(2))
        res[f"stats|{strategy}"] = dict(st.last_stats)
    m = ddp()  # the error report and the time breakdown
    st = gradq.register(m, "qsgd:bits=2", measure_error=True, **KW)
    backward(m, rank, 0)
    res["measured"] = dict(st.last_stats)
    m = ddp()  # policy: a named parameter stays fp32 even above min_numel; warm-up steps are all fp32
    st = gradq.register(m, "maxnorm:bits=2", min_numel=500, uncompressed={"2.weight"}, warmup_steps=1)
    backward(m, rank, 0)
    res["warmup_quantized"] = st.last_stats["quantized_coords"]
    backward(m, rank, 1)
    res["policy_quantized"] = st.last_stats["quantized_coords"]
    res["totals"] = dict(st.totals)

    # 2b. overlap: a bucket's future is still pending when the hook returns it (its group's job, or
    # the step's last one, finishes it), and after the first step groups start before the last bucket
    m = ddp()
    st = GradqState("qsgd:bits=4,bucket=512", module=m, group_mb=0.02, **KW)
    seen: list = []

    def watching(state, bucket):  # noqa: ANN001, ANN202
        fut = gradq_hook(state, bucket)
        if not bucket.is_last():
            seen.append((state.step, fut.done(), len(state._step_work.launched)))
        return fut
    m.register_comm_hook(st, watching)
    res["overlap_same"] = train(m, torch.optim.SGD(m.parameters(), lr=0.1), rank, range(3))
    res["overlap_seen"] = seen
    res["overlap_groups"] = st.last_stats["groups"]

    # 2c. the integer all-reduce makes two exchanges per step: the scale statistics with the float32
    # tensors and the agreement beside them, then the codes (2 ranks: each one all-to-all)
    real = {n: getattr(dist, n) for n in ("all_reduce", "all_to_all_single", "all_gather_into_tensor",
                                          "all_gather", "broadcast")}
    calls: list = []

    def counting(n):  # noqa: ANN001, ANN202
        def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
            calls.append(n)
            return real[n](*a, **k)
        return call
    for spec in ("terngrad", "maxnorm:bits=2"):
        m = ddp()
        gradq.register(m, spec, group_mb=1.0, **KW)
        backward(m, rank, 0)  # (the first step also checks the spec across ranks)
        for n in real:
            setattr(dist, n, counting(n))
        try:
            backward(m, rank, 1)
        finally:
            for n, f in real.items():
                setattr(dist, n, f)
        res[f"calls|{spec}"], calls[:] = list(calls), []

    # 3. a one-rank group: auto picks the local encode/decode
    groups = [dist.new_group([r]) for r in range(world)]
    m = ddp(groups[rank])
    st = gradq.register(m, "qsgd:bits=4", **KW)
    backward(m, rank, 0)
    res["local"] = st.strategy_used

    # 4. checkpoint -> resume is exact (momentum SGD; two specs with error-feedback residuals; warm-up)
    for spec in ("topk:ratio=0.1,ef=1", "maxnorm:bits=2,ef=1"):
        kw = dict(KW, seed=7, warmup_steps=1)
        done, resumed, ck, st_b, st_c = resume_run(spec, kw, rank, 2, 4)
        res[f"residual_keys|{spec}"] = sorted(ck["hook"]["residuals"])
        res[f"resume|{spec}"] = torch.equal(done, resumed)
        d = ddp()  # control: same model/optimizer checkpoint, hook state NOT restored
        d.module.load_state_dict(ck["model"])
        gradq.register(d, spec, **kw)
        opt_d = torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.9)
        opt_d.load_state_dict(ck["opt"])
        train(d, opt_d, rank, range(2, 4))
        res[f"control|{spec}"] = torch.equal(done, params(d))
        res[f"resume_step|{spec}"] = st_c.step
        try:
            gradq.register(ddp(), "topk:ratio=0.2,ef=1", **kw).load_state_dict(ck["hook"])
            res[f"resume_refused|{spec}"] = None
        except ValueError as e:
            res[f"resume_refused|{spec}"] = str(e)

    # 5. pickling drops the group and names, keeps step/settings/residuals
    st_p = pickle.loads(pickle.dumps(st_b))
    res["pickle"] = (st_p.process_group is None, st_p.step == st_b.step, st_p.settings() == st_b.settings(),
                     sorted(st_p.quantizer.residuals) == sorted(st_b.quantizer.residuals),
                     all(torch.equal(st_p.quantizer.residuals[k], st_b.quantizer.residuals[k])
                         for k in st_b.quantizer.residuals))
    m = ddp()
    m.register_comm_hook(st_p, gradq_hook)
    try:
        backward(m, rank, 0)
        res["unbound"] = None
    except Exception as e:  # noqa: BLE001 — whatever DDP wraps it in, the message must explain
        res["unbound"] = str(e)
    m = ddp()
    st_p2 = pickle.loads(pickle.dumps(GradqState("terngrad", **KW))).bind(m)
    m.register_comm_hook(st_p2, gradq_hook)
    backward(m, rank, 0)
    res["pickle_bound_step"] = st_p2.step

    # 6. no_sync accumulation through the hook == without a hook
    plain, hooked = ddp(), ddp()
    st = gradq.register(hooked, "none", **KW)
    for m in (plain, hooked):
        with m.no_sync():
            backward(m, rank, 0)
        backward(m, rank, 1)
    res["nosync_diff"] = float((grads(plain) - grads(hooked)).abs().max())
    res["nosync_steps"] = st.step

    # 7. NaN policies (NaN only on rank 0): skip zeroes everything on both ranks; raise errors on both
    m = ddp()
    st = gradq.register(m, "maxnorm:bits=2", nan_policy="skip", **KW)
    h = nan_on(m, "2.weight") if rank == 0 else None
    backward(m, rank, 0)
    res["skip_zero"] = all(bool((p.grad == 0).all()) for p in m.parameters())
    res["skip_counts"] = (st.skipped_steps, st.last_stats["skipped"], st.step)
    if h is not None:
        h.remove()
    m.zero_grad()
    backward(m, rank, 1)
    res["after_skip_nonzero"] = any(bool((p.grad != 0).any()) for p in m.parameters())
    res["after_skip_counts"] = (st.skipped_steps, st.last_stats["skipped"])
    m = ddp()
    gradq.register(m, "maxnorm:bits=2", **KW)
    if rank == 0:
        nan_on(m, "2.weight")
    try:
        backward(m, rank, 0)
        res["nan_raise"] = None
    except Exception as e:  # noqa: BLE001
        res["nan_raise"] = f"{type(e).__name__}: {e}"

    # 7b. ranks sharing cores: no warning above, where each rank runs one thread (the spawn's
    # OMP_NUM_THREADS=1); pools wider than the machine in both ranks draw one warning, from rank 0
    res["share_quiet"] = list(shared.messages)
    res["cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(res["cpus"] + 1)   # wider than any share
    m = ddp()
    gradq.register(m, "qsgd:bits=4", **KW)
    backward(m, rank, 0)
    torch.set_num_threads(1)
    res["share_wide"] = list(shared.messages)

    # 8. mismatched specs: both ranks raise, nobody hangs (last: the failed DDP is left unusable)
    m = ddp()
    gradq.register(m, "qsgd:bits=4" if rank == 0 else "qsgd:bits=2", **KW)
    try:
        backward(m, rank, 0)
        res["mismatch"] = None
    except Exception as e:  # noqa: BLE001
        res["mismatch"] = str(e)
    torch.save(res, f"{tmp}/out{rank}.pt")
    gradq_testing.teardown()


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ddp"))
    gradq_testing.spawn_ranks(_child, (2, tmp), 2)
    return [torch.load(f"{tmp}/out{r}.pt") for r in range(2)]


def test_none_matches_plain_ddp(outs):
    for r in outs:
        # float rounding only: the hook sums then divides, DDP divides then sums (≤ 1 ulp per value)
        assert max(r["none_diff"]) <= 1e-6 * r["none_scale"], r["none_diff"]
        st = r["none_stats"]
        # every value at 32 bits, plus the step's agreement (non-finite, damaged) riding in the same
        # all-reduce: two more float32 values, 2(M−1)/M·8 = 8 bytes with 2 ranks
        assert st["strategy"] == "allreduce" and st["bytes_sent"] == 4 * st["coords"] + 8, st


def test_quantizers_keep_replicas_identical(outs):
    for r in outs:
        for spec in SPECS:
            assert r[f"same|{spec}"] == [True] * 3, spec
            assert r[f"moved|{spec}"], spec
            st = r[f"stats|{spec}"]
            assert st["strategy"] == EXPECT_AUTO[spec], (spec, st)
            assert st["quantized_coords"] == QUANTIZED and 0 < st["bits_per_coord"] < 32, (spec, st)
        for s in ("allgather", "ps", "scatter"):
            assert r[f"same|{s}"] == [True] * 2, s
            assert r[f"stats|{s}"]["strategy"] == s and r[f"stats|{s}"]["bytes_sent"] > 0


def test_integer_allreduce_step_makes_two_exchanges(outs):
    for r in outs:
        for spec in ("terngrad", "maxnorm:bits=2"):
            assert r[f"calls|{spec}"] == ["all_to_all_single"] * 2, (spec, r[f"calls|{spec}"])


def test_policy_warmup_and_totals(outs):
    for r in outs:
        assert r["warmup_quantized"] == 0
        assert r["policy_quantized"] == 4096 + 640  # 2.weight named fp32; 4.weight (640) ≥ min_numel=500
        assert r["totals"]["steps"] == 2 and r["totals"]["bytes_sent"] > 0 and r["totals"]["seconds"] > 0


def test_jobs_start_during_the_backward_pass_and_futures_complete_later(outs):
    for r in outs:
        assert all(r["overlap_same"]) and r["overlap_groups"] == 2, r["overlap_groups"]
        assert r["overlap_seen"] and not any(done for _, done, _ in r["overlap_seen"]), r["overlap_seen"]
        # the first step learns the groups at its last bucket; later steps launch before it
        assert all(n == 0 for step, _, n in r["overlap_seen"] if step == 0)
        assert any(n > 0 for step, _, n in r["overlap_seen"] if step > 0), r["overlap_seen"]


def test_single_rank_group_is_local(outs):
    assert [r["local"] for r in outs] == ["local", "local"]


def test_checkpoint_resume_is_exact(outs):
    for r in outs:
        for spec in ("topk:ratio=0.1,ef=1", "maxnorm:bits=2,ef=1"):
            assert r[f"resume|{spec}"], spec
            assert not r[f"control|{spec}"], spec  # the hook state matters: without it the run differs
            assert r[f"resume_step|{spec}"] == 4
            keys = r[f"residual_keys|{spec}"]
            assert keys and all(k.split("#")[0] in ("0.weight", "2.weight") for k in keys), keys
            assert "spec" in (r[f"resume_refused|{spec}"] or ""), spec


def test_pickle(outs):
    for r in outs:
        assert r["pickle"] == (True, True, True, True, True)
        assert "bind" in (r["unbound"] or "")
        assert r["pickle_bound_step"] == 1


def test_no_sync_accumulation(outs):
    for r in outs:
        assert r["nosync_diff"] <= 1e-6 and r["nosync_steps"] == 1


def test_nan_policies(outs):
    for r in outs:
        assert r["skip_zero"] and r["skip_counts"] == (1, True, 1)
        assert r["after_skip_nonzero"] and r["after_skip_counts"] == (1, False)
        assert r["nan_raise"] is not None and "NonFiniteError" in r["nan_raise"]
    assert "2.weight" in outs[0]["nan_raise"]
    assert "another rank" in outs[1]["nan_raise"]


def test_mismatched_specs_fail_on_both_ranks(outs):
    for r in outs:
        assert r["mismatch"] is not None and "spec" in r["mismatch"] and "disagree" in r["mismatch"]


def test_ranks_sharing_cores_are_warned_once_where_their_pools_oversubscribe(outs):
    assert outs[0]["share_quiet"] == [] and outs[1]["share_quiet"] == []
    assert outs[1]["share_wide"] == []          # the lowest rank of a machine speaks for it
    (msg,) = outs[0]["share_wide"]
    assert "2 ranks share" in msg and "OMP_NUM_THREADS=" in msg


def test_error_report_and_time_breakdown(outs):
    for r in outs:
        st = r["measured"]
        # 2-bit QSGD (s = 1) on Gaussian-like gradients: relative error of the 2-worker average is
        # well above 0 and below the single-encode bound sqrt(min(d/s², √d/s)) ≈ 22 for d = 512
        assert 0.05 < st["rel_error"] < 5, st
        parts = st["encode_seconds"] + st["comm_seconds"] + st["decode_seconds"]
        assert min(st["encode_seconds"], st["comm_seconds"], st["decode_seconds"]) > 0
        assert parts <= st["seconds"], st
    for r in outs:
        assert "rel_error" not in r["stats|qsgd:bits=4"]  # only on request


def test_which_schemes_are_batched_into_one_call_per_step():
    from gradq.ddp import _bucketed

    for spec, want in [("qsgd:bits=4,bucket=512", True), ("ef(qsgd:bits=2)", True), ("orq:levels=5", True),
                       ("qsgd:bits=4,bucket=none", False), ("terngrad", False), ("terngrad:bucket=128", False),
                       ("maxnorm:bits=4", False), ("maxnorm:bits=4,bucket=64", True)]:
        assert _bucketed(gradq.build(spec)) is want, spec


def test_groups_are_cut_in_reverse_model_order_and_listed_in_model_order():
    from gradq.ddp import _make_groups

    names = ["a.w", "a.b", "b.w", "b.b", "c.w", "c.b"]
    numels = [1000, 10, 3000, 10, 500, 10]
    groups = _make_groups(names, numels, cap_bytes=4 * 2000)
    # from the back: c.b+c.w+b.b+b.w reach 2000 values; a.b+a.w are the rest
    assert [g.names for g in groups] == [("b.w", "b.b", "c.w", "c.b"), ("a.w", "a.b")]
    assert [g.index for g in groups] == [0, 1] and groups[0].numels == (3000, 10, 500, 10)
    assert [g.names for g in _make_groups(names, numels, cap_bytes=1)] == [(n,) for n in reversed(names)]
    assert len(_make_groups(names, numels, cap_bytes=1 << 30)) == 1
