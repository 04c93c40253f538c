"""Device operations and host reads per call of the Triton backend, counted without a GPU.

At a gradient's size a GPU encode is short: a 100 MB copy takes about 73 µs on an H100, so every
extra kernel launch (a few µs of host time each) and every host read (which waits for the queue to
drain) shows in the time per call (docs/performance.md, "GPU (Triton)"). This script counts them
for each scheme's ``encode`` and ``decode(out=)`` through the public API, on CPU tensors with the
Triton kernels under the interpreter (``GRADQ_KERNELS=triton``), which take the same code path as
CUDA tensors:

* ``triton``: Triton kernel launches;
* ``torch``: torch operators that run a device kernel (every aten operator except views, shape
  and metadata operators and allocations, which launch nothing on a GPU);
* ``host reads``: operators that bring a device value to the host (``.item()``, ``int(t)``,
  ``float(t)``, ``bool(t)``, ``torch.equal``; and ``nonzero``, boolean-mask indexing and the like,
  whose output's size the host must read), and ``.tolist()`` or ``.cpu()`` of a tensor on the device (an input
  of the call, a kernel's argument or a result of a device operation, not one made from host
  data), each a synchronization on a GPU. On a CPU tensor ``.tolist()`` and ``.cpu()`` run no
  operator, so they are caught by name. The encode's look at its non-finite witness, which sums a
  CPU field with NumPy, is counted as its CUDA branch runs it (a ``sum`` and a host read);
* ``from host``: tensors made from host data (``torch.tensor(list, device=...)``), each a copy
  from pageable memory on a GPU;
* ``peak``: the most bytes held at once by tensors the call allocated (outputs of operators whose
  storage is neither an input's nor already counted; a storage is freed when the last tensor that
  the call made on it dies), divided by the payload's bytes for an encode and by the input's for a
  decode. On a GPU this is what ``torch.cuda.max_memory_allocated`` grows by during the call, up to
  the allocator's rounding, since Triton kernels allocate nothing: the issue's ≤ 1.25 × payload.

* with ``--host``: the host's own time per call, in µs (median of 300 calls after 20), with every
  Triton launch stubbed out: the package's Python, allocations and torch operators, without
  Triton's launcher (about 25 µs a launch on the H100 host, docs/performance.md) or any device
  work. The encode is the DDP hook's (``check_finite=False``) and the decode runs with its checks
  deferred; the stubbed kernels write nothing, so only timings come from these calls, and only
  where the host decides nothing from what a kernel wrote (the Rand-K family's selection keeps
  the last one: the rows time calls that reuse it).

    python benchmarks/bench_launches.py [--n 100000] [--spec SPEC ...] [--deferred] [--host]

The counts do not depend on ``n`` beyond a few logarithmic terms (tree merges); they are a proxy
for the host-side cost per call, to be set against times measured on a GPU.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import weakref
from collections import Counter

os.environ.setdefault("GRADQ_KERNELS", "triton")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import gradq  # noqa: E402
from gradq import kernels as K  # noqa: E402
from gradq.kernels import triton_common as C  # noqa: E402
from gradq.kernels import triton_binary as B  # noqa: E402
from gradq.kernels import triton_decode as D  # noqa: E402
from gradq.kernels import triton_levels as L  # noqa: E402
from gradq.kernels import triton_checks as CK  # noqa: E402
from gradq.kernels import triton_moments as MO  # noqa: E402
from gradq.kernels import triton_multiscale as M  # noqa: E402
from gradq.kernels import triton_ops as T  # noqa: E402
from gradq.kernels import triton_crc as X  # noqa: E402
from gradq.kernels import triton_subset as S  # noqa: E402
from gradq.kernels import triton_randk as RK  # noqa: E402
from gradq.kernels import triton_randk_values as RV  # noqa: E402
from gradq.kernels import triton_topk as TK  # noqa: E402

#: operators that launch nothing on a GPU: views, metadata, allocation
NO_KERNEL = {"view", "_unsafe_view", "reshape", "as_strided", "detach", "alias", "slice", "select", "expand",
             "t", "transpose", "permute", "unsqueeze", "squeeze", "empty", "empty_like", "empty_strided",
             "new_empty", "new_empty_strided", "set_", "split", "split_with_sizes", "unbind",
             "view_as_real", "resolve_conj", "resolve_neg", "unfold", "flatten", "narrow", "_reshape_alias",
             "is_nonzero", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "contiguous"}
HOST_READ = {"_local_scalar_dense", "item"}
#: operators that run a device kernel and return its result to the host (a host read as well), and
#: those whose output's size depends on the data (the host reads that size before it allocates):
#: ``nonzero``, ``masked_select``, ``unique`` and indexing with a boolean mask (``t[mask]``,
#: ``t[mask] = v``), counted under the name ``index (bool mask)``
READ_TOO = {"equal", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
            "index (bool mask)"}


def op_name(func, args) -> str:
    """The aten operator's name, or ``index (bool mask)`` for indexing with a boolean mask."""
    name = func.__name__.split(".")[0]
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1 and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
        return "index (bool mask)"
    return name
