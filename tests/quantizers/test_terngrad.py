"""TernGrad (paper 001): ternary values, clipping at c·σ of the layer, unbiasedness w.r.t. the clipped
tensor, scaler sharing across workers, both wire packings, spec."""

from __future__ import annotations

import math

import pytest
import torch

import gradq  # noqa: F401  (registers the quantizers)
from gradq.errors import PayloadError, SpecError
from gradq.payload import FIELD_HEADER_BYTES, HEADER_BYTES
from gradq.quantizers.terngrad import TernGrad
from gradq.factory import build


def _data(n: int, seed: int, outliers: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if outliers:  # a few entries far beyond 2.5 sigma, so clipping matters
        x[:4] = torch.tensor([9.0, -12.0, 7.5, -8.0])
    return x


def _bucket_index(n: int, bucket: int | None) -> torch.Tensor:
    return torch.arange(n) // (n if bucket is None else bucket)


def _mean_and_z(q: TernGrad, x: torch.Tensor, target: torch.Tensor, reps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of ``reps`` decodes and the per-coordinate z-score of ``mean − target``.

    One decode of coordinate k is ``s·sgn(g_k)·Bernoulli(|g_k|/s)``, variance ``s·|g_k| − g_k²`` (g the
    clipped value, s the scaler); the mean of ``reps`` independent encodes has SE ``sqrt(var/reps)``.
    """
    acc = torch.zeros_like(x, dtype=torch.float64)
    for seed in range(reps):
        acc += q.roundtrip(x, seed=seed).double()
    mean = acc / reps
    g = target.double()
    s = g.abs().max()
    var = (s * g.abs() - g * g).clamp(min=0)
    se = (var / reps).sqrt()
    diff = mean - g
    z = torch.where(se > 0, diff / se.clamp(min=1e-30), torch.where(diff.abs() < 1e-6, 0.0, math.inf))
    return mean, z


def test_decoded_values_are_minus_zero_plus_scaler_per_bucket():
    x = _data(1000, 1) * 3.0
    for bucket in (None, 128):
        for pack in ("trit", "2bit"):
            q = TernGrad(bucket=bucket, pack=pack)
            p = q.encode(x, seed=7)
            scales = p["scales"]
            y = q.decode(p)
            s = scales[_bucket_index(x.numel(), bucket)]
            ratio = y / s
            assert set(ratio.unique().tolist()) <= {-1.0, 0.0, 1.0}
            # the scaler is max|clipped g| of its bucket (computed after clipping)
            c = q.clipped(x)
            expect = torch.stack([c[i: i + (bucket or x.numel())].abs().max()
                                  for i in range(0, x.numel(), bucket or x.numel())])
            assert torch.equal(scales, expect)
            # signs never flip: a nonzero output has the sign of the input
            nz = y != 0
            assert torch.equal(torch.sign(y[nz]), torch.sign(x[nz]))


def test_clipping_at_c_sigma_of_the_layer():
    x = _data(2000, 2)
    sigma = float(x.std(correction=0))
    q = TernGrad(clip=2.5)
    c = q.clipped(x)
    bound = 2.5 * sigma
    assert torch.allclose(c, x.clamp(-bound, bound))
    assert float(c.abs().max()) == pytest.approx(bound, rel=1e-6)
    inside = x.abs() <= bound * (1 - 1e-6)
    assert torch.equal(c[inside], x[inside]) and int((~inside).sum()) >= 4
    # the scaler of a whole-tensor encode is c·sigma, not max|x| = 12
    assert float(q.encode(x, seed=0)["scales"][0]) == pytest.approx(bound, rel=1e-6)
    # clip=none leaves outliers alone: the scaler is max|x|
    q0 = TernGrad(clip=None)
    assert torch.equal(q0.clipped(x), x)
    assert float(q0.encode(x, seed=0)["scales"][0]) == 12.0
    # a smaller c clips harder
    assert float(TernGrad(clip=1.0).clipped(x).abs().max()) == pytest.approx(sigma, rel=1e-6)


def test_clipping_uses_the_whole_tensor_sigma_even_when_bucketed():
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(64, generator=g) * 0.1, torch.randn(64, generator=g) * 10.0])
    x[64] = 60.0
    bound = 2.5 * float(x.std(correction=0))
    scales = TernGrad(bucket=64).encode(x, seed=0)["scales"]
    # bucket 0 (small entries) is untouched by the layer-wide bound; bucket 1 is clipped at it.
    # A per-bucket sigma would clip bucket 0 at 2.5·0.1 instead.
    assert float(scales[0]) == float(x[:64].abs().max())
    assert float(scales[1]) == pytest.approx(bound, rel=1e-6)


def test_sigma_edge_cases_are_safe():
    q = TernGrad()
    one = torch.tensor([-3.0])
    assert torch.equal(q.clipped(one), one)
    assert torch.equal(q.roundtrip(one, seed=0), one)  # |g|/s = 1: always sent exactly
    const = torch.full((10,), 2.0)  # sigma = 0: clipping would erase it, so it is skipped
    assert torch.equal(q.clipped(const), const)
    assert torch.equal(q.roundtrip(const, seed=0), const)
    assert q.roundtrip(torch.zeros(0), seed=0).numel() == 0
    assert torch.equal(q.roundtrip(torch.zeros(9), seed=0), torch.zeros(9))


def test_unbiased_with_respect_to_the_clipped_tensor():
    # 256 coordinates, 2000 encodes; every coordinate within 5 SE (SE from the exact Bernoulli
    # variance s|g| − g², see _mean_and_z). Clipped coordinates have |g| = s: zero variance, exact.
    x = _data(256, 4)
    q = TernGrad(clip=2.5)
    assert q.unbiased is False
    c = q.clipped(x)
    mean, z = _mean_and_z(q, x, c, reps=2000)
    assert float(z.abs().max()) < 5.0
    # ... and therefore biased with respect to x itself: the outliers (|x| >= 7.5) always decode to
    # exactly ±c·sigma (about 3.84 here)
    assert torch.equal(mean[:4], c[:4].double())
    assert float((mean[:4] - x[:4].double()).abs().min()) > 3.0


def test_unbiased_without_clipping():
    x = _data(256, 5)
    q = build("terngrad:clip=none")
    assert q.unbiased is True
    _, z = _mean_and_z(q, x, x, reps=2000)
    assert float(z.abs().max()) < 5.0  # 5 SE per coordinate, as above


@pytest.mark.parametrize("workers,bucket", [(2, None), (3, 100), (4, None)])
def test_shared_scaler_codes_sum_to_the_mean_of_decodes(workers, bucket):
    q = TernGrad(bucket=bucket)
    n = 500
    xs = [_data(n, 10 + m) * (m + 1) for m in range(workers)]
    stats = [q.shared_stats(x) for x in xs]
    assert all(s["scale"].op == "max" for s in stats)
    shared = {"scale": torch.stack([s["scale"].value for s in stats]).amax(dim=0)}
    codes = [q.encode_codes(x, shared=shared, seed=m) for m, x in enumerate(xs)]
    assert all(c.dtype == torch.int32 and int(c.abs().max()) <= q.max_code == 1 for c in codes)
    total = torch.stack(codes).sum(dim=0)
    assert int(total.abs().max()) <= workers
    avg = q.decode_codes(total, shared=shared, count=workers, numel=n)
    decodes = [q.decode(q.encode(x, shared=shared, seed=m)) for m, x in enumerate(xs)]
    # both are s·(integer)/M: equal up to float32 rounding of the final division/product
    assert torch.allclose(avg, torch.stack(decodes).mean(dim=0), rtol=1e-6, atol=0)


def test_shared_scaler_below_own_is_refused():
    x = _data(100, 6)
    q = TernGrad()
    own = q.shared_stats(x)["scale"].value
    with pytest.raises(ValueError, match="MAX"):
        q.encode(x, shared={"scale": own * 0.5}, seed=0)


@pytest.mark.parametrize("n", [1, 5, 1001])
def test_trit_and_2bit_packing_same_decode_different_size(n):
    x = _data(n, 7, outliers=n > 4)
    qt, q2 = TernGrad(pack="trit"), TernGrad(pack="2bit")
    pt, p2 = qt.encode(x, seed=9), q2.encode(x, seed=9)
    assert torch.equal(qt.decode(pt), q2.decode(p2))
    head = HEADER_BYTES + 2 * FIELD_HEADER_BYTES
    assert pt.nbytes == head + math.ceil(n / 5) + 4 == qt.expected_nbytes(n) == len(pt.to_bytes())
    assert p2.nbytes == head + math.ceil(n / 4) + 4 == q2.expected_nbytes(n) == len(p2.to_bytes())
    qb = TernGrad(bucket=100)
    assert qb.encode(x, seed=0).nbytes == head + math.ceil(n / 5) + 4 * math.ceil(n / 100)


def test_corrupt_2bit_field_is_rejected():
    q = TernGrad(pack="2bit")
    p = q.encode(_data(8, 8), seed=0)
    p.fields["codes"] = torch.full_like(p.fields["codes"], 0xFF)  # every field = 3, not a trit
    with pytest.raises(PayloadError):
        q.decode(p)


def test_spec_round_trip_and_errors():
    q = build("terngrad")
    assert str(q) == "terngrad:clip=2.5,bucket=none,pack=trit"
    assert q.layerwise and q.summable and q.max_code == 1 and not q.needs_shared_seed
    for spec in ("terngrad:clip=none,bucket=64,pack=2bit", "terngrad:clip=1.5,bucket=none,pack=trit"):
        assert str(build(spec)) == spec and build(str(build(spec))) == build(spec)
    assert build("terngrad:clip=none") != q
    for bad in ("terngrad:clip=0", "terngrad:clip=-1", "terngrad:pack=3bit", "terngrad:bucket=0",
                "terngrad:bits=2"):
        with pytest.raises(SpecError):
            build(bad)
    x = _data(50, 9)
    p = q.encode(x, seed=1)
    with pytest.raises(PayloadError):
        build("terngrad:pack=2bit").decode(p)
    p2 = q.payload_from_bytes(p.to_bytes(), x.shape)
    assert torch.equal(q.decode(p2), q.decode(p))
