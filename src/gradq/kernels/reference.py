"""The plain-torch backend of :mod:`gradq.kernels`: the specification every fast backend reproduces.

Each primitive of :mod:`gradq.kernels` is written here once in eager torch. It runs on any device.
The numba kernels (CPU) and the Triton kernels (GPU, or CPU under Triton's interpreter) give the same
bytes and floats for the same seed, and the tests compare them with these functions. The path is
used wherever no fast backend applies, or when ``GRADQ_KERNELS=torch`` (or ``0``) asks for it.

The first half holds the math the quantizer families share (bucket views and norms, stochastic
rounding, uniform codes, level construction and rounding, pairwise sums, BinGrad's statistics); the
second half the kernel API, whose functions take and return exactly what the other backends'
functions of the same names do (packed bytes, per-bucket scales or levels).

Arithmetic (float32 throughout unless named): uniform codes ``r = s / scale`` (torch evaluates it as
``float32(1/scale)·s``; a zero scale reads as 1), ``a = |x|·r`` (``0·inf`` from a denormal scale is
0), ``m = min(floor(a + u), s)``; decode ``float32(c)·(scale/s)``; a mean of M decodes adds them in
order, then divides by M. Level rounding: ``hi = searchsorted(levels, x)``, ``p = (x − l_lo)/(l_hi −
l_lo)``, index ``hi if u < p else lo``. The references allocate as eager torch does (a few
input-sized temporaries); the fast kernels do not.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch

from ..codecs.bitpack import pack_bits, pack_trits, unpack_bits, unpack_trits
from ..errors import PayloadError
from ..random import RandomStream

__all__ = [
    # shared math
    "num_buckets", "bucket_view", "bucket_chunks", "bucket_index", "bucket_norms", "FLOAT32_MAX", "saturate_norm",
    "stochastic_round",
    "uniform_codes", "dequantize_uniform", "population_std", "clip_by_std", "orq_levels", "linear_levels",
    "round_to_levels", "check_level_count", "linear_positions", "SUM_BLOCK", "pairwise_row_sum", "masked_mean", "bingrad_pb_threshold",
    "bingrad_b_levels",
    # the kernel API
    "maxabs_scales", "l2_scales", "uniform_encode", "maxabs_uniform_encode", "l2_uniform_encode", "uniform_encode_trits", "uniform_decode",
    "uniform_decode_trits", "uniform_decode_mean", "uniform_decode_trits_mean", "terngrad_stats",
    "levels_encode", "levels_decode", "orq_encode", "linear_encode", "threshold_encode", "sign_encode",
    "bit_decode", "sign_scale_encode", "onebit_encode", "bingrad_b_encode", "bingrad_pb_encode",
    "multiscale_indices", "multiscale_encode", "multiscale_decode", "multiscale_dequantize",
    "sign_scale_stats", "onebit_stats", "bingrad_b_stats", "one_bit_stats", "random_subset",
]

RngLike = Union[RandomStream, int]

#: length of the runs that :func:`pairwise_row_sum` folds before folding the run sums
SUM_BLOCK = 4096


# == shared math ==================================================================================
def num_buckets(n: int, bucket: Optional[int]) -> int:
    """Number of buckets of size ``bucket`` (``None`` = one bucket for the whole tensor)."""
    if n == 0:
        return 0
    if bucket is None:
        return 1
    return (n + bucket - 1) // bucket


def bucket_view(v: torch.Tensor, bucket: Optional[int]) -> torch.Tensor:
    """``v`` as an ``(num_buckets, d)`` matrix, the last bucket zero-padded.

    Zero padding is harmless for norms and for any rounding where a zero stays a zero; schemes that
    look at the bucket's minimum, quantiles or counts use :func:`bucket_chunks` instead."""
    n = v.numel()
    d = n if bucket is None else bucket
    nb = num_buckets(n, bucket)
    if nb == 0:
        return v.new_zeros(0, max(d, 1))
    pad = nb * d - n
    if pad:
        v = torch.cat([v, v.new_zeros(pad)])
    return v.view(nb, d)


