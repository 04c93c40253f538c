"""Elias streams of QSGD codes read by Triton kernels: the GPU path of decoding Elias-coded QSGD.

The stream is :func:`gradq.codecs.qsgd_stream.encode_fields_stream`'s (a flag bit; for the sparse
layout ``omega(nnz + 1)``, then per nonzero ``omega(gap)``, a sign bit and ``omega(|c|)``; for the
dense layout per value ``omega(|c| + 1)`` and a sign bit where ``c ≠ 0``). Its items are codes of
varying length, so where one starts is known only by reading every item before it. The chunk index
marks one start every 2**18 values: too few places to start for a GPU. These kernels find their own:

1. **Segments.** The stream after the header is cut into segments of ``TUNING["read_bits"]`` bits,
   one lane each. A lane reads items from a guess of where its first item starts (at first, its
   segment's first bit) until it passes the segment's end, and records where it stopped, how many
   items it read and the sum of their gaps. An item is one look-up in the host reader's table of
   12-bit windows (16 bits for dense streams of ``s`` above 15) where it fits, else read code by
   code; one that does not read at all (after a wrong guess, as a rule) is skipped a bit at a time.
2. **Rounds.** Each lane's next guess is where the lane before it stopped. Lane 0's guess is exact,
   so after ``r`` rounds the first ``r`` lanes are; and when a round changes no guess, every lane
   read from a true start. Prefix codes resynchronize within a few items after a wrong start, so
   the second round almost always confirms the first: one read of the whole stream and then only
   the lanes whose guess changed (``_ROUNDS`` at most, then the host's reader).
3. **Write.** From the exclusive sums of the lanes' counts (and gaps) each lane knows the index
   (sparse: the position) of its first item, reads its items again and stores their fields
   ``c + s`` (into fields of ``s``, for the sparse layout). The lane with the last item checks the
   padding; every item is checked for ``|c| ≤ s`` and a position within ``n``.

Anything out of the ordinary (an item that does not read, too many rounds, too few items, a bad
tail) returns ``None``, and the caller reads the stream on the host, whose reader raises the
specific error of a corrupt stream: these kernels never decide that a payload is corrupt, and a
stream they accept is one the host's reader accepts with the same fields. The index is not read
(its CRC was checked with the stream's). Host reads: the header's 16 bytes, one count a round, and
the result's check.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import numpy as np
import torch

from ..codecs.elias import OK, read_omega
from ..codecs.qsgd_fields import _IWIN, WIDE, WIDE_FROM, item_tables, wide_dense_table
from . import triton_common as _C
from .triton_common import _jit, tl

__all__ = ["decode_fields_stream"]

#: rounds of guesses before the host's reader takes over (each after the first re-reads only the
#: lanes whose guess changed)
_ROUNDS = 16


@_jit
def _peek(w_ptr, p, nwords):
    """The 64 stream bits from bit ``p`` (int64 lanes) as uint64, the first at bit 63, from the
    stream's big-endian 32-bit words (``w_ptr``, int32, zeros past the end)."""
    q = p >> 5
    r = (p & 31).to(tl.uint64)
    a = tl.load(w_ptr + q, mask=q < nwords, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    b = tl.load(w_ptr + q + 1, mask=q + 1 < nwords, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    c = tl.load(w_ptr + q + 2, mask=q + 2 < nwords, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    return (((a << 32) | b) << r) | ((c >> 1) >> (31 - r))


@_jit
def _omega(w):
    """The omega code at the top of ``w`` (uint64): ``(value int64, bits int32, ok)``; ``ok`` is false
    for codes of more than six groups or with a group of more than 32 bits (values of 2**32 and up,
    which no stream of fewer than 2**31 values holds)."""
    v = tl.full(w.shape, 1, tl.int64)
    used = tl.zeros(w.shape, tl.int32)
    done = tl.zeros(w.shape, tl.int1)
    ok = tl.full(w.shape, 1, tl.int1)
    for _ in tl.static_range(6):
        top = (w << tl.minimum(used, 63).to(tl.uint64))
        stop = ~done & ((top >> 63) == 0)
        grow = ~done & ~stop
        wide = v + 1                                       # the next group's bits
        ok = ok & ~(grow & ((wide > 32) | (used + wide > 64)))
        width = tl.minimum(wide, 32).to(tl.int32)
        nv = (top >> (64 - width).to(tl.uint64)).to(tl.int64)
        used = tl.where(stop, used + 1, tl.where(grow, used + width, used))
        v = tl.where(grow, nv, v)
        done = done | stop
    return v, used, ok & done


@_jit
def _item(w, SPARSE: tl.constexpr):
    """The item at the top of the window ``w``: ``(gap, c, bits, ok)``, code by code. Sparse:
    ``omega(gap)``, a sign bit and ``omega(|c|)``; dense: ``omega(|c| + 1)`` and a sign bit where
    ``c ≠ 0`` (gap 1)."""
    if SPARSE:
        gap, used, ok = _omega(w)
        rest = w << tl.minimum(used + 1, 63).to(tl.uint64)
        mag, used2, ok2 = _omega(rest)
        neg = ((w << tl.minimum(used, 63).to(tl.uint64)) >> 63) != 0
        bits = used + 1 + used2
        ok = ok & ok2 & (bits <= 64)
    else:
        v, used, ok = _omega(w)
        gap = tl.full(w.shape, 1, tl.int64)
        mag = v - 1
        sign = (mag != 0).to(tl.int32)
        neg = (sign != 0) & (((w << tl.minimum(used, 63).to(tl.uint64)) >> 63) != 0)
        bits = used + sign
        ok = ok & (bits <= 64)
    return gap, tl.where(neg, -mag, mag), bits, ok


@_jit
def _next_item(w_ptr, tab_ptr, p, nwords, s, SPARSE: tl.constexpr, WIN: tl.constexpr):
    """The item at bit ``p``: ``(gap, field c + s, bits, ok)``. Items of up to ``WIN`` bits (and,
    sparse, gaps below 2**16) come from one look-up in the host reader's table of ``WIN``-bit
    windows (:func:`gradq.codecs.qsgd_fields.item_tables`, ``wide_dense_table``); where any lane's
    item does not, the program reads the codes (:func:`_item`)."""
    w = _peek(w_ptr, p, nwords)
    t = tl.load(tab_ptr + (w >> (64 - WIN)).to(tl.int32))
    bits = t & 31
    ok = t != 0
    if SPARSE:
        gap = (t >> 13).to(tl.int64)
        field = (t >> 5) & 0xFF
    else:
        gap = tl.full(p.shape, 1, tl.int64)
        field = t >> 5
    if tl.max((~ok).to(tl.int32), axis=0) > 0:
        g2, c2, b2, ok2 = _item(w, SPARSE)
        gap = tl.where(ok, gap, g2)
        field = tl.where(ok, field, (c2 + s).to(tl.int32))
        bits = tl.where(ok, bits, b2)
        ok = ok | ok2
    return gap, field, bits, ok


@_jit
def _elias_read_kernel(w_ptr, tab_ptr, start_ptr, act_ptr, end_ptr, cnt_ptr, gsum_ptr, err_ptr, fields_ptr,
                       base_ptr, pos_ptr, nbytes, nwords, nseg, n, nitems, s, b0, SEG: tl.constexpr,
                       LANES: tl.constexpr, SPARSE: tl.constexpr, WRITE: tl.constexpr, WIN: tl.constexpr):
    """One lane a segment of ``SEG`` bits: its items from bit ``start[k]`` until one starts at or past
    the segment's end. Without ``WRITE`` (the lanes with ``act[k] ≠ 0``): where it stopped, the
    items and the sum of their gaps, and whether an item did not read (``end``, ``cnt``, ``gsum``,
    ``err``; such an item is skipped a bit at a time). With ``WRITE`` (every lane, from true
    starts): the fields of the items with indices ``base[k]`` on below ``nitems`` (sparse: at
    positions ``pos[k]`` plus the running gaps, 1-based), and ``err[k]`` set for an item that does
    not read, ``|c| > s``, a position past ``n``, or (the lane with the last item) padding that is
    not zeros or extra bytes. ``WIN``: the bits of the table's windows (:func:`_next_item`)."""
    k = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)
    live = k < nseg
    if not WRITE:
        live = live & (tl.load(act_ptr + k, mask=live, other=0) != 0)
    nbits = nbytes * 8
    limit = tl.minimum(b0 + (k + 1) * SEG, nbits)
    p = tl.load(start_ptr + k, mask=live, other=0)
    i = tl.zeros([LANES], tl.int64)
    g = tl.zeros([LANES], tl.int64)
    bad = tl.zeros([LANES], tl.int1)
    if WRITE:
        base = tl.load(base_ptr + k, mask=live, other=0)
        at = tl.load(pos_ptr + k, mask=live, other=0)
        last = tl.load(w_ptr + (nbytes - 1) // 4) >> (8 * (3 - (nbytes - 1) % 4))   # the last byte
    go = live & (p < limit)
    while tl.max(go.to(tl.int32), axis=0) > 0:
        gap, field, bits, ok = _next_item(w_ptr, tab_ptr, p, nwords, s, SPARSE, WIN)
        bad = bad | (go & ~ok)
        adv = go & ok
        g = g + tl.where(adv, gap, 0)
        if WRITE:
            idx = base + i
            real = adv & (idx < nitems)
            if SPARSE:
                where = at + g - 1
            else:
                where = idx
            wrong = (field < 0) | (field > 2 * s) | (where >= n)
            bad = bad | (real & wrong)
            tl.store(fields_ptr + tl.where(real & ~wrong, where, 0), field.to(tl.uint8), mask=real & ~wrong)
            # the last item: then only zero bits to the end of its byte, and no more bytes
            e = p + bits
            tail = real & (idx == nitems - 1)
            pad = (8 - (e & 7)) & 7
            loose = ((e + 7) >> 3 != nbytes) | ((pad != 0) & ((last & ((1 << pad) - 1)) != 0))
            bad = bad | (tail & loose)
        # an item that does not read (after a wrong guess, as a rule) is skipped one bit at a time,
        # so that the lane can fall into step with the items again
        p = tl.where(adv, p + bits, tl.where(go, p + 1, p))
        i = i + adv.to(tl.int64)
        go = go & (p < limit)
    if WRITE:
        tl.store(err_ptr + k, bad.to(tl.int32), mask=live)
    else:
        tl.store(end_ptr + k, p, mask=live)
        tl.store(cnt_ptr + k, i, mask=live)
        tl.store(gsum_ptr + k, g, mask=live)
        tl.store(err_ptr + k, bad.to(tl.int32), mask=live)


def _words(stream: torch.Tensor) -> torch.Tensor:
    """The stream as big-endian 32-bit words (int32, as the kernels read them), two zero words after."""
    nw = -(-stream.numel() // 4) + 2
    b = torch.zeros(4 * nw, dtype=torch.uint8, device=stream.device)
    b[:stream.numel()] = stream
    return b.view(nw, 4).flip(1).reshape(-1).view(torch.int32)


@lru_cache(maxsize=None)
def _table(s: int, sparse: bool, device: str) -> tuple[torch.Tensor, int]:
    """The host reader's table of whole items for the layout, on ``device``, and its window's bits:
    :func:`gradq.codecs.qsgd_fields.item_tables` (12 bits), or for dense streams of ``s`` above 15,
    whose items mostly pass 12 bits, ``wide_dense_table`` (16 bits, 256 KiB), as the host reader
    chooses (``gradq.codecs.qsgd_chunks_read``)."""
    if not sparse and s > WIDE_FROM:
        return torch.from_numpy(wide_dense_table(s)).to(torch.device(device)), WIDE
    return torch.from_numpy(item_tables(s)[0 if sparse else 1]).to(torch.device(device)), _IWIN


def _header(stream: torch.Tensor, n: int) -> Optional[tuple[bool, int, int]]:
    """``(sparse, first item's bit, items)`` from the stream's first bytes, or None where the header
    does not read (the host's reader then says why)."""
    head = np.ascontiguousarray(stream[:16].cpu().numpy())
    if head[0] >> 7:
        return False, 1, n
    v, p, err = read_omega(head, 1, head.size * 8)
    if err != OK or v - 1 > n:
        return None
    return True, int(p), int(v) - 1


def decode_fields_stream(stream: torch.Tensor, n: int, s: int) -> Optional[torch.Tensor]:
    """The ``n`` uint8 fields ``c + s`` of an Elias stream on its device, as
    :func:`gradq.codecs.qsgd_stream.decode_fields_stream` gives them, or None where these kernels
    cannot tell (a stream they do not accept, or one whose guesses do not settle in ``_ROUNDS``
    rounds; also an empty stream or no items): the caller then reads it on the host."""
    nbytes = stream.numel()
    if nbytes == 0 or n == 0:
        return None
    head = _header(stream, n)
    if head is None or head[2] == 0:
        return None
    sparse, b0, nitems = head
    seg = _C.TUNING["read_bits"]
    nseg = -(-(nbytes * 8 - b0) // seg)
    if nseg < 1:
        return None
    dev = stream.device
    lanes = 32 * _C.TUNING["read_warps"]
    grid = (-(-nseg // lanes),)
    words = _words(stream)
    tab, win = _table(s, sparse, str(dev))
    start = b0 + seg * torch.arange(nseg, dtype=torch.int64, device=dev)
    act = torch.ones(nseg, dtype=torch.int8, device=dev)
    end, cnt, gsum = (torch.empty(nseg, dtype=torch.int64, device=dev) for _ in range(3))
    err = torch.empty(nseg, dtype=torch.int32, device=dev)
    sizes = (nbytes, words.numel(), nseg, n, nitems, s, b0)
    meta = dict(SEG=seg, LANES=lanes, SPARSE=sparse, WIN=win, num_warps=_C.TUNING["read_warps"])
    for _ in range(_ROUNDS):
        _C._launch(_elias_read_kernel, grid, words, tab, start, act, end, cnt, gsum, err, words, start, start,
                   *sizes, WRITE=False, **meta)
        guess = torch.cat([start[:1], end[:-1]])
        act = (guess != start).to(torch.int8)
        if not int(act.sum()):            # one host read a round
            break
        start = guess
    else:
        return None
    base = torch.cumsum(cnt, 0) - cnt
    pos = torch.cumsum(gsum, 0) - gsum
    fields = torch.full((n,), s, dtype=torch.uint8, device=dev) if sparse else torch.empty(n, dtype=torch.uint8,
                                                                                           device=dev)
    werr = torch.empty(nseg, dtype=torch.int32, device=dev)
    _C._launch(_elias_read_kernel, grid, words, tab, start, act, end, cnt, gsum, werr, fields, base, pos,
               *sizes, WRITE=True, **meta)
    bad, total = torch.stack([(err != 0).sum() + (werr != 0).sum(), cnt.sum()]).tolist()
    if bad or total < nitems:
        return None
    return fields
