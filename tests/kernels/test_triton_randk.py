"""GlobalRandK-MaxNorm and Rand-K on the Triton backend with an implicit subset (gradq.kernels.triton_randk
and triton_randk_values).

Under Triton's interpreter (CPU tensors): the primitives give the bytes and floats of the
composition they replace (the reference's indices, a gather, MaxNorm's primitives on the ``k``
values, a scatter), without asking for the indices; where they do not choose the subset (nothing to
choose, the torch path) they ask for them and give the same; an encode allocates nothing ``k``- or
``n``-sized besides its payload. On a GPU: the same bytes for 25M values, and the issue's peak of
1.25× the payload.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._pytree import tree_leaves

import gradq
from gradq import kernels
from gradq.errors import PayloadError
from gradq.kernels import reference as R
from gradq.random import RandomStream

T = pytest.importorskip("gradq.kernels.triton_ops", reason="triton is not installed")
from gradq.kernels import triton_randk as K  # noqa: E402
from gradq.kernels import triton_randk_values as V  # noqa: E402
from gradq.kernels import triton_subset as S  # noqa: E402
from test_triton_kernels import data, first_difference, same  # noqa: E402

interpreted = pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

#: (the MaxNorm widths: s = 1, 3, 7, 15, 127 give 2-, 3-, 4-, 5- and 8-bit fields; 3 and 5 cross words)
WIDTHS = [(2, 1), (3, 3), (4, 7), (5, 15), (8, 127)]


def _refuse(*args, **kwargs):
    raise AssertionError("the indices were asked for")


@pytest.fixture
def fresh(monkeypatch):
    """The Triton backend (CPU tensors under the interpreter), with no selection kept from another
    test (the module keeps its last one)."""
    monkeypatch.setattr(K, "_LAST", None)
    was = kernels.get_backend()
    kernels.set_backend("triton")
    yield
    kernels.set_backend(was)


def gradient_like(n: int, seed: int) -> torch.Tensor:
    """Log-normally scaled Gaussians: every code and scale index in play."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) / 2)


@interpreted
@pytest.mark.parametrize("n,k,seed,elems,widths", [
    (4_097, 2, 7, 1024, WIDTHS), (70_001, 1, 0, 8192, WIDTHS[2:3]), (60_003, 700, -3, 2048, WIDTHS[1::2]),
    (100_003, 4_500, 2**63 - 1, 8192, WIDTHS[2:3]), (10_000, 2_000, 1, 1024, WIDTHS[2:3])])
def test_implicit_subset_gives_the_composition(n, k, seed, elems, widths, fresh, monkeypatch):
    """Norms (max and L2), codes (every width on a small case; fields across words: 3 and 5 bits)
    and decodes (with and without rescaling, into ``out=``) equal the composition's, and the
    indices are never asked for: a partial last program (4,097 values), one selected value, many
    programs of several loop steps, and ``k`` of a fifth of ``n`` (five histogram levels of six
    bits and one of two pick ``t``)."""
    monkeypatch.setitem(T.TUNING, "randk_elems", elems)
    x = data(n, 11) if n < 5000 else gradient_like(n, 11)   # (huge values zero most codes: on one case)
    idx = R.random_subset(n, k, seed)
    monkeypatch.setattr(R, "random_subset", _refuse)
    monkeypatch.setattr(S, "random_subset", _refuse)
    want_max, want_l2 = R.maxabs_scales(x[idx], None), R.l2_scales(x[idx], None)
    assert same(kernels.subset_norm(x, k, seed, "max", _refuse), want_max)
    assert same(kernels.subset_norm(x, k, seed, "l2", _refuse), want_l2)
    scale = want_max
    for width, s in widths:
        rng, ref_rng = RandomStream(5), RandomStream(5)
        want = R.uniform_encode(x[idx], scale, s, None, width, ref_rng)
        got = kernels.subset_uniform_encode(x, k, seed, scale, s, width, rng, _refuse)
        assert same(got, want), (width, first_difference(got, want))
        assert rng.offset == ref_rng.offset
        sub = R.uniform_decode(want, scale, s, None, width, k)
        for rescale in (False, True):
            ref = torch.zeros(n)
            ref[idx] = sub * (n / k) if rescale else sub
            into = torch.full((n,), float("nan"))
            assert kernels.subset_uniform_decode(want, scale, s, width, k, seed, n, rescale, _refuse, into) is into
            assert same(into, ref), (width, rescale, first_difference(into, ref))


