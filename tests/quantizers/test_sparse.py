"""Top-K and Rand-K (ALGORITHMS.md §5): selection, placement, uniformity, unbiasedness, wire size."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import gradq
from gradq.payload import Payload
from gradq.quantizers.sparse import select_count, shared_random_indices, topk_indices
from gradq.random import hash32_reference
from gradq_testing import assert_unbiased, mc_mean

HEADER = 16 + 5 * 2  # payload header with two fields


def _vec(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g)


# -- K -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k,ratio,want", [
    (0, None, None, 0), (0, 5, None, 0),
    (1000, None, None, 10),           # default ratio 0.01
    (50, None, None, 1),              # round(0.5) = 0 -> at least 1
    (10, None, 0.25, 2),              # round(2.5) = 2 (half to even)
    (10, None, 0.35, 4),              # round(3.5) = 4
    (10, None, 1.0, 10),
    (10, 3, None, 3), (10, 99, None, 10),
])
def test_select_count(n, k, ratio, want):
    assert select_count(n, k, ratio) == want


# -- Top-K -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(1, 1), (257, 1), (1000, 37), (1000, 999), (1000, 1000), (4096, 300)])
def test_topk_keeps_exactly_the_k_largest(n, k):
    x = _vec(n, seed=n + k)
    q = gradq.build(f"topk:k={k}")
    p = q.encode(x, seed=0)
    idx = p["indices"].to(torch.int64)
    # Oracle: Python sort of the magnitudes (continuous draws, so there are no ties here).
    want = sorted(sorted(range(n), key=lambda i: -abs(float(x[i])))[:k])
    assert idx.tolist() == want
    assert torch.equal(p["values"], x[idx])
    assert p["indices"].dtype == torch.int32 and p["values"].dtype == torch.float32
    # Everything dropped is no larger than everything kept.
    kept = torch.zeros(n, dtype=torch.bool)
    kept[idx] = True
    if k < n:
        assert float(x[~kept].abs().max()) <= float(x[kept].abs().min())


def test_topk_decode_places_values():
    x = torch.tensor([[0.5, -3.0, 0.1], [2.0, 0.0, -2.5]], dtype=torch.float64)
    q = gradq.build("topk:k=3")
    out = q.roundtrip(x, seed=0)
    assert out.dtype == torch.float64 and out.shape == x.shape
    assert torch.equal(out, torch.tensor([[0.0, -3.0, 0.0], [2.0, 0.0, -2.5]], dtype=torch.float64))


def test_topk_ties_go_to_the_lower_index():
    x = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0])
    assert topk_indices(x, 2).tolist() == [1, 2]
    assert topk_indices(x, 3).tolist() == [1, 2, 4]
    assert topk_indices(torch.zeros(8), 3).tolist() == [0, 1, 2]
    # -0.0 and +0.0 have equal magnitude
    assert topk_indices(torch.tensor([0.0, -0.0, -0.0, 1.0]), 2).tolist() == [0, 3]


def test_topk_indices_are_data_dependent_not_seed_dependent():
    x = _vec(512, seed=3)
    q = gradq.build("topk:ratio=0.05")
    assert q.encode(x, seed=1).same_bytes(q.encode(x, seed=2))


def test_topk_nbytes_formula():
    for n, spec, k in [(1000, "topk", 10), (1000, "topk:k=7", 7), (4096, "topk:ratio=0.1", 410), (3, "topk:k=9", 3)]:
        q = gradq.build(spec)
        p = q.encode(_vec(n), seed=0)
        assert p.nbytes == len(p.to_bytes()) == q.expected_nbytes(n) == HEADER + 8 * k
    # int64 indices past 2**31 - 1 coordinates (layout only; no tensor is allocated)
    q = gradq.build("topk:k=5")
    assert q.field_layout(2**31 - 1)["indices"] == (torch.int32, 5)
    assert q.field_layout(2**31)["indices"] == (torch.int64, 5)
    assert q.expected_nbytes(2**31) == HEADER + 12 * 5


def _forged(q, x, **fields):
    p = q.encode(x, seed=0)
    return Payload(p.spec, p.shape, p.dtype, p.numel, {**p.fields, **fields})


@pytest.mark.parametrize("bad,what", [([0, 5, 10], "out of range"), ([-1, 2, 3], "out of range"),
                                      ([3, 2, 7], "strictly increasing"), ([2, 2, 7], "strictly increasing")])
def test_topk_decode_rejects_bad_indices(bad, what):
    q = gradq.build("topk:k=3")
    p = _forged(q, _vec(10), indices=torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(gradq.PayloadError, match=what):
        q.decode(p)


def test_topk_decode_rejects_wrong_field_sizes():
    q = gradq.build("topk:k=3")
    with pytest.raises(gradq.PayloadError, match="indices"):
        q.decode(_forged(q, _vec(10), indices=torch.tensor([1, 2], dtype=torch.int32)))
    with pytest.raises(gradq.PayloadError, match="indices"):
        q.decode(_forged(q, _vec(10), indices=torch.tensor([1, 2, 3], dtype=torch.int64)))


# -- Rand-K selection ------------------------------------------------------------------------------
def test_shared_random_indices_matches_reference_keys():
    # The documented construction, evaluated with the pure-Python hash: key_i = (signed bits_i << 32) | i.
    n, k, seed = 200, 17, 987654321

    def signed(b: int) -> int:
        return b - (1 << 32) if b >= (1 << 31) else b

    keys = sorted(((signed(hash32_reference(seed, i)) << 32) | i, i) for i in range(n))
    want = sorted(i for _, i in keys[:k])
    got = shared_random_indices(n, k, seed, "cpu")
    assert got.dtype == torch.int64 and got.tolist() == want


def test_shared_random_indices_basic_properties():
    a = shared_random_indices(1000, 50, 7)
    assert torch.equal(a, shared_random_indices(1000, 50, 7))          # same seed, same indices
    assert not torch.equal(a, shared_random_indices(1000, 50, 8))      # another seed, another set
    assert a.unique().numel() == 50 and bool((a[1:] > a[:-1]).all())   # distinct, sorted
    assert int(a.min()) >= 0 and int(a.max()) < 1000
    assert shared_random_indices(10, 0, 1).numel() == 0
    assert shared_random_indices(10, 10, 1).tolist() == list(range(10))
    with pytest.raises(ValueError):
        shared_random_indices(10, 11, 1)


def test_randk_selection_is_uniform_over_subsets():
    # n=6, k=2: 15 subsets, each of probability 1/15. S=6000 seeds give expected count E=400 per subset;
    # Pearson's X² ~ chi-square(14 dof): mean 14, sd sqrt(28)≈5.3. We allow mean + 6 sd ≈ 45.7
    # (p < 1e-6). A subset with probability off by 20% shifts X² by about (80²)/400 = 16 on its own,
    # and a systematic bias (e.g. index-ordered ties) far more.
    n, k, S = 6, 2, 6000
    counts = {c: 0 for c in itertools.combinations(range(n), k)}
    for s in range(S):
        counts[tuple(shared_random_indices(n, k, s).tolist())] += 1
    e = S / len(counts)
    x2 = sum((c - e) ** 2 / e for c in counts.values())
    dof = len(counts) - 1
    assert x2 <= dof + 6 * math.sqrt(2 * dof), (x2, counts)


def test_randk_marginals_are_uniform():
    # n=16, k=4, S=4000 seeds: coordinate i is kept c_i ~ Binomial(S, 1/4) times (E=1000,
    # sd = sqrt(S·p·(1-p)) ≈ 27.4). Bonferroni over 16 coordinates: allow 5 sd (p ≤ 16·5.7e-7).
    n, k, S = 16, 4, 4000
    counts = torch.zeros(n)
    for s in range(S):
        counts[shared_random_indices(n, k, 10_000 + s)] += 1
    p = k / n
    sd = math.sqrt(S * p * (1 - p))
    assert float((counts - S * p).abs().max()) <= 5 * sd, counts


def test_randk_selection_is_independent_of_the_data():
    q = gradq.build("randk:k=20")
    a, b = _vec(300, 1) + 10.0, -_vec(300, 2) * 1e-3 - 5.0   # no zeros, so the support is the selection
    pa, pb = q.encode(a, seed=1, shared_seed=42), q.encode(b, seed=2, shared_seed=42)
    sa, sb = q.decode(pa).nonzero().flatten(), q.decode(pb).nonzero().flatten()
    assert torch.equal(sa, sb) and torch.equal(sa, shared_random_indices(300, 20, 42))
    assert torch.equal(pa["values"], a[sa]) and torch.equal(pa["seed"], torch.tensor([42]))


def test_randk_seed_field_and_derived_seed():
    q = gradq.build("randk:k=5")
    x = _vec(100)
    # a seed using all 64 bits is stored as the int64 with the same bits and still decodes
    p = q.encode(x, seed=0, shared_seed=2**64 - 1)
    assert p["seed"].tolist() == [-1]
    assert torch.equal(q.decode(p).nonzero().flatten(), shared_random_indices(100, 5, 2**64 - 1))
    # no shared_seed: one is derived from the encode's seed (same seed, same bytes; another seed differs)
    assert q.encode(x, seed=3).same_bytes(q.encode(x, seed=3))
    assert not torch.equal(q.encode(x, seed=3)["seed"], q.encode(x, seed=4)["seed"])
    back = q.payload_from_bytes(p.to_bytes(), (100,))
    assert torch.equal(q.decode(back), q.decode(p))


def test_randk_nbytes_formula():
    for n, spec, k in [(1000, "randk", 10), (1000, "randk:k=7,rescale=1", 7), (4096, "randk:ratio=0.1", 410)]:
        q = gradq.build(spec)
        p = q.encode(_vec(n), seed=0)
        assert p.nbytes == len(p.to_bytes()) == q.expected_nbytes(n) == HEADER + 4 * k + 8


# -- Rand-K statistics -----------------------------------------------------------------------------
def test_randk_rescale_is_unbiased():
    q = gradq.build("randk:k=16,rescale=1")
    assert q.unbiased and not gradq.build("randk:k=16").unbiased
    # Tolerances of assert_unbiased (chi-square and max-|z| at 6 sd) are documented in gradq_testing.
    assert_unbiased(q, _vec(64, seed=5), trials=2000)


def test_randk_without_rescale_is_shrunk_by_k_over_n():
    # E[v̂_i] = p·x_i with p = K/n = 1/4; per-coordinate SE of the mean over N=2000 encodes is
    # |x_i|·sqrt(p(1-p)/N); we allow 5 SE (Bonferroni over 64 coordinates: p ≤ 64·5.7e-7).
    q = gradq.build("randk:k=16")
    x = _vec(64, seed=6)
    N, p = 2000, 16 / 64
    mean = torch.stack([q.roundtrip(x, seed=s) for s in range(N)]).double().mean(0)
    se = x.double().abs() * math.sqrt(p * (1 - p) / N)
    assert bool(((mean - p * x.double()).abs() <= 5 * se + 1e-12).all())


def test_randk_rescale_variance():
    # E‖v̂ − v‖² = (n/K − 1)·‖v‖² = 3‖v‖² here; the Monte-Carlo mean over 2000 seeds must be within
    # 5 of its standard errors.
    q = gradq.build("randk:k=16,rescale=1")
    x = _vec(64, seed=7)
    want = 3.0 * float((x.double() ** 2).sum())
    mean, se = mc_mean(lambda s: float(((q.roundtrip(x, seed=s) - x).double() ** 2).sum()), 2000)
    assert abs(mean - want) <= 5 * se, (mean, want, se)


# -- specs and errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,canon", [
    ("topk", "topk:ratio=0.01"), ("topk:ratio=0.01", "topk:ratio=0.01"), ("topk:k=5", "topk:k=5"),
    ("topk:k=5,ratio=none", "topk:k=5"), ("topk:ratio=1", "topk:ratio=1.0"),
    ("randk", "randk:ratio=0.01,rescale=0"), ("randk:k=3,rescale=1", "randk:k=3,rescale=1"),
])
def test_canonical_specs(spec, canon):
    q = gradq.build(spec)
    assert str(q) == canon and gradq.build(canon) == q


@pytest.mark.parametrize("spec,msg", [
    ("topk:k=3,ratio=0.1", "not both"), ("randk:k=3,ratio=0.1", "not both"),
    ("topk:ratio=0", r"\(0.0, 1.0\]"), ("topk:ratio=1.5", r"\(0.0, 1.0\]"),
    ("topk:k=0", r"\[1, inf\]"), ("randk:k=abc", "integer"), ("randk:rescale=2", "1/0"),
    ("topk:rescale=1", "valid: k, ratio, ef"),
])
def test_spec_errors(spec, msg):
    with pytest.raises(gradq.SpecError, match=msg):
        gradq.build(spec)


def test_decode_with_another_spec_is_refused():
    p = gradq.build("randk:k=4").encode(_vec(50), seed=0)
    with pytest.raises(gradq.PayloadError):
        gradq.build("randk:k=4,rescale=1").decode(p)
    with pytest.raises(gradq.PayloadError):
        gradq.build("topk:k=4").decode(p)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x = _vec(4096, seed=9)
    x[::7] = x[3]  # plenty of ties
    for spec in ("topk:k=300", "randk:k=300,rescale=1"):
        q = gradq.build(spec)
        a, b = q.encode(x, seed=1), q.encode(x.cuda(), seed=1)
        assert torch.equal(a.to_bytes(), b.to_bytes().cpu())
        assert torch.equal(q.decode(a), q.decode(b).cpu())


# -- decode into a caller's buffer ---------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "randk:ratio=0.05", "randk:ratio=0.05,rescale=1",
                                  "randk-maxnorm:ratio=0.05,bits=4", "randk-multiscale:ratio=0.05,bits=2+6"])
def test_sparse_decode_writes_zeros_and_the_kept_values_into_out(spec):
    """decode(p, out=t) into a buffer full of NaN: every unselected coordinate becomes 0, the kept
    ones hold the decode's values, and nothing input-sized is allocated on the way (the buffer is
    written in place: the kept values are at most K of n)."""
    q = gradq.build(spec)
    x = _vec(5000, 3)
    p = q.encode(x, seed=11, shared_seed=99) if q.needs_shared_seed else q.encode(x, seed=11)
    want = q.decode(p)
    out = torch.full((5000,), float("nan"))
    assert q.decode(p, out=out) is out
    assert torch.equal(out, want)
    kept = q.num_selected(5000) if hasattr(q, "num_selected") else q.count(5000)
    assert 0 < int((out != 0).sum()) <= kept


def test_a_corrupt_topk_payload_leaves_out_untouched():
    """An index out of range or out of order is refused before the caller's buffer is written."""
    q = gradq.build("topk:ratio=0.05")
    p = q.encode(_vec(1000, 4), seed=0)
    for bad in (1000, -1):
        fields = dict(p.fields)
        idx = fields["indices"].clone()
        idx[3] = bad
        fields["indices"] = idx
        out = torch.full((1000,), 7.0)
        with pytest.raises(gradq.PayloadError):
            q.decode(Payload(p.spec, p.shape, p.dtype, p.numel, fields), out=out)
        assert bool((out == 7.0).all()), bad


