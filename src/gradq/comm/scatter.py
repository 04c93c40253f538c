"""Scatter-reduce / all-gather with packed codes (docs/algorithms.md, third bullet): any quantizer.

What CGX, DeepSpeed and Bagua do so that sub-byte codes can travel through an all-reduce-shaped
exchange. With ``M`` workers and ``n`` coordinates:

1. split ``x`` into ``M`` equal chunks of ``c = ceil(n/M)`` coordinates, zero-padding the last
   **[decided]** (the pad is encoded with the last chunk and dropped at the end; for schemes whose
   levels depend on the data's distribution — orq, linear — the zeros slightly shape that chunk's levels);
2. encode chunk ``j`` for its owner, rank ``j`` (seed ``derive_seed(seed, rank, "chunk{j}")``; an
   error-feedback ``q`` keeps one memory per chunk, keyed ``"{name}#chunk{j}"``);
3. ``all_to_all_single`` of the payload bytes (fixed-width schemes: all chunk payloads have the same
   size, no lengths are sent; otherwise the lengths are exchanged first and passed as split sizes, so
   no padding crosses the wire);
4. rank ``j`` decodes the ``M`` payloads of its chunk and averages them (rank order 0..M−1);
5. it re-encodes that average — with ``q`` stripped of error feedback, or through ``second_ef`` (an
   :class:`ErrorFeedback` whose memory is keyed ``"{name}#avg{j}"``), seed ``derive_seed(seed, j, "reencode")``;
6. the re-encoded chunks are all-gathered; every rank decodes all ``M``, concatenates, unpads.

The result is NOT the mean of the workers' decodes but its re-quantization ``Q(mean of chunk)``.

Pipeline **[decided]**: a tensor of more than :data:`SEGMENT_NUMEL` coordinates is cut into segments
of that size, and each segment is one independent run of steps 1-6 (seed
``derive_seed(seed, None, "segment{s}")``, error-feedback keys suffixed ``@s``). The exchanges run on
one background thread in a fixed order (all-to-all of segment ``s+1`` is queued before the all-gather
of segment ``s``), while the calling thread encodes the next segment and decodes finished ones — so
encoding and decoding hide behind the transfers instead of adding to them. Layer-wise schemes
(``bucket=none``) then have one scale per (segment, chunk), as they already have one per chunk.

Backend notes (measured, torch 2.13, 4 ranks, ``benchmarks/bench_collectives.py``): gloo supports
``all_to_all_single`` on uint8 CPU tensors with split sizes. Its ``all_gather`` is slow per byte, so on
gloo step 6 goes around a ring of point-to-point messages (:func:`gradq.comm._util.ring_all_gather`).

Traffic per worker: ``(M−1)·B_c`` bytes in the all-to-all plus ``(M−1)·B_c'`` in the ring all-gather,
with ``B_c ≈ c·bits/8 + header`` — in total ``≈ 2(M−1)/M · n·bits/8`` bytes (a ring all-reduce at
``bits`` instead of 32), plus ``2(M−1)`` payload headers and, with ``checksum`` (the default, CPU
tensors), a 4-byte CRC-32 trailer on each of those payloads.
"""

from __future__ import annotations

import queue
import threading
import zlib
from concurrent.futures import Future
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..quantizers.base import Quantizer
from ..transforms import ErrorFeedback
from . import lifecycle
from ._util import (all_gather_bytes, check_inputs, collective, decoded_or_zeros, decoding, note_damage, phase, plain,
                    raise_if_damaged, seal, seal_bytes, sealed_payload, unseal)

__all__ = ["scatter_allgather", "scatter_bytes_per_worker", "ScatterPipeline", "SEGMENT_NUMEL"]

#: coordinates per pipeline segment: large tensors are cut into segments so that the encode of one
#: segment, the exchanges of the previous ones and the decode of older ones run at the same time
SEGMENT_NUMEL = 1 << 22


def scatter_bytes_per_worker(chunk_nbytes: int, reencoded_nbytes: int, world_size: int) -> int:
    """Bytes one worker sends: ``(M−1)·B_c`` (all-to-all) ``+ (M−1)·B_c'`` (ring all-gather)."""
    return (world_size - 1) * (chunk_nbytes + reencoded_nbytes)


def _key(name: Optional[str], part: str) -> str:
    return f"{'' if name is None else name}#{part}"