def _subtracted(u: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, factor) -> torch.Tensor:
    """The composition's ``u − decode``: ``u`` minus the rescaled values at ``idx``, the rest ``u``."""
    want = u.clone()
    want[idx] = want[idx] - (vals * factor if factor is not None else vals)
    return want


@interpreted
@pytest.mark.parametrize("n,k,seed,elems", [(4_097, 2, 7, 1024), (70_001, 1, 0, 8192), (60_003, 700, -3, 2048),
                                            (100_003, 4_500, 2**63 - 1, 8192), (100_003, 40_000, 3, 4096),
                                            (3_001, 3_000, 5, 1024)])
def test_rand_k_values_on_the_implicit_subset(n, k, seed, elems, fresh, monkeypatch):
    """Rand-K's gather, its scatter (with and without rescaling, into ``out=`` and new) and its
    subtraction (error feedback's ``u − decode``, on data with ±0.0, NaN and ±inf where it is
    subtracted from) equal the composition's bits without asking for the indices."""
    from gradq.kernels import triton_randk_values as V

    monkeypatch.setitem(T.TUNING, "randk_elems", elems)
    x = data(n, 12)
    idx = R.random_subset(n, k, seed)
    monkeypatch.setattr(R, "random_subset", _refuse)
    monkeypatch.setattr(S, "random_subset", _refuse)
    got = kernels.subset_gather(x, k, seed, _refuse)
    assert same(got, x[idx]), first_difference(got, x[idx])
    vals = data(k, 13)
    u = data(n, 14)
    u[idx[::3]] = float("nan")
    u[idx[1::5]] = float("inf")
    u[idx[2::7]] = -0.0
    for rescale in (False, True):
        factor = n / k if rescale else None
        ref = torch.zeros(n)
        ref[idx] = vals * factor if rescale else vals
        into = torch.full((n,), float("nan"))
        assert kernels.subset_scatter(vals, k, seed, n, rescale, _refuse, into) is into
        assert same(into, ref), (rescale, first_difference(into, ref))
        assert same(kernels.subset_scatter(vals, k, seed, n, rescale, _refuse), ref)
        want, mine = _subtracted(u, idx, vals, factor), u.clone()
        assert kernels.subset_scatter(vals, k, seed, n, rescale, _refuse, mine, subtract=True) is mine
        assert same(mine, want), (rescale, first_difference(mine, want))
    with pytest.raises(ValueError, match="expected"):
        V.subset_scatter(vals[1:], k, seed, n, False)


@interpreted
@pytest.mark.parametrize("bits", [(2, 6), (2, 4, 8)])
def test_multiscale_on_the_implicit_subset(bits, fresh, monkeypatch):
    """RandK-MultiScale's fields (codes and each value's own scale index, 1 or 2 bits) and decodes
    equal the composition's without the indices; with three scales a 2-bit index can name none,
    and such a payload is refused before ``out`` is touched, as the composition refuses it."""
    from gradq.quantizers.multiscale import multiscale_levels

    n, k, seed = 50_001, 500, 21
    levels = multiscale_levels(bits)
    width, iw = 2, (len(levels) - 1).bit_length()
    x = gradient_like(n, 8)
    idx = R.random_subset(n, k, seed)
    monkeypatch.setattr(R, "random_subset", _refuse)
    scale = R.maxabs_scales(x[idx], None)
    want = R.multiscale_encode(x[idx], scale, None, levels, None, width, iw, RandomStream(4))
    got = kernels.subset_multiscale_encode(x, k, seed, scale, levels, width, iw, RandomStream(4), _refuse)
    assert same(got, want), first_difference(got[0], want[0])
    sub = R.multiscale_decode(want[0], want[1], scale, levels, None, width, iw, k)
    for rescale in (False, True):
        ref = torch.zeros(n)
        ref[idx] = sub * (n / k) if rescale else sub
        into = torch.full((n,), float("nan"))
        assert kernels.subset_multiscale_decode(*want, scale, levels, width, iw, k, seed, n, rescale, _refuse,
                                                into) is into
        assert same(into, ref), first_difference(into, ref)
    if len(levels) == 3:
        bad = want[1].clone()
        bad[-1] |= 0xC0   # the last field: index 3 of 3 scales
        into = torch.full((n,), float("nan"))
        with pytest.raises(PayloadError, match="corrupt scale index"):
            kernels.subset_multiscale_decode(want[0], bad, scale, levels, width, iw, k, seed, n, False, _refuse, into)
        assert torch.isnan(into).all()


