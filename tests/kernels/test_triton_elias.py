"""The Triton builder of Elias streams (:mod:`gradq.kernels.triton_elias`) gives the serial writer's
bytes and chunk index.

Without a GPU its kernels run under Triton's interpreter on CPU tensors; the GPU-marked test in
test_triton_kernels.py compares a CUDA encode with the CPU's.
"""

from __future__ import annotations

import pytest
import torch

import gradq
from gradq import kernels
from gradq.codecs import ans
from gradq.codecs.qsgd_stream import encode_fields_stream

T = pytest.importorskip("gradq.kernels.triton_ops", reason="triton is not installed")
from gradq.kernels import triton_elias as E  # noqa: E402  (needs triton)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("case", range(8))
def test_elias_stream_in_triton(case, monkeypatch):
    """The Triton stream builder gives the serial writer's stream and chunk index byte for byte:
    both layouts and ``auto``, gaps past the 4,096-entry table (and past a block), sparse streams
    with more than 4,095 nonzeros (a long header), one value, no nonzero, every value nonzero, and
    (the last case, 'auto' only: the interpreter is slow) more than one chunk of 2**18 values, in
    blocks of 8,192 fields (the interpreter runs programs one after another: 33 programs a pass
    take 1 s where 264 took 9; a chunk's row is written by the block that starts it either way)."""
    if case == 7:
        monkeypatch.setattr(E, "BLOCK", 8192)
    g = torch.Generator().manual_seed(case)
    s, n, density = [(1, 1, 1.0), (7, 9000, 0.0005), (127, 12000, 0.3), (3, 30000, 0.01), (127, 5, 0.0),
                     (15, 3, 1.0), (7, 20_000, 0.7), (7, 270_000, 1e-5)][case]
    codes = torch.randint(-s, s + 1, (n,), generator=g, dtype=torch.int32)
    codes[torch.rand(n, generator=g) >= density] = 0
    fields = (codes + s).to(torch.uint8)
    for layout in ("auto",) if case == 7 else ("auto", "sparse", "dense"):
        got, want = E.encode_fields_stream(fields, s, layout), encode_fields_stream(fields, s, layout, index=True)
        assert torch.equal(got[0], want[0]), layout
        assert torch.equal(got[1], want[1]), layout
    if case == 7:
        assert want[1].numel() == 3
    with pytest.raises(ValueError, match="lie in"):
        E.encode_fields_stream(torch.full((2,), 2 * s + 1, dtype=torch.uint8), s)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_block_prefix_sums_across_many_tiles(monkeypatch):
    """The blocks' prefix sums run per tile of blocks, then over the tiles, TILE at a time. With
    tiles of 2 blocks, 41 blocks make 21 tiles and a scan of 11 steps: tiles with no nonzero, a
    first gap that goes back several tiles, a tile whose only nonzero is in its second block, and a
    partial last tile; both layouts, byte for byte the serial writer's."""
    monkeypatch.setattr(E, "_TILE", 2)
    n = 41 * E.BLOCK - 100
    fields = torch.full((n,), 7, dtype=torch.uint8)             # s = 7: all zero codes
    for pos, v in [(5, 9), (1030, 0), (1031, 14), (9 * E.BLOCK + 3, 8), (17 * E.BLOCK - 1, 6),
                   (23 * E.BLOCK + 600, 10), (n - 1, 3)]:
        fields[pos] = v
    fields[30 * E.BLOCK:32 * E.BLOCK:5] = 12                     # a dense stretch over a whole tile
    for layout in ("sparse", "dense"):
        got, want = E.encode_fields_stream(fields, 7, layout), encode_fields_stream(fields, 7, layout, index=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), layout


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_gaps_at_the_edges_of_rows_of_lanes():
    """A gap is found from the last nonzero before each lane, within rows of 32 lanes and then
    across the rows (``_prev_nonzero``): nonzeros at the first and last lane of rows and blocks,
    a gap that spans whole rows, a block whose first nonzero is its last lane, followed by one whose
    first is its first lane, and one whose only nonzeros are in its first row; both layouts, byte for
    byte the serial writer's."""
    B = E.BLOCK
    n = 4 * B
    fields = torch.full((n,), 3, dtype=torch.uint8)             # s = 3: all zero codes
    for pos in [0, 31, 32, 63, 64, 65, 95, 96 + 31 * 5, B - 1, B, 2 * B - 1, 3 * B + 1, 3 * B + 2]:
        fields[pos] = 5 if pos % 2 else 0
    for layout in ("sparse", "dense"):
        got, want = E.encode_fields_stream(fields, 3, layout), encode_fields_stream(fields, 3, layout, index=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), layout


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("spec", ["qsgd:bits=4,coding=elias", "qsgd:bits=2,bucket=none,norm=l2,coding=elias-sparse",
                                  "qsgd:levels=100,coding=elias-dense"])