FROM_HOST = {"lift_fresh"}


class Count(TorchDispatchMode):
    """Counts the aten operators run outside Triton launches (the interpreter's own copies of a
    kernel's arguments are not the program's)."""

    def __init__(self, inputs=()):
        super().__init__()
        self.ops: Counter = Counter()
        self.in_launch = False
        self.live: dict[int, list[int]] = {}   # storage address -> [bytes, tensors made on it]
        self.held = 0
        self.peak = 0
        # storages on the device (the call's inputs, kernels' arguments, results of device
        # operations) and storages of host data (made from host data, or only from such)
        self.device: set[int] = set()
        self.host: set[int] = set()
        self.note_device(inputs)

    def note_device(self, obj) -> None:
        self.device.update(t.untyped_storage().data_ptr() for t in _tensors(obj))

    def on_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        if not self.in_launch:
            name = op_name(func, args)
            self.ops[name] += 1
            inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
            outs = {t.untyped_storage().data_ptr() for t in _tensors(res)} - {0}
            if name in FROM_HOST or (inputs and inputs <= self.host):
                self.host |= outs
            elif name not in HOST_READ:
                self.device |= outs - self.host
            for t in _tensors(res):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr in self.live:
                    self.live[ptr][1] += 1
                elif ptr in inputs or not st.nbytes():
                    continue
                else:
                    self.live[ptr] = [st.nbytes(), 1]
                    self.held += st.nbytes()
                    self.peak = max(self.peak, self.held)
                weakref.finalize(t, self._release, ptr)
        return res

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if not entry[1]:
            del self.live[ptr]
            self.held -= entry[0]


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def counts(fn, inputs=()) -> tuple[int, int, int, int, int, Counter]:
    """Launches, torch operators, host reads, tensors from host data, peak bytes and the operators
    of ``fn()``; ``inputs``: the tensors it is given, which live on the device."""
    launches = [0]
    real = C._launch
    c = Count(inputs)

    def counting(kernel, grid, *a, **kw):
        launches[0] += 1
        c.note_device((a, kw))
        c.in_launch = True
        try:
            return real(kernel, grid, *a, **kw)
        finally:
            c.in_launch = False

    # every module of the backend launches through its own name for _launch (triton_elias through
    # triton_common's)
    mods = (C, T, B, D, L, MO, M, S, X, RK, RV, TK, CK)
    reads = [0]
    tolist, cpu, witness = torch.Tensor.tolist, torch.Tensor.cpu, K.witness_is_finite

    def reading(method):
        def read(self, *a, **kw):
            if not c.in_launch and c.on_device(self):
                reads[0] += 1
            return method(self, *a, **kw)
        return read

    for m in mods:
        m._launch = counting
    torch.Tensor.tolist, torch.Tensor.cpu = reading(tolist), reading(cpu)
    K.witness_is_finite = (T.field_is_finite if T.TUNING["witness_path"] == 2     # the CUDA branch
                           else lambda t: math.isfinite(float(t.sum())))
    try:
        with c:
            fn()
    finally:
        for m in mods:
            m._launch = real
        torch.Tensor.tolist, torch.Tensor.cpu, K.witness_is_finite = tolist, cpu, witness
    torch_ops = sum(v for k, v in c.ops.items() if k not in NO_KERNEL | HOST_READ | FROM_HOST)
    host_reads = sum(v for k, v in c.ops.items() if k in HOST_READ | READ_TOO) + reads[0]
    return (launches[0], torch_ops, host_reads, sum(v for k, v in c.ops.items() if k in FROM_HOST), c.peak,
            c.ops)


