"""The Triton backend of :mod:`gradq.kernels`: fused quantize+pack and unpack+dequantize on GPU tensors.

Every function has the signature and the result of its namesake in :mod:`gradq.kernels.reference`:
the same bytes and the same floats for the same seed. :func:`gradq.kernels.backend_for` sends CUDA
tensors here when triton imports. On a machine without a GPU the kernels run under Triton's
interpreter (NumPy on CPU tensors) when ``GRADQ_KERNELS=triton`` asks for it. That mode is slow and
exists so that the suite can check every kernel against the reference without a GPU.

The backend is four modules, and this one exports all of their functions:

* this one: the uniform codes (QSGD, MaxNorm, TernGrad and the RandK variants' fixed-width parts):
  scales, encodes, decodes and ``decode_mean``, TernGrad's statistics;
* :mod:`.triton_levels`: level rounding and its decode (ORQ, Linear), the levels themselves, and the
  one-bit family;
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
  - TernGrad's σ: per-block float64 moments merged in a fixed tree.
  - The one-bit statistics, Linear's, ORQ's and BinGrad-pb's levels: :mod:`.triton_levels`.

Host reads. Fixed-width encodes and decodes never read device memory on the host. Two exceptions:
the checks that refuse corrupt codes (TernGrad's 2-bit fields and trits, level indices) read one
count per call, and RandK's subset reads its count of candidates (or the RandK variants their
``K``-th draw) once per new shared seed.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import PayloadError
from . import reference
from ._args import RngLike, _bucket, _clip, _levels_s, _nbuckets, _stream, _width
from .triton_common import (TUNING, _bucket_of, _bucket_split, _constant, _counter_halves, _flat, _grid, _groups, _jit,
                           _launch, _load8, _out, _pack8_tail, _payload, _span, _store8, _uniform_at, _unpack8, _vector,
                           tl, triton)
# the backend's settings (tests and benchmarks read them here)
from .triton_common import INTERPRETED, VALUE_ARGS  # noqa: F401
# the other families' kernels, under the backend's name (gradq.kernels dispatches to this module)
from .triton_levels import (bingrad_b_encode, bingrad_pb_encode, bingrad_pb_levels, bit_decode,  # noqa: F401
                            levels_decode, levels_encode, linear_encode, linear_levels, onebit_encode, orq_encode,
                            orq_levels, sign_encode, sign_scale_encode, threshold_encode)
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
def _block_moments_kernel(x_ptr, cnt_ptr, mean_ptr, m2_ptr, maxbits_ptr, f_ptr, top_ptr, n, nblocks, clip,
                          BLOCK: tl.constexpr, CHUNK: tl.constexpr, LAST: tl.constexpr):
    """One read per block of BLOCK values: its count, float64 mean and ``Σ (x − mean)²`` (the block
    stays in registers for the second sum), and the largest ``|x|`` bit pattern (atomic max into
    ``maxbits_ptr[0]``). With ``LAST`` the program that finishes last (a ticket counter at
    ``maxbits_ptr[3]``, taken after the program's stores and released with them) merges the
    ``nblocks`` triples (:func:`_merge_chunks`) and writes :func:`_moments_result`: one launch for the
    whole of TernGrad's statistics."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    x32 = tl.load(x_ptr + idx, mask=ok, other=0.0)
    x = x32.to(tl.float64)
    cnt = tl.sum(ok.to(tl.float64), axis=0)
    mean = tl.sum(x, axis=0) / cnt
    d = tl.where(ok, x - mean, 0.0)
    tl.store(cnt_ptr + pid, cnt)
    tl.store(mean_ptr + pid, mean)
    tl.store(m2_ptr + pid, tl.sum(d * d, axis=0))
    tl.atomic_max(maxbits_ptr, tl.max(x32.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0))
    if LAST:
        tl.debug_barrier()   # (every thread's stores before the ticket)
        if tl.atomic_add(maxbits_ptr + 3, 1, sem="acq_rel", scope="gpu") == nblocks - 1:
            bn, bm, bq = _merge_chunks(cnt_ptr, mean_ptr, m2_ptr, nblocks, CHUNK)
            _moments_result(bn, bq, f_ptr, top_ptr, clip)


@triton.jit
def _chan_merge(na, ma, qa, nb, mb, qb):
    """Chan et al.'s merge of two (count, mean, centred sum of squares) triples, float64; a triple
    with count 0 is the identity."""
    tot = na + nb
    safe = tl.where(tot > 0, tot, 1.0)
    d = mb - ma
    return tot, ma + d * (nb / safe), qa + qb + d * d * (na * nb / safe)


@_jit
def _chunk_triple(cnt_ptr, mean_ptr, m2_ptr, offs, nblocks):
    """The triples at ``offs`` (those below ``nblocks``) merged by Triton's fixed reduction tree
    (deterministic), read from L2 (``.cg``: written by other programs of the same launch)."""
    ok = offs < nblocks
    n = tl.load(cnt_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
    m = tl.load(mean_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
    q = tl.load(m2_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
    return tl.reduce((n, m, q), 0, _chan_merge)


@_jit
def _merge_chunks(cnt_ptr, mean_ptr, m2_ptr, nblocks, CHUNK: tl.constexpr):
    """Every one of ``nblocks`` triples merged: each run of CHUNK by :func:`_chunk_triple`, the runs
    in order."""
    offs = tl.arange(0, CHUNK)
    bn, bm, bq = _chunk_triple(cnt_ptr, mean_ptr, m2_ptr, offs, nblocks)
    start = nblocks * 0 + CHUNK   # (a while loop: the interpreter's range() takes no runtime bound)
    while start < nblocks:
        cn, cm, cq = _chunk_triple(cnt_ptr, mean_ptr, m2_ptr, start + offs, nblocks)
        bn, bm, bq = _chan_merge(bn, bm, bq, cn, cm, cq)
        start += CHUNK
    return bn, bm, bq


@_jit
def _moments_result(bn, bq, f_ptr, top_ptr, clip):
    """From the merged count and centred sum of squares, into the float32 ``[max |x|, σ, bound]`` at
    ``f_ptr`` whose max is complete: σ, TernGrad's clip bound ``float32(clip)·σ`` (inf where σ is
    not positive: no clipping, as the host's ``None``) and at ``top_ptr`` the clipped max
    ``min(max |x|, bound)`` (a NaN max reads the bound), all without a host read."""
    sigma = tl.sqrt(bq / bn).to(tl.float32)
    bound = tl.where(sigma > 0, clip * sigma, float("inf"))
    mx = tl.load(f_ptr, cache_modifier=".cg")
    tl.store(f_ptr + 1, sigma)
    tl.store(f_ptr + 2, bound)
    tl.store(top_ptr, tl.where(mx < bound, mx, bound))


@_jit
def _merge_moments_kernel(cnt_ptr, mean_ptr, m2_ptr, ocnt_ptr, omean_ptr, om2_ptr, nblocks, clip,
                          CHUNK: tl.constexpr, FINAL: tl.constexpr):
    """One level of the merge tree (:func:`_moments`): each program reduces CHUNK consecutive
    triples (:func:`_chunk_triple`) into one. With FINAL (one program) ``ocnt_ptr`` is the float32
    ``[max |x|, σ, bound]`` of :func:`_moments` and ``omean_ptr`` the clipped max
    (:func:`_moments_result`)."""
    pid = tl.program_id(0)
    bn, bm, bq = _chunk_triple(cnt_ptr, mean_ptr, m2_ptr, pid.to(tl.int64) * CHUNK + tl.arange(0, CHUNK), nblocks)
    if FINAL:   # (float32 pointers here)
        _moments_result(bn, bq, ocnt_ptr, omean_ptr, clip)
    else:
        tl.store(ocnt_ptr + pid, bn)
        tl.store(omean_ptr + pid, bm)
        tl.store(om2_ptr + pid, bq)


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
def _uniform_encode_body(x_ptr, scales_ptr, out_ptr, first, rem, nbytes, nb, bucket, s, clip, k1, k2, lo0, hi0,
                         W: tl.constexpr, TRITS: tl.constexpr, G: tl.constexpr, BIG: tl.constexpr,
                         CLIP: tl.constexpr, WIDE: tl.constexpr, FULL: tl.constexpr):
    """One program of :func:`_uniform_encode_kernel` (FULL: as in :func:`_norm_uniform_body`)."""
    g = tl.arange(0, G)
    if TRITS:   # a byte of five trits per group: five loads at a stride of five values
        PER: tl.constexpr = 5 * G
        base = g * 5
        if BIG:
            b0, edge = _bucket_split(first, bucket, PER)
            ra = _recip_s(tl.load(scales_ptr + b0), s)
            rb = _recip_s(tl.load(scales_ptr + b0 + 1, mask=b0 + 1 < nb, other=1.0), s)
        byte = tl.zeros((G,), tl.int32)
        for j in tl.static_range(4, -1, -1):   # Horner: t0 + 3·(t1 + 3·(t2 + …))
            o = base + j
            if FULL:
                v = tl.load(x_ptr + first + o)
            else:
                v = tl.load(x_ptr + first + o, mask=o < rem, other=0.0)
            if BIG:
                r = tl.where(o < edge, ra, rb)
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
            ra = _recip_s(tl.load(scales_ptr + b0), s)
            rb = _recip_s(tl.load(scales_ptr + b0 + 1, mask=b0 + 1 < nb, other=1.0), s)
            r0 = tl.where(base < edge, ra, rb)
            r1 = tl.where(base + 1 < edge, ra, rb)
            r2 = tl.where(base + 2 < edge, ra, rb)
            r3 = tl.where(base + 3 < edge, ra, rb)
            r4 = tl.where(base + 4 < edge, ra, rb)
            r5 = tl.where(base + 5 < edge, ra, rb)
            r6 = tl.where(base + 6 < edge, ra, rb)
            r7 = tl.where(base + 7 < edge, ra, rb)
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
    groups of eight values (or five trits) a program, a group a thread. BIG: buckets hold at least
    a program's values, so a program reads two scales and divides twice; else every value finds its
    bucket with a 32-bit division and divides. Whole programs run unmasked. CLIP_AT: ``clip`` points
    at the bound (a float32 on the device) instead of holding it."""
    PER: tl.constexpr = 5 * G if TRITS else 8 * G
    if CLIP_AT:
        clip = tl.load(clip)
    first, rem = _span(n, PER)
    lo0, hi0, nowrap = _counter_halves(ctr0, first, PER)
    if (rem == PER) & nowrap:
        _uniform_encode_body(x_ptr, scales_ptr, out_ptr, first, rem, nbytes, nb, bucket, s, clip, k1, k2, lo0, hi0,
                             W, TRITS, G, BIG, CLIP, WIDE, True)
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


@_jit
def _scale_mult(scales_ptr, first, o, rem, nb, bucket, sf, ma, mb, edge, BIG: tl.constexpr):
    """``scale/s`` of the bucket of each value ``first + o``: with BIG, ``ma`` before offset
    ``edge`` and ``mb`` from it (:func:`_bucket_split`), else a load and a division a value."""
    if BIG:
        return tl.where(o < edge, ma, mb)
    else:
        sc = tl.load(scales_ptr + _bucket_of(first, o, bucket), mask=o < rem, other=0.0)
        return tl.math.div_rn(sc, tl.full(sc.shape, 1.0, tl.float32) * sf)


@_jit
def _over(a, M: tl.constexpr):
    """``a / M`` in float32, correctly rounded: for ``M`` a power of two the product with ``1/M``,
    which is exact in float32, so both round the same real number (subnormals too: the product is
    ``mul.rn``, no flush); else an IEEE division."""
    if M & (M - 1) == 0:
        return a * (1.0 / M)
    else:
        return tl.math.div_rn(a, tl.full(a.shape, M, tl.float32))


@_jit
def _uniform_decode_body(base_ptr, offs_ptr, scales_ptr, out_ptr, bad_ptr, first, rem, nbytes, nb, bucket, s,
                         max_field, M: tl.constexpr, W: tl.constexpr, TRITS: tl.constexpr, G: tl.constexpr,
                         CHECK: tl.constexpr, BIG: tl.constexpr, WIDE: tl.constexpr, FULL: tl.constexpr):
    """One program of :func:`_uniform_decode_kernel`."""
    g = tl.arange(0, G)
    sf = s.to(tl.float32)
    PER: tl.constexpr = 5 * G if TRITS else 8 * G
    b0, edge = _bucket_split(first, bucket, PER)
    nbad = tl.zeros((G,), tl.int32)
    if TRITS:
        base = g * 5
        acc0 = tl.zeros((G,), tl.float32)
        acc1 = tl.zeros((G,), tl.float32)
        acc2 = tl.zeros((G,), tl.float32)
        acc3 = tl.zeros((G,), tl.float32)
        acc4 = tl.zeros((G,), tl.float32)
        for j in tl.static_range(M):
            data = base_ptr + tl.load(offs_ptr + j)
            byte = tl.load(data + first // 5 + g, mask=first // 5 + g < nbytes, other=0).to(tl.int32)
            nbad += (byte > 242).to(tl.int32)
            sj = scales_ptr + j * nb
            ma = tl.math.div_rn(tl.load(sj + b0), sf)
            mb = tl.math.div_rn(tl.load(sj + b0 + 1, mask=b0 + 1 < nb, other=0.0), sf)
            t = byte
            d0 = ((t % 3) - s).to(tl.float32) * _scale_mult(sj, first, base, rem, nb, bucket, sf, ma, mb, edge, BIG)
            t = t // 3
            d1 = ((t % 3) - s).to(tl.float32) * _scale_mult(sj, first, base + 1, rem, nb, bucket, sf, ma, mb, edge,
                                                             BIG)
            t = t // 3
            d2 = ((t % 3) - s).to(tl.float32) * _scale_mult(sj, first, base + 2, rem, nb, bucket, sf, ma, mb, edge,
                                                             BIG)
            t = t // 3
            d3 = ((t % 3) - s).to(tl.float32) * _scale_mult(sj, first, base + 3, rem, nb, bucket, sf, ma, mb, edge,
                                                             BIG)
            t = t // 3
            d4 = ((t % 3) - s).to(tl.float32) * _scale_mult(sj, first, base + 4, rem, nb, bucket, sf, ma, mb, edge,
                                                             BIG)
            if j == 0:
                acc0, acc1, acc2, acc3, acc4 = d0, d1, d2, d3, d4
            else:
                acc0, acc1, acc2, acc3, acc4 = acc0 + d0, acc1 + d1, acc2 + d2, acc3 + d3, acc4 + d4
        if M > 1:
            acc0, acc1, acc2 = _over(acc0, M), _over(acc1, M), _over(acc2, M)
            acc3, acc4 = _over(acc3, M), _over(acc4, M)
        tl.store(out_ptr + first + base, acc0, mask=base < rem)
        tl.store(out_ptr + first + base + 1, acc1, mask=base + 1 < rem)
        tl.store(out_ptr + first + base + 2, acc2, mask=base + 2 < rem)
        tl.store(out_ptr + first + base + 3, acc3, mask=base + 3 < rem)
        tl.store(out_ptr + first + base + 4, acc4, mask=base + 4 < rem)
    else:
        base = g * 8
        bfirst = first // 8 * W
        a0 = tl.zeros((G,), tl.float32)
        a1 = tl.zeros((G,), tl.float32)
        a2 = tl.zeros((G,), tl.float32)
        a3 = tl.zeros((G,), tl.float32)
        a4 = tl.zeros((G,), tl.float32)
        a5 = tl.zeros((G,), tl.float32)
        a6 = tl.zeros((G,), tl.float32)
        a7 = tl.zeros((G,), tl.float32)
        for j in tl.static_range(M):
            data = base_ptr + tl.load(offs_ptr + j) + bfirst
            f0, f1, f2, f3, f4, f5, f6, f7 = _unpack8(data, g, nbytes - bfirst, W, WIDE and FULL)
            if CHECK:
                if FULL:
                    nbad += ((f0 > max_field).to(tl.int32) + (f1 > max_field).to(tl.int32)
                             + (f2 > max_field).to(tl.int32) + (f3 > max_field).to(tl.int32)
                             + (f4 > max_field).to(tl.int32) + (f5 > max_field).to(tl.int32)
                             + (f6 > max_field).to(tl.int32) + (f7 > max_field).to(tl.int32))
                else:
                    nbad += (((f0 > max_field) & (base < rem)).to(tl.int32)
                             + ((f1 > max_field) & (base + 1 < rem)).to(tl.int32)
                             + ((f2 > max_field) & (base + 2 < rem)).to(tl.int32)
                             + ((f3 > max_field) & (base + 3 < rem)).to(tl.int32)
                             + ((f4 > max_field) & (base + 4 < rem)).to(tl.int32)
                             + ((f5 > max_field) & (base + 5 < rem)).to(tl.int32)
                             + ((f6 > max_field) & (base + 6 < rem)).to(tl.int32)
                             + ((f7 > max_field) & (base + 7 < rem)).to(tl.int32))
            sj = scales_ptr + j * nb
            ma = tl.math.div_rn(tl.load(sj + b0), sf)
            mb = tl.math.div_rn(tl.load(sj + b0 + 1, mask=b0 + 1 < nb, other=0.0), sf)
            d0 = (f0 - s).to(tl.float32) * _scale_mult(sj, first, base, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d1 = (f1 - s).to(tl.float32) * _scale_mult(sj, first, base + 1, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d2 = (f2 - s).to(tl.float32) * _scale_mult(sj, first, base + 2, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d3 = (f3 - s).to(tl.float32) * _scale_mult(sj, first, base + 3, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d4 = (f4 - s).to(tl.float32) * _scale_mult(sj, first, base + 4, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d5 = (f5 - s).to(tl.float32) * _scale_mult(sj, first, base + 5, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d6 = (f6 - s).to(tl.float32) * _scale_mult(sj, first, base + 6, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d7 = (f7 - s).to(tl.float32) * _scale_mult(sj, first, base + 7, rem, nb, bucket, sf, ma, mb, edge, BIG)
            if j == 0:
                a0, a1, a2, a3, a4, a5, a6, a7 = d0, d1, d2, d3, d4, d5, d6, d7
            else:
                a0, a1, a2, a3 = a0 + d0, a1 + d1, a2 + d2, a3 + d3
                a4, a5, a6, a7 = a4 + d4, a5 + d5, a6 + d6, a7 + d7
        if M > 1:
            a0, a1, a2, a3 = _over(a0, M), _over(a1, M), _over(a2, M), _over(a3, M)
            a4, a5, a6, a7 = _over(a4, M), _over(a5, M), _over(a6, M), _over(a7, M)
        _store8(out_ptr + first, base, rem, a0, a1, a2, a3, a4, a5, a6, a7, FULL)
    if CHECK:
        tl.store(bad_ptr + tl.program_id(0), tl.sum(nbad, axis=0))


@_jit
def _uniform_decode_kernel(base_ptr, offs_ptr, scales_ptr, out_ptr, bad_ptr, n, nbytes, nb, bucket, s,
                           max_field, M: tl.constexpr, W: tl.constexpr, TRITS: tl.constexpr, G: tl.constexpr,
                           CHECK: tl.constexpr, BIG: tl.constexpr, WIDE: tl.constexpr):
    """``out = (((d_0 + d_1) + …) / M``, ``d_j = float32(field − s)·(scale_jb / s)``, and, with
    CHECK, the number of fields above ``max_field`` (trits: bytes above 242) in ``bad_ptr[program]``.
    A group of eight fields (or a byte of trits) a thread; BIG and whole programs as in
    :func:`_uniform_encode_kernel`. WIDE: every payload's bytes are 4-byte aligned."""
    PER: tl.constexpr = 5 * G if TRITS else 8 * G
    first, rem = _span(n, PER)
    if rem == PER:
        _uniform_decode_body(base_ptr, offs_ptr, scales_ptr, out_ptr, bad_ptr, first, rem, nbytes, nb, bucket, s,
                             max_field, M, W, TRITS, G, CHECK, BIG, WIDE, True)
    else:
        _uniform_decode_body(base_ptr, offs_ptr, scales_ptr, out_ptr, bad_ptr, first, rem, nbytes, nb, bucket, s,
                             max_field, M, W, TRITS, G, CHECK, BIG, WIDE, False)


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
        per = 5 if trits else 8
        _launch(_uniform_encode_kernel, _grid(-(-n // per), _groups()), xv, sc, packed, n, nbytes, nb, d, s, c, k1,
                k2, ctr0, W=max(width, 1), TRITS=trits, G=_groups(), BIG=d >= per * _groups(),
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


def _rows(packed: Sequence[torch.Tensor], nbytes: int, what: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A uint8 base tensor, the int64 offset of each payload's bytes from it (one payload itself,
    the storage several share (a received buffer: no copy), or else their concatenation), and
    whether every payload starts at a multiple of 4 bytes (the kernels' word loads)."""
    datas = [_payload(t, nbytes, what) for t in packed]
    if len(datas) == 1:
        return datas[0], _constant(datas[0].device, torch.int64), datas[0].data_ptr() % 4 == 0
    st = packed[0].untyped_storage()
    dev = packed[0].device
    if all(t.untyped_storage().data_ptr() == st.data_ptr() and t.is_contiguous() for t in packed):
        base = torch.empty(0, dtype=torch.uint8, device=dev).set_(st)
        offs = [t.storage_offset() for t in packed]
        aligned = all((base.data_ptr() + o) % 4 == 0 for o in offs)
        step = offs[1] - offs[0]
        if step and offs == list(range(offs[0], offs[0] + step * len(offs), step)):
            # payloads at a fixed stride (a received buffer): offsets made on the device, with no
            # host-to-device copy (one from pageable memory can wait for the stream)
            return (base, torch.arange(offs[0], offs[0] + step * len(offs), step, dtype=torch.int64, device=dev),
                    aligned)
        return base, torch.tensor(offs, dtype=torch.int64, device=dev), aligned
    base = torch.cat(datas)
    return (base, torch.arange(len(packed), dtype=torch.int64, device=dev) * nbytes,
            base.data_ptr() % 4 == 0 and nbytes % 4 == 0)


def _decode_mean(packed, scales, s, bucket, width, n, out, max_field):
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not packed:
        raise ValueError("need at least one payload")
    if len(scales) != len(packed):
        raise ValueError(f"{len(packed)} packed payloads but {len(scales)} scale vectors")
    trits = width == 0
    nbytes = (n + 4) // 5 if trits else (n * width + 7) // 8
    base, offs, aligned = _rows(packed, nbytes, "trits" if trits else f"{width}-bit codes")
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    dev = base.device
    vecs = [_vector(sc, nb, f"scales[{k}]", torch.float32, dev) for k, sc in enumerate(scales)]
    sv = vecs[0] if len(vecs) == 1 else torch.stack(vecs)
    res = _out(out, n, torch.float32, dev)
    if n:
        per = 5 if trits else 8
        grid = _grid(-(-n // per), _groups())
        check = trits or max_field is not None   # only where a code can be invalid
        bad = torch.zeros(grid[0], dtype=torch.int32, device=dev) if check else _constant(dev, torch.int32)
        _launch(_uniform_decode_kernel, grid, base, offs, sv, res, bad, n, nbytes, nb, d, s,
                255 if max_field is None else max_field, M=len(packed), W=max(width, 1), TRITS=trits, G=_groups(),
                CHECK=check, BIG=d >= per * _groups(), WIDE=aligned)
        if check:  # (a host read)
            nbad = int(bad.sum())
            if nbad:
                what = "bytes above 242 (3**5 - 1)" if trits else f"fields above {max_field}"
                raise PayloadError(f"corrupt codes: {nbad} {what}")
    return res


def uniform_decode(packed: torch.Tensor, scales: torch.Tensor, s: int, bucket: Optional[int], width: int,
                   n: int, max_field: Optional[int] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.uniform_decode`."""
    return _decode_mean([packed], [scales], _levels_s(s, None), bucket, _width(width), n, out, max_field)


def uniform_decode_trits(packed: torch.Tensor, scales: torch.Tensor, bucket: Optional[int], n: int,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.uniform_decode_trits`."""
    return _decode_mean([packed], [scales], 1, bucket, 0, n, out, None)


def uniform_decode_mean(packed: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], s: int,
                        bucket: Optional[int], width: int, n: int, max_field: Optional[int] = None,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.uniform_decode_mean`, in one pass over the M payloads."""
    return _decode_mean(packed, scales, _levels_s(s, None), bucket, _width(width), n, out, max_field)


def uniform_decode_trits_mean(packed: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                              bucket: Optional[int], n: int,
                              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.uniform_decode_trits_mean`."""
    return _decode_mean(packed, scales, 1, bucket, 0, n, out, None)


# -- TernGrad's statistics -------------------------------------------------------------------------
_MOMENT_BLOCK = 4096
_MERGE_CHUNK = 1024
_LAST_RUNS = 8         # most runs of _MERGE_CHUNK blocks (33.5M values) the last block merges (moment_launches 1)


def _moments(xv: torch.Tensor, clip: float = float("inf")) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(σ, bound, clipped max)`` in one read of ``xv``, as float32 device tensors (no host read):
    σ as a 0-dim tensor, TernGrad's bound ``float32(clip)·σ`` (inf where σ ≤ 0 or is NaN) as one
    element, and ``min(max |x|, bound)`` as one element. Per block its count, mean and centred sum
    of squares in float64, then the blocks' triples merged (Chan et al.'s update): with
    ``TUNING["moment_launches"] = 1`` by the block that finishes last, in the same launch, for up to
    ``_LAST_RUNS`` runs of ``_MERGE_CHUNK`` blocks; otherwise (the shipped setting, until a GPU has
    timed and checked the other) by a tree of Triton programs, each merging up to ``_MERGE_CHUNK``
    of them (3 launches for up to 2^32 values). σ equals the reference's two-pass float64 σ rounded
    to float32, except within float64 rounding (~1e-13 relative) of a float32 rounding tie."""
    n = xv.numel()
    grid = _grid(n, _MOMENT_BLOCK)
    cnt, mean, m2 = torch.empty(3, grid[0], dtype=torch.float64, device=xv.device)   # (one allocation)
    out = torch.zeros(4, dtype=torch.int32, device=xv.device)   # [max |x| bits, σ, bound, blocks done]
    f = out.view(torch.float32)
    top = torch.empty(1, dtype=torch.float32, device=xv.device)
    last = TUNING["moment_launches"] == 1 and grid[0] <= _LAST_RUNS * _MERGE_CHUNK
    _launch(_block_moments_kernel, grid, xv, cnt, mean, m2, out, f, top, n, grid[0], float(clip), BLOCK=_MOMENT_BLOCK,
            CHUNK=_MERGE_CHUNK, LAST=last)
    if not last:
        while cnt.numel() > _MERGE_CHUNK:
            k = -(-cnt.numel() // _MERGE_CHUNK)
            nxt = torch.empty(3, k, dtype=torch.float64, device=xv.device)
            _launch(_merge_moments_kernel, (k,), cnt, mean, m2, *nxt, cnt.numel(), 0.0, CHUNK=_MERGE_CHUNK,
                    FINAL=False)
            cnt, mean, m2 = nxt
        _launch(_merge_moments_kernel, (1,), cnt, mean, m2, f, top, f, cnt.numel(), float(clip), CHUNK=_MERGE_CHUNK,
                FINAL=True)
    return f[1], f[2:3], top


def population_std(x: torch.Tensor) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.population_std`, in one read (see :func:`_moments`)."""
    xv = _flat(x, "x", torch.float32)
    if xv.numel() == 0:
        return torch.tensor(float("nan"), device=xv.device)
    return _moments(xv)[0]


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
