"""The numba backend of :mod:`gradq.kernels`: fused quantize+pack and unpack+dequantize on CPU tensors.

Each function takes and returns torch CPU tensors (shared with NumPy, no copies) and gives **the same
bytes and the same floats** as the plain-torch reference of the same name in
:mod:`gradq.kernels.reference` — same seed, same output, on any number of threads. Callers go through
:mod:`gradq.kernels`, which picks the backend; the jitted code lives in :mod:`gradq.kernels.cpu`
(uniform codes, levels, bits), :mod:`gradq.kernels.cpu_levels` and :mod:`gradq.kernels.cpu_binary`.

Randomness: ``rng`` is a :class:`gradq.random.RandomStream` (or an int seed for a fresh one).
Element ``i`` uses counter ``rng.offset + i`` and the stream is advanced by exactly as many numbers as
the reference draws (``num_buckets·bucket`` for the zero-padded uniform schemes, ``n`` for levels), so
later draws from the same stream agree too.

Math notes (the references are the specification): ``r = float32(1/scale)·s`` is what torch evaluates
for ``s / scale``; a zero scale reads as 1. Two deliberate differences:

* where ``1/scale·s`` overflows to ``inf`` (a bucket max-abs below ``s/3.4e38``), the kernel gives a
  zero element code 0 (its value), as the reference does through ``nan_to_num``;
* TernGrad's σ (:func:`population_std`) is summed in float64 in a fixed order, not by torch's
  reduction: the two agree except when the exact σ lies within float64 rounding (~1e-13 relative) of
  a float32 rounding tie.

The first call of each kernel compiles it (a few seconds); compiled code is cached on disk (see
:mod:`gradq.kernels.numba_cache`), so later processes load it.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import PayloadError
from ._args import RngLike, _bucket, _clip, _levels_s, _nbuckets, _stream, _width
from .checks import refuse_invalid

_CPU = None          # the imported gradq.kernels.cpu module, once loaded
_IMPORT_ERROR: Optional[BaseException] = None
_PART = 65536        # elements per parallel task (rounded to whole buckets and to 40)


def _load():
    global _CPU, _IMPORT_ERROR
    if _CPU is None and _IMPORT_ERROR is None:
        try:
            from .numba_cache import keyed_cache

            with keyed_cache():
                from . import cpu as _mod
            _CPU = _mod
        except Exception as exc:  # numba missing or broken: the torch paths remain
            _IMPORT_ERROR = exc
    return _CPU


def loads() -> bool:
    """True when numba imports and the jitted module loads."""
    return _load() is not None


def _cpu():
    mod = _load()
    if mod is None:
        raise RuntimeError(f"gradq.kernels needs numba, which failed to import: {_IMPORT_ERROR!r}")
    return mod


# -- argument handling ---------------------------------------------------------------------------
def _vec(x: torch.Tensor, name: str, dtype: torch.dtype) -> np.ndarray:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor (the numba kernels run on the CPU), got {x.device}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {x.dtype}")
    return x.detach().reshape(-1).contiguous().numpy()


def _out(out: Optional[torch.Tensor], size: int, dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(size, dtype=dtype)
    if out.dtype != dtype or out.device.type != "cpu" or out.numel() != size or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous CPU {dtype} tensor of {size} elements")
    return out.view(-1)


def _chunk(d: int) -> int:
    """Elements per parallel task: a multiple of 40 (byte-aligned for every width and for trits)
    and, when that stays near 65536, of whole buckets. Depends on the bucket only."""
    unit = d * 40 // math.gcd(d, 40)
    return unit * max(1, _PART // unit) if unit <= _PART else 65520


def _scales(scales: torch.Tensor, nb: int, name: str = "scales") -> np.ndarray:
    arr = _vec(scales, name, torch.float32)
    if arr.size != nb:
        raise ValueError(f"expected {nb} {name} (one per bucket), got {arr.size}")
    return arr


def _payload(data: torch.Tensor, need: int, what: str) -> np.ndarray:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise PayloadError(f"packed {what} must be a uint8 tensor")
    arr = _vec(data, "packed", torch.uint8)
    if arr.size != need:
        raise PayloadError(f"packed {what} need {need} bytes, got {arr.size}")
    return arr


# -- max-abs norms and uniform codes (QSGD, MaxNorm, TernGrad) -----------------------------------
def maxabs_scales(x: torch.Tensor, bucket: Optional[int], clip: Optional[float] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-bucket ``max |x|`` (float32, one per bucket; ``bucket=None``: the whole tensor). With
    ``clip``, the max of ``clamp(x, −clip, clip)``, i.e. ``min(max |x|, clip)`` (TernGrad)."""
    xv = _vec(x, "x", torch.float32)
    d = _bucket(xv.size, bucket)
    res = _out(out, _nbuckets(xv.size, d), torch.float32)
    if xv.size:
        _cpu().maxabs_scales(xv.view(np.int32), d, _clip(clip), res.numpy())
    return res


