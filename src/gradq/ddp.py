"""A DistributedDataParallel communication hook that quantizes gradients with any gradq scheme.

DDP hands the hook one *bucket* at a time: a flat buffer holding the concatenated gradients
``g^m = (g^m_1, …, g^m_L)`` of the bucket's parameters on worker ``m``. The hook returns, on every rank,

    ĝ_l = mean_m g^m_l                          for parameters kept in float32 (the policy below),
    ĝ_l = protocol(g^m_l, Q, name=l, seed=s_l)  for every other parameter,

where ``protocol`` is one of gradq.comm's (ALGORITHMS.md §6): the shared-scale integer all-reduce for
summable quantizers, scatter/all-gather for fixed-width ones, all-gather otherwise (or a parameter
server), each returning the same average of decoded gradients on every rank.

Groups and overlap **[decided]**: the hook does not communicate per DDP bucket but per *group*: the
model's parameters cut, in reverse model order, into groups of about ``group_mb`` MiB
(:class:`_Group`) — a pure function of the model, because DDP rebuilds its buckets after the first
iteration and a layout that followed them would change the results between a run and its resume. A
group's job starts as soon as its last gradient has arrived and runs beside the rest of the backward
pass: on a worker thread over gloo, on a side CUDA stream (ordered after the backward's stream by
``wait_stream``, never by a host wait) on GPUs. Each bucket's future completes when every job that
writes into the bucket has finished; nothing writes into a bucket after that. The first step of a state
(and of a resumed run) learns the groups at its last bucket and runs without overlap.

Within a group, a bucketed scheme (fixed-size buckets of values, :func:`_bucketed`) sends each tensor
of at least :data:`OWN_CALL_NUMEL` values through a protocol call of its own, averaged in place in
DDP's buffer, and the smaller ones concatenated (model order) through one call keyed ``group{g}``;
layer-wise schemes (TernGrad's per-layer scaler, paper 001) get one call per tensor. Error-feedback
residuals are keyed by parameter name (or ``group{g}``). Under ``strategy="auto"`` a payload of at most
:data:`SMALL_PAYLOAD` bytes is all-gathered rather than scattered (one exchange instead of two).

Policy (kept in float32): tensors with fewer than ``min_numel`` elements (QSGD's experiments left
tensors below 10 000 elements unquantized, paper 000 §4), 1-D tensors (biases, norm scales) when
``keep_1d_fp32``, parameters named in ``uncompressed`` (TernGrad §4.2 keeps the last classifier in
full precision), and every parameter during the first ``warmup_steps`` steps. They are averaged by the
step's LAST collective, concatenated in model order (so each value's place, which fixes the order gloo's
ring adds it up in on 3 or more ranks, depends on the model alone: resumed runs stay bit-identical),
followed by two values: the step's agreement (below). A small vector goes through one all-to-all and
is added up in rank order (:func:`gradq.comm._util.sum_over_ranks`).

Randomness **[decided]**: a protocol call keyed ``k`` (a parameter name or ``group{g}``) at step ``t``
uses ``derive_seed(derive_seed(seed, None, t), None, k)``, a pure function of (run seed, step, key); the
protocols derive the per-rank encode seeds from it. So a run resumed from :meth:`GradqState.state_dict`
reproduces the uninterrupted run bit for bit.

Non-finite gradients and damaged payloads **[decided]**: nobody stops mid-step, so no rank waits alone
in a collective. A rank whose group holds a non-finite value encodes zeros in its place and counts it;
payloads whose CRC-32 fails are counted where they arrive; the step's last collective sums both counts
over the ranks (on a GPU the count stays on the device until then: the host reads it once per step).
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
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from .comm import derive_seed
from .comm.api import average, choose_protocol
from .comm.allgather import AllgatherPipeline
from .comm.allreduce import shared_scale_allreduce_many
from .comm.scatter import ScatterPipeline
from .comm._util import check_timeout, collective, sum_over_ranks, time_limit
from .errors import CommunicationError, NonFiniteError, PayloadError
from .quantizers.base import Quantizer
from .spec import build
from .transforms import ErrorFeedback

__all__ = ["GradqState", "gradq_hook", "register", "DEFAULT_TIMEOUT"]

logger = logging.getLogger(__name__)

STRATEGIES = ("auto", "allreduce", "scatter", "allgather", "ps")
NAN_POLICIES = ("raise", "skip")
#: seconds a collective of the hook may wait for the other ranks before the step fails (``timeout=``):
#: long enough for a first step that compiles kernels on a loaded machine, far below gloo's 30 minutes
DEFAULT_TIMEOUT = 300.0
#: under ``strategy="auto"``, quantized payloads up to this many bytes are all-gathered, not scattered
SMALL_PAYLOAD = 64 * 1024
#: under a bucketed scheme, tensors of at least this many values get a protocol call of their own,
#: averaged in place in DDP's bucket; smaller ones are concatenated into one call per group
OWN_CALL_NUMEL = 1 << 18


class GradqState:
    """State of :func:`gradq_hook`: the quantizer, the policy, the step counter and statistics.

    Args:
        spec: a spec string (``"qsgd:bits=4"``, ``"topk:ratio=0.1,ef=1"``…) or a built Quantizer.
        strategy: ``"auto"`` (default), ``"allreduce"``, ``"scatter"``, ``"allgather"`` or ``"ps"``.
            ``"auto"`` picks the integer all-reduce for summable schemes, scatter/all-gather for
            fixed-width ones, all-gather otherwise, and a local encode/decode when the group has one rank.
        process_group: the group to average over (``None``: the default group).
        seed: run seed common to all ranks (default 0).
        min_numel: parameters with fewer elements stay float32 (default 10 000).
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
            has no checksum. Equal on every rank.
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
                 seed: int = 0, min_numel: int = 10_000, keep_1d_fp32: bool = True,
                 uncompressed: Iterable[str] = (), warmup_steps: int = 0, nan_policy: str = "raise",
                 measure_error: bool = False, module: Optional[torch.nn.Module] = None,
                 timeout: Optional[float] = DEFAULT_TIMEOUT, checksum: bool = True,
                 group_mb: float = 25.0) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if int(min_numel) < 0 or int(warmup_steps) < 0:
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
        self.min_numel = int(min_numel)
        self.keep_1d_fp32 = bool(keep_1d_fp32)
        self.uncompressed = frozenset(str(n) for n in uncompressed)
        self.warmup_steps = int(warmup_steps)
        self.nan_policy = nan_policy
        self.measure_error = bool(measure_error)
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
                           "groups": len(work.launched)}
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
        return {"spec": self.spec, "strategy": self.strategy, "seed": self.seed, "min_numel": self.min_numel,
                "keep_1d_fp32": self.keep_1d_fp32, "uncompressed": sorted(self.uncompressed),
                "warmup_steps": self.warmup_steps, "nan_policy": self.nan_policy, "group_mb": self.group_mb}

    def _check_consistency(self, device: torch.device) -> None:
        """One MAX all-reduce of ``(h, −h)`` per setting (MAX and MIN at once); raise naming mismatches."""
        items = {**self.settings(), "step": self.step, "measure_error": self.measure_error, "checksum": self.checksum}
        keys = list(items)
        vals = [zlib.crc32(repr(items[k]).encode("utf-8")) for k in keys]
        t = torch.tensor(vals + [-v for v in vals], dtype=torch.int64, device=device)
        collective("the check that every rank registered the same settings", dist.all_reduce, t,
                   op=dist.ReduceOp.MAX, group=self.process_group)
        hi, lo = t[: len(keys)].tolist(), [-v for v in t[len(keys):].tolist()]
        bad = [k for i, k in enumerate(keys) if hi[i] != lo[i]]
        if bad:
            mine = ", ".join(f"{k}={items[k]!r}" for k in bad)
            raise ValueError(f"gradq_hook: ranks disagree on {', '.join(bad)} (this rank: {mine}); every rank "
                             "must register the same spec and settings (and resume from the same step)")
        self._checked = True

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step, seed, spec/settings, skipped steps and the error-feedback residuals (by parameter name)."""
        q = self.quantizer
        return {"step": self.step, "skipped_steps": self.skipped_steps, "settings": self.settings(),
                "residuals": q.state_dict()["residuals"] if isinstance(q, ErrorFeedback) else {}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the spec and settings must match this state's."""
        saved = dict(state["settings"])
        mine = self.settings()
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

    def _keeps_fp32(self, name: str, p: torch.Tensor) -> bool:
        return (self.step < self.warmup_steps or p.numel() < self.min_numel or name in self.uncompressed
                or (self.keep_1d_fp32 and p.dim() <= 1))