# -- the mean of several payloads ----------------------------------------------------------------
def _generic_mean(q, payloads):
    """Base's ``decode_mean``: a dense decode of each payload, added in list order, then ``/ M``."""
    acc = q.decode(payloads[0]).clone()
    for p in payloads[1:]:
        acc += q.decode(p)
    return acc.div_(len(payloads))


@pytest.fixture(params=["with a read", "on the device"])
def zero_signs(request, monkeypatch):
    """Both forms of the sparse mean's signed-zero step: the CPU's (one host read) and the GPU's
    (lookups, no read), the latter swapped in for the CPU here."""
    from gradq.kernels import reference

    if request.param == "on the device":
        monkeypatch.setattr(reference, "sparse_mean_zero_signs", reference.sparse_mean_zero_signs_on_device)
    return request.param


@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "topk:ratio=0.9", "topk:k=1", "topk:ratio=1"])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_topk_decode_mean_is_the_generic_sum_bit_for_bit(spec, m, zero_signs):
    """Payloads that overlap in part, with signed zeros among the kept values (nine in ten values
    are ±0.0, so ratio=0.9 keeps many): the sparse mean equals the dense sum's bits, −0.0 included,
    with either form of its signed-zero step."""
    q = gradq.build(spec)
    payloads = []
    for j in range(m):
        x = _vec(3000, seed=20 + j)
        x[torch.rand(3000, generator=torch.Generator().manual_seed(j)) < 0.9] = 0.0
        x[::2] *= -1.0                                   # -0.0 at the even zeros of every payload
        payloads.append(q.encode(x, seed=j))
    want = _generic_mean(q, payloads)
    got = q.decode_mean(payloads, out=torch.full((3000,), float("nan")))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    if m > 1 and spec == "topk:ratio=0.9":
        # the case the mean must get right is here: adding each later payload at its positions only
        # leaves a −0.0 of the first payload where the dense sum added a later payload's +0.0
        naive = torch.zeros(3000)
        for j, p in enumerate(payloads):
            idx, v = p.fields["indices"].long(), p.fields["values"]
            if j == 0:
                naive[idx] = v
            else:
                naive.index_add_(0, idx, v)
        assert not torch.equal(naive.div_(m).view(torch.int32), want.view(torch.int32))


