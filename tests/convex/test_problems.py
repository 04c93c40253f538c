"""The convex test problems: gradients, constants, the optimum, sharding and input errors."""

from __future__ import annotations

import math

import pytest
import torch

from gradq.convex.problems import PROBLEMS, make_problem, shard

SYNTHETIC = ["lsq-synthetic", "logreg-synthetic"]


def _autograd_loss(p, x: torch.Tensor, idx=None) -> torch.Tensor:
    A, b = (p.A, p.b) if idx is None else (p.A[idx], p.b[idx])
    z = A @ x
    data = 0.5 * ((z - b) ** 2).mean() if p.kind == "lsq" else torch.nn.functional.softplus(-b * z).mean()
    return data + 0.5 * p.reg * x.dot(x)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_gradient_matches_autograd(name):
    p = make_problem(name, n_samples=96, dim=12)
    gen = torch.Generator().manual_seed(1)
    for idx in (None, torch.tensor([3]), torch.tensor([0, 5, 7, 95])):
        x = torch.randn(p.dim, generator=gen, dtype=torch.float64).requires_grad_()
        f = _autograd_loss(p, x, idx)
        f.backward()
        f = f.detach()
        # float64 throughout: agreement to ~1e-15 relative; 1e-10 leaves room for summation order
        assert torch.allclose(p.grad(x.detach(), idx), x.grad, rtol=1e-10, atol=1e-12)
        if idx is None:
            assert p.loss(x.detach()) == pytest.approx(f.item(), rel=1e-12, abs=1e-13)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_mean_of_sample_gradients_is_the_full_gradient(name):
    p = make_problem(name, n_samples=40, dim=8)
    x = torch.linspace(-1, 1, p.dim, dtype=torch.float64)
    per_sample = torch.stack([p.grad(x, torch.tensor([j])) for j in range(p.n_samples)])
    assert torch.allclose(per_sample.mean(0), p.grad(x), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_optimum_is_stationary_and_f_star_is_its_value(name):
    p = make_problem(name)
    # strong convexity: ||x - x*_true|| <= ||grad f(x)|| / mu and f(x) - f* <= ||grad||^2 / (2 mu)
    g = float(p.grad(p.x_star).norm())
    assert g <= 1e-12
    assert g ** 2 / (2 * p.mu) < 1e-20
    assert p.suboptimality(p.x_star) <= 1e-15
    direct = _autograd_loss(p, p.x_star).item()
    assert p.f_star == pytest.approx(direct, rel=1e-13)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_smoothness_and_strong_convexity_constants(name):
    p = make_problem(name, n_samples=128, dim=16)
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        x, y = (torch.randn(p.dim, generator=gen, dtype=torch.float64) * 3 for _ in range(2))
        dg, dx = p.grad(x) - p.grad(y), x - y
        assert float(dg.norm()) <= p.L * float(dx.norm()) * (1 + 1e-12)  # L-smooth
        assert float(dg.dot(dx)) >= p.mu * float(dx.dot(dx)) * (1 - 1e-12)  # mu-strongly convex
        # the quadratic sandwich around the optimum
        e2 = float((x - p.x_star).pow(2).sum())
        assert p.mu / 2 * e2 * (1 - 1e-9) <= p.suboptimality(x) <= p.L / 2 * e2 * (1 + 1e-9)
        j = torch.tensor([int(torch.randint(p.n_samples, (1,), generator=gen))])
        dgj = p.grad(x, j) - p.grad(y, j)
        assert float(dgj.norm()) <= p.L_max * float(dx.norm()) * (1 + 1e-12)  # each f_j is L_max-smooth
    assert p.L_max >= p.L >= p.mu > 0


def test_lsq_suboptimality_has_no_cancellation_floor():
    p = make_problem("lsq-synthetic")
    x = p.x_star + 1e-9 * torch.ones(p.dim, dtype=torch.float64)
    # 0.5 e^T H e with ||e||^2 = 32e-18: about 1e-17, far below what f(x) - f* in float64 could resolve
    expected = 0.5 * float((x - p.x_star) @ p._H @ (x - p.x_star))
    assert p.suboptimality(x) == pytest.approx(expected, rel=1e-12)
    assert 0 < p.suboptimality(x) < 1e-15


def test_same_seed_same_data_other_seed_other_data():
    a, b, c = (make_problem("logreg-synthetic", seed=s, n_samples=64, dim=8) for s in (3, 3, 4))
    assert torch.equal(a.A, b.A) and torch.equal(a.b, b.b)
    assert not torch.equal(a.A, c.A)
    assert set(a.b.tolist()) == {-1.0, 1.0}


def test_digits_problem_features():
    p = make_problem("logreg-digits", n_samples=300)
    assert p.n_samples == 300 and p.dim <= 62
    assert torch.all(p.A[:, -1] == 1.0)  # bias column
    feats = p.A[:, :-1]
    assert float(feats.abs().max()) <= 3.0  # standardized, clipped at 3
    assert float(feats.mean(0).abs().max()) < 0.1  # centred before clipping, so means stay near 0
    assert set(p.b.tolist()) == {-1.0, 1.0}
    assert float(p.grad(p.x_star).norm()) <= 1e-12
    q = make_problem("lsq-digits", n_samples=300)
    assert torch.equal(q.A, p.A) and torch.equal(q.b, p.b)  # same task, the +-1 label is the target


def test_problem_errors():
    with pytest.raises(ValueError, match="choose one of: " + ", ".join(PROBLEMS)):
        make_problem("lsq-mnist")
    with pytest.raises(ValueError, match="reg must be > 0"):
        make_problem("lsq-synthetic", reg=0.0)
    with pytest.raises(ValueError, match="fixed dimension"):
        make_problem("lsq-digits", dim=10)
    with pytest.raises(ValueError, match="n_samples must be in 1..1797"):
        make_problem("logreg-digits", n_samples=5000)
    with pytest.raises(ValueError, match="n_samples and dim must be >= 1"):
        make_problem("lsq-synthetic", dim=0)
    p = make_problem("lsq-synthetic", n_samples=16, dim=4)
    with pytest.raises(ValueError, match="has dim 4"):
        p.loss(torch.zeros(5))
    with pytest.raises(ValueError, match="idx is empty"):
        p.grad(torch.zeros(4), torch.tensor([], dtype=torch.long))


@pytest.mark.parametrize("n,k", [(10, 3), (12, 4), (7, 7), (5, 1)])
def test_shards_are_disjoint_and_cover(n, k):
    parts = [shard(n, k, r) for r in range(k)]
    flat = torch.cat(parts).sort().values
    assert torch.equal(flat, torch.arange(n))
    sizes = [len(s) for s in parts]
    assert max(sizes) - min(sizes) <= 1


def test_shard_errors():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        shard(10, 0, 0)
    with pytest.raises(ValueError, match="rank must be in 0..2"):
        shard(10, 3, 3)
    with pytest.raises(ValueError, match="at most 4 workers"):
        shard(4, 5, 0)


def test_condition_number_and_repr():
    p = make_problem("lsq-synthetic")
    assert p.condition_number == pytest.approx(p.L / p.mu)
    assert "lsq-synthetic" in repr(p) and math.isfinite(p.f_star)
