"""The layout of an FSDP2 module's reduce-scatter buffer, and how gradq's policy cuts it
(:mod:`gradq.fsdp`).

FSDP2 copies a module's unsharded gradients into one flat buffer of ``M`` blocks; every block holds
each parameter's padded shard at the same offset, in the module's parameter order
(:func:`read_segments`). The policy splits a block into compressed and full-precision ranges
(:class:`Layout`), and a :class:`Plan` cuts the rows of one call accordingly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

__all__ = ["Segment", "Layout", "Plan", "read_segments", "screen"]


@dataclass(frozen=True)
class Segment:
    """One parameter's padded shard inside every block of a module's buffer."""
    offset: int
    length: int
    name: str
    numel: int     # the parameter's unsharded size
    dim: int


@dataclass
class Layout:
    """A module's block layout (from FSDP's parameter group) and its split into the policy's parts."""
    key: str
    segments: list[Segment]
    block: int = 0
    comp: list[tuple[int, int]] = field(default_factory=list)   # compressed (start, stop) in a block
    full: list[tuple[int, int]] = field(default_factory=list)   # full precision
    comp_lengths: list[int] = field(default_factory=list)        # each compressed parameter's shard, in order


class Plan:
    """How one call cuts each block: compressed parts (one, or one per layer) and the full-precision rest."""

    def __init__(self, S: int, comp: list[tuple[int, int]], full: list[tuple[int, int]],
                 lengths: Optional[list[int]] = None) -> None:
        self.S = S
        self.comp, self.full = comp, full
        self.n_comp = sum(b - a for a, b in comp)
        # (start, stop) in the concatenated compressed values: one part, or one per parameter (``lengths``)
        self.parts: list[tuple[int, int]] = [(0, self.n_comp)] if self.n_comp else []
        if lengths:
            bounds = [0]
            for n in lengths:
                bounds.append(bounds[-1] + n)
            self.parts = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        self.n_full = sum(b - a for a, b in full)
        self.fallback = False   # the module's layout did not match the call (the whole buffer compressed)

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(compressed values, full-precision values)`` of every row of ``rows`` (``K×S``)."""
        def cat(rs: list[tuple[int, int]]) -> torch.Tensor:
            if len(rs) == 1:
                return rows[:, rs[0][0]:rs[0][1]]
            if not rs:
                return rows[:, :0]
            return torch.cat([rows[:, a:b] for a, b in rs], dim=1)
        return cat(self.comp), cat(self.full)

    @staticmethod
    def scatter_into(out: torch.Tensor, ranges: list[tuple[int, int]], vals: torch.Tensor) -> None:
        """The inverse of :meth:`split` for one row and one kind: ``vals`` back into ``out``'s ``ranges``."""
        pos = 0
        for a, b in ranges:
            out[a:b] = vals[pos:pos + b - a]
            pos += b - a


def screen(x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``(number of non-finite values, x with them zeroed)``; one sum when there are none (a NaN or
    Inf element makes the sum non-finite whatever the order; only then, or when finite values
    overflow it, are the elements counted)."""
    if not x.numel() or bool(torch.isfinite(x.sum(dtype=torch.float32))):
        return 0, x
    ok = torch.isfinite(x)
    n = int(ok.numel() - int(ok.sum()))
    return n, (torch.where(ok, x, torch.zeros((), dtype=x.dtype, device=x.device)) if n else x)


def read_segments(module: torch.nn.Module, names: Mapping[int, str]) -> Optional[list[Segment]]:
    """Each parameter's padded shard in the module's blocks, from FSDP2's parameter group (private
    attributes of torch's FSDP2: ``fsdp_params``, ``padded_sharded_param_size``, ``_orig_size``)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    pg = state._fsdp_param_group
    if pg is None:   # a module without parameters of its own
        return None
    segs, off = [], 0
    for fp in pg.fsdp_params:
        if not fp.sharded_param.requires_grad:
            continue
        length = int(fp.padded_sharded_param_size.numel())
        size = fp._orig_size
        segs.append(Segment(off, length, names.get(id(fp.sharded_param), fp._module_info.param_name),
                             int(size.numel()), len(size)))
        off += length
    return segs
