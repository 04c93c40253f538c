"""The Triton backend of :mod:`gradq.kernels`: fused quantize+pack and unpack+dequantize on GPU tensors.

Every function has the signature and the result of its namesake in :mod:`gradq.kernels.reference`:
the same bytes and the same floats for the same seed. :func:`gradq.kernels.backend_for` sends CUDA
tensors here when triton imports. On a machine without a GPU the kernels run under Triton's
interpreter (NumPy on CPU tensors) when ``GRADQ_KERNELS=triton`` asks for it. That mode is slow and
exists so that the suite can check every kernel against the reference without a GPU.

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
  - The one-bit statistics: whole power-of-two buckets per program, summed in the reference's
    pairwise order (:func:`_fold_rows`); a partial last bucket in one more program.
  - Linear's levels: each bucket sorted in registers by its order-preserving integer keys.
  - ORQ's levels (up to 17) and BinGrad-pb's level: the same sort, then the reference's float64
    running sums in sorted order (``tl.cumsum``). Under the interpreter a scan runs in order, as on
    the CPU; on a GPU it is a parallel scan, whose sums may differ in their last bits (as torch's
    CUDA cumsum, which these levels took before, does too). Buckets above ``_SORT_MAX`` values and
    more ORQ levels take the reference in torch.

Host reads. Fixed-width encodes and decodes never read device memory on the host. Two exceptions:
the checks that refuse corrupt codes (TernGrad's 2-bit fields and trits, level indices) read one
count per call, and TernGrad's clip bound is a host float.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from typing import Optional, Sequence

import numpy as np
import torch

#: True when no GPU is present: the kernels run under Triton's interpreter (for tests). The
#: interpreter is switched on for the process before triton is first imported (triton's own
#: library functions are built for one mode at import). ``GRADQ_TRITON_INTERPRET=0`` keeps the
#: compiler on without a GPU: kernels cannot run then, but they can be compiled for a GPU target
#: (what ``tests/kernels/test_triton_compile.py`` does).
INTERPRETED = {"0": False, "1": True}.get(os.environ.get("GRADQ_TRITON_INTERPRET", "").strip(),
                                          not torch.cuda.is_available())
if INTERPRETED:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ImportError("triton was imported before gradq's Triton backend on a machine without a GPU: set "
                          "TRITON_INTERPRET=1 before importing triton to run its kernels under the interpreter")
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ..errors import PayloadError  # noqa: E402
from . import reference  # noqa: E402
from ._args import RngLike, _bucket, _clip, _levels_s, _nbuckets, _stream, _width  # noqa: E402

#: Integer arguments that are values rather than sizes. Triton compiles a kernel of its own when an
#: integer argument equals 1 (passed as a constant, on which ``s.to(...)`` fails) or is divisible by
#: 16; for these that would break the kernel (2-bit codes have ``s = 1``) or compile new kernels as
#: the per-step seeds change, so they are never specialized.
VALUE_ARGS = ("s", "clip", "k1", "k2", "ctr0", "max_field", "L", "w", "h0", "h1", "base")


def _jit(fn):
    names = [n for n, p in inspect.signature(fn).parameters.items()
             if n in VALUE_ARGS and "constexpr" not in str(p.annotation)]
    k = triton.jit(fn, do_not_specialize=names) if names else triton.jit(fn)
    if INTERPRETED and _Interpreted is not None and type(k) is _Interpreted:
        k.__class__ = _NestedCall
    return k


# Under the interpreter, Triton re-patches the whole of ``triton.language`` each time a kernel calls a
# device function (about 1 ms a call, a quarter of the interpreter tests' time), although the kernel's
# launch has patched it already. gradq's device functions are only ever called from gradq's kernels
# (one ``tl`` for all), so theirs skip that step; Triton's own library functions keep it.
try:
    from triton.runtime.interpreter import InterpretedFunction as _Interpreted
    from triton.runtime.errors import InterpreterError as _InterpreterError
except ImportError:  # (another Triton layout: every call takes Triton's own path)
    _Interpreted = None
else:
    if not hasattr(_Interpreted, "rewrite"):
        _Interpreted = None
    else:
        class _NestedCall(_Interpreted):
            def __call__(self, *args, **kwargs):
                fn = self.rewrite()
                try:
                    return fn(*args, **kwargs)
                except Exception as e:
                    raise _InterpreterError(repr(e)) from e


_FUSED_MAX = 4096      # largest power-of-two bucket the one-pass QSGD encode handles
_ROWS = 64             # buckets per program (at most) in the max-abs pass

#: Launch shapes: how much work a program takes and how many warps run it. None of them changes a
#: result (every value's randomness is its own counter, every bucket is folded whole by one
#: program), only the speed; ``benchmarks/bench_triton_tuning.py`` times the alternatives on a GPU
#: (and checks that the bytes stay the same). The interpreter ignores the warps.
#: The values are the fastest measured on an H100 (docs/performance.md, "Launch settings"): two warps
#: a program gave the one-bit statistics 2.0–2.6× and Linear's sort 1.3× against four.
TUNING = {
    "groups": 64,           # groups of 8 fields (or 5 trits) a program: the element-wise encodes, decodes
    "groups_warps": 2,
    "fused_elems": 2048,    # values a program in the one-pass QSGD encode (whole buckets)
    "fused_warps": 2,
    "stats_elems": 1024,    # values a program in the one-bit statistics (whole buckets)
    "stats_warps": 2,
    "sort_elems": 1024,     # values a program in Linear's levels (whole buckets, padded to powers of two)
    "sort_warps": 2,
    "orq_warp_elems": 128,  # values a warp in ORQ's levels (one bucket a program; not yet timed on a GPU)
    "elias_warps": 8,       # the Elias stream's passes (gradq.kernels.triton_elias; not yet timed; 4 spilled)
}


def _tuning_from_env() -> None:
    """``GRADQ_TRITON_TUNING=FILE``: a JSON object of ``TUNING`` entries to use instead of the
    shipped ones (``benchmarks/bench_triton_tuning.py --best FILE`` writes one for the GPU at hand)."""
    path = os.environ.get("GRADQ_TRITON_TUNING")
    if not path:
        return
    with open(path) as f:
        new = json.load(f)
    if not isinstance(new, dict):
        raise ValueError(f"GRADQ_TRITON_TUNING={path}: expected a JSON object, got {new!r}")
    bad = {k: v for k, v in new.items() if k not in TUNING or type(v) is not int or v < 1 or v & (v - 1)}
    if bad:
        raise ValueError(f"GRADQ_TRITON_TUNING={path}: expected powers of two for keys of {sorted(TUNING)}, "
                         f"got {bad!r}")
    TUNING.update(new)


_tuning_from_env()


def _groups() -> int:
    return TUNING["groups"]


def _launch(kernel, grid, *args, **meta) -> None:
    if INTERPRETED:
        meta.pop("num_warps", None)
    else:
        meta["enable_fp_fusion"] = False  # the reference rounds every product and sum on its own
        if "G" in meta:                   # the element-wise kernels
            meta.setdefault("num_warps", TUNING["groups_warps"])
    kernel[grid](*args, **meta)


# == device helpers ===============================================================================
@_jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@_jit
def _uniform_at(lo0, hi0, o, k1, k2, NOWRAP: tl.constexpr):
    """Uniform float32 in [0, 1) (24 random bits) of the counters ``(hi0 << 32 | lo0) + o``, for
    int32 offsets ``o ≥ 0`` from one int64 counter split into uint32 halves, so that no value needs
    int64 arithmetic. NOWRAP: the caller knows that ``lo0 + o`` does not pass 2**32 (the high half
    is then ``hi0`` throughout)."""
    lo = lo0 + o.to(tl.uint32)
    if NOWRAP:
        hi = hi0
    else:
        hi = hi0 + (lo < lo0).to(tl.uint32)
    h = _mix32(_mix32(lo * tl.full((), 0x9E3779B9, tl.uint32) + k1.to(tl.uint32)) ^ k2.to(tl.uint32) ^ hi)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


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
def _maxabs_bits_kernel(x_ptr, bits_ptr, n, bucket, nb, ncol, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Per bucket, the largest ``|x|`` bit pattern (for non-NaN floats the integer order of the
    magnitude bits is the order of ``|x|``; NaN ranks above inf, as in the numba kernel), over a
    ``(rows, column chunk)`` grid merged by an atomic max (order-free, so deterministic)."""
    pid = tl.program_id(0).to(tl.int64)  # one axis (CUDA limits the others to 65535 programs)
    rows = (pid // ncol) * ROWS + tl.arange(0, ROWS)
    c = (pid % ncol) * COLS + tl.arange(0, COLS)
    idx = rows[:, None].to(tl.int64) * bucket + c[None, :]
    ok = (rows[:, None] < nb) & (c[None, :] < bucket) & (idx < n)
    bits = tl.load(x_ptr + idx, mask=ok, other=0.0).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(bits_ptr + rows, tl.max(bits, axis=1), mask=rows < nb)


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
def _block_moments_kernel(x_ptr, cnt_ptr, mean_ptr, m2_ptr, maxbits_ptr, n, BLOCK: tl.constexpr):
    """One read per block of BLOCK values: its count, float64 mean and ``Σ (x − mean)²`` (the block
    stays in registers for the second sum), and the largest ``|x|`` bit pattern (atomic max)."""
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


@triton.jit
def _chan_merge(na, ma, qa, nb, mb, qb):
    """Chan et al.'s merge of two (count, mean, centred sum of squares) triples, float64; a triple
    with count 0 is the identity."""
    tot = na + nb
    safe = tl.where(tot > 0, tot, 1.0)
    d = mb - ma
    return tot, ma + d * (nb / safe), qa + qb + d * d * (na * nb / safe)


@_jit
def _merge_moments_kernel(cnt_ptr, mean_ptr, m2_ptr, ocnt_ptr, omean_ptr, om2_ptr, nblocks,
                          CHUNK: tl.constexpr, FINAL: tl.constexpr):
    """One level of the merge tree: each program reduces CHUNK consecutive (count, mean, centred sum
    of squares) triples by Triton's fixed reduction tree (deterministic) into one triple; with FINAL
    (one program) it stores σ as float32 at ``ocnt_ptr`` instead."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < nblocks
    n = tl.load(cnt_ptr + offs, mask=ok, other=0.0)
    m = tl.load(mean_ptr + offs, mask=ok, other=0.0)
    q = tl.load(m2_ptr + offs, mask=ok, other=0.0)
    bn, bm, bq = tl.reduce((n, m, q), 0, _chan_merge)
    if FINAL:
        tl.store(ocnt_ptr, tl.sqrt(bq / bn).to(tl.float32))   # (a float32 pointer here)
    else:
        tl.store(ocnt_ptr + pid, bn)
        tl.store(omean_ptr + pid, bm)
        tl.store(om2_ptr + pid, bq)


@_jit
def _split4(t):
    """The four columns of ``[N, 4]`` as four ``[N]`` tensors. ``tl.split`` keeps a thread's values
    in its registers, where a sum over the axis would shuffle them between threads."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    return c0, c1, c2, c3


@_jit
def _absbits(v):
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@_jit
def _pack8(f0, f1, f2, f3, f4, f5, f6, f7, out_ptr, g, left, W: tl.constexpr, WIDE: tl.constexpr):
    """Store groups ``g`` of eight W-bit uint32 fields as W little-endian bytes each, at ``out_ptr``
    (bytes from ``left`` on are not written). WIDE: every group is whole and ``out_ptr`` is 4-byte
    aligned, so 2-, 4- and 8-bit groups go out as one 16- or 32-bit word, or two."""
    if W == 8 and WIDE:
        p = out_ptr.to(tl.pointer_type(tl.uint32))
        tl.store(p + 2 * g, f0 | (f1 << 8) | (f2 << 16) | (f3 << 24))
        tl.store(p + 2 * g + 1, f4 | (f5 << 8) | (f6 << 16) | (f7 << 24))
    elif W <= 4:
        word = (f0 | (f1 << W) | (f2 << 2 * W) | (f3 << 3 * W) | (f4 << 4 * W) | (f5 << 5 * W) | (f6 << 6 * W)
                | (f7 << 7 * W))
        if WIDE and W == 4:
            tl.store(out_ptr.to(tl.pointer_type(tl.uint32)) + g, word)
        elif WIDE and W == 2:
            tl.store(out_ptr.to(tl.pointer_type(tl.uint16)) + g, word.to(tl.uint16))
        else:
            for b in tl.static_range(W):
                tl.store(out_ptr + g * W + b, ((word >> 8 * b) & 0xFF).to(tl.uint8), mask=g * W + b < left)
    else:
        word = (f0.to(tl.uint64) | (f1.to(tl.uint64) << W) | (f2.to(tl.uint64) << 2 * W)
                | (f3.to(tl.uint64) << 3 * W) | (f4.to(tl.uint64) << 4 * W) | (f5.to(tl.uint64) << 5 * W)
                | (f6.to(tl.uint64) << 6 * W) | (f7.to(tl.uint64) << 7 * W))
        for b in tl.static_range(W):
            tl.store(out_ptr + g * W + b, ((word >> 8 * b) & 0xFF).to(tl.uint8), mask=g * W + b < left)


@_jit
def _load8(ptr, base, rem, FULL: tl.constexpr):
    """Values ``ptr[base + j]``, j = 0..7, for group starts ``base`` (int32, multiples of 8): two
    16-byte loads a group, split in registers. Without FULL, offsets from ``rem`` on read 0."""
    o = base[:, None] + tl.arange(0, 4)[None, :]
    if FULL:
        va = tl.load(ptr + o)
        vb = tl.load(ptr + 4 + o)
    else:
        va = tl.load(ptr + o, mask=o < rem, other=0.0)
        vb = tl.load(ptr + 4 + o, mask=o + 4 < rem, other=0.0)
    v0, v1, v2, v3 = _split4(va)
    v4, v5, v6, v7 = _split4(vb)
    return v0, v1, v2, v3, v4, v5, v6, v7


@_jit
def _pack8_tail(f0, f1, f2, f3, f4, f5, f6, f7, out_ptr, first, base, rem, nbytes, W: tl.constexpr,
                WIDE: tl.constexpr, FULL: tl.constexpr):
    """:func:`_pack8` of the groups at ``first + base``; without FULL, fields from ``rem`` on are
    zero bits (the reference's padding) and no byte past ``nbytes`` is written."""
    if not FULL:
        f0 = tl.where(base < rem, f0, 0)
        f1 = tl.where(base + 1 < rem, f1, 0)
        f2 = tl.where(base + 2 < rem, f2, 0)
        f3 = tl.where(base + 3 < rem, f3, 0)
        f4 = tl.where(base + 4 < rem, f4, 0)
        f5 = tl.where(base + 5 < rem, f5, 0)
        f6 = tl.where(base + 6 < rem, f6, 0)
        f7 = tl.where(base + 7 < rem, f7, 0)
    bfirst = first // 8 * W
    _pack8(f0, f1, f2, f3, f4, f5, f6, f7, out_ptr + bfirst, base // 8, nbytes - bfirst, W, WIDE and FULL)


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
def _span(n, PER: tl.constexpr):
    """This program's values: the first one's index (int64) and how many there are (int32, ≤ PER)."""
    first = tl.program_id(0).to(tl.int64) * PER
    return first, tl.minimum(n - first, PER).to(tl.int32)


@_jit
def _counter_halves(ctr0, first, PER: tl.constexpr):
    """The counter of value ``first`` split into uint32 halves, and whether the PER counters from it
    stay below the next multiple of 2**32 (then the high half is one value: ``_uniform_at``'s NOWRAP)."""
    c = ctr0 + first
    lo0 = (c & 0xFFFFFFFF).to(tl.uint32)
    return lo0, (c >> 32).to(tl.uint32), lo0 <= 0xFFFFFFFF - PER


@_jit
def _bucket_split(first, bucket, PER: tl.constexpr):
    """For buckets of at least PER values: the bucket ``b0`` of value ``first`` and the offset from
    ``first`` (int32, at most PER) where bucket ``b0 + 1`` starts."""
    b0 = first // bucket
    return b0, tl.minimum((b0 + 1) * bucket - first, PER).to(tl.int32)


@_jit
def _bucket_of(first, o, bucket):
    """The bucket (int64) of values ``first + o`` (``o`` int32 offsets < 2**31, buckets < 2**31):
    one 64-bit division a program, 32-bit ones a value."""
    b0 = first // bucket
    r0 = (first - b0 * bucket).to(tl.int32)
    return b0 + (r0 + o) // tl.cast(bucket, tl.int32)


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
                           CLIP: tl.constexpr, WIDE: tl.constexpr):
    """Fields ``c + s`` of every element under its bucket's scale, packed (W bits, or trits): G
    groups of eight values (or five trits) a program, a group a thread. BIG: buckets hold at least
    a program's values, so a program reads two scales and divides twice; else every value finds its
    bucket with a 32-bit division and divides. Whole programs run unmasked."""
    PER: tl.constexpr = 5 * G if TRITS else 8 * G
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
def _unpack8(data_ptr, g, left, W: tl.constexpr, WIDE: tl.constexpr):
    """The eight W-bit fields (int32) of each group ``g``, from W little-endian bytes a group at
    ``data_ptr`` (bytes from ``left`` on read 0). WIDE: every group is whole and ``data_ptr`` is
    4-byte aligned, so 2-, 4- and 8-bit groups come in as one 16- or 32-bit word, or two."""
    if W == 8:
        if WIDE:
            p = data_ptr.to(tl.pointer_type(tl.uint32))
            lo = tl.load(p + 2 * g)
            hi = tl.load(p + 2 * g + 1)
            f0, f1, f2, f3 = lo & 0xFF, (lo >> 8) & 0xFF, (lo >> 16) & 0xFF, lo >> 24
            f4, f5, f6, f7 = hi & 0xFF, (hi >> 8) & 0xFF, (hi >> 16) & 0xFF, hi >> 24
        else:
            f0 = tl.load(data_ptr + g * 8, mask=g * 8 < left, other=0)
            f1 = tl.load(data_ptr + g * 8 + 1, mask=g * 8 + 1 < left, other=0)
            f2 = tl.load(data_ptr + g * 8 + 2, mask=g * 8 + 2 < left, other=0)
            f3 = tl.load(data_ptr + g * 8 + 3, mask=g * 8 + 3 < left, other=0)
            f4 = tl.load(data_ptr + g * 8 + 4, mask=g * 8 + 4 < left, other=0)
            f5 = tl.load(data_ptr + g * 8 + 5, mask=g * 8 + 5 < left, other=0)
            f6 = tl.load(data_ptr + g * 8 + 6, mask=g * 8 + 6 < left, other=0)
            f7 = tl.load(data_ptr + g * 8 + 7, mask=g * 8 + 7 < left, other=0)
    else:
        if W <= 4:
            if WIDE and W == 4:
                word = tl.load(data_ptr.to(tl.pointer_type(tl.uint32)) + g)
            elif WIDE and W == 2:
                word = tl.load(data_ptr.to(tl.pointer_type(tl.uint16)) + g).to(tl.uint32)
            else:
                word = tl.zeros(g.shape, tl.uint32)
                for b in tl.static_range(W):
                    word = word | (tl.load(data_ptr + g * W + b, mask=g * W + b < left, other=0).to(tl.uint32)
                                   << 8 * b)
        else:
            word = tl.zeros(g.shape, tl.uint64)
            for b in tl.static_range(W):
                word = word | (tl.load(data_ptr + g * W + b, mask=g * W + b < left, other=0).to(tl.uint64) << 8 * b)
        m = (1 << W) - 1
        f0, f1, f2, f3 = word & m, (word >> W) & m, (word >> 2 * W) & m, (word >> 3 * W) & m
        f4, f5, f6, f7 = (word >> 4 * W) & m, (word >> 5 * W) & m, (word >> 6 * W) & m, (word >> 7 * W) & m
    return (f0.to(tl.int32), f1.to(tl.int32), f2.to(tl.int32), f3.to(tl.int32), f4.to(tl.int32), f5.to(tl.int32),
            f6.to(tl.int32), f7.to(tl.int32))


@_jit
def _join4(c0, c1, c2, c3):
    """``[N, 4]`` from four ``[N]`` columns (the inverse of :func:`_split4`, in registers)."""
    t = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    return tl.reshape(t, (c0.shape[0], 4))


@_jit
def _store8(ptr, base, rem, v0, v1, v2, v3, v4, v5, v6, v7, FULL: tl.constexpr):
    """``ptr[base + j] = v_j`` for groups of eight at ``base``: two 16-byte stores a group (the
    inverse of :func:`_load8`); without FULL, nothing from offset ``rem`` on."""
    o = base[:, None] + tl.arange(0, 4)[None, :]
    if FULL:
        tl.store(ptr + o, _join4(v0, v1, v2, v3))
        tl.store(ptr + 4 + o, _join4(v4, v5, v6, v7))
    else:
        tl.store(ptr + o, _join4(v0, v1, v2, v3), mask=o < rem)
        tl.store(ptr + 4 + o, _join4(v4, v5, v6, v7), mask=o + 4 < rem)


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
            acc0 = tl.math.div_rn(acc0, tl.full(acc0.shape, M, tl.float32))
            acc1 = tl.math.div_rn(acc1, tl.full(acc1.shape, M, tl.float32))
            acc2 = tl.math.div_rn(acc2, tl.full(acc2.shape, M, tl.float32))
            acc3 = tl.math.div_rn(acc3, tl.full(acc3.shape, M, tl.float32))
            acc4 = tl.math.div_rn(acc4, tl.full(acc4.shape, M, tl.float32))
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
            mm = tl.full((G,), M, tl.float32)
            a0, a1, a2, a3 = tl.math.div_rn(a0, mm), tl.math.div_rn(a1, mm), tl.math.div_rn(a2, mm), tl.math.div_rn(a3, mm)
            a4, a5, a6, a7 = tl.math.div_rn(a4, mm), tl.math.div_rn(a5, mm), tl.math.div_rn(a6, mm), tl.math.div_rn(a7, mm)
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


@_jit
def _row_of(first, o, rem, bucket, b0, ONE: tl.constexpr):
    """The bucket of values ``first + o``: ``b0`` for a program inside one bucket (ONE), else each
    value's (0 for offsets from ``rem`` on, so that a gather by it stays in bounds)."""
    if ONE:
        return b0
    else:
        return tl.where(o < rem, _bucket_of(first, o, bucket), 0)


@_jit
def _fast(n, bucket, PER: tl.constexpr):
    """This program's span and bucket, and whether it is whole and inside one bucket (the paths of
    the kernels below that read per-bucket levels: unmasked, with the levels' row one scalar)."""
    first, rem = _span(n, PER)
    b0, edge = _bucket_split(first, bucket, PER)
    return first, rem, b0, (rem == PER) & (edge == PER)


@_jit
def _level_field(x, lv_ptr, row, u, L: tl.constexpr):
    """Stochastic rounding of ``x`` onto the sorted row ``row`` of L levels: ``hi`` = the number of
    levels below x (torch.searchsorted on a sorted row), ``p = (x − l_lo)/(l_hi − l_lo)``, ``hi if u < p``."""
    lv = lv_ptr + row * L
    hi = tl.zeros(x.shape, tl.int32)
    for j in tl.static_range(L):
        hi += (tl.load(lv + j) < x).to(tl.int32)
    hi = tl.minimum(hi, L - 1)
    lo = tl.maximum(hi - 1, 0)
    l_hi = tl.load(lv + hi)
    l_lo = tl.load(lv + lo)
    gap = l_hi - l_lo
    p = tl.where(gap > 0.0, tl.math.div_rn(x - l_lo, tl.where(gap > 0.0, gap, 1.0)), 0.0)
    return tl.where(u < p, hi, lo).to(tl.uint32)


@_jit
def _levels_encode_body(x_ptr, levels_ptr, out_ptr, first, rem, nbytes, bucket, b0, k1, k2, lo0, hi0,
                        L: tl.constexpr, W: tl.constexpr, G: tl.constexpr, WIDE: tl.constexpr, FAST: tl.constexpr):
    base = tl.arange(0, G) * 8
    v0, v1, v2, v3, v4, v5, v6, v7 = _load8(x_ptr + first, base, rem, FAST)
    f0 = _level_field(v0, levels_ptr, _row_of(first, base, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base, k1, k2, FAST), L)
    f1 = _level_field(v1, levels_ptr, _row_of(first, base + 1, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 1, k1, k2, FAST), L)
    f2 = _level_field(v2, levels_ptr, _row_of(first, base + 2, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 2, k1, k2, FAST), L)
    f3 = _level_field(v3, levels_ptr, _row_of(first, base + 3, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 3, k1, k2, FAST), L)
    f4 = _level_field(v4, levels_ptr, _row_of(first, base + 4, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 4, k1, k2, FAST), L)
    f5 = _level_field(v5, levels_ptr, _row_of(first, base + 5, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 5, k1, k2, FAST), L)
    f6 = _level_field(v6, levels_ptr, _row_of(first, base + 6, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 6, k1, k2, FAST), L)
    f7 = _level_field(v7, levels_ptr, _row_of(first, base + 7, rem, bucket, b0, FAST),
                      _uniform_at(lo0, hi0, base + 7, k1, k2, FAST), L)
    _pack8_tail(f0, f1, f2, f3, f4, f5, f6, f7, out_ptr, first, base, rem, nbytes, W, WIDE, FAST)


@_jit
def _levels_encode_kernel(x_ptr, levels_ptr, out_ptr, n, nbytes, bucket, k1, k2, ctr0,
                          L: tl.constexpr, W: tl.constexpr, G: tl.constexpr, WIDE: tl.constexpr):
    """Level indices (:func:`_level_field`) of every value, packed in W bits: a group of eight a
    thread; a whole program inside one bucket whose counters do not pass a multiple of 2**32 runs
    unmasked with its levels' row as scalars."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    lo0, hi0, nowrap = _counter_halves(ctr0, first, 8 * G)
    if fast & nowrap:
        _levels_encode_body(x_ptr, levels_ptr, out_ptr, first, rem, nbytes, bucket, b0, k1, k2, lo0, hi0, L, W, G,
                            WIDE, True)
    else:
        _levels_encode_body(x_ptr, levels_ptr, out_ptr, first, rem, nbytes, bucket, b0, k1, k2, lo0, hi0, L, W, G,
                            WIDE, False)


@_jit
def _level_value(f, lv_ptr, row, L, over, o, rem, FAST: tl.constexpr):
    """The level of index ``f`` in row ``row`` (index 0 where it is out of range) and ``over`` plus
    whether it is out of range (counted only below offset ``rem`` unless FAST)."""
    bad = f >= L
    if not FAST:
        bad = bad & (o < rem)
    return tl.load(lv_ptr + row * L + tl.where(f >= L, 0, f)), over + bad.to(tl.int32)


@_jit
def _levels_decode_body(data_ptr, levels_ptr, out_ptr, bad_ptr, first, rem, nbytes, bucket, b0, L,
                        W: tl.constexpr, G: tl.constexpr, WIDE: tl.constexpr, FAST: tl.constexpr):
    g = tl.arange(0, G)
    base = g * 8
    bfirst = first // 8 * W
    f0, f1, f2, f3, f4, f5, f6, f7 = _unpack8(data_ptr + bfirst, g, nbytes - bfirst, W, WIDE and FAST)
    over = tl.zeros((G,), tl.int32)
    v0, over = _level_value(f0, levels_ptr, _row_of(first, base, rem, bucket, b0, FAST), L, over, base, rem, FAST)
    v1, over = _level_value(f1, levels_ptr, _row_of(first, base + 1, rem, bucket, b0, FAST), L, over, base + 1, rem,
                            FAST)
    v2, over = _level_value(f2, levels_ptr, _row_of(first, base + 2, rem, bucket, b0, FAST), L, over, base + 2, rem,
                            FAST)
    v3, over = _level_value(f3, levels_ptr, _row_of(first, base + 3, rem, bucket, b0, FAST), L, over, base + 3, rem,
                            FAST)
    v4, over = _level_value(f4, levels_ptr, _row_of(first, base + 4, rem, bucket, b0, FAST), L, over, base + 4, rem,
                            FAST)
    v5, over = _level_value(f5, levels_ptr, _row_of(first, base + 5, rem, bucket, b0, FAST), L, over, base + 5, rem,
                            FAST)
    v6, over = _level_value(f6, levels_ptr, _row_of(first, base + 6, rem, bucket, b0, FAST), L, over, base + 6, rem,
                            FAST)
    v7, over = _level_value(f7, levels_ptr, _row_of(first, base + 7, rem, bucket, b0, FAST), L, over, base + 7, rem,
                            FAST)
    _store8(out_ptr + first, base, rem, v0, v1, v2, v3, v4, v5, v6, v7, FAST)
    tl.store(bad_ptr + tl.program_id(0), tl.sum(over, axis=0))


@_jit
def _levels_decode_kernel(data_ptr, levels_ptr, out_ptr, bad_ptr, n, nbytes, bucket, L,
                          W: tl.constexpr, G: tl.constexpr, WIDE: tl.constexpr):
    """Each value's level by its W-bit index, and per program the number of indices ``≥ L``."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    if fast:
        _levels_decode_body(data_ptr, levels_ptr, out_ptr, bad_ptr, first, rem, nbytes, bucket, b0, L, W, G, WIDE,
                            True)
    else:
        _levels_decode_body(data_ptr, levels_ptr, out_ptr, bad_ptr, first, rem, nbytes, bucket, b0, L, W, G, WIDE,
                            False)


@_jit
def _threshold_body(x_ptr, t_ptr, out_ptr, first, rem, nbytes, bucket, b0, G: tl.constexpr, FAST: tl.constexpr):
    base = tl.arange(0, G) * 8
    v0, v1, v2, v3, v4, v5, v6, v7 = _load8(x_ptr + first, base, rem, FAST)
    f0 = (v0.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base, rem, bucket, b0, FAST))).to(tl.uint32)
    f1 = (v1.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 1, rem, bucket, b0, FAST))).to(tl.uint32)
    f2 = (v2.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 2, rem, bucket, b0, FAST))).to(tl.uint32)
    f3 = (v3.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 3, rem, bucket, b0, FAST))).to(tl.uint32)
    f4 = (v4.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 4, rem, bucket, b0, FAST))).to(tl.uint32)
    f5 = (v5.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 5, rem, bucket, b0, FAST))).to(tl.uint32)
    f6 = (v6.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 6, rem, bucket, b0, FAST))).to(tl.uint32)
    f7 = (v7.to(tl.float64) >= tl.load(t_ptr + _row_of(first, base + 7, rem, bucket, b0, FAST))).to(tl.uint32)
    _pack8_tail(f0, f1, f2, f3, f4, f5, f6, f7, out_ptr, first, base, rem, nbytes, 1, False, FAST)


