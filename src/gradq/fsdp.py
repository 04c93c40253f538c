"""Compressed gradient reduce-scatter for models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 does not all-reduce gradients, so a DDP communication hook never runs; it *reduce-scatters*
them: after each FSDP module's backward it copies the unsharded gradients into one flat buffer of
``M·S`` values, laid out so that block ``j`` holds rank ``j``'s shards (in every block the same
parameters at the same offsets: each parameter's padded shard, in the module's parameter order), and
asks a reduce-scatter to leave in every rank's output the reduction of its own block over the ranks.
That is the first phase of gradq's scatter protocol (:mod:`gradq.comm.scatter`), so
:class:`GradqReduceScatter`, installed with ``FSDPModule.set_custom_reduce_scatter``, runs it:

1. each rank encodes its ``M`` blocks with the spec (seed ``derive_seed(seed, rank, "rs<call>:<j>")``:
   independent per rank, block and call; ``call`` counts the reduce-scatters so far, equal on every
   rank because FSDP calls them in the same order). The parameters the policy keeps in full precision
   travel as raw values of FSDP's reduce dtype inside the same payload; the others are encoded together
   (or one by one for layer-wise schemes such as TernGrad, whose scaler is per layer);
2. the packed payloads travel in one ``all_to_all_single`` (sub-byte codes stay packed; a CRC-32
   trailer per payload on CPU tensors; 4 bytes per payload carry the sender's count of non-finite
   values, so every rank learns the same total without a collective of its own);
3. each rank decodes the ``M`` payloads of its block and reduces them into FSDP's output as FSDP's
   ``op`` asks: ``AVG`` the mean (summed in rank order, divided once, as the scatter protocol does),
   ``SUM`` the sum, ``PREMUL_SUM(f)`` ``f`` times the sum. FSDP's pre- and post-divide factors are
   applied by FSDP itself around the call, as for its own reduce-scatter.

Policy (as the DDP hook's, :mod:`gradq.ddp`): a parameter with fewer than ``min_numel`` elements, a
1-D one under ``keep_1d_fp32``, or one named in ``uncompressed`` (its name in the model given to
:func:`register`) is sent in full precision. The layout of a module's buffer is read from FSDP's
parameter group at the first call; if a call's buffer does not match it (a parameter received no
gradient in that backward), that call compresses the whole buffer and ``policy_fallbacks`` counts it.

Hierarchical layout (``intra_node="fp32"``, as ZeRO++'s hierarchical qgZ): with ``L`` ranks per node
(``ranks_per_node``, default ``LOCAL_WORLD_SIZE``), the blocks are first reduce-scattered in full
precision inside each node, so that local rank ``l`` holds its node's sums of the blocks of ranks
``l, L+l, 2L+l, …``; those ``N = M/L`` node sums are then encoded and exchanged by one all-to-all among
the ranks of equal local rank (one per node), decoded and summed. Only ``N−1`` compressed payloads per
rank cross the network instead of ``M−1``, and the fast intra-node links carry the float32 traffic.

Non-finite gradients: a rank encodes zeros in place of NaN/Inf values and counts them; the count
reaches every rank in the payloads (above), and a bad call's output is zeroed. When the backward
ends, ``nan_policy="raise"`` raises :class:`gradq.NonFiniteError` on every rank; ``"skip"`` zeroes
every gradient of the model and marks the step ``skipped`` in ``last_stats`` (check it to skip
``optimizer.step()``). On CUDA tensors nothing waits for the GPU inside a call: the counts stay on
the device, the input buffer is cleaned in place, and the decision, like the phase times (CUDA
events), is read once, when the backward ends.

Damaged payloads: a payload that fails its CRC-32 (CPU tensors), does not parse, or holds codes that no
encode writes is known only to the rank that received it. That rank decodes the call as zeros (or
counts the bad codes) and goes on. When the backward ends, one small all-reduce a step sums those
counts over the ranks, with whether any rank saw non-finite flags (a flag that arrived in a damaged
payload is lost to its receiver), and every rank then raises :class:`gradq.PayloadError`
(``nan_policy="raise"``; :class:`gradq.NonFiniteError` first where both) or skips the step as above
(``"skip"``). No rank leaves the step while its peers wait in a collective.

Error feedback (a spec such as ``ef(qsgd:bits=2)`` or a scheme that has it by default) keeps one
residual per FSDP module and block: the size of the *unsharded* gradient, in float32, on every rank —
the memory FSDP exists to save (``residual_bytes``; ``docs/performance.md`` measures it). The unbiased
schemes (QSGD, TernGrad, MaxNorm…) need none, and are the path to take under FSDP.

Steps: the calls of one backward form a step (closed by a callback at the end of the backward, after
FSDP's own). ``last_stats`` describes the last step as the DDP hook's does (``bytes_sent``,
``coords``, ``quantized_coords``, ``bits_per_coord``, ``encode_seconds``, ``comm_seconds``,
``decode_seconds``, ``skipped``, ``calls``, and ``agree_seconds``: the step's agreement below, which
also waits for the slowest rank); ``last_call`` the last call; ``totals`` the run.
Gradient accumulation with ``set_requires_gradient_sync(False)`` works as with stock FSDP2: the
accumulating backwards make no call and are not steps.

Traffic per rank and call: ``(M−1)`` chunk payloads of ``S`` values, against ``(M−1)·4S`` bytes for
float32 (``N−1`` payloads between nodes under ``intra_node="fp32"``, plus the intra-node float32).

:func:`register` (also reached through :func:`gradq.register` with a ``fully_shard`` model) installs
one :class:`GradqReduceScatter` on every FSDP module of a model. Its
:meth:`~GradqReduceScatter.state_dict` (spec, settings, the call counter, residuals) continues a run's
seeds on resume. :class:`StockReduceScatter` is FSDP2's own reduce-scatter, timed (the baseline of
``gradq train --fsdp`` and ``benchmarks/bench_fsdp.py``), and :func:`shard` the sharding both use.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from .errors import NonFiniteError, PayloadError
from .factory import build
from .fsdp_layout import Layout, Plan, read_segments, screen
from .fsdp_wire import decode_sum, encode_rows, shared_seeds
from .quantizers.base import Quantizer
from .transforms import ErrorFeedback

__all__ = ["GradqReduceScatter", "StockReduceScatter", "register", "shard", "is_fsdp2", "INTRA_NODE"]

logger = logging.getLogger(__name__)

#: ``intra_node=`` values: ``None`` (one flat compressed exchange) or ``"fp32"`` (full precision inside a node)
INTRA_NODE = (None, "fp32")
_NAN_POLICIES = ("raise", "skip")
_DDP_ONLY = ("warmup_steps", "measure_error", "adaptive", "group_mb", "strategy", "module", "timeout")


def _reduce_scatter_single() -> Any:
    """torch.distributed's one-tensor reduce-scatter (``reduce_scatter_single`` from torch 2.13, before
    that ``reduce_scatter_tensor``)."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_fsdp2(model: Any) -> bool:
    """Whether ``model`` was sharded with FSDP2's ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:   # an old torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _op_kind(op: Any) -> tuple[str, float]:
    """``("avg" | "sum", factor)`` of FSDP's reduce op (``PREMUL_SUM(f)`` is a sum times ``f``)."""
    R = dist.ReduceOp
    inner = getattr(op, "op", op)   # a ReduceOp object (PREMUL_SUM) carries the type in .op
    if inner == R.AVG:
        return "avg", 1.0
    if inner == R.SUM:
        return "sum", 1.0
    if inner == R.PREMUL_SUM:
        return "sum", float(op.factor)
    raise ValueError(f"GradqReduceScatter: FSDP asked for reduce op {op!r}; only AVG, SUM and PREMUL_SUM are "
                     "gradient reductions")


