"""Machine instructions per value of the Triton codec kernels for an H100 (sm_90), counted without a GPU.

A one-pass encode at a gradient's size is bound by instruction issue, not by memory: profiled on an
H100, the 4-bit QSGD encode ran its SMs at 90 % of their issue rate while DRAM carried 38 % of its
bandwidth (docs/performance.md, "What limits each kernel"). Its time then follows the number of
instructions each value costs. This script compiles each element-wise kernel as a launch would (the
shipped launch shape from ``TUNING``; pointers, ``n`` and byte counts divisible by 16, as Triton
specializes them for a fresh tensor of 25M values), disassembles it with the ``nvdisasm`` that
ships with Triton and divides the kernel's instructions by the values each thread handles:

    python benchmarks/bench_sass.py [--kernel SUBSTRING ...] [--ops]

It also prints the registers a thread uses (``cuobjdump --dump-resource-usage``), which bound how
many warps an SM can hold to hide latency.

Kernels with an unmasked path for whole programs (the one-pass QSGD encode) are counted on that
path, which every program but the last runs. A Triton copy kernel (16-byte loads and stores), the
memory-bound baseline, is counted in the same run. A static count is not a time: the mix of
instructions matters (integer and logic operations issue at half the rate of float ones on an H100's
SM sub-partitions), and so do memory stalls. Times come from ``bench_codecs.py --device cuda`` on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("GRADQ_TRITON_INTERPRET", "0")   # compile for a GPU target, even on a machine without one

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from gradq.kernels import triton_elias as E  # noqa: E402
from gradq.kernels import triton_elias_read as ER  # noqa: E402
from gradq.kernels import triton_binary as B  # noqa: E402
from gradq.kernels import triton_decode as D  # noqa: E402
from gradq.kernels import triton_levels as L  # noqa: E402
from gradq.kernels import triton_moments as MO  # noqa: E402
from gradq.kernels import triton_multiscale as M  # noqa: E402
from gradq.kernels import triton_ops as T  # noqa: E402
from gradq.kernels import triton_randk as K  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
CUOBJDUMP = os.path.join(os.path.dirname(NVDISASM), "cuobjdump")
PF, P8, P32, PF64, PI64, I, U, F, C = "*fp32", "*u8", "*i32", "*fp64", "*i64", "i64", "u32", "fp32", "constexpr"
SIZES = ("n", "nbytes", "nb", "first", "left")   # size arguments: divisible by 16 for a 25M-value tensor


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """The baseline: ``y = x``, BLOCK values a program."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + idx, tl.load(x_ptr + idx, mask=idx < n), mask=idx < n)


