"""The Triton backend gives the reference's bytes and floats, primitive by primitive and scheme by scheme.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (``GRADQ_KERNELS=triton`` /
``kernels.set_backend("triton")``), which checks their logic exactly: the interpreter evaluates the
same operations in NumPy float32/uint32. What only a GPU can show (no FMA contraction, correctly
rounded division on the device) is checked by the GPU-marked tests at the end, which compare the
CUDA bytes with the CPU reference's. The shapes are small on purpose: the interpreter runs each
program in Python.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import gradq
from gradq import kernels
from gradq.errors import NonFiniteError, PayloadError
from gradq.kernels import reference as R
from gradq.random import RandomStream
from gradq_testing import grid

T = pytest.importorskip("gradq.kernels.triton_ops", reason="triton is not installed")
# (the interpreter divides by denormal scales as the kernels do on a GPU: 1/3e-42 overflows to inf)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

SIZES = [1, 7, 8, 9, 40, 513, 2051]
BUCKETS = [None, 1, 5, 8, 64, 512]
# Every size and every bucket once or more, each width inside each of them (1 value, a partial
# group, a whole group, a group and one, a partial program, two programs, five with a partial last),
# buckets crossing groups (5) and programs (64 in 513 values, 512 in 2,051); the program-boundary
# paths have tests of their own below. The rest of the product runs with --full.
UNIFORM_COVER = [(None, 1), (None, 8), (None, 513), (1, 1), (1, 9), (5, 7), (5, 40), (5, 513), (8, 8),
                 (8, 9), (64, 40), (64, 513), (512, 7), (512, 2051)]


def data(n: int, seed: int) -> torch.Tensor:
    """Heavy-tailed values with zeros, −0.0, denormals, a huge value and an all-zero stretch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    x[::97] = 0.0
    x[5::101] = -0.0
    x[3::89] = 3e-42
    x[11::211] = -2.5e37
    if n > 200:
        x[100:180] = 0.0   # whole buckets of zeros (scale 0) for buckets <= 64
    return x


