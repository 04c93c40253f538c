"""SummableQuantizer.encode_fields / decode_field_sum: the fused uint8 path of the integer all-reduce."""

import pytest
import torch

import gradq
from gradq import kernels

SPECS = ["maxnorm:bits=4", "maxnorm:bits=2,bucket=64", "maxnorm:bits=8,bucket=100", "terngrad",
         "terngrad:bucket=512,clip=none", "terngrad:clip=1.5,bucket=37", "randk-maxnorm:ratio=0.3,bits=4",
         "randk-maxnorm:k=7,bits=2,norm=l2,rescale=1"]
SEED = 11   # (the shared seed: the RandK variants select their coordinates from it; the others ignore it)


def workers(n: int, m: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n + m)
    return [torch.randn(n, generator=g) * (1 + r) for r in range(m)]


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [0, 1, 37, 5000])
def test_fields_are_the_codes_plus_s(spec, n):
    q = gradq.build(spec)
    xs = workers(n, 3)
    stats = [q.shared_stats(x, shared_seed=SEED) for x in xs]
    shared = {k: torch.stack([s[k].value for s in stats]).amax(0) for k in stats[0]}
    kept = q.num_selected(n) if hasattr(q, "num_selected") else n
    for r, x in enumerate(xs):
        f = q.encode_fields(x, shared=shared, seed=r, shared_seed=SEED)
        c = q.encode_codes(x, shared=shared, seed=r, shared_seed=SEED)
        assert f.dtype == torch.uint8 and f.numel() == kept
        assert torch.equal(f.to(torch.int32) - q.max_code, c.to(torch.int32))
        # the statistics shared was reduced from, given: the same fields, neither recomputed nor checked
        assert torch.equal(q.encode_fields(x, shared=shared, seed=r, shared_seed=SEED, own=stats[r]), f)
        assert torch.equal(q.encode_codes(x, shared=shared, seed=r, shared_seed=SEED, own=stats[r]), c)


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("m", [2, 4, 40])
def test_field_sum_decodes_to_the_mean(spec, m):
    n = 3001
    q = gradq.build(spec)
    xs = workers(n, m)
    stats = [q.shared_stats(x, shared_seed=SEED) for x in xs]
    shared = {k: torch.stack([s[k].value for s in stats]).amax(0) for k in stats[0]}
    fields = [q.encode_fields(x, shared=shared, seed=r, shared_seed=SEED) for r, x in enumerate(xs)]
    codes = torch.stack([q.encode_codes(x, shared=shared, seed=r, shared_seed=SEED) for r, x in enumerate(xs)]).sum(0)
    exp = q.decode_codes(codes, shared=shared, count=m, like=xs[0], shared_seed=SEED)
    if 2 * m * q.max_code <= 255:
        total = torch.stack(fields).sum(0).to(torch.uint8)   # exact: the bound fits a byte
    else:
        total = torch.stack(fields).to(torch.int32).sum(0)
    got = q.decode_field_sum(total, shared=shared, count=m, like=xs[0], shared_seed=SEED)
    # Σc·w/(M·s) in one product vs (Σc·w/s)/M: float32 rounding only (|values| <= ~4·m)
    torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6 * m)


@pytest.mark.parametrize("spec", ["maxnorm:bits=4,bucket=64", "terngrad:bucket=100"])
def test_every_backend_gives_the_same_fields(spec):
    """The fields come from gradq.kernels on every backend (the torch reference too), bit for bit;
    GlobalRandK-MaxNorm has them (its sub-vector's), GlobalRandK-MultiScale none."""
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
    assert gradq.build("randk-maxnorm").encode_fields(torch.randn(100), seed=0, shared_seed=1).numel() == 1
    assert gradq.build("randk-multiscale").encode_fields(torch.randn(100), seed=0, shared_seed=1) is None


class _Reads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators that bring a value to the host (each a wait for a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("_local_scalar_dense", "is_nonzero", "equal"):
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("spec", ["maxnorm:bits=4,bucket=64", "terngrad:bucket=100", "ef(maxnorm:bits=4)",
                                  "ef(terngrad)"])
def test_own_statistics_are_neither_recomputed_nor_checked(spec, monkeypatch):
    """``own=`` (the all-reduce protocol's own ``shared_stats`` of the tensor): no check of the shared
    scale against them, which is a host read (on a GPU a wait), and no second pass for them: MaxNorm
    does not compute its norms again, nor TernGrad its σ, clip bound and scales (the bound rides in
    the statistics' ``aux``). Without ``own`` a shared scale below the worker's own is still refused;
    ``own`` without ``shared`` is refused."""
    q = gradq.build(spec)
    xs = workers(5000, 2)
    stats = [q.shared_stats(x, check_finite=False) for x in xs]
    shared = {k: torch.stack([s[k].value for s in stats]).amax(0) for k in stats[0]}
    passes = []
    name = "terngrad_stats" if "terngrad" in spec else "maxabs_scales"
    real = getattr(kernels, name)
    monkeypatch.setattr(kernels, name, lambda *a: passes.append(1) or real(*a))
    with _Reads() as without:
        want = q.encode_fields(xs[0], shared=shared, seed=3, check_finite=False)
    calls, passes[:] = len(passes), []
    q = gradq.build(spec)   # (error feedback's state moved on: a fresh one, as the first was)
    with _Reads() as given:
        got = q.encode_fields(xs[0], shared=shared, seed=3, check_finite=False, own=stats[0])
    assert torch.equal(got, want)
    assert without.reads >= 1 and given.reads == 0, (without.reads, given.reads)
    assert calls == 1 and not passes
    low = {k: v / 2 for k, v in shared.items()}
    with pytest.raises(ValueError, match="below this worker's own"):
        q.encode_fields(xs[1], shared=low, seed=3)
    with pytest.raises(ValueError, match="pass both"):
        q.encode_fields(xs[1], seed=3, own=stats[1])
