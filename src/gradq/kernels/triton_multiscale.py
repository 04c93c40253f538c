"""Triton kernels of MultiScale: each value's scale index, its codes under that scale, and the decode.

Part of the Triton backend (:mod:`gradq.kernels.triton_ops`, which exports these functions); every
function has the signature and the result of its namesake in :mod:`gradq.kernels.reference`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._args import RngLike, _bucket, _nbuckets, _stream, _width
from .checks import refuse_invalid
from .triton_common import (_counter_halves, _fast, _flat, _grid, _groups, _jit, _launch, _load8, _out, _pack8_tail,
                           _payload, _row_of, _store8, _uniform_at, _unpack8, _vector, tl)


@_jit
def _ms_allowed(r, lv_ptr, L: tl.constexpr):
    s1 = tl.load(lv_ptr)
    k = tl.zeros(r.shape, tl.int32)
    for j in tl.static_range(1, L):
        k += (tl.load(lv_ptr + j) * r <= s1).to(tl.int32)
    return k


@_jit
def _ms_ratio(x, w):
    """``|x| / w`` (a zero scale reads as 1)."""
    return tl.math.div_rn(tl.abs(x), tl.where(w > 0.0, w, 1.0))


@_jit
def _ms_indices_kernel(x_ptr, w_ptr, lv_ptr, out_ptr, n, bucket, L: tl.constexpr, BLOCK: tl.constexpr):
    """Each value's largest allowed scale index (:func:`_ms_allowed`), one byte a value."""
    first, rem, b0, fast = _fast(n, bucket, BLOCK)
    o = tl.arange(0, BLOCK)
    if fast:
        r = _ms_ratio(tl.load(x_ptr + first + o), tl.load(w_ptr + b0))
        tl.store(out_ptr + first + o, _ms_allowed(r, lv_ptr, L).to(tl.uint8))
    else:
        r = _ms_ratio(tl.load(x_ptr + first + o, mask=o < rem, other=0.0),
                      tl.load(w_ptr + _row_of(first, o, rem, bucket, b0, False)))
        tl.store(out_ptr + first + o, _ms_allowed(r, lv_ptr, L).to(tl.uint8), mask=o < rem)


@_jit
def _ms_code(x, w, ix, lv_ptr, u, o, rem, over, L: tl.constexpr, FAST: tl.constexpr, OWN: tl.constexpr):
    """MultiScale's field ``s1 ± min(floor(s_ix·|x|/w + u), s1)`` of one value, ``over`` plus
    whether its shared index ``ix`` exceeds the value's own allowed one (below offset ``rem``), and
    the index used. OWN: the value's own index (``ix`` is not read)."""
    r = _ms_ratio(x, w)
    if OWN:
        ix = _ms_allowed(r, lv_ptr, L)
    else:
        bad = ix > _ms_allowed(r, lv_ptr, L)
        if not FAST:
            bad = bad & (o < rem)
        over = over + bad.to(tl.int32)
    s1f = tl.load(lv_ptr)
    s1 = s1f.to(tl.int32)
    t = tl.load(lv_ptr + tl.minimum(ix, L - 1)) * r + u
    mag = tl.where(t > s1f, s1f, t).to(tl.int32)
    return tl.where(x < 0.0, s1 - mag, s1 + mag).to(tl.uint32), over, ix


