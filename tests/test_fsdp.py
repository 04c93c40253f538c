"""gradq's compressed reduce-scatter under FSDP2 (fully_shard), 2 and 4 gloo ranks on CPU."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import gradq
from gradq.fsdp import GradqReduceScatter, is_fsdp2
from gradq.netem import EmulatedNetwork, can_emulate, launch
from gradq_testing import KeptWarnings, count_unseeded_decodes, init_gloo, keep_warnings, spawn_ranks, teardown

pytest.importorskip("torch.distributed.fsdp")

#: every parameter of the small test models compressed (the default policy would keep them all in float32)
ALL = {"min_numel": 0, "keep_1d_fp32": False}


def _model(width: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))


def _shard(m: torch.nn.Module, **kw: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kw)
    return fully_shard(m, **kw)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4] * 2.0 - x[:, 4:8]


def _full(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().reshape(-1) for p in m.parameters()])


def _train(spec: Optional[str], steps: int, rank: int, *, accumulate: int = 1, shard_kw: Optional[dict] = None,
           lr: float = 0.05, **kw: Any) -> tuple[list[float], torch.Tensor, Any]:
    m = _shard(_model(), **(shard_kw or {}))
    comm = None if spec is None else gradq.register(m, spec, seed=5, **{**ALL, **kw})
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    losses = []
    for t in range(steps):
        for a in range(accumulate):   # gradient accumulation: only the last micro-batch reduces
            m.set_requires_gradient_sync(a == accumulate - 1)
            x, y = _batch(t * accumulate + a, rank)
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, _full(m), comm


def _case_fp32(rank: int, world: int, tmp: str) -> dict:
    """Spec "none" through gradq against stock FSDP2: plain, without resharding after forward, with
    gradient accumulation, and with a bfloat16 reduce dtype (the policy's raw values)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out: dict = {}
    variants = {"plain": {}, "no_reshard": {"shard_kw": {"reshard_after_forward": False}},
                "accumulate": {"accumulate": 3},
                # every parameter kept in full precision by the policy: raw bfloat16 values on the wire
                "bf16": {"shard_kw": {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)},
                         "min_numel": 10 ** 9}}
    for name, kw in variants.items():
        _, stock, _ = _train(None, 3, rank, **{k: v for k, v in kw.items() if k != "min_numel"})
        _, ours, comm = _train("none", 3, rank, **kw)
        out[name] = {"equal": bool(torch.equal(stock, ours)), "steps": comm.totals["steps"],
                     "calls": comm.totals["calls"], "bits": comm.last_stats["bits_per_coord"]}
    return out


