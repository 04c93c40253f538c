"""Triton kernels of the uniform codes' decode (QSGD, MaxNorm, TernGrad, the RandK variants' fixed-width
parts): unpack and dequantize straight into ``out=``, and ``decode_mean`` of M payloads in one pass
(the scatter protocol's reducer).

Part of the Triton backend (:mod:`gradq.kernels.triton_ops`, which exports these functions); every
function has the signature and the result of its namesake in :mod:`gradq.kernels.reference`. A
thread takes whole groups of eight fields (or four bytes of five trits); the M payloads' values are
added in order and divided by M (a product with ``1/M`` where M is a power of two, which rounds the
same real number). Where a field can be invalid (2-bit TernGrad codes, trits, a ``max_field``) each
program counts the invalid ones and the host reads their sum: a corrupt payload is refused.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._args import _bucket, _levels_s, _nbuckets, _width
from .checks import refuse_invalid
from .triton_common import (_bucket_of, _bucket_split, _constant, _grid, _groups, _jit, _join4, _launch,
                           _one_bucket, _out, _payload, _span, _split4, _store8, _unpack8, _vector, tl)


@_jit
def _scale_mult(scales_ptr, first, o, rem, nb, bucket, sf, ma, mb, edge, BIG: tl.constexpr):
    """``scale/s`` of the bucket of each value ``first + o``: with BIG 2 (the program inside one
    bucket) ``ma``; with BIG 1, ``ma`` before offset ``edge`` and ``mb`` from it
    (:func:`_bucket_split`); else a load and a division a value."""
    if BIG == 2:
        return ma
    elif BIG:
        return tl.where(o < edge, ma, mb)
    else:
        sc = tl.load(scales_ptr + _bucket_of(first, o, bucket), mask=o < rem, other=0.0)
        return tl.math.div_rn(sc, tl.full(sc.shape, 1.0, tl.float32) * sf)


@_jit
def _over(a, M: tl.constexpr):
    """``a / M`` in float32, correctly rounded: for ``M`` a power of two the product with ``1/M``,
    which is exact in float32, so both round the same real number (subnormals too: the product is
    ``mul.rn``, no flush); else an IEEE division."""
    if M & (M - 1) == 0:
        return a * (1.0 / M)
    else:
        return tl.math.div_rn(a, tl.full(a.shape, M, tl.float32))


@_jit
def _trits5(t):
    """The five base-3 digits of bytes ``t`` (int32, 0 to 255), lowest first, as int32 (a byte above
    242 has a fifth digit of 3). The divisions are unsigned: the bytes are never negative."""
    u = t.to(tl.uint32)
    q1 = u // 3
    q2 = q1 // 3
    q3 = q2 // 3
    q4 = q3 // 3
    return ((u - 3 * q1).to(tl.int32), (q1 - 3 * q2).to(tl.int32), (q2 - 3 * q3).to(tl.int32),
            (q3 - 3 * q4).to(tl.int32), q4.to(tl.int32))


@_jit
def _trit_values(t, s, sj, first, o, rem, nb, bucket, sf, ma, mb, edge, BIG: tl.constexpr):
    """The five values ``float32(digit − s)·(scale/s)`` of trit bytes ``t`` whose first value is at
    offset ``o`` (:func:`_scale_mult` gives the multipliers)."""
    t0, t1, t2, t3, t4 = _trits5(t)
    d0 = (t0 - s).to(tl.float32) * _scale_mult(sj, first, o, rem, nb, bucket, sf, ma, mb, edge, BIG)
    d1 = (t1 - s).to(tl.float32) * _scale_mult(sj, first, o + 1, rem, nb, bucket, sf, ma, mb, edge, BIG)
    d2 = (t2 - s).to(tl.float32) * _scale_mult(sj, first, o + 2, rem, nb, bucket, sf, ma, mb, edge, BIG)
    d3 = (t3 - s).to(tl.float32) * _scale_mult(sj, first, o + 3, rem, nb, bucket, sf, ma, mb, edge, BIG)
    d4 = (t4 - s).to(tl.float32) * _scale_mult(sj, first, o + 4, rem, nb, bucket, sf, ma, mb, edge, BIG)
    return d0, d1, d2, d3, d4


@_jit
def _two_mults(sj, b0, nb, sf, BIG: tl.constexpr):
    """``scale/s`` of buckets ``b0`` and ``b0 + 1`` (with BIG 2 only ``b0``'s is needed: both are it)."""
    ma = tl.math.div_rn(tl.load(sj + b0), sf)
    if BIG == 2:
        return ma, ma
    else:
        return ma, tl.math.div_rn(tl.load(sj + b0 + 1, mask=b0 + 1 < nb, other=0.0), sf)


@_jit
def _trit_add(j: tl.constexpr, acc0, acc1, acc2, acc3, acc4, t, s, sj, first, o, rem, nb, bucket, sf, b0, edge,
              BIG: tl.constexpr):
    """Payload ``j``'s values (:func:`_trit_values`; its scales ``sj``) added to the five sums, the
    first payload's taking their place."""
    ma, mb = _two_mults(sj, b0, nb, sf, BIG)
    d0, d1, d2, d3, d4 = _trit_values(t, s, sj, first, o, rem, nb, bucket, sf, ma, mb, edge, BIG)
    if j == 0:
        return d0, d1, d2, d3, d4
    else:
        return acc0 + d0, acc1 + d1, acc2 + d2, acc3 + d3, acc4 + d4


@_jit
def _over5(acc0, acc1, acc2, acc3, acc4, M: tl.constexpr):
    """The five sums over M payloads divided by M (:func:`_over`)."""
    if M > 1:
        return _over(acc0, M), _over(acc1, M), _over(acc2, M), _over(acc3, M), _over(acc4, M)
    else:
        return acc0, acc1, acc2, acc3, acc4


@_jit
def _trits_decode_wide(base_ptr, offs_ptr, scales_ptr, out_ptr, first, nb, bucket, s, sf, b0, edge,
                       M: tl.constexpr, G: tl.constexpr, BIG: tl.constexpr):
    """A whole program of the trit decode, every payload 4-byte aligned: four bytes (twenty values)
    a thread, read as one 32-bit word a payload and written as five 16-byte stores, the values
    regrouped in registers (:func:`_split4`, :func:`_join4`). The same values, added in the same
    order, as the byte-wise path of the other programs. Returns the number of bytes above 242."""
    Q: tl.constexpr = G // 4
    q = tl.arange(0, Q)
    o = q[:, None] * 20 + tl.arange(0, 4)[None, :] * 5   # [Q, 4]: the first value of each byte
    nbad = tl.zeros((Q,), tl.int32)
    acc0 = tl.zeros((Q, 4), tl.float32)
    acc1 = tl.zeros((Q, 4), tl.float32)
    acc2 = tl.zeros((Q, 4), tl.float32)
    acc3 = tl.zeros((Q, 4), tl.float32)
    acc4 = tl.zeros((Q, 4), tl.float32)
    for j in tl.static_range(M):
        words = (base_ptr + tl.load(offs_ptr + j) + first // 5).to(tl.pointer_type(tl.uint32))
        w = tl.load(words + q)
        nbad += (((w & 0xFF) > 242).to(tl.int32) + (((w >> 8) & 0xFF) > 242).to(tl.int32)
                 + (((w >> 16) & 0xFF) > 242).to(tl.int32) + ((w >> 24) > 242).to(tl.int32))
        t = _join4(w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF, w >> 24).to(tl.int32)   # (in registers)
        acc0, acc1, acc2, acc3, acc4 = _trit_add(j, acc0, acc1, acc2, acc3, acc4, t, s, scales_ptr + j * nb, first,
                                                 o, 5 * G, nb, bucket, sf, b0, edge, BIG)
    acc0, acc1, acc2, acc3, acc4 = _over5(acc0, acc1, acc2, acc3, acc4, M)
    # value 5·i + j of a thread's twenty is column i of acc_j
    a00, a01, a02, a03 = _split4(acc0)
    a10, a11, a12, a13 = _split4(acc1)
    a20, a21, a22, a23 = _split4(acc2)
    a30, a31, a32, a33 = _split4(acc3)
    a40, a41, a42, a43 = _split4(acc4)
    p = out_ptr + first + q[:, None] * 20 + tl.arange(0, 4)[None, :]
    tl.store(p, _join4(a00, a10, a20, a30))
    tl.store(p + 4, _join4(a40, a01, a11, a21))
    tl.store(p + 8, _join4(a31, a41, a02, a12))
    tl.store(p + 12, _join4(a22, a32, a42, a03))
    tl.store(p + 16, _join4(a13, a23, a33, a43))
    return tl.sum(nbad, axis=0)


@_jit
def _uniform_decode_body(base_ptr, offs_ptr, scales_ptr, out_ptr, bad_ptr, first, rem, nbytes, nb, bucket, s,
                         max_field, M: tl.constexpr, W: tl.constexpr, TRITS: tl.constexpr, G: tl.constexpr,
                         CHECK: tl.constexpr, BIG: tl.constexpr, WIDE: tl.constexpr, FULL: tl.constexpr):
    """One program of :func:`_uniform_decode_kernel`."""
    g = tl.arange(0, G)
    sf = s.to(tl.float32)
    PER: tl.constexpr = 5 * G if TRITS else 8 * G
    b0, edge = _bucket_split(first, bucket, PER)
    nbad = tl.zeros((G,), tl.int32)
    if TRITS and FULL and WIDE and G >= 4:
        total = _trits_decode_wide(base_ptr, offs_ptr, scales_ptr, out_ptr, first, nb, bucket, s, sf, b0, edge,
                                   M, G, BIG)
    elif TRITS:
        base = g * 5
        acc0 = tl.zeros((G,), tl.float32)
        acc1 = tl.zeros((G,), tl.float32)
        acc2 = tl.zeros((G,), tl.float32)
        acc3 = tl.zeros((G,), tl.float32)
        acc4 = tl.zeros((G,), tl.float32)
        for j in tl.static_range(M):
            data = base_ptr + tl.load(offs_ptr + j)
            byte = tl.load(data + first // 5 + g, mask=first // 5 + g < nbytes, other=0).to(tl.int32)
            nbad += (byte > 242).to(tl.int32)
            acc0, acc1, acc2, acc3, acc4 = _trit_add(j, acc0, acc1, acc2, acc3, acc4, byte, s, scales_ptr + j * nb,
                                                     first, base, rem, nb, bucket, sf, b0, edge, BIG)
        acc0, acc1, acc2, acc3, acc4 = _over5(acc0, acc1, acc2, acc3, acc4, M)
        tl.store(out_ptr + first + base, acc0, mask=base < rem)
        tl.store(out_ptr + first + base + 1, acc1, mask=base + 1 < rem)
        tl.store(out_ptr + first + base + 2, acc2, mask=base + 2 < rem)
        tl.store(out_ptr + first + base + 3, acc3, mask=base + 3 < rem)
        tl.store(out_ptr + first + base + 4, acc4, mask=base + 4 < rem)
        total = tl.sum(nbad, axis=0)
    else:
        base = g * 8
        bfirst = first // 8 * W
        a0 = tl.zeros((G,), tl.float32)
        a1 = tl.zeros((G,), tl.float32)
        a2 = tl.zeros((G,), tl.float32)
        a3 = tl.zeros((G,), tl.float32)
        a4 = tl.zeros((G,), tl.float32)
        a5 = tl.zeros((G,), tl.float32)
        a6 = tl.zeros((G,), tl.float32)
        a7 = tl.zeros((G,), tl.float32)
        for j in tl.static_range(M):
            data = base_ptr + tl.load(offs_ptr + j) + bfirst
            f0, f1, f2, f3, f4, f5, f6, f7 = _unpack8(data, g, nbytes - bfirst, W, WIDE and FULL)
            if CHECK:
                if FULL:
                    nbad += ((f0 > max_field).to(tl.int32) + (f1 > max_field).to(tl.int32)
                             + (f2 > max_field).to(tl.int32) + (f3 > max_field).to(tl.int32)
                             + (f4 > max_field).to(tl.int32) + (f5 > max_field).to(tl.int32)
                             + (f6 > max_field).to(tl.int32) + (f7 > max_field).to(tl.int32))
                else:
                    nbad += (((f0 > max_field) & (base < rem)).to(tl.int32)
                             + ((f1 > max_field) & (base + 1 < rem)).to(tl.int32)
                             + ((f2 > max_field) & (base + 2 < rem)).to(tl.int32)
                             + ((f3 > max_field) & (base + 3 < rem)).to(tl.int32)
                             + ((f4 > max_field) & (base + 4 < rem)).to(tl.int32)
                             + ((f5 > max_field) & (base + 5 < rem)).to(tl.int32)
                             + ((f6 > max_field) & (base + 6 < rem)).to(tl.int32)
                             + ((f7 > max_field) & (base + 7 < rem)).to(tl.int32))
            sj = scales_ptr + j * nb
            ma, mb = _two_mults(sj, b0, nb, sf, BIG)
            d0 = (f0 - s).to(tl.float32) * _scale_mult(sj, first, base, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d1 = (f1 - s).to(tl.float32) * _scale_mult(sj, first, base + 1, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d2 = (f2 - s).to(tl.float32) * _scale_mult(sj, first, base + 2, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d3 = (f3 - s).to(tl.float32) * _scale_mult(sj, first, base + 3, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d4 = (f4 - s).to(tl.float32) * _scale_mult(sj, first, base + 4, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d5 = (f5 - s).to(tl.float32) * _scale_mult(sj, first, base + 5, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d6 = (f6 - s).to(tl.float32) * _scale_mult(sj, first, base + 6, rem, nb, bucket, sf, ma, mb, edge, BIG)
            d7 = (f7 - s).to(tl.float32) * _scale_mult(sj, first, base + 7, rem, nb, bucket, sf, ma, mb, edge, BIG)
            if j == 0:
                a0, a1, a2, a3, a4, a5, a6, a7 = d0, d1, d2, d3, d4, d5, d6, d7
            else:
                a0, a1, a2, a3 = a0 + d0, a1 + d1, a2 + d2, a3 + d3
                a4, a5, a6, a7 = a4 + d4, a5 + d5, a6 + d6, a7 + d7
        if M > 1:
            a0, a1, a2, a3 = _over(a0, M), _over(a1, M), _over(a2, M), _over(a3, M)
            a4, a5, a6, a7 = _over(a4, M), _over(a5, M), _over(a6, M), _over(a7, M)
        _store8(out_ptr + first, base, rem, a0, a1, a2, a3, a4, a5, a6, a7, FULL)
        total = tl.sum(nbad, axis=0)
    if CHECK:
        tl.store(bad_ptr + tl.program_id(0), total)


@_jit
def _uniform_decode_kernel(base_ptr, offs_ptr, scales_ptr, out_ptr, bad_ptr, n, nbytes, nb, bucket, s,
                           max_field, M: tl.constexpr, W: tl.constexpr, TRITS: tl.constexpr, G: tl.constexpr,
                           CHECK: tl.constexpr, BIG: tl.constexpr, WIDE: tl.constexpr):
    """``out = (((d_0 + d_1) + …) / M``, ``d_j = float32(field − s)·(scale_jb / s)``, and, with
    CHECK, the number of fields above ``max_field`` (trits: bytes above 242) in ``bad_ptr[program]``.
    A group of eight fields a thread (trits: four bytes a thread in whole programs whose payloads
    are 4-byte aligned, else a byte at a time); BIG, a whole program inside one bucket and whole
    programs as in :func:`_uniform_encode_kernel`. WIDE: every payload's bytes are 4-byte aligned."""
    PER: tl.constexpr = 5 * G if TRITS else 8 * G
    first, rem = _span(n, PER)
    if rem == PER:
        if _one_bucket(first, bucket, PER, BIG):
            _uniform_decode_body(base_ptr, offs_ptr, scales_ptr, out_ptr, bad_ptr, first, rem, nbytes, nb, bucket,
                                 s, max_field, M, W, TRITS, G, CHECK, 2, WIDE, True)
        else:
            _uniform_decode_body(base_ptr, offs_ptr, scales_ptr, out_ptr, bad_ptr, first, rem, nbytes, nb, bucket,
                                 s, max_field, M, W, TRITS, G, CHECK, BIG, WIDE, True)
    else:
        _uniform_decode_body(base_ptr, offs_ptr, scales_ptr, out_ptr, bad_ptr, first, rem, nbytes, nb, bucket, s,
                             max_field, M, W, TRITS, G, CHECK, BIG, WIDE, False)


# == the kernel API ===============================================================================
def _rows(packed: Sequence[torch.Tensor], nbytes: int, what: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A uint8 base tensor, the int64 offset of each payload's bytes from it (one payload itself,
    the storage several share (a received buffer: no copy), or else their concatenation), and
    whether every payload starts at a multiple of 4 bytes (the kernels' word loads)."""
    datas = [_payload(t, nbytes, what) for t in packed]
    if len(datas) == 1:
        return datas[0], _constant(datas[0].device, torch.int64), datas[0].data_ptr() % 4 == 0
    st = packed[0].untyped_storage()
    dev = packed[0].device
    if all(t.untyped_storage().data_ptr() == st.data_ptr() and t.is_contiguous() for t in packed):
        base = torch.empty(0, dtype=torch.uint8, device=dev).set_(st)
        offs = [t.storage_offset() for t in packed]
        aligned = all((base.data_ptr() + o) % 4 == 0 for o in offs)
        step = offs[1] - offs[0]
        if step and offs == list(range(offs[0], offs[0] + step * len(offs), step)):
            # payloads at a fixed stride (a received buffer): offsets made on the device, with no
            # host-to-device copy (one from pageable memory can wait for the stream)
            return (base, torch.arange(offs[0], offs[0] + step * len(offs), step, dtype=torch.int64, device=dev),
                    aligned)
        return base, torch.tensor(offs, dtype=torch.int64, device=dev), aligned
    base = torch.cat(datas)
    return (base, torch.arange(len(packed), dtype=torch.int64, device=dev) * nbytes,
            base.data_ptr() % 4 == 0 and nbytes % 4 == 0)


def _decode_mean(packed, scales, s, bucket, width, n, out, max_field):
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not packed:
        raise ValueError("need at least one payload")
    if len(scales) != len(packed):
        raise ValueError(f"{len(packed)} packed payloads but {len(scales)} scale vectors")
    trits = width == 0
    nbytes = (n + 4) // 5 if trits else (n * width + 7) // 8
    base, offs, aligned = _rows(packed, nbytes, "trits" if trits else f"{width}-bit codes")
    d = _bucket(n, bucket)
    nb = _nbuckets(n, d)
    dev = base.device
    vecs = [_vector(sc, nb, f"scales[{k}]", torch.float32, dev) for k, sc in enumerate(scales)]
    sv = vecs[0] if len(vecs) == 1 else torch.stack(vecs)
    res = _out(out, n, torch.float32, dev)
    if n:
        per, g = (5, _groups("trit_decode_bytes")) if trits else (8, _groups())
        grid = _grid(-(-n // per), g)
        check = trits or max_field is not None   # only where a code can be invalid
        # (every program writes its count: nothing to zero first)
        bad = torch.empty(grid[0], dtype=torch.int32, device=dev) if check else _constant(dev, torch.int32)
        _launch(_uniform_decode_kernel, grid, base, offs, sv, res, bad, n, nbytes, nb, d, s,
                255 if max_field is None else max_field, M=len(packed), W=max(width, 1), TRITS=trits, G=g,
                CHECK=check, BIG=d >= per * g, WIDE=aligned)
        if check:  # (a host read, unless deferred: gradq.kernels.checks)
            what = "bytes above 242 (3**5 - 1)" if trits else f"fields above {max_field}"
            refuse_invalid(bad, lambda k: f"corrupt codes: {k} {what}", f"codes: {what}")
    return res


def uniform_decode(packed: torch.Tensor, scales: torch.Tensor, s: int, bucket: Optional[int], width: int,
                   n: int, max_field: Optional[int] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.uniform_decode`."""
    return _decode_mean([packed], [scales], _levels_s(s, None), bucket, _width(width), n, out, max_field)


def uniform_decode_trits(packed: torch.Tensor, scales: torch.Tensor, bucket: Optional[int], n: int,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.uniform_decode_trits`."""
    return _decode_mean([packed], [scales], 1, bucket, 0, n, out, None)


def uniform_decode_mean(packed: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], s: int,
                        bucket: Optional[int], width: int, n: int, max_field: Optional[int] = None,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.uniform_decode_mean`, in one pass over the M payloads."""
    return _decode_mean(packed, scales, _levels_s(s, None), bucket, _width(width), n, out, max_field)


def uniform_decode_trits_mean(packed: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                              bucket: Optional[int], n: int,
                              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As :func:`gradq.kernels.reference.uniform_decode_trits_mean`."""
    return _decode_mean(packed, scales, 1, bucket, 0, n, out, None)
