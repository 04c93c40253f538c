"""A DistributedDataParallel communication hook that quantizes gradients with any gradq scheme.

DDP hands the hook one *bucket* at a time: a flat buffer holding the concatenated gradients
``g^m = (g^m_1, …, g^m_L)`` of the bucket's parameters on worker ``m``. The hook returns, on every rank,

    ĝ_l = mean_m g^m_l                          for parameters kept in float32 (the policy below),
    ĝ_l = protocol(g^m_l, Q, name=l, seed=s_l)  for every other parameter,

where ``protocol`` is one of gradq.comm's (ALGORITHMS.md §6): the shared-scale integer all-reduce for
summable quantizers, scatter/all-gather for fixed-width ones, all-gather otherwise (or a parameter
server), each returning the same average of decoded gradients on every rank. The buffer is split at
the parameter boundaries, so layer-wise schemes (TernGrad's per-layer scaler, paper 001) see layers,
and error-feedback residuals are keyed by PARAMETER NAME — DDP rebuilds its buckets after the first
iteration, so bucket indices are not stable keys.

Policy (kept in float32; averaged by ONE all-reduce per step, at the last bucket, of all of them
concatenated in the model's parameter order — **[decided]** with 3 or more ranks the ring's float
summation order depends on an element's position in the buffer, so the layout must not follow DDP's
bucketing, which its rebuild after the first iteration changes; in model order a resumed run stays
bit-identical to an uninterrupted one, and a step costs one collective instead of one per tensor):
tensors with fewer than ``min_numel`` elements (QSGD's experiments left tensors below 10 000 elements
unquantized, paper 000 §4), 1-D tensors (biases, norm scales) when ``keep_1d_fp32``, parameters named
in ``uncompressed`` (TernGrad §4.2 keeps the last classifier in full precision), and every parameter
during the first ``warmup_steps`` steps.

Randomness **[decided]**: parameter ``l`` at step ``t`` uses ``s_l = derive_seed(derive_seed(seed, None, t), None, l)``,
a pure function of (run seed, step, name); the protocols derive the per-rank encode seeds from it. So a
run resumed from :meth:`GradqState.state_dict` reproduces the uninterrupted run bit for bit.

Non-finite gradients **[decided]**: each bucket's ranks agree on a flag (one MAX all-reduce) so that no
rank waits alone in a collective. ``nan_policy="raise"`` raises :class:`NonFiniteError` on EVERY rank (the
rank that saw it names the parameters). ``"skip"`` zeroes that bucket, the step's later buckets and the
earlier ones (their buffers are still DDP's until the backward pass finishes), on every rank; residuals
that earlier buckets of that step already updated are kept; the optimizer then sees zero gradients
(check ``state.last_stats["skipped"]`` to skip ``optimizer.step()``, e.g. for momentum).

Steps **[decided]**: the counter advances after the bucket DDP marks last; ``no_sync`` iterations never
reach the hook and are not counted.

Wire size per worker and step: ``Σ_l bytes(protocol, n_l)`` for quantized parameters plus
``2(M−1)/M · 4 · n_fp32`` for the float32 group, plus 8 bytes per bucket for the non-finite flag
(and, once, the settings check). ``state.last_stats`` reports the figures.

The hook is **synchronous**: all communication happens inside the call and the returned future is
already completed. This costs the overlap of communication with the rest of the backward pass.
"""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with the real
# ``dist.GradBucket`` / ``torch.futures.Future[torch.Tensor]`` objects, not strings.

