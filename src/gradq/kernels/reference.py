"""The plain-torch backend of :mod:`gradq.kernels`: the specification every fast backend reproduces.

Each primitive of :mod:`gradq.kernels` is written here once in eager torch. It runs on any device.
The numba kernels (CPU) and the Triton kernels (GPU, or CPU under Triton's interpreter) give the same
bytes and floats for the same seed, and the tests compare them with these functions. The path is
used wherever no fast backend applies, or when ``GRADQ_KERNELS=torch`` (or ``0``) asks for it.

The first half holds the math the quantizer families share (bucket views and norms, stochastic
rounding, uniform codes, TernGrad's σ and clip); the second half the kernel API, whose functions take
and return exactly what the other backends' functions of the same names do (packed bytes, per-bucket
scales or levels). Two families live in modules of their own, whose names this module exports: the
schemes with per-bucket levels (ORQ and Linear, :mod:`gradq.kernels.reference_levels`) and the
one-bit schemes (:mod:`gradq.kernels.reference_binary`); so does the sparse mean's signed-zero step
(:mod:`gradq.kernels.reference_sparse`).

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
from ..random import RandomStream
from .checks import refuse_invalid

__all__ = [
    # shared math
    "num_buckets", "bucket_view", "bucket_chunks", "bucket_index", "bucket_norms", "FLOAT32_MAX", "saturate_norm",
    "stochastic_round", "uniform_codes", "dequantize_uniform", "population_std", "clip_by_std", "uniform_decode_sum",
    # levels (reference_levels)
    "orq_levels", "linear_levels", "round_to_levels", "check_level_count", "linear_positions", "sort_rows",
    "orq_shift", "orq_fixed",
    # one bit (reference_binary)
    "SUM_BLOCK", "pairwise_row_sum", "masked_mean", "bingrad_pb_threshold", "bingrad_b_levels",
    # the kernel API
    "maxabs_scales", "l2_scales", "uniform_encode", "maxabs_uniform_encode", "l2_uniform_encode",
    "uniform_encode_trits", "uniform_decode", "uniform_decode_trits", "uniform_decode_mean",
    "uniform_decode_trits_mean", "terngrad_stats",
    "levels_encode", "levels_decode", "orq_encode", "linear_encode", "threshold_encode", "sign_encode",
    "bit_decode", "sign_scale_encode", "onebit_encode", "bingrad_b_encode", "bingrad_pb_encode",
    "multiscale_indices", "multiscale_encode", "multiscale_decode", "multiscale_dequantize",
    "sign_scale_stats", "onebit_stats", "bingrad_b_stats", "one_bit_stats", "random_subset",
    "topk_indices", "topk_select", "sparse_mean_zero_signs", "sparse_mean_zero_signs_on_device",
]

RngLike = Union[RandomStream, int]


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
    """The fields, after the check of those no encode writes (:func:`gradq.kernels.checks.refuse_invalid`;
    a deferred check decodes an invalid byte of trits as 242)."""
    if width == 0:
        need = (n + 4) // 5
        if packed.dtype == torch.uint8 and packed.dim() == 1 and packed.numel() >= need:
            what = "bytes above 242 (3**5 - 1)"
            refuse_invalid((packed[:need] > 242).sum(), lambda k: f"corrupt codes: {k} {what}", f"codes: {what}")
            packed = packed[:need].clamp(max=242)
        return unpack_trits(packed, n)   # (which refuses a wrong dtype or length itself)
    fields = unpack_bits(packed, width, n)
    if max_field is not None and fields.numel():
        refuse_invalid((fields > max_field).sum(), lambda k: f"corrupt codes: {k} fields above {max_field}",
                       f"codes: fields above {max_field}")
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


def uniform_decode_sum(total: torch.Tensor, scales: torch.Tensor, s: int, bucket: Optional[int], n: int,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``float32(t − s)·(scale_b/s)`` for ``n`` integer fields of any integer dtype: the SUM of ``M``
    workers' one-byte fields where it no longer fits a byte (``s`` then ``M`` times the scheme's), as
    :func:`uniform_decode` decodes a byte. In place in ``out`` (float32, flat): a pass for the
    conversion (exact below ``2²⁴``), one for the offset and one for the bucket's factor."""
    res = torch.empty(n, dtype=torch.float32, device=total.device) if out is None else out.view(-1)
    if n:
        res.copy_(total.reshape(-1)[:n])
        res.sub_(s)
        ratio = scales.to(device=res.device, dtype=torch.float32) / s
        d = n if bucket is None else min(int(bucket), n)
        full = n // d
        res[:full * d].view(full, d).mul_(ratio[:full].unsqueeze(1))
        if full * d < n:
            res[full * d:].mul_(ratio[full])
    return res if out is None else out


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
                      rng: RngLike, check: bool = True,
                      out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(packed fields s_1 + c, packed indices or None)`` of ``x`` under the shared per-bucket
    ``scales`` and per-coordinate ``index`` (uint8, the MIN over workers): ``c = sgn(x)·min(floor(
    float32(s_idx)·|x|/w + u), s_1)``, ``u`` from ``rng`` (advanced by ``n``). A shared index above
    this worker's own raises ValueError (unless ``check=False``: its code saturates at ``s_1``).
    ``index=None``: each value's own index (:func:`multiscale_indices`), which the other backends
    compute as they encode."""
    v = x.detach().reshape(-1)
    n = v.numel()
    if index is None:
        index = multiscale_indices(v, scales, levels, bucket)
    r = _ms_ratios(bucket_view(v, bucket), scales.to(device=v.device, dtype=torch.float32)).reshape(-1)[:n]
    idx = index.reshape(-1).to(device=v.device, dtype=torch.int64)
    if check and n and bool((idx > _ms_index_matrix(r, levels)).any()):
        raise ValueError("multiscale: the shared scale_index exceeds this worker's own index for some "
                         "coordinates; it must be the MIN over workers of the indices")
    s1 = levels[0]
    table = torch.tensor(levels, dtype=torch.float32, device=v.device)
    a = torch.nan_to_num(table[idx.clamp(max=len(levels) - 1)] * r, nan=0.0)  # (NaN input: code 0, as the kernels)
    mag = stochastic_round(a, _stream(rng)).clamp_(max=s1).to(torch.int32)
    codes = torch.where(v < 0, -mag, mag)
    packed_index = pack_bits(index.reshape(-1), index_width) if index_width else None
    return _into(pack_bits(codes + s1, width), out), packed_index


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
        if n:
            L = len(levels)
            refuse_invalid((idx >= L).sum(), lambda _: f"multiscale: corrupt scale index (>= {L} scales)",
                           f"scale indices above {L - 1}")
            idx = torch.where(idx >= L, torch.zeros_like(idx), idx)   # (deferred: the first scale)
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


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted int64 indices of the ``k`` largest ``|x_i|`` of a float32 vector (``0 ≤ k ≤ n``), ties
    broken towards the lower index: a pure function of ``x``, identical on every device.

    The magnitude's bit pattern ``bits(x_i) & 0x7FFFFFFF`` orders like ``|x_i|`` (NaN above +Inf), so
    for ``n ≤ 2**32`` the key ``(bits << 32) | (2**32 − 1 − i)`` is unique per coordinate and one
    ``torch.topk`` on it is exact and deterministic; larger vectors use a stable descending sort."""
    n = x.numel()
    if k < 0 or k > n:
        raise ValueError(f"cannot keep k={k} of n={n} coordinates")
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if k == n:
        return torch.arange(n, dtype=torch.int64, device=x.device)
    if n <= (1 << 32):
        mbits = x.reshape(-1).view(torch.int32).to(torch.int64) & 0x7FFFFFFF
        keys = (mbits << 32) | ((1 << 32) - 1 - torch.arange(n, dtype=torch.int64, device=x.device))
        sel = torch.topk(keys, k, largest=True, sorted=False).indices
    else:  # pragma: no cover - needs a > 16 GiB tensor
        sel = torch.sort(x.reshape(-1).abs(), descending=True, stable=True).indices[:k]
    return torch.sort(sel).values


