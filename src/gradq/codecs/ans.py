"""Entropy coding of integer codes with rANS (the optional ``constriction`` package), and CRC fields.

``ans_encode_codes`` codes a vector of integer codes under its own histogram: the payload carries the
coder's 32-bit words (``ans``), the histogram as Elias-omega-coded ``count + 1`` per value of the
observed code range (``model``) and the range ``(lo, K)`` (``range``). Within about 2% of the empirical
entropy at 2^20 coordinates (see docs/performance.md). ``constriction`` is imported lazily: without it
``coding=ans`` raises an ImportError saying how to install it.
"""

from __future__ import annotations

import zlib
from typing import Mapping

import numpy as np
import torch

from ..errors import PayloadError

__all__ = ["ans_encode_codes", "ans_decode_codes", "crc_field", "constriction_module"]


def crc_field(*parts: torch.Tensor) -> torch.Tensor:
    """CRC-32 of the parts' bytes, in order, as one int32 (same bits as the unsigned checksum)."""
    crc = 0
    for t in parts:
        crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return torch.tensor([crc - (1 << 32) if crc >= (1 << 31) else crc], dtype=torch.int32)


def constriction_module():
    try:
        import constriction
    except ImportError:
        raise ImportError("qsgd:coding=ans needs the optional package 'constriction' "
                          "(pip install constriction==0.5.0); coding=elias needs nothing extra") from None
    return constriction


def ans_encode_codes(codes: torch.Tensor) -> dict[str, torch.Tensor]:
    """rANS code of integer codes under their own histogram (the ``ans``, ``model``, ``range`` fields).

    ``range = (lo, K)``: the codes lie in ``[lo, lo+K)``; ``model``: Elias omega codes of ``count+1`` of
    each of those K values; ``ans``: the coder's 32-bit words, little-endian (empty when ``K ≤ 1``)."""
    from ..codecs.elias import omega_encode

    c = codes.detach().cpu().reshape(-1).to(torch.int64).numpy()
    lo = int(c.min()) if c.size else 0
    counts = np.bincount(c - lo) if c.size else np.zeros(0, dtype=np.int64)
    ans = torch.zeros(0, dtype=torch.uint8)
    if counts.size > 1:
        cn = constriction_module()
        model = cn.stream.model.Categorical(counts.astype(np.float64), perfect=False)
        coder = cn.stream.stack.AnsCoder()
        coder.encode_reverse((c - lo).astype(np.int32), model)
        words = coder.get_compressed().astype("<u4")
        ans = torch.from_numpy(words.view(np.uint8).copy())
    return {"ans": ans, "model": omega_encode(counts + 1),
            "range": torch.tensor([lo, counts.size], dtype=torch.int32)}


def ans_decode_codes(fields: Mapping[str, torch.Tensor], n: int, s: int) -> torch.Tensor:
    """Inverse of :func:`ans_encode_codes`: ``n`` int32 codes in ``[-s, s]``; raises PayloadError."""
    from ..codecs.elias import omega_decode

    lo, k = (int(v) for v in fields["range"].tolist())
    ans = fields["ans"].detach().cpu().numpy()
    if not ((n == 0 and k == 0) or (n > 0 and 1 <= k and -s <= lo and lo + k - 1 <= s)):
        raise PayloadError(f"qsgd: corrupt ANS payload: code range lo={lo}, K={k} invalid for n={n}, s={s}")
    counts = omega_decode(fields["model"], k).numpy() - 1
    if k and (int(counts.max()) > n or counts[0] == 0 or counts[-1] == 0 or int(counts.sum()) != n):
        raise PayloadError(f"qsgd: corrupt ANS payload: the model's counts do not describe {n} codes")
    if k <= 1:
        if ans.size:
            raise PayloadError("qsgd: corrupt ANS payload: data after a single-valued model (extended stream)")
        return torch.full((n,), lo, dtype=torch.int32)
    if ans.size % 4:
        raise PayloadError(f"qsgd: corrupt ANS payload: {ans.size} bytes is not a whole number of 32-bit words")
    cn = constriction_module()
    try:
        model = cn.stream.model.Categorical(counts.astype(np.float64), perfect=False)
        coder = cn.stream.stack.AnsCoder(np.ascontiguousarray(ans).view("<u4").astype(np.uint32))
        sym = coder.decode(model, n)
        empty = coder.is_empty()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # the coder reports malformed data as Rust panics or ValueErrors
        raise PayloadError(f"qsgd: corrupt ANS payload: {e}") from None
    if not empty or not np.array_equal(np.bincount(sym, minlength=k), counts):
        raise PayloadError("qsgd: corrupt ANS payload: decoded codes disagree with the model (truncated, "
                           "extended or altered data)")
    return torch.from_numpy((sym + lo).astype(np.int32))
