"""Elias omega ("recursive Elias") and Elias gamma codes of positive integers, MSB-first bit streams.

**Omega** (docs/algorithms.md; QSGD [QSGD], [QSGD-full], section 3.1 and appendix A). The code of ``k ≥ 1``:
start from ``0``; while ``k > 1`` prepend the binary form of ``k`` and set ``k ← bitlength(k) − 1``.
Examples: ``1 → 0``, ``2 → 100``, ``3 → 110``, ``4 → 101000``. Decode: ``N ← 1``; while the next bit is
1, read that bit and the ``N`` bits after it as a binary number and make it the new ``N``; a 0 bit ends
the code with value ``N``. Its length is ``1 + Σ_j bitlength(k_j)`` over the chain
``k_0 = k, k_{j+1} = bitlength(k_j) − 1`` — about ``log k + log log k + …`` bits.

**Gamma**: ``bitlength(k) − 1`` zero bits, then the binary form of ``k`` (``2·bitlength(k) − 1`` bits).

**Bit order [decided]**: codes are written one after another, most significant bit first, starting at
bit 7 of byte 0; the last byte is zero-padded. A stream of values ``v`` takes ``ceil(Σ len(v_i)/8)``
bytes (:func:`omega_nbits` / :func:`gamma_nbits` give the exact bit count without writing).

**Range**: values ``1 … 2**62`` (int64). **Robust decoding [decided]**: every read is checked against the
buffer end; an omega group longer than 63 bits, a gamma prefix of more than 62 zeros, or a value above
``2**62`` is malformed (so the omega recursion stops after at most 6 groups, since each group's value is at
least ``2^N > N``), and after the last value only zero padding bits may remain in the final byte and no
further byte may follow. Any violation raises :class:`gradq.PayloadError` — decoding never hangs, never
reads out of bounds and never returns the wrong number of values.

The loops are compiled with numba (``nogil``, cached); without numba they run as plain Python (slow but
identical).
"""

from __future__ import annotations

from typing import Callable, Union

import numpy as np
import torch

from ..errors import PayloadError

try:  # pragma: no cover - exercised by the environment, not by a test
    from ..kernels.numba_cache import keyed_njit

    # compiled into a directory keyed by the codecs' sources (gradq.kernels.numba_cache): the modules
    # that call these functions inline them, which numba's own per-file cache does not notice
    # (keyed_njit imports numba: without it, ImportError)
    _jit = keyed_njit("codecs", nogil=True)

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    def _jit(fn: Callable) -> Callable:
        return fn

    HAVE_NUMBA = False

__all__ = ["omega_encode", "omega_decode", "omega_nbits", "gamma_encode", "gamma_decode", "gamma_nbits",
           "MAX_VALUE", "raise_for_error"]

#: largest integer the codecs accept
MAX_VALUE = 1 << 62

# error codes returned by the compiled decoders (0 = success)
OK = 0
ERR_TRUNCATED = 1
ERR_TOO_LARGE = 2
ERR_PADDING = 3
ERR_EXTRA = 4
ERR_GAP = 5
ERR_CODE = 6
ERR_NNZ = 7
ERR_INDEX = 8

_MESSAGES = {
    ERR_TRUNCATED: "truncated: the stream ends inside a code",
    ERR_TOO_LARGE: "value too large / malformed prefix (an Elias group longer than 63 bits or a value above 2**62)",
    ERR_PADDING: "extended stream: nonzero padding bits after the last code",
    ERR_EXTRA: "extended stream: bytes follow the last code",
    ERR_GAP: "a gap runs past the end of the vector",
    ERR_CODE: "a code's magnitude exceeds s",
    ERR_NNZ: "more nonzeros than coordinates",
    ERR_INDEX: "the chunk index does not match the stream",
}

ArrayLike = Union[np.ndarray, torch.Tensor, list]


def raise_for_error(err: int, bitpos: int, what: str) -> None:
    """Raise :class:`PayloadError` for a nonzero decoder error code (no-op for 0)."""
    if err != OK:
        raise PayloadError(f"corrupt {what}: {_MESSAGES.get(err, f'error {err}')} (at bit {bitpos})")


