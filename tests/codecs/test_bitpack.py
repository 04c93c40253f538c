"""Bit-field and trit packing (gradq.codecs.bitpack): exact round trips, byte layout, validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradq
from gradq.codecs.bitpack import pack_bits, pack_trits, packed_nbytes, trit_nbytes, unpack_bits, unpack_trits

WIDTHS = range(1, 9)


def ref_pack(codes: list[int], width: int) -> list[int]:
    """Pure-Python oracle: value i occupies bits [i·width, (i+1)·width) of one little-endian integer."""
    acc = 0
    for i, c in enumerate(codes):
        acc |= c << (i * width)
    return list(acc.to_bytes(packed_nbytes(len(codes), width), "little"))


def ref_trits(trits: list[int]) -> list[int]:
    """Pure-Python oracle: five trits per byte, first trit least significant (Σ t_k·3^k)."""
    out = []
    for i in range(0, len(trits), 5):
        out.append(sum(t * 3 ** k for k, t in enumerate(trits[i:i + 5])))
    return out


def _codes(n: int, width: int, seed: int, dtype=torch.int64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << width, (n,), generator=g).to(dtype)


# -- bit fields ------------------------------------------------------------------------------------
@pytest.mark.parametrize("width", WIDTHS)
def test_round_trip_and_reference_every_length(width):
    for n in range(71):
        c = _codes(n, width, seed=100 * width + n)
        packed = pack_bits(c, width)
        assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, width) == -(-n * width // 8)
        assert packed.tolist() == ref_pack(c.tolist(), width), (width, n)
        back = unpack_bits(packed, width, n)
        assert back.dtype == torch.int64 and torch.equal(back, c), (width, n)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("n", [1001, 65_537, 1_000_003])   # none fills whole 8-value groups
def test_round_trip_large(width, n):
    c = _codes(n, width, seed=n + width)
    packed = pack_bits(c, width)
    assert packed.numel() == packed_nbytes(n, width)
    assert torch.equal(unpack_bits(packed, width, n), c)
    if n == 1001:
        assert packed.tolist() == ref_pack(c.tolist(), width)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_code_dtypes_and_shapes(dtype):
    c = _codes(24, 3, seed=1, dtype=dtype)
    assert torch.equal(pack_bits(c.view(4, 6), 3), pack_bits(c.to(torch.int64), 3))
    assert torch.equal(unpack_bits(pack_bits(c, 3).view(3, 3), 3, 24), c.to(torch.int64))


@pytest.mark.parametrize("codes,width,want", [
    ([1, 2, 3], 2, [0b00111001]),                      # 01 | 10<<2 | 11<<4
    ([1, 0, 1, 1, 0, 0, 0, 1], 1, [0b10001101]),       # bit i = value i
    ([1] * 9, 1, [0xFF, 0x01]),                        # 9th value spills into byte 1
    ([5, 3, 7], 3, [0b11011101, 0b1]),                 # 101 | 011<<3 | 111<<6 (top bit into byte 1)
    ([0xA, 0x5], 4, [0x5A]),                           # low nibble first
    ([1, 2, 3], 4, [0x21, 0x03]),
    ([31, 1], 5, [0b00111111, 0]),                     # 10 bits -> 2 bytes, last one padding
    ([63, 1, 2, 3], 6, [0x7F, 0x20, 0x0C]),            # 63 | 1<<6 | 2<<12 | 3<<18 = 0x0C207F
    ([127, 0, 1], 7, [127, 64, 0]),                    # 1<<14 lands on bit 6 of byte 1
    ([0, 255, 7], 8, [0, 255, 7]),
    ([], 3, []),
])
def test_known_bytes(codes, width, want):
    packed = pack_bits(torch.tensor(codes, dtype=torch.int64), width)
    assert packed.tolist() == want
    assert unpack_bits(packed, width, len(codes)).tolist() == codes


@pytest.mark.parametrize("width", WIDTHS)
def test_out_of_range_codes_raise_value_error(width):
    for bad in ([1 << width], [0, -1], [(1 << width) + 5, 0]):
        with pytest.raises(ValueError, match=r"codes must lie in \[0, "):
            pack_bits(torch.tensor(bad), width)


@pytest.mark.parametrize("width", [0, 9, -1, True, 2.0])
def test_bad_width_raises_value_error(width):
    with pytest.raises(ValueError, match="bit width"):
        pack_bits(torch.tensor([0]), width)
    with pytest.raises(ValueError, match="bit width"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), width, 1)


@pytest.mark.parametrize("width", WIDTHS)
def test_wrong_byte_count_raises_payload_error(width):
    for n in (1, 7, 8, 9, 33):
        need = packed_nbytes(n, width)
        for have in (need - 1, need + 1, 0 if need else 1):
            if have < 0 or have == need:
                continue
            with pytest.raises(gradq.PayloadError, match=f"need {need} bytes, got {have}"):
                unpack_bits(torch.zeros(have, dtype=torch.uint8), width, n)


def test_wrong_byte_dtype_raises_payload_error():
    with pytest.raises(gradq.PayloadError, match="uint8"):
        unpack_bits(torch.zeros(3, dtype=torch.int8), 3, 8)
    with pytest.raises(gradq.PayloadError, match="uint8"):
        unpack_trits(torch.zeros(1, dtype=torch.int32), 5)


def test_unused_trailing_bits_are_ignored_on_unpack():
    # 3 values of 3 bits use 9 of 16 bits; garbage in the 7 unused bits must not change the values.
    c = torch.tensor([5, 2, 7])
    packed = pack_bits(c, 3)
    assert packed[1] == 1   # only the top bit of value 2 is set in byte 1
    dirty = packed.clone()
    dirty[1] |= 0b11111110
    assert torch.equal(unpack_bits(dirty, 3, 3), c)


# -- trits -----------------------------------------------------------------------------------------
def test_trits_round_trip_every_length():
    for n in list(range(71)) + [1001, 100_003]:
        g = torch.Generator().manual_seed(n)
        t = torch.randint(0, 3, (n,), generator=g)
        packed = pack_trits(t)
        assert packed.dtype == torch.uint8 and packed.numel() == trit_nbytes(n) == -(-n // 5)
        if n <= 70:
            assert packed.tolist() == ref_trits(t.tolist())
        assert torch.equal(unpack_trits(packed, n), t)


@pytest.mark.parametrize("trits,want", [
    ([1, 2, 0, 0, 1], [1 + 2 * 3 + 81]),
    ([2] * 5, [242]),
    ([2] * 6, [242, 2]),
    ([0, 0, 0, 0, 0, 1], [0, 1]),
    ([], []),
])
def test_trits_known_bytes(trits, want):
    packed = pack_trits(torch.tensor(trits, dtype=torch.int64))
    assert packed.tolist() == want
    assert unpack_trits(packed, len(trits)).tolist() == trits


def test_every_valid_trit_byte_decodes():
    allb = torch.arange(243, dtype=torch.uint8)
    t = unpack_trits(allb, 5 * 243)
    assert torch.equal(pack_trits(t), allb)


@pytest.mark.parametrize("byte", [243, 250, 255])
def test_trit_bytes_above_242_raise_payload_error(byte):
    data = torch.tensor([0, byte, 1], dtype=torch.uint8)
    with pytest.raises(gradq.PayloadError, match="above 242"):
        unpack_trits(data, 15)


def test_trits_validation():
    with pytest.raises(ValueError, match=r"\{0, 1, 2\}"):
        pack_trits(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"\{0, 1, 2\}"):
        pack_trits(torch.tensor([-1]))
    for n, have in [(5, 0), (5, 2), (6, 1), (0, 1)]:
        with pytest.raises(gradq.PayloadError, match=f"need {trit_nbytes(n)} bytes, got {have}"):
            unpack_trits(torch.zeros(have, dtype=torch.uint8), n)


# -- properties ------------------------------------------------------------------------------------
@settings(max_examples=300)
@given(st.integers(1, 8).flatmap(lambda w: st.tuples(st.just(w), st.lists(st.integers(0, (1 << w) - 1),
                                                                        max_size=150))))
def test_bits_property(case):
    width, codes = case
    packed = pack_bits(torch.tensor(codes, dtype=torch.int64), width)
    assert packed.tolist() == ref_pack(codes, width)
    assert unpack_bits(packed, width, len(codes)).tolist() == codes


@settings(max_examples=200)
@given(st.integers(1, 8), st.integers(0, 100), st.binary(max_size=120))
def test_unpack_arbitrary_bytes_never_misbehaves(width, n, raw):
    data = torch.tensor(list(raw), dtype=torch.uint8)
    if len(raw) != packed_nbytes(n, width):
        with pytest.raises(gradq.PayloadError):
            unpack_bits(data, width, n)
        return
    vals = unpack_bits(data, width, n)
    assert vals.numel() == n and (n == 0 or (int(vals.min()) >= 0 and int(vals.max()) < (1 << width)))
    # re-packing reproduces the bytes up to the unused bits of the last byte
    used = n * width
    again = pack_bits(vals, width)
    if used % 8 == 0:
        assert torch.equal(again, data)
    else:
        mask = (1 << (used % 8)) - 1
        assert torch.equal(again[:-1], data[:-1]) and int(again[-1]) == int(data[-1]) & mask


@settings(max_examples=200)
@given(st.lists(st.integers(0, 2), max_size=120))
def test_trits_property(trits):
    packed = pack_trits(torch.tensor(trits, dtype=torch.int64))
    assert packed.tolist() == ref_trits(trits)
    assert unpack_trits(packed, len(trits)).tolist() == trits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    for width in WIDTHS:
        c = _codes(1003, width, seed=width)
        p = pack_bits(c.cuda(), width)
        assert p.is_cuda and torch.equal(p.cpu(), pack_bits(c, width))
        assert torch.equal(unpack_bits(p, width, 1003).cpu(), c)
    t = torch.randint(0, 3, (1003,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(pack_trits(t.cuda()).cpu(), pack_trits(t))
    assert torch.equal(unpack_trits(pack_trits(t).cuda(), 1003).cpu(), t)


@pytest.mark.parametrize("n", [-1, 2.0, True])
def test_bad_counts_are_refused(n):
    with pytest.raises(ValueError, match="non-negative integer"):
        unpack_bits(torch.zeros(0, dtype=torch.uint8), 3, n)
    with pytest.raises(ValueError, match="non-negative integer"):
        unpack_trits(torch.zeros(0, dtype=torch.uint8), n)
