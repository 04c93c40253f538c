"""Deferred checks of decoded payloads (gradq.kernels.checks), on every backend.

A decode refuses fields that no encode writes; inside ``kernels.deferred_checks()`` it counts the
payload instead (on the device, no host read) and the caller refuses it after one look. Each case
corrupts one field of a real payload so that it names no code (a TernGrad field of 3, a trit byte
of 255, a level index of 7 of 5 levels, a scale index of 3 of 3 scales) and checks, per backend:
outside the context the decode raises as before; inside it does not, the count is exactly the
number of corrupt payloads decoded (clean ones add nothing), every value of a field left intact
is the clean decode's, ``check()`` raises, and an inner context keeps its own count.
"""

from __future__ import annotations

import pytest
import torch

import gradq
from gradq import kernels
from gradq.errors import PayloadError

BACKENDS = ["torch", "numba"] + (["triton"] if kernels.triton_available() else [])

# (spec, n, byte to corrupt in the field, its new value, the coordinates that byte holds)
CASES = [
    ("terngrad:pack=2bit", 1000, ("codes", 10, 0xFF), range(40, 44)),
    ("terngrad", 1000, ("codes", 10, 0xFF), range(50, 55)),
    # 3-bit indices: bytes 372-374 hold coordinates 992-999, in the last bucket (a read past the
    # last row of levels would leave the tensor)
    ("orq:levels=5,bucket=64", 1000, ("codes", 372, 0xFF), range(992, 1000)),
    ("multiscale:bits=2+4+6", 1000, ("index", 10, 0xFF), range(40, 44)),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    was = kernels.get_backend()
    kernels.set_backend(request.param)
    yield request.param
    kernels.set_backend(was)


def _corrupt(p: gradq.Payload, field: str, at: int, value: int) -> gradq.Payload:
    fields = dict(p.fields)
    fields[field] = fields[field].clone()
    fields[field][at] = value
    return gradq.Payload(p.spec, p.shape, p.dtype, p.numel, fields)


@pytest.mark.parametrize("spec,n,where,hit", CASES, ids=[c[0] for c in CASES])
def test_a_corrupt_payload_is_counted_inside_and_refused_outside(backend, spec, n, where, hit):
    q = gradq.build(spec)
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    p = q.encode(x, seed=5)
    bad = _corrupt(p, *where)
    clean = q.decode(p)
    with pytest.raises(PayloadError):
        q.decode(bad)
    with kernels.deferred_checks() as checks:
        got = q.decode(bad)
        q.decode(p)                                   # a clean payload adds nothing
        assert int(checks.count) == 1
        with kernels.deferred_checks() as inner:      # an inner context counts its own decodes
            q.decode(bad, out=torch.empty(n))
            q.decode(bad)
        assert int(inner.count) == 2 and int(checks.count) == 1
    keep = torch.ones(n, dtype=torch.bool)
    keep[list(hit)] = False
    assert torch.equal(got[keep], clean[keep])        # every intact field decodes as before
    assert torch.isfinite(got).all()
    with pytest.raises(PayloadError, match="codes no encode writes"):
        checks.check()
    with pytest.raises(PayloadError):                 # and outside again it raises at once
        q.decode(bad)


def test_the_mean_of_payloads_counts_each_corrupt_one(backend):
    """``decode_mean`` (the scatter protocol's reducer) counts the payloads among its inputs that
    hold invalid fields: one fused pass over M payloads reports one (it cannot say which)."""
    q = gradq.build("terngrad:pack=2bit,bucket=64")
    xs = [torch.randn(500, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    ps = [q.encode(x, seed=k) for k, x in enumerate(xs)]
    ps[1] = _corrupt(ps[1], "codes", 3, 0xFF)
    with pytest.raises(PayloadError):
        q.decode_mean(ps)
    with kernels.deferred_checks() as checks:
        q.decode_mean(ps)
    assert int(checks.count) == 1
    with kernels.deferred_checks() as clean:
        q.decode_mean([ps[0], ps[2]])
    assert int(clean.count) == 0
    clean.check()   # nothing to refuse


@pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")
def test_randk_multiscale_on_its_implicit_subset_counts_a_corrupt_index():
    """The Triton RandK-MultiScale decode checks its indices before it writes ``out``; deferred, it
    writes every coordinate (an index naming no scale reads the first scale) and counts the payload."""
    was = kernels.get_backend()
    kernels.set_backend("triton")
    try:
        q = gradq.build("randk-multiscale:ratio=0.01,bits=2+4+6")
        x = torch.randn(20_000, generator=torch.Generator().manual_seed(2))
        p = q.encode(x, seed=9)
        bad = _corrupt(p, "index", 7, 0xFF)
        out = torch.full((20_000,), float("nan"))
        with pytest.raises(PayloadError, match="corrupt scale index"):
            q.decode(bad, out=out)
        assert torch.isnan(out).all()                 # refused before out was touched
        with kernels.deferred_checks() as checks:
            q.decode(bad, out=out)
        assert int(checks.count) == 1 and torch.isfinite(out).all()
    finally:
        kernels.set_backend(was)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators that bring a value to the host (each a synchronization on a GPU),
    including those whose output's size depends on the data (``nonzero``, boolean-mask indexing)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        mask = name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if mask or name in ("_local_scalar_dense", "equal", "is_nonzero", "nonzero", "masked_select"):
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bad", [1000, -1, "order"])
def test_topk_indices_are_counted_inside_and_refused_outside(bad):
    """Top-K's decode checks its indices (in range, strictly increasing) with one host read, and
    with none inside the context, where a corrupt payload is counted and its indices are clamped
    into range: the decode and the mean stay in bounds, the intact positions decode as before."""
    q = gradq.build("topk:ratio=0.05")
    n = 1000
    p = q.encode(torch.randn(n, generator=torch.Generator().manual_seed(2)), seed=0)
    idx = p.fields["indices"]
    at = 3
    broken = _corrupt(p, "indices", at, int(idx[at - 1]) if bad == "order" else bad)
    clean = q.decode(p)
    out = torch.full((n,), 7.0)
    with pytest.raises(PayloadError, match="not strictly increasing" if bad == "order" else "out of range"):
        q.decode(broken, out=out)
    assert bool((out == 7.0).all())                  # refused before out is touched
    with _HostReads() as mode:
        q.decode(p, out=out)
    assert mode.reads == 1
    with kernels.deferred_checks() as checks:
        with _HostReads() as mode:
            got = q.decode(broken)
            q.decode(p)                               # a clean payload adds nothing
        mean = q.decode_mean([broken, p])             # (its signed-zero step reads on the CPU: below)
    assert mode.reads == 0 and int(checks.count) == 2
    keep = torch.ones(n, dtype=torch.bool)
    keep[idx[at - 1:at + 1].long()] = False
    keep[0] = keep[n - 1] = False                     # (a clamped index lands at an end)
    assert torch.equal(got[keep], clean[keep]) and torch.isfinite(mean).all()
    with pytest.raises(PayloadError, match="sparse indices"):
        checks.check()


@pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")
def test_topk_mean_on_the_triton_backend_reads_nothing(triton_backend):
    """The hook's all-gather reducer for Top-K as a GPU runs it (the Triton backend, whose
    signed-zero step looks positions up instead of reading a mask): no host read inside the
    context, and the bits of the CPU's mean."""
    q = gradq.build("topk:ratio=0.5")
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    for x in xs:
        x[::3] = -0.0
    ps = [q.encode(x, seed=0) for x in xs]
    with _HostReads() as mode, kernels.deferred_checks() as checks:
        got = q.decode_mean(ps)
    assert mode.reads == 0 and int(checks.count) == 0
    kernels.set_backend("numba" if kernels.available() else "torch")
    assert torch.equal(got.view(torch.int32), q.decode_mean(ps).view(torch.int32))


@pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "randk:ratio=0.05,rescale=1"])
def test_error_feedback_trusts_its_own_payload(spec, triton_backend):
    """Error feedback subtracts the decode of the payload its inner scheme just made: it does not
    check that payload again, so an unchecked sparse encode (the DDP hook's) reads nothing on the
    host on the Triton backend (Rand-K's selection of a new seed aside: the same seed twice here;
    and Rand-K, which has no field that holds every NaN of ``x``, skips its screen unchecked). The
    same payload given back untrusted is checked (one read: Top-K's indices, Rand-K's seed),
    trusted not; the results are the same bits both ways."""
    n = 4000
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    q = gradq.build(f"ef({spec})")
    q.encode(x, seed=0, shared_seed=5, name="w", check_finite=False)   # (Rand-K: selects for seed 5)
    with _HostReads() as mode:
        p = q.encode(x, seed=1, shared_seed=5, name="w", check_finite=False)
    assert mode.reads == 0
    trusted = q.residuals["w"].clone()
    u = x + trusted                                    # (any u: the subtraction is what is counted)
    a, b = u.clone(), u.clone()
    inner = q.inner
    fields = gradq.Payload(inner.spec, p.shape, p.dtype, p.numel, p.fields)
    with _HostReads() as mode:
        assert inner.subtract_decode_(a, fields)
    assert mode.reads == 1
    with _HostReads() as mode:
        assert inner.subtract_decode_(b, p, trusted=True)   # (p's fields: the very ones the encode made)
    assert mode.reads == 0
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    want = u - inner.decode(fields)
    assert torch.equal(a.view(torch.int32), want.view(torch.int32))
