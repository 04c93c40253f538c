"""gradq.hostshare: which ranks share a machine's cores, and the warning when their thread pools add up
to more threads than those cores (the DDP hook's use of it runs in tests/test_ddp.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from gradq import hostshare


def test_only_the_lowest_rank_of_ranks_sharing_oversubscribed_cores_warns():
    keys = [7, 9, 7, 7, 9]      # ranks 0, 2, 3 share one machine; 1 and 4 another
    wide = {"torch": 4, "numba": 4}
    assert hostshare.thread_share_warning(keys, 0, cpus=8, pools=wide) is not None      # 3 × 4 > 8
    for rank in (2, 3):
        assert hostshare.thread_share_warning(keys, rank, cpus=8, pools=wide) is None
    assert hostshare.thread_share_warning(keys, 1, cpus=8, pools=wide) is None            # 2 × 4 = 8 fits
    assert hostshare.thread_share_warning(keys, 1, cpus=7, pools=wide) is not None
    assert hostshare.thread_share_warning(keys, 0, cpus=12, pools=wide) is None           # 3 × 4 = 12 fits


def test_the_widest_pool_counts_and_the_advice_is_the_share():
    keys = [1, 1]
    msg = hostshare.thread_share_warning(keys, 0, cpus=16, pools={"torch": 1, "numba": 16})
    assert msg is not None and "2 ranks share the 16 CPUs" in msg and "numba 16" in msg
    assert "OMP_NUM_THREADS=8" in msg
    assert hostshare.thread_share_warning(keys, 0, cpus=16, pools={"torch": 8, "numba": 8}) is None


def test_ranks_that_outnumber_the_cores_with_one_thread_each_are_not_warned():
    """(``gradq train`` emulates 4 workers on 2 cores that way: narrower pools are not possible.)"""
    one = {"torch": 1, "numba": 1}
    assert hostshare.thread_share_warning([1, 1, 1, 1], 0, cpus=2, pools=one) is None
    assert hostshare.thread_share_warning([1, 1, 1], 0, cpus=4, pools={"torch": 2}) is not None   # 2 > 4 // 3


def test_a_rank_alone_on_its_cores_is_never_warned():
    wide = {"torch": 64}
    assert hostshare.thread_share_warning([3], 0, cpus=2, pools=wide) is None
    assert hostshare.thread_share_warning([3, 4, 5], 1, cpus=2, pools=wide) is None


def test_slots_after_a_max_all_reduce_hold_every_rank_key(monkeypatch):
    """What the hook's all-reduce does with the slots, done here by hand for three ranks."""
    keys = {0: 11, 1: 0, 2: 11}     # a key of 0 is a valid CRC-32: EMPTY must stay below it
    rows = []
    for r in range(3):
        monkeypatch.setattr(hostshare, "host_key", lambda r=r: keys[r])
        rows.append(hostshare.host_slots(r, 3))
    assert torch.stack([torch.tensor(x) for x in rows]).max(0).values.tolist() == [11, 0, 11]


def test_the_key_names_the_machine_and_the_cpu_set(monkeypatch):
    k = hostshare.host_key()
    assert k == hostshare.host_key() and 0 <= k < 2 ** 32
    monkeypatch.setattr(hostshare, "_cpus", lambda: [0])
    one = hostshare.host_key()
    monkeypatch.setattr(hostshare, "_cpus", lambda: [1])
    assert hostshare.host_key() != one       # ranks pinned to different cores do not share


def test_warn_once_logs_for_cpu_ranks_only_and_once(monkeypatch, caplog):
    monkeypatch.setattr(hostshare, "_WARNED", False)
    monkeypatch.setattr(hostshare, "pool_threads", lambda: {"torch": 1000})
    with caplog.at_level(logging.WARNING, logger="gradq.hostshare"):
        assert hostshare.warn_once([5, 5], 0, torch.device("meta")) is None   # not a CPU rank
        assert caplog.records == []
        assert hostshare.warn_once([5, 5], 0, torch.device("cpu")) is not None
        assert hostshare.warn_once([5, 5], 0, torch.device("cpu")) is None     # said once
    assert len(caplog.records) == 1 and "OMP_NUM_THREADS" in caplog.records[0].getMessage()


@pytest.mark.parametrize("numba_loaded", [False, True])
def test_pool_threads_reads_the_pools(numba_loaded, monkeypatch):
    import sys

    if numba_loaded:
        import numba
        from numba.np.ufunc import parallel

        monkeypatch.setattr(parallel, "_is_initialized", False)   # not started: the pool's size, and not started
        monkeypatch.setattr(numba, "get_num_threads", lambda: pytest.fail("would start numba's pool"))
        assert hostshare.pool_threads()["numba"] == numba.config.NUMBA_NUM_THREADS
        monkeypatch.undo()
        numba.get_num_threads()                                   # started: what this thread uses
        assert hostshare.pool_threads()["numba"] == numba.get_num_threads()
    else:
        monkeypatch.delitem(sys.modules, "numba", raising=False)
        assert "numba" not in hostshare.pool_threads()
    assert hostshare.pool_threads()["torch"] == torch.get_num_threads()