def topk_select(x: torch.Tensor, k: int, index_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K's fields of a float32 vector: ``(x[idx], idx)``, ``idx`` = :func:`topk_indices` as
    ``index_dtype``."""
    idx = topk_indices(x, k)
    return x.reshape(-1)[idx].contiguous(), idx.to(index_dtype)


def subset_index_bits(n: int) -> int:
    """``w`` of :func:`random_subset`: the bits its keys give the index, ``max(32, bit length of n − 1)``."""
    return max(32, (max(n, 1) - 1).bit_length())


# -- the families in modules of their own (imported last: they take the shared math above) ---------
from .reference_binary import (SUM_BLOCK, bingrad_b_encode, bingrad_b_levels, bingrad_b_stats,  # noqa: E402
                               bingrad_pb_encode, bingrad_pb_threshold, bit_decode, masked_mean, one_bit_stats,
                               onebit_encode, onebit_stats, pairwise_row_sum, sign_encode, sign_scale_encode,
                               sign_scale_stats, threshold_encode)
from .reference_levels import (check_level_count, levels_decode, levels_encode, linear_encode,  # noqa: E402
                               linear_levels, linear_positions, orq_encode, orq_fixed, orq_levels, orq_shift,
                               round_to_levels, sort_rows)
from .reference_sparse import sparse_mean_zero_signs, sparse_mean_zero_signs_on_device  # noqa: E402
