"""Adaptive compression: time whole steps with float32 averaging and with the spec, run the faster.

Compression pays only where the network is the bottleneck. :class:`AdaptiveController` decides it
for a DDP hook, per run, from measurements:

* **Probing.** After ``settle`` uncounted float32 steps (the first steps of a run are slow: caches,
  DDP's bucket rebuild, first calls), the hook alternates float32 and the spec for
  ``2·probe_steps`` steps, so a drift of the machine hits both modes alike. The controller times
  whole steps: the interval between the starts of consecutive steps, so forward, backward,
  optimizer and the wait for communication are all in it.
* **Deciding.** The ranks agree in one small collective: a MAX all-reduce of every rank's two
  medians, so the slowest rank's view decides, and identically everywhere. The spec is chosen only
  if its median is below float32's by more than ``margin``; float32 is always safe for accuracy.
* **Following changes.**
  - Every ``reprobe_every`` steps the controller probes again (without settling steps).
  - Every ``check_every`` steps the ranks compare the running median of the chosen mode with its
    steady median, taken at the first check after the decision: one more small MAX all-reduce. A
    drift beyond ``drift`` (relative) probes again at once.
  - Both triggers are functions of the step and of agreed values, so every rank switches at the
    same step.

Error feedback across a switch **[decided]**: residuals are kept, untouched, through float32 steps
and resume when compression resumes. During float32 steps the exact gradient is sent, so "what was
sent = the gradients − the residuals" stays true over the whole run.

**Which tensors to compress** (``min_numel="auto"``): :func:`fp32_threshold` sets the hook's float32
threshold from the link's latency and bandwidth (:func:`measure_link`) and the scheme's codec speed
(:func:`measure_codec`), measured once at the first step and agreed over the ranks.

Resume: :meth:`AdaptiveController.state_dict` holds the mode, the probe's samples and the schedule,
so a resumed run continues in the same mode at the same step. Decisions after that depend on
timings, which no run reproduces; given the same decisions, the results are bit-identical.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

__all__ = ["AdaptiveController", "FP32", "SPEC", "fp32_threshold", "measure_link", "measure_codec", "NEVER"]

FP32 = "fp32"
SPEC = "spec"


@dataclass
class AdaptiveController:
    """The adaptive mode's schedule and measurements (see the module docstring).

    Args:
        probe_steps: counted steps per mode in a probe (default 5).
        settle: uncounted float32 steps before the first probe's samples (default 2).
        reprobe_every: steps between the end of a probe and the next one (default 500).
        check_every: steps between drift checks (default 50).
        drift: relative change of the chosen mode's median that triggers a new probe (default 0.25).
        margin: the spec must beat float32 by this fraction to be chosen (default 0.02).
    """

    probe_steps: int = 5
    settle: int = 2
    reprobe_every: int = 500
    check_every: int = 50
    drift: float = 0.25
    margin: float = 0.02
    #: ``"probe"`` or ``"run"``
    phase: str = "probe"
    #: the mode of the run phase (``"fp32"`` until a probe decides)
    chosen: str = FP32
    #: the step at which the current probe started (or the next one starts, in the run phase)
    probe_start: int = 0
    samples: dict[str, list[float]] = field(default_factory=lambda: {FP32: [], SPEC: []})
    #: the agreed medians of the last decision (seconds per step), and the decisions so far
    medians: dict[str, float] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    recent: list[float] = field(default_factory=list)
    #: the chosen mode's steady median (seconds), the drift checks' reference (None: not yet taken)
    baseline: Optional[float] = None
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    _last_start: Optional[float] = field(default=None, repr=False)
    _last_mode: Optional[str] = field(default=None, repr=False)
    _last_step: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        for name in ("probe_steps", "reprobe_every", "check_every", "settle"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "settle" else 1):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'settle' else 'positive'} int, "
                                 f"got {v!r}")
        if not self.drift > 0 or not 0 <= self.margin < 1:
            raise ValueError(f"drift must be > 0 and margin in [0, 1), got {self.drift!r} and {self.margin!r}")

    # -- the schedule ------------------------------------------------------------------------------
    def _settle(self) -> int:
        """Uncounted steps at the start of this probe: only the run's first probe needs them."""
        return 0 if self.decisions else self.settle

    def _probe_len(self) -> int:
        return self._settle() + 2 * self.probe_steps

    def mode(self, step: int) -> str:
        """The mode of ``step``: during a probe, float32 for its settling steps (the first probe
        only), then float32 and the spec in turn; in the run phase, the chosen one."""
        if self.phase == "probe":
            k = step - self.probe_start - self._settle()
            return FP32 if k < 0 or k % 2 == 0 else SPEC
        return self.chosen

    def start_step(self, step: int, agree: Callable[[list[float]], list[float]]) -> str:
        """Called as a step starts (the hook's first bucket): credit the previous interval to the
        previous step's mode, decide or check when the schedule says so, and return this step's mode.

        ``agree`` sums nothing: it takes this rank's values and returns their MAX over the ranks (a
        small all-reduce; called at the same steps on every rank)."""
        now = self.clock()
        if self._last_start is not None and self._last_step == step - 1 and self._last_mode is not None:
            self._credit(step - 1, self._last_mode, now - self._last_start)
        if self.phase == "probe" and step - self.probe_start >= self._probe_len():
            self._decide(step, agree)
        elif self.phase == "run":
            if step >= self.probe_start:
                self._begin_probe(step)
            elif step % self.check_every == 0 and len(self.recent) >= min(self.check_every, 10):
                self._check_drift(step, agree)
        mode = self.mode(step)
        self._last_start, self._last_mode, self._last_step = now, mode, step
        return mode

    def _credit(self, step: int, mode: str, seconds: float) -> None:
        if self.phase == "probe":
            if step - self.probe_start >= self._settle():
                self.samples[mode].append(seconds)
        elif mode == self.chosen:
            self.recent.append(seconds)
            del self.recent[:-self.check_every]

    def _begin_probe(self, step: int) -> None:
        self.phase = "probe"
        self.probe_start = step
        self.samples = {FP32: [], SPEC: []}

    def _decide(self, step: int, agree: Callable[[list[float]], list[float]]) -> None:
        mine = [statistics.median(self.samples[FP32]), statistics.median(self.samples[SPEC])]
        t32, tspec = agree(mine)
        chosen = SPEC if tspec < t32 * (1.0 - self.margin) else FP32
        self.medians = {FP32: t32, SPEC: tspec}
        self.decisions.append({"step": step, "chosen": chosen, "fp32_s": t32, "spec_s": tspec,
                               "switch": chosen != self.chosen or not self.decisions})
        self.chosen = chosen
        self.phase = "run"
        self.probe_start = step + self.reprobe_every
        self.recent = []
        self.baseline = None

    def _check_drift(self, step: int, agree: Callable[[list[float]], list[float]]) -> None:
        now = statistics.median(self.recent)
        if self.baseline is None:
            # the first check after a decision takes the chosen mode's steady median as the reference:
            # a step timed inside the probe, next to steps of the other mode, is not the same step
            (self.baseline,) = agree([now])
            return
        off = abs(now - self.baseline) / self.baseline if self.baseline > 0 else 0.0
        (worst,) = agree([off])
        if worst > self.drift:
            self.decisions.append({"step": step, "chosen": self.chosen, "drift": worst, "reprobe": True})
            self._begin_probe(step)

    # -- reports and checkpoints -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What ``last_stats`` shows: the phase, the chosen mode, the agreed medians, decisions so far."""
        return {"adaptive_phase": self.phase, "adaptive_chosen": self.chosen,
                "adaptive_medians": dict(self.medians), "adaptive_decisions": len(self.decisions)}

    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "chosen": self.chosen, "probe_start": self.probe_start,
                "samples": {k: list(v) for k, v in self.samples.items()}, "medians": dict(self.medians),
                "decisions": [dict(d) for d in self.decisions], "recent": list(self.recent),
                "baseline": self.baseline, "settings": self.settings()}

    def settings(self) -> dict[str, Any]:
        return {"probe_steps": self.probe_steps, "settle": self.settle, "reprobe_every": self.reprobe_every,
                "check_every": self.check_every, "drift": self.drift, "margin": self.margin}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["settings"] != self.settings():
            raise ValueError(f"adaptive settings differ: saved {state['settings']}, now {self.settings()}")
        self.phase, self.chosen, self.probe_start = state["phase"], state["chosen"], int(state["probe_start"])
        self.samples = {k: list(v) for k, v in state["samples"].items()}
        self.medians = dict(state["medians"])
        self.decisions = [dict(d) for d in state["decisions"]]
        self.recent = list(state["recent"])
        self.baseline = state.get("baseline")
        self._last_start = self._last_mode = None
        self._last_step = -1


