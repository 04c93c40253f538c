"""Helpers shared by the protocols: validation, rank-ordered averaging, variable-size byte exchange."""

from __future__ import annotations

import time
import zlib
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from .. import hostshare
from ..errors import CommunicationError, GradqError, PayloadError
from ..kernels.checks import deferred_checks
from ..payload import Payload
from ..quantizers.base import Quantizer
from ..transforms import ErrorFeedback

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_T = TypeVar("_T")


# -- failures and time limits ----------------------------------------------------------------------
def describe_failure(exc: BaseException, timeout: Optional[float]) -> str:
    """What a backend error means, in a few words (gloo's messages are matched, anything else kept)."""
    text = str(exc)
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        limit = f" within {timeout:g} s" if timeout is not None else ""
        return f"no answer{limit} (a rank stalled, died or left the step)"
    if "closed by peer" in low or "connection reset" in low or "broken pipe" in low or "eof" in low:
        return "a peer closed its connection (that rank died or exited)"
    return text.splitlines()[0][:300] if text else type(exc).__name__


def collective(what: str, fn: Callable[..., _T], *args: Any, group: Any = None, **kw: Any) -> _T:
    """Run one collective ``fn(*args, group=group, **kw)``; a backend failure becomes a
    :class:`CommunicationError` that names ``what`` this rank was waiting for."""
    try:
        return fn(*args, group=group, **kw)
    except GradqError:
        raise
    except RuntimeError as exc:  # gloo and NCCL raise RuntimeError (DistBackendError) subclasses
        limit = group_timeout(group)
        reason = describe_failure(exc, limit)
        raise CommunicationError(f"{what}: {reason} [{type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:200] if str(exc) else ''}]",
                                 waiting_for=what, reason=reason, timeout=limit, cause=exc) from exc


def check_timeout(timeout: Optional[float]) -> Optional[float]:
    """``timeout`` as float seconds (or None); anything else but a positive number is refused."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def group_timeout(group: Any) -> Optional[float]:
    """The time limit, in seconds, that ``group``'s collectives run under now (None if unknown)."""
    from torch.distributed import distributed_c10d as c10d

    try:
        pg = group if group is not None else c10d._get_default_group()
    except Exception:  # no default group
        return None
    for dev in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(dev)).options._timeout.total_seconds()
        except Exception:  # no backend for that device type, or no readable limit
            continue
    return None


@contextmanager
def time_limit(group: Any, seconds: Optional[float]) -> Iterator[None]:
    """Run the block's collectives on ``group`` under a limit of ``seconds`` (``None``: the group's
    own), restoring the group's limit afterwards. A collective that a peer does not join in time then
    raises instead of waiting for the group's default (30 minutes on gloo)."""
    if seconds is None or not dist.is_initialized():
        yield
        return
    from torch.distributed import distributed_c10d as c10d

    old = group_timeout(group)
    if old is not None and abs(old - seconds) < 1e-3:
        yield
        return
    pg = group if group is not None else c10d._get_default_group()
    c10d._set_pg_timeout(timedelta(seconds=seconds), pg)
    try:
        yield
    finally:
        if old is not None:
            c10d._set_pg_timeout(timedelta(seconds=old), pg)


#: largest vector (bytes, times the world size) that :func:`sum_over_ranks` sums by one all-to-all
SMALL_SUM_BYTES = 1 << 20
#: most bytes per rank the all-to-all may send beyond what a ring all-reduce would (a compression
#: library does not trade many bytes for a round trip: the codes of a larger tensor take the ring)
SMALL_EXTRA_BYTES = 16 * 1024
#: largest vector (bytes) that more than 2 ranks all-reduce on CPU by two all-to-alls — a ring's bytes
#: in 2 rounds instead of 2(M−1) — rather than by the backend's ring (4 gloo ranks on 2 cores: 0.47×
#: the ring's time for 200 KB of float32, 0.89× for 1 MiB of uint8, 1.2× for 4 MiB of float32)
TWO_ROUND_BYTES = 1 << 20


_LOCAL_OPS = {"sum": None, "max": torch.maximum, "min": torch.minimum}  # combined locally in rank order