@interpreted
@pytest.mark.parametrize("case", ["k = 0", "k = n", "torch path"])
def test_outside_the_implicit_subset_the_indices_give_the_same(case, fresh, monkeypatch):
    """Nothing to choose (``k`` 0 or ``n``) or ``subset_path`` 2: the primitives ask for the indices
    and give the composition's results."""
    n, k, seed = {"k = 0": (5_000, 0, 1), "k = n": (500, 500, 1)}.get(case, (50_001, 400, 13))
    x = data(n, 3)
    idx = R.random_subset(n, k, seed)
    asked = []

    def indices():
        asked.append(1)
        return idx

    if case == "torch path":
        monkeypatch.setitem(T.TUNING, "subset_path", 2)
    scale = R.maxabs_scales(x[idx], None)
    assert same(kernels.subset_norm(x, k, seed, "max", indices), scale) and asked
    asked.clear()
    want = R.uniform_encode(x[idx], scale, 7, None, 4, RandomStream(2))
    assert same(kernels.subset_uniform_encode(x, k, seed, scale, 7, 4, RandomStream(2), indices), want) and asked
    asked.clear()
    ref = torch.zeros(n)
    if k:
        ref[idx] = R.uniform_decode(want, scale, 7, None, 4, k)
    assert same(kernels.subset_uniform_decode(want, scale, 7, 4, k, seed, n, False, indices), ref)
    assert asked or k in (0, n)
    asked.clear()
    assert same(kernels.subset_gather(x, k, seed, indices), x[idx]) and asked
    asked.clear()
    vals = data(k, 5)
    ref = torch.zeros(n)
    ref[idx] = vals
    assert same(kernels.subset_scatter(vals, k, seed, n, False, indices), ref)
    u = data(n, 6)
    want, mine = _subtracted(u, idx, vals, None), u.clone()
    kernels.subset_scatter(vals, k, seed, n, False, indices, mine, subtract=True)
    assert same(mine, want) and (asked or k in (0, n))


def test_draws_of_distinct_counters_are_distinct():
    """Why the subset needs no tie-break by index: the draws of counters below 2³² are a bijection of
    the counters (checked on 2²⁰ counters for three seeds: the reference's bits, no repeat)."""
    for seed in (0, 1, -7):
        b = RandomStream(seed).bits32(1 << 20)
        assert torch.unique(b).numel() == b.numel()


class Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every new storage the torch operators outside Triton's launches make (an upper bound
    on the call's peak: frees are not subtracted), and the largest one."""

    def __init__(self):
        super().__init__()
        self.total = self.largest = 0
        self.in_launch = False
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        if not self.in_launch:
            inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
            for t in _tensors(res):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr not in inputs and ptr not in self.seen and st.nbytes():
                    self.seen.add(ptr)
                    weakref.finalize(t, self.seen.discard, ptr)
                    self.total += st.nbytes()
                    self.largest = max(self.largest, st.nbytes())
        return res


def _tensors(obj):
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _counted(monkeypatch, mode, module=K):
    """Mark ``mode`` as inside a launch while ``module``'s kernels run (their tensors are not counted)."""
    real = module._launch

    def launch(*args, **meta):
        mode.in_launch = True
        try:
            return real(*args, **meta)
        finally:
            mode.in_launch = False
    monkeypatch.setattr(module, "_launch", launch)


@interpreted
@pytest.mark.parametrize("spec,field,largest", [("randk-maxnorm:ratio=0.01,bits=4", "codes", 0.75),
                                                ("randk:ratio=0.01,rescale=1", "values", 4.25)])
