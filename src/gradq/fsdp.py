"""Compressed gradient reduce-scatter for models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 does not all-reduce gradients, so a DDP communication hook never runs; it *reduce-scatters*
them: after each FSDP module's backward it copies the unsharded gradients into one flat buffer of
``M·S`` values, laid out so that block ``j`` holds rank ``j``'s shards, and asks a reduce-scatter
to leave in every rank's output the reduction of its own block over the ranks. That is the first phase
of gradq's scatter protocol (:mod:`gradq.comm.scatter`), so :class:`GradqReduceScatter`, installed
with ``FSDPModule.set_custom_reduce_scatter``, runs it:

1. each rank encodes its ``M`` blocks with the spec (seed ``derive_seed(seed, rank, "rs<call>:<j>")``:
   independent per rank, block and call; ``call`` counts the reduce-scatters so far, equal on every
   rank because FSDP calls them in the same order);
2. the packed payloads travel in one ``all_to_all_single`` (sub-byte codes stay packed; a CRC-32
   trailer per payload on CPU tensors);
3. each rank decodes the ``M`` payloads of its block and reduces them into FSDP's output as FSDP's
   ``op`` asks: ``AVG`` the mean (summed left to right, divided once, as the scatter protocol does),
   ``SUM`` the sum, ``PREMUL_SUM(f)`` ``f`` times the sum. FSDP's pre- and post-divide factors are
   applied by FSDP itself around the call, as for its own reduce-scatter.

Traffic per rank and call: ``(M−1)`` chunk payloads of ``S`` values, against ``(M−1)·4S`` bytes for
float32 (``last_stats``, ``totals``).

:func:`register` (also reached through :func:`gradq.register` with a ``fully_shard`` model) installs
one instance on every FSDP module of a model. Its :meth:`~GradqReduceScatter.state_dict` (spec,
seed, the call counter) continues a run's seeds on resume.

Not yet here (the DDP hook has them): per-tensor policies (``min_numel``, 1-D tensors in float32: the
whole block is compressed), error feedback (its residual would be the size of the unsharded gradient,
the memory FSDP exists to save), the non-finite policy beyond the quantizer's own error, and a
hierarchical (intra-node float32) layout.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from .errors import PayloadError
from .factory import build
from .quantizers.base import Quantizer
from .transforms import ErrorFeedback

__all__ = ["GradqReduceScatter", "register", "is_fsdp2"]

_UNSUPPORTED = ("min_numel", "keep_1d_fp32", "uncompressed", "warmup_steps", "nan_policy", "measure_error",
                "adaptive", "group_mb", "strategy", "module", "timeout")


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
        spec: a gradq spec or quantizer (any scheme; error feedback is refused, see the module docstring).
        seed: base seed, equal on every rank (default 0).
        checksum: a CRC-32 trailer on every payload of CPU tensors, checked on arrival (default True).

    Attributes:
        last_stats: the last call's ``bytes_sent`` (this rank), ``coords`` (its block), ``bits_per_coord``,
            ``encode_seconds``, ``comm_seconds``, ``decode_seconds``, ``op``.
        totals: ``calls``, ``bytes_sent``, ``coords`` and the three phase times summed over the run.
    """

    def __init__(self, spec: str | Quantizer, *, seed: int = 0, checksum: bool = True) -> None:
        self.quantizer: Quantizer = build(spec)
        if isinstance(self.quantizer, ErrorFeedback):
            raise ValueError("GradqReduceScatter: error feedback under FSDP2 would keep a residual the size of the "
                             "unsharded gradient on every rank; use an unbiased scheme (qsgd, terngrad, maxnorm…)")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.seed = seed
        self.checksum = bool(checksum)
        self.calls = 0
        self.last_stats: dict[str, Any] = {}
        self.totals: dict[str, float] = {"calls": 0, "bytes_sent": 0, "coords": 0, "encode_seconds": 0.0,
                                         "comm_seconds": 0.0, "decode_seconds": 0.0}
        self._checked = False

    @property
    def spec(self) -> str:
        return self.quantizer.spec

    # -- FSDP2's ReduceScatter protocol ------------------------------------------------------------
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP's buffers: plain tensors."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        from .comm import derive_seed
        from .comm._util import check_inputs, seal_bytes, sealed_payload, unseal
        from .comm.scatter import _exchange

        kind, factor = _op_kind(op)
        world, rank = group.size(), group.rank()
        n = input_tensor.numel()
        if n % world or output_tensor.numel() != n // world:
            raise ValueError(f"GradqReduceScatter: input of {n} values does not split into {world} blocks of "
                             f"the output's {output_tensor.numel()}")
        if not self._checked:   # once: the same spec, seed and call count on every rank
            check_inputs("GradqReduceScatter", input_tensor, self.quantizer, group,
                         [self.seed & 0x7FFFFFFF, self.calls, int(self.checksum)])
            self._checked = True
        S = n // world
        q = self.quantizer
        blocks = input_tensor.detach().reshape(world, S).to(torch.float32)
        trailer = seal_bytes(input_tensor.device, self.checksum)
        t0 = time.perf_counter()
        bufs = [sealed_payload(q.encode(blocks[j], seed=derive_seed(self.seed, rank, f"rs{self.calls}:{j}")), trailer)
                for j in range(world)]
        sizes = [b.numel() for b in bufs]
        fixed = q.expected_nbytes(S)
        t1 = time.perf_counter()
        recv, recv_sizes = _exchange(torch.cat(bufs), sizes, None if fixed is None else fixed + trailer, group)
        t2 = time.perf_counter()
        total: Optional[torch.Tensor] = None
        parts = torch.split(recv, recv_sizes)
        for i, buf in enumerate(parts):
            body, intact = unseal(buf, trailer)
            if not intact:
                raise PayloadError(f"GradqReduceScatter: the payload from rank {i} failed its checksum")
            d = q.decode(q.payload_from_bytes(body, (S,), torch.float32, copy=False))
            total = d.clone() if total is None else total.add_(d)
        assert total is not None
        if kind == "avg":
            total.div_(world)
        elif factor != 1.0:
            total.mul_(factor)
        output_tensor.copy_(total.reshape(output_tensor.shape))
        t3 = time.perf_counter()
        sent = sum(s for j, s in enumerate(sizes) if j != rank)
        self.last_stats = {"call": self.calls, "bytes_sent": sent, "coords": S, "op": kind,
                           "bits_per_coord": 8.0 * sent / ((world - 1) * S) if S and world > 1 else 0.0,
                           "encode_seconds": t1 - t0, "comm_seconds": t2 - t1, "decode_seconds": t3 - t2}
        tot = self.totals
        tot["calls"] += 1
        tot["bytes_sent"] += sent
        tot["coords"] += S
        tot["encode_seconds"] += t1 - t0
        tot["comm_seconds"] += t2 - t1
        tot["decode_seconds"] += t3 - t2
        self.calls += 1
        return None

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Spec, seed and the call counter (the seeds of the next calls)."""
        return {"spec": self.spec, "seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`; the spec and seed must match."""
        if state.get("spec") != self.spec or state.get("seed") != self.seed:
            raise ValueError(f"GradqReduceScatter.load_state_dict: checkpoint has spec {state.get('spec')!r}, seed "
                             f"{state.get('seed')!r}; this one {self.spec!r}, {self.seed!r}")
        self.calls = int(state["calls"])
        self._checked = False


def register(model: torch.nn.Module, spec: str | Quantizer, **kw: Any) -> GradqReduceScatter:
    """Install one :class:`GradqReduceScatter` on every FSDP module of ``model`` (sharded with
    ``fully_shard``); ``kw``: ``seed``, ``checksum``. Returns it (``last_stats``, ``totals``,
    ``state_dict``).

    Raises:
        TypeError: ``model`` is not an FSDP2 module, or a DDP-hook option not supported here yet.
    """
    from torch.distributed.fsdp import FSDPModule

    if not is_fsdp2(model):
        raise TypeError(f"gradq.fsdp.register needs a model sharded with fully_shard, got {type(model).__name__}")
    bad = sorted(k for k in kw if k in _UNSUPPORTED or k not in ("seed", "checksum", "process_group"))
    if bad:
        raise TypeError(f"gradq.register on an FSDP2 model does not support {bad} yet (see gradq.fsdp)")
    kw.pop("process_group", None)   # FSDP passes its own group to every call
    comm = GradqReduceScatter(spec, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(comm)
    return comm
