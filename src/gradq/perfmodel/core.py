"""The arithmetic of the performance model: communication cost per protocol, codec cost, iteration time.

Every formula is stated in the package docstring (:mod:`gradq.perfmodel`); the comments here point
back to it. Nothing here measures anything: inputs are measured elsewhere (compute and codec times)
or assumed (cluster presets).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Mapping, Optional, Sequence

from .codec_times import codec_times_from
from .components import Cluster, Compressor, Model, compressor_from
from .presets import cluster as cluster_preset
from .presets import network as network_preset
from .units import PerfModelError, check_nonneg, check_pos, parse_rate

__all__ = [
    "PROTOCOLS", "FORMULAS", "DEFAULT_SWEEP", "DEFAULT_OVERLAP_FRACTION", "CommCost", "Prediction",
    "comm_cost", "codec_factors", "resolve_protocol", "predict", "sweep", "setup", "predict_config",
    "CONFIG_KEYS", "break_even_bandwidth", "BREAK_EVEN_RANGE",
]

#: protocol names ("auto" picks per worker count as gradq.comm.choose_protocol does)
PROTOCOLS = ("allreduce", "scatter", "allgather", "ps", "auto")
#: communication formulas: two-level ring α–β (default) or [Vineeth]'s tree formula
FORMULAS = ("ring", "paper002")
#: GPU counts of a default sweep: 1, 2, 4, …, 512
DEFAULT_SWEEP = tuple(2**k for k in range(10))
#: share of the compute time that can hide communication when overlap is on: the backward pass,
#: about 2/3 of forward + backward [assumption]
DEFAULT_OVERLAP_FRACTION = 2.0 / 3.0


@dataclass(frozen=True)
class CommCost:
    """Communication of one iteration: seconds in each stage and bytes moved."""

    intra_s: float
    inter_s: float
    bytes_per_worker: float   # bytes one worker sends (all stages)
    node_bytes: float         # bytes through the busiest network link (node NIC or server link), one way


def _tree_steps(k: int) -> int:
    """ceil(log2 k) for k ≥ 1 (0 for k = 1): levels of a binary tree over k members."""
    return (k - 1).bit_length()


def comm_cost(protocol: str, size: float, workers: int, cluster: Cluster, *, formula: str = "ring",
              messages: int = 1, out_size: Optional[float] = None, ps_servers: int = 1) -> CommCost:
    """Seconds and bytes to move one iteration's gradients (package docstring, "Communication").

    Args:
        protocol: ``"allreduce"``, ``"scatter"``, ``"allgather"`` or ``"ps"`` (resolved, not ``"auto"``).
        size: bytes of one worker's (compressed) gradient, ``S``.
        workers: ``M`` ≥ 1.
        cluster: the two-level cluster.
        formula: ``"ring"`` (default) or ``"paper002"`` (all-reduce and scatter only).
        messages: collective calls per iteration, ``L`` (each pays α once per step); default 1.
        out_size: ``ps`` only: bytes the server sends back per worker (default ``size``).
        ps_servers: ``ps`` only: servers sharing the gradient, ``k`` (default 1).
    """
    check_nonneg("message size", size)
    if protocol not in PROTOCOLS[:-1]:
        raise PerfModelError(f"unknown protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")
    if formula not in FORMULAS:
        raise PerfModelError(f"unknown formula {formula!r}; valid: {', '.join(FORMULAS)}")
    g, n_nodes = cluster.layout(workers)
    L = messages
    a_n, b_n = cluster.latency_s, cluster.bandwidth
    a_i, b_i = cluster.intra_latency_s, cluster.intra_bandwidth or cluster.bandwidth
    if workers == 1:
        return CommCost(0.0, 0.0, 0.0, 0.0)
    if protocol == "ps":
        if formula != "ring":
            raise PerfModelError("formula 'paper002' models an all-reduce; use formula 'ring' with protocol 'ps'")
        out = size if out_size is None else out_size
        k = ps_servers
        push = L * a_n + max(workers * size / k, g * size) / b_n
        pull = L * a_n + max(workers * out / k, g * out) / b_n
        return CommCost(0.0, push + pull, size, workers * size / k)
    if protocol == "allgather":
        if formula != "ring":
            raise PerfModelError("formula 'paper002' models an all-reduce; use formula 'ring' with "
                                 "protocol 'allgather'")
        inter = (n_nodes - 1) * (L * a_n + g * size / b_n)
        intra = (g - 1) * (L * a_i + n_nodes * size / b_i)
        return CommCost(intra, inter, (n_nodes - 1) * size + (g - 1) * n_nodes * size,
                        g * (n_nodes - 1) * size)
    # allreduce / scatter: the same volume
    if formula == "paper002":
        t_g, t_n = _tree_steps(g), _tree_steps(n_nodes)
        return CommCost(t_g * size / b_i, t_n * (L * a_n + size / b_n), (t_g + t_n) * size, t_n * size)
    intra = 2 * (g - 1) * L * a_i + 2 * (g - 1) / g * size / b_i
    inter = 2 * (n_nodes - 1) * L * a_n + 2 * (n_nodes - 1) / n_nodes * size / b_n
    per_worker = 2 * (g - 1) / g * size + 2 * (n_nodes - 1) / n_nodes * size / g
    return CommCost(intra, inter, per_worker, 2 * (n_nodes - 1) / n_nodes * size)


def codec_factors(protocol: str, workers: int, *, ps_requantize: bool = False,
                  ps_servers: int = 1) -> tuple[float, float]:
    """How many whole-gradient encodes and decodes lie on one iteration's critical path
    (package docstring, "Codec"). ``(0, 0)`` for one worker."""
    M = workers
    if M == 1:
        return 0.0, 0.0
    if protocol == "allreduce":
        return 1.0, 1.0
    if protocol == "scatter":
        return 1.0 + 1.0 / M, 2.0
    if protocol == "allgather":
        return 1.0, float(M)
    if protocol == "ps":
        r = 1.0 if ps_requantize else 0.0
        return 1.0 + r / ps_servers, M / ps_servers + r
    raise PerfModelError(f"unknown protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")


def resolve_protocol(protocol: str, compressor: Compressor, workers: int) -> str:
    """``protocol`` checked against the compressor; ``"auto"`` becomes gradq's choice: all-reduce for
    summable codes while ``M·s ≤ 127`` (and for fp32/float casts), else scatter."""
    if protocol not in PROTOCOLS:
        raise PerfModelError(f"unknown protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")
    if protocol == "auto":
        if compressor.summable is not False and (compressor.max_code is None or
                                                 workers * compressor.max_code <= 127):
            return "allreduce"
        return "scatter"
    if protocol == "allreduce" and compressor.summable is False:
        raise PerfModelError(f"{compressor.name!r} codes cannot be summed in an all-reduce; use protocol "
                             "'scatter', 'allgather' or 'ps'")
    return protocol


@dataclass(frozen=True)
class Prediction:
    """One predicted configuration. Times in ms; throughput in ``throughput_unit``."""

    compressor: str
    workers: int
    nodes: int
    protocol: str
    formula: str
    bits: float
    compute_ms: float
    encode_ms: float
    decode_ms: float
    comm_ms: float
    intra_comm_ms: float
    inter_comm_ms: float
    iteration_ms: float
    throughput: Optional[float]
    throughput_unit: str
    bytes_per_worker: float
    node_bytes: float
    overlap: bool
    speedup_vs_fp32: Optional[float] = None
    #: inter-node bandwidth (bytes/s) below which this compressor is faster than fp32 (``inf``: at every
    #: bandwidth tried, 0: at none); ``None`` when not asked for, for fp32, or with one node
    break_even_bandwidth: Optional[float] = None
    codec_source: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def predict(model: Model | str, compressor: Compressor | str, cluster: Cluster | str, workers: int, *,
            protocol: str = "allreduce", formula: str = "ring", overlap: bool = False,
            overlap_fraction: float = DEFAULT_OVERLAP_FRACTION, ps_requantize: bool = False,
            ps_servers: int = 1, comm_floor_ms: float = 0.0, speedup: bool = False,
            codec_times=None, break_even: bool = False,
            ps_pull_bits: Optional[float | str] = None) -> Prediction:
    """Predicted time of one iteration of ``model`` on ``workers`` GPUs of ``cluster``.

    Args:
        model, compressor, cluster: objects, or preset names (a compressor name is read by
            :func:`~gradq.perfmodel.components.compressor_from` for ``model``).
        workers: number of GPUs ``M`` (≥ 1).
        protocol: ``"allreduce"`` (default), ``"scatter"``, ``"allgather"``, ``"ps"`` or ``"auto"``.
        formula: ``"ring"`` (default, two-level ring α–β) or ``"paper002"`` ([Vineeth]'s tree formula).
        overlap: hide communication behind the last ``overlap_fraction`` of the compute (default off).
        overlap_fraction: in [0, 1], default 2/3 (the backward pass) [assumption].
        ps_requantize: ``ps``: the server sends the average re-encoded (else fp32). Default False.
        ps_servers: ``ps``: number of servers sharing the gradient (default 1).
        comm_floor_ms: measured floor of one iteration's communication (default 0: none): the time its
            collectives take on a link fast enough that the bytes cost nothing (synchronising the
            workers, software cost per collective). Communication is ``max(t_comm, floor)``.
        speedup: also predict the fp32 baseline (same protocol and cluster) and set ``speedup_vs_fp32``.
        codec_times: measured codec speeds for a compressor given by name
            (:func:`~gradq.perfmodel.codec_times.codec_times_from`: ``None``/``"none"``, ``"default"``,
            a path or a :class:`~gradq.perfmodel.codec_times.CodecTimes`); default none (0 ms).
        break_even: also find :func:`break_even_bandwidth` (sets ``break_even_bandwidth``).
        ps_pull_bits: ``ps``: bits per coordinate of what the server sends back, overriding
            ``ps_requantize``; ``"summed"`` is [TernGrad]'s exchange (scaler sharing and parameter
            localization): the sum of ``M`` shared-scale codes in ``[−M·s, M·s]``, ``log2(2·M·s + 1)``
            bits. That is the paper's protocol, not one of gradq's (gradq sums shared-scale codes in its
            all-reduce instead). Default ``None``.
    """
    m = network_preset(model) if isinstance(model, str) else model
    c = compressor_from(compressor, m, codec_times_from(codec_times))
    cl = cluster_preset(cluster) if isinstance(cluster, str) else cluster
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PerfModelError(f"workers must be an integer >= 1, got {workers!r}")
    f = check_nonneg("overlap_fraction", overlap_fraction)
    floor = check_nonneg("comm_floor_ms", comm_floor_ms)
    if f > 1:
        raise PerfModelError(f"overlap_fraction must lie in [0, 1], got {overlap_fraction!r}")
    if isinstance(ps_servers, bool) or not isinstance(ps_servers, int) or ps_servers < 1:
        raise PerfModelError(f"ps_servers must be an integer >= 1, got {ps_servers!r}")
    proto = resolve_protocol(protocol, c, workers)
    n = m.params
    bits = c.bits
    if proto == "allreduce" and c.sum_bits is not None:
        bits = c.sum_bits
    elif proto == "allreduce" and c.max_code is not None and not c.is_fp32:
        # what gradq's shared-scale all-reduce really sums: one byte or a wider integer per summed
        # code (a GlobalRandK variant's K only), not the packed payload, and its shared statistics
        from ..comm.allreduce import summed_itemsize

        bits = c.stat_bits + c.sum_fraction * 8.0 * summed_itemsize(workers, c.max_code, c.fields)
    size = n * bits / 8.0                                     # S
    out_size = size if ps_requantize else 4.0 * n             # ps pull: re-encoded or fp32
    if ps_pull_bits is not None and proto == "ps" and not c.is_fp32:
        out_size = n * _pull_bits(ps_pull_bits, c, workers) / 8.0
    cost = comm_cost(proto, size, workers, cl, formula=formula, messages=m.n_messages, out_size=out_size,
                     ps_servers=ps_servers)
    enc1, dec1 = (0.0, 0.0) if c.is_fp32 else c.codec_ms(m.grad_bytes)
    fe, fd = codec_factors(proto, workers, ps_requantize=ps_requantize, ps_servers=ps_servers)
    enc, dec = fe * enc1, fd * dec1
    comm = max(1e3 * (cost.intra_s + cost.inter_s), floor) if workers > 1 else 0.0
    t_c = m.compute_ms
    if overlap:   # T = t_codec + (1 − f)·t_compute + max(f·t_compute, t_comm)
        total = enc + dec + (1.0 - f) * t_c + max(f * t_c, comm)
    else:         # T = t_compute + t_codec + t_comm
        total = t_c + enc + dec + comm
    if total <= 0:
        thr = None
    elif m.batch_size is not None:
        thr = workers * m.batch_size * 1e3 / total
    else:
        thr = 1e3 / total
    pred = Prediction(
        compressor=c.name, workers=workers, nodes=cl.layout(workers)[1], protocol=proto, formula=formula,
        bits=bits, compute_ms=t_c, encode_ms=enc, decode_ms=dec, comm_ms=comm,
        intra_comm_ms=1e3 * cost.intra_s, inter_comm_ms=1e3 * cost.inter_s, iteration_ms=total,
        throughput=thr, throughput_unit="samples/s" if m.batch_size is not None else "iterations/s",
        bytes_per_worker=cost.bytes_per_worker, node_bytes=cost.node_bytes, overlap=bool(overlap),
        codec_source=c.codec_source)
    if break_even and not c.is_fp32:
        pred = replace(pred, break_even_bandwidth=break_even_bandwidth(
            m, c, cl, workers, protocol=protocol, formula=formula, overlap=overlap, overlap_fraction=f,
            ps_requantize=ps_requantize, ps_servers=ps_servers, comm_floor_ms=floor, ps_pull_bits=ps_pull_bits))
    if speedup:
        base = predict(m, "fp32", cl, workers, protocol="allreduce" if protocol == "auto" else protocol,
                       formula=formula, overlap=overlap, overlap_fraction=f, ps_requantize=ps_requantize,
                       ps_servers=ps_servers)
        pred = replace(pred, speedup_vs_fp32=base.iteration_ms / total if total > 0 else None)
    return pred


def _pull_bits(value: float | str, c: Compressor, workers: int) -> float:
    """Bits per coordinate of a parameter server's reply (see ``ps_pull_bits`` in :func:`predict`)."""
    import math

    if isinstance(value, str) and value.strip().lower() == "summed":
        if c.max_code is None or c.summable is False:
            raise PerfModelError(f"ps_pull_bits='summed' needs shared-scale integer codes; {c.name!r} has none")
        return math.log2(2 * workers * c.max_code + 1)
    try:
        return check_pos("ps_pull_bits", float(value))
    except (TypeError, ValueError):
        raise PerfModelError(f"ps_pull_bits must be a number of bits or 'summed', got {value!r}") from None


