"""Sparsification baselines (docs/algorithms.md): Top-K and Rand-K.

Both keep ``K`` of the ``n`` coordinates of ``v`` and zero the rest, with

    K = min(k, n)                          if ``k`` is given,
    K = min(max(1, round(ratio·n)), n)     otherwise (``ratio`` defaults to 0.01),

``round`` being Python's round-half-to-even; an empty tensor keeps ``K = 0``.

**Top-K** keeps the ``K`` coordinates of largest magnitude: ``v̂_i = v_i`` for ``i ∈ S`` and 0 elsewhere.
It is biased (``E v̂ ≠ v``; ``‖v − v̂‖² ≤ (1 − K/n)·‖v‖²``, the usual contraction bound), so it is meant to
be run with error feedback (``ef(topk:...)``). Ties in ``|v_i|`` are broken towards the *lower index*
[decided; the papers do not say]: the selection is a pure function of ``v``, identical on every device.
Wire: ``K`` float32 values + ``K`` indices (int32, or int64 when ``n > 2**31 − 1``), indices sorted
ascending, i.e. ``8K`` bytes (``12K`` with int64 indices) + the 26-byte payload header.

**Rand-K** keeps ``K`` coordinates chosen uniformly at random without replacement from a seed the
workers share (docs/algorithms.md, §3.3): the receiver regenerates the coordinates from the seed, so no
indices cross the wire. With ``rescale=1`` the kept values are multiplied by ``n/K``, which makes the
scheme unbiased (each coordinate is kept with probability ``K/n``), with variance
``E‖v̂ − v‖² = (n/K − 1)·‖v‖²``; without it (the default, as in [Vineeth]) ``E v̂ = (K/n)·v``.
Wire: ``K`` float32 values + the 64-bit seed, i.e. ``4K + 8`` bytes + the 26-byte header.

The shared selection (:func:`shared_random_indices`) is also used by GlobalRandK (§3.3).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from ..errors import SpecError
from .. import kernels
from ..kernels.checks import refuse_invalid
from ..spec import BoolParam, FloatParam, IntParam, register
from ..payload import Payload
from ..random import U64 as _U64, signed64
from .base import EncodeContext, Quantizer

__all__ = ["TopK", "RandK", "shared_random_indices", "select_count", "topk_indices", "signed64", "seed_field"]

_INT32_MAX = (1 << 31) - 1
_DEFAULT_RATIO = 0.01

K_PARAM = IntParam("k", None, "number of coordinates kept (instead of ratio)", allow_none=True, lo=1)
RATIO_PARAM = FloatParam("ratio", None, "fraction of coordinates kept; default 0.01", allow_none=True,
                         lo=0.0, hi=1.0, lo_open=True)


def select_count(n: int, k: Optional[int], ratio: Optional[float]) -> int:
    """``K = min(k or max(1, round(ratio·n)), n)`` (``ratio`` defaults to 0.01); 0 for an empty tensor."""
    if n <= 0:
        return 0
    if k is None:
        k = max(1, round((_DEFAULT_RATIO if ratio is None else ratio) * n))
    return min(int(k), n)


def shared_random_indices(n: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``k`` distinct coordinates of ``range(n)``, uniformly at random without replacement, as a sorted
    int64 tensor on ``device``: a pure function of ``(n, k, seed)``, identical on every device
    (:func:`gradq.kernels.random_subset`, whose reference states the keys)."""
    return kernels.random_subset(n, k, seed, device)