def test_a_corrupt_payload_in_a_topk_mean_leaves_out_untouched():
    q = gradq.build("topk:ratio=0.05")
    good = q.encode(_vec(1000, 5), seed=0)
    p = q.encode(_vec(1000, 6), seed=1)
    fields = dict(p.fields)
    fields["indices"] = fields["indices"].flip(0).contiguous()
    bad = Payload(p.spec, p.shape, p.dtype, p.numel, fields)
    out = torch.full((1000,), 7.0)
    with pytest.raises(gradq.PayloadError, match="strictly increasing"):
        q.decode_mean([good, bad], out=out)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("spec", ["randk:ratio=0.05", "randk:ratio=0.9,rescale=1", "randk:k=1"])
@pytest.mark.parametrize("seeds", ["shared", "each its own", "two"])
def test_randk_decode_mean_is_the_generic_sum_and_selects_once_a_seed(monkeypatch, spec, seeds, zero_signs):
    """Bit for bit the dense sum (signed zeros among the values), with the coordinates of each
    distinct shared seed selected once: the DDP hook's workers share one seed, so one selection."""
    import gradq.quantizers.sparse as sparse

    q = gradq.build(spec)
    # (three payloads that share a seed: a mean over M = 3 is not a product by 1/M; four of two seeds)
    shared = {"shared": [7] * 3, "each its own": [7, 8, 9, 10], "two": [7, 8, 7, 8]}[seeds]
    payloads = []
    for j, s in enumerate(shared):
        x = _vec(3000, seed=30 + j)
        x[torch.rand(3000, generator=torch.Generator().manual_seed(j)) < 0.9] = 0.0
        x[::2] *= -1.0
        payloads.append(q.encode(x, seed=j, shared_seed=s))
    want = _generic_mean(q, payloads)
    calls = []
    real = sparse.shared_random_indices
    monkeypatch.setattr(sparse, "shared_random_indices", lambda *a: calls.append(a) or real(*a))
    got = q.decode_mean(payloads, out=torch.full((3000,), float("nan")))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert len(calls) == len(set(shared) - {shared[-1]})   # (q's last encode's selection is kept)