def test_elias_coded_qsgd_on_the_triton_backend(spec):
    """Elias-coded QSGD through the Triton backend (the path of CUDA tensors): the stream comes from
    the Triton builder, its CRC-32 from the device kernel (zlib on the host is not called), and the
    payload equals the CPU's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5000, generator=g) * torch.exp(2 * torch.randn(5000, generator=g))
    x[::7] = 0.0
    q = gradq.build(spec)
    calls = []
    real = E.encode_fields_stream

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def host_crc(*args):
        raise AssertionError("the CRC-32 was computed on the host")

    was = kernels.get_backend()
    E.encode_fields_stream = spy
    real_crc, ans.crc_field = ans.crc_field, host_crc
    try:
        kernels.set_backend("triton")
        enc = q.encode(x, seed=3)
    finally:
        E.encode_fields_stream = real
        ans.crc_field = real_crc
        kernels.set_backend(was)
    assert calls
    ref = q.encode(x, seed=3)
    assert enc.same_bytes(ref)
    assert torch.equal(q.decode(enc).view(torch.int32), q.decode(ref).view(torch.int32))


# -- the reader ----------------------------------------------------------------------------------
from gradq.codecs import qsgd_stream  # noqa: E402
from gradq.errors import PayloadError  # noqa: E402
from gradq.kernels import triton_elias_read as R  # noqa: E402

#: (s, n, density, layout): both layouts; magnitudes past the 12-bit table (s = 127); sparse gaps
#: past its 2**16 (read code by code); one value; a stream of every value nonzero
READ_CASES = [(7, 9000, 0.3, "dense"), (7, 9000, 0.3, "sparse"), (127, 3000, 0.5, "dense"),
              (127, 2000, 0.2, "sparse"), (3, 200_000, 1e-4, "sparse"), (1, 1, 1.0, "dense"), (1, 1, 1.0, "sparse"),
              (15, 4000, 1.0, "auto")]


def _stream_of(s, n, density, layout, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-s, s + 1, (n,), generator=g, dtype=torch.int32)
    codes[torch.rand(n, generator=g) >= density] = 0
    return encode_fields_stream((codes + s).to(torch.uint8), s, layout, index=True)


@pytest.fixture
def reader_shape(monkeypatch):
    """Segments of 32 bits and programs of 1,024 lanes: the interpreter runs a program's lanes
    together and its programs one after another, so few programs keep the tests short."""
    from gradq.kernels import triton_common as C

    monkeypatch.setitem(C.TUNING, "read_bits", 32)
    monkeypatch.setitem(C.TUNING, "read_warps", 32)


def _no_host_reader(*args, **kwargs):
    raise AssertionError("the stream was read on the host")


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
@pytest.mark.parametrize("case", range(len(READ_CASES)))
def test_elias_stream_read_in_triton(case, reader_shape, monkeypatch):
    """The Triton reader gives the host reader's fields, byte for byte, without calling it: both
    layouts, items read from the table and code by code, gaps past 2**16, one value."""
    s, n, density, layout = READ_CASES[case]
    stream, index = _stream_of(s, n, density, layout, case)
    want = qsgd_stream.decode_fields_stream(stream, n, s, index=index)
    monkeypatch.setattr(qsgd_stream, "decode_fields_stream", _no_host_reader)
    was = kernels.get_backend()
    kernels.set_backend("triton")
    try:
        got = kernels.elias_stream_fields(stream, n, s, index)
    finally:
        kernels.set_backend(was)
    assert torch.equal(got, want)


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_elias_stream_read_with_the_shipped_shape():
    """The shipped segment length and warps (the other tests take shorter segments and wider
    programs, which the interpreter runs faster), over two programs: the host reader's fields."""
    stream, index = _stream_of(7, 3000, 0.7, "dense", 6)
    from gradq.kernels import triton_common as C

    assert 8 * stream.numel() > 32 * C.TUNING["read_warps"] * C.TUNING["read_bits"]   # more than one program
    got = R.decode_fields_stream(stream, 3000, 7)
    assert got is not None and torch.equal(got, qsgd_stream.decode_fields_stream(stream, 3000, 7))


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_elias_reader_hands_over_what_it_does_not_accept(reader_shape, monkeypatch, full_tests):
    """The Triton reader never calls a stream corrupt and never returns other fields than the host
    reader's: for truncated and extended streams, non-zero padding and 8 single flipped bits (48
    with ``--full``) it returns None (the host reader then raises) or the host reader's fields; a
    stream whose guesses do not settle within ``_ROUNDS`` rounds goes to the host too; an empty
    stream or no items as well."""
    s, n = 7, 1500
    stream, index = _stream_of(s, n, 0.3, "dense", 1)
    damaged = [stream[:-1], torch.cat([stream, torch.zeros(1, dtype=torch.uint8)]), stream.clone()]
    damaged[2][-1] |= 1
    g = torch.Generator().manual_seed(5)
    for bit in torch.randint(0, 8 * stream.numel(), (48 if full_tests else 8,), generator=g).tolist():
        d = stream.clone()
        d[bit // 8] ^= 1 << (7 - bit % 8)
        damaged.append(d)
    accepted = refused = 0
    for d in damaged:
        got = R.decode_fields_stream(d, n, s)
        try:
            want = qsgd_stream.decode_fields_stream(d, n, s)
        except PayloadError:
            assert got is None
            refused += 1
            continue
        assert got is None or torch.equal(got, want)
        accepted += got is not None
    assert refused >= 3          # (at least the truncated, extended and padded ones)
    monkeypatch.setattr(R, "_ROUNDS", 1)
    assert R.decode_fields_stream(stream, n, s) is None
    assert R.decode_fields_stream(stream[:0], n, s) is None
    empty, _ = _stream_of(s, 100, 0.0, "sparse", 2)
    assert R.decode_fields_stream(empty, 100, s) is None


@pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
def test_elias_coded_qsgd_decodes_on_the_triton_backend(reader_shape, monkeypatch):
    """Elias-coded QSGD decoded through the Triton backend (the path of CUDA tensors): the reader
    on the device, not the host's, and the CPU's values bit for bit (dense: ``decode(out=)``;
    sparse: ``decode``)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4000, generator=g) * torch.exp(torch.randn(4000, generator=g))
    for spec in ("qsgd:bits=4,coding=elias-dense", "qsgd:bits=2,bucket=none,norm=l2,coding=elias-sparse"):
        q = gradq.build(spec)
        enc = q.encode(x, seed=9)
        want = q.decode(enc)
        with monkeypatch.context() as m:
            m.setattr(qsgd_stream, "decode_fields_stream", _no_host_reader)
            was = kernels.get_backend()
            kernels.set_backend("triton")
            try:
                if "dense" in spec:
                    got = torch.empty_like(x)
                    q.decode(enc, out=got)
                else:
                    got = q.decode(enc)
            finally:
                kernels.set_backend(was)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), spec
