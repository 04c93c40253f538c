"""Elias streams of QSGD fields built with tensor operations, on the fields' own device.

The Triton backend (CUDA tensors) has a builder of its own that reads the fields twice and allocates
nothing of the input's size (:mod:`gradq.kernels.triton_elias`); this one serves the devices
without it (``GRADQ_KERNELS=torch``) and is the tensor-level statement of the parallel layout.

The bytes are :func:`gradq.codecs.qsgd_stream.encode_fields_stream`'s. The stream is assembled in
parallel instead of by a bit-serial writer:

1. every value's code is taken from a table and its length known: the dense layout's
   ``omega(|c| + 1) + sign``, or, for the sparse layout, the gap's omega code and ``sign +
   omega(|c|)`` for each nonzero (a gap past the 4,096-entry table is coded from its bit length);
2. a prefix sum of the lengths gives each code's bit offset;
3. each code is cut into the three 32-bit words it can touch and added into them with
   ``scatter_add_``. Codes never overlap, so the sums are ORs and the order of the adds does not
   matter;
4. the words are written out big-endian.

Only the stream's length is read on the host, to size the output (and, for the sparse layout, the
number of nonzeros). So an encode on a GPU no longer copies the codes to the CPU. The chunk index
(:mod:`gradq.codecs.qsgd_chunks`) is read off the same prefix sums at the chunk starts. Decoding stays
:func:`gradq.codecs.qsgd_stream.decode_fields_stream` on the CPU (chunk-parallel with the index).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .elias import _OMEGA_CODE, _OMEGA_LEN, _SMALL
from .qsgd_fields import _CHUNK as CHUNK

__all__ = ["encode_fields_stream_torch", "check_stream_args"]

_M32 = 0xFFFFFFFF


@lru_cache(maxsize=None)
def _tables(s: int, device: str) -> tuple[torch.Tensor, ...]:
    from .qsgd_fields import field_tables

    sc, sl, dc, dl = field_tables(s)
    dev = torch.device(device)
    return (torch.from_numpy(sc).to(dev), torch.from_numpy(sl).to(dev), torch.from_numpy(dc).to(dev),
            torch.from_numpy(dl).to(dev), torch.from_numpy(_OMEGA_CODE).to(dev), torch.from_numpy(_OMEGA_LEN).to(dev))


def _omega_codes(k: torch.Tensor, oc: torch.Tensor, ol: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Omega codes and lengths of ``1 ≤ k < 2**31`` (int64): the table below 4,096, else
    ``omega(b − 1)`` without its final 0, then the ``b`` bits of ``k``, then 0 (``b`` = bit length)."""
    small = k < _SMALL
    ks = torch.where(small, k, torch.zeros_like(k))
    code, length = oc[ks], ol[ks]
    if bool((~small).any()):
        powers = torch.tensor([1 << i for i in range(63)], dtype=torch.int64, device=k.device)
        b = torch.searchsorted(powers, k, right=True)   # the bit length: the powers of 2 not above k
        head, hlen = oc[(b - 1).clamp(0, _SMALL - 1)] >> 1, ol[(b - 1).clamp(0, _SMALL - 1)] - 1
        big_code = (head << (b + 1)) | (k << 1)
        code = torch.where(small, code, big_code)
        length = torch.where(small, length, hlen + b + 1)
    return code, length


def _place(words: torch.Tensor, value: torch.Tensor, length: torch.Tensor, offset: torch.Tensor) -> None:
    """Add each code (``length ≤ 63`` bits, MSB first at bit ``offset`` of the stream) into the three
    32-bit words it can touch."""
    w0 = offset >> 5
    total = (offset & 31) + length          # the code ends this many bits into word w0 (≤ 94)
    for j in range(3):
        d = total - 32 - 32 * j             # shift right by d (d ≥ 0) or left by −d
        right = (value >> d.clamp(0, 63)) & _M32
        left_sh = (-d).clamp(0, 63)
        left = (value & (_M32 >> left_sh)) << left_sh
        part = torch.where(d >= 0, right, torch.where(-d >= 32, torch.zeros_like(value), left))
        words.scatter_add_(0, w0 + j, part)