#: the bandwidths :func:`break_even_bandwidth` searches between, bytes/s (1 kbit/s to 100 Tbit/s)
BREAK_EVEN_RANGE = (1e3 / 8, 1e14 / 8)


def break_even_bandwidth(model: Model | str, compressor: Compressor | str, cluster: Cluster | str, workers: int,
                         **kw: Any) -> Optional[float]:
    """The inter-node bandwidth (bytes/s per node link) at which ``compressor`` and fp32 (same protocol,
    cluster and options ``kw`` as :func:`predict`) take equally long per iteration: compression pays
    below it, fp32 wins above it.

    The difference ``T_fp32 − T_compressor`` never grows with the bandwidth (bandwidth only divides the
    bytes, and the compressor sends fewer; its codec time and communication floor do not shrink), so a
    bisection on log bandwidth over :data:`BREAK_EVEN_RANGE` finds the crossing to 0.1 %. Returns
    ``math.inf`` when compression pays over the whole range, ``0.0`` when it pays nowhere in it, and
    ``None`` when every GPU sits in one node (the network is not used).
    """
    import math

    m = network_preset(model) if isinstance(model, str) else model
    c = compressor_from(compressor, m, codec_times_from(kw.pop("codec_times", None)))
    cl = cluster_preset(cluster) if isinstance(cluster, str) else cluster
    kw.pop("speedup", None)
    kw.pop("break_even", None)
    if cl.layout(workers)[1] < 2:
        return None

    def pays(bw: float) -> bool:
        p = predict(m, c, replace(cl, bandwidth=bw), workers, speedup=True, **kw)
        return p.speedup_vs_fp32 is not None and p.speedup_vs_fp32 > 1.0

    lo, hi = BREAK_EVEN_RANGE
    if pays(hi):
        return math.inf
    if not pays(lo):
        return 0.0
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if pays(mid) else (lo, mid)
    return math.sqrt(lo * hi)


