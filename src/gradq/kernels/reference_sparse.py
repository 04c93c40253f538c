"""The plain-torch reference of the sparse mean's signed-zero step (Top-K's and Rand-K's mean of
several payloads, :meth:`gradq.quantizers.sparse._Sparse._mean_at`), in two forms that give the
same bits: one with a host read (the CPU's) and one without (a device's).

Part of :mod:`gradq.kernels.reference`, which exports every public name here.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["sparse_mean_zero_signs", "sparse_mean_zero_signs_on_device"]


def sparse_mean_zero_signs(out: torch.Tensor, idxs: Sequence[torch.Tensor], vals: Sequence[torch.Tensor]) -> None:
    """The signed-zero step of the sparse mean (``gradq.quantizers.sparse._Sparse._mean_at``): where
    the first payload holds ``−0.0`` at a position that a later payload does not hold, the dense sum
    adds that payload's ``+0.0`` and makes it ``+0.0``; ``out[p] + 0.0`` there, in place. ``idxs``:
    strictly increasing int64 positions, one tensor a payload (the same object for payloads that
    share their positions). One host read (the positions of ``−0.0``, usually none)."""
    negative_zero = idxs[0][(vals[0] == 0) & torch.signbit(vals[0])]
    if negative_zero.numel() and len(idxs) > 1:
        missed = torch.zeros_like(negative_zero, dtype=torch.bool)
        for idx in idxs[1:]:
            if idx is not idxs[0]:
                missed |= ~torch.isin(negative_zero, idx)
        at = negative_zero[missed]
        out[at] = out[at] + 0.0


def sparse_mean_zero_signs_on_device(out: torch.Tensor, idxs: Sequence[torch.Tensor],
                                     vals: Sequence[torch.Tensor]) -> None:
    """:func:`sparse_mean_zero_signs` without a host read: every position of the first payload is
    looked up in each later one (``searchsorted``, ``K log K``) and rewritten, the ``−0.0`` ones that
    one misses with ``+ 0.0``. For devices, where a read waits for the queue; on the CPU the read is
    free and the lookups are not."""
    if len(idxs) < 2 or not idxs[0].numel():
        return
    first, v = idxs[0], vals[0]
    missed = torch.zeros(first.shape, dtype=torch.bool, device=first.device)
    for idx in idxs[1:]:
        if idx is first:
            continue
        if not idx.numel():
            missed.fill_(True)
        else:
            missed |= idx[torch.searchsorted(idx, first).clamp_(max=idx.numel() - 1)] != first
    kept = out[first]
    out[first] = torch.where((v == 0) & torch.signbit(v) & missed, kept + 0.0, kept)
