"""First-call compile time of the CPU kernels, per scheme.

numba compiles a kernel on its first call and caches it on disk (``~/.cache/gradq/numba``, moved by
``GRADQ_NUMBA_CACHE``). A fresh clone, CI, or an upgrade pays that once; this script measures it.
Point ``GRADQ_NUMBA_CACHE`` at an empty folder to time a cold start (a warm cache prints about 0 s):

    GRADQ_NUMBA_CACHE=$(mktemp -d) python benchmarks/bench_compile.py

For each spec, in order, it times :func:`gradq.precompile.precompile`: the spec's first encode,
decode, ``decode(out=)`` and ``decode_mean`` of 5,000 float32 values (and, for summable schemes, its
code sums); kernels that an earlier spec already compiled cost nothing later, so the order matters
(the default, :data:`gradq.precompile.SPECS`, is the one recorded in ``docs/reliability.md``; before
2026-11-28 the script timed only the encode and the two decodes).
"""

from __future__ import annotations

import argparse

from gradq.precompile import precompile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", action="append", help="time this spec (repeatable; default: gradq.precompile.SPECS)")
    args = ap.parse_args()
    took = precompile(args.spec)
    for spec, seconds in took.items():
        print(f"{spec:32s} {seconds:6.1f} s", flush=True)
    print(f"{'total':32s} {sum(took.values()):6.1f} s")


if __name__ == "__main__":
    main()
