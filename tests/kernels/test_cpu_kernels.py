"""gradq.kernels (numba): bit-exact agreement with the plain-torch references for every fixed-width
scheme, over widths, sizes, bucket sizes and awkward values, plus thread-count independence, stream
bookkeeping, payload validation and the on/off switch.

Every comparison is ``torch.equal`` on bytes or float32 values (no tolerance): the kernels promise the
reference's exact bits. Skipped as a whole when numba is not installed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

pytest.importorskip("numba")

import numba  # noqa: E402
import numpy as np  # noqa: E402

from gradq import kernels as K  # noqa: E402
from gradq.kernels import reference as R  # noqa: E402
from gradq.codecs.bitpack import pack_bits, pack_trits, unpack_bits, unpack_trits  # noqa: E402
from gradq.errors import PayloadError  # noqa: E402
from gradq.quantizers._common import bucket_chunks, bucket_norms, bucket_view, code_width  # noqa: E402
from gradq.quantizers.binary import bingrad_b_levels  # noqa: E402
from gradq.quantizers.orq import bucket_index, linear_levels, orq_levels, round_to_levels  # noqa: E402
from gradq.quantizers.qsgd import uniform_codes, uniform_decode  # noqa: E402
from gradq.quantizers.terngrad import clip_by_std, population_std  # noqa: E402
from gradq.random import RandomStream  # noqa: E402

SIZES = [0, 1, 7, 8, 9, 511, 512, 513, 10_007]
BUCKETS = [None, 1, 7, 8, 512]
# (s, width): the bits=b convention s = 2^(b-1) - 1 for b = 2..8, and levels= spellings that leave
# unused field values (s = 2, 5, 100)
UNIFORM = [(1, 2), (3, 3), (7, 4), (15, 5), (31, 6), (63, 7), (127, 8), (2, 3), (5, 4), (100, 8)]


def data(n: int, seed: int = 0) -> torch.Tensor:
    """Gaussian values with zeros, negative zeros, huge, tiny and denormal entries sprinkled in (every
    13th element onwards is special), so that buckets mix magnitudes across the float32 range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    special = torch.tensor([0.0, -0.0, 3.0e38, -1.5e38, 1e-30, -2e-42, 5e-45, 1.0, -1.0, 0.5])
    idx = torch.arange(0, n, 13)
    x[idx] = special[torch.arange(idx.numel()) % special.numel()]
    return x


def ref_uniform(x, scales, s, bucket, width, rng, trit=False):
    mat = bucket_view(x, bucket)
    codes = uniform_codes(mat, scales, s, rng).reshape(-1)[: x.numel()] + s
    return pack_trits(codes) if trit else pack_bits(codes, width)


# -- norms and uniform codes ------------------------------------------------------------------------
@pytest.mark.parametrize("bucket", BUCKETS + [70_000])
@pytest.mark.parametrize("n", SIZES + [140_001])
def test_maxabs_scales(n, bucket):
    x = data(n, n)
    want = bucket_norms(bucket_view(x, bucket), "max")
    assert torch.equal(K.maxabs_scales(x, bucket), want)
    c = 0.75
    clipped = bucket_norms(bucket_view(torch.clamp(x, -c, c), bucket), "max")
    assert torch.equal(K.maxabs_scales(x, bucket, clip=c), clipped)
    # a clip of −0.0 is the clip 0.0: scales of +0.0, a NaN bucket's too (as the reference's)
    x[:1] = float("nan")
    zero = K.maxabs_scales(x, bucket, clip=-0.0)
    assert torch.equal(zero.view(torch.int32), torch.zeros_like(zero).view(torch.int32))
    assert torch.equal(R.maxabs_scales(x, bucket, clip=-0.0).view(torch.int32), zero.view(torch.int32))


@pytest.mark.parametrize("bucket", BUCKETS + [70_000])
@pytest.mark.parametrize("n", SIZES + [140_001])
def test_l2_scales(n, bucket):
    """float32(sqrt(Σ float64(x)²)): the kernel's parallel parts and interleaved sums give the
    reference's float32 result (the float64 sums may differ in their last bits, the rounded root does
    not, except within ~1e-13 of a float32 tie — not hit by this data)."""
    x = data(n, n)
    assert torch.equal(K.l2_scales(x, bucket), bucket_norms(bucket_view(x, bucket), "l2"))