def l2_scales(x: torch.Tensor, bucket: Optional[int], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-bucket L2 norm ``float32(sqrt(Σ float64(x)²))`` (see :func:`gradq.kernels.reference.bucket_norms`)."""
    xv = _vec(x, "x", torch.float32)
    d = _bucket(xv.size, bucket)
    res = _out(out, _nbuckets(xv.size, d), torch.float32)
    if xv.size:
        part = max(d, 8) if d <= _PART else 65536
        _cpu().sumsq_norms(xv, d, part, res.numpy())
    return res


def _uniform(x, scales, s, bucket, width, rng, clip, out, norm=None):
    """Codes under ``scales``, or under each bucket's ``norm`` (``"max"`` or ``"l2"``) computed in
    the same pass while the bucket is in cache; returns ``(packed, scales)``."""
    xv = _vec(x, "x", torch.float32)
    n = xv.size
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    nbytes = (n + 4) // 5 if width == 0 else (n * width + 7) // 8
    packed = _out(out, nbytes, torch.uint8)
    k1, k2, ctr0 = _stream(rng, nb * d)
    compute = {None: 0, "max": 1, "l2": 2}[norm]
    if compute:
        sc = torch.empty(nb, dtype=torch.float32)
        if d > _PART and n:   # a big bucket: its norm first (parallel over parts), then quantize
            if compute == 1:
                maxabs_scales(x, bucket, clip, out=sc)
            else:
                l2_scales(x, bucket, out=sc)
            compute = 0
    else:
        sc = scales
    sv = _scales(sc, nb)
    if n:
        _cpu().uniform_encode(xv, xv.view(np.int32), sv, compute, s, d, width, _clip(clip), k1, k2, ctr0,
                              _chunk(d), packed.numpy())
    return packed, sc


def uniform_encode(x: torch.Tensor, scales: torch.Tensor, s: int, bucket: Optional[int], width: int,
                   rng: RngLike, clip: Optional[float] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """QSGD-style codes ``c = sgn(x)·min(floor(|x|·s/scale + u), s)`` under the given per-bucket
    ``scales`` (MaxNorm's shared scale), packed as ``width``-bit fields ``c + s``; ``clip`` clamps x
    first (TernGrad). Returns ``ceil(n·width/8)`` uint8 bytes."""
    return _uniform(x, scales, _levels_s(s, _width(width)), bucket, width, rng, clip, out)[0]


def maxabs_uniform_encode(x: torch.Tensor, s: int, bucket: Optional[int], width: int, rng: RngLike,
                          clip: Optional[float] = None,
                          out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`maxabs_scales` and :func:`uniform_encode` fused (QSGD with ``norm=max``): each bucket's
    norm, codes and bytes in one pass while it is in cache. Returns ``(packed, scales)``."""
    return _uniform(x, None, _levels_s(s, _width(width)), bucket, width, rng, clip, out, "max")


def l2_uniform_encode(x: torch.Tensor, s: int, bucket: Optional[int], width: int, rng: RngLike,
                      out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`l2_scales` and :func:`uniform_encode` under them (QSGD with ``norm=l2``), fused as
    :func:`maxabs_uniform_encode` is. Returns ``(packed, scales)``."""
    return _uniform(x, None, _levels_s(s, _width(width)), bucket, width, rng, None, out, "l2")


def uniform_encode_trits(x: torch.Tensor, scales: torch.Tensor, bucket: Optional[int], rng: RngLike,
                         clip: Optional[float] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TernGrad's codes ``{−1, 0, 1}`` (``s = 1``) as trits ``c + 1``, five per byte (``ceil(n/5)``
    bytes); ``clip`` is TernGrad's bound ``c·σ``. For ``pack=2bit`` use :func:`uniform_encode` with
    ``s=1, width=2``."""
    return _uniform(x, scales, 1, bucket, 0, rng, clip, out)[0]


def uniform_decode(packed: torch.Tensor, scales: torch.Tensor, s: int, bucket: Optional[int], width: int,
                   n: int, max_field: Optional[int] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``float32(field − s)·(scale_b/s)`` for ``n`` packed ``width``-bit fields. With ``max_field``,
    a field above it raises :class:`PayloadError` (TernGrad 2-bit: ``max_field=2``)."""
    return _decode_uniform_mean([packed], [scales], _levels_s(s, None), bucket, _width(width), n, out, max_field)


def uniform_decode_trits(packed: torch.Tensor, scales: torch.Tensor, bucket: Optional[int], n: int,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TernGrad ``pack=trit`` decode: ``(trit − 1)·scale_b``; a byte above 242 raises PayloadError."""
    return _decode_uniform_mean([packed], [scales], 1, bucket, 0, n, out, None)


def _rows(packed: Sequence[torch.Tensor], nbytes: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """One uint8 array and the offset of each payload's bytes in it: the storage they share (a
    received buffer holding all of them: no copy) or else their concatenation."""
    if not packed:
        raise ValueError("need at least one payload")
    for t in packed:
        _payload(t, nbytes, what)
    st = packed[0].untyped_storage()
    if all(t.untyped_storage().data_ptr() == st.data_ptr() and t.is_contiguous() for t in packed):
        base = torch.empty(0, dtype=torch.uint8).set_(st)
        return base.numpy(), np.array([t.storage_offset() for t in packed], np.int64)
    return torch.cat([t.reshape(-1) for t in packed]).numpy(), np.arange(len(packed), dtype=np.int64) * nbytes


def _decode_uniform_mean(packed, scales, s, bucket, width, n, out, max_field):
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if len(scales) != len(packed):
        raise ValueError(f"{len(packed)} packed payloads but {len(scales)} scale vectors")
    nbytes = (n + 4) // 5 if width == 0 else (n * width + 7) // 8
    data, offs = _rows(packed, nbytes, "trits" if width == 0 else f"{width}-bit codes")
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    for k, sc in enumerate(scales):
        _scales(sc, nb, f"scales[{k}]")
    res = _out(out, n, torch.float32)
    if n:
        sv = torch.stack([sc.reshape(-1) for sc in scales]).numpy()
        bad = _cpu().uniform_decode_mean(data, offs, nbytes, sv, s, d, width,
                                         255 if max_field is None else max_field, _chunk(d), res.numpy())
        what = "bytes above 242 (3**5 - 1)" if width == 0 else f"fields above {max_field}"
        refuse_invalid(int(bad), lambda k: f"corrupt codes: {k} {what}", f"codes: {what}")
    return res


def uniform_decode_mean(packed: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], s: int,
                        bucket: Optional[int], width: int, n: int, max_field: Optional[int] = None,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The mean of :func:`uniform_decode` over several payloads (``packed[j]`` with ``scales[j]``),
    added in list order in float32 and divided by their count — bit for bit the plain loop, in one
    pass (what the reducing rank of scatter/all-gather does with the M chunks it receives)."""
    return _decode_uniform_mean(packed, scales, _levels_s(s, None), bucket, _width(width), n, out, max_field)


def uniform_decode_trits_mean(packed: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                              bucket: Optional[int], n: int,
                              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`uniform_decode_mean` for TernGrad's trits (five per byte)."""
    return _decode_uniform_mean(packed, scales, 1, bucket, 0, n, out, None)


# -- ORQ / Linear: rounding onto given levels ----------------------------------------------------
def _level_matrix(levels: torch.Tensor, nb: int) -> tuple[np.ndarray, int]:
    if not isinstance(levels, torch.Tensor) or levels.dim() != 2 or levels.shape[0] != nb:
        raise ValueError(f"levels must be a ({nb}, L) float32 tensor, one row per bucket")
    L = int(levels.shape[1])
    if not 2 <= L <= 256:
        raise ValueError(f"the number of levels must be in [2, 256], got {L}")
    return _vec(levels, "levels", torch.float32), L


def levels_encode(x: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], width: int, rng: RngLike,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Unbiased stochastic rounding of every element onto its bucket's sorted row of ``levels``
    (``(num_buckets, L)``, rows covering their bucket's range), packed as ``width``-bit indices."""
    xv = _vec(x, "x", torch.float32)
    n = xv.size
    d = _bucket(n, bucket)
    lv, L = _level_matrix(levels, _nbuckets(n, d))
    if L > (1 << _width(width)):
        raise ValueError(f"{L} level indices do not fit in {width} bits")
    packed = _out(out, (n * width + 7) // 8, torch.uint8)
    k1, k2, ctr0 = _stream(rng, n)
    if n:
        _cpu().levels_encode(xv, lv, L, d, width, k1, k2, ctr0, _chunk(d), packed.numpy())
    return packed


def levels_decode(packed: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], width: int, n: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``levels[b, index]`` for ``n`` packed indices; an index ``≥ L`` raises PayloadError."""
    arr = _payload(packed, (n * _width(width) + 7) // 8, f"{width}-bit indices")
    d = _bucket(n, bucket)
    lv, L = _level_matrix(levels, _nbuckets(n, d))
    res = _out(out, n, torch.float32)
    if n:
        bad = _cpu().levels_decode(arr, lv, L, d, width, _chunk(d), res.numpy())
        refuse_invalid(int(bad), lambda k: f"level index out of range [0, {L - 1}]", f"level indices above {L - 1}")
    return res


# -- one bit per element -------------------------------------------------------------------------
def threshold_encode(x: torch.Tensor, thresholds: torch.Tensor, bucket: Optional[int],
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bits ``float64(x) >= thresholds[b]`` (float64, one per bucket; BinGrad-b) packed 8 per byte."""
    xv = _vec(x, "x", torch.float32)
    d = _bucket(xv.size, bucket)
    tv = _vec(thresholds, "thresholds", torch.float64)
    if tv.size != _nbuckets(xv.size, d):
        raise ValueError(f"expected {_nbuckets(xv.size, d)} thresholds, got {tv.size}")
    packed = _out(out, (xv.size + 7) // 8, torch.uint8)
    if xv.size:
        _cpu().threshold_encode(xv, tv, d, _chunk(d), packed.numpy())
    return packed


def sign_encode(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bits ``x >= 0`` (−0.0 gives 1) packed 8 per byte: the code of SignSGD and 1BitSGD."""
    return threshold_encode(x, torch.zeros(1 if x.numel() else 0, dtype=torch.float64), None, out=out)


def bit_decode(packed: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], n: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode one bit per element. ``levels`` of shape ``(nb, 2)``: ``levels[b, bit]`` (1BitSGD,
    BinGrad-b); of shape ``(nb,)`` or ``(nb, 1)``: ``levels[b]·float32(2·bit − 1)`` (SignSGD, BinGrad-pb)."""
    arr = _payload(packed, (n + 7) // 8, "bits")
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    per = 2 if levels.dim() == 2 and levels.shape[1] == 2 else 1
    lv = _vec(levels, "levels", torch.float32)
    if lv.size != nb * per:
        raise ValueError(f"expected {nb * per} levels ({per} per bucket), got {lv.size}")
    res = _out(out, n, torch.float32)
    if n:
        _cpu().bit_decode(arr, lv, per, d, _chunk(d), res.numpy())
    return res


# -- TernGrad's clipping statistics ----------------------------------------------------------------
def population_std(x: torch.Tensor) -> torch.Tensor:
    """``torch.std(x, correction=0)`` (0-dim float32) computed in float64: per chunk of 65520 values
    two passes (mean, then squared deviations), chunks merged in order. Deterministic and independent
    of the thread count; equal to torch's result except when the exact σ lies within float64
    rounding (~1e-13 relative) of a float32 rounding tie. NaN for an empty tensor."""
    return _moments(x)[0]


def _moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xv = _vec(x, "x", torch.float32)
    if xv.size == 0:
        return torch.tensor(float("nan")), torch.tensor(0.0)
    chunk = 65520
    parts = np.empty(((xv.size + chunk - 1) // chunk, 4), np.float64)
    mod = _cpu()
    mod.moments(xv, chunk, parts)
    var, mx = mod.combine_moments(parts)
    return torch.tensor(float(np.float32(np.sqrt(var)))), torch.tensor(float(mx))


def terngrad_stats(x: torch.Tensor, clip: Optional[float], bucket: Optional[int]
                   ) -> tuple[Optional[float], torch.Tensor]:
    """TernGrad's ``(bound, scales)``: ``bound = float32(clip)·σ`` as in ``clip_by_std`` (None when
    ``clip`` is None, ``n ≤ 1`` or ``σ = 0``: no clipping) and the per-bucket max-abs of the clipped
    vector, ``min(max |x|, bound)``. With one bucket, σ and the max come from the same pass.
    Pass ``bound`` as ``clip=`` to :func:`uniform_encode_trits` / :func:`uniform_encode`."""
    n = x.numel()
    if clip is None or n <= 1:
        return None, maxabs_scales(x, bucket)
    sigma, mx = _moments(x)
    if float(sigma) != float(sigma):   # NaN/Inf in x make σ NaN: the reference's max-abs without clipping
        return None, maxabs_scales(x, bucket)   # (NaN/Inf buckets read inf: the encode's witness sees them)
    bound = None
    if float(sigma) > 0:
        bound = float(np.float32(clip) * np.float32(float(sigma)))
    if bucket is None or bucket >= n:
        m = float(mx)
        return bound, torch.tensor([m if bound is None or m < bound else bound], dtype=torch.float32)
    return bound, maxabs_scales(x, bucket, clip=bound)


# -- MultiScale ----------------------------------------------------------------------------------
_MS = None


def _ms():
    global _MS
    if _MS is None:
        _cpu()
        from .numba_cache import keyed_cache

        with keyed_cache():
            from . import cpu_multiscale
        _MS = cpu_multiscale
    return _MS


def _ms_levels(levels) -> np.ndarray:
    lv = np.asarray(levels, dtype=np.float32)
    if lv.ndim != 1 or not 1 <= lv.size <= 255:
        raise ValueError(f"levels must be 1 to 255 increasing scales, got {levels!r}")
    return lv


def multiscale_indices(x: torch.Tensor, scales: torch.Tensor, levels, bucket: Optional[int]) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.multiscale_indices`."""
    xv = _vec(x, "x", torch.float32)
    n = xv.size
    d = _bucket(n, bucket)
    res = torch.empty(n, dtype=torch.uint8)
    if n:
        _ms().indices(xv, xv.view(np.int32), _scales(scales, _nbuckets(n, d)), d, _ms_levels(levels), 65536, res.numpy())
    return res


def multiscale_encode(x: torch.Tensor, scales: torch.Tensor, index: Optional[torch.Tensor], levels,
                      bucket: Optional[int], width: int, index_width: int,
                      rng: RngLike, check: bool = True,
                      out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """As :func:`gradq.kernels.reference.multiscale_encode` (``index=None``: the kernel computes
    each value's own index, a chunk at a time)."""
    xv = _vec(x, "x", torch.float32)
    n = xv.size
    d = _bucket(n, bucket)
    iv = np.empty(0, np.uint8) if index is None else _vec(index, "index", torch.uint8)
    if index is not None and iv.size != n:
        raise ValueError(f"expected {n} scale indices, got {iv.size}")
    codes = _out(out, (n * _width(width) + 7) // 8, torch.uint8)
    packed_index = torch.empty((n * index_width + 7) // 8, dtype=torch.uint8) if index_width else None
    k1, k2, ctr0 = _stream(rng, n)
    if n:
        bad = _ms().encode(xv, _scales(scales, _nbuckets(n, d)), iv, d, _ms_levels(levels), width, index_width,
                           k1, k2, ctr0, 65536, codes.numpy(),
                           packed_index.numpy() if packed_index is not None else np.empty(0, np.uint8))
        if check and bad:
            raise ValueError("multiscale: the shared scale_index exceeds this worker's own index for some "
                             "coordinates; it must be the MIN over workers of the indices")
    return codes, packed_index


def multiscale_decode(codes: torch.Tensor, index: Optional[torch.Tensor], scales: torch.Tensor, levels,
                      bucket: Optional[int], width: int, index_width: int, n: int,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.multiscale_decode`."""
    cv = _payload(codes, (n * _width(width) + 7) // 8, f"{width}-bit codes")
    iv = _payload(index, (n * index_width + 7) // 8, f"{index_width}-bit indices") if index_width \
        else np.empty(0, np.uint8)
    d = _bucket(n, bucket)
    lv = _ms_levels(levels)
    res = _out(out, n, torch.float32)
    if n:
        bad = _ms().decode(cv, iv, _scales(scales, _nbuckets(n, d)), d, lv, width, index_width, n, 65536, res.numpy())
        refuse_invalid(int(bad), lambda k: f"multiscale: corrupt scale index (>= {lv.size} scales)",
                       f"scale indices above {lv.size - 1}")
    return res