def sweep(model: Model | str, compressors: Compressor | str | Sequence[Compressor | str], cluster: Cluster | str,
          workers: Iterable[int] = DEFAULT_SWEEP, **kw: Any) -> list[Prediction]:
    """:func:`predict` for every compressor (outer loop) and every GPU count in ``workers``
    (default 1, 2, 4, …, 512); ``kw`` as for :func:`predict`."""
    if isinstance(compressors, (str, Compressor)):
        compressors = [compressors]
    m = network_preset(model) if isinstance(model, str) else model
    counts = list(workers)
    if not counts:
        raise PerfModelError("the sweep names no GPU count; give e.g. 1,2,4,8")
    return [predict(m, c, cluster, w, **kw) for c in compressors for w in counts]


def setup(*, network: Optional[str] = None, params: Optional[int] = None, gradient_mb: Optional[float] = None,
          gradient_bytes: Optional[float] = None, compute_ms: Optional[float] = None,
          batch_size: Optional[int] = None, messages: Optional[int] = None, cluster: Optional[str] = None,
          bandwidth: Optional[str | float] = None, latency_us: Optional[float] = None,
          gpus_per_node: Optional[int] = None, intra_bandwidth: Optional[str | float] = None,
          intra_latency_us: Optional[float] = None) -> tuple[Model, Cluster]:
    """A model and a cluster from preset names and overriding numbers (every argument optional).

    The model is the preset ``network`` (or a custom one, which then needs one size: ``params``,
    ``gradient_mb`` or ``gradient_bytes``); a size override drops the preset's layer sizes but keeps
    its message count. The cluster is the preset ``cluster``, or a flat network (1 GPU per node) that
    then needs ``bandwidth``. Rates are strings such as ``"1gbit"`` or bytes/s; latencies in µs.
    """
    sizes = {k: v for k, v in (("params", params), ("gradient_mb", gradient_mb),
                               ("gradient_bytes", gradient_bytes)) if v is not None}
    if len(sizes) > 1:
        raise PerfModelError(f"give one gradient size, not {' and '.join(sizes)}")
    base = network_preset(network) if network is not None else None
    if base is None and not sizes:
        raise PerfModelError("give a network preset (--network, see --list-presets) or a gradient size "
                             "(--gradient-mb, --gradient-bytes or --params)")
    if params is not None:
        new = Model(params=params)
    elif gradient_mb is not None:
        new = Model.from_mb(gradient_mb)
    elif gradient_bytes is not None:
        new = Model.from_bytes(gradient_bytes)
    else:
        new = base
    if base is not None and new is not base:
        new = replace(base, params=new.params, layer_sizes=None, messages=base.n_messages)
    over: dict[str, Any] = {k: v for k, v in (("compute_ms", compute_ms), ("batch_size", batch_size),
                                              ("messages", messages)) if v is not None}
    model = replace(new, **over)
    if cluster is None and bandwidth is None:
        raise PerfModelError("give a cluster preset (--cluster, see --list-presets) or a bandwidth "
                             "(--bandwidth 1gbit)")
    cov: dict[str, Any] = {}
    if bandwidth is not None:
        cov["bandwidth"] = parse_rate(bandwidth)
    if latency_us is not None:
        cov["latency_s"] = check_nonneg("latency_us", latency_us) * 1e-6
    if gpus_per_node is not None:
        cov["gpus_per_node"] = gpus_per_node
    if intra_bandwidth is not None:
        cov["intra_bandwidth"] = parse_rate(intra_bandwidth)
    if intra_latency_us is not None:
        cov["intra_latency_s"] = check_nonneg("intra_latency_us", intra_latency_us) * 1e-6
    if cluster is not None:
        cl = cluster_preset(cluster, **cov)
    else:
        cl = Cluster(**cov)
    return model, cl


