"""The hook, the protocols, ``allreduce_`` and the runner on CUDA tensors with several ranks.

NCCL refuses two ranks on one GPU, but gloo runs collectives on CUDA tensors ("cuda:gloo"), several
ranks sharing the GPU; a collective on a CPU tensor there raises "No backend type associated with
device type cpu" exactly as on NCCL, so these tests catch any CPU tensor that would break an NCCL run.
NCCL itself runs with one rank (its own all-to-all and all-gather, a forced protocol). Marked ``gpu``
and skipped without one: ``python -m pytest -m gpu tests/test_cuda_ranks.py`` on a GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

WORLD = 4
SPECS = [("qsgd:bits=4,bucket=512", "scatter"), ("maxnorm:bits=4", "allreduce"), ("terngrad", "allreduce"),
         ("topk:ratio=0.05", "allgather"), ("qsgd:bits=2,bucket=128", "allgather")]


def _init(tmp: str, rank: int, world: int, backend: str = "cuda:gloo") -> None:
    import torch.distributed as dist

    from gradq.comm import lifecycle

    lifecycle.before_init()
    torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{tmp}/rdv", rank=rank, world_size=world)


def _protocols_child(rank: int, world: int, tmp: str, device: str = "cuda") -> None:
    import gradq
    from gradq.comm.api import average
    from gradq_testing import teardown

    if device == "cuda":
        _init(tmp, rank, world)
    else:   # the same exchanges between CPU ranks, to compare with
        from gradq_testing import init_gloo
        init_gloo(tmp, rank, world)
    out: dict = {}
    try:
        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        xs = [torch.randn(3001, generator=torch.Generator().manual_seed(m)) for m in range(world)]
        exact = torch.stack(xs).mean(0)
        for spec, protocol in SPECS:
            q = gradq.build(spec)
            x = xs[rank].to(dev)
            # no CRC-32 trailers: CPU payloads carry them and CUDA payloads do not (comm._util.seal_bytes),
            # so with them the bytes sent would differ by 4 per payload; this test compares the payloads
            got, nbytes = average(x, q, protocol, seed=7, name="w", checksum=False)
            every = [torch.empty_like(got) for _ in range(world)]
            torch.distributed.all_gather(every, got)
            out[f"{spec}|{protocol}"] = {
                "device": str(got.device), "same": all(torch.equal(e, every[0]) for e in every),
                "rel": float((got.cpu() - exact).norm() / exact.norm()), "bytes": nbytes}
        ts = [xs[rank][:1000].to(dev).clone(), xs[rank][1000:].to(dev).clone()]
        info = gradq.allreduce_(ts, "qsgd:bits=8,bucket=512", seed=3)
        out["allreduce_"] = {"device": str(ts[0].device), "protocol": info["protocol"],
                             "rel": float((torch.cat(ts).cpu() - exact).norm() / exact.norm())}
    finally:
        teardown()
    with open(f"{tmp}/protocols{rank}.json", "w") as f:
        json.dump(out, f)


def _hook_child(rank: int, world: int, tmp: str) -> None:
    import gradq
    from gradq_testing import teardown
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init(tmp, rank, world)
    out: dict = {}
    try:
        dev = torch.device("cuda", 0)
        for spec in ("qsgd:bits=4,bucket=512", "terngrad", "topk:ratio=0.1,ef=1"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                        torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
            ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.1)
            state = gradq.register(ddp, spec, min_numel=1000, group_mb=0.1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(100 + rank)
            for step in range(4):
                x, y = torch.randn(16, 64, generator=g).to(dev), torch.randint(0, 10, (16,), generator=g).to(dev)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            every = [torch.empty_like(flat) for _ in range(world)]
            torch.distributed.all_gather(every, flat)
            st = state.last_stats
            out[spec] = {"same": all(torch.equal(e, every[0]) for e in every), "finite": bool(torch.isfinite(flat).all()),
                         "step": state.step, "groups": st["groups"], "encode": st["encode_seconds"],
                         "bits": st["bits_per_coord"]}
        # a non-finite gradient on one rank: every rank skips the step, gradients zero
        torch.manual_seed(0)
        model = torch.nn.Linear(128, 128).to(dev)
        ddp = DDP(model, device_ids=[0])
        state = gradq.register(ddp, "qsgd:bits=4,bucket=512", nan_policy="skip", min_numel=100)
        for step in range(2):
            x = torch.randn(8, 128, device=dev)
            if step == 1 and rank == 1:
                x[0, 0] = float("nan")
            ddp(x).sum().backward()
        out["skip"] = {"skipped": state.last_stats["skipped"], "count": state.skipped_steps,
                       "zero": all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())}
        # codes no encode writes (CUDA payloads carry no CRC): rank 1 sets a byte of four 2-bit TernGrad
        # codes of rank 0's payload to 0xFF at step 1; its decode counts that on the device (no host
        # read) and every rank skips the step
        from gradq.comm import allgather as allgather_mod
        gather, at = allgather_mod.all_gather_bytes, [0]

        def bad_gather(*a, **k):
            got = gather(*a, **k)
            if rank == 1 and at[0] == 1:
                got[0] = got[0].clone()
                got[0][-5] = 0xFF   # the last byte of rank 0's codes (its 4-byte scale follows)
            return got
        allgather_mod.all_gather_bytes = bad_gather
        try:
            torch.manual_seed(0)
            model = torch.nn.Linear(128, 128).to(dev)
            ddp = DDP(model, device_ids=[0])
            state = gradq.register(ddp, "terngrad:pack=2bit", "allgather", nan_policy="skip", min_numel=100)
            skipped = []
            for step in range(3):
                at[0] = step
                ddp(torch.randn(8, 128, device=dev)).sum().backward()
                skipped.append(state.last_stats["skipped"])
            out["invalid"] = {"skipped": skipped, "count": state.skipped_steps}
        finally:
            allgather_mod.all_gather_bytes = gather
    finally:
        teardown()
    with open(f"{tmp}/hook{rank}.json", "w") as f:
        json.dump(out, f)


def _fsdp_child(rank: int, world: int, tmp: str) -> None:
    """FSDP2 on CUDA tensors: spec "none" against stock FSDP2, 4-bit flat and 2x2 hierarchical steps."""
    import gradq
    from gradq_testing import teardown
    from torch.distributed.fsdp import fully_shard

    _init(tmp, rank, world)
    out: dict = {}
    dev = torch.device("cuda", 0)

    def run(spec, **kw):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
        for layer in (m[0], m[2]):
            fully_shard(layer)
        fully_shard(m)
        comm = None if spec is None else gradq.register(m, spec, seed=1, min_numel=1000, **kw)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            x, y = torch.randn(16, 64, generator=g).to(dev), torch.randint(0, 10, (16,), generator=g).to(dev)
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        # each rank's own shards: DTensor.full_tensor() gathers through torch's functional collectives,
        # which crash with SIGSEGV over cuda:gloo in torch 2.11 (seen on an H100, in stock FSDP2 before
        # gradq ran); the shards of all ranks together are the whole model, and each rank checks its own
        return torch.cat([p.to_local().reshape(-1) for p in m.parameters()]), comm

    try:
        stock, _ = run(None)
        none, _ = run("none")
        q4, comm = run("qsgd:bits=4,bucket=512")
        hier, hc = run("qsgd:bits=4,bucket=512", intra_node="fp32", ranks_per_node=2)
        out = {"device": str(q4.device), "none_rel": float((none - stock).norm() / stock.norm()),
               "finite": bool(torch.isfinite(q4).all() and torch.isfinite(hier).all()),
               "steps": [comm.totals["steps"], hc.totals["steps"]], "bits": comm.last_stats["bits_per_coord"],
               "intra": hc.totals["intra_node_bytes"]}
    finally:
        teardown()
    with open(f"{tmp}/fsdp{rank}.json", "w") as f:
        json.dump(out, f)


def _run(fn, tmp, world: int = WORLD, *extra) -> list[dict]:
    from gradq_testing import spawn_ranks

    tmp.mkdir(parents=True, exist_ok=True)
    spawn_ranks(fn, (world, str(tmp), *extra), world)
    name = fn.__name__.strip("_").replace("_child", "")
    return [json.load(open(f"{tmp}/{name}{r}.json")) for r in range(world)]


# The average of 4 workers' N(0, 1) vectors has variance 1/4 per coordinate; unbiased stochastic
# rounding onto a grid of step D adds at most D^2/4 per worker, /16 on the average. 4-bit schemes
# (D = scale/7, scale about 3): relative error about 0.25. Ternary and 2-bit codes (D = scale, the
# shared max about 2.5-3): about 1.0-1.15, the size of the signal itself. Top-K at 5 % keeps only the
# largest values: below 1 by construction. The bounds sit well above these.
REL_BOUND = {"qsgd:bits=4,bucket=512": 0.6, "maxnorm:bits=4": 0.6, "terngrad": 1.5, "topk:ratio=0.05": 1.0,
             "qsgd:bits=2,bucket=128": 1.5}


def test_protocols_and_allreduce_on_cuda_tensors(tmp_path):
    """Every protocol between 4 ranks on CUDA tensors gives what CPU ranks give for the same seeds
    (the kernels give the CPU's bytes), on every rank, within the error its scheme implies."""
    outs = _run(_protocols_child, tmp_path / "cuda", WORLD, "cuda")
    cpu = _run(_protocols_child, tmp_path / "cpu", WORLD, "cpu")
    for r, c in zip(outs, cpu):
        assert r.keys() == c.keys()
        for key, v in r.items():
            assert v["device"].startswith("cuda"), (key, v)
            # float sums over ranks may run in another order on the device: equal up to rounding
            assert abs(v["rel"] - c[key]["rel"]) <= 1e-5 * c[key]["rel"], (key, v, c[key])
            if key == "allreduce_":
                assert v["protocol"] == "scatter" and v["rel"] < 0.05, v
                continue
            assert v["same"] and v["bytes"] == c[key]["bytes"], (key, v, c[key])
            assert v["rel"] < REL_BOUND[key.split("|")[0]], (key, v)


def test_hook_on_cuda_tensors_keeps_replicas_identical(tmp_path):
    outs = _run(_hook_child, tmp_path)
    for r in outs:
        for spec in ("qsgd:bits=4,bucket=512", "terngrad", "topk:ratio=0.1,ef=1"):
            v = r[spec]
            assert v["same"] and v["finite"] and v["step"] == 4, (spec, v)
            assert v["groups"] >= 2, v          # several groups: jobs started before the last bucket
            assert v["encode"] > 0, v            # timed with CUDA events
        assert r["skip"] == {"skipped": True, "count": 1, "zero": True}, r["skip"]
        assert r["invalid"] == {"skipped": [False, True, False], "count": 1}, r["invalid"]


def test_fsdp2_reduce_scatter_on_cuda_tensors(tmp_path):
    for r in _run(_fsdp_child, tmp_path):
        assert r["device"].startswith("cuda") and r["finite"] and r["steps"] == [3, 3], r
        assert r["none_rel"] < 1e-6, r          # float32 through gradq: stock FSDP2's up to addition order
        assert 4.0 < r["bits"] < 6.0 and r["intra"] > 0, r


def test_runner_on_cuda_gloo_and_nccl_world_one(tmp_path):
    """``gradq train`` end to end: 2 ranks sharing the GPU over cuda:gloo, and NCCL with one process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath("src"), os.environ.get("PYTHONPATH", "")]))
    for backend, workers in (("cuda:gloo", 2), ("nccl", 1)):
        out = tmp_path / backend.replace(":", "_")
        cmd = [sys.executable, "-m", "gradq.cli", "train", "--workers", str(workers), "--backend", backend,
               "--model", "mlp", "--data", "digits", "--epochs", "1", "--out", str(out),
               "-c", "fp32", "-c", "qsgd:bits=4,bucket=512", "--strategy", "scatter" if workers == 1 else "auto"]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        logs = sorted(out.glob("*/log.jsonl"))
        assert len(logs) == 2
        for log in logs:
            rows = [json.loads(line) for line in open(log)]
            assert rows[-1]["kind"] == "summary" and rows[-1]["final_test_accuracy"] > 0.5, rows[-1]
