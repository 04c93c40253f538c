"""Counter-based randomness: reproducible, thread-count independent, identical on every device.

Every random number gradq draws is a pure function of ``(key, index)``: a 64-bit seed is turned into a
:class:`RandomStream`, and element ``i`` of a draw is ``hash(key, offset + i)``. Nothing depends on the
order in which threads or GPU blocks run, so a fast kernel (numba, Triton) that evaluates the same hash
produces the same codes bit for bit, and the CPU and GPU paths agree.

The hash is two rounds of the ``lowbias32`` integer mixer (xor-shift-multiply, 32-bit) with the key
folded in between; a uniform float in ``[0, 1)`` takes the top 24 bits, which float32 holds exactly.
The torch path works on int32 tensors and relies on two's-complement wrap-around of int32
multiplication (what every torch backend does); ``hash32_reference`` is the pure-Python oracle the
tests compare it with.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RandomStream", "resolve_seed", "mix32", "hash32_reference", "signed64", "U64"]

M32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9
_C1 = 0x7FEB352D
_C2 = 0x846CA68B


def _i32(c: int) -> int:
    """A 32-bit constant as the signed int32 value with the same bits."""
    c &= M32
    return c - (1 << 32) if c >= (1 << 31) else c


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The ``lowbias32`` mixer on an int32 tensor (wrapping 32-bit arithmetic, logical shifts)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _i32(_C1)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _i32(_C2)
    return x ^ ((x >> 16) & 0xFFFF)


def _mix32_int(x: int) -> int:
    """Pure-Python ``lowbias32`` on a non-negative int (the reference for :func:`mix32`)."""
    x &= M32
    x ^= x >> 16
    x = (x * _C1) & M32
    x ^= x >> 15
    x = (x * _C2) & M32
    return x ^ (x >> 16)


def hash32_reference(seed: int, index: int) -> int:
    """Pure-Python value of element ``index`` of :meth:`RandomStream.bits32` (test oracle)."""
    s = RandomStream(seed)
    x = ((index & M32) * GOLDEN32 + s.k1) & M32
    h = _mix32_int(x)
    return _mix32_int(h ^ s.k2 ^ ((index >> 32) & M32))


U64 = (1 << 64) - 1   # a 64-bit seed's mask


def signed64(seed: int) -> int:
    """A 64-bit seed as the int64 with the same bits (what a payload's ``seed`` field holds)."""
    s = int(seed) & U64
    return s - (1 << 64) if s >= (1 << 63) else s


def resolve_seed(seed: Optional[int] = None, generator: Optional[torch.Generator] = None) -> int:
    """One 63-bit seed from an explicit ``seed``, a ``torch.Generator``, or torch's global RNG.

    With neither given, the seed is drawn from torch's default generator, so ``torch.manual_seed``
    makes a whole program reproducible.
    """
    if seed is not None and generator is not None:
        raise ValueError("pass either seed= or generator=, not both")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        return seed & ((1 << 63) - 1)
    if generator is not None:
        return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    return int(torch.randint(0, 2**62, (1,)).item())


class RandomStream:
    """A stream of counter-based random numbers for one encode call.

    Element ``i`` of the stream is ``mix32(mix32(i·φ + k1) ^ k2 ^ hi32(i))`` with ``k1, k2`` derived
    from the seed (``φ`` the 32-bit golden ratio). Successive draws use consecutive counter ranges, so
    two draws never share numbers; :meth:`child` gives an independent stream.
    """

    def __init__(self, seed: int):
        self.seed = int(seed) & ((1 << 64) - 1)
        lo, hi = self.seed & M32, self.seed >> 32
        self.k1 = _mix32_int(lo ^ _mix32_int(hi ^ GOLDEN32))
        self.k2 = _mix32_int(self.k1 ^ hi ^ 0x85EBCA6B)
        self.offset = 0

    def child(self, tag: int) -> "RandomStream":
        """An independent stream derived from this one's seed and ``tag``."""
        mixed = (self.seed * 0x9E3779B97F4A7C15 + (tag + 1) * 0xC2B2AE3D27D4EB4F) & ((1 << 64) - 1)
        return RandomStream(mixed)

    def bits32(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``n`` uniformly distributed 32-bit values as an int32 tensor (bits reinterpreted), advancing
        the stream."""
        start, self.offset = self.offset, self.offset + n
        if start + n <= (1 << 31):
            lo = torch.arange(start, start + n, dtype=torch.int32, device=device)
            hi = None
        else:
            idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
            low = idx & M32
            lo = torch.where(low >= (1 << 31), low - (1 << 32), low).to(torch.int32)
            hi = (idx >> 32).to(torch.int32)
        x = lo * _i32(GOLDEN32) + _i32(self.k1)
        h = mix32(x) ^ _i32(self.k2)
        if hi is not None:
            h = h ^ hi
        return mix32(h)

    def uniform(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``n`` float32 values uniform on ``[0, 1)`` with 24 random bits each, advancing the stream."""
        return ((self.bits32(n, device) >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / 16777216.0)