def _cases() -> list[tuple]:
    """(label, kernel, signature, constexprs, values a program, warps)."""
    G, gw = T.TUNING["groups"], T.TUNING["groups_warps"]
    TG, TD = T.TUNING["trit_bytes"], T.TUNING["trit_decode_bytes"]
    bucket = 512
    r = max(1, T.TUNING["fused_elems"] // bucket)
    fused_sig = dict(x_ptr=PF, scales_ptr=PF, out_ptr=P8, first=I, rem="i32", nbytes=I, nb=I, s="i32", clip=F,
                     k1=I, k2=I, lo0=U, hi0=U, W=C, BUCKET=C, R=C, CLIP=C, WIDE=C, FULL=C, L2=C)
    enc_sig = dict(x_ptr=PF, scales_ptr=PF, out_ptr=P8, first=I, rem="i32", nbytes=I, nb=I, bucket=I, s="i32",
                   clip=F, k1=I, k2=I, lo0=U, hi0=U, W=C, TRITS=C, G=C, BIG=C, CLIP=C, WIDE=C, FULL=C)
    dec_sig = dict(base_ptr=P8, offs_ptr=PI64, scales_ptr=PF, out_ptr=PF, bad_ptr=P32, first=I, rem="i32",
                   nbytes=I, nb=I, bucket=I, s="i32", max_field="i32", M=C, W=C, TRITS=C, G=C, CHECK=C, BIG=C,
                   WIDE=C, FULL=C)
    cases = [("copy (baseline)", _copy_kernel, dict(x_ptr=PF, y_ptr=PF, n=I, BLOCK=C), dict(BLOCK=1024), 1024, 4)]
    for w in (2, 4, 8):
        cases.append((f"qsgd one-pass encode, {w}-bit, bucket {bucket}", T._norm_uniform_body, fused_sig,
                      dict(W=w, BUCKET=bucket, R=r, CLIP=False, WIDE=True, FULL=True, L2=False), r * bucket,
                      T.TUNING["fused_warps"]))
    cases.append(("qsgd one-pass encode, 4-bit, L2 norm", T._norm_uniform_body, fused_sig,
                  dict(W=4, BUCKET=bucket, R=r, CLIP=False, WIDE=True, FULL=True, L2=True), r * bucket,
                  T.TUNING["fused_warps"]))
    cases += [
        ("uniform encode (scales given), 4-bit", T._uniform_encode_body, enc_sig,
         dict(W=4, TRITS=False, G=G, BIG=2, CLIP=False, WIDE=True, FULL=True), 8 * G, gw),
        ("uniform encode (scales given), trits", T._uniform_encode_body, enc_sig,
         dict(W=1, TRITS=True, G=TG, BIG=2, CLIP=True, WIDE=True, FULL=True), 5 * TG, gw),
        ("uniform encode (scales given), trits, byte-wise", T._uniform_encode_body, enc_sig,
         dict(W=1, TRITS=True, G=TG, BIG=2, CLIP=True, WIDE=False, FULL=True), 5 * TG, gw),
        ("uniform encode (scales given), 4-bit, a bucket edge in the program", T._uniform_encode_body, enc_sig,
         dict(W=4, TRITS=False, G=G, BIG=1, CLIP=False, WIDE=True, FULL=True), 8 * G, gw),
        ("uniform encode, 4-bit, buckets < a program", T._uniform_encode_body, enc_sig,
         dict(W=4, TRITS=False, G=G, BIG=False, CLIP=False, WIDE=True, FULL=True), 8 * G, gw),
        ("uniform decode, 4-bit", D._uniform_decode_body, dec_sig,
         dict(M=1, W=4, TRITS=False, G=G, CHECK=False, BIG=2, WIDE=True, FULL=True), 8 * G, gw),
        ("uniform decode, 4-bit, a bucket edge in the program", D._uniform_decode_body, dec_sig,
         dict(M=1, W=4, TRITS=False, G=G, CHECK=False, BIG=1, WIDE=True, FULL=True), 8 * G, gw),
        ("uniform decode, 2-bit (checked)", D._uniform_decode_body, dec_sig,
         dict(M=1, W=2, TRITS=False, G=G, CHECK=True, BIG=2, WIDE=True, FULL=True), 8 * G, gw),
        ("uniform decode, trits (checked)", D._uniform_decode_body, dec_sig,
         dict(M=1, W=1, TRITS=True, G=TD, CHECK=True, BIG=2, WIDE=True, FULL=True), 5 * TD, gw),
        ("uniform decode, trits (checked), byte-wise", D._uniform_decode_body, dec_sig,
         dict(M=1, W=1, TRITS=True, G=TD, CHECK=True, BIG=2, WIDE=False, FULL=True), 5 * TD, gw),
        ("uniform decode mean of 4, trits", D._uniform_decode_body, dec_sig,
         dict(M=4, W=1, TRITS=True, G=TD, CHECK=True, BIG=2, WIDE=True, FULL=True), 5 * TD, gw),
        ("uniform decode mean of 4, 4-bit", D._uniform_decode_body, dec_sig,
         dict(M=4, W=4, TRITS=False, G=G, CHECK=False, BIG=2, WIDE=True, FULL=True), 8 * G, gw),
        ("levels encode, L=5", L._levels_encode_body,
         dict(x_ptr=PF, levels_ptr=PF, out_ptr=P8, first=I, rem="i32", nbytes=I, bucket=I, b0=I, k1=I, k2=I, lo0=U,
              hi0=U, L=C, W=C, G=C, WIDE=C, FAST=C), dict(L=5, W=3, G=G, WIDE=False, FAST=True), 8 * G, gw),
        ("levels decode, L=5", L._levels_decode_body,
         dict(data_ptr=P8, levels_ptr=PF, out_ptr=PF, bad_ptr=P32, first=I, rem="i32", nbytes=I, bucket=I, b0=I,
              L="i32", W=C, G=C, WIDE=C, FAST=C), dict(W=3, G=G, WIDE=False, FAST=True), 8 * G, gw),
        ("one-bit threshold encode", B._threshold_body,
         dict(x_ptr=PF, t_ptr=PF64, out_ptr=P8, first=I, rem="i32", nbytes=I, bucket=I, b0=I, G=C, FAST=C),
         dict(G=G, FAST=True), 8 * G, gw),
        ("bingrad-pb bits encode", B._pb_bits_body,
         dict(x_ptr=PF, b_ptr=PF, out_ptr=P8, first=I, rem="i32", nbytes=I, bucket=I, b0=I, k1=I, k2=I, lo0=U,
              hi0=U, G=C, FAST=C), dict(G=G, FAST=True), 8 * G, gw),
        ("multiscale encode, 2+6", M._ms_encode_body,
         dict(x_ptr=PF, w_ptr=PF, ix_ptr=P8, lv_ptr=PF, codes_ptr=P8, index_ptr=P8, bad_ptr=P32, first=I, rem="i32",
              n=I, nbytes=I, ibytes=I, bucket=I, b0=I, k1=I, k2=I, lo0=U, hi0=U, L=C, W=C, IW=C, G=C, WIDE=C,
              FAST=C), dict(L=2, W=2, IW=1, G=G, WIDE=True, FAST=True), 8 * G, gw),
        ("multiscale decode, 2+6", M._ms_decode_body,
         dict(codes_ptr=P8, index_ptr=P8, w_ptr=PF, q_ptr=PF, out_ptr=PF, bad_ptr=P32, first=I, rem="i32",
              nbytes=I, ibytes=I, bucket=I, b0=I, L=C, W=C, IW=C, G=C, WIDE=C, FAST=C),
         dict(L=2, W=2, IW=1, G=G, WIDE=True, FAST=True), 8 * G, gw),
        ("max-abs per bucket (MaxNorm's first pass)", T._maxabs_bits_kernel,
         dict(x_ptr=PF, bits_ptr=P32, n=I, bucket=I, nb=I, ncol=I, cap="i32", ROWS=C, COLS=C), dict(ROWS=8, COLS=512),
         4096, 4),
        ("TernGrad's moments and max-abs, blocks of 4096", MO._block_moments_kernel,
         dict(x_ptr=PF, cnt_ptr=PF64, mean_ptr=PF64, m2_ptr=PF64, maxbits_ptr=P32, f_ptr=PF, top_ptr=PF, n=I,
              nblocks=I, clip=F, BLOCK=C, CHUNK=C, LAST=C), dict(BLOCK=4096, CHUNK=1024, LAST=T.TUNING["moment_launches"] == 1), 4096, 4),
        ("one-bit decode", B._bit_decode_body,
         dict(data_ptr=P8, levels_ptr=PF, out_ptr=PF, first=I, rem="i32", nbytes=I, bucket=I, b0=I, PER=C, G=C,
              FAST=C), dict(PER=1, G=G, FAST=True), 8 * G, gw),
    ]
    # kernels with loops, sorts or scans along a program: their per-value figure is the whole
    # program's SASS over its values (no loop counted twice), a size to compare, not a time
    ew = T.TUNING["elias_warps"]
    cases.append(("elias count pass", E._elias_count_kernel,
                  dict(f_ptr=P8, sl_ptr=P32, dl_ptr=P32, ol_ptr=P32, stats_ptr=PI64, n=I, s="i32", BLOCK=C, SMALL=C),
                  dict(BLOCK=E.BLOCK, SMALL=E._SMALL), E.BLOCK, ew))
    for sparse in (True, False):
        cases.append((f"elias write pass, {'sparse' if sparse else 'dense'}", E._elias_write_kernel,
                      dict(f_ptr=P8, sc_ptr=PI64, sl_ptr=P32, dc_ptr=P32, dl_ptr=P32, oc_ptr=PI64, ol_ptr=P32,
                           pre_ptr=PI64, words_ptr=P32, index_ptr=PI64, n=I, s="i32", base=I, h0="i32", h1="i32",
                           SPARSE=C, BLOCK=C, SMALL=C, PER_CHUNK=C),
                      dict(SPARSE=sparse, BLOCK=E.BLOCK, SMALL=E._SMALL, PER_CHUNK=E.CHUNK // E.BLOCK), E.BLOCK, ew))
    rw = T.TUNING["read_warps"]
    for sparse, write in ((False, False), (False, True), (True, False), (True, True)):
        cases.append((f"elias reader, {'sparse' if sparse else 'dense'} {'write' if write else 'rounds'}",
                      ER._elias_read_kernel,
                      dict(w_ptr=P32, tab_ptr=P32, start_ptr=PI64, act_ptr="*i8", end_ptr=PI64, cnt_ptr=PI64,
                           gsum_ptr=PI64, err_ptr=P32, fields_ptr=P8, base_ptr=PI64, pos_ptr=PI64, nbytes=I, nwords=I,
                           nseg=I, n=I, nitems=I, s="i32", b0=I, SEG=C, LANES=C, SPARSE=C, WRITE=C, WIN=C),
                      dict(SEG=T.TUNING["read_bits"], LANES=32 * rw, SPARSE=sparse, WRITE=write, WIN=12),
                      32 * rw, rw))
    for lv in (5, 9):
        lp = 1 << (lv - 1).bit_length()
        cases.append((f"orq levels, L={lv}, bucket 512", L._orq_levels_kernel,
                      dict(x_ptr=PF, lv_ptr=PF, n=I, bucket=I, LG_FULL="i32", LG_TAIL="i32", L=C, LP=C, ITER=C, P=C,
                           LOG=C),
                      dict(L=lv, LP=lp, ITER=(lv - 1).bit_length() - 1, P=512, LOG=9), 512,
                      max(1, 512 // T.TUNING["orq_warp_elems"])))
    rows, sw = max(1, T.TUNING["sort_elems"] // 512), T.TUNING["sort_warps"]
    for r, w in ((rows, sw), (1, 1)):
        cases.append((f"linear levels, L=5, {r} bucket(s) of 512", L._linear_levels_kernel,
                      dict(x_ptr=PF, pos_ptr=PI64, lv_ptr=PF, n=I, bucket=I, nrows=I, L=C, P=C, LOG=C, ROWS=C),
                      dict(L=5, P=512, LOG=9, ROWS=r), 512 * r, w))
    kw, kb, ks = T.TUNING["randk_warps"], T.TUNING["randk_elems"], 1024
    sel = dict(n=I, k1=I, k2=I, t_ptr=PI64)
    cases += [
        *((f"randk histogram, {label} level", K._randk_hist_kernel,
           dict(hist_ptr=P32, state_ptr=PI64, n=I, k1=I, k2=I, shift="i32", width="i32", BLOCK=C, SUB=C, BINS=C,
                FIRST=C), dict(BLOCK=kb, SUB=ks, BINS=2048, FIRST=first), kb, kw)
          for label, first in (("top", True), ("lower", False))),
        ("randk count", K._randk_count_kernel, dict(cnt_ptr=P32, **sel, BLOCK=C, SUB=C), dict(BLOCK=kb, SUB=ks), kb, kw),
        ("randk scale (max)", K._randk_norm_kernel, dict(x_ptr=PF, acc_ptr=P32, **sel, L2=C, BLOCK=C, SUB=C),
         dict(L2=False, BLOCK=kb, SUB=ks), kb, kw),
        ("randk maxnorm encode, 4-bit", K._randk_encode_kernel,
         dict(x_ptr=PF, words_ptr=P32, incl_ptr=P32, scale_ptr=PF, **sel, s="i32", rk1=I, rk2=I, lo0=I, hi0=I, W=C,
              BLOCK=C, SUB=C), dict(W=4, BLOCK=kb, SUB=ks), kb, kw),
        ("randk maxnorm decode, 4-bit", K._randk_decode_kernel,
         dict(codes_ptr=P8, out_ptr=PF, incl_ptr=P32, scale_ptr=PF, n=I, nbytes=I, k1=I, k2=I, t_ptr=PI64, s="i32",
              factor=F, W=C, RESCALE=C, BLOCK=C, SUB=C), dict(W=4, RESCALE=False, BLOCK=kb, SUB=ks), kb, kw),
        ("randk multiscale encode, 2+6", K._randk_ms_encode_kernel,
         dict(x_ptr=PF, w_ptr=PF, lv_ptr=PF, codes_ptr=P32, index_ptr=P32, incl_ptr=P32, **sel, rk1=I, rk2=I,
              lo0=I, hi0=I, L=C, W=C, IW=C, BLOCK=C, SUB=C), dict(L=2, W=2, IW=1, BLOCK=kb, SUB=ks), kb, kw),
        ("randk multiscale decode, 2+6", K._randk_ms_decode_kernel,
         dict(codes_ptr=P8, index_ptr=P8, w_ptr=PF, q_ptr=PF, out_ptr=PF, incl_ptr=P32, n=I, nbytes=I, ibytes=I,
              k1=I, k2=I, t_ptr=PI64, factor=F, L=C, W=C, IW=C, RESCALE=C, BLOCK=C, SUB=C),
         dict(L=2, W=2, IW=1, RESCALE=False, BLOCK=kb, SUB=ks), kb, kw),
    ]
    return cases


def _path(sass: str) -> list[str]:
    """The instructions on the path that falls through every conditional branch and exit, following
    unconditional branches: in these kernels the common path (conditional branches lead to the
    slow paths of divisions, to 64-bit division calls, and to masked tails), counted once."""
    code, labels = [], {}
    for ln in sass.splitlines():
        m = re.match(r"^(\.L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = len(code)
        elif re.match(r"\s+/\*[0-9a-f]{4}\*/", ln):
            code.append(re.sub(r"^\s+/\*[0-9a-f]+\*/\s+", "", ln).strip())
    path, pc = [], 0
    while pc < len(code) and len(path) <= len(code):
        ins = code[pc]
        path.append(ins)
        guarded = ins.startswith("@")
        op = ins.split()[1 if guarded else 0]
        if not guarded and op.startswith(("EXIT", "RET")):
            break
        m = re.search(r"\(\.L_x_\d+\)", ins)
        if not guarded and op.startswith("BRA") and m:
            pc = labels[m.group(0)[1:-1]]
            continue
        pc += 1
    return path


def count(fn, sig: dict, consts: dict, warps: int, workdir: str) -> tuple[int, int, collections.Counter, str]:
    """``fn`` compiled for sm_90 as a launch would: its SASS instructions, those on the common path
    (:func:`_path`), that path's opcodes, and the registers a thread uses (which bound how many
    warps an SM holds)."""
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
             if t.startswith("*") or (a in SIZES and t != C)}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                       options={"enable_fp_fusion": False, "num_warps": warps})
    path = os.path.join(workdir, "k.cubin")
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([NVDISASM, "-c", path], capture_output=True, text=True, check=True).stdout
    total = sum(1 for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln) and "NOP" not in ln)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0] for ins in _path(sass))
    ops.pop("NOP;", None)
    res = subprocess.run([CUOBJDUMP, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    return total, sum(ops.values()), ops, regs.group(1) if regs else "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", action="append", default=[], help="only labels containing this (repeatable)")
    ap.add_argument("--ops", action="store_true", help="print each kernel's most frequent opcodes")
    args = ap.parse_args(argv)
    if not os.path.exists(NVDISASM):
        print(f"nvdisasm not found at {NVDISASM}: this triton has no NVIDIA tools", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, fn, sig, consts, per_program, warps in _cases():
            if args.kernel and not any(k in label for k in args.kernel) and "baseline" not in label:
                continue
            total, common, ops, regs = count(fn, sig, consts, warps, tmp)
            per_value = common / (per_program / (32 * warps))
            rows.append((label, per_program, warps, regs, total, common, per_value, ops))
    base = rows[0][6]
    print(f"{'kernel':<42} {'values/prog':>11} {'warps':>5} {'regs':>4} {'SASS':>6} {'path':>6} {'per value':>9} "
          f"{'x copy':>7}")
    for label, per_program, warps, regs, total, common, per_value, ops in rows:
        print(f"{label:<42} {per_program:>11} {warps:>5} {regs:>4} {total:>6} {common:>6} {per_value:>9.1f} "
              f"{per_value / base:>7.1f}")
        if args.ops:
            print("    " + ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