_SETUP_KEYS = ("network", "params", "gradient_mb", "gradient_bytes", "compute_ms", "batch_size", "messages",
               "cluster", "bandwidth", "latency_us", "gpus_per_node", "intra_bandwidth", "intra_latency_us")
_CODEC_KEYS = ("sum_bits", "encode_ms", "decode_ms", "encode_ms_per_mb", "decode_ms_per_mb")
_PREDICT_KEYS = ("workers", "protocol", "formula", "overlap", "overlap_fraction", "ps_requantize", "ps_servers",
                 "comm_floor_ms", "speedup", "codec_times", "break_even", "ps_pull_bits")
#: every key :func:`predict_config` reads (plus ``compressor``)
CONFIG_KEYS = _SETUP_KEYS + _CODEC_KEYS + _PREDICT_KEYS + ("compressor",)


def predict_config(config: Mapping[str, Any]) -> Prediction:
    """:func:`predict` from one flat dict of :data:`CONFIG_KEYS` (the CLI's option names; ``None``
    values mean "not given"). ``compressor`` defaults to fp32, ``workers`` to 1.

    Raises:
        PerfModelError: an unknown key (the message lists the valid ones) or a bad value.
    """
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise PerfModelError(f"unknown configuration key(s) {unknown}; valid: {', '.join(CONFIG_KEYS)}")
    get = {k: v for k, v in config.items() if v is not None}
    model, cl = setup(**{k: get[k] for k in _SETUP_KEYS if k in get})
    codec = {k: get[k] for k in _CODEC_KEYS if k in get}
    times = codec_times_from(get.get("codec_times"))
    comp = compressor_from(get.get("compressor", "fp32"), model, times, **codec)
    kw = {k: get[k] for k in _PREDICT_KEYS if k in get and k not in ("workers", "codec_times")}
    return predict(model, comp, cl, get.get("workers", 1), **kw)
