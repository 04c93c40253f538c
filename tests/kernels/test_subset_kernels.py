"""The numba selection of RandK's / GlobalRandK's shared random subset against the torch reference."""

from __future__ import annotations

import pytest
import torch

from gradq import kernels
from gradq.kernels import numba_ops, reference, subset
from gradq.random import RandomStream

pytestmark = pytest.mark.skipif(not numba_ops.loads(), reason="numba is not installed")


@pytest.mark.parametrize("n,k", [(1, 1), (2, 1), (5, 3), (1000, 10), (70_000, 1), (70_000, 69_999),
                                 (300_001, 3_000), (1 << 20, 1 << 19), (3_000_017, 30_000)])
@pytest.mark.parametrize("seed", [0, 7, -3, 2**63 - 1])
def test_same_indices_as_reference(n, k, seed):
    got = subset.random_subset(n, k, seed)
    assert got.dtype == torch.int64 and got.shape == (k,)
    assert torch.equal(got, reference.random_subset(n, k, seed))


def test_boundary_at_histogram_bin_edges():
    """k whose last key is the first or last of a 16-bit histogram bin, or just past it (the cases where
    the kernel's boundary bin is switched). The draws of one stream never repeat below 2**32 elements
    (a multiply-add and two lowbias32 rounds are bijections of 32 bits), so indices never break ties."""
    n, seed = 1 << 20, 11
    u = RandomStream(seed).bits32(n).to(torch.int64) + (1 << 31)   # order-preserving, non-negative
    assert torch.unique(u).numel() == n
    per_bin = torch.bincount(u >> 16, minlength=65536)
    edge = int(torch.cumsum(per_bin, 0)[40_000])                   # keys in bins 0..40000
    for k in (edge - 1, edge, edge + 1):
        assert torch.equal(subset.random_subset(n, k, seed), reference.random_subset(n, k, seed))


def test_dispatch_and_errors():
    assert torch.equal(kernels.random_subset(10_000, 100, 3), reference.random_subset(10_000, 100, 3))
    assert kernels.random_subset(10, 0, 3).numel() == 0
    assert torch.equal(kernels.random_subset(10, 10, 3), torch.arange(10))
    for bad in (-1, 11):
        with pytest.raises(ValueError, match="cannot choose"):
            subset.random_subset(10, bad, 0)


def test_one_pass_of_candidates_decides_small_subsets(monkeypatch):
    """For k up to about n/16 the candidates below the threshold decide the subset: the histogram
    path is not needed (here it would raise)."""
    def no_histogram(*args):
        raise AssertionError("the histogram path ran")

    monkeypatch.setattr(subset, "_subset_by_histogram", no_histogram)
    for n, k, seed in ((70_000, 1, 0), (300_001, 3_000, 7), (3_000_017, 30_000, -3), (1 << 20, 60_000, 5)):
        assert torch.equal(subset.random_subset(n, k, seed), reference.random_subset(n, k, seed))


def _count_calls(monkeypatch, name: str) -> list:
    """Wrap ``subset.<name>`` so that each call appends to the returned list."""
    ran: list = []
    real = getattr(subset, name)

    def counted(*args):
        ran.append(1)
        return real(*args)

    monkeypatch.setattr(subset, name, counted)
    return ran


