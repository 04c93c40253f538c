"""The three inputs of the performance model: a :class:`Model`, a :class:`Compressor`, a :class:`Cluster`.

All three are frozen dataclasses that check their values when built, so a bad number fails where it
is given, with a message that names it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .units import MB, PerfModelError, check_nonneg, check_pos

__all__ = ["Model", "Compressor", "Cluster", "compressor_from", "FP32_NAMES"]

#: compressor names that mean "plain fp32 all-reduce, no codec, exactly 32 bits per coordinate"
FP32_NAMES = ("none", "fp32", "float32")
_BITS_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*bits?\s*$", re.IGNORECASE)


def _check_count(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PerfModelError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class Model:
    """A network to train: what one worker computes and how big its gradient is.

    Args:
        params: gradient coordinates ``n`` (fp32 gradient = ``4n`` bytes); must be ≥ 1.
        compute_ms: measured forward + backward time of one iteration on one worker (default 0).
        batch_size: samples per worker per iteration; ``None`` (default) gives throughput in iterations/s.
        layer_sizes: coordinates per parameter tensor (must sum to ``params``); used for honest
            per-tensor payload sizes of gradq specs and as the default message count. Default ``None``.
        messages: collective calls per iteration (each pays the latency α once); default
            ``len(layer_sizes)`` when given, else 1.
        name: a label (default ``"custom"``).
    """

    params: int
    compute_ms: float = 0.0
    batch_size: Optional[int] = None
    layer_sizes: Optional[tuple[int, ...]] = None
    messages: Optional[int] = None
    name: str = "custom"

    def __post_init__(self) -> None:
        _check_count("params (gradient coordinates)", self.params)
        object.__setattr__(self, "compute_ms", check_nonneg("compute_ms", self.compute_ms))
        if self.batch_size is not None:
            _check_count("batch_size", self.batch_size)
        if self.messages is not None:
            _check_count("messages", self.messages)
        if self.layer_sizes is not None:
            sizes = tuple(self.layer_sizes)
            for s in sizes:
                _check_count("every layer size", s)
            if sum(sizes) != self.params:
                raise PerfModelError(f"layer sizes sum to {sum(sizes)} but params is {self.params}; "
                                     "give matching values, or no layer sizes")
            object.__setattr__(self, "layer_sizes", sizes)

    @classmethod
    def from_bytes(cls, nbytes: float, **kw) -> "Model":
        """A model whose fp32 gradient has ``nbytes`` bytes (``params = round(nbytes / 4)``)."""
        check_pos("gradient size in bytes", nbytes)
        return cls(params=max(1, int(round(nbytes / 4))), **kw)

    @classmethod
    def from_mb(cls, megabytes: float, **kw) -> "Model":
        """A model whose fp32 gradient has ``megabytes`` MB (1 MB = 10⁶ bytes)."""
        check_pos("gradient size in MB", megabytes)
        return cls.from_bytes(megabytes * MB, **kw)

    @property
    def grad_bytes(self) -> int:
        """Bytes of the fp32 gradient, ``4n``."""
        return 4 * self.params

    @property
    def n_messages(self) -> int:
        """Collective calls per iteration (see ``messages``)."""
        if self.messages is not None:
            return self.messages
        return len(self.layer_sizes) if self.layer_sizes else 1


@dataclass(frozen=True)
class Compressor:
    """How gradients travel: wire size and measured codec cost.

    Args:
        name: a label; ``"fp32"`` marks the uncompressed baseline (default).
        bits: wire bits per coordinate including every overhead (scales, headers); default 32.
        sum_bits: bits per coordinate inside a SUM all-reduce (``protocol="allreduce"``), when codes are
            widened to an integer type that cannot overflow (gradq: int8 while ``M·s ≤ 127``, else
            int32 on gloo/NCCL); default ``None`` = ``bits`` (the ideal packed all-reduce).
        encode_ms, decode_ms: measured time of one encode / decode of the whole gradient (default 0).
        encode_ms_per_mb, decode_ms_per_mb: measured time per MB of fp32 gradient input (default 0);
            added to the fixed times above.
        summable: whether the codes of ``M`` workers can be summed in an all-reduce (``None`` = unknown,
            treated as yes); ``False`` makes ``protocol="allreduce"`` an error.
        max_code: largest integer code ``s`` of a summable quantizer (``None`` = not integer codes);
            ``protocol="auto"`` uses it as gradq does (all-reduce while ``M·s ≤ 127``). With it and no
            ``sum_bits``, the all-reduce is charged the integer width gradq's protocol sums at ``M``
            workers (:func:`gradq.comm.allreduce.summed_itemsize`), not the packed ``bits``.
        fields: whether the scheme sums one-byte fields ``c + s`` (its fused fast path: TernGrad,
            MaxNorm, MultiScale and the GlobalRandK variants) rather than integer codes.
        sum_fraction: codes summed per coordinate (default 1; a GlobalRandK variant's ``K/n``).
        stat_bits: bits per coordinate of the shared statistics the all-reduce also reduces
            (default 0; the scales, and MultiScale's byte of scale index per summed code).
        codec_source: where the codec times come from (``"given"``, a measurement's description, or
            ``""`` for none), for reports.
    """

    name: str = "fp32"
    bits: float = 32.0
    sum_bits: Optional[float] = None
    encode_ms: float = 0.0
    decode_ms: float = 0.0
    encode_ms_per_mb: float = 0.0
    decode_ms_per_mb: float = 0.0
    summable: Optional[bool] = None
    max_code: Optional[int] = None
    fields: bool = False
    sum_fraction: float = 1.0
    stat_bits: float = 0.0
    codec_source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_pos(f"bits per coordinate of {self.name!r}", self.bits))
        if self.sum_bits is not None:
            object.__setattr__(self, "sum_bits", check_pos("sum_bits", self.sum_bits))
        for k in ("encode_ms", "decode_ms", "encode_ms_per_mb", "decode_ms_per_mb", "sum_fraction", "stat_bits"):
            object.__setattr__(self, k, check_nonneg(k, getattr(self, k)))

    @property
    def is_fp32(self) -> bool:
        """True for the uncompressed fp32 baseline."""
        return self.name in FP32_NAMES and self.bits == 32.0

    def codec_ms(self, grad_bytes: float) -> tuple[float, float]:
        """``(encode, decode)`` milliseconds of ONE encode and ONE decode of a ``grad_bytes`` fp32 gradient."""
        mb = grad_bytes / MB
        return self.encode_ms + self.encode_ms_per_mb * mb, self.decode_ms + self.decode_ms_per_mb * mb


@dataclass(frozen=True)
class Cluster:
    """A two-level cluster: nodes of ``gpus_per_node`` GPUs, one network link (NIC) per node.

    Args:
        bandwidth: inter-node bandwidth per node link, bytes/s (full duplex).
        latency_s: inter-node latency α per message, seconds (default 0).
        gpus_per_node: GPUs per node (default 1: every worker has its own link).
        intra_bandwidth: GPU-to-GPU bandwidth inside a node, bytes/s; required when ``gpus_per_node > 1``.
        intra_latency_s: intra-node latency per message, seconds (default 0).
        name: a label (default ``"flat"``).
        note: where the numbers come from.
    """

    bandwidth: float
    latency_s: float = 0.0
    gpus_per_node: int = 1
    intra_bandwidth: Optional[float] = None
    intra_latency_s: float = 0.0
    name: str = "flat"
    note: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", check_pos("bandwidth (bytes/s)", self.bandwidth))
        object.__setattr__(self, "latency_s", check_nonneg("latency (s)", self.latency_s))
        _check_count("gpus_per_node", self.gpus_per_node)
        if self.intra_bandwidth is not None:
            object.__setattr__(self, "intra_bandwidth", check_pos("intra-node bandwidth", self.intra_bandwidth))
        elif self.gpus_per_node > 1:
            raise PerfModelError(f"a cluster with {self.gpus_per_node} GPUs per node needs an intra-node "
                                 "bandwidth (e.g. --intra-bandwidth 10GB/s for PCIe, 25GB/s for NVLink)")
        object.__setattr__(self, "intra_latency_s", check_nonneg("intra-node latency (s)", self.intra_latency_s))

    def layout(self, workers: int) -> tuple[int, int]:
        """``(g, N)``: GPUs used per node ``g = min(M, G)`` and nodes ``N = ceil(M / G)``."""
        _check_count("workers", workers)
        return min(workers, self.gpus_per_node), math.ceil(workers / self.gpus_per_node)


def _payload_nbytes(q, sizes: Sequence[int], spec: str) -> int:
    total = 0
    for n in sizes:
        nb = q.expected_nbytes(int(n))
        if nb is None:
            raise PerfModelError(f"{spec!r} has a data-dependent wire size; measure its bits per coordinate "
                                 "(gradq compare) and pass it as e.g. --compressor 4.15bit")
        total += int(nb)
    return total


def compressor_from(spec: str | Compressor, model: Model, codec_times=None, **codec) -> Compressor:
    """A :class:`Compressor` from a name, for ``model``'s gradient.

    ``spec`` may be ``"none"``/``"fp32"`` (the fp32 baseline: exactly 32 bits, no codec), ``"<b>bit"``
    (e.g. ``"4bit"``, ``"1.6bits"``: exactly ``b`` bits per coordinate), or any fixed-width gradq spec
    (``"terngrad"``, ``"maxnorm:bits=4"``…), whose bits per coordinate are
    ``8·Σ_l expected_nbytes(n_l) / n`` over the model's parameter tensors (or the whole gradient when
    the model has no layer sizes) — headers and scales included. ``codec`` keywords (``encode_ms``,
    ``decode_ms``, ``encode_ms_per_mb``, ``decode_ms_per_mb``, ``sum_bits``) apply to every compressor
    except the fp32 baseline. A :class:`Compressor` is returned as it is.
    """
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise PerfModelError(f"compressor must be a non-empty string, got {spec!r}")
    text = spec.strip()
    if text.lower() in FP32_NAMES:
        return Compressor(name="fp32", bits=32.0, summable=True)
    given = any(codec.get(k) for k in ("encode_ms", "decode_ms", "encode_ms_per_mb", "decode_ms_per_mb"))
    source = "given" if given else ""
    m = _BITS_RE.match(text)
    if m:
        return Compressor(name=text, bits=float(m.group(1)), codec_source=source, **codec)
    from ..factory import build

    try:
        q = build(text)
    except ValueError as e:
        raise PerfModelError(f"{e}; or write 'none' (fp32) or a width such as '4bit'") from None
    nbytes = _payload_nbytes(q, model.layer_sizes or (model.params,), text)
    mc = getattr(q, "max_code", None) if q.summable else None
    has_fields = bool(q.summable) and bool(getattr(q, "has_fields", False))
    sum_fraction = stat_bits = None
    if mc is not None:   # what the all-reduce sums besides its codes, and how many codes
        sizes = [int(s) for s in (model.layer_sizes or (model.params,))]
        stat_bytes = sum(count * dt.itemsize
                         for s in sizes for dt, count in q.stat_layout(s).values())
        sum_fraction = sum(q.num_codes(s) for s in sizes) / model.params
        stat_bits = 8.0 * stat_bytes / model.params
    if codec_times is not None and not given:
        measured = codec_times.lookup(text)
        if measured is None:
            source = f"not measured in {codec_times.source}"
        else:
            codec = {**codec, "encode_ms_per_mb": measured[0], "decode_ms_per_mb": measured[1]}
            source = codec_times.describe()
    extra = {} if sum_fraction is None else {"sum_fraction": sum_fraction, "stat_bits": stat_bits}
    return Compressor(name=text, bits=8.0 * nbytes / model.params, summable=bool(q.summable),
                      max_code=None if mc is None else int(mc), fields=has_fields, codec_source=source,
                      **extra, **codec)
