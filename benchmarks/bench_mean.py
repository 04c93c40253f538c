"""The mean of M workers' payloads, as the all-gather protocol and the DDP hook compute it:
``q.decode_mean(payloads, out=buf)`` against the dense way (decode every payload into a full vector
and add them, the generic path that every scheme without a mean of its own takes), and against a
device copy of the vector, all timed in the same run.

    python benchmarks/bench_mean.py [--n 25000000] [--payloads 2 4] [--repeats 7] [--spec SPEC ...]

Each payload encodes its own random vector (seeds 0…M−1); schemes with a shared seed (Rand-K) get
one seed for all, as the hook's workers do. The two ways are checked to give the same bits before
anything is timed. Medians of ``--repeats``; "× copy" is the copy's time divided by the mean's, and
"dense ÷ mean" how many times longer the dense way took.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import gradq

SPECS = ["topk:ratio=0.01", "randk:ratio=0.01", "randk:ratio=0.01,rescale=1", "qsgd:bits=4,bucket=512"]


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _dense_mean(q, payloads, out: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """The generic path: a dense decode of each payload, added in list order, then ``/ M``."""
    q.decode(payloads[0], out=out)
    for p in payloads[1:]:
        out += q.decode(p, out=tmp)
    return out.div_(len(payloads))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=25_000_000)
    ap.add_argument("--payloads", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--spec", action="append", help="a spec to time (repeatable; default: %s)" % ", ".join(SPECS))
    args = ap.parse_args(argv)
    if args.n < 1 or min(args.payloads) < 1 or args.repeats < 1:
        ap.error("--n, --payloads and --repeats must be positive")

    x = torch.randn(args.n)
    out, tmp, dst = torch.zeros(args.n), torch.zeros(args.n), torch.zeros(args.n)
    copy = _median_ms(lambda: dst.copy_(x), args.repeats)
    print(f"n = {args.n:,} float32, {torch.get_num_threads()} threads; copy dst.copy_(x): {copy:.3f} ms\n")
    print("| spec | payloads | decode_mean ms | × copy | dense decodes ms | dense ÷ mean |")
    print("|---|---:|---:|---:|---:|---:|")
    for spec in args.spec or SPECS:
        q = gradq.build(spec)
        most = max(args.payloads)
        payloads = []
        for j in range(most):
            v = torch.randn(args.n, generator=torch.Generator().manual_seed(j))
            payloads.append(q.encode(v, seed=j, shared_seed=7) if q.needs_shared_seed else q.encode(v, seed=j))
        for m in args.payloads:
            ps = payloads[:m]
            want = _dense_mean(q, ps, out, tmp).clone()
            if not torch.equal(q.decode_mean(ps, out=out).view(torch.int32), want.view(torch.int32)):
                raise SystemExit(f"{spec}: decode_mean differs from the dense mean with {m} payloads")
            fused = _median_ms(lambda: q.decode_mean(ps, out=out), args.repeats)
            dense = _median_ms(lambda: _dense_mean(q, ps, out, tmp), args.repeats)
            print(f"| {q.spec} | {m} | {fused:.2f} | {copy / fused:.3f} | {dense:.2f} | {dense / fused:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
