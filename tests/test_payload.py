"""The wire format (gradq.payload): honest sizes, byte round trips, and PayloadError on any corruption."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradq
from gradq.payload import FIELD_HEADER_BYTES, HEADER_BYTES, Payload, spec_crc

SPEC = "test:bits=4,bucket=8"
SHAPE = (3, 7)
NAMES = ("codes", "scales")

ALL_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _payload() -> Payload:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (11,), generator=g).to(torch.uint8)
    scales = torch.rand(3, generator=g)
    return Payload(SPEC, SHAPE, torch.float32, 21, {"codes": codes, "scales": scales})


def _parse(buf, names=NAMES, spec=SPEC, shape=SHAPE) -> Payload:
    return Payload.from_bytes(buf, names=names, spec=spec, shape=shape, dtype=torch.float32)


def _raw() -> bytes:
    return bytes(_payload().to_bytes().tolist())


def test_sizes_are_honest():
    p = _payload()
    assert HEADER_BYTES == 16 and FIELD_HEADER_BYTES == 5
    assert p.header_nbytes == 16 + 5 * 2 == 26
    assert p.data_nbytes == 11 * 1 + 3 * 4
    assert p.nbytes == len(p.to_bytes()) == 26 + 23
    assert p.bits_per_coordinate == 8 * p.nbytes / 21


def test_header_layout():
    b = _raw()
    assert b[:2] == b"GQ" and b[2] == 1 and b[3] == 2
    assert int.from_bytes(b[4:8], "little") == spec_crc(SPEC)
    assert int.from_bytes(b[8:16], "little") == 21
    assert b[16] == 1 and int.from_bytes(b[17:21], "little") == 11     # uint8 x 11
    assert b[21] == 8 and int.from_bytes(b[22:26], "little") == 3      # float32 x 3
    p = _payload()
    assert list(b[26:37]) == p["codes"].tolist()
    assert b[37:] == p["scales"].numpy().astype("<f4").tobytes()


@pytest.mark.parametrize("as_bytes", [False, True])
def test_round_trip(as_bytes):
    p = _payload()
    buf = _raw() if as_bytes else p.to_bytes()
    q = _parse(buf)
    assert q.spec == SPEC and q.shape == SHAPE and q.numel == 21 and q.dtype == torch.float32
    assert list(q.fields) == list(NAMES)
    for k in NAMES:
        assert q[k].dtype == p[k].dtype and torch.equal(q[k], p[k])
    assert q.same_bytes(p) and q.nbytes == p.nbytes


def test_round_trip_every_dtype_and_empty_fields():
    g = torch.Generator().manual_seed(1)
    fields = {f"f{i}": (torch.randn(i + 1, generator=g) * 50).to(dt) for i, dt in enumerate(ALL_DTYPES)}
    fields["empty"] = torch.empty(0, dtype=torch.float32)
    p = Payload("s", (5,), torch.float16, 5, fields)
    buf = p.to_bytes()
    assert p.nbytes == len(buf) == 16 + 5 * len(fields) + sum(t.numel() * t.element_size() for t in fields.values())
    q = Payload.from_bytes(buf, names=list(fields), spec="s", shape=(5,), dtype=torch.float16)
    for k, t in fields.items():
        assert q[k].dtype == t.dtype and torch.equal(q[k], t)


def test_no_fields_and_empty_tensor():
    p = Payload("s", (0, 4), torch.float32, 0, {})
    assert p.nbytes == len(p.to_bytes()) == 16
    q = Payload.from_bytes(p.to_bytes(), names=(), spec="s", shape=(0, 4), dtype=torch.float32)
    assert q.numel == 0 and q.fields == {}


def test_missing_field_name_is_a_payload_error():
    with pytest.raises(gradq.PayloadError, match="no field 'nope'"):
        _payload()["nope"]


# -- corruption ------------------------------------------------------------------------------------
@pytest.mark.parametrize("as_bytes", [False, True])
def test_every_truncation_is_refused(as_bytes):
    b = _raw()
    for cut in range(len(b)):
        if as_bytes and cut == 0:
            continue  # see test_empty_bytes_object_is_refused
        buf = b[:cut] if as_bytes else torch.tensor(list(b[:cut]), dtype=torch.uint8)
        with pytest.raises(gradq.PayloadError):
            _parse(buf)


def test_empty_bytes_object_is_refused():
    with pytest.raises(gradq.PayloadError):
        _parse(b"")


def _mutated(pos: int, value: int) -> bytes:
    b = bytearray(_raw())
    b[pos] = value
    return bytes(b)


@pytest.mark.parametrize("buf,match", [
    (_raw() + b"\x00", "trailing"),
    (_mutated(0, ord("X")), "magic"),
    (_mutated(1, 0), "magic"),
    (_mutated(2, 2), "version"),
    (_mutated(2, 0), "version"),
    (_mutated(3, 1), "fields"),
    (_mutated(3, 3), "fields"),
    (_mutated(5, _raw()[5] ^ 1), "spec"),
    (_mutated(8, 22), "coordinates"),
    (_mutated(15, 1), "coordinates"),
    (_mutated(16, 0), "dtype code 0"),
    (_mutated(16, 10), "dtype code 10"),
    (_mutated(21, 255), "dtype code 255"),
    (_mutated(17, 12), "truncated"),       # codes count 11 -> 12: scales run past the end
    (_mutated(17, 10), "trailing"),        # codes count 11 -> 10: one byte left over
    (_mutated(20, 1), "truncated"),        # a count in the billions
    (_mutated(16, 8), "truncated"),        # codes as float32: 44 bytes, not 11
], ids=["extra-byte", "magic0", "magic1", "version2", "version0", "nfields1", "nfields3", "crc", "numel-lo",
        "numel-hi", "dtype0", "dtype10", "dtype255", "count+1", "count-1", "count-huge", "dtype-size"])
def test_corruptions_are_refused(buf, match):
    with pytest.raises(gradq.PayloadError, match=match):
        _parse(buf)


@pytest.mark.parametrize("kwargs,match", [
    ({"spec": SPEC + ",x=1"}, "different quantizer spec"),
    ({"shape": (3, 8)}, "coordinates"),
    ({"shape": (21, 1, 2)}, "coordinates"),
    ({"names": ("codes",)}, "fields"),
    ({"names": ("codes", "scales", "more")}, "fields"),
])
def test_mismatched_expectations_are_refused(kwargs, match):
    with pytest.raises(gradq.PayloadError, match=match):
        _parse(_raw(), **kwargs)


def test_wrong_buffer_type_is_refused():
    t = _payload().to_bytes()
    with pytest.raises(gradq.PayloadError, match="uint8"):
        _parse(t.to(torch.int16))
    with pytest.raises(gradq.PayloadError, match="1-D"):
        _parse(t.view(1, -1))


def test_unsupported_field_dtype_is_refused_on_write():
    p = Payload("s", (2,), torch.float32, 2, {"x": torch.zeros(2, dtype=torch.bool)})
    with pytest.raises(gradq.PayloadError, match="unsupported dtype"):
        p.to_bytes()


@settings(max_examples=400)
@given(st.lists(st.tuples(st.integers(0, 48), st.integers(0, 255)), min_size=1, max_size=4),
       st.integers(-3, 3))
def test_random_mutations_parse_or_raise_payload_error(edits, resize):
    b = bytearray(_raw())
    for pos, val in edits:
        b[pos % len(b)] = val
    if resize > 0:
        b += bytes(resize)
    elif resize < 0:
        del b[resize:]
    try:
        q = _parse(bytes(b))
    except gradq.PayloadError:
        return
    # Anything that parses accounts for every byte and has the expected structure.
    assert q.nbytes == len(b) and q.numel == 21 and list(q.fields) == list(NAMES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip():
    p = _payload().to("cuda")
    buf = p.to_bytes()
    assert buf.is_cuda and torch.equal(buf.cpu(), _payload().to_bytes())
    q = _parse(buf)
    assert q.device.type == "cuda" and torch.equal(q["scales"].cpu(), _payload()["scales"])


def test_to_bytes_into_a_slice_of_a_buffer():
    p = _payload()
    buf = torch.full((p.nbytes + 10,), 7, dtype=torch.uint8)
    got = p.to_bytes(out=buf[4:4 + p.nbytes])
    assert torch.equal(got, p.to_bytes())
    assert torch.equal(buf[:4], torch.full((4,), 7, dtype=torch.uint8))  # nothing written outside
    assert torch.equal(buf[4 + p.nbytes:], torch.full((6,), 7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8 tensor of"):
        p.to_bytes(out=torch.empty(p.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8 tensor of"):
        p.to_bytes(out=torch.empty(p.nbytes, dtype=torch.int8))


@pytest.mark.parametrize("shift", [0, 1, 2, 3])
def test_parse_without_copy_views_aligned_fields_and_copies_the_rest(shift):
    p = _payload()
    buf = torch.cat([torch.zeros(shift, dtype=torch.uint8), p.to_bytes()])[shift:]
    q = Payload.from_bytes(buf, names=NAMES, spec=SPEC, shape=SHAPE, dtype=torch.float32, copy=False)
    assert q.same_bytes(p)
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    assert lo <= q["codes"].data_ptr() < hi  # uint8: always a view
    scales_view = lo <= q["scales"].data_ptr() < hi
    at = buf.data_ptr() + HEADER_BYTES + 2 * FIELD_HEADER_BYTES + 11  # after the 11 code bytes
    assert scales_view == (at % 4 == 0)  # float32 scales: a view only where 4-byte aligned
    buf[-1] ^= 0xFF  # a view follows its buffer; a copy does not
    assert torch.equal(q["scales"], p["scales"]) != scales_view
    c = Payload.from_bytes(buf, names=NAMES, spec=SPEC, shape=SHAPE, dtype=torch.float32)
    assert c["codes"].data_ptr() != q["codes"].data_ptr()  # the default copies


def test_from_layout_reads_the_fields_from_their_offsets():
    """The header-free parse (used on GPUs, where reading the header would wait for the stream) gives
    the same fields as the checked parse, for fixed-width schemes; a wrong length is refused."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for spec in ("qsgd:bits=4,bucket=128", "terngrad", "maxnorm:bits=2", "signsgd"):
        q = gradq.build(spec)
        raw = q.encode(x, seed=1).to_bytes()
        layout = q.field_layout(x.numel())
        a = Payload.from_layout(raw, layout, spec=q.spec, shape=x.shape, dtype=x.dtype)
        b = q.payload_from_bytes(raw, x.shape)
        assert list(a.fields) == list(b.fields)
        assert all(torch.equal(a.fields[k], b.fields[k]) for k in a.fields), spec
        assert torch.equal(q.decode(a), q.decode(b))
        with pytest.raises(gradq.PayloadError):
            Payload.from_layout(raw[:-1], layout, spec=q.spec, shape=x.shape, dtype=x.dtype)


