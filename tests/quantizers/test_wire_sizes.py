"""Wire sizes against hand-written formulas, one per scheme (independent of each quantizer's own
``field_layout``). ``H(F) = 16 + 5·F`` is the payload header for ``F`` fields."""

from __future__ import annotations

import math

import pytest
import torch

import gradq


def H(fields: int) -> int:
    return 16 + 5 * fields


def ceil(a: float) -> int:
    return math.ceil(a)


def K(n: int, ratio: float = 0.01) -> int:
    return min(max(1, round(ratio * n)), n)


FORMULAS = {
    "none": lambda n: 4 * n + H(1),
    "fp16": lambda n: 2 * n + H(1),
    "bf16": lambda n: 2 * n + H(1),
    "qsgd": lambda n: ceil(n * 4 / 8) + 4 * ceil(n / 512) + H(2),
    "qsgd:bits=2,bucket=128": lambda n: ceil(n * 2 / 8) + 4 * ceil(n / 128) + H(2),
    "qsgd:bits=8,bucket=none": lambda n: n + 4 + H(2),
    "qsgd:levels=5": lambda n: ceil(n * 4 / 8) + 4 * ceil(n / 512) + H(2),  # 11 values → 4 bits
    "terngrad": lambda n: ceil(n / 5) + 4 + H(2),
    "terngrad:pack=2bit,bucket=100": lambda n: ceil(n / 4) + 4 * ceil(n / 100) + H(2),
    "maxnorm": lambda n: ceil(n * 4 / 8) + 4 + H(2),
    "multiscale": lambda n: ceil(n * 2 / 8) + ceil(n / 8) + 4 + H(3),  # 2-bit codes + 1 index bit
    "multiscale:bits=2+4+6": lambda n: ceil(n * 2 / 8) + ceil(n * 2 / 8) + 4 + H(3),
    "randk-maxnorm": lambda n: 8 + ceil(K(n) * 4 / 8) + 4 + H(3),
    "randk-multiscale": lambda n: 8 + ceil(K(n) * 2 / 8) + ceil(K(n) / 8) + 4 + H(4),
    "orq": lambda n: ceil(n * 3 / 8) + 4 * 5 * ceil(n / 512) + H(2),
    "orq:levels=17": lambda n: ceil(n * 5 / 8) + 4 * 17 * ceil(n / 512) + H(2),
    "linear:levels=3": lambda n: ceil(n * 2 / 8) + 4 * 3 * ceil(n / 512) + H(2),
    "bingrad-pb": lambda n: ceil(n / 8) + 4 * ceil(n / 512) + H(2),
    "bingrad-b": lambda n: ceil(n / 8) + 8 * ceil(n / 512) + H(2),
    "signsgd": lambda n: ceil(n / 8) + 4 * ceil(n / 512) + H(2),
    "onebit": lambda n: ceil(n / 8) + 8 * ceil(n / 512) + H(2),
    "topk": lambda n: 8 * K(n) + H(2),
    "randk": lambda n: 4 * K(n) + 8 + H(2),
}


def test_every_scheme_has_a_formula():
    names = {s.split(":")[0] for s in FORMULAS}
    assert set(gradq.available()) <= names


@pytest.mark.parametrize("spec", sorted(FORMULAS))
@pytest.mark.parametrize("n", [1, 9, 513, 10_000, 65_537])
def test_nbytes_matches_the_formula(spec, n):
    p = gradq.build(spec).encode(torch.randn(n), seed=0)
    assert p.nbytes == FORMULAS[spec](n)
    assert p.nbytes == len(p.to_bytes())
