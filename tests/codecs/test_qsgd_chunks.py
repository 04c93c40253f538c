"""The chunk-parallel Elias writer and reader (gradq.codecs.qsgd_chunks) and the chunk index.

The writer must give the serial codes writer's bytes, and an index equal to the one recomputed from
the codes by a plain walk (``qsgd_stream._codes_index``); the reader must return the fields, and refuse
any index that is not the stream's own. Vectors span 4 to 5 chunks of ``CHUNK`` = 2**18 values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradq import PayloadError
from gradq.codecs.qsgd_chunks import CHUNK, index_len
from gradq.codecs.qsgd_stream import decode_fields_stream, decode_stream, encode_fields_stream, encode_stream

N = 4 * CHUNK + 5


def _codes(kind: str, s: int) -> torch.Tensor:
    g = np.random.default_rng(len(kind) * 1000 + s)
    c = np.zeros(N, np.int64)
    if kind == "edges":         # nonzeros on chunk boundaries, chunks 1 and 3 empty, the last value set
        c[[0, CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 1, N - 1]] = [1, -s, 2 if s > 1 else 1, -1, s]
    elif kind == "long gaps":   # gaps past the 4,096-entry tables and across chunks
        c[g.choice(N, 40, replace=False)] = g.integers(1, s + 1, 40) * g.choice([-1, 1], 40)
    elif kind == "one":
        c[3 * CHUNK + 100] = -1
    elif kind == "dense":
        c = g.integers(-s, s + 1, N)
    elif kind == "mixed":
        c = g.integers(-s, s + 1, N) * (g.random(N) < 0.3)
    elif kind in ("dense first", "dense later"):
        # |c| in 4…6 takes a bit less dense than sparse (omega(|c| + 1) has the length of omega(|c|)),
        # a run of zeros a bit a value more: the first chunk predicts one layout, the whole the other
        big = g.integers(4, 7, N) if s >= 7 else np.ones(N, np.int64)
        if kind == "dense first":
            c[:CHUNK] = big[:CHUNK]
        else:
            c[:CHUNK] = big[:CHUNK] * (g.random(CHUNK) < 0.05)
            c[CHUNK:] = big[CHUNK:]
    return torch.from_numpy(c)


KINDS = ["edges", "long gaps", "one", "zeros", "dense", "mixed", "dense first", "dense later"]


@pytest.mark.parametrize("s", [1, 7, 127])
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_writer_and_reader_agree_with_the_serial_codec(kind, s):
    codes = _codes(kind, s)
    fields = (codes + s).to(torch.uint8)
    for layout in ("auto", "sparse", "dense"):
        stream, index = encode_fields_stream(fields, s, layout, index=True)
        want, want_index = encode_stream(codes, s, layout, index=True)
        assert torch.equal(stream, want), layout
        if layout == "auto" and kind.startswith("dense ") and s >= 7:   # (not the first chunk's layout)
            assert (stream[0] >> 7) == (kind == "dense later")
        assert torch.equal(index, want_index) and index.numel() == index_len(N) == 12, layout
        out = torch.full((N,), 255, dtype=torch.uint8)        # the reader fills every value itself
        assert decode_fields_stream(stream, N, s, out=out, index=index) is out
        assert torch.equal(out, fields)
        assert torch.equal(decode_fields_stream(stream, N, s), fields)                   # serial
        assert torch.equal(decode_stream(stream, N, s, index=index).to(torch.int64), codes)


@pytest.mark.parametrize("kind", ["edges", "long gaps", "mixed", "dense"])
def test_any_other_index_is_refused(kind):
    """Every single-entry change of the index (±1, and the entry of the next row) is refused by the
    parallel reader and by the serial reader's check; so is an index of the wrong length."""
    s = 7
    fields = (_codes(kind, s) + s).to(torch.uint8)
    for layout in ("sparse", "dense"):
        stream, index = encode_fields_stream(fields, s, layout, index=True)
        for k in range(index.numel()):
            for bad_value in (index[k] - 1, index[k] + 1, index[(k + 3) % index.numel()]):
                if bad_value == index[k]:
                    continue
                bad = index.clone()
                bad[k] = bad_value
                with pytest.raises(PayloadError):   # (a chunk read from a wrong bit may fail as damage)
                    decode_fields_stream(stream, N, s, index=bad)
                with pytest.raises(PayloadError, match="chunk index"):
                    decode_stream(stream, N, s, index=bad)
        for bad in (index[:-3], torch.cat([index, index[:3]])):
            with pytest.raises(PayloadError):
                decode_fields_stream(stream, N, s, index=bad)


