"""SummableQuantizer.encode_fields / decode_field_sum: the fused uint8 path of the integer all-reduce."""

import pytest
import torch

import gradq
from gradq import kernels

SPECS = ["maxnorm:bits=4", "maxnorm:bits=2,bucket=64", "maxnorm:bits=8,bucket=100", "terngrad",
         "terngrad:bucket=512,clip=none", "terngrad:clip=1.5,bucket=37"]


def workers(n: int, m: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n + m)
    return [torch.randn(n, generator=g) * (1 + r) for r in range(m)]


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [0, 1, 37, 5000])
def test_fields_are_the_codes_plus_s(spec, n):
    q = gradq.build(spec)
    xs = workers(n, 3)
    stats = [q.shared_stats(x) for x in xs]
    shared = {k: torch.stack([s[k].value for s in stats]).amax(0) for k in stats[0]}
    for r, x in enumerate(xs):
        f = q.encode_fields(x, shared=shared, seed=r)
        c = q.encode_codes(x, shared=shared, seed=r)
        assert f.dtype == torch.uint8 and f.numel() == n
        assert torch.equal(f.to(torch.int32) - q.max_code, c.to(torch.int32))


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("m", [2, 4, 40])
def test_field_sum_decodes_to_the_mean(spec, m):
    n = 3001
    q = gradq.build(spec)
    xs = workers(n, m)
    stats = [q.shared_stats(x) for x in xs]
    shared = {k: torch.stack([s[k].value for s in stats]).amax(0) for k in stats[0]}
    fields = [q.encode_fields(x, shared=shared, seed=r) for r, x in enumerate(xs)]
    codes = torch.stack([q.encode_codes(x, shared=shared, seed=r) for r, x in enumerate(xs)]).sum(0)
    exp = q.decode_codes(codes, shared=shared, count=m, like=xs[0])
    if 2 * m * q.max_code <= 255:
        total = torch.stack(fields).sum(0).to(torch.uint8)   # exact: the bound fits a byte
    else:
        total = torch.stack(fields).to(torch.int32).sum(0)
    got = q.decode_field_sum(total, shared=shared, count=m, like=xs[0])
    # Σc·w/(M·s) in one product vs (Σc·w/s)/M: float32 rounding only (|values| <= ~4·m)
    torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6 * m)


@pytest.mark.parametrize("spec", ["maxnorm:bits=4,bucket=64", "terngrad:bucket=100"])
def test_every_backend_gives_the_same_fields(spec):
    """The fields come from gradq.kernels on every backend (the torch reference too), bit for bit;
    schemes whose codes depend on a shared seed have none."""
    q = gradq.build(spec)
    x = workers(1000, 1)[0]
    fast = q.encode_fields(x, seed=0)
    was = kernels.get_backend()
    kernels.set_enabled(False)
    try:
        ref = q.encode_fields(x, seed=0)
    finally:
        kernels.set_backend(was)
    assert ref is not None and torch.equal(ref, fast)
    assert gradq.build("randk-maxnorm").encode_fields(torch.randn(100), seed=0, shared_seed=1) is None
