"""Throughput of the fixed-width quantizers: numba kernels (gradq.kernels) against the plain-torch
references, relative to a memory copy measured in the same run.

For every scheme it times encode (quantize + pack, from a float32 vector to bytes) and decode (bytes to
float32), counting ``4n`` bytes of fp32 input/output, and divides by the throughput of a plain memory
copy of the same vector (``dst.copy_(x)`` into a preallocated tensor, torch's threads). Before timing,
the kernel's bytes and floats are checked to be identical to the reference's (same seed).

What each row measures (both paths compute the same thing):

* ``qsgd-b``: per-bucket max-abs norm, stochastic codes, ``b``-bit fields (bucket 512);
* ``maxnorm-b``: one max-abs scale for the whole tensor, then the codes (as the quantizer: the shared
  stat first, then the codes under it);
* ``terngrad-trit/-2bit``: clip at 2.5 standard deviations, max-abs scale of the clipped vector,
  ternary codes packed 5 per byte / 2 bits (the kernel path computes σ and the max-abs in one pass with
  ``kernels.terngrad_stats``; the reference computes σ in float64 with torch; they agree, see that function);
* ``orq-5``: stochastic rounding onto 5 given levels per bucket of 512, 3-bit indices (levels are
  computed once beforehand: their sort-based construction is not part of this kernel);
* ``signsgd``/``onebit``: the sign bits (``x >= 0``) packed 8 per byte; decode to ``±scale`` /
  two levels per bucket (the per-bucket float64 statistics are torch reductions in both paths and are
  not timed).

Kernel outputs go into preallocated tensors (``out=``); the torch references allocate as they do in the
quantizers.

A second table times the public API a user calls — ``q.encode(x, seed=…)`` (input validation, the
finiteness screen, shared statistics and the kernels, i.e. the default path), ``q.decode(p, out=buf)``
into a preallocated tensor and ``q.decode(p)`` returning a fresh tensor (a new 100 MB tensor is
page-faulted in on first touch, which costs about as much as the decode itself here) — for the
fixed-width schemes and for the Elias- and ANS-coded QSGD (``--no-api`` skips it). Medians of ``--repeats`` runs (``--ref-repeats`` for the slow references). Run:

    python benchmarks/bench_codecs.py [--n 25000000] [--repeats 7] [--ref-repeats 3] [--compile] [--no-api]
    python benchmarks/bench_codecs.py --memory [--device cuda] [--n 25000000] [--repeats 7]

``--memory`` prints, for every scheme of the quantizer API (the default backend of the device:
numba on the CPU, Triton on CUDA), the encode and ``decode(out=)`` times as ratios to a device copy
timed in the same run (CUDA events on a GPU), and the peak extra memory of each call: on CUDA
``torch.cuda.max_memory_allocated`` above what was allocated before the call, on the CPU the growth
of the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` before each
call). The encode's peak is given as a multiple of the payload's bytes, the decode's as a multiple
of the input's bytes (0 = no input-sized temporary). On CUDA the bytes of every scheme are first
checked against the CPU reference on the first million values, and four more columns give the
device's own time per call (the CUDA profiler's sum of the kernels, copies and fills it ran, with
their number) and its ratio to the copy's: what the kernels cost, apart from the host's share.

``--compile`` adds the tool comparison for 4-bit QSGD encode: the same math written as one torch
function (eager) and that function under ``torch.compile`` (inductor, CPU), with compile time reported
separately, next to the numba kernel.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch

from gradq import kernels as K
from gradq.codecs.bitpack import pack_bits, pack_trits, unpack_bits, unpack_trits
from gradq.quantizers._common import bucket_chunks, bucket_norms, bucket_view
from gradq.quantizers.orq import bucket_index, orq_levels, round_to_levels
from gradq.quantizers.qsgd import uniform_codes, uniform_decode
from gradq.quantizers.terngrad import clip_by_std
from gradq.random import GOLDEN32, RandomStream, _i32, mix32

SEED = 1234


def median_time(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(seconds of the first call, median seconds of ``repeats`` further calls)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(same(p, q) for p, q in zip(a, b))
    return a.dtype == b.dtype and torch.equal(a, b)


# ---- the cases ------------------------------------------------------------------------------------
def uniform_case(x: torch.Tensor, s: int, width: int, bucket, tern: str = ""):
    """Encode/decode closures (reference and kernel) for QSGD/MaxNorm (``tern=""``) and TernGrad."""
    n = x.numel()
    trit = tern == "trit"
    nbytes = (n + 4) // 5 if trit else (n * width + 7) // 8
    buf = torch.empty(nbytes, dtype=torch.uint8)

    def ref_enc():
        v = clip_by_std(x, 2.5) if tern else x
        mat = bucket_view(v, bucket)
        sc = bucket_norms(mat, "max")
        codes = uniform_codes(mat, sc, s, RandomStream(SEED)).reshape(-1)[:n] + s
        return (pack_trits(codes) if trit else pack_bits(codes, width)), sc

    def k_enc():
        if tern:
            bound, sc = K.terngrad_stats(x, 2.5, bucket)   # σ and the clipped max-abs in one pass
            if trit:
                return K.uniform_encode_trits(x, sc, bucket, SEED, clip=bound, out=buf), sc
            return K.uniform_encode(x, sc, s, bucket, width, SEED, clip=bound, out=buf), sc
        if bucket is None:   # MaxNorm: the shared scale first, then the codes under it
            sc = K.maxabs_scales(x, None)
            return K.uniform_encode(x, sc, s, None, width, SEED, out=buf), sc
        return K.maxabs_uniform_encode(x, s, bucket, width, SEED, out=buf)

    def ref_dec(enc):
        packed, sc = enc
        codes = unpack_trits(packed, n) if trit else unpack_bits(packed, width, n)
        return uniform_decode(codes - s, sc, s, n, bucket)

    def k_dec(enc, dst):
        packed, sc = enc
        if trit:
            return K.uniform_decode_trits(packed, sc, bucket, n, out=dst)
        return K.uniform_decode(packed, sc, s, bucket, width, n, max_field=2 if tern else None, out=dst)

    return ref_enc, k_enc, ref_dec, k_dec


def levels_case(x: torch.Tensor, L: int = 5, bucket: int = 512):
    n = x.numel()
    width = (L - 1).bit_length()
    chunks = list(bucket_chunks(x, bucket))
    lvs = [orq_levels(m, L) for m in chunks]
    levels = torch.cat(lvs)
    buf = torch.empty((n * width + 7) // 8, dtype=torch.uint8)

    def ref_enc():
        rng = RandomStream(SEED)
        codes = torch.cat([round_to_levels(m, lv, rng).reshape(-1) for m, lv in zip(chunks, lvs)])
        return pack_bits(codes, width)

    def k_enc():
        return K.levels_encode(x, levels, bucket, width, SEED, out=buf)

    def ref_dec(packed):
        idx = bucket_index(n, bucket, x.device) * L + unpack_bits(packed, width, n)
        return levels.reshape(-1)[idx]

    def k_dec(packed, dst):
        return K.levels_decode(packed, levels, bucket, width, n, out=dst)

    return ref_enc, k_enc, ref_dec, k_dec


def bits_case(x: torch.Tensor, two_level: bool, bucket: int = 512):
    n = x.numel()
    x64 = x.to(torch.float64)
    mats = list(bucket_chunks(x64, bucket))
    if two_level:   # 1BitSGD: means of the negative and the non-negative entries
        vals = []
        for m in mats:
            up = m >= 0
            lo = torch.where(~up, m, 0).sum(1) / (~up).sum(1).clamp(min=1)
            hi = torch.where(up, m, 0).sum(1) / up.sum(1).clamp(min=1)
            vals.append(torch.stack([lo, hi], 1))
        levels = torch.cat(vals).to(torch.float32)
    else:           # SignSGD: mean |x| per bucket
        levels = torch.cat([m.abs().mean(1) for m in mats]).to(torch.float32)
    buf = torch.empty((n + 7) // 8, dtype=torch.uint8)

    def ref_enc():
        return pack_bits(torch.cat([(m >= 0).reshape(-1) for m in bucket_chunks(x, bucket)]).to(torch.int64), 1)

    def k_enc():
        return K.sign_encode(x, out=buf)

    def ref_dec(packed):
        bits = unpack_bits(packed, 1, n)
        bidx = bucket_index(n, bucket, x.device)
        if two_level:
            return levels.reshape(-1)[bidx * 2 + bits]
        return levels[bidx] * (2 * bits - 1).to(torch.float32)

    def k_dec(packed, dst):
        return K.bit_decode(packed, levels, bucket, n, out=dst)

    return ref_enc, k_enc, ref_dec, k_dec


# ---- torch.compile comparison ---------------------------------------------------------------------
def qsgd4_torch(x: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor):
    """4-bit QSGD encode (bucket 512, max norm) as one torch function: the reference's math with the
    stream keys as tensors (so one compiled graph serves every seed); ``n`` a multiple of 512."""
    mat = x.view(-1, 512)
    sc = mat.abs().amax(dim=1)
    safe = torch.where(sc > 0, sc, torch.ones_like(sc)).unsqueeze(1)
    idx = torch.arange(x.numel(), dtype=torch.int32, device=x.device)
    h = mix32(mix32(idx * _i32(GOLDEN32) + k1) ^ k2)
    u = ((h >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / 16777216.0)
    mag = torch.floor(mat.abs() * (7 / safe) + u.view(mat.shape)).clamp_(max=7)
    c = ((torch.sign(mat) * mag).to(torch.int32) + 7).view(-1, 2)
    return (c[:, 0] | (c[:, 1] << 4)).to(torch.uint8), sc


def compare_compile(n: int, repeats: int, copy_gbs: float) -> None:
    n = max(512, n // 512 * 512)
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    rs = RandomStream(SEED)
    keys = (torch.tensor(_i32(rs.k1), dtype=torch.int32), torch.tensor(_i32(rs.k2), dtype=torch.int32))
    want = K.maxabs_uniform_encode(x, 7, 512, 4, SEED)
    rows = []
    first, t = median_time(lambda: qsgd4_torch(x, *keys), min(repeats, 3))
    assert same(qsgd4_torch(x, *keys), want), "eager torch function differs from the kernel"
    rows.append(("torch eager (one function)", first, t))
    compiled = torch.compile(qsgd4_torch)
    first, t = median_time(lambda: compiled(x, *keys), repeats)
    assert same(compiled(x, *keys), want), "compiled torch function differs from the kernel"
    rows.append(("torch.compile inductor (1st call = compile)", first, t))
    buf = torch.empty(n // 2, dtype=torch.uint8)
    first, t = median_time(lambda: K.maxabs_uniform_encode(x, 7, 512, 4, SEED, out=buf), repeats)
    rows.append(("numba kernel (1st call = JIT or cache load)", first, t))
    print(f"\n### Tool choice: 4-bit QSGD encode, n = {n:,}, bucket 512 (all bit-identical)\n")
    print("| implementation | first call s | median ms | GB/s | × copy |")
    print("|---|---:|---:|---:|---:|")
    for name, f, t in rows:
        print(f"| {name} | {f:.2f} | {t * 1e3:.1f} | {4 * n / t / 1e9:.2f} | {4 * n / t / 1e9 / copy_gbs:.2f} |")


# ---- main -----------------------------------------------------------------------------------------
API_SPECS = ["qsgd:bits=2,bucket=512", "qsgd:bits=4,bucket=512", "qsgd:bits=8,bucket=512", "maxnorm:bits=2",
             "maxnorm:bits=4", "maxnorm:bits=8", "terngrad", "terngrad:pack=2bit", "orq:levels=5", "signsgd",
             "onebit:ef=0", "bingrad-b", "qsgd:bits=4,coding=elias", "qsgd:bits=4,coding=ans"]


def paired_rounds(x: torch.Tensor, dst: torch.Tensor, cases: dict, rounds: int, repeats: int) -> None:
    """Per round and kernel: the copy's median time, then the kernel's; the ratio copy/kernel of each
    round, and their median. Pairing cancels the slow drifts of a shared machine."""
    print(f"\n### Encode and decode ÷ copy, median of {rounds} paired rounds\n")
    print("| scheme | encode × copy (median) | min–max | decode × copy (median) | min–max |")
    print("|---|---:|---:|---:|---:|")
    for name, (_, k_enc, _, k_dec) in cases.items():
        enc = k_enc()
        enc = tuple(e.clone() for e in enc)
        out = torch.empty_like(dst)
        re, rd = [], []
        for _ in range(rounds):
            _, tc = median_time(lambda: dst.copy_(x), repeats)
            _, te = median_time(k_enc, repeats)
            _, td = median_time(lambda: k_dec(enc, out), repeats)
            re.append(tc / te)
            rd.append(tc / td)
        print(f"| {name} | {statistics.median(re):.2f} | {min(re):.2f}–{max(re):.2f} | "
              f"{statistics.median(rd):.2f} | {min(rd):.2f}–{max(rd):.2f} |", flush=True)


def api_table(x: torch.Tensor, dst: torch.Tensor, repeats: int, copy_gbs: float) -> None:
    """Throughput of ``q.encode`` / ``q.decode(out=)`` / ``q.decode`` for each spec (see the docstring)."""
    import gradq

    n = x.numel()
    print(f"\n### Through the quantizer API (default path), n = {n:,}\n")
    print("| spec | encode GB/s | × copy | decode(out=) GB/s | × copy | decode() GB/s | × copy | bits/coord |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec in API_SPECS:
        try:
            q = gradq.build(spec)
        except ImportError as e:  # coding=ans without constriction
            print(f"| {spec} | skipped: {e} |||||||")
            continue
        p = q.encode(x, seed=SEED)
        _, te = median_time(lambda: q.encode(x, seed=SEED), repeats)
        _, tdo = median_time(lambda: q.decode(p, out=dst), repeats)
        _, tdf = median_time(lambda: q.decode(p), repeats)
        g = [4 * n / t / 1e9 for t in (te, tdo, tdf)]
        print(f"| {spec} | {g[0]:.2f} | {g[0] / copy_gbs:.2f} | {g[1]:.2f} | {g[1] / copy_gbs:.2f} | "
              f"{g[2]:.2f} | {g[2] / copy_gbs:.2f} | {p.bits_per_coordinate:.3f} |", flush=True)


# ---- peak memory and device timing (--memory) ----------------------------------------------------
MEMORY_SPECS = ["qsgd:bits=2,bucket=512", "qsgd:bits=4,bucket=512", "qsgd:bits=8,bucket=512",
                "qsgd:bits=4,bucket=512,norm=l2", "terngrad", "terngrad:pack=2bit", "maxnorm:bits=2", "maxnorm:bits=4",
                "maxnorm:bits=8", "multiscale:bits=2+6", "randk-maxnorm:ratio=0.01,bits=4",
                "randk-multiscale:ratio=0.01,bits=2+6", "orq:levels=5", "orq:levels=9", "linear:levels=5", "signsgd",
                "onebit:ef=0", "bingrad-b", "bingrad-pb", "qsgd:bits=4,coding=elias", "topk:ratio=0.01",
                "randk:ratio=0.01"]


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def peak_extra(fn: Callable[[], object], device: torch.device) -> tuple[object, int]:
    """``(fn(), peak bytes allocated above the level before the call)``."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        res = fn()
        torch.cuda.synchronize()
        return res, torch.cuda.max_memory_allocated() - base
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system, so reuse shows as growth
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM (the peak RSS) to the current RSS
        f.write("5")
    base = _proc_status("VmRSS")
    res = fn()
    return res, _proc_status("VmHWM") - base


