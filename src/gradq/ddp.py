"""A DistributedDataParallel communication hook that quantizes gradients with any gradq scheme.

DDP hands the hook one *bucket* at a time: a flat buffer holding the concatenated gradients
``g^m = (g^m_1, …, g^m_L)`` of the bucket's parameters on worker ``m``. The hook returns, on every rank,

    ĝ_l = mean_m g^m_l                          for parameters kept in float32 (the policy below),
    ĝ_l = protocol(g^m_l, Q, name=l, seed=s_l)  for every other parameter,

where ``protocol`` is one of gradq.comm's (docs/algorithms.md): the shared-scale integer all-reduce for
summable quantizers, scatter/all-gather for fixed-width ones, all-gather otherwise (or a parameter
server), each returning the same average of decoded gradients on every rank.

Groups and overlap **[decided]**: the hook does not communicate per DDP bucket but per *group*: the
model's parameters cut, in reverse model order, into groups of about ``group_mb`` MiB
(:class:`gradq.ddp_step._Group`) — a pure function of the model, because DDP rebuilds its buckets after the first
iteration and a layout that followed them would change the results between a run and its resume. A
group's job starts as soon as its last gradient has arrived and runs beside the rest of the backward
pass: on a worker thread over gloo, on a side CUDA stream (ordered after the backward's stream by
``wait_stream``, never by a host wait) on GPUs. Each bucket's future completes when every job that
writes into the bucket has finished; nothing writes into a bucket after that. The first step of a state
(and of a resumed run) learns the groups at its last bucket and runs without overlap.

Within a group, a bucketed scheme (fixed-size buckets of values, :func:`gradq.ddp_step._bucketed`) sends each tensor
of at least :data:`OWN_CALL_NUMEL` values through a protocol call of its own, averaged in place in
DDP's buffer, and the smaller ones concatenated (model order) through one call keyed ``group{g}``;
layer-wise schemes (TernGrad's per-layer scaler, [TernGrad]) get one call per tensor. Error-feedback
residuals are keyed by parameter name (or ``group{g}``). Under ``strategy="auto"`` a payload of at most
:data:`SMALL_PAYLOAD` bytes is all-gathered rather than scattered (one exchange instead of two).

Policy (kept in float32): tensors with fewer than ``min_numel`` elements (QSGD's experiments left
tensors below 10 000 elements unquantized, [QSGD] §4), 1-D tensors (biases, norm scales) when
``keep_1d_fp32``, parameters named in ``uncompressed`` (TernGrad §4.2 keeps the last classifier in
full precision), and every parameter during the first ``warmup_steps`` steps. They are averaged by the
step's LAST collective, concatenated in model order (so each value's place, which fixes the order gloo's
ring adds it up in on 3 or more ranks, depends on the model alone: resumed runs stay bit-identical),
followed by two values: the step's agreement (below). A small vector goes through one all-to-all and
is added up in rank order, a medium one on CPU through two (:func:`gradq.comm._util.sum_over_ranks`).
Under the integer all-reduce that vector rides in the exchange of the last group's scale statistics
(:func:`gradq.comm.allreduce.shared_scale_allreduce_many`'s ``extra``): no round of its own.

Randomness **[decided]**: a protocol call keyed ``k`` (a parameter name or ``group{g}``) at step ``t``
uses ``derive_seed(derive_seed(seed, None, t), None, k)``, a pure function of (run seed, step, key); the
protocols derive the per-rank encode seeds from it. So a run resumed from :meth:`GradqState.state_dict`
reproduces the uninterrupted run bit for bit.

Non-finite gradients and damaged payloads **[decided]**: nobody stops mid-step, so no rank waits alone
in a collective. A rank whose group holds a non-finite value encodes zeros in its place and counts it;
payloads whose CRC-32 fails are counted where they arrive, and so are those whose decode finds codes
no encode writes or that do not decode at all (with or without checksums:
:func:`gradq.kernels.deferred_checks`); the step's last
collective sums the counts over the ranks (on a GPU they stay on the device until then: the host reads
them once per step; the protocols encode the screened groups with ``check_finite=False`` and decode
with the checks deferred, so no encode or decode reads one either).
Then every rank decides alike: ``nan_policy="raise"`` raises :class:`NonFiniteError` (the rank that saw
it names the parameters) or :class:`PayloadError` on every rank; ``"skip"`` zeroes every gradient of
the step once DDP has written them (a callback queued behind DDP's own), ``last_stats["skipped"]`` is
True and ``skipped_steps`` counts it (check it to skip ``optimizer.step()``, e.g. for momentum).
Error-feedback residuals already updated in that step are kept.

Steps **[decided]**: the counter advances after the bucket DDP marks last; ``no_sync`` iterations never
reach the hook and are not counted.

Wire size per worker and step: ``Σ bytes(protocol call)`` for quantized parameters plus the float32
group and the 2 agreement values (``(M−1)·4`` bytes each through the all-to-all, ``2(M−1)/M·4`` through
a ring all-reduce), and, once, the settings check. ``state.last_stats`` reports the figures.
"""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with the real
# ``dist.GradBucket`` / ``torch.futures.Future[torch.Tensor]`` objects, not strings.

