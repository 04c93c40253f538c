"""Elias and entropy coding of QSGD codes: measured size against the paper's bounds and the entropy,
and coding speed.

For each data source (Gaussian, Laplace, a small model's real gradients) and QSGD setting it reports the
bits per coordinate of the Elias stream (``stream bits + 32 per bucket`` — the payload adds a fixed 35-byte
header/CRC per tensor, not counted here), next to

* Theorem 3.2's bound for the sparse layout, ``Σ_buckets (3 + 1.5·log2(2(s²+d)/(s(s+√d))))·s(s+√d) + 32``;
* Corollary 3.3's ``2.8n + 32`` for the dense layout at ``s = √n``;
* the empirical entropy of the codes, ``n·H(codes) + 32 per bucket`` (what an ideal coder with a free,
  perfect model of the code histogram would need);
* ``coding=ans``: rANS (``constriction``, if installed) under the codes' own histogram, whose size counts
  the model honestly: the Elias-omega-coded count of every value in ``[min c, max c]`` plus the two int32
  bounds (see :func:`gradq.codecs.ans.ans_encode_codes`).

Sizes are averaged over ``--trials`` seeds. Throughput is the median of 5 runs, in MB/s of fp32 input
(``4n`` bytes), single-threaded codecs. Run:

    python benchmarks/bench_elias.py [--n 1048576] [--trials 3] [--data digits|mnist:PATH|none]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable, Optional

import numpy as np
import torch

from gradq.codecs.qsgd_stream import decode_stream, encode_stream, layout_nbits
from gradq.quantizers._common import bucket_norms, bucket_view, num_buckets
from gradq.codecs.ans import ans_decode_codes, ans_encode_codes
from gradq.quantizers.qsgd import QSGD, uniform_codes
from gradq.random import RandomStream

try:
    import constriction
except ImportError:  # the ANS columns are left empty
    constriction = None


# ---- data ---------------------------------------------------------------------------------------------
def synthetic(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(n, generator=g)
    u = torch.rand(n, generator=g) - 0.5  # Laplace by inverse CDF
    return -torch.sign(u) * torch.log1p(-2 * u.abs())


def real_gradients(data: str) -> torch.Tensor:
    from gradq.train import build_model, load_dataset, model_gradients

    ds = load_dataset(data)
    model = build_model("mlp", ds.num_features, ds.num_classes, ds.image_shape)
    grads = model_gradients(model, ds)
    return torch.cat([g.reshape(-1) for _, g in grads])


# ---- codes and reference sizes ------------------------------------------------------------------------
def qsgd_codes(x: torch.Tensor, s: int, bucket: Optional[int], norm: str, seed: int) -> np.ndarray:
    """The codes ``qsgd:levels=s,bucket=..,norm=..`` sends for seed ``seed`` (any coding)."""
    mat = bucket_view(x, bucket)
    scales = bucket_norms(mat, norm)
    return uniform_codes(mat, scales, s, RandomStream(seed)).reshape(-1)[: x.numel()].numpy()


def sizes_of_buckets(n: int, bucket: Optional[int]) -> list[int]:
    if bucket is None or bucket >= n:
        return [n]
    return [bucket] * (n // bucket) + ([n % bucket] if n % bucket else [])


def theorem_3_2(n: int, s: int, bucket: Optional[int]) -> float:
    total = 0.0
    for d in sizes_of_buckets(n, bucket):
        m = s * (s + math.sqrt(d))
        total += (3 + 1.5 * math.log2(2 * (s * s + d) / m)) * m + 32
    return total


def entropy_bits(codes: np.ndarray) -> float:
    counts = np.bincount(codes - codes.min()).astype(np.float64)
    p = counts[counts > 0] / codes.size
    return float(-(p * np.log2(p)).sum() * codes.size)


def ans_bits(codes: np.ndarray) -> int:
    """Bits of ``qsgd:coding=ans``'s coded fields: rANS words + omega-coded counts + (lo, K) int32 pair."""
    f = ans_encode_codes(torch.from_numpy(codes))
    return 8 * (f["ans"].numel() + f["model"].numel() + 8)


# ---- tables -------------------------------------------------------------------------------------------
SETTINGS = [  # (label, s (None = √n), bucket, norm, layout, bound)
    ("s=1 l2 bucket=none", 1, None, "l2", "sparse", "thm3.2"),
    ("s=1 l2 bucket=none", 1, None, "l2", "auto", "thm3.2"),
    ("s=1 l2 bucket=512", 1, 512, "l2", "sparse", "thm3.2"),
    ("s=1 l2 bucket=512", 1, 512, "l2", "auto", "thm3.2"),
    ("s=√n l2 bucket=none", None, None, "l2", "dense", "2.8n"),
    ("s=√n l2 bucket=none", None, None, "l2", "auto", "2.8n"),
    ("s=7 max bucket=512", 7, 512, "max", "auto", "fixed"),
]