def device_time(fn: Callable[[], object], repeats: int, device: torch.device, batch: int = 1) -> float:
    """Median seconds per call of ``repeats`` timings after one warm-up. On a GPU each timing is a pair of
    CUDA events around ``batch`` back-to-back calls (divided by ``batch``): the host queues the next
    call while the device runs the last, as in training, so a call's Python cost counts only where it
    exceeds the device's time."""
    fn()
    if device.type != "cuda":
        return median_time(fn, repeats)[1]
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / batch)
    return statistics.median(times)


def kernel_time(fn: Callable[[], object], calls: int = 5) -> tuple[float, float, dict]:
    """On CUDA: ``(device seconds per call, device operations per call, {kernel name: µs per call})``,
    summed over the kernels, copies and fills the profiler sees the device run during ``calls`` calls
    after one warm-up. What the device itself spends, whatever the host adds between launches; the
    difference from ``device_time`` is the host's share."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict = {}
    count = 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            count += 1
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.time_range.elapsed_us() / calls
    return sum(per_kernel.values()) / 1e6, count / calls, per_kernel


def _kernel_columns(q, x: torch.Tensor, dst: torch.Tensor, p, t_copy_dev: float) -> tuple[str, dict]:
    """The device-only columns of a CUDA row (see ``kernel_time``), or blanks where the profiler fails."""
    seeds = itertools.count(SEED + 1000)
    try:
        ke, ne, kinds_e = kernel_time(lambda: q.encode(x, seed=next(seeds)))
        kd, nd, kinds_d = kernel_time(lambda: q.decode(p, out=dst))
    except Exception as e:  # a profiler that cannot start must not hide the timings
        return f" profiler failed: {type(e).__name__} | |", {}
    top = sorted(kinds_e.items(), key=lambda kv: -kv[1])[:3]
    cols = f" {ke * 1e3:.3f} ({ne:.0f}) | {t_copy_dev / ke:.3f} | {kd * 1e3:.3f} ({nd:.0f}) | {t_copy_dev / kd:.3f} |"
    return cols, {"encode_device_ms": ke * 1e3, "encode_device_ops": ne, "decode_device_ms": kd * 1e3,
                  "decode_device_ops": nd, "encode_top_kernels_us": {k[:80]: round(v, 2) for k, v in top}}


def _memory_row(q, x: torch.Tensor, dst: torch.Tensor, repeats: int, device: torch.device, batch: int,
                t_copy: float, t_copy_dev: Optional[float] = None) -> dict:
    """Time one scheme for ``memory_table``, print its row and return it. On CUDA the bytes are first
    compared with the CPU reference on the first million values; a difference is printed in the row
    (``bytes DIFFER``) and the scheme is still timed."""
    n = x.numel()
    note = ""
    if device.type == "cuda":
        head = x[: min(n, 1 << 20)]
        was = K.get_backend()
        K.set_backend("torch")
        try:
            ref = q.encode(head.cpu(), seed=SEED)
        finally:
            K.set_backend(was)
        note = "" if q.encode(head, seed=SEED).same_bytes(ref) else " (bytes DIFFER from the CPU's)"
    q.encode(x, seed=SEED)   # warm-ups: a first call loads (or compiles) its kernels, once a process
    # (another seed than the warm-up's, as a new step's: a scheme that keeps its last selection of
    # coordinates, as the Rand-K family does, makes the selection inside the measured call)
    p, enc_peak = peak_extra(lambda: q.encode(x, seed=SEED + 500), device)
    q.decode(p, out=dst)
    _, dec_peak = peak_extra(lambda: q.decode(p, out=dst), device)
    seeds = itertools.count(SEED + 1)   # a new step's seed each call, as in training
    te = device_time(lambda: q.encode(x, seed=next(seeds)), repeats, device, batch)
    td = device_time(lambda: q.decode(p, out=dst), repeats, device, batch)
    extra, dev = _kernel_columns(q, x, dst, p, t_copy_dev) if t_copy_dev else ("", {})
    if device.type == "cuda":   # as the DDP hook encodes (it screened x itself): no host read per call
        teu = device_time(lambda: q.encode(x, seed=next(seeds), check_finite=False), repeats, device, batch)
        extra += f" {teu * 1e3:.3f} | {t_copy / teu:.3f} |"
        dev["encode_unchecked_ms"] = teu * 1e3
        # and as its protocols decode: a corrupt payload counted on the device, refused at the step's
        # end (gradq.kernels.deferred_checks), so no decode waits for a host read
        with K.deferred_checks() as checks:
            tdd = device_time(lambda: q.decode(p, out=dst), repeats, device, batch)
        checks.check()
        extra += f" {tdd * 1e3:.3f} | {t_copy / tdd:.3f} |"
        dev["decode_deferred_ms"] = tdd * 1e3
    print(f"| {q.spec}{note} | {te * 1e3:.3f} | {t_copy / te:.3f} | {td * 1e3:.3f} | {t_copy / td:.3f} | "
          f"{enc_peak / p.nbytes:.2f} | {dec_peak / (4 * n):.2f} | {p.bits_per_coordinate:.3f} |{extra}", flush=True)
    return {"spec": q.spec, "encode_ms": te * 1e3, "decode_ms": td * 1e3, "bits_per_coordinate": p.bits_per_coordinate,
            "encode_peak_per_payload": enc_peak / p.nbytes, "decode_peak_per_input": dec_peak / (4 * n),
            "same_bytes_as_cpu": not note, **dev}


def memory_table(n: int, repeats: int, device: torch.device, json_path: Optional[str] = None,
                 specs: Optional[list[str]] = None, batch: Optional[int] = None) -> None:
    """Encode / decode(out=) ÷ a device copy, and their peak extra memory, per scheme; with ``json_path``
    also the measured times as JSON, the file ``gradq perfmodel --codec-times`` reads."""
    import gradq

    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    dst = torch.empty_like(x)
    dst.fill_(0.0)  # touched, as a hook's bucket is
    t_copy = device_time(lambda: dst.copy_(x), repeats, device, 5 if device.type == "cuda" else 1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n### Encode and decode on {device.type} ({name}), n = {n:,} float32, backend "
          f"{K.backend_for(x)}\n")
    print(f"device copy dst.copy_(x): {t_copy * 1e3:.3f} ms ({8 * n / t_copy / 1e9:.1f} GB/s read + written)")
    t_copy_dev = None
    if device.type == "cuda":
        try:
            t_copy_dev = kernel_time(lambda: dst.copy_(x))[0]
            print(f"the copy's device time alone: {t_copy_dev * 1e3:.3f} ms; the last four columns are the device's "
                  "time alone (the sum of what the profiler sees it run, operations per call in brackets) and its "
                  "ratio to that")
        except Exception as e:
            print(f"profiler unavailable ({type(e).__name__}: {e}); no device-only columns")
    head = ("| spec | encode ms | × copy | decode(out=) ms | × copy | encode peak extra ÷ payload bytes "
            "| decode(out=) peak extra ÷ input bytes | bits/coord |")
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|"
    if t_copy_dev:
        head += " encode device ms (ops) | × copy | decode device ms (ops) | × copy |"
        rule += "---:|---:|---:|---:|"
    if device.type == "cuda":
        head += " encode(check_finite=False) ms | × copy | decode(out=), checks deferred ms | × copy |"
        rule += "---:|---:|---:|---:|"
    print("\n" + head + "\n" + rule)
    rows = []
    if batch is None:   # on a GPU the host queues the next call while the device runs the last
        batch = 5 if device.type == "cuda" else 1
    failed = []
    for spec in specs or MEMORY_SPECS:
        try:
            row = _memory_row(gradq.build(spec), x, dst, repeats, device, batch, t_copy, t_copy_dev)
        except Exception as e:  # one scheme's failure must not hide the others' figures
            failed.append(spec)
            print(f"| {spec} | failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''} |"
                  " | | | | | |", flush=True)
            continue
        rows.append(row)
    if json_path:
        import datetime
        import json

        doc = {"format": "gradq-codec-times/1", "device": device.type, "device_name": name, "n": n,
               "input_mb": 4 * n / 1e6, "copy_ms": t_copy * 1e3,
               "copy_device_ms": t_copy_dev * 1e3 if t_copy_dev else None, "repeats": repeats, "torch": torch.__version__,
               "backend": K.backend_for(x), "measured": datetime.date.today().isoformat(),
               "command": "python benchmarks/bench_codecs.py " + " ".join(sys.argv[1:]), "rows": rows}
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nwrote {json_path}")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=25_000_000, help="number of fp32 values")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per kernel (median)")
    ap.add_argument("--ref-repeats", type=int, default=3, help="timed runs per torch reference (median)")
    ap.add_argument("--compile", action="store_true", help="add the torch.compile comparison")
    ap.add_argument("--no-api", action="store_true", help="skip the table of the public quantizer API")
    ap.add_argument("--rounds", type=int, default=0,
                    help="also time the target kernels (QSGD/MaxNorm 2/4/8, TernGrad) in this many rounds, each "
                         "round timing the copy right before the kernel; prints the median of per-round ratios")
    ap.add_argument("--memory", action="store_true",
                    help="only the table of encode/decode ratios and peak memory per scheme (see the docstring)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda, for --memory")
    ap.add_argument("--batch", type=int, help="--memory: calls issued back to back per timing (default 5 on a GPU, "
                    "where a larger batch hides more of the host's time per call, 1 on the CPU)")
    ap.add_argument("--json", metavar="FILE", help="--memory: also write the measured times as JSON (the file "
                                                   "`gradq perfmodel --codec-times FILE` reads)")
    ap.add_argument("--spec", action="append", help="--memory: time this spec (repeatable; default: the list "
                                                    "in MEMORY_SPECS)")
    args = ap.parse_args()
    if args.memory or args.device != "cpu":
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU here")
        memory_table(args.n, args.repeats, device, args.json, args.spec, args.batch)
        return
    if not K.available():
        raise SystemExit("gradq.kernels is not available (numba missing or GRADQ_KERNELS=0)")
    import numba

    n = args.n
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    dst = torch.empty(n)
    _, t_copy = median_time(lambda: dst.copy_(x), args.repeats)
    xn, dn = x.numpy(), dst.numpy()
    _, t_np = median_time(lambda: np.copyto(dn, xn), args.repeats)
    _, t_clone = median_time(lambda: x.clone(), args.repeats)
    copy_gbs = 4 * n / t_copy / 1e9
    print(f"n = {n:,} fp32 ({4 * n / 1e6:.0f} MB); torch threads {torch.get_num_threads()}, "
          f"numba threads {numba.get_num_threads()}")
    print(f"memory copy: torch dst.copy_(x) preallocated {copy_gbs:.2f} GB/s (the baseline below); "
          f"np.copyto {4 * n / t_np / 1e9:.2f} GB/s; x.clone() (allocating) {4 * n / t_clone / 1e9:.2f} GB/s\n")

    cases = []
    for b in (2, 4, 8):
        cases.append((f"qsgd-{b}", uniform_case(x, (1 << (b - 1)) - 1, b, 512)))
    for b in (2, 4, 8):
        cases.append((f"maxnorm-{b}", uniform_case(x, (1 << (b - 1)) - 1, b, None)))
    cases.append(("terngrad-trit", uniform_case(x, 1, 2, None, tern="trit")))
    cases.append(("terngrad-2bit", uniform_case(x, 1, 2, None, tern="2bit")))
    cases.append(("orq-5 (given levels)", levels_case(x)))
    cases.append(("signsgd", bits_case(x, two_level=False)))
    cases.append(("onebit", bits_case(x, two_level=True)))

    print("| scheme | path | encode GB/s | × copy | decode GB/s | × copy | kernel 1st call s (enc+dec) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, (ref_enc, k_enc, ref_dec, k_dec) in cases:
        f_e, t_ke = median_time(k_enc, args.repeats)
        enc = k_enc()
        enc = tuple(e.clone() for e in enc) if isinstance(enc, tuple) else enc.clone()
        f_d, t_kd = median_time(lambda: k_dec(enc, dst), args.repeats)
        _, t_re = median_time(ref_enc, args.ref_repeats)
        ref = ref_enc()
        assert same(ref, enc), f"{name}: kernel bytes differ from the torch reference"
        _, t_rd = median_time(lambda: ref_dec(ref), args.ref_repeats)
        assert same(ref_dec(ref), k_dec(enc, dst)), f"{name}: kernel decode differs from the reference"
        for path, te, td, first in (("numba", t_ke, t_kd, f"{f_e + f_d:.2f}"), ("torch", t_re, t_rd, "")):
            ge, gd = 4 * n / te / 1e9, 4 * n / td / 1e9
            print(f"| {name} | {path} | {ge:.2f} | {ge / copy_gbs:.2f} | {gd:.2f} | {gd / copy_gbs:.2f} | {first} |",
                  flush=True)
    print(f"\n(numba threading layer: {numba.threading_layer()})")
    if args.rounds:
        paired_rounds(x, dst, {name: case for name, case in cases if name.startswith(("qsgd", "maxnorm", "terngrad"))},
                      args.rounds, args.repeats)
    if not args.no_api:
        api_table(x, dst, args.repeats, copy_gbs)
    if args.compile:
        compare_compile(n, args.repeats, copy_gbs)


if __name__ == "__main__":
    main()
