"""What gradq's Triton kernels share: the interpreter switch, the launch settings, device helpers and
argument checks.

* **The interpreter.** Without a GPU the kernels run under Triton's interpreter (tests); it is
  switched on here, before triton is first imported.
* **Launch settings** (:data:`TUNING`, ``GRADQ_TRITON_TUNING``) and :func:`_launch`, which turns off
  FMA contraction on a GPU.
* **Device helpers** of the element-wise kernels (:mod:`gradq.kernels.triton_ops`): counter-based
  uniforms (:func:`_uniform_at`), groups of eight values loaded, packed, unpacked and stored in one
  thread (:func:`_load8`, :func:`_pack8`, :func:`_unpack8`, :func:`_store8`), a program's span of
  counters and buckets (:func:`_span`, :func:`_bucket_split`, :func:`_row_of`, :func:`_fast`).
* **Argument checks** on the host (:func:`_flat`, :func:`_out`, :func:`_vector`, :func:`_payload`).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from typing import Optional

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

#: Integer arguments that are values rather than sizes. Triton compiles a kernel of its own when an
#: integer argument equals 1 (passed as a constant, on which ``s.to(...)`` fails) or is divisible by
#: 16; for these that would break the kernel (2-bit codes have ``s = 1``) or compile new kernels as
#: the per-step seeds change, so they are never specialized.
VALUE_ARGS = ("s", "clip", "k1", "k2", "ctr0", "max_field", "L", "w", "h0", "h1", "base", "cap", "limit", "pad",
              "tail", "t", "lo", "shift", "width", "need0", "rk1", "rk2", "lo0", "hi0")


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
# (one ``tl`` for all), so theirs skip that step. Triton's own library functions (``tl.sum``,
# ``tl.cumsum``, ``tl.randint4x``...) see ``triton.language.core`` under another name, which a
# launch does not patch; the first library call patches it, and that patch is never undone (Triton
# keeps no handle on it). So a library call repeats the patch only while that module still holds
# Triton's own builtins: the same state, without walking every module a call (another sixth of the
# interpreter tests' time).
try:
    from triton.runtime import interpreter as _interpreter
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

        class _LibraryCall(_Interpreted):
            _gradq_langs: tuple = ()  # the language modules Triton's ``_patch_lang`` patches for it

            def __call__(self, *args, **kwargs):
                langs = self._gradq_langs
                if not langs or any(tl.core.is_builtin(lang.full) for lang in langs):
                    _interpreter._patch_lang(self.fn)
                fn = self.rewrite()
                try:
                    return fn(*args, **kwargs)
                except Exception as e:
                    raise _InterpreterError(repr(e)) from e

        if INTERPRETED and hasattr(_interpreter, "_patch_lang") and hasattr(tl.core, "full"):
            for _mod in (tl, tl.core, tl.standard, tl.random, tl.math):
                for _f in list(vars(_mod).values()):
                    if type(_f) is _Interpreted:
                        _f.__class__ = _LibraryCall
                        _f._gradq_langs = tuple(v for v in _f.fn.__globals__.values() if v is tl or v is tl.core)

# The interpreter also rebuilds its table of dtypes at every use (a tenth of its time in the
# tests). The same table, built once, gives the same answers: checked here for every entry.
if INTERPRETED and _Interpreted is not None and callable(getattr(_interpreter, "_get_np_dtype", None)):
    def _np_dtype_table(lookup):
        names = ("int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
                 "int64", "uint64", "bfloat16", "float8e5", "float8e5b16", "float8e4nv", "float8e4b8",
                 "float8e4b15")
        table = {getattr(tl, n): lookup(getattr(tl, n)) for n in names if hasattr(tl, n)}
        pointer = lookup(tl.pointer_type(tl.float32))

        def get(tt_dtype):
            if isinstance(tt_dtype, tl.pointer_type):
                return pointer
            if isinstance(tt_dtype, tl.block_type):
                tt_dtype = tt_dtype.element_ty
                if isinstance(tt_dtype, tl.pointer_type):
                    return pointer
            return table[tt_dtype]

        probes = [*table, tl.pointer_type(tl.int8), tl.block_type(tl.float32, [4]),
                  tl.block_type(tl.pointer_type(tl.uint8), [4])]
        return get if all(get(t) == lookup(t) for t in probes) else lookup

    _interpreter._get_np_dtype = _np_dtype_table(_interpreter._get_np_dtype)

# Every integer +, − and × of 32 bits or fewer builds an overflow check beside it (the operands widened
# to int64, the operation again, two comparisons), and hands it to ``device_assert``, which keeps it
# only in debug mode. The interpreter's options are not in debug mode, so each check is computed over
# every lane and then dropped: about half of a hashing kernel's time under the interpreter. Its
# options skip the check while debug mode is off; the results cannot differ, the check having no
# other effect.
if INTERPRETED and _Interpreted is not None:
    _builder = getattr(_interpreter, "interpreter_builder", None)
    _opts = getattr(_builder, "options", None)
    if getattr(_opts, "debug", True) is False and getattr(_opts, "sanitize_overflow", False) is True:
        import dataclasses

        _builder.options = dataclasses.replace(_opts, sanitize_overflow=False)


#: Launch shapes: how much work a program takes and how many warps run it. None of them changes a
#: result (every value's randomness is its own counter, every bucket is folded whole by one
#: program), only the speed; ``benchmarks/bench_triton_tuning.py`` times the alternatives on a GPU
#: (and checks that the bytes stay the same). The interpreter ignores the warps.
#: The values are the fastest measured on an H100 (docs/performance.md, "Launch settings" and "Third
#: H100 session"): two warps a program gave Linear's sort 1.3× against four; one warp on 512 values
#: made the one-bit statistics kernel 2.7–3.7× faster than two on 1,024; the one-pass QSGD encode
#: on 1,024 values and four warps (fewer values a thread, fewer registers) took 1.11–1.18× less
#: device time than on 2,048 and two at 2 and 8 bits and with the L2 norm, the same at 4 bits.
#: An H200 (2026-11-29, "Fifth GPU session" there) chose the radix selects' bins (Top-K's 64
#: against 2,048: 5.5× less device time; Rand-K's 256: 2.5×) and TernGrad's merge tree.
TUNING = {
    "groups": 64,           # groups of 8 fields a program: the element-wise encodes, decodes
    "groups_warps": 2,      # (and the trits' warps)
    "trit_bytes": 256,      # bytes of five trits a program in TernGrad's encode, and in its decode: four a
    "trit_decode_bytes": 256,  # thread at two warps, in 16-byte loads or stores (against 64, a byte a thread:
                            # sm_90 instructions a value 64.6 -> 44.8 and 47.0 -> 16.8; not yet timed on a GPU)
    "fused_elems": 1024,    # values a program in the one-pass QSGD encode (whole buckets)
    "fused_warps": 4,
    "stats_elems": 512,     # values a program in the one-bit statistics (whole buckets)
    "stats_warps": 1,
    "stats_passes": 1,      # reads of x in the one-bit encodes: 1, the bits in the statistics' pass; 2, a pass each
    "stats_tail": 1,        # a partial last bucket's statistics: 1, the launch's last program; 2, a launch of
                            # its own (the main one then needs fewer registers: SignSGD's 65 against 127; on an
                            # H200 1.13-1.25x less device time, but a launch more where the host sets the pace)
    "sort_elems": 1024,     # values a program in Linear's levels (whole buckets, padded to powers of two)
    "sort_warps": 2,
    "orq_warp_elems": 128,  # values a warp in ORQ's levels (one bucket a program)
    "elias_warps": 8,       # the Elias stream's count and write passes (gradq.kernels.triton_elias)
    "maxabs_elems": 4096,   # values a program in the max-abs pass (MaxNorm's, MultiScale's, bucketed TernGrad's)
    "moment_launches": 2,   # TernGrad's moments: 1, merged by their last block (1.2x slower on an H200); 2, a tree
    "moment_chunk": 1024,   # blocks' triples a program of that tree merges (6 programs, then 1, for 25M values:
                            # 11 us of an H200's 111 us TernGrad encode)
    "subset_path": 1,       # RandK's subset: 1, a Triton candidate pass (or the implicit subset); 2, torch's topk
    "subset_elems": 1024,   # counters a program in that candidate pass (54 registers a thread at sm_90,
    "subset_warps": 4,      # against 182 with 4,096)
    "randk_path": 1,        # the Rand-K family: 1, an implicit subset (gradq.kernels.triton_randk: no host read);
    "randk_elems": 8192,    # 2, the candidates' indices (a host read each selection) and a gather. Counters a
    "randk_warps": 4,       # program there (one int32 of running sums a program is kept per selection; it loops
    "randk_bins": 256,      # over 1,024 at a time), and at most this many bins a level of its radix select
    "topk_path": 1,         # Top-K's selection: 1, a radix select on the device (gradq.kernels.triton_topk; 3.5x
    "topk_elems": 4096,     # less device time than 2 on an H200); 2, torch's topk of n int64 keys. Values a
    "topk_warps": 4,        # program in its passes, 1,024 at a time,
    "topk_bins": 64,        # and bins a level of the radix select (6 bits a level: 31 in six)
    "witness_path": 1,      # a checked encode's look at its non-finite witness (a value per bucket): 1, torch's
                            # sum (a reduction kernel: 10-18 us on an H200 for 49K-98K values); 2, a Triton kernel
                            # of exponent-bit flags, a flag per 4,096 values read at once (not yet on a GPU)
    "read_bits": 256,       # stream bits a lane in the Elias reader (gradq.kernels.triton_elias_read;
    "read_warps": 1,        # 32 lanes a warp, not yet on a GPU)
    "crc_words": 1024,      # 4-byte words a program in the device CRC-32 (not yet on a GPU)
    "crc_warps": 8,         # (63 registers a thread at sm_90; 161 with 4 warps)
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


def _groups(key: str = "groups") -> int:
    """Groups a program of the element-wise kernels: of eight fields, or (``trit_bytes``,
    ``trit_decode_bytes``) bytes of five trits."""
    return TUNING[key]


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
def _split4(t):
    """The four columns of ``[N, 4]`` as four ``[N]`` tensors. ``tl.split`` keeps a thread's values
    in its registers, where a sum over the axis would shuffle them between threads."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    return c0, c1, c2, c3


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
def _one_bucket(first, bucket, PER: tl.constexpr, BIG: tl.constexpr):
    """With BIG (buckets of at least PER values), whether the PER values from ``first`` lie in one
    bucket: the element-wise kernels then use that bucket's scale for all of them (``BIG`` 2)."""
    if BIG:
        return _bucket_split(first, bucket, PER)[1] == PER
    else:
        return False


@_jit
def _bucket_of(first, o, bucket):
    """The bucket (int64) of values ``first + o`` (``o`` int32 offsets < 2**31, buckets < 2**31):
    one 64-bit division a program, 32-bit ones a value."""
    b0 = first // bucket
    r0 = (first - b0 * bucket).to(tl.int32)
    return b0 + (r0 + o) // tl.cast(bucket, tl.int32)


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


#: small constant tensors per (device, dtype, value): kernel arguments that need no launch to make
_CONSTANTS: dict = {}


def _constant(device: torch.device, dtype: torch.dtype, value: int = 0) -> torch.Tensor:
    """A one-element tensor holding ``value``, made once per device (read-only by the kernels)."""
    key = (str(device), dtype, value)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.full((1,), value, dtype=dtype, device=device)
    return _CONSTANTS[key]