def size_rows(name: str, x: torch.Tensor, trials: int) -> list[list[str]]:
    n = x.numel()
    rows = []
    for label, s, bucket, norm, layout, bound_kind in SETTINGS:
        s = s or math.isqrt(n)
        nb = num_buckets(n, bucket)
        elias, ent, ans = [], [], []
        for t in range(trials):
            c = qsgd_codes(x, s, bucket, norm, seed=t)
            sp, de = layout_nbits(c)
            body = {"sparse": sp, "dense": de, "auto": min(sp, de)}[layout]
            elias.append(1 + body + 32 * nb)
            ent.append(entropy_bits(c) + 32 * nb)
            if constriction is not None:
                ans.append(ans_bits(c) + 32 * nb)
        if bound_kind == "thm3.2":
            bound = theorem_3_2(n, s, bucket)
        elif bound_kind == "2.8n":
            bound = 2.8 * n + 32
        else:  # fixed-width fields, for reference
            bound = QSGD(levels=s).width * n + 32 * nb
        per = lambda v: f"{statistics.fmean(v) / n:.4f}" if v else "-"
        rows.append([name, str(n), label.replace("√n", f"√n={s}"), layout, per(elias), f"{bound / n:.4f} ({bound_kind})",
                     per(ent), per(ans)])
    return rows


def median_time(fn: Callable[[], object], reps: int = 5) -> float:
    fn()  # warm up (compilation, caches)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed_rows(x: torch.Tensor) -> list[list[str]]:
    n = x.numel()
    mb = 4 * n / 1e6
    rows = []
    for label, s, bucket, norm, layout, _ in SETTINGS:
        s = s or math.isqrt(n)
        c = qsgd_codes(x, s, bucket, norm, seed=0)
        ct = torch.from_numpy(c)
        stream = encode_stream(ct, s, layout)
        enc = median_time(lambda: encode_stream(ct, s, layout))
        dec = median_time(lambda: decode_stream(stream, n, s))
        coding = {"auto": "elias", "sparse": "elias-sparse", "dense": "elias-dense"}[layout]
        q = QSGD(levels=s, bucket=bucket, norm=norm, coding=coding)
        p = q.encode(x, seed=0)
        qenc = median_time(lambda: q.encode(x, seed=0))
        qdec = median_time(lambda: q.decode(p))
        ans_cols = ["-"] * 4
        if constriction is not None:
            f = ans_encode_codes(ct)
            assert torch.equal(ans_decode_codes(f, n, s), ct)
            qa = QSGD(levels=s, bucket=bucket, norm=norm, coding="ans")
            pa = qa.encode(x, seed=0)
            ans_cols = [f"{mb / median_time(fn):.0f}" for fn in (
                lambda: ans_encode_codes(ct), lambda: ans_decode_codes(f, n, s),
                lambda: qa.encode(x, seed=0), lambda: qa.decode(pa))]
        rows.append([f"{label} ({layout})", f"{mb / enc:.0f}", f"{mb / dec:.0f}", f"{mb / qenc:.0f}",
                     f"{mb / qdec:.0f}", *ans_cols])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(cells)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (x + 2) for x in w) + "|", *map(line, rows)])


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1 << 20, help="coordinates of the synthetic vectors")
    ap.add_argument("--trials", type=int, default=3, help="seeds averaged for the sizes")
    ap.add_argument("--data", default="digits", help="real gradients: digits, mnist:PATH, or none")
    ap.add_argument("--no-speed", action="store_true", help="skip the throughput table")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    sources = [("gaussian", synthetic("gaussian", args.n)), ("laplace", synthetic("laplace", args.n))]
    if args.data != "none":
        sources.append((f"{args.data.split(':')[0]} mlp grads", real_gradients(args.data)))
    rows = [r for name, x in sources for r in size_rows(name, x, args.trials)]
    print("Bits per coordinate (stream + 32-bit scale per bucket; mean over seeds)\n")
    print(table(["data", "n", "setting", "layout", "elias", "bound", "entropy", "ans (+model)"], rows))
    if not args.no_speed:
        print(f"\nThroughput, MB/s of fp32 input, n={args.n} Gaussian, 1 thread, median of 5\n")
        print(table(["setting", "elias enc", "elias dec", "qsgd elias enc", "qsgd elias dec", "ANS enc",
                     "ANS dec", "qsgd ans enc", "qsgd ans dec"], speed_rows(sources[0][1])))


if __name__ == "__main__":
    main()