import logging
import time
import zlib
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from .comm import derive_seed
from .comm.api import average, choose_protocol
from .comm._util import check_timeout, collective, time_limit
from .comm.allreduce import allreduce_bytes_per_worker
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
            bucket, so the caller's other collectives (evaluation barriers…) keep theirs.
        checksum: payloads of the scatter, all-gather and parameter-server protocols carry a CRC-32
            trailer (4 bytes each, CPU tensors). The ranks agree on damaged payloads in the step's last
            float32 all-reduce (one more value, no extra collective) and refuse the step alike:
            :class:`gradq.PayloadError` on every rank, or with ``nan_policy="skip"`` a skipped step
            (zero gradients, ``skipped_steps`` counts it). The integer all-reduce moves no payload and
            has no checksum. Equal on every rank.

    Attributes: ``step`` (completed hook steps), ``skipped_steps``, ``last_stats`` (dict of the last step:
    ``bytes_sent`` per worker, ``coords``, ``quantized_coords``, ``bits_per_coord``, ``seconds`` in the
    hook, of which ``encode_seconds``, ``comm_seconds`` (waiting for the network: the float32
    all-reduces and what the protocols could not hide behind encoding/decoding) and ``decode_seconds``,
    ``skipped``, and ``rel_error`` with ``measure_error``), ``totals`` (cumulative ``bytes_sent``,
    ``coords``, ``seconds``, ``encode/comm/decode_seconds``, ``steps``), ``strategy_used``.
    """

    def __init__(self, spec: str | Quantizer, strategy: str = "auto", *, process_group: Any = None,
                 seed: int = 0, min_numel: int = 10_000, keep_1d_fp32: bool = True,
                 uncompressed: Iterable[str] = (), warmup_steps: int = 0, nan_policy: str = "raise",
                 measure_error: bool = False, module: Optional[torch.nn.Module] = None,
                 timeout: Optional[float] = DEFAULT_TIMEOUT, checksum: bool = True) -> None:
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
        self._order: dict[str, int] = {}  # parameter name -> position in the model (fp32 all-reduce order)
        self._reset_runtime()
        if module is not None:
            self.bind(module)

    def _reset_runtime(self) -> None:
        self._checked = False
        self._pending: dict[str, Any] = self._fresh_pending()
        self._step_buffers: list[torch.Tensor] = []

    @staticmethod
    def _fresh_pending() -> dict[str, Any]:
        return {"bytes_sent": 0, "coords": 0, "quantized_coords": 0, "seconds": 0.0, "skip": False,
                "encode_s": 0.0, "comm_s": 0.0, "decode_s": 0.0, "err2": 0.0, "ref2": 0.0, "fp32": [],
                "batched": [], "damaged": 0, "damaged_what": []}

    # -- names -------------------------------------------------------------------------------------
    def bind(self, module: torch.nn.Module) -> "GradqState":
        """Name the parameters of ``module`` (a model or its DDP wrapper) for the hook."""
        inner = getattr(module, "module", module)
        self._names = {id(p): n for n, p in inner.named_parameters()}
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
                "warmup_steps": self.warmup_steps, "nan_policy": self.nan_policy}

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
        for k in ("process_group", "_names", "_order", "_pending", "_step_buffers", "_checked"):
            d.pop(k, None)
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.process_group = None
        self._names = {}
        self._order = {}
        self._reset_runtime()

    # -- strategy ----------------------------------------------------------------------------------
    def _resolve_strategy(self, world: int) -> str:
        if self.strategy != "auto":
            return self.strategy
        return choose_protocol(self.quantizer, world)

    def _keeps_fp32(self, name: str, p: torch.Tensor) -> bool:
        return (self.step < self.warmup_steps or p.numel() < self.min_numel or name in self.uncompressed
                or (self.keep_1d_fp32 and p.dim() <= 1))


def _communicate(state: GradqState, strategy: str, x: torch.Tensor, name: str, seed: int,
                 rank: int) -> int:
    """Average ``x`` over the group through ``strategy``, in place; returns the bytes this worker sent
    and adds the protocol's encode/comm/decode seconds to the step's figures."""
    info: dict[str, Any] = {}
    _, nbytes = average(x, state.quantizer, strategy, group=state.process_group, seed=seed, name=name,
                        rank=rank, out=x, info=info, verify=False,  # sizes: DDP's; spec: checked at step 0
                        checksum=state.checksum, defer_damage=True)  # damage: agreed at the step's end
    pend = state._pending
    for k in ("encode_s", "comm_s", "decode_s"):
        pend[k] += info.get(k, 0.0)
    pend["damaged"] += info.get("damaged", 0)
    pend["damaged_what"] += [f"{name}: {w}" for w in info.get("damaged_what", [])]
    return nbytes


def gradq_hook(state: GradqState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients, quantizing the parameters outside the
    float32 policy (module docstring). Synchronous: the returned future is already completed.

    Raises :class:`gradq.CommunicationError` (naming the step and the collective) when another rank
    dies or stalls past ``state.timeout``.

    Example::

        state = GradqState("qsgd:bits=4", module=ddp_model)
        ddp_model.register_comm_hook(state, gradq_hook)
    """
    try:
        with time_limit(state.process_group, state.timeout):
            return _hook(state, bucket)
    except CommunicationError as exc:
        if exc.step is not None:
            raise
        err = exc.within(f"gradq_hook: step {state.step} (bucket {bucket.index()})", step=state.step)
        err.args = (f"{err}. The process group cannot be used any more; end this process (the other ranks "
                    "fail the same way).",)
        raise err from exc


