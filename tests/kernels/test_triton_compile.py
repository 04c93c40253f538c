"""Every Triton kernel compiles for a GPU target, on machines without a GPU, and without FMA.

The interpreter tests (test_triton_kernels.py) check what the kernels compute; this test checks that
the compiler accepts them for an H100 (sm_90) and that the float arithmetic stays as written: no
``fma`` instructions (launches pass ``enable_fp_fusion=False``, which the compiled PTX must show) and
correctly rounded division (``div.rn.f32``). It runs in a child process with the compiler on
(``GRADQ_TRITON_INTERPRET=0``), since the test process runs Triton's interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

# (not imported here: this process runs Triton's interpreter, which must be switched on before the
# first import of triton — test_triton_kernels.py does that through gradq.kernels.triton_ops)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

SCRIPT = textwrap.dedent('''
    import os, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from gradq.kernels import triton_ops as T
    from gradq.kernels import triton_elias as E
    from gradq.kernels import triton_levels as L
    from gradq.kernels import triton_binary as B
    from gradq.kernels import triton_decode as D
    from gradq.kernels import triton_moments as MO
    from gradq.kernels import triton_multiscale as M
    from gradq.kernels import triton_crc as X
    from gradq.kernels import triton_checks as CK
    from gradq.kernels import triton_subset as S
    from gradq.kernels import triton_elias_read as R
    from gradq.kernels import triton_randk as K
    from gradq.kernels import triton_topk as TK
    from gradq.kernels import triton_randk_values as KV

    assert not T.INTERPRETED
    target = GPUTarget("cuda", 90, 32)
    P8, P32, PF, PI64, PF64, I, F, C = "*u8", "*i32", "*fp32", "*i64", "*fp64", "i64", "fp32", "constexpr"
    cases = [
        ("_maxabs_bits_kernel", dict(x_ptr=PF, bits_ptr=P32, n=I, bucket=I, nb=I, ncol=I, cap="i32", ROWS=C, COLS=C),
         dict(ROWS=rows, COLS=cols), False)
        for rows, cols in [(8, 512), (1, 4096)]
    ] + [
        ("_uniform_encode_kernel", dict(x_ptr=PF, scales_ptr=PF, out_ptr=P8, n=I, nbytes=I, nb=I, bucket=I, s="i32",
         clip=PF if at else F, k1=I, k2=I, ctr0=I, W=C, TRITS=C, G=C, BIG=C, CLIP=C, CLIP_AT=C, WIDE=C),
         dict(W=w, TRITS=trits, G=64, BIG=big, CLIP=clip, CLIP_AT=at, WIDE=wide), True)
        for w, trits, big, clip, at, wide in [(4, False, True, False, False, True), (3, False, False, True, False, False),
                                              (1, True, True, True, False, False), (1, True, False, True, True, True),
                                              (2, False, True, True, True, True)]
    ] + [
        ("_norm_uniform_encode_kernel", dict(x_ptr=PF, scales_ptr=PF, out_ptr=P8, n=I, nbytes=I, nb=I, s="i32",
         clip=F, k1=I, k2=I, ctr0=I, W=C, BUCKET=C, R=C, CLIP=C, WIDE=C, L2=C),
         dict(W=w, BUCKET=bucket, R=r, CLIP=clip, WIDE=wide, L2=l2), True)
        for w, bucket, r, clip, wide, l2 in [(4, 512, 4, False, True, False), (3, 64, 2, True, False, False),
                                             (8, 512, 4, False, True, True)]
    ] + [
    ] + [
        ("_uniform_decode_kernel", dict(base_ptr=P8, offs_ptr=PI64, scales_ptr=PF, out_ptr=PF, bad_ptr=P32, n=I,
         nbytes=I, nb=I, bucket=I, s="i32", max_field="i32", M=C, W=C, TRITS=C, G=C, CHECK=C, BIG=C, WIDE=C),
         dict(M=m, W=w, TRITS=trits, G=64, CHECK=check, BIG=big, WIDE=wide), True)
        for m, w, trits, check, big, wide in [(4, 3, False, True, True, False), (1, 8, False, False, False, True),
                                              (3, 1, True, True, False, True)]
    ] + [
        ("_levels_encode_kernel", dict(x_ptr=PF, levels_ptr=PF, out_ptr=P8, n=I, nbytes=I, bucket=I, k1=I, k2=I,
         ctr0=I, L=C, W=C, G=C, WIDE=C), dict(L=9, W=4, G=64, WIDE=True), True),
        ("_levels_decode_kernel", dict(data_ptr=P8, levels_ptr=PF, out_ptr=PF, bad_ptr=P32, n=I, nbytes=I,
         bucket=I, L="i32", W=C, G=C, WIDE=C), dict(W=4, G=64, WIDE=True), False),
        ("_threshold_kernel", dict(x_ptr=PF, t_ptr=PF64, out_ptr=P8, n=I, nbytes=I, bucket=I, G=C), dict(G=128),
         False),
        ("_pb_bits_kernel", dict(x_ptr=PF, b_ptr=PF, out_ptr=P8, n=I, nbytes=I, bucket=I, k1=I, k2=I, ctr0=I, G=C),
         dict(G=128), True),
        ("_bit_decode_kernel", dict(data_ptr=P8, levels_ptr=PF, out_ptr=PF, n=I, nbytes=I, bucket=I, PER=C, G=C),
         dict(PER=1, G=128), False),
    ] + [
        ("_block_moments_kernel", dict(x_ptr=PF, cnt_ptr=PF64, mean_ptr=PF64, m2_ptr=PF64, maxbits_ptr=P32, f_ptr=PF,
         top_ptr=PF, n=I, nblocks=I, clip=F, BLOCK=C, CHUNK=C, LAST=C), dict(BLOCK=4096, CHUNK=1024, LAST=last), False)
        for last in (True, False)
    ] + [
        ("_merge_moments_kernel", dict(cnt_ptr=PF64, mean_ptr=PF64, m2_ptr=PF64, ocnt_ptr=PF64, omean_ptr=PF64,
         om2_ptr=PF64, nblocks=I, clip=F, CHUNK=C, FINAL=C), dict(CHUNK=1024, FINAL=False), False),
        ("_merge_moments_kernel", dict(cnt_ptr=PF64, mean_ptr=PF64, m2_ptr=PF64, ocnt_ptr=PF, omean_ptr=PF,
         om2_ptr=PF, nblocks=I, clip=F, CHUNK=C, FINAL=C), dict(CHUNK=1024, FINAL=True), False),
        ("_nonfinite_kernel", dict(bits_ptr=P32, flags_ptr=P32, n=I, EXP=C, BLOCK=C), dict(EXP=0x7F800000, BLOCK=4096),
         False),
        ("_nonfinite_kernel", dict(bits_ptr=PI64, flags_ptr=P32, n=I, EXP=C, BLOCK=C),
         dict(EXP=0x7FF0000000000000, BLOCK=4096), False),
        ("_sumsq_kernel", dict(x_ptr=PF, part_ptr=PF64, n=I, bucket=I, nb=I, ncol=I, ROWS=C, COLS=C),
         dict(ROWS=8, COLS=512), False),
        ("_ms_indices_kernel", dict(x_ptr=PF, w_ptr=PF, lv_ptr=PF, out_ptr=P8, n=I, bucket=I, L=C, BLOCK=C),
         dict(L=2, BLOCK=1024), True),
        ("_ms_encode_kernel", dict(x_ptr=PF, w_ptr=PF, ix_ptr=P8, lv_ptr=PF, codes_ptr=P8, index_ptr=P8,
         bad_ptr=P32, n=I, nbytes=I, ibytes=I, bucket=I, k1=I, k2=I, ctr0=I, L=C, W=C, IW=C, G=C, WIDE=C, OWN=C),
         dict(L=4, W=3, IW=2, G=64, WIDE=False, OWN=False), True),
        ("_ms_encode_kernel", dict(x_ptr=PF, w_ptr=PF, ix_ptr=PF, lv_ptr=PF, codes_ptr=P8, index_ptr=P8,
         bad_ptr=P32, n=I, nbytes=I, ibytes=I, bucket=I, k1=I, k2=I, ctr0=I, L=C, W=C, IW=C, G=C, WIDE=C, OWN=C),
         dict(L=2, W=2, IW=1, G=64, WIDE=True, OWN=True), True),
        ("_ms_decode_kernel", dict(codes_ptr=P8, index_ptr=P8, w_ptr=PF, q_ptr=PF, out_ptr=PF, bad_ptr=P32, n=I,
         nbytes=I, ibytes=I, bucket=I, L=C, W=C, IW=C, G=C, WIDE=C), dict(L=2, W=2, IW=1, G=64, WIDE=True), False),
        # the all-reduce's fields: a byte a value, no index field; their sum decoded with byte indices
        ("_ms_encode_kernel", dict(x_ptr=PF, w_ptr=PF, ix_ptr=P8, lv_ptr=PF, codes_ptr=P8, index_ptr=P8,
         bad_ptr=P32, n=I, nbytes=I, ibytes=I, bucket=I, k1=I, k2=I, ctr0=I, L=C, W=C, IW=C, G=C, WIDE=C, OWN=C),
         dict(L=2, W=8, IW=0, G=64, WIDE=False, OWN=False), True),
        ("_ms_decode_kernel", dict(codes_ptr=P8, index_ptr=P8, w_ptr=PF, q_ptr=PF, out_ptr=PF, bad_ptr=P32, n=I,
         nbytes=I, ibytes=I, bucket=I, L=C, W=C, IW=C, G=C, WIDE=C), dict(L=2, W=8, IW=8, G=64, WIDE=False), False),

    ] + [
        ("_binary_stats_kernel", dict(x_ptr=PF, t_ptr=PF if bits else PF64, lv_ptr=PF,
         buf_ptr=PF64 if tail or not bits else PF, bits_ptr=P8, nrows=I, w=I, rem=I,
         MODE=C, ITERS=C, D=C, LOG=C, ROWS=C, TAIL=C, BITS=C), dict(MODE=mode, ITERS=iters, D=d,
         LOG=d.bit_length() - 1, ROWS=max(1, 4096 // d), TAIL=tail, BITS=bits), False)
        for mode, iters, d, tail, bits in [(0, 0, 512, False, True), (1, 0, 512, False, True),
                                           (2, 0, 512, False, True), (2, 3, 64, False, False),
                                           (2, 1, 1, False, False), (0, 0, 4096, False, False),
                                           (0, 0, 16, True, True), (1, 0, 512, True, False), (2, 2, 4096, True, True),
                                           (0, 0, 512, False, False), (2, 0, 512, False, False)]
    ] + [
        ("_linear_levels_kernel", dict(x_ptr=PF, pos_ptr=PI64, lv_ptr=PF, n=I, bucket=I, nrows=I, L=C, P=C, LOG=C,
         ROWS=C), dict(L=L, P=p, LOG=p.bit_length() - 1, ROWS=rows), False)
        for L, p, rows in [(5, 512, 8), (3, 16, 1)]
    ] + [
        ("_orq_levels_kernel", dict(x_ptr=PF, lv_ptr=PF, n=I, bucket=I, LG_FULL=I, LG_TAIL=I, L=C, LP=C, ITER=C, P=C, LOG=C),
         dict(L=L, LP=1 << (L - 1).bit_length(), ITER=(L - 1).bit_length() - 1, P=p, LOG=p.bit_length() - 1), False)
        for L, p in [(5, 512), (3, 16)]
    ] + [
        ("_pb_level_kernel", dict(x_ptr=PF, b_ptr=PF, n=I, bucket=I, nrows=I, P=C, LOG=C, ROWS=C),
         dict(P=512, LOG=9, ROWS=2), False),
        ("_elias_count_kernel", dict(f_ptr=P8, sl_ptr=P32, dl_ptr=P32, ol_ptr=P32, stats_ptr=PI64, n=I, s="i32",
         BLOCK=C, SMALL=C), dict(BLOCK=E.BLOCK, SMALL=4096), False),
    ] + [
        ("_elias_tiles_kernel", dict(stats_ptr=PI64, ol_ptr=P32, tiles_ptr=PI64, nblk=I, TILE=C, SMALL=C),
         dict(TILE=E._TILE, SMALL=4096), False),
        ("_elias_scan_kernel", dict(tiles_ptr=PI64, ol_ptr=P32, tpre_ptr=PI64, totals_ptr=PI64, ntiles=I, TILE=C,
         SMALL=C), dict(TILE=E._TILE, SMALL=4096), False),
        ("_elias_blocks_kernel", dict(stats_ptr=PI64, ol_ptr=P32, tpre_ptr=PI64, pre_ptr=PI64, nblk=I, TILE=C,
         SMALL=C), dict(TILE=E._TILE, SMALL=4096), False),
    ] + [
        ("_elias_write_kernel", dict(f_ptr=P8, sc_ptr=PI64, sl_ptr=P32, dc_ptr=P32, dl_ptr=P32, oc_ptr=PI64,
         ol_ptr=P32, pre_ptr=PI64, words_ptr=P32, index_ptr=PI64, n=I, s="i32", base=I, h0="i32", h1="i32",
         SPARSE=C, BLOCK=C, SMALL=C, PER_CHUNK=C),
         dict(SPARSE=sparse, BLOCK=E.BLOCK, SMALL=4096, PER_CHUNK=E.CHUNK // E.BLOCK), False)
        for sparse in (True, False)
    ] + [
        ("_subset_candidates_kernel", dict(keys_ptr=PI64, count_ptr=P32, n=I, k1=I, k2=I, lo=I, limit="i32", cap=I,
         BLOCK=C), dict(BLOCK=1024), False),
    ] + [
        ("_randk_hist_kernel", dict(hist_ptr=P32, state_ptr=PI64, n=I, k1=I, k2=I, shift="i32", width="i32",
         BLOCK=C, SUB=C, BINS=C, FIRST=C), dict(BLOCK=8192, SUB=1024, BINS=bins, FIRST=first), False)
        for first in (True, False) for bins in (256, 2048)   # (the shipped bins, and the most)
    ] + [
        ("_randk_pick_kernel", dict(hist_ptr=P32, state_ptr=PI64, width="i32", need0=I, BINS=C), dict(BINS=bins),
         False)
        for bins in (64, 256, 2048)
    ] + [
        ("_randk_count_kernel", dict(cnt_ptr=P32, n=I, k1=I, k2=I, t_ptr=PI64, BLOCK=C, SUB=C), dict(BLOCK=8192, SUB=1024),
         False),
        ("_randk_scan_kernel", dict(cnt_ptr=P32, m=I, CH=C), dict(CH=1024), False),
    ] + [
        ("_randk_norm_kernel", dict(x_ptr=PF, acc_ptr=PF64 if l2 else P32, n=I, k1=I, k2=I, t_ptr=PI64, L2=C, BLOCK=C,
         SUB=C), dict(L2=l2, BLOCK=8192, SUB=1024), False)
        for l2 in (False, True)
    ] + [
        ("_randk_encode_kernel", dict(x_ptr=PF, words_ptr=P32, incl_ptr=P32, scale_ptr=PF, n=I, k1=I, k2=I, t_ptr=PI64,
         s="i32", rk1=I, rk2=I, lo0=I, hi0=I, W=C, BLOCK=C, SUB=C), dict(W=w, BLOCK=8192, SUB=1024), True)
        for w in (4, 3)
    ] + [
        ("_randk_decode_kernel", dict(codes_ptr=P8, out_ptr=PF, incl_ptr=P32, scale_ptr=PF, n=I, nbytes=I, k1=I,
         k2=I, t_ptr=PI64, s="i32", factor=F, W=C, RESCALE=C, BLOCK=C, SUB=C),
         dict(W=w, RESCALE=rescale, BLOCK=8192, SUB=1024), True)
        for w, rescale in ((4, False), (5, True))
    ] + [
        ("_randk_ms_encode_kernel", dict(x_ptr=PF, w_ptr=PF, lv_ptr=PF, codes_ptr=P32, index_ptr=P32, incl_ptr=P32,
         n=I, k1=I, k2=I, t_ptr=PI64, rk1=I, rk2=I, lo0=I, hi0=I, L=C, W=C, IW=C, BLOCK=C, SUB=C),
         dict(L=L, W=2, IW=iw, BLOCK=8192, SUB=1024), True)
        for L, iw in ((2, 1), (3, 2))
    ] + [
        ("_randk_ms_check_kernel", dict(index_ptr=P8, bad_ptr=P32, k=I, ibytes=I, L=C, IW=C, BLOCK=C),
         dict(L=3, IW=2, BLOCK=1024), False),
    ] + [
        ("_randk_ms_decode_kernel", dict(codes_ptr=P8, index_ptr=P8, w_ptr=PF, q_ptr=PF, out_ptr=PF, incl_ptr=P32,
         n=I, nbytes=I, ibytes=I, k1=I, k2=I, t_ptr=PI64, factor=F, L=C, W=C, IW=C, RESCALE=C, BLOCK=C, SUB=C),
         dict(L=L, W=2, IW=iw, RESCALE=rescale, BLOCK=8192, SUB=1024), False)
        for L, iw, rescale in ((2, 1, False), (3, 2, True))
    ] + [
        ("_randk_gather_kernel", dict(x_ptr=PF, vals_ptr=PF, incl_ptr=P32, n=I, k1=I, k2=I, t_ptr=PI64, BLOCK=C, SUB=C),
         dict(BLOCK=8192, SUB=1024), False),
        ("_randk_index_kernel", dict(idx_ptr=PI64, incl_ptr=P32, n=I, k1=I, k2=I, t_ptr=PI64, BLOCK=C, SUB=C),
         dict(BLOCK=8192, SUB=1024), False),
    ] + [
        ("_randk_scatter_kernel", dict(vals_ptr=PF, out_ptr=PF, incl_ptr=P32, n=I, k1=I, k2=I, t_ptr=PI64, factor=F,
         RESCALE=C, SUBTRACT=C, BLOCK=C, SUB=C), dict(RESCALE=rescale, SUBTRACT=sub, BLOCK=8192, SUB=1024), False)
        for rescale, sub in ((False, False), (True, True))
    ] + [
        ("_topk_hist_kernel", dict(x_ptr=PF, hist_ptr=P32, state_ptr=PI64, n="i32", shift="i32", width="i32",
         BLOCK=C, SUB=C, BINS=C), dict(BLOCK=block, SUB=1024, BINS=bins), False)
        for block, bins in ((4096, 64), (8192, 2048))   # (the shipped shape, and the most bins)
    ] + [
        ("_topk_count_kernel", dict(x_ptr=PF, cnt_ptr=P32, state_ptr=PI64, n="i32", m="i32", BLOCK=C, SUB=C),
         dict(BLOCK=8192, SUB=1024), False),
        ("_topk_plan_kernel", dict(cnt_ptr=P32, state_ptr=PI64, m="i32", CH=C), dict(CH=1024), False),
    ] + [
        ("_topk_write_kernel", dict(x_ptr=PF, cnt_ptr=P32, state_ptr=PI64, idx_ptr=pi, val_ptr=PF, n="i32", m="i32",
         k="i32", BLOCK=C, SUB=C), dict(BLOCK=8192, SUB=1024), False)
        for pi in (P32, PI64)
    ] + [
        ("_crc32_kernel", dict(data_ptr=P8, out_ptr=P32, tab_ptr=P32, L=I, pad=I, tail="i32", W=C, NBITS=C),
         dict(W=w, NBITS=nbits), False)
        for w, nbits in [(1024, 12), (1, 4)]
    ] + [
        ("_elias_read_kernel", dict(w_ptr=P32, tab_ptr=P32, start_ptr=PI64, act_ptr="*i8", end_ptr=PI64,
         cnt_ptr=PI64, gsum_ptr=PI64, err_ptr=P32, fields_ptr=P8, base_ptr=PI64, pos_ptr=PI64, nbytes=I, nwords=I,
         nseg=I, n=I, nitems=I, s="i32", b0=I, SEG=C, LANES=C, SPARSE=C, WRITE=C, WIN=C),
         dict(SEG=256, LANES=32, SPARSE=sparse, WRITE=write, WIN=12 if sparse else 16), False)
        for sparse in (True, False) for write in (True, False)
    ]


    # the variant with integer arguments equal to 1 is compiled for each kernel's first case (every
    # case with --full: GRADQ_FULL_TESTS=1)
    full = os.environ.get("GRADQ_FULL_TESTS") == "1"
    firsts = {id(c) for c in {c[0]: c for c in reversed(cases)}.values()}

    def check(case):
        name, sig, consts, divides = case
        fn = next(getattr(m, name) for m in (T, L, B, D, MO, M, E, S, X, R, K, TK, KV, CK) if hasattr(m, name))
        # at launch Triton passes an integer argument equal to 1 as a constant, unless the kernel says
        # not to (T.VALUE_ARGS): every other integer argument may be 1 (one bucket, one value...)
        ones = {a: 1 for a, t in sig.items() if t in ("i32", "i64") and a not in fn.do_not_specialize}
        assert {a for a, t in sig.items() if a in T.VALUE_ARGS and t != C} <= set(fn.do_not_specialize), name
        if full or id(case) in firsts:
            triton.compile(ASTSource(fn=fn, signature={**sig, **dict.fromkeys(ones, C)},
                                     constexprs={**consts, **ones}),
                           target=target, options={"enable_fp_fusion": False})
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                           options={"enable_fp_fusion": False})
        ptx = k.asm["ptx"]
        assert not re.search(r"\\bfma\\.[a-z.]*f(32|64)", ptx), name + ": an FMA would round once where the reference rounds twice"
        assert set(re.findall(r"\\bdiv\\.(\\w+)\\.f64", ptx)) <= {"rn"}, name + ": float64 division not correctly rounded"
        if divides:
            assert "div.rn.f32" in ptx and not re.search(r"div\\.(approx|full)\\.f32", ptx), name + ": inexact division"
        return name

    # two processes (forked after the imports): the compiles are independent and CPU-bound
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        for name in pool.map(check, cases):
            print("compiled", name)
''')


def test_every_kernel_compiles_for_sm90_without_fma(tmp_path, full_tests):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(GRADQ_TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
               GRADQ_FULL_TESTS="1" if full_tests else "0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("triton's ptxas is not available here")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # (imported here: triton may be missing, and the test is then skipped)
    from gradq.kernels import triton_elias as E
    from gradq.kernels import triton_levels as L
    from gradq.kernels import triton_binary as B
    from gradq.kernels import triton_decode as D
    from gradq.kernels import triton_moments as MO
    from gradq.kernels import triton_multiscale as M
    from gradq.kernels import triton_crc as X
    from gradq.kernels import triton_checks as CK
    from gradq.kernels import triton_ops as T
    from gradq.kernels import triton_subset as S
    from gradq.kernels import triton_elias_read as R
    from gradq.kernels import triton_randk as K
    from gradq.kernels import triton_topk as TK
    from gradq.kernels import triton_randk_values as KV

    compiled = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("compiled ")}
    kernels = {name for mod in (T, L, B, D, MO, M, E, S, X, R, K, TK, KV, CK) for name in vars(mod)
               if name.endswith("_kernel")}
    assert compiled == kernels, ("every Triton kernel must be compiled here", kernels - compiled)


def test_element_wise_kernels_stay_lean(tmp_path):
    """benchmarks/bench_sass.py counts the sm_90 instructions a value on a whole program's path.
    The bounds hold the layout of docs/performance.md ("Fewer instructions a value"): 40.4 for the
    4-bit QSGD encode and 21.0 for the 4-bit decode when written, 14.0 for the decode of a program
    inside one bucket since it takes one scale (2026-11-29). A group of eight spread over threads
    again (three rounds of 64-bit shuffles and adds a group) or a division a value (about ten
    instructions) would put them above 45, 25 and 18; a select a value back in the one-scale decode
    (about seven with its compare and offsets) above 18.

    The count a value also depends on how many values a thread takes (a bucket's reduction and
    reciprocal are shared by them), which the launch settings choose, so the test pins the shape
    the bounds were set at: 2,048 values and two warps a one-pass program, 32 values a thread. (The
    shipped 1,024 values and four warps, 8 a thread, count 45.2 and ran faster on an H100.)"""
    import re
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_sass.py")
    shape = tmp_path / "tuning.json"
    shape.write_text('{"fused_elems": 2048, "fused_warps": 2, "groups": 64, "groups_warps": 2}')
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(GRADQ_TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
               GRADQ_TRITON_TUNING=str(shape))
    proc = subprocess.run([sys.executable, script, "--kernel", "one-pass encode, 4-bit", "--kernel",
                           "uniform decode, 4-bit"], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode == 2 and "nvdisasm not found" in proc.stderr:
        pytest.skip("triton's nvdisasm is not available here")
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("triton's ptxas is not available here")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    per = {m.group(1).strip(): float(m.group(2)) for m in
           re.finditer(r"^(\S.*?)\s+\d+\s+\d+\s+\S+\s+\d+\s+\d+\s+([\d.]+)\s+[\d.]+$", proc.stdout, re.M)}
    assert "copy (baseline)" in per, proc.stdout
    assert per["qsgd one-pass encode, 4-bit, bucket 512"] <= 45, proc.stdout
    assert per["uniform decode, 4-bit, a bucket edge in the program"] <= 25, proc.stdout
    assert per["uniform decode, 4-bit"] <= 18, proc.stdout