@pytest.mark.parametrize("bucket", BUCKETS + [70_000])
@pytest.mark.parametrize("n", SIZES + [140_001])
def test_l2_uniform_encode_matches_reference(n, bucket):
    """QSGD with ``norm=l2``: each bucket's norm computed in the encoding pass (buckets up to 65,536
    values) or first, in parallel parts (larger ones), gives the reference's scales and bytes; the
    data's 3e38 entries make some norms saturate at the largest float32."""
    x = data(n, 200 + n)
    scales = bucket_norms(bucket_view(x, bucket), "l2")
    packed, got = K.l2_uniform_encode(x, 7, bucket, 4, n)
    assert torch.equal(got, scales), (n, bucket)
    assert torch.equal(packed, ref_uniform(x, scales, 7, bucket, 4, RandomStream(n))), (n, bucket)


@pytest.mark.parametrize("s,width", UNIFORM)
@pytest.mark.parametrize("bucket", BUCKETS)
def test_uniform_encode_and_decode_match_reference(s, width, bucket):
    for n in SIZES:
        x = data(n, 100 + n)
        scales = bucket_norms(bucket_view(x, bucket), "max")
        want = ref_uniform(x, scales, s, bucket, width, RandomStream(n))
        packed, got_scales = K.maxabs_uniform_encode(x, s, bucket, width, n)
        assert torch.equal(got_scales, scales)
        assert torch.equal(packed, want), (n, bucket, s)
        # given scales (MaxNorm's shared scale, here larger than the vector's own)
        shared = scales * 1.5
        want2 = ref_uniform(x, shared, s, bucket, width, RandomStream(7))
        assert torch.equal(K.uniform_encode(x, shared, s, bucket, width, 7), want2)
        codes = unpack_bits(want, width, n) - s
        assert torch.equal(K.uniform_decode(want, scales, s, bucket, width, n),
                           uniform_decode(codes, scales, s, n, bucket))


@pytest.mark.parametrize("start", [0, 5, 2**32 - 100, 2**40 + 3])
def test_stream_offset_and_advance(start):
    """Counters continue from ``rng.offset`` (also across the 2**32 boundary, where the high word
    enters the hash) and the stream advances by the reference's draw count (padded buckets)."""
    n, bucket = 1000, 64
    x = data(n, 3)
    scales = bucket_norms(bucket_view(x, bucket), "max")
    ref_rng, k_rng = RandomStream(11).child(2), RandomStream(11).child(2)
    ref_rng.offset = k_rng.offset = start
    want = ref_uniform(x, scales, 7, bucket, 4, ref_rng)
    assert torch.equal(K.uniform_encode(x, scales, 7, bucket, 4, k_rng), want)
    assert k_rng.offset == ref_rng.offset == start + 16 * 64
    chunks = list(bucket_chunks(x, bucket))
    lvs = [orq_levels(m, 5) for m in chunks]
    ref_codes = torch.cat([round_to_levels(m, lv, ref_rng).reshape(-1) for m, lv in zip(chunks, lvs)])
    assert torch.equal(K.levels_encode(x, torch.cat(lvs), bucket, 3, k_rng), pack_bits(ref_codes, 3))
    assert k_rng.offset == ref_rng.offset == start + 16 * 64 + n


def test_zero_and_negative_zero_give_zero_codes():
    x = torch.tensor([0.0, -0.0, 0.0, -0.0] * 5)
    packed, scales = K.maxabs_uniform_encode(x, 7, 8, 4, 0)
    assert torch.equal(scales, torch.zeros(3))
    assert torch.equal(unpack_bits(packed, 4, 20), torch.full((20,), 7))
    out = K.uniform_decode(packed, scales, 7, 8, 4, 20)
    assert torch.equal(out, torch.zeros(20)) and not torch.signbit(out).any()