def host_us(fn, repeats: int = 300) -> float:
    """Median wall time of ``fn()`` in µs with every Triton launch a no-op (20 calls first)."""
    from bench_codecs import median_time

    mods = (C, T, B, D, L, MO, M, S, X, RK, RV, TK, CK)
    real = C._launch
    for m in mods:
        m._launch = lambda *a, **kw: None
    try:
        for _ in range(19):
            fn()
        return median_time(fn, repeats)[1] * 1e6   # (its first call is the twentieth)
    finally:
        for m in mods:
            m._launch = real


def main() -> None:
    from bench_codecs import MEMORY_SPECS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="number of fp32 values (default 100000)")
    ap.add_argument("--spec", action="append", help="count this spec (repeatable; default: bench_codecs' list)")
    ap.add_argument("--ops", action="store_true", help="also list the torch operators of each call")
    ap.add_argument("--deferred", action="store_true",
                    help="decode with the checks deferred (gradq.kernels.deferred_checks), as the DDP hook does")
    ap.add_argument("--host", action="store_true",
                    help="add the host's own µs per call, launches stubbed (the hook's unchecked encode and "
                         "deferred decode)")
    args = ap.parse_args()
    x = torch.randn(args.n, generator=torch.Generator().manual_seed(0))
    dst = torch.empty_like(x)
    assert K.backend_for(x) == "triton", "GRADQ_KERNELS=triton is needed (set before gradq is imported)"
    print(f"n = {args.n:,}; Triton kernels under the interpreter, torch {torch.__version__}\n")
    print("| spec | encode: triton | torch | host reads | from host | peak ÷ payload | decode(out=): triton | torch "
          "| host reads | from host | peak ÷ input |" + (" host µs: encode | decode |" if args.host else ""))
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.host else ""))
    for spec in args.spec or [s for s in MEMORY_SPECS if "coding=" not in s]:
        q = gradq.build(spec)
        p = q.encode(x, seed=1)
        q.decode(p, out=dst)
        e = counts(lambda: q.encode(x, seed=2), inputs=x)
        def decode():
            if not args.deferred:
                return q.decode(p, out=dst)
            with K.deferred_checks():
                return q.decode(p, out=dst)
        d = counts(decode, inputs=(dst, *p.fields.values()))
        cells = [*map(str, e[:4]), f"{e[4] / p.nbytes:.2f}", *map(str, d[:4]), f"{d[4] / x.nbytes:.2f}"]
        if args.host:
            def deferred():
                with K.deferred_checks():
                    q.decode(p, out=dst)
            cells += [f"{host_us(lambda: q.encode(x, seed=2, check_finite=False)):.1f}", f"{host_us(deferred):.1f}"]
        print(f"| {q.spec} | {' | '.join(cells)} |", flush=True)
        if args.ops:
            print(f"|   encode ops: {dict(e[5])} |\n|   decode ops: {dict(d[5])} |")


if __name__ == "__main__":
    main()