@dataclass(frozen=True)
class _Group:
    """One unit of the hook's communication: parameters (in model order) averaged by one job.

    Groups are a pure function of the parameters that reach the hook (their names, sizes and model
    order) and of ``group_mb`` — never of DDP's buckets, which DDP rebuilds after the first iteration.
    So each value's position in the float32 all-reduce, the concatenation a bucketed scheme encodes and
    the error-feedback keys are the same in every run and after a resume (bit-exact results)."""

    index: int
    names: tuple[str, ...]
    numels: tuple[int, ...]


def _make_groups(names: list[str], numels: list[int], cap_bytes: int) -> list[_Group]:
    """Cut the parameters, in REVERSE model order (the order backward produces their gradients, which
    DDP's buckets follow), into groups that each close once they hold ``cap_bytes`` float32 bytes or
    more (so a small tensor joins the next large one instead of making a job of its own); each group
    lists its names in model order."""
    groups: list[_Group] = []
    cur: list[int] = []
    size = 0
    for i in reversed(range(len(names))):
        cur.append(i)
        size += 4 * numels[i]
        if size >= cap_bytes:
            groups.append(_Group(len(groups), tuple(names[j] for j in sorted(cur)),
                                 tuple(numels[j] for j in sorted(cur))))
            cur, size = [], 0
    if cur:
        groups.append(_Group(len(groups), tuple(names[j] for j in sorted(cur)), tuple(numels[j] for j in sorted(cur))))
    return groups