@_jit
def _ms_encode_body(x_ptr, w_ptr, ix_ptr, lv_ptr, codes_ptr, index_ptr, bad_ptr, first, rem, n, nbytes, ibytes,
                    bucket, b0, k1, k2, lo0, hi0, L: tl.constexpr, W: tl.constexpr, IW: tl.constexpr,
                    G: tl.constexpr, WIDE: tl.constexpr, FAST: tl.constexpr, OWN: tl.constexpr):
    g = tl.arange(0, G)
    base = g * 8
    v0, v1, v2, v3, v4, v5, v6, v7 = _load8(x_ptr + first, base, rem, FAST)
    if OWN:   # (placeholders: _ms_code computes each value's own index)
        i0 = tl.zeros((G,), tl.int32)
        i1, i2, i3, i4, i5, i6, i7 = i0, i0, i0, i0, i0, i0, i0
    else:
        i0, i1, i2, i3, i4, i5, i6, i7 = _unpack8(ix_ptr + first, g, n - first, 8, WIDE and FAST)
    over = tl.zeros((G,), tl.int32)
    f0, over, i0 = _ms_code(v0, tl.load(w_ptr + _row_of(first, base, rem, bucket, b0, FAST)), i0, lv_ptr,
                            _uniform_at(lo0, hi0, base, k1, k2, FAST), base, rem, over, L, FAST, OWN)
    f1, over, i1 = _ms_code(v1, tl.load(w_ptr + _row_of(first, base + 1, rem, bucket, b0, FAST)), i1, lv_ptr,
                            _uniform_at(lo0, hi0, base + 1, k1, k2, FAST), base + 1, rem, over, L, FAST, OWN)
    f2, over, i2 = _ms_code(v2, tl.load(w_ptr + _row_of(first, base + 2, rem, bucket, b0, FAST)), i2, lv_ptr,
                            _uniform_at(lo0, hi0, base + 2, k1, k2, FAST), base + 2, rem, over, L, FAST, OWN)
    f3, over, i3 = _ms_code(v3, tl.load(w_ptr + _row_of(first, base + 3, rem, bucket, b0, FAST)), i3, lv_ptr,
                            _uniform_at(lo0, hi0, base + 3, k1, k2, FAST), base + 3, rem, over, L, FAST, OWN)
    f4, over, i4 = _ms_code(v4, tl.load(w_ptr + _row_of(first, base + 4, rem, bucket, b0, FAST)), i4, lv_ptr,
                            _uniform_at(lo0, hi0, base + 4, k1, k2, FAST), base + 4, rem, over, L, FAST, OWN)
    f5, over, i5 = _ms_code(v5, tl.load(w_ptr + _row_of(first, base + 5, rem, bucket, b0, FAST)), i5, lv_ptr,
                            _uniform_at(lo0, hi0, base + 5, k1, k2, FAST), base + 5, rem, over, L, FAST, OWN)
    f6, over, i6 = _ms_code(v6, tl.load(w_ptr + _row_of(first, base + 6, rem, bucket, b0, FAST)), i6, lv_ptr,
                            _uniform_at(lo0, hi0, base + 6, k1, k2, FAST), base + 6, rem, over, L, FAST, OWN)
    f7, over, i7 = _ms_code(v7, tl.load(w_ptr + _row_of(first, base + 7, rem, bucket, b0, FAST)), i7, lv_ptr,
                            _uniform_at(lo0, hi0, base + 7, k1, k2, FAST), base + 7, rem, over, L, FAST, OWN)
    _pack8_tail(f0, f1, f2, f3, f4, f5, f6, f7, codes_ptr, first, base, rem, nbytes, W, WIDE, FAST)
    if IW > 0:
        _pack8_tail(i0.to(tl.uint32), i1.to(tl.uint32), i2.to(tl.uint32), i3.to(tl.uint32), i4.to(tl.uint32),
                    i5.to(tl.uint32), i6.to(tl.uint32), i7.to(tl.uint32), index_ptr, first, base, rem, ibytes, IW,
                    WIDE, FAST)
    tl.store(bad_ptr + tl.program_id(0), tl.sum(over, axis=0))


