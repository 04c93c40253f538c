"""Triton kernels of TernGrad's statistics: σ, the clip bound and the clipped max of a vector in one read,
with no host read.

Part of the Triton backend (:mod:`gradq.kernels.triton_ops`, which exports :func:`population_std` and
builds ``terngrad_stats`` on :func:`_moments`). Each block of ``_MOMENT_BLOCK`` values gives its count,
float64 mean and centred sum of squares; the triples are merged by Chan et al.'s update in a fixed
order (Triton's reduction tree within a run, the runs in order), either by a tree of launches
(``TUNING["moment_launches"] = 2``, shipped) or by the block that finishes last (``1``).
"""

from __future__ import annotations

import torch

from .triton_common import TUNING, _flat, _grid, _jit, _launch, tl, triton


@_jit
def _block_triple(x_ptr, idx, n, WHOLE: tl.constexpr):
    """The values at ``idx`` (those below ``n``): their count, float64 mean and centred sum of
    squares, and their largest ``|x|`` bit pattern. WHOLE: every index is below ``n``, so nothing is
    masked; the count is then the block's size, and the sums are those of the masked path, whose
    masked values add zeros."""
    if WHOLE:
        x32 = tl.load(x_ptr + idx)
        x = x32.to(tl.float64)
        cnt = tl.full((), idx.shape[0], tl.float64)
        mean = tl.sum(x, axis=0) / cnt
        d = x - mean
    else:
        ok = idx < n
        x32 = tl.load(x_ptr + idx, mask=ok, other=0.0)
        x = x32.to(tl.float64)
        cnt = tl.sum(ok.to(tl.float64), axis=0)
        mean = tl.sum(x, axis=0) / cnt
        d = tl.where(ok, x - mean, 0.0)
    return cnt, mean, tl.sum(d * d, axis=0), tl.max(x32.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)