def test_tiny_scale_with_zero_decodes_zero():
    """Where ``s/scale`` overflows float32 (max-abs 1e-38, s = 7) the reference computes 0·inf = NaN
    for a zero entry (and fails to pack it); the kernel gives the zero its exact code 0."""
    x = torch.tensor([0.0, 1e-38, -1e-39, -0.0])
    packed, scales = K.maxabs_uniform_encode(x, 7, None, 4, 1)
    assert unpack_bits(packed, 4, 4).tolist() == [7, 14, 0, 7]
    assert torch.equal(K.uniform_decode(packed, scales, 7, None, 4, 4)[[0, 3]], torch.zeros(2))


# -- TernGrad ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bucket", [None, 7, 512])
@pytest.mark.parametrize("n", SIZES)
def test_terngrad_trits_and_2bit(n, bucket):
    x = data(n, 200 + n)
    v = clip_by_std(x, 2.5)
    scales = bucket_norms(bucket_view(v, bucket), "max")
    bound = None
    if n > 1:
        sigma = population_std(x)
        bound = float(2.5 * sigma) if float(sigma) > 0 else None
    assert torch.equal(K.maxabs_scales(x, bucket, clip=bound), scales)
    want_t = ref_uniform(v, scales, 1, bucket, 0, RandomStream(n), trit=True)
    got_t = K.uniform_encode_trits(x, scales, bucket, n, clip=bound)
    assert torch.equal(got_t, want_t)
    want_2 = ref_uniform(v, scales, 1, bucket, 2, RandomStream(n))
    assert torch.equal(K.uniform_encode(x, scales, 1, bucket, 2, n, clip=bound), want_2)
    dec = uniform_decode(unpack_trits(want_t, n) - 1, scales, 1, n, bucket)
    assert torch.equal(K.uniform_decode_trits(want_t, scales, bucket, n), dec)
    assert torch.equal(K.uniform_decode(want_2, scales, 1, bucket, 2, n, max_field=2), dec)


@pytest.mark.parametrize("bucket", [None, 7, 512])
@pytest.mark.parametrize("n", [0, 1, 2, 9, 513, 10_007, 70_001])
def test_terngrad_stats_match_clip_by_std(n, bucket):
    """σ in float64 (two passes per chunk) equals the float64 reference, so the bound and the
    clipped scales are the reference's bits."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.3 + 0.05
    if n > 100:
        x[::97] *= 40.0   # outliers that the clip cuts
    bound, scales = K.terngrad_stats(x, 2.5, bucket)
    assert torch.equal(scales, bucket_norms(bucket_view(clip_by_std(x, 2.5), bucket), "max"))
    if n > 1:
        assert bound == float(2.5 * population_std(x))
        assert torch.equal(K.population_std(x), population_std(x))
    else:
        assert bound is None
    assert K.terngrad_stats(torch.full((50,), 0.7), 2.5, bucket)[0] is None   # σ = 0: no clipping
    assert K.terngrad_stats(x, None, bucket)[0] is None


def test_population_std_is_correctly_rounded():
    """A large mean against a small spread: the kernel's σ is the float32 rounding of the exact σ
    (computed here in rational arithmetic). torch's Welford result may be one ulp off here."""
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(5)) * 0.01 + 200.0
    vals = [Fraction(v) for v in x.double().tolist()]
    s1, s2 = sum(vals), sum(v * v for v in vals)
    var = (s2 - s1 * s1 / len(vals)) / len(vals)
    exact = float(np.float32(math.sqrt(float(var))))   # float(var) is within 1 ulp; sqrt halves it
    assert K.population_std(x).item() == exact


def test_terngrad_corrupt_payloads_raise():
    x = data(20)
    scales = K.maxabs_scales(x, None)
    trits = K.uniform_encode_trits(x, scales, None, 0)
    trits[1] = 243
    with pytest.raises(PayloadError):
        K.uniform_decode_trits(trits, scales, None, 20)
    two = K.uniform_encode(x, scales, 1, None, 2, 0)
    two[0] |= 3
    with pytest.raises(PayloadError):
        K.uniform_decode(two, scales, 1, None, 2, 20, max_field=2)
    with pytest.raises(PayloadError):   # wrong byte count
        K.uniform_decode_trits(trits[:-1], scales, None, 20)


# -- mean of several payloads (the reducing side of scatter/all-gather) ------------------------------
def _loop_mean(decodes):
    acc = decodes[0].clone()
    for d in decodes[1:]:
        acc += d
    return acc.div_(len(decodes))


