"""First-call compile time of the CPU kernels, per scheme; and ranks that start together on an empty cache.

numba compiles a kernel on its first call and caches it on disk (``~/.cache/gradq/numba``, moved by
``GRADQ_NUMBA_CACHE``). A fresh clone, CI, or an upgrade pays that once; this script measures it.
Point ``GRADQ_NUMBA_CACHE`` at an empty folder to time a cold start (a warm cache prints about 0 s):

    GRADQ_NUMBA_CACHE=$(mktemp -d) python benchmarks/bench_compile.py

For each spec, in order, it times :func:`gradq.precompile.precompile`: the spec's first encode,
decode, ``decode(out=)`` and ``decode_mean`` of 5,000 float32 values (and, for summable schemes, its
code sums); kernels that an earlier spec already compiled cost nothing later, so the order matters
(the default, :data:`gradq.precompile.SPECS`, is the one recorded in ``docs/reliability.md``; before
2026-11-28 the script timed only the encode and the two decodes).

``--ranks N`` starts N processes at once on a new empty cache, as a launcher starts its ranks
(one thread each), each running the same precompile of ``--spec`` (default ``qsgd:bits=4``), and
prints the wall time until the last one ends and how many kernels were compiled in all. It does so
with the compile lock (:mod:`gradq.kernels.numba_cache`: one process compiles a kernel, the others
load it) and without it (``GRADQ_COMPILE_LOCK=0``), alternated ``--repeats`` times, then as often
(at least 3 times) on the warm caches, and prints the medians and their ratio:

    python benchmarks/bench_compile.py --ranks 4 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

RANK = r"""
import sys
from numba.core import event
from gradq.kernels import numba_cache as nc
from gradq.precompile import precompile
n = [0]
class Count(event.Listener):   # compiles that go ahead (not a look in the cache that missed)
    def on_start(self, ev):
        d = ev.data.get("dispatcher")
        if d is not getattr(nc._PROBE, "dispatcher", None) and str(getattr(d.py_func, "__module__", "")).startswith("gradq."):
            n[0] += 1
    def on_end(self, ev):
        pass
event.register("numba:compile", Count())
precompile(sys.argv[1:])
print("compiled", n[0])
"""


def launch(ranks: int, specs: list[str], cache: str, lock: bool) -> tuple[float, int]:
    """Seconds until the last of ``ranks`` processes ends, and the kernels they compiled in all."""
    env = dict(os.environ, GRADQ_NUMBA_CACHE=cache, GRADQ_COMPILE_LOCK="1" if lock else "0",
               OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, *specs], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(ranks)]
    outs = [p.communicate() for p in procs]
    wall = time.perf_counter() - t0
    for p, (out, err) in zip(procs, outs):
        if p.returncode:
            raise SystemExit(f"a rank failed:\n{err[-3000:]}")
    return wall, sum(int(out.split("compiled")[-1]) for out, _ in outs)


def ranks_main(ranks: int, specs: list[str], repeats: int) -> None:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{ranks} processes at once, {cpus} cores, specs {' '.join(specs)}; seconds until the last ends "
          "(kernels compiled in all)")
    walls: dict[tuple[str, bool], list[float]] = {}
    with tempfile.TemporaryDirectory() as root:
        warm = {}
        for r in range(repeats):
            for lock in ((True, False) if r % 2 == 0 else (False, True)):
                cache = os.path.join(root, f"{r}-{int(lock)}")
                wall, n = launch(ranks, specs, cache, lock)
                warm[lock] = cache
                walls.setdefault(("cold", lock), []).append(wall)
                print(f"  cold cache, lock {'on ' if lock else 'off'}: {wall:6.1f} s ({n} compiled)", flush=True)
        for r in range(max(3, repeats)):   # (a few seconds each)
            for lock in ((True, False) if r % 2 == 0 else (False, True)):
                wall, n = launch(ranks, specs, warm[lock], lock)
                walls.setdefault(("warm", lock), []).append(wall)
                print(f"  warm cache, lock {'on ' if lock else 'off'}: {wall:6.1f} s ({n} compiled)", flush=True)
    for kind in ("cold", "warm"):
        on, off = statistics.median(walls[kind, True]), statistics.median(walls[kind, False])
        print(f"{kind} cache, medians: lock on {on:.1f} s, off {off:.1f} s; off ÷ on = {off / on:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", action="append", help="time this spec (repeatable; default: gradq.precompile.SPECS, "
                    "or qsgd:bits=4 with --ranks)")
    ap.add_argument("--ranks", type=int, default=0, help="start this many processes at once on an empty cache")
    ap.add_argument("--repeats", type=int, default=1, help="with --ranks: cold runs of each mode (default 1)")
    args = ap.parse_args()
    if args.ranks:
        ranks_main(args.ranks, args.spec or ["qsgd:bits=4"], args.repeats)
        return
    from gradq.precompile import precompile

    took = precompile(args.spec)
    for spec, seconds in took.items():
        print(f"{spec:32s} {seconds:6.1f} s", flush=True)
    print(f"{'total':32s} {sum(took.values()):6.1f} s")


if __name__ == "__main__":
    main()