def _case_direct(rank: int, world: int, tmp: str) -> dict:
    """One call outside FSDP: this rank's block equals its recomputation from every rank's input."""
    from gradq.comm import derive_seed

    comm = GradqReduceScatter("qsgd:bits=4,bucket=64", seed=9)
    S = 300
    inputs = [torch.randn(world * S, generator=torch.Generator().manual_seed(i)) for i in range(world)]
    res = torch.empty(S)
    comm(res, inputs[rank].clone(), dist.group.WORLD, dist.ReduceOp.AVG)
    q = comm.quantizer
    want = torch.zeros(S)
    for i in range(world):   # in rank order, divided once: the protocol's sum
        want.add_(q.decode(q.encode(inputs[i][rank * S:(rank + 1) * S], seed=derive_seed(9, i, f"rs0:{rank}"))))
    want.div_(world)
    summed = torch.empty(S)
    comm(summed, inputs[rank].clone(), dist.group.WORLD, dist.ReduceOp.PREMUL_SUM(0.5))
    # Rand-K: every sender's payload for this block carries the same shared seed, which the owner
    # derives and decodes with (AVG: one mean; SUM: decodes one by one) instead of reading the fields
    unseeded = count_unseeded_decodes()
    rk = GradqReduceScatter("randk:ratio=0.25", seed=9)
    r = rk.quantizer
    rk_mean, rk_sum = torch.empty(S), torch.empty(S)
    rk(rk_mean, inputs[rank].clone(), dist.group.WORLD, dist.ReduceOp.AVG)
    rk(rk_sum, inputs[rank].clone(), dist.group.WORLD, dist.ReduceOp.SUM)
    rk_unseeded = unseeded[0]   # (before the recomputation's plain decodes, which count)
    rk_want = [torch.zeros(S), torch.zeros(S)]
    for call, acc in enumerate(rk_want):
        tag = f"rs{call}:{rank}"
        for i in range(world):
            acc.add_(r.decode(r.encode(inputs[i][rank * S:(rank + 1) * S], seed=derive_seed(9, i, tag),
                                       shared_seed=derive_seed(9, None, tag))))
    rk_want[0].div_(world)
    return {"exact": bool(torch.equal(res, want)), "bytes": comm.last_stats["bytes_sent"],
            "expected": (world - 1) * (q.expected_nbytes(S) + 4 + 4), "calls": comm.calls,
            "steps": comm.totals["steps"], "premul_close": float((summed - 0.5 * world * want).abs().max()) < 0.5,
            "randk_exact": [bool(torch.equal(rk_mean, rk_want[0])), bool(torch.equal(rk_sum, rk_want[1]))],
            "randk_unseeded": [rk_unseeded, unseeded[0] - rk_unseeded]}


