"""The quantizers' default CPU path uses the fused kernels and gives the same bytes as the plain-torch
reference path (kernels disabled), for every fixed-width scheme."""

from __future__ import annotations

import pytest
import torch

import gradq
from gradq import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")

FIXED_WIDTH = [
    "qsgd", "qsgd:bits=2,bucket=128", "qsgd:bits=8,bucket=none", "qsgd:levels=5,bucket=7,norm=l2",
    "maxnorm", "maxnorm:bits=2,bucket=64", "maxnorm:bits=8,norm=l2",
    "terngrad", "terngrad:pack=2bit,bucket=100", "terngrad:clip=none,bucket=33",
    "multiscale", "multiscale:bits=2+4+8,bucket=64,norm=l2", "randk-multiscale:ratio=0.4", "randk-maxnorm:ratio=0.3",
    "orq", "orq:levels=3,bucket=100", "orq:levels=17,bucket=none", "linear:levels=9",
    "bingrad-b", "bingrad-b:iters=2,bucket=77", "signsgd", "onebit:ef=0", "bingrad-pb",
    "topk:ratio=0.05", "topk:k=300",   # (not fixed-width: a selection kernel, the same bytes all the same)
]


def _data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    x[::97] = 0.0
    x[5::101] = -0.0
    return x


@pytest.fixture
def reference():
    """Run a block with the kernels switched off, restoring the switch afterwards."""
    class _Ref:
        def __enter__(self):
            kernels.set_enabled(False)

        def __exit__(self, *exc):
            kernels.set_enabled(True)
    return _Ref()


@pytest.mark.parametrize("spec", FIXED_WIDTH)
@pytest.mark.parametrize("n", [1, 9, 1000, 70_001])
def test_fast_path_gives_reference_bytes(spec, n, reference):
    x = _data(n, n)
    fast = gradq.build(spec).encode(x, seed=n)
    with reference:
        ref = gradq.build(spec).encode(x, seed=n)
        ref_dec = gradq.build(spec).decode(ref)
    assert fast.same_bytes(ref)
    assert torch.equal(gradq.build(spec).decode(fast), ref_dec)


def test_fast_path_with_shared_scale_and_terngrad_large_mean(reference):
    """Shared (MAX) scales from other workers, and a TernGrad layer whose |mean|/σ is huge."""
    x = _data(5000, 3)
    q = gradq.build("maxnorm:bits=4,bucket=500")
    w = q.shared_stats(x)["scale"].value * 3
    fast = q.encode(x, seed=1, shared={"scale": w})
    t = 1e4 + torch.randn(4000, generator=torch.Generator().manual_seed(4))
    tg = gradq.build("terngrad").encode(t, seed=2)
    with reference:
        assert fast.same_bytes(q.encode(x, seed=1, shared={"scale": w}))
        assert tg.same_bytes(gradq.build("terngrad").encode(t, seed=2))


def test_denormal_scales_do_not_crash(reference):
    """A bucket whose max-abs is a denormal makes s/scale overflow; zeros must stay zeros."""
    x = torch.tensor([0.0, 1e-45, -1e-45, 0.0, 3e-45, 0.0, 0.0, 0.0])
    q = gradq.build("qsgd:bits=4,bucket=4")
    fast = q.encode(x, seed=0)
    with reference:
        ref = q.encode(x, seed=0)
    assert fast.same_bytes(ref)
    y = q.decode(fast)
    assert torch.all(y[x == 0] == 0)


def test_kernels_can_be_switched_off():
    kernels.set_enabled(False)
    try:
        assert not kernels.available()
        assert kernels.backend_for(torch.zeros(3)) == "torch"
    finally:
        kernels.set_enabled(True)
    assert kernels.available()


L2_SPECS = ["qsgd:bits=4,norm=l2", "qsgd:bits=4,norm=l2,bucket=none", "maxnorm:bits=4,norm=l2",
            "multiscale:bits=2+6,norm=l2", "qsgd:bits=4,norm=l2,coding=elias"]


@pytest.mark.parametrize("spec", L2_SPECS)
def test_l2_norm_of_finite_values_saturates_instead_of_overflowing(spec):
    """Finite values whose L2 norm exceeds the largest float32 (64 values of about 1e38): the norm
    saturates at ``FLOAT32_MAX`` on every backend, with the same bytes, the decode is finite and
    unbiased, and a non-finite input is still refused. (Before, the norm rounded to inf and every
    value decoded to NaN.) Unbiasedness: each coordinate's decode lies on a grid of step
    ``FLOAT32_MAX/s`` around it, so its variance is at most ``(FLOAT32_MAX/s)²/4``; the mean of 400
    seeds must lie within 5 standard errors of ``x`` in every coordinate."""
    from gradq.errors import NonFiniteError
    from gradq.kernels.reference import FLOAT32_MAX

    g = torch.Generator().manual_seed(7)
    x = (torch.rand(64, generator=g) * 2 - 1) * 2e38
    q = gradq.build(spec)
    backends = ["numba", "torch"] + (["triton"] if kernels.triton_available() else [])
    was = kernels.get_backend()
    try:
        wire = set()
        for be in backends:
            kernels.set_backend(be)
            wire.add(bytes(q.encode(x, seed=3).to_bytes().numpy()))
            with pytest.raises(NonFiniteError):
                q.encode(torch.cat([x, torch.tensor([float("inf")])]), seed=3)
        assert len(wire) == 1, "the backends disagree"
    finally:
        kernels.set_backend(was)
    runs = torch.stack([q.decode(q.encode(x, seed=k)) for k in range(400)])
    assert torch.isfinite(runs).all()
    s = 1 if spec.startswith("multiscale") else 15   # the coarsest grid: MultiScale's 2-bit codes
    assert ((runs.double().mean(0) - x.double()).abs() <= 5 * (FLOAT32_MAX / s / 2) / 20).all()


