"""The plain-torch reference of the schemes with per-bucket levels, ORQ and Linear: their level
construction (a sort per bucket, then Linear's order statistics or ORQ's rounds in fixed point), the
stochastic rounding onto a bucket's levels and its decode.

Part of :mod:`gradq.kernels.reference`, which exports every public name here: the kernel API below
takes and returns exactly what the fast backends' functions of the same names do.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..codecs.bitpack import pack_bits, unpack_bits
from ..random import RandomStream
from .checks import refuse_invalid
from .reference import RngLike, _into, _stream, bucket_chunks, bucket_index, num_buckets

__all__ = ["orq_levels", "linear_levels", "round_to_levels", "check_level_count", "linear_positions", "sort_rows",
           "orq_shift", "orq_fixed", "levels_encode", "levels_decode", "orq_encode", "linear_encode"]


# == the levels ====================================================================================
def _check_level_matrix(mat: torch.Tensor, L: int) -> None:
    if mat.dim() != 2 or mat.shape[1] == 0:
        raise ValueError(f"expected a (buckets, d) matrix with d >= 1, got shape {tuple(mat.shape)}")
    check_level_count(L)


def check_level_count(L: int) -> None:
    """ORQ's and Linear's level counts are ``2^k + 1``: refuse any other."""
    if L < 2 or (L - 1) & (L - 2):
        raise ValueError(f"L must be 2^k + 1 (3, 5, 9, 17, ...), got {L}")


def linear_positions(d: int, L: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Linear-L's sorted positions in a row of ``d`` values: ``round(i·(d − 1)/(L − 1))`` for
    ``i = 0 … L−1`` (int64; float64 arithmetic, ties to even). Every backend takes them from here."""
    pos = torch.round(torch.arange(L, dtype=torch.float64, device=device) * ((d - 1) / (L - 1)))
    return pos.to(torch.int64)


def sort_rows(mat: torch.Tensor) -> torch.Tensor:
    """Every row of ``mat`` as float32, sorted ascending with ``−0.0`` before ``+0.0``.

    ``torch.sort`` leaves the two zeros, which compare equal, in whatever order its algorithm does,
    and the CPU's and CUDA's algorithms differ; a level that is a zero would then have another sign
    on each device. The rows are sorted as order-preserving integer keys instead (the bits of a
    negative float with its magnitude bits flipped), which every device and backend orders alike."""
    bits = mat.to(torch.float32).contiguous().view(torch.int32)
    keys = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).sort(dim=1).values
    return (keys ^ ((keys >> 31) & 0x7FFFFFFF)).view(torch.float32)


def orq_shift(mat: torch.Tensor) -> torch.Tensor:
    """ORQ's fixed-point shift per row of ``mat`` (``(nb, d)`` float32): ``sh = 61 − E − ⌈log2 d⌉``,
    where ``2^E`` bounds the row's largest magnitude (``E = max(e, 1) − 126`` from the float32 exponent
    field ``e`` of ``max|g|``). Every ``⌊g·2^sh⌋`` then has magnitude ``< 2^61/2^⌈log2 d⌉``, so the
    integer sums of :func:`orq_levels` cannot overflow int64. int64, one per row."""
    d = mat.shape[1]
    top = mat.to(torch.float32).abs().amax(dim=1).contiguous().view(torch.int32)
    e = ((top >> 23) & 0xFF).to(torch.int64).clamp_(min=1) - 126
    return 61 - e - (d - 1).bit_length()


def orq_fixed(v: torch.Tensor, sh: torch.Tensor) -> torch.Tensor:
    """``⌊v·2^sh⌋`` as int64 (``v`` float32, ``sh`` broadcastable int64): exact, because a float32
    times a power of two is exact in float64 (the power is built from its bits, never rounded)."""
    p2 = ((sh + 1023) << 52).view(torch.float64)
    return torch.floor(v.to(torch.float64) * p2).to(torch.int64)