def _omega_table(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Omega codeword (right-aligned integer) and length of every ``k < size`` (index 0 unused)."""
    codes = np.zeros(size, dtype=np.int64)
    lens = np.zeros(size, dtype=np.int64)
    for k in range(1, size):
        word, n, j = 0, 1, k  # the terminating 0 bit
        while j > 1:
            b = j.bit_length()
            word |= j << n
            n += b
            j = b - 1
        codes[k], lens[k] = word, n
    return codes, lens


#: values below this use the lookup tables (most gaps and magnitudes of QSGD codes; 64 KiB of tables)
_SMALL = 4096
_OMEGA_CODE, _OMEGA_LEN = _omega_table(_SMALL)


# ---------------------------------------------------------------------------------------------
# compiled primitives (shared with qsgd_stream)
# ---------------------------------------------------------------------------------------------
@_jit
def bitlen(k: int) -> int:
    """Number of binary digits of ``k ≥ 0`` (0 for 0)."""
    n = 0
    while k >= 256:
        k >>= 8
        n += 8
    while k > 0:
        k >>= 1
        n += 1
    return n


@_jit
def omega_len(k: int) -> int:
    """Bits of the omega code of ``k ≥ 1``."""
    if k < _SMALL:
        return _OMEGA_LEN[k]
    total = 1
    while k > 1:
        b = bitlen(k)
        total += b
        k = b - 1
    return total


@_jit
def gamma_len(k: int) -> int:
    """Bits of the gamma code of ``k ≥ 1``."""
    return 2 * bitlen(k) - 1


@_jit
def put_bits(buf: np.ndarray, p: int, value: int, nbits: int) -> None:
    """OR the low ``nbits`` bits of ``value`` into the zeroed ``buf`` at bit ``p``, MSB first."""
    while nbits > 0:
        free = 8 - (p & 7)
        take = free if free < nbits else nbits
        chunk = (value >> (nbits - take)) & ((1 << take) - 1)
        i = p >> 3
        buf[i] = int(buf[i]) | (chunk << (free - take))
        p += take
        nbits -= take


@_jit
def get_bits(buf: np.ndarray, p: int, nbits: int) -> int:
    """``nbits ≤ 63`` bits at bit ``p`` as an unsigned number; the caller checks the bounds."""
    v = 0
    while nbits > 0:
        off = p & 7
        avail = 8 - off
        take = avail if avail < nbits else nbits
        chunk = (int(buf[p >> 3]) >> (avail - take)) & ((1 << take) - 1)
        v = (v << take) | chunk
        p += take
        nbits -= take
    return v


@_jit
def write_omega(buf: np.ndarray, p: int, k: int) -> int:
    """Write the omega code of ``k`` at bit ``p`` of a zeroed buffer; return the next bit position.

    The groups are written backwards from the terminating 0 bit, so no group stack is needed."""
    if k < _SMALL:
        n = _OMEGA_LEN[k]
        put_bits(buf, p, _OMEGA_CODE[k], n)
        return p + n
    end = p + omega_len(k) - 1  # position of the final 0 bit (already zero)
    q = end
    while k > 1:
        b = bitlen(k)
        q -= b
        put_bits(buf, q, k, b)
        k = b - 1
    return end + 1


@_jit
def omega_pieces(k: int):
    """The omega code of ``1 ≤ k < 2**60`` as three pieces ``(code, nbits)`` of at most 31 bits each, in
    wire order (a piece may be empty): for small ``k`` the whole code from the table in the last piece;
    otherwise ``omega(bitlength(k) − 1)`` without its final 0, then the high bits of ``k``, then its low
    29 bits followed by the terminating 0. For writers that keep at most 31 pending bits in a register."""
    if k < _SMALL:
        return 0, 0, 0, 0, _OMEGA_CODE[k], _OMEGA_LEN[k]
    b = bitlen(k)
    lo = b if b < 29 else 29
    return (_OMEGA_CODE[b - 1] >> 1, _OMEGA_LEN[b - 1] - 1, k >> lo, b - lo,
            (k & ((1 << lo) - 1)) << 1, lo + 1)


@_jit
def flush(buf: np.ndarray, o: int, acc: int, nacc: int) -> int:
    """Write the ``nacc`` pending bits of ``acc`` at byte ``o``, left-aligned and zero-padded; returns
    the number of bytes used."""
    while nacc >= 8:
        nacc -= 8
        buf[o] = (acc >> nacc) & 0xFF
        o += 1
    if nacc:
        buf[o] = (acc << (8 - nacc)) & 0xFF
        o += 1
    return o


@_jit
def read_omega(buf: np.ndarray, p: int, end: int):
    """Read one omega code at bit ``p`` (``end`` = bits available): ``(value, next_p, err)``."""
    n = 1
    while True:
        if p >= end:
            return 0, p, ERR_TRUNCATED
        if (int(buf[p >> 3]) >> (7 - (p & 7))) & 1 == 0:
            if n > MAX_VALUE:
                return 0, p, ERR_TOO_LARGE
            return n, p + 1, OK
        w = n + 1
        if w > 63:
            return 0, p, ERR_TOO_LARGE
        if p + w > end:
            return 0, p, ERR_TRUNCATED
        n = get_bits(buf, p, w)
        p += w


@_jit
def write_gamma(buf: np.ndarray, p: int, k: int) -> int:
    b = bitlen(k)
    put_bits(buf, p + b - 1, k, b)
    return p + 2 * b - 1


@_jit
def read_gamma(buf: np.ndarray, p: int, end: int):
    z = 0
    while True:
        if p >= end:
            return 0, p, ERR_TRUNCATED
        if (int(buf[p >> 3]) >> (7 - (p & 7))) & 1 == 1:
            break
        z += 1
        p += 1
        if z > 62:
            return 0, p, ERR_TOO_LARGE
    if p + z + 1 > end:
        return 0, p, ERR_TRUNCATED
    v = get_bits(buf, p, z + 1)
    if v > MAX_VALUE:
        return 0, p, ERR_TOO_LARGE
    return v, p + z + 1, OK


@_jit
def check_tail(buf: np.ndarray, p: int) -> int:
    """After the last code ends at bit ``p``: zero padding in the final byte and no extra bytes."""
    used = (p + 7) >> 3
    if buf.shape[0] > used:
        return ERR_EXTRA
    if p & 7:
        if int(buf[p >> 3]) & ((1 << (8 - (p & 7))) - 1):
            return ERR_PADDING
    return OK


# ---------------------------------------------------------------------------------------------
# array kernels
# ---------------------------------------------------------------------------------------------
@_jit
def _array_len(values: np.ndarray, gamma: bool) -> int:
    total = 0
    for i in range(values.shape[0]):
        total += gamma_len(values[i]) if gamma else omega_len(values[i])
    return total


@_jit
def _array_write(values: np.ndarray, buf: np.ndarray, gamma: bool) -> int:
    p = 0
    for i in range(values.shape[0]):
        if gamma:
            p = write_gamma(buf, p, values[i])
        else:
            p = write_omega(buf, p, values[i])
    return p


@_jit
def _array_read(buf: np.ndarray, out: np.ndarray, gamma: bool):
    end = buf.shape[0] * 8
    p = 0
    for i in range(out.shape[0]):
        if gamma:
            v, p, err = read_gamma(buf, p, end)
        else:
            v, p, err = read_omega(buf, p, end)
        if err != OK:
            return err, p
        out[i] = v
    return check_tail(buf, p), p


def _as_values(values: ArrayLike) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(values).reshape(-1))
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"Elias codes take integers, got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (int(arr.min()) < 1 or int(arr.max()) > MAX_VALUE):
        raise ValueError(f"Elias codes take integers in [1, 2**62], got values in [{arr.min()}, {arr.max()}]")
    return arr


def _as_bytes(buf: ArrayLike | bytes) -> np.ndarray:
    if isinstance(buf, (bytes, bytearray)):
        return np.frombuffer(bytes(buf), dtype=np.uint8)
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8:
            raise PayloadError(f"an Elias stream must be uint8 bytes, got {buf.dtype}")
        return np.ascontiguousarray(buf.detach().cpu().reshape(-1).numpy())
    arr = np.asarray(buf)
    if arr.dtype != np.uint8:
        raise PayloadError(f"an Elias stream must be uint8 bytes, got {arr.dtype}")
    return np.ascontiguousarray(arr.reshape(-1))


def _encode(values: ArrayLike, gamma: bool) -> torch.Tensor:
    arr = _as_values(values)
    nbits = int(_array_len(arr, gamma))
    buf = np.zeros((nbits + 7) // 8, dtype=np.uint8)
    _array_write(arr, buf, gamma)
    return torch.from_numpy(buf)


def _decode(buf: ArrayLike | bytes, count: int, gamma: bool) -> torch.Tensor:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative integer, got {count!r}")
    data = _as_bytes(buf)
    name = "Elias gamma stream" if gamma else "Elias omega stream"
    if count > 8 * data.shape[0]:  # every code takes at least one bit
        raise PayloadError(f"corrupt {name}: truncated: {count} codes cannot fit in {data.shape[0]} bytes")
    out = np.zeros(count, dtype=np.int64)
    err, pos = _array_read(data, out, gamma)
    raise_for_error(int(err), int(pos), name)
    return torch.from_numpy(out)


def omega_nbits(values: ArrayLike) -> int:
    """Exact number of bits of the omega codes of ``values`` (no padding)."""
    return int(_array_len(_as_values(values), False))


def omega_encode(values: ArrayLike) -> torch.Tensor:
    """Omega codes of integers in ``[1, 2**62]``, back to back, as a CPU ``uint8`` tensor.

    >>> omega_encode([1, 2, 3, 4]).tolist()   # 0 100 110 101000 + 3 padding bits
    [77, 64]
    """
    return _encode(values, False)


def omega_decode(buf: ArrayLike | bytes, count: int) -> torch.Tensor:
    """Exactly ``count`` values (int64) from an :func:`omega_encode` stream; raises
    :class:`PayloadError` on truncation, malformed codes, nonzero padding or trailing bytes."""
    return _decode(buf, count, False)


def gamma_nbits(values: ArrayLike) -> int:
    """Exact number of bits of the gamma codes of ``values`` (no padding)."""
    return int(_array_len(_as_values(values), True))


def gamma_encode(values: ArrayLike) -> torch.Tensor:
    """Gamma codes of integers in ``[1, 2**62]``, back to back, as a CPU ``uint8`` tensor."""
    return _encode(values, True)


def gamma_decode(buf: ArrayLike | bytes, count: int) -> torch.Tensor:
    """Exactly ``count`` values (int64) from a :func:`gamma_encode` stream (same checks as omega)."""
    return _decode(buf, count, True)
