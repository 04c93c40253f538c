"""Quantized gradient descent with appendix F's top-component sign quantizer (Lemma F.1, Theorem F.2)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gradq.convex.gd import (TOPSIGN, GDConfig, gd_table, run_gd, step_contraction_bound, top_sign_bits,
                             top_sign_quantize)
from gradq.convex.problems import make_problem


def _vectors():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 9, 32, 64, 100):
        yield torch.randn(n, generator=gen, dtype=torch.float64)
        yield torch.ones(n, dtype=torch.float64)  # flat: needs ceil(sqrt(n)) components
        yield torch.distributions.StudentT(1.2).sample((n,)).to(torch.float64)  # heavy tails
        e = torch.zeros(n, dtype=torch.float64)
        e[n // 2] = -2.5
        yield e  # one-hot: one component suffices
        yield torch.rand(n, generator=gen, dtype=torch.float64) ** 6 - 0.1


def test_lemma_f1_properties():
    for v in _vectors():
        q, k = top_sign_quantize(v)
        n, norm = v.numel(), float(v.norm())
        kept = q != 0
        assert int(kept.sum()) == k
        assert k <= math.ceil(math.sqrt(n))  # |I(v)| <= sqrt(n), rounded up
        assert float(v.dot(q)) >= norm ** 2 * (1 - 1e-12)  # <v, Q(v)> >= ||v||^2
        assert float(q.pow(2).sum()) == pytest.approx(k * norm ** 2, rel=1e-12)  # ||Q||^2 = |I| ||v||^2
        assert torch.all(torch.sign(q[kept]) == torch.sign(v[kept]))
        assert torch.allclose(q[kept].abs(), torch.full((k,), norm, dtype=torch.float64))
        # I(v) holds the largest magnitudes and is minimal: k - 1 of them do not reach ||v||
        mags = v.abs().sort(descending=True).values
        assert float(v[kept].abs().min()) >= float(mags[k - 1])
        assert float(mags[: k - 1].sum()) < norm


def test_flat_vector_needs_ceil_sqrt_n_and_zero_vector():
    assert top_sign_quantize(torch.ones(32))[1] == 6  # sqrt(32) = 5.66
    assert top_sign_quantize(torch.ones(36))[1] == 6
    q, k = top_sign_quantize(torch.zeros(7))
    assert k == 0 and torch.equal(q, torch.zeros(7))


def test_bits_and_bound_formulas():
    assert top_sign_bits(5, 32) == 32 + 5 * (5 + 1)
    assert top_sign_bits(1, 1) == 32 + 2
    # eta = 1/(L sqrt(n)), k = sqrt(n): 1 - mu/(L sqrt(n))
    assert step_contraction_bound(0.1, 1.0, 16, 4) == pytest.approx(1 - 0.1 / 4)


@pytest.mark.parametrize("name", ["lsq-synthetic", "logreg-synthetic"])
def test_quantized_gd_converges_with_few_bits(name, tmp_path):
    p = make_problem(name)
    n = p.dim
    rows = {r["label"]: r for r in run_gd(GDConfig(problem=name, eps=1e-10), tmp_path, problem=p)}
    qgd, gd = rows["QGD top-sign"], rows["GD fp32"]
    start = p.suboptimality(torch.zeros(n, dtype=torch.float64))
    assert qgd["reached"] and gd["reached"]
    assert start / qgd["final_suboptimality"] > 1e8  # eight or more orders of magnitude
    # every step contracts at least as fast as the smoothness/strong-convexity bound for its |I_t|
    # (deterministic; 1e-9 absorbs float64 rounding of the suboptimality)
    assert qgd["worst_step_ratio"] <= qgd["rate_bound"] + 1e-9
    assert gd["worst_step_ratio"] <= gd["rate_bound"] + 1e-9
    # bits per step: at most 32 + ceil(sqrt n)(ceil(log2 n) + 1) = 68 for n = 32, against 32 n = 1024
    assert qgd["bits_per_iteration"] <= top_sign_bits(math.ceil(math.sqrt(n)), n) < 0.1 * 32 * n
    assert qgd["max_k"] <= math.ceil(math.sqrt(n))
    # no more iterations than the guaranteed rate allows, more than plain GD needs, fewer bits in total
    allowed = math.log(start / 1e-10) / -math.log(qgd["rate_bound"]) + 1
    assert gd["iterations_to_eps"] < qgd["iterations_to_eps"] <= allowed
    assert qgd["bits_to_eps"] < gd["bits_to_eps"]
    log = [json.loads(x) for x in (tmp_path / "QGD_top-sign" / "log.jsonl").read_text().splitlines()]
    assert log[0]["iteration"] == 1 and log[-2]["iteration"] == qgd["iterations_to_eps"]
    assert log[-1]["kind"] == "summary" and all(r["compressor"] == TOPSIGN for r in log)
    table = {r["method"]: r for r in gd_table(tmp_path)}
    assert table["QGD top-sign"]["bits_to_eps"] == qgd["bits_to_eps"]


def test_config_errors():
    with pytest.raises(ValueError, match="eps must be > 0"):
        run_gd(GDConfig(eps=-1.0))
    with pytest.raises(ValueError, match="lr must be > 0"):
        run_gd(GDConfig(lr=0.0))
    with pytest.raises(FloatingPointError, match="lower --lr"):
        run_gd(GDConfig(lr=100.0, max_iters=500), problem=make_problem("lsq-synthetic", n_samples=64, dim=8))
