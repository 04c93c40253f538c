"""Numba helpers of the bit-field and trit packing that the CPU kernel modules share: groups of eight
``w``-bit fields to ``w`` bytes (``pext`` where the CPU has BMI2), odd widths, and five trits a byte,
in the layout of :mod:`gradq.codecs.bitpack`.

The kernel modules import them from here and numba inlines them; compiled code is cached in a
directory keyed by the sources of every kernel module (:mod:`gradq.kernels.numba_cache`), this one
included, so an edit here recompiles every kernel that inlines it.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .numba_common import _ir_target_features

_inline = njit(inline="always", cache=True, error_model="numpy")


# -- packing (all helpers take slices that start at element / byte 0: offset indexing would add a
# negative-index check per access and stop the loops from vectorizing) ----------------------------
@_inline
def _pack_groups(tmp, out, w):
    """Whole groups of 8 fields of ``w`` bits (a literal, so the inner loops unroll) -> ``w`` bytes."""
    for g in range(tmp.size // 8):
        word = 0
        for k in range(8):
            word |= np.int64(tmp[8 * g + k]) << (k * w)
        for b in range(w):
            out[g * w + b] = (word >> (8 * b)) & 0xFF


@_inline
def _unpack_groups(data, tmp, w):
    """Inverse of :func:`_pack_groups` for the whole groups of 8 fields in ``tmp``."""
    mask = (1 << w) - 1
    for g in range(tmp.size // 8):
        word = 0
        for b in range(w):
            word |= np.int64(data[g * w + b]) << (8 * b)
        for k in range(8):
            tmp[8 * g + k] = (word >> (k * w)) & mask


@intrinsic
def _pack_pext(typingctx, tmp, out, ngroups, w):
    """Whole groups of 8 fields of ``w`` bits (a literal: 3, 5, 6 or 7) -> ``w`` bytes each, by one
    BMI2 ``pext`` of the group's 8 bytes; returns the number of groups packed (0 without BMI2: the
    caller's loop does them). Each group but the last stores 4 or 8 bytes, the spare ones
    overwritten by the next group; the last stores its ``w`` bytes exactly."""
    if not isinstance(w, types.IntegerLiteral):
        return None
    wv = w.literal_value
    mask = int.from_bytes(bytes([(1 << wv) - 1] * 8), "little")
    sig = types.intp(tmp, out, ngroups, w)

    def codegen(context, builder, signature, args):
        i8, i64 = ir.IntType(8), ir.IntType(64)
        count = context.cast(builder, args[2], signature.args[2], types.intp)
        if "bmi2" not in _ir_target_features(context):
            return ir.Constant(count.type, 0)
        tptr = context.make_array(signature.args[0])(context, builder, args[0]).data
        optr = context.make_array(signature.args[1])(context, builder, args[1]).data
        pext = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64, i64]),
                                              "llvm.x86.bmi.pext.64")
        wide = ir.IntType(32 if wv == 3 else 64)

        def group(g):
            src = builder.gep(tptr, [builder.mul(g, ir.Constant(g.type, 8))])
            word = builder.load(builder.bitcast(src, i64.as_pointer()), align=1)
            return builder.call(pext, [word, ir.Constant(i64, mask)]), builder.gep(
                optr, [builder.mul(g, ir.Constant(g.type, wv))])

        last = builder.sub(count, ir.Constant(count.type, 1))
        with cgutils.for_range(builder, last) as loop:
            bits, dst = group(loop.index)
            builder.store(builder.trunc(bits, wide) if wv == 3 else bits, builder.bitcast(dst, wide.as_pointer()),
                          align=1)
        with builder.if_then(builder.icmp_signed(">", count, ir.Constant(count.type, 0))):
            bits, dst = group(last)
            for b in range(wv):
                byte = builder.trunc(builder.lshr(bits, ir.Constant(i64, 8 * b)), i8)
                builder.store(byte, builder.gep(dst, [ir.Constant(ir.IntType(32), b)]))
        return count

    return sig, codegen


@_inline
def _pack_odd(tmp, out, w):
    """Whole groups of 8 fields of ``w`` bits (a literal): by ``pext`` where the CPU has it, else by
    shifts."""
    ng = tmp.size // 8
    if _pack_pext(tmp, out, ng, w) < ng:
        _pack_groups(tmp, out, w)


@_inline
def _pack(tmp, width, out):
    """Pack ``tmp`` (values < 2**width) into ``out`` as little-endian ``width``-bit fields."""
    m = tmp.size
    if width == 8:
        for i in range(m):
            out[i] = tmp[i]
        return
    if width == 4:
        for j in range(m // 2):
            out[j] = tmp[2 * j] | (tmp[2 * j + 1] << 4)
    elif width == 2:
        for j in range(m // 4):
            out[j] = tmp[4 * j] | (tmp[4 * j + 1] << 2) | (tmp[4 * j + 2] << 4) | (tmp[4 * j + 3] << 6)
    elif width == 1:
        for j in range(m // 8):
            k = 8 * j
            out[j] = (tmp[k] | (tmp[k + 1] << 1) | (tmp[k + 2] << 2) | (tmp[k + 3] << 3)
                      | (tmp[k + 4] << 4) | (tmp[k + 5] << 5) | (tmp[k + 6] << 6) | (tmp[k + 7] << 7))
    elif width == 3:
        _pack_odd(tmp, out, 3)
    elif width == 5:
        _pack_odd(tmp, out, 5)
    elif width == 6:
        _pack_odd(tmp, out, 6)
    else:
        _pack_odd(tmp, out, 7)
    # the last partial group of 8 fields (only in the last chunk): bit by bit, zero padded
    start = (m // 8) * 8
    if width in (4, 2):
        start = (m // (8 // width)) * (8 // width)
    if start < m:
        acc = 0
        for k in range(start, m):
            acc |= np.int64(tmp[k]) << ((k - start) * width)
        byte0 = (start * width) // 8
        for b in range(((m - start) * width + 7) // 8):
            out[byte0 + b] = (acc >> (8 * b)) & 0xFF


@_inline
def _unpack(data, width, tmp):
    """Inverse of :func:`_pack`: ``tmp.size`` fields from ``data`` into ``tmp``."""
    m = tmp.size
    if width == 8:
        for i in range(m):
            tmp[i] = data[i]
        return
    if width == 4 or width == 2 or width == 1:
        # a byte at a time, its fields written by constant shifts: this loop vectorizes, where one
        # indexed by field (a variable shift per field) ran 5–17× slower
        per = 8 // width
        full = m // per
        if width == 4:
            for j in range(full):
                d = data[j]
                tmp[2 * j] = d & 15
                tmp[2 * j + 1] = d >> 4
        elif width == 2:
            for j in range(full):
                d = data[j]
                tmp[4 * j] = d & 3
                tmp[4 * j + 1] = (d >> 2) & 3
                tmp[4 * j + 2] = (d >> 4) & 3
                tmp[4 * j + 3] = d >> 6
        else:
            for j in range(full):
                d = data[j]
                tmp[8 * j] = d & 1
                tmp[8 * j + 1] = (d >> 1) & 1
                tmp[8 * j + 2] = (d >> 2) & 1
                tmp[8 * j + 3] = (d >> 3) & 1
                tmp[8 * j + 4] = (d >> 4) & 1
                tmp[8 * j + 5] = (d >> 5) & 1
                tmp[8 * j + 6] = (d >> 6) & 1
                tmp[8 * j + 7] = d >> 7
        for i in range(full * per, m):
            tmp[i] = (data[full] >> ((i - full * per) * width)) & ((1 << width) - 1)
        return
    if width == 3:
        _unpack_groups(data, tmp, 3)
    elif width == 5:
        _unpack_groups(data, tmp, 5)
    elif width == 6:
        _unpack_groups(data, tmp, 6)
    else:
        _unpack_groups(data, tmp, 7)
    mask = (1 << width) - 1
    for i in range((m // 8) * 8, m):
        bit = i * width
        word = np.int64(data[bit >> 3])
        if (bit & 7) + width > 8:
            word |= np.int64(data[(bit >> 3) + 1]) << 8
        tmp[i] = (word >> (bit & 7)) & mask


@_inline
def _pack_trits(tmp, out):
    """Values in {0, 1, 2} five per byte, base 3, first value least significant."""
    m = tmp.size
    full = m // 5
    for j in range(full):
        k = 5 * j
        out[j] = tmp[k] + 3 * tmp[k + 1] + 9 * tmp[k + 2] + 27 * tmp[k + 3] + 81 * tmp[k + 4]
    if full * 5 < m:
        acc = 0
        pw = 1
        for k in range(full * 5, m):
            acc += np.int64(tmp[k]) * pw
            pw *= 3
        out[full] = acc


#: the five base-3 digits of every byte, least significant first: ``(b // 3**k) % 3`` (bytes above
#: 242 are not trits; they decode to these digits and are counted as bad). A constant of the kernels.
_TRITS = np.array([[(b // 3 ** k) % 3 for k in range(5)] for b in range(256)], dtype=np.uint8)


@_inline
def _unpack_trits(data, tmp):
    """Trits of ``data`` into ``tmp``; returns the number of bytes above 242 (3**5 − 1). A byte's
    digits come from a 1.25 KiB table (five loads) instead of four divisions by 3 and five
    remainders: about twice as fast."""
    m = tmp.size
    bad = 0
    full = m // 5
    for j in range(full):
        b = np.int32(data[j])
        bad += b > 242
        tmp[5 * j] = _TRITS[b, 0]
        tmp[5 * j + 1] = _TRITS[b, 1]
        tmp[5 * j + 2] = _TRITS[b, 2]
        tmp[5 * j + 3] = _TRITS[b, 3]
        tmp[5 * j + 4] = _TRITS[b, 4]
    if full * 5 < m:
        b = np.int32(data[full])
        bad += b > 242
        for k in range(full * 5, m):
            tmp[k] = b % 3
            b //= 3
    return bad