@dataclass
class _Figures:
    """What one step's jobs measured (written by the job thread only; read after the step's last job)."""

    bytes_sent: int = 0
    quantized_coords: int = 0
    encode_s: float = 0.0
    comm_s: float = 0.0
    decode_s: float = 0.0
    err2: float = 0.0
    ref2: float = 0.0
    damaged: int = 0
    damaged_what: list[str] = field(default_factory=list)
    nonfinite_names: list[str] = field(default_factory=list)
    events: list[tuple[str, Any, Any]] = field(default_factory=list)  # CUDA phase events

    def add_protocol(self, info: Mapping[str, Any], name: Optional[str]) -> None:
        for k in ("encode_s", "comm_s", "decode_s"):
            setattr(self, k, getattr(self, k) + info.get(k, 0.0))
        self.damaged += info.get("damaged", 0)
        self.damaged_what += [w if name is None else f"{name}: {w}" for w in info.get("damaged_what", [])]


class _Step:
    """The hook's bookkeeping for one DDP step: its buckets, its groups and their jobs, its figures.

    DDP calls the hook bucket by bucket, in bucket order (the same on every rank). A group's job starts
    as soon as every parameter of the group has arrived, and runs — encode, collectives, decode — on a
    worker thread (CPU) or on a side CUDA stream, while the backward pass goes on computing the next
    gradients. A bucket's future completes when every group that touches it has written its average
    into the bucket; nothing writes into a bucket after that. At the last bucket the remaining groups
    start, the last job also carries the step's agreement on non-finite and damaged values (two more
    values in its float32 all-reduce, or one small all-reduce), and the hook waits for the jobs: the
    backward pass is over by then, so the wait hides nothing it could overlap. The first step of a
    state (or after a resume) knows the groups only at the last bucket, so it runs without overlap."""

    def __init__(self, state: "GradqState", bucket_device: torch.device, rank: int, world: int, strategy: str):
        self.state = state
        self.device = bucket_device
        self.cuda = bucket_device.type == "cuda"
        self.rank, self.world, self.strategy = rank, world, strategy
        self.t0 = time.perf_counter()
        self.coords = 0
        self.views: dict[str, torch.Tensor] = {}
        self.bucket_groups: list[set[int]] = []        # per bucket: the groups still to finish
        self.buckets: list[tuple[torch.Tensor, torch.futures.Future]] = []
        self.bucket_names: list[list[str]] = []
        self.missing: dict[int, int] = {}             # group -> parameters not yet arrived
        self.launched: list[int] = []
        self.fp32: list[tuple[str, torch.Tensor]] = []  # the float32-policy tensors, averaged at the end
        self.t_close: Optional[float] = None  # when the last bucket arrived (the backward pass ended)
        self.pipe: Any = None  # the step's protocol calls, pipelined across groups (scatter or all-gather)
        self.pipe_info: dict[str, Any] = {}
        self.side: list[tuple[str, Any]] = []  # protocol calls queued on the comm lane behind the pipeline's exchanges
        self.jobs: list[Any] = []
        self.error: Optional[BaseException] = None
        self.fig = _Figures()
        self.local_bad: Any = 0                        # non-finite groups here (an int, or a CUDA tensor)
        self.agreed: Any = None                        # (non-finite, damaged) summed over ranks
        self.stream = state._side_stream(bucket_device) if self.cuda else None
        # the step's time limit holds from its first bucket to its end: the pipeline's exchanges run on
        # the comm lane between jobs, and every one of them must fail within it when a peer stalls
        self._limit = ExitStack()
        self._limit.enter_context(time_limit(state.process_group, state.timeout))
        if state._groups is not None:
            self.missing = {g.index: len(g.names) for g in state._groups}

    # -- buckets -----------------------------------------------------------------------------------
    def add_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buf = bucket.buffer()
        params = bucket.parameters()
        names = [self.state._name_of(p) for p in params]
        sizes = [p.numel() for p in params]
        if sum(sizes) != buf.numel():
            raise RuntimeError(f"gradq_hook: bucket {bucket.index()} holds {buf.numel()} values but its "
                               f"parameters have {sum(sizes)}")
        fut: torch.futures.Future = torch.futures.Future(devices=[buf.device]) if self.cuda else torch.futures.Future()
        self.buckets.append((buf, fut))
        self.bucket_names.append(names)
        self.coords += buf.numel()
        for n, v, p in zip(names, torch.split(buf, sizes), params):
            self.views[n] = v.view_as(p) if v.numel() == p.numel() else v
        self.bucket_groups.append(set())
        if self.state._groups is not None:
            self._assign(len(self.buckets) - 1, names)
            ready = []
            for n in names:
                g = self.state._group_of[n]
                self.missing[g] -= 1
                if self.missing[g] == 0:
                    ready.append(g)
            if not bucket.is_last():  # the last bucket's groups run in close(), on this thread
                for g in sorted(ready):
                    self._launch(g)
        return fut

    def _assign(self, b: int, names: list[str]) -> None:
        owner = self.state._group_of
        unknown = [n for n in names if n not in owner]
        if unknown:
            raise RuntimeError(f"gradq_hook: parameter(s) {unknown[:4]} reached the hook but were not in the "
                               "model's first step; a model whose parameters change needs a new GradqState")
        self.bucket_groups[b] = {owner[n] for n in names} | {-1}  # -1: the step's last job (float32, agreement)
        if not self.bucket_groups[b]:
            self._complete(b)

    def release(self) -> None:
        """Give the process group its own time limit back (idempotent)."""
        self._limit.close()

    def close(self) -> None:
        """At the last bucket: run the remaining groups (the first step: all of them) and wait. The
        backward pass is over, so they run on this thread, after the jobs already queued (no hand-off)."""
        state = self.state
        self.t_close = time.perf_counter()
        if state._groups is None:  # the first step: the groups are known now
            state._build_groups(list(self.views))
            for b, names in enumerate(self.bucket_names):
                self._assign(b, names)
        absent = [n for g in state._groups for n in g.names if n not in self.views]  # type: ignore[union-attr]
        if absent:
            raise RuntimeError(f"gradq_hook: parameter(s) {absent[:4]} got no gradient this step; a model whose "
                               "parameters change needs a new GradqState")
        rest = [g.index for g in state._groups if g.index not in self.launched]  # type: ignore[union-attr]
        if not rest and self.launched:  # every group is running: the agreement gets a job of its own
            self._submit(lambda: self._run(None, True))
        for i, g in enumerate(rest):
            self._launch(g, agree=i == len(rest) - 1)
        self._wait()

    # -- jobs --------------------------------------------------------------------------------------
    def _launch(self, g: int, agree: bool = False) -> None:
        self.launched.append(g)
        group = self.state._groups[g]  # type: ignore[index]
        self._submit(lambda: self._run(group, agree))

    def _submit(self, fn: Callable[[], None]) -> None:
        if self.cuda:  # on the side stream, in order, after the backward's writes; the host never waits here
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # type: ignore[union-attr]
            with torch.cuda.stream(self.stream):
                fn()
            return
        from .comm.scatter import _lane

        if self.t_close is None:
            self.jobs.append(_lane("gradq-hook").submit(fn))
            return
        for job in self.jobs:  # the tail: after the queued jobs, in order, on this thread
            job.result()
        self.jobs = []
        fn()

    def _run(self, group: Optional[_Group], agree: bool) -> None:
        """One job: average ``group`` (``None``: only the agreement), then complete the buckets it was
        the last to finish — also after an error, so that DDP never waits for a future forever."""
        try:
            if self.error is None:
                if group is None:
                    self._agree()
                else:
                    self._average(group, agree)
        except BaseException as exc:  # raised by the hook once the step's jobs are done
            if self.error is None:
                self.error = exc
        finally:
            done = {-1} if agree else set()
            if group is not None:
                done.add(group.index)
            for b, pending in enumerate(self.bucket_groups):
                if pending & done:
                    pending -= done
                    if not pending:
                        self._complete(b)

    def _complete(self, b: int) -> None:
        buf, fut = self.buckets[b]
        fut.set_result(buf)  # on CUDA inside the side stream: the future records its event there

    def _average(self, group: _Group, agree: bool) -> None:
        """Average one group in place: its quantized parameters through the protocol, its float32 ones
        (and, for the step's last job, the agreement values) in one all-reduce, in model order."""
        state, fig = self.state, self.fig
        views = [self.views[n] for n in group.names]
        self._check_finite(group, views)
        q_parts = [(n, v) for n, v in zip(group.names, views) if not state._keeps_fp32(n, v)]
        fp32 = [(n, v) for n, v in zip(group.names, views) if state._keeps_fp32(n, v)]
        if q_parts:
            step_seed = derive_seed(state.seed, None, state.step)
            small: list[tuple[str, torch.Tensor]] = []
            if self.strategy == "scatter" and _bucketed(state.quantizer):
                # large tensors are averaged in place in DDP's bucket (no copies); two or more small
                # ones share one protocol call on their concatenation (model order), keyed by the group
                small = [(n, v) for n, v in q_parts if v.numel() < OWN_CALL_NUMEL]
                if len(small) < 2:
                    small = []
            if self.strategy == "allreduce" and len(q_parts) > 1:
                self._summable(q_parts, step_seed)  # one exchange for all statistics, one for all codes
                q_parts = []
            alone = {n for n, _ in small}
            for n, v in q_parts:
                if n not in alone:
                    self._quantized(v.view(-1) if v.is_contiguous() else v, n, derive_seed(step_seed, None, n))
            if small:
                key = f"group{group.index}"
                flat = torch.cat([v.reshape(-1) for _, v in small])
                self._quantized(flat, key, derive_seed(step_seed, None, key))
                for (_, v), part in zip(small, torch.split(flat, [v.numel() for _, v in small])):
                    v.copy_(part.view_as(v))
        self.fp32 += fp32  # averaged by the step's last job, with the agreement
        if agree:
            self._agree()

    def _check_finite(self, group: _Group, views: list[torch.Tensor]) -> None:
        """Count a group holding non-finite values on this rank and encode zeros in its place, so every
        rank still runs the same collectives (the step is refused or skipped once all agree on it)."""
        if not views:
            return
        total = torch.stack([v.sum(dtype=torch.float32) for v in views]).sum()
        bad = ~torch.isfinite(total)
        if self.cuda:  # no host read: the count stays on the GPU until the step's end
            self.local_bad = self.local_bad + bad.to(torch.float32)
            for v in views:
                v.masked_fill_(bad, 0.0)
            return
        if bool(bad):
            self.local_bad += 1
            self.fig.nonfinite_names += [n for n, v in zip(group.names, views) if not bool(torch.isfinite(v).all())]
            for v in views:
                v.zero_()

    def _protocol_for(self, numel: int) -> str:
        """The protocol for ``numel`` coordinates: the state's, except that under ``strategy="auto"`` a
        payload of at most :data:`SMALL_PAYLOAD` bytes is all-gathered instead of scattered — one
        exchange instead of two, for ``(M−1)·B`` bytes instead of ``2(M−1)/M·B``: at that size a
        round trip costs more than the extra bytes (a pure function of the size: equal on every rank)."""
        if self.strategy != "scatter" or self.state.strategy != "auto":
            return self.strategy
        nbytes = self.state.quantizer.expected_nbytes(numel)
        return "allgather" if nbytes is not None and nbytes <= SMALL_PAYLOAD else "scatter"

    def _quantized(self, x: torch.Tensor, name: str, seed: int) -> None:
        """Average ``x`` in place through the quantized protocol, in the step's one order of collectives."""
        state, fig = self.state, self.fig
        protocol = self._protocol_for(x.numel())
        fig.quantized_coords += x.numel()
        # scatter calls always; all-gathers with 2 ranks (the protocol auto picks there; with more ranks
        # only small payloads are all-gathered, and those go behind the pipeline as calls of their own)
        pipe_kind = protocol if protocol == "scatter" or (protocol == "allgather" and self.world == 2) else None
        if pipe_kind and not state.measure_error and x.dtype == torch.float32 and x.is_contiguous():
            # into the step's pipeline: this group's exchanges overlap the next group's encoding
            self._pipeline(pipe_kind).add(x.view(-1), x.view(-1), seed=seed, name=name)
            return

        def call() -> tuple[dict[str, Any], int, float, float]:
            return self._protocol_call(x, protocol, name, seed)
        if self.pipe is not None and self.pipe.pipelined and protocol != "scatter":
            # the pipeline's exchanges are queued on the comm lane: this call goes behind them, so
            # every rank issues the step's collectives in one order (it holds no lane job of its own)
            from .comm.scatter import _lane

            self.side.append((name, _lane().submit(call)))
            return
        self._flush_pipeline()  # (a scatter call of its own may queue on the lane itself)
        self._collect(*call(), name)

    def _summable(self, parts: list[tuple[str, torch.Tensor]], step_seed: int) -> None:
        """The group's tensors through one shared-scale all-reduce (each keeps its own scale, seed and
        error-feedback key; their statistics and codes travel together)."""
        state = self.state
        self._flush_pipeline()
        info: dict[str, Any] = {"cuda_events": []} if self.cuda else {}
        exact = None
        if state.measure_error:  # the exact average of all of them, for the error report (one float32 sum)
            exact, _ = sum_over_ranks(torch.cat([v.detach().reshape(-1) for _, v in parts]).float(),
                                      state.process_group, what="the exact all-reduce for the error measurement")
            exact.div_(self.world)
        outs = shared_scale_allreduce_many([v for _, v in parts], state.quantizer, group=state.process_group,
                                           seeds=[derive_seed(step_seed, None, n) for n, _ in parts],
                                           names=[n for n, _ in parts], info=info)
        for (_, v), o in zip(parts, outs):
            v.copy_(o.view_as(v))
        self.fig.quantized_coords += sum(v.numel() for _, v in parts)
        err2 = ref2 = 0.0
        if exact is not None:  # (a host read: only when the user asked for the error)
            got = torch.cat([v.detach().reshape(-1) for _, v in parts]).double()
            err2 = float((got - exact.double()).square().sum())
            ref2 = float(exact.double().square().sum())
        self._collect(info, int(info["bytes_sent"]), err2, ref2, None)

    def _protocol_call(self, x: torch.Tensor, protocol: str, name: str,
                       seed: int) -> tuple[dict[str, Any], int, float, float]:
        """One protocol call; returns its figures (added up by the job thread: :meth:`_collect`)."""
        state = self.state
        info: dict[str, Any] = {"cuda_events": []} if self.cuda else {}
        exact = None
        if state.measure_error:  # the exact average, for the error report (costs an fp32 all-reduce)
            exact, _ = sum_over_ranks(x.detach().reshape(-1).clone(), state.process_group,
                                      what="the exact all-reduce for the error measurement")
            exact = exact.view_as(x).div_(self.world)
        _, nbytes = average(x, state.quantizer, protocol, group=state.process_group, seed=seed, name=name,
                            rank=self.rank, out=x, info=info, verify=False,  # sizes: DDP's; spec: checked at step 0
                            checksum=state.checksum, defer_damage=True)    # damage: agreed at the step's end
        err2 = ref2 = 0.0
        if exact is not None:  # (a host read: only when the user asked for the error)
            err2 = float((x.detach().double() - exact.double()).square().sum())
            ref2 = float(exact.double().square().sum())
        return info, nbytes, err2, ref2

    def _collect(self, info: dict[str, Any], nbytes: int, err2: float, ref2: float, name: Optional[str]) -> None:
        fig = self.fig
        fig.add_protocol(info, name)
        fig.events += info.get("cuda_events", [])
        fig.bytes_sent += nbytes
        fig.err2 += err2
        fig.ref2 += ref2

    def _pipeline(self, kind: str) -> Any:
        """The step's pipeline of protocol calls (created at its first call; one kind per step: the
        scatter protocol, or with 2 ranks the all-gather)."""
        if self.pipe is None:
            self.pipe_info = {"cuda_events": self.fig.events} if self.cuda else {}
            cls = ScatterPipeline if kind == "scatter" else AllgatherPipeline
            self.pipe = cls(self.state.quantizer, group=self.state.process_group, checksum=self.state.checksum,
                            info=self.pipe_info, device=self.device)
        return self.pipe

    def _flush_pipeline(self) -> None:
        """Finish the pipeline's segments and the calls queued behind them (before any collective this
        thread issues itself: the step's last one, or a protocol call of its own)."""
        if self.pipe is not None:
            self.pipe.flush()
            self.fig.add_protocol(self.pipe_info, None)  # (its notes name the tensors)
            self.fig.bytes_sent += self.pipe.sent
            self.pipe = None
        side, self.side = self.side, []
        for name, job in side:
            self._collect(*job.result(), name)

    def _fp32(self, parts: list[tuple[str, torch.Tensor]], tail: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """One float32 all-reduce of ``parts`` (model order) followed by ``tail``; returns the summed tail."""
        t = time.perf_counter()
        dtype = parts[0][1].dtype if parts else torch.float32
        pieces = [v.reshape(-1) for _, v in parts] + ([tail.to(dtype)] if tail is not None else [])
        flat = torch.cat(pieces)
        flat, sent = sum_over_ranks(flat, self.state.process_group, what="the float32 all-reduce")
        n = flat.numel() - (0 if tail is None else tail.numel())
        body = flat[:n].div_(self.world)
        for (_, v), part in zip(parts, torch.split(body, [v.numel() for _, v in parts])):
            v.copy_(part.view_as(v))
        self.fig.bytes_sent += sent
        if not self.cuda:
            self.fig.comm_s += time.perf_counter() - t
        return None if tail is None else flat[n:]

    def _agree(self) -> None:
        """The step's last collective: the float32-policy tensors of every group (in model order, so each
        value's place in the buffer, and the order gloo's ring adds it in, depends on the model alone)
        followed by this rank's non-finite groups and damaged payloads, summed over ranks."""
        self._flush_pipeline()
        local = torch.zeros(2, dtype=torch.float32, device=self.device)
        local[0] = self.local_bad if not isinstance(self.local_bad, int) else float(self.local_bad)
        local[1] = float(self.fig.damaged)
        parts = sorted(self.fp32, key=lambda nv: self.state._order.get(nv[0], -1))
        self.agreed = self._fp32(parts, local)

    def _wait(self) -> None:
        """Wait for every job of the step (the host reads the agreement once per step), then finish."""
        state = self.state
        if self.cuda:
            self.stream.synchronize()  # type: ignore[union-attr]
        else:
            for job in self.jobs:
                job.result()
        wait_s = time.perf_counter() - (self.t_close or time.perf_counter())
        if self.error is not None:
            raise self.error
        bad, damaged = (int(v) for v in self.agreed.tolist()) if self.agreed is not None else (0, 0)
        state._finish_step(self, wait_s, skipped=bool(bad or damaged))
        if bad:
            self._refuse_nonfinite(bad)
        if damaged:
            self._refuse_damaged(damaged)

    # -- refusing a step ---------------------------------------------------------------------------
    def _refuse_nonfinite(self, bad: int) -> None:
        state = self.state
        if state.nan_policy == "raise":
            names = self.fig.nonfinite_names
            where = (f"parameter(s) {names} on rank {self.rank}" if names else
                     "a gradient on this rank" if self.cuda and float(self.local_bad) else "another rank's gradient")
            raise NonFiniteError(f"gradq_hook: non-finite gradient in {where} at step {state.step - 1}; "
                                 "fix the model or register with nan_policy='skip'")
        self._zero_after_ddp()

    def _refuse_damaged(self, damaged: int) -> None:
        state = self.state
        what = self.fig.damaged_what
        mine = f"; on this rank: {', '.join(what[:4])}" if what else ""
        if state.nan_policy == "raise":
            raise PayloadError(f"gradq_hook: step {state.step - 1}: {damaged} payload(s) arrived damaged (CRC-32 "
                               f"mismatch){mine}; the step is refused on every rank (nan_policy='skip' skips it)")
        logger.warning("gradq_hook: step %d skipped on every rank: %d payload(s) arrived damaged%s",
                       state.step - 1, damaged, mine)
        self._zero_after_ddp()

    def _zero_after_ddp(self) -> None:
        """A skipped step: zero the gradients once DDP has copied the averages into them. The bucket
        futures keep their results; the zeroing is queued behind DDP's own end-of-backward callback."""
        params = list(self.state._params.values())
        engine = torch.autograd.Variable._execution_engine

        def zero() -> None:
            for p in params:
                if p.grad is not None:
                    p.grad.zero_()

        # DDP queues its finalizer after this hook returns: a callback queued now runs before it, and
        # one queued from that callback runs after it
        engine.queue_callback(lambda: engine.queue_callback(zero))


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


def _bucketed(q: Quantizer) -> bool:
    """Whether ``q`` quantizes fixed-size buckets (not whole layers), so that tensors may be
    concatenated before encoding without changing what a scale covers beyond bucket edges."""
    inner = getattr(q, "inner", q)
    return not q.layerwise and isinstance(getattr(inner, "bucket", None), int)


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, spec: str | Quantizer,
             strategy: str = "auto", **kw: Any) -> GradqState:
    """Quantize ``ddp_model``'s gradient averaging with ``spec``; returns the hook's :class:`GradqState`.

    ``kw`` are :class:`GradqState`'s keyword arguments (``process_group`` defaults to the DDP model's)."""
    if not hasattr(ddp_model, "register_comm_hook"):
        raise TypeError(f"register needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    kw.setdefault("process_group", getattr(ddp_model, "process_group", None))
    cap = getattr(ddp_model, "bucket_bytes_cap", None)
    if isinstance(cap, int) and cap > 0:
        kw.setdefault("group_mb", cap / 2 ** 20)
    state = GradqState(spec, strategy, module=ddp_model, **kw)
    ddp_model.register_comm_hook(state, gradq_hook)
    return state