def test_encode_and_decode_hold_no_subset(spec, field, largest, fresh, monkeypatch):
    """Through the API (a new shared seed, so the selection is made inside the call): an encode
    allocates at most its payload, the histogram (4 bytes a bin), one int32 a program and a few
    scalars; the indices alone would be 8 bytes a selected value, 16× a 4-bit payload and 2× Rand-K's
    values. A decode into ``out=`` allocates only the selection's part of that."""
    n = 100_003
    q = gradq.build(spec)
    k = q.count(n) if hasattr(q, "count") else q.num_selected(n)
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))   # (finite sum: the screen's one pass)
    try:
        mode = Allocations()
        _counted(monkeypatch, mode)
        with mode:
            enc = q.encode(x, seed=1, shared_seed=77)
        programs = -(-n // T.TUNING["randk_elems"])
        selection = 4 * (1 << K._bin_bits(k)) + 4 * programs + 512   # (the 512: a few scalars)
        assert enc.fields[field].nbytes <= mode.total <= enc.nbytes + selection < enc.nbytes + 8 * k, (
            mode.total, enc.nbytes, selection)   # (the payload is counted: the count is not blind)
        assert mode.largest < largest * k   # (the payload's largest field)
        out = torch.empty(n)
        monkeypatch.setattr(K, "_LAST", None)
        mode = Allocations()
        with mode:
            q.decode(enc, out=out)
        assert mode.total <= selection, mode.total
    finally:
        kernels.set_backend("torch")
    ref = q.encode(x, seed=1, shared_seed=77)
    assert enc.same_bytes(ref), first_difference(enc, ref)
    assert same(out, q.decode(ref))


@interpreted
@pytest.mark.parametrize("spec", ["randk:ratio=0.01", "randk:k=900,rescale=1"])
def test_rand_k_through_the_api(spec, fresh, monkeypatch):
    """Rand-K on the Triton backend: the torch backend's bytes, decodes (new and into ``out=``), means
    (workers that share a seed, as the hook's do, without the indices; and payloads of two seeds)
    and error feedback's subtraction, bit for bit."""
    n = 60_001
    xs = [data(n, 40 + j) for j in range(3)]

    def run(triton: bool):
        kernels.set_backend("triton" if triton else "torch")
        q = gradq.build(spec)
        shared = [q.encode(x, seed=j, shared_seed=91) for j, x in enumerate(xs)]
        mixed = [q.encode(x, seed=j, shared_seed=91 + j % 2) for j, x in enumerate(xs)]
        got = {"decode": q.decode(shared[0]), "into": q.decode(shared[1], out=torch.full((n,), float("nan"))),
               "mean": q.decode_mean(shared, out=torch.full((n,), float("nan"))),
               "mixed mean": q.decode_mean(mixed)}
        u = data(n, 50)
        assert q.subtract_decode_(u, shared[2])
        got["subtract"] = u
        return shared + mixed, got

    ref_payloads, ref = run(False)
    monkeypatch.setattr(R, "random_subset", _refuse)   # (the shared seed's: selected on the device)
    monkeypatch.setattr(S, "random_subset", _refuse)   # (and the indices written from it, no candidates)
    real = V.subset_indices
    asked = []
    monkeypatch.setattr(V, "subset_indices", lambda *a: asked.append(a[2]) or real(*a))
    payloads, got = run(True)
    for p, r in zip(payloads, ref_payloads):
        assert p.same_bytes(r), first_difference(p, r)
    for key in ref:
        assert same(got[key], ref[key]), (key, first_difference(got[key], ref[key]))
    assert asked == [91, 92]   # (the indices only for the mean of two seeds, once each)


@interpreted
@pytest.mark.parametrize("spec", ["randk-maxnorm:ratio=0.01,bits=4,rescale=1", "randk-maxnorm:k=300,bits=2,norm=l2"])
def test_global_randk_fields_on_the_implicit_subset(spec, fresh, monkeypatch):
    """The all-reduce's fields of GlobalRandK-MaxNorm (a byte ``c + s`` a selected value) and the
    decode of three workers' sum (``s`` becomes ``3·s``) on the Triton backend: the torch
    backend's bits, without the indices."""
    n = 60_001
    xs = [gradient_like(n, 20 + j) for j in range(3)]

    def run(backend: str):
        kernels.set_backend(backend)
        q = gradq.build(spec)
        stats = [q.shared_stats(x, shared_seed=9) for x in xs]
        shared = {"scale": torch.stack([s["scale"].value for s in stats]).amax(0)}
        fields = [q.encode_fields(x, shared=shared, seed=j, shared_seed=9, own=stats[j]) for j, x in enumerate(xs)]
        total = torch.stack(fields).to(torch.int32).sum(0).to(torch.uint8)   # (2·3·s ≤ 255: a byte holds it)
        return fields, q.decode_field_sum(total, shared=shared, count=3, like=xs[0], shared_seed=9)

    ref_fields, ref = run("torch")
    monkeypatch.setattr(R, "random_subset", _refuse)
    monkeypatch.setattr(S, "random_subset", _refuse)
    fields, got = run("triton")
    for f, r in zip(fields, ref_fields):
        assert same(f, r), first_difference(f, r)
    assert same(got, ref), first_difference(got, ref)


class _FromHost(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators that wait for a GPU on the host: reads of a value, and tensors made from
    host data (a blocking copy to the device)."""

    def __init__(self):
        super().__init__()
        self.names: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "lift_fresh"):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


@interpreted
@pytest.mark.parametrize("spec", ["randk:ratio=0.01", "randk-maxnorm:ratio=0.01,bits=4",
                                  "randk-multiscale:ratio=0.01,bits=2+6", "ef(randk:ratio=0.01,rescale=1)"])
def test_unchecked_randk_encodes_wait_for_nothing(spec, fresh, monkeypatch):
    """The DDP hook's encode of the Rand-K family on the Triton backend (``check_finite=False``) with
    a new shared seed, as every step has, so that the call makes the selection: no host read and no
    tensor made from host data (``t`` stays on the device, the seed field is filled there), and
    the checked encode's bytes."""
    x = gradient_like(50_001, 3)
    want = gradq.build(spec).encode(x, seed=1, shared_seed=21)
    q = gradq.build(spec)
    monkeypatch.setattr(K, "_LAST", None)   # (the selection is made inside the call)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    with _FromHost() as mode:
        got = q.encode(x, seed=1, shared_seed=21, check_finite=False)
    assert mode.names == [] and reads == []
    assert K._LAST is not None and K._LAST[1] is not None   # (made in the call, on the device)
    assert got.same_bytes(want), first_difference(got, want)


@pytest.mark.gpu
@gpu
def test_gpu_randk_bytes_and_peak():
    """On CUDA (atomic ORs and maxima in whatever order the programs run): the CPU's bytes and
    decode for 25M values, three shared seeds, both norms, both variants and plain Rand-K; and the encode's peak
    extra memory, with a new shared seed (the selection made inside the call), at most 1.25× the
    payload."""
    n = 25_000_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    xc = x.cuda()
    for spec in ("randk-maxnorm:ratio=0.01,bits=4", "randk-maxnorm:ratio=0.002,bits=3,norm=l2,rescale=1",
                 "randk-multiscale:ratio=0.01,bits=2+6", "randk-multiscale:ratio=0.005,bits=2+4+8,rescale=1",
                 "randk:ratio=0.01", "randk:ratio=0.002,rescale=1"):
        q = gradq.build(spec)
        for shared in (5, -9, 2**62):
            enc = q.encode(xc, seed=2, shared_seed=shared)
            dec = q.decode(enc)
            ref = q.encode(x, seed=2, shared_seed=shared)
            assert enc.same_bytes(ref), (spec, shared, first_difference(enc, ref))
            assert same(dec.cpu(), q.decode(ref)), (spec, shared)
    for spec in ("randk-maxnorm:ratio=0.01,bits=4", "randk-multiscale:ratio=0.01,bits=2+6", "randk:ratio=0.01"):
        q = gradq.build(spec)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        enc = q.encode(xc, seed=1, shared_seed=12345)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert extra <= 1.25 * enc.nbytes, (spec, extra, enc.nbytes)