def topk_indices(v: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted int64 indices of the ``k`` largest ``|v_i|`` of a float32 vector, ties broken towards
    the lower index (:func:`gradq.kernels.topk_select`, whose reference states the keys)."""
    return kernels.topk_select(v.reshape(-1), k)[1]


def seed_field(seed: int, device: torch.device | str) -> torch.Tensor:
    """The payload's ``seed`` field: one int64 on ``device``, filled there (``torch.full``: the value
    travels as a kernel argument, where ``torch.tensor([...], device=...)`` copies it from host memory,
    which on a GPU waits for the device)."""
    return torch.full((1,), signed64(seed), dtype=torch.int64, device=device)


class _Sparse(Quantizer):
    """Shared parameters and checks of Top-K and Rand-K."""

    def _init_count(self) -> None:
        if self.k is not None and self.ratio is not None:
            raise SpecError(f"{self.name}: give k= or ratio=, not both (k={self.k}, ratio={self.ratio})")
        if self.k is None and self.ratio is None:
            self.ratio = self._values["ratio"] = _DEFAULT_RATIO

    def count(self, numel: int) -> int:
        """Coordinates kept, ``K``, for a tensor of ``numel`` coordinates."""
        return select_count(numel, self.k, self.ratio)

    @staticmethod
    def _mean_at(idxs: Sequence[torch.Tensor], vals: Sequence[torch.Tensor], out: torch.Tensor) -> bool:
        """``out`` = the mean of the sparse decodes ``(idxs[j], vals[j])`` (distinct int64 positions,
        float32 values): the first payload's values, each later payload's added at its positions in
        list order, then ``/ M``.

        Bit for bit the generic ``((d_0 + d_1) + …) / M`` of dense decodes: that also adds ``+0.0``
        wherever a payload does not hold a position, which changes a value only where it is
        ``−0.0``; a sum is ``−0.0`` there only if the first payload held ``−0.0`` and every later
        one held ``−0.0`` or nothing, so those positions that a later payload misses get the
        ``+ 0.0`` here."""
        vals = [v.to(device=out.device, dtype=torch.float32) for v in vals]
        out.zero_()
        out[idxs[0]] = vals[0]
        for idx, v in zip(idxs[1:], vals[1:]):
            out.index_add_(0, idx, v)            # (indices distinct: each position once, in list order)
        kernels.sparse_mean_zero_signs(out, idxs, vals)
        out.div_(len(idxs))
        return True

    @staticmethod
    def _subtract_at(u: torch.Tensor, payload: Payload, kept) -> bool:
        """``u.view(-1)[idx] -= values`` with ``(idx, values) = kept()``, for a contiguous float32 ``u``
        of the payload's coordinates (else ``False``, ``u`` untouched): bit for bit ``u − decode``."""
        if u.dtype != torch.float32 or not u.is_contiguous() or u.numel() != payload.numel:
            return False
        idx, values = kept()
        flat = u.view(-1)
        flat[idx] = flat[idx] - values.to(device=u.device, dtype=torch.float32)
        return True

    def _count_items(self) -> list[tuple[str, str]]:
        if self.k is not None:
            return [("k", str(self.k))]
        return [("ratio", RATIO_PARAM.format(self.ratio))]