def reduce_over_ranks(x: torch.Tensor, group: Any = None, *, op: str = "sum",
                      what: str = "the all-reduce") -> tuple[torch.Tensor, int]:
    """:func:`sum_over_ranks` for ``op`` ``"sum"``, ``"max"`` or ``"min"`` (any dtype the backend moves):
    a small vector through one all-to-all, combined here in rank order; a large one by the backend's
    all-reduce with that op. Returns ``(result, bytes this rank sent)``; ``x`` may be overwritten."""
    out, sent = reduce_segments(x.reshape(-1), [(x.numel(), op)], group, what=what)
    return out.view_as(x), sent


def one_round_fits(nbytes: int, world: int) -> bool:
    """Whether ``nbytes`` per rank go through one all-to-all: at most :data:`SMALL_SUM_BYTES` times the
    world in all, and at most :data:`SMALL_EXTRA_BYTES` sent beyond a ring's ``2(M−1)/M·n`` (the
    all-to-all sends ``(M−1)·n``: the extra is ``(M−1)(M−2)/M·n``, none with 2 ranks)."""
    extra = (world - 1) * (world - 2) * nbytes // world
    return world * nbytes <= SMALL_SUM_BYTES and extra <= SMALL_EXTRA_BYTES


def _combine(out: torch.Tensor, rows: torch.Tensor, offset: int, bounds: Sequence[tuple[int, int, str]]) -> None:
    """``out`` ← the rank-order combination of ``rows`` (one row per rank), which hold the values at
    ``offset…offset+len(out)`` of a vector whose segments ``bounds`` say which op applies where."""
    out.copy_(rows[0])
    end = offset + out.numel()
    for lo, hi, op in bounds:
        a, b = max(lo, offset) - offset, min(hi, end) - offset
        if a >= b:
            continue
        fn, part = _LOCAL_OPS[op], out[a:b]
        for r in range(1, rows.shape[0]):
            if fn is None:
                part += rows[r, a:b]
            else:
                fn(part, rows[r, a:b], out=part)


def _two_rounds(x: torch.Tensor, bounds: Sequence[tuple[int, int, str]], group: Any,
                what: str) -> tuple[torch.Tensor, int]:
    """All-reduce by two all-to-alls, a ring's bytes in 2 rounds instead of 2(M−1): each rank combines
    one M-th of the vector from every rank's copy (in rank order), then sends its part to all."""
    world, rank, n = dist.get_world_size(group), dist.get_rank(group), x.numel()
    base, rem = divmod(n, world)
    sizes = [base + (1 if r < rem else 0) for r in range(world)]
    mine, offset = sizes[rank], sum(sizes[:rank])
    recv = torch.empty(world * mine, dtype=x.dtype, device=x.device)
    collective(f"{what} of {n} values (reduce-scatter by all-to-all)", dist.all_to_all_single, recv, x,
               output_split_sizes=[mine] * world, input_split_sizes=sizes, group=group)
    part = torch.empty(mine, dtype=x.dtype, device=x.device)
    _combine(part, recv.view(world, mine), offset, bounds)
    out = torch.empty_like(x)
    collective(f"{what} of {n} values (all-gather by all-to-all)", dist.all_to_all_single, out, part.repeat(world),
               output_split_sizes=sizes, input_split_sizes=[mine] * world, group=group)
    sent = ((n - mine) + (world - 1) * mine) * x.element_size()
    return out, sent