@pytest.mark.parametrize("patch", ["too_few", "no_room"])
def test_candidates_that_cannot_decide_fall_back_to_the_histogram(monkeypatch, patch):
    """Too few candidates (a threshold below the k-th draw) or a part's share past its room: the
    histogram path gives the same subset."""
    ran = _count_calls(monkeypatch, "_subset_by_histogram")
    n, k, seed = 300_001, 3_000, 13
    if patch == "too_few":
        monkeypatch.setattr(subset, "_candidate_limit", lambda n_, k_: (k_ // 2) * (1 << 32) // n_)
    else:
        monkeypatch.setattr(subset, "_candidate_room", lambda per: 10)
    assert torch.equal(subset.random_subset(n, k, seed), reference.random_subset(n, k, seed))
    assert ran


# -- Top-K: the k largest magnitudes ---------------------------------------------------------------
def _vector(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if kind == "sparse":             # nine zeros in ten, both signs of zero
        x[torch.rand(n, generator=g) < 0.9] = 0.0
        x[torch.rand(n, generator=g) < 0.05] = -0.0
    elif kind == "few":              # a handful of magnitudes: long runs of ties
        x = torch.randint(-3, 4, (n,), generator=g).to(torch.float32)
    elif kind == "grid":             # many magnitudes, each taken by many values: ties inside the window
        x = torch.round(x * 64) / 64
    elif kind == "constant":
        x = torch.full((n,), -0.5)
    elif kind == "tiny":             # denormals and zeros beside normal values
        x = x * torch.where(torch.rand(n, generator=g) < 0.5, 1e-40, 1.0)
    elif kind == "layers":           # blocks a thousand times apart, as a model's gradient has
        x = x * torch.repeat_interleave(torch.logspace(-3, 0, 8), -(-n // 8))[:n]
    return x


def _same_topk(x: torch.Tensor, k: int, dtype: torch.dtype = torch.int32) -> None:
    got_v, got_i = subset.topk_select(x, k, dtype)
    ref_v, ref_i = reference.topk_select(x, k, dtype)
    assert got_i.dtype == dtype and got_v.dtype == torch.float32
    assert torch.equal(got_i, ref_i)
    assert torch.equal(got_v.view(torch.int32), ref_v.view(torch.int32))   # bit for bit (−0.0, NaN)


@pytest.mark.parametrize("kind", ["randn", "sparse", "grid", "few", "constant", "tiny", "layers"])
@pytest.mark.parametrize("n,k", [(2, 1), (65, 64), (1000, 1), (1000, 999), (70_001, 700), (70_001, 35_000),
                                 (300_001, 3_000)])
def test_topk_same_as_reference(monkeypatch, kind, n, k):
    """Several parts (the part size lowered to 4,096 values), ragged 64-value blocks, ties within
    and across parts, and both plans (the window on smooth data, the histogram on flat data)."""
    monkeypatch.setattr(subset, "TOPK_MIN_PART", 4096)
    _same_topk(_vector(kind, n, seed=n + k), k)


def test_topk_on_one_part_with_int64_indices():
    x = _vector("randn", 3_000_017, seed=1)
    _same_topk(x, 30_000, torch.int64)
    _same_topk(x, 1, torch.int64)


def test_topk_with_non_finite_values():
    """NaN ranks above +Inf, as in the reference's keys (the kernels' callers screen for them)."""
    x = _vector("randn", 50_000, seed=2)
    x[[7, 900, 40_000]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for k in (1, 2, 3, 4, 500):
        _same_topk(x, k)


@pytest.mark.parametrize("plan", ["window", "histogram"])
def test_topk_plans_each_decide(monkeypatch, plan):
    """Each plan alone gives the reference's selection: the other one raises if it is asked."""
    def refuse(*args):
        raise AssertionError("the other plan ran")

    if plan == "window":
        monkeypatch.setattr(subset, "_topk_by_histogram", refuse)
        kinds = ["randn", "sparse", "grid", "tiny", "layers"]
    else:
        monkeypatch.setattr(subset, "_topk_by_window", lambda *args: None)
        kinds = ["randn", "sparse", "grid", "few", "constant", "tiny", "layers"]
    monkeypatch.setattr(subset, "TOPK_MIN_PART", 1 << 15)
    for i, kind in enumerate(kinds):
        _same_topk(_vector(kind, 400_003, seed=i), 4_000)


@pytest.mark.parametrize("case", ["misled", "room", "flat"])
def test_topk_window_that_cannot_decide_falls_back(monkeypatch, case):
    """The strided sample misled (the large values sit between its points, so the k-th largest lies
    above the window), a part's share of the window past its room, or flat data (a window of most
    values): the histogram plan runs and gives the same selection."""
    ran = _count_calls(monkeypatch, "_topk_by_histogram")
    n, k = 1 << 20, 2_000
    stride = n // subset.TOPK_SAMPLE
    x = _vector("randn", n, seed=5) * 1e-3
    if case == "misled":
        x[1::stride] = 1.0 + torch.arange(x[1::stride].numel(), dtype=torch.float32)   # none in the sample
    elif case == "room":
        monkeypatch.setattr(subset, "_window_room", lambda seen, stride: seen * 0 + 10)
    else:
        x = _vector("few", n, seed=5)
    _same_topk(x, k)
    assert ran


def test_topk_dispatch():
    x = _vector("randn", 10_000, seed=3)
    ref = reference.topk_select(x, 100)
    got = kernels.topk_select(x, 100)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for k in (0, 10_000):
        v, i = kernels.topk_select(x, k, torch.int32)
        assert i.dtype == torch.int32 and torch.equal(i.long(), torch.arange(k)) and torch.equal(v, x[:k])
    for bad in (-1, 10_001):
        with pytest.raises(ValueError, match="cannot keep"):
            kernels.topk_select(x, bad)


def test_topk_refuses_counts_that_do_not_match_the_vector(monkeypatch):
    """A plan whose counts disagree with what the last pass finds (as where another thread wrote to
    the vector between the passes): an error, and no write past a part's share."""
    real = subset._topk_by_window

    def shifted(*args):
        t, ties, per_part = real(*args)
        per_part = per_part.copy()
        per_part[0] += 1
        per_part[1] -= 1
        return t, ties, per_part

    monkeypatch.setattr(subset, "_topk_by_window", shifted)
    monkeypatch.setattr(subset, "TOPK_MIN_PART", 1 << 15)
    with pytest.raises(RuntimeError, match="changed while"):
        subset.topk_select(_vector("randn", 400_003, seed=9), 4_000)