@_jit
def _block_moments_kernel(x_ptr, cnt_ptr, mean_ptr, m2_ptr, maxbits_ptr, f_ptr, top_ptr, n, nblocks, clip,
                          BLOCK: tl.constexpr, CHUNK: tl.constexpr, LAST: tl.constexpr):
    """One read per block of BLOCK values: its count, float64 mean and ``Σ (x − mean)²`` (the block
    stays in registers for the second sum), and the largest ``|x|`` bit pattern (atomic max into
    ``maxbits_ptr[0]``). With ``LAST`` the program that finishes last (a ticket counter at
    ``maxbits_ptr[3]``, taken after the program's stores and released with them) merges the
    ``nblocks`` triples (:func:`_merge_chunks`) and writes :func:`_moments_result`: one launch for the
    whole of TernGrad's statistics."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if (pid.to(tl.int64) + 1) * BLOCK <= n:
        cnt, mean, m2, top = _block_triple(x_ptr, idx, n, True)
    else:
        cnt, mean, m2, top = _block_triple(x_ptr, idx, n, False)
    tl.store(cnt_ptr + pid, cnt)
    tl.store(mean_ptr + pid, mean)
    tl.store(m2_ptr + pid, m2)
    tl.atomic_max(maxbits_ptr, top)
    if LAST:
        tl.debug_barrier()   # (every thread's stores before the ticket)
        if tl.atomic_add(maxbits_ptr + 3, 1, sem="acq_rel", scope="gpu") == nblocks - 1:
            bn, bm, bq = _merge_chunks(cnt_ptr, mean_ptr, m2_ptr, nblocks, CHUNK)
            _moments_result(bn, bq, f_ptr, top_ptr, clip)


@triton.jit
def _chan_merge(na, ma, qa, nb, mb, qb):
    """Chan et al.'s merge of two (count, mean, centred sum of squares) triples, float64; a triple
    with count 0 is the identity."""
    tot = na + nb
    safe = tl.where(tot > 0, tot, 1.0)
    d = mb - ma
    return tot, ma + d * (nb / safe), qa + qb + d * d * (na * nb / safe)


@_jit
def _chunk_triple(cnt_ptr, mean_ptr, m2_ptr, offs, nblocks):
    """The triples at ``offs`` (those below ``nblocks``) merged by Triton's fixed reduction tree
    (deterministic), read from L2 (``.cg``: written by other programs of the same launch)."""
    ok = offs < nblocks
    n = tl.load(cnt_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
    m = tl.load(mean_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
    q = tl.load(m2_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
    return tl.reduce((n, m, q), 0, _chan_merge)


@_jit
def _merge_chunks(cnt_ptr, mean_ptr, m2_ptr, nblocks, CHUNK: tl.constexpr):
    """Every one of ``nblocks`` triples merged: each run of CHUNK by :func:`_chunk_triple`, the runs
    in order."""
    offs = tl.arange(0, CHUNK)
    bn, bm, bq = _chunk_triple(cnt_ptr, mean_ptr, m2_ptr, offs, nblocks)
    start = nblocks * 0 + CHUNK   # (a while loop: the interpreter's range() takes no runtime bound)
    while start < nblocks:
        cn, cm, cq = _chunk_triple(cnt_ptr, mean_ptr, m2_ptr, start + offs, nblocks)
        bn, bm, bq = _chan_merge(bn, bm, bq, cn, cm, cq)
        start += CHUNK
    return bn, bm, bq


@_jit
def _moments_result(bn, bq, f_ptr, top_ptr, clip):
    """From the merged count and centred sum of squares, into the float32 ``[max |x|, σ, bound]`` at
    ``f_ptr`` whose max is complete: σ, TernGrad's clip bound ``float32(clip)·σ`` (inf where σ is
    not positive: no clipping, as the host's ``None``) and at ``top_ptr`` the clipped max
    ``min(max |x|, bound)`` (a NaN max reads the bound), all without a host read."""
    sigma = tl.sqrt(bq / bn).to(tl.float32)
    bound = tl.where(sigma > 0, clip * sigma, float("inf"))
    mx = tl.load(f_ptr, cache_modifier=".cg")
    tl.store(f_ptr + 1, sigma)
    tl.store(f_ptr + 2, bound)
    tl.store(top_ptr, tl.where(mx < bound, mx, bound))


@_jit
def _merge_moments_kernel(cnt_ptr, mean_ptr, m2_ptr, ocnt_ptr, omean_ptr, om2_ptr, nblocks, clip,
                          CHUNK: tl.constexpr, FINAL: tl.constexpr):
    """One level of the merge tree (:func:`_moments`): each program reduces CHUNK consecutive
    triples (:func:`_chunk_triple`) into one. With FINAL (one program) ``ocnt_ptr`` is the float32
    ``[max |x|, σ, bound]`` of :func:`_moments` and ``omean_ptr`` the clipped max
    (:func:`_moments_result`)."""
    pid = tl.program_id(0)
    bn, bm, bq = _chunk_triple(cnt_ptr, mean_ptr, m2_ptr, pid.to(tl.int64) * CHUNK + tl.arange(0, CHUNK), nblocks)
    if FINAL:   # (float32 pointers here)
        _moments_result(bn, bq, ocnt_ptr, omean_ptr, clip)
    else:
        tl.store(ocnt_ptr + pid, bn)
        tl.store(omean_ptr + pid, bm)
        tl.store(om2_ptr + pid, bq)


_MOMENT_BLOCK = 4096


_LAST_RUNS = 8         # most runs of TUNING["moment_chunk"] blocks the last block merges (moment_launches 1)


def _moments(xv: torch.Tensor, clip: float = float("inf")) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(σ, bound, clipped max)`` in one read of ``xv``, as float32 device tensors (no host read):
    σ as a 0-dim tensor, TernGrad's bound ``float32(clip)·σ`` (inf where σ ≤ 0 or is NaN) as one
    element, and ``min(max |x|, bound)`` as one element. Per block its count, mean and centred sum
    of squares in float64, then the blocks' triples merged (Chan et al.'s update): with
    ``TUNING["moment_launches"] = 1`` by the block that finishes last, in the same launch, for up to
    ``_LAST_RUNS`` runs of ``TUNING["moment_chunk"]`` blocks; otherwise (the shipped setting: 1.2x
    faster on an H200) by a tree of Triton programs, each merging up to ``moment_chunk`` of them (3
    launches for up to 2^32 values at 1,024). σ equals the reference's two-pass float64 σ rounded to
    float32, except within float64 rounding (~1e-13 relative) of a float32 rounding tie."""
    n = xv.numel()
    chunk = max(2, TUNING["moment_chunk"])   # (a tree of one triple a program would never end)
    grid = _grid(n, _MOMENT_BLOCK)
    cnt, mean, m2 = torch.empty(3, grid[0], dtype=torch.float64, device=xv.device)   # (one allocation)
    out = torch.zeros(4, dtype=torch.int32, device=xv.device)   # [max |x| bits, σ, bound, blocks done]
    f = out.view(torch.float32)
    top = torch.empty(1, dtype=torch.float32, device=xv.device)
    last = TUNING["moment_launches"] == 1 and grid[0] <= _LAST_RUNS * chunk
    _launch(_block_moments_kernel, grid, xv, cnt, mean, m2, out, f, top, n, grid[0], float(clip), BLOCK=_MOMENT_BLOCK,
            CHUNK=chunk, LAST=last)
    if not last:
        while cnt.numel() > chunk:
            k = -(-cnt.numel() // chunk)
            nxt = torch.empty(3, k, dtype=torch.float64, device=xv.device)
            _launch(_merge_moments_kernel, (k,), cnt, mean, m2, *nxt, cnt.numel(), 0.0, CHUNK=chunk,
                    FINAL=False)
            cnt, mean, m2 = nxt
        _launch(_merge_moments_kernel, (1,), cnt, mean, m2, f, top, f, cnt.numel(), float(clip), CHUNK=chunk,
                FINAL=True)
    return f[1], f[2:3], top


def population_std(x: torch.Tensor) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.population_std`, in one read (see :func:`_moments`)."""
    xv = _flat(x, "x", torch.float32)
    if xv.numel() == 0:
        return torch.tensor(float("nan"), device=xv.device)
    return _moments(xv)[0]
