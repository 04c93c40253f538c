"""One conformance suite over every registered quantizer (and a few non-default variants).

Each property here must hold for every scheme: shape/dtype kept, determinism under a seed, honest
``nbytes``, byte round trips, zero in → zero out, clear errors on NaN/Inf and on a foreign payload,
canonical spec round trips, unbiasedness where claimed, and — for summable schemes — that the sum of
the workers' integer codes decodes to the mean of their decoded tensors.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import gradq
from gradq import NonFiniteError, PayloadError
from gradq_testing import assert_unbiased

#: non-default variants that exercise other code paths of each family
VARIANTS = [
    "qsgd:bits=2,bucket=128", "qsgd:bits=8,bucket=none,norm=l2", "qsgd:levels=5,bucket=7",
    "maxnorm:bits=2,bucket=16,norm=l2", "terngrad:clip=none,pack=2bit", "terngrad:bucket=10",
    "multiscale:bits=2+4+6,bucket=32", "multiscale:bits=4,norm=l2",
    "randk-maxnorm:ratio=0.5,rescale=1", "randk-multiscale:k=20,rescale=1",
    "orq:levels=3,bucket=16", "orq:levels=17", "linear:levels=9,bucket=24",
    "bingrad-pb:bucket=none", "bingrad-b:iters=3,bucket=9", "signsgd:bucket=none", "onebit:ef=0,bucket=16",
    "topk:k=5", "randk:ratio=0.5,rescale=1", "ef(qsgd:bits=2)", "qsgd:bits=3,ef=1",
    "qsgd:coding=elias", "qsgd:levels=1000,bucket=none,norm=l2,coding=elias-dense", "qsgd:bits=2,coding=elias-sparse",
] + (["qsgd:bits=2,coding=ans"] if importlib.util.find_spec("constriction") else [])  # optional package

ALL_SPECS = sorted(gradq.available()) + VARIANTS
UNBIASED_SPECS = [s for s in ALL_SPECS if gradq.build(s).unbiased]
SUMMABLE_SPECS = [s for s in ALL_SPECS if gradq.build(s).summable]


def _fresh(spec: str):
    return gradq.build(spec)


def _data(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))  # heavy-ish tails
    return x.to(dtype)


@pytest.fixture(params=ALL_SPECS)
def spec(request) -> str:
    return request.param


def test_claims_cover_the_papers():
    """The property lists above are not vacuous: the schemes the papers call unbiased / all-reduce
    compatible are among them."""
    assert {"qsgd", "maxnorm", "multiscale", "orq", "linear", "none"} <= set(UNBIASED_SPECS)
    assert {"maxnorm", "multiscale", "terngrad", "randk-maxnorm", "randk-multiscale"} <= set(SUMMABLE_SPECS)


def test_every_family_is_registered():
    expected = {"none", "fp16", "bf16", "qsgd", "terngrad", "maxnorm", "multiscale", "randk-maxnorm",
                "randk-multiscale", "orq", "linear", "bingrad-pb", "bingrad-b", "signsgd", "onebit", "topk",
                "randk"}
    assert expected <= set(gradq.available())


@pytest.mark.parametrize("shape", [(1,), (37,), (16, 33), (2, 3, 5, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_shape_dtype_device_kept(spec, shape, dtype):
    q = _fresh(spec)
    x = _data(shape, dtype)
    y = q.roundtrip(x, seed=3, name="w")
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert torch.isfinite(y).all()


def test_canonical_spec_round_trip(spec):
    q = _fresh(spec)
    again = gradq.build(str(q))
    assert again == q and str(again) == str(q)
    assert gradq.build(str(again)).spec == q.spec


def test_same_seed_same_bytes(spec):
    x = _data((1000,))
    a = _fresh(spec).encode(x, seed=11)
    b = _fresh(spec).encode(x, seed=11)
    assert a.same_bytes(b)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert _fresh(spec).encode(x, generator=g1).same_bytes(_fresh(spec).encode(x, generator=g2))
    torch.manual_seed(7)
    c = _fresh(spec).encode(x)
    torch.manual_seed(7)
    assert c.same_bytes(_fresh(spec).encode(x))


def test_zero_in_zero_out(spec):
    for n in (1, 5, 1000):
        x = torch.zeros(n)
        y = _fresh(spec).roundtrip(x, seed=0)
        assert torch.equal(y, torch.zeros(n)), f"{spec}: zero input gave {y[:5]}"


def test_empty_tensor(spec):
    q = _fresh(spec)
    x = torch.zeros(0, 3)
    p = q.encode(x, seed=0)
    assert q.decode(p).shape == (0, 3)
    assert p.nbytes == len(p.to_bytes())


@pytest.mark.parametrize("n", [1, 7, 128, 1000, 4099])
def test_nbytes_is_honest(spec, n):
    q = _fresh(spec)
    x = _data((n,), seed=n)
    p = q.encode(x, seed=1)
    raw = p.to_bytes()
    assert raw.dtype == torch.uint8 and raw.numel() == p.nbytes
    assert p.nbytes == p.header_nbytes + sum(t.numel() * t.element_size() for t in p.fields.values())
    expected = q.expected_nbytes(n)
    if expected is not None:
        assert p.nbytes == expected


def test_bytes_round_trip(spec):
    q = _fresh(spec)
    x = _data((12, 50), seed=2)
    p = q.encode(x, seed=4)
    back = _fresh(spec).payload_from_bytes(p.to_bytes(), x.shape, x.dtype)
    assert torch.equal(_fresh(spec).decode(back), q.decode(p))


def test_bytes_round_trip_without_copy(spec):
    """copy=False parses into views of the buffer where aligned; the decode is the same, and a
    byte-sized field really shares the buffer's memory."""
    q = _fresh(spec)
    x = _data((9, 70), seed=3)
    p = q.encode(x, seed=5)
    buf = torch.cat([torch.zeros(3, dtype=torch.uint8), p.to_bytes()])[3:]  # an odd start address
    back = q.payload_from_bytes(buf, x.shape, x.dtype, copy=False)
    assert torch.equal(q.decode(back), q.decode(p))
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for t in back.fields.values():
        if t.numel() and t.element_size() == 1:
            assert lo <= t.data_ptr() < hi