@register("topk")
class TopK(_Sparse):
    """Top-K sparsification: keep the ``K`` largest-magnitude coordinates (see the module docstring).

    Spec: ``topk:ratio=0.01`` (default) or ``topk:k=1000`` (``k`` and ``ratio`` are exclusive; the
    canonical spec prints the one in use). Biased; combine with error feedback (``ef(topk:...)``).
    Wire: float32 ``values`` (K) + sorted ``indices`` (K; int32, int64 when ``n > 2**31 − 1``).
    """

    params = (K_PARAM, RATIO_PARAM)
    unbiased = False

    def __init__(self, k: Optional[int] = None, ratio: Optional[float] = None) -> None:
        super().__init__(k=k, ratio=ratio)
        self._init_count()

    def _spec_items(self) -> list[tuple[str, str]]:
        return self._count_items()

    @staticmethod
    def index_dtype(numel: int) -> torch.dtype:
        """int32 indices, or int64 when ``numel > 2**31 − 1``."""
        return torch.int64 if numel > _INT32_MAX else torch.int32

    def field_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        kk = self.count(numel)
        return {"values": (torch.float32, kk), "indices": (self.index_dtype(numel), kk)}

    def _nonfinite_witness(self, x: torch.Tensor, shared: Optional[Mapping[str, torch.Tensor]]) -> Optional[str]:
        # a NaN's or Inf's magnitude ranks above every finite one (NaN above Inf), so with K ≥ 1 the
        # kept values hold one whenever x does; every backend selects on such data harmlessly
        return "values" if x.dtype == torch.float32 and self.count(x.numel()) > 0 else None

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        n = v.numel()
        values, idx = kernels.topk_select(v, self.count(n), self.index_dtype(n))
        return {"values": values, "indices": idx}

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32, device=fields["values"].device)
        self._decode_into(fields, numel, out)
        return out

    def _indices(self, fields: Mapping[str, torch.Tensor], numel: int, device: torch.device,
                 check: bool = True) -> torch.Tensor:
        """The payload's indices as int64 on ``device``, refused unless strictly increasing in ``[0, numel)``:
        one host read (the count of what is wrong), none inside :func:`gradq.kernels.deferred_checks`,
        where a corrupt payload is counted there and its indices are clamped into range, so that the
        decode stays in bounds (its output is then not meaningful, as the check says later). Without
        ``check`` (this quantizer's own payload, just encoded) as they are."""
        idx = fields["indices"].to(device=device, dtype=torch.int64)
        if not idx.numel() or not check:
            return idx
        bad = (idx[:1] < 0) | (idx[-1:] >= numel)
        if idx.numel() > 1:
            bad |= (idx[1:] <= idx[:-1]).any()
        if refuse_invalid(bad, lambda _: self._index_error(idx, numel), "sparse indices"):
            idx = idx.clamp(0, numel - 1)   # (a new tensor: idx may be the payload's own field)
        return idx

    def _index_error(self, idx: torch.Tensor, numel: int) -> str:
        """What is wrong with indices the check refused (host reads: only on the way to an error)."""
        out = idx[(idx < 0) | (idx >= numel)]
        if out.numel():
            return (f"{self.name}: {out.numel()} index(es) out of range [0, {numel}) in payload (the first "
                    f"{int(out[0])}); corrupt payload")
        return f"{self.name}: payload indices are not strictly increasing; corrupt payload"

    def _decode_into(self, fields: Mapping[str, torch.Tensor], numel: int, out: torch.Tensor) -> bool:
        """Zeros and the kept values straight into ``out`` (checked before ``out`` is touched)."""
        idx = self._indices(fields, numel, out.device)
        out.zero_()
        out[idx] = fields["values"].to(device=out.device, dtype=torch.float32)
        return True

    def _decode_mean_into(self, fields: Sequence[Mapping[str, torch.Tensor]], numel: int,
                          out: torch.Tensor) -> bool:
        """The mean of the payloads' decodes without a dense decode each (:meth:`_Sparse._mean_at`);
        every payload's indices are checked before ``out`` is touched."""
        idxs = [self._indices(f, numel, out.device) for f in fields]
        return self._mean_at(idxs, [f["values"] for f in fields], out)

    def subtract_decode_(self, u: torch.Tensor, payload: Payload, *, trusted: bool = False) -> bool:
        """Error feedback's ``u − decode(payload)`` at the ``K`` kept positions only (``u − 0.0`` is
        ``u``); a ``trusted`` payload's indices are not checked again (no host read)."""
        return self._subtract_at(u, payload, lambda: (self._indices(payload.fields, payload.numel, u.device,
                                                                    check=not trusted),
                                                      payload.fields["values"]))


