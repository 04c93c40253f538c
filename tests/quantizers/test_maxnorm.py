"""QSGDMaxNorm (paper 002 §3.1): shared scale, summable codes, Lemma 1's variance bound."""

from __future__ import annotations

import math

import pytest
import torch

import gradq
from gradq.quantizers.maxnorm import MaxNorm
from gradq_testing import mc_mean


def _adversarial(d: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    onehot = torch.zeros(d)
    onehot[3] = -4.0
    return {
        "onehot": onehot,
        "constant": torch.full((d,), -0.7),
        "heavy": torch.randn(d, generator=g) / torch.rand(d, generator=g).clamp_min(1e-3),
        "gaussian": torch.randn(d, generator=g),
    }


@pytest.mark.parametrize("s", [1, 3, 7])
@pytest.mark.parametrize("kind", ["onehot", "constant", "heavy", "gaussian"])
@pytest.mark.parametrize("inflate", [1.0, 3.0])
def test_variance_bound_with_shared_scale(s, kind, inflate):
    """E‖Q(v) − v‖² ≤ min(n/s², √n/s)·w² for any shared w ≥ ‖v‖₂ (L2 norm; Lemma 1 states the looser
    (1 + …)·w²). ``inflate`` plays another worker with a larger norm. Monte Carlo over 300 seeds,
    allowing 5 standard errors."""
    n = 256
    x = _adversarial(n)[kind]
    q = MaxNorm(levels=s, norm="l2")
    w = torch.tensor([float(x.norm()) * inflate])
    mean, se = mc_mean(lambda seed: float(((q.roundtrip(x, seed=seed, shared={"scale": w}) - x) ** 2).sum()), 300)
    bound = min(n / s ** 2, math.sqrt(n) / s) * float(w) ** 2
    assert mean - 5 * se <= bound


@pytest.mark.parametrize("kind", ["onehot", "constant", "heavy"])
def test_variance_bound_max_norm(kind):
    """With the max-abs scale each coordinate's rounding variance is at most (w/s)²/4 and at most
    (w/s)·|v_i|, so E‖Q(v) − v‖² ≤ min(n/(4s²)·w², ‖v‖₁·w/s). 300 seeds, 5 standard errors."""
    n, s = 256, 3
    x = _adversarial(n)[kind]
    q = MaxNorm(levels=s, norm="max")
    w = float(x.abs().max())
    mean, se = mc_mean(lambda seed: float(((q.roundtrip(x, seed=seed) - x) ** 2).sum()), 300)
    bound = min(n / (4 * s * s) * w * w, float(x.abs().sum()) * w / s)
    assert mean - 5 * se <= bound


def test_single_process_equals_qsgd_with_one_bucket():
    """Alone, MaxNorm is QSGD with the tensor's own norm: identical decodes for the same seed."""
    x = torch.randn(3000)
    a = gradq.build("maxnorm:bits=4,norm=l2").roundtrip(x, seed=5)
    b = gradq.build("qsgd:bits=4,bucket=none,norm=l2").roundtrip(x, seed=5)
    assert torch.equal(a, b)


def test_shared_scale_below_own_norm_is_refused():
    x = torch.randn(100)
    q = MaxNorm(bits=4)
    with pytest.raises(ValueError, match="MAX over workers"):
        q.encode(x, seed=0, shared={"scale": torch.tensor([float(x.abs().max()) / 2])})


def test_shared_stats_shape_and_op():
    q = gradq.build("maxnorm:bits=2,bucket=100")
    st = q.shared_stats(torch.randn(250))
    assert set(st) == {"scale"} and st["scale"].op == "max" and st["scale"].value.shape == (3,)
    with pytest.raises(ValueError, match="shape"):
        q.encode(torch.randn(250), shared={"scale": torch.ones(2)})
    with pytest.raises(ValueError, match="exactly"):
        q.encode(torch.randn(250), shared={"norm": torch.ones(3)})


def test_codes_of_many_workers_fit_the_declared_range():
    """Worker codes lie in [-s, s], so M workers sum within ±M·s (what the all-reduce dtype relies on)."""
    q = MaxNorm(bits=8)
    xs = [torch.randn(500) * (m + 1) for m in range(8)]
    w = torch.stack([q.shared_stats(x)["scale"].value for x in xs]).amax(0)
    total = sum(q.encode_codes(x, shared={"scale": w}, seed=m) for m, x in enumerate(xs))
    assert int(total.abs().max()) <= 8 * q.max_code
    assert q.max_code == 127
