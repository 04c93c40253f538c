"""The plain-torch reference of the one-bit schemes (scaled SignSGD, 1BitSGD, BinGrad-b and -pb): the
pairwise float64 sums every backend reproduces, the per-bucket statistics, the bits and their decode.

Part of :mod:`gradq.kernels.reference`, which exports every public name here: the kernel API below
takes and returns exactly what the fast backends' functions of the same names do.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..codecs.bitpack import pack_bits, unpack_bits
from .reference import RngLike, _into, _stream, bucket_chunks, bucket_index, num_buckets

__all__ = ["SUM_BLOCK", "pairwise_row_sum", "masked_mean", "bingrad_pb_threshold", "bingrad_b_levels",
           "threshold_encode", "sign_encode", "bit_decode", "sign_scale_stats", "onebit_stats", "bingrad_b_stats",
           "one_bit_stats", "sign_scale_encode", "onebit_encode", "bingrad_b_encode", "bingrad_pb_encode"]


# == sums and statistics ===========================================================================
#: length of the runs that :func:`pairwise_row_sum` folds before folding the run sums
SUM_BLOCK = 4096


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