def _case_policy(rank: int, world: int, tmp: str) -> dict:
    """The default policy: the biases (1-D) and the small output layer (< min_numel) travel in float32
    and reduce exactly as stock FSDP2's; the wide layer is quantized; bytes follow the layout."""
    spec = "qsgd:bits=4,bucket=64"
    _, stock, _ = _train(None, 1, rank, lr=1.0)
    _, ours, comm = _train(spec, 1, rank, lr=1.0, min_numel=200, keep_1d_fp32=True)
    m = _model()
    sizes = [p.numel() for p in m.parameters()]   # w1 (512), b1 (32), w2 (128), b2 (4)
    parts = list(torch.split(ours - stock, sizes))
    q = comm.quantizer
    # the layer-1 module: w1 quantized (512/world values per rank), b1 in float32 (32/world)
    expect_l1 = (world - 1) * (q.expected_nbytes(512 // world) + 4 * (32 // world) + 4 + 4)
    # layer 2 (w2 128 values < min_numel, b2 4 values): all float32
    expect_l2 = (world - 1) * (4 * (128 // world + 4 // world) + 4 + 4)
    # a parameter named in uncompressed (its name in the model given to register) travels in float32
    _, named, _ = _train(spec, 1, rank, lr=1.0, min_numel=0, keep_1d_fp32=True, uncompressed=["0.weight"])
    named_exact = [bool(torch.equal(p, torch.zeros_like(p))) for p in torch.split(named - stock, sizes)]
    # TernGrad's scaler is per layer: one payload per parameter shard inside each block
    _, tern, tc = _train("terngrad", 1, rank, **ALL)
    t = tc.quantizer
    expect_t = (world - 1) * (t.expected_nbytes(256) + t.expected_nbytes(16) + 8 + t.expected_nbytes(64)
                              + t.expected_nbytes(2) + 8)
    return {"fp32_exact": [bool(torch.equal(p, torch.zeros_like(p))) for p in parts],
            "named_exact": named_exact, "tern_bytes": tc.last_stats["bytes_sent"], "tern_expected": expect_t,
            "tern_finite": bool(torch.isfinite(tern).all()),
            "bytes": comm.last_stats["bytes_sent"], "expected": expect_l1 + expect_l2,
            "quantized": comm.last_stats["quantized_coords"], "coords": comm.last_stats["coords"]}


def _case_train(rank: int, world: int, tmp: str) -> dict:
    l32, _, _ = _train(None, 60, rank)
    lq, _, comm = _train("qsgd:bits=4,bucket=128", 60, rank)
    lef, _, ef = _train("ef(qsgd:bits=2,bucket=128)", 60, rank)
    per_rank = sum(p.numel() for p in _model().parameters())   # unsharded sizes (both dims divide by 2)
    from gradq.integrations import step_metrics   # what the framework callbacks log, as for the DDP hook

    metrics = step_metrics(comm)
    return {"fp32": [l32[0], sum(l32[-10:]) / 10], "q": [lq[0], sum(lq[-10:]) / 10],
            "ef": [lef[0], sum(lef[-10:]) / 10], "bits": comm.last_stats["bits_per_coord"],
            "state": comm.state_dict(), "residual_bytes": ef.residual_bytes, "expected_residual": 4 * per_rank,
            "ef_state_keys": len(ef.state_dict()["residuals"]), "metrics": metrics}


def _case_nonfinite(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    for policy, defer in (("raise", False), ("skip", False), ("raise-deferred", True), ("skip-deferred", True)):
        m = _shard(_model())
        comm = gradq.register(m, "qsgd:bits=4", seed=1, nan_policy=policy.split("-")[0], **ALL)
        comm._defer = defer   # the CUDA path's bookkeeping: counts read once, when the backward ends
        rows = []
        for t in range(3):
            x, y = _batch(t, rank)
            if t == 1 and rank == 1:
                x = x.clone()
                x[0, 0] = float("nan")   # only rank 1 sees it
            try:
                torch.nn.functional.mse_loss(m(x), y).backward()
                grads_zero = all(bool((p.grad == 0).all()) for p in m.parameters())
                rows.append({"skipped": comm.last_stats["skipped"], "zero": grads_zero})
            except gradq.NonFiniteError as e:
                rows.append({"error": str(e)[:80]})
            for p in m.parameters():
                p.grad = None
        out[policy] = {"rows": rows, "skipped_steps": comm.totals["skipped_steps"], "steps": comm.totals["steps"]}
    return out


def _case_damage(rank: int, world: int, tmp: str) -> dict:
    """At step 1 one byte of the first payload rank 1 receives from rank 0 is damaged: with checksums
    its CRC-32 fails; without, the byte becomes 0xFF, four 2-bit TernGrad codes of 3, which no encode
    writes. Only rank 1 can see it. In "both", rank 0 also has a NaN in its input at step 1 and every
    payload rank 1 receives from it in that step is damaged, so rank 1 reads none of rank 0's
    non-finite flags. In "elias", Elias-coded QSGD without checksums: the stream's own CRC-32 fails in
    the decode. Returns every rank's rows."""
    from gradq.comm import scatter as scatter_mod

    real = scatter_mod._exchange
    out: dict = {}
    tern, elias = "terngrad:pack=2bit", "qsgd:bits=4,coding=elias"
    for name, spec, policy, checksum, both in (("raise-crc", tern, "raise", True, False),
                                               ("raise-codes", tern, "raise", False, False),
                                               ("skip-crc", tern, "skip", True, False),
                                               ("skip-codes", tern, "skip", False, False),
                                               ("both", tern, "raise", True, True),
                                               ("elias", elias, "raise", False, False)):
        m = _shard(_model())
        comm = gradq.register(m, spec, seed=1, nan_policy=policy, checksum=checksum, **ALL)
        state = {"t": 0, "done": False}

        def damaged(send, sizes, fixed, group, _checksum=checksum, _every=both, _elias=spec == elias):
            recv, recv_sizes = real(send, sizes, fixed, group)
            if state["t"] == 1 and rank == 1 and (_every or not state["done"]):
                # byte 40 of the payload from rank 0: a byte of its codes (after a 26-byte header; of
                # an Elias stream's coded codes)
                recv[40] = recv[40] ^ 0x5A if _checksum or _elias else 0xFF
                state["done"] = True
            return recv, recv_sizes

        scatter_mod._exchange = damaged
        rows = []
        try:
            for t in range(3):
                state["t"] = t
                x, y = _batch(t, rank)
                if both and t == 1 and rank == 0:
                    x = x.clone()
                    x[0, 0] = float("nan")
                try:
                    torch.nn.functional.mse_loss(m(x), y).backward()
                    grads_zero = all(bool((p.grad == 0).all()) for p in m.parameters())
                    rows.append({"skipped": comm.last_stats["skipped"], "zero": grads_zero})
                except (gradq.PayloadError, gradq.NonFiniteError) as e:
                    rows.append({"error": str(e), "type": type(e).__name__})
                for p in m.parameters():
                    p.grad = None
        finally:
            scatter_mod._exchange = real
        every: list = [None] * world
        dist.all_gather_object(every, {"rows": rows, "skipped_steps": comm.totals["skipped_steps"],
                                       "steps": comm.totals["steps"]})
        out[name] = every
    return out


def _case_resume(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    spec = "qsgd:bits=4,bucket=64"

    def run(steps: range, m, opt) -> None:
        for t in steps:
            x, y = _batch(t, rank)
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()

    def fresh():
        m = _shard(_model())
        return m, gradq.register(m, spec, seed=3, **ALL), torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    def load(m, opt) -> None:
        msd, osd = get_state_dict(m, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=f"{tmp}/ckpt")
        set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    m, comm, opt = fresh()
    run(range(6), m, opt)
    straight = _full(m)
    m, comm, opt = fresh()
    run(range(3), m, opt)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/ckpt")
    saved_comm = comm.state_dict()
    m, comm, opt = fresh()   # a new process would start here
    load(m, opt)
    comm.load_state_dict(saved_comm)
    run(range(3, 6), m, opt)
    resumed = _full(m)
    m, comm, opt = fresh()   # without gradq's state the seeds restart: a different run
    load(m, opt)
    run(range(3, 6), m, opt)
    return {"exact": bool(torch.equal(straight, resumed)), "forgot_differs": not torch.equal(straight, _full(m)),
            "calls": saved_comm["calls"], "steps": saved_comm["steps"]}


def _case_mismatch(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for what, kw in {"spec": {"spec": "qsgd:bits=4" if rank == 0 else "qsgd:bits=2"},
                     "settings": {"spec": "qsgd:bits=4", "min_numel": 0 if rank == 0 else 100}}.items():
        try:
            _train(kw.pop("spec"), 1, rank, **kw)
            out[what] = None
        except ValueError as e:
            out[what] = str(e)
    return out


def _case_world4(rank: int, world: int, tmp: str) -> dict:
    """4 ranks: the flat exchange and the 2x2 hierarchical one, each against its one-process recomputation."""
    from gradq.comm import derive_seed

    S, L = 200, 2
    inputs = [torch.randn(world * S, generator=torch.Generator().manual_seed(7 + i)) for i in range(world)]
    blocks = [x.reshape(world, S) for x in inputs]
    out = {}
    unseeded = count_unseeded_decodes()
    tag = f"rs0:{rank}"
    for spec, label in (("qsgd:bits=4,bucket=50", ""), ("randk:ratio=0.25", "randk_")):
        for name, kw in {"flat": {}, "hier": {"intra_node": "fp32", "ranks_per_node": L}}.items():
            comm = GradqReduceScatter(spec, seed=4, **kw)
            q = comm.quantizer
            res = torch.empty(S)
            before = unseeded[0]
            comm(res, inputs[rank].clone(), dist.group.WORLD, dist.ReduceOp.AVG)
            read = unseeded[0] - before
            # sent to this rank: every rank's block (flat), or node n's sum of it from the rank of
            # node n with this rank's local index (hier); Rand-K's under the one shared seed
            sent = ([(i, blocks[i][rank]) for i in range(world)] if name == "flat" else
                    [(n * L + rank % L, blocks[n * L][rank] + blocks[n * L + 1][rank]) for n in range(world // L)])
            ss = derive_seed(4, None, tag) if q.needs_shared_seed else None
            want = torch.zeros(S)
            for sender, block in sent:
                want.add_(q.decode(q.encode(block, seed=derive_seed(4, sender, tag), shared_seed=ss)))
            want.div_(world)
            peers = world - 1 if name == "flat" else world // L - 1
            out[label + name] = {"exact": bool(torch.equal(res, want)), "bytes": comm.last_stats["bytes_sent"],
                                 "expected": peers * (q.expected_nbytes(S) + 8),
                                 "intra": comm.last_stats["intra_node_bytes"], "unseeded": read}
    # FSDP steps on the 2x2 layout: spec "none" matches stock FSDP2 up to the order of the float32
    # additions (node sums first); 4-bit steps run on
    _, stock, _ = _train(None, 3, rank)
    _, ours, _ = _train("none", 3, rank, intra_node="fp32", ranks_per_node=L)
    _, full, comm = _train("qsgd:bits=4,bucket=64", 4, rank, intra_node="fp32", ranks_per_node=L)
    out["hier_train"] = {"none_err": float((stock - ours).abs().max() / stock.abs().max()),
                         "steps": comm.totals["steps"], "finite": bool(torch.isfinite(full).all()),
                         "moved": float((full - stock).abs().max())}
    return out


def _case_threads(rank: int, world: int, tmp: str) -> dict:
    """Ranks sharing cores: the cases before ran one thread a rank (the spawn's OMP_NUM_THREADS=1) and
    drew no warning; with torch's pool wider than the machine in both ranks, a new reduce-scatter's
    first call draws one, from rank 0 (the lowest rank of the machine)."""
    quiet = list(_SHARED.messages)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(cpus + 1)   # wider than any share
    try:
        comm = GradqReduceScatter("qsgd:bits=4,bucket=64", seed=9)
        comm(torch.empty(100), torch.randn(world * 100), dist.group.WORLD, dist.ReduceOp.AVG)
    finally:
        torch.set_num_threads(1)
    return {"cpus": cpus, "quiet": quiet, "wide": list(_SHARED.messages)}


_SHARED: Optional[KeptWarnings] = None   # what gradq.hostshare says in this rank (kept from _child on)


CASES = {k[len("_case_"):]: v for k, v in globals().items() if k.startswith("_case_")}


def _child(rank: int, world: int, tmp: str, cases: list[str]) -> None:
    """Run ``cases`` one after another in one group (one spawn: the processes' start-up is most of a
    small case's time); a case that fails records its traceback and the next one runs."""
    import traceback
    from datetime import timedelta

    init_gloo(tmp, rank, world, timeout=timedelta(seconds=180))   # a bug that strands a rank fails, not hangs
    global _SHARED
    _SHARED = keep_warnings("gradq.hostshare")
    out: dict = {}
    try:
        for case in cases:
            try:
                out[case] = CASES[case](rank, world, tmp)
            except Exception:
                out[case] = {"__error__": traceback.format_exc()}
    finally:
        if rank == 0:
            with open(f"{tmp}/out.json", "w") as f:
                json.dump(out, f)
        teardown()


def _spawn(cases: list[str], world: int) -> dict:
    tmp = tempfile.mkdtemp()
    spawn_ranks(_child, (world, tmp, cases), world)
    with open(f"{tmp}/out.json") as f:
        return json.load(f)


#: the 2-rank cases, run in one spawn by the module's fixture (the mismatch last: it fails on purpose)
TWO_RANKS = ["fp32", "direct", "policy", "train", "nonfinite", "damage", "resume", "threads", "mismatch"]


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return _spawn(TWO_RANKS, 2)


def _result(out: dict, case: str) -> dict:
    r = out[case]
    if "__error__" in r:
        pytest.fail(f"case {case!r} failed on rank 0:\n{r['__error__']}")
    return r


def test_fp32_through_gradq_equals_stock_fsdp2(two_ranks):
    """Also without resharding after forward, with accumulation (set_requires_gradient_sync(False) on
    2 of 3 micro-batches: those backwards make no call and no step) and with a bfloat16 reduce dtype."""
    out = _result(two_ranks, "fp32")
    for name, r in out.items():
        assert r["equal"], name
        assert r["steps"] == 3, name
        assert r["calls"] == 6, name      # 3 steps x 2 FSDP modules holding parameters (the root holds none)
    assert 32.0 <= out["plain"]["bits"] < 34.0       # float32 plus header, flag and CRC (338 values per step)
    assert 16.0 <= out["bf16"]["bits"] < 17.5        # bfloat16 values stay bfloat16 on the wire


def test_quantized_block_equals_single_process_recomputation_and_bytes(two_ranks):
    out = _result(two_ranks, "direct")
    assert out["exact"] and out["calls"] == 2 and out["steps"] == 2   # outside a backward each call is a step
    assert out["bytes"] == out["expected"]   # one packed payload, its flag and CRC to the other rank
    assert out["premul_close"]
    # Rand-K's blocks decode under the shared seed the reduce-scatter derives, and none reads its
    # field; the count is not blind: the recomputation's 2 x 2 plain decodes count
    assert out["randk_exact"] == [True, True] and out["randk_unseeded"] == [0, 4]


def test_policy_keeps_small_and_1d_parameters_in_float32(two_ranks):
    out = _result(two_ranks, "policy")
    w1, b1, w2, b2 = out["fp32_exact"]
    assert not w1 and b1 and w2 and b2   # the quantized layer differs from stock; the rest is exactly stock's
    assert out["bytes"] == out["expected"]
    assert out["tern_bytes"] == out["tern_expected"] and out["tern_finite"]
    assert out["named_exact"] == [True, True, False, True]   # only the second weight quantized
    assert out["quantized"] == 512 // 2 and out["coords"] == (512 + 32 + 128 + 4) // 2


def test_training_converges_like_fp32_at_4_bits_and_with_error_feedback(two_ranks):
    out = _result(two_ranks, "train")
    (a32, b32), (aq, bq), (ae, be) = out["fp32"], out["q"], out["ef"]
    assert b32 < 0.5 * a32 and bq < 0.5 * aq and be < 0.5 * ae   # all learn the linear map
    assert bq < 1.5 * b32 + 0.05                  # 4-bit QSGD stays close to fp32 (variance ~ 1/s²)
    assert be < 2.0 * b32 + 0.1                   # 2-bit with error feedback too
    assert 4.0 < out["bits"] < 6.0 and out["state"]["calls"] > 0
    m = out["metrics"]
    assert m["gradq/step"] == 60 and m["gradq/bits_per_coord"] == out["bits"] and m["gradq/bytes_sent"] > 0
    # error feedback holds the unsharded gradient in float32 on every rank: FSDP's saving undone
    assert out["residual_bytes"] == out["expected_residual"] and out["ef_state_keys"] == 4


def test_nonfinite_gradients_raise_on_every_rank_or_skip_the_step(two_ranks):
    out = _result(two_ranks, "nonfinite")
    for how in ("", "-deferred"):   # the CPU bookkeeping, and the CUDA one (counts kept on the device)
        r = out["raise" + how]["rows"]
        assert "skipped" in r[0] and "error" in r[1] and "non-finite" in r[1]["error"] and "skipped" in r[2], how
        s = out["skip" + how]["rows"]   # rank 0 (which saw no NaN) reports: every rank skips alike
        assert s[0] == {"skipped": False, "zero": False}, how
        assert s[1] == {"skipped": True, "zero": True}, how
        assert s[2] == {"skipped": False, "zero": False}, how
        assert out["skip" + how]["skipped_steps"] == 1 and out["skip" + how]["steps"] == 3, how


def test_a_damaged_payload_is_refused_on_every_rank_in_the_same_step(two_ranks):
    """Rank 1 alone received the damaged payload (step 1); every rank raises PayloadError at the end
    of that step, or skips it with zeroed gradients, and both go on to step 2 together."""
    out = _result(two_ranks, "damage")
    for how in ("crc", "codes"):
        for rank, r in enumerate(out["raise-" + how]):
            rows = r["rows"]
            assert rows[0] == {"skipped": False, "zero": False}, (how, rank)
            assert "error" in rows[1] and "1 payload(s) of step 1 arrived damaged or corrupt" in rows[1]["error"], \
                (how, rank)
            assert rows[2] == {"skipped": False, "zero": False}, (how, rank)
            assert r["steps"] == 3, (how, rank)
        seen = out["raise-" + how][1]["rows"][1]["error"]   # the receiver names what it saw
        assert ("failed its checksum" if how == "crc" else "fields no encode writes") in seen, seen
        for rank, r in enumerate(out["skip-" + how]):
            assert [row.get("skipped") for row in r["rows"]] == [False, True, False], (how, rank)
            assert r["rows"][1]["zero"] and r["skipped_steps"] == 1 and r["steps"] == 3, (how, rank)
    # rank 1 lost every non-finite flag of rank 0 in damaged payloads: the step's agreement still
    # makes it raise NonFiniteError with rank 0 (before, rank 0 raised alone, in the call)
    for rank, r in enumerate(out["both"]):
        row = r["rows"][1]
        assert row.get("type") == "NonFiniteError" and r["rows"][2] == {"skipped": False, "zero": False}, (rank, row)
    assert "on another rank" in out["both"][1]["rows"][1]["error"]
    for rank, r in enumerate(out["elias"]):   # a stream that does not read: refused alike, not raised alone
        row = r["rows"][1]
        assert row.get("type") == "PayloadError" and r["rows"][2] == {"skipped": False, "zero": False}, (rank, row)
    assert "CRC-32 of the coded codes" in out["elias"][1]["rows"][1]["error"]


def test_checkpoint_and_resume_continue_exactly(two_ranks):
    """torch.distributed.checkpoint for the model and optimizer, GradqReduceScatter.state_dict for
    gradq (its call counter sets the next seeds); without the latter the seeds restart and the run
    ends elsewhere, which shows the comparison can fail."""
    out = _result(two_ranks, "resume")
    assert out["calls"] == 6 and out["steps"] == 3   # 3 steps x 2 FSDP modules holding parameters
    assert out["exact"] and out["forgot_differs"]


def test_ranks_sharing_cores_are_warned_where_their_pools_oversubscribe(two_ranks):
    r = _result(two_ranks, "threads")
    assert r["quiet"] == []
    (msg,) = r["wide"]
    assert "2 ranks share" in msg and "OMP_NUM_THREADS=" in msg


def test_mismatched_specs_or_settings_fail_at_the_first_reduce_scatter(two_ranks):
    out = _result(two_ranks, "mismatch")
    assert out["spec"] is not None and "spec" in out["spec"].lower()
    assert out["settings"] is not None and "disagree" in out["settings"]


def test_four_ranks_flat_and_two_by_two_hierarchical():
    out = _result(_spawn(["world4"], 4), "world4")
    for name in ("flat", "hier", "randk_flat", "randk_hier"):
        assert out[name]["exact"], name
        assert out[name]["bytes"] == out[name]["expected"], name   # hier: one payload to the other node
        assert out[name]["unseeded"] == 0, name   # Rand-K: decoded under the shared seed, no field read
    assert out["flat"]["intra"] == 0
    assert out["hier"]["intra"] == (2 - 1) * (2 * 200 + 1) * 4   # float32 ring reduce-scatter inside the node
    h = out["hier_train"]
    assert h["none_err"] < 1e-6 and h["finite"] and h["steps"] == 4 and h["moved"] > 0


NODE_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from gradq.comm import lifecycle, derive_seed
import gradq
from gradq.fsdp import GradqReduceScatter
from torch.distributed.fsdp import fully_shard
lifecycle.before_init()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
# one call, against its one-process recomputation (node sums encoded by the rank of equal local index)
S = 300
blocks = [torch.randn(world * S, generator=torch.Generator().manual_seed(3 + i)).reshape(world, S)
          for i in range(world)]
comm = GradqReduceScatter("qsgd:bits=4,bucket=64", seed=6, intra_node="fp32")   # node size: LOCAL_WORLD_SIZE
res = torch.empty(S)
comm(res, blocks[rank].reshape(-1).clone(), dist.group.WORLD, dist.ReduceOp.AVG)
q, L = comm.quantizer, comm.ranks_per_node
want = torch.zeros(S)
for n in range(world // L):
    node_sum = blocks[n * L][rank] + blocks[n * L + 1][rank]
    want.add_(q.decode(q.encode(node_sum, seed=derive_seed(6, n * L + rank % L, f"rs0:{rank}"))))
want.div_(world)
exact = torch.tensor([int(torch.equal(res, want))])
dist.all_reduce(exact, op=dist.ReduceOp.MIN)
# FSDP steps across the emulated link
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
for layer in (m[0], m[2]):
    fully_shard(layer)
fully_shard(m)
fc = gradq.register(m, "qsgd:bits=4,bucket=64", seed=2, min_numel=0, intra_node="fp32")
opt = torch.optim.SGD(m.parameters(), lr=0.05)
for t in range(3):
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(10 * t + rank))
    torch.nn.functional.mse_loss(m(x), x[:, :4]).backward()
    opt.step(); opt.zero_grad()
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"exact": bool(exact.item()), "nodes": L, "steps": fc.steps, "stats": fc.totals}, f)
lifecycle.teardown()
"""


@pytest.mark.skipif(not can_emulate()[0], reason="needs root for network namespaces")
def test_two_emulated_nodes_of_two_ranks():
    """4 ranks as 2 emulated hosts of 2 (LOCAL_WORLD_SIZE=2 as torchrun sets it per node): the
    hierarchical exchange runs across the emulated 1 Gbit/s link, bit for bit as its one-process
    recomputation on every rank, and FSDP steps run on it."""
    tmp = tempfile.mkdtemp()
    with EmulatedNetwork(4, "1gbit", ranks_per_host=2) as net:
        launch([[sys.executable, "-c", NODE_SCRIPT, f"{tmp}/net.json"]] * 4, net=net, timeout=240)
    with open(f"{tmp}/net.json") as f:
        a = json.load(f)
    assert a["nodes"] == 2 and a["exact"] and a["steps"] == 3
    assert a["stats"]["intra_node_bytes"] > 0 and a["stats"]["bytes_sent"] > 0


def test_register_refuses_what_it_cannot_do():
    assert not is_fsdp2(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="fully_shard"):
        gradq.fsdp.register(torch.nn.Linear(2, 2), "qsgd:bits=4")
    with pytest.raises(ValueError, match="min_numel"):
        GradqReduceScatter("qsgd:bits=4", min_numel="auto")
    with pytest.raises(ValueError, match="nan_policy"):
        GradqReduceScatter("qsgd:bits=4", nan_policy="ignore")
    with pytest.raises(ValueError, match="intra_node"):
        GradqReduceScatter("qsgd:bits=4", intra_node="bf16")
    comm = GradqReduceScatter("qsgd:bits=4", seed=1)
    comm.load_state_dict({"spec": comm.spec, "seed": 1, "calls": 12})
    assert comm.calls == 12
    with pytest.raises(ValueError, match="checkpoint has spec"):
        comm.load_state_dict({"spec": "qsgd:bits=2", "seed": 1, "calls": 3})
    with pytest.raises(ValueError, match="differ on"):
        comm.load_state_dict({**comm.state_dict(), "settings": {**comm.settings(), "min_numel": 5}})
    with pytest.raises(ValueError, match="residuals"):
        comm.load_state_dict({**comm.state_dict(), "residuals": {"x": torch.zeros(2)}})