import logging
import time
import zlib
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from . import hostshare
from .adaptive import FP32, AdaptiveController, max_over_ranks
from .comm.api import choose_protocol
from .comm._util import check_timeout, collective, time_limit
from .ddp_step import OWN_CALL_NUMEL, SMALL_PAYLOAD, _bucketed, _Group, _make_groups, _Step  # noqa: F401
from .errors import CommunicationError
from .quantizers.base import Quantizer
from .factory import build
from .transforms import ErrorFeedback

__all__ = ["GradqState", "gradq_hook", "register", "DEFAULT_TIMEOUT"]

logger = logging.getLogger(__name__)

STRATEGIES = ("auto", "allreduce", "scatter", "allgather", "ps")
NAN_POLICIES = ("raise", "skip")
#: seconds a collective of the hook may wait for the other ranks before the step fails (``timeout=``):
#: long enough for a first step that compiles kernels on a loaded machine, far below gloo's 30 minutes
DEFAULT_TIMEOUT = 300.0


class GradqState:
    """State of :func:`gradq_hook`: the quantizer, the policy, the step counter and statistics.

    Args:
        spec: a spec string (``"qsgd:bits=4"``, ``"topk:ratio=0.1,ef=1"``…) or a built Quantizer.
        strategy: ``"auto"`` (default), ``"allreduce"``, ``"scatter"``, ``"allgather"`` or ``"ps"``.
            ``"auto"`` picks the integer all-reduce for summable schemes, scatter/all-gather for
            fixed-width ones, all-gather otherwise, and a local encode/decode when the group has one rank.
        process_group: the group to average over (``None``: the default group).
        seed: run seed common to all ranks (default 0).
        min_numel: parameters with fewer elements stay float32 (default 10 000). ``"auto"`` sets it from
            measurement at the first step (:func:`gradq.adaptive.fp32_threshold`): the link's latency and
            bandwidth and the scheme's codec speed, agreed over the ranks; the smallest tensor whose
            transfer saving exceeds its codec cost and per-tensor overhead. Kept in checkpoints, so a
            resumed run uses the same value.
        keep_1d_fp32: 1-D parameters (biases, norm parameters) stay float32 (default True).
        uncompressed: names of parameters that stay float32 (e.g. the last classifier layer).
        warmup_steps: the first steps are averaged in float32 (default 0).
        nan_policy: ``"raise"`` (default; :class:`NonFiniteError` naming the parameter, on every rank)
            or ``"skip"`` (the step's gradient is zeroed on every rank and ``skipped_steps`` counts it).
        measure_error: also report ``rel_error`` = ‖ĝ − ḡ‖/‖ḡ‖ over the quantized parameters, with ḡ
            the exact average (costs one extra float32 all-reduce of those parameters per step).
        module: the model (or DDP wrapper) whose ``named_parameters`` name the bucket's parameters;
            may be given later with :meth:`bind`.
        timeout: seconds each of the hook's collectives may wait for the other ranks (default
            :data:`DEFAULT_TIMEOUT`, 300 s; ``None`` keeps the process group's own limit, 30 minutes on
            gloo). When a rank dies, the others fail at once (its connections close); when it stalls,
            they fail after ``timeout``: every rank raises :class:`gradq.CommunicationError` naming the
            step and the collective it was waiting for. The group's own limit is restored after each
            job, so the caller's other collectives (evaluation barriers…) keep theirs.
        checksum: payloads of the scatter, all-gather and parameter-server protocols carry a CRC-32
            trailer (4 bytes each, CPU tensors). The ranks agree on damaged payloads in the step's last
            collective (one more value beside the float32 tensors) and refuse the step alike:
            :class:`gradq.PayloadError` on every rank, or with ``nan_policy="skip"`` a skipped step
            (zero gradients, ``skipped_steps`` counts it). The integer all-reduce moves no payload and
            has no checksum. Equal on every rank. Without checksums (and on CUDA tensors, which carry
            none) a damaged payload is still refused alike where its decode finds codes no encode writes.
        adaptive: ``True`` (or a dict of :class:`gradq.adaptive.AdaptiveController` settings: ``probe_steps``,
            ``reprobe_every``, ``check_every``, ``drift``, ``margin``) times whole steps with float32
            averaging and with the spec, runs the faster, and probes again periodically and when the
            step time drifts (:mod:`gradq.adaptive`). Float32 steps average each bucket with the
            backend's own all-reduce, overlapped as DDP's default does; non-finite values are then
            averaged as DDP averages them (the same on every rank), and ``nan_policy`` applies to
            compressed steps. Default False.
        group_mb: parameters are averaged in groups of about this many MiB of float32 gradient (a group
            closes once it holds that much), cut in reverse model order like DDP's buckets; a group's
            communication starts as soon as its last gradient is computed. :func:`register` takes
            DDP's own bucket size. Equal on every rank and in a resumed run (it fixes the layout).

    Attributes: ``step`` (completed hook steps), ``skipped_steps``, ``last_stats`` (dict of the last step:
    ``bytes_sent`` per worker, ``coords``, ``quantized_coords``, ``bits_per_coord``, ``seconds`` from the
    first bucket to the step's end, ``wait_seconds`` (the part the backward pass could not hide: how
    long the last bucket waited for the step's jobs), ``encode_seconds``, ``comm_seconds`` (waiting for
    the network) and ``decode_seconds`` spent by the jobs (beside the backward pass; on CUDA the GPU's
    own times, from CUDA events), ``groups``, ``skipped``, and ``rel_error`` with ``measure_error``),
    ``totals`` (cumulative ``bytes_sent``, ``coords``, ``seconds``, ``wait/encode/comm/decode_seconds``,
    ``steps``), ``strategy_used``.
    """

    def __init__(self, spec: str | Quantizer, strategy: str = "auto", *, process_group: Any = None,
                 seed: int = 0, min_numel: int | str = 10_000, keep_1d_fp32: bool = True,
                 uncompressed: Iterable[str] = (), warmup_steps: int = 0, nan_policy: str = "raise",
                 measure_error: bool = False, module: Optional[torch.nn.Module] = None,
                 timeout: Optional[float] = DEFAULT_TIMEOUT, checksum: bool = True,
                 group_mb: float = 25.0, adaptive: bool | Mapping[str, Any] = False) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.min_numel_auto = min_numel == "auto"
        if isinstance(min_numel, str) and not self.min_numel_auto:
            raise ValueError(f"min_numel must be a non-negative int or 'auto', got {min_numel!r}")
        if (not self.min_numel_auto and int(min_numel) < 0) or int(warmup_steps) < 0:
            raise ValueError("min_numel and warmup_steps must be non-negative")
        if isinstance(uncompressed, str):
            raise TypeError("uncompressed must be an iterable of parameter names, not one string")
        self.timeout: Optional[float] = check_timeout(timeout)
        self.checksum = bool(checksum)
        if isinstance(group_mb, bool) or not isinstance(group_mb, (int, float)) or not group_mb > 0:
            raise ValueError(f"group_mb must be a positive number of MiB, got {group_mb!r}")
        self.group_mb = float(group_mb)
        self.quantizer: Quantizer = build(spec)
        if strategy == "allreduce" and not self.quantizer.summable:
            raise ValueError(f"strategy='allreduce' needs a summable quantizer; {self.quantizer.spec!r} is not "
                             "(use 'scatter', 'allgather' or 'auto')")
        self.strategy = strategy
        self.process_group = process_group
        self.seed = seed
        #: the float32 threshold (under "auto": None until the first step measures it)
        self.min_numel: Optional[int] = None if self.min_numel_auto else int(min_numel)
        self.calibration: dict[str, Any] = {}
        self.keep_1d_fp32 = bool(keep_1d_fp32)
        self.uncompressed = frozenset(str(n) for n in uncompressed)
        self.warmup_steps = int(warmup_steps)
        self.nan_policy = nan_policy
        self.measure_error = bool(measure_error)
        if isinstance(adaptive, Mapping):
            self.adaptive: Optional[AdaptiveController] = AdaptiveController(**dict(adaptive))
        elif isinstance(adaptive, bool):
            self.adaptive = AdaptiveController() if adaptive else None
        else:
            raise TypeError(f"adaptive must be a bool or a dict of settings, got {type(adaptive).__name__}")
        self.step = 0
        self.skipped_steps = 0
        self.strategy_used: Optional[str] = None
        self.last_stats: dict[str, Any] = {}
        self.totals: dict[str, float] = {"bytes_sent": 0, "coords": 0, "seconds": 0.0, "steps": 0}
        self._names: dict[int, str] = {}
        self._params: dict[str, torch.nn.Parameter] = {}
        self._order: dict[str, int] = {}  # parameter name -> position in the model (fp32 all-reduce order)
        self._reset_runtime()
        if module is not None:
            self.bind(module)

    def _reset_runtime(self) -> None:
        self._checked = False
        self._mode: Optional[str] = None       # this step's mode under the adaptive mode
        self._fp32_step: Optional[dict[str, Any]] = None  # a float32 step's bookkeeping
        self._step_work: Optional[_Step] = None
        self._groups: Optional[list[_Group]] = None  # built at the first step (a pure function of the model)
        self._group_of: dict[str, int] = {}
        self._streams: dict[torch.device, Any] = {}

    def _build_groups(self, names: Iterable[str]) -> None:
        """The communication groups of the parameters that reach the hook (see :class:`_Group`)."""
        order = sorted(names, key=lambda n: self._order.get(n, -1))
        numels = [self._params[n].numel() if n in self._params else 0 for n in order]
        self._groups = _make_groups(order, numels, int(self.group_mb * 2 ** 20))
        self._group_of = {n: g.index for g in self._groups for n in g.names}

    def _side_stream(self, device: torch.device) -> Any:
        """The CUDA stream this state's jobs run on for ``device`` (created once)."""
        st = self._streams.get(device)
        if st is None:
            st = self._streams[device] = torch.cuda.Stream(device=device)
        return st

    def _finish_step(self, work: "_Step", wait_s: float, skipped: bool) -> None:
        """Record the step's figures in ``last_stats`` and ``totals`` and advance the step counter."""
        fig = work.fig
        enc, com, dec = fig.encode_s, fig.comm_s, fig.decode_s
        if fig.events:  # CUDA: the GPU's own times (the stream has finished)
            t = {"encode": 0.0, "comm": 0.0, "decode": 0.0}
            for name, a, b in fig.events:
                t[name] += a.elapsed_time(b) / 1000.0
            enc, com, dec = t["encode"], t["comm"], t["decode"]
        coords = work.coords
        seconds = time.perf_counter() - work.t0
        self.last_stats = {"step": self.step, "bytes_sent": fig.bytes_sent, "coords": coords,
                           "quantized_coords": fig.quantized_coords,
                           "bits_per_coord": 8.0 * fig.bytes_sent / coords if coords else 0.0,
                           "seconds": seconds, "wait_seconds": wait_s, "encode_seconds": enc, "comm_seconds": com,
                           "decode_seconds": dec, "skipped": skipped, "strategy": self.strategy_used,
                           "groups": len(work.launched), "mode": "spec"}
        if self.adaptive is not None:
            self.last_stats.update(self.adaptive.stats())
        if self.min_numel_auto:
            self.last_stats["min_numel"] = self.min_numel
        if self.measure_error and fig.quantized_coords:
            self.last_stats["rel_error"] = (fig.err2 / fig.ref2) ** 0.5 if fig.ref2 > 0 else 0.0
        tot = self.totals
        tot["bytes_sent"] += fig.bytes_sent
        tot["coords"] += coords
        tot["seconds"] += seconds
        for k, v in (("wait", wait_s), ("encode", enc), ("comm", com), ("decode", dec)):
            tot[f"{k}_seconds"] = tot.get(f"{k}_seconds", 0.0) + v
        tot["steps"] += 1
        if skipped:
            self.skipped_steps += 1
        self.step += 1

    # -- names -------------------------------------------------------------------------------------
    def bind(self, module: torch.nn.Module) -> "GradqState":
        """Name the parameters of ``module`` (a model or its DDP wrapper) for the hook."""
        inner = getattr(module, "module", module)
        self._names = {id(p): n for n, p in inner.named_parameters()}
        self._params = {n: p for n, p in inner.named_parameters()}
        self._order = {n: i for i, n in enumerate(self._names.values())}
        return self

    def _name_of(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))
        if name is None:
            raise RuntimeError("gradq_hook: a bucket parameter has no name; build the state with "
                               "module=model, call state.bind(model) (needed again after unpickling), "
                               "or use gradq.register(ddp_model, spec)")
        return name

    # -- settings ----------------------------------------------------------------------------------
    @property
    def spec(self) -> str:
        return self.quantizer.spec

    def settings(self) -> dict[str, Any]:
        """Everything that must be equal on all ranks (and between a checkpoint and its resume)."""
        return {"spec": self.spec, "strategy": self.strategy, "seed": self.seed,
                "min_numel": "auto" if self.min_numel_auto else self.min_numel,
                "keep_1d_fp32": self.keep_1d_fp32, "uncompressed": sorted(self.uncompressed),
                "warmup_steps": self.warmup_steps, "nan_policy": self.nan_policy, "group_mb": self.group_mb,
                "adaptive": None if self.adaptive is None else self.adaptive.settings()}

    def _check_consistency(self, device: torch.device) -> None:
        """One MAX all-reduce of ``(h, −h)`` per setting (MAX and MIN at once); raise naming mismatches.
        The same all-reduce tells every rank which ranks share its cores (:mod:`gradq.hostshare`), to warn
        once where their thread pools oversubscribe them."""
        items = {**self.settings(), "step": self.step, "measure_error": self.measure_error, "checksum": self.checksum}
        keys = list(items)
        vals = [zlib.crc32(repr(items[k]).encode("utf-8")) for k in keys]
        rank, world = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        t = torch.tensor(vals + [-v for v in vals] + hostshare.host_slots(rank, world), dtype=torch.int64,
                         device=device)
        collective("the check that every rank registered the same settings", dist.all_reduce, t,
                   op=dist.ReduceOp.MAX, group=self.process_group)
        got = t.tolist()
        hi, lo = got[: len(keys)], [-v for v in got[len(keys): 2 * len(keys)]]
        bad = [k for i, k in enumerate(keys) if hi[i] != lo[i]]
        if bad:
            mine = ", ".join(f"{k}={items[k]!r}" for k in bad)
            raise ValueError(f"gradq_hook: ranks disagree on {', '.join(bad)} (this rank: {mine}); every rank "
                             "must register the same spec and settings (and resume from the same step)")
        hostshare.warn_once(got[2 * len(keys):], rank, device)
        self._checked = True

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step, seed, spec/settings, skipped steps and the error-feedback residuals (by parameter name)."""
        q = self.quantizer
        return {"step": self.step, "skipped_steps": self.skipped_steps, "settings": self.settings(),
                "residuals": q.state_dict()["residuals"] if isinstance(q, ErrorFeedback) else {},
                "adaptive": None if self.adaptive is None else self.adaptive.state_dict(),
                "min_numel_measured": self.min_numel if self.min_numel_auto else None,
                "calibration": dict(self.calibration)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the spec and settings must match this state's."""
        saved = dict(state["settings"])
        mine = self.settings()
        saved.setdefault("adaptive", None)  # (written before the adaptive mode existed)
        if "group_mb" not in saved:  # written before the hook grouped parameters: its layout was per step
            logger.warning("GradqState.load_state_dict: the checkpoint predates parameter groups; the run "
                           "continues, but not bit for bit as the run that wrote it would have")
            saved["group_mb"] = mine["group_mb"]
        diff = [k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k)]
        if diff:
            diff = sorted(diff)
            raise ValueError(f"GradqState.load_state_dict: checkpoint settings differ on {diff}: "
                             f"saved {[saved.get(k) for k in diff]}, now {[mine.get(k) for k in diff]}")
        if isinstance(self.quantizer, ErrorFeedback):
            self.quantizer.load_state_dict({"spec": self.spec, "residuals": state["residuals"]})
        elif state["residuals"]:
            raise ValueError("checkpoint holds error-feedback residuals but this spec has no error feedback")
        if self.adaptive is not None and state.get("adaptive") is not None:
            self.adaptive.load_state_dict(state["adaptive"])
        if self.min_numel_auto and state.get("min_numel_measured") is not None:
            self.min_numel = int(state["min_numel_measured"])  # measured once: the same value on resume
            self.calibration = dict(state.get("calibration") or {})
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        self._reset_runtime()

    # -- pickling ----------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Drop what cannot travel: the process group (restored as ``None``, the default group),
        the object-id name map (call :meth:`bind` again) and per-step scratch."""
        logger.warning("GradqState: the process group and parameter names are not pickled; "
                       "set state.process_group and call state.bind(model) after unpickling")
        d = dict(self.__dict__)
        for k in ("process_group", "_names", "_params", "_order", "_step_work", "_groups", "_group_of", "_streams",
                  "_checked"):
            d.pop(k, None)
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.process_group = None
        self._names = {}
        self._params = {}
        self._order = {}
        self._reset_runtime()

    # -- strategy ----------------------------------------------------------------------------------
    def _resolve_strategy(self, world: int) -> str:
        """``strategy``, or under ``"auto"`` :func:`gradq.comm.choose_protocol`'s choice — except that
        with 2 ranks the hook all-gathers what that rule would scatter: the same bytes (``(M−1)·B``
        both), a third less encoding, one exchange instead of two and no re-quantization of the
        average, pipelined across the step's tensors (measured: ``docs/performance.md``)."""
        if self.strategy != "auto":
            return self.strategy
        chosen = choose_protocol(self.quantizer, world)
        return "allgather" if chosen == "scatter" and world == 2 else chosen

    def _calibrate(self, device: torch.device, world: int) -> None:
        """``min_numel="auto"``: measure the link and the codec (every rank, the slowest rank's view)
        and set the float32 threshold (:func:`gradq.adaptive.fp32_threshold`)."""
        from .adaptive import fp32_threshold, measure_codec, measure_link
        from .comm.allreduce import summed_nbytes

        q = self.quantizer.inner if isinstance(self.quantizer, ErrorFeedback) else self.quantizer
        protocol = self._resolve_strategy(world)
        alpha, bandwidth = measure_link(self.process_group, device)
        per_value, per_call = max_over_ranks(list(measure_codec(q, device)), self.process_group, device)
        if protocol == "allreduce":   # (statistics and codes as summed, a selected subset's only)
            bits = 8.0 * summed_nbytes(q, 1 << 20, world) / (1 << 20)
        else:
            nb = q.expected_nbytes(1 << 20)
            bits = 8.0 * nb / (1 << 20) if nb is not None else 8.0
        own_call = protocol != "allreduce" and not _bucketed(q)
        self.min_numel = fp32_threshold(world=world, wire_bits=bits, protocol=protocol, alpha_s=alpha,
                                        bandwidth=bandwidth, codec_s_per_value=per_value, call_s=per_call,
                                        own_call=own_call)
        self.calibration = {"alpha_s": alpha, "bandwidth_Bps": bandwidth, "codec_s_per_value": per_value,
                            "call_s": per_call, "wire_bits": bits, "protocol": protocol, "own_call": own_call,
                            "min_numel": self.min_numel}
        logger.info("gradq_hook: min_numel=auto measured %s", self.calibration)

    def _keeps_fp32(self, name: str, p: torch.Tensor) -> bool:
        return (self.step < self.warmup_steps or p.numel() < self.min_numel or name in self.uncompressed
                or (self.keep_1d_fp32 and p.dim() <= 1))


