"""Launch shapes of the Triton kernels, and where the host's time goes, on a GPU.

``gradq.kernels.triton_common.TUNING`` (also ``triton_ops.TUNING``) sets how much work a program
takes and how many warps run it; none of it changes a result, only the speed. For each group of
settings this times every alternative on the public API (``q.encode(x, seed=…)`` of 25M float32
values, the default size of bench_codecs.py), after checking that the payload's bytes equal those
of the shipped settings:

* the device time per call (the sum of what the CUDA profiler sees the device run, as
  ``bench_codecs.py --memory --device cuda`` reports it) and that of the kernel the setting
  governs;
* the wall time per call of 20 unchecked calls back to back (``check_finite=False``, as the DDP
  hook encodes; the decode for the decode groups, the checked encode for :data:`CHECKED_GROUPS`),
  until the device is done: where the host's
  work per call exceeds the device's, it is the host's pace, and a setting that adds a launch can
  win on the device and lose here;
* the best alternative per group by device time, and a JSON file of everything (``--json``);
  ``--best FILE`` writes the best settings in the form ``GRADQ_TRITON_TUNING=FILE`` reads. The best
  never takes an alternative that waits for the device on the host each call (:data:`HOST_READS`);
  the table still times it.

``--host`` adds where the host's time goes: the wall time per call of encode and ``decode(out=)``
(host work, launches, the encode's one host read), and a profile of the host's calls for the
4-bit QSGD decode.

    python benchmarks/bench_triton_tuning.py [--n 25000000] [--host] [--budget SECONDS] [--json FILE] [--best FILE]
        [--groups stats passes moments maxabs subset randk topk fused groups trits trits_decode witness sort orq elias
         crc read]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_codecs import SEED, kernel_time  # noqa: E402

import gradq  # noqa: E402
from gradq.kernels import triton_ops as T  # noqa: E402

#: group -> (specs, the kernel the settings govern, alternatives)
GROUPS = {
    "stats": (["signsgd", "onebit:ef=0", "bingrad-b"], "_binary_stats_kernel",
              [dict(stats_elems=e, stats_warps=w) for e in (512, 1024, 2048, 4096) for w in (2, 4)]),
    "passes": (["signsgd", "onebit:ef=0", "bingrad-b"], "_(binary_stats|threshold)_kernel",
               [dict(stats_passes=1, stats_tail=1), dict(stats_passes=1, stats_tail=2),
                dict(stats_passes=2, stats_tail=2)]),
    "moments": (["terngrad", "terngrad:pack=2bit"], "_(block|merge)_moments_kernel",
                [dict(moment_launches=1)] + [dict(moment_launches=2, moment_chunk=c) for c in (64, 256, 1024)]),
    "maxabs": (["maxnorm:bits=4", "multiscale:bits=2+6"], "_maxabs_bits_kernel",
               [dict(maxabs_elems=e) for e in (1024, 2048, 4096, 8192, 16384)]),
    # (the candidate pass serves only the indices path, randk_path 2, so every alternative takes it)
    "subset": (["randk-maxnorm:ratio=0.01,bits=4", "randk-multiscale:ratio=0.01,bits=2+6"],
               "_subset_candidates_kernel",
               [dict(randk_path=2, subset_path=2)] + [dict(randk_path=2, subset_path=1, subset_elems=e, subset_warps=w)
                                                       for e in (512, 1024, 2048, 4096) for w in (2, 4)]),
    "randk": (["randk-maxnorm:ratio=0.01,bits=4", "randk-multiscale:ratio=0.01,bits=2+6", "randk:ratio=0.01"],
              "_randk_\\w+_kernel",
              [dict(randk_path=2)] + [dict(randk_path=1, randk_elems=e, randk_warps=4, randk_bins=b)
                                       for e in (8192, 16384) for b in (64, 256, 2048)]),
    "topk": (["topk:ratio=0.01", "topk:ratio=0.001"], "_topk_\\w+_kernel",
             [dict(topk_path=2)] + [dict(topk_path=1, topk_elems=e, topk_warps=w, topk_bins=b)
                                     for e in (4096, 8192) for w in (4,) for b in (64, 256, 2048)]),
    "fused": (["qsgd:bits=4,bucket=512"], "_norm_uniform_encode_kernel",
              [dict(fused_elems=e, fused_warps=w) for e in (512, 1024, 2048, 4096) for w in (2, 4)]),
    "groups": (["maxnorm:bits=4", "terngrad:pack=2bit", "linear:levels=5"], "_(uniform|levels)_encode_kernel",
               [dict(groups=g, groups_warps=w) for g in (64, 128, 256) for w in (1, 2, 4, 8)]),
    "trits": (["terngrad", "terngrad:bucket=512"], "_uniform_encode_kernel",
              [dict(trit_bytes=b) for b in (64, 128, 256, 512, 1024)]),
    # (timed on the decode)
    "trits_decode": (["terngrad", "terngrad:bucket=512"], "_uniform_decode_kernel",
                     [dict(trit_decode_bytes=b) for b in (64, 128, 256, 512, 1024)]),
    # (the checked encode: its look at the non-finite witness, torch's sum against the Triton flags)
    "witness": (["qsgd:bits=4,bucket=512", "signsgd", "bingrad-b"], "(.*reduce_kernel.*|_nonfinite_kernel)",
                [dict(witness_path=p) for p in (1, 2)]),
    "sort": (["linear:levels=5", "bingrad-pb"], "_(linear_levels|pb_level)_kernel",
             [dict(sort_elems=e, sort_warps=w) for e in (512, 1024, 4096) for w in (1, 2, 4, 8)]),
    "orq": (["orq:levels=5", "orq:levels=9"], "_orq_levels_kernel",
            [dict(orq_warp_elems=e) for e in (32, 64, 128, 256, 512)]),
    "crc": (["qsgd:bits=4,coding=elias"], "_crc32_kernel",
            [dict(crc_words=e, crc_warps=w) for e in (256, 1024, 4096) for w in (2, 4, 8)]),
    "elias": (["qsgd:bits=4,coding=elias", "qsgd:bits=8,coding=elias"], "_elias_\\w+_kernel",
              [dict(elias_warps=w) for w in (2, 4, 8, 16)]),
    # (timed on the decode: the Elias reader)
    "read": (["qsgd:bits=4,coding=elias", "qsgd:bits=8,coding=elias"], "_elias_read_kernel",
             [dict(read_bits=b, read_warps=w) for b in (128, 256, 512, 1024) for w in (1, 2, 4)]),
}
#: groups whose settings govern the decode, which the sweep times instead of the encode
DECODE_GROUPS = {"read", "trits_decode"}
#: groups whose settings govern the checked encode only: their wall column times it (the others
#: time the encode unchecked, as the DDP hook calls it)
CHECKED_GROUPS = {"witness"}
#: alternatives that read from the device on the host each call (the indices path reads its
#: candidates' count): timed, never chosen as the best (a hook's step would wait on each)
HOST_READS = [dict(randk_path=2)]


def wall_time(fn, calls: int = 20, reps: int = 3) -> float:
    """Seconds a call of ``fn`` issued ``calls`` times back to back, until the device is done
    (median of ``reps``): the host's pace where its work exceeds the device's."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / calls)
    return statistics.median(ts)


