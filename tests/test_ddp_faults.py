"""A rank that dies or stalls during a step with the gradq hook registered (2 and 4 gloo ranks).

Every rank is its own process (not ``mp.spawn``, so one can be killed or frozen). Rank 1 misbehaves at
step 3: ``kill`` (SIGKILL to itself inside the forward pass), ``raise`` (an exception in the forward
pass: the process exits with it) or ``stall`` (sleeps, as a hung data loader or a frozen host would).
Every other rank must raise :class:`gradq.CommunicationError` naming step 3 and the collective it was
waiting for, within the hook's ``timeout`` (2 s here) plus a margin for a loaded 2-core machine, and
then exit — no process may hang. ``gradq train`` is checked the same way with real SIGKILL / SIGSTOP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TIMEOUT = 2.0  # the hook's limit in these tests
MARGIN = 20.0  # process start-up on a loaded machine is not part of the bound; see the assertions


def _rank_main(tmp: str, rank: int, world: int, mode: str, spec: str) -> None:
    """Body of one rank (run as ``python -c``); writes ``rank{r}.json`` with what happened."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradq
    import gradq_testing
    from test_ddp import backward, net

    torch.set_num_threads(1)
    gradq_testing.init_gloo(tmp, rank, world)
    model = DDP(net(), bucket_cap_mb=0.02)
    state = gradq.register(model, spec, min_numel=1000, timeout=TIMEOUT)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    res: dict = {"rank": rank, "steps_done": 0}
    t0 = None
    try:
        for step in range(6):
            if step == 3:
                t0 = time.time()
                if rank == 1 and mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if rank == 1 and mode == "raise":
                    raise RuntimeError("injected failure on rank 1")
                if rank == 1 and mode == "stall":
                    time.sleep(120)
            opt.zero_grad()
            backward(model, rank, step)
            opt.step()
            res["steps_done"] = step + 1
    except gradq.CommunicationError as exc:
        res.update(error=str(exc), kind="CommunicationError", step=exc.step, waiting_for=exc.waiting_for,
                   seconds=time.time() - (t0 or time.time()))
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(res))
    # the process group is unusable after a failure: leave without collectives (destroying it here
    # would wait on the failed group); a clean run tears down in order
    os._exit(0 if "error" not in res else 3)


def _launch(tmp: Path, world: int, mode: str, spec: str) -> tuple[list[int], float]:
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    code = "import sys, test_ddp_faults as t; t._rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp), str(r), str(world), mode, spec], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in range(world)]
    t0 = time.time()
    codes: list[int] = []
    try:
        for r, p in enumerate(procs):
            if mode == "stall" and r == 1:
                continue
            p.wait(timeout=240)
        survivors_done = time.time() - t0
    finally:
        for r, p in enumerate(procs):  # the stalled rank, and anything left after a failed assertion
            if p.poll() is None:
                p.kill()
                p.wait()
            codes.append(p.returncode)
    return codes, survivors_done


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["kill", "raise", "stall"])
def test_other_ranks_fail_in_bounded_time_naming_the_step(tmp_path, world, mode):
    spec = "qsgd:bits=4"  # scatter/all-gather (all-to-all, then the point-to-point ring on gloo)
    codes, _ = _launch(tmp_path, world, mode, spec)
    for r in range(world):
        if r == 1:
            continue
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["steps_done"] == 3, res
        assert res.get("kind") == "CommunicationError", res
        assert res["step"] == 3 and "step 3" in res["error"], res
        assert res["waiting_for"] and res["waiting_for"] in res["error"], res
        # a dead peer is noticed when its connection closes; a stalled one after the limit; either way
        # well within limit + margin (measured from the step's start on this rank)
        assert res["seconds"] < TIMEOUT + MARGIN, res
        if mode == "stall" and world == 2:  # the only peer is alive but silent: the limit itself fired
            assert "no answer within 2 s" in res["error"], res
            assert res["seconds"] >= TIMEOUT - 0.5, res
        assert codes[r] == 3  # exited by itself with the error (not killed by the test)
    assert codes[1] != 0


def test_allreduce_protocol_and_integer_sums_too(tmp_path):
    """The integer all-reduce path (TernGrad) fails the same way when the peer stalls."""
    codes, _ = _launch(tmp_path, 2, "stall", "terngrad")
    res = json.loads((tmp_path / "rank0.json").read_text())
    assert res["kind"] == "CommunicationError" and res["step"] == 3, res
    assert "no answer within 2 s" in res["error"], res
    assert codes[0] == 3


# -- gradq train ----------------------------------------------------------------------------------
def _worker_pids(parent: int) -> dict[int, int]:
    """RANK -> pid of the worker processes below ``parent``."""
    out: dict[int, int] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = int(pid)
    return out


def _rows(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds worker processes through /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
def test_gradq_train_exits_nonzero_with_the_message_and_an_intact_log(tmp_path, sig):
    pytest.importorskip("sklearn")
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "gradq.cli", "train", "--workers", "2", "--model", "mlp", "--data", "digits",
           "--epochs", "4", "--min-numel", "1000", "--comm-timeout", "3", "--out", str(out), "-c", "qsgd:bits=4"]
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "GRADQ_LAUNCHED"):
        env.pop(k, None)
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "00-qsgd_bits=4-s0" / "log.jsonl"
    try:
        deadline = time.time() + 180
        while len([r for r in _rows_safe(log) if r.get("kind") == "step"]) < 5:
            assert p.poll() is None, p.communicate()
            assert time.time() < deadline, "training did not start"
            time.sleep(0.2)
        pids = _worker_pids(p.pid)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], sig)
        t_fault = time.time()
        stdout, stderr = p.communicate(timeout=120)
        took = time.time() - t_fault
    finally:
        if p.poll() is None:
            p.kill()
        for pid in _worker_pids(p.pid).values():
            os.kill(pid, signal.SIGKILL)
    assert p.returncode != 0
    assert "exited with" in stderr  # the launcher names the rank that failed
    if sig == signal.SIGSTOP:
        # rank 0 reports the stall itself, with the step and the collective, after the 3 s limit
        assert "gradq: rank 0: error: gradq_hook: step" in stderr and "waiting for" in stderr, stderr[-2000:]
        assert "no answer within 3 s" in stderr, stderr[-2000:]
    assert took < 3 + MARGIN, took
    rows = _rows(log)  # every line is whole JSON (a torn line would raise here)
    steps = [r["step"] for r in rows if r["kind"] == "step"]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5
    assert rows[-1]["kind"] != "summary"  # the run is not marked finished: a rerun starts it again


def _rows_safe(log: Path) -> list[dict]:
    try:
        return _rows(log)
    except (OSError, ValueError):  # the file is being written
        return []


def test_timeout_arguments_are_checked():
    import torch

    import gradq
    from gradq.ddp import DEFAULT_TIMEOUT, GradqState

    assert GradqState("qsgd:bits=4").timeout == DEFAULT_TIMEOUT == 300.0
    assert GradqState("qsgd:bits=4", timeout=None).timeout is None
    for bad in (0, -1.0, True, "30"):
        with pytest.raises(ValueError, match="timeout"):
            GradqState("qsgd:bits=4", timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            gradq.allreduce_(torch.ones(3), "qsgd:bits=4", timeout=bad)


def test_backend_failures_are_described():
    from gradq.comm._util import describe_failure

    gloo_timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv")
    assert describe_failure(gloo_timeout, 2.0).startswith("no answer within 2 s")
    closed = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7563")
    assert "closed its connection" in describe_failure(closed, 2.0)
    assert describe_failure(RuntimeError("something else\nmore"), None) == "something else"
