"""First-call compile time of the CPU kernels, per scheme.

numba compiles a kernel on its first call and caches it on disk (``~/.cache/gradq/numba``, moved by
``GRADQ_NUMBA_CACHE``). A fresh clone, CI, or an upgrade pays that once; this script measures it.
Point ``GRADQ_NUMBA_CACHE`` at an empty folder to time a cold start (a warm cache prints about 0 s):

    GRADQ_NUMBA_CACHE=$(mktemp -d) python benchmarks/bench_compile.py

For each spec, in order, it times ``gradq.build(spec)``'s first ``encode``, ``decode`` and
``decode(out=)`` of 5,000 float32 values; kernels that an earlier spec already compiled cost
nothing later, so the order matters (the default order is the one recorded in
``docs/reliability.md``).
"""

from __future__ import annotations

import argparse
import time

import torch

import gradq

SPECS = ["qsgd:bits=4", "qsgd:bits=4,norm=l2", "maxnorm:bits=4", "terngrad", "terngrad:pack=2bit",
         "multiscale:bits=2+6", "orq:levels=5", "linear:levels=5", "signsgd", "onebit", "bingrad-b",
         "bingrad-pb", "qsgd:bits=4,coding=elias", "randk-maxnorm:ratio=0.3"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", action="append", help="time this spec (repeatable; default: the list above)")
    args = ap.parse_args()
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    total = 0.0
    for spec in args.spec or SPECS:
        t0 = time.perf_counter()
        q = gradq.build(spec)
        p = q.encode(x, seed=1)
        q.decode(p)
        q.decode(p, out=torch.empty_like(x))
        dt = time.perf_counter() - t0
        total += dt
        print(f"{spec:32s} {dt:6.1f} s", flush=True)
    print(f"{'total':32s} {total:6.1f} s")


if __name__ == "__main__":
    main()
