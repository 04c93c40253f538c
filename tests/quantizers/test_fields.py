"""SummableQuantizer.encode_fields / decode_field_sum: the fused uint8 path of the integer all-reduce."""

import pytest
import torch

import gradq
from gradq import kernels
from gradq_testing import HostReads, NewStorage

SPECS = ["maxnorm:bits=4", "maxnorm:bits=2,bucket=64", "maxnorm:bits=8,bucket=100", "terngrad",
         "terngrad:bucket=512,clip=none", "terngrad:clip=1.5,bucket=37", "randk-maxnorm:ratio=0.3,bits=4",
         "randk-maxnorm:k=7,bits=2,norm=l2,rescale=1", "multiscale", "multiscale:bits=3+5+8,bucket=64,norm=l2",
         "randk-multiscale:ratio=0.3", "randk-multiscale:k=7,bits=3+6,rescale=1"]
SEED = 11   # (the shared seed: the RandK variants select their coordinates from it; the others ignore it)


def reduced(stats: list) -> dict:
    """The workers' statistics reduced as the all-reduce protocol reduces them (MAX scales, MIN
    MultiScale indices)."""
    return {k: getattr(torch.stack([s[k].value for s in stats]), "a" + stats[0][k].op)(0) for k in stats[0]}


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
    shared = reduced(stats)
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
    shared = reduced(stats)
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


@pytest.mark.parametrize("spec", ["maxnorm:bits=4,bucket=64", "terngrad:bucket=100", "multiscale:bucket=64",
                                  "randk-multiscale:ratio=0.5"])
def test_every_backend_gives_the_same_fields(spec):
    """The fields come from gradq.kernels on every backend (the torch reference too), bit for bit;
    the GlobalRandK variants have them (their sub-vector's)."""
    q = gradq.build(spec)
    x = workers(1000, 1)[0]
    fast = q.encode_fields(x, seed=0, shared_seed=SEED)
    was = kernels.get_backend()
    kernels.set_enabled(False)
    try:
        ref = q.encode_fields(x, seed=0, shared_seed=SEED)
    finally:
        kernels.set_backend(was)
    assert ref is not None and torch.equal(ref, fast)
    assert gradq.build("randk-maxnorm").encode_fields(torch.randn(100), seed=0, shared_seed=1).numel() == 1
    assert gradq.build("randk-multiscale").encode_fields(torch.randn(100), seed=0, shared_seed=1).numel() == 1


#: the kernel each scheme's own statistics take a pass over the tensor with
OWN_PASS = {"maxnorm:bits=4,bucket=64": "maxabs_scales", "terngrad:bucket=100": "terngrad_stats",
            "ef(maxnorm:bits=4)": "maxabs_scales", "ef(terngrad)": "terngrad_stats",
            "multiscale:bits=2+6,bucket=64": "maxabs_scales", "multiscale:bits=2+6,norm=l2": "l2_scales",
            "randk-multiscale:ratio=0.25": "subset_norm", "ef(multiscale)": "maxabs_scales"}


@pytest.mark.parametrize("spec", list(OWN_PASS))
def test_own_statistics_are_neither_recomputed_nor_checked(spec, monkeypatch):
    """``own=`` (the all-reduce protocol's own ``shared_stats`` of the tensor): no check of the shared
    scale against them, which is a host read (on a GPU a wait), and no second pass for them: MaxNorm
    and MultiScale do not compute their norms again (Rand-K-MultiScale those of its subset), nor
    TernGrad its σ, clip bound and scales (the bound rides in the statistics' ``aux``). Without
    ``own`` a shared scale below the worker's own is still refused; ``own`` without ``shared`` is
    refused."""
    q = gradq.build(spec)
    xs = workers(5000, 2)
    kw = {"shared_seed": SEED} if q.needs_shared_seed else {}
    stats = [q.shared_stats(x, check_finite=False, **kw) for x in xs]
    shared = reduced(stats)
    passes = []
    name = OWN_PASS[spec]
    real = getattr(kernels, name)
    monkeypatch.setattr(kernels, name, lambda *a: passes.append(1) or real(*a))

    def encode(q, x=xs[0], **more):   # as the all-reduce protocol does: the fields where the scheme has them
        fields = q.encode_fields(x, seed=3, check_finite=False, **kw, **more)
        return fields if fields is not None else q.encode_codes(x, seed=3, check_finite=False, **kw, **more)

    with HostReads() as without:
        want = encode(q, shared=shared)
    calls, passes[:] = len(passes), []
    q = gradq.build(spec)   # (error feedback's state moved on: a fresh one, as the first was)
    with HostReads() as given:
        got = encode(q, shared=shared, own=stats[0])
    assert torch.equal(got, want)
    assert without.reads >= 1 and given.reads == 0, (without.reads, given.reads)
    assert calls == 1 and not passes
    low = {k: v / 2 if k == "scale" else v for k, v in shared.items()}
    with pytest.raises(ValueError, match="below this worker's own"):
        encode(q, xs[1], shared=low)
    with pytest.raises(ValueError, match="pass both"):
        encode(q, xs[1], own=stats[1])