def test_the_signed_zero_step_without_a_read_is_the_one_with_a_read():
    """Edge cases of the two forms: one payload, a later payload with no positions, later payloads
    that are the first's own positions (RandK's shared seed), and positions at both ends."""
    from gradq.kernels import reference

    g = torch.Generator().manual_seed(4)
    n = 64
    for trial in range(40):
        m = 1 + trial % 4
        idxs, vals = [], []
        for j in range(m):
            if j and trial % 5 == 0:
                idx = idxs[0]                               # (the same object: a shared selection)
            elif j and trial % 7 == 0:
                idx = torch.empty(0, dtype=torch.int64)
            else:
                idx = torch.sort(torch.randperm(n, generator=g)[:1 + trial % n]).values
            v = torch.randint(-1, 2, (idx.numel(),), generator=g).float() * 0.0   # ±0.0
            v[torch.rand(idx.numel(), generator=g) < 0.3] = 1.5
            idxs.append(idx)
            vals.append(v)
        base = torch.zeros(n)
        base[idxs[0]] = vals[0]
        a, b = base.clone(), base.clone()
        reference.sparse_mean_zero_signs(a, idxs, vals)
        reference.sparse_mean_zero_signs_on_device(b, idxs, vals)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), trial


def test_the_mean_benchmark_runs_and_checks_its_bits(capsys):
    """``benchmarks/bench_mean.py`` on a small vector: it compares decode_mean with the dense mean
    (and exits on a difference) before it times anything."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "bench_mean.py")
    spec = importlib.util.spec_from_file_location("bench_mean", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--n", "20000", "--payloads", "1", "3", "--repeats", "1", "--spec", "topk:ratio=0.5",
                "--spec", "randk:k=7"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| topk") or
            line.startswith("| randk")]
    assert len(rows) == 4


# -- error feedback's residual --------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["ef(topk:ratio=0.3)", "ef(topk:k=1)", "ef(randk:ratio=0.3)",
                                  "ef(randk:ratio=0.3,rescale=1)"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_error_feedback_residual_without_a_dense_decode(monkeypatch, spec, layout):
    """The residual ``u − decode(Q(u))`` from the kept positions only is bit for bit the dense one,
    step after step (signed zeros among the gradients); a transposed gradient takes the dense way."""
    fast, dense = gradq.build(spec), gradq.build(spec)
    monkeypatch.setattr(dense.inner, "subtract_decode_", lambda u, p, **kw: False)
    decodes = []
    real = fast.inner.decode
    monkeypatch.setattr(fast.inner, "decode", lambda *a, **k: decodes.append(1) or real(*a, **k))
    for step in range(3):
        x = _vec(60 * 50, seed=40 + step).reshape(60, 50)
        x[x.abs() < 0.5] = 0.0
        x[::2] *= -1.0
        if layout == "transposed":
            x = x.t()
        a = fast.encode(x, seed=step, shared_seed=9 + step, name="w")
        b = dense.encode(x, seed=step, shared_seed=9 + step, name="w")
        assert a.same_bytes(b)
        ra, rb = fast.residuals["w"], dense.residuals["w"]
        assert torch.equal(ra.view(torch.int32), rb.view(torch.int32)), step
    assert (decodes == []) == (layout == "contiguous")


def test_randk_decodes_its_own_payload_without_selecting_again(monkeypatch):
    import gradq.quantizers.sparse as sparse

    q = gradq.build("randk:ratio=0.1")
    x = _vec(5000, seed=50)
    p = q.encode(x, seed=0, shared_seed=11)
    other = gradq.build("randk:ratio=0.1").encode(x, seed=0, shared_seed=12)
    calls = []
    real = sparse.shared_random_indices
    monkeypatch.setattr(sparse, "shared_random_indices", lambda *a: calls.append(a) or real(*a))
    want = gradq.build("randk:ratio=0.1").decode(p)
    assert len(calls) == 1                                    # (a fresh quantizer selects)
    assert torch.equal(q.decode(p), want) and len(calls) == 1   # (the encoder does not)
    q.decode(other)
    assert len(calls) == 2


class _FieldReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators that bring a value of the payloads' fields to the host (on a GPU, each
    waits for the device); values the decode made on the host are not counted."""

    def __init__(self, payloads):
        super().__init__()
        self.fields = {f.untyped_storage().data_ptr() for p in payloads for f in p.fields.values()}
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("_local_scalar_dense", "item", "equal", "is_nonzero"):
            self.reads += any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.fields
                              for a in args)
        return func(*args, **(kwargs or {}))