@_jit
def _ms_encode_kernel(x_ptr, w_ptr, ix_ptr, lv_ptr, codes_ptr, index_ptr, bad_ptr, n, nbytes, ibytes, bucket,
                      k1, k2, ctr0, L: tl.constexpr, W: tl.constexpr, IW: tl.constexpr, G: tl.constexpr,
                      WIDE: tl.constexpr, OWN: tl.constexpr):
    """MultiScale's fields (:func:`_ms_code`) in W bits and, with IW > 0, the shared indices in IW
    bits; per program the number of values whose shared index exceeds their own. WIDE: the indices
    and both outputs are 4-byte aligned. OWN: each value's own index, computed here (``ix_ptr`` is
    not read), so no input-sized array of indices exists."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    lo0, hi0, nowrap = _counter_halves(ctr0, first, 8 * G)
    if fast & nowrap:
        _ms_encode_body(x_ptr, w_ptr, ix_ptr, lv_ptr, codes_ptr, index_ptr, bad_ptr, first, rem, n, nbytes, ibytes,
                        bucket, b0, k1, k2, lo0, hi0, L, W, IW, G, WIDE, True, OWN)
    else:
        _ms_encode_body(x_ptr, w_ptr, ix_ptr, lv_ptr, codes_ptr, index_ptr, bad_ptr, first, rem, n, nbytes, ibytes,
                        bucket, b0, k1, k2, lo0, hi0, L, W, IW, G, WIDE, False, OWN)


@_jit
def _ms_value(f, ix, w, q_ptr, o, rem, over, L: tl.constexpr, W: tl.constexpr, FAST: tl.constexpr):
    """``(float32(f − s1) / s_ix)·w`` of one field (index 0 where ``ix ≥ L``), the quotient looked up
    in ``q_ptr`` (:func:`_ms_quotients`), and ``over`` plus whether ``ix ≥ L`` (below offset ``rem``)."""
    bad = ix >= L
    if not FAST:
        bad = bad & (o < rem)
    ix = tl.where(ix >= L, 0, ix)
    return tl.load(q_ptr + ix * (1 << W) + f) * w, over + bad.to(tl.int32)


@_jit
def _ms_decode_body(codes_ptr, index_ptr, w_ptr, q_ptr, out_ptr, bad_ptr, first, rem, nbytes, ibytes, bucket, b0,
                    L: tl.constexpr, W: tl.constexpr, IW: tl.constexpr, G: tl.constexpr, WIDE: tl.constexpr,
                    FAST: tl.constexpr):
    g = tl.arange(0, G)
    base = g * 8
    cfirst = first // 8 * W
    f0, f1, f2, f3, f4, f5, f6, f7 = _unpack8(codes_ptr + cfirst, g, nbytes - cfirst, W, WIDE and FAST)
    if IW > 0:
        ifirst = first // 8 * IW
        i0, i1, i2, i3, i4, i5, i6, i7 = _unpack8(index_ptr + ifirst, g, ibytes - ifirst, IW, WIDE and FAST)
    else:
        i0 = tl.zeros((G,), tl.int32)
        i1, i2, i3, i4, i5, i6, i7 = i0, i0, i0, i0, i0, i0, i0
    over = tl.zeros((G,), tl.int32)
    v0, over = _ms_value(f0, i0, tl.load(w_ptr + _row_of(first, base, rem, bucket, b0, FAST)), q_ptr, base, rem,
                         over, L, W, FAST)
    v1, over = _ms_value(f1, i1, tl.load(w_ptr + _row_of(first, base + 1, rem, bucket, b0, FAST)), q_ptr, base + 1,
                         rem, over, L, W, FAST)
    v2, over = _ms_value(f2, i2, tl.load(w_ptr + _row_of(first, base + 2, rem, bucket, b0, FAST)), q_ptr, base + 2,
                         rem, over, L, W, FAST)
    v3, over = _ms_value(f3, i3, tl.load(w_ptr + _row_of(first, base + 3, rem, bucket, b0, FAST)), q_ptr, base + 3,
                         rem, over, L, W, FAST)
    v4, over = _ms_value(f4, i4, tl.load(w_ptr + _row_of(first, base + 4, rem, bucket, b0, FAST)), q_ptr, base + 4,
                         rem, over, L, W, FAST)
    v5, over = _ms_value(f5, i5, tl.load(w_ptr + _row_of(first, base + 5, rem, bucket, b0, FAST)), q_ptr, base + 5,
                         rem, over, L, W, FAST)
    v6, over = _ms_value(f6, i6, tl.load(w_ptr + _row_of(first, base + 6, rem, bucket, b0, FAST)), q_ptr, base + 6,
                         rem, over, L, W, FAST)
    v7, over = _ms_value(f7, i7, tl.load(w_ptr + _row_of(first, base + 7, rem, bucket, b0, FAST)), q_ptr, base + 7,
                         rem, over, L, W, FAST)
    _store8(out_ptr + first, base, rem, v0, v1, v2, v3, v4, v5, v6, v7, FAST)
    tl.store(bad_ptr + tl.program_id(0), tl.sum(over, axis=0))


@_jit
def _ms_decode_kernel(codes_ptr, index_ptr, w_ptr, q_ptr, out_ptr, bad_ptr, n, nbytes, ibytes, bucket,
                      L: tl.constexpr, W: tl.constexpr, IW: tl.constexpr, G: tl.constexpr, WIDE: tl.constexpr):
    """MultiScale's values (:func:`_ms_value`) and per program the number of indices ``≥ L``."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    if fast:
        _ms_decode_body(codes_ptr, index_ptr, w_ptr, q_ptr, out_ptr, bad_ptr, first, rem, nbytes, ibytes, bucket,
                        b0, L, W, IW, G, WIDE, True)
    else:
        _ms_decode_body(codes_ptr, index_ptr, w_ptr, q_ptr, out_ptr, bad_ptr, first, rem, nbytes, ibytes, bucket,
                        b0, L, W, IW, G, WIDE, False)


# -- MultiScale ----------------------------------------------------------------------------------
_LEVELS: dict[tuple, torch.Tensor] = {}


def _ms_levels(levels, device: torch.device) -> torch.Tensor:
    """The scales as a float32 tensor on ``device``, made once per scales and device (a copy from
    host memory per call would be a transfer per encode and decode)."""
    plain = isinstance(levels, (tuple, list)) and all(isinstance(v, (int, float)) for v in levels)
    key = (tuple(levels), torch.device(device)) if plain else None
    if key is not None and key in _LEVELS:
        return _LEVELS[key]
    lv = torch.tensor(list(levels), dtype=torch.float32)
    if lv.dim() != 1 or not 1 <= lv.numel() <= 255:
        raise ValueError(f"levels must be 1 to 255 increasing scales, got {levels!r}")
    lv = lv.to(device)
    if key is not None:
        _LEVELS[key] = lv
    return lv


