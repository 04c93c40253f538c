"""QSGD bit streams (gradq.codecs.qsgd_stream) and their use by ``qsgd:coding=elias*``: exact layouts
against a pure-Python oracle, strict validation, robustness to corruption, and the quantizer's payload
(same codes as the fixed coding, honest size, CRC catching every corruption of the stream)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradq
from gradq_testing import ref_omega
from gradq import PayloadError, SpecError
from gradq.codecs.bitpack import unpack_bits
from gradq.codecs.elias import omega_encode
from gradq.codecs.qsgd_chunks import index_len
from gradq.codecs.qsgd_stream import decode_stream, encode_stream, layout_nbits, stream_nbits


# ---- pure-Python oracle ---------------------------------------------------------------------------


def ref_sparse(codes: list[int]) -> str:
    """Body of the sparse layout: Elias(nnz+1), then per nonzero Elias(gap), sign, Elias(|c|)."""
    nz = [(i + 1, c) for i, c in enumerate(codes) if c != 0]
    out, last = ref_omega(len(nz) + 1), 0
    for pos, c in nz:
        out += ref_omega(pos - last) + ("1" if c < 0 else "0") + ref_omega(abs(c))
        last = pos
    return out


def ref_dense(codes: list[int]) -> str:
    """Body of the dense layout: Elias(|c|+1), then a sign bit when c != 0."""
    return "".join(ref_omega(abs(c) + 1) + (("1" if c < 0 else "0") if c else "") for c in codes)


def ref_stream(codes: list[int], layout: str) -> bytes:
    sp, de = ref_sparse(codes), ref_dense(codes)
    if layout == "auto":
        layout = "sparse" if len(sp) <= len(de) else "dense"
    bits = "0" + sp if layout == "sparse" else "1" + de
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))


def rand_codes(rng: np.random.Generator, n: int, s: int, density: float) -> np.ndarray:
    mag = rng.integers(1, s + 1, n) * (rng.random(n) < density)
    return (mag * rng.choice([-1, 1], n)).astype(np.int32)


LAYOUTS = ("auto", "sparse", "dense")


# ---- layouts -----------------------------------------------------------------------------------------
def test_known_stream():
    codes = torch.tensor([0, 0, -1, 0, 2])
    # sparse: flag 0 | nnz+1=3 '110' | gap 3 '110', '-' 1, |c|=1 '0' | gap 2 '100', '+' 0, |c|=2 '100'
    assert encode_stream(codes, 2, "sparse").tolist() == [0b01101101, 0b01000100]
    # dense: flag 1 | '0' '0' | '100' 1 | '0' | '110' 0  (+ 4 padding bits)
    assert encode_stream(codes, 2, "dense").tolist() == [0b10010010, 0b11000000]
    assert encode_stream(codes, 2, "auto").tolist() == [0b10010010, 0b11000000]  # 12 < 16 bits
    assert layout_nbits(codes) == (15, 11) and stream_nbits(codes, "auto") == 12


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,s,density", [(0, 1, 0.0), (1, 1, 1.0), (4096, 1, 0.01), (4096, 7, 0.6),
                                         (3000, 1000, 0.9), (257, 2 ** 20, 0.5), (4096, 3, 0.0)])
def test_round_trip_matches_oracle(layout, n, s, density):
    codes = rand_codes(np.random.default_rng(n + s), n, s, density)
    out = encode_stream(codes, s, layout)
    assert bytes(out.tolist()) == ref_stream(codes.tolist(), layout)
    assert out.numel() == (stream_nbits(codes, layout) + 7) // 8
    back = decode_stream(out, n, s)
    assert back.dtype == torch.int32 and torch.equal(back, torch.from_numpy(codes))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_long_codes_match_oracle(layout):
    """Values past the writers' lookup table: gaps of up to ~2**17 and magnitudes up to 2**31 - 1 (codes
    split into several register-sized pieces)."""
    rng = np.random.default_rng(11)
    n, s = 200_000, (1 << 31) - 1
    codes = np.zeros(n, dtype=np.int64)
    pos = np.sort(rng.choice(n, 40, replace=False))
    codes[pos] = (2.0 ** rng.uniform(0, 31, 40)).astype(np.int64).clip(1, s) * rng.choice([-1, 1], 40)
    codes[pos[:3]] = [s, -s, 4096]
    out = encode_stream(codes, s, layout)
    assert bytes(out.tolist()) == ref_stream(codes.tolist(), layout)
    assert torch.equal(decode_stream(out, n, s).to(torch.int64), torch.from_numpy(codes))


def test_auto_picks_the_shorter_layout():
    rng = np.random.default_rng(1)
    sparse = rand_codes(rng, 2000, 1, 0.01)
    dense = rand_codes(rng, 2000, 5, 0.9)
    assert encode_stream(sparse, 1)[0] >> 7 == 0 and encode_stream(dense, 5)[0] >> 7 == 1
    for c in (sparse, dense):
        assert stream_nbits(c) == 1 + min(layout_nbits(c))


@settings(max_examples=800)
@given(codes=st.lists(st.integers(-9, 9), max_size=200), layout=st.sampled_from(LAYOUTS))
def test_random_codes_match_oracle(codes, layout):
    out = encode_stream(np.array(codes, dtype=np.int64), 9, layout)
    assert bytes(out.tolist()) == ref_stream(codes, layout)
    assert decode_stream(out, len(codes), 9).tolist() == codes


def test_encoder_validates():
    with pytest.raises(ValueError, match=r"\[-2, 2\]"):
        encode_stream(torch.tensor([3]), 2)
    with pytest.raises(ValueError, match="layout"):
        encode_stream(torch.tensor([1]), 2, "zigzag")
    with pytest.raises(TypeError, match="integers"):
        encode_stream(torch.tensor([1.0]), 2)
    with pytest.raises(ValueError, match="2\\*\\*62"):
        encode_stream(np.array([-(1 << 63)], dtype=np.int64), 2)


# ---- strict decoding ------------------------------------------------------------------------------------
def test_decoder_validation_messages():
    codes = torch.tensor([0, 5, 0, -3, 0, 0])
    sp, de = encode_stream(codes, 5, "sparse"), encode_stream(codes, 5, "dense")
    for st_ in (sp, de):
        with pytest.raises(PayloadError, match="exceeds s"):
            decode_stream(st_, 6, 4)
    with pytest.raises(PayloadError, match="gap runs past the end"):
        decode_stream(sp, 3, 5)
    with pytest.raises(PayloadError, match="more nonzeros than coordinates"):
        decode_stream(encode_stream(torch.tensor([1, 1, 1]), 1, "sparse"), 2, 1)
    with pytest.raises(PayloadError, match="extended stream"):
        decode_stream(torch.cat([sp, torch.zeros(1, dtype=torch.uint8)]), 6, 5)
    with pytest.raises(PayloadError, match="extended stream"):
        decode_stream(de, 2, 5)  # fewer coordinates than coded: bits left over
    with pytest.raises(PayloadError, match="truncated"):
        decode_stream(de, 40, 5)
    with pytest.raises(PayloadError, match="truncated"):
        decode_stream(b"", 0, 1)


def _check_raw(stream: bytes, n: int, s: int) -> None:
    """PayloadError, or exactly n codes in [-s, s] whose encoding (in the flagged layout) is the stream."""
    try:
        out = decode_stream(stream, n, s)
    except PayloadError:
        return
    assert out.shape == (n,) and out.dtype == torch.int32
    assert int(out.abs().max()) <= s if n else True
    layout = "dense" if stream[0] >> 7 else "sparse"
    assert bytes(encode_stream(out, s, layout).tolist()) == stream


CORRUPT = settings(max_examples=1200, suppress_health_check=[HealthCheck.too_slow])


@CORRUPT
@given(codes=st.lists(st.integers(-6, 6), max_size=120), layout=st.sampled_from(LAYOUTS),
       cut=st.integers(0, 1000), flips=st.lists(st.integers(0, 10_000), min_size=1, max_size=3),
       extra=st.binary(min_size=1, max_size=4))
def test_raw_decoder_survives_corruption(codes, layout, cut, flips, extra):
    n, s = len(codes), 6
    data = bytes(encode_stream(np.array(codes, dtype=np.int64), s, layout).tolist())
    assert decode_stream(data, n, s).tolist() == codes
    _check_raw(data[: cut % len(data)], n, s)
    b = bytearray(data)
    for f in flips:
        b[(f // 8) % len(b)] ^= 0x80 >> (f % 8)
    _check_raw(bytes(b), n, s)
    _check_raw(data + extra, n, s)
    _check_raw(data, n + 1, s)
    _check_raw(data, max(n - 1, 0), s)


@settings(max_examples=1000)
@given(data=st.binary(min_size=1, max_size=64), n=st.integers(0, 600), s=st.integers(1, 2 ** 20))
def test_raw_decoder_on_random_bytes(data, n, s):
    _check_raw(data, n, s)


def test_every_truncation_length():
    codes = rand_codes(np.random.default_rng(5), 300, 7, 0.5)
    for layout in ("sparse", "dense"):
        data = bytes(encode_stream(codes, 7, layout).tolist())
        for cut in range(len(data)):
            with pytest.raises(PayloadError):
                decode_stream(data[:cut], 300, 7)


def test_pure_python_fallback_gives_the_same_bytes():
    """Without numba the same functions run as plain Python and must write identical streams."""
    import subprocess
    import sys

    codes = rand_codes(np.random.default_rng(7), 300, 5000, 0.3)
    script = (
        "import sys; sys.modules['numba'] = None\n"
        "import numpy as np\n"
        "from gradq.codecs import elias, qsgd_stream as q\n"
        "assert not elias.HAVE_NUMBA\n"
        f"c = np.array({codes.tolist()}, dtype=np.int32)\n"
        "for l in q.LAYOUTS:\n"
        "    b = q.encode_stream(c, 5000, l)\n"
        "    assert (q.decode_stream(b, c.size, 5000).numpy() == c).all()\n"
        "    print(bytes(b.tolist()).hex())\n"
        "print(bytes(elias.omega_encode([1, 5, 2**62, 77]).tolist()).hex())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expect = [bytes(encode_stream(codes, 5000, l).tolist()).hex() for l in LAYOUTS]
    expect.append(bytes(omega_encode([1, 5, 2 ** 62, 77]).tolist()).hex())
    assert out.stdout.split() == expect


# ---- the quantizer ---------------------------------------------------------------------------------------
ELIAS_SPECS = ["qsgd:coding=elias", "qsgd:bits=2,bucket=128,coding=elias-sparse",
               "qsgd:bits=8,bucket=none,norm=l2,coding=elias-dense", "qsgd:levels=5,bucket=7,coding=elias"]


@pytest.mark.parametrize("spec", ELIAS_SPECS)
def test_same_codes_as_fixed_coding(spec):
    q = gradq.build(spec)
    fixed = gradq.build(spec.rsplit(",coding=", 1)[0].replace("qsgd:coding=elias", "qsgd"))
    assert fixed.get_params()["coding"] == "fixed" and fixed.s == q.s
    x = torch.randn(3001, generator=torch.Generator().manual_seed(0)) * 2
    p, pf = q.encode(x, seed=9), fixed.encode(x, seed=9)
    codes = decode_stream(p["stream"], x.numel(), q.s)
    assert torch.equal(codes.to(torch.int64), unpack_bits(pf["codes"], fixed.width, x.numel()) - fixed.s)
    assert torch.equal(p["scales"], pf["scales"])
    assert torch.equal(q.decode(p), fixed.decode(pf))
    assert p.same_bytes(q.encode(x, seed=9)) and not p.same_bytes(q.encode(x, seed=10))


@pytest.mark.parametrize("spec", ELIAS_SPECS + ["qsgd:levels=1000,bucket=none,norm=l2,coding=elias-dense"])
@pytest.mark.parametrize("n", [0, 1, 511, 4099])
def test_nbytes_is_header_plus_stream_scales_crc(spec, n):
    q = gradq.build(spec)
    p = q.encode(torch.randn(n, generator=torch.Generator().manual_seed(n)), seed=0)
    B = 0 if n == 0 else (1 if q.bucket is None else -(-n // q.bucket))
    assert p.nbytes == (16 + 5 * 4) + p["stream"].numel() + 8 * index_len(n) + 4 * B + 4 == len(p.to_bytes())
    assert p["stream"].numel() == (stream_nbits(decode_stream(p["stream"], n, q.s), q.coding.replace(
        "elias-", "").replace("elias", "auto")) + 7) // 8
    assert q.expected_nbytes(n) is None and q.wire_fields(n) == ("stream", "index", "scales", "crc")


def test_spec_and_levels_limits():
    assert str(gradq.build("qsgd")) == "qsgd:bits=4,bucket=512,norm=max"  # unchanged canonical spec
    assert str(gradq.build("qsgd:coding=fixed,bits=2")) == "qsgd:bits=2,bucket=512,norm=max"
    assert str(gradq.build("qsgd:levels=1000,coding=elias")) == "qsgd:levels=1000,bucket=512,norm=max,coding=elias"
    with pytest.raises(SpecError, match="levels above 127 need coding=elias"):
        gradq.build("qsgd:levels=128")
    gradq.build(f"qsgd:levels={2 ** 20},coding=elias-dense")
    with pytest.raises(SpecError, match="out of range"):
        gradq.build(f"qsgd:levels={2 ** 20 + 1},coding=elias")
    with pytest.raises(SpecError, match="coding"):
        gradq.build("qsgd:coding=huffman")


def test_large_s_round_trip_is_exact_in_codes():
    """s = 2**20 (far beyond fixed fields): decode equals scale·c/s for the transmitted codes."""
    q = gradq.build(f"qsgd:levels={2 ** 20},bucket=none,norm=l2,coding=elias")
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    p = q.encode(x, seed=1)
    codes = decode_stream(p["stream"], 1000, q.s)
    assert int(codes.abs().max()) > 127
    assert torch.allclose(q.decode(p), p["scales"][0] * codes.float() / q.s)
    # |Q(x) - x| <= ‖x‖/s per coordinate (one rounding step)
    assert float((q.decode(p) - x).abs().max()) <= float(x.norm()) / q.s * (1 + 1e-4)


@pytest.mark.parametrize("spec", ELIAS_SPECS)
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 31), n=st.integers(1, 700), kind=st.sampled_from(["cut", "extend", "flip", "crc"]),
       where=st.integers(0, 10 ** 6), extra=st.binary(min_size=1, max_size=4))
def test_payload_detects_every_stream_corruption(spec, seed, n, kind, where, extra):
    q = gradq.build(spec)
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed % 1000))
    p = q.encode(x, seed=seed)
    stream, crc = p["stream"].clone(), p["crc"].clone()
    if kind == "cut":
        stream = stream[: where % stream.numel()]
    elif kind == "extend":
        stream = torch.cat([stream, torch.tensor(list(extra), dtype=torch.uint8)])
    elif kind == "flip":
        stream[(where // 8) % stream.numel()] ^= 1 << (where % 8)
    else:
        crc ^= 1 << (where % 32)
    bad = gradq.Payload(p.spec, p.shape, p.dtype, p.numel,
                        {"stream": stream, "index": p["index"], "scales": p["scales"], "crc": crc})
    with pytest.raises(PayloadError):
        q.decode(bad)
    if stream.numel():
        with pytest.raises(PayloadError):  # and through the serialized form
            q.decode(q.payload_from_bytes(bad.to_bytes(), x.shape))


def test_payload_field_checks():
    q = gradq.build("qsgd:coding=elias")
    p = q.encode(torch.randn(100), seed=0)
    f = dict(p.fields)
    for bad in ({"stream": f["stream"], "scales": f["scales"]},
                {"stream": f["stream"], "scales": f["scales"], "crc": f["crc"]},   # no index
                {**f, "scales": f["scales"].double()},
                {**f, "crc": f["crc"].repeat(2)},
                {**f, "index": torch.zeros(3, dtype=torch.int64)},             # 100 values: an empty index
                {**f, "index": f["index"].int()},
                {**f, "stream": torch.zeros(0, dtype=torch.uint8)},
                {"scales": f["scales"], "stream": f["stream"], "index": f["index"], "crc": f["crc"]}):
        with pytest.raises(PayloadError):
            q.decode(gradq.Payload(p.spec, p.shape, p.dtype, p.numel, bad))


# ---- optional rANS coding (skipped without constriction) ----------------------------------------------
def test_ans_missing_package_message(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "constriction", None)  # makes `import constriction` fail
    with pytest.raises(ImportError, match=r"pip install constriction==0\.5\.0"):
        gradq.build("qsgd:coding=ans")


ANS_SPECS = ["qsgd:coding=ans", "qsgd:levels=1000,bucket=none,norm=l2,coding=ans", "qsgd:bits=2,bucket=128,coding=ans"]


@pytest.mark.parametrize("spec", ANS_SPECS)
@pytest.mark.parametrize("n", [0, 1, 7, 4099])
def test_ans_same_codes_and_honest_size(spec, n):
    pytest.importorskip("constriction")
    from gradq.codecs.ans import ans_decode_codes

    q = gradq.build(spec)
    fixed = gradq.build(spec.replace(",coding=ans", "").replace(":coding=ans", "").replace("levels=1000", "levels=100"))
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    p = q.encode(x, seed=5)
    assert p.same_bytes(q.encode(x, seed=5))
    codes = ans_decode_codes(p.fields, n, q.s)
    if fixed.s == q.s:
        pf = fixed.encode(x, seed=5)
        assert torch.equal(codes.to(torch.int64), unpack_bits(pf["codes"], fixed.width, n) - fixed.s)
        assert torch.equal(q.decode(p), fixed.decode(pf))
    B = 0 if n == 0 else (1 if q.bucket is None else -(-n // q.bucket))
    assert p.nbytes == (16 + 5 * 5) + p["ans"].numel() + p["model"].numel() + 8 + 4 * B + 4 == len(p.to_bytes())
    back = q.payload_from_bytes(p.to_bytes(), (n,))
    assert torch.equal(q.decode(back), q.decode(p))


def test_ans_is_near_the_entropy():
    """On 2**16 Gaussian coordinates with s = 7 the rANS payload body (words + model) stays within 2% +
    64 bytes of n·H(codes): rANS loses at most a few bits per stream plus the 24-bit probability
    quantization (≪ 1%), and the omega-coded model is tens of bytes."""
    pytest.importorskip("constriction")
    q = gradq.build("qsgd:bits=4,bucket=none,coding=ans")
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    p = q.encode(x, seed=0)
    from gradq.codecs.ans import ans_decode_codes

    c = ans_decode_codes(p.fields, x.numel(), q.s).numpy()
    prob = np.bincount(c - c.min()) / c.size
    h = float(-(prob[prob > 0] * np.log2(prob[prob > 0])).sum()) * c.size / 8
    body = p["ans"].numel() + p["model"].numel()
    assert h <= body <= 1.02 * h + 64, (body, h)


@pytest.mark.parametrize("spec", ANS_SPECS)
@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 31), n=st.integers(1, 700), field=st.sampled_from(["ans", "model", "range", "crc"]),
       kind=st.sampled_from(["cut", "extend", "flip"]), where=st.integers(0, 10 ** 6),
       extra=st.binary(min_size=1, max_size=8))
def test_ans_corruption(spec, seed, n, field, kind, where, extra):
    """Through the payload every corruption raises PayloadError; the raw decoder (no CRC) either raises
    PayloadError or returns n codes within [-s, s]."""
    pytest.importorskip("constriction")
    from gradq.codecs.ans import ans_decode_codes

    q = gradq.build(spec)
    p = q.encode(torch.randn(n, generator=torch.Generator().manual_seed(seed % 997)), seed=seed)
    fields = {k: v.clone() for k, v in p.fields.items()}
    t = fields[field].view(torch.uint8) if field in ("range", "crc") else fields[field]
    if kind == "flip" and t.numel():
        t[(where // 8) % t.numel()] ^= 1 << (where % 8)
    elif kind == "cut" and field in ("ans", "model") and t.numel():
        fields[field] = t[: where % t.numel()]
    elif kind == "extend" and field in ("ans", "model"):
        fields[field] = torch.cat([t, torch.tensor(list(extra), dtype=torch.uint8)])
    else:
        return  # nothing to corrupt in this combination
    bad = gradq.Payload(p.spec, p.shape, p.dtype, p.numel, fields)
    with pytest.raises(PayloadError):
        q.decode(bad)
    try:
        codes = ans_decode_codes(fields, n, q.s)
    except PayloadError:
        return
    assert codes.shape == (n,) and int(codes.abs().max()) <= q.s


@pytest.mark.parametrize("layout", ["auto", "sparse", "dense"])
@pytest.mark.parametrize("s", [1, 7, 127])
def test_fields_streams_are_the_codes_streams(layout, s):
    """uint8 fields ``c + s`` stream to the same bytes as the codes, and decode back to the fields."""
    from gradq.codecs.qsgd_stream import decode_fields_stream, encode_fields_stream

    g = torch.Generator().manual_seed(s)
    codes = torch.randint(-s, s + 1, (5003,), generator=g, dtype=torch.int32)
    codes[torch.rand(5003, generator=g) < 0.7] = 0
    fields = (codes + s).to(torch.uint8)
    stream = encode_fields_stream(fields, s, layout)
    assert torch.equal(stream, encode_stream(codes, s, layout))
    out = torch.empty(5003, dtype=torch.uint8)
    assert decode_fields_stream(stream, 5003, s, out=out) is out
    assert torch.equal(out, fields)
    with pytest.raises(PayloadError):
        decode_fields_stream(stream[:-1], 5003, s)
    with pytest.raises(ValueError, match="lie in"):
        encode_fields_stream(torch.full((3,), 2 * s + 1, dtype=torch.uint8), s, layout)


@pytest.mark.parametrize("seed", range(6))
def test_fields_codec_agrees_with_the_codes_codec_on_odd_streams(seed):
    """Long gaps (past the 4,096-entry tables), the largest magnitudes, all-zero and all-nonzero
    vectors, and damaged streams: the table-driven fields codec writes the same bytes as the codes
    codec, and refuses exactly the streams the strict decoder refuses."""
    from gradq.codecs.qsgd_stream import decode_fields_stream, encode_fields_stream

    g = torch.Generator().manual_seed(seed)
    s = [1, 7, 127, 3, 127, 15][seed]
    n = [1, 9000, 20_000, 70_000, 5, 3][seed]
    density = [1.0, 0.0005, 0.3, 0.01, 0.0, 1.0][seed]
    codes = torch.randint(-s, s + 1, (n,), generator=g, dtype=torch.int32)
    codes[torch.rand(n, generator=g) >= density] = 0
    fields = (codes + s).to(torch.uint8)
    for layout in ("sparse", "dense"):
        stream = encode_fields_stream(fields, s, layout)
        assert torch.equal(stream, encode_stream(codes, s, layout))
        assert torch.equal(decode_fields_stream(stream, n, s), fields)
        for k in range(min(12, stream.numel())):   # flip one bit at a time: same verdict and codes
            bad = stream.clone()
            bad[(k * 7919) % bad.numel()] ^= 1 << (k % 8)
            try:
                want = decode_stream(bad, n, s)
            except PayloadError as e:
                with pytest.raises(PayloadError, match=str(e).split(" at ")[0][:20]):
                    decode_fields_stream(bad, n, s)
            else:
                assert torch.equal(decode_fields_stream(bad, n, s).to(torch.int32) - s, want)


@pytest.mark.parametrize("seed", range(8))
def test_tensor_built_streams_are_the_serial_writers(seed):
    """The stream assembled by tensor operations (lengths, prefix sum, scatter of 32-bit words; the
    GPU path) is byte for byte the serial writer's, for both layouts, long gaps past the tables and
    headers of more than 4,095 nonzeros."""
    from gradq.codecs.qsgd_stream import encode_fields_stream
    from gradq.codecs.qsgd_stream_torch import encode_fields_stream_torch

    g = torch.Generator().manual_seed(seed)
    s, n, density = [(1, 1, 1.0), (7, 9000, 0.0005), (127, 20000, 0.3), (3, 70000, 0.01), (127, 5, 0.0),
                     (15, 3, 1.0), (7, 100_000, 0.7), (7, 300_000, 1e-5)][seed]
    codes = torch.randint(-s, s + 1, (n,), generator=g, dtype=torch.int32)
    codes[torch.rand(n, generator=g) >= density] = 0
    fields = (codes + s).to(torch.uint8)
    for layout in ("auto", "sparse", "dense"):
        got, want = encode_fields_stream_torch(fields, s, layout, index=True), encode_fields_stream(fields, s, layout,
                                                                                                     index=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="lie in"):
        encode_fields_stream_torch(torch.full((2,), 2 * s + 1, dtype=torch.uint8), s)