SEEDED = ["randk:ratio=0.01", "randk:k=50,rescale=1", "randk-maxnorm:ratio=0.05,bits=4",
          "randk-multiscale:ratio=0.05,bits=2+6", "ef(randk:ratio=0.02)"]


@pytest.mark.parametrize("spec", SEEDED)
def test_decode_under_the_known_shared_seed_reads_no_seed_field(spec):
    """``decode`` / ``decode_mean`` with ``shared_seed=`` (as the protocols decode): the decodes of
    the payload's own seed bit for bit, with no host read inside ``deferred_checks`` (where the plain
    decode reads the field); and :meth:`implied_shared_seed` is the seed an encode without one drew."""
    from gradq import kernels

    n = 4_001
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(j)) for j in range(3)]
    q = gradq.build(spec)
    ps = [q.encode(x, seed=j, shared_seed=77) for j, x in enumerate(xs)]
    assert torch.equal(q.decode(ps[0], shared_seed=77), q.decode(ps[0]))
    into = torch.full((n,), float("nan"))
    assert q.decode(ps[1], out=into, shared_seed=77) is into and torch.equal(into, q.decode(ps[1]))
    assert torch.equal(q.decode_mean(ps, shared_seed=77), q.decode_mean(ps))
    for given in (True, False):
        with kernels.deferred_checks() as checks, _FieldReads(ps) as mode:
            q.decode(ps[2], out=into, shared_seed=77 if given else None)
            q.decode_mean(ps, out=into, shared_seed=77 if given else None)
        assert (mode.reads == 0) == given, (given, mode.reads)   # (the plain decodes read the field)
        checks.check()
    own = q.encode(xs[0], seed=5)   # (no shared seed: the encode draws one and sends it)
    assert torch.equal(q.decode(own, shared_seed=q.implied_shared_seed(5)), q.decode(own))


