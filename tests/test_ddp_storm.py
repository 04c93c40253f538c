"""A non-finite storm through gradq.ddp with ``nan_policy="skip"``.

Requirement: NaN/Inf on ONE rank for many consecutive steps under ``nan_policy="skip"``: every rank
skips the same steps, ``skipped_steps`` agrees, and training continues once the values are finite.

Setup (one spawn of 2 gloo ranks; each rank saves what it saw, the tests read it): the model of
``test_ddp.py`` (Linear(32,128) → Linear(128,64) → Linear(64,10), ``min_numel=1000``: ``0.weight`` and
``2.weight`` are quantized, the rest stays float32). After DDP's rebuild at step 0 the hook sees two
buckets per step: ``[4.bias, 4.weight, 2.bias, 2.weight]`` first, ``[0.bias, 0.weight]`` last. On rank 1
only, for the 20 steps ``STORM`` = 5..24, one parameter's gradient is entirely NaN, and on the steps
``INF_STEPS`` one entry of another parameter's gradient is +Inf as well. Each spec runs both placements:

* NaN in ``0.weight`` (last bucket), +Inf in ``2.weight``: the first bucket has already been handled
  (averaged in place, for TernGrad's integer all-reduce) when the NaN shows; it must be zeroed after
  the fact.
* NaN in ``2.weight`` (first bucket), +Inf in ``0.weight``: the last bucket is clean on most storm
  steps and must be skipped because the step already is.

The bucket layout is recorded at every step and checked, so that a change in DDP's bucketing cannot
silently drop either case.

The optimizer is momentum SGD that skips ``optimizer.step()`` when ``state.last_stats["skipped"]`` (a
zero gradient would still move the parameters through the momentum buffer). The task is learnable
(labels from a fixed random linear teacher) so that the loss on a fixed evaluation batch shows whether
training resumes after the storm.

Two quantizer families run: ``qsgd:bits=4`` (with 2 ranks the hook's pipelined all-gather; scatter
with more) and ``terngrad`` (integer all-reduce, one shared exchange per group).
"""

from __future__ import annotations

import pytest
import torch

import gradq_testing
from gradq.ddp import GradqState, gradq_hook
from test_ddp import KW, all_equal, ddp, params

SPECS = {"qsgd:bits=4": {2: "allgather", 4: "scatter"}, "terngrad": {2: "allreduce", 4: "allreduce"}}  # auto's pick
FIRST, LAST = "2.weight", "0.weight"  # in the first and in the last bucket (checked)
PLACEMENTS = ((LAST, FIRST), (FIRST, LAST))  # (NaN parameter, +Inf parameter)
RUNS = [(spec, nan, inf) for spec in SPECS for nan, inf in PLACEMENTS]
# 4 ranks pass every check too, but on a 2-core machine cost twice the CPU time of 2 ranks (about 50
# against 25 CPU-seconds), so the suite runs 2; add 4 here to run both.
WORLDS = (2,)
STEPS = 35  # 5 clean steps, the 20-step storm, 10 clean steps
STORM = range(5, 25)  # steps 5..24
INF_STEPS = (5, 13, 24)  # first, middle and last storm step
BAD_RANK = 1
LR, MOMENTUM = 0.1, 0.9


def teacher_batch(seed: int, n: int):
    """Inputs and labels of a fixed random linear teacher (the same teacher for every batch)."""
    w = torch.randn(32, 10, generator=torch.Generator().manual_seed(4242))
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    return x, (x @ w).argmax(1)


def eval_loss(model) -> float:
    """Cross-entropy on one fixed evaluation batch (the same on every rank)."""
    x, y = teacher_batch(999_999, 512)
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model.module(x), y))


def inject(model, rank: int, nan_param: str, inf_param: str, step: list[int], fired: dict[str, list[int]]):
    """On ``BAD_RANK``, tensor hooks (they run before DDP sees the gradient) that make ``nan_param``'s
    gradient NaN on storm steps and put one +Inf into ``inf_param``'s on ``INF_STEPS``; ``fired``
    records the steps on which each one did."""
    if rank != BAD_RANK:
        return []
    named = dict(model.module.named_parameters())

    def nan(g):
        if step[0] not in STORM:
            return g
        fired["nan"].append(step[0])
        return torch.full_like(g, float("nan"))

    def inf(g):
        if step[0] not in INF_STEPS:
            return g
        fired["inf"].append(step[0])
        g = g.clone()
        g.view(-1)[17] = float("inf")
        return g

    return [named[nan_param].register_hook(nan), named[inf_param].register_hook(inf)]


def run(spec: str, nan_param: str, inf_param: str, rank: int) -> dict:
    m = ddp()
    st = GradqState(spec, nan_policy="skip", module=m, **KW)  # what gradq.register does, plus a spy
    layout: list[list[str]] = []  # the current step's buckets, in the order the hook sees them

    def spy(state, bucket):
        layout.append([state._name_of(p) for p in bucket.parameters()])
        return gradq_hook(state, bucket)

    m.register_comm_hook(st, spy)
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)
    step = [0]
    fired: dict[str, list[int]] = {"nan": [], "inf": []}
    hooks = inject(m, rank, nan_param, inf_param, step, fired)
    rec: dict = {k: [] for k in ("layout", "skipped", "skipped_steps", "hook_step", "zero_grads", "changed",
                                 "same", "finite", "loss")}
    for s in range(STEPS):
        step[0] = s
        before = params(m)
        rec["loss"].append(eval_loss(m))  # before step s's update
        opt.zero_grad()
        layout.clear()
        x, y = teacher_batch(1000 * rank + s, 32)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        skipped = bool(st.last_stats["skipped"])
        rec["skipped"].append(skipped)
        rec["layout"].append([list(b) for b in layout])
        rec["skipped_steps"].append(st.skipped_steps)
        rec["hook_step"].append(st.step)
        rec["zero_grads"].append(all(bool((p.grad == 0).all()) for p in m.parameters()))
        if not skipped:  # the contract: the caller skips the optimizer on a skipped step
            opt.step()
        after = params(m)
        rec["changed"].append(not torch.equal(before, after))
        rec["same"].append(all_equal(m))
        rec["finite"].append(bool(torch.isfinite(after).all()))
    rec["loss"].append(eval_loss(m))  # after the last step
    rec.update(strategy=st.strategy_used, final_skipped_steps=st.skipped_steps, final_step=st.step, fired=fired)
    for h in hooks:
        h.remove()
    return rec


