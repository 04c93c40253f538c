"""Kernel thread count from the process's share of the machine (gradq.kernels.process_threads)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gradq.kernels import process_threads


def test_rule_order():
    # an explicit NUMBA_NUM_THREADS wins: nothing is chosen
    assert process_threads({"NUMBA_NUM_THREADS": "3", "OMP_NUM_THREADS": "1"}, cpus=16) is None
    # torchrun's OMP_NUM_THREADS, then cores per local process
    assert process_threads({"OMP_NUM_THREADS": "2", "LOCAL_WORLD_SIZE": "8"}, cpus=16) == 2
    assert process_threads({"LOCAL_WORLD_SIZE": "4"}, cpus=16) == 4
    assert process_threads({"LOCAL_WORLD_SIZE": "32"}, cpus=16) == 1
    assert process_threads({"OMP_NUM_THREADS": "64"}, cpus=16) == 16
    # a lone process, or values that are not positive integers: numba's own default
    assert process_threads({}, cpus=16) is None
    assert process_threads({"OMP_NUM_THREADS": "0", "LOCAL_WORLD_SIZE": "x"}, cpus=16) is None


PROBE = ("import gradq, torch, numba; q = gradq.build('qsgd:bits=4,bucket=512'); "
         "q.decode(q.encode(torch.randn(300_000), seed=0)); print(numba.get_num_threads())")


def _threads_in_child(**env: str) -> int:
    base = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS",
                                                              "LOCAL_WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=300, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to tell the counts apart")
def test_a_torchrun_process_gets_its_share_without_settings():
    """What torchrun sets (OMP_NUM_THREADS=1 with several processes per node) now caps gradq's kernels
    too; an explicit NUMBA_NUM_THREADS still wins."""
    assert _threads_in_child(OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE="2") == 1
    assert _threads_in_child(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="2") == 2
    assert _threads_in_child(LOCAL_WORLD_SIZE=str(len(os.sched_getaffinity(0)))) == 1