def _governed(per_kernel: dict, pattern: str) -> float:
    import re

    return sum(us for name, us in per_kernel.items() if re.fullmatch(pattern, name))


def sweep(x: torch.Tensor, group: str, shipped: dict, deadline: float = float("inf")) -> list[dict]:
    specs, kernel, alternatives = GROUPS[group]
    rows = []
    for spec in specs:
        if time.monotonic() > deadline:
            print(f"| {group} | {spec} | out of time (--budget): not run |", flush=True)
            continue
        q = gradq.build(spec)
        T.TUNING.update(shipped)
        want = q.encode(x, seed=SEED)
        if group in DECODE_GROUPS:
            ref = q.decode(want).view(torch.int32)
            dst = torch.empty_like(x)
        base = None
        for alt in alternatives:
            T.TUNING.update(shipped)
            T.TUNING.update(alt)
            try:
                if group in DECODE_GROUPS:
                    if not torch.equal(q.decode(want).view(torch.int32), ref):
                        raise AssertionError("values differ from the shipped settings'")
                    total, _, per_kernel = kernel_time(lambda: q.decode(want, out=dst))
                    wall = wall_time(lambda: q.decode(want, out=dst))
                else:
                    got = q.encode(x, seed=SEED)
                    if not got.same_bytes(want):
                        raise AssertionError("bytes differ from the shipped settings'")
                    seeds = itertools.count(SEED + 1)
                    total, _, per_kernel = kernel_time(lambda: q.encode(x, seed=next(seeds)))
                    wall = wall_time(lambda: q.encode(x, seed=next(seeds), check_finite=group in CHECKED_GROUPS))
            except Exception as e:  # one alternative's failure (e.g. too many registers) must not stop the sweep
                print(f"| {group} | {spec} | {alt} | failed: {type(e).__name__}: {str(e)[:100]} |", flush=True)
                continue
            k_us = _governed(per_kernel, kernel)
            is_shipped = all(shipped[k] == v for k, v in alt.items())
            row = {"group": group, "spec": spec, "settings": alt, "device_us": total * 1e6, "kernel_us": k_us,
                   "wall_us": wall * 1e6, "shipped": is_shipped}
            if is_shipped:
                base = row
            rows.append(row)
            print(f"| {group} | {spec} | {alt} | {total * 1e6:.1f} | {k_us:.1f} | {wall * 1e6:.1f} |"
                  f"{' shipped' if is_shipped else ''}", flush=True)
        if base:
            for r in rows:
                if r["spec"] == spec:
                    r["vs_shipped"] = base["device_us"] / r["device_us"]
    T.TUNING.update(shipped)
    return rows