@pytest.mark.parametrize("fixed_spec", [s for s in ALL_SPECS if gradq.build(s).field_layout(600) is not None])
def test_bytes_on_a_device_parse_by_the_fixed_layout(fixed_spec):
    """Wire bytes off the host parse without a header read where the layout is fixed (as the DDP hook
    parses CUDA payloads); a ``meta`` buffer, which holds no data, proves that nothing is read. The
    fields have the dtypes and counts of the host parse."""
    q = _fresh(fixed_spec)
    x = _data((12, 50), seed=2)
    p = q.encode(x, seed=4)
    back = q.payload_from_bytes(torch.empty(p.nbytes, dtype=torch.uint8, device="meta"), x.shape, x.dtype)
    host = q.payload_from_bytes(p.to_bytes(), x.shape, x.dtype)
    assert [(k, t.dtype, t.numel()) for k, t in back.fields.items()] == \
        [(k, t.dtype, t.numel()) for k, t in host.fields.items()]
    assert all(t.device.type == "meta" for t in back.fields.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_mean_is_the_loop(spec, dtype):
    """decode_mean = ((d0 + d1) + d2) / 3 in the payloads' dtype, bit for bit, for payloads parsed
    from one receive buffer (the scatter protocol's case) and for separate ones; out= is honoured."""
    q = _fresh(spec)
    ps = [q.encode(_data((7, 61), dtype, seed=10 + j), seed=j) for j in range(3)]
    buf = torch.cat([p.to_bytes() for p in ps])
    sizes = [p.nbytes for p in ps]
    parsed = [q.payload_from_bytes(b, (7, 61), dtype, copy=False) for b in torch.split(buf, sizes)]
    want = q.decode(ps[0]).clone()  # (decode may return a view of the payload, e.g. for none)
    for p in ps[1:]:
        want += q.decode(p)
    want /= 3
    for group in (parsed, ps):
        assert torch.equal(q.decode_mean(group), want)
    out = torch.full((7, 61), 5.0, dtype=dtype)
    assert q.decode_mean(parsed, out=out) is out
    assert torch.equal(out, want)
    assert torch.equal(q.decode_mean(ps[:1]), q.decode(ps[0]))
    with pytest.raises(ValueError, match="non-empty sequence"):
        q.decode_mean([])
    with pytest.raises(ValueError, match="one shape"):
        q.decode_mean([ps[0], _fresh(spec).encode(_data((61, 7), dtype), seed=0)])
    with pytest.raises(ValueError, match="out= must have"):
        q.decode_mean(ps, out=torch.empty(7 * 61, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_into_out(spec, dtype):
    """decode(p, out=t) writes the same values into t (and returns it); a wrong shape is refused."""
    q = _fresh(spec)
    x = _data((30, 41), dtype, seed=5)
    p = q.encode(x, seed=2)
    out = torch.full_like(x, 7.0)
    assert q.decode(p, out=out) is out
    assert torch.equal(out, q.decode(p))
    with pytest.raises(ValueError, match="out= must have shape"):
        q.decode(p, out=torch.empty(30 * 41, dtype=dtype))


def test_foreign_payload_is_refused(spec):
    q = _fresh(spec)
    other = gradq.build("qsgd:bits=5") if not spec.startswith("qsgd:bits=5") else gradq.build("none")
    p = other.encode(_data((300,)), seed=0)
    with pytest.raises(PayloadError, match="encoded by"):
        q.decode(p)
    with pytest.raises(PayloadError):
        q.payload_from_bytes(p.to_bytes(), (300,))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_refused(spec, bad):
    x = _data((64,))
    x[17] = bad
    with pytest.raises(NonFiniteError, match="layer3.weight"):
        _fresh(spec).encode(x, seed=0, name="layer3.weight")


#: the schemes whose encode must skip its check under check_finite=False (the DDP hook's encodes):
#: every fixed-width scheme with its own scale, whose payload shows a NaN/Inf (see _nonfinite_witness),
#: Top-K, whose kept values hold any NaN/Inf of x (their magnitudes rank above every finite one), and
#: the Rand-K family, whose kernels only carry a selected NaN/Inf, and the casts, which only carry
#: one (runs_on_nonfinite)
SKIPPING = {"qsgd", "maxnorm", "terngrad", "multiscale", "orq", "linear", "signsgd", "onebit", "bingrad-b", "topk",
            "randk", "randk-maxnorm", "randk-multiscale", "none", "fp16", "bf16"}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_encode_without_the_check(spec, bad):
    """``check_finite=False``: finite input gives the same bytes as the checked encode; non-finite
    input still raises in the schemes that do not claim to run on it harmlessly, and in the others
    gives a payload of the promised size without a look at the data (no error)."""
    q = _fresh(spec)
    x = _data((300,))
    assert q.encode(x, seed=4, name="w", check_finite=False).same_bytes(_fresh(spec).encode(x, seed=4, name="w"))
    x[123] = bad
    q = _fresh(spec)
    if not q.skips_finite_check(x):
        with pytest.raises(NonFiniteError, match="layer3.weight"):
            q.encode(x, seed=0, name="layer3.weight", check_finite=False)
        return
    try:
        p = q.encode(x, seed=0, name="layer3.weight", check_finite=False)
    except NonFiniteError as e:   # (a kernel may find NaN/Inf itself at no cost: the error still names x)
        assert "layer3.weight" in str(e)
    else:
        assert p.numel == x.numel() and q.expected_nbytes(300) == p.nbytes


def test_the_hook_schemes_skip_the_check():
    """The list above is what the quantizers claim (not vacuous either way)."""
    x = _data((300,))
    for name in gradq.available():
        q = gradq.build(name)
        assert q.skips_finite_check(x) == (name.split(":")[0] in SKIPPING), name
    assert not gradq.build("maxnorm").skips_finite_check(x, {"scale": torch.ones(1)})  # a shared scale: checked


def test_non_float_input_is_refused(spec):
    with pytest.raises(TypeError, match="floating-point"):
        _fresh(spec).encode(torch.arange(10), seed=0)


@pytest.mark.parametrize("spec", UNBIASED_SPECS)
def test_unbiased_where_claimed(spec):
    q = _fresh(spec)
    x = _data((48,), seed=9)
    x[5] = 0.0  # an exact zero must stay unbiased too
    trials = 1500 if q.needs_shared_seed else 2500
    assert_unbiased(q, x, trials=trials)


@pytest.mark.parametrize("spec", SUMMABLE_SPECS)
def test_summed_codes_decode_to_the_mean(spec):
    """M workers: reduce shared stats with their op, encode codes, SUM them, decode once.
    Must equal the mean of the workers' own decodes under the same shared stats (float rounding)."""
    q = _fresh(spec)
    M, n = 4, 300
    xs = [_data((n,), seed=100 + m) * (m + 1) for m in range(M)]
    shared_seed = 1234 if q.needs_shared_seed else None
    stats = [q.shared_stats(x, shared_seed=shared_seed, name="p") for x in xs]
    reduced = {}
    for key, st in stats[0].items():
        vals = torch.stack([s[key].value for s in stats])
        op = st.op
        reduced[key] = {"max": vals.amax(0), "min": vals.amin(0), "sum": vals.sum(0)}[op]
    codes = [q.encode_codes(x, shared=reduced, seed=m, shared_seed=shared_seed, name="p")
             for m, x in enumerate(xs)]
    if q.max_code is not None:
        for c in codes:
            assert int(c.abs().max()) <= q.max_code
    total = torch.stack(codes).sum(0)
    avg = q.decode_codes(total, shared=reduced, count=M, like=xs[0], shared_seed=shared_seed)
    each = [q.decode_codes(c, shared=reduced, count=1, like=xs[0], shared_seed=shared_seed) for c in codes]
    ref = torch.stack(each).mean(0)
    # integer codes add exactly; float codes (casts) add in their own dtype, so allow M roundings
    eps = torch.finfo(codes[0].dtype).eps if codes[0].is_floating_point() else 1e-6
    tol = 4 * M * eps * float(torch.stack(xs).abs().max())
    assert torch.allclose(avg, ref, atol=tol, rtol=1e-5)
    # and each worker's codes under shared stats decode close to its input on average (sanity)
    assert avg.shape == xs[0].shape


@pytest.mark.parametrize("spec", SUMMABLE_SPECS + ["ef(maxnorm:bits=2,bucket=16)"])
def test_summable_entry_points_without_the_check(spec, monkeypatch):
    """``check_finite=False`` on ``shared_stats``, ``encode_codes`` and ``encode_fields`` (the
    shared-scale all-reduce in the DDP hook): the same statistics and codes, with no screen of the
    input where the scheme skips the check (the screen replaced by a function that fails), and the
    screen as before where it does not (Rand-K)."""
    from gradq.quantizers import base

    x = _data((300,), seed=7)
    ss = 99 if _fresh(spec).needs_shared_seed else None
    q = _fresh(spec)
    stats = {k: st.value for k, st in q.shared_stats(x, shared_seed=ss, name="p").items()}
    want = q.encode_codes(x, shared=stats, seed=3, shared_seed=ss, name="p")
    fields = getattr(q, "encode_fields", None)
    # (a fresh quantizer for the fields: error feedback's encode_codes has just moved its residual)
    want_f = _fresh(spec).encode_fields(x, shared=stats, seed=3, shared_seed=ss, name="p") if fields else None

    def screen(v, name=None):
        raise AssertionError("the up-front screen ran")

    q = _fresh(spec)
    with monkeypatch.context() as m:
        m.setattr(base, "check_finite", screen)
        if not q.skips_finite_check(x):
            with pytest.raises(AssertionError, match="up-front screen"):
                q.shared_stats(x, shared_seed=ss, name="p", check_finite=False)
            return
        got = {k: st.value for k, st in q.shared_stats(x, shared_seed=ss, name="p", check_finite=False).items()}
        codes = q.encode_codes(x, shared=got, seed=3, shared_seed=ss, name="p", check_finite=False)
        got_f = fields and _fresh(spec).encode_fields(x, shared=got, seed=3, shared_seed=ss, name="p",
                                                      check_finite=False)
    assert got.keys() == stats.keys() and all(torch.equal(got[k], stats[k]) for k in got)
    assert torch.equal(codes, want)
    assert (want_f is None and got_f is None) or torch.equal(got_f, want_f)


def test_error_feedback_identity(spec):
    """For ef(q): decode(encode(x)) + new residual == x + old residual, every step."""
    q = _fresh(spec)
    ef = q if isinstance(q, gradq.ErrorFeedback) else gradq.ErrorFeedback(q)
    old = torch.zeros(200)
    for step in range(3):
        x = _data((200,), seed=step)
        y = ef.roundtrip(x, seed=step, name="w")
        new = ef.residuals["w"]
        assert torch.allclose(y.float() + new, x + old, atol=1e-5 * float((x + old).abs().max() + 1))
        old = new.clone()
