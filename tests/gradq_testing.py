"""Shared helpers for gradq tests (importable as ``gradq_testing``): statistical checks with tolerances derived from the variance."""

from __future__ import annotations

import itertools
import logging
import math
from typing import Callable, Iterable, Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def grid(*axes: Sequence, covering: Iterable[tuple]) -> list:
    """Parameters for ``pytest.mark.parametrize`` over the product of ``axes``: the ``covering``
    combinations run by default, every other one carries the ``full`` mark (``pytest --full``)."""
    keep = {tuple(c) for c in covering}
    cases = list(itertools.product(*axes))
    missing = keep - set(cases)
    if missing:
        raise ValueError(f"covering cases outside the grid: {sorted(missing, key=repr)}")
    return [pytest.param(*c) if c in keep else pytest.param(*c, marks=pytest.mark.full) for c in cases]


def unbiasedness_stats(q, x: torch.Tensor, trials: int, **encode_kwargs) -> dict[str, float]:
    """Encode ``x`` ``trials`` times (seeds 0..trials-1) and compare the sample mean with ``x``.

    Returns, over coordinates whose sample variance is positive, the chi-square-like statistic
    ``T = Σ z_i²`` with ``z_i = (mean_i − x_i) / sqrt(var_i / trials)`` and its number of terms ``k``,
    the largest ``|z_i|``, and the largest error of the zero-variance coordinates. For an unbiased
    quantizer ``T`` is approximately chi-square with ``k`` degrees of freedom (mean ``k``, sd ``√(2k)``)
    and every ``z_i`` approximately standard normal.
    """
    outs = torch.stack([q.roundtrip(x, seed=s, **encode_kwargs).to(torch.float64).reshape(-1)
                        for s in range(trials)])
    xf = x.to(torch.float64).reshape(-1)
    mean = outs.mean(0)
    var = outs.var(0, unbiased=True)
    live = var > 1e-20
    z = (mean[live] - xf[live]) / torch.sqrt(var[live] / trials)
    dead_err = (mean[~live] - xf[~live]).abs().max().item() if (~live).any() else 0.0
    k = int(live.sum())
    return {"T": float((z ** 2).sum()), "k": k, "max_z": float(z.abs().max()) if k else 0.0,
            "dead_err": dead_err}


def assert_unbiased(q, x: torch.Tensor, trials: int = 3000, **encode_kwargs) -> None:
    """Assert unbiasedness with tolerances from the variance.

    * ``T ≤ k + 6·√(2k)``: six standard deviations above the chi-square mean (one-sided p < 1e-6
      under the normal approximation; the test's seeds are fixed, so it is deterministic).
    * ``max |z| ≤ 6``: with at most a few hundred coordinates, a Bonferroni bound gives
      p ≤ 300 · 2·Φ(−6) ≈ 6e-7.
    * zero-variance coordinates are exact up to float32 rounding of the decode (1e-5 relative).
    A bias of one standard error per coordinate already moves ``T`` by ``k``, far beyond these.
    """
    st = unbiasedness_stats(q, x, trials, **encode_kwargs)
    k = st["k"]
    assert st["T"] <= k + 6 * math.sqrt(2 * max(k, 1)), f"{q}: biased? {st}"
    assert st["max_z"] <= 6.0, f"{q}: biased coordinate? {st}"
    scale = float(x.abs().max()) if x.numel() else 1.0
    assert st["dead_err"] <= 1e-5 * max(scale, 1e-30), f"{q}: deterministic coordinates off: {st}"


def mc_mean(fn: Callable[[int], float], trials: int) -> tuple[float, float]:
    """Monte Carlo mean of ``fn(seed)`` over ``trials`` seeds and its standard error."""
    vals = torch.tensor([fn(s) for s in range(trials)], dtype=torch.float64)
    return float(vals.mean()), float(vals.std(unbiased=True) / math.sqrt(trials))


def ref_omega(k: int) -> str:
    """Pure-Python Elias omega code of ``k`` as a bit string (the codecs' test oracle); ALGORITHMS.md §1.1: start from '0'; while k > 1 prepend bin(k) and set k = bitlength(k) - 1."""
    out = "0"
    while k > 1:
        out = format(k, "b") + out
        k = k.bit_length() - 1
    return out


def spawn_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with ``OMP_NUM_THREADS=1`` in the children's
    environment, as torchrun sets it for several processes per node. A child that sets it itself does
    so after importing gradq, too late for numba's pool, which is sized when gradq loads it: each rank
    then ran a pool as wide as the machine, and on two cores the ranks' pools spun against each other
    (a protocol's decode of a few hundred values took 12 ms instead of 0.04 ms with 4 ranks)."""
    import os

    import torch.multiprocessing as mp

    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def init_gloo(tmp: str, rank: int, world: int, **kw) -> None:
    """Start a gloo group for a spawned test rank (file rendezvous in ``tmp``: no ports), in the order
    gradq needs for a clean exit (``torch._dynamo`` loaded first; see gradq.comm.lifecycle)."""
    import torch.distributed as dist

    from gradq.comm import lifecycle

    lifecycle.before_init()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world, **kw)


def teardown() -> None:
    """End a spawned test rank: gradq's threads, garbage, then the process group (gradq.teardown)."""
    from gradq.comm import lifecycle

    lifecycle.teardown()


class KeptWarnings(logging.Handler):
    """The warnings a logger gives, kept as their messages (``keep_warnings("gradq.hostshare")`` in a
    spawned rank, whose log pytest does not capture)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def keep_warnings(logger: str) -> KeptWarnings:
    kept = KeptWarnings()
    logging.getLogger(logger).addHandler(kept)
    return kept


def count_unseeded_decodes(patch=setattr) -> list:
    """From now on (``patch``: how to replace the method; a test's ``monkeypatch.setattr`` undoes it),
    count the decodes of payloads with a ``seed`` field that are not given the shared seed they were
    sent under (each reads the field on the host, a wait on a GPU): ``[count]``."""
    from gradq.quantizers.base import Quantizer

    count = [0]
    real = Quantizer._given_seed

    def counting(self, fields, shared_seed):
        count[0] += shared_seed is None and any("seed" in f for f in fields)   # (a decode, or a mean)
        return real(self, fields, shared_seed)

    patch(Quantizer, "_given_seed", counting)
    return count


class HostReads(TorchDispatchMode):
    """Counts the operators that bring a value to the host (each a wait for a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("_local_scalar_dense", "is_nonzero", "equal"):
            self.reads += 1
        return func(*args, **(kwargs or {}))


class NewStorage(TorchDispatchMode):
    """The largest storage (bytes) an operator made: an output that is no view of its inputs."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor)}
        for t in tree_leaves(res):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return res
