"""The Triton backend of :mod:`gradq.kernels`: fused quantize+pack and unpack+dequantize on GPU tensors.

Every function has the signature and the result of its namesake in :mod:`gradq.kernels.reference`:
the same bytes and the same floats for the same seed. :func:`gradq.kernels.backend_for` sends CUDA
tensors here when triton imports. On a machine without a GPU the kernels run under Triton's
interpreter (NumPy on CPU tensors) when ``GRADQ_KERNELS=triton`` asks for it. That mode is slow and
exists so that the suite can check every kernel against the reference without a GPU.

The backend is several modules, and this one exports all of their functions:

* this one: the uniform codes' scales and encodes (QSGD, MaxNorm, TernGrad and the RandK variants'
  fixed-width parts) and TernGrad's ``terngrad_stats``;
* :mod:`.triton_decode`: the uniform codes' decode and ``decode_mean``;
* :mod:`.triton_moments`: TernGrad's σ, clip bound and clipped max in one read;
* :mod:`.triton_levels`: level rounding and its decode (ORQ, Linear) and the levels themselves;
* :mod:`.triton_binary`: the one-bit family (statistics, bits, BinGrad-pb's level, decode);
* :mod:`.triton_multiscale`: MultiScale;
* :mod:`.triton_common`: the interpreter switch, the launch settings, the device helpers they share
  and the argument checks (and :mod:`.triton_elias`, the Elias stream, which the QSGD quantizer calls,
  :mod:`.triton_subset`, RandK's shared subset, which :func:`gradq.kernels.random_subset` calls, and
  :mod:`.triton_randk`, the RandK variants on a subset never stored, which the ``subset_*``
  primitives call).

How the kernels reproduce the reference:

* **Randomness.** Element ``i`` hashes its counter ``offset + i`` with :mod:`gradq.random`'s
  ``lowbias32`` mixer in wrapping uint32 arithmetic, exactly as the reference's int32 code and the
  numba kernels do.
* **Float operations.** They run in the reference's order, in float32. Divisions are correctly
  rounded (``div_rn``), and launches pass ``enable_fp_fusion=False`` so that no multiply-add is
  contracted into an FMA (which would round once instead of twice).
* **Packing.** Eight ``w``-bit fields form ``w`` bytes of one little-endian word, as in
  :mod:`gradq.codecs.bitpack`; trits go five to a byte. A program owns whole groups, so no two
  programs write one byte.
* **Layout of the element-wise kernels.** A thread takes whole groups of eight values (two 16-byte
  loads split in registers with ``tl.split``, so packing needs no exchange between threads) or a
  byte of five trits. Counters are uint32 offsets from the program's first. Per-bucket scales and
  levels are read once a program where a program lies in one or two buckets. A whole program (and
  for per-bucket levels, one inside a bucket) runs with no masks; the others take a masked path
  that gives the same bytes. ``benchmarks/bench_sass.py`` counts the instructions a value.
* **Encodes.**
  - QSGD with the max norm and a power-of-two bucket of 8 to 4096 values is fused into one pass:
    each program reads its buckets once, and writes their scales and bytes.
  - Other buckets take two passes: max-abs, then codes.
  - TernGrad's σ: per-block float64 moments merged in a fixed tree (:mod:`.triton_moments`).
  - Linear's and ORQ's levels: :mod:`.triton_levels`; the one-bit statistics and BinGrad-pb's
    level: :mod:`.triton_binary`.

Host reads. Fixed-width encodes and decodes never read device memory on the host. Two exceptions:
the checks that refuse corrupt codes (TernGrad's 2-bit fields and trits, level indices) read one
count per call, and RandK's explicit subset (:mod:`.triton_subset`, where the indices are asked
for) reads its count of candidates. The implicit subset of the Rand-K family
(:mod:`.triton_randk`) keeps its ``K``-th draw on the device and reads nothing.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import reference
from ._args import RngLike, _bucket, _clip, _levels_s, _nbuckets, _stream, _width
from .triton_common import (TUNING, _bucket_of, _bucket_split, _counter_halves, _flat, _grid, _groups, _jit, _join4,
                           _launch, _load8, _one_bucket, _out, _pack8_tail, _span, _split4, _uniform_at, _vector, tl,
                           triton)
from .triton_moments import _moments
# the backend's settings (tests and benchmarks read them here)
from .triton_common import INTERPRETED, VALUE_ARGS  # noqa: F401
# the other modules' functions, under the backend's name (gradq.kernels dispatches to this module)
from .triton_binary import (bingrad_b_encode, bingrad_pb_encode, bingrad_pb_levels, bit_decode,  # noqa: F401
                            onebit_encode, sign_encode, sign_scale_encode, threshold_encode)
from .triton_decode import (uniform_decode, uniform_decode_mean, uniform_decode_trits,  # noqa: F401
                            uniform_decode_trits_mean)
from .triton_levels import (levels_decode, levels_encode, linear_encode, linear_levels, orq_encode,  # noqa: F401
                            orq_levels)
from .triton_checks import field_is_finite  # noqa: F401
from .triton_moments import population_std  # noqa: F401
from .triton_multiscale import multiscale_decode, multiscale_encode, multiscale_indices  # noqa: F401

_FUSED_MAX = 4096      # largest power-of-two bucket the one-pass QSGD encode handles
_ROWS = 64             # buckets per program (at most) in the max-abs pass


@_jit
def _recip_s(scale, s):
    """``float32(1/scale)·s`` (a zero scale reads as 1): the multiplier of :func:`_field_r`."""
    safe = tl.where(scale > 0.0, scale, 1.0)
    return tl.math.div_rn(tl.full(safe.shape, 1.0, tl.float32), safe) * s.to(tl.float32)


@_jit
def _field_r(v, r, s, clip, u, CLIP: tl.constexpr = True):
    """``s ± min(floor(|v|·r + u), s)``, ``v`` first clamped to ``[−clip, clip]`` (CLIP=False: the
    caller knows ``clip`` is inf, where the clamp changes nothing, NaN included)."""
    if CLIP:
        v = tl.where(v > clip, clip, v)
        v = tl.where(v < -clip, -clip, v)
    av = tl.abs(v)
    a = tl.where(av > 0.0, av * r, 0.0)  # 0·inf would be NaN for a denormal scale
    # a is never NaN here, so min() is the reference's clamp on every backend (min's NaN rule differs)
    mag = tl.minimum(a + u, s.to(tl.float32)).to(tl.int32)
    return tl.where(v < 0.0, s - mag, s + mag)


@_jit
def _two_recips(scales_ptr, b0, nb, s, BIG: tl.constexpr):
    """The multipliers (:func:`_recip_s`) of buckets ``b0`` and ``b0 + 1``; with BIG 2 (the
    program inside bucket ``b0``) only ``b0``'s, as both."""
    ra = _recip_s(tl.load(scales_ptr + b0), s)
    if BIG == 2:
        return ra, ra
    else:
        return ra, _recip_s(tl.load(scales_ptr + b0 + 1, mask=b0 + 1 < nb, other=1.0), s)