@pytest.mark.parametrize("shared", [True, False], ids=["one-buffer", "separate"])
@pytest.mark.parametrize("s,width", [(1, 2), (3, 3), (7, 4), (127, 8), ("trit", 0)])
@pytest.mark.parametrize("bucket", [None, 7, 48, 512])   # 48, 512: 2/4/8-bit fields read 16 a step
@pytest.mark.parametrize("n", [1, 513, 70_001])
def test_uniform_decode_mean_is_the_loop(n, bucket, s, width, shared):
    trit = s == "trit"
    lv = 1 if trit else s
    packed, scales, decodes = [], [], []
    for j in range(4):  # scales of different sizes per payload, as every worker has its own
        x = data(n, 300 + j) / (j + 1)
        sc = bucket_norms(bucket_view(x, bucket), "max")
        p = ref_uniform(x, sc, lv, bucket, width, RandomStream(j), trit=trit)
        packed.append(p)
        scales.append(sc)
        decodes.append(K.uniform_decode_trits(p, sc, bucket, n) if trit else K.uniform_decode(p, sc, lv, bucket, width, n))
    if shared:  # views into one receive buffer, each behind a 5-byte header (the zero-copy path)
        buf = torch.cat([torch.cat([torch.zeros(5, dtype=torch.uint8), p]) for p in packed])
        step = packed[0].numel() + 5
        packed = [buf[j * step + 5:(j + 1) * step] for j in range(4)]
    want = _loop_mean(decodes)
    if trit:
        got = K.uniform_decode_trits_mean(packed, scales, bucket, n)
    else:
        got = K.uniform_decode_mean(packed, scales, lv, bucket, width, n)
    assert torch.equal(got, want)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # the same signs of zero too
    one = K.uniform_decode_trits_mean(packed[:1], scales[:1], bucket, n) if trit else \
        K.uniform_decode_mean(packed[:1], scales[:1], lv, bucket, width, n)
    assert torch.equal(one, decodes[0])


def test_uniform_decode_mean_errors():
    x = data(20)
    sc = K.maxabs_scales(x, None)
    two = K.uniform_encode(x, sc, 1, None, 2, 0)
    bad = two.clone()
    bad[0] |= 3
    with pytest.raises(PayloadError, match="fields above 2"):  # a corrupt field in the second payload
        K.uniform_decode_mean([two, bad], [sc, sc], 1, None, 2, 20, max_field=2)
    with pytest.raises(PayloadError):  # wrong byte count in one payload
        K.uniform_decode_mean([two, two[:-1]], [sc, sc], 1, None, 2, 20)
    with pytest.raises(ValueError, match="scale vectors"):
        K.uniform_decode_mean([two, two], [sc], 1, None, 2, 20)
    with pytest.raises(ValueError, match="at least one"):
        K.uniform_decode_mean([], [], 1, None, 2, 20)
    with pytest.raises(ValueError, match="one per bucket"):
        K.uniform_decode_mean([two], [torch.ones(2)], 1, None, 2, 20)
    trits = K.uniform_encode_trits(x, sc, None, 0)
    t_bad = trits.clone()
    t_bad[1] = 243
    with pytest.raises(PayloadError, match="above 242"):
        K.uniform_decode_trits_mean([trits, t_bad], [sc, sc], None, 20)