@_jit
def _threshold_kernel(x_ptr, t_ptr, out_ptr, n, nbytes, bucket, G: tl.constexpr):
    """Bits ``float64(x) >= t[bucket]`` packed 8 per byte (bit i of byte g = element 8g + i)."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    if fast:
        _threshold_body(x_ptr, t_ptr, out_ptr, first, rem, nbytes, bucket, b0, G, True)
    else:
        _threshold_body(x_ptr, t_ptr, out_ptr, first, rem, nbytes, bucket, b0, G, False)


@_jit
def _pb_bit(x, b, u):
    """BinGrad-pb's bit ``u < clamp((x + b)/(2·b), 0, 1)`` (1 where ``b = 0``)."""
    safe = tl.where(b > 0.0, b, 1.0)
    p = tl.math.div_rn(x + b, 2.0 * safe)
    p = tl.minimum(tl.maximum(p, 0.0), 1.0)
    p = tl.where(b > 0.0, p, 1.0)
    return (u < p).to(tl.uint32)


@_jit
def _pb_bits_body(x_ptr, b_ptr, out_ptr, first, rem, nbytes, bucket, b0, k1, k2, lo0, hi0, G: tl.constexpr,
                  FAST: tl.constexpr):
    base = tl.arange(0, G) * 8
    v0, v1, v2, v3, v4, v5, v6, v7 = _load8(x_ptr + first, base, rem, FAST)
    f0 = _pb_bit(v0, tl.load(b_ptr + _row_of(first, base, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base, k1, k2, FAST))
    f1 = _pb_bit(v1, tl.load(b_ptr + _row_of(first, base + 1, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 1, k1, k2, FAST))
    f2 = _pb_bit(v2, tl.load(b_ptr + _row_of(first, base + 2, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 2, k1, k2, FAST))
    f3 = _pb_bit(v3, tl.load(b_ptr + _row_of(first, base + 3, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 3, k1, k2, FAST))
    f4 = _pb_bit(v4, tl.load(b_ptr + _row_of(first, base + 4, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 4, k1, k2, FAST))
    f5 = _pb_bit(v5, tl.load(b_ptr + _row_of(first, base + 5, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 5, k1, k2, FAST))
    f6 = _pb_bit(v6, tl.load(b_ptr + _row_of(first, base + 6, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 6, k1, k2, FAST))
    f7 = _pb_bit(v7, tl.load(b_ptr + _row_of(first, base + 7, rem, bucket, b0, FAST)),
                 _uniform_at(lo0, hi0, base + 7, k1, k2, FAST))
    _pack8_tail(f0, f1, f2, f3, f4, f5, f6, f7, out_ptr, first, base, rem, nbytes, 1, False, FAST)


@_jit
def _pb_bits_kernel(x_ptr, b_ptr, out_ptr, n, nbytes, bucket, k1, k2, ctr0, G: tl.constexpr):
    """BinGrad-pb's bits (:func:`_pb_bit`) packed 8 per byte."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    lo0, hi0, nowrap = _counter_halves(ctr0, first, 8 * G)
    if fast & nowrap:
        _pb_bits_body(x_ptr, b_ptr, out_ptr, first, rem, nbytes, bucket, b0, k1, k2, lo0, hi0, G, True)
    else:
        _pb_bits_body(x_ptr, b_ptr, out_ptr, first, rem, nbytes, bucket, b0, k1, k2, lo0, hi0, G, False)


@_jit
def _bit_value(bit, lv_ptr, row, PER: tl.constexpr):
    """A one-bit code's value: level ``bit`` of the bucket's two (PER = 2), else ``±`` its scale."""
    if PER == 2:
        return tl.load(lv_ptr + 2 * row + bit)
    else:
        return tl.load(lv_ptr + row) * (2 * bit - 1).to(tl.float32)


@_jit
def _bit_decode_body(data_ptr, levels_ptr, out_ptr, first, rem, nbytes, bucket, b0, PER: tl.constexpr,
                     G: tl.constexpr, FAST: tl.constexpr):
    g = tl.arange(0, G)
    base = g * 8
    f0, f1, f2, f3, f4, f5, f6, f7 = _unpack8(data_ptr + first // 8, g, nbytes - first // 8, 1, False)
    v0 = _bit_value(f0, levels_ptr, _row_of(first, base, rem, bucket, b0, FAST), PER)
    v1 = _bit_value(f1, levels_ptr, _row_of(first, base + 1, rem, bucket, b0, FAST), PER)
    v2 = _bit_value(f2, levels_ptr, _row_of(first, base + 2, rem, bucket, b0, FAST), PER)
    v3 = _bit_value(f3, levels_ptr, _row_of(first, base + 3, rem, bucket, b0, FAST), PER)
    v4 = _bit_value(f4, levels_ptr, _row_of(first, base + 4, rem, bucket, b0, FAST), PER)
    v5 = _bit_value(f5, levels_ptr, _row_of(first, base + 5, rem, bucket, b0, FAST), PER)
    v6 = _bit_value(f6, levels_ptr, _row_of(first, base + 6, rem, bucket, b0, FAST), PER)
    v7 = _bit_value(f7, levels_ptr, _row_of(first, base + 7, rem, bucket, b0, FAST), PER)
    _store8(out_ptr + first, base, rem, v0, v1, v2, v3, v4, v5, v6, v7, FAST)


@_jit
def _bit_decode_kernel(data_ptr, levels_ptr, out_ptr, n, nbytes, bucket, PER: tl.constexpr, G: tl.constexpr):
    """Every value of one-bit codes (:func:`_bit_value`)."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    if fast:
        _bit_decode_body(data_ptr, levels_ptr, out_ptr, first, rem, nbytes, bucket, b0, PER, G, True)
    else:
        _bit_decode_body(data_ptr, levels_ptr, out_ptr, first, rem, nbytes, bucket, b0, PER, G, False)


@_jit
def _fold_rows(v, ROWS: tl.constexpr, D: tl.constexpr, LOG: tl.constexpr):
    """:func:`gradq.kernels.reference.pairwise_row_sum` of every row of ``v`` (``[ROWS, D]``,
    ``D = 2**LOG ≤ SUM_BLOCK``): column ``i + D/2`` added to column ``i``, repeatedly. Each step
    sums an axis of two, one addition, so the order is the reference's. A reduction may start from
    ``+0.0``, which changes nothing but the sign of a zero, and only where the reference's sum is
    ``−0.0``: that is where every entry is ``−0.0`` (``x + (−x)`` is ``+0.0``), set at the end."""
    negzero = (v == 0.0) & (v.to(tl.int64, bitcast=True) < 0)
    allneg = tl.sum(tl.where(negzero, 0, 1), axis=1) == 0
    for j in tl.static_range(LOG):
        v = tl.sum(tl.reshape(v, (ROWS, 2, D >> (j + 1))), axis=1)
    bits = tl.reshape(v, (ROWS,)).to(tl.int64, bitcast=True)
    return tl.where(allneg, bits | (-9223372036854775807 - 1), bits).to(tl.float64, bitcast=True)   # sign bit


@_jit
def _fold_tail(v, w, buf_ptr, P: tl.constexpr):
    """:func:`gradq.kernels.reference.pairwise_row_sum` of one row of ``w ≤ P`` values (``v``,
    float64 ``[1, P]``), any ``w ≤ SUM_BLOCK``: the reference's folds (``h = ⌊w/2⌋``, column
    ``i + h`` added to column ``i``, an odd last column moved to ``h``) through the scratch
    ``buf_ptr`` (``P`` float64). Returns ``[1]``."""
    i = tl.arange(0, P)
    v = tl.reshape(v, (P,))
    while w > 1:
        tl.store(buf_ptr + i, v, mask=i < w)
        tl.debug_barrier()
        h = w // 2
        a = tl.load(buf_ptr + i, mask=i < h, other=0.0)
        b = tl.load(buf_ptr + i + h, mask=i < h, other=0.0)
        last = tl.load(buf_ptr + 2 * h + i * 0, mask=(i == h) & (w % 2 == 1), other=0.0)
        v = tl.where(i < h, a + b, last)
        tl.debug_barrier()
        w = h + w % 2
    tl.store(buf_ptr + i, v, mask=i < 1)
    tl.debug_barrier()
    r = tl.load(buf_ptr + tl.arange(0, 1))
    tl.debug_barrier()
    return r


@_jit
def _fold(v, w, buf_ptr, ROWS: tl.constexpr, D: tl.constexpr, LOG: tl.constexpr, TAIL: tl.constexpr):
    if TAIL:
        return _fold_tail(v, w, buf_ptr, D)
    else:
        return _fold_rows(v, ROWS, D, LOG)


@_jit
def _masked_mean(x, mask, empty, w, buf_ptr, ROWS: tl.constexpr, D: tl.constexpr, LOG: tl.constexpr,
                 TAIL: tl.constexpr):
    """:func:`gradq.kernels.reference.masked_mean` of the rows of ``x`` (float64 ``[ROWS, D]``)."""
    cnt = tl.sum(mask.to(tl.int64), axis=1)
    tot = _fold(tl.where(mask, x, 0.0), w, buf_ptr, ROWS, D, LOG, TAIL)
    safe = tl.where(cnt > 0, cnt, 1).to(tl.float64)
    return tl.where(cnt > 0, tot / safe, empty)   # float64 '/' is div.rn.f64


@_jit
def _binary_stats_kernel(x_ptr, t_ptr, lv_ptr, buf_ptr, nrows, w, MODE: tl.constexpr, ITERS: tl.constexpr,
                         D: tl.constexpr, LOG: tl.constexpr, ROWS: tl.constexpr, TAIL: tl.constexpr):
    """The one-bit statistics of buckets of ``w`` values, as
    :func:`gradq.kernels.reference.one_bit_stats`: float64 thresholds into ``t_ptr`` and float32
    levels into ``lv_ptr`` (MODE 0, SignSGD: ``mean |x|``; 1, 1BitSGD: the means of ``x < 0`` and
    ``x ≥ 0``; 2, BinGrad-b: ``(b0, b1)`` after ``ITERS`` Lloyd steps). Either ``ROWS`` full
    buckets of ``w = D = 2**LOG`` values a program, or (``TAIL``) one bucket of any ``w ≤ D``,
    whose folds go through the scratch ``buf_ptr``."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, D)
    ok = row < nrows
    ok2 = ok[:, None] & (col[None, :] < w)
    x32 = tl.load(x_ptr + row[:, None] * D + col[None, :], mask=ok2, other=0.0)
    x = x32.to(tl.float64)
    dd = tl.zeros((ROWS,), tl.float64) + w.to(tl.float64)
    zero = tl.zeros((ROWS,), tl.float64)
    if MODE == 0:
        tl.store(t_ptr + row, zero, mask=ok)
        lv = _fold(tl.abs(x), w, buf_ptr, ROWS, D, LOG, TAIL) / dd
        tl.store(lv_ptr + row, lv.to(tl.float32), mask=ok)
    else:
        if MODE == 1:
            t = zero
            up = ok2 & (x32 >= 0.0)
            b0 = _masked_mean(x, ok2 & (up == 0), zero, w, buf_ptr, ROWS, D, LOG, TAIL)
            b1 = _masked_mean(x, up, zero, w, buf_ptr, ROWS, D, LOG, TAIL)
        else:
            t = _fold(x, w, buf_ptr, ROWS, D, LOG, TAIL) / dd
            b0 = t
            b1 = t
            for step in tl.static_range(ITERS + 1):
                if step > 0:
                    t = 0.5 * (b0 + b1)
                upper = ok2 & (x >= t[:, None])
                b0 = _masked_mean(x, ok2 & (upper == 0), t, w, buf_ptr, ROWS, D, LOG, TAIL)
                b1 = _masked_mean(x, upper, t, w, buf_ptr, ROWS, D, LOG, TAIL)
        tl.store(t_ptr + row, t, mask=ok)
        tl.store(lv_ptr + 2 * row, b0.to(tl.float32), mask=ok)
        tl.store(lv_ptr + 2 * row + 1, b1.to(tl.float32), mask=ok)


@_jit
def _bitonic_rows(v, ROWS: tl.constexpr, P: tl.constexpr, LOG: tl.constexpr):
    """Every row of ``v`` (integers, ``[ROWS, P]``, ``P = 2**LOG``) sorted ascending by a bitonic
    network: merges of blocks of ``2**s``, exchanges at distance ``2**(s − 1 − t)``, a block sorted
    downwards where bit ``s`` of the position is set. An exchange views the row as ``(…, 2, j)`` and
    takes the minimum and maximum over the axis of two."""
    side = tl.reshape(tl.arange(0, 2), (1, 1, 2, 1))
    for s in tl.static_range(1, LOG + 1):
        for t in tl.static_range(s):
            y = tl.reshape(v, (ROWS, P >> (s - t), 2, 1 << (s - 1 - t)))
            lo = tl.min(y, axis=2, keep_dims=True)
            hi = tl.max(y, axis=2, keep_dims=True)
            down = (tl.reshape(tl.arange(0, P >> (s - t)), (1, P >> (s - t), 1, 1)) >> t) & 1
            v = tl.reshape(tl.where(side == down, lo, hi), (ROWS, P))
    return v


@_jit
def _order_key(b):
    """The signed order-preserving key of int32 float bit patterns ``b`` (``−0.0`` below ``+0.0``);
    the map is its own inverse."""
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@_jit
def _linear_levels_kernel(x_ptr, pos_ptr, lv_ptr, n, bucket, nrows, L: tl.constexpr, P: tl.constexpr,
                          LOG: tl.constexpr, ROWS: tl.constexpr):
    """Linear's levels of buckets (``bucket ≤ P`` values; the last may be shorter): each row sorted
    by the order-preserving integer keys of its values (``reference.sort_rows``: ``−0.0`` before
    ``+0.0``), padded with the largest key, and its values at the positions ``pos_ptr[0:L]`` (a
    full bucket) or ``pos_ptr[L:2L]`` (a shorter last one)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, P)
    start = row * bucket
    width = tl.minimum(n - start, bucket)
    live = row < nrows
    ok = live[:, None] & (col[None, :] < width[:, None])
    b = tl.load(x_ptr + start[:, None] + col[None, :], mask=ok, other=0.0).to(tl.int32, bitcast=True)
    key = tl.where(ok, _order_key(b), 0x7FFFFFFF)
    srt = _bitonic_rows(key, ROWS, P, LOG)
    tail = tl.where(width < bucket, L, 0)
    for j in tl.static_range(L):
        p = tl.load(pos_ptr + tail + j, mask=live, other=0)
        k = tl.sum(tl.where(col[None, :] == p[:, None], srt, 0), axis=1)   # the one key at p
        v = _order_key(k).to(tl.float32, bitcast=True)
        tl.store(lv_ptr + row * L + j, v, mask=live)



@_jit
def _orq_levels_kernel(x_ptr, lv_ptr, n, bucket, L: tl.constexpr, LP: tl.constexpr, ITER: tl.constexpr,
                       P: tl.constexpr, LOG: tl.constexpr):
    """ORQ's ``L`` levels of one bucket a program (``bucket ≤ P`` values; the last may be shorter), in
    the operations of :func:`gradq.kernels.reference.orq_levels`: the values sorted by their
    order-preserving integer keys, the least and greatest as the first two levels, then ``ITER``
    rounds that split every interval at the first sorted value whose slope (a difference of float64
    running sums) is not negative, or at the clamped midpoint where none is.

    Every sorted value carries the index of its interval (``ids``, non-decreasing along the row).
    After a round the index becomes ``2·ids + (value ≥ new level)``, which is the reference's
    ``searchsorted(right) − 1`` against the interleaved levels: a new level lies inside its
    interval. Segment starts and ends come from a histogram of the indices (no scan with an operator
    of its own, which the interpreter runs element by element), so the only ``[P, LP]`` work is one
    minimum a round (the first good position of each interval). Levels are kept as bit patterns in
    ``[LP]`` (``LP ≥ L``, a power of two) and moved with gathers, never rounded."""
    r = tl.program_id(0).to(tl.int64)
    start = r * bucket
    width = tl.minimum(n - start, bucket).to(tl.int32)
    col = tl.arange(0, P)
    ok = col < width
    b = tl.load(x_ptr + start + col, mask=ok, other=0.0).to(tl.int32, bitcast=True)
    key = tl.where(ok, _order_key(b), 0x7FFFFFFF)
    srtk = _order_key(tl.reshape(_bitonic_rows(tl.reshape(key, (1, P)), 1, P, LOG), (P,)))   # float bits
    srt = srtk.to(tl.float32, bitcast=True)
    g64 = srt.to(tl.float64)
    j = tl.arange(0, LP)
    lo_bits = tl.sum(tl.where(col == 0, srtk, 0), axis=0)
    hi_bits = tl.sum(tl.where(col == width - 1, srtk, 0), axis=0)
    lvk = tl.where(j == 0, lo_bits, tl.where(j == 1, hi_bits, 0))      # 2 levels so far
    ids = tl.zeros([P], dtype=tl.int32)
    for it in tl.static_range(ITER):
        lv = lvk.to(tl.float32, bitcast=True)
        a = tl.gather(lv, ids, 0)
        bb = tl.gather(lv, ids + 1, 0)
        left_terms = tl.where(ok, g64 - a.to(tl.float64), 0.0)
        right_terms = tl.where(ok, bb.to(tl.float64) - g64, 0.0)
        cum_l = tl.cumsum(left_terms, 0)
        cum_r = tl.cumsum(right_terms, 0)
        # each value's segment (its interval's values, consecutive along the row): where it starts and
        # ends, from a histogram of the interval indices (the padding counts as one more interval)
        seg = tl.where(ok, ids, LP)
        cnt = tl.histogram(seg, 2 * LP)
        st = tl.gather(tl.cumsum(cnt, 0) - cnt, seg, 0)
        en = st + tl.gather(cnt, seg, 0) - 1
        left = cum_l - tl.gather(cum_l - left_terms, st, 0)
        right = tl.gather(cum_r, en, 0) - cum_r
        good = ok & (srt > a) & (srt < bb) & (left - right >= 0)
        split = tl.min(tl.where(good[:, None] & (ids[:, None] == j[None, :]), col[:, None], P), axis=0)
        c_bits = tl.gather(srtk, tl.minimum(split, P - 1), 0)
        # no split: the midpoint, halves first (no overflow), clamped into the interval
        hi = tl.gather(lv, tl.minimum(j + 1, LP - 1), 0)
        mid = 0.5 * lv + 0.5 * hi
        mid = tl.where(mid > hi, hi, tl.where(mid < lv, lv, mid))
        c_bits = tl.where(split < P, c_bits, mid.to(tl.int32, bitcast=True))
        if it + 1 < ITER:
            ids = 2 * ids + (srt >= tl.gather(c_bits.to(tl.float32, bitcast=True), ids, 0)).to(tl.int32)
        # interleave: level k of the next round is old level k/2 (k even) or new level (k − 1)/2 (k odd)
        lvk = tl.where(j % 2 == 0, tl.gather(lvk, j // 2, 0), tl.gather(c_bits, tl.maximum(j - 1, 0) // 2, 0))
    tl.store(lv_ptr + r * L + j, lvk.to(tl.float32, bitcast=True), mask=j < L)


@_jit
def _pb_level_kernel(x_ptr, b_ptr, n, bucket, nrows, P: tl.constexpr, LOG: tl.constexpr, ROWS: tl.constexpr):
    """BinGrad-pb's ``b`` of whole buckets (``bucket ≤ P`` values; the last may be shorter), in the
    operations of :func:`gradq.kernels.reference.bingrad_pb_threshold`: each row's ``|x|`` sorted
    (their bit patterns order as their values), float64 tail sums ``S_k``, the first ``k`` with
    ``d·a_{k+1} ≥ S_k``, and ``max(S_k/d, a_k)``."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, P)
    start = row * bucket
    width = tl.maximum(tl.minimum(n - start, bucket), 1)
    live = row < nrows
    ok = live[:, None] & (col[None, :] < width[:, None])
    bits = tl.load(x_ptr + start[:, None] + col[None, :], mask=ok, other=0.0).to(tl.int32, bitcast=True)
    key = tl.where(ok, bits & 0x7FFFFFFF, 0x7FFFFFFF)
    a = tl.where(ok, _bitonic_rows(key, ROWS, P, LOG).to(tl.float32, bitcast=True).to(tl.float64), 0.0)
    tail = tl.cumsum(a, 1, reverse=True)                 # S_k = a_{k+1} + … + a_d; the padding adds +0.0
    dd = width.to(tl.float64)
    k = tl.sum((ok & (dd[:, None] * a < tail)).to(tl.int32), axis=1)
    s_k = tl.sum(tl.where(col[None, :] == k[:, None], tail, 0.0), axis=1)       # 0 where k = d
    a_k = tl.sum(tl.where(col[None, :] == k[:, None] - 1, a, 0.0), axis=1)      # 0 where k = 0
    tl.store(b_ptr + row, tl.maximum(s_k / dd, a_k).to(tl.float32), mask=live)


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
def _ms_code(x, w, ix, lv_ptr, u, o, rem, over, L: tl.constexpr, FAST: tl.constexpr):
    """MultiScale's field ``s1 ± min(floor(s_ix·|x|/w + u), s1)`` of one value and ``over`` plus
    whether its shared index ``ix`` exceeds the value's own allowed one (below offset ``rem``)."""
    r = _ms_ratio(x, w)
    bad = ix > _ms_allowed(r, lv_ptr, L)
    if not FAST:
        bad = bad & (o < rem)
    s1f = tl.load(lv_ptr)
    s1 = s1f.to(tl.int32)
    t = tl.load(lv_ptr + tl.minimum(ix, L - 1)) * r + u
    mag = tl.where(t > s1f, s1f, t).to(tl.int32)
    return tl.where(x < 0.0, s1 - mag, s1 + mag).to(tl.uint32), over + bad.to(tl.int32)


@_jit
def _ms_encode_body(x_ptr, w_ptr, ix_ptr, lv_ptr, codes_ptr, index_ptr, bad_ptr, first, rem, n, nbytes, ibytes,
                    bucket, b0, k1, k2, lo0, hi0, L: tl.constexpr, W: tl.constexpr, IW: tl.constexpr,
                    G: tl.constexpr, WIDE: tl.constexpr, FAST: tl.constexpr):
    g = tl.arange(0, G)
    base = g * 8
    v0, v1, v2, v3, v4, v5, v6, v7 = _load8(x_ptr + first, base, rem, FAST)
    i0, i1, i2, i3, i4, i5, i6, i7 = _unpack8(ix_ptr + first, g, n - first, 8, WIDE and FAST)
    over = tl.zeros((G,), tl.int32)
    f0, over = _ms_code(v0, tl.load(w_ptr + _row_of(first, base, rem, bucket, b0, FAST)), i0, lv_ptr,
                        _uniform_at(lo0, hi0, base, k1, k2, FAST), base, rem, over, L, FAST)
    f1, over = _ms_code(v1, tl.load(w_ptr + _row_of(first, base + 1, rem, bucket, b0, FAST)), i1, lv_ptr,
                        _uniform_at(lo0, hi0, base + 1, k1, k2, FAST), base + 1, rem, over, L, FAST)
    f2, over = _ms_code(v2, tl.load(w_ptr + _row_of(first, base + 2, rem, bucket, b0, FAST)), i2, lv_ptr,
                        _uniform_at(lo0, hi0, base + 2, k1, k2, FAST), base + 2, rem, over, L, FAST)
    f3, over = _ms_code(v3, tl.load(w_ptr + _row_of(first, base + 3, rem, bucket, b0, FAST)), i3, lv_ptr,
                        _uniform_at(lo0, hi0, base + 3, k1, k2, FAST), base + 3, rem, over, L, FAST)
    f4, over = _ms_code(v4, tl.load(w_ptr + _row_of(first, base + 4, rem, bucket, b0, FAST)), i4, lv_ptr,
                        _uniform_at(lo0, hi0, base + 4, k1, k2, FAST), base + 4, rem, over, L, FAST)
    f5, over = _ms_code(v5, tl.load(w_ptr + _row_of(first, base + 5, rem, bucket, b0, FAST)), i5, lv_ptr,
                        _uniform_at(lo0, hi0, base + 5, k1, k2, FAST), base + 5, rem, over, L, FAST)
    f6, over = _ms_code(v6, tl.load(w_ptr + _row_of(first, base + 6, rem, bucket, b0, FAST)), i6, lv_ptr,
                        _uniform_at(lo0, hi0, base + 6, k1, k2, FAST), base + 6, rem, over, L, FAST)
    f7, over = _ms_code(v7, tl.load(w_ptr + _row_of(first, base + 7, rem, bucket, b0, FAST)), i7, lv_ptr,
                        _uniform_at(lo0, hi0, base + 7, k1, k2, FAST), base + 7, rem, over, L, FAST)
    _pack8_tail(f0, f1, f2, f3, f4, f5, f6, f7, codes_ptr, first, base, rem, nbytes, W, WIDE, FAST)
    if IW > 0:
        _pack8_tail(i0.to(tl.uint32), i1.to(tl.uint32), i2.to(tl.uint32), i3.to(tl.uint32), i4.to(tl.uint32),
                    i5.to(tl.uint32), i6.to(tl.uint32), i7.to(tl.uint32), index_ptr, first, base, rem, ibytes, IW,
                    WIDE, FAST)
    tl.store(bad_ptr + tl.program_id(0), tl.sum(over, axis=0))


@_jit
def _ms_encode_kernel(x_ptr, w_ptr, ix_ptr, lv_ptr, codes_ptr, index_ptr, bad_ptr, n, nbytes, ibytes, bucket,
                      k1, k2, ctr0, L: tl.constexpr, W: tl.constexpr, IW: tl.constexpr, G: tl.constexpr,
                      WIDE: tl.constexpr):
    """MultiScale's fields (:func:`_ms_code`) in W bits and, with IW > 0, the shared indices in IW
    bits; per program the number of values whose shared index exceeds their own. WIDE: the indices
    and both outputs are 4-byte aligned."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    lo0, hi0, nowrap = _counter_halves(ctr0, first, 8 * G)
    if fast & nowrap:
        _ms_encode_body(x_ptr, w_ptr, ix_ptr, lv_ptr, codes_ptr, index_ptr, bad_ptr, first, rem, n, nbytes, ibytes,
                        bucket, b0, k1, k2, lo0, hi0, L, W, IW, G, WIDE, True)
    else:
        _ms_encode_body(x_ptr, w_ptr, ix_ptr, lv_ptr, codes_ptr, index_ptr, bad_ptr, first, rem, n, nbytes, ibytes,
                        bucket, b0, k1, k2, lo0, hi0, L, W, IW, G, WIDE, False)


@_jit
def _ms_value(f, ix, w, lv_ptr, o, rem, over, L: tl.constexpr, FAST: tl.constexpr):
    """``(float32(f − s1) / s_ix)·w`` of one field (index 0 where ``ix ≥ L``), and ``over`` plus
    whether ``ix ≥ L`` (below offset ``rem``)."""
    bad = ix >= L
    if not FAST:
        bad = bad & (o < rem)
    ix = tl.where(ix >= L, 0, ix)
    s1 = tl.load(lv_ptr).to(tl.int32)
    return tl.math.div_rn((f - s1).to(tl.float32), tl.load(lv_ptr + ix)) * w, over + bad.to(tl.int32)


@_jit
def _ms_decode_body(codes_ptr, index_ptr, w_ptr, lv_ptr, out_ptr, bad_ptr, first, rem, nbytes, ibytes, bucket, b0,
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
    v0, over = _ms_value(f0, i0, tl.load(w_ptr + _row_of(first, base, rem, bucket, b0, FAST)), lv_ptr, base, rem,
                         over, L, FAST)
    v1, over = _ms_value(f1, i1, tl.load(w_ptr + _row_of(first, base + 1, rem, bucket, b0, FAST)), lv_ptr, base + 1,
                         rem, over, L, FAST)
    v2, over = _ms_value(f2, i2, tl.load(w_ptr + _row_of(first, base + 2, rem, bucket, b0, FAST)), lv_ptr, base + 2,
                         rem, over, L, FAST)
    v3, over = _ms_value(f3, i3, tl.load(w_ptr + _row_of(first, base + 3, rem, bucket, b0, FAST)), lv_ptr, base + 3,
                         rem, over, L, FAST)
    v4, over = _ms_value(f4, i4, tl.load(w_ptr + _row_of(first, base + 4, rem, bucket, b0, FAST)), lv_ptr, base + 4,
                         rem, over, L, FAST)
    v5, over = _ms_value(f5, i5, tl.load(w_ptr + _row_of(first, base + 5, rem, bucket, b0, FAST)), lv_ptr, base + 5,
                         rem, over, L, FAST)
    v6, over = _ms_value(f6, i6, tl.load(w_ptr + _row_of(first, base + 6, rem, bucket, b0, FAST)), lv_ptr, base + 6,
                         rem, over, L, FAST)
    v7, over = _ms_value(f7, i7, tl.load(w_ptr + _row_of(first, base + 7, rem, bucket, b0, FAST)), lv_ptr, base + 7,
                         rem, over, L, FAST)
    _store8(out_ptr + first, base, rem, v0, v1, v2, v3, v4, v5, v6, v7, FAST)
    tl.store(bad_ptr + tl.program_id(0), tl.sum(over, axis=0))


@_jit
def _ms_decode_kernel(codes_ptr, index_ptr, w_ptr, lv_ptr, out_ptr, bad_ptr, n, nbytes, ibytes, bucket,
                      L: tl.constexpr, W: tl.constexpr, IW: tl.constexpr, G: tl.constexpr, WIDE: tl.constexpr):
    """MultiScale's values (:func:`_ms_value`) and per program the number of indices ``≥ L``."""
    first, rem, b0, fast = _fast(n, bucket, 8 * G)
    if fast:
        _ms_decode_body(codes_ptr, index_ptr, w_ptr, lv_ptr, out_ptr, bad_ptr, first, rem, nbytes, ibytes, bucket,
                        b0, L, W, IW, G, WIDE, True)
    else:
        _ms_decode_body(codes_ptr, index_ptr, w_ptr, lv_ptr, out_ptr, bad_ptr, first, rem, nbytes, ibytes, bucket,
                        b0, L, W, IW, G, WIDE, False)


# == argument handling ============================================================================
def _flat(x: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {x.dtype}")
    return x.detach().reshape(-1).contiguous()


def _out(out: Optional[torch.Tensor], size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(size, dtype=dtype, device=device)
    if out.dtype != dtype or out.device != device or out.numel() != size or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of {size} elements on {device}")
    return out  # (the kernels index it flat)


def _vector(t: torch.Tensor, size: int, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    v = _flat(t, name, dtype).to(device)
    if v.numel() != size:
        raise ValueError(f"expected {size} {name} (one per bucket), got {v.numel()}")
    return v


def _payload(data: torch.Tensor, need: int, what: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise PayloadError(f"packed {what} must be a uint8 tensor")
    if data.numel() != need:
        raise PayloadError(f"packed {what} need {need} bytes, got {data.numel()}")
    return data.reshape(-1).contiguous()


def _grid(units: int, per: int) -> tuple[int]:
    return (max(1, -(-units // per)),)


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
        bits = torch.zeros(nb, dtype=torch.int32, device=xv.device)
        cols = min(1024, triton.next_power_of_2(d))
        rows = max(1, min(_ROWS, 4096 // cols))
        ncol = -(-d // cols)
        _launch(_maxabs_bits_kernel, (-(-nb // rows) * ncol,), xv, bits, n, d, nb, ncol, ROWS=rows, COLS=cols)
        m = bits.view(torch.float32)
        c = float(_clip(clip))
        torch.where(m < c, m, torch.full_like(m, c), out=res.view(-1))  # (NaN < c is false: a NaN bucket reads c)
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
    c = float(_clip(clip))
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
                CLIP=bool(c < np.inf), WIDE=packed.data_ptr() % 4 == 0)
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


#: small constant tensors per (device, dtype, value): kernel arguments that need no launch to make
_CONSTANTS: dict = {}


def _constant(device: torch.device, dtype: torch.dtype, value: int = 0) -> torch.Tensor:
    """A one-element tensor holding ``value``, made once per device (read-only by the kernels)."""
    key = (str(device), dtype, value)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.full((1,), value, dtype=dtype, device=device)
    return _CONSTANTS[key]


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


def _moments(xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(σ as a float32 0-dim tensor, max |x| as float32)`` in one read of ``xv``: per block its
    count, mean and centred sum of squares in float64, then the blocks' triples merged (Chan et al.'s
    update) by a tree of Triton programs, each merging up to ``_MERGE_CHUNK`` of them: 3 launches for
    up to 2^32 values. σ equals the reference's two-pass float64 σ rounded to float32, except within
    float64 rounding (~1e-13 relative) of a float32 rounding tie."""
    n = xv.numel()
    grid = _grid(n, _MOMENT_BLOCK)
    cnt, mean, m2 = (torch.empty(grid[0], dtype=torch.float64, device=xv.device) for _ in range(3))
    out = torch.zeros(2, dtype=torch.int32, device=xv.device)   # [max |x| bits, σ]
    _launch(_block_moments_kernel, grid, xv, cnt, mean, m2, out, n, BLOCK=_MOMENT_BLOCK)
    f = out.view(torch.float32)
    while cnt.numel() > _MERGE_CHUNK:
        k = -(-cnt.numel() // _MERGE_CHUNK)
        nxt = [torch.empty(k, dtype=torch.float64, device=xv.device) for _ in range(3)]
        _launch(_merge_moments_kernel, (k,), cnt, mean, m2, *nxt, cnt.numel(), CHUNK=_MERGE_CHUNK, FINAL=False)
        cnt, mean, m2 = nxt
    _launch(_merge_moments_kernel, (1,), cnt, mean, m2, f[1:], f[1:], f[1:], cnt.numel(), CHUNK=_MERGE_CHUNK,
            FINAL=True)
    return f[1], f[0]


def population_std(x: torch.Tensor) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.population_std`, in one read (see :func:`_moments`)."""
    xv = _flat(x, "x", torch.float32)
    if xv.numel() == 0:
        return torch.tensor(float("nan"), device=xv.device)
    return _moments(xv)[0]


def terngrad_stats(x: torch.Tensor, clip: Optional[float], bucket: Optional[int]
                   ) -> tuple[Optional[float], torch.Tensor]:
    """As :func:`gradq.kernels.reference.terngrad_stats`. σ and, with one bucket, the max-abs come
    from one read; the clipped max is ``min(max |x|, bound)``. The bound is a host float."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    if clip is None or n <= 1:
        return None, maxabs_scales(xv, bucket)
    sigma_t, mx = _moments(xv)
    sigma = float(sigma_t)
    bound = float(np.float32(clip) * np.float32(sigma)) if sigma > 0 else None
    if bucket is None or bucket >= n:
        c = float(_clip(bound))
        return bound, torch.where(mx < c, mx, torch.full_like(mx, c)).reshape(1)
    return bound, maxabs_scales(xv, bucket, clip=bound)


# -- ORQ / Linear --------------------------------------------------------------------------------
def _level_matrix(levels: torch.Tensor, nb: int, device: torch.device) -> tuple[torch.Tensor, int]:
    if not isinstance(levels, torch.Tensor) or levels.dim() != 2 or levels.shape[0] != nb:
        raise ValueError(f"levels must be a ({nb}, L) float32 tensor, one row per bucket")
    L = int(levels.shape[1])
    if not 2 <= L <= 256:
        raise ValueError(f"the number of levels must be in [2, 256], got {L}")
    return _flat(levels, "levels", torch.float32).to(device), L


def levels_encode(x: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], width: int, rng: RngLike,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.levels_encode`."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    lv, L = _level_matrix(levels, _nbuckets(n, d), xv.device)
    if L > (1 << _width(width)):
        raise ValueError(f"{L} level indices do not fit in {width} bits")
    nbytes = (n * width + 7) // 8
    packed = _out(out, nbytes, torch.uint8, xv.device)
    k1, k2, ctr0 = _stream(rng, n)
    if n:
        _launch(_levels_encode_kernel, _grid(-(-n // 8), _groups()), xv, lv, packed, n, nbytes, d, k1, k2, ctr0,
                L=L, W=width, G=_groups(), WIDE=packed.data_ptr() % 4 == 0)
    return packed


def levels_decode(packed: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], width: int, n: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.levels_decode`."""
    nbytes = (n * _width(width) + 7) // 8
    data = _payload(packed, nbytes, f"{width}-bit indices")
    d = _bucket(n, bucket)
    lv, L = _level_matrix(levels, _nbuckets(n, d), data.device)
    res = _out(out, n, torch.float32, data.device)
    if n:
        grid = _grid(-(-n // 8), _groups())
        bad = torch.zeros(grid[0], dtype=torch.int32, device=data.device)
        _launch(_levels_decode_kernel, grid, data, lv, res, bad, n, nbytes, d, L, W=width, G=_groups(),
                WIDE=data.data_ptr() % 4 == 0)
        if int(bad.sum()):
            raise PayloadError(f"level index out of range [0, {L - 1}]")
    return res


_SORT_MAX = 4096       # longest bucket sorted in a Triton program (Linear's, ORQ's and BinGrad-pb's levels)
_ORQ_LEVELS_MAX = 17   # most ORQ levels built in a Triton program (more take the reference in torch)
_POSITIONS: dict = {}


def _positions(d: int, tail: int, L: int, device: torch.device) -> torch.Tensor:
    """Linear's sorted positions ``round(i·(m − 1)/(L − 1))`` (as ``reference.linear_levels``
    computes them) for a full bucket ``m = d`` and a last bucket ``m = tail``, made once per device."""
    key = (d, tail, L, str(device))
    if key not in _POSITIONS:
        _POSITIONS[key] = torch.cat([reference.linear_positions(m, L) for m in (d, max(tail, 1))]).to(device)
    return _POSITIONS[key]


def _torch_levels(xv: torch.Tensor, L: int, bucket: Optional[int], make_levels) -> torch.Tensor:
    """``(nb, L)`` levels of every bucket chunk of ``xv`` by the reference's ``make_levels``, in torch."""
    chunks = list(reference.bucket_chunks(xv, bucket))
    return torch.cat([make_levels(m, L) for m in chunks]) if chunks else xv.new_zeros(0, L)


def linear_levels(x: torch.Tensor, L: int, bucket: Optional[int]) -> torch.Tensor:
    """Linear's ``(nb, L)`` levels of every bucket of ``x``, as ``reference.linear_levels`` per bucket
    chunk: one Triton pass for buckets of up to ``_SORT_MAX`` values, torch for longer ones."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    reference.check_level_count(L)
    nb = _nbuckets(n, d)
    if d > _SORT_MAX:
        return _torch_levels(xv, L, bucket, reference.linear_levels)
    levels = torch.empty(nb, L, dtype=torch.float32, device=xv.device)
    if nb:
        p = max(16, 1 << (d - 1).bit_length())
        rows = _rows_per_program(max(1, TUNING["sort_elems"] // p), nb)
        _launch(_linear_levels_kernel, _grid(nb, rows), xv, _positions(d, n - (nb - 1) * d, L, xv.device), levels,
                n, d, nb, L=L, P=p, LOG=p.bit_length() - 1, ROWS=rows, num_warps=TUNING["sort_warps"])
    return levels


def orq_levels(x: torch.Tensor, L: int, bucket: Optional[int]) -> torch.Tensor:
    """ORQ's ``(nb, L)`` levels of every bucket of ``x``, as ``reference.orq_levels`` per bucket
    chunk: one Triton program a bucket for buckets of up to ``_SORT_MAX`` values and up to
    ``_ORQ_LEVELS_MAX`` levels, torch otherwise (and with a Triton that lacks ``tl.gather``)."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    reference.check_level_count(L)
    nb = _nbuckets(n, d)
    if d > _SORT_MAX or L > _ORQ_LEVELS_MAX or not hasattr(tl, "gather"):
        return _torch_levels(xv, L, bucket, reference.orq_levels)
    levels = torch.empty(nb, L, dtype=torch.float32, device=xv.device)
    if nb:
        p = max(16, 1 << (d - 1).bit_length())
        warps = min(32, max(1, p // TUNING["orq_warp_elems"]))
        _launch(_orq_levels_kernel, (nb,), xv, levels, n, d, L=L, LP=1 << (L - 1).bit_length(),
                ITER=(L - 1).bit_length() - 1, P=p, LOG=p.bit_length() - 1, num_warps=warps)
    return levels


def orq_encode(x: torch.Tensor, L: int, bucket: Optional[int], width: int, rng: RngLike,
               out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.orq_encode`: two passes, the levels and then the codes."""
    xv = _flat(x, "x", torch.float32)
    levels = orq_levels(xv, L, bucket)
    return levels_encode(xv, levels, bucket, width, rng, out), levels


def linear_encode(x: torch.Tensor, L: int, bucket: Optional[int], width: int, rng: RngLike,
                  out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.linear_encode`: two passes, the levels and then the codes."""
    xv = _flat(x, "x", torch.float32)
    levels = linear_levels(xv, L, bucket)
    return levels_encode(xv, levels, bucket, width, rng, out), levels


# -- one bit per element -------------------------------------------------------------------------
def threshold_encode(x: torch.Tensor, thresholds: torch.Tensor, bucket: Optional[int],
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.threshold_encode`."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    t = _vector(thresholds, _nbuckets(n, d), "thresholds", torch.float64, xv.device)
    nbytes = (n + 7) // 8
    packed = _out(out, nbytes, torch.uint8, xv.device)
    if n:
        _launch(_threshold_kernel, _grid(-(-n // 8), _groups()), xv, t, packed, n, nbytes, d, G=_groups())
    return packed


def sign_encode(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.sign_encode`."""
    xv = _flat(x, "x", torch.float32)
    zero = torch.zeros(1 if xv.numel() else 0, dtype=torch.float64, device=xv.device)
    return threshold_encode(xv, zero, None, out=out)


def bit_decode(packed: torch.Tensor, levels: torch.Tensor, bucket: Optional[int], n: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.bit_decode`."""
    nbytes = (n + 7) // 8
    data = _payload(packed, nbytes, "bits")
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    per = 2 if levels.dim() == 2 and levels.shape[1] == 2 else 1
    lv = _flat(levels, "levels", torch.float32).to(data.device)
    if lv.numel() != nb * per:
        raise ValueError(f"expected {nb * per} levels ({per} per bucket), got {lv.numel()}")
    res = _out(out, n, torch.float32, data.device)
    if n:
        _launch(_bit_decode_kernel, _grid(-(-n // 8), _groups()), data, lv, res, n, nbytes, d, PER=per, G=_groups())
    return res




def _rows_per_program(most: int, rows: int) -> int:
    """Whole buckets per program: ``most`` (a power of two, at least 1), fewer when there are fewer
    rows than that (a power of two covering them), so that no program is mostly masked."""
    return max(1, min(most, 1 << max(rows - 1, 0).bit_length()))


def _binary_stats(xv: torch.Tensor, bucket: Optional[int], mode: int, iters: int,
                  stats) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-bucket ``(float64 thresholds, flat float32 levels)`` as ``reference.one_bit_stats(xv,
    bucket, stats)``. Full buckets of a power-of-two size up to ``reference.SUM_BLOCK`` take one
    Triton pass (whole buckets per program, each read once, nothing input-sized allocated), a
    partial last bucket one more launch; buckets of other sizes take the reference in torch."""
    n = xv.numel()
    d = _bucket(n, bucket)
    nfull = n // d if d and n else 0
    if not nfull or d & (d - 1) or d > reference.SUM_BLOCK:
        return reference.one_bit_stats(xv, bucket, stats)
    per = 1 if mode == 0 else 2
    nb = _nbuckets(n, d)
    t = torch.empty(nb, dtype=torch.float64, device=xv.device)
    lv = torch.empty(nb * per, dtype=torch.float32, device=xv.device)
    rows = _rows_per_program(max(1, TUNING["stats_elems"] // d), nfull)
    log = d.bit_length() - 1
    _launch(_binary_stats_kernel, _grid(nfull, rows), xv, t, lv, t, nfull, d, MODE=mode, ITERS=iters, D=d,
            LOG=log, ROWS=rows, TAIL=False, num_warps=TUNING["stats_warps"])
    w = n - nfull * d
    if w:   # the partial last bucket: one program, its folds through a scratch row
        scratch = torch.empty(d, dtype=torch.float64, device=xv.device)
        _launch(_binary_stats_kernel, (1,), xv[nfull * d:], t[nfull:], lv[nfull * per:], scratch, 1, w, MODE=mode,
                ITERS=iters, D=d, LOG=log, ROWS=1, TAIL=True)
    return t, lv


def _one_bit(x: torch.Tensor, bucket: Optional[int], mode: int, iters: int,
             stats) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistics (:func:`_binary_stats`), then the bits."""
    xv = _flat(x, "x", torch.float32)
    t, lv = _binary_stats(xv, bucket, mode, iters, stats)
    return threshold_encode(xv, t, bucket), lv


def sign_scale_encode(x: torch.Tensor, bucket: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.sign_scale_encode`."""
    return _one_bit(x, bucket, 0, 0, reference.sign_scale_stats)


def onebit_encode(x: torch.Tensor, bucket: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.onebit_encode`."""
    return _one_bit(x, bucket, 1, 0, reference.onebit_stats)


def bingrad_b_encode(x: torch.Tensor, bucket: Optional[int], iters: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.bingrad_b_encode`."""
    return _one_bit(x, bucket, 2, iters, lambda mat: reference.bingrad_b_stats(mat, iters))


def bingrad_pb_levels(x: torch.Tensor, bucket: Optional[int]) -> torch.Tensor:
    """BinGrad-pb's float32 ``b`` of every bucket of ``x``, as ``reference.bingrad_pb_threshold`` per
    bucket chunk: whole buckets of up to ``_SORT_MAX`` values sorted in Triton programs, torch for
    longer ones."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    if d > _SORT_MAX:
        chunks = list(reference.bucket_chunks(xv, bucket))
        return torch.cat([reference.bingrad_pb_threshold(m) for m in chunks]) if chunks else xv.new_zeros(0)
    levels = torch.empty(nb, dtype=torch.float32, device=xv.device)
    if nb:
        p = max(16, 1 << (d - 1).bit_length())
        rows = _rows_per_program(max(1, TUNING["sort_elems"] // p), nb)
        _launch(_pb_level_kernel, _grid(nb, rows), xv, levels, n, d, nb, P=p, LOG=p.bit_length() - 1, ROWS=rows,
                num_warps=TUNING["sort_warps"])
    return levels


def bingrad_pb_encode(x: torch.Tensor, bucket: Optional[int], rng: RngLike) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gradq.kernels.reference.bingrad_pb_encode`: two passes, the level and then the bits."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    levels = bingrad_pb_levels(xv, bucket)
    nbytes = (n + 7) // 8
    packed = torch.empty(nbytes, dtype=torch.uint8, device=xv.device)
    k1, k2, ctr0 = _stream(rng, n)
    if n:
        _launch(_pb_bits_kernel, _grid(-(-n // 8), _groups()), xv, levels, packed, n, nbytes, d, k1, k2, ctr0,
                G=_groups())
    return packed, levels


# -- MultiScale ----------------------------------------------------------------------------------
def _ms_levels(levels, device: torch.device) -> torch.Tensor:
    lv = torch.tensor(list(levels), dtype=torch.float32)
    if lv.dim() != 1 or not 1 <= lv.numel() <= 255:
        raise ValueError(f"levels must be 1 to 255 increasing scales, got {levels!r}")
    return lv.to(device)


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


def multiscale_encode(x: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, levels, bucket: Optional[int],
                      width: int, index_width: int, rng: RngLike) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """As :func:`gradq.kernels.reference.multiscale_encode`."""
    xv = _flat(x, "x", torch.float32)
    n = xv.numel()
    d = _bucket(n, bucket)
    lv = _ms_levels(levels, xv.device)
    iv = _flat(index, "index", torch.uint8).to(xv.device)
    if iv.numel() != n:
        raise ValueError(f"expected {n} scale indices, got {iv.numel()}")
    nbytes, ibytes = (n * _width(width) + 7) // 8, (n * index_width + 7) // 8
    codes = torch.empty(nbytes, dtype=torch.uint8, device=xv.device)
    packed_index = torch.empty(ibytes, dtype=torch.uint8, device=xv.device) if index_width else None
    k1, k2, ctr0 = _stream(rng, n)
    if n:
        w = _vector(scales, _nbuckets(n, d), "scales", torch.float32, xv.device)
        grid = _grid(-(-n // 8), _groups())
        bad = torch.zeros(grid[0], dtype=torch.int32, device=xv.device)
        pidx = codes if packed_index is None else packed_index
        _launch(_ms_encode_kernel, grid, xv, w, iv, lv, codes, pidx, bad, n, nbytes, ibytes, d, k1, k2, ctr0,
                L=lv.numel(), W=width, IW=index_width, G=_groups(),
                WIDE=all(t.data_ptr() % 4 == 0 for t in (iv, codes, pidx)))
        if int(bad.sum()):  # (a host read: the check the reference makes)
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
    lv = _ms_levels(levels, cv.device)
    res = _out(out, n, torch.float32, cv.device)
    if n:
        w = _vector(scales, _nbuckets(n, d), "scales", torch.float32, cv.device)
        grid = _grid(-(-n // 8), _groups())
        bad = torch.zeros(grid[0], dtype=torch.int32, device=cv.device)
        _launch(_ms_decode_kernel, grid, cv, iv, w, lv, res, bad, n, nbytes, ibytes, d, L=lv.numel(), W=width,
                IW=index_width, G=_groups(), WIDE=cv.data_ptr() % 4 == 0 and iv.data_ptr() % 4 == 0)
        if int(bad.sum()):
            raise PayloadError(f"multiscale: corrupt scale index (>= {lv.numel()} scales)")
    return res
