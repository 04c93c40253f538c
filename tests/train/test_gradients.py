"""The gradient study behind `gradq demo`: its error and bias estimators."""

from __future__ import annotations

import math

import torch

from gradq.train.gradients import compare_quantizers, format_table


def _grads():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(40, 30, generator=g)), ("a.bias", torch.randn(30, generator=g))]


def test_deterministic_scheme_bias_equals_error():
    """A deterministic quantizer has no noise: bias² == error exactly and the noise level is 0."""
    (row,) = compare_quantizers(["signsgd"], _grads(), trials=4)
    assert row["bias_noise"] == 0
    assert math.isclose(row["rel_bias"] ** 2, row["rel_error"], rel_tol=1e-9)


def test_unbiased_scheme_bias_is_within_noise():
    (row,) = compare_quantizers(["qsgd:bits=2,bucket=64"], _grads(), trials=12)
    assert row["rel_error"] > 0.1
    assert row["rel_bias"] <= row["bias_noise"] < math.sqrt(row["rel_error"])


def test_bits_and_ratio_are_consistent():
    grads = _grads()
    (row,) = compare_quantizers(["qsgd:bits=4,bucket=none"], grads, trials=2)
    n = sum(v.numel() for _, v in grads)
    payload_bytes = sum((v.numel() * 4 + 7) // 8 + 4 + 26 for _, v in grads)  # codes + scale + header
    assert math.isclose(row["bits_per_coord"], 8 * payload_bytes / n)
    assert math.isclose(row["compression"], 32 / row["bits_per_coord"])
    assert "qsgd:bits=4,bucket=none,norm=max" in format_table([row])
