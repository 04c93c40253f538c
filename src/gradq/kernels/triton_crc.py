"""CRC-32 (zlib's) of device tensors, computed on the device: :func:`gradq.kernels.crc32_field` for the
Triton backend, so that an Elias-coded payload built on a GPU needs no copy of its stream to the host
for its checksum.

zlib's CRC-32 is affine in the message bits. With the register started at 0 and no final inversion
(the linear part ``lin``), ``crc32(M) = lin(M) ^ lin_L(0xFFFFFFFF) ^ 0xFFFFFFFF``, where the middle
term is the initial register carried through the ``L = len(M)`` bytes: a constant of ``L`` alone,
computed on the host. ``lin`` splits over any cut of the message: a word ``w`` (four bytes, little
endian) followed by ``z`` bytes adds ``w·x^(32 + 8z) mod P`` (polynomials over GF(2) in zlib's
reflected bit order, where bit 31 is ``x^0``), and leading zero bytes add nothing. So each program
takes a block of ``4·W`` bytes of the message, front-padded with zeros to whole blocks: every word
multiplied by its power of ``x`` within the block (a table made once), the products XOR-ed, the
block's sum multiplied by ``x`` to the bytes after it (``x`` to the bytes after the tensor, from
the host, times squares of ``x`` to a block's bytes from the same table, chosen by the bits of the
number of blocks after it), and XOR-ed into the result by an atomic XOR, which the order of
the programs cannot change. The result starts as the constant term, so it is the CRC when the last
program is done; several tensors are one message, each launched with the bytes that follow it.

No host read, one launch a tensor; ``tests/kernels/test_triton_kernels.py`` checks it against zlib.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..random import _i32
from .triton_common import TUNING, _jit, _launch, tl, triton

_POLY = 0xEDB88320           # zlib's CRC-32 polynomial, reflected
_ONE = 1 << 31               # x^0 in the reflected order
_BLOCKS_BITS = 32            # squares x^(8·B·2^i) in a device table: up to 2**32 blocks a tensor


def _mulmod_host(a: int, b: int) -> int:
    """``a·b mod P`` (reflected), on the host; the kernels' :func:`_mulmod`."""
    p = 0
    for i in range(32):
        if (a >> (31 - i)) & 1:
            p ^= b
        b = (b >> 1) ^ (_POLY if b & 1 else 0)
    return p


def _squares(first: int, count: int) -> list[int]:
    """``first^(2^i)`` for ``i < count``."""
    out = [first]
    for _ in range(count - 1):
        out.append(_mulmod_host(out[-1], out[-1]))
    return out


_X8_SQUARES = _squares(1 << 23, 64)    # x^(8·2^i): x^8 is bit 23 in the reflected order


def _xpow8_host(nbytes: int) -> int:
    """``x^(8·nbytes) mod P`` (reflected): the register's shift through ``nbytes`` zero bytes."""
    r = _ONE
    for i in range(nbytes.bit_length()):
        if (nbytes >> i) & 1:
            r = _mulmod_host(r, _X8_SQUARES[i])
    return r


def crc_constant(nbytes: int) -> int:
    """The part of zlib's CRC-32 of ``nbytes`` bytes that does not depend on them: the initial
    register ``0xFFFFFFFF`` carried through them, and the final inversion."""
    return _mulmod_host(_xpow8_host(nbytes), 0xFFFFFFFF) ^ 0xFFFFFFFF


_TABLES: dict = {}


def _table(words: int, device: torch.device) -> torch.Tensor:
    """``x^(32·(W − k))`` for the ``W`` words ``k`` of a block, then ``x^(8·B·2^i)`` for
    ``i < 32`` (``B = 4·W`` bytes a block), as int32 on ``device`` (made once per block size and
    device)."""
    key = (words, str(device))
    if key not in _TABLES:
        x32 = _xpow8_host(4)
        pw = [x32]
        for _ in range(words - 1):
            pw.append(_mulmod_host(pw[-1], x32))
        vals = pw[::-1] + _squares(_xpow8_host(4 * words), _BLOCKS_BITS)
        _TABLES[key] = torch.tensor([_i32(v) for v in vals], dtype=torch.int32, device=device)
    return _TABLES[key]


@_jit
def _mulmod(a, b):
    """``a·b mod P`` in zlib's reflected order (bit 31 is ``x^0``), for uint32 ``a`` and ``b`` of
    one shape: ``a``'s bits from ``x^0`` up select ``b·x^i``, ``b`` multiplied by ``x`` each step."""
    poly = tl.full((), 0xEDB88320, tl.uint32)
    p = b ^ b
    for i in tl.static_range(32):
        p = p ^ (b * ((a >> (31 - i)) & 1))
        b = (b >> 1) ^ (poly * (b & 1))
    return p


@triton.jit
def _xor(a, b):
    return a ^ b


@_jit
def _crc32_kernel(data_ptr, out_ptr, tab_ptr, L, pad, tail, W: tl.constexpr, NBITS: tl.constexpr):
    """XOR into ``out`` this block's share of ``lin`` of the ``L`` bytes at ``data_ptr`` (front-padded
    by ``pad`` zero bytes to whole blocks of ``4·W``), where ``tail`` is ``x`` to the bytes of the
    message after them; ``NBITS``: at least the bit length of the number of blocks."""
    blk = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, W)
    first = blk * (4 * W) + 4 * k - pad
    word = tl.zeros([W], dtype=tl.uint32)
    for t in tl.static_range(4):
        at = first + t
        byte = tl.load(data_ptr + at, mask=(at >= 0) & (at < L), other=0)
        word = word | (byte.to(tl.uint32) << (8 * t))
    share = tl.reduce(_mulmod(tl.load(tab_ptr + k).to(tl.uint32, bitcast=True), word), 0, _xor)
    behind = tl.num_programs(0) - 1 - blk          # whole blocks after this one
    shift = tail.to(tl.uint32)
    for i in tl.static_range(NBITS):
        if ((behind >> i) & 1) != 0:
            shift = _mulmod(shift, tl.load(tab_ptr + W + i).to(tl.uint32, bitcast=True))
    tl.atomic_xor(out_ptr, _mulmod(share, shift).to(tl.int32, bitcast=True))


def crc32_field(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """zlib's CRC-32 of the tensors' bytes, in order, as one int32 (the unsigned checksum's bits) on
    the first tensor's device, computed there (module docstring)."""
    device = parts[0].device
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in parts]
    total = sum(t.numel() for t in flat)
    out = torch.full((1,), _i32(crc_constant(total)), dtype=torch.int32, device=device)
    words = TUNING["crc_words"]
    table = _table(words, device)
    after = total
    for t in flat:
        after -= t.numel()
        if t.numel() == 0:
            continue
        nb = -(-t.numel() // (4 * words))
        if nb > 1 << _BLOCKS_BITS:
            raise ValueError(f"crc32_field: a tensor of {t.numel()} bytes is past the device CRC's "
                             f"{1 << _BLOCKS_BITS} blocks")
        # (NBITS rounded up to a multiple of 4: a few compiled variants, not one a length)
        _launch(_crc32_kernel, (nb,), t, out, table, t.numel(), nb * 4 * words - t.numel(),
                _i32(_xpow8_host(after)), W=words, NBITS=max(4, -(-(nb - 1).bit_length() // 4) * 4),
                num_warps=TUNING["crc_warps"])
    return out
