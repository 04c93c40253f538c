"""gradq through Lightning, Accelerate and the Transformers Trainer: 2 gloo processes under torchrun,
running the examples' scripts.

Each framework: a run that checkpoints half way, a run resumed from that checkpoint (must end with
the same parameters, bit for bit), and a resume whose gradq entry was removed from the checkpoint (must
end elsewhere: without it error feedback restarts, which shows that the comparison can fail; the
Trainer's callback refuses such a resume instead). The spec
is ``onebit`` (1 bit per coordinate plus scales, with error-feedback residuals per rank). Skipped where
the framework is not installed (``pip install 'gradq[integrations]'``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradq import GradqState
from gradq.integrations import FORMAT, RankStates, find_ddp, step_metrics

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str, *args: str, timeout: float = 120, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / script), *args]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if ok:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def result(out: Path) -> tuple[dict, torch.Tensor]:
    return json.loads((out / "result.json").read_text()), torch.load(out / "params.pt")


def check_run(res: dict) -> None:
    assert res["replicas_equal"]
    stats = res["last_stats"]
    # the hook is really active: onebit's 1 bit a coordinate plus two float32 scales per tensor, far
    # below the 32 of a float32 all-reduce that a silently dropped hook would leave
    assert stats["mode"] == "spec" and stats["quantized_coords"] == stats["coords"] == 2762
    assert 1.0 < stats["bits_per_coord"] < 2.0


def test_lightning_callback_trains_logs_and_resumes_exactly(tmp_path):
    pytest.importorskip("lightning")
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    torchrun("lightning_ddp.py", "--out", str(a))
    res_a, p_a = result(a)
    check_run(res_a)
    assert res_a["gradq_step"] == res_a["global_step"] == 32   # the hook ran at every optimizer step
    assert {"gradq/bits_per_coord", "gradq/bytes_sent", "gradq/encode_seconds"} <= set(res_a["logged"])
    assert "gradq/bits_per_coord" in (a / "metrics.csv").read_text().splitlines()[0]
    mid = a / "ckpt" / "epoch=0.ckpt"
    torchrun("lightning_ddp.py", "--out", str(b), "--resume", str(mid))
    res_b, p_b = result(b)
    check_run(res_b)
    assert torch.equal(p_a, p_b)
    ckpt = torch.load(mid, weights_only=False)
    (key,) = [k for k in ckpt["callbacks"] if k.startswith("GradqCallback")]
    assert ckpt["callbacks"][key]["format"] == FORMAT and len(ckpt["callbacks"][key]["ranks"]) == 2
    del ckpt["callbacks"][key]
    torch.save(ckpt, tmp_path / "forgot.ckpt")
    torchrun("lightning_ddp.py", "--out", str(c), "--resume", str(tmp_path / "forgot.ckpt"))
    assert not torch.equal(p_a, result(c)[1])


def test_accelerate_register_checkpoints_and_resumes_exactly(tmp_path):
    pytest.importorskip("accelerate")
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    torchrun("accelerate_ddp.py", "--out", str(a))
    res_a, p_a = result(a)
    check_run(res_a)
    assert res_a["gradq_step"] == 30
    torchrun("accelerate_ddp.py", "--out", str(b), "--resume", str(a / "ckpt"))
    res_b, p_b = result(b)
    check_run(res_b)
    assert torch.equal(p_a, p_b)
    saved = torch.load(a / "ckpt" / "custom_checkpoint_0.pkl", weights_only=False)
    assert saved["format"] == FORMAT and len(saved["ranks"]) == 2
    import shutil

    shutil.copytree(a / "ckpt", tmp_path / "forgot")
    torch.save({**saved, "ranks": []}, tmp_path / "forgot" / "custom_checkpoint_0.pkl")   # as if never saved
    torchrun("accelerate_ddp.py", "--out", str(c), "--resume", str(tmp_path / "forgot"))
    assert not torch.equal(p_a, result(c)[1])


def test_trainer_callback_registers_after_ddp_logs_and_resumes_exactly(tmp_path):
    pytest.importorskip("transformers")
    a, b = tmp_path / "a", tmp_path / "b"
    torchrun("trainer_ddp.py", "--out", str(a))
    res_a, p_a = result(a)
    check_run(res_a)
    assert res_a["gradq_step"] == res_a["global_step"] == 8
    # the reporters (a stand-in callback added at construction) receive gradq's figures in `logs`
    assert {"gradq/bits_per_coord", "gradq/bytes_sent", "gradq/encode_seconds"} <= set(res_a["logged"])
    mid = a / "checkpoint-4"
    saved = torch.load(mid / "gradq_state.pt", weights_only=False)
    assert saved["format"] == FORMAT and [r["step"] for r in saved["ranks"]] == [4, 4]
    torchrun("trainer_ddp.py", "--out", str(b), "--resume", str(mid))
    res_b, p_b = result(b)
    check_run(res_b)
    assert torch.equal(p_a, p_b)
    (mid / "gradq_state.pt").unlink()   # a resume without gradq's state is refused, not silently restarted
    res = torchrun("trainer_ddp.py", "--out", str(tmp_path / "c"), "--resume", str(mid), ok=False)
    assert res.returncode != 0 and "gradq_state.pt does not exist" in res.stdout + res.stderr


# -- the shared pieces, in one process ---------------------------------------------------------------------
def test_rank_states_round_trip_and_refusals():
    st = GradqState("qsgd:bits=4")
    st.step = 7
    saved = RankStates(st).state_dict()
    assert saved["format"] == FORMAT and saved["world_size"] == 1 and saved["ranks"][0]["step"] == 7
    later = RankStates()                    # loaded before the hook exists (Lightning restores first)
    later.load_state_dict(saved)
    fresh = GradqState("qsgd:bits=4")
    later.attach(fresh)
    assert fresh.step == 7
    RankStates(GradqState("qsgd:bits=4")).load_state_dict({"format": FORMAT, "world_size": 1, "ranks": []})
    assert RankStates().state_dict()["ranks"] == []
    with pytest.raises(ValueError, match="format"):
        RankStates(fresh).load_state_dict({"step": 3})
    with pytest.raises(ValueError, match="saved by 2 ranks"):
        RankStates(fresh).load_state_dict({**saved, "ranks": saved["ranks"] * 2})
    with pytest.raises(ValueError, match="settings differ"):
        RankStates(GradqState("qsgd:bits=2")).load_state_dict(saved)


def test_step_metrics_and_find_ddp():
    st = GradqState("qsgd:bits=4")
    assert step_metrics(st) == {}
    st.last_stats = {"bits_per_coord": 4.5, "bytes_sent": 100, "encode_seconds": 0.1, "skipped": False,
                     "strategy": "allreduce"}
    st.step = 3
    assert step_metrics(st) == {"gradq/bits_per_coord": 4.5, "gradq/bytes_sent": 100.0,
                                "gradq/encode_seconds": 0.1, "gradq/step": 3.0}
    m = torch.nn.Linear(2, 2)
    assert find_ddp(m) is None

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    assert find_ddp(Wrapper(Wrapper(m))) is None
