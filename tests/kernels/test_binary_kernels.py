"""gradq.kernels.binary (numba): the one-bit quantizers' CPU kernels give the plain-torch reference's
exact bytes and floats — SignSGD, 1BitSGD, BinGrad-b (fixed-order pairwise sums) and BinGrad-pb
(certified bracketing search, full-sort fallback) — on adversarial inputs: ties, zeros of both signs,
constant / all-negative / all-zero buckets, denormals, huge values, tails shorter than a bucket,
n = 0 and 1, buckets longer than a summation block or a packing chunk.

Every comparison is exact (``torch.equal`` / ``same_bytes``), never a tolerance: the kernels promise
the reference's bits. Skipped as a whole when numba is not installed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("numba")

import numba  # noqa: E402
import numpy as np  # noqa: E402

import gradq  # noqa: E402
from gradq import kernels as K  # noqa: E402
from gradq.kernels import binary as KB  # noqa: E402
from gradq.kernels import reference as R  # noqa: E402
from gradq.quantizers._common import bucket_chunks  # noqa: E402
from gradq.quantizers.binary import bingrad_pb_threshold, pairwise_row_sum  # noqa: E402
from gradq.random import RandomStream  # noqa: E402

pytestmark = pytest.mark.skipif(not K.available(), reason="numba kernels unavailable")

SIZES = [0, 1, 2, 7, 9, 511, 513, 4099, 10_007]
BUCKETS = [None, 1, 7, 512, 5000]
KINDS = ["wild", "ties", "blocks"]


def data(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    """``wild``: Gaussians times exp(3·Gaussian) with zeros, −0.0, huge, tiny and denormal values
    every 13th entry. ``ties``: a handful of values (many exact ties, zeros of both signs).
    ``blocks``: runs of 8 that are constant, all-negative, all-zero, all −0.0, denormal-only, or
    spread over 60 binades (the last push BinGrad-pb onto its full-sort fallback)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "wild":
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
        special = torch.tensor([0.0, -0.0, 3.0e38, -1.5e38, 1e-30, -2e-42, 5e-45, 1.0, -1.0, 0.5])
        idx = torch.arange(0, n, 13)
        x[idx] = special[torch.arange(idx.numel()) % special.numel()]
        return x
    if kind == "ties":
        vals = torch.tensor([-2.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0, 1.0, 0.5])
        return vals[torch.randint(0, vals.numel(), (n,), generator=g)]
    runs = [torch.full((8,), 0.3), torch.full((8,), -2.5), torch.zeros(8), torch.full((8,), -0.0),
            torch.tensor([1e-45, -3e-45, 2e-40, -1e-39, 0.0, 7e-43, -1e-44, 1e-38]),
            -torch.rand(8, generator=g) - 0.1,
            torch.tensor([1e-30] * 7 + [1.0]) * torch.tensor([1.0, -1.0] * 4),
            torch.randn(8, generator=g) * torch.exp(torch.randn(8, generator=g) * 20)]
    order = torch.randint(0, len(runs), ((n + 7) // 8,), generator=g).tolist()
    return torch.cat([runs[i] for i in order] + [torch.zeros(0)])[:n].contiguous()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """numba and torch on one thread here (the thread test switches numba back): on a small machine
    their two OpenMP pools spin-wait against each other and slow these many small calls down; the
    bytes do not depend on the thread count (tested below)."""
    threads = numba.get_num_threads(), torch.get_num_threads()
    numba.set_num_threads(1)
    torch.set_num_threads(1)
    yield
    numba.set_num_threads(threads[0])
    torch.set_num_threads(threads[1])


@pytest.fixture
def reference():
    """Run a block with the kernels switched off (the torch path), restoring the switch afterwards."""
    class _Ref:
        def __enter__(self):
            K.set_enabled(False)

        def __exit__(self, *exc):
            K.set_enabled(True)
    return _Ref()


# -- the fixed summation order ------------------------------------------------------------------------
def folded(vals: list[float], block: int = KB.SUM_BLOCK) -> float:
    """The documented order of :func:`pairwise_row_sum` in plain Python floats (IEEE float64)."""
    def fold(v):
        while len(v) > 1:
            h = len(v) // 2
            v = [v[i] + v[i + h] for i in range(h)] + v[2 * h:]
        return v[0]
    if len(vals) <= block:
        return fold(vals)
    return fold([fold(vals[i:i + block]) for i in range(0, len(vals), block)])


@pytest.mark.parametrize("d", [1, 2, 3, 5, 6, 37, 4096, 4097, 9001])
def test_pairwise_row_sum_is_the_documented_order(d):
    # magnitudes over 40 binades, so that a different association would round differently
    g = torch.Generator().manual_seed(d)
    rows = (torch.randn(2, d, generator=g, dtype=torch.float64)
            * torch.exp(torch.randn(2, d, generator=g, dtype=torch.float64) * 10))
    got = pairwise_row_sum(rows)
    for r in range(2):
        assert got[r].item() == folded(rows[r].tolist())
    assert torch.equal(pairwise_row_sum(rows[1:]), got[1:])   # rows do not influence each other
    assert torch.equal(pairwise_row_sum(torch.full((1, d), -0.0, dtype=torch.float64)).signbit(),
                       torch.tensor([True]))


# -- statistics ---------------------------------------------------------------------------------------
def ref_stats(x: torch.Tensor, bucket, mode: int, iters: int):
    """The torch reference's per-bucket threshold (float64) and float32 levels."""
    ts, lvs = [], []
    for mat in bucket_chunks(x, bucket):
        m64 = mat.to(torch.float64)
        zero = m64.new_zeros(mat.shape[0])
        if mode == KB.SIGN:
            t, lv = zero, pairwise_row_sum(m64.abs()) / mat.shape[1]
        elif mode == KB.ONEBIT:
            up = mat >= 0
            t, lv = zero, torch.stack([R.masked_mean(m64, ~up, zero), R.masked_mean(m64, up, zero)], dim=1)
        else:
            t, b0, b1 = R.bingrad_b_levels(mat, iters)
            lv = torch.stack([b0, b1], dim=1)
        ts.append(t.to(torch.float64).reshape(-1))
        lvs.append(lv.to(torch.float32).reshape(-1))
    if not ts:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0)
    return torch.cat(ts), torch.cat(lvs)


@pytest.mark.parametrize("mode,iters", [(KB.SIGN, 0), (KB.ONEBIT, 0), (KB.BINGRAD_B, 0), (KB.BINGRAD_B, 3),
                                        (KB.BINGRAD_B, 40)])   # (40: most buckets converge early)
@pytest.mark.parametrize("bucket", BUCKETS)
def test_stats_match_reference(mode, iters, bucket):
    for kind in KINDS:
        for n in SIZES:
            x = data(kind, n, n)
            t, lv = KB.binary_stats(x, bucket, mode, iters)
            want_t, want_lv = ref_stats(x, bucket, mode, iters)
            assert torch.equal(t, want_t) and torch.equal(lv, want_lv), (kind, n)
            assert torch.equal(lv.signbit(), want_lv.signbit())


def test_bingrad_pb_levels_match_reference_and_fallback_is_exercised():
    """The certified search and the full-sort fallback both give ``bingrad_pb_threshold``'s bits. The
    fallback runs only where the reference's float64 sums really round: a bucket whose values above
    the level add up to more than 2^30 times the level (3e38 or 1.0 next to small values in ``wild``
    and ``blocks``); never for ties or for heavy-tailed data of a sane range."""
    sane = torch.randn(20_000, generator=torch.Generator().manual_seed(1)) * torch.exp(
        torch.randn(20_000, generator=torch.Generator().manual_seed(2)) * 3)
    for kind in KINDS + ["sane"]:
        for bucket in BUCKETS + [8]:
            for n in SIZES:
                x = data(kind, n, 50 + n) if kind != "sane" else sane[:n]
                got, fb = KB.bingrad_pb_levels(x, bucket, return_fallback=True)
                chunks = list(bucket_chunks(x, bucket))
                want = torch.cat([bingrad_pb_threshold(m) for m in chunks]) if chunks else torch.zeros(0)
                assert torch.equal(got, want), (kind, bucket, n)
                if kind in ("ties", "sane"):
                    assert not bool(fb.any()), (kind, bucket, n)
    _, fb = KB.bingrad_pb_levels(data("blocks", 4000, 1), 8, return_fallback=True)
    assert bool(fb.any()) and not bool(fb.all())


def test_bingrad_pb_search_paths():
    """Buckets whose scales jump by 1e±20 from one to the next (a useless hint), long tied runs, a
    single nonzero among zeros, and one long bucket, against the reference."""
    g = torch.Generator().manual_seed(3)
    scales = torch.tensor([1e-20, 1e20, 1.0, 1e-35, 3e30, 1.0]).repeat_interleave(512)
    cases = [torch.randn(scales.numel(), generator=g) * scales,
             torch.tensor([0.0] * 300 + [1.0] * 200 + [2.0] * 12).repeat(3),
             torch.tensor([0.0] * 511 + [-4.0]), torch.randn(70_000, generator=g).exp()]
    for x in cases:
        for bucket in (512, 100, None):
            chunks = list(bucket_chunks(x, bucket))
            want = torch.cat([bingrad_pb_threshold(m) for m in chunks])
            got, fb = KB.bingrad_pb_levels(x, bucket, return_fallback=True)
            assert torch.equal(got, want)
            assert not bool(fb.any())


def test_bingrad_pb_search_from_any_hint():
    """The search starts from a hint (the previous bucket's level); from any hint — none, the answer
    itself, one ulp off, far below or above the data, a denormal — it finds the reference's level,
    and never needs the fallback on data of a sane range."""
    from gradq.kernels import binary, cpu_pb as C

    binary._cpu()   # (cpu_pb is compiled under the keyed cache, as the backend loads it)
    g = torch.Generator().manual_seed(11)
    rows = [torch.randn(512, generator=g), torch.randn(512, generator=g).exp(), torch.rand(300, generator=g),
            torch.randn(513, generator=g) * torch.exp(torch.randn(513, generator=g) * 3),
            torch.tensor([0.5] * 100 + [1.5] * 30 + [0.0] * 20), torch.randn(4096, generator=g)]
    for row in rows:
        want = bingrad_pb_threshold(row.view(1, -1))[0]
        b = float(want)
        xi = row.numpy().view(np.int32)
        for hint in [0.0, b, float(np.nextafter(np.float32(b), np.float32(0))), float(np.nextafter(
                np.float32(b), np.float32(np.inf))), 0.5 * b, 2 * b, 1e-38, 1e-45, 3e38,
                float(row.abs().max()), float(row.abs().min())]:
            got = C._pb_level(xi, np.empty(row.numel(), np.int32), np.empty(3, np.float64),
                              np.empty(1, np.float64), np.empty(3, np.int64), np.float32(hint))
            assert got == want.item(), (hint, got, b)


# -- whole encodes: kernels on vs off -------------------------------------------------------------------
SPECS = ["signsgd", "onebit:ef=0", "bingrad-b", "bingrad-b:iters=3", "bingrad-pb"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bucket", BUCKETS + [48, 70_000])
def test_encode_gives_reference_bytes(spec, bucket, reference):
    """Bytes and decodes against the reference. Buckets that are a multiple of 16 long (48, 512)
    write their bits straight into the payload, 16 at a time, with a ragged last bucket (sizes
    9, 513, 10,007) in bytes of 8 and a zero-padded last byte."""
    sizes = [0, 1, 9, 513, 10_007] if bucket != 70_000 else [140_003]   # 70000: buckets straddle chunks
    b = "none" if bucket is None else bucket
    q = gradq.build(f"{spec},bucket={b}" if ":" in spec else f"{spec}:bucket={b}")
    for kind in KINDS:
        for n in sizes:
            x = data(kind, n, 7 + n)
            fast = q.encode(x, seed=n)
            with reference:
                ref = q.encode(x, seed=n)
                ref_dec = q.decode(ref)
            assert fast.same_bytes(ref), (kind, n)
            dec = q.decode(fast)
            assert torch.equal(dec, ref_dec) and torch.equal(dec.signbit(), ref_dec.signbit())


@pytest.mark.parametrize("start", [0, 2**32 - 700, 2**40 + 5])
def test_bingrad_pb_stream_offset_and_advance(start):
    """Counters continue from ``rng.offset`` (also across 2**32, where the high word enters the
    hash) and the stream advances by n, as the reference's draws over its bucket chunks do."""
    x, bucket = data("wild", 1300, 4), 512
    k_rng, r_rng = RandomStream(5).child(1), RandomStream(5).child(1)
    k_rng.offset = r_rng.offset = start
    packed, levels = KB.bingrad_pb_encode(x, bucket, k_rng)
    want_packed, want_levels = R.bingrad_pb_encode(x, bucket, r_rng)
    assert torch.equal(packed, want_packed)
    assert torch.equal(levels, want_levels)
    assert k_rng.offset == r_rng.offset == start + 1300


def test_thread_count_does_not_change_bytes():
    x = data("wild", 300_007, 9)
    threads = numba.get_num_threads()

    def run():
        return [KB.sign_scale_encode(x, 512), KB.onebit_encode(x, 1000), KB.bingrad_b_encode(x, 777, 2),
                KB.bingrad_pb_encode(x, 512, 3), KB.bingrad_pb_encode(x, 100_000, 3),
                KB.onebit_encode(x, None)]

    try:
        numba.set_num_threads(1)
        one = run()
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = run()
    finally:
        numba.set_num_threads(threads)
    for a, b in zip(one, many):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_onebit_error_feedback_same_with_kernels(reference):
    """The default ``onebit`` (error feedback around 1BitSGD): same payloads and residuals either way."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(3000, generator=g) + 0.2 for _ in range(5)]
    fast, ref = gradq.build("onebit"), gradq.build("onebit")
    for t, x in enumerate(xs):
        p = fast.encode(x, seed=t, name="w")
        with reference:
            r = ref.encode(x, seed=t, name="w")
        assert p.same_bytes(r)
        assert torch.equal(fast.residuals["w"], ref.residuals["w"])


def test_argument_errors():
    x = data("wild", 100)
    with pytest.raises(TypeError):
        KB.onebit_encode(x.double(), 8)
    with pytest.raises(ValueError):
        KB.binary_stats(x, 8, 7)                      # no such mode
    with pytest.raises(ValueError):
        KB.binary_stats(x, 8, KB.SIGN, iters=2)       # iters is BinGrad-b's
    with pytest.raises(ValueError):
        KB.bingrad_b_encode(x, 0)
    with pytest.raises(TypeError):
        KB.bingrad_pb_encode(x, 8, rng=1.5)
    assert KB.bingrad_pb_encode(torch.zeros(0), 8, 0)[0].numel() == 0