# The schemes whose payload has a field that shows a NaN/Inf input (QSGD's, MaxNorm's and
# MultiScale's and TernGrad's scales, the 1-bit levels, ORQ's and Linear's levels): they skip the up-front screen.
WITNESS_SPECS = ["qsgd:bits=4,bucket=64", "qsgd:bits=2,bucket=7,norm=l2", "maxnorm:bits=4,bucket=64",
                 "terngrad", "terngrad:bucket=7", "terngrad:clip=none,pack=2bit,bucket=64",
                 "multiscale:bits=2+6,bucket=64", "signsgd:bucket=64", "onebit:ef=0,bucket=7",
                 "bingrad-b:bucket=64", "bingrad-b:iters=3,bucket=7", "orq:levels=5,bucket=64",
                 "orq:levels=9,bucket=7", "linear:levels=5,bucket=64", "linear:levels=3,bucket=none"]
BAD_VALUES = [float("nan"), -float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("spec", WITNESS_SPECS)
def test_non_finite_input_is_found_after_the_encode_on_every_backend(spec, monkeypatch, full_tests):
    """A NaN (either sign) or Inf (either sign) anywhere, first, middle or in a partial last bucket, is
    refused by name on every backend, although these schemes look for it only in the payload; and a
    finite input runs no separate screen (``check_finite`` replaced by a function that fails).
    Triton's interpreter takes 50–80 ms a launch: there each place gets one of the four values in
    turn (all four with ``--full``); the kernels treat them alike, the other backends see all four."""
    from gradq.errors import NonFiniteError
    from gradq.quantizers import base

    backends = ["numba", "torch"] + (["triton"] if kernels.triton_available() else [])
    was = kernels.get_backend()
    try:
        for be in backends:
            kernels.set_backend(be)
            q = gradq.build(spec)
            turn = 0
            for n in (1, 100, 301):
                for pos in sorted({0, n // 2, n - 1}):
                    turn += 1
                    for bad in BAD_VALUES if be != "triton" or full_tests else BAD_VALUES[turn % 4:][:1]:
                        x = _data(n, n + pos)
                        x[pos] = bad
                        with pytest.raises(NonFiniteError, match="'fc.w' holds (1 NaN and 0|0 NaN and 1) Inf"):
                            q.encode(x, seed=1, name="fc.w")
            with monkeypatch.context() as m:
                m.setattr(base, "check_finite", _no_screen)
                q.encode(_data(301, 5), seed=1, name="fc.w")
    finally:
        kernels.set_backend(was)


def _no_screen(x, name=None):
    raise AssertionError("the up-front screen ran")


@pytest.mark.parametrize("spec,x", [("bingrad-pb", torch.ones(10)), ("orq", torch.ones(10, dtype=torch.float64)),
                                    ("terngrad", torch.ones(10, dtype=torch.float64)),
                                    ("qsgd", torch.ones(10, dtype=torch.float64)),
                                    ("maxnorm", torch.ones(10, dtype=torch.float16))])
def test_schemes_without_a_witness_still_screen_first(spec, x, monkeypatch):
    """Where no field is a witness (BinGrad-pb's level can clip an Inf away; a float64 input can
    overflow to Inf in float32), the screen still runs before the encode."""
    from gradq.quantizers import base

    monkeypatch.setattr(base, "check_finite", _no_screen)
    with pytest.raises(AssertionError, match="up-front screen"):
        gradq.build(spec).encode(x, seed=1)


@pytest.mark.parametrize("clip", [None, 2.5])
def test_max_abs_scales_of_non_finite_buckets_agree_on_every_backend(clip):
    """A bucket holding NaN (of either sign) gets the clip bound, or inf without one, and a bucket
    holding ±Inf the bound too, on the reference, numba and Triton alike, by the primitive alone
    and by the fused encode (the encodes refuse such input; this is what the kernels return)."""
    from gradq.kernels import numba_ops as N
    from gradq.kernels import reference as R
    from gradq.random import RandomStream

    x = _data(40, 3)
    x[3], x[25], x[33] = float("nan"), -float("nan"), -float("inf")
    bound = float("inf") if clip is None else clip
    want = R.maxabs_scales(x, 8, clip)
    assert want[[0, 3, 4]].tolist() == [bound] * 3 and torch.isfinite(want[[1, 2]]).all()
    backends = [R, N]
    if kernels.triton_available():
        from gradq.kernels import triton_ops as T
        backends.append(T)
    for B in backends:
        assert torch.equal(B.maxabs_scales(x, 8, clip), want), B.__name__
        assert torch.equal(B.maxabs_uniform_encode(x, 7, 8, 4, RandomStream(1), clip)[1], want), B.__name__
