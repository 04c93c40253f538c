"""gradq.ddp on 4 gloo processes (one spawn runs every check; the tests read what each rank saved).

Same model and data as ``test_ddp.py`` (its helpers are reused); on top of the 2-rank file this covers
4 workers, DDP's ``gradient_as_bucket_view=True``, wide integer sums that int8 could not hold,
pipelined segments of the scatter protocol inside the hook, and checkpoint → resume at 4 ranks.
"""

from __future__ import annotations

import pytest
import gradq_testing
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradq
from gradq.comm import scatter as scatter_mod
from test_ddp import KW, QUANTIZED, backward, grads, net, params, resume_run, train

WORLD = 4
SPECS = ["qsgd:bits=2,bucket=128", "terngrad", "maxnorm:bits=4", "orq:levels=5", "bingrad-b",
         "qsgd:bits=4,coding=elias"]
EXPECT_AUTO = {"qsgd:bits=2,bucket=128": "scatter", "terngrad": "allreduce", "maxnorm:bits=4": "allreduce",
               "orq:levels=5": "scatter", "bingrad-b": "scatter", "qsgd:bits=4,coding=elias": "allgather"}


def ddp(**kw) -> DDP:
    return DDP(net(), bucket_cap_mb=0.02, **kw)


def _child(rank: int, world: int, tmp: str) -> None:
    gradq_testing.init_gloo(tmp, rank, world)
    res: dict = {}

    # none through the hook == DDP without a hook, also with gradient_as_bucket_view
    for view in (False, True):
        plain, hooked = ddp(gradient_as_bucket_view=view), ddp(gradient_as_bucket_view=view)
        gradq.register(hooked, "none", **KW)
        diffs = []
        for s in range(2):
            for m in (plain, hooked):
                m.zero_grad()
                backward(m, rank, s)
            diffs.append(float((grads(plain) - grads(hooked)).abs().max()))
        res[f"none|{view}"] = (diffs, float(grads(plain).abs().max()))

    # every family trains 3 steps with bit-identical replicas (and gradient_as_bucket_view for two)
    for spec in SPECS:
        for view in (False, True) if spec in ("qsgd:bits=2,bucket=128", "maxnorm:bits=4") else (False,):
            m = ddp(gradient_as_bucket_view=view)
            st = gradq.register(m, spec, **KW)
            res[f"same|{spec}|{view}"] = train(m, torch.optim.SGD(m.parameters(), lr=0.1), rank, range(3))
            res[f"stats|{spec}|{view}"] = dict(st.last_stats)
            res[f"moved|{spec}|{view}"] = not torch.equal(params(m), params(ddp()))

    # sums wider than int8: 8-bit MaxNorm (s = 127) forced through the integer all-reduce, 4·127 = 508;
    # gradients scaled up so that every code is large. int8 would wrap; the result must stay within
    # one quantization step (scale/s) of the exact mean.
    plain, hooked = ddp(), ddp()
    gradq.register(hooked, "maxnorm:bits=8", "allreduce", **KW)
    for m in (plain, hooked):
        for p in m.parameters():
            p.register_hook(lambda g: g * 1000 + 500)
        m.zero_grad()
        backward(m, rank, 0)
    res["wide"] = (grads(plain), grads(hooked))

    # the scatter protocol's pipeline inside the hook: tiny segments so the 8192-value weight is cut
    old = scatter_mod.SEGMENT_NUMEL
    scatter_mod.SEGMENT_NUMEL = 1000
    try:
        m = ddp()
        st = gradq.register(m, "qsgd:bits=4", **KW)
        res["segmented"] = train(m, torch.optim.SGD(m.parameters(), lr=0.1), rank, range(2))
    finally:
        scatter_mod.SEGMENT_NUMEL = old

    # checkpoint -> resume at 4 ranks (error feedback, momentum)
    done, resumed, ck, _, _ = resume_run("qsgd:bits=2,ef=1", dict(KW, seed=3), rank, 1, 3)
    res["resume"] = torch.equal(done, resumed)
    res["residuals"] = len(ck["hook"]["residuals"])

    # a mismatch on one rank of four (warm-up steps) fails clearly on all four
    m = ddp()
    gradq.register(m, "qsgd:bits=4", warmup_steps=1 if rank == 2 else 0, **KW)
    try:
        backward(m, rank, 0)
        res["mismatch"] = None
    except Exception as e:  # noqa: BLE001
        res["mismatch"] = str(e)
    torch.save(res, f"{tmp}/out{rank}.pt")
    gradq_testing.teardown()


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ddp4"))
    gradq_testing.spawn_ranks(_child, (WORLD, tmp), WORLD)
    return [torch.load(f"{tmp}/out{r}.pt") for r in range(WORLD)]


def test_none_matches_plain_ddp(outs):
    for r in outs:
        for view in (False, True):
            diffs, scale = r[f"none|{view}"]
            # float rounding only: the hook sums then divides, DDP divides then sums
            assert max(diffs) <= 1e-6 * scale, (view, diffs)


def test_every_family_keeps_replicas_identical(outs):
    for r in outs:
        for key in [k for k in r if k.startswith("same|")]:
            _, spec, view = key.split("|")
            assert r[key] == [True] * 3, key
            assert r[f"moved|{spec}|{view}"], key
            st = r[f"stats|{spec}|{view}"]
            assert st["strategy"] == EXPECT_AUTO[spec], (key, st)
            assert st["quantized_coords"] == QUANTIZED and 0 < st["bits_per_coord"] < 32, (key, st)


def test_wide_sums_do_not_overflow(outs):
    exact, got = outs[0]["wide"]
    # |g| ≤ ~1000·|g0| + 500 per rank; the one shared scale is the max |g| over ranks (the layer's),
    # so each decode is within scale/127 of its gradient and the mean within the same bound
    scale = float(exact.abs().max()) * WORLD  # generous: ≥ any rank's own max-abs
    err = float((got - exact).abs().max())
    assert err <= scale / 127, (err, scale / 127)
    assert float((got - exact).abs().mean()) < 0.05 * float(exact.abs().mean())
    for r in outs[1:]:
        assert torch.equal(r["wide"][1], got)


def test_segmented_scatter_in_the_hook(outs):
    for r in outs:
        assert r["segmented"] == [True, True]


def test_resume_is_exact_at_four_ranks(outs):
    for r in outs:
        assert r["resume"] and r["residuals"] > 0


def test_mismatch_on_one_rank_fails_everywhere(outs):
    for r in outs:
        assert r["mismatch"] is not None and "warmup_steps" in r["mismatch"]
