"""Elias omega / gamma codecs (gradq.codecs.elias): known codes, exact agreement with a pure-Python
oracle, round trips at the range edges, and robustness of the decoder against any corruption."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradq import PayloadError
from gradq_testing import ref_omega
from gradq.codecs.elias import (MAX_VALUE, gamma_decode, gamma_encode, gamma_nbits, omega_decode, omega_encode,
                                omega_nbits)


# ---- pure-Python oracle (bit strings) -------------------------------------------------------------


def ref_gamma(k: int) -> str:
    return "0" * (k.bit_length() - 1) + format(k, "b")


def ref_read_omega(bits: str, p: int) -> tuple[int, int] | None:
    """Decode one omega code at p; None if malformed (group over 63 bits, value above 2**62, truncated)."""
    n = 1
    while True:
        if p >= len(bits):
            return None
        if bits[p] == "0":
            return (n, p + 1) if n <= MAX_VALUE else None
        if n + 1 > 63 or p + n + 1 > len(bits):
            return None
        n, p = int(bits[p:p + n + 1], 2), p + n + 1


def ref_read_gamma(bits: str, p: int) -> tuple[int, int] | None:
    z = 0
    while p < len(bits) and bits[p] == "0":
        z, p = z + 1, p + 1
    if p >= len(bits) or z > 62 or p + z + 1 > len(bits):
        return None
    v = int(bits[p:p + z + 1], 2)
    return (v, p + z + 1) if v <= MAX_VALUE else None


def ref_decode(data: bytes, count: int, gamma: bool) -> list[int] | None:
    """Strict oracle decoder: None unless exactly ``count`` codes, zero padding, no extra bytes."""
    bits = "".join(format(b, "08b") for b in data)
    p, out = 0, []
    for _ in range(count):
        r = (ref_read_gamma if gamma else ref_read_omega)(bits, p)
        if r is None:
            return None
        v, p = r
        out.append(v)
    if len(data) != (p + 7) // 8 or "1" in bits[p:]:
        return None
    return out


def to_bytes(bits: str) -> bytes:
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))


def bitstring(t: torch.Tensor) -> str:
    return "".join(format(b, "08b") for b in t.tolist())


CODECS = {"omega": (omega_encode, omega_decode, omega_nbits, ref_omega),
          "gamma": (gamma_encode, gamma_decode, gamma_nbits, ref_gamma)}
EDGES = sorted({1, 2, 3, MAX_VALUE} | {(1 << k) - 1 for k in range(1, 63)} | {1 << k for k in range(0, 63)}
               | {(1 << k) + 1 for k in range(1, 62)})


# ---- known codes --------------------------------------------------------------------------------
@pytest.mark.parametrize("k,code", [(1, "0"), (2, "100"), (3, "110"), (4, "101000"), (7, "101110"),
                                    (8, "1110000"), (16, "10100100000"), (100, "1011011001000")])
def test_known_omega_codes(k, code):
    assert ref_omega(k) == code
    assert omega_nbits([k]) == len(code)
    assert bitstring(omega_encode([k])) == code + "0" * (-len(code) % 8)


@pytest.mark.parametrize("k,code", [(1, "1"), (2, "010"), (3, "011"), (4, "00100"), (9, "0001001")])
def test_known_gamma_codes(k, code):
    assert ref_gamma(k) == code
    assert bitstring(gamma_encode([k])) == code + "0" * (-len(code) % 8)


def test_msb_first_concatenation():
    # 0 100 110 101000 = 0100110101000 + 000 padding -> 0x4D 0x40
    assert omega_encode([1, 2, 3, 4]).tolist() == [0x4D, 0x40]
    assert omega_decode(bytes([0x4D, 0x40]), 4).tolist() == [1, 2, 3, 4]


# ---- exact agreement with the oracle and round trips ----------------------------------------------
@pytest.mark.parametrize("name", CODECS)
def test_edge_values_match_oracle_and_round_trip(name):
    enc, dec, nbits, ref = CODECS[name]
    vals = np.array(EDGES, dtype=np.int64)
    bits = "".join(ref(int(v)) for v in vals)
    assert nbits(vals) == len(bits)
    out = enc(vals)
    assert bytes(out.tolist()) == to_bytes(bits)
    assert dec(out, len(vals)).tolist() == vals.tolist()
    assert dec(out.numpy(), len(vals)).dtype == torch.int64


@pytest.mark.parametrize("name", CODECS)
def test_random_round_trip(name):
    enc, dec, nbits, ref = CODECS[name]
    rng = np.random.default_rng(0)
    # log-uniform magnitudes so every code length appears
    vals = (2.0 ** rng.uniform(0, 62, 20_000)).astype(np.int64).clip(1, MAX_VALUE)
    out = enc(vals)
    assert out.numel() == (nbits(vals) + 7) // 8
    assert torch.equal(dec(out, vals.size), torch.from_numpy(vals))
    assert bytes(enc(vals[:300]).tolist()) == to_bytes("".join(ref(int(v)) for v in vals[:300]))


@pytest.mark.parametrize("name", CODECS)
def test_empty(name):
    enc, dec, nbits, _ = CODECS[name]
    assert enc([]).numel() == 0 and nbits([]) == 0
    assert dec(b"", 0).numel() == 0
    with pytest.raises(PayloadError, match="extended stream"):
        dec(b"\x00", 0)


@pytest.mark.parametrize("bad", [0, -1, MAX_VALUE + 1, -(1 << 63)])
def test_encode_refuses_out_of_range(bad):
    for enc in (omega_encode, gamma_encode):
        with pytest.raises(ValueError, match=r"\[1, 2\*\*62\]"):
            enc(np.array([1, bad], dtype=np.int64))
    with pytest.raises(TypeError, match="integers"):
        omega_encode(np.array([1.5]))


# ---- clear errors on malformed streams ---------------------------------------------------------------
def test_group_longer_than_63_bits_is_malformed():
    # chain 2 ('10'), 5 ('101'), 63 ('111111'): the next group would need 64 bits
    with pytest.raises(PayloadError, match="too large / malformed prefix"):
        omega_decode(to_bytes("10" + "101" + "111111" + "1" * 64 + "0"), 1)


def test_value_above_2_62_is_malformed():
    ok = "10" + "101" + "111110" + format(MAX_VALUE, "b") + "0"
    assert omega_decode(to_bytes(ok), 1).tolist() == [MAX_VALUE]
    bad = "10" + "101" + "111110" + format(MAX_VALUE + 1, "b") + "0"
    with pytest.raises(PayloadError, match="too large"):
        omega_decode(to_bytes(bad), 1)
    with pytest.raises(PayloadError, match="too large"):
        gamma_decode(to_bytes("0" * 63 + "1" + "0" * 63), 1)
    with pytest.raises(PayloadError, match="too large"):
        gamma_decode(to_bytes("0" * 62 + format(MAX_VALUE + 1, "b")), 1)


def test_truncated_and_extended_messages():
    s = omega_encode([5, 1000, 3])
    with pytest.raises(PayloadError, match="truncated"):
        omega_decode(s[:-1], 3)
    # 26 bits of codes + 6 zero padding bits; a 0 bit is the code of 1, so asking for more values than
    # 3 + 6 runs off the end
    assert omega_decode(s, 9).tolist() == [5, 1000, 3] + [1] * 6
    with pytest.raises(PayloadError, match="truncated"):
        omega_decode(s, 10)
    with pytest.raises(PayloadError, match="extended stream: bytes follow"):
        omega_decode(torch.cat([s, torch.zeros(1, dtype=torch.uint8)]), 3)
    with pytest.raises(PayloadError, match="extended stream: nonzero padding"):
        omega_decode(bytes([0b0000_0001]), 1)  # '0' = 1, then a stray 1 in the padding
    with pytest.raises(PayloadError, match="uint8"):
        omega_decode(torch.zeros(2, dtype=torch.int32), 1)


# ---- robustness: any corruption -> PayloadError or exactly `count` valid values ---------------------
VALUES = st.lists(st.one_of(st.integers(1, 40), st.integers(1, MAX_VALUE)), min_size=0, max_size=40)
ROBUST = settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])


def _check_decoder(dec, enc, data: bytes, count: int, gamma: bool) -> None:
    """The compiled decoder agrees with the oracle: same verdict and, when accepted, same values; an
    accepted stream is canonical (re-encoding its values gives the same bytes)."""
    expect = ref_decode(data, count, gamma)
    try:
        got = dec(data, count)
    except PayloadError:
        assert expect is None, f"rejected a valid stream {data.hex()} ({count})"
        return
    assert expect is not None, f"accepted a malformed stream {data.hex()} ({count})"
    assert got.dtype == torch.int64 and got.numel() == count
    assert got.tolist() == expect
    assert bytes(enc(got).tolist()) == data


@pytest.mark.parametrize("name", CODECS)
@ROBUST
@given(vals=VALUES, cut=st.integers(0, 10_000), flip=st.integers(0, 10_000), extra=st.binary(min_size=1, max_size=3))
def test_corrupted_streams(name, vals, cut, flip, extra):
    enc, dec, _, _ = CODECS[name]
    gamma = name == "gamma"
    data = bytes(enc(vals).tolist())
    n = len(vals)
    _check_decoder(dec, enc, data, n, gamma)  # the intact stream
    if data:
        _check_decoder(dec, enc, data[: cut % len(data)], n, gamma)  # truncated
        b = bytearray(data)
        b[(flip // 8) % len(b)] ^= 0x80 >> (flip % 8)  # one bit flipped
        _check_decoder(dec, enc, bytes(b), n, gamma)
    _check_decoder(dec, enc, data + extra, n, gamma)  # extended
    _check_decoder(dec, enc, data, max(n - 1, 0), gamma)  # wrong count
    _check_decoder(dec, enc, data, n + 1, gamma)


@pytest.mark.parametrize("name", CODECS)
def test_every_truncation_length(name):
    enc, dec, _, _ = CODECS[name]
    vals = [1, 2, 3, 4, 1000, 2 ** 40 + 7, MAX_VALUE, 9]
    data = bytes(enc(vals).tolist())
    for cut in range(len(data)):
        with pytest.raises(PayloadError):
            dec(data[:cut], len(vals))


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=1500)
@given(data=st.binary(max_size=48), count=st.integers(0, 400))
def test_random_bytes(name, data, count):
    enc, dec, _, _ = CODECS[name]
    _check_decoder(dec, enc, data, count, name == "gamma")
