"""QSGD (papers 000/004): levels, codes, wire size and the Lemma 3.1 guarantees."""

from __future__ import annotations

import math

import pytest
import torch

import gradq
from gradq.codecs.bitpack import unpack_bits
from gradq.quantizers.qsgd import QSGD
from gradq_testing import mc_mean


def _vectors(d: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(d)
    onehot = torch.zeros(d)
    onehot[d // 3] = 2.5
    return {
        "gaussian": torch.randn(d, generator=g),
        "constant": torch.full((d,), 0.3),  # the vector that makes the sqrt(d)/s bound nearly tight
        "onehot": onehot,
        "heavy": torch.randn(d, generator=g) / torch.rand(d, generator=g).clamp_min(1e-3),  # Cauchy-like
    }


@pytest.mark.parametrize("bits,s,width", [(2, 1, 2), (3, 3, 3), (4, 7, 4), (8, 127, 8)])
def test_bits_convention(bits, s, width):
    q = QSGD(bits=bits)
    assert q.s == s and q.width == width
    assert gradq.build(f"qsgd:levels={s}") == q


@pytest.mark.parametrize("levels,width", [(1, 2), (2, 3), (5, 4), (8, 5), (100, 8)])
def test_levels_field_width(levels, width):
    assert QSGD(levels=levels).width == width


def test_issue_size_example():
    """qsgd:bits=4,bucket=512 on 2^20 values: 2^20/2 + 4·2048 bytes plus a small fixed header."""
    q = gradq.build("qsgd:bits=4,bucket=512")
    p = q.encode(torch.randn(2 ** 20), seed=0)
    assert 0 < p.nbytes - (2 ** 19 + 4 * 2048) <= 32
    assert p.nbytes - (2 ** 19 + 4 * 2048) == p.header_nbytes == 26


@pytest.mark.parametrize("spec", ["qsgd:bits=2,bucket=128", "qsgd:bits=4", "qsgd:levels=5,norm=l2,bucket=100"])
def test_codes_and_scales(spec):
    q = gradq.build(spec)
    x = torch.randn(1000) * 3
    p = q.encode(x, seed=2)
    codes = unpack_bits(p["codes"], q.width, x.numel()) - q.s
    assert int(codes.abs().max()) <= q.s
    d = q.bucket
    for b in range(0, 1000, d):
        chunk = x[b:b + d]
        norm = chunk.abs().max() if q.norm == "max" else chunk.norm()
        assert torch.isclose(p["scales"][b // d], norm)
        # each magnitude is floor or ceil of |v|·s/norm, with the sign of v
        a = chunk.abs() * q.s / norm
        c = codes[b:b + d]
        assert torch.all((c.abs() == torch.floor(a)) | (c.abs() == torch.ceil(a)))
        assert torch.all((c == 0) | (torch.sign(c) == torch.sign(chunk)))


def test_decode_formula():
    q = QSGD(bits=3, bucket=4, norm="max")
    x = torch.tensor([0.5, -1.0, 0.25, 0.0, 2.0, 0.0, -2.0, 1.0])
    p = q.encode(x, seed=0)
    codes = (unpack_bits(p["codes"], 3, 8) - 3).float()
    expect = torch.cat([codes[:4] * 1.0 / 3, codes[4:] * 2.0 / 3])
    assert torch.allclose(q.decode(p), expect)
    # max-abs coordinates (|v| = norm) are always exact
    y = q.decode(p)
    assert y[1] == -1.0 and y[4] == 2.0 and y[6] == -2.0


def _exact_variance(x: torch.Tensor, s: int, norm: float) -> float:
    """Σ_i (norm/s)² · p_i(1 − p_i), p_i the fractional part of |x_i|·s/norm: the exact expected
    squared error of stochastic rounding onto the grid norm/s · {0..s}."""
    a = x.double().abs() * s / norm
    p = a - torch.floor(a)
    return float(((norm / s) ** 2 * p * (1 - p)).sum())


@pytest.mark.parametrize("s", [1, 2, 7, 31])
@pytest.mark.parametrize("kind", ["gaussian", "constant", "onehot", "heavy"])
def test_variance_bound_lemma_3_1(s, kind):
    """E‖Q(v) − v‖² ≤ min(d/s², √d/s)·‖v‖² for the L2 norm (one bucket of d = 256).

    The Monte Carlo mean over 400 seeds must (a) match the exact variance of stochastic rounding to
    within 5 standard errors, which checks the rounding probabilities, and (b) stay below the bound
    (allowing the same 5 standard errors of sampling noise)."""
    d = 256
    x = _vectors(d)[kind]
    q = QSGD(levels=s, bucket=None, norm="l2")
    nrm = float(x.norm())
    mean, se = mc_mean(lambda seed: float(((q.roundtrip(x, seed=seed) - x) ** 2).sum()), 400)
    exact = _exact_variance(x, s, nrm)
    assert abs(mean - exact) <= 5 * se + 1e-9 * nrm ** 2
    bound = min(d / s ** 2, math.sqrt(d) / s) * nrm ** 2
    assert exact <= bound * (1 + 1e-9)
    assert mean - 5 * se <= bound


def test_bound_is_nearly_tight_on_constant_vector():
    """On the constant vector the √d/s term is tight up to the factor (1 − s/√d)."""
    d, s = 1024, 2
    x = torch.full((d,), 1.0)
    exact = _exact_variance(x, s, float(x.norm()))
    bound = math.sqrt(d) / s * float(x.norm()) ** 2
    assert exact == pytest.approx(bound * (1 - s / math.sqrt(d)), rel=1e-6)


@pytest.mark.parametrize("s", [1, 4])
def test_expected_nonzeros_lemma_3_1(s):
    """E[nnz(Q(v))] ≤ s(s + √d) for the L2 norm; Monte Carlo over 200 seeds, 5 standard errors."""
    d = 4096
    x = torch.randn(d, generator=torch.Generator().manual_seed(1))
    q = QSGD(levels=s, bucket=None, norm="l2")
    mean, se = mc_mean(lambda seed: float((q.roundtrip(x, seed=seed) != 0).sum()), 200)
    assert mean - 5 * se <= s * (s + math.sqrt(d))


def test_bucketing_reduces_error():
    """Smaller buckets give each bucket its own scale: the max-norm error falls with the bucket size
    (expected squared errors computed exactly, no sampling)."""
    x = torch.randn(8192, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.1, 10, 8192)
    errs = []
    for bucket in (64, 512, 8192):
        mat = x.view(-1, bucket)
        errs.append(sum(_exact_variance(row, 7, float(row.abs().max())) for row in mat))
    assert errs[0] < errs[1] < errs[2]


def test_bytes_independent_of_thread_count():
    """Same seed, different thread counts: identical bytes (the randomness is counter based)."""
    x = torch.randn(50_000)
    q = gradq.build("qsgd:bits=4")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = q.encode(x, seed=9)
        torch.set_num_threads(2)
        b = q.encode(x, seed=9)
    finally:
        torch.set_num_threads(old)
    assert a.same_bytes(b)


@pytest.mark.parametrize("norm", ["max", "l2"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_found_in_any_bucket_by_the_scales(norm, bad):
    """The fixed-width CPU path skips the up-front NaN/Inf screen and reads it off the bucket norms
    instead: a bad value in any bucket, first or last, is still refused by name."""
    q = gradq.build(f"qsgd:bits=4,bucket=64,norm={norm}")
    for pos in (0, 5000, 9999):
        x = torch.randn(10_000)
        x[pos] = bad
        with pytest.raises(gradq.NonFiniteError, match="'fc.weight' holds"):
            q.encode(x, seed=0, name="fc.weight")


def test_overflowing_l2_norm_of_finite_values_is_not_an_error():
    """Finite values whose L2 norm exceeds the largest float32 are not a NaN/Inf input: the scale
    saturates at the largest float32 (it used to round to inf and decode every value to NaN), and
    the encode goes ahead exactly as with the kernels off. (Squares that overflow float32 alone do
    not matter: the norm is summed in float64.)"""
    from gradq.kernels.reference import FLOAT32_MAX

    q = gradq.build("qsgd:bits=4,bucket=64,norm=l2")
    assert bool(torch.isfinite(q.encode(torch.full((256,), 3e30), seed=1)["scales"]).all())
    x = torch.full((256,), 3e38)
    got = q.encode(x, seed=1)
    assert bool((got["scales"] == FLOAT32_MAX).all())
    assert bool(torch.isfinite(q.decode(got)).all())
    gradq.kernels.set_enabled(False)
    try:
        want = q.encode(x, seed=1)
    finally:
        gradq.kernels.set_enabled(True)
    assert got.same_bytes(want)