@pytest.mark.parametrize("spec", ["maxnorm", "terngrad", "multiscale", "randk-maxnorm", "randk-multiscale", "fp16",
                                  "bf16", "none", "ef(multiscale)", "ef(fp16)", "maxnorm:bits=8"])
def test_has_fields_says_whether_encode_fields_gives_them(spec):
    """``has_fields`` (what the hook's and the performance model's byte counts use) is what
    ``encode_fields`` does: fields for the integer schemes with a fused path, None for casts."""
    q = gradq.build(spec)
    x = workers(100, 1)[0]
    stats = q.shared_stats(x, shared_seed=SEED)
    fields = q.encode_fields(x, shared=reduced([stats]), seed=0, shared_seed=SEED)
    assert q.has_fields == (fields is not None) and q.has_fields == (spec not in ("fp16", "bf16", "none", "ef(fp16)"))


@pytest.mark.parametrize("spec", ["maxnorm:bits=4,bucket=64", "terngrad:bucket=512", "multiscale",
                                  "randk-maxnorm:ratio=0.05", "randk-multiscale:ratio=0.05"])
def test_field_sum_decodes_into_out_without_a_tensor_of_its_size(spec):
    """``decode_field_sum(out=)``: the mean of the fields of :func:`test_field_sum_decodes_to_the_mean`
    written into ``out`` (a 2-D float32 tensor) and returned shaped like ``like``, without any
    tensor a tenth of its size (a fresh one costs its page faults on a CPU); an ``out`` it cannot
    write into is refused."""
    n, m = 30_000, 3
    q = gradq.build(spec)
    xs = workers(n, m)
    stats = [q.shared_stats(x, shared_seed=SEED) for x in xs]
    shared = reduced(stats)
    total = torch.stack([q.encode_fields(x, shared=shared, seed=r, shared_seed=SEED)
                         for r, x in enumerate(xs)]).sum(0).to(torch.uint8)
    want = q.decode_field_sum(total, shared=shared, count=m, like=xs[0], shared_seed=SEED)
    out = torch.full((100, 300), float("nan"))
    with NewStorage() as made:
        got = q.decode_field_sum(total, shared=shared, count=m, like=xs[0], shared_seed=SEED, out=out)
    assert got.shape == xs[0].shape and got.data_ptr() == out.data_ptr() and torch.equal(got, want)
    assert made.largest < 4 * n // 10, made.largest
    for bad in (torch.empty(n, dtype=torch.float64), torch.empty(n + 1), torch.empty(2 * n)[::2]):
        with pytest.raises(ValueError, match="out= must be"):
            q.decode_field_sum(total, shared=shared, count=m, like=xs[0], shared_seed=SEED, out=bad)


@pytest.mark.parametrize("spec", ["none", "bf16"])
def test_casts_unchecked_read_nothing_on_the_host(spec):
    """A cast only carries a NaN or Inf: with ``check_finite=False`` (the hook screened ``x``) its
    statistics, codes and payload take no screen, which is a host read (a wait on a GPU); checked,
    they do. (fp16 still reads its largest magnitude, to refuse one it cannot hold.)"""
    q = gradq.build(spec)
    x = workers(1000, 1)[0]

    def calls(check: bool) -> int:
        with HostReads() as r:
            st = q.shared_stats(x, check_finite=check)
            q.encode_codes(x, shared={k: s.value for k, s in st.items()}, seed=1, check_finite=check, own=st)
            q.encode(x, seed=1, check_finite=check)
        return r.reads
    assert calls(False) == 0 and calls(True) == 3


@pytest.mark.parametrize("spec", ["maxnorm:bits=4,bucket=64", "maxnorm:bits=2", "terngrad:bucket=100", "terngrad",
                                  "multiscale:bucket=64", "multiscale:bits=3+5+8", "randk-maxnorm:ratio=0.3",
                                  "randk-multiscale:k=7", "ef(multiscale)", "none", "bf16"])
@pytest.mark.parametrize("n", [0, 1, 37, 5000])
def test_stat_layout_and_num_codes_are_what_the_all_reduce_reduces(spec, n):
    """``stat_layout`` and ``num_codes`` (the byte counts of the hook's adaptive choice and of the
    performance model) describe the statistics and codes the protocol reduces, for any size."""
    from gradq.comm.allreduce import summed_itemsize, summed_nbytes

    q = gradq.build(spec)
    x = workers(n, 1)[0]
    stats = q.shared_stats(x, shared_seed=SEED)
    layout = q.stat_layout(n)
    assert set(layout) == set(stats), (layout, list(stats))
    assert all(layout[k] == (s.value.dtype, s.value.numel()) for k, s in stats.items()), (layout, stats)
    codes = q.encode_codes(x, shared=reduced([stats]), seed=0, shared_seed=SEED)
    assert q.num_codes(n) == codes.numel()
    stat_bytes = sum(s.value.numel() * s.value.element_size() for s in stats.values())
    width = codes.element_size() if q.max_code is None else summed_itemsize(4, q.max_code, q.has_fields)
    assert summed_nbytes(q, n, 4) == stat_bytes + codes.numel() * width


