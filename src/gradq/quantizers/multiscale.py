"""Multi-scale and globally sparsified all-reduce-compatible quantizers of [Vineeth] (Vineeth S).

**QSGDMaxNormMultiScale** (§3.2, Eqs. 10–13). Scales ``s_1 < … < s_N`` come from bit widths
(``s_j = 2^(b_j−1) − 1``; ``bits=2+6`` gives 1 and 31). With the shared scale ``w`` (MAX over workers of
the per-bucket norm, max-abs by default or L2), coordinate ``i`` uses the largest scale ``s`` with

    s·|v_i|/w ≤ s_1                                                    (Eq. 11)

so small coordinates get finer levels while their code still fits the smallest scale's range. The code
``c_i = sgn(v_i)·round_stoch(s_i*·|v_i|/w) ∈ [−s_1, s_1]`` decodes to ``w·c_i/s_i*`` (Eq. 13). Stochastic
rounding makes it unbiased; the variance bound is QSGDMaxNorm's with ``s = s_1`` (Lemma 2).
**Scale sharing**: the per-coordinate scale index is MIN-reduced across workers (shared stat
``scale_index``); a smaller index means a smaller scale, hence a smaller code, so every worker's code
stays in ``[−s_1, s_1]`` and the codes add up: the mean is ``w·(Σ_m c^m)/(s_i*·M)``.

Shared stats are computed before any reduction, so the ``scale_index`` of :meth:`shared_stats` uses
the worker's own ``w``. Algorithm 2 of the paper computes the indices *after* the MAX of ``w``; a worker
following it calls :meth:`MultiScale.scale_indices` ``(x, w_shared)`` and MIN-reduces that instead.
Both orders keep the codes in range (a larger ``w`` only allows larger indices).

Wire: codes at ``code_width(2·s_1 + 1)`` bits + scale indices at ``ceil(log2 N)`` bits (no field when
``N = 1``) + one float32 ``w`` per bucket (+ the payload header).

**GlobalRandK-MaxNorm / -MultiScale** (§3.3, §3.4). All workers keep the same ``K`` coordinates, drawn
uniformly from a seed they share (no indices on the wire), and apply §3.1 (``randk-maxnorm``) or §3.2
(``randk-multiscale``) to that sub-vector, with one shared scale over the selected entries. Unselected
coordinates decode to zero. The paper does not rescale (biased: ``E[v̂] = (K/n)·v``); ``rescale=1``
multiplies by ``n/K`` and is unbiased. ``K = min(k, n)``, or ``max(1, round(ratio·n))`` capped at ``n``
(Python's ``round``: halves go to the even neighbour).

Coordinate selection **[decided]**: the same uniform K-subset as ``randk``
(:func:`gradq.quantizers.sparse.shared_random_indices`: the ``K`` smallest of per-coordinate random keys
drawn from the shared seed), sorted in increasing position.
Wire: the inner quantizer's fields for ``K`` coordinates, plus the shared seed as one int64 field
``seed`` (8 bytes), so that a lone decode knows the coordinates.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from .. import kernels
from ..codecs.bitpack import packed_nbytes
from ..errors import SpecError
from ..kernels.reference import multiscale_dequantize
from ..spec import BoolParam, IntParam, IntTupleParam, register
from .base import EncodeContext, SharedStat
from .summable import SummableQuantizer
from ._common import code_width, levels_from_bits, num_buckets
from .maxnorm import MaxNorm
from .qsgd import BITS, LEVELS, NORM, levels_spec_items
from .sparse import K_PARAM, RATIO_PARAM, seed_field, select_count, shared_random_indices

__all__ = ["MultiScale", "RandKMaxNorm", "RandKMultiScale", "multiscale_levels"]

MS_BITS = IntTupleParam("bits", (2, 6), "increasing bit widths of the scales (s_j = 2^(b_j-1) - 1)",
                        lo=2, hi=8, min_len=1, max_len=8)


def multiscale_levels(bits: Sequence[int]) -> tuple[int, ...]:
    """The scales ``s_j = 2^(b_j−1) − 1`` of increasing bit widths (increasing)."""
    return tuple(levels_from_bits(b) for b in bits)


@register("multiscale")
class MultiScale(SummableQuantizer):
    """QSGDMaxNormMultiScale: per-coordinate choice among several scales, summable via scale sharing.

    Spec: ``multiscale:bits=2+6,bucket=none,norm=max`` (defaults). Shared: ``scale`` (MAX, one per
    bucket) and ``scale_index`` (MIN, uint8, one per coordinate).
    """

    params = (MS_BITS, IntParam("bucket", None, "bucket size (none = whole tensor)", allow_none=True, lo=1),
              NORM)
    unbiased = True

    def __init__(self, bits: Sequence[int] | int = (2, 6), bucket: Optional[int] = None,
                 norm: str = "max") -> None:
        super().__init__(bits=bits, bucket=bucket, norm=norm)
        self.levels = multiscale_levels(self.bits)
        self.s1 = self.levels[0]
        self.width = code_width(2 * self.s1 + 1)
        self.index_width = code_width(len(self.levels)) if len(self.levels) > 1 else 0

    @property
    def max_code(self) -> int:
        return self.s1

    def field_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        layout = {"codes": (torch.uint8, packed_nbytes(numel, self.width))}
        if self.index_width:
            layout["index"] = (torch.uint8, packed_nbytes(numel, self.index_width))
        layout["scales"] = (torch.float32, num_buckets(numel, self.bucket))
        return layout

    def _nonfinite_witness(self, x: torch.Tensor, shared: Optional[Mapping[str, torch.Tensor]]) -> Optional[str]:
        # the kernels only do arithmetic on NaN/Inf, and a bucket's norm is NaN/Inf when it holds one
        return "scales" if x.dtype == torch.float32 else None

    # -- scale indices -----------------------------------------------------------------------------
    def scale_indices(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Per-coordinate scale indices (uint8, Eq. 11) of ``x`` under the per-bucket scale ``scale``
        (e.g. the MAX-reduced ``shared_stats()['scale']``); MIN-reduce them across workers."""
        v = self._flatten(x, None)
        return self._indices(v, torch.as_tensor(scale).to(device=v.device, dtype=torch.float32))

    def _indices(self, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return kernels.multiscale_indices(v, w, self.levels, self.bucket)

    # -- encode ------------------------------------------------------------------------------------
    def stat_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"scale": (torch.float32, num_buckets(numel, self.bucket)), "scale_index": (torch.uint8, int(numel))}

    def _shared_stats(self, v: torch.Tensor, shared_seed: Optional[int]) -> dict[str, SharedStat]:
        w = self._norms(v)
        return {"scale": SharedStat(w, "max"), "scale_index": SharedStat(self._indices(v, w), "min")}

    def _norms(self, v: torch.Tensor) -> torch.Tensor:
        return (kernels.maxabs_scales if self.norm == "max" else kernels.l2_scales)(v, self.bucket)

    def _own_stats(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, SharedStat]:
        # The encode never needs this worker's own indices as a tensor (a byte a value, 2.7x a
        # 2+6 payload): encoding under them, the kernels compute each one as they go; under shared
        # indices, they check each against it. A zero-stride stand-in keeps the name and shape.
        index = torch.zeros((), dtype=torch.uint8, device=v.device).expand(v.numel())
        return {"scale": SharedStat(self._norms(v), "max"), "scale_index": SharedStat(index, "min")}

    def _take_own(self, own: Mapping[str, SharedStat], ctx: EncodeContext) -> Optional[dict[str, SharedStat]]:
        # own= (its norms, and its indices as a tensor) serves as it is: the encode compares its own
        # indices with the shared ones by identity alone, and the kernels check each value against
        # the protocol's shared ones
        return dict(own)

    def _fields_of(self, v: torch.Tensor, ctx: EncodeContext, wide: bool = False,
                   out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """``(codes, packed indices or None, scales)`` of the encode: the codes ``s_1 + c`` packed at
        the payload's width, or with ``wide`` a byte a value and no indices (the all-reduce's fields;
        the same randomness, so the same values)."""
        w = ctx.shared["scale"].to(torch.float32)
        self._check_scale(ctx, w)
        index = ctx.shared["scale_index"]
        if index is ctx.own["scale_index"].value:   # no shared indices: each value's own
            index = None
        # (trusted: the caller reduced the shared indices with this worker's own, so none is above it)
        codes, packed = kernels.multiscale_encode(v, w, index, self.levels, self.bucket, 8 if wide else self.width,
                                                  0 if wide else self.index_width, ctx.rng, check=not ctx.trusted,
                                                  out=out)
        return codes, packed, w

    def _fields(self, v: torch.Tensor, ctx: EncodeContext, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        return self._fields_of(v, ctx, wide=True, out=out)[0]

    def _codes(self, v: torch.Tensor, ctx: EncodeContext) -> torch.Tensor:
        return self._fields(v, ctx).to(torch.int32) - self.s1

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        codes, index, w = self._fields_of(v, ctx)
        fields = {"codes": codes}
        if self.index_width:
            fields["index"] = index
        fields["scales"] = w
        return fields

    # -- decode ------------------------------------------------------------------------------------
    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        return kernels.multiscale_decode(fields["codes"], fields.get("index"), fields["scales"], self.levels,
                                         self.bucket, self.width, self.index_width, numel)

    def _decode_into(self, fields: Mapping[str, torch.Tensor], numel: int, out: torch.Tensor) -> bool:
        kernels.multiscale_decode(fields["codes"], fields.get("index"), fields["scales"], self.levels,
                                  self.bucket, self.width, self.index_width, numel, out=out)
        return True

    def _decode_codes(self, codes: torch.Tensor, shared: Mapping[str, torch.Tensor], numel: int,
                      shared_seed: Optional[int]) -> torch.Tensor:
        return multiscale_dequantize(codes, shared["scale"], shared["scale_index"], self.levels, self.bucket, numel)

    def _decode_field_sum(self, total: torch.Tensor, shared: Mapping[str, torch.Tensor], count: int,
                          numel: int, shared_seed: Optional[int],
                          out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        # Σ fields − M·s_1 = Σ codes: with every scale times M the decode's (Σf − M·s_1)/(M·s_idx)·w is
        # the average, in one pass (the indices a byte each, as the protocol reduced them)
        if total.dtype != torch.uint8:   # (more than 127 workers: the codes' decode)
            return None
        return kernels.multiscale_decode(total, shared["scale_index"], shared["scale"].to(torch.float32),
                                         tuple(count * s for s in self.levels), self.bucket, 8, 8, numel, out=out)


# --------------------------------------------------------------------------------------------------
# GlobalRandK
# --------------------------------------------------------------------------------------------------
RESCALE = BoolParam("rescale", False, "multiply by n/K (unbiased); 0 = the paper's unscaled version")


class _GlobalRandK(SummableQuantizer):
    """Shared-seed Rand-K around a summable inner quantizer applied to the selected sub-vector."""

    needs_shared_seed = True
    # (the inner scheme's kernels on the selected values, which run on NaN/Inf harmlessly as its own
    # do; no field shows every NaN/Inf of x, so the checked encode screens x up front)
    runs_on_nonfinite = True
    inner: SummableQuantizer

    def _check_k(self, k: Optional[int], ratio: Optional[float]) -> Optional[float]:
        if k is not None and ratio is not None:
            raise SpecError(f"{self.name}: give k= or ratio=, not both")
        return 0.01 if k is None and ratio is None else ratio

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        """True with ``rescale=1`` (each coordinate is kept with probability K/n)."""
        return self.rescale

    @property
    def max_code(self) -> int:
        return self.inner.max_code

    def num_selected(self, numel: int) -> int:
        """``K`` for a tensor of ``numel`` coordinates."""
        return select_count(numel, self.k, self.ratio)

    def coordinates(self, numel: int, shared_seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The selected positions (sorted int64) for ``numel`` coordinates and ``shared_seed``: the same
        uniform K-subset as ``randk`` draws (:func:`gradq.quantizers.sparse.shared_random_indices`).

        The last selection is kept (one entry): an encode asks for it twice (statistics, then codes),
        and a protocol's decodes of the same step ask again with the same seed."""
        key = (numel, self.num_selected(numel), int(shared_seed), torch.device(device))
        memo = getattr(self, "_last_selection", None)
        if memo is not None and memo[0] == key:
            return memo[1]
        idx = shared_random_indices(numel, key[1], shared_seed, device)
        self._last_selection = (key, idx)   # one tuple, replaced whole: safe for the hook's worker thread
        return idx

    def _spec_items(self) -> list[tuple[str, str]]:
        drop = {"k" if self.k is None else "ratio"}
        return [(k, v) for k, v in super()._spec_items() if k not in drop]

    def field_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return {"seed": (torch.int64, 1), **self.inner.field_layout(self.num_selected(numel))}

    def _need_seed(self, shared_seed: Optional[int]) -> int:
        if shared_seed is None:
            raise ValueError(f"{self.name}: needs shared_seed= (common to all workers) to pick coordinates")
        return shared_seed

    def _indices(self, numel: int, seed: int, device: torch.device) -> Callable[[], torch.Tensor]:
        """The selection as the subset primitives ask for it (only where they gather)."""
        return lambda: self.coordinates(numel, seed, device)

    def _select(self, v: torch.Tensor, shared_seed: Optional[int]) -> torch.Tensor:
        """The selected entries of ``v`` in increasing position (Rand-K's gather: on the Triton
        backend without the indices, so without a host read)."""
        seed = self._need_seed(shared_seed)
        n = v.numel()
        return kernels.subset_gather(v, self.num_selected(n), seed, self._indices(n, seed, v.device))

    def _scatter(self, sub: torch.Tensor, numel: int, shared_seed: int,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The decoded selected entries ``sub`` at their coordinates (times ``n/K`` with ``rescale``),
        zeros elsewhere, in ``out`` (a flat float32 tensor) or a new tensor."""
        return kernels.subset_scatter(sub, self.num_selected(numel), shared_seed, numel, self.rescale,
                                      self._indices(numel, shared_seed, sub.device if out is None else out.device), out)

    def _shared_stats(self, v: torch.Tensor, shared_seed: Optional[int]) -> dict[str, SharedStat]:
        return self.inner._shared_stats(self._select(v, shared_seed), None)

    def stat_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return self.inner.stat_layout(self.num_selected(numel))

    def num_codes(self, numel: int) -> int:
        return self.num_selected(numel)

    def _codes(self, v: torch.Tensor, ctx: EncodeContext) -> torch.Tensor:
        return self.inner._codes(self._select(v, ctx.shared_seed), ctx)

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        seed = self._need_seed(ctx.shared_seed)
        return {"seed": seed_field(seed, v.device), **self.inner._encode(self._select(v, seed), ctx)}

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        return self._decode_selected(fields, numel, None)

    def _decode_into(self, fields: Mapping[str, torch.Tensor], numel: int, out: torch.Tensor) -> bool:
        self._decode_selected(fields, numel, out)
        return True

    def _decode_selected(self, fields: Mapping[str, torch.Tensor], numel: int,
                         out: Optional[torch.Tensor]) -> torch.Tensor:
        """The inner scheme's decode of the ``K`` selected entries (checked before ``out`` is
        touched), scattered into ``out`` or a new tensor."""
        seed = int(fields["seed"].reshape(-1)[0])
        k = self.num_selected(numel)
        sub = self.inner._decode({f: t for f, t in fields.items() if f != "seed"}, k)
        return self._scatter(sub, numel, seed, out)

    def _decode_codes(self, codes: torch.Tensor, shared: Mapping[str, torch.Tensor], numel: int,
                      shared_seed: Optional[int]) -> torch.Tensor:
        seed = self._need_seed(shared_seed)
        sub = self.inner._decode_codes(codes, shared, self.num_selected(numel), None)
        return self._scatter(sub, numel, seed)


@register("randk-maxnorm")
class RandKMaxNorm(_GlobalRandK):
    """GlobalRandK-MaxNorm: QSGDMaxNorm on K coordinates picked from a shared seed.

    Spec: ``randk-maxnorm:ratio=0.01,bits=4,norm=max,rescale=0`` (defaults; ``k=K`` replaces
    ``ratio``). Shared: ``scale`` (MAX, the norm of the selected entries); needs a shared seed.
    """

    params = (K_PARAM, RATIO_PARAM, BITS, LEVELS, NORM, RESCALE)

    def __init__(self, k: Optional[int] = None, ratio: Optional[float] = None, bits: Optional[int] = None,
                 levels: Optional[int] = None, norm: str = "max", rescale: bool = False) -> None:
        ratio = self._check_k(k, ratio)
        super().__init__(k=k, ratio=ratio, bits=bits, levels=levels, norm=norm, rescale=rescale)
        self.inner = MaxNorm(bits=self.bits, levels=self.levels, bucket=None, norm=self.norm)
        self.s = self.inner.s

    def _spec_items(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for key, val in super()._spec_items():
            if key == "bits":
                out += levels_spec_items(self.s)
            elif key != "levels":
                out.append((key, val))
        return out

    # MaxNorm on the subset through the primitives that take it whole (kernels.subset_*): with the
    # Triton backend no index or gathered value is stored; elsewhere they gather from the indices
    def _shared_stats(self, v: torch.Tensor, shared_seed: Optional[int]) -> dict[str, SharedStat]:
        seed = self._need_seed(shared_seed)
        n = v.numel()
        scale = kernels.subset_norm(v, self.num_selected(n), seed, self.norm, self._indices(n, seed, v.device))
        return {"scale": SharedStat(scale, "max")}

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        seed = self._need_seed(ctx.shared_seed)
        n = v.numel()
        scale = self.inner._shared_scale(ctx)
        codes = kernels.subset_uniform_encode(v, self.num_selected(n), seed, scale, self.inner.s, self.inner.width,
                                              ctx.rng, self._indices(n, seed, v.device))
        return {"seed": seed_field(seed, v.device), "codes": codes, "scales": scale}

    def _decode_selected(self, fields: Mapping[str, torch.Tensor], numel: int,
                         out: Optional[torch.Tensor]) -> torch.Tensor:
        seed = int(fields["seed"].reshape(-1)[0])
        codes = fields["codes"]
        return kernels.subset_uniform_decode(codes, fields["scales"], self.inner.s, self.inner.width,
                                             self.num_selected(numel), seed, numel, self.rescale,
                                             self._indices(numel, seed, codes.device), out)

    # the all-reduce's fields (a byte c + s a selected coordinate) through the same subset primitives:
    # MaxNorm's 8-bit fields of the sub-vector, and their sum's average scattered
    def _fields(self, v: torch.Tensor, ctx: EncodeContext, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        seed = self._need_seed(ctx.shared_seed)
        n = v.numel()
        return kernels.subset_uniform_encode(v, self.num_selected(n), seed, self.inner._shared_scale(ctx),
                                             self.inner.s, 8, ctx.rng, self._indices(n, seed, v.device))

    def _decode_field_sum(self, total: torch.Tensor, shared: Mapping[str, torch.Tensor], count: int,
                          numel: int, shared_seed: Optional[int],
                          out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        # Σ fields − M·s = Σ codes, and scale/(M·s) gives the average (as MaxNorm's own), then n/K
        if total.dtype != torch.uint8:   # (a sum wider than a byte: the codes' decode)
            return None
        seed = self._need_seed(shared_seed)
        return kernels.subset_uniform_decode(total, shared["scale"].to(torch.float32), count * self.inner.s, 8,
                                             self.num_selected(numel), seed, numel, self.rescale,
                                             self._indices(numel, seed, total.device), out)


@register("randk-multiscale")
class RandKMultiScale(_GlobalRandK):
    """GlobalRandK-MaxNorm-MultiScale: QSGDMaxNormMultiScale on K coordinates from a shared seed.

    Spec: ``randk-multiscale:ratio=0.01,bits=2+6,norm=max,rescale=0`` (defaults; ``k=K`` replaces
    ``ratio``). Shared: ``scale`` (MAX) and ``scale_index`` (MIN, one per selected coordinate).
    """

    params = (K_PARAM, RATIO_PARAM, MS_BITS, NORM, RESCALE)

    def __init__(self, k: Optional[int] = None, ratio: Optional[float] = None,
                 bits: Sequence[int] | int = (2, 6), norm: str = "max", rescale: bool = False) -> None:
        ratio = self._check_k(k, ratio)
        super().__init__(k=k, ratio=ratio, bits=bits, norm=norm, rescale=rescale)
        self.inner = MultiScale(bits=self.bits, bucket=None, norm=self.norm)

    def scale_indices(self, x: torch.Tensor, scale: torch.Tensor, *, shared_seed: int) -> torch.Tensor:
        """Scale indices (uint8, one per selected coordinate) of ``x``'s selected entries under the
        shared ``scale``; see :meth:`MultiScale.scale_indices`."""
        v = self._flatten(x, None)
        return self.inner._indices(self._select(v, shared_seed),
                                   torch.as_tensor(scale).to(device=v.device, dtype=torch.float32))

    # An encode under its own indices (no protocol's shared ones) goes through the subset primitives,
    # which never store the indices, the gathered values or the per-value scale indices on the
    # Triton backend (as MultiScale computes each value's index as it encodes); under shared indices
    # (a byte a selected value, made by the protocol) it gathers.
    def _own_stats(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, SharedStat]:
        seed = self._need_seed(ctx.shared_seed)
        n, k = v.numel(), self.num_selected(v.numel())
        w = kernels.subset_norm(v, k, seed, self.norm, self._indices(n, seed, v.device))
        index = torch.zeros((), dtype=torch.uint8, device=v.device).expand(k)   # (a zero-stride stand-in)
        return {"scale": SharedStat(w, "max"), "scale_index": SharedStat(index, "min")}

    def _take_own(self, own: Mapping[str, SharedStat], ctx: EncodeContext) -> Optional[dict[str, SharedStat]]:
        # own= (its norms, and its indices as a tensor) serves as it is: the encode compares its own
        # indices with the shared ones by identity alone, and the kernels check each value against
        # the protocol's shared ones
        return dict(own)

    # the all-reduce's fields: MultiScale's of the selected sub-vector (a byte s_1 + c each), and
    # their sum's average scattered
    def _fields(self, v: torch.Tensor, ctx: EncodeContext, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        return self.inner._fields(self._select(v, ctx.shared_seed), ctx, out)

    def _decode_field_sum(self, total: torch.Tensor, shared: Mapping[str, torch.Tensor], count: int,
                          numel: int, shared_seed: Optional[int],
                          out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        seed = self._need_seed(shared_seed)
        sub = self.inner._decode_field_sum(total, shared, count, self.num_selected(numel), None)
        return None if sub is None else self._scatter(sub, numel, seed, out)

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        if ctx.shared["scale_index"] is not ctx.own["scale_index"].value:
            return super()._encode(v, ctx)
        seed = self._need_seed(ctx.shared_seed)
        n, inner = v.numel(), self.inner
        w = ctx.shared["scale"].to(torch.float32)
        self._check_scale(ctx, w, inner.name)
        codes, index = kernels.subset_multiscale_encode(v, self.num_selected(n), seed, w, inner.levels, inner.width,
                                                        inner.index_width, ctx.rng, self._indices(n, seed, v.device))
        fields = {"seed": seed_field(seed, v.device), "codes": codes}
        if inner.index_width:
            fields["index"] = index
        fields["scales"] = w
        return fields

    def _decode_selected(self, fields: Mapping[str, torch.Tensor], numel: int,
                         out: Optional[torch.Tensor]) -> torch.Tensor:
        seed = int(fields["seed"].reshape(-1)[0])
        codes, inner = fields["codes"], self.inner
        return kernels.subset_multiscale_decode(codes, fields.get("index"), fields["scales"], inner.levels,
                                                inner.width, inner.index_width, self.num_selected(numel), seed,
                                                numel, self.rescale, self._indices(numel, seed, codes.device), out)