@pytest.mark.parametrize("spec", SEEDED[:3])
def test_a_seed_field_other_than_the_given_seed_is_refused(spec):
    """A payload whose seed field is not the shared seed the caller gives: refused before ``out`` is
    written (a host read, as the plain decode's own read of the field), or counted inside
    ``deferred_checks``, whose check then refuses the step."""
    from gradq import kernels
    from gradq.errors import PayloadError

    n = 2_003
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    q = gradq.build(spec)
    p = q.encode(x, seed=1, shared_seed=77)
    into = torch.full((n,), float("nan"))
    with pytest.raises(PayloadError, match="seed field"):
        q.decode(p, out=into, shared_seed=78)
    assert torch.isnan(into).all()
    with pytest.raises(PayloadError, match="seed field"):
        q.decode_mean([p, p], shared_seed=78)
    with kernels.deferred_checks() as checks:
        q.decode(p, out=into, shared_seed=78)
    with pytest.raises(PayloadError, match="shared seeds"):
        checks.check()


def test_schemes_without_a_seed_field_ignore_the_shared_seed():
    x = torch.randn(1_000, generator=torch.Generator().manual_seed(2))
    for spec in ("qsgd:bits=4,bucket=64", "topk:ratio=0.1", "maxnorm:bits=4"):
        q = gradq.build(spec)
        p = q.encode(x, seed=3)
        assert torch.equal(q.decode(p, shared_seed=9), q.decode(p))
        assert torch.equal(q.decode_mean([p, p], shared_seed=9), q.decode_mean([p, p]))