def gradq_hook(state: GradqState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients, quantizing the parameters outside the
    float32 policy (module docstring). Returns a future that completes when the bucket's average is in
    place; the communication of earlier buckets runs while the backward pass computes later ones.

    Raises :class:`gradq.CommunicationError` (naming the step and the collective) when another rank
    dies or stalls past ``state.timeout``.

    Example::

        state = GradqState("qsgd:bits=4", module=ddp_model)
        ddp_model.register_comm_hook(state, gradq_hook)
    """
    try:
        return _hook(state, bucket)
    except CommunicationError as exc:
        _drop_step(state)
        if exc.step is not None:
            raise
        err = exc.within(f"gradq_hook: step {state.step} (bucket {bucket.index()})", step=state.step)
        err.args = (f"{err}. The process group cannot be used any more; end this process (the other ranks "
                    "fail the same way).",)
        raise err from exc
    except BaseException:
        _drop_step(state)
        raise


def _drop_step(state: GradqState) -> None:
    """Forget a step that failed inside the hook, restoring the group's time limit."""
    work, state._step_work = state._step_work, None
    if work is not None:
        work.release()


def _hook(state: GradqState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    if not state._checked:
        with time_limit(state.process_group, state.timeout):
            state._check_consistency(buf.device)
    if state.min_numel is None:  # min_numel="auto": measured once, at the first step
        with time_limit(state.process_group, state.timeout):
            state._calibrate(buf.device, dist.get_world_size(state.process_group))
    if state.adaptive is not None:
        if bucket.index() == 0:
            mode = state.adaptive.start_step(state.step, lambda v: max_over_ranks(v, state.process_group, buf.device))
            if mode != state._mode and state._mode is not None:
                logger.info("gradq_hook: adaptive mode %s -> %s at step %d (%s)", state._mode, mode, state.step,
                            state.adaptive.stats())
            state._mode = mode
        if state._mode == FP32:
            return _fp32_bucket(state, bucket)
    if bucket.index() == 0 or state._step_work is None:
        _drop_step(state)  # (none is left over normally: the last bucket ends every step)
        rank, world = dist.get_rank(state.process_group), dist.get_world_size(state.process_group)
        strategy = state._resolve_strategy(world)
        if state.strategy_used is None:
            state.strategy_used = strategy
            logger.info("gradq_hook: spec=%s strategy=%s (asked %s) world=%d settings=%s", state.spec, strategy,
                        state.strategy, world, state.settings())
        state._step_work = _Step(state, buf.device, rank, world, strategy)
    work = state._step_work
    fut = work.add_bucket(bucket)
    if bucket.is_last():
        state._step_work = None
        try:
            work.close()
        finally:
            work.release()
    return fut


def _fp32_bucket(state: GradqState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A float32 step of the adaptive mode: the bucket averaged by the backend's own all-reduce,
    asynchronously (its future completes when the average is in place), as DDP's default hook does."""
    buf = bucket.buffer()
    group = state.process_group
    world = dist.get_world_size(group)
    if bucket.index() == 0 or state._fp32_step is None:
        state._fp32_step = {"t0": time.perf_counter(), "coords": 0, "buckets": 0}
    step = state._fp32_step
    step["coords"] += buf.numel()
    step["buckets"] += 1
    buf.div_(world)  # divided, then summed: DDP's own order, so the average is DDP's bit for bit

    def done(f: torch.futures.Future) -> torch.Tensor:
        # what the step waits for once its last bucket is handed over (as gradq's wait_seconds):
        # from that call to the last completion; updated as the completions come in
        step["done"] = max(step.get("done", 0.0), time.perf_counter())
        if "t_last" in step and state.last_stats.get("step") == step.get("index"):
            state.last_stats["wait_seconds"] = state.last_stats["comm_seconds"] = max(0.0, step["done"] - step["t_last"])
        return f.value()[0]

    fut = dist.all_reduce(buf, group=group, async_op=True).get_future().then(done)
    if bucket.is_last():
        state._fp32_step = None
        step["t_last"], step["index"] = time.perf_counter(), state.step
        coords = step["coords"]
        # what a ring all-reduce sends per worker: 2(M−1)/M of the float32 bytes
        sent = int(round(2 * (world - 1) / world * 4 * coords)) if world > 1 else 0
        seconds = time.perf_counter() - step["t0"]
        state.last_stats = {"step": state.step, "bytes_sent": sent, "coords": coords, "quantized_coords": 0,
                            "bits_per_coord": 8.0 * sent / coords if coords else 0.0, "seconds": seconds,
                            "wait_seconds": max(0.0, step.get("done", 0.0) - step["t_last"]), "encode_seconds": 0.0,
                            "comm_seconds": max(0.0, step.get("done", 0.0) - step["t_last"]), "decode_seconds": 0.0,
                            "skipped": False, "strategy": "fp32", "groups": step["buckets"], "mode": "fp32",
                            **state.adaptive.stats()}  # type: ignore[union-attr]
        tot = state.totals
        tot["bytes_sent"] += sent
        tot["coords"] += coords
        tot["seconds"] += seconds
        tot["steps"] += 1
        state.step += 1
    return fut


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, spec: str | Quantizer,
             strategy: str = "auto", **kw: Any) -> GradqState:
    """Quantize ``ddp_model``'s gradient averaging with ``spec``; returns the hook's :class:`GradqState`.

    ``kw`` are :class:`GradqState`'s keyword arguments (``process_group`` defaults to the DDP model's).

    A model sharded with FSDP2's ``fully_shard`` gets gradq's compressed reduce-scatter instead
    (:func:`gradq.fsdp.register`, which returns a :class:`gradq.fsdp.GradqReduceScatter`; ``kw`` are
    its keyword arguments: ``seed``, ``min_numel``, ``keep_1d_fp32``, ``uncompressed``, ``nan_policy``,
    ``intra_node``, ``ranks_per_node``, ``checksum``)."""
    from .fsdp import is_fsdp2

    if is_fsdp2(ddp_model):
        from .fsdp import register as register_fsdp

        if strategy != "auto":
            raise TypeError("strategy= does not apply to an FSDP2 model (its gradients are reduce-scattered)")
        return register_fsdp(ddp_model, spec, **kw)  # type: ignore[return-value]
    if type(ddp_model).__name__ == "FullyShardedDataParallel":
        raise TypeError("gradq.register supports FSDP2 (torch.distributed.fsdp.fully_shard), not the FSDP1 "
                        "FullyShardedDataParallel wrapper")
    if not hasattr(ddp_model, "register_comm_hook"):
        raise TypeError(f"register needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    kw.setdefault("process_group", getattr(ddp_model, "process_group", None))
    cap = getattr(ddp_model, "bucket_bytes_cap", None)
    if isinstance(cap, int) and cap > 0:
        kw.setdefault("group_mb", cap / 2 ** 20)
    state = GradqState(spec, strategy, module=ddp_model, **kw)
    ddp_model.register_comm_hook(state, gradq_hook)
    return state
