"""Quantizers whose integer codes add up across workers once their shared statistics are reduced
(docs/algorithms.md, "All-reduce-compatible quantizers"): the protocol of :class:`SummableQuantizer`
and the check of a shared scale."""

from __future__ import annotations

from typing import ClassVar, Mapping, Optional

import torch

from ..random import RandomStream, resolve_seed
from .base import EncodeContext, Quantizer, SharedStat

__all__ = ["SummableQuantizer", "check_shared_scale"]


def check_shared_scale(name: str, shared: torch.Tensor, own: torch.Tensor) -> None:
    """A shared scale must be at least every worker's own (it is their MAX); refuse a smaller one.
    (Nothing to check, and no host read, when the "shared" scale is the worker's own.)"""
    if shared is own:
        return
    if shared.numel() and bool((shared < own * (1 - 1e-6)).any()):
        raise ValueError(f"{name}: the shared scale is below this worker's own norm; "
                         "it must be the MAX over workers of shared_stats()['scale']")


def _check_out(out: torch.Tensor, like: torch.Tensor, device: torch.device) -> None:
    """Refuse an ``out=`` that a decode of ``like.numel()`` float32 values cannot write straight into."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or not out.is_contiguous() \
            or out.numel() != like.numel() or out.device != device or like.dtype != torch.float32:
        raise ValueError(f"out= must be a contiguous float32 tensor of {like.numel()} values on {device}, for a "
                         f"float32 like=; got {getattr(out, 'dtype', type(out).__name__)}, "
                         f"{getattr(out, 'numel', lambda: '?')()} values, like {like.dtype}")


class SummableQuantizer(Quantizer):
    """A quantizer whose integer codes from different workers add up, once the
    :meth:`shared_stats` are reduced across workers.

    Protocol: every worker computes ``shared_stats``, the stats are reduced with their ``op``,
    every worker calls ``encode_codes(x, shared=reduced)``, the integer codes are summed over the
    ``M`` workers (``|sum| <= M * max_code``), and ``decode_codes(sum, shared=reduced, count=M)``
    returns the average of the workers' decoded tensors.
    """

    summable: ClassVar[bool] = True

    def _check_scale(self, ctx: EncodeContext, scale: torch.Tensor, name: Optional[str] = None) -> None:
        """Refuse a shared ``scale`` below this worker's own (``ctx.own["scale"]``), unless the caller
        vouched for it (``ctx.trusted``): :func:`check_shared_scale`."""
        if not ctx.trusted:
            check_shared_scale(name or self.name, scale, ctx.own["scale"].value)

    @property
    def max_code(self) -> int:
        """Largest absolute value of one worker's integer code."""
        raise NotImplementedError

    def encode_codes(self, x: torch.Tensor, *, shared: Optional[Mapping[str, torch.Tensor]] = None,
                     seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                     shared_seed: Optional[int] = None, name: Optional[str] = None,
                     check_finite: bool = True, own: Optional[Mapping[str, SharedStat]] = None) -> torch.Tensor:
        """Integer codes (int32, one per transmitted coordinate) of ``x`` under the shared stats
        (``check_finite`` as in :meth:`encode`). ``own``: this worker's :meth:`shared_stats` of
        ``x``, which ``shared`` was reduced from (the all-reduce protocol passes them): not
        computed again where the scheme can reuse them, and ``shared`` not checked against them."""
        v = self._flatten(x, name, self._screens(x, check_finite))
        if self.needs_shared_seed and shared_seed is None:
            raise ValueError(f"{self.name}: encode_codes needs shared_seed= (common to all workers)")
        ctx = self._context(v, RandomStream(resolve_seed(seed, generator)), shared, shared_seed, name, own)
        return self._codes(v, ctx)

    def decode_codes(self, codes: torch.Tensor, *, shared: Mapping[str, torch.Tensor], count: int = 1,
                     like: Optional[torch.Tensor] = None, numel: Optional[int] = None,
                     shared_seed: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The average of ``count`` workers' decoded tensors, from the SUM of their codes.

        ``like`` (a tensor of the original shape/dtype) or ``numel`` gives the output size. ``out``:
        as in :meth:`decode_field_sum` (needs ``like``); the division by ``count`` writes there."""
        if count < 1:
            raise ValueError("count must be >= 1")
        if like is not None:
            numel = like.numel()
        if numel is None:
            raise ValueError("pass like= or numel=")
        if out is not None:
            if like is None:
                raise ValueError("out= needs like=")
            _check_out(out, like, codes.device)
            v = self._decode_codes(codes.to(torch.float32), dict(shared), int(numel), shared_seed)
            torch.div(v.reshape(-1), count, out=out.view(-1))
            return out.view(like.shape)
        v = self._decode_codes(codes.to(torch.float32), dict(shared), int(numel), shared_seed) / count
        if like is not None:
            return v.reshape(like.shape).to(like.dtype)
        return v

    def encode_fields(self, x: torch.Tensor, *, shared: Optional[Mapping[str, torch.Tensor]] = None,
                      seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                      shared_seed: Optional[int] = None, name: Optional[str] = None,
                      check_finite: bool = True, own: Optional[Mapping[str, SharedStat]] = None,
                      out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The codes as one uint8 *field* ``c + max_code`` per coordinate, through a fused fast path;
        ``None`` where the scheme or device has none (then use :meth:`encode_codes`); ``check_finite``
        and ``own`` as in :meth:`encode_codes`. ``out``: a contiguous uint8 tensor of
        :meth:`num_codes` values on ``x``'s device to write them into (the all-reduce encodes every
        tensor's fields into one buffer, which it then reduces without a copy).

        Same randomness as :meth:`encode_codes`: ``fields − max_code`` equals its codes exactly. The
        sum of ``M`` workers' fields is ``Σc + M·max_code``; it fits in uint8 when
        ``2·M·max_code ≤ 255``, and :meth:`decode_field_sum` turns it into the average."""
        v = self._flatten(x, name, self._screens(x, check_finite))
        if not self.has_fields:
            return None
        if self.needs_shared_seed and shared_seed is None:
            raise ValueError(f"{self.name}: encode_fields needs shared_seed= (common to all workers)")
        if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1
                                or not out.is_contiguous() or out.numel() != self.num_codes(v.numel())
                                or out.device != v.device):
            raise ValueError(f"{self.name}: out= must be a contiguous 1-D uint8 tensor of {self.num_codes(v.numel())} "
                             f"values on {v.device}")
        ctx = self._context(v, RandomStream(resolve_seed(seed, generator)), shared, shared_seed, name, own)
        fields = self._fields(v, ctx, out)
        if out is not None and fields is not None and fields.data_ptr() != out.data_ptr():
            fields = out.copy_(fields.reshape(-1))   # (a kernel that made its own)
        return fields

    def stat_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        """The dtype and size of each :meth:`shared_stats` value for a tensor of ``numel`` values:
        what the all-reduce protocol reduces before the codes (the byte counts of the DDP hook's
        adaptive choice and of the performance model come from it)."""
        return {}

    def num_codes(self, numel: int) -> int:
        """How many codes (or fields) :meth:`encode_codes` makes for ``numel`` values: one a value,
        or one a selected value for the GlobalRandK variants."""
        return int(numel)

    @property
    def has_fields(self) -> bool:
        """Whether :meth:`encode_fields` gives fields rather than None: integer codes of at most
        127 (casts have none) and a fused fields path (:meth:`_fields` overridden)."""
        mc = self.max_code
        return mc is not None and mc <= 127 and type(self)._fields is not SummableQuantizer._fields

    def decode_field_sum(self, total: torch.Tensor, *, shared: Mapping[str, torch.Tensor], count: int,
                         like: torch.Tensor, shared_seed: Optional[int] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The average of ``count`` workers' decodes from the SUM of their :meth:`encode_fields`
        (uint8, or any wider integer dtype); shaped like ``like``. ``shared_seed``: the one the
        fields were encoded with, for schemes that need one. ``out``: a contiguous float32 tensor of
        ``like.numel()`` values on ``total``'s device (``like`` float32 too) to decode into, with no
        input-sized allocation where the scheme decodes the sum in one pass (a fresh tensor costs
        its page faults on a CPU: about four times the decode itself); returned shaped like ``like``."""
        if count < 1:
            raise ValueError("count must be >= 1")
        if self.needs_shared_seed and shared_seed is None:
            raise ValueError(f"{self.name}: decode_field_sum needs the fields' shared_seed=")
        flat = None
        if out is not None:
            _check_out(out, like, total.device)
            flat = out.view(-1)
        res = self._decode_field_sum(total, dict(shared), count, like.numel(), shared_seed, flat)
        if res is None:   # (the codes' decode, dividing into out where given)
            return self.decode_codes(total.to(torch.int64) - count * self.max_code, shared=shared, count=count,
                                     like=like, shared_seed=shared_seed, out=out)
        if flat is not None:
            if res.data_ptr() != flat.data_ptr():   # (a decode that made a tensor of its own)
                flat.copy_(res.reshape(-1))
            return out.view(like.shape)
        return res.reshape(like.shape).to(like.dtype)

    def _fields(self, v: torch.Tensor, ctx: EncodeContext, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The fields (into ``out`` where the kernel can write there; the caller copies otherwise),
        or None where the scheme has no fields path."""
        return None

    def _decode_field_sum(self, total: torch.Tensor, shared: Mapping[str, torch.Tensor], count: int,
                          numel: int, shared_seed: Optional[int],
                          out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The average from a sum of fields (uint8, or a wider integer dtype where ``2·M·s > 255``)
        in one pass (into ``out`` where given: flat float32), or None where the scheme has no such
        decode for ``total``'s dtype (then the codes' decode serves)."""
        return None

    def _codes(self, v: torch.Tensor, ctx: EncodeContext) -> torch.Tensor:
        raise NotImplementedError

    def _decode_codes(self, codes: torch.Tensor, shared: Mapping[str, torch.Tensor], numel: int,
                      shared_seed: Optional[int]) -> torch.Tensor:
        raise NotImplementedError
