"""The DDP hook's work for one step: parameter groups, their jobs, and the step's figures.

:mod:`gradq.ddp` holds the hook and its checkpointable state; this module holds what one step does
with them (its module docstring describes the behaviour): :class:`_Group` (a unit of communication, a
pure function of the model), :class:`_Step` (the step's buckets, jobs, pipeline of protocol calls and
agreement) and :class:`_Figures` (what the step measured).
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from .comm import derive_seed
from .comm.allgather import AllgatherPipeline
from .comm.allreduce import shared_scale_allreduce_many
from .comm.api import average
from .comm.scatter import ScatterPipeline
from .comm._util import sum_over_ranks, time_limit
from .errors import NonFiniteError, PayloadError
from .quantizers.base import Quantizer

if TYPE_CHECKING:
    from .ddp import GradqState

logger = logging.getLogger("gradq.ddp")

#: under ``strategy="auto"``, quantized payloads up to this many bytes are all-gathered, not scattered
SMALL_PAYLOAD = 64 * 1024
#: under a bucketed scheme, tensors of at least this many values get a protocol call of their own,
#: averaged in place in DDP's bucket; smaller ones are concatenated into one call per group
OWN_CALL_NUMEL = 1 << 18


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
    invalid: Any = 0   # payloads whose decode found codes no encode writes (an int, or a count on the GPU)
    nonfinite_names: list[str] = field(default_factory=list)
    events: list[tuple[str, Any, Any]] = field(default_factory=list)  # CUDA phase events

    def add_protocol(self, info: Mapping[str, Any], name: Optional[str]) -> None:
        for k in ("encode_s", "comm_s", "decode_s"):
            setattr(self, k, getattr(self, k) + info.get(k, 0.0))
        self.damaged += info.get("damaged", 0)
        self.invalid = self.invalid + info.get("invalid", 0)
        self.damaged_what += [w if name is None else f"{name}: {w}"
                              for w in info.get("damaged_what", []) + info.get("invalid_what", [])]


class _Step:
    """The hook's bookkeeping for one DDP step: its buckets, its groups and their jobs, its figures.

    DDP calls the hook bucket by bucket, in bucket order (the same on every rank). A group's job starts
    as soon as every parameter of the group has arrived, and runs — encode, collectives, decode — on a
    worker thread (CPU) or on a side CUDA stream, while the backward pass goes on computing the next
    gradients. A bucket's future completes when every group that touches it has written its average
    into the bucket; nothing writes into a bucket after that. At the last bucket the remaining groups
    start, the last job also carries the step's agreement on non-finite and damaged values (two more
    values in its float32 all-reduce, which under the integer all-reduce rides in the exchange of the
    scale statistics; or one small all-reduce), and the hook waits for the jobs: the
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
        """Average one group in place: its quantized parameters through the protocol; its float32 ones
        wait for the step's last job, which sums them (in model order) with the agreement values."""
        state = self.state
        views = [self.views[n] for n in group.names]
        self._check_finite(group, views)
        q_parts = [(n, v) for n, v in zip(group.names, views) if not state._keeps_fp32(n, v)]
        fp32 = [(n, v) for n, v in zip(group.names, views) if state._keeps_fp32(n, v)]
        self.fp32 += fp32  # averaged by the step's last job, with the agreement
        step_seed = derive_seed(state.seed, None, state.step)
        if q_parts and self.strategy == "allreduce":
            # one exchange for all statistics, one for all codes; in the step's last job the float32
            # tensors and the agreement are summed with the statistics (no round of their own)
            self._summable(q_parts, step_seed, agree)
            return
        small: list[tuple[str, torch.Tensor]] = []
        if self.strategy == "scatter" and _bucketed(state.quantizer):
            # large tensors are averaged in place in DDP's bucket (no copies); two or more small ones
            # share one protocol call on their concatenation (model order), keyed by the group
            small = [(n, v) for n, v in q_parts if v.numel() < OWN_CALL_NUMEL]
            if len(small) < 2:
                small = []
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

    def _summable(self, parts: list[tuple[str, torch.Tensor]], step_seed: int, agree: bool = False) -> None:
        """The group's tensors through one shared-scale all-reduce (each keeps its own scale, seed and
        error-feedback key; their statistics and codes travel together). With ``agree`` (the step's
        last job) the float32 tensors and the agreement values are summed with the statistics."""
        state = self.state
        self._flush_pipeline()
        info: dict[str, Any] = {"cuda_events": []} if self.cuda else {}
        fp32, extra = self._agreement() if agree else ([], None)
        if extra is not None and extra.dtype != torch.float32:  # (half-precision buckets: a round of its own)
            self._agree()
            extra = None
        exact = None
        if state.measure_error:  # the exact average of all of them, for the error report (one float32 sum)
            exact, _ = sum_over_ranks(torch.cat([v.detach().reshape(-1) for _, v in parts]).float(),
                                      state.process_group, what="the exact all-reduce for the error measurement")
            exact.div_(self.world)
        # each average decoded straight into its gradient's view of the bucket (read by the encode by then)
        shared_scale_allreduce_many([v for _, v in parts], state.quantizer, group=state.process_group,
                                    seeds=[derive_seed(step_seed, None, n) for n, _ in parts],
                                    names=[n for n, _ in parts], info=info, extra=extra,
                                    check_finite=False,   # (screened by _check_finite)
                                    defer_damage=True,    # (corrupt codes: refused at the step's end)
                                    outs=[v for _, v in parts])
        if extra is not None:
            self.agreed = self._spread(fp32, info["extra_sum"])
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
                            checksum=state.checksum, defer_damage=True,    # damage: agreed at the step's end
                            check_finite=False)  # (screened by _check_finite: no host read per payload)
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
                            info=self.pipe_info, device=self.device, check_finite=False)  # (screened: _check_finite)
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

    def _agreement(self) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
        """The step's float32-policy tensors of every group in model order (so each value's place in
        the vector, and the order a ring adds it in, depends on the model alone), and the vector to sum
        over ranks: their values, then this rank's non-finite groups and damaged payloads."""
        self._flush_pipeline()  # (the pipeline's damaged payloads are counted once it is flushed)
        parts = sorted(self.fp32, key=lambda nv: self.state._order.get(nv[0], -1))
        dtype = parts[0][1].dtype if parts else torch.float32
        local = torch.zeros(2, dtype=dtype, device=self.device)
        local[0] = self.local_bad if not isinstance(self.local_bad, int) else float(self.local_bad)
        # damaged payloads and those with codes no encode writes (counted on the GPU: no host read)
        local[1] = float(self.fig.damaged)
        local[1] += self.fig.invalid
        return parts, torch.cat([v.reshape(-1) for _, v in parts] + [local])

    def _spread(self, parts: list[tuple[str, torch.Tensor]], summed: torch.Tensor) -> torch.Tensor:
        """Write the averages of ``parts`` from their sum over ranks; returns the summed agreement."""
        n = summed.numel() - 2
        body = summed[:n].div_(self.world)
        for (_, v), part in zip(parts, torch.split(body, [v.numel() for _, v in parts])):
            v.copy_(part.view_as(v))
        return summed[n:]

    def _agree(self) -> None:
        """The step's last collective, when it has none to ride in: the float32-policy tensors and the
        agreement values (:meth:`_agreement`), summed over ranks."""
        parts, flat = self._agreement()
        t = time.perf_counter()
        flat, sent = sum_over_ranks(flat, self.state.process_group, what="the float32 all-reduce")
        self.fig.bytes_sent += sent
        if not self.cuda:
            self.fig.comm_s += time.perf_counter() - t
        self.agreed = self._spread(parts, flat)

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
                               f"mismatch, or corrupt codes){mine}; the step is refused on every rank "
                               "(nan_policy='skip' skips it)")
        logger.warning("gradq_hook: step %d skipped on every rank: %d payload(s) arrived damaged (CRC-32 mismatch, "
                       "or corrupt codes)%s", state.step - 1, damaged, mine)
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


def _bucketed(q: Quantizer) -> bool:
    """Whether ``q`` quantizes fixed-size buckets (not whole layers), so that tensors may be
    concatenated before encoding without changing what a scale covers beyond bucket edges."""
    inner = getattr(q, "inner", q)
    return not q.layerwise and isinstance(getattr(inner, "bucket", None), int)