def best_settings(rows: list[dict], shipped: dict) -> dict:
    """Per group, the alternative with the least summed device time over the group's specs (only
    alternatives that ran for every spec, none of :data:`HOST_READS`; a group left with none, such
    as ``subset``, whose alternatives all take the indices path, keeps the shipped settings)."""
    best = {}
    for group in {r["group"] for r in rows}:
        totals: dict = {}
        counts: dict = {}
        for r in rows:
            if r["group"] == group and not any(all(r["settings"].get(k) == v for k, v in h.items())
                                               for h in HOST_READS):
                key = json.dumps(r["settings"], sort_keys=True)
                totals[key] = totals.get(key, 0.0) + r["device_us"]
                counts[key] = counts.get(key, 0) + 1
        if not counts:
            print(f"best {group}: none eligible (each reads the host every call); shipped settings kept")
            continue
        full = max(counts.values())
        key = min((k for k in totals if counts[k] == full), key=totals.get)
        best.update(json.loads(key))
        ship = json.dumps({k: shipped[k] for k in json.loads(key)}, sort_keys=True)
        print(f"best {group}: {key}: {totals[key]:.1f} µs summed over its specs; shipped {ship}: "
              f"{totals.get(ship, float('nan')):.1f} µs")
    return best


def host_table(x: torch.Tensor, specs: list[str], calls: int = 50) -> list[dict]:
    """Wall time per call on the host (no synchronization between calls except the encode's own
    host read, which ``check_finite=False`` skips), and the device time: where the wall is well above
    the device, the host sets the pace."""
    out = []
    dst = torch.empty_like(x)
    print("\n| spec | encode wall µs | encode(check_finite=False) wall µs | encode device µs | decode(out=) wall µs "
          "| decode device µs |")
    print("|---|---:|---:|---:|---:|---:|")
    for spec in specs:
        q = gradq.build(spec)
        p = q.encode(x, seed=SEED)
        q.decode(p, out=dst)
        row = {"spec": spec}
        for name, fn in (("encode", lambda: q.encode(x, seed=SEED)),
                         ("unchecked", lambda: q.encode(x, seed=SEED, check_finite=False)),
                         ("decode", lambda: q.decode(p, out=dst))):
            ts = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                ts.append((time.perf_counter() - t0) / calls)   # the host's pace: the queue drains behind it
            torch.cuda.synchronize()
            row[f"{name}_wall_us"] = statistics.median(ts) * 1e6
            if name != "unchecked":
                row[f"{name}_device_us"] = kernel_time(fn)[0] * 1e6
        out.append(row)
        print(f"| {spec} | {row['encode_wall_us']:.1f} | {row['unchecked_wall_us']:.1f} | {row['encode_device_us']:.1f} "
              f"| {row['decode_wall_us']:.1f} | {row['decode_device_us']:.1f} |", flush=True)
    q = gradq.build("qsgd:bits=4,bucket=512")
    p = q.encode(x, seed=SEED)
    for what, fn in (("encodes (check_finite=False)", lambda: q.encode(x, seed=SEED, check_finite=False)),
                     ("decodes", lambda: q.decode(p, out=dst))):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(f"\nhost profile of 300 {what} of qsgd:bits=4,bucket=512 (tottime):\n" + s.getvalue())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=25_000_000)
    ap.add_argument("--groups", nargs="*", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--host", action="store_true", help="add the host's share (wall against device, a profile)")
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds: start no spec's sweep after this (the results so far are still written)")
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--best", help="write the best settings here (the file GRADQ_TRITON_TUNING reads)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    shipped = dict(T.TUNING)
    x = torch.randn(args.n, generator=torch.Generator().manual_seed(0)).cuda()
    print(f"{torch.cuda.get_device_name()}, n = {args.n:,}; shipped settings {shipped}\n")
    print("| group | spec | settings | device µs per encode | governed kernel µs | wall µs, 20 unchecked back to back |")
    print("|---|---|---|---:|---:|---:|")
    rows = []
    deadline = time.monotonic() + args.budget
    for g in args.groups:
        rows += sweep(x, g, shipped, deadline)
    best = best_settings(rows, shipped) if rows else {}
    host = host_table(x, ["qsgd:bits=4,bucket=512", "qsgd:bits=2,bucket=512", "maxnorm:bits=4", "terngrad",
                          "signsgd", "onebit:ef=0", "bingrad-b", "linear:levels=5"]) \
        if args.host else []
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "n": args.n, "shipped": shipped,
                                               "rows": rows, "best": best, "host": host}, indent=1))
    if args.best:
        Path(args.best).write_text(json.dumps(best, indent=1))
        print(f"wrote {args.best}")


if __name__ == "__main__":
    main()