def max_over_ranks(values: list[float], group: Any, device: torch.device) -> list[float]:
    """The MAX over the group's ranks of every value (one small all-reduce)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


# -- the float32 threshold from measurement (min_numel="auto") ---------------------------------------------
#: the threshold when compression never pays (every tensor stays float32)
NEVER = 1 << 62


def fp32_threshold(*, world: int, wire_bits: float, protocol: str, alpha_s: float, bandwidth: float,
                   codec_s_per_value: float, call_s: float, own_call: bool) -> int:
    """The smallest tensor worth quantizing: ``n* = (call_s + [α if own_call]) / (saved − codec)``.

    A float32 tensor rides in the step's last collective, which runs anyway. Quantizing ``n`` values
    instead saves ``n·(4·f₃₂ − (wire_bits/8)·f)/bandwidth`` seconds of transfer, where ``f₃₂ =
    2(M−1)/M`` (the float32 sum) and ``f`` is the protocol's bytes per worker per payload byte:
    ``2(M−1)/M`` for the integer all-reduce and scatter, ``M−1`` for an all-gather. It costs
    ``n·codec_s_per_value`` of encode and decode, a fixed ``call_s`` per tensor, and, when the
    tensor gets a protocol call of its own (layer-wise schemes), one more collective latency ``α``.
    Never worth it (``NEVER``) when the transfer saved per value does not exceed the codec's cost."""
    if world < 2:
        return NEVER
    f32 = 2.0 * (world - 1) / world
    f = {"allreduce": f32, "scatter": f32, "allgather": float(world - 1), "ps": 2.0}.get(protocol, f32)
    saved = (4.0 * f32 - wire_bits / 8.0 * f) / bandwidth
    gain = saved - codec_s_per_value
    if gain <= 0:
        return NEVER
    fixed = call_s + (alpha_s if own_call else 0.0)
    return max(1, int(math.ceil(fixed / gain)))