class GradqReduceScatter:
    """FSDP2's reduce-scatter through gradq's compressed all-to-all (module docstring).

    Args:
        spec: a gradq spec or quantizer (any scheme; error feedback keeps unsharded-size residuals).
        seed: base seed, equal on every rank (default 0).
        checksum: a CRC-32 trailer on every payload of CPU tensors, checked on arrival (default True).
        min_numel: parameters with fewer elements travel in full precision (default 10 000, as the
            DDP hook's).
        keep_1d_fp32: 1-D parameters (biases, norm scales) travel in full precision (default True).
        uncompressed: names of parameters (in the model given to :func:`register`) sent in full precision.
        nan_policy: ``"raise"`` (default) or ``"skip"`` (module docstring).
        intra_node: ``None`` (default) or ``"fp32"``: full precision inside a node, compressed between nodes.
        ranks_per_node: ranks per node for ``intra_node`` (default: ``LOCAL_WORLD_SIZE`` as torchrun sets it).
        process_group: the group FSDP shards over (default: the world); needed to build the node groups.

    Attributes:
        last_stats: the last step (module docstring); ``last_call``: the last call.
        totals: ``steps``, ``calls``, ``bytes_sent``, ``intra_node_bytes``, ``coords``, ``quantized_coords``,
            ``skipped_steps``, ``policy_fallbacks``, the three phase times and ``agree_seconds`` summed over the
            run.
    """

    def __init__(self, spec: str | Quantizer, *, seed: int = 0, checksum: bool = True, min_numel: int = 10_000,
                 keep_1d_fp32: bool = True, uncompressed: Iterable[str] = (), nan_policy: str = "raise",
                 intra_node: Optional[str] = None, ranks_per_node: Optional[int] = None,
                 process_group: Any = None) -> None:
        self.quantizer: Quantizer = build(spec)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative int under FSDP2 (no 'auto'), got {min_numel!r}")
        if isinstance(uncompressed, str):
            raise TypeError("uncompressed must be an iterable of parameter names, not one string")
        if nan_policy not in _NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {_NAN_POLICIES}, got {nan_policy!r}")
        if intra_node not in INTRA_NODE:
            raise ValueError(f"intra_node must be one of {INTRA_NODE}, got {intra_node!r}")
        self.seed = seed
        self.checksum = bool(checksum)
        self.min_numel = min_numel
        self.keep_1d_fp32 = bool(keep_1d_fp32)
        self.uncompressed = frozenset(str(n) for n in uncompressed)
        self.nan_policy = nan_policy
        self.intra_node = intra_node
        self.ranks_per_node = 1
        self._local_group: Any = None
        self._cross_group: Any = None
        self._group = process_group
        if intra_node is not None:
            self._build_node_groups(ranks_per_node, process_group)
        self.calls = 0
        self.steps = 0
        self.last_stats: dict[str, Any] = {}
        self.last_call: dict[str, Any] = {}
        self.totals: dict[str, float] = {"steps": 0, "calls": 0, "bytes_sent": 0, "intra_node_bytes": 0,
                                         "coords": 0, "quantized_coords": 0, "skipped_steps": 0,
                                         "policy_fallbacks": 0, "encode_seconds": 0.0, "comm_seconds": 0.0,
                                         "decode_seconds": 0.0, "agree_seconds": 0.0}
        self._checked = False
        self._defer = False   # True: decide on non-finite values at the step's end, as on CUDA (for tests)
        self._step: Optional[dict[str, Any]] = None
        self._model: Optional[torch.nn.Module] = None
        self._plans: dict[tuple[str, int], Plan] = {}
        if isinstance(self.quantizer, ErrorFeedback):
            self.quantizer.spares = False   # (memory is what FSDP saves: no second buffer per residual)
            logger.info("GradqReduceScatter: %s keeps an error-feedback residual the size of each FSDP module's "
                        "unsharded gradient on every rank (residual_bytes)", self.spec)

    # -- settings ----------------------------------------------------------------------------------
    @property
    def spec(self) -> str:
        return self.quantizer.spec

    def settings(self) -> dict[str, Any]:
        """What every rank must agree on (checked at the first call, and on resume)."""
        return {"spec": self.spec, "seed": self.seed, "checksum": self.checksum, "min_numel": self.min_numel,
                "keep_1d_fp32": self.keep_1d_fp32, "uncompressed": sorted(self.uncompressed),
                "nan_policy": self.nan_policy, "intra_node": self.intra_node, "ranks_per_node": self.ranks_per_node}

    @property
    def step(self) -> int:
        """Steps completed (as :attr:`gradq.GradqState.step`; ``gradq.integrations.step_metrics`` reads it)."""
        return self.steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped by ``nan_policy="skip"`` (as :attr:`gradq.GradqState.skipped_steps`)."""
        return int(self.totals["skipped_steps"])

    @property
    def residual_bytes(self) -> int:
        """Bytes held by error-feedback residuals on this rank (0 without error feedback; no spare
        buffers here: :class:`gradq.ErrorFeedback`'s ``spares`` is off under FSDP)."""
        q = self.quantizer
        if not isinstance(q, ErrorFeedback):
            return 0
        return sum(r.numel() * r.element_size() for r in q.residuals.values()) + q.spare_bytes

    def _build_node_groups(self, ranks_per_node: Optional[int], group: Any) -> None:
        """The node groups and the cross-node groups (a collective: every rank calls it alike)."""
        if not dist.is_initialized():
            raise RuntimeError("GradqReduceScatter(intra_node=...) needs torch.distributed initialized first")
        if ranks_per_node is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            if env is None:
                raise ValueError("intra_node='fp32' needs ranks_per_node= (LOCAL_WORLD_SIZE is not set)")
            ranks_per_node = int(env)
        world = dist.get_world_size(group)
        L = int(ranks_per_node)
        if L < 1 or world % L:
            raise ValueError(f"ranks_per_node={L} does not divide the {world} ranks into equal nodes")
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        me = dist.get_rank()
        self.ranks_per_node = L
        for n in range(world // L):   # every rank creates every group, in the same order
            g = dist.new_group(ranks[n * L:(n + 1) * L])
            if me in ranks[n * L:(n + 1) * L]:
                self._local_group = g
        for lr in range(L):
            g = dist.new_group(ranks[lr::L])
            if me in ranks[lr::L]:
                self._cross_group = g

    # -- the module layouts ------------------------------------------------------------------------
    def _layout_of(self, module: torch.nn.Module, key: str, names: Mapping[int, str]) -> Optional[Layout]:
        try:
            segs = read_segments(module, names)
        except AttributeError as exc:   # FSDP's internals moved (another torch): no policy, said loudly
            logger.warning("GradqReduceScatter: cannot read FSDP module %r's parameter layout (%s); its whole "
                           "buffer is compressed, min_numel/keep_1d_fp32/uncompressed do not apply there", key, exc)
            return None
        if segs is None:
            return None
        off = segs[-1].offset + segs[-1].length if segs else 0
        lay = Layout(key, segs, off)
        for s in segs:
            keep = (s.numel < self.min_numel or s.name in self.uncompressed or (self.keep_1d_fp32 and s.dim <= 1))
            rs = lay.full if keep else lay.comp
            if not keep:
                lay.comp_lengths.append(s.length)
            if rs and rs[-1][1] == s.offset:
                rs[-1] = (rs[-1][0], s.offset + s.length)
            else:
                rs.append((s.offset, s.offset + s.length))
        return lay

    def _plan(self, S: int, layout: Optional[Layout]) -> Plan:
        key = ("" if layout is None else layout.key, S)
        plan = self._plans.get(key)
        if plan is None:
            if layout is not None and layout.block == S:
                layerwise = bool(getattr(self.quantizer, "layerwise", False))
                plan = Plan(S, layout.comp, layout.full, layout.comp_lengths if layerwise else None)
            else:
                if layout is not None:
                    logger.warning("GradqReduceScatter: module %r reduced %d values per rank, its parameters make "
                                   "%d (a parameter without gradient?); compressing the whole buffer",
                                   layout.key, S, layout.block)
                plan = Plan(S, [(0, S)] if S else [], [])
                plan.fallback = layout is not None
            self._plans[key] = plan
        return plan

    # -- FSDP2's ReduceScatter protocol ------------------------------------------------------------
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP's buffers: plain tensors."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        self.reduce_scatter(output_tensor, input_tensor, group, op)

    def reduce_scatter(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                       layout: Optional[Layout] = None) -> None:
        """One call (what FSDP's ``__call__`` does), with the module's ``layout`` when known."""
        from .comm._util import check_inputs, phase

        kind, factor = _op_kind(op)
        world, rank = group.size(), group.rank()
        n = input_tensor.numel()
        if n % world or output_tensor.numel() != n // world:
            raise ValueError(f"GradqReduceScatter: input of {n} values does not split into {world} blocks of "
                             f"the output's {output_tensor.numel()}")
        if not self._checked:   # once: the same spec, settings and call count on every rank
            import zlib

            st = repr(sorted(self.settings().items())).encode()
            check_inputs("GradqReduceScatter", input_tensor, self.quantizer, group,
                         [zlib.crc32(st), self.calls, world], hosts=True)
            if self.intra_node is not None and self._local_group is not None:
                if world != self._local_group.size() * self._cross_group.size():
                    raise ValueError(f"GradqReduceScatter: FSDP reduces over {world} ranks, the node groups were "
                                     f"built for {self._local_group.size() * self._cross_group.size()}")
            self._checked = True
        self._begin_call()
        assert self._step is not None
        self._step.setdefault("group", group)   # (the step's agreement on damaged payloads runs over it)
        self._step["device"] = input_tensor.device
        S = n // world
        plan = self._plan(S, layout)
        key = "rs" if layout is None else layout.key
        rows = input_tensor.detach().reshape(world, S)
        cuda = rows.device.type == "cuda"
        defer = cuda or self._defer   # counts kept on the device until the step's end (tests force it on CPU)
        # CUDA: times from events read at the end of the step
        info: dict[str, Any] = {"cuda_events": []} if cuda else {}
        hier = self.intra_node is not None and self._local_group is not None
        bad: Any = None   # None: left to the quantizer's own screen, which is free for most schemes (below)
        with phase(info, "encode"):
            if defer:   # no host wait: always clean, in place (FSDP's buffer is its scratch, as its divide is)
                bad = torch.isfinite(rows).logical_not_().sum()
                rows = rows.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            elif hier or isinstance(self.quantizer, ErrorFeedback):   # (both need the count before encoding)
                bad, rows = screen(rows)
        intra_bytes = 0
        if hier:
            with phase(info, "comm"):
                rows, bad, intra_bytes = self._intra_node_sum(rows, bad)
            ex_group = self._cross_group
            owners = [j * self.ranks_per_node + rank % self.ranks_per_node for j in range(rows.shape[0])]
        else:
            ex_group = group
            owners = list(range(world))
        with phase(info, "encode"):
            bufs, fixed, bad = encode_rows(self.quantizer, rows, plan, owners, rank, key, bad, seed=self.seed,
                                           call=self.calls, checksum=self.checksum)
        sizes = [b.numel() for b in bufs]
        from .comm.scatter import _exchange

        with phase(info, "comm"):
            recv, recv_sizes = _exchange(torch.cat(bufs), sizes, fixed, ex_group)
        damage: dict[str, Any] = {}   # payloads this rank received damaged: refused at the step's end
        with phase(info, "decode"):
            total, bad_total = decode_sum(self.quantizer, recv, recv_sizes, plan, rows.dtype, rows.device, key,
                                          world if kind == "avg" else None, factor, checksum=self.checksum,
                                          info=damage, seeds=shared_seeds(self.quantizer, self.seed, self.calls,
                                                                          rank, len(plan.parts)))
            if defer:
                total = torch.where(bad_total > 0, torch.zeros((), device=total.device), total)
            elif int(bad_total):
                total.zero_()
            output_tensor.copy_(total.reshape(output_tensor.shape))
        sent = sum(sz for j, sz in enumerate(sizes) if j != ex_group.rank())
        if damage:
            self._step["damage"].append((damage.get("damaged", 0) + damage.get("invalid", 0),
                                         damage.get("damaged_what", []) + damage.get("invalid_what", [])))
        self._end_call(plan, S, sent, intra_bytes, info, bad, bad_total, key)

    def _intra_node_sum(self, rows: torch.Tensor, bad: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Full precision inside the node: local rank ``l`` gets its node's sums of the blocks of ranks
        ``l, L+l, …`` (and the node's count of ranks that saw non-finite values). Returns those ``N``
        rows, the count, and the bytes this rank sent (a ring reduce-scatter's ``(L−1)/L``)."""
        from .comm._util import collective

        L = self.ranks_per_node
        N = rows.shape[0] // L
        S = rows.shape[1]
        # row l·(N·S+1) … : the blocks of ranks n·L+l for n = 0..N−1, then one flag per local rank
        send = torch.empty(L, N * S + 1, dtype=rows.dtype, device=rows.device)
        send[:, :-1].view(L, N, S).copy_(rows.view(N, L, S).transpose(0, 1))
        send[:, -1] = (bad > 0).to(rows.dtype) if isinstance(bad, torch.Tensor) else float(bad > 0)
        recv = torch.empty(N * S + 1, dtype=rows.dtype, device=rows.device)
        collective("the intra-node reduce-scatter", _reduce_scatter_single(), recv, send.reshape(-1),
                   group=self._local_group)
        sent = (L - 1) * (N * S + 1) * rows.element_size()
        return recv[:-1].view(N, S), recv[-1].round().to(torch.int64), sent

    # -- steps and statistics ----------------------------------------------------------------------
    def _begin_call(self) -> None:
        task = torch._C._current_graph_task_id()
        if self._step is not None:
            if self._step["task"] == task:
                return
            self._end_step()   # a backward that ended without our callback (it raised)
        self._step = {"step": self.steps, "calls": 0, "bytes_sent": 0, "intra_node_bytes": 0, "coords": 0,
                      "quantized_coords": 0, "encode_seconds": 0.0, "comm_seconds": 0.0, "decode_seconds": 0.0,
                      "agree_seconds": 0.0, "skipped": False, "policy_fallbacks": 0}
        self._step.update(task=task, in_backward=task != -1, events=[], bad=[], damage=[])
        if self._step["in_backward"]:   # runs after FSDP's own end-of-backward callback (queued earlier)
            from torch.autograd import Variable

            Variable._execution_engine.queue_callback(self._end_step)

    def _end_call(self, plan: Plan, S: int, sent: int, intra: int, info: dict[str, Any], bad: torch.Tensor,
                  bad_total: torch.Tensor, key: str) -> None:
        events = info.get("cuda_events")
        call = {"call": self.calls, "bytes_sent": sent, "intra_node_bytes": intra, "coords": S,
                "quantized_coords": plan.n_comp, "policy_fallbacks": int(plan.fallback),
                **{f"{k}_seconds": info.get(f"{k}_s", 0.0) for k in ("encode", "comm", "decode")}}
        self.last_call = call
        step = self._step
        assert step is not None
        for k in ("bytes_sent", "intra_node_bytes", "coords", "quantized_coords", "encode_seconds", "comm_seconds",
                  "decode_seconds", "policy_fallbacks"):
            step[k] += call[k]
        step["calls"] += 1
        step["events"].extend(events or ())
        step["bad"].append((key, bad, bad_total))
        self.calls += 1
        if not step["in_backward"]:
            self._end_step()

    def _agree(self, step: dict[str, Any]) -> tuple[Optional[str], Optional[str]]:
        """What every rank refuses of this step, agreed in one small all-reduce a step: the payloads
        that arrived damaged or corrupt (known only to the rank that received each) and whether any
        rank's payloads flagged non-finite gradients (every rank reads the flags, but a rank that
        received a flag in a damaged payload could not). Returns the two refusals' messages, or None
        for each. Without it one rank would leave the step while its peers went on into the next
        collective."""
        group = step.pop("group", None)
        if group is None:   # (no call in this step)
            return None, None
        from .comm._util import collective

        agreed = torch.zeros(2, dtype=torch.int64, device=step["device"])
        for n, _ in step["damage"]:
            agreed[0] += n    # (an int, or a count the decode kept on the device: no host read here)
        for _, _, total in step["bad"]:
            agreed[1] += total > 0
        t0 = time.perf_counter()
        collective("GradqReduceScatter's agreement on the step", dist.all_reduce, agreed, group=group)
        damaged, flagged = agreed.tolist()   # (the step's one host read of them)
        step["agree_seconds"] = time.perf_counter() - t0
        damage = nonfinite = None
        if damaged:
            seen = [w for _, whats in step["damage"] for w in whats]
            here = (f"; on this rank: {', '.join(seen[:4])}" if seen else
                    "; on this rank: fields no encode writes" if step["damage"] else "")
            damage = (f"GradqReduceScatter: {damaged} payload(s) of step {step['step']} arrived damaged or corrupt "
                      f"over the ranks (CRC-32 mismatch, bytes that do not parse, or codes no encode writes){here}")
        if flagged:
            hits = [(key, int(mine), int(total)) for key, mine, total in step["bad"] if int(total)]
            what = "ranks" if self.intra_node else "values"
            nonfinite = (f"GradqReduceScatter: non-finite gradients in FSDP module {hits[0][0]!r} ({what} over the "
                         f"ranks: {hits[0][2]}; values on this rank: {hits[0][1]})" if hits else
                         "GradqReduceScatter: non-finite gradients on another rank (their flag reached this rank in "
                         "a damaged payload)")
        return damage, nonfinite

    def _end_step(self) -> None:
        step = self._step
        if step is None:
            return
        damage, nonfinite = self._agree(step)   # (CUDA: the counts were left on the device until now)
        if (damage or nonfinite) and self.nan_policy == "skip":
            step["skipped"] = True
        self._step = None
        if step["events"]:
            t = {"encode": 0.0, "comm": 0.0, "decode": 0.0}
            for name, a, b in step["events"]:
                b.synchronize()
                t[name] += a.elapsed_time(b) / 1000.0
            step.update({f"{k}_seconds": v for k, v in t.items()})
        for k in ("in_backward", "task", "events", "bad", "damage", "device", "group"):
            step.pop(k, None)
        if step["skipped"] and self._model is not None:
            for p in self._model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
        peers = max(1, (self._cross_group.size() if self._cross_group is not None else
                        dist.get_world_size(self._group)) - 1) if dist.is_initialized() else 1
        step["bits_per_coord"] = 8.0 * step["bytes_sent"] / (peers * step["coords"]) if step["coords"] else 0.0
        step["residual_bytes"] = self.residual_bytes
        self.last_stats = step
        tot = self.totals
        for k in ("bytes_sent", "intra_node_bytes", "coords", "quantized_coords", "encode_seconds", "comm_seconds",
                  "decode_seconds", "agree_seconds", "policy_fallbacks", "calls"):
            tot[k] += step[k]
        tot["steps"] += 1
        tot["skipped_steps"] += int(step["skipped"])
        self.steps += 1
        if self.nan_policy == "raise":   # (every rank alike: the counts were summed over them)
            if nonfinite:
                raise NonFiniteError(f"{nonfinite}; nan_policy='raise'")
            if damage:
                raise PayloadError(f"{damage}; the step's gradients must not be used (nan_policy='raise')")
        elif damage:
            logger.warning("%s; the step was skipped (nan_policy='skip')", damage)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Settings, the call and step counters (the seeds of the next calls) and this rank's
        error-feedback residuals (per rank: save one per rank)."""
        q = self.quantizer
        return {"spec": self.spec, "seed": self.seed, "calls": self.calls, "steps": self.steps,
                "settings": self.settings(),
                "residuals": q.state_dict()["residuals"] if isinstance(q, ErrorFeedback) else {}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; the spec, seed and settings must match."""
        if state.get("spec") != self.spec or state.get("seed") != self.seed:
            raise ValueError(f"GradqReduceScatter.load_state_dict: checkpoint has spec {state.get('spec')!r}, seed "
                             f"{state.get('seed')!r}; this one {self.spec!r}, {self.seed!r}")
        saved = state.get("settings")
        if saved is not None and dict(saved) != self.settings():
            diff = sorted(k for k in set(saved) | set(self.settings()) if saved.get(k) != self.settings().get(k))
            raise ValueError(f"GradqReduceScatter.load_state_dict: checkpoint settings differ on {diff}")
        residuals = state.get("residuals") or {}
        if isinstance(self.quantizer, ErrorFeedback):
            self.quantizer.load_state_dict({"spec": self.spec, "residuals": residuals})
        elif residuals:
            raise ValueError("checkpoint holds error-feedback residuals but this spec has no error feedback")
        self.calls = int(state["calls"])
        self.steps = int(state.get("steps", 0))
        self._checked = False
        self._step = None


class _ModuleReduceScatter:
    """What one FSDP module holds: the shared :class:`GradqReduceScatter` and the module's layout."""

    def __init__(self, core: GradqReduceScatter, module: torch.nn.Module, key: str, names: Mapping[int, str]) -> None:
        self.core, self.module, self.key, self._names = core, module, key, names
        self._layout: Optional[Layout] = None
        self._read = False

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.core.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        if not self._read:   # FSDP's parameter group exists once the module has run lazily-initialized
            self._layout = self.core._layout_of(self.module, self.key, self._names)
            self._read = True
        self.core.reduce_scatter(output_tensor, input_tensor, group, op, layout=self._layout)


def register(model: torch.nn.Module, spec: str | Quantizer, **kw: Any) -> GradqReduceScatter:
    """Install gradq's reduce-scatter on every FSDP module of ``model`` (sharded with ``fully_shard``).

    ``kw``: :class:`GradqReduceScatter`'s keyword arguments. Returns the shared instance
    (``last_stats``, ``totals``, ``state_dict``).

    Raises:
        TypeError: ``model`` is not an FSDP2 module, or an option of the DDP hook that FSDP2 has no use for.
    """
    from torch.distributed.fsdp import FSDPModule

    if not is_fsdp2(model):
        raise TypeError(f"gradq.fsdp.register needs a model sharded with fully_shard, got {type(model).__name__}")
    bad = sorted(k for k in kw if k in _DDP_ONLY)
    if bad:
        raise TypeError(f"gradq.register on an FSDP2 model does not take {bad} (DDP-hook options; see gradq.fsdp)")
    comm = GradqReduceScatter(spec, **kw)
    comm._model = model
    names = {id(p): n for n, p in model.named_parameters()}
    for key, m in model.named_modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(_ModuleReduceScatter(comm, m, key or "<root>", names))  # type: ignore[arg-type]
    return comm


class StockReduceScatter:
    """FSDP2's own reduce-scatter, timed (the float32 baseline of ``gradq train --fsdp`` and the
    benchmark): ``seconds`` and ``bytes`` (what a ring reduce-scatter sends, ``(W−1)/W`` of its
    input) accumulate; :meth:`take` returns and resets them. Install it with :meth:`install`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.bytes = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        import time

        t = time.perf_counter()
        _reduce_scatter_single()(output_tensor, input_tensor, op=op, group=group)
        if output_tensor.device.type == "cuda":
            torch.cuda.synchronize(output_tensor.device)
        self.seconds += time.perf_counter() - t
        self.bytes += (group.size() - 1) * output_tensor.numel() * output_tensor.element_size()

    def take(self) -> tuple[float, int]:
        """Seconds and bytes since the last call."""
        out = (self.seconds, self.bytes)
        self.seconds, self.bytes = 0.0, 0
        return out

    def install(self, model: torch.nn.Module) -> "StockReduceScatter":
        """Set on every FSDP module of ``model``; returns itself."""
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(self)  # type: ignore[arg-type]
        return self


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 (``fully_shard``) on every submodule that holds parameters of its own, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for m in list(model.modules())[1:]:
        if any(True for _ in m.parameters(recurse=False)):
            fully_shard(m)
    return fully_shard(model)