def _chunks(x: torch.Tensor, world: int) -> tuple[list[torch.Tensor], int]:
    """``world`` float32 chunks of ``c = ceil(n/world)`` coordinates: views of ``x`` where possible,
    the last (and any beyond ``n``) zero-padded copies."""
    n = x.numel()
    chunk = -(-n // world) if n else 0
    flat = x.detach().reshape(-1).to(torch.float32)
    out = []
    for j in range(world):
        a, b = j * chunk, min(n, (j + 1) * chunk)
        if b - a == chunk:
            out.append(flat[a:b])
        else:
            piece = flat.new_zeros(chunk)
            if b > a:
                piece[: b - a] = flat[a:b]
            out.append(piece)
    return out, chunk


def _decode_mean(q: Quantizer, bufs: list[torch.Tensor], chunk: int,
                 shared_seed: Optional[int] = None) -> torch.Tensor:
    """``(d_0 + d_1 + … + d_{M−1}) / M`` of the received payloads, summed left to right in float32
    (as :func:`mean_in_order`) by :meth:`Quantizer.decode_mean` — one fused pass where the scheme has
    a kernel for it; ``shared_seed``: the one the chunk's payloads were encoded under."""
    return q.decode_mean([q.payload_from_bytes(b, (chunk,), torch.float32, copy=False) for b in bufs],
                         shared_seed=shared_seed)


def _exchange(send: torch.Tensor, send_sizes: list[int], fixed: Optional[int],
              group: Any) -> tuple[torch.Tensor, list[int]]:
    """Phase 1: ``all_to_all_single`` of the chunk payloads, concatenated in ``send`` (lengths
    first when not ``fixed``)."""
    if fixed is not None:
        recv_sizes = [fixed] * len(send_sizes)
    else:
        s_in = torch.tensor(send_sizes, dtype=torch.int64, device=send.device)
        s_out = torch.empty_like(s_in)
        collective("the all-to-all of the chunk payload sizes", dist.all_to_all_single, s_out, s_in, group=group)
        recv_sizes = [int(v) for v in s_out.tolist()]
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=send.device)
    collective("the all-to-all of the chunk payloads", dist.all_to_all_single, recv, send,
               output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=group)
    return recv, recv_sizes


class _Inline:
    """Runs a communication job at once (one segment: nothing to overlap)."""

    @staticmethod
    def submit(fn: Callable[[], Any]) -> Future:
        f: Future = Future()
        f.set_result(fn())
        return f


