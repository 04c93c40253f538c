"""gradq.kernels.levels (numba ORQ-L / Linear-L): bit-exact agreement with the plain-torch references
``orq_levels`` / ``linear_levels`` (per bucket chunk) followed by ``round_to_levels`` and ``pack_bits``.

Every comparison is on raw bits (levels viewed as int32, packed bytes with ``torch.equal``): the sign
of a zero level, denormal levels and midpoints must come out exactly as torch computes them. The data
mixes magnitudes over the whole float32 range, ties, constant stretches and zeros of both signs; one
test builds inputs on which torch's sort (libstdc++ introsort) falls back to heapsort. Skipped as a
whole when numba is not installed.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("numba")

import numba  # noqa: E402

import gradq  # noqa: E402
from gradq import kernels  # noqa: E402
from gradq.codecs.bitpack import pack_bits  # noqa: E402
from gradq.kernels import levels as KL  # noqa: E402
from gradq.kernels import reference as ref_kernels  # noqa: E402
from gradq.quantizers._common import bucket_chunks  # noqa: E402
from gradq.quantizers.orq import linear_levels, orq_levels, round_to_levels  # noqa: E402
from gradq.random import RandomStream  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")

# (n, data kind): tiny, around a bucket of 16 and of 512, and several buckets with a tail
CASES = [(1, 0), (7, 1), (16, 0), (17, 1), (511, 0), (513, 1), (3001, 0)]
# 2500: rows sorted by radix (> 2048) in the fused path; 9000 > 8192: the two-pass path (levels one
# bucket per task, then kernels.levels_encode)
BUCKETS = [None, 1, 7, 100, 512, 2500, 9000]
REFS = {"orq": orq_levels, "linear": linear_levels}
KERNEL_LEVELS = {"orq": KL.orq_levels, "linear": KL.linear_levels}
KERNEL_ENCODE = {"orq": KL.orq_encode, "linear": KL.linear_encode}


def data(n: int, seed: int, kind: int = 0) -> torch.Tensor:
    """kind 0: magnitudes e^(3·N(0,1)) with ±0, ±huge, denormals and ±1 every 13th element and a
    constant stretch; 1: few distinct values (heavy ties, both zeros); 2: plain Gaussian."""
    g = torch.Generator().manual_seed(seed)
    if kind == 2:
        return torch.randn(n, generator=g)
    if kind == 1:
        choices = torch.tensor([-1.5, -0.0, 0.0, 0.25, 0.25, 2.0, 1e-45, -3e-39])
        return choices[torch.randint(0, choices.numel(), (n,), generator=g)]
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    special = torch.tensor([0.0, -0.0, 3.0e38, -1.5e38, 1e-30, -2e-42, 5e-45, 1.0, -1.0, 0.5])
    idx = torch.arange(0, n, 13)
    x[idx] = special[torch.arange(idx.numel()) % special.numel()]
    if n > 40:
        x[n // 3: n // 3 + n // 5] = 0.25
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def ref_levels(kind: str, x: torch.Tensor, bucket, L: int) -> torch.Tensor:
    rows = [REFS[kind](m, L) for m in bucket_chunks(x, bucket)]
    return torch.cat(rows) if rows else torch.zeros(0, L)


def ref_encode(kind: str, x: torch.Tensor, bucket, L: int, width: int, rng: RandomStream):
    chunks = list(bucket_chunks(x, bucket))
    lvs = [REFS[kind](m, L) for m in chunks]
    codes = [round_to_levels(m, lv, rng).reshape(-1) for m, lv in zip(chunks, lvs)]
    empty = torch.zeros(0, dtype=torch.int64)
    return pack_bits(torch.cat(codes) if codes else empty, width), (torch.cat(lvs) if lvs else torch.zeros(0, L))


# -- levels -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,L", [("orq", 2), ("orq", 3), ("orq", 5), ("orq", 17),
                                    ("linear", 3), ("linear", 17), ("linear", 129)])
@pytest.mark.parametrize("bucket", BUCKETS)
def test_levels_match_reference(kind, L, bucket):
    for n, variant in CASES:
        x = data(n, 1000 * L + n, variant)
        got = KERNEL_LEVELS[kind](x, L, bucket)
        assert torch.equal(bits(got), bits(ref_levels(kind, x, bucket, L))), (n, variant)


def test_matrix_rows_and_empty():
    """A 2-D input is a matrix of buckets (its rows); an empty vector has no buckets."""
    x = data(40 * 33, 5).view(40, 33)
    for kind in ("orq", "linear"):
        assert torch.equal(bits(KERNEL_LEVELS[kind](x, 5)), bits(REFS[kind](x, 5)))
        assert KERNEL_LEVELS[kind](torch.zeros(0), 5, 8).shape == (0, 5)
    packed, lv = KL.orq_encode(torch.zeros(0), 5, 8, 3, 0)
    assert packed.numel() == 0 and lv.shape == (0, 5)


def test_degenerate_buckets():
    """Constant buckets (every level equal), two-valued, all-denormal, all-zero buckets of either
    sign and an equal-magnitude pair around zero, where ORQ falls back to (clamped) midpoints."""
    rows = [
        [0.7] * 16, [-0.0] * 16, [0.0] * 16, [1e-45] * 16, [-1e-45, 1e-45] * 8, [3e-45, 5e-45] * 8,
        [-2.0] + [2.0] * 15, [5.0, -5.0] * 8, [-0.0, 0.0] * 8, [1.4e-45, 0.0, -0.0, 2.8e-45] * 4,
        [3.4e38, -3.4e38] * 8, [1.0] * 15 + [1.0000001],
    ]
    x = torch.tensor(rows, dtype=torch.float32)
    for kind, Ls in (("orq", (2, 3, 5, 9, 17)), ("linear", (3, 5, 9, 17))):
        for L in Ls:
            assert torch.equal(bits(KERNEL_LEVELS[kind](x, L)), bits(REFS[kind](x, L))), (kind, L)
            width = max(1, (L - 1).bit_length())
            want, _ = ref_encode(kind, x.reshape(-1), 16, L, width, RandomStream(L))
            assert torch.equal(KERNEL_ENCODE[kind](x.reshape(-1), L, 16, width, RandomStream(L))[0], want)


# -- signed zeros: −0.0 sorts before +0.0 on every device and backend -----------------------------
def _signed_zero_rows(n: int, seed: int) -> torch.Tensor:
    """Rows with a run of zeros of random signs among other values, some with denormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, n, generator=g)
    x[:, : n // 4] = 0.0
    neg = torch.rand(4, n, generator=g) < 0.5
    x = torch.where(neg & (x == 0), torch.tensor(-0.0), x)
    x[1, n // 2:: 7] = 3e-42
    return x[:, torch.randperm(n, generator=g)]


@pytest.mark.parametrize("n", [17, 512, 1500, 3000])   # bitonic rows, and radix-sorted ones past 2048
def test_signed_zero_order(n):
    """``reference.sort_rows`` orders by value with every −0.0 before every +0.0 (which
    ``torch.sort`` leaves to its algorithm, differently on CPU and CUDA), and the kernels' levels
    agree with the reference's bit for bit on such rows."""
    x = _signed_zero_rows(n, n)
    srt = ref_kernels.sort_rows(x)
    for row, got in zip(x.tolist(), srt):
        want = sorted(row, key=lambda v: (v, 0 if math.copysign(1.0, v) < 0 else 1))
        assert torch.equal(bits(got), bits(torch.tensor(want, dtype=torch.float32)))
    for kind, L in (("linear", 129), ("linear", 5), ("orq", 17), ("orq", 5)):
        assert torch.equal(bits(KERNEL_LEVELS[kind](x, L)), bits(REFS[kind](x, L))), (kind, L)


def test_signed_zero_order_random_buckets():
    """Buckets full of ``+0`` and ``−0`` (plus a few values): Linear with 129 levels reads many
    positions of the zero run, so a zero of the wrong sign anywhere would show."""
    g = torch.Generator().manual_seed(3)
    for d in (17, 40, 512, 2500):
        x = torch.where(torch.rand(20 * d, generator=g) < 0.5, 0.0, -0.0)
        x[torch.rand(20 * d, generator=g) < 0.1] = torch.randn(1, generator=g).item()
        for kind, L in (("linear", 129), ("orq", 9)):
            assert torch.equal(bits(KERNEL_LEVELS[kind](x, L, d)), bits(ref_levels(kind, x, d, L))), d


# -- fused encode -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,L", [("orq", 3), ("orq", 5), ("orq", 9), ("orq", 17), ("linear", 5), ("linear", 17)])
@pytest.mark.parametrize("bucket", BUCKETS)
def test_encode_matches_reference(kind, L, bucket):
    """Same packed bytes, level bits and stream advance as the torch path; the stream may start just
    below 2**32 (the high counter word then changes inside the vector)."""
    width = (L - 1).bit_length()
    for n, variant, start in ((1, 0, 0), (17, 1, 5), (513, 2, 2**32 - 77), (10007, 0, 2**32 - 3000), (4099, 1, 0)):
        x = data(n, 7 * n + L, variant)
        r_ref, r_fast = RandomStream(n).child(L), RandomStream(n).child(L)
        r_ref.offset = r_fast.offset = start
        want, want_lv = ref_encode(kind, x, bucket, L, width, r_ref)
        got, got_lv = KERNEL_ENCODE[kind](x, L, bucket, width, r_fast)
        assert torch.equal(got, want), (n, variant)
        assert torch.equal(bits(got_lv), bits(want_lv)), (n, variant)
        assert r_fast.offset == r_ref.offset == start + n


@pytest.mark.parametrize("spec", ["orq", "orq:levels=3,bucket=100", "orq:levels=17,bucket=none", "orq:levels=9,bucket=9000",
                                  "linear", "linear:levels=17,bucket=7", "linear:levels=3,bucket=none"])
def test_quantizer_fast_path_gives_reference_bytes(spec):
    x = data(20_011, 11)
    fast = gradq.build(spec).encode(x, seed=4)
    try:
        kernels.set_enabled(False)
        ref = gradq.build(spec).encode(x, seed=4)
        ref_out = gradq.build(spec).decode(ref)
    finally:
        kernels.set_enabled(True)
    assert fast.same_bytes(ref)
    assert torch.equal(bits(gradq.build(spec).decode(fast)), bits(ref_out))


def test_thread_count_does_not_change_bytes():
    x = data(300_007, 9)
    threads = numba.get_num_threads()

    def run():
        return [KL.orq_encode(x, 5, 512, 3, 5), KL.linear_encode(x, 9, 1000, 4, 5), KL.orq_levels(x, 17, 20_000)]

    try:
        numba.set_num_threads(1)
        one = run()
        numba.set_num_threads(max(2, threads) if numba.config.NUMBA_NUM_THREADS >= 2 else 1)
        many = run()
    finally:
        numba.set_num_threads(threads)
    for a, b in zip(one, many):
        for p, q in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(p, q)


# -- argument checks --------------------------------------------------------------------------------
def test_argument_errors():
    x = data(100, 1)
    with pytest.raises(ValueError):
        KL.orq_levels(x, 4, 10)                   # not 2^k + 1
    with pytest.raises(ValueError):
        KL.orq_levels(x, 33, 10)                  # ORQ kernel: L <= 17
    with pytest.raises(ValueError):
        KL.linear_levels(x, 513, 10)
    with pytest.raises(ValueError):
        KL.orq_encode(x, 9, 10, 3, 0)             # 9 indices need 4 bits
    with pytest.raises(TypeError):
        KL.orq_levels(x.double(), 5, 10)
    with pytest.raises(ValueError):
        KL.orq_levels(x, 5, 0)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[57] = bad
        with pytest.raises(ValueError):
            KL.orq_levels(y, 5, 10)
        with pytest.raises(ValueError):
            KL.linear_encode(y, 5, 10, 3, 0)


# -- sixteen buckets at a time, one a lane (cpu_sort_lanes, cpu_orq_lanes) ---------------------------
@pytest.mark.parametrize("bucket", [16, 32, 64, 128, 256, 512])
@pytest.mark.parametrize("kind,L", [("linear", 3), ("linear", 5), ("linear", 17), ("linear", 129),
                                    ("orq", 2), ("orq", 3), ("orq", 5), ("orq", 9), ("orq", 17)])
def test_buckets_sorted_sixteen_a_lane_match_reference(kind, L, bucket):
    """Buckets of a power of two from 16 to 512 values are sorted sixteen at a time, one a lane, and
    their levels come from the lanes (Linear's positions, ORQ's rounds): two whole groups, a partial
    one and a short last bucket; in a group, buckets that hold zeros of both signs (here 3 and 20,
    and many in the tied and mixed data) are sorted on their own. Levels and encode equal the
    reference's bit for bit (129 levels read most positions of the shorter buckets)."""
    width = (L - 1).bit_length()
    n = 37 * bucket + 5
    for variant in (2, 0, 1):
        x = data(n, 31 * bucket + L + variant, variant)
        for b in (3, 20):
            x[b * bucket + 1], x[b * bucket + bucket // 2] = -0.0, 0.0
        assert torch.equal(bits(KERNEL_LEVELS[kind](x, L, bucket)), bits(ref_levels(kind, x, bucket, L))), variant
        r_ref, r_fast = RandomStream(n).child(L), RandomStream(n).child(L)
        want, want_lv = ref_encode(kind, x, bucket, L, width, r_ref)
        got, got_lv = KERNEL_ENCODE[kind](x, L, bucket, width, r_fast)
        assert torch.equal(got, want), variant
        assert torch.equal(bits(got_lv), bits(want_lv)), variant


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_in_a_lane_group_is_refused(bad):
    """A NaN or infinity in any bucket of a group sorted sixteen at a time (first, middle or last
    lane, first or last position) raises, from the levels and from the encode, Linear's and ORQ's."""
    bucket = 64
    x = data(40 * bucket, 9, 2)
    for b in (0, 7, 15, 16, 31):
        for p in (0, bucket - 1):
            y = x.clone()
            y[b * bucket + p] = bad
            for levels, encode in ((KL.linear_levels, KL.linear_encode), (KL.orq_levels, KL.orq_encode)):
                with pytest.raises(ValueError):
                    levels(y, 5, bucket)
                with pytest.raises(ValueError):
                    encode(y, 9, bucket, 4, 0)


def _lane_rows(kind: str, n: int, bucket: int, g: torch.Generator) -> torch.Tensor:
    """Whole buckets of one kind for :func:`test_orq_rounds_on_the_lanes_match_reference`."""
    if kind == "wide":          # magnitudes from 1e-30 to 1e30 in one bucket
        return torch.randn(n, generator=g) * 10.0 ** (60 * torch.rand(n, generator=g) - 30)
    if kind == "huge":          # near the float32 maximum: the fixed point's shift is at its lowest
        return (2 * torch.rand(n, generator=g) - 1) * 3.4e38
    if kind == "denormal":      # every value denormal: the shift at its highest
        return torch.randn(n, generator=g) * 1e-40
    if kind == "two":           # two values: every split is a midpoint or a copy of one of them
        return torch.tensor([-1.0, 2.0])[torch.randint(0, 2, (n,), generator=g)]
    if kind == "few":           # five values: long runs of copies at the splits
        return torch.randn(5, generator=g)[torch.randint(0, 5, (n,), generator=g)]
    if kind == "sparse":        # mostly +0.0 (one sign of zero: the lanes keep these buckets)
        x = torch.randn(n, generator=g)
        return torch.where(torch.rand(n, generator=g) < 0.8, torch.zeros(n), x)
    if kind == "constant":      # one value a bucket; at ±1e-45 the midpoint 0.5·a + 0.5·a rounds past a
        vals = torch.tensor([0.375, 1e-45, -1e-45, 0.0, -2.5e38])
        return vals[torch.arange(n // bucket) % vals.numel()].repeat_interleave(bucket)
    x = torch.randn(n, generator=g).view(-1, bucket)   # "sorted": buckets in order, then reversed
    half = x.shape[0] // 2
    return torch.cat([x[:half].sort(dim=1).values, x[half:].sort(dim=1, descending=True).values]).reshape(-1)


@pytest.mark.parametrize("bucket", [16, 128, 512])
@pytest.mark.parametrize("L", [3, 5, 9, 17])
def test_orq_rounds_on_the_lanes_match_reference(bucket, L):
    """ORQ's rounds on sixteen sorted lanes (``cpu_orq_lanes``: prefix sums in fixed point, binary
    searches with gathers that run only where a bucket's neighbours do not settle a bound) give the
    reference's levels bit for bit on data that drives every branch: copies of a level at a split,
    empty segments and midpoints, the fixed point's extreme shifts, values already in order. Two
    groups of sixteen buckets per kind, no short bucket (every bucket goes through the lanes)."""
    g = torch.Generator().manual_seed(1000 * L + bucket)
    for kind in ("wide", "huge", "denormal", "two", "few", "sparse", "constant", "sorted"):
        x = _lane_rows(kind, 32 * bucket, bucket, g)
        assert torch.equal(bits(KL.orq_levels(x, L, bucket)), bits(ref_levels("orq", x, bucket, L))), kind


# -- what the sort's copy sees: 16 values at a time, then the bucket's tail --------------------------
def test_a_non_finite_value_anywhere_in_a_bucket_is_refused():
    """The copy before each bucket's sort tests 16 values at a time and the last ``d mod 16`` one by
    one; a NaN or infinity in either part, in any bucket, raises (a missed one would be sorted)."""
    d = 40                                          # two 16-value vectors and a tail of 8
    x = data(3 * d, 5, 2)
    for p in range(3 * d):
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[p] = bad
            for fn in (KL.linear_levels, KL.orq_levels):
                with pytest.raises(ValueError):
                    fn(y, 5, d)


def test_both_zeros_anywhere_in_a_bucket_give_the_reference_levels():
    """One −0.0 and one +0.0 at every pair of places (vector part or tail): the row must take the
    sort that orders the two zeros. Linear with 129 levels reads every position of a 40-value row."""
    d = 40
    x = data(d, 6, 2)
    for p in range(d):
        for q in (p + 1, p + 17, p + 29):
            y = x.clone()
            y[p] = -0.0
            y[q % d] = 0.0
            if q % d == p:
                continue
            assert torch.equal(bits(KL.linear_levels(y, 129, d)), bits(ref_levels("linear", y, d, 129))), (p, q)


# -- the bucket sort itself: every padded size of the bitonic network ------------------------------
@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 31, 32, 100, 255, 256, 257, 511, 512, 513, 1000, 1024, 1025,
                               2047, 2048])
def test_bucket_sort_gives_the_reference_order(m):
    """``cpu_sort._sort_row`` against ``reference.sort_rows`` on rows of every padded size of the
    network (16 … 2048 values: one vector up to 128), with one sign of zero (the network's rows),
    heavy ties, denormals and a constant row. Rows with both zeros take the radix sort, which the
    level tests cover."""
    from gradq.kernels.cpu_sort import _pad_size, _sort_row
    g = torch.Generator().manual_seed(m)
    rows = [torch.randn(m, generator=g),
            torch.randn(m, generator=g) * torch.exp(3 * torch.randn(m, generator=g)),
            torch.tensor([-2.0, -0.0, 1e-45, 3.0, 3.0, -2e-40])[torch.randint(0, 6, (m,), generator=g)],
            torch.tensor([0.0, 5e-41, -1.0, 7.0])[torch.randint(0, 4, (m,), generator=g)],
            torch.full((m,), 0.375)]
    npad = _pad_size(m)
    for r, row in enumerate(rows):
        x = row.numpy()
        srt = torch.empty(npad, dtype=torch.float32)
        flags = _sort_row(x, x.view("int32"), torch.empty(npad).numpy(), srt.numpy())
        assert flags & 4 == 0 and (flags & 3) != 3, (r, flags)
        assert torch.equal(bits(srt[:m]), bits(ref_kernels.sort_rows(row.view(1, -1))[0])), r