_QUOTIENTS: dict[tuple, torch.Tensor] = {}


def _ms_quotients(levels, width: int, device: torch.device) -> torch.Tensor:
    """``float32(f − s_1) / float32(s_j)`` for every ``width``-bit field ``f`` and scale ``j``, as an
    ``[L, 2**width]`` float32 table on ``device``, divided on the host in float32 (correctly rounded,
    as the reference divides): the decode looks each value's quotient up instead of dividing. Made
    once per scales, width and device."""
    lv = _ms_levels(levels, "cpu")
    key = (tuple(lv.tolist()), width, torch.device(device))
    if key not in _QUOTIENTS:
        f = torch.arange(1 << width, dtype=torch.float32) - lv[0]
        _QUOTIENTS[key] = (f[None, :] / lv[:, None]).contiguous().to(device)
    return _QUOTIENTS[key]


def multiscale_indices(x: torch.Tensor, scales: torch.Tensor, levels, bucket: Optional[int]) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.multiscale_indices`."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    lv = _ms_levels(levels, xv.device)
    res = torch.empty(n, dtype=torch.uint8, device=xv.device)
    if n:
        w = _vector(scales, _nbuckets(n, d), "scales", torch.float32, xv.device)
        _launch(_ms_indices_kernel, _grid(n, 1024), xv, w, lv, res, n, d, L=lv.numel(), BLOCK=1024)
    return res


def multiscale_encode(x: torch.Tensor, scales: torch.Tensor, index: Optional[torch.Tensor], levels,
                      bucket: Optional[int], width: int, index_width: int,
                      rng: RngLike, check: bool = True,
                      out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """As :func:`gradq.kernels.reference.multiscale_encode` (``index=None``: each value's own index,
    computed in the kernel)."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    lv = _ms_levels(levels, xv.device)
    own = index is None
    iv = xv if own else _flat(index, "index", torch.uint8).to(xv.device)   # (own: a pointer the kernel never reads)
    if not own and iv.numel() != n:
        raise ValueError(f"expected {n} scale indices, got {iv.numel()}")
    nbytes, ibytes = (n * _width(width) + 7) // 8, (n * index_width + 7) // 8
    codes = _out(out, nbytes, torch.uint8, xv.device).view(-1)
    packed_index = torch.empty(ibytes, dtype=torch.uint8, device=xv.device) if index_width else None
    k1, k2, ctr0 = _stream(rng, n)
    if n:
        w = _vector(scales, _nbuckets(n, d), "scales", torch.float32, xv.device)
        grid = _grid(-(-n // 8), _groups())
        bad = torch.empty(grid[0], dtype=torch.int32, device=xv.device)   # (every program writes its count)
        pidx = codes if packed_index is None else packed_index
        _launch(_ms_encode_kernel, grid, xv, w, iv, lv, codes, pidx, bad, n, nbytes, ibytes, d, k1, k2, ctr0,
                L=lv.numel(), W=width, IW=index_width, G=_groups(),
                WIDE=all(t.data_ptr() % 4 == 0 for t in (iv, codes, pidx)), OWN=own)
        if check and not own and int(bad.sum()):  # (a host read: the check the reference makes)
            raise ValueError("multiscale: the shared scale_index exceeds this worker's own index for some "
                             "coordinates; it must be the MIN over workers of the indices")
    return codes, packed_index


def multiscale_decode(codes: torch.Tensor, index: Optional[torch.Tensor], scales: torch.Tensor, levels,
                      bucket: Optional[int], width: int, index_width: int, n: int,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.multiscale_decode`."""
    nbytes, ibytes = (n * _width(width) + 7) // 8, (n * index_width + 7) // 8
    cv = _payload(codes, nbytes, f"{width}-bit codes")
    iv = _payload(index, ibytes, f"{index_width}-bit indices") if index_width else cv
    d = _bucket(n, bucket)
    q = _ms_quotients(levels, width, cv.device)
    res = _out(out, n, torch.float32, cv.device)
    if n:
        w = _vector(scales, _nbuckets(n, d), "scales", torch.float32, cv.device)
        grid = _grid(-(-n // 8), _groups())
        bad = torch.empty(grid[0], dtype=torch.int32, device=cv.device)   # (every program writes its count)
        _launch(_ms_decode_kernel, grid, cv, iv, w, q, res, bad, n, nbytes, ibytes, d, L=q.shape[0], W=width,
                IW=index_width, G=_groups(), WIDE=cv.data_ptr() % 4 == 0 and iv.data_ptr() % 4 == 0)
        refuse_invalid(bad, lambda k: f"multiscale: corrupt scale index (>= {q.shape[0]} scales)",
                       f"scale indices above {q.shape[0] - 1}")
    return res
