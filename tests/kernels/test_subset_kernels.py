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


@pytest.mark.parametrize("patch", ["too_few", "no_room"])
def test_candidates_that_cannot_decide_fall_back_to_the_histogram(monkeypatch, patch):
    """Too few candidates (a threshold below the k-th draw) or a part's share past its room: the
    histogram path gives the same subset."""
    ran = []
    real = subset._subset_by_histogram

    def histogram(*args):
        ran.append(1)
        return real(*args)

    monkeypatch.setattr(subset, "_subset_by_histogram", histogram)
    n, k, seed = 300_001, 3_000, 13
    if patch == "too_few":
        monkeypatch.setattr(subset, "_candidate_limit", lambda n_, k_: (k_ // 2) * (1 << 32) // n_)
    else:
        monkeypatch.setattr(subset, "_candidate_room", lambda per: 10)
    assert torch.equal(subset.random_subset(n, k, seed), reference.random_subset(n, k, seed))
    assert ran