@pytest.mark.parametrize("layout,s", [("sparse", 7), ("dense", 7), ("dense", 127)])
def test_damaged_streams_with_an_index(layout, s):
    """Bit flips in a multi-chunk stream: the parallel reader refuses what the serial one refuses, and
    whatever it accepts is exactly what the writer makes of the decoded fields (stream and index).
    (Dense fields of 8 bits are read through the 16-bit window.)"""
    codes = _codes("mixed", s)
    stream, index = encode_fields_stream((codes + s).to(torch.uint8), s, layout, index=True)
    g = np.random.default_rng(5)
    for bit in g.choice(stream.numel() * 8, 24, replace=False):
        bad = stream.clone()
        bad[bit // 8] ^= 1 << int(bit % 8)
        try:
            got = decode_fields_stream(bad, N, s, index=index)
        except PayloadError:
            continue
        again, again_index = encode_fields_stream(got, s, layout, index=True)
        assert torch.equal(again, bad) and torch.equal(again_index, index)
    for cut in (stream[:-1], stream[: stream.numel() // 2], torch.cat([stream, stream[:1]])):
        with pytest.raises(PayloadError):
            decode_fields_stream(cut, N, s, index=index)


def test_small_vectors_have_an_empty_index():
    for n in (0, 1, CHUNK):
        f = torch.full((n,), 3, dtype=torch.uint8)
        stream, index = encode_fields_stream(f, 3, "auto", index=True)
        assert index.numel() == index_len(n) == 0 and index.dtype == torch.int64
        assert torch.equal(decode_fields_stream(stream, n, 3, index=index), f)
    assert index_len(CHUNK + 1) == 3


@pytest.mark.parametrize("spec", ["qsgd:bits=4,coding=elias", "qsgd:bits=8,bucket=1000,norm=l2,coding=elias-dense",
                                  "qsgd:bits=2,bucket=none,coding=elias-sparse"])
def test_decode_into_out_dequantizes_by_chunks_bit_for_bit(spec):
    """``decode(p, out=)`` on the CPU decodes each chunk into a chunk-sized buffer and dequantizes it
    there (buckets that straddle chunks included): the same floats as the fixed coding's decode."""
    import gradq

    q = gradq.build(spec)
    fixed = gradq.build(spec.replace(",coding=elias-dense", "").replace(",coding=elias-sparse", "")
                        .replace(",coding=elias", ""))
    x = torch.randn(2 * CHUNK + 999, generator=torch.Generator().manual_seed(3))
    p = q.encode(x, seed=4)
    out = torch.full_like(x, float("nan"))
    assert q.decode(p, out=out) is out
    assert torch.equal(out, fixed.decode(fixed.encode(x, seed=4))) and torch.equal(out, q.decode(p))
    bad = dict(p.fields)
    bad["index"] = bad["index"].clone()
    bad["index"][0] += 1
    from gradq.codecs.ans import crc_field

    bad["crc"] = crc_field(bad["stream"], bad["index"])   # a consistent CRC: the index check must catch it
    with pytest.raises(PayloadError):
        q.decode(gradq.Payload(p.spec, p.shape, p.dtype, p.numel, bad), out=out)


@pytest.mark.parametrize("s", [1, 7, 127])
def test_the_sparse_floor_never_exceeds_the_sparse_length(s):
    """``auto`` takes the dense layout without writing the sparse one when a lower bound of the sparse
    bits (every gap ≥ 1 bit, ≥ 3 after a zero) already exceeds the dense bits: the bound must hold
    for every kind of vector, exactly computed here from the codes, and it must settle the plain
    dense case (so that the test above covers that path too). Fields of up to 4 bits have their
    dense bits counted by the sparse pair writer instead: that count must be exact."""
    from gradq.codecs.elias import omega_len
    from gradq.codecs.qsgd_chunks import (_chunk_bodies, _dense_bodies, _packed_bits, _sparse_floor, item_code_table,
                                          pair_code_table)
    from gradq.codecs.qsgd_fields import field_tables

    sc, sl, dc, dl = field_tables(s)
    for kind in KINDS:
        codes = _codes(kind, s).numpy()
        f = (codes + s).astype(np.uint8)
        pos = np.flatnonzero(codes)
        gaps = np.diff(np.concatenate(([-1], pos)))
        exact = omega_len(pos.size + 1) + int(sl[f[pos]].sum()) + sum(omega_len(int(g)) for g in gaps)
        scratch = np.zeros(-(-N // CHUNK) * (2 * CHUNK + 16), np.uint8)
        counts = _dense_bodies(f, s, _packed_bits(sl, dl), dc, scratch, 2 * CHUNK + 16)
        assert int(counts[0].sum()) == int(dl[f].sum())
        table, shift = item_code_table(s)
        if shift <= 4:   # the pair writer counts the dense bits while it writes the sparse items
            tally = _chunk_bodies(f, s, sc, sl, dl, table, shift, pair_code_table(s), scratch, 2 * CHUNK + 16)[4]
            assert int(tally.sum()) == int(dl[f].sum()), kind
        assert _sparse_floor(counts) <= exact, kind
        if kind == "dense" and s == 127:
            assert _sparse_floor(counts) > int(counts[0].sum())


def test_the_kept_field_buffer_never_reaches_a_payload():
    """The quantizer writes the fields into a buffer kept per thread (``field_buffer``) and streams
    them: a payload must not change when the next encode reuses the buffer, and each thread has a
    buffer of its own."""
    import threading

    import gradq
    from gradq.codecs.qsgd_chunks import field_buffer

    q = gradq.build("qsgd:bits=4,coding=elias")
    x = torch.randn(CHUNK + 77, generator=torch.Generator().manual_seed(8))
    p = q.encode(x, seed=1)
    stream = p.fields["stream"].clone()
    want = q.decode(p)
    q.encode(-x, seed=2)                      # overwrites the kept fields
    assert torch.equal(p.fields["stream"], stream) and torch.equal(q.decode(p), want)
    assert field_buffer(5).data_ptr() == field_buffer(9).data_ptr()
    other = []
    t = threading.Thread(target=lambda: other.append(field_buffer(5).data_ptr()))
    t.start()
    t.join()
    assert other[0] != field_buffer(5).data_ptr()


@pytest.mark.parametrize("norm", ["max", "l2"])
def test_the_elias_primitives_are_the_quantizers_and_each_other(norm):
    """``kernels.elias_encode`` / ``elias_decode`` (what Elias-coded QSGD calls): the quantizer's
    stream, index and scales for the same seed; ``elias_decode`` into a CPU ``out=`` (decoded by
    chunks) gives the values of the decode without ``out=`` (the fields path); a bad norm is refused."""
    import gradq
    from gradq import kernels

    q = gradq.build(f"qsgd:bits=4,bucket=500,norm={norm},coding=elias")
    x = torch.randn(CHUNK + 1234, generator=torch.Generator().manual_seed(5))
    p = q.encode(x, seed=6)
    stream, index, scales = kernels.elias_encode(x, q.s, 500, norm, 6)
    assert torch.equal(stream, p.fields["stream"]) and torch.equal(index, p.fields["index"])
    assert torch.equal(scales, p.fields["scales"])
    out32 = torch.full_like(x, float("nan"))
    assert kernels.elias_decode(stream, index, scales, q.s, 500, x.numel(), out32) is out32
    assert torch.equal(out32, q.decode(p))
    with pytest.raises(ValueError, match="norm"):
        kernels.elias_encode(x, q.s, 500, "l1", 6)