@pytest.mark.parametrize("spec", ["maxnorm:bits=4,bucket=64", "terngrad", "multiscale", "randk-maxnorm:ratio=0.3",
                                  "randk-multiscale:k=7", "ef(maxnorm:bits=2)"])
def test_encode_fields_into_out(spec):
    """``encode_fields(out=)`` (the all-reduce's one buffer for every tensor's fields): the fields of
    the call without it, written into ``out`` and returned (by the kernels themselves where the
    scheme encodes every value: no tensor of the fields' size made); an ``out`` of another size,
    dtype or layout is refused."""
    x = workers(3001, 1)[0]
    q, twin = gradq.build(spec), gradq.build(spec)
    stats = q.shared_stats(x, shared_seed=SEED)
    shared = reduced([stats])
    buf = torch.full((q.num_codes(3001) + 10,), 0xEE, dtype=torch.uint8)
    out = buf[5:-5]
    with NewStorage() as made:
        got = q.encode_fields(x, shared=shared, seed=2, shared_seed=SEED, out=out)
    if spec.split(":")[0] in ("maxnorm", "terngrad", "multiscale"):
        assert made.largest < out.numel(), made.largest
    want = twin.encode_fields(x, shared=shared, seed=2, shared_seed=SEED)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)
    assert buf[:5].eq(0xEE).all() and buf[-5:].eq(0xEE).all()   # nothing written outside
    for bad in (buf[4:-5], buf[5:-5].to(torch.int32), torch.empty(2 * out.numel(), dtype=torch.uint8)[::2]):
        with pytest.raises(ValueError, match="out= must be"):
            gradq.build(spec).encode_fields(x, shared=shared, seed=2, shared_seed=SEED, out=bad)


@pytest.mark.parametrize("spec", ["maxnorm:bits=4,bucket=64", "maxnorm:bits=2", "terngrad:bucket=100", "terngrad"])
@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_a_sum_wider_than_a_byte_decodes_as_a_byte(spec, dtype):
    """Where ``2·M·s > 255`` the protocol sums the fields in a wider integer; its decode
    (``kernels.uniform_decode_sum``, in place in ``out=``) gives the uint8 sum's decode bit for bit
    (here a sum that fits both), not the codes' float32 rounding."""
    m, n = 3, 3001
    q = gradq.build(spec)
    xs = workers(n, m)
    stats = [q.shared_stats(x) for x in xs]
    shared = reduced(stats)
    total = torch.stack([q.encode_fields(x, shared=shared, seed=r) for r, x in enumerate(xs)]).to(torch.int32).sum(0)
    want = q.decode_field_sum(total.to(torch.uint8), shared=shared, count=m, like=xs[0])
    out = torch.full((n,), float("nan"))
    got = q.decode_field_sum(total.to(dtype), shared=shared, count=m, like=xs[0], out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)
    assert torch.equal(q.decode_field_sum(total.to(dtype), shared=shared, count=m, like=xs[0]), want)


def test_the_fields_benchmark_runs_and_checks_its_decode(capsys):
    """``benchmarks/bench_fields.py`` on a small vector: it checks the mean of the sum against the
    codes' decode (and exits on a difference) before it times anything."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "bench_fields.py")
    spec = importlib.util.spec_from_file_location("bench_fields", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--n", "20000", "--repeats", "1", "--spec", "maxnorm:bits=8", "--spec", "multiscale",
                "--spec", "randk-maxnorm:ratio=0.1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| maxnorm", "| multiscale",
                                                                                      "| randk"))]
    assert len(rows) == 3 and "int32" in rows[0] and "uint8" in rows[1], rows


@pytest.mark.parametrize("spec", ["none", "bf16", "maxnorm:bits=4"])
def test_decode_codes_into_out(spec):
    """``decode_codes(out=)`` (the all-reduce's codes path: a cast's, or a scheme's without fields):
    the average of the call without it, divided straight into ``out`` (a cast's float32 sum makes
    no tensor of its size); ``out`` needs ``like``."""
    n, m = 3001, 3
    q = gradq.build(spec)
    xs = workers(n, m)
    stats = [q.shared_stats(x) for x in xs]
    shared = reduced(stats)
    codes = torch.stack([q.encode_codes(x, shared=shared, seed=r) for r, x in enumerate(xs)]).sum(0)
    want = q.decode_codes(codes, shared=shared, count=m, like=xs[0])
    out = torch.full((n,), float("nan"))
    with NewStorage() as made:
        got = q.decode_codes(codes, shared=shared, count=m, like=xs[0], out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)
    if spec == "none":
        assert made.largest < 4 * n, made.largest
    with pytest.raises(ValueError, match="like="):
        q.decode_codes(codes, shared=shared, count=m, numel=n, out=out)
