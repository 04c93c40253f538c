"""Counter-based randomness (gradq.random): agreement with the pure-Python oracle, uniformity,
reproducibility, seed resolution and independence from the thread count."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradq.random import RandomStream, hash32_reference, resolve_seed

SEEDS = [0, 1, 12345, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]
M32 = 0xFFFFFFFF


def _u32(t: torch.Tensor) -> list[int]:
    return [v & M32 for v in t.tolist()]


# -- the oracle ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_bits32_matches_reference_first_indices(seed):
    got = RandomStream(seed).bits32(1000)
    assert got.dtype == torch.int32 and got.shape == (1000,)
    assert _u32(got) == [hash32_reference(seed, i) for i in range(1000)]


@pytest.mark.parametrize("start", [2**31 - 5, 2**32 - 3, 2**33 - 1, 2**40 + 7, 2**62 + 11])
@pytest.mark.parametrize("seed", [7, 2**64 - 1])
def test_bits32_matches_reference_at_large_offsets(seed, start):
    s = RandomStream(seed)
    s.offset = start
    got = s.bits32(10)
    assert s.offset == start + 10
    assert _u32(got) == [hash32_reference(seed, start + i) for i in range(10)]


def test_high_counter_bits_matter():
    # indices i and i + 2**32 share their low 32 bits; the high word must still change the value
    a = RandomStream(5)
    b = RandomStream(5)
    b.offset = 2**32
    assert _u32(a.bits32(64)) != _u32(b.bits32(64))


@settings(max_examples=200)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**62), st.integers(1, 20))
def test_bits32_property(seed, start, n):
    s = RandomStream(seed)
    s.offset = start
    assert _u32(s.bits32(n)) == [hash32_reference(seed, start + i) for i in range(n)]


# -- uniform ---------------------------------------------------------------------------------------
def test_uniform_range_and_resolution():
    s = RandomStream(3)
    u = s.uniform(200_000)
    assert u.dtype == torch.float32
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    scaled = u.double() * 2**24
    assert torch.equal(scaled, scaled.round())            # 24 random bits, exactly representable
    # uniform() is the top 24 bits of the same counters as bits32()
    t = RandomStream(3).bits32(200_000)
    assert torch.equal(scaled.long(), (t.long() & M32) >> 8)


def test_uniform_moments_and_histogram():
    N = 200_000
    u = RandomStream(11).uniform(N).double()
    # mean: sd of the sample mean is sqrt(1/12/N) ≈ 6.5e-4; we allow 5 sd
    assert abs(float(u.mean()) - 0.5) <= 5 * math.sqrt(1 / 12 / N)
    # variance: sd of the sample variance ≈ sqrt((μ4 − σ⁴)/N) with μ4 = 1/80, σ⁴ = 1/144, i.e.
    # sqrt(1/(180·N)) ≈ 1.7e-4; we allow 5 sd
    assert abs(float(u.var()) - 1 / 12) <= 5 * math.sqrt(1 / 180 / N)
    # 64-bin histogram: Pearson X² ~ chi-square(63), mean 63, sd sqrt(126) ≈ 11.2; allow mean + 6 sd
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    e = N / 64
    x2 = float(((counts - e) ** 2 / e).sum())
    assert x2 <= 63 + 6 * math.sqrt(126), x2
    # lag-1 correlation of successive draws: sd ≈ 1/sqrt(N) ≈ 2.2e-3; allow 5 sd
    c = float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])
    assert abs(c) <= 5 / math.sqrt(N), c


def test_bits32_bit_balance():
    # each of the 32 bits is set with probability 1/2: count ~ Binomial(N, 1/2), sd = sqrt(N)/2 ≈ 224
    # for N = 200000; Bonferroni over 32 bits: allow 5 sd (p ≤ 32 · 5.7e-7)
    N = 200_000
    b = RandomStream(99).bits32(N).long() & M32
    ones = torch.stack([((b >> k) & 1).sum() for k in range(32)]).double()
    assert float((ones - N / 2).abs().max()) <= 5 * math.sqrt(N) / 2


# -- reproducibility -------------------------------------------------------------------------------
def test_successive_draws_differ_and_continue_the_counter():
    s = RandomStream(42)
    a, b = s.bits32(100), s.bits32(100)
    assert not torch.equal(a, b)
    assert _u32(b) == [hash32_reference(42, 100 + i) for i in range(100)]
    assert s.offset == 200
    u1, u2 = s.uniform(50), s.uniform(50)
    assert not torch.equal(u1, u2)


def test_same_seed_same_values_other_seed_other_values():
    assert torch.equal(RandomStream(8).uniform(1000), RandomStream(8).uniform(1000))
    assert not torch.equal(RandomStream(8).uniform(1000), RandomStream(9).uniform(1000))
    # seeds that differ only in the high 32 bits, or by 2**64, still give different / equal streams
    assert not torch.equal(RandomStream(8).bits32(100), RandomStream(8 + 2**32).bits32(100))
    assert torch.equal(RandomStream(8).bits32(100), RandomStream(8 + 2**64).bits32(100))


def test_children_are_deterministic_and_distinct():
    s = RandomStream(5)
    c0, c1 = s.child(0), s.child(1)
    assert torch.equal(c0.bits32(64), RandomStream(5).child(0).bits32(64))
    vals = [s.bits32(64), c0.bits32(64), c1.bits32(64), RandomStream(6).child(0).bits32(64)]
    for i in range(len(vals)):
        for j in range(i):
            assert not torch.equal(vals[i], vals[j]), (i, j)
    # a child does not depend on how far the parent has advanced
    t = RandomStream(5)
    t.bits32(1000)
    assert t.child(0).seed == c0.seed


# -- resolve_seed ----------------------------------------------------------------------------------
def test_resolve_seed_explicit():
    assert resolve_seed(5) == 5
    assert resolve_seed(0) == 0
    assert resolve_seed(-1) == 2**63 - 1           # masked to 63 bits
    assert resolve_seed(2**64 + 3) == 3


def test_resolve_seed_generator():
    g1, g2 = torch.Generator().manual_seed(17), torch.Generator().manual_seed(17)
    a, b = resolve_seed(generator=g1), resolve_seed(generator=g2)
    assert a == b and 0 <= a < 2**62
    assert resolve_seed(generator=g1) != a          # the generator advances


def test_resolve_seed_global_rng_follows_manual_seed():
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(123)
        a1, a2 = resolve_seed(), resolve_seed()
        torch.manual_seed(123)
        assert (resolve_seed(), resolve_seed()) == (a1, a2)
        assert a1 != a2 and 0 <= a1 < 2**62
        torch.manual_seed(124)
        assert resolve_seed() != a1
    finally:
        torch.random.set_rng_state(state)


def test_resolve_seed_errors():
    with pytest.raises(ValueError, match="not both"):
        resolve_seed(1, torch.Generator().manual_seed(0))
    for bad in (True, False, 1.0, "1", torch.tensor(1)):
        with pytest.raises(TypeError, match="seed must be an int"):
            resolve_seed(bad)


# -- thread-count independence ---------------------------------------------------------------------
def test_thread_count_does_not_change_values():
    n = 1 << 20  # well above torch's intra-op grain size, so 2 threads really split the work
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (RandomStream(77).bits32(n), RandomStream(77).uniform(n))
        s = RandomStream(77)
        s.offset = 2**32 - n // 2                    # the 64-bit counter path too
        one_hi = s.bits32(n)
        torch.set_num_threads(2)
        two = (RandomStream(77).bits32(n), RandomStream(77).uniform(n))
        s = RandomStream(77)
        s.offset = 2**32 - n // 2
        two_hi = s.bits32(n)
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1]) and torch.equal(one_hi, two_hi)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    for start in (0, 2**31 - 100, 2**32 + 5):
        a, b = RandomStream(31), RandomStream(31)
        a.offset = b.offset = start
        assert torch.equal(a.bits32(100_000).cpu(), b.bits32(100_000, "cuda").cpu())
    assert torch.equal(RandomStream(3).uniform(1000), RandomStream(3).uniform(1000, "cuda").cpu())