def reduce_segments(x: torch.Tensor, segments: Sequence[tuple[int, str]], group: Any = None, *,
                    what: str = "the all-reduce") -> tuple[torch.Tensor, int]:
    """Reduce the 1-D tensor ``x`` over the group's ranks, segment by segment: ``segments`` lists
    ``(length, op)`` in order (``op``: ``"sum"``, ``"max"`` or ``"min"``; lengths add up to ``x.numel()``).

    A small ``x`` (:func:`one_round_fits`) takes ONE all-to-all whatever its ops — the scale statistics
    (a MAX) and the float32 tensors beside them (a SUM) share a round — and every rank combines the
    ``M`` copies in rank order 0..M−1, so the result is identical on every rank. A larger CPU vector of
    at most :data:`TWO_ROUND_BYTES` with more than 2 ranks takes two all-to-alls (each rank combines one
    M-th in rank order, then sends it to all: a ring's bytes in 2 rounds). Larger still, or on a GPU,
    the backend's all-reduce, once per op (its segments concatenated). Returns ``(result, bytes this
    rank sent)``; ``x`` may be overwritten."""
    if x.dim() != 1:
        raise ValueError(f"reduce_segments needs a 1-D tensor, got shape {tuple(x.shape)}")
    if sum(n for n, _ in segments) != x.numel():
        raise ValueError(f"segments cover {sum(n for n, _ in segments)} values, the tensor has {x.numel()}")
    for _, op in segments:
        if op not in _LOCAL_OPS:
            raise ValueError(f"op must be one of {sorted(_LOCAL_OPS)}, got {op!r}")
    world = dist.get_world_size(group)
    nbytes = x.numel() * x.element_size()
    if world == 1 or not x.numel():
        return x, 0
    bounds: list[tuple[int, int, str]] = []
    at = 0
    for n, op in segments:
        bounds.append((at, at + n, op))
        at += n
    if one_round_fits(nbytes, world):
        send = x.repeat(world)
        recv = torch.empty_like(send)
        collective(f"{what} of {x.numel()} values (all-to-all)", dist.all_to_all_single, recv, send, group=group)
        out = torch.empty_like(x)
        _combine(out, recv.view(world, -1), 0, bounds)
        return out, (world - 1) * nbytes
    if world > 2 and x.device.type == "cpu" and nbytes <= TWO_ROUND_BYTES:
        return _two_rounds(x, bounds, group, what)
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    sent = 0
    for op in sorted({op for _, _, op in bounds}):
        mine = [(lo, hi) for lo, hi, o in bounds if o == op and hi > lo]
        if not mine:
            continue
        whole = len(mine) == 1 and mine[0] == (0, x.numel())
        flat = x if whole else torch.cat([x[lo:hi] for lo, hi in mine])
        collective(f"{what} of {flat.numel()} values", dist.all_reduce, flat, op=ops[op], group=group)
        if not whole:
            for (lo, hi), part in zip(mine, torch.split(flat, [hi - lo for lo, hi in mine])):
                x[lo:hi].copy_(part)
        sent += (2 * (world - 1) * flat.numel() * flat.element_size()) // world
    return x, sent


def sum_over_ranks(x: torch.Tensor, group: Any = None, *, what: str = "the all-reduce") -> tuple[torch.Tensor, int]:
    """The sum of the 1-D tensor ``x`` over the group's ranks, identical on every rank; returns
    ``(sum, bytes this rank sent)``. ``x`` may be overwritten.

    A small vector (``world · nbytes ≤`` :data:`SMALL_SUM_BYTES`, and at most :data:`SMALL_EXTRA_BYTES`
    more sent than by a ring) goes through ONE all-to-all: every
    rank sends its whole vector to every other and adds the ``M`` copies in rank order 0..M−1. A ring
    all-reduce takes ``2(M−1)`` dependent steps, each a wake-up of every rank — most of its time for a
    few kilobytes (docs/performance.md, "The DDP hook", has the measurement) — and
    the rank-order sum does not depend on where a value sits in the vector. Larger vectors send a
    ring's ``2(M−1)/M`` of the bytes instead of ``M−1`` times them: by two all-to-alls (still added in
    rank order) up to :data:`TWO_ROUND_BYTES` on CPU with more than 2 ranks, else by the backend's
    all-reduce (:func:`reduce_segments`)."""
    return reduce_over_ranks(x, group, op="sum", what=what)


# -- payload checksums ----------------------------------------------------------------------------
#: bytes of the CRC-32 trailer a protocol appends to every payload it sends (CPU tensors)
SEAL_BYTES = 4


def seal_bytes(device: torch.device, checksum: bool) -> int:
    """Trailer bytes per payload: :data:`SEAL_BYTES` for CPU payloads with ``checksum``, else 0.
    (CUDA payloads carry none yet. :func:`gradq.kernels.crc32_field` computes the CRC on the
    device, but checking it on arrival without a host read per payload would need the damage
    count kept on the device until the step's last collective, which is not built.)"""
    return SEAL_BYTES if checksum and device.type == "cpu" else 0