@_jit
def _pick(o, edge, ra, rb, BIG: tl.constexpr):
    """The multiplier of values at offsets ``o``: ``ra`` before ``edge``, ``rb`` from it; with BIG 2
    ``ra`` for all."""
    if BIG == 2:
        return ra
    else:
        return tl.where(o < edge, ra, rb)


@_jit
def _field(v, scale, s, clip, u):
    """``s ± min(floor(|v|·r + u), s)`` with ``r = float32(1/scale)·s`` (a zero scale reads as 1)."""
    return _field_r(v, _recip_s(scale, s), s, clip, u)


@_jit
def _maxabs_bits_kernel(x_ptr, bits_ptr, n, bucket, nb, ncol, cap, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Per bucket, the largest ``|x|`` bit pattern (for non-NaN floats the integer order of the
    magnitude bits is the order of ``|x|``; NaN ranks above inf, as in the numba kernel) capped at
    ``cap`` (``min(max, cap)`` is the max of the capped values), over a ``(rows, column chunk)``
    grid merged by an atomic max (order-free, so deterministic) into zeros."""
    pid = tl.program_id(0).to(tl.int64)  # one axis (CUDA limits the others to 65535 programs)
    rows = (pid // ncol) * ROWS + tl.arange(0, ROWS)
    c = (pid % ncol) * COLS + tl.arange(0, COLS)
    idx = rows[:, None].to(tl.int64) * bucket + c[None, :]
    ok = (rows[:, None] < nb) & (c[None, :] < bucket) & (idx < n)
    bits = tl.load(x_ptr + idx, mask=ok, other=0.0).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(bits_ptr + rows, tl.minimum(tl.max(bits, axis=1), cap), mask=rows < nb)


@_jit
def _sumsq_kernel(x_ptr, part_ptr, n, bucket, nb, ncol, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Per (rows, column chunk) tile: ``Σ float64(x)²`` of each row's chunk into ``part[row, chunk]``."""
    pid = tl.program_id(0).to(tl.int64)
    rows = (pid // ncol) * ROWS + tl.arange(0, ROWS)
    col = pid % ncol
    c = col * COLS + tl.arange(0, COLS)
    idx = rows[:, None].to(tl.int64) * bucket + c[None, :]
    ok = (rows[:, None] < nb) & (c[None, :] < bucket) & (idx < n)
    v = tl.load(x_ptr + idx, mask=ok, other=0.0).to(tl.float64)
    tl.store(part_ptr + rows * ncol + col, tl.sum(v * v, axis=1), mask=rows < nb)


@_jit
def _absbits(v):
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@_jit
def _encode8(v0, v1, v2, v3, v4, v5, v6, v7, r0, r1, r2, r3, r4, r5, r6, r7, s, clip, k1, k2, lo0, hi0,
             out_ptr, first, base, rem, nbytes, W: tl.constexpr, WIDE: tl.constexpr, FULL: tl.constexpr,
             CLIP: tl.constexpr):
    """The uniform fields (:func:`_field_r`) of groups of eight values ``v_j`` at offsets ``base + j``
    under multipliers ``r_j``, packed by :func:`_pack8_tail`."""
    f0 = _field_r(v0, r0, s, clip, _uniform_at(lo0, hi0, base, k1, k2, FULL), CLIP).to(tl.uint32)
    f1 = _field_r(v1, r1, s, clip, _uniform_at(lo0, hi0, base + 1, k1, k2, FULL), CLIP).to(tl.uint32)
    f2 = _field_r(v2, r2, s, clip, _uniform_at(lo0, hi0, base + 2, k1, k2, FULL), CLIP).to(tl.uint32)
    f3 = _field_r(v3, r3, s, clip, _uniform_at(lo0, hi0, base + 3, k1, k2, FULL), CLIP).to(tl.uint32)
    f4 = _field_r(v4, r4, s, clip, _uniform_at(lo0, hi0, base + 4, k1, k2, FULL), CLIP).to(tl.uint32)
    f5 = _field_r(v5, r5, s, clip, _uniform_at(lo0, hi0, base + 5, k1, k2, FULL), CLIP).to(tl.uint32)
    f6 = _field_r(v6, r6, s, clip, _uniform_at(lo0, hi0, base + 6, k1, k2, FULL), CLIP).to(tl.uint32)
    f7 = _field_r(v7, r7, s, clip, _uniform_at(lo0, hi0, base + 7, k1, k2, FULL), CLIP).to(tl.uint32)
    _pack8_tail(f0, f1, f2, f3, f4, f5, f6, f7, out_ptr, first, base, rem, nbytes, W, WIDE, FULL)


@_jit
def _trits_encode_wide(x_ptr, scales_ptr, out_ptr, first, nb, bucket, s, clip, k1, k2, lo0, hi0, G: tl.constexpr,
                       BIG: tl.constexpr, CLIP: tl.constexpr):
    """A whole program of the trit encode into a 4-byte-aligned output: four bytes (twenty values) a
    thread, read as five 16-byte loads, regrouped in registers by digit (:func:`_split4`,
    :func:`_join4`) and written as one 32-bit word. The same fields as the byte-wise path."""
    Q: tl.constexpr = G // 4
    q = tl.arange(0, Q)
    c = tl.arange(0, 4)
    p = x_ptr + first + q[:, None] * 20 + c[None, :]
    x0, x1, x2, x3 = _split4(tl.load(p))
    x4, x5, x6, x7 = _split4(tl.load(p + 4))
    x8, x9, x10, x11 = _split4(tl.load(p + 8))
    x12, x13, x14, x15 = _split4(tl.load(p + 12))
    x16, x17, x18, x19 = _split4(tl.load(p + 16))
    o = q[:, None] * 20 + c[None, :] * 5       # [Q, 4]: the first value of each byte
    if BIG:
        b0, edge = _bucket_split(first, bucket, 5 * G)
        ra, rb = _two_recips(scales_ptr, b0, nb, s, BIG)
    byte = tl.zeros((Q, 4), tl.int32)
    for j in tl.static_range(4, -1, -1):   # Horner, as the byte-wise path: digit j of byte i is value 5·i + j
        if j == 0:
            v = _join4(x0, x5, x10, x15)
        elif j == 1:
            v = _join4(x1, x6, x11, x16)
        elif j == 2:
            v = _join4(x2, x7, x12, x17)
        elif j == 3:
            v = _join4(x3, x8, x13, x18)
        else:
            v = _join4(x4, x9, x14, x19)
        if BIG:
            r = _pick(o + j, edge, ra, rb, BIG)
        else:
            r = _recip_s(tl.load(scales_ptr + _bucket_of(first, o + j, bucket)), s)
        byte = byte * 3 + _field_r(v, r, s, clip, _uniform_at(lo0, hi0, o + j, k1, k2, True), CLIP)
    b0_, b1_, b2_, b3_ = _split4(byte.to(tl.uint32))
    words = (out_ptr + first // 5).to(tl.pointer_type(tl.uint32))
    tl.store(words + q, b0_ | (b1_ << 8) | (b2_ << 16) | (b3_ << 24))


@_jit
def _uniform_encode_body(x_ptr, scales_ptr, out_ptr, first, rem, nbytes, nb, bucket, s, clip, k1, k2, lo0, hi0,
                         W: tl.constexpr, TRITS: tl.constexpr, G: tl.constexpr, BIG: tl.constexpr,
                         CLIP: tl.constexpr, WIDE: tl.constexpr, FULL: tl.constexpr):
    """One program of :func:`_uniform_encode_kernel` (FULL: as in :func:`_norm_uniform_body`)."""
    g = tl.arange(0, G)
    if TRITS and FULL and WIDE and G >= 4:
        _trits_encode_wide(x_ptr, scales_ptr, out_ptr, first, nb, bucket, s, clip, k1, k2, lo0, hi0, G, BIG, CLIP)
    elif TRITS:   # a byte of five trits per group: five loads at a stride of five values
        PER: tl.constexpr = 5 * G
        base = g * 5
        if BIG:
            b0, edge = _bucket_split(first, bucket, PER)
            ra, rb = _two_recips(scales_ptr, b0, nb, s, BIG)
        byte = tl.zeros((G,), tl.int32)
        for j in tl.static_range(4, -1, -1):   # Horner: t0 + 3·(t1 + 3·(t2 + …))
            o = base + j
            if FULL:
                v = tl.load(x_ptr + first + o)
            else:
                v = tl.load(x_ptr + first + o, mask=o < rem, other=0.0)
            if BIG:
                r = _pick(o, edge, ra, rb, BIG)
            else:
                r = _recip_s(tl.load(scales_ptr + _bucket_of(first, o, bucket), mask=o < rem, other=1.0), s)
            f = _field_r(v, r, s, clip, _uniform_at(lo0, hi0, o, k1, k2, FULL), CLIP)
            if not FULL:
                f = tl.where(o < rem, f, 0)
            byte = byte * 3 + f
        tl.store(out_ptr + first // 5 + g, byte.to(tl.uint8), mask=first // 5 + g < nbytes)
    else:
        PER: tl.constexpr = 8 * G
        base = g * 8
        v0, v1, v2, v3, v4, v5, v6, v7 = _load8(x_ptr + first, base, rem, FULL)
        if BIG:
            b0, edge = _bucket_split(first, bucket, PER)
            ra, rb = _two_recips(scales_ptr, b0, nb, s, BIG)
            r0 = _pick(base, edge, ra, rb, BIG)
            r1 = _pick(base + 1, edge, ra, rb, BIG)
            r2 = _pick(base + 2, edge, ra, rb, BIG)
            r3 = _pick(base + 3, edge, ra, rb, BIG)
            r4 = _pick(base + 4, edge, ra, rb, BIG)
            r5 = _pick(base + 5, edge, ra, rb, BIG)
            r6 = _pick(base + 6, edge, ra, rb, BIG)
            r7 = _pick(base + 7, edge, ra, rb, BIG)
        else:
            r0 = _recip_s(tl.load(scales_ptr + _bucket_of(first, base, bucket), mask=base < rem, other=1.0), s)
            r1 = _recip_s(tl.load(scales_ptr + _bucket_of(first, base + 1, bucket), mask=base + 1 < rem, other=1.0), s)
            r2 = _recip_s(tl.load(scales_ptr + _bucket_of(first, base + 2, bucket), mask=base + 2 < rem, other=1.0), s)
            r3 = _recip_s(tl.load(scales_ptr + _bucket_of(first, base + 3, bucket), mask=base + 3 < rem, other=1.0), s)
            r4 = _recip_s(tl.load(scales_ptr + _bucket_of(first, base + 4, bucket), mask=base + 4 < rem, other=1.0), s)
            r5 = _recip_s(tl.load(scales_ptr + _bucket_of(first, base + 5, bucket), mask=base + 5 < rem, other=1.0), s)
            r6 = _recip_s(tl.load(scales_ptr + _bucket_of(first, base + 6, bucket), mask=base + 6 < rem, other=1.0), s)
            r7 = _recip_s(tl.load(scales_ptr + _bucket_of(first, base + 7, bucket), mask=base + 7 < rem, other=1.0), s)
        _encode8(v0, v1, v2, v3, v4, v5, v6, v7, r0, r1, r2, r3, r4, r5, r6, r7, s, clip, k1, k2, lo0, hi0,
                 out_ptr, first, base, rem, nbytes, W, WIDE, FULL, CLIP)


@_jit
def _uniform_encode_kernel(x_ptr, scales_ptr, out_ptr, n, nbytes, nb, bucket, s, clip, k1, k2, ctr0,
                           W: tl.constexpr, TRITS: tl.constexpr, G: tl.constexpr, BIG: tl.constexpr,
                           CLIP: tl.constexpr, CLIP_AT: tl.constexpr, WIDE: tl.constexpr):
    """Fields ``c + s`` of every element under its bucket's scale, packed (W bits, or trits): G
    groups of eight values (or bytes of five trits) a program, a group a thread (trits: four bytes a
    thread in whole programs into an aligned output, :func:`_trits_encode_wide`). BIG: buckets hold at least
    a program's values, so a program reads two scales and divides twice (once, and no select a value,
    for a whole program inside one bucket: BIG 2 in the body); else every value finds its bucket
    with a 32-bit division and divides. Whole programs run unmasked. CLIP_AT: ``clip`` points at
    the bound (a float32 on the device) instead of holding it."""
    PER: tl.constexpr = 5 * G if TRITS else 8 * G
    if CLIP_AT:
        clip = tl.load(clip)
    first, rem = _span(n, PER)
    lo0, hi0, nowrap = _counter_halves(ctr0, first, PER)
    if (rem == PER) & nowrap:
        if _one_bucket(first, bucket, PER, BIG):   # one scale for the whole program
            _uniform_encode_body(x_ptr, scales_ptr, out_ptr, first, rem, nbytes, nb, bucket, s, clip, k1, k2, lo0,
                                 hi0, W, TRITS, G, 2, CLIP, WIDE, True)
        else:
            _uniform_encode_body(x_ptr, scales_ptr, out_ptr, first, rem, nbytes, nb, bucket, s, clip, k1, k2, lo0,
                                 hi0, W, TRITS, G, BIG, CLIP, WIDE, True)
    else:
        _uniform_encode_body(x_ptr, scales_ptr, out_ptr, first, rem, nbytes, nb, bucket, s, clip, k1, k2, lo0, hi0,
                             W, TRITS, G, BIG, CLIP, WIDE, False)


@_jit
def _sq64(v):
    w = v.to(tl.float64)
    return w * w


@_jit
def _norm_uniform_body(x_ptr, scales_ptr, out_ptr, first, rem, nbytes, nb, s, clip, k1, k2, lo0, hi0,
                       W: tl.constexpr, BUCKET: tl.constexpr, R: tl.constexpr, CLIP: tl.constexpr,
                       WIDE: tl.constexpr, FULL: tl.constexpr, L2: tl.constexpr):
    """One program of :func:`_norm_uniform_encode_kernel`: values ``first + o`` for ``o < rem``.
    FULL: ``rem`` is the whole program and no counter passes a multiple of 2**32, so nothing is
    masked and the counters' high half is one value."""
    NG: tl.constexpr = R * BUCKET // 8
    base = tl.arange(0, NG) * 8
    v0, v1, v2, v3, v4, v5, v6, v7 = _load8(x_ptr + first, base, rem, FULL)
    if L2:   # float32(sqrt(Σ float64(x)²)), finite roots above FLOAT32_MAX held to it (reference.saturate_norm)
        q = _sq64(v0) + _sq64(v1) + _sq64(v2) + _sq64(v3) + _sq64(v4) + _sq64(v5) + _sq64(v6) + _sq64(v7)
        root = tl.sqrt(tl.sum(tl.reshape(q, (R, BUCKET // 8)), axis=1))   # (float64: sqrt.rn.f64)
        sc = tl.where((root > 3.4028234663852886e38) & (root - root == 0.0), 3.4028234663852886e38, root)
        sc = sc.to(tl.float32)
    else:
        bits = tl.maximum(tl.maximum(tl.maximum(_absbits(v0), _absbits(v1)), tl.maximum(_absbits(v2), _absbits(v3))),
                          tl.maximum(tl.maximum(_absbits(v4), _absbits(v5)), tl.maximum(_absbits(v6), _absbits(v7))))
        sc = tl.max(tl.reshape(bits, (R, BUCKET // 8)), axis=1).to(tl.float32, bitcast=True)
        sc = tl.where(sc < clip, sc, clip)   # (NaN < clip is false: a NaN bucket reads clip; the encode raises)
    rows = first // BUCKET + tl.arange(0, R)
    tl.store(scales_ptr + rows, sc, mask=rows < nb)
    r = tl.reshape(tl.broadcast_to(_recip_s(sc, s)[:, None], (R, BUCKET // 8)), (NG,))
    _encode8(v0, v1, v2, v3, v4, v5, v6, v7, r, r, r, r, r, r, r, r, s, clip, k1, k2, lo0, hi0,
             out_ptr, first, base, rem, nbytes, W, WIDE, FULL, CLIP)


@_jit
def _norm_uniform_encode_kernel(x_ptr, scales_ptr, out_ptr, n, nbytes, nb, s, clip, k1, k2, ctr0,
                                W: tl.constexpr, BUCKET: tl.constexpr, R: tl.constexpr, CLIP: tl.constexpr,
                                WIDE: tl.constexpr, L2: tl.constexpr):
    """QSGD in one pass: R whole buckets of BUCKET (a power of two, a multiple of 8) values per
    program — their norm (max-abs, or with L2 the float64 root of the sum of squares), then their
    fields, packed. Each thread takes whole groups of eight values (two 16-byte loads,
    ``tl.split`` in registers), so packing needs no exchange between threads; counters are uint32
    offsets from the program's first; and a program that is whole and whose counters stay below
    the next multiple of 2**32 (all but at most two) runs unmasked."""
    first, rem = _span(n, R * BUCKET)
    lo0, hi0, nowrap = _counter_halves(ctr0, first, R * BUCKET)
    if (rem == R * BUCKET) & nowrap:
        _norm_uniform_body(x_ptr, scales_ptr, out_ptr, first, rem, nbytes, nb, s, clip, k1, k2, lo0, hi0,
                           W, BUCKET, R, CLIP, WIDE, True, L2)
    else:
        _norm_uniform_body(x_ptr, scales_ptr, out_ptr, first, rem, nbytes, nb, s, clip, k1, k2, lo0, hi0,
                           W, BUCKET, R, CLIP, WIDE, False, L2)


# == the kernel API ===============================================================================
def maxabs_scales(x: torch.Tensor, bucket: Optional[int], clip: Optional[float] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-bucket ``max |x|`` (of ``clamp(x, −clip, clip)`` with ``clip``), float32."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    res = _out(out, nb, torch.float32, xv.device)
    if n:
        # min(max |x|, c), where NaN < c is false (a NaN bucket reads c): a clip on the host is a
        # cap in the kernel (non-negative floats order as their bits do, NaN above inf), so the
        # kernel's maxima are the result; a bound on the device (TernGrad's) is applied after
        at = isinstance(clip, torch.Tensor)
        bits = torch.empty(nb, dtype=torch.int32, device=xv.device) if at else res.view(-1).view(torch.int32)
        bits.zero_()
        # TUNING["maxabs_elems"] values a program, no more rows than there are buckets (MaxNorm's
        # one bucket of the whole tensor: one row, all of a program's values useful)
        e = TUNING["maxabs_elems"]
        cols = min(e, triton.next_power_of_2(d))
        rows = max(1, min(_ROWS, e // cols, triton.next_power_of_2(nb)))
        ncol = -(-d // cols)
        _launch(_maxabs_bits_kernel, (-(-nb // rows) * ncol,), xv, bits, n, d, nb, ncol,
                0x7FFFFFFF if at else int(_clip(clip).view(np.int32)), ROWS=rows, COLS=cols)
        if at:
            m = bits.view(torch.float32)
            torch.where(m < clip, m, clip, out=res.view(-1))
    return res


def l2_scales(x: torch.Tensor, bucket: Optional[int], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.l2_scales`: float64 sums of squares per (bucket, chunk),
    the chunks added by torch on the device, the root rounded once."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    res = _out(out, nb, torch.float32, xv.device)
    if n:
        cols = min(1024, triton.next_power_of_2(d))
        rows = max(1, min(_ROWS, 4096 // cols))
        ncol = -(-d // cols)
        part = torch.empty(nb, ncol, dtype=torch.float64, device=xv.device)
        _launch(_sumsq_kernel, (-(-nb // rows) * ncol,), xv, part, n, d, nb, ncol, ROWS=rows, COLS=cols)
        res.view(-1).copy_(reference.saturate_norm(part.sum(dim=1).sqrt_()))
    return res


def _encode(x, scales, s, bucket, width, rng, clip, out, fused, l2=False):
    """The encodes of uniform codes: under given ``scales``, or ``fused`` with their per-bucket norm
    (max-abs, or ``l2``) in one pass where the bucket allows, else the norm pass first."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    trits = width == 0
    nbytes = (n + 4) // 5 if trits else (n * width + 7) // 8
    packed = _out(out, nbytes, torch.uint8, xv.device)
    k1, k2, ctr0 = _stream(rng, nb * d)
    at = isinstance(clip, torch.Tensor)   # a bound on the device (TernGrad's): read there, not here
    if at and fused:
        clip, at = float(clip), False
    c = clip.to(device=xv.device, dtype=torch.float32) if at else float(_clip(clip))
    if fused and 8 <= d <= _FUSED_MAX and d & (d - 1) == 0 and not trits:
        sc = torch.empty(nb, dtype=torch.float32, device=xv.device)
        if n:
            r = max(1, TUNING["fused_elems"] // d)
            _launch(_norm_uniform_encode_kernel, _grid(nb, r), xv, sc, packed, n, nbytes, nb, s, c, k1, k2, ctr0,
                    W=width, BUCKET=d, R=r, CLIP=bool(c < np.inf), WIDE=packed.data_ptr() % 4 == 0, L2=l2,
                    num_warps=TUNING["fused_warps"])
        return packed, sc
    if fused:
        sc = l2_scales(x, bucket) if l2 else maxabs_scales(x, bucket, clip)
    else:
        sc = _vector(scales, nb, "scales", torch.float32, xv.device)
    if n:
        per, g = (5, _groups("trit_bytes")) if trits else (8, _groups())
        _launch(_uniform_encode_kernel, _grid(-(-n // per), g), xv, sc, packed, n, nbytes, nb, d, s, c, k1,
                k2, ctr0, W=max(width, 1), TRITS=trits, G=g, BIG=d >= per * g,
                CLIP=at or bool(c < np.inf), CLIP_AT=at, WIDE=packed.data_ptr() % 4 == 0)
    return packed, sc


def uniform_encode(x: torch.Tensor, scales: torch.Tensor, s: int, bucket: Optional[int], width: int,
                   rng: RngLike, clip: Optional[float] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.uniform_encode`."""
    return _encode(x, scales, _levels_s(s, _width(width)), bucket, width, rng, clip, out, False)[0]


def maxabs_uniform_encode(x: torch.Tensor, s: int, bucket: Optional[int], width: int, rng: RngLike,
                          clip: Optional[float] = None,
                          out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.maxabs_uniform_encode` (one pass for power-of-two buckets)."""
    return _encode(x, None, _levels_s(s, _width(width)), bucket, width, rng, clip, out, True)


def l2_uniform_encode(x: torch.Tensor, s: int, bucket: Optional[int], width: int, rng: RngLike,
                      out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.l2_uniform_encode` (one pass for power-of-two buckets)."""
    return _encode(x, None, _levels_s(s, _width(width)), bucket, width, rng, None, out, True, l2=True)


def uniform_encode_trits(x: torch.Tensor, scales: torch.Tensor, bucket: Optional[int], rng: RngLike,
                         clip: Optional[float] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.uniform_encode_trits`."""
    return _encode(x, scales, 1, bucket, 0, rng, clip, out, False)[0]


# -- TernGrad's statistics (σ and the bound from gradq.kernels.triton_moments) -------------------------
def terngrad_stats(x: torch.Tensor, clip: Optional[float], bucket: Optional[int]
                   ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """As :func:`gradq.kernels.reference.terngrad_stats`, but the bound is a one-element float32
    tensor on the device (inf for the reference's ``None``: σ = 0), so nothing is read on the host;
    the encodes here take it as ``clip=``. σ, the bound and, with one bucket, the clipped max
    ``min(max |x|, bound)`` come from one read."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    if clip is None or n <= 1:
        return None, maxabs_scales(xv, bucket)
    _, bound, top = _moments(xv, float(_clip(clip)))
    if bucket is None or bucket >= n:
        return bound, top
    return bound, maxabs_scales(xv, bucket, clip=bound)