def measure_link(group: Any, device: torch.device, nbytes: int = 1 << 20, repeats: int = 5) -> tuple[float, float]:
    """``(α seconds, bandwidth bytes/s)`` of the group's float32 all-reduce, the slowest rank's view:
    medians of ``repeats`` calls of 8 bytes and of ``nbytes``; the bandwidth counts the ring's
    ``2(M−1)/M`` bytes per worker against the large call's time less α."""
    import torch.distributed as dist

    world = dist.get_world_size(group)

    def timed(n: int) -> float:
        t = torch.zeros(n, dtype=torch.float32, device=device)
        times = []
        for _ in range(repeats + 1):
            dist.barrier(group=group)
            a = time.perf_counter()
            dist.all_reduce(t, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - a)
        return statistics.median(times[1:])

    alpha = timed(2)
    big = timed(max(2, nbytes // 4))
    alpha, big = max_over_ranks([alpha, big], group, device)
    moved = 2.0 * (world - 1) / world * nbytes
    return alpha, moved / max(big - alpha, 1e-9)


def measure_codec(q: Any, device: torch.device, n: int = 1 << 18, repeats: int = 5) -> tuple[float, float]:
    """``(seconds per value, seconds per call)`` of an encode and a decode of ``q`` on this device:
    medians over ``repeats`` of ``n`` values and of 16 values (the per-call overhead)."""
    def timed(m: int) -> float:
        x = torch.randn(m, generator=torch.Generator().manual_seed(m)).to(device)
        times = []
        for k in range(repeats + 1):
            a = time.perf_counter()
            q.decode(q.encode(x, seed=k))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - a)
        return statistics.median(times[1:])

    small = timed(16)
    large = timed(n)
    return max(large - small, 0.0) / n, small
