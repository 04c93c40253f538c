"""Fixed-width bit fields and base-3 trits, vectorized in torch.

**Bit fields.** ``pack_bits(codes, width)`` stores ``n`` unsigned integers of ``width`` bits
(1 ≤ width ≤ 8) in ``ceil(n·width/8)`` bytes, little-endian: value ``i`` occupies bits
``[i·width, (i+1)·width)`` of the stream, bit 0 being the least significant bit of byte 0. Groups of
eight values form ``width`` whole bytes, so packing is one int64 shift-and-sum over an ``(n/8, 8)`` view
and unpacking its inverse; a partial last group is zero-padded and its unused trailing bytes dropped.

**Trits.** ``pack_trits(t)`` stores values in ``{0, 1, 2}`` five to a byte as ``Σ t_k·3^k`` (at most
242), i.e. ``ceil(n/5)`` bytes — 1.6 bits per value, against 2 for 2-bit fields.

Both unpackers validate their input sizes (and trits their byte range) and raise
:class:`gradq.PayloadError`; neither ever reads outside the buffer.
"""

from __future__ import annotations

import torch

from ..errors import PayloadError

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes", "pack_trits", "unpack_trits", "trit_nbytes"]

_TRIT_POW = (1, 3, 9, 27, 81)


def packed_nbytes(n: int, width: int) -> int:
    """Bytes used by ``n`` fields of ``width`` bits."""
    return (n * width + 7) // 8


def _check_width(width: int) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 8:
        raise ValueError(f"bit width must be an integer in [1, 8], got {width!r}")


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"the number of values must be a non-negative integer, got {n!r}")


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack unsigned integer codes ``0 <= c < 2**width`` into a flat ``uint8`` tensor.

    >>> pack_bits(torch.tensor([1, 2, 3]), 2).tolist()   # 0b11_10_01
    [57]
    """
    _check_width(width)
    c = codes.reshape(-1)
    n = c.numel()
    if width == 8:
        if c.numel() and (int(c.min()) < 0 or int(c.max()) > 255):
            raise ValueError("codes must lie in [0, 255] for width 8")
        return c.to(torch.uint8)
    c64 = c.to(torch.int64)
    if n and (int(c64.min()) < 0 or int(c64.max()) >= (1 << width)):
        raise ValueError(f"codes must lie in [0, {(1 << width) - 1}] for width {width}")
    groups = (n + 7) // 8
    if groups * 8 != n:
        c64 = torch.cat([c64, c64.new_zeros(groups * 8 - n)])
    shifts = torch.arange(8, device=c.device, dtype=torch.int64) * width
    word = (c64.view(groups, 8) << shifts).sum(dim=1)  # up to 56 bits per group
    byte_shift = torch.arange(width, device=c.device, dtype=torch.int64) * 8
    out = ((word.unsqueeze(1) >> byte_shift) & 0xFF).to(torch.uint8).reshape(-1)
    return out[: packed_nbytes(n, width)]


def unpack_bits(data: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``n`` codes (``int64``) from ``ceil(n·width/8)`` bytes."""
    _check_width(width)
    _check_count(n)
    if data.dtype != torch.uint8:
        raise PayloadError(f"packed codes must be uint8, got {data.dtype}")
    data = data.reshape(-1)
    need = packed_nbytes(n, width)
    if data.numel() != need:
        raise PayloadError(f"{n} codes of {width} bits need {need} bytes, got {data.numel()}")
    if width == 8:
        return data.to(torch.int64)
    groups = (n + 7) // 8
    full = groups * width
    b = data.to(torch.int64)
    if full != need:
        b = torch.cat([b, b.new_zeros(full - need)])
    byte_shift = torch.arange(width, device=data.device, dtype=torch.int64) * 8
    word = (b.view(groups, width) << byte_shift).sum(dim=1)
    shifts = torch.arange(8, device=data.device, dtype=torch.int64) * width
    vals = (word.unsqueeze(1) >> shifts) & ((1 << width) - 1)
    return vals.reshape(-1)[:n]


def trit_nbytes(n: int) -> int:
    """Bytes used by ``n`` trits packed five per byte."""
    return (n + 4) // 5


def pack_trits(trits: torch.Tensor) -> torch.Tensor:
    """Pack values in ``{0, 1, 2}`` five per byte (base 3, first value least significant)."""
    t = trits.reshape(-1).to(torch.int16)
    n = t.numel()
    if n and (int(t.min()) < 0 or int(t.max()) > 2):
        raise ValueError("trits must lie in {0, 1, 2}")
    groups = trit_nbytes(n)
    if groups * 5 != n:
        t = torch.cat([t, t.new_zeros(groups * 5 - n)])
    pw = torch.tensor(_TRIT_POW, dtype=torch.int16, device=t.device)
    return (t.view(groups, 5) * pw).sum(dim=1).to(torch.uint8)


def unpack_trits(data: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_trits`: ``n`` values in ``{0, 1, 2}`` (``int64``)."""
    _check_count(n)
    if data.dtype != torch.uint8:
        raise PayloadError(f"packed trits must be uint8, got {data.dtype}")
    data = data.reshape(-1)
    need = trit_nbytes(n)
    if data.numel() != need:
        raise PayloadError(f"{n} trits need {need} bytes, got {data.numel()}")
    if need and int(data.max()) > 242:
        raise PayloadError("corrupt trit stream: byte value above 242 (3**5 - 1)")
    b = data.to(torch.int64).unsqueeze(1)
    pw = torch.tensor(_TRIT_POW, dtype=torch.int64, device=data.device)
    return ((b // pw) % 3).reshape(-1)[:n]