def check_stream_args(fields: torch.Tensor, s: int, layout: str) -> None:
    """The arguments of a parallel stream builder: a uint8 tensor of fields, ``1 ≤ s ≤ 127`` and a
    layout of ``auto``, ``sparse`` or ``dense``; raises ``ValueError``/``TypeError`` naming the bad one."""
    if layout not in ("auto", "sparse", "dense"):
        raise ValueError(f"layout={layout!r} is not valid; expected one of auto, sparse, dense")
    if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= 127:
        raise ValueError(f"s must be an integer in [1, 127] for uint8 fields, got {s!r}")
    if not isinstance(fields, torch.Tensor) or fields.dtype != torch.uint8:
        raise TypeError("fields must be a uint8 tensor")


def encode_fields_stream_torch(fields: torch.Tensor, s: int, layout: str = "auto", *, index: bool = False):
    """The Elias stream of the codes ``fields − s`` (uint8 fields, ``1 ≤ s ≤ 127``) as a uint8 tensor
    on the fields' device, byte for byte :func:`gradq.codecs.qsgd_stream.encode_fields_stream`; with
    ``index=True``, ``(stream, chunk index)`` (:mod:`gradq.codecs.qsgd_chunks`), also on the device."""
    check_stream_args(fields, s, layout)
    dev = fields.device
    sc, sl, dc, dl, oc, ol = _tables(s, str(dev))
    f = fields.reshape(-1).to(torch.int64)
    n = f.numel()
    bad = int((f > 2 * s).sum()) if n else 0
    if bad:
        raise ValueError(f"QSGD codes must lie in [-{s}, {s}], got {bad} fields above {2 * s}")
    pos = torch.nonzero(f != s).reshape(-1)
    nnz = pos.numel()
    gcode, glen = _omega_codes(torch.diff(pos, prepend=pos.new_tensor([-1])), oc, ol) if nnz else (pos, pos)
    header = int(_OMEGA_CODE[nnz + 1]) if nnz + 1 < _SMALL else None
    if header is None:  # (nnz + 1 ≥ 4096: its code from the tensor helper)
        hc, hl = _omega_codes(torch.tensor([nnz + 1], dtype=torch.int64), oc.cpu(), ol.cpu())
        header, hlen = int(hc), int(hl)
    else:
        hlen = int(_OMEGA_LEN[nnz + 1])
    fnz = f[pos]
    sparse_bits = 1 + hlen + int(glen.sum()) + int(sl[fnz].sum()) if nnz else 1 + hlen
    dense_bits = 1 + int(dl[f].sum())
    sparse = layout == "sparse" or (layout == "auto" and sparse_bits - 1 <= dense_bits - 1)
    nbits = sparse_bits if sparse else dense_bits
    nbytes = (nbits + 7) // 8
    words = torch.zeros((nbits + 31) // 32 + 3, dtype=torch.int64, device=dev)
    bounds = torch.arange(1, max(1, -(-n // CHUNK)), dtype=torch.int64, device=dev) * CHUNK   # chunks after the first
    idx = torch.empty((bounds.numel(), 3), dtype=torch.int64, device=dev)
    if sparse:
        # the flag bit 0 and the header, then per nonzero: the gap, then sign + magnitude
        _place(words, torch.tensor([header], dtype=torch.int64, device=dev), torch.tensor([hlen], device=dev),
               torch.tensor([1], device=dev))
        if nnz:
            lengths = torch.stack([glen, sl[fnz]], dim=1).reshape(-1)
            values = torch.stack([gcode, sc[fnz]], dim=1).reshape(-1)
            offsets = 1 + hlen + torch.cumsum(lengths, 0) - lengths
            _place(words, values, lengths, offsets)
        if bounds.numel():
            j = torch.searchsorted(pos, bounds)          # each chunk's first nonzero (nnz: none left)
            end = torch.tensor([nbits], dtype=torch.int64, device=dev)
            item_at = torch.cat([offsets[0::2], end]) if nnz else end
            idx[:, 0] = item_at[j]
            idx[:, 1] = j
            idx[:, 2] = torch.where(j > 0, torch.cat([pos.new_tensor([-1]), pos])[j] + 1, torch.zeros_like(j))
    else:
        words[0] = 1 << 31  # the flag bit 1
        if n:
            lengths = dl[f]
            offsets = 1 + torch.cumsum(lengths, 0) - lengths
            _place(words, dc[f], lengths, offsets)
            idx[:, 0] = offsets[bounds]
            idx[:, 1] = idx[:, 2] = bounds
    out = torch.stack([(words >> 24) & 0xFF, (words >> 16) & 0xFF, (words >> 8) & 0xFF, words & 0xFF], dim=1)
    stream = out.reshape(-1)[:nbytes].to(torch.uint8)
    return (stream, idx.reshape(-1)) if index else stream