def _hook(state: GradqState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    t0 = time.perf_counter()
    group = state.process_group
    buf = bucket.buffer()
    if bucket.index() == 0:
        state._pending = state._fresh_pending()
        state._step_buffers = []
    if not state._checked:
        state._check_consistency(buf.device)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    strategy = state._resolve_strategy(world)
    if state.strategy_used is None:
        state.strategy_used = strategy
        logger.info("gradq_hook: spec=%s strategy=%s (asked %s) world=%d settings=%s", state.spec, strategy,
                    state.strategy, world, state.settings())

    params = bucket.parameters()
    names = [state._name_of(p) for p in params]
    sizes = [p.numel() for p in params]
    if sum(sizes) != buf.numel():
        raise RuntimeError(f"gradq_hook: bucket {bucket.index()} holds {buf.numel()} values but its "
                           f"parameters have {sum(sizes)}")
    views = torch.split(buf, sizes)
    pend = state._pending

    # non-finite check, agreed by all ranks so that nobody waits in a collective alone
    local_bad = not bool(torch.isfinite(buf.sum(dtype=torch.float32))) if buf.numel() else False
    flag = torch.tensor([1 if local_bad else 0], dtype=torch.int32, device=buf.device)
    collective(f"the agreement on non-finite values (bucket {bucket.index()})", dist.all_reduce, flag,
               op=dist.ReduceOp.MAX, group=group)
    if int(flag) or pend["skip"]:
        if state.nan_policy == "raise":
            bad = [n for n, v in zip(names, views) if not bool(torch.isfinite(v).all())]
            where = f"parameter(s) {bad} on rank {rank}" if bad else "another rank's gradient"
            raise NonFiniteError(f"gradq_hook: non-finite gradient in {where} at step {state.step}; "
                                 "fix the model or register with nan_policy='skip'")
        if not pend["skip"]:
            for b in state._step_buffers:
                b.zero_()
        pend["skip"] = True
        buf.zero_()
    else:
        step_seed = derive_seed(state.seed, None, state.step)
        fp32 = [i for i, (n, p) in enumerate(zip(names, params)) if state._keeps_fp32(n, p)]
        # averaged all together by one all-reduce at the step's last bucket (_reduce_fp32)
        pend["fp32"].extend((names[i], views[i]) for i in fp32)
        kept = set(fp32)
        batch = strategy == "scatter" and _bucketed(state.quantizer)
        for i, (n, v) in enumerate(zip(names, views)):
            if i in kept:
                continue
            if batch:  # one protocol call for all of them at the step's last bucket (_reduce_batched)
                pend["batched"].append((n, v))
                continue
            _quantized_average(state, strategy, v, n, derive_seed(step_seed, None, n), rank, group, world)
    state._step_buffers.append(buf)
    if bucket.is_last():
        _reduce_batched(state, strategy, rank, group, world)
        _reduce_fp32(state, group, world)
    pend["coords"] += buf.numel()
    pend["seconds"] += time.perf_counter() - t0
    if bucket.is_last():
        _finish_step(state)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _bucketed(q: Quantizer) -> bool:
    """Whether ``q`` quantizes fixed-size buckets (not whole layers), so that tensors may be
    concatenated before encoding without changing what a scale covers beyond bucket edges."""
    inner = getattr(q, "inner", q)
    return not q.layerwise and isinstance(getattr(inner, "bucket", None), int)


def _quantized_average(state: GradqState, strategy: str, v: torch.Tensor, name: str, seed: int, rank: int,
                       group: Any, world: int) -> None:
    """Average ``v`` in place through the quantized protocol, with the error measurement if asked."""
    pend = state._pending
    exact = None
    if state.measure_error:  # the exact average, for the error report (costs an fp32 all-reduce)
        exact = v.detach().clone()
        collective("the exact all-reduce for the error measurement", dist.all_reduce, exact, group=group)
        exact.div_(world)
    pend["bytes_sent"] += _communicate(state, strategy, v, name, seed, rank)
    pend["quantized_coords"] += v.numel()
    if exact is not None:
        pend["err2"] += float((v.detach().double() - exact.double()).square().sum())
        pend["ref2"] += float(exact.double().square().sum())


def _reduce_batched(state: GradqState, strategy: str, rank: int, group: Any, world: int) -> None:
    """Scatter/all-gather ALL of the step's quantized tensors as one vector (bucketed schemes).

    **[decided]** Concatenated in the model's parameter order (independent of DDP's bucketing, so
    error-feedback memory, kept under the key ``"step"``, and resumed runs stay exact), the step costs
    one protocol call — a few collectives — instead of one per tensor; a bucket of ``d`` values may
    then span the end of one tensor and the start of the next. Layer-wise schemes (one scale per
    tensor) are never batched."""
    pend = state._pending
    parts, pend["batched"] = sorted(pend["batched"], key=lambda nv: state._order.get(nv[0], -1)), []
    if not parts or pend["skip"]:
        return
    flat = torch.cat([v.reshape(-1) for _, v in parts])
    seed = derive_seed(derive_seed(state.seed, None, state.step), None, "step")
    _quantized_average(state, strategy, flat, "step", seed, rank, group, world)
    for (_, v), part in zip(parts, torch.split(flat, [v.numel() for _, v in parts])):
        v.copy_(part.view_as(v))


def _reduce_fp32(state: GradqState, group: Any, world: int) -> None:
    """Average the step's float32-policy tensors of every bucket with ONE all-reduce, which also
    carries this rank's count of damaged payloads (one more value: the ranks agree on it for free).

    They are concatenated in the model's parameter order, so each value's position in the buffer —
    which fixes the order in which gloo's ring adds it up on more than 2 ranks — depends on the model
    alone, not on how DDP (re)buckets the parameters: a resumed run stays bit-exact. The earlier buckets'
    futures are already complete; their buffers are updated in place before DDP reads them (after the
    last bucket's hook). Skipped steps (NaN policy, agreed by every rank) have nothing to average."""
    pend = state._pending
    parts, pend["fp32"] = sorted(pend["fp32"], key=lambda nv: state._order.get(nv[0], -1)), []
    agree = state.checksum and pend["quantized_coords"] > 0 and state.strategy_used not in ("allreduce", "local")
    if pend["skip"] or not (parts or agree):
        return
    t = time.perf_counter()
    dtype = parts[0][1].dtype if parts else torch.float32
    device = parts[0][1].device if parts else state._step_buffers[-1].device
    tail = [torch.tensor([float(pend["damaged"])], dtype=dtype, device=device)] if agree else []
    flat = torch.cat([v.reshape(-1) for _, v in parts] + tail)
    collective(f"the float32 all-reduce of {flat.numel()} values", dist.all_reduce, flat, group=group)
    if agree:
        damaged = int(flat[-1])  # a small count: exact in any float dtype
        flat = flat[:-1]
    flat.div_(world)
    for (_, v), part in zip(parts, torch.split(flat, [v.numel() for _, v in parts])):
        v.copy_(part.view_as(v))
    pend["bytes_sent"] += allreduce_bytes_per_worker(flat.numel() + len(tail), world, flat.dtype)
    pend["comm_s"] += time.perf_counter() - t
    if agree and damaged:
        _refuse_damaged_step(state, damaged)


def _refuse_damaged_step(state: GradqState, damaged: int) -> None:
    """Every rank saw the same count: raise everywhere, or skip the step everywhere (``nan_policy``)."""
    pend = state._pending
    mine = f"; on this rank: {', '.join(pend['damaged_what'][:4])}" if pend["damaged_what"] else ""
    if state.nan_policy == "raise":
        raise PayloadError(f"gradq_hook: step {state.step}: {damaged} payload(s) arrived damaged (CRC-32 "
                           f"mismatch){mine}; the step is refused on every rank (nan_policy='skip' skips it)")
    logger.warning("gradq_hook: step %d skipped on every rank: %d payload(s) arrived damaged%s",
                   state.step, damaged, mine)
    for b in state._step_buffers:
        b.zero_()
    pend["skip"] = True


def _finish_step(state: GradqState) -> None:
    p = state._pending
    coords = p["coords"]
    state.last_stats = {"step": state.step, "bytes_sent": p["bytes_sent"], "coords": coords,
                        "quantized_coords": p["quantized_coords"],
                        "bits_per_coord": 8.0 * p["bytes_sent"] / coords if coords else 0.0,
                        "seconds": p["seconds"], "encode_seconds": p["encode_s"], "comm_seconds": p["comm_s"],
                        "decode_seconds": p["decode_s"], "skipped": p["skip"], "strategy": state.strategy_used}
    if state.measure_error and p["quantized_coords"]:
        state.last_stats["rel_error"] = (p["err2"] / p["ref2"]) ** 0.5 if p["ref2"] > 0 else 0.0
    state.totals["bytes_sent"] += p["bytes_sent"]
    state.totals["coords"] += coords
    state.totals["seconds"] += p["seconds"]
    for k in ("encode", "comm", "decode"):
        state.totals[f"{k}_seconds"] = state.totals.get(f"{k}_seconds", 0.0) + p[f"{k}_s"]
    state.totals["steps"] += 1
    if p["skip"]:
        state.skipped_steps += 1
    state.step += 1
    state._pending = state._fresh_pending()
    state._step_buffers = []


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, spec: str | Quantizer,
             strategy: str = "auto", **kw: Any) -> GradqState:
    """Quantize ``ddp_model``'s gradient averaging with ``spec``; returns the hook's :class:`GradqState`.

    ``kw`` are :class:`GradqState`'s keyword arguments (``process_group`` defaults to the DDP model's)."""
    if not hasattr(ddp_model, "register_comm_hook"):
        raise TypeError(f"register needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    kw.setdefault("process_group", getattr(ddp_model, "process_group", None))
    state = GradqState(spec, strategy, module=ddp_model, **kw)
    ddp_model.register_comm_hook(state, gradq_hook)
    return state
