"""Elias streams of QSGD fields built by Triton kernels: the GPU path of Elias-coded QSGD.

The bytes and the chunk index are :func:`gradq.codecs.qsgd_stream.encode_fields_stream`'s (the serial
writer, the specification), as :func:`gradq.codecs.qsgd_stream_torch.encode_fields_stream_torch`
builds them with tensor operations. That version moves several int64 tensors of the input's length
through memory. Here the fields are read twice and nothing of the input's size is allocated:

1. **Count** (one program a block of ``BLOCK`` fields): the block's dense bits, nonzeros, sparse
   bits but for its first gap, and its first and last nonzero positions; any field above ``2s``.
2. **Blocks** (one program over the blocks' counts): each block's first gap from the last nonzero
   before it, and every block's first bit in either layout (prefix sums); the totals, which the
   host reads once to size the stream and pick the layout as the serial writer does.
3. **Write** (one program a block): each item's code (a sparse item is its gap's omega code and
   the sign + magnitude code; a dense one the table's code), its bit offset from an exclusive scan
   of the lengths, and its parts in the up to three 32-bit words it touches. Codes share no bit,
   so a word is the sum of its parts: a run of parts bound for one word is added with two atomic
   adds (a difference of running sums), not one per code. The words are stored byte-swapped, so
   that memory holds the stream's big-endian bytes. A block that starts a chunk of 2**18 values
   writes the chunk's row of the index (:mod:`gradq.codecs.qsgd_chunks`).

Only sums, maxima and gathers run along a block (no histogram, whose bins cost shared-memory
atomics, and no scan with an operator of its own, which the interpreter runs element by element):
a gap comes from the last nonzero before each lane, by doubling steps within rows of 32 lanes
(:func:`_prev_nonzero`).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..codecs.elias import _OMEGA_CODE, _OMEGA_LEN, _SMALL
from ..codecs.qsgd_fields import _CHUNK as CHUNK
from ..codecs.qsgd_fields import field_tables
from ..codecs.qsgd_stream_torch import _omega_codes, check_stream_args
from . import triton_common as _C
from .triton_common import _jit, tl

__all__ = ["encode_fields_stream"]

#: fields a program, in both passes (a power of two that divides the chunk length)
BLOCK = 1024
assert CHUNK % BLOCK == 0 and BLOCK % 32 == 0
#: blocks a tile of the prefix sums over the blocks' counts (and tiles a step of the scan over the
#: tiles); with four warps a program, 96–224 registers a thread and no spills for sm_90
_TILE = 64


@lru_cache(maxsize=None)
def _tables(s: int, device: str) -> tuple[torch.Tensor, ...]:
    """``(sparse code, sparse bits, dense code, dense bits)`` per field and the omega table, on device."""
    dev = torch.device(device)
    sc, sl, dc, dl = (torch.from_numpy(t).to(dev) for t in field_tables(s))
    # (dense codes have at most 15 bits: int32, cut into parts in 32-bit arithmetic)
    return sc, sl.to(torch.int32), dc.to(torch.int32), dl.to(torch.int32), torch.from_numpy(_OMEGA_CODE).to(dev), \
        torch.from_numpy(_OMEGA_LEN).to(dev, torch.int32)


# == device helpers ===============================================================================
@_jit
def _bit_length(k):
    """Binary digits of ``1 ≤ k < 2**53`` (int64), read off the exponent of ``float64(k)`` (exact)."""
    e = (k.to(tl.float64).to(tl.int64, bitcast=True) >> 52) & 0x7FF
    return e - 1022


@_jit
def _omega_len(k, ol_ptr, SMALL: tl.constexpr):
    """Omega code lengths of ``1 ≤ k < 2**31`` (int64; lanes where ``k < 1`` give garbage, unread)."""
    small = k < SMALL
    b = _bit_length(tl.maximum(k, 1))
    head = tl.load(ol_ptr + tl.minimum(tl.maximum(b - 1, 0), SMALL - 1)).to(tl.int64) - 1
    return tl.where(small, tl.load(ol_ptr + tl.where(small, k, 0)).to(tl.int64), head + b + 1)


@_jit
def _omega_code(k, oc_ptr, ol_ptr, SMALL: tl.constexpr):
    """Omega codes (right-aligned int64) of ``1 ≤ k < 2**31``: the table below ``SMALL``, else
    ``omega(b − 1)`` without its final 0, the ``b`` bits of ``k``, then 0 (``b`` = bit length)."""
    small = k < SMALL
    b = _bit_length(tl.maximum(k, 1))
    head = tl.load(oc_ptr + tl.minimum(tl.maximum(b - 1, 0), SMALL - 1)) >> 1
    return tl.where(small, tl.load(oc_ptr + tl.where(small, k, 0)), (head << (b + 1)) | (k << 1))


@_jit
def _bswap32(v):
    return ((v & 0xFF) << 24) | (((v >> 8) & 0xFF) << 16) | (((v >> 16) & 0xFF) << 8) | ((v >> 24) & 0xFF)


@_jit
def _write_words(words_ptr, code, length, wbase, lead, col, BLOCK: tl.constexpr, PARTS: tl.constexpr,
                 NARROW: tl.constexpr):
    """Add every code (``length ≤ 63`` bits, int32; length 0 for lanes without a code; NARROW: the
    codes are int32 of at most 32 bits, cut into parts in 32-bit arithmetic) into the
    byte-swapped 32-bit words it touches. The codes follow one another from bit ``lead`` (< 32) of
    word ``wbase``, most significant bit first: a block's codes span fewer than 2**31 bits, so
    their offsets from there are an int32 running sum.

    Codes never share a bit, so a word's OR is its sum, and the parts bound for one word (a run of
    lanes with the same word) add up as a difference of running sums: the run's last lane adds the
    running sum, its first lane subtracts the sum before it. Two atomic adds a word and part, in
    int32 arithmetic that wraps, which is exact modulo 2**32 (the running sums are int32 too).

    A part's word is the lane's first word plus the part's number, so the runs are those of the
    first words for every part. A lane ends its run where the next lane's code starts in another
    word (at ``offset + length``: no neighbour read); it starts one where the lane before it
    started in another (one gather of the first words)."""
    offset = lead + tl.cumsum(length, 0) - length
    w0 = offset >> 5
    last = (col == BLOCK - 1) | (w0 != ((offset + length) >> 5))
    first = (col == 0) | (w0 != tl.gather(w0, tl.maximum(col - 1, 0), 0))
    total = (offset & 31) + length
    if NARROW:
        code = code.to(tl.uint32, bitcast=True)
    for j in tl.static_range(PARTS):
        d = total - 32 - 32 * j                           # shift right by d (d ≥ 0) or left by −d
        if NARROW:
            right = tl.where(d >= 32, 0, code >> tl.minimum(tl.maximum(d, 0), 31).to(tl.uint32))
            left = code << tl.minimum(tl.maximum(-d, 0), 31).to(tl.uint32)
            part = tl.where(length > 0, tl.where(d >= 0, right, tl.where(-d >= 32, 0, left)), 0)
            part = _bswap32(part).to(tl.int32, bitcast=True)
        else:
            right = (code >> tl.minimum(tl.maximum(d, 0), 63)) & 0xFFFFFFFF
            left = (code << tl.minimum(tl.maximum(-d, 0), 63)) & 0xFFFFFFFF
            part = tl.where(length > 0, tl.where(d >= 0, right, tl.where(-d >= 32, 0, left)), 0)
            part = _bswap32(part).to(tl.int32)
        run = tl.cumsum(part, 0)                          # modulo 2**32
        add = tl.where(last, run, 0) - tl.where(first, run - part, 0)
        on = add != 0
        tl.atomic_add(words_ptr + wbase + tl.where(on, w0 + j, 0), add, mask=on)


@_jit
def _prev_nonzero(nz, BLOCK: tl.constexpr):
    """Per lane, the column of the last nonzero lane before it (−1: none), an exclusive running
    maximum: within rows of 32 lanes by a shift and five doubling steps (gathers along a row, which
    stay inside a warp), then the greatest nonzero column of the earlier rows (a ``[R, R]``
    maximum). No histogram, no scan with an operator of its own."""
    R: tl.constexpr = BLOCK // 32
    c = tl.arange(0, 32)[None, :] + tl.zeros((R, 32), tl.int32)
    r = tl.arange(0, R)
    q = tl.reshape(tl.where(nz, tl.arange(0, BLOCK), -1), (R, 32))
    m = tl.where(c >= 1, tl.gather(q, tl.maximum(c - 1, 0), 1), -1)
    for k in tl.static_range(5):
        m = tl.where(c >= (1 << k), tl.maximum(m, tl.gather(m, tl.maximum(c - (1 << k), 0), 1)), m)
    rows = tl.max(q, axis=1)
    carry = tl.max(tl.where(r[None, :] < r[:, None], rows[None, :], -1), axis=1)
    return tl.reshape(tl.maximum(m, carry[:, None]), (BLOCK,))


@_jit
def _gaps(nz, col, pos, before, BLOCK: tl.constexpr):
    """Per nonzero lane, the distance to the nonzero before it (:func:`_prev_nonzero`); for the
    block's first, to position ``before`` (the last nonzero of earlier blocks, −1: none); 1
    elsewhere (int64)."""
    prev = _prev_nonzero(nz, BLOCK)
    return tl.where(nz, tl.where(prev < 0, pos - before, (col - prev).to(tl.int64)), 1)


# == kernels ======================================================================================
@_jit
def _elias_count_kernel(f_ptr, sl_ptr, dl_ptr, ol_ptr, stats_ptr, n, s, BLOCK: tl.constexpr,
                        SMALL: tl.constexpr):
    """Per block, six int64 at ``stats_ptr + 6·block``: dense bits, nonzeros, sparse bits without the
    first gap, first and last nonzero position (−1: none), fields above ``2s``."""
    blk = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    pos = blk * BLOCK + col
    ok = pos < n
    f = tl.load(f_ptr + pos, mask=ok, other=0).to(tl.int32)
    bad = ok & (f > 2 * s)
    fs = tl.where(ok & ~bad, f, s)                       # (a bad field makes the call fail: read as zero)
    nz = fs != s
    # a block's counts fit int32 (at most 1,024 items of at most 56 bits)
    prev = _prev_nonzero(nz, BLOCK)
    gap_len = _omega_len(tl.where(prev >= 0, col - prev, 1), ol_ptr, SMALL).to(tl.int32)   # (the first's: later)
    dense = tl.sum(tl.where(ok, tl.load(dl_ptr + fs), 0), axis=0)
    rest = tl.sum(tl.where(nz, tl.load(sl_ptr + fs) + tl.where(prev >= 0, gap_len, 0), 0), axis=0)
    first = tl.min(tl.where(nz, col, BLOCK), axis=0)
    last = tl.max(tl.where(nz, col, -1), axis=0)
    out = stats_ptr + 6 * blk
    tl.store(out, dense.to(tl.int64))
    tl.store(out + 1, tl.sum(nz.to(tl.int32), axis=0).to(tl.int64))
    tl.store(out + 2, rest.to(tl.int64))
    tl.store(out + 3, tl.where(first < BLOCK, blk * BLOCK + first, -1))
    tl.store(out + 4, tl.where(last >= 0, blk * BLOCK + last, -1))
    tl.store(out + 5, tl.sum(bad.to(tl.int32), axis=0).to(tl.int64))


@_jit
def _tile_of_blocks(stats_ptr, t0, nblk, TILE: tl.constexpr):
    """Blocks ``t0 … t0 + TILE − 1`` of the counts (:func:`_elias_count_kernel`): dense bits,
    nonzeros, sparse bits without the first gap, first and last nonzero, fields above ``2s``, and per
    block the last nonzero of the tile's earlier blocks (−1: none; a ``[TILE, TILE]`` maximum, not a
    scan)."""
    i = tl.arange(0, TILE)
    b = t0 + i
    ok = b < nblk
    row = stats_ptr + 6 * b.to(tl.int64)
    dense = tl.load(row, mask=ok, other=0)
    nnz = tl.load(row + 1, mask=ok, other=0)
    rest = tl.load(row + 2, mask=ok, other=0)
    first = tl.load(row + 3, mask=ok, other=-1)
    last = tl.load(row + 4, mask=ok, other=-1)
    bad = tl.load(row + 5, mask=ok, other=0)
    earlier = tl.max(tl.where(i[None, :] < i[:, None], last[None, :], -1), axis=1)
    return ok, dense, nnz, rest, first, last, bad, earlier


@_jit
def _sparse_bits(rest, nnz, first, before, ol_ptr, SMALL: tl.constexpr):
    """A block's sparse bits: ``rest`` plus its first gap's code, from the last nonzero ``before``."""
    has = nnz > 0
    return rest + tl.where(has, _omega_len(tl.where(has, first - before, 1), ol_ptr, SMALL), 0)


@_jit
def _elias_tiles_kernel(stats_ptr, ol_ptr, tiles_ptr, nblk, TILE: tl.constexpr, SMALL: tl.constexpr):
    """Per tile of TILE blocks, six int64 at ``tiles_ptr + 6·tile``: its dense bits, nonzeros, the
    sparse bits it knows alone (all but the first gap of its first block with nonzeros, which goes
    back to an earlier tile), fields above ``2s``, its last nonzero, and the first nonzero of that
    block (−1: the tile has none)."""
    t = tl.program_id(0).to(tl.int64)
    ok, dense, nnz, rest, first, last, bad, earlier = _tile_of_blocks(stats_ptr, t * TILE, nblk, TILE)
    opens = nnz > 0
    opens = opens & (earlier < 0)                       # at most one block: the tile's first with nonzeros
    known = tl.where(opens, rest, _sparse_bits(rest, nnz, first, earlier, ol_ptr, SMALL))
    out = tiles_ptr + 6 * t
    tl.store(out, tl.sum(dense, axis=0))
    tl.store(out + 1, tl.sum(nnz, axis=0))
    tl.store(out + 2, tl.sum(tl.where(ok, known, 0), axis=0))
    tl.store(out + 3, tl.sum(bad, axis=0))
    tl.store(out + 4, tl.max(last, axis=0))
    tl.store(out + 5, tl.max(tl.where(opens, first, -1), axis=0))


@_jit
def _elias_scan_kernel(tiles_ptr, ol_ptr, tpre_ptr, totals_ptr, ntiles, TILE: tl.constexpr, SMALL: tl.constexpr):
    """One program over the tiles (:func:`_elias_tiles_kernel`), TILE at a time: per tile, four int64
    at ``tpre_ptr + 4·tile`` (the sparse and dense bits and the nonzeros of the tiles before it, and
    the last nonzero before it, −1: none), and at ``totals_ptr`` the fields above ``2s``, the
    nonzeros and the sparse and dense bits of all of them."""
    i = tl.arange(0, TILE)
    last_before = tl.full((), -1, tl.int64)
    sparse_run = tl.full((), 0, tl.int64)
    dense_run = tl.full((), 0, tl.int64)
    nnz_run = tl.full((), 0, tl.int64)
    bad = tl.full((), 0, tl.int64)
    t = tl.full((), 0, tl.int64)
    while t < ntiles:    # (a while loop: the interpreter cannot take a range over a kernel argument)
        k = t + i
        ok = k < ntiles
        row = tiles_ptr + 6 * k
        dense = tl.load(row, mask=ok, other=0)
        nnz = tl.load(row + 1, mask=ok, other=0)
        known = tl.load(row + 2, mask=ok, other=0)
        bad += tl.sum(tl.load(row + 3, mask=ok, other=0), axis=0)
        last = tl.load(row + 4, mask=ok, other=-1)
        opener = tl.load(row + 5, mask=ok, other=-1)
        earlier = tl.max(tl.where(i[None, :] < i[:, None], last[None, :], -1), axis=1)
        before = tl.maximum(earlier, last_before)
        sparse = _sparse_bits(known, (opener >= 0).to(tl.int64), opener, before, ol_ptr, SMALL)
        out = tpre_ptr + 4 * k
        tl.store(out, sparse_run + tl.cumsum(sparse, 0) - sparse, mask=ok)
        tl.store(out + 1, dense_run + tl.cumsum(dense, 0) - dense, mask=ok)
        tl.store(out + 2, nnz_run + tl.cumsum(nnz, 0) - nnz, mask=ok)
        tl.store(out + 3, before, mask=ok)
        last_before = tl.maximum(last_before, tl.max(last, axis=0))
        sparse_run += tl.sum(sparse, axis=0)
        dense_run += tl.sum(dense, axis=0)
        nnz_run += tl.sum(nnz, axis=0)
        t += TILE
    tl.store(totals_ptr, bad)
    tl.store(totals_ptr + 1, nnz_run)
    tl.store(totals_ptr + 2, sparse_run)
    tl.store(totals_ptr + 3, dense_run)


@_jit
def _elias_blocks_kernel(stats_ptr, ol_ptr, tpre_ptr, pre_ptr, nblk, TILE: tl.constexpr, SMALL: tl.constexpr):
    """Per block, four int64 at ``pre_ptr + 4·block``: its first bit in a sparse and in a dense
    stream (not counting the flag and header), its nonzeros before it, and the last nonzero before
    it (−1: none), from its tile's row of ``tpre_ptr`` (:func:`_elias_scan_kernel`) and the tile's
    own blocks; one program a tile."""
    t = tl.program_id(0).to(tl.int64)
    ok, dense, nnz, rest, first, last, bad, earlier = _tile_of_blocks(stats_ptr, t * TILE, nblk, TILE)
    tp = tpre_ptr + 4 * t
    before = tl.maximum(earlier, tl.load(tp + 3))
    sparse = _sparse_bits(rest, nnz, first, before, ol_ptr, SMALL)
    out = pre_ptr + 4 * (t * TILE + tl.arange(0, TILE)).to(tl.int64)
    tl.store(out, tl.load(tp) + tl.cumsum(sparse, 0) - sparse, mask=ok)
    tl.store(out + 1, tl.load(tp + 1) + tl.cumsum(dense, 0) - dense, mask=ok)
    tl.store(out + 2, tl.load(tp + 2) + tl.cumsum(nnz, 0) - nnz, mask=ok)
    tl.store(out + 3, before, mask=ok)


@_jit
def _elias_write_kernel(f_ptr, sc_ptr, sl_ptr, dc_ptr, dl_ptr, oc_ptr, ol_ptr, pre_ptr, words_ptr, index_ptr, n, s,
                        base, h0, h1, SPARSE: tl.constexpr, BLOCK: tl.constexpr, SMALL: tl.constexpr,
                        PER_CHUNK: tl.constexpr):
    """The block's items into ``words_ptr`` (zeroed int32, byte-swapped), from bit ``base`` plus the
    block's own (``pre_ptr``, :func:`_elias_blocks_kernel`). Program 0 also adds the first two words
    of the flag and header (``h0``, ``h1``); a block that starts a chunk (``PER_CHUNK`` blocks a
    chunk) writes the chunk's row of the index."""
    blk = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    pos = blk * BLOCK + col
    ok = pos < n
    f = tl.load(f_ptr + pos, mask=ok, other=0).to(tl.int32)
    fs = tl.where(ok, f, s)
    pre = pre_ptr + 4 * blk
    if SPARSE:
        bit0 = base + tl.load(pre)
        before = tl.load(pre + 3)
        nz = fs != s
        gap = _gaps(nz, col, pos, before, BLOCK)
        glen = _omega_len(gap, ol_ptr, SMALL)
        mlen = tl.load(sl_ptr + fs)
        length = tl.where(nz, glen.to(tl.int32) + mlen, 0)
        code = (_omega_code(gap, oc_ptr, ol_ptr, SMALL) << mlen) | tl.load(sc_ptr + fs)
        _write_words(words_ptr, code, length, bit0 >> 5, (bit0 & 31).to(tl.int32), col, BLOCK, 3, False)   # ≤ 56 bits
        row = (bit0, tl.load(pre + 2), before + 1)
    else:
        bit0 = base + tl.load(pre + 1)
        length = tl.where(ok, tl.load(dl_ptr + fs), 0)
        _write_words(words_ptr, tl.load(dc_ptr + fs), length, bit0 >> 5, (bit0 & 31).to(tl.int32), col, BLOCK,
                     2, True)   # up to 15 bits, int32
        row = (bit0, blk * BLOCK, blk * BLOCK)
    if blk == 0:
        tl.atomic_add(words_ptr, h0)
        tl.atomic_add(words_ptr + 1, h1)
    elif blk % PER_CHUNK == 0:
        at = index_ptr + 3 * (blk // PER_CHUNK - 1)
        tl.store(at, row[0])
        tl.store(at + 1, row[1])
        tl.store(at + 2, row[2])


# == host =========================================================================================
def _header(nnz: int) -> tuple[int, int]:
    """Omega code and length of ``nnz + 1`` (the sparse stream's header), by the tensor builder's rule."""
    code, length = _omega_codes(torch.tensor([nnz + 1]), torch.from_numpy(_OMEGA_CODE), torch.from_numpy(_OMEGA_LEN))
    return int(code), int(length)


def _first_words(value: int, length: int) -> tuple[int, int]:
    """Words 0 and 1 (byte-swapped int32) of a stream that starts with ``length ≤ 63`` bits ``value``."""
    bits = value << (64 - length)
    w = [(bits >> 32) & 0xFFFFFFFF, bits & 0xFFFFFFFF]
    sw = [int.from_bytes(x.to_bytes(4, "big"), "little") for x in w]
    return tuple(x - (1 << 32) if x >= 1 << 31 else x for x in sw)


def encode_fields_stream(fields: torch.Tensor, s: int, layout: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(stream, chunk index)`` of the codes ``fields − s`` (uint8 fields, ``1 ≤ s ≤ 127``) on the
    fields' device, byte for byte :func:`gradq.codecs.qsgd_stream.encode_fields_stream` with
    ``index=True``."""
    check_stream_args(fields, s, layout)
    dev = fields.device
    f = fields.reshape(-1)
    n = f.numel()
    if n >= 1 << 31:
        raise ValueError(f"at most 2**31 - 1 values a stream, got {n}")
    sc, sl, dc, dl, oc, ol = _tables(s, str(dev))
    nblk = -(-n // BLOCK)
    stats = torch.empty((nblk, 6), dtype=torch.int64, device=dev)
    pre = torch.empty((nblk, 4), dtype=torch.int64, device=dev)
    totals = torch.zeros(4, dtype=torch.int64, device=dev)
    if nblk:
        _C._launch(_elias_count_kernel, (nblk,), f, sl, dl, ol, stats, n, s, BLOCK=BLOCK, SMALL=_SMALL,
                   num_warps=_C.TUNING["elias_warps"])
        # the blocks' prefix sums: per tile of _TILE blocks, its scan over the tiles, then per block
        ntiles = -(-nblk // _TILE)
        tiles = torch.empty((ntiles, 6), dtype=torch.int64, device=dev)
        tpre = torch.empty((ntiles, 4), dtype=torch.int64, device=dev)
        _C._launch(_elias_tiles_kernel, (ntiles,), stats, ol, tiles, nblk, TILE=_TILE, SMALL=_SMALL, num_warps=4)
        _C._launch(_elias_scan_kernel, (1,), tiles, ol, tpre, totals, ntiles, TILE=_TILE, SMALL=_SMALL,
                   num_warps=4)
        _C._launch(_elias_blocks_kernel, (ntiles,), stats, ol, tpre, pre, nblk, TILE=_TILE, SMALL=_SMALL,
                   num_warps=4)
    bad, nnz, sparse_sum, dense_sum = totals.tolist()   # the one host read
    if bad:
        raise ValueError(f"QSGD codes must lie in [-{s}, {s}], got {bad} fields above {2 * s}")
    hcode, hlen = _header(nnz)
    sparse_bits, dense_bits = 1 + hlen + sparse_sum, 1 + dense_sum
    sparse = layout == "sparse" or (layout == "auto" and sparse_bits <= dense_bits)
    nbits = sparse_bits if sparse else dense_bits
    words = torch.zeros((nbits + 31) // 32 + 3, dtype=torch.int32, device=dev)
    h0, h1 = _first_words(hcode, 1 + hlen) if sparse else _first_words(1, 1)
    index = torch.empty((max(0, -(-n // CHUNK) - 1), 3), dtype=torch.int64, device=dev)
    if nblk:
        _C._launch(_elias_write_kernel, (nblk,), f, sc, sl, dc, dl, oc, ol, pre, words, index, n, s,
                   1 + hlen if sparse else 1, h0, h1, SPARSE=sparse, BLOCK=BLOCK, SMALL=_SMALL,
                   PER_CHUNK=CHUNK // BLOCK, num_warps=_C.TUNING["elias_warps"])
    else:
        words[:2] = torch.tensor([h0, h1], dtype=torch.int32)
    return words.view(torch.uint8)[: (nbits + 7) // 8], index.reshape(-1)