def _crc(buf: torch.Tensor) -> int:
    return zlib.crc32(buf.detach().contiguous().numpy())


def seal(region: torch.Tensor, trailer: int) -> None:
    """Write the CRC-32 of ``region[:-trailer]`` into its last ``trailer`` bytes (little-endian)."""
    if trailer:
        crc = _crc(region[:-trailer])
        region[-trailer:] = torch.tensor(list(crc.to_bytes(4, "little")), dtype=torch.uint8)


def unseal(buf: torch.Tensor, trailer: int) -> tuple[torch.Tensor, bool]:
    """``(payload bytes, intact)``: the bytes before the trailer, and whether its CRC-32 matches."""
    if not trailer:
        return buf, True
    if buf.numel() < trailer:
        return buf[:0], False
    body = buf[:-trailer]
    return body, _crc(body) == int.from_bytes(bytes(buf[-trailer:].tolist()), "little")


def sealed_payload(p: Payload, trailer: int) -> torch.Tensor:
    """``p``'s serialized bytes followed by their checksum trailer, in one new buffer."""
    if not trailer:
        return payload_bytes(p)
    out = torch.empty(p.nbytes + trailer, dtype=torch.uint8)
    p.to_bytes(out=out[: p.nbytes])
    seal(out, trailer)
    return out


def note_damage(info: Optional[dict], what: str) -> None:
    """Count a payload that arrived damaged (its checksum does not match) in ``info``."""
    if info is not None:
        info["damaged"] = info.get("damaged", 0) + 1
        info.setdefault("damaged_what", []).append(what)


@contextmanager
def refused_later(info: dict) -> Iterator[None]:
    """Decodes inside do not raise on fields no encode writes (:func:`gradq.kernels.deferred_checks`):
    the payloads that hold such fields are counted in ``info["invalid"]`` (an int, or a tensor on the
    device that decoded them: no host read), which the caller refuses with the damaged payloads."""
    with deferred_checks() as checks:
        yield
    count = checks.count
    if isinstance(count, torch.Tensor) or count:
        info["invalid"] = info.get("invalid", 0) + count


def decoded_or_zeros(info: dict, decode: Callable[[], torch.Tensor], zeros: Callable[[], torch.Tensor],
                     what: str) -> torch.Tensor:
    """``decode()``, or where it raises :class:`gradq.PayloadError` (a payload that no check before
    the decode could refuse: a damaged header without a checksum, an entropy-coded stream that does
    not read) ``zeros()``, with the payload counted in ``info["invalid"]`` and named in
    ``info["invalid_what"]``: refused with the damaged ones after the last collective, so that no
    rank leaves a protocol (or the hook's step) early while its peers wait in a collective."""
    try:
        return decode()
    except PayloadError as exc:
        info["invalid"] = info.get("invalid", 0) + 1
        info.setdefault("invalid_what", []).append(f"{what} ({exc})")
        return zeros()


@contextmanager
def decoding(info: dict) -> Iterator[None]:
    """A protocol's decode phase: :func:`phase` ``"decode"`` and :func:`refused_later`."""
    with phase(info, "decode"), refused_later(info):
        yield


def raise_if_damaged(fn: str, info: dict, defer: bool) -> None:
    """A protocol called alone refuses a damaged result on the rank that saw it (after its last
    collective, so no peer waits): payloads that failed their checksum (``info["damaged"]``) or held
    codes no encode writes (``info["invalid"]``, read here: a host read where a GPU counted them).
    Callers that agree across ranks (the DDP hook, ``allreduce_``) pass ``defer=True`` and read both
    themselves."""
    if defer:
        return
    invalid = int(info.get("invalid", 0))
    if info.get("damaged"):
        raise PayloadError(f"{fn}: {info['damaged']} payload(s) arrived damaged (CRC-32 mismatch): "
                           f"{', '.join(info['damaged_what'][:4])}; the result was not used")
    if invalid:
        named = info.get("invalid_what", [])
        raise PayloadError(f"{fn}: {invalid} payload(s) arrived corrupt (codes no encode writes, or bytes that "
                           f"do not decode){': ' + '; '.join(named[:4]) if named else ''}; the result was not used")