@register("randk")
class RandK(_Sparse):
    """Rand-K sparsification with a shared seed: keep ``K`` uniformly random coordinates.

    Spec: ``randk:ratio=0.01,rescale=0`` (defaults) or ``randk:k=1000,rescale=1``. ``rescale=1``
    multiplies the kept values by ``n/K`` and makes the scheme unbiased. Pass ``shared_seed=`` (common
    to all workers, e.g. derived from the seed and the step) to select the same coordinates everywhere;
    omitted, one is derived from the encode's randomness. Wire: float32 ``values`` (K) + int64 ``seed``
    (1); the coordinates are regenerated from the seed with :func:`shared_random_indices`.
    """

    params = (K_PARAM, RATIO_PARAM, BoolParam("rescale", False, "multiply kept values by n/K (unbiased)"))
    needs_shared_seed = True
    runs_on_nonfinite = True   # (a gather and a scatter: a NaN/Inf is only carried, where selected)

    def __init__(self, k: Optional[int] = None, ratio: Optional[float] = None, rescale: bool = False) -> None:
        super().__init__(k=k, ratio=ratio, rescale=rescale)
        self._init_count()

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return bool(self.rescale)

    def _spec_items(self) -> list[tuple[str, str]]:
        return self._count_items() + [("rescale", "1" if self.rescale else "0")]

    def field_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"values": (torch.float32, self.count(numel)), "seed": (torch.int64, 1)}

    def coordinates(self, numel: int, kk: int, seed: int, device: torch.device | str,
                    keep: bool = False) -> torch.Tensor:
        """The ``kk`` coordinates a shared seed selects (:func:`shared_random_indices`). An encode's
        selection is kept (``keep``; one tuple, replaced whole: safe for the hook's worker thread), so
        that the decodes of the same seed that follow it do not select again."""
        key = (numel, kk, int(seed) & _U64, torch.device(device))
        last = getattr(self, "_last", None)
        if last is not None and last[0] == key:
            return last[1]
        idx = shared_random_indices(numel, kk, seed, device)
        if keep:
            self._last = (key, idx)
        return idx

    def _indices(self, numel: int, kk: int, seed: int, device: torch.device,
                 keep: bool = False) -> Callable[[], torch.Tensor]:
        """The selection as the subset primitives ask for it (only where they do not select on the
        device themselves)."""
        return lambda: self.coordinates(numel, kk, seed, device, keep)

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        if ctx.shared_seed is None:  # the base always supplies one; guard direct calls
            raise ValueError(f"{self.name}: needs a shared seed")
        n = v.numel()
        kk = self.count(n)
        seed = int(ctx.shared_seed) & _U64
        values = kernels.subset_gather(v, kk, seed, self._indices(n, kk, seed, v.device, keep=True))
        field = seed_field(seed, v.device)
        self._encoded_seed = (field, seed)   # (a trusted subtraction of this payload reads no seed)
        return {"values": values, "seed": field}

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32, device=fields["values"].device)
        self._decode_into(fields, numel, out)
        return out

    @staticmethod
    def _seed(fields: Mapping[str, torch.Tensor]) -> int:
        """The payload's shared seed (a host read where the field is on a device)."""
        return int(fields["seed"].reshape(-1)[0].item()) & _U64

    def _decode_into(self, fields: Mapping[str, torch.Tensor], numel: int, out: torch.Tensor) -> bool:
        """Zeros and the kept values straight into ``out``."""
        values = fields["values"].to(device=out.device, dtype=torch.float32)
        kk, seed = values.numel(), self._seed(fields)
        kernels.subset_scatter(values, kk, seed, numel, self.rescale, self._indices(numel, kk, seed, out.device),
                               out)
        return True

    def _decode_mean_into(self, fields: Sequence[Mapping[str, torch.Tensor]], numel: int,
                          out: torch.Tensor) -> bool:
        """The mean of the payloads' decodes without a dense decode each.

        Payloads that share one seed (the DDP hook's workers do) hold the same coordinates: their
        values (rescaled each) are added in list order, divided by ``M`` and scattered, ``+0.0``
        elsewhere, which is the dense ``((d_0 + d_1) + …) / M`` bit for bit (a coordinate none holds
        is ``+0.0 / M``). Otherwise :meth:`_Sparse._mean_at`, each distinct seed's coordinates
        selected once."""
        values = [f["values"].to(device=out.device, dtype=torch.float32) for f in fields]
        keys = [(self._seed(f), v.numel()) for f, v in zip(fields, values)]   # (one read a payload)
        if self.rescale:
            values = [v * (numel / kk) if kk else v for v, (_, kk) in zip(values, keys)]
        if len(set(keys)) > 1:
            chosen = {key: self.coordinates(numel, key[1], key[0], out.device) for key in dict.fromkeys(keys)}
            return self._mean_at([chosen[key] for key in keys], values, out)
        seed, kk = keys[0]
        acc = values[0].clone()
        for v in values[1:]:
            acc += v
        acc.div_(len(values))
        kernels.subset_scatter(acc, kk, seed, numel, False, self._indices(numel, kk, seed, out.device), out)
        return True

    def subtract_decode_(self, u: torch.Tensor, payload: Payload, *, trusted: bool = False) -> bool:
        """Error feedback's ``u − decode(payload)`` at the ``K`` kept positions only (``u − 0.0`` is ``u``),
        for a contiguous float32 ``u`` of the payload's coordinates (else ``False``, ``u`` untouched).
        A ``trusted`` payload of this quantizer's last encode gives its seed without a host read."""
        if u.dtype != torch.float32 or not u.is_contiguous() or u.numel() != payload.numel:
            return False
        values = payload.fields["values"].to(device=u.device, dtype=torch.float32)
        last = getattr(self, "_encoded_seed", None)
        own = trusted and last is not None and payload.fields["seed"] is last[0]
        kk, seed = values.numel(), last[1] if own else self._seed(payload.fields)
        kernels.subset_scatter(values, kk, seed, u.numel(), self.rescale,
                               self._indices(u.numel(), kk, seed, u.device), u.view(-1), subtract=True)
        return True