def same(a, b) -> bool:
    """Equal bits, including the sign of zeros."""
    if isinstance(a, tuple):
        return all(same(u, v) for u, v in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8
                                                                      else a, b.view(torch.uint8) if b.dtype !=
                                                                      torch.uint8 else b)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_the_interpreter_shortcuts_give_tritons_answers():
    """gradq spares Triton's interpreter two repeated costs (gradq.kernels.triton_common): library
    calls re-patching triton.language while it is patched already, and its dtype table rebuilt at
    every use. Library calls in a kernel, across launches and beside a launch of a kernel that calls
    none, must still compute what torch does, and the table must answer as NumPy's types say."""
    import numpy as np
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    from gradq.kernels import triton_common as C

    assert type(tl.sum) is type(tl.cumsum) is type(tl.randint4x) is C._LibraryCall

    @triton.jit
    def sums(x_ptr, out_ptr, N: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, N))
        tl.store(out_ptr + tl.arange(0, N), tl.cumsum(x, 0) + tl.sum(x, 0) + tl.max(x, 0))

    @triton.jit
    def plain(x_ptr, out_ptr, N: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, N), tl.load(x_ptr + tl.arange(0, N)) * 2)

    for seed in range(3):
        x = torch.randint(-50, 50, (16,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        out = torch.empty_like(x)
        sums[(1,)](x, out, N=16)
        assert torch.equal(out, torch.cumsum(x, 0, dtype=torch.int32) + x.sum(dtype=torch.int32) + x.max())
        plain[(1,)](x, out, N=16)
        assert torch.equal(out, x * 2)

    get = interpreter._get_np_dtype
    for name, want in [("int1", bool), ("float16", np.float16), ("float32", np.float32), ("float64", np.float64),
                       ("int8", np.int8), ("uint8", np.uint8), ("int16", np.int16), ("uint16", np.uint16),
                       ("int32", np.int32), ("uint32", np.uint32), ("int64", np.int64), ("uint64", np.uint64),
                       ("bfloat16", np.uint16), ("float8e5", np.uint8), ("float8e4nv", np.uint8)]:
        ty = getattr(tl, name)
        assert get(ty) == np.dtype(want) and get(tl.block_type(ty, [8])) == np.dtype(want), name
    assert get(tl.pointer_type(tl.float32)) == get(tl.block_type(tl.pointer_type(tl.int8), [4])) == np.dtype(np.uint64)
    with pytest.raises(KeyError):
        get(tl.void)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_the_interpreter_builds_no_overflow_check_that_debug_mode_would_drop():
    """Outside debug mode the interpreter's integer overflow checks end in an assert that is never
    kept, so gradq's set-up turns them off (gradq.kernels.triton_common). Integer arithmetic that
    wraps around must give the same answer as with the checks built, and torch's int32 answer."""
    import dataclasses

    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    assert builder.options.debug is False and builder.options.sanitize_overflow is False

    @triton.jit
    def wraps(x_ptr, out_ptr, N: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, N))
        tl.store(out_ptr + tl.arange(0, N), (x * -1640531535 + 2147483000) - (x * x - 7))

    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (64,), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    want = (x * -1640531535 + 2147483000) - (x * x - 7)       # torch's int32 arithmetic wraps around too
    out = torch.empty_like(x)
    wraps[(1,)](x, out, N=64)
    assert torch.equal(out, want)
    shipped = builder.options
    builder.options = dataclasses.replace(shipped, sanitize_overflow=True)
    try:
        checked = torch.empty_like(x)
        wraps[(1,)](x, checked, N=64)
    finally:
        builder.options = shipped
    assert torch.equal(checked, want)


# -- primitives -------------------------------------------------------------------------------------
@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests (a GPU is present: see the GPU tests)")
@pytest.mark.parametrize("bucket", [None, 4, 512])
def test_maxabs_scales_clip_and_non_finite(bucket):
    """``maxabs_scales``' clip is a cap inside the kernel's atomic maximum (a clip of non-negative
    bits) or applied after it (−0.0, a bound on the device): every kind gives the reference's
    bits, with NaN and ±inf in some buckets (a NaN bucket reads the clip), into ``out=`` too."""
    x = data(2051, 9)
    x[7], x[600], x[1500] = float("nan"), float("inf"), -float("inf")
    for clip in (None, 0.0, -0.0, 0.75, 1e30, float("inf")):
        want = R.maxabs_scales(x, bucket, clip=clip)
        assert same(T.maxabs_scales(x, bucket, clip=clip), want), clip
        out = torch.full_like(want, 7.0)
        assert T.maxabs_scales(x, bucket, clip=clip, out=out) is out and same(out, want), clip
    bound = torch.tensor([0.5])
    assert same(T.maxabs_scales(x, bucket, clip=bound), R.maxabs_scales(x, bucket, clip=0.5))


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests (a GPU is present: see the GPU tests)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_field_is_finite_reads_the_exponent_bits(dtype):
    """``field_is_finite`` (a flag per 4,096 values, read at once): False for a NaN, +Inf or −Inf
    anywhere (first, last, a block's last and the next block's first value), True for finite
    values, −0.0 and denormals, and for huge finite values whose sum overflows (where torch's sum
    answers non-finite)."""
    g = torch.Generator().manual_seed(7)
    for n in (1, 4095, 4096, 4097, 9000):
        x = torch.randn(n, generator=g, dtype=dtype)
        x[::7] = -0.0
        x[1::11] = torch.finfo(dtype).tiny / 4       # denormals
        assert T.field_is_finite(x), n
        assert T.field_is_finite(x[1:] if n > 1 else x), n      # (an offset view)
        for pos in sorted({0, n - 1, min(4095, n - 1), min(4096, n - 1), n // 2}):
            for bad in (float("nan"), float("inf"), -float("inf")):
                y = x.clone()
                y[pos] = bad
                assert not T.field_is_finite(y), (n, pos, bad)
    huge = torch.full((5000,), torch.finfo(dtype).max, dtype=dtype)
    assert not math.isfinite(float(huge.sum())) and T.field_is_finite(huge)
    assert T.field_is_finite(torch.empty(0, dtype=dtype))
    half = torch.ones(10, dtype=torch.float16)
    assert T.field_is_finite(half)
    half[3] = float("inf")
    assert not T.field_is_finite(half)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("spec", ["qsgd:bits=4,bucket=512", "signsgd:bucket=512", "bingrad-b:bucket=512"])
def test_checked_encode_looks_at_its_witness_by_flags(spec, triton_backend, monkeypatch):
    """With ``witness_path`` 2 a checked encode looks at its witness (scales, levels) through
    ``field_is_finite``: NaN or Inf in x still raises NonFiniteError, naming x; finite x whose
    witness sums past float32 (a huge value in every bucket) passes without the exact screen that
    an overflowing sum costs; the bytes are those of the shipped path."""
    from gradq.quantizers import base

    n = 9000
    x = data(n, 31)
    x[::512] = 3.0e38                               # every bucket's max: the scales' sum overflows
    q = gradq.build(spec)
    want = q.encode(x, seed=4)
    looks, screens = [], []
    flags = T.field_is_finite
    monkeypatch.setitem(T.TUNING, "witness_path", 2)
    monkeypatch.setattr(T, "field_is_finite", lambda t: looks.append(t.numel()) or flags(t))
    screen = base._screen
    monkeypatch.setattr(base, "_screen", lambda v, name: screens.append(1) or screen(v, name))
    got = q.encode(x, seed=4)
    witness = want.fields[q._nonfinite_witness(x, None)]
    assert got.same_bytes(want) and looks == [witness.numel()] and not screens, (looks, screens)
    for pos in (0, 4500, n - 1):
        y = x.clone()
        y[pos] = float("nan") if pos != 4500 else -float("inf")
        with pytest.raises(NonFiniteError, match="grad"):
            q.encode(y, seed=4, name="grad")


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests (a GPU is present: see the GPU tests)")
@pytest.mark.parametrize("bucket,n", grid(BUCKETS, SIZES, covering=UNIFORM_COVER))
def test_uniform_primitives(n, bucket):
    x = data(n, n)
    assert same(T.maxabs_scales(x, bucket), R.maxabs_scales(x, bucket))
    assert same(T.maxabs_scales(x, bucket, clip=0.75), R.maxabs_scales(x, bucket, clip=0.75))
    assert same(T.l2_scales(x, bucket), R.l2_scales(x, bucket))
    for s, w in [(1, 2), (3, 3), (7, 4), (15, 5), (127, 8)]:
        enc = T.maxabs_uniform_encode(x, s, bucket, w, RandomStream(n))
        ref = R.maxabs_uniform_encode(x, s, bucket, w, RandomStream(n))
        assert same(enc, ref), (s, w)
        if w == 4:
            assert same(T.l2_uniform_encode(x, s, bucket, w, RandomStream(n)),
                        R.l2_uniform_encode(x, s, bucket, w, RandomStream(n))), (s, w)
        packed, sc = ref
        assert same(T.uniform_encode(x, sc * 1.5, s, bucket, w, 3), R.uniform_encode(x, sc * 1.5, s, bucket, w, 3))
        assert same(T.uniform_decode(packed, sc, s, bucket, w, n), R.uniform_decode(packed, sc, s, bucket, w, n))
        many = ([packed, packed.flip(0), packed], [sc, sc * 3, sc / 7])
        assert same(T.uniform_decode_mean(*many, s, bucket, w, n), R.uniform_decode_mean(*many, s, bucket, w, n))
    sc = R.maxabs_scales(x, bucket, clip=0.5)
    trits = T.uniform_encode_trits(x, sc, bucket, 11, clip=0.5)
    assert same(trits, R.uniform_encode_trits(x, sc, bucket, 11, clip=0.5))
    assert same(T.uniform_decode_trits(trits, sc, bucket, n), R.uniform_decode_trits(trits, sc, bucket, n))
    assert same(T.uniform_decode_trits_mean([trits, trits], [sc, sc * 2], bucket, n),
                R.uniform_decode_trits_mean([trits, trits], [sc, sc * 2], bucket, n))


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests (a GPU is present: see the GPU tests)")
def test_decode_mean_over_a_power_of_two_rounds_as_a_division():
    """The mean of M payloads divides by M; for M a power of two the kernel multiplies by 1/M, which
    rounds the same real number: the reference's values bit for bit for M = 2, 4, 8 (and 3, 5, 6 by
    division), with scales whose means are subnormal and with huge ones."""
    n, s, w, bucket = 1000, 7, 4, 64
    packed, sc = R.maxabs_uniform_encode(data(n, 5), s, bucket, w, RandomStream(5))
    for m in (2, 3, 4, 5, 6, 8):
        payloads = [packed.roll(17 * j) for j in range(m)]
        for top in (1e-38, 3.0e38):
            scales = [torch.full_like(sc, top / (j + 1)) for j in range(m)]
            want = R.uniform_decode_mean(payloads, scales, s, bucket, w, n)
            assert same(T.uniform_decode_mean(payloads, scales, s, bucket, w, n), want), (m, top)
            if top < 1:
                assert bool(((want != 0) & (want.abs() < 1.17549435e-38)).any()), m     # subnormal means
            else:
                assert bool((want.abs() > 1e37).any()), m                                         # huge means


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_decode_mean_reads_payloads_in_place_at_any_offsets():
    """Payloads that are slices of one receive buffer are read where they lie: at a fixed stride
    (offsets made on the device), backwards, at irregular offsets, and one payload twice."""
    n, s, w = 1001, 7, 4
    x = data(n, 5)
    packed, sc = R.maxabs_uniform_encode(x, s, 64, w, RandomStream(1))
    nbytes = packed.numel()
    buf = torch.zeros(7 * nbytes + 13, dtype=torch.uint8)
    for starts in ([3, 3 + nbytes, 3 + 2 * nbytes], [5 * nbytes, 3 * nbytes, nbytes], [0, 2 * nbytes + 13, nbytes],
                   [nbytes, nbytes], [2 * nbytes + 1]):
        views = []
        for k, o in enumerate(starts):
            buf[o:o + nbytes] = packed.roll(k)
            views.append(buf[o:o + nbytes])
        scales = [sc * (k + 1) for k in range(len(views))]
        want = R.uniform_decode_mean([v.clone() for v in views], scales, s, 64, w, n)
        assert same(T.uniform_decode_mean(views, scales, s, 64, w, n), want), starts


def host_bound(bound):
    """TernGrad's clip bound from the Triton backend (a one-element device tensor, inf for no
    clipping) as the reference gives it (a float, or None)."""
    if bound is None:
        return None
    assert isinstance(bound, torch.Tensor) and bound.numel() == 1 and bound.dtype == torch.float32
    b = float(bound)
    return None if math.isinf(b) else b


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("chunk,launches,runs", [(1, 2, 8), (2, 2, 8), (4, 2, 8), (1024, 2, 8), (8, 1, 2), (2, 1, 32),
                                                  (4, 1, 16), (1024, 1, 8)])
def test_sigma_merge_tree(chunk, launches, runs, monkeypatch):
    """TernGrad's σ through one, two and several levels of the merge tree (small merge chunks, so
    that a few blocks take several levels), or merged by the block that finishes last, in runs of
    ``chunk`` (``moment_launches`` 1, where the blocks fit in ``_LAST_RUNS`` runs: no merge launch
    at all; 47 blocks in 2 runs of 8 take the tree; a setting of 1 merges pairs): the reference's σ, bit
    for bit, on data with
    an offset (a large mean, where a one-pass E[x²] − E[x]² would cancel) and on the edge-case data
    (blocks of 64 values: 1 to 47 blocks)."""
    from gradq.kernels import triton_moments as MO

    monkeypatch.setattr(MO, "_MOMENT_BLOCK", 64)
    monkeypatch.setitem(T.TUNING, "moment_chunk", chunk)
    monkeypatch.setattr(MO, "_LAST_RUNS", runs)
    monkeypatch.setitem(T.TUNING, "moment_launches", launches)
    if launches == 1 and chunk * runs >= 47:
        monkeypatch.setattr(MO, "_merge_moments_kernel", None)   # (a merge launch would fail)
    g = torch.Generator().manual_seed(chunk)
    for x in (torch.randn(3001, generator=g) + 1000.0, data(2000, chunk), torch.randn(65, generator=g),
              torch.full((130,), 0.25)):
        assert same(T.population_std(x).reshape(1), R.population_std(x).reshape(1)), chunk
        assert host_bound(T.terngrad_stats(x, 2.5, None)[0]) == R.terngrad_stats(x, 2.5, None)[0]
        assert same(T.terngrad_stats(x, 2.5, None)[1], R.terngrad_stats(x, 2.5, None)[1])


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("rows,tail,passes,own", grid([1, 4], [0, 1, 2, 3, 5, 15], [1, 2], [1, 2],
                                                      covering=[(1, 0, 1, 1), (1, 3, 2, 1), (4, 1, 1, 1),
                                                                (4, 5, 2, 1), (4, 15, 1, 1), (1, 0, 2, 1),
                                                                (4, 3, 1, 1), (1, 15, 2, 1), (1, 3, 1, 2),
                                                                (4, 5, 2, 2)]))
def test_one_bit_statistics_in_triton(tail, rows, passes, own, monkeypatch):
    """The one-bit statistics of power-of-two buckets and of a partial last bucket of any width run
    in the Triton kernels (the torch reference is not called), with the reference's folds: the
    same thresholds and levels, bit for bit, for SignSGD, 1BitSGD and BinGrad-b with 0 to 3 Lloyd
    steps, one or four buckets a program (``T.TUNING``). The rows include buckets of −0.0 only, of
    one sign only, and a constant one. With one pass (``stats_passes``) the statistics' kernel
    writes the bits too (``threshold_encode`` is not called), a partial last byte included, and the
    statistics are one launch, the partial last bucket in its last program (``stats_tail`` 1) or,
    with ``stats_tail`` 2 (``own``), in a launch of its own."""
    from gradq.kernels import triton_binary

    monkeypatch.setitem(T.TUNING, "stats_elems", 16 * rows)
    monkeypatch.setitem(T.TUNING, "stats_passes", passes)
    monkeypatch.setitem(T.TUNING, "stats_tail", own)
    launched = []
    real = triton_binary._launch

    def counted(kernel, *args, **meta):
        launched.append(kernel)
        return real(kernel, *args, **meta)

    monkeypatch.setattr(triton_binary, "_launch", counted)
    if passes == 1:
        def no_second_pass(*args, **kwargs):
            raise AssertionError("the bits took a pass of their own")

        monkeypatch.setattr(triton_binary, "threshold_encode", no_second_pass)
    g = torch.Generator().manual_seed(tail)
    x = torch.cat([data(16 * 5, tail), -torch.zeros(16), torch.rand(16, generator=g), torch.full((16,), 0.3),
                   torch.randn(tail, generator=g) * 1e3])
    want = {name: fn(x, 16, *extra) for name, fn, extra in (
        ("sign", R.sign_scale_encode, ()), ("onebit", R.onebit_encode, ()),
        *[(f"bingrad{k}", R.bingrad_b_encode, (k,)) for k in range(4)])}

    def refuse(*args, **kwargs):
        raise AssertionError("the torch reference was called")

    monkeypatch.setattr(R, "one_bit_stats", refuse)
    assert same(T.sign_scale_encode(x, 16), want["sign"])
    assert same(T.onebit_encode(x, 16), want["onebit"])
    for k in range(4):
        assert same(T.bingrad_b_encode(x, 16, k), want[f"bingrad{k}"]), k
    stats = 2 if own == 2 and tail else 1   # (launches of the statistics a call)
    assert launched.count(triton_binary._binary_stats_kernel) == 6 * stats
    assert len(launched) == 6 * (stats + passes - 1)


def _level_test_input(bucket: int) -> torch.Tensor:
    """Per bucket size: heavy tails, zeros of both signs in one bucket, ties, a constant run (ORQ's
    intervals without interior values take their midpoint) and a shorter last bucket."""
    g = torch.Generator().manual_seed(bucket)
    zeros = torch.where(torch.rand(3 * bucket, generator=g) < 0.5, 0.0, -0.0)
    ties = torch.randint(-2, 3, (2 * bucket,), generator=g).float()
    return torch.cat([data(4 * bucket, bucket), zeros, ties, torch.full((bucket,), -1.5),
                      torch.randn(bucket // 3 + 1, generator=g)])


def _refuse(*args, **kwargs):
    raise AssertionError("the torch reference was called")


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("bucket", [1, 16, 100, 512])
def test_linear_levels_in_triton(bucket, monkeypatch):
    """Linear's levels come from the Triton sort (the torch reference is not called), equal to the
    reference's bit for bit: zeros of both signs in one bucket (−0.0 sorts first), ties across the
    wanted positions, a shorter last bucket, and L = 3 … 129."""
    x = _level_test_input(bucket)
    chunks = list(R.bucket_chunks(x, bucket))
    want = {L: torch.cat([R.linear_levels(m, L) for m in chunks]) for L in (3, 5, 17, 129)}
    monkeypatch.setattr(R, "linear_levels", _refuse)
    monkeypatch.setattr(R, "sort_rows", _refuse)
    for L, ref in want.items():
        assert same(T.linear_levels(x, L, bucket), ref), L
    with pytest.raises(ValueError, match="2\\^k"):
        T.linear_levels(x, 4, bucket)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("bucket", [1, 2, 7, 100, 512])
def test_orq_levels_in_triton(bucket, monkeypatch):
    """ORQ's levels come from the Triton kernel (the torch reference is not called), equal to the
    reference's bit for bit for L = 3 … 17; more levels take the reference."""
    x = _level_test_input(bucket)
    chunks = list(R.bucket_chunks(x, bucket))
    want = {L: torch.cat([R.orq_levels(m, L) for m in chunks]) for L in (3, 5, 9, 17)}
    with monkeypatch.context() as m:
        m.setattr(R, "orq_levels", _refuse)
        m.setattr(R, "sort_rows", _refuse)
        for L, ref in want.items():
            assert same(T.orq_levels(x, L, bucket), ref), L
        with pytest.raises(AssertionError, match="reference was called"):
            T.orq_levels(x, 33, bucket)
    with pytest.raises(ValueError, match="2\\^k"):
        T.orq_levels(x, 4, bucket)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("bucket", [None, 1, 3, 16, 100, 512])
def test_bingrad_pb_level_in_triton(bucket, monkeypatch):
    """BinGrad-pb's level comes from the Triton kernel, equal to the reference's bit for bit, and
    the encode's bits with it."""
    x = _level_test_input(bucket or 64)
    want = torch.cat([R.bingrad_pb_threshold(m) for m in R.bucket_chunks(x, bucket)])
    encoded = R.bingrad_pb_encode(x, bucket, RandomStream(9))
    monkeypatch.setattr(R, "bingrad_pb_threshold", _refuse)
    assert same(T.bingrad_pb_levels(x, bucket), want)
    assert same(T.bingrad_pb_encode(x, bucket, RandomStream(9)), encoded)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("n,k,seed,elems", [(70_000, 1, 0, 1024), (4_097, 2, 7, 4096), (300_001, 3_000, -3, 1024),
                                            (300_001, 3_000, -3, 512), (1 << 20, 62_000, 2**63 - 1, 4096),
                                            (1 << 20, 62_000, 5, 16384)])
def test_random_subset_in_triton(n, k, seed, elems, monkeypatch):
    """RandK's shared subset from the candidate pass equals the reference's, which is not called
    (4,097 values: a partial last program; 2**20 values and 62,000 draws: near the largest k the
    candidates take there, about n/16), with programs of any size (``subset_elems``)."""
    from gradq.kernels import triton_subset as S

    monkeypatch.setitem(T.TUNING, "subset_elems", elems)
    want = R.random_subset(n, k, seed)
    monkeypatch.setattr(R, "random_subset", _refuse)
    got = S.random_subset(n, k, seed)
    assert got.dtype == torch.int64 and torch.equal(got, want)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("n,k,seed,elems,bins", [
    (4_097, 2, 7, 4096, 2048), (70_000, 1, 0, 1024, 2048), (20_000, 19_999, 5, 2048, 2048),
    (1 << 18, 40_000, 2**63 - 1, 4096, 2048), (1 << 18, 40_000, -3, 1024, 256), (1 << 18, 40_000, 9, 4096, 64)])
def test_random_subset_from_the_implicit_subset(n, k, seed, elems, bins, triton_backend, monkeypatch):
    """``kernels.random_subset`` on the Triton backend writes the indices from the implicit subset
    (the k-th draw found on the device, positions from the running sums): the reference's, bit for
    bit, for any k (one; almost n, past the candidates' n/16), with programs of any size and
    radix levels of 9, 8 or 6 bits (``randk_bins`` 2,048 lets k = 40,000 take 9), and neither the
    reference nor the candidate pass runs, so the host reads nothing."""
    from gradq_testing import HostReads
    from gradq.kernels import triton_randk, triton_subset as S

    monkeypatch.setitem(T.TUNING, "randk_elems", elems)
    monkeypatch.setitem(T.TUNING, "randk_bins", bins)
    monkeypatch.setattr(triton_randk, "_LAST", None)
    want = R.random_subset(n, k, seed)
    monkeypatch.setattr(R, "random_subset", _refuse)
    monkeypatch.setattr(S, "random_subset", _refuse)
    with HostReads() as r:
        got = kernels.random_subset(n, k, seed)
    assert got.dtype == torch.int64 and torch.equal(got, want) and r.reads == 0, r.reads


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("case", ["too few", "no room", "large k", "small n", "k = 0", "k = n", "torch path"])
def test_random_subset_in_triton_falls_back_to_the_reference(case, monkeypatch):
    """Where the candidates cannot decide (a threshold below the k-th draw, or more candidates than
    the buffer holds) or are not used (k past about n/16, nothing to choose, or ``subset_path`` 2),
    the reference gives the subset; a bad k is refused as on the other backends."""
    from gradq.kernels import triton_subset as S

    n, k, seed = {"large k": (10_000, 5_000, 1), "small n": (10, 3, 1), "k = 0": (500, 0, 1),
                  "k = n": (500, 500, 1)}.get(case, (300_001, 3_000, 13))
    want = R.random_subset(n, k, seed)
    ran = []
    real = R.random_subset

    def reference(*args):
        ran.append(args)
        return real(*args)

    monkeypatch.setattr(R, "random_subset", reference)
    if case == "too few":
        monkeypatch.setattr(S, "_candidate_limit", lambda n_, k_: (k_ // 2) * (1 << 32) // n_)
    elif case == "no room":
        monkeypatch.setattr(S, "_candidate_room", lambda per: 10)
    elif case == "torch path":
        monkeypatch.setitem(T.TUNING, "subset_path", 2)
    assert torch.equal(S.random_subset(n, k, seed), want) and ran
    for bad in (-1, n + 1):
        with pytest.raises(ValueError, match="cannot choose"):
            S.random_subset(n, bad, seed)


def _zlib(*parts: torch.Tensor) -> int:
    import zlib

    crc = 0
    for t in parts:
        crc = zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def test_crc_arithmetic_on_the_host():
    """The identity the device CRC rests on: zlib's CRC-32 is ``lin(M)`` (register from 0, no
    inversion), XOR the constant of the length; ``lin`` of a message is the XOR of each word times
    x to the power of its distance from the end, whatever leading zero bytes it has."""
    from gradq.kernels import triton_crc as X

    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 4, 5, 16, 17, 100, 257):
        m = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        padded = bytes((-n) % 4) + bytes(m.tolist())
        lin = 0
        for j in range(0, len(padded), 4):
            word = int.from_bytes(padded[j:j + 4], "little")
            lin ^= X._mulmod_host(X._xpow8_host(len(padded) - j), word)
        assert lin ^ X.crc_constant(n) == _zlib(m), n


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("words", [1, 4, 16, 1024])
def test_crc32_in_triton(words, monkeypatch):
    """The device CRC-32 equals zlib's, for messages of one tensor or several, of any dtype, empty
    parts, lengths around a block (``4·words`` bytes) and many blocks."""
    from gradq.kernels import triton_crc as X

    monkeypatch.setitem(T.TUNING, "crc_words", words)
    g = torch.Generator().manual_seed(words)
    block = 4 * words
    for sizes in ([1], [3], [block - 1], [block], [block + 1], [7 * block + 3], [0, 5], [block, 0, 9, 2 * block + 1]):
        parts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
        got = X.crc32_field(parts)
        assert got.dtype == torch.int32 and got.shape == (1,)
        assert int(got) & 0xFFFFFFFF == _zlib(*parts), sizes
    parts = [torch.randn(33, generator=g), torch.tensor([3, -1], dtype=torch.int64), torch.arange(5, dtype=torch.int32)]
    assert int(X.crc32_field(parts)) & 0xFFFFFFFF == _zlib(*parts)


def test_crc32_field_dispatch(triton_backend):
    """``kernels.crc32_field``: the device kernel on the Triton backend, zlib on the host otherwise;
    the same int32 either way, on the first tensor's device."""
    from gradq.codecs.ans import crc_field

    parts = (torch.arange(1000, dtype=torch.int16), torch.tensor([7], dtype=torch.int64))
    got = kernels.crc32_field(*parts)
    kernels.set_backend("torch")
    assert torch.equal(got, kernels.crc32_field(*parts)) and torch.equal(got, crc_field(*parts))
    with pytest.raises(ValueError, match="at least one"):
        kernels.crc32_field()


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("spec", ["randk-maxnorm:ratio=0.001,bits=4", "randk-multiscale:k=150,rescale=1"])
def test_global_randk_selects_in_triton(spec, triton_backend, monkeypatch):
    """GlobalRandK through the Triton backend (selection, shared scale, codes, decode): the torch
    backend's bytes and floats, with the selection from the candidate pass."""
    x = gpu_input("gradient-like", 200_003, 5)
    q = gradq.build(spec)
    kernels.set_backend("torch")
    ref = q.encode(x, seed=3, shared_seed=11)
    ref_dec = q.decode(ref)
    kernels.set_backend("triton")
    q = gradq.build(spec)     # (a fresh selection memo)
    monkeypatch.setattr(R, "random_subset", _refuse)
    enc = q.encode(x, seed=3, shared_seed=11)
    assert enc.same_bytes(ref), first_difference(enc, ref)
    assert same(q.decode(enc), ref_dec)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("bucket,n", grid([None, 7, 64], [1, 9, 1000],
                                          covering=[(None, 9), (7, 1), (7, 1000), (64, 9)]))
def test_level_and_bit_primitives(n, bucket):
    x = data(n, 100 + n)
    g = torch.Generator().manual_seed(n)
    nb = R.num_buckets(n, bucket)
    for L, w in [(3, 2), (5, 3), (9, 4), (17, 5)]:
        # (ORQ's levels take a program a bucket, which the interpreter runs slowly: with many buckets,
        # 5 levels only; test_orq_levels_in_triton covers every L)
        if nb <= 16 or L == 5:
            enc = T.orq_encode(x, L, bucket, w, RandomStream(1))
            assert same(enc, R.orq_encode(x, L, bucket, w, RandomStream(1))), L
            assert same(T.levels_decode(enc[0], enc[1], bucket, w, n), R.levels_decode(enc[0], enc[1], bucket, w, n))
        assert same(T.linear_encode(x, L, bucket, w, 2), R.linear_encode(x, L, bucket, w, 2))
    t = torch.randn(nb, dtype=torch.float64, generator=g)
    assert same(T.threshold_encode(x, t, bucket), R.threshold_encode(x, t, bucket))
    assert same(T.sign_encode(x), R.sign_encode(x))
    assert same(T.sign_scale_encode(x, bucket), R.sign_scale_encode(x, bucket))
    assert same(T.onebit_encode(x, bucket), R.onebit_encode(x, bucket))
    assert same(T.bingrad_b_encode(x, bucket, 3), R.bingrad_b_encode(x, bucket, 3))
    pb = T.bingrad_pb_encode(x, bucket, RandomStream(4))
    assert same(pb, R.bingrad_pb_encode(x, bucket, RandomStream(4)))
    for lv in (torch.randn(nb, 2, generator=g), torch.randn(nb, generator=g)):
        assert same(T.bit_decode(pb[0], lv, bucket, n), R.bit_decode(pb[0], lv, bucket, n))
    assert host_bound(T.terngrad_stats(x, 2.5, bucket)[0]) == R.terngrad_stats(x, 2.5, bucket)[0]
    assert same(T.terngrad_stats(x, 2.5, bucket)[1], R.terngrad_stats(x, 2.5, bucket)[1])


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("bucket,n", grid([None, 7, 64], [1, 9, 700],
                                          covering=[(None, 700), (7, 9), (64, 1), (64, 700)]))
def test_multiscale_primitives(n, bucket):
    x = data(n, 200 + n)
    for levels, w, iw in [((1, 31), 2, 1), ((1, 3, 15, 127), 2, 2), ((7,), 4, 0), ((3, 31, 127), 3, 2)]:
        sc = R.maxabs_scales(x, bucket) * 1.5
        idx = R.multiscale_indices(x, sc, levels, bucket)
        assert same(T.multiscale_indices(x, sc, levels, bucket), idx)
        enc = T.multiscale_encode(x, sc, idx, levels, bucket, w, iw, RandomStream(3))
        ref = R.multiscale_encode(x, sc, idx, levels, bucket, w, iw, RandomStream(3))
        assert same(enc[0], ref[0]) and (iw == 0 or same(enc[1], ref[1]))
        own = T.multiscale_encode(x, sc, None, levels, bucket, w, iw, RandomStream(3))  # own indices, in the kernel
        assert same(own[0], ref[0]) and (iw == 0 or same(own[1], ref[1]))
        assert same(R.multiscale_encode(x, sc, None, levels, bucket, w, iw, RandomStream(3))[0], ref[0])
        assert same(T.multiscale_decode(*ref, sc, levels, bucket, w, iw, n),
                    R.multiscale_decode(*ref, sc, levels, bucket, w, iw, n))
        if n > 1 and len(levels) > 1:
            high = torch.full_like(idx, len(levels) - 1)
            with pytest.raises(ValueError, match="MIN over workers"):
                T.multiscale_encode(x, sc, high, levels, bucket, w, iw, 0)
            # unchecked (a caller that made the MIN itself): the reference's saturated codes
            got = T.multiscale_encode(x, sc, high, levels, bucket, w, iw, RandomStream(3), check=False)
            want = R.multiscale_encode(x, sc, high, levels, bucket, w, iw, RandomStream(3), check=False)
            assert same(got[0], want[0]) and same(got[1], want[1])
        if len(levels) == 3:           # index 3 names no scale: in a whole program (n = 700) and in the last
            for pos in {min(1, n - 1), n - 1}:
                bad = ref[1].clone()
                bad[pos * iw // 8] |= 3 << (pos * iw % 8)
                with pytest.raises(PayloadError, match="corrupt scale index"):
                    T.multiscale_decode(ref[0], bad, sc, levels, bucket, w, iw, n)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_stream_offsets_past_two_to_the_32():
    """Counters continue from the stream's offset (the high word enters the hash past 2**32) and
    the stream advances as the reference's does."""
    x = data(300, 5)
    for start in (0, 2**32 - 100, 2**40 + 7):
        a, b = RandomStream(9), RandomStream(9)
        a.offset = b.offset = start
        assert same(T.maxabs_uniform_encode(x, 7, 64, 4, a), R.maxabs_uniform_encode(x, 7, 64, 4, b))
        assert a.offset == b.offset == start + 320
        lv = R.orq_levels(x.view(1, -1), 5)
        assert same(T.levels_encode(x, lv, None, 3, a), R.levels_encode(x, lv, None, 3, b))
        assert a.offset == b.offset


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_one_pass_encode_paths():
    """The one-pass QSGD encode's programs run unmasked when they are whole and their counters stay
    below the next multiple of 2**32, masked otherwise; whole ones store 2-, 4- and 8-bit groups as
    words when the output is 4-byte aligned. Every width, aligned and not, with the counters passing
    2**32 inside the second program, gives the reference's bytes."""
    per = T.TUNING["fused_elems"]
    x = data(3 * per + 5, 12)
    for start in (0, 2**32 - per - 100):
        for w in range(1, 9):
            s = (1 << (w - 1)) - 1 or 1
            if 2 * s >= 1 << w or (start and w not in (3, 4)):   # (1 bit holds no sign and magnitude)
                continue
            for shift in ((0, 1) if w in (2, 4, 8) else (w % 2,)):
                a, b = RandomStream(4), RandomStream(4)
                a.offset = b.offset = start
                nbytes = (x.numel() * w + 7) // 8
                out = torch.full((nbytes + shift,), 0xA5, dtype=torch.uint8)[shift:]
                got = T.maxabs_uniform_encode(x, s, 64, w, a, out=out)
                assert got[0] is out and same(got, R.maxabs_uniform_encode(x, s, 64, w, b)), (start, w, shift)
                if w in (3, 4):
                    got = T.l2_uniform_encode(x, s, 64, w, a, out=out)
                    assert got[0] is out and same(got, R.l2_uniform_encode(x, s, 64, w, b)), (start, w, shift)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("bucket", [24, 700])
def test_encode_with_scales_paths(bucket):
    """The element-wise encode (scales given: MaxNorm, TernGrad) reads two scales a program where
    buckets hold at least a program's values (700, and bucket=None), else a bucket per value (24).
    Whole programs run unmasked, as the one-pass encode's; counters pass 2**32 inside one program;
    words are stored where the output is aligned (odd widths: bytes), and trits. Same bytes as the
    reference."""
    per = 8 * T.TUNING["groups"]
    x = data(3 * per + 5, 13)
    sc = R.maxabs_scales(x, bucket) * 0.75     # (some values above their scale: the fields saturate)
    for start in (0, 2**32 - per - 100):
        for w, s in [(0, 1), (2, 1), (3, 3), (4, 7), (8, 127)]:
            for shift in ((0, 1) if w in (0, 4) else (w % 2,)):
                a, b = RandomStream(5), RandomStream(5)
                a.offset = b.offset = start
                if w == 0:
                    out = torch.zeros((x.numel() + 4) // 5 + shift, dtype=torch.uint8)[shift:]
                    got = T.uniform_encode_trits(x, sc, bucket, a, clip=2.0, out=out)
                    ref = R.uniform_encode_trits(x, sc, bucket, b, clip=2.0)
                else:
                    out = torch.zeros((x.numel() * w + 7) // 8 + shift, dtype=torch.uint8)[shift:]
                    got = T.uniform_encode(x, sc, s, bucket, w, a, out=out)
                    ref = R.uniform_encode(x, sc, s, bucket, w, b)
                assert got is out and same(got, ref), (start, w, shift)
                assert a.offset == b.offset


def check_decodes_in_place(packed, sc, dec, ref, mean, ref_mean, margs) -> None:
    """``dec`` equals ``ref`` on one payload aligned or not, and ``mean`` equals ``ref_mean`` on
    three read in place from a shared buffer at a stride that keeps them 4-byte aligned or not."""
    nbytes = packed.numel()
    for shift in (0, 1):
        buf = torch.zeros(nbytes + shift, dtype=torch.uint8)
        buf[shift:] = packed
        assert same(dec(buf[shift:], sc), ref(packed, sc)), shift
    scs = [sc, sc * 3, sc / 7]
    for stride in (nbytes + (-nbytes) % 4, nbytes + 1):
        buf = torch.zeros(3 * stride, dtype=torch.uint8)
        rows = [buf[k * stride:k * stride + nbytes] for k in range(3)]
        for k, r in enumerate(rows):
            r.copy_(packed if k != 1 else packed.flip(0))
        assert same(mean(rows, scs, *margs), ref_mean([r.clone() for r in rows], scs, *margs)), stride


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("bucket", [24, 700])
def test_decode_paths(bucket):
    """The decode takes the encode's paths (two scales a program or a bucket a value, unmasked whole
    programs) and loads 2-, 4- and 8-bit groups as words where every payload is 4-byte aligned:
    one payload aligned or not, and means of three read in place from a shared buffer at a stride
    that keeps them aligned or not. Same floats as the reference, and corrupt codes found in a
    whole program and in the last."""
    per = 8 * T.TUNING["groups"]
    n = 2 * per + 5
    x = data(n, 14)
    sc = R.maxabs_scales(x, bucket)
    for w, s in [(0, 1), (2, 1), (3, 3), (4, 7), (8, 127)]:
        if w == 0:
            packed = R.uniform_encode_trits(x, sc, bucket, 3)
            dec = functools.partial(T.uniform_decode_trits, bucket=bucket, n=n)
            ref = functools.partial(R.uniform_decode_trits, bucket=bucket, n=n)
            mean, ref_mean = T.uniform_decode_trits_mean, R.uniform_decode_trits_mean
            margs = (bucket, n)
        else:
            packed = R.uniform_encode(x, sc, s, bucket, w, 3)
            dec = functools.partial(T.uniform_decode, s=s, bucket=bucket, width=w, n=n)
            ref = functools.partial(R.uniform_decode, s=s, bucket=bucket, width=w, n=n)
            mean, ref_mean = T.uniform_decode_mean, R.uniform_decode_mean
            margs = (s, bucket, w, n)
        check_decodes_in_place(packed, sc, dec, ref, mean, ref_mean, margs)
    two_bit = R.uniform_encode(x, sc, 1, bucket, 2, 3)
    for pos in (5, n - 2):             # a field 3 (not a trit) in a whole program, then in the last
        bad = two_bit.clone()
        bad[pos // 4] |= 3 << (2 * (pos % 4))
        with pytest.raises(PayloadError, match="fields above 2"):
            T.uniform_decode(bad, sc, 1, bucket, 2, n, max_field=2)
    assert same(T.uniform_decode(two_bit, sc, 1, bucket, 2, n, max_field=2),
                R.uniform_decode(two_bit, sc, 1, bucket, 2, n))
    trits = R.uniform_encode_trits(x, sc, bucket, 3)
    for pos in (5, trits.numel() - 1):
        bad = trits.clone()
        bad[pos] = 250
        with pytest.raises(PayloadError, match="above 242"):
            T.uniform_decode_trits(bad, sc, bucket, n)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("bucket,sizes", [(None, None), (24, None), (2000, None), (2000, (64, 32))])
def test_trit_paths(bucket, sizes, monkeypatch):
    """TernGrad's trits take four bytes (twenty values) a thread in whole programs whose payloads
    are 4-byte aligned: the encode reads five 16-byte rows and writes a word, the decode reads a
    word a payload and writes five rows, regrouping the values in registers. Other programs (the
    last, and every one where a payload is not aligned) go a byte at a time. Both paths, with two
    scales a program (None, 2000: buckets of at least a program's values), a scale a value (24),
    counters passing 2**32 inside a program, and means of three read in place at aligned and
    unaligned strides: the reference's bytes and floats. Every valid byte decodes as the
    reference's in a whole program, and a corrupt byte is found in a whole program and in the last.
    At the shipped program sizes, and at others a tuning file may give (a word a program)."""
    if sizes:
        monkeypatch.setitem(T.TUNING, "trit_bytes", sizes[0])
        monkeypatch.setitem(T.TUNING, "trit_decode_bytes", sizes[1])
    per = 5 * max(T.TUNING["trit_bytes"], T.TUNING["trit_decode_bytes"])
    n = max(2 * per + 7, 2567)
    x = data(n, 21)
    # scales near the values (clip=2.0 leaves every field 0 under a heavy tail's max-abs), and a
    # first bucket a million times larger: the value that opens the next bucket (inside a whole
    # program for 2000) gives another field under its neighbour's scale
    nb = 1 if bucket is None else -(-n // bucket)
    sc = 0.5 + torch.rand(nb, generator=torch.Generator().manual_seed(3))
    if bucket:
        sc[0] = 1e6
        x[bucket - 1] = x[bucket] = 0.99 * float(sc[1])
    for start in (0, 2**32 - per - 100):
        for shift in (0, 1):
            a, b = RandomStream(5), RandomStream(5)
            a.offset = b.offset = start
            out = torch.zeros((n + 4) // 5 + shift, dtype=torch.uint8)[shift:]
            got = T.uniform_encode_trits(x, sc, bucket, a, clip=2.0, out=out)
            assert got is out and same(got, R.uniform_encode_trits(x, sc, bucket, b, clip=2.0)), (start, shift)
            assert a.offset == b.offset
    packed = R.uniform_encode_trits(x, sc, bucket, 3)
    packed[:243] = torch.arange(243, dtype=torch.uint8)    # every valid byte, in the first (whole) program
    nbytes = packed.numel()
    check_decodes_in_place(packed, sc, functools.partial(T.uniform_decode_trits, bucket=bucket, n=n),
                           functools.partial(R.uniform_decode_trits, bucket=bucket, n=n),
                           T.uniform_decode_trits_mean, R.uniform_decode_trits_mean, (bucket, n))
    for pos in (8, 13, 18, 23, nbytes - 1):      # each byte of a word in a whole program, and the last
        for byte in (243, 255):
            bad = packed.clone()
            bad[pos] = byte
            with pytest.raises(PayloadError, match="corrupt codes: 1 bytes above 242"):
                T.uniform_decode_trits(bad, sc, bucket, n)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("spec", ["terngrad", "terngrad:pack=2bit", "linear:levels=5,bucket=512",
                                  "multiscale:bits=2+6,bucket=512"])
def test_invalid_field_counts_need_no_zeroed_buffer(spec, monkeypatch):
    """The checked decodes (trits, 2-bit TernGrad, level and MultiScale indices) and MultiScale's
    encode count invalid fields into a buffer of a count a program that they do not zero first:
    every program writes its count, and every output byte and float is written. With ``torch.empty``
    handing out buffers full of 7s (NaN for floats) during the Triton calls, the encode (and the
    all-reduce's fields under shared statistics) gives the reference's bytes and the decode its
    floats, with no error."""
    n = 2 * 5 * max(T.TUNING["trit_decode_bytes"], T.TUNING["groups"]) + 7
    x = data(n, 41)
    q = gradq.build(spec)
    was = kernels.get_backend()
    kernels.set_backend("torch")
    try:
        want = q.encode(x, seed=2)
        want_dec = q.decode(want)
        shared = _larger_scales(q.shared_stats(x, shared_seed=11)) if spec.startswith("multiscale") else None
        want_fields = shared and q.encode_fields(x, seed=3, shared=shared, shared_seed=11)
    finally:
        kernels.set_backend(was)
    real = torch.empty

    def dirty(*args, **kw):
        t = real(*args, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else 7) if t.numel() else t

    kernels.set_backend("triton")
    try:
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", dirty)
            got = q.encode(x, seed=2)
            dec = q.decode(want)
            # (MultiScale's encode under shared scales reads its count: a check of the shared indices)
            fields = shared and q.encode_fields(x, seed=3, shared=shared, shared_seed=11)
    finally:
        kernels.set_backend(was)
    assert got.same_bytes(want) and same(dec, want_dec)
    assert shared is None or same(fields, want_fields)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_level_and_one_bit_paths():
    """Level rounding, one-bit thresholds, BinGrad-pb's bits and their decodes run a whole program
    inside one bucket unmasked, with the bucket's levels as scalars, and any other program (one
    across buckets of 700, the last) masked; counters pass 2**32 inside a program; index words are
    read and written whole where aligned. Same bytes and floats as the reference, and an index out
    of range is found in a whole program and in the last."""
    per = 8 * T.TUNING["groups"]
    n = 3 * per + 5
    x = data(n, 15)
    bucket = 700
    nb = -(-n // bucket)
    rows = x.new_zeros(nb * bucket)
    rows[:n] = x
    mat = rows.view(nb, bucket)
    for L, w in [(5, 3), (9, 4)]:
        lv = R.linear_levels(mat, L)
        for start, shift in [(0, 0), (2**32 - per - 100, 1)]:
            a, b = RandomStream(6), RandomStream(6)
            a.offset = b.offset = start
            out = torch.zeros((n * w + 7) // 8 + shift, dtype=torch.uint8)[shift:]
            packed = T.levels_encode(x, lv, bucket, w, a, out=out)
            assert packed is out and same(packed, R.levels_encode(x, lv, bucket, w, b)), (L, start)
            assert same(T.levels_decode(packed, lv, bucket, w, n), R.levels_decode(packed, lv, bucket, w, n))
        for pos in (3, n - 1):
            bad = R.levels_encode(x, lv, bucket, w, 1).clone()
            bit = pos * w
            bad[bit // 8] |= (((1 << w) - 1) << (bit % 8)) & 0xFF   # (an index of all ones: ≥ L)
            if (bit % 8) + w > 8:
                bad[bit // 8 + 1] |= ((1 << w) - 1) >> (8 - bit % 8)
            with pytest.raises(PayloadError, match="out of range"):
                T.levels_decode(bad, lv, bucket, w, n)
    t = R.pairwise_row_sum(mat.to(torch.float64)) / bucket
    bits = T.threshold_encode(x, t, bucket)
    assert same(bits, R.threshold_encode(x, t, bucket))
    two = torch.stack([mat.min(dim=1).values, mat.max(dim=1).values], dim=1)
    assert same(T.bit_decode(bits, two, bucket, n), R.bit_decode(bits, two, bucket, n))
    assert same(T.bit_decode(bits, two[:, 1], bucket, n), R.bit_decode(bits, two[:, 1], bucket, n))
    for start in (0, 2**32 - per - 100):
        a, b = RandomStream(7), RandomStream(7)
        a.offset = b.offset = start
        assert same(T.bingrad_pb_encode(x, bucket, a), R.bingrad_pb_encode(x, bucket, b)), start


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_empty_one_value_and_zero_buckets():
    for x in (torch.zeros(0), torch.tensor([2.5]), torch.zeros(64), torch.tensor([-0.0] * 9)):
        n = x.numel()
        assert same(T.maxabs_uniform_encode(x, 7, 8, 4, 0), R.maxabs_uniform_encode(x, 7, 8, 4, 0))
        packed, sc = R.maxabs_uniform_encode(x, 7, 8, 4, 0)
        assert same(T.uniform_decode(packed, sc, 7, 8, 4, n), R.uniform_decode(packed, sc, 7, 8, 4, n))


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_out_buffers_and_errors():
    x = data(100, 1)
    packed, sc = R.maxabs_uniform_encode(x, 7, 16, 4, 0)
    out = torch.full((100,), 7.0)
    assert T.uniform_decode(packed, sc, 7, 16, 4, 100, out=out) is out
    assert same(out, R.uniform_decode(packed, sc, 7, 16, 4, 100))
    with pytest.raises(ValueError, match="out must be"):
        T.uniform_decode(packed, sc, 7, 16, 4, 100, out=torch.empty(99))
    with pytest.raises(PayloadError, match="need 50 bytes"):
        T.uniform_decode(packed[:-1], sc, 7, 16, 4, 100)
    bad = torch.full((20,), 255, dtype=torch.uint8)   # TernGrad 2-bit: field 3 is not a trit
    with pytest.raises(PayloadError, match="fields above 2"):
        T.uniform_decode(bad, torch.ones(1), 1, None, 2, 80, max_field=2)
    with pytest.raises(PayloadError, match="above 242"):
        T.uniform_decode_trits(torch.full((4,), 243, dtype=torch.uint8), torch.ones(1), None, 20)
    lv = R.orq_levels(x.view(1, -1), 5)
    with pytest.raises(PayloadError, match="out of range"):
        T.levels_decode(torch.full((38,), 255, dtype=torch.uint8), lv, None, 3, 100)
    with pytest.raises(ValueError, match="do not fit"):
        T.uniform_encode(x, sc, 8, 16, 4, 0)


# -- schemes, through the quantizers --------------------------------------------------------------
FIXED_WIDTH = [
    "qsgd", "qsgd:bits=2,bucket=128", "qsgd:bits=8,bucket=none", "qsgd:levels=5,bucket=7,norm=l2",
    "maxnorm", "maxnorm:bits=2,bucket=64", "maxnorm:bits=4,norm=l2", "multiscale", "multiscale:bits=2+4+8,bucket=64",
    "randk-multiscale:ratio=0.5", "terngrad", "terngrad:pack=2bit,bucket=100",
    "terngrad:clip=none,bucket=33", "randk-maxnorm:ratio=0.3", "orq", "orq:levels=3,bucket=100",
    "linear:levels=9", "bingrad-b", "signsgd", "onebit:ef=0", "bingrad-pb",
    "randk-maxnorm:ratio=0.01",   # (selected by the Triton candidate pass from about 2,100 values on)
]


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("kind,spec", grid(
    ["edge cases", "gradient-like"], FIXED_WIDTH,
    # every scheme on the edge cases; on gradient-like values one scheme of each kernel family
    covering=[("edge cases", s) for s in FIXED_WIDTH] + [("gradient-like", s) for s in (
        "qsgd:levels=5,bucket=7,norm=l2", "maxnorm", "multiscale:bits=2+4+8,bucket=64", "terngrad", "orq",
        "linear:levels=9", "bingrad-b", "bingrad-pb")]))
def test_schemes_give_the_reference_bytes(spec, kind, triton_backend):
    x = gpu_input(kind, 1100, 3)
    q = gradq.build(spec)
    assert kernels.backend_for(x) == "triton"
    enc = q.encode(x, seed=7)
    dec = q.decode(enc)
    into = torch.full_like(x, float("nan"))
    assert q.decode(enc, out=into) is into and same(into, dec)   # (the kernels' own decode into out=)
    mean = q.decode_mean([enc, q.encode(x * 2, seed=8)])
    kernels.set_backend("torch")
    ref = q.encode(x, seed=7)
    assert enc.same_bytes(ref), first_difference(enc, ref)
    assert same(dec, q.decode(ref))
    assert same(mean, q.decode_mean([ref, q.encode(x * 2, seed=8)]))


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("spec", ["qsgd", "maxnorm:bits=4,bucket=64", "terngrad", "orq", "signsgd"])
def test_non_finite_input_raises_as_before(spec, triton_backend):
    x = data(200, 4)
    x[17] = float("nan")
    with pytest.raises(NonFiniteError):
        gradq.build(spec).encode(x, seed=0)
    x[17] = float("inf")
    with pytest.raises(NonFiniteError):
        gradq.build(spec).encode(x, seed=0)


def _summable_encode(q, x: torch.Tensor, **kw) -> torch.Tensor:
    """As the all-reduce protocol encodes: the fields where the scheme has them, else the codes."""
    fields = q.encode_fields(x, seed=1, shared_seed=11, **kw)
    return fields if fields is not None else q.encode_codes(x, seed=1, shared_seed=11, **kw)


def _larger_scales(stats) -> dict:
    """Shared statistics as a reduction over workers could make them: larger scales (MAX), the same
    MultiScale indices (MIN, under the smaller scales)."""
    return {k: s.value * 1.5 if k == "scale" else s.value.clone() for k, s in stats.items()}


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("spec", ["maxnorm:bits=4,bucket=64", "multiscale:bucket=64", "multiscale:bits=3+5+8",
                                  "randk-multiscale:ratio=0.3"])
def test_summable_fields_match(spec, triton_backend):
    """The all-reduce's fields (own statistics, and shared ones of a reduction: larger scales; also
    into an unaligned slice of a buffer) and the average from their sum: the torch reference's, bit
    for bit."""
    q = gradq.build(spec)
    x = data(500, 6)
    stats = q.shared_stats(x, shared_seed=11)
    shared = _larger_scales(stats)
    fields = [q.encode_fields(x, seed=3, shared_seed=11), q.encode_fields(x, seed=3, shared=shared, shared_seed=11)]
    buf = torch.zeros(q.num_codes(x.numel()) + 1, dtype=torch.uint8)   # (the pooled buffer's unaligned slice)
    assert same(q.encode_fields(x, seed=3, shared=shared, shared_seed=11, out=buf[1:]), fields[1])
    total = (fields[1].to(torch.int32) * 2).to(torch.uint8)   # two workers with the same fields
    avg = q.decode_field_sum(total, shared=shared, count=2, like=x, shared_seed=11)
    kernels.set_backend("torch")
    assert same(fields[0], q.encode_fields(x, seed=3, shared_seed=11))
    assert same(fields[1], q.encode_fields(x, seed=3, shared=shared, shared_seed=11))
    assert same(avg, q.decode_field_sum(total, shared=shared, count=2, like=x, shared_seed=11))


def test_backend_choice():
    """CPU tensors take numba (or torch) unless Triton is forced; the interpreter serves them then."""
    was = kernels.get_backend()
    try:
        kernels.set_backend("auto")
        assert kernels.backend_for(torch.zeros(3)) in ("numba", "torch")
        kernels.set_backend("triton")
        assert kernels.backend_for(torch.zeros(3)) == ("triton" if T.INTERPRETED else kernels.backend_for(
            torch.zeros(3)))
        with pytest.raises(ValueError, match="unknown kernel backend"):
            kernels.set_backend("cuda")
    finally:
        kernels.set_backend(was)


# -- on a real GPU --------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec", FIXED_WIDTH)
@pytest.mark.parametrize("kind", ["edge cases", "gradient-like"])
def test_gpu_bytes_equal_the_cpu_reference(spec, kind):
    """On CUDA the default backend is Triton, and its bytes, decodes (also into ``out=``) and
    decode_mean equal the CPU's: on the edge-case data (whose huge values zero most codes) and on
    gradient-like values (every code and every rounding draw in play)."""
    x = gpu_input(kind, 300_001, 9)
    q = gradq.build(spec)
    assert kernels.backend_for(x.cuda()) == "triton"
    enc = q.encode(x.cuda(), seed=5)
    dec = q.decode(enc)
    into = torch.full_like(x, float("nan"), device="cuda")
    assert q.decode(enc, out=into) is into and same_decode(into.cpu(), dec.cpu())   # (decode into out=)
    mean = q.decode_mean([enc, q.encode(x.cuda() * 2, seed=6)])
    was = kernels.get_backend()
    kernels.set_backend("torch")
    try:
        ref = q.encode(x, seed=5)
        assert enc.same_bytes(ref), first_difference(enc, ref)  # (compared on the CPU)
        assert same_decode(dec.cpu(), q.decode(ref)), first_difference(dec, q.decode(ref))
        ref_mean = q.decode_mean([ref, q.encode(x * 2, seed=6)])
        assert same_decode(mean.cpu(), ref_mean), first_difference(mean, ref_mean)
    finally:
        kernels.set_backend(was)


def gpu_input(kind: str, n: int, seed: int) -> torch.Tensor:
    """``data`` for "edge cases"; for "gradient-like", log-normally scaled Gaussians (no huge values)."""
    if kind == "edge cases":
        return data(n, seed)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) / 2)


def same_decode(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``same``, except that a NaN matches any NaN: where a decode makes a NaN (``0 · inf``), x86
    makes a negative NaN and CUDA a positive one. (The edge-case data's huge values once gave an L2
    scale of inf; norms now saturate at the largest float32, but a NaN's sign is still no part of
    the result.)"""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and same(torch.where(nan, 0.0, a), torch.where(nan, 0.0, b))


def first_difference(a, b) -> str:
    """Where two payloads (field by field) or two tensors first differ, for a failure message."""
    if isinstance(a, torch.Tensor):
        pairs = {"tensor": (a, b)}
    else:
        pairs = {k: (a.fields[k], b.fields.get(k)) for k in a.fields}
    out = []
    for k, (u, v) in pairs.items():
        if v is None or u.shape != v.shape or u.dtype != v.dtype:
            out.append(f"{k}: {None if v is None else (v.dtype, tuple(v.shape))} vs {(u.dtype, tuple(u.shape))}")
            continue
        u, v = u.detach().cpu().reshape(-1), v.detach().cpu().reshape(-1)
        bad = (u.view(torch.uint8) if u.dtype != torch.uint8 else u) != (v.view(torch.uint8) if v.dtype != torch.uint8
                                                                          else v)
        if bad.any():
            i = int(bad.nonzero()[0]) // max(1, u.element_size())
            out.append(f"{k}: {int(bad.sum())} bytes differ; first element {i}: {u[i].item()!r} here, "
                       f"{v[i].item()!r} in the reference")
    return "; ".join(out) or "no field differs (header?)"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec", ["qsgd:bits=4,bucket=512", "qsgd:bits=2,bucket=512,norm=l2", "maxnorm:bits=4",
                                  "terngrad", "linear:levels=5", "orq:levels=5", "orq:levels=9", "signsgd",
                                  "onebit:ef=0", "bingrad-b", "bingrad-pb"])
def test_gpu_encode_needs_no_input_sized_temporaries(spec):
    """Peak extra memory of an encode: at most 1.25x the payload's bytes (the schemes that meet it;
    bench_codecs.py --memory --device cuda measures every scheme)."""
    x = torch.randn(1 << 24, device="cuda")
    q = gradq.build(spec)
    q.encode(x, seed=0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    enc = q.encode(x, seed=1)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 1.25 * enc.nbytes, (extra, enc.nbytes)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec", ["qsgd:bits=4,bucket=64", "maxnorm:bits=4,bucket=64", "multiscale:bits=2+6,bucket=64",
                                  "terngrad", "terngrad:bucket=64",
                                  "signsgd:bucket=64", "onebit:ef=0,bucket=7", "bingrad-b:iters=3,bucket=64",
                                  "linear:levels=5,bucket=64"])
@pytest.mark.parametrize("witness", [1, 2])
def test_gpu_non_finite_input_is_found_after_the_encode(spec, witness, monkeypatch):
    """The compiled kernels run on NaN/Inf harmlessly and the payload field that these schemes read
    instead of a separate screen shows them: every NaN or Inf, first, middle or in a partial last
    bucket, is refused by name, as on the CPU (tests/kernels/test_dispatch.py); the field looked at
    by torch's sum or by the flags kernel (``witness_path`` 1, 2)."""
    monkeypatch.setitem(T.TUNING, "witness_path", witness)
    q = gradq.build(spec)
    for n in (1, 100, 301):
        for pos in sorted({0, n // 2, n - 1}):
            for bad in (float("nan"), -float("nan"), float("inf"), -float("inf")):
                x = data(n, n + pos)
                x[pos] = bad
                with pytest.raises(NonFiniteError, match="'fc.w' holds"):
                    q.encode(x.cuda(), seed=1, name="fc.w")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec", ["qsgd:bits=4,bucket=512", "qsgd:bits=2,bucket=512,norm=l2", "maxnorm:bits=4",
                                  "terngrad", "terngrad:pack=2bit,bucket=4096", "multiscale:bits=2+6",
                                  "signsgd", "onebit:ef=0", "bingrad-b", "linear:levels=5", "ef(qsgd:bits=2)",
                                  "topk:ratio=0.01", "ef(topk:ratio=0.01)", "randk:ratio=0.01",
                                  "randk-maxnorm:ratio=0.01,bits=4", "randk-multiscale:ratio=0.01,bits=2+6"])
def test_gpu_unchecked_encode_never_waits_for_the_device(spec):
    """``encode(check_finite=False)``, as the DDP hook calls it, asks nothing of the device on the
    host: under torch's synchronization debug mode "error" any call that waits for the GPU (a host
    read, a blocking copy) raises. The checked encode reads its NaN/Inf witness (one wait). The
    Rand-K family's selection is made again inside the call, as a new shared seed makes it."""
    from gradq.kernels import triton_randk

    x = torch.randn(1 << 20, device="cuda")
    want = gradq.build(spec).encode(x, seed=1)   # (compiles the kernels; the checked encode's bytes)
    q = gradq.build(spec)                         # (a fresh one: error feedback's state moves on)
    triton_randk._LAST = None                     # (no selection kept)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = q.encode(x, seed=1, check_finite=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.same_bytes(want)


#: the schemes of the shared-scale all-reduce, by their encodes' statistics
ALLREDUCE_SPECS = ["maxnorm:bits=4", "maxnorm:bits=2,bucket=4096", "terngrad", "ef(maxnorm:bits=4)", "multiscale",
                   "multiscale:bucket=512,norm=l2", "randk-multiscale:ratio=0.01", "ef(multiscale)"]


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("spec", ["multiscale", "randk-multiscale:ratio=0.25", "randk-multiscale:ratio=0.01",
                                  "terngrad", "ef(multiscale)"])
def test_shared_scale_encode_reads_nothing_on_the_host(spec, triton_backend):
    """The all-reduce protocol's encode on the Triton backend (statistics, then fields or codes under
    the reduced ones with ``own=`` the statistics they were reduced from, unchecked): no host read
    (on a GPU, a wait for the device), and the bytes of the checked call without ``own=``.
    MultiScale's encode under shared indices refuses one above the worker's own with a host read;
    with ``own=`` the caller made the MIN over workers itself, so it is skipped. Error feedback's
    decode of its own fields leaves its index check to the protocol's decode of their sum."""
    from gradq_testing import HostReads

    x = gpu_input("gradient-like", 3001, 2)
    q = gradq.build(spec)
    stats = q.shared_stats(x, shared_seed=11)
    shared = _larger_scales(stats)
    with HostReads() as checked:
        want = _summable_encode(q, x, shared=shared)
    q = gradq.build(spec)
    with HostReads() as given:
        got = _summable_encode(q, x, shared=shared, check_finite=False,
                               own=q.shared_stats(x, shared_seed=11, check_finite=False))
    assert torch.equal(got, want)
    assert checked.reads >= 1 and given.reads == 0, (checked.reads, given.reads)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("spec", ["randk-multiscale:ratio=0.01", "randk-maxnorm:ratio=0.01"])
def test_randk_field_sum_decode_reads_nothing_on_the_host(spec, triton_backend):
    """The all-reduce's decode of a GlobalRandK scheme's field sum with its checks deferred (as the
    protocol decodes): the Triton backend scatters on the implicit subset, so no host read (the
    candidates' count of the indices' path was one, a wait for the GPU every step), and the values
    are the reference backend's, bit for bit, into ``out=`` as into a new tensor."""
    from gradq_testing import HostReads

    x = gpu_input("gradient-like", 3001, 2)
    q = gradq.build(spec)
    shared = _larger_scales(q.shared_stats(x, shared_seed=11))
    total = _summable_encode(q, x, shared=shared).to(torch.int32).mul_(2).to(torch.uint8)   # (two equal workers)
    kernels.set_backend("torch")
    want = q.decode_field_sum(total, shared=shared, count=2, like=x, shared_seed=11)
    kernels.set_backend("triton")
    out = torch.full_like(x, float("nan"))
    q = gradq.build(spec)   # (a fresh one: no selection kept from the encode, as in a new step)
    with HostReads() as r, kernels.deferred_checks() as checks:
        got = q.decode_field_sum(total, shared=shared, count=2, like=x, shared_seed=11, out=out)
    assert r.reads == 0, r.reads
    checks.check()   # (nothing corrupt: the sum of two workers' fields)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec", ALLREDUCE_SPECS)
def test_gpu_shared_scale_encode_never_waits_for_the_device(spec):
    """The all-reduce protocol's encode as the DDP hook makes it (statistics, then fields or codes
    under the reduced ones with ``own=`` the statistics they were reduced from, unchecked): no call
    that waits for the GPU (torch's synchronization debug mode "error" raises on one), and the
    bytes of the checked path."""
    x = torch.randn(1 << 20, device="cuda")
    q = gradq.build(spec)
    shared = _larger_scales(q.shared_stats(x, shared_seed=11))
    want = _summable_encode(q, x, shared=shared)
    q = gradq.build(spec)                                    # (a fresh one: error feedback's state moves on)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        own = q.shared_stats(x, shared_seed=11, check_finite=False)
        got = _summable_encode(q, x, shared=shared, check_finite=False, own=own)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("launches,chunk", [(1, 1024), (2, 1024), (2, 64)])
def test_gpu_terngrad_statistics_of_many_blocks(launches, chunk, monkeypatch):
    """TernGrad's σ, bound and clipped max on CUDA over thousands of blocks, merged by the block that
    finishes last (``moment_launches`` 1: 9M values are 3 runs; 40M values, 10 runs, take the tree)
    or by the tree (of 1,024 or 64 triples a program): the reference's, ten times over (the ticket
    that elects the last block must not let it read a triple before it is written)."""
    monkeypatch.setitem(T.TUNING, "moment_launches", launches)
    monkeypatch.setitem(T.TUNING, "moment_chunk", chunk)
    g = torch.Generator().manual_seed(launches + chunk)
    for n in (9_000_001, 40_000_003):
        x = torch.randn(n, generator=g) * 0.01 + 0.003
        want = R.population_std(x), R.terngrad_stats(x, 2.5, None)
        xc = x.cuda()
        for _ in range(10):
            sigma = T.population_std(xc)
            bound, top = T.terngrad_stats(xc, 2.5, None)
            assert same(sigma.cpu().reshape(1), want[0].reshape(1)), (n, float(sigma), float(want[0]))
            assert float(bound) == want[1][0] and same(top.cpu(), want[1][1]), (n, float(bound), want[1])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("path", ["implicit", "candidates"])
def test_gpu_random_subset_equals_the_cpu(path, monkeypatch):
    """RandK's selection on CUDA is the CPU reference's, five times over for 25M values: written
    from the implicit subset (the default), or from the candidate pass where that declines
    (``randk_path`` 2; its programs append their candidates in whatever order they run). At its
    peak the implicit path holds the result (8 bytes an index) and its selection's state (a
    histogram of at most 2,048 bins, an int32 a program): within 8 bytes an index and 64 KiB. The
    candidate pass holds the candidates' keys (8 bytes for each of about 1.04·k), and torch.sort's
    values, indices and radix-sort scratch for the 1.02·k found (about 8 + 8 + 16 bytes each): about
    49 bytes an index (an H200 measured 49.4), bounded at 56 — both far below the reference's 8 bytes
    a coordinate (800 an index at 1 %)."""
    from gradq.kernels import triton_randk

    if path == "candidates":
        monkeypatch.setitem(T.TUNING, "randk_path", 2)
    for n, k, seed, reps in ((25_000_000, 250_000, 3, 5), (1 << 20, 62_000, -1, 1), (300_001, 3_000, 2**63 - 1, 1)):
        want = R.random_subset(n, k, seed)
        for _ in range(reps):
            triton_randk._LAST = None   # (the selection made again each time)
            got = kernels.random_subset(n, k, seed, "cuda")
            assert got.is_cuda and torch.equal(got.cpu(), want), (n, k, seed)
    triton_randk._LAST = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    idx = kernels.random_subset(25_000_000, 250_000, 4, "cuda")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= (8 * idx.numel() + (1 << 16) if path == "implicit" else 56 * idx.numel()), peak


@pytest.mark.gpu
@gpu
def test_gpu_crc32_equals_zlib():
    """The device CRC-32 on CUDA (programs XOR their blocks' shares in whatever order they finish)
    equals zlib's, for 12 MB in one tensor (about an Elias stream of 25M values) and for several
    tensors, and never waits for the device on the host."""
    g = torch.Generator().manual_seed(1)
    for sizes in ([12_500_003], [1, 4096 * 3 + 1, 0, 77]):
        parts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
        want = _zlib(*parts)
        dev = [t.cuda() for t in parts]
        kernels.crc32_field(*dev)            # (compiles the kernel)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = kernels.crc32_field(*dev)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got.is_cuda and int(got) & 0xFFFFFFFF == want, sizes


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec", ["qsgd:bits=4,coding=elias", "qsgd:bits=2,bucket=none,norm=l2,coding=elias-sparse",
                                  "qsgd:levels=100,coding=elias-dense"])
@pytest.mark.parametrize("kind", ["edge cases", "gradient-like"])
def test_gpu_elias_stream_equals_the_cpu(spec, kind):
    """Elias-coded QSGD on CUDA: codes and stream from the Triton kernels; the bytes equal the CPU's,
    and the decode too."""
    x = gpu_input(kind, 200_003, 11)
    q = gradq.build(spec)
    enc = q.encode(x.cuda(), seed=3)
    assert enc["stream"].is_cuda
    ref = q.encode(x, seed=3)
    assert enc.same_bytes(ref), first_difference(enc, ref)
    assert same_decode(q.decode(enc).cpu(), q.decode(ref))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec", ["qsgd:bits=4,coding=elias", "qsgd:bits=2,bucket=none,norm=l2,coding=elias-sparse",
                                  "qsgd:bits=8,coding=elias-dense", "qsgd:bits=4,coding=elias-sparse"])
def test_gpu_elias_stream_read_on_the_device(spec, monkeypatch):
    """Elias-coded QSGD decoded on CUDA by the device's reader (the host's reader is not called),
    4M gradient-like values, both layouts: the CPU's values bit for bit, into ``out=`` too."""
    from gradq.codecs import qsgd_stream

    x = gpu_input("gradient-like", 4_000_037, 13)
    q = gradq.build(spec)
    enc = q.encode(x.cuda(), seed=5)
    want = q.decode(q.encode(x, seed=5))

    def host_reader(*args, **kwargs):
        raise AssertionError("the stream was read on the host")

    monkeypatch.setattr(qsgd_stream, "decode_fields_stream", host_reader)
    out = torch.empty(x.numel(), device="cuda")
    q.decode(enc, out=out)
    assert same_decode(q.decode(enc).cpu(), want)
    assert same_decode(out.cpu(), want)


def test_launch_settings_from_the_environment(tmp_path, monkeypatch):
    """GRADQ_TRITON_TUNING names a JSON file of launch settings (what bench_triton_tuning.py --best
    writes): known keys with powers of two replace the shipped ones; anything else is refused by name."""
    from gradq.kernels import triton_common as C   # (where the settings live; T.TUNING is the same table)

    assert C.TUNING is T.TUNING
    for key, value in T.TUNING.items():    # (restored after the test)
        monkeypatch.setitem(T.TUNING, key, value)
    f = tmp_path / "best.json"
    f.write_text('{"stats_elems": 512, "stats_warps": 8}')
    monkeypatch.setenv("GRADQ_TRITON_TUNING", str(f))
    C._tuning_from_env()
    assert (T.TUNING["stats_elems"], T.TUNING["stats_warps"]) == (512, 8)
    for bad in ('{"stats_elems": 500}', '{"groups": 0}', '{"no_such_key": 4}', '{"groups": 64.0}', '[64]'):
        f.write_text(bad)
        with pytest.raises(ValueError, match="GRADQ_TRITON_TUNING"):
            C._tuning_from_env()