def check_inputs(fn: str, x: torch.Tensor, q: Quantizer, group, extra: Sequence[int] = (),
                 verify: bool = True, hosts: bool = False) -> tuple[int, int]:
    """Validate ``x``/``q`` and check, with ONE small MAX all-reduce, that every rank passes the same
    number of coordinates, the same quantizer spec and the same ``extra`` integers (skipped with
    ``verify=False``, for callers that checked once already, like the DDP hook). With ``hosts`` the
    all-reduce also finds the ranks that share this rank's cores (:mod:`gradq.hostshare`, for a
    caller's first call). Returns ``(rank, world_size)`` in ``group``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{fn}: torch.distributed is not initialized (call init_process_group first)")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"{fn}: expected a floating-point tensor, got {x.dtype}")
    if not isinstance(q, Quantizer):
        raise TypeError(f"{fn}: expected a gradq Quantizer, got {type(q).__name__}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if not verify:
        return rank, world
    vals = [x.numel(), zlib.crc32(q.spec.encode("utf-8")), *[int(e) for e in extra]]
    slots = hostshare.host_slots(rank, world) if hosts else []
    t = torch.tensor(vals + [-v for v in vals] + slots, dtype=torch.int64, device=x.device)
    collective(f"{fn}'s check that every rank passes the same size and quantizer", dist.all_reduce, t,
               op=dist.ReduceOp.MAX, group=group)
    got = t.tolist()
    hi, neg_lo = got[: len(vals)], got[len(vals): 2 * len(vals)]
    what = ["numel", "quantizer spec", *[f"argument {i}" for i in range(len(extra))]]
    for i, w in enumerate(what):
        if hi[i] != -neg_lo[i]:
            raise ValueError(f"{fn}: ranks disagree on {w} (this rank: {vals[i]}, range over ranks "
                             f"{-neg_lo[i]}..{hi[i]}); every rank must pass the same size and quantizer")
    if hosts:
        hostshare.warn_once(got[2 * len(vals):], rank, x.device)
    return rank, world


@contextmanager
def phase(info: Optional[dict], name: str) -> Iterator[None]:
    """Add the wall seconds spent in the block to ``info[name + "_s"]`` (``encode``, ``comm``, ``decode``).

    When ``info["cuda_events"]`` is a list (the DDP hook on a GPU), the block is timed on the GPU
    instead: a pair of CUDA events is recorded on the current stream and appended as ``(name, start,
    end)``; the caller reads their elapsed time once the stream has finished (host clocks would only
    measure kernel launches)."""
    events = None if info is None else info.get("cuda_events")
    if events is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            events.append((name, start, end))
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if info is not None:
            info[f"{name}_s"] = info.get(f"{name}_s", 0.0) + time.perf_counter() - t0


def plain(q: Quantizer) -> Quantizer:
    """``q`` without its error-feedback wrapper (for re-encoding an average, which has no memory)."""
    return q.inner if isinstance(q, ErrorFeedback) else q


def mean_in_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(p_0 + p_1 + … + p_{M-1}) / M`` in float32, summed left to right (bit-reproducible)."""
    acc = parts[0].detach().reshape(-1).to(torch.float32).clone()
    for p in parts[1:]:
        acc += p.detach().reshape(-1).to(torch.float32)
    return acc / len(parts)


def decode_bytes(q: Quantizer, buf: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
                 shared_seed: Optional[int] = None) -> torch.Tensor:
    """Decode one serialized payload (``Payload.to_bytes`` output, unpadded), encoded under
    ``shared_seed`` where the caller knows it (:meth:`gradq.Quantizer.decode`)."""
    return q.decode(q.payload_from_bytes(buf, shape, dtype), shared_seed=shared_seed)


