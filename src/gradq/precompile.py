"""Compile the CPU kernels into numba's on-disk cache once, before many processes need them.

numba compiles a kernel on its first call and keeps the machine code on disk
(:mod:`gradq.kernels.numba_cache`; ``~/.cache/gradq/numba`` unless ``GRADQ_NUMBA_CACHE`` says
otherwise), keyed by a hash of the kernels' sources. A fresh machine, a new version of gradq, or a
fresh CI runner pays that once: 1–30 s a scheme, about two minutes for all of them on two cores
(``benchmarks/bench_compile.py``). Ranks started together on a cold cache take turns at it (one compiles
a kernel under a lock in the cache folder, the others wait and load it), but the first steps still
wait for it. Compiling first, in one process, lets every rank load the kernels at once.

``gradq train`` and ``gradq demo`` do this for their specs before they start their local workers.
Before a ``torchrun`` of your own, run ``gradq compile`` (every scheme) or ``gradq compile -c SPEC``
once per machine, or call :func:`precompile`.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

import torch

from .factory import build
from .kernels.numba_cache import quiet_compiles

__all__ = ["SPECS", "precompile"]

#: one spec per family of CPU kernels, ordered so that each reaches kernels the earlier ones did not
SPECS = ("qsgd:bits=4", "qsgd:bits=4,norm=l2", "maxnorm:bits=4", "terngrad", "terngrad:pack=2bit",
         "multiscale:bits=2+6", "orq:levels=5", "linear:levels=5", "signsgd", "onebit", "bingrad-b",
         "bingrad-pb", "qsgd:bits=4,coding=elias", "randk-maxnorm:ratio=0.3", "topk:ratio=0.01")


def _exercise(spec: str, numel: int) -> None:
    """Every CPU entry point the protocols and the hooks call, once, on ``numel`` float32 values."""
    q = build(spec)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    out = torch.empty_like(x)
    a, b = q.encode(x, seed=1), q.encode(y, seed=2, check_finite=False)
    q.decode(a)
    q.decode(b, out=out)
    q.decode_mean([a, b], out=out)
    if not q.summable:
        return
    stats = q.shared_stats(x, shared_seed=3)
    shared = {k: s.value for k, s in stats.items()}
    fields = q.encode_fields(x, shared=shared, seed=4, shared_seed=3)
    if fields is not None:
        q.decode_field_sum(fields.to(torch.int32) + fields.to(torch.int32), shared=shared, count=2, like=x,
                           shared_seed=3)
        q.decode_field_sum(fields, shared=shared, count=1, like=x, shared_seed=3)
    codes = q.encode_codes(x, shared=shared, seed=4, shared_seed=3)
    q.decode_codes(codes, shared=shared, count=1, like=x, shared_seed=3)


def precompile(specs: Optional[Iterable[str]] = None, *, numel: int = 5000,
               progress: bool = False) -> dict[str, float]:
    """Run every CPU kernel that ``specs`` (default :data:`SPECS`, one per kernel family) use once,
    so that numba compiles each into its cache; returns the seconds each spec took (about 0 where
    the cache already held its kernels, or an earlier spec compiled them).

    Raises :class:`gradq.SpecError` for a spec that does not parse, before compiling anything."""
    todo = list(SPECS if specs is None else specs)
    for spec in todo:  # refuse a bad spec before minutes of compiling
        build(spec)
    bar = None
    if progress:
        from tqdm import tqdm

        # shown only once a spec takes a while (a cache that holds the kernels loads in about a second)
        bar = tqdm(total=len(todo), desc="compiling CPU kernels (once per machine)", unit="spec", leave=False,
                   delay=1.0)
    took: dict[str, float] = {}
    try:
        with quiet_compiles():   # (no note of the compiles: this is the place for them)
            for spec in todo:
                if bar is not None:
                    bar.set_postfix_str(spec, refresh=False)
                t0 = time.perf_counter()
                _exercise(spec, numel)
                took[spec] = time.perf_counter() - t0
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
    return took