def _child(rank: int, world: int, tmp: str) -> None:
    gradq_testing.init_gloo(tmp, rank, world)
    res = {run_id: run(*run_id, rank) for run_id in RUNS}
    torch.save(res, f"{tmp}/out{rank}.pt")
    gradq_testing.teardown()


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def outs(request, tmp_path_factory):
    world = request.param
    tmp = str(tmp_path_factory.mktemp(f"storm{world}"))
    gradq_testing.spawn_ranks(_child, (world, tmp), world)
    return [torch.load(f"{tmp}/out{r}.pt") for r in range(world)]


def each(outs):
    """(run, rank, record) for every run and rank."""
    for run_id in RUNS:
        for rank, res in enumerate(outs):
            yield run_id, rank, res[run_id]


def test_the_storm_happened_on_one_rank_only(outs):
    for run_id, rank, r in each(outs):
        want = {"nan": list(STORM), "inf": list(INF_STEPS)} if rank == BAD_RANK else {"nan": [], "inf": []}
        assert r["fired"] == want, (run_id, rank, r["fired"])


def test_bucket_layout_covers_both_cases(outs):
    # from step 1 (DDP rebuilds its buckets after step 0): FIRST is in the first bucket the hook sees,
    # LAST in the last, so one placement has a bad bucket after a handled one and the other a clean
    # bucket after a bad one
    for run_id, rank, r in each(outs):
        for s, buckets in enumerate(r["layout"][1:], start=1):
            assert len(buckets) >= 2 and FIRST in buckets[0] and LAST in buckets[-1], (run_id, rank, s, buckets)


def test_every_rank_skips_exactly_the_storm(outs):
    want = set(STORM)
    for run_id, rank, r in each(outs):
        assert r["strategy"] == SPECS[run_id[0]][len(outs)], (run_id, rank, r["strategy"])
        got = {s for s, k in enumerate(r["skipped"]) if k}
        assert got == want, (run_id, rank, "differ on steps", sorted(got ^ want))
        assert r["final_skipped_steps"] == len(STORM) == 20, (run_id, rank, r["final_skipped_steps"])
        assert r["final_step"] == STEPS, (run_id, rank)  # skipped steps still count as hook steps
        # the counter agrees with the flags after every step
        assert r["skipped_steps"] == [sum(s in want for s in range(t + 1)) for t in range(STEPS)], (run_id, rank)
        assert r["hook_step"] == list(range(1, STEPS + 1)), (run_id, rank)


def test_replicas_stay_identical_and_finite(outs):
    for run_id, rank, r in each(outs):
        assert r["same"] == [True] * STEPS, (run_id, rank, [s for s, k in enumerate(r["same"]) if not k])
        assert r["finite"] == [True] * STEPS, (run_id, rank, [s for s, k in enumerate(r["finite"]) if not k])


def test_skipped_steps_change_nothing(outs):
    for run_id, rank, r in each(outs):
        # on a skipped step every gradient reaches the optimizer as exactly zero on every rank: the
        # clean ranks' too, a bucket handled before the NaN showed, and a clean bucket after it
        bad = [s for s in range(STEPS) if r["zero_grads"][s] != (s in STORM)]
        assert not bad, (run_id, rank, "all-zero gradients differ from the storm on steps", bad)
        # parameters are bit-for-bit unchanged on skipped steps; every other step moves them
        bad = [s for s in range(STEPS) if r["changed"][s] != (s not in STORM)]
        assert not bad, (run_id, rank, "parameter changes differ from the storm on steps", bad)


def test_training_continues_after_the_storm(outs):
    for run_id in RUNS:
        loss = outs[0][run_id]["loss"]  # loss[s]: evaluation loss before step s; loss[STEPS]: at the end
        for res in outs[1:]:
            assert res[run_id]["loss"] == loss, run_id  # identical replicas, the same evaluation batch
        assert all(loss[s] == loss[STORM.start] for s in range(STORM.start, STORM.stop + 1)), run_id
        # where the NaN was does not matter: a skipped step changes nothing, and the hook's randomness
        # is a function of (seed, step, parameter), so both placements of a spec train identically
        assert loss == outs[0][(run_id[0], *PLACEMENTS[0])]["loss"], run_id
        # The 10 clean steps after the storm must lower the loss clearly. Seeds are fixed, so this is
        # deterministic; measured: 7-8 % lower in every run (2 and 4 ranks). Frozen parameters would
        # give 0 %, a run poisoned by the storm (momentum, NaN) a rise or NaN (which fails the
        # comparison). 3 % leaves room for other seeds or torch versions.
        assert loss[STEPS] < 0.97 * loss[STORM.stop], (run_id, loss[STORM.stop], loss[STEPS])