def test_header_bytes_are_built_once_per_layout():
    from gradq import payload as payload_mod

    q = gradq.build("qsgd:bits=4,bucket=128")
    a = q.encode(torch.randn(300), seed=0).to_bytes()
    b = q.encode(torch.randn(300), seed=1).to_bytes()
    key = next(k for k in payload_mod._HEADERS if k[0] == q.spec and k[1] == 300)
    assert torch.equal(a[:payload_mod._HEADERS[key].numel()], b[:payload_mod._HEADERS[key].numel()])


LAYOUT = {"codes": (torch.uint8, 11), "scales": (torch.float32, 3)}


def _parse_where_it_lies(buf, layout=LAYOUT) -> Payload:
    return Payload.parse(buf, names=NAMES, layout=layout, spec=SPEC, shape=SHAPE, dtype=torch.float32)


def test_parse_views_a_device_buffer_by_its_layout_without_reading_it():
    """A buffer off the host with a fixed layout is cut into views at the layout's offsets. A ``meta``
    tensor holds no data at all, so any read of its header (or of anything) would raise here: the
    parse reads nothing, as it must on a GPU, where a read is a synchronization."""
    buf = torch.empty(_payload().nbytes, dtype=torch.uint8, device="meta")
    p = _parse_where_it_lies(buf)
    assert list(p.fields) == list(NAMES) and p.numel == 21 and p.shape == SHAPE
    assert [(t.device.type, t.dtype, t.numel()) for t in p.fields.values()] == [
        ("meta", torch.uint8, 11), ("meta", torch.float32, 3)]
    with pytest.raises(gradq.PayloadError, match="needs 49"):
        _parse_where_it_lies(torch.empty(48, dtype=torch.uint8, device="meta"))


def test_parse_reads_host_bytes_and_unknown_layouts_with_their_header():
    """Host bytes are parsed by their header even where the layout is known: a damaged header is
    refused, and the fields are the payload's."""
    good = _parse_where_it_lies(_payload().to_bytes())
    assert good.same_bytes(_payload())
    assert _parse_where_it_lies(_payload().to_bytes(), layout=None).same_bytes(_payload())
    bad = bytearray(_raw())
    bad[0] ^= 1
    with pytest.raises(gradq.PayloadError):
        _parse_where_it_lies(bytes(bad))


def test_parse_checks_what_it_read_from_a_header_only():
    """``check`` sees each payload read by its header; a view by the layout has the layout's fields by
    construction and is not checked again (the DDP hook parses device payloads every step)."""
    seen = []
    kw = dict(names=NAMES, layout=LAYOUT, spec=SPEC, shape=SHAPE, dtype=torch.float32, check=seen.append)
    got = Payload.parse(_payload().to_bytes(), **kw)
    assert seen == [got]
    Payload.parse(torch.empty(_payload().nbytes, dtype=torch.uint8, device="meta"), **kw)
    assert seen == [got]