def bucket_chunks(v: torch.Tensor, bucket: Optional[int]) -> Iterator[torch.Tensor]:
    """Yield at most two matrices covering ``v`` in order, without padding: the full buckets as a
    ``(k, bucket)`` matrix and the last partial bucket as a ``(1, r)`` matrix."""
    n = v.numel()
    if n == 0:
        return
    if bucket is None or bucket >= n:
        yield v.view(1, n)
        return
    full = (n // bucket) * bucket
    if full:
        yield v[:full].view(-1, bucket)
    if full < n:
        yield v[full:].view(1, n - full)


def bucket_index(n: int, bucket: Optional[int], device: torch.device) -> torch.Tensor:
    """Bucket number (int64) of every coordinate ``0 … n−1``."""
    if bucket is None:
        return torch.zeros(n, dtype=torch.int64, device=device)
    return torch.arange(n, dtype=torch.int64, device=device) // bucket


def bucket_norms(mat: torch.Tensor, norm: str) -> torch.Tensor:
    """Per-row L2 (``"l2"``) or max-abs (``"max"``) norm of a bucket matrix.

    The L2 norm is ``float32(sqrt(Σ float64(x)²))``: summed and rooted in float64, rounded once.
    Any order of the float64 sum then gives the same float32 result, except when the exact norm lies
    within float64 rounding (~1e-13 relative) of a float32 rounding tie. So every backend and
    device agrees on it, which a float32 reduction (whose result depends on its order) would not.

    The norm of finite float32 values can exceed the largest float32 (``FLOAT32_MAX``), where the
    rounding would give ``inf`` and every decode ``inf·0 = NaN``. A float32 norm saturates at
    ``FLOAT32_MAX`` instead (:func:`saturate_norm`): still at least every ``|x|``, so the rounding
    stays unbiased and the decode finite. A non-finite input keeps its non-finite norm."""
    if mat.numel() == 0:
        return mat.new_zeros(mat.shape[0])
    if norm == "l2":
        root = mat.to(torch.float64).square().sum(dim=1).sqrt()
        return (saturate_norm(root) if mat.dtype == torch.float32 else root).to(mat.dtype)
    return mat.abs().amax(dim=1)


#: the largest finite float32, as a Python float (exact in float64)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def saturate_norm(root: torch.Tensor) -> torch.Tensor:
    """Float64 norms ``root`` with every finite value above ``FLOAT32_MAX`` set to it (so that the
    float32 rounding gives ``FLOAT32_MAX``, not ``inf``); ``inf`` and NaN are kept."""
    return torch.where(torch.isfinite(root), root.clamp(max=FLOAT32_MAX), root)


def stochastic_round(a: torch.Tensor, rng: RandomStream) -> torch.Tensor:
    """Round non-negative ``a`` to ``floor(a)`` or ``floor(a)+1`` with probability of the latter
    ``a - floor(a)`` (unbiased): ``floor(a + u)`` with ``u`` uniform on [0, 1)."""
    u = rng.uniform(a.numel(), a.device).view(a.shape)
    return torch.floor(a + u)


def uniform_codes(mat: torch.Tensor, scales: torch.Tensor, s: int, rng: RandomStream) -> torch.Tensor:
    """Signed integer codes in ``[-s, s]`` of a bucket matrix under per-row ``scales``:
    ``sgn(v)·round_stochastic(|v|·s/scale)``; a zero scale gives zero codes."""
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    # a scale below s/3.4e38 makes s/scale overflow to inf; 0·inf must stay 0 (a zero stays a zero)
    a = torch.nan_to_num(mat.abs() * (s / safe), nan=0.0)
    mag = stochastic_round(a, rng).clamp_(max=s).to(torch.int32)
    # the sign as the kernels take it (x < 0): a NaN gets code 0 instead of an undefined cast, so an
    # encode runs harmlessly on non-finite data and its NaN scales reveal it afterwards
    return torch.where(mat < 0, -mag, mag)


def dequantize_uniform(codes: torch.Tensor, scales: torch.Tensor, s: float, n: int,
                       bucket: Optional[int]) -> torch.Tensor:
    """``scale·c/s`` per bucket for flat ``codes`` of length ``n`` (codes may be sums over workers)."""
    mat = bucket_view(codes.to(torch.float32), bucket)
    return (mat * (scales.to(torch.float32) / s).unsqueeze(1)).reshape(-1)[:n]


def population_std(v: torch.Tensor) -> torch.Tensor:
    """σ of a flat float32 vector, computed in float64 (two passes) and rounded once to float32.

    Float64 makes σ the correctly rounded value on any data (a float32 pass can be an ulp off when
    ``|mean|/σ`` is large), so the fast kernels, which sum in float64 in their own fixed order, agree
    with it bit for bit except when the exact σ lies within float64 rounding (~1e-13 relative) of a
    float32 rounding tie. NaN for an empty vector."""
    v64 = v.reshape(-1).to(torch.float64)
    return torch.sqrt(((v64 - v64.mean()) ** 2).mean()).to(torch.float32)


def clip_by_std(v: torch.Tensor, c: Optional[float]) -> torch.Tensor:
    """TernGrad's Eq. 21 on a flat float32 vector: ``clamp(v, −c·σ, c·σ)`` with ``σ`` the population
    standard deviation of ``v``. ``c=None``, an empty or one-element vector, or ``σ = 0`` return ``v``
    unchanged."""
    if c is None or v.numel() <= 1:
        return v
    sigma = population_std(v)
    bound = c * sigma
    # sigma == 0 (constant vector): no clipping (the TernGrad module docstring says why)
    bound = torch.where(sigma > 0, bound, torch.full_like(bound, float("inf")))
    return torch.clamp(v, -bound, bound)


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


def _fold(mat: torch.Tensor) -> torch.Tensor:
    """Fold the columns in half until one is left: column ``i + h`` is added to column ``i``
    (``h = ⌊w/2⌋``); an odd last column moves to position ``h``."""
    while mat.shape[1] > 1:
        w = mat.shape[1]
        h = w // 2
        s = mat[:, :h] + mat[:, h:2 * h]
        mat = torch.cat([s, mat[:, 2 * h:]], dim=1) if w % 2 else s
    return mat[:, 0]


def pairwise_row_sum(mat: torch.Tensor) -> torch.Tensor:
    """Per-row sum of ``mat`` (``(k, d)``) in a fixed pairwise order: each run of ``SUM_BLOCK``
    (4096) consecutive entries (the last run may be shorter) is folded in half repeatedly (entry
    ``i + h`` added to entry ``i``, an odd last entry kept), then the run sums are folded the same way.

    Every float64 bucket sum of the one-bit schemes goes through here, so the order is part of the
    result. It replaces ``torch.sum``, whose order depends on the CPU's vector width and, for a
    single long row, on the thread count, so no kernel could reproduce it; this order the kernels
    reproduce bit for bit. It is as accurate (error ``O(log d)`` ulps) and gives the same bits on
    every device and thread count (it is made of elementwise additions only)."""
    if mat.dim() != 2:
        raise ValueError(f"expected a (rows, d) matrix, got shape {tuple(mat.shape)}")
    k, d = mat.shape
    if d == 0:
        return mat.new_zeros(k)
    if d <= SUM_BLOCK:
        return _fold(mat)
    q, r = divmod(d, SUM_BLOCK)
    parts = [_fold(mat[:, :q * SUM_BLOCK].reshape(k * q, SUM_BLOCK)).view(k, q)]
    if r:
        parts.append(_fold(mat[:, q * SUM_BLOCK:]).unsqueeze(1))
    return _fold(torch.cat(parts, dim=1))


def masked_mean(mat64: torch.Tensor, mask: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """Per-row mean of the entries of ``mat64`` where ``mask``; ``empty`` where no entry is selected.
    The sum runs over the whole row (``+0.0`` where the mask is off) in :func:`pairwise_row_sum`'s order."""
    cnt = mask.sum(dim=1)
    tot = pairwise_row_sum(torch.where(mask, mat64, torch.zeros_like(mat64)))
    return torch.where(cnt > 0, tot / cnt.clamp(min=1), empty)


def bingrad_pb_threshold(mat: torch.Tensor) -> torch.Tensor:
    """BinGrad-pb's optimal ``b`` per row of ``mat`` (``(nb, d)``), as float32 (the derivation is in
    :mod:`gradq.quantizers.binary`'s docstring)."""
    if mat.dim() != 2 or mat.shape[1] == 0:
        raise ValueError(f"expected a (buckets, d) matrix with d >= 1, got shape {tuple(mat.shape)}")
    d = mat.shape[1]
    a = mat.to(torch.float32).abs().sort(dim=1).values.to(torch.float64)   # a_1 .. a_d
    tail = a.flip(1).cumsum(dim=1).flip(1)                                  # tail[:, k] = S_k, k < d
    # first k in 0..d with d*a_{k+1} >= S_k (k = d always qualifies); the test is monotone in k
    k = (d * a < tail).sum(dim=1, keepdim=True)
    s_k = torch.cat([tail, torch.zeros_like(tail[:, :1])], dim=1).gather(1, k)
    a_k = torch.cat([torch.zeros_like(a[:, :1]), a], dim=1).gather(1, k)
    return torch.maximum(s_k / d, a_k).squeeze(1).to(torch.float32)


def bingrad_b_levels(mat: torch.Tensor, iters: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BinGrad-b per row of ``mat``: ``(t, b0, b1)`` after ``iters`` Lloyd iterations (float64);
    a value ``g`` maps to ``b1`` if ``g ≥ t`` else ``b0``."""
    m64 = mat.to(torch.float64)
    t = pairwise_row_sum(m64) / mat.shape[1]
    b0 = b1 = t
    for step in range(iters + 1):
        if step:
            t = 0.5 * (b0 + b1)
        upper = m64 >= t.unsqueeze(1)
        b0 = masked_mean(m64, ~upper, t)
        b1 = masked_mean(m64, upper, t)
    return t, b0, b1


# == the kernel API ===============================================================================
def _stream(rng: RngLike) -> RandomStream:
    return rng if isinstance(rng, RandomStream) else RandomStream(rng)


def _clipped(x: torch.Tensor, clip: Optional[float]) -> torch.Tensor:
    v = x.detach().reshape(-1)
    if clip is None:
        return v
    c = float(clip) + 0.0   # (a clip of −0.0 is 0.0: no scale or bound of −0.0)
    return torch.clamp(v, -c, c)


def _into(res: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return res
    out.view(-1).copy_(res.reshape(-1))
    return out


def maxabs_scales(x: torch.Tensor, bucket: Optional[int], clip: Optional[float] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-bucket ``max |x|`` (of ``clamp(x, −clip, clip)`` with ``clip``), float32. A bucket that
    holds a NaN gets the clip bound (``inf`` without one), as the compiled kernels' integer maximum
    over ``|x|`` clamped to the bound gives it; so every backend agrees on non-finite input too."""
    m = bucket_norms(bucket_view(_clipped(x, clip), bucket), "max").to(torch.float32)
    bound = math.inf if clip is None else float(clip) + 0.0
    return _into(torch.where(torch.isnan(m), torch.full_like(m, bound), m), out)


def l2_scales(x: torch.Tensor, bucket: Optional[int], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-bucket L2 norm (float32, see :func:`bucket_norms`)."""
    return _into(bucket_norms(bucket_view(x.detach().reshape(-1), bucket), "l2").to(torch.float32), out)


def _codes(x: torch.Tensor, scales: torch.Tensor, s: int, bucket: Optional[int], rng: RngLike,
           clip: Optional[float]) -> torch.Tensor:
    v = _clipped(x, clip)
    return uniform_codes(bucket_view(v, bucket), scales.to(v.device), s, _stream(rng)).reshape(-1)[: v.numel()]


def uniform_encode(x: torch.Tensor, scales: torch.Tensor, s: int, bucket: Optional[int], width: int,
                   rng: RngLike, clip: Optional[float] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``pack_bits(uniform_codes(bucket_view(x), scales, s, rng) + s, width)``."""
    return _into(pack_bits(_codes(x, scales, s, bucket, rng, clip) + s, width), out)


def maxabs_uniform_encode(x: torch.Tensor, s: int, bucket: Optional[int], width: int, rng: RngLike,
                          clip: Optional[float] = None,
                          out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`maxabs_scales`, then :func:`uniform_encode` under them; ``(packed, scales)``."""
    scales = maxabs_scales(x, bucket, clip)
    return uniform_encode(x, scales, s, bucket, width, rng, clip, out), scales


def l2_uniform_encode(x: torch.Tensor, s: int, bucket: Optional[int], width: int, rng: RngLike,
                      out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`l2_scales`, then :func:`uniform_encode` under them; ``(packed, scales)``."""
    scales = l2_scales(x, bucket)
    return uniform_encode(x, scales, s, bucket, width, rng, None, out), scales


def uniform_encode_trits(x: torch.Tensor, scales: torch.Tensor, bucket: Optional[int], rng: RngLike,
                         clip: Optional[float] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``pack_trits(uniform_codes(..., s=1) + 1)``."""
    return _into(pack_trits(_codes(x, scales, 1, bucket, rng, clip) + 1), out)


def _fields(packed: torch.Tensor, width: int, n: int, max_field: Optional[int]) -> torch.Tensor:
    if width == 0:
        return unpack_trits(packed, n)
    fields = unpack_bits(packed, width, n)
    if max_field is not None and fields.numel():
        bad = int((fields > max_field).sum())
        if bad:
            raise PayloadError(f"corrupt codes: {bad} fields above {max_field}")
    return fields


def uniform_decode_mean(packed: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], s: int,
                        bucket: Optional[int], width: int, n: int, max_field: Optional[int] = None,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each payload's ``float32(field − s)·(scale_b/s)``, added in list order, divided by their count
    (``width=0``: trits)."""
    if not packed:
        raise ValueError("need at least one payload")
    if len(scales) != len(packed):
        raise ValueError(f"{len(packed)} packed payloads but {len(scales)} scale vectors")
    total: Optional[torch.Tensor] = None
    for p, sc in zip(packed, scales):
        d = dequantize_uniform(_fields(p, width, n, max_field).to(sc.device) - s, sc, s, n, bucket)
        total = d if total is None else total + d
    assert total is not None
    if len(packed) > 1:
        total = total / len(packed)
    return _into(total, out)


def uniform_decode(packed: torch.Tensor, scales: torch.Tensor, s: int, bucket: Optional[int], width: int,
                   n: int, max_field: Optional[int] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``float32(field − s)·(scale_b/s)`` for ``n`` packed ``width``-bit fields."""
    return uniform_decode_mean([packed], [scales], s, bucket, width, n, max_field, out)


def uniform_decode_trits(packed: torch.Tensor, scales: torch.Tensor, bucket: Optional[int], n: int,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(trit − 1)·scale_b``."""
    return uniform_decode_mean([packed], [scales], 1, bucket, 0, n, None, out)


def uniform_decode_trits_mean(packed: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                              bucket: Optional[int], n: int,
                              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`uniform_decode_mean` for trits."""
    return uniform_decode_mean(packed, scales, 1, bucket, 0, n, None, out)


def terngrad_stats(x: torch.Tensor, clip: Optional[float], bucket: Optional[int]
                   ) -> tuple[Optional[float], torch.Tensor]:
    """TernGrad's ``(bound, scales)``: ``bound = float32(clip)·σ`` (None when ``clip`` is None,
    ``n ≤ 1`` or ``σ = 0``: no clipping) and the per-bucket max-abs of the clipped vector."""
    v = x.detach().reshape(-1)
    if clip is None or v.numel() <= 1:
        return None, maxabs_scales(v, bucket)
    sigma = float(population_std(v))
    bound = float(np.float32(clip) * np.float32(sigma)) if sigma > 0 else None
    return bound, maxabs_scales(v, bucket, clip=bound)


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
    if bool((codes >= L).any()):
        raise PayloadError(f"level index out of range [0, {L - 1}]")
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


def threshold_encode(x: torch.Tensor, thresholds: torch.Tensor, bucket: Optional[int],
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bits ``float64(x) >= thresholds[b]`` (float64, one per bucket) packed 8 per byte."""
    v = x.detach().reshape(-1)
    n = v.numel()
    t = thresholds.reshape(-1).to(device=v.device, dtype=torch.float64)
    if t.numel() != num_buckets(n, bucket):
        raise ValueError(f"expected {num_buckets(n, bucket)} thresholds, got {t.numel()}")
    bits = v.to(torch.float64) >= t[bucket_index(n, bucket, v.device)]
    return _into(pack_bits(bits.to(torch.int64), 1), out)


def sign_encode(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bits ``x >= 0`` (−0.0 gives 1) packed 8 per byte: the code of SignSGD and 1BitSGD."""
    return _into(pack_bits((x.detach().reshape(-1) >= 0).to(torch.int64), 1), out)


def bit_decode(packed: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], n: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One bit per element: ``levels`` ``(nb, 2)`` gives ``levels[b, bit]``; ``(nb,)`` or ``(nb, 1)``
    gives ``levels[b]·float32(2·bit − 1)``."""
    lv = levels.to(torch.float32)
    bits = unpack_bits(packed, 1, n).to(device=lv.device, dtype=torch.int64)
    bidx = bucket_index(n, bucket, lv.device)
    if lv.dim() == 2 and lv.shape[1] == 2:
        return _into(lv.reshape(-1)[bidx * 2 + bits], out)
    return _into(lv.reshape(-1)[bidx] * (2 * bits - 1).to(torch.float32), out)


def sign_scale_stats(mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled SignSGD's per-row ``(float64 threshold 0, mean |x|)`` of a bucket matrix."""
    m64 = mat.to(torch.float64)
    return m64.new_zeros(mat.shape[0]), pairwise_row_sum(m64.abs()) / mat.shape[1]


def onebit_stats(mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1BitSGD's per-row ``(float64 threshold 0, (mean{x < 0}, mean{x ≥ 0}))``."""
    m64 = mat.to(torch.float64)
    up = mat >= 0
    zero = m64.new_zeros(mat.shape[0])
    return zero, torch.stack([masked_mean(m64, ~up, zero), masked_mean(m64, up, zero)], dim=1)


def bingrad_b_stats(mat: torch.Tensor, iters: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """BinGrad-b's per-row ``(float64 threshold t, (b0, b1))`` after ``iters`` Lloyd iterations."""
    t, b0, b1 = bingrad_b_levels(mat, iters)
    return t, torch.stack([b0, b1], dim=1)


def one_bit_stats(x: torch.Tensor, bucket: Optional[int], stats) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float64 thresholds, flat float32 levels)`` of every bucket chunk of ``x`` by ``stats`` (one of
    the three above): what every backend's one-bit encoders compute before their bits."""
    v = x.detach().reshape(-1).to(torch.float32)
    ts, vals = [], []
    for mat in bucket_chunks(v, bucket):
        t, lv = stats(mat)
        ts.append(t.reshape(-1))
        vals.append(lv.to(torch.float32).reshape(-1))
    if not ts:
        return v.new_zeros(0, dtype=torch.float64), v.new_zeros(0)
    return torch.cat(ts).to(torch.float64), torch.cat(vals)


def sign_scale_encode(x: torch.Tensor, bucket: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled SignSGD: ``(bits x ≥ 0 packed, float32 mean |x| per bucket)``."""
    v = x.detach().reshape(-1).to(torch.float32)
    t, lv = one_bit_stats(v, bucket, sign_scale_stats)
    return threshold_encode(v, t, bucket), lv


def onebit_encode(x: torch.Tensor, bucket: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """1BitSGD: ``(bits x ≥ 0 packed, float32 (mean{x < 0}, mean{x ≥ 0}) per bucket, flattened)``."""
    v = x.detach().reshape(-1).to(torch.float32)
    t, lv = one_bit_stats(v, bucket, onebit_stats)
    return threshold_encode(v, t, bucket), lv


def bingrad_b_encode(x: torch.Tensor, bucket: Optional[int],
                     iters: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """BinGrad-b: ``(bits float64(x) ≥ t packed, float32 (b0, b1) per bucket, flattened)``."""
    v = x.detach().reshape(-1).to(torch.float32)
    t, lv = one_bit_stats(v, bucket, lambda mat: bingrad_b_stats(mat, iters))
    return threshold_encode(v, t, bucket), lv


def bingrad_pb_encode(x: torch.Tensor, bucket: Optional[int],
                      rng: RngLike) -> tuple[torch.Tensor, torch.Tensor]:
    """BinGrad-pb: ``(packed bits, float32 b per bucket)``; bit ``u < (x + b)/(2b)`` (all ones in a
    bucket with ``b = 0``), ``u`` the uniforms of ``rng`` (advanced by ``n``)."""
    st = _stream(rng)
    v = x.detach().reshape(-1).to(torch.float32)
    bits, vals = [], []
    for mat in bucket_chunks(v, bucket):
        b = bingrad_pb_threshold(mat).unsqueeze(1)
        safe = torch.where(b > 0, b, torch.ones_like(b))
        p_up = ((mat + b) / (2 * safe)).clamp(0.0, 1.0)   # 1 above +b, 0 below -b: the clip
        p_up = torch.where(b > 0, p_up, torch.ones_like(p_up))   # b = 0: decode +0, not -0
        u = st.uniform(mat.numel(), mat.device).view(mat.shape)
        bits.append((u < p_up).reshape(-1))
        vals.append(b.reshape(-1))
    if not bits:
        return pack_bits(v.new_zeros(0, dtype=torch.int64), 1), v.new_zeros(0)
    return pack_bits(torch.cat(bits).to(torch.int64), 1), torch.cat(vals)


# -- MultiScale (QSGDMaxNormMultiScale) ---------------------------------------------------------------
def _ms_ratios(mat: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``|v|/w`` per bucket row (IEEE float32 division); a zero scale divides by 1."""
    safe = torch.where(w > 0, w, torch.ones_like(w)).to(mat.dtype).unsqueeze(1)
    return mat.abs() / safe


def _ms_index_matrix(r: torch.Tensor, levels: Sequence[int]) -> torch.Tensor:
    """Eq. 11: the number of scales ``s_j`` (``j ≥ 1``) with ``float32(s_j)·r ≤ s_1`` — the index of the
    largest scale that keeps the code in ``[−s_1, s_1]`` (the condition is monotone in ``s``). The
    same float32 products as the codes', so a code never exceeds ``s_1``."""
    idx = torch.zeros(r.shape, dtype=torch.int64, device=r.device)
    for s in levels[1:]:
        idx += (s * r <= levels[0]).to(torch.int64)
    return idx


def multiscale_indices(x: torch.Tensor, scales: torch.Tensor, levels: Sequence[int],
                       bucket: Optional[int]) -> torch.Tensor:
    """Per-coordinate scale indices (uint8) of ``x`` under the per-bucket ``scales``."""
    v = x.detach().reshape(-1)
    r = _ms_ratios(bucket_view(v, bucket), scales.to(device=v.device, dtype=torch.float32))
    return _ms_index_matrix(r, levels).reshape(-1)[: v.numel()].to(torch.uint8)


def multiscale_encode(x: torch.Tensor, scales: torch.Tensor, index: Optional[torch.Tensor], levels: Sequence[int],
                      bucket: Optional[int], width: int, index_width: int,
                      rng: RngLike) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(packed fields s_1 + c, packed indices or None)`` of ``x`` under the shared per-bucket
    ``scales`` and per-coordinate ``index`` (uint8, the MIN over workers): ``c = sgn(x)·min(floor(
    float32(s_idx)·|x|/w + u), s_1)``, ``u`` from ``rng`` (advanced by ``n``). A shared index above
    this worker's own raises ValueError. ``index=None``: each value's own index
    (:func:`multiscale_indices`), which the other backends compute as they encode."""
    v = x.detach().reshape(-1)
    n = v.numel()
    if index is None:
        index = multiscale_indices(v, scales, levels, bucket)
    r = _ms_ratios(bucket_view(v, bucket), scales.to(device=v.device, dtype=torch.float32)).reshape(-1)[:n]
    idx = index.reshape(-1).to(device=v.device, dtype=torch.int64)
    if n and bool((idx > _ms_index_matrix(r, levels)).any()):
        raise ValueError("multiscale: the shared scale_index exceeds this worker's own index for some "
                         "coordinates; it must be the MIN over workers of the indices")
    s1 = levels[0]
    table = torch.tensor(levels, dtype=torch.float32, device=v.device)
    a = torch.nan_to_num(table[idx.clamp(max=len(levels) - 1)] * r, nan=0.0)  # (NaN input: code 0, as the kernels)
    mag = stochastic_round(a, _stream(rng)).clamp_(max=s1).to(torch.int32)
    codes = torch.where(v < 0, -mag, mag)
    packed_index = pack_bits(index.reshape(-1), index_width) if index_width else None
    return pack_bits(codes + s1, width), packed_index


def multiscale_dequantize(codes: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, levels: Sequence[int],
                          bucket: Optional[int], n: int) -> torch.Tensor:
    """``(float32(c) / float32(s_idx))·w`` for flat codes (possibly sums over workers)."""
    table = torch.tensor(levels, dtype=torch.float32, device=codes.device)
    frac = codes.to(torch.float32) / table[index.to(device=codes.device, dtype=torch.int64)]
    return (bucket_view(frac, bucket) * scales.to(device=codes.device, dtype=torch.float32).unsqueeze(1)
            ).reshape(-1)[:n]


def multiscale_decode(codes: torch.Tensor, index: Optional[torch.Tensor], scales: torch.Tensor,
                      levels: Sequence[int], bucket: Optional[int], width: int, index_width: int, n: int,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode packed fields and indices (``index=None`` with one scale); an index ``≥ len(levels)``
    raises PayloadError."""
    c = unpack_bits(codes, width, n).to(scales.device) - levels[0]
    if index_width:
        idx = unpack_bits(index, index_width, n).to(scales.device)
        if n and int(idx.max()) >= len(levels):
            raise PayloadError(f"multiscale: corrupt scale index (>= {len(levels)} scales)")
    else:
        idx = torch.zeros(n, dtype=torch.int64, device=scales.device)
    return _into(multiscale_dequantize(c, scales, idx, levels, bucket, n), out)


# -- the shared random subset of RandK / GlobalRandK ----------------------------------------------

def random_subset(n: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``k`` distinct coordinates of ``range(n)``, uniformly at random without replacement, as a sorted
    int64 tensor on ``device``: a pure function of ``(n, k, seed)``, identical on every device.

    Each coordinate ``i`` gets the unique key ``(b_i << w) | i`` where ``b_i`` is element ``i`` of
    ``RandomStream(seed).bits32(n)`` (its 32 bits as a signed integer, arithmetically shifted right by
    ``w − 32`` when ``w > 32``) and ``w = max(32, bit length of n − 1)``; the ``k`` smallest keys are the
    selection. Ordering by i.i.d. random keys gives a uniformly random ``k``-subset; the index in the low
    bits only breaks ties between equal 32-bit draws (towards the lower index), which perturbs the
    uniform law by at most about ``k²/2³³`` in total variation.
    """
    if k < 0 or k > n:
        raise ValueError(f"cannot choose k={k} coordinates out of n={n}")
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if k == n:
        return torch.arange(n, dtype=torch.int64, device=device)
    w = subset_index_bits(n)
    bits = RandomStream(seed).bits32(n, device).to(torch.int64)
    if w > 32:
        bits = bits >> (w - 32)
    keys = (bits << w) | torch.arange(n, dtype=torch.int64, device=bits.device)
    sel = torch.topk(keys, k, largest=False, sorted=False).indices
    return torch.sort(sel).values


def subset_index_bits(n: int) -> int:
    """``w`` of :func:`random_subset`: the bits its keys give the index, ``max(32, bit length of n − 1)``."""
    return max(32, (max(n, 1) - 1).bit_length())
