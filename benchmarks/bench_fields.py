"""The shared-scale all-reduce's codec, one worker's part, against a device copy timed in the same run.

For each summable scheme, as the DDP hook calls them (unchecked, ``own=`` the statistics the shared
ones are reduced from): its statistics (``shared_stats``), its one-byte fields under them
(``encode_fields`` into a buffer, as the protocol pools every tensor's fields) and the mean of two
workers' fields from their sum (``decode_field_sum`` into a touched ``out=``, checks deferred, as the
protocol decodes), and a step as the protocol makes it (statistics, then fields). Each figure is a
median in ms and its ratio to a ``copy_`` of the input (higher is faster), with the peak extra
memory of the fields' encode (on CUDA ``max_memory_allocated``; on a CPU the peak RSS growth) as a
multiple of the fields' bytes. Error feedback is timed after two such steps (its spare buffers
exist then, as in training); its statistics and fields alone are not a step's parts there (repeated
statistics of one ``x`` reuse the ``x + e`` they made), so read its step column::

    python benchmarks/bench_fields.py                      # 25M values on the CPU
    python benchmarks/bench_fields.py --device cuda --n 25000000 --repeats 7
    python benchmarks/bench_fields.py --spec maxnorm:bits=4 --spec multiscale --n 1000000
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_codecs import device_time, peak_extra  # noqa: E402

import gradq  # noqa: E402
from gradq import kernels  # noqa: E402

SPECS = ["maxnorm:bits=4", "maxnorm:bits=2,bucket=512", "maxnorm:bits=8", "terngrad", "terngrad:bucket=512",
         "multiscale", "multiscale:bucket=512", "randk-maxnorm:ratio=0.01", "randk-multiscale:ratio=0.01",
         "ef(maxnorm:bits=4)"]
WORKERS = 2   # the mean is of this many workers' fields (a uint8 sum while 2·M·s ≤ 255)


def row(spec: str, x: torch.Tensor, dst: torch.Tensor, t_copy: float, repeats: int, batch: int) -> str:
    q = gradq.build(spec)
    kw = {"shared_seed": 11} if q.needs_shared_seed else {}
    stats = q.shared_stats(x, check_finite=False, **kw)
    shared = {k: s.value.clone() for k, s in stats.items()}   # (one worker's reduction: its own values)
    buf = torch.empty(q.num_codes(x.numel()), dtype=torch.uint8, device=x.device)

    def encode():
        return q.encode_fields(x, shared=shared, seed=1, check_finite=False, own=stats, out=buf, **kw)

    def step():
        st = q.shared_stats(x, check_finite=False, **kw)
        return q.encode_fields(x, shared={k: s.value for k, s in st.items()}, seed=1, check_finite=False, own=st,
                               out=buf, **kw)

    fields = encode()
    if fields is None:
        return f"| {q.spec} | no fields path | | | | | |"
    step()
    step()   # (error feedback: its spare buffers exist from here on)
    narrow = 2 * WORKERS * q.max_code <= 255
    total = (fields.to(torch.int32) * WORKERS)
    total = total.to(torch.uint8) if narrow else total

    def decode():
        with kernels.deferred_checks():
            return q.decode_field_sum(total, shared=shared, count=WORKERS, like=x, out=dst, **kw)

    # before timing: the mean of the sum is the codes' decode of their sum, up to float32 rounding
    codes = fields.to(torch.int64) - q.max_code
    want = q.decode_codes(codes * WORKERS, shared=shared, count=WORKERS, like=x, **kw)
    got = decode()
    if got.data_ptr() != dst.data_ptr() or not torch.allclose(got, want, rtol=1e-6, atol=1e-6 * float(
            want.abs().max()) if want.numel() else 0.0):
        raise SystemExit(f"{q.spec}: the mean of the sum is not the codes' decode")

    t_stats = device_time(lambda: q.shared_stats(x, check_finite=False, **kw), repeats, x.device, batch)
    t_enc = device_time(encode, repeats, x.device, batch)
    t_dec = device_time(decode, repeats, x.device, batch)
    t_step = device_time(step, repeats, x.device, batch)
    _, peak = peak_extra(encode, x.device)
    cells = [f"{t * 1e3:.2f} ({t_copy / t:.2f}×)" for t in (t_stats, t_enc, t_step, t_dec)]
    return f"| {q.spec} | {' | '.join(cells)} | {peak / max(1, buf.numel()):.2f} | {'uint8' if narrow else 'int32'} |"


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=25_000_000, help="number of fp32 values (default 25M)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--repeats", type=int, default=7, help="timings per figure (median)")
    ap.add_argument("--batch", type=int, help="on a GPU, calls issued back to back per timing (default 5)")
    ap.add_argument("--spec", action="append", help="time this spec (repeatable; default: a list of the summable "
                                                     "schemes)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a GPU")
    batch = args.batch or (5 if device.type == "cuda" else 1)
    x = torch.randn(args.n, generator=torch.Generator().manual_seed(0)).to(device)
    dst = torch.empty_like(x)
    dst.fill_(0.0)   # (touched: the decode's target is the hook's bucket)
    t_copy = device_time(lambda: dst.copy_(x), args.repeats, device, batch)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"n = {args.n:,} float32 values on {name}; torch {torch.__version__}; a copy_ of the input "
          f"{t_copy * 1e3:.2f} ms; the mean of {WORKERS} workers' fields\n")
    print("| spec | statistics ms (× copy) | fields ms (× copy) | a step: both (× copy) | mean of the sum ms (× copy) "
          "| encode peak ÷ fields | sum |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for spec in args.spec or SPECS:
        print(row(spec, x, dst, t_copy, args.repeats, batch), flush=True)


if __name__ == "__main__":
    main()