class _CommLane:
    """One thread that runs communication jobs in the order they are submitted.

    Every rank submits the same jobs in the same program order, so the collectives match across
    ranks; meanwhile the calling thread encodes and decodes other segments (the numba kernels and
    torch's ops release the GIL). :meth:`stop` ends and joins it (``gradq.comm.lifecycle`` does so
    before interpreter shutdown and before destroying a process group); a stopped lane is replaced by a
    new one on the next use."""

    _STOP = object()

    def __init__(self, name: str = "gradq-comm") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # daemon only as a last resort: stop() joins it before shutdown (see gradq.comm.lifecycle)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is self._STOP:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller by fut.result()
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def stop(self, timeout: Optional[float] = 30.0) -> bool:
        """Finish the queued jobs, end the thread and join it; False if it is still blocked after
        ``timeout`` seconds (inside a collective that a peer never joins: the group's timeout ends it)."""
        self._jobs.put(self._STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()


#: the running lanes by thread name: "gradq-comm" (the segments' exchanges) and "gradq-hook" (the
#: DDP hook's per-group jobs, which themselves submit exchanges to "gradq-comm": two threads, no wait cycle)
_LANES: dict[str, _CommLane] = {}
_LANE_LOCK = threading.Lock()


def _lane(name: str = "gradq-comm") -> _CommLane:
    with _LANE_LOCK:
        lane = _LANES.get(name)
        if lane is None:
            lane = _LANES[name] = _CommLane(name)
        return lane


def stop_lane() -> None:
    """Stop and join every lane that runs (the next use starts a new one)."""
    with _LANE_LOCK:
        lanes = list(_LANES.values())
        _LANES.clear()
    for lane in lanes:
        lane.stop()


lifecycle.on_stop(stop_lane)


def scatter_allgather(x: torch.Tensor, q: Quantizer, *, group: Any = None, seed: int,
                      name: Optional[str] = None, second_ef: Optional[ErrorFeedback] = None,
                      info: Optional[dict] = None, out: Optional[torch.Tensor] = None,
                      segment: Optional[int] = None, verify: bool = True, checksum: bool = True,
                      defer_damage: bool = False, check_finite: bool = True) -> torch.Tensor:
    """Chunked all-to-all / average / re-encode / all-gather (module docstring); same result on all ranks.

    Args:
        x: this worker's gradient (any floating dtype/shape, same numel on every rank).
        q: any quantizer (equal on every rank); an ErrorFeedback ``q`` keeps one memory per chunk.
        group: process group (``None`` = default).
        seed: base seed common to all ranks.
        name: tensor name (prefix of the error-feedback keys).
        second_ef: optional :class:`ErrorFeedback` (same spec on every rank) used to re-encode this
            rank's averaged chunk with its own memory; without it the chunk is re-encoded by ``q``
            without error feedback.
        info: optional dict filled with ``chunk``, ``segments``, ``bytes_sent`` (:func:`scatter_bytes_per_worker`).
        out: optional tensor of ``x``'s shape and dtype for the result (may be ``x`` itself: a
            segment's chunks are all encoded before anything is written into it).
        segment: coordinates per pipelined segment (default :data:`SEGMENT_NUMEL`; equal on all ranks).
        checksum: every payload sent carries a CRC-32 trailer (4 bytes, CPU tensors), checked on
            arrival; a damaged one is decoded as zeros, counted in ``info["damaged"]`` and, unless
            ``defer_damage`` (the caller agrees across ranks itself), refused with
            :class:`gradq.PayloadError` on this rank once the collectives are done. Equal on all ranks.
        check_finite: ``False`` where the caller screened ``x`` for NaN/Inf itself (the DDP hook):
            the encodes skip their own check where the scheme allows it (see
            :meth:`gradq.Quantizer.encode`), which on a GPU saves a host read per payload (the re-encoded averages of finite
            decodes too).
    Returns:
        ``out``, or a new tensor of ``x``'s shape and dtype.
    """
    if second_ef is not None and not isinstance(second_ef, ErrorFeedback):
        raise TypeError(f"second_ef must be a gradq.ErrorFeedback (it holds the memory), "
                        f"got {type(second_ef).__name__}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(f"out= must have x's shape {tuple(x.shape)} and dtype {x.dtype}")
    seg = SEGMENT_NUMEL if segment is None else segment
    if isinstance(seg, bool) or not isinstance(seg, int) or seg < 1:
        raise ValueError(f"segment must be a positive int, got {segment!r}")
    q2: Quantizer = plain(q) if second_ef is None else second_ef
    check_inputs("scatter_allgather", x, q, group, [zlib.crc32(q2.spec.encode("utf-8")), seg], verify=verify)
    n = x.numel()
    flat = x.detach().reshape(-1).to(torch.float32)
    direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
    res = out.view(-1) if direct else torch.empty(n, dtype=torch.float32, device=x.device)  # type: ignore[union-attr]
    info = {} if info is None else info
    pipe = ScatterPipeline(q, group=group, second_ef=second_ef, checksum=checksum, info=info,
                           pipelined=max(1, -(-n // seg)) > 1, device=x.device, check_finite=check_finite)
    pipe.add(flat, res, seed=seed, name=name, segment=seg)
    pipe.flush()
    info.update(chunk=pipe.first_chunk, segments=pipe.segments, bytes_sent=pipe.sent)
    raise_if_damaged("scatter_allgather", info, defer_damage)
    if direct:
        return out  # type: ignore[return-value]
    res = res.reshape(x.shape).to(x.dtype)
    return res if out is None else out.copy_(res)


class ScatterPipeline:
    """The scatter/all-gather protocol (module docstring) as a software pipeline over a stream of
    segments, which may arrive over time (the DDP hook adds its groups as the backward pass produces
    them). Steps per segment ``s``: ``encode`` (chunks encoded, their all-to-all queued on the comm
    lane), ``reduce`` (wait for it, decode-and-average this rank's chunk, re-encode, queue the
    all-gather) and ``finish`` (wait for it, decode into the output). After each new segment, the
    previous one is reduced and the one before finished, so the lane receives a2a(0), a2a(1),
    gather(0), a2a(2), gather(1), … in the same order on every rank, while this thread encodes and
    decodes beside the transfers. :meth:`flush` drains the pipeline.

    ``pipelined=False`` runs each exchange at once on the calling thread (a single segment: nothing
    to overlap). ``info`` receives the encode/comm/decode seconds and damage notes; :attr:`sent` is the
    bytes this rank sent so far."""

    def __init__(self, q: Quantizer, *, group: Any = None, second_ef: Optional[ErrorFeedback] = None,
                 checksum: bool = True, info: Optional[dict] = None, pipelined: bool = True,
                 device: Optional[torch.device] = None, check_finite: bool = True) -> None:
        # CUDA tensors: every exchange is issued from this thread, on the stream that wrote its buffer
        # (the backend's collectives run asynchronously on the GPU already; a second thread would issue
        # them on another stream with nothing ordering the two)
        pipelined = pipelined and (device is None or torch.device(device).type == "cpu")
        self.q = q
        self.q2: Quantizer = plain(q) if second_ef is None else second_ef
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.checksum = checksum
        self.check_finite = check_finite
        self.info = {} if info is None else info
        self.lane: Any = _lane() if pipelined else _Inline
        self.pipelined = pipelined
        self.sent = 0
        self.segments = 0
        self.first_chunk = 0
        self._stages: list[tuple[str, int, Future]] = []  # ("a2a" | "gather", segment, future), oldest first
        self._seg: dict[int, dict[str, Any]] = {}

    # -- the stream ----------------------------------------------------------------------------------
    def add(self, flat: torch.Tensor, out: torch.Tensor, *, seed: int, name: Optional[str],
            segment: int = SEGMENT_NUMEL) -> None:
        """Average the float32 vector ``flat`` into ``out`` (same length; may be ``flat`` itself),
        cut into segments of ``segment`` values; a vector of several segments gets seeds
        ``derive_seed(seed, None, f"segment{s}")`` and keys suffixed ``@s``, one segment keeps ``seed``
        and plain keys (as :func:`scatter_allgather`). ``out`` is written by later calls or :meth:`flush`."""
        from . import derive_seed

        n = flat.numel()
        nseg = max(1, -(-n // segment))
        for k in range(nseg):
            a, b = k * segment, min(n, (k + 1) * segment)
            sd, tg = (seed, "") if nseg == 1 else (derive_seed(seed, None, f"segment{k}"), f"@{k}")
            self._push(flat[a:b], out[a:b], sd, name, tg)

    def flush(self) -> None:
        """Finish every segment added so far."""
        while self._stages:
            self._advance()

    # -- stages --------------------------------------------------------------------------------------
    def _push(self, x: torch.Tensor, out: torch.Tensor, seed: int, name: Optional[str], tag: str) -> None:
        s = self.segments
        self.segments += 1
        self._stages.append(("a2a", s, self._encode(s, x, out, seed, name, tag)))
        # the pipeline keeps one exchange of each kind in flight: reduce the previous segment, finish the one before
        # (the lane then receives a2a(s), gather(s-1); and segment s-2 is decoded meanwhile)
        while sum(1 for kind, _, _ in self._stages if kind == "a2a") > 1 or len(self._stages) > 2:
            self._advance()

    def _advance(self) -> None:
        """Move the oldest stage on: reduce a segment whose all-to-all was queued, or finish one
        whose all-gather was."""
        kind, s, fut = self._stages.pop(0)
        if kind == "a2a":
            self._stages.append(("gather", s, self._reduce(s, fut)))
        else:
            self._finish(s, fut)

    def _submit(self, fn: Callable[[], Any]) -> Future:
        if self.pipelined:
            return self.lane.submit(fn)
        with phase(self.info, "comm"):  # one segment: the exchange runs here and now
            return self.lane.submit(fn)

    def _encode(self, s: int, x: torch.Tensor, out: torch.Tensor, seed: int, name: Optional[str], tag: str) -> Future:
        from . import derive_seed

        q, rank, world = self.q, self.rank, self.world
        trailer = seal_bytes(x.device, self.checksum)
        pieces, chunk = _chunks(x, world)
        if s == 0:
            self.first_chunk = chunk
        self._seg[s] = {"chunk": chunk, "out": out, "n": x.numel(), "seed": seed, "name": name, "tag": tag,
                        "trailer": trailer}
        fixed = q.expected_nbytes(chunk)
        fixed = None if fixed is None else fixed + trailer
        with phase(self.info, "encode"):
            payloads = []
            for j in range(world):
                ss = derive_seed(seed, None, f"chunk{j}") if q.needs_shared_seed else None
                payloads.append(q.encode(pieces[j], seed=derive_seed(seed, rank, f"chunk{j}"), shared_seed=ss,
                                         name=_key(name, f"chunk{j}{tag}"), check_finite=self.check_finite))
            send_sizes = [p.nbytes + trailer for p in payloads]
            if fixed is not None and any(sz != fixed for sz in send_sizes):
                raise RuntimeError(f"{q.spec}: chunk payload sizes {send_sizes} differ from the promised {fixed}")
            # serialized straight into one send buffer (no second concatenating copy)
            flat_send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=x.device)
            pos = 0
            for p, sz in zip(payloads, send_sizes):
                p.to_bytes(out=flat_send[pos:pos + p.nbytes])
                seal(flat_send[pos:pos + sz], trailer)
                pos += sz
        self.sent += sum(send_sizes) - send_sizes[rank]
        group = self.group
        return self._submit(lambda: _exchange(flat_send, send_sizes, fixed, group))

    def _reduce(self, s: int, fut: Future) -> Future:
        from . import derive_seed

        with phase(self.info, "comm"):  # what is left of the exchange once this thread needs it
            recv, recv_sizes = fut.result()
        st = self._seg[s]
        chunk, trailer, rank = st["chunk"], st["trailer"], self.rank
        with decoding(self.info):
            bodies, intact = zip(*(unseal(b, trailer) for b in torch.split(recv, recv_sizes)))
            for src in (m for m, ok in enumerate(intact) if not ok):
                where = f"{st['name']}: " if st["name"] else ""
                note_damage(self.info, f"{where}chunk {rank} payload from rank {src}"
                            + (f" (segment {st['tag'][1:]})" if st["tag"] else ""))
            # a damaged chunk is not decoded: the step will be refused, and its bytes could be anything
            zeros = lambda: recv.new_zeros(chunk, dtype=torch.float32)  # noqa: E731
            ss = derive_seed(st["seed"], None, f"chunk{rank}") if self.q.needs_shared_seed else None
            avg = decoded_or_zeros(self.info, lambda: _decode_mean(self.q, list(bodies), chunk, ss), zeros,
                                   f"chunk {rank}") if all(intact) else zeros()
        with phase(self.info, "encode"):
            # (with check_finite=False: the average of finite decodes, finite unless float32 overflows)
            pb = sealed_payload(self.q2.encode(avg, seed=derive_seed(st["seed"], rank, "reencode"),
                                               name=_key(st["name"], f"avg{rank}{st['tag']}"),
                                               check_finite=self.check_finite), trailer)
        self.sent += (self.world - 1) * int(pb.numel())
        fixed2 = self.q2.expected_nbytes(chunk)
        group = self.group
        return self._submit(lambda: all_gather_bytes(pb, None if fixed2 is None else fixed2 + trailer, group))

    def _finish(self, s: int, fut: Future) -> None:
        from . import derive_seed

        with phase(self.info, "comm"):
            gathered = fut.result()
        st = self._seg.pop(s)
        chunk, trailer, n, res = st["chunk"], st["trailer"], st["n"], st["out"]
        with decoding(self.info):
            for j, sealed in enumerate(gathered):
                lo, hi = j * chunk, min(n, (j + 1) * chunk)
                buf, ok = unseal(sealed, trailer)
                if not ok:
                    note_damage(self.info, (f"{st['name']}: " if st["name"] else "") + f"averaged chunk {j} from rank {j}")
                if hi <= lo:
                    continue
                if not ok:
                    res[lo:hi] = 0.0
                    continue
                # (the seed rank j re-encoded with: the shared seed its encode drew is known here)
                ss = (self.q2.implied_shared_seed(derive_seed(st["seed"], j, "reencode"))
                      if self.q2.needs_shared_seed else None)

                def one(lo=lo, hi=hi, buf=buf, ss=ss):
                    pl = self.q2.payload_from_bytes(buf, (chunk,), torch.float32, copy=False)
                    if hi - lo == chunk:
                        return self.q2.decode(pl, out=res[lo:hi], shared_seed=ss)
                    res[lo:hi] = self.q2.decode(pl, shared_seed=ss)[: hi - lo]
                    return res[lo:hi]
                decoded_or_zeros(self.info, one, lambda lo=lo, hi=hi: res[lo:hi].zero_(), f"averaged chunk {j}")