def gather_into(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """``all_gather_single`` (torch ≥ 2.12's name) or ``all_gather_into_tensor`` (earlier)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _peer(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def ring_all_gather(buf: torch.Tensor, group, sizes: Optional[Sequence[int]] = None) -> list[torch.Tensor]:
    """All-gather 1-D tensors around a ring of point-to-point messages; returns one tensor per rank.

    In round ``k = 0 … M−2`` rank ``r`` forwards block ``r−k`` to rank ``r+1`` and receives block
    ``r−k−1`` from rank ``r−1`` (indices mod ``M``): every worker sends ``(M−1)`` blocks over one
    connection, the ring all-gather of the traffic formulas. ``sizes``: every rank's element count
    (default: all equal to ``buf``'s). Blocks travel unpadded. Against gloo's own all-gathers
    (``benchmarks/bench_collectives.py``): docs/performance.md, "Compressed collectives over gloo"."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = [buf.numel()] * world if sizes is None else [int(s) for s in sizes]
    if sizes[rank] != buf.numel():
        raise RuntimeError(f"ring_all_gather: this rank's block has {buf.numel()} elements, sizes say {sizes[rank]}")
    blocks = [buf if j == rank else torch.empty(sizes[j], dtype=buf.dtype, device=buf.device)
              for j in range(world)]
    nxt, prv = _peer(group, (rank + 1) % world), _peer(group, (rank - 1) % world)
    limit = group_timeout(group)  # point-to-point waits ignore the group's limit on gloo: passed explicitly
    for k in range(world - 1):
        s, r = (rank - k) % world, (rank - k - 1) % world
        ops = []
        if sizes[s]:
            ops.append(dist.P2POp(dist.isend, blocks[s], nxt, group))
        if sizes[r]:
            ops.append(dist.P2POp(dist.irecv, blocks[r], prv, group))
        if ops:
            try:
                for w in dist.batch_isend_irecv(ops):
                    if limit is not None:
                        w.wait(timedelta(seconds=limit))
                    else:
                        w.wait()
            except RuntimeError as exc:
                what = f"the ring all-gather (round {k + 1} of {world - 1}, from rank {prv}, to rank {nxt})"
                reason = describe_failure(exc, limit)
                raise CommunicationError(f"{what}: {reason}", waiting_for=what, reason=reason, timeout=limit,
                                         cause=exc) from exc
    return blocks


def all_gather_bytes(buf: torch.Tensor, fixed: Optional[int], group) -> list[torch.Tensor]:
    """All-gather 1-D uint8 buffers of possibly different lengths; returns one per rank (unpadded).

    ``fixed``: the byte length every rank's buffer is known to have (skips the size exchange).
    On gloo with CPU tensors the bytes go around a point-to-point ring (:func:`ring_all_gather`, unpadded), or, when
    ``M`` times the largest is at most :data:`SMALL_SUM_BYTES`, through one all-to-all (every rank sends
    its buffer to every other: the same bytes as the ring in one round instead of ``M−1``); on NCCL and
    for CUDA tensors (gloo's point-to-point refuses them) through the backend's ``all_gather_into_tensor``
    (zero-padded to the longest)."""
    world = dist.get_world_size(group)
    if fixed is not None:
        if buf.numel() != fixed:
            raise RuntimeError(f"payload has {buf.numel()} bytes, its quantizer promised {fixed}")
        sizes = [fixed] * world
    else:
        n = torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device)
        got = torch.empty(world, dtype=torch.int64, device=buf.device)
        collective("the all-gather of the payload sizes", gather_into, got, n, group=group)
        sizes = [int(s) for s in got.tolist()]
    if buf.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):
        if world * max(sizes) <= SMALL_SUM_BYTES:  # small: one all-to-all round instead of M−1 ring rounds
            send = buf.repeat(world)
            recv = torch.empty(sum(sizes), dtype=torch.uint8, device=buf.device)
            collective("the all-gather of the payloads (all-to-all)", dist.all_to_all_single, recv, send,
                       output_split_sizes=sizes, input_split_sizes=[buf.numel()] * world, group=group)
            return list(torch.split(recv, sizes))
        return ring_all_gather(buf, group, sizes)
    width = max(sizes)
    send = buf if buf.numel() == width else torch.cat([buf, buf.new_zeros(width - buf.numel())])
    out = torch.empty(world * width, dtype=torch.uint8, device=buf.device)
    collective("the all-gather of the payloads", gather_into, out, send, group=group)
    return [out[j * width: j * width + s] for j, s in enumerate(sizes)]


def payload_bytes(p: Payload) -> torch.Tensor:
    return p.to_bytes().reshape(-1)