# -- ORQ / Linear levels ----------------------------------------------------------------------------
@pytest.mark.parametrize("L", [3, 5, 9, 17])
@pytest.mark.parametrize("bucket", BUCKETS)
def test_levels_encode_and_decode_match_reference(L, bucket):
    width = code_width(L)
    for n in SIZES:
        x = data(n, 300 + n)
        if n > 20:
            x[: n // 4] = 0.25   # constant stretches: equal levels, zero gaps
        chunks = list(bucket_chunks(x, bucket))
        for make in (orq_levels, linear_levels):
            lvs = [make(m, L) for m in chunks]
            levels = torch.cat(lvs) if lvs else torch.zeros(0, L)
            rng = RandomStream(n)
            codes = [round_to_levels(m, lv, rng).reshape(-1) for m, lv in zip(chunks, lvs)]
            want = pack_bits(torch.cat(codes) if codes else torch.zeros(0, dtype=torch.int64), width)
            got = K.levels_encode(x, levels, bucket, width, n)
            assert torch.equal(got, want), (n, bucket, make.__name__)
            idx = bucket_index(n, bucket, x.device) * L + unpack_bits(want, width, n)
            assert torch.equal(K.levels_decode(want, levels, bucket, width, n), levels.reshape(-1)[idx])


def test_levels_decode_rejects_out_of_range_index():
    x = data(40)
    levels = orq_levels(x.view(1, -1), 5)
    packed = K.levels_encode(x, levels, None, 3, 0)
    packed[0] |= 7   # index 7 >= L = 5
    with pytest.raises(PayloadError):
        K.levels_decode(packed, levels, None, 3, 40)


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("bucket", [1, 7, 512, None])
def test_levels_decode_of_every_field_value(width, bucket):
    """The raw kernel on fields drawn over the whole width, so that some name no level: every index
    ``< L`` gives its row's level, every other gives the row's first level and is counted once.
    Lengths leave every remainder mod 16 at some bucket (the vector loop's tail) and 70,001 spans
    two chunks; widths up to 5 go through the table look-up, wider ones through the plain loop."""
    from gradq.kernels import numba_ops
    cpu = numba_ops._cpu()
    g = torch.Generator().manual_seed(width)
    for L in sorted({max(2, (1 << (width - 1)) + 1), 1 << width, 3} & set(range(2, 257))):
        for n in (0, 1, 15, 17, 513, 70_001):
            d = numba_ops._bucket(n, bucket)
            nb = numba_ops._nbuckets(n, d)
            fields = torch.randint(0, 1 << width, (n,), generator=g)
            levels = torch.randn(nb, L, generator=g)
            out = torch.full((n,), float("nan"))
            bad = cpu.levels_decode(pack_bits(fields, width).numpy(), levels.numpy().reshape(-1), L, d, width,
                                    numba_ops._chunk(d), out.numpy()) if n else 0
            ok = fields < L
            want = levels.reshape(-1)[bucket_index(n, bucket, out.device) * L + torch.where(ok, fields, 0)]
            assert torch.equal(out, want), (width, L, n, bucket)
            assert bad == int((~ok).sum()), (width, L, n, bucket)


def test_decodes_count_every_corrupt_field():
    """The decodes find corrupt fields by their maximum and count them only then: the count in the
    error is exact, and one bad field among valid ones, anywhere (first, middle, in a tail), is
    seen."""
    n, bucket = 1000, 64          # the last bucket, 40 values: two 16-field steps and a tail of 8
    x = data(n, 5)
    sc = K.maxabs_scales(x, bucket)
    for s, width in ((1, 2), (7, 4), (127, 8)):   # fields 0..2s; the all-ones field is corrupt
        packed = K.uniform_encode(x, sc, s, bucket, width, 0)
        for where in ([0], [517], [n - 1], [3, 64, 65, 999]):
            fields = unpack_bits(packed, width, n)
            fields[where] = (1 << width) - 1
            with pytest.raises(PayloadError, match=f"corrupt codes: {len(where)} fields above {2 * s}"):
                K.uniform_decode(pack_bits(fields, width), sc, s, bucket, width, n, max_field=2 * s)
    levels = orq_levels(x.view(-1, 8), 5)   # 125 buckets of 8
    packed = K.levels_encode(x, levels, 8, 3, 0)
    for where in ([0], [517], [n - 1]):
        bad = packed.clone()
        fields = unpack_bits(bad, 3, n)
        fields[where] = 6
        with pytest.raises(PayloadError, match="level index out of range"):
            K.levels_decode(pack_bits(fields, 3), levels, 8, 3, n)


# -- one bit ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bucket", [16, 48, 70_000])
def test_threshold_bits_straight_into_the_payload(bucket):
    """Buckets a multiple of 16 long have their bits written 16 at a time straight into the
    payload, and decoded 16 at a time straight from it; 70,000 also crosses the packing chunks (65,520 values), and 140,003 values leave a
    ragged last bucket and a zero-padded last byte."""
    n = 140_003
    x = data(n, 17)
    nb = (n + bucket - 1) // bucket
    thr = torch.randn(nb, generator=torch.Generator().manual_seed(bucket), dtype=torch.float64) * 0.1
    bits = (x.to(torch.float64) >= thr[torch.arange(n) // bucket]).to(torch.int64)
    want = pack_bits(bits, 1)
    assert torch.equal(K.threshold_encode(x, thr, bucket), want)
    # and the decodes, 16 bits selecting 16 values straight from the payload
    g = torch.Generator().manual_seed(bucket + 1)
    two, scale = torch.randn(nb, 2, generator=g), torch.rand(nb, generator=g)
    scale[1] = 0.0   # 0·(−1) = −0.0, as the reference gives
    bidx = torch.arange(n) // bucket
    assert torch.equal(K.bit_decode(want, two, bucket, n), two.reshape(-1)[bidx * 2 + bits])
    got, ref = K.bit_decode(want, scale, bucket, n), scale[bidx] * (2 * bits - 1).to(torch.float32)
    assert torch.equal(got, ref) and torch.equal(got.signbit(), ref.signbit())


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("n", SIZES)
def test_one_bit_paths(n, bucket):
    x = data(n, 400 + n)
    chunks = list(bucket_chunks(x, bucket))
    empty = torch.zeros(0, dtype=torch.int64)
    signs = pack_bits(torch.cat([(m >= 0).reshape(-1) for m in chunks]).to(torch.int64) if chunks else empty, 1)
    assert torch.equal(K.sign_encode(x), signs)   # -0.0 >= 0: bit 1, as in SignSGD / 1BitSGD
    tb = [bingrad_b_levels(m, 1) for m in chunks]
    thr = torch.cat([t for t, _, _ in tb]) if tb else torch.zeros(0, dtype=torch.float64)
    bits = [m.to(torch.float64) >= t.unsqueeze(1) for m, (t, _, _) in zip(chunks, tb)]
    want = pack_bits(torch.cat([b.reshape(-1) for b in bits]).to(torch.int64) if bits else empty, 1)
    assert torch.equal(K.threshold_encode(x, thr, bucket), want)
    nb = 0 if n == 0 else (1 if bucket is None else (n + bucket - 1) // bucket)
    two = torch.randn(nb, 2, generator=torch.Generator().manual_seed(n))
    scale = torch.rand(nb, generator=torch.Generator().manual_seed(n + 1))
    if nb:
        scale[0] = 0.0   # 0·(−1) = −0.0 in the reference: the kernel must match that sign too
    ubits = unpack_bits(want, 1, n)
    bidx = bucket_index(n, bucket, x.device)
    assert torch.equal(K.bit_decode(want, two, bucket, n), two.reshape(-1)[bidx * 2 + ubits])
    ref_signed = scale[bidx] * (2 * ubits - 1).to(torch.float32)
    got_signed = K.bit_decode(want, scale, bucket, n)
    assert torch.equal(got_signed, ref_signed) and torch.equal(torch.signbit(got_signed), torch.signbit(ref_signed))


# -- threads, switch, errors ------------------------------------------------------------------------
def test_thread_count_does_not_change_bytes():
    x = data(300_007, 9)
    lv = torch.cat([orq_levels(m, 5) for m in bucket_chunks(x, 1000)])
    torch_threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()

    def run():
        return (K.maxabs_uniform_encode(x, 7, 512, 4, 5), K.maxabs_uniform_encode(x, 3, None, 3, 5),
                K.uniform_encode_trits(x, K.maxabs_scales(x, 777, clip=2.0), 777, 5, clip=2.0),
                K.levels_encode(x, lv, 1000, 3, 5))

    try:
        torch.set_num_threads(1)
        numba.set_num_threads(1)
        one = run()
        torch.set_num_threads(max(2, torch_threads))
        numba.set_num_threads(max(2, numba_threads) if numba.config.NUMBA_NUM_THREADS >= 2 else 1)
        many = run()
    finally:
        torch.set_num_threads(torch_threads)
        numba.set_num_threads(numba_threads)
    for a, b in zip(one, many):
        for p, q in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(p, q)


def test_switch():
    assert K.available()
    try:
        K.set_enabled(False)
        assert not K.available()
    finally:
        K.set_enabled(True)
    assert K.available()
    env = dict(os.environ, GRADQ_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", "import gradq.kernels as K; print(K.available())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_argument_errors():
    x = data(100)
    with pytest.raises(TypeError):
        K.maxabs_scales(x.double(), 8)
    with pytest.raises(ValueError):
        K.uniform_encode(x, torch.ones(3), 7, 8, 4, 0)            # 13 buckets, 3 scales
    with pytest.raises(ValueError):
        K.maxabs_uniform_encode(x, 8, 8, 4, 0)                    # fields up to 16 need 5 bits
    with pytest.raises(PayloadError):
        K.uniform_decode(torch.zeros(49, dtype=torch.uint8), torch.ones(13), 7, 8, 4, 100)
    with pytest.raises(ValueError):
        K.maxabs_uniform_encode(x, 7, 0, 4, 0)
    with pytest.raises(ValueError):
        K.uniform_encode(x, K.maxabs_scales(x, 8), 7, 8, 4, 0, out=torch.empty(10, dtype=torch.uint8))


def test_borrowed_views_alias_their_owner_and_count_no_references():
    """``numba_common._borrowed`` gives a view with no owner (a null meminfo, so numba's reference
    counting of it costs nothing) over the owner's memory; ``_keep`` keeps the owner alive up to its
    call, so writes through the view land in the owner's buffer and a later allocation does not
    take it."""
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    from gradq.kernels import numba_ops
    numba_ops._cpu()
    from gradq.kernels.numba_common import _borrowed, _keep

    @intrinsic
    def meminfo_is_null(typingctx, arr):
        def codegen(context, builder, signature, args):
            mi = context.make_array(signature.args[0])(context, builder, args[0]).meminfo
            return builder.zext(builder.icmp_unsigned("==", mi, ir.Constant(mi.type, None)), ir.IntType(8))
        return types.uint8(arr), codegen

    @njit(cache=False)
    def fill(n):
        own = np.zeros(n, np.int64)
        view = _borrowed(own)
        for i in range(n):
            view[i] = i * i
        other = np.full(n, -1, np.int64)   # allocated while the view is in use
        total = 0
        for i in range(n):
            total += view[i] + other[i]
        flags = (meminfo_is_null(own), meminfo_is_null(view), meminfo_is_null(view[1:]))
        _keep(own)
        return own, total, flags

    own, total, flags = fill(1000)
    assert np.array_equal(own, np.arange(1000) ** 2)
    assert total == int((np.arange(1000) ** 2).sum()) - 1000
    assert flags == (0, 1, 1)


_PACK_SCRIPT = """
import numpy as np, torch
from numba import njit
from gradq.kernels import numba_ops
numba_ops._cpu()
from gradq.kernels.numba_pack import _pack
from gradq.codecs.bitpack import pack_bits

@njit(cache=False)
def pack(tmp, width, out):
    _pack(tmp, width, out)

g = np.random.default_rng(0)
for width in (3, 5, 6, 7):
    for m in (0, 1, 7, 8, 9, 16, 23, 64, 1001):
        tmp = g.integers(0, 1 << width, m).astype(np.uint8)
        out = np.full((m * width + 7) // 8 + 8, 0xAB, np.uint8)
        pack(tmp, width, out)
        want = pack_bits(torch.from_numpy(tmp.astype(np.int64)), width).numpy()
        assert np.array_equal(out[:want.size], want), (width, m)
        assert (out[want.size:] == 0xAB).all(), (width, m)   # nothing written past the fields
print("ok")
"""


@pytest.mark.parametrize("cpu", ["host", "generic"])
def test_pack_of_odd_widths_with_and_without_pext(cpu, tmp_path):
    """Fields of 3, 5, 6 and 7 bits pack by BMI2's ``pext`` where the CPU has it and by shifts where
    it does not (numba compiling for a generic x86-64): the same bytes as ``pack_bits``, and no byte
    written past the last field (a chunk's neighbour belongs to another thread)."""
    env = dict(os.environ, GRADQ_NUMBA_CACHE=str(tmp_path))
    if cpu == "generic":
        env["NUMBA_CPU_NAME"] = "generic"
    out = subprocess.run([sys.executable, "-c", _PACK_SCRIPT], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