def orq_levels(mat: torch.Tensor, L: int) -> torch.Tensor:
    """ORQ's ``L`` levels for each row of ``mat`` (a ``(nb, d)`` float matrix): an ``(nb, L)`` float32
    matrix with sorted rows, first column the row minimum and last the maximum (the algorithm is in
    :mod:`gradq.quantizers.orq`'s docstring).

    The split of an interval ``[a, b]`` holding the segment's ``n`` values is the first sorted value
    strictly inside ``(a, b)`` where the slope ``h = Σ_{left}(g − a) − Σ_{right}(b − g)`` (left: the
    segment's first ``k`` values) is ``≥ 0``. Since every value is in exactly one of the two sums,
    ``h = k·(b − a) − Σ_{segment}(b − g)``: the split is the value of rank ``k = ⌈R/(b − a)⌉`` with
    ``R = Σ(b − g)``, moved up past the values equal to ``a``. ``R`` and ``b − a`` are computed
    exactly, in integers: every value as ``⌊g·2^sh⌋`` (:func:`orq_shift`, :func:`orq_fixed`). Integer
    sums do not depend on their order, so every backend (a parallel GPU reduction too) finds the same
    rank, and the level is then a value of the bucket, bit for bit."""
    _check_level_matrix(mat, L)
    nb, d = mat.shape
    srt = sort_rows(mat)
    sh = orq_shift(srt).unsqueeze(1)
    fix = orq_fixed(srt, sh)
    lv = torch.stack([srt[:, 0], srt[:, -1]], dim=1)
    for _ in range(int(round(math.log2(L - 1)))):
        m = lv.shape[1]
        # interval of every sorted value: [lv[j], lv[j+1]); the maximum goes to the last interval
        ids = (torch.searchsorted(lv, srt, right=True) - 1).clamp_(0, m - 2)
        lo, hi = lv[:, :-1], lv[:, 1:]
        count = torch.zeros(nb, m - 1, dtype=torch.int64, device=mat.device)
        count.scatter_add_(1, ids, torch.ones_like(ids))
        total = torch.zeros_like(count).scatter_add_(1, ids, fix)
        at_lo = torch.zeros_like(count).scatter_add_(1, ids, (srt == lo.gather(1, ids)).to(torch.int64))
        at_hi = torch.zeros_like(count).scatter_add_(1, ids, (srt == hi.gather(1, ids)).to(torch.int64))
        a_fix, b_fix = orq_fixed(lo, sh), orq_fixed(hi, sh)
        gap = b_fix - a_fix                           # >= 0; every value's fixed point lies in [a_fix, b_fix]
        need = count * b_fix - total                  # R = Σ (b − g) over the segment, >= 0
        safe = gap.clamp(min=1)
        k = torch.where(gap > 0, need // safe + (need % safe > 0).to(torch.int64), torch.ones_like(need))
        rank = torch.maximum(k.clamp(min=1), at_lo + 1)
        found = rank <= count - at_hi
        first = count.cumsum(dim=1) - count
        c = srt.gather(1, (first + rank - 1).clamp(0, d - 1))
        # none: halves first (no overflow), then clamp, since with equal odd denormal ends 0.5a + 0.5a
        # can leave [a, b]; a tie keeps the midpoint (torch.maximum/minimum break ties on ±0 by device)
        mid = 0.5 * lo + 0.5 * hi
        mid = torch.where(mid > hi, hi, torch.where(mid < lo, lo, mid))
        c = torch.where(found, c, mid)
        lv = torch.cat([torch.stack([lv[:, :-1], c], dim=2).reshape(nb, -1), lv[:, -1:]], dim=1)
    return lv


def linear_levels(mat: torch.Tensor, L: int) -> torch.Tensor:
    """Linear-L's levels per row: ``sorted[round(i·(d − 1)/(L − 1))]`` for ``i = 0 … L−1``."""
    _check_level_matrix(mat, L)
    d = mat.shape[1]
    return sort_rows(mat)[:, linear_positions(d, L, mat.device)]


def round_to_levels(mat: torch.Tensor, levels: torch.Tensor, rng: RandomStream) -> torch.Tensor:
    """Unbiased stochastic rounding of every entry of ``mat`` (``(nb, d)``) onto its row of sorted
    ``levels`` (``(nb, L)``, covering the row's range); returns int64 level indices in ``[0, L−1]``."""
    L = levels.shape[1]
    x = mat.to(torch.float32).contiguous()
    hi = torch.searchsorted(levels.contiguous(), x).clamp_(max=L - 1)
    lo = (hi - 1).clamp_(min=0)
    l_hi = levels.gather(1, hi)
    l_lo = levels.gather(1, lo)
    gap = l_hi - l_lo
    p = torch.where(gap > 0, (x - l_lo) / torch.where(gap > 0, gap, torch.ones_like(gap)),
                    torch.zeros_like(gap))
    u = rng.uniform(x.numel(), x.device).view(x.shape)
    return torch.where(u < p, hi, lo)


# == the kernel API ===============================================================================
def _level_rows(levels: torch.Tensor, n: int, bucket: Optional[int]) -> torch.Tensor:
    nb = num_buckets(n, bucket)
    if levels.dim() != 2 or levels.shape[0] != nb:
        raise ValueError(f"levels must be a ({nb}, L) float32 tensor, one row per bucket")
    return levels.to(torch.float32)


def levels_encode(x: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], width: int, rng: RngLike,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Unbiased stochastic rounding of every element onto its bucket's sorted row of ``levels``,
    packed as ``width``-bit indices; the stream advances by ``n``."""
    v = x.detach().reshape(-1)
    lv = _level_rows(levels, v.numel(), bucket).to(v.device)
    if lv.shape[1] > (1 << width):
        raise ValueError(f"{lv.shape[1]} level indices do not fit in {width} bits")
    st = _stream(rng)
    idx, row = [], 0
    for mat in bucket_chunks(v, bucket):
        idx.append(round_to_levels(mat, lv[row:row + mat.shape[0]], st).reshape(-1))
        row += mat.shape[0]
    codes = torch.cat(idx) if idx else v.new_zeros(0, dtype=torch.int64)
    return _into(pack_bits(codes, width), out)


def levels_decode(packed: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], width: int, n: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``levels[b, index]`` for ``n`` packed indices; an index ``≥ L`` raises PayloadError."""
    lv = _level_rows(levels, n, bucket)
    L = lv.shape[1]
    codes = unpack_bits(packed, width, n).to(device=lv.device, dtype=torch.int64)
    refuse_invalid((codes >= L).sum(), lambda _: f"level index out of range [0, {L - 1}]",
                   f"level indices above {L - 1}")
    codes = torch.where(codes >= L, torch.zeros_like(codes), codes)   # (a deferred check: the first level)
    return _into(lv.reshape(-1)[bucket_index(n, bucket, lv.device) * L + codes], out)


def _level_encode(x: torch.Tensor, L: int, bucket: Optional[int], width: int, rng: RngLike,
                  make_levels, out: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    v = x.detach().reshape(-1).to(torch.float32)
    if L > (1 << width):
        raise ValueError(f"{L} level indices do not fit in {width} bits")
    st = _stream(rng)
    codes, levels = [], []
    for mat in bucket_chunks(v, bucket):
        lv = make_levels(mat, L)
        codes.append(round_to_levels(mat, lv, st).reshape(-1))
        levels.append(lv)
    if not codes:
        return _into(pack_bits(v.new_zeros(0, dtype=torch.int64), width), out), v.new_zeros(0, L)
    return _into(pack_bits(torch.cat(codes), width), out), torch.cat(levels)


def orq_encode(x: torch.Tensor, L: int, bucket: Optional[int], width: int, rng: RngLike,
               out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ORQ-L encode of a float32 vector: ``(packed width-bit level indices, (nb, L) levels)``."""
    return _level_encode(x, L, bucket, width, rng, orq_levels, out)


def linear_encode(x: torch.Tensor, L: int, bucket: Optional[int], width: int, rng: RngLike,
                  out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear-L encode of a float32 vector: ``(packed width-bit level indices, (nb, L) levels)``."""
    return _level_encode(x, L, bucket, width, rng, linear_levels, out)
