"""Communication against convergence: SGD with QSGD's ``Q_s`` for a range of ``s`` (QSGD paper, section 3.2).

Setting ([QSGD], [QSGD-full], section 3.2, Theorem 3.4). ``K`` workers, simulated in one process, each hold a
shard of the samples of a smooth, strongly convex ``f`` (:mod:`gradq.convex.problems`). In iteration ``t``
worker ``i`` draws a minibatch of ``batch`` samples from its shard, computes the stochastic gradient
``g_i``, and sends ``Q_s(g_i)`` (``qsgd:levels=s,norm=l2,bucket=none``: the analysed scheme, one bucket);
every worker decodes all ``K`` messages and applies ``x ← x − η_t · mean_i Q_s(g_i)``.

What the theory predicts. ``Q_s`` is unbiased with ``E‖Q_s(v) − v‖² ≤ min(n/s², √n/s)·‖v‖²`` (Lemma 3.1),
so it adds at most ``B' = min(n/s², √n/s)·B`` to the variance of a stochastic gradient with second
moment ``B``, and Theorem 3.4 needs ``T = O(R²·max(2B'/(Kε²), L/ε))`` iterations with ``K`` workers: in the
variance-limited regime the iterations to reach ε grow with the blow-up, while the bits per iteration
grow with ``s``
(about ``2.8n + 32`` with Elias coding at ``s = √n``, Corollary 3.3; ``32n`` unquantized).

How it is measured here.

* Step sizes are the same for every ``s``: ``η_t = min(lr, 2/(mu·t))`` (``schedule="decay"``, the default;
  ``lr`` defaults to ``0.5/L``). With this textbook strongly convex schedule ``E f(x_t) − f* ≈ c·B/t``, so
  the iterations to a small ε are proportional to the gradient's second moment — the quantity the
  theorem ties to ``s``. ``schedule="constant"`` keeps ``η = lr`` (a variance-dependent floor instead).
* A run stops at the first iteration with ``f(x_t) − f* ≤ eps`` (``iterations_to_eps`` and
  ``bits_to_eps`` are recorded) or after ``max_iters`` (then they are ``None``).
* ``measured_variance_blowup`` is the mean over all encodes of ``‖Q(g) − g‖²/‖g‖²`` with its standard
  error; ``expected_variance_blowup`` is the exact expectation for the same vectors,
  ``Σ_i φ_i(1 − φ_i)/s²`` with ``φ_i`` the fractional part of ``s|g_i|/‖g‖``; ``variance_bound`` is
  ``min(n/s², √n/s)``.
* Bits are ``payload.nbytes·8`` of the real payloads (``coding="elias"`` by default: the paper's Elias
  stream; gradq's payload header and the fp32 scale included), summed over workers;
  ``bits_per_iteration_data`` leaves out the payload header (26–31 bytes, which dominates at n = 32);
  ``bits_per_iteration_fixed`` is the same codes at fixed width; the unquantized baseline sends ``32n``
  bits per worker.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from tqdm.auto import tqdm

from .problems import ConvexProblem, make_problem, shard
from .runlog import DivergedError, open_log, run_subdir, summary_groups

__all__ = ["TradeoffConfig", "Channel", "auto_levels", "variance_bound", "expected_blowup", "qsgd_spec",
           "run_tradeoff", "run_tradeoff_one", "tradeoff_table", "plot_tradeoff", "step_size"]


def auto_levels(dim: int) -> list[int]:
    """``1, 2, 4, …`` up to the first power of two ``≥ √dim`` (the ``s ≈ √n`` end of the range)."""
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    out = [1]
    while out[-1] < math.sqrt(dim):
        out.append(out[-1] * 2)
    return out


def variance_bound(n: int, s: int) -> float:
    """Lemma 3.1's variance blow-up bound ``min(n/s², √n/s)``."""
    return min(n / s ** 2, math.sqrt(n) / s)


def expected_blowup(v: torch.Tensor, s: int) -> float:
    """Exact ``E‖Q_s(v) − v‖²/‖v‖²`` for QSGD with the L2 norm and one bucket: ``Σ φ_i(1−φ_i)/s²``."""
    v = v.to(torch.float64).reshape(-1)
    norm = float(v.norm())
    if norm == 0.0:
        return 0.0
    p = v.abs() * (s / norm)
    frac = p - p.floor()
    return float((frac * (1 - frac)).sum()) / s ** 2


def qsgd_spec(s: int, coding: str = "elias") -> str:
    """The gradq spec of the analysed ``Q_s``: L2 norm, the whole vector as one bucket."""
    if int(s) != s or s < 1:
        raise ValueError(f"the number of levels s must be an integer >= 1, got {s!r}")
    extra = "" if coding == "fixed" else f",coding={coding}"
    return f"qsgd:levels={int(s)},norm=l2,bucket=none{extra}"


class Channel:
    """The uplink of ``K`` simulated workers: encode each worker's vector with one gradq quantizer (or send
    it as float32 when ``spec`` is ``None``/``"fp32"``), decode, and keep the bit and error tallies.

    ``seed`` makes every encode reproducible (encode ``k`` of the run uses seed ``seed·2³² + k``).
    ``levels`` (the ``s`` of a QSGD spec) enables the exact expected blow-up tally.
    """

    def __init__(self, spec: Optional[str], seed: int = 0, levels: Optional[int] = None) -> None:
        import gradq

        self.q = None if spec in (None, "fp32") else gradq.build(spec)
        self.spec = "fp32" if self.q is None else self.q.spec
        self.levels = levels
        self._seed = (int(seed) & 0x7FFFFFFF) << 32
        self.count = 0
        self.bits = 0
        self.data_bits = 0  # the same without gradq's per-payload framing header
        self._r = self._r2 = self._expected = 0.0

    def send(self, v: torch.Tensor) -> torch.Tensor:
        """One worker's message: returns the receiver's float64 copy of ``v`` and adds its bits."""
        v32 = v.to(torch.float32)
        if not bool(torch.isfinite(v32).all()):
            raise DivergedError("a worker's vector is not finite (or overflows float32): the iteration "
                                     "diverged; lower --lr")
        self.count += 1
        if self.q is None:
            self.bits += 32 * v32.numel()
            self.data_bits += 32 * v32.numel()
            return v32.to(torch.float64)
        payload = self.q.encode(v32, seed=self._seed + self.count)
        self.bits += 8 * payload.nbytes
        self.data_bits += 8 * payload.data_nbytes
        out = self.q.decode(payload)
        sq = float(v32.to(torch.float64).pow(2).sum())
        if sq > 0:
            r = float((out - v32).to(torch.float64).pow(2).sum()) / sq
            self._r += r
            self._r2 += r * r
            if self.levels is not None:
                self._expected += expected_blowup(v32, self.levels)
        return out.to(torch.float64)

    def mean(self, vectors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Send every worker's vector and return the mean of the decoded copies."""
        return torch.stack([self.send(v) for v in vectors]).mean(dim=0)

    def blowup(self) -> dict[str, Optional[float]]:
        """Mean ``‖Q(g) − g‖²/‖g‖²`` over the encodes so far, its standard error, and the exact expectation."""
        if self.q is None or self.count == 0:
            return {"measured_variance_blowup": 0.0 if self.q is None else None,
                    "measured_variance_blowup_se": 0.0 if self.q is None else None,
                    "expected_variance_blowup": 0.0 if self.q is None else None}
        n = self.count
        mean = self._r / n
        var = max(self._r2 / n - mean * mean, 0.0) * n / max(n - 1, 1)
        return {"measured_variance_blowup": mean, "measured_variance_blowup_se": math.sqrt(var / n),
                "expected_variance_blowup": self._expected / n if self.levels is not None else None}


def step_size(lr: float, mu: float, t: int, schedule: str) -> float:
    """``lr`` (constant) or ``min(lr, 2/(mu·t))`` (decay) for the 1-based iteration ``t``."""
    if schedule == "constant":
        return lr
    if schedule == "decay":
        return min(lr, 2.0 / (mu * t))
    raise ValueError(f"schedule must be 'constant' or 'decay', got {schedule!r}")


@dataclass
class TradeoffConfig:
    """Settings of the trade-off sweep (defaults finish in well under a minute on two cores).

    ``levels=None`` means :func:`auto_levels` of the problem's dimension; ``lr=None`` means ``0.5/L``;
    ``fp32`` adds the unquantized baseline.
    """

    problem: str = "lsq-synthetic"
    workers: int = 4
    batch: int = 8
    levels: Optional[list[int]] = None
    fp32: bool = True
    eps: float = 1e-3
    lr: Optional[float] = None
    schedule: str = "decay"
    max_iters: int = 5000
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    coding: str = "elias"
    problem_seed: int = 0
    log_every: int = 10

    def validate(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0 (the target suboptimality f(x) - f*), got {self.eps}")
        for name in ("workers", "batch", "max_iters", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.levels is not None and (not self.levels or any(int(s) != s or s < 1 for s in self.levels)):
            raise ValueError(f"levels must be integers >= 1 (e.g. 1,2,4,8), got {self.levels}")
        if self.coding not in ("elias", "fixed", "elias-sparse", "elias-dense"):
            raise ValueError(f"coding must be elias, fixed, elias-sparse or elias-dense, got {self.coding!r}")
        if not self.seeds:
            raise ValueError("give at least one seed")
        step_size(1.0, 1.0, 1, self.schedule)


def _label(s: Optional[int]) -> str:
    return "fp32" if s is None else f"QSGD s={s}"


def run_tradeoff_one(problem: ConvexProblem, cfg: TradeoffConfig, s: Optional[int], seed: int,
                     run_dir: Optional[Path] = None, *, progress: bool = False) -> dict[str, Any]:
    """One run (levels ``s``, or fp32 when ``None``) with one seed; returns its summary row and writes
    ``run_dir`` when given."""
    n, K = problem.dim, cfg.workers
    lr = cfg.lr if cfg.lr is not None else 0.5 / problem.L
    spec = None if s is None else qsgd_spec(s, cfg.coding)
    chan = Channel(spec, seed=seed, levels=s)
    fixed_bits = None
    if s is not None and s <= 127:
        import gradq

        fixed_bits = K * 8 * gradq.build(qsgd_spec(s, "fixed")).expected_nbytes(n)
    shards = [shard(problem.n_samples, K, i) for i in range(K)]
    gen = torch.Generator().manual_seed(int(seed))
    config = {"label": _label(s), "compressor": chan.spec, "experiment": "tradeoff", "problem": problem.name,
              "workers": K, "seed": seed, "lr": lr, "levels": s, "dim": n, "n_samples": problem.n_samples,
              "batch": cfg.batch, "eps": cfg.eps, "schedule": cfg.schedule, "max_iters": cfg.max_iters,
              "coding": cfg.coding, "problem_seed": cfg.problem_seed, "L": problem.L, "mu": problem.mu}
    with open_log(run_dir, config) as log:
        x = torch.zeros(n, dtype=torch.float64)
        hit: Optional[int] = None
        hit_bits: Optional[int] = None
        hit_data_bits: Optional[int] = None
        t0 = time.perf_counter()
        bar = tqdm(range(1, cfg.max_iters + 1), desc=f"{_label(s)} seed {seed}", disable=None if progress else True,
                   leave=False)
        sub = problem.suboptimality(x)
        t = 0
        for t in bar:
            grads = []
            for i in range(K):
                idx = shards[i][torch.randint(len(shards[i]), (cfg.batch,), generator=gen)]
                grads.append(problem.grad(x, idx))
            eta = step_size(lr, problem.mu, t, cfg.schedule)
            x = x - eta * chan.mean(grads)
            sub = problem.suboptimality(x)
            if not math.isfinite(sub) or sub > 1e12:
                raise DivergedError(f"{_label(s)} diverged at iteration {t} (f(x) - f* = {sub:.3g}); lower --lr "
                                         f"(now {lr:.3g}) or raise --batch")
            done = sub <= cfg.eps
            if t % cfg.log_every == 0 or t == 1 or done or t == cfg.max_iters:
                log.row(kind="step", iteration=t, suboptimality=sub, bits=chan.bits, lr=eta)
            if done:
                hit, hit_bits, hit_data_bits = t, chan.bits, chan.data_bits
                break
        summary = {"levels": s, "eps": cfg.eps, "reached": hit is not None, "iterations_to_eps": hit,
                   "bits_to_eps": hit_bits, "data_bits_to_eps": hit_data_bits, "iterations": t, "bits": chan.bits,
                   "final_suboptimality": sub,
                   "bits_per_iteration": chan.bits / max(t, 1),
                   "bits_per_iteration_data": chan.data_bits / max(t, 1),
                   "bits_per_iteration_fixed": fixed_bits if s is not None else 32 * n * K,
                   "variance_bound": None if s is None else variance_bound(n, s),
                   **chan.blowup(), "wall_s": time.perf_counter() - t0}
        log.summary(**summary)
    return summary


def run_tradeoff(cfg: TradeoffConfig, out: Optional[str | Path] = None, *, progress: bool = False,
                 problem: Optional[ConvexProblem] = None) -> list[dict[str, Any]]:
    """Run every ``s`` (and fp32) with every seed; write one run directory each under ``out`` (when given)
    and return the summary rows (each with ``label`` and ``seed`` added)."""
    cfg.validate()
    problem = problem or make_problem(cfg.problem, seed=cfg.problem_seed)
    levels = list(cfg.levels) if cfg.levels is not None else auto_levels(problem.dim)
    if cfg.coding == "fixed" and max(levels) > 127:
        raise ValueError(f"fixed-width QSGD codes hold at most 127 levels; drop s={max(levels)} or use coding=elias")
    settings: list[Optional[int]] = ([None] if cfg.fp32 else []) + levels
    rows = []
    for s in settings:
        for seed in cfg.seeds:
            d = run_subdir(out, _label(s), seed=seed) if out is not None else None
            row = run_tradeoff_one(problem, cfg, s, seed, d, progress=progress)
            rows.append({"label": _label(s), "seed": seed, **row})
    return rows


def _mean(values: list[Any]) -> Optional[float]:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def tradeoff_table(source: str | Path | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per setting (seeds averaged) from a run folder or from :func:`run_tradeoff`'s rows.

    Columns: ``setting``, ``s``, ``bound`` (min(n/s², √n/s)), ``blowup`` (measured, mean over seeds),
    ``blowup_exact`` (expected for the same vectors), ``reached`` ("k/m" seeds), ``iters_to_eps`` (mean over
    the seeds that reached ε), ``iters_vs_fp32`` (that mean over fp32's), ``1+blowup`` (what the theory
    says that ratio should be), ``bits_per_iter`` (all workers, on the wire), ``bits_per_iter_data`` (the
    same without gradq's 26–31-byte payload header), ``bits_per_iter_fixed`` (fixed-width codes, header
    included), ``bits_to_eps`` (on the wire) and ``data_bits_to_eps`` (without the payload headers).
    """
    groups = summary_groups(source, "tradeoff")
    rows = []
    for label, items in groups.items():
        sums = [s for _, s in items]
        s_val = sums[0].get("levels")
        blow = _mean([x.get("measured_variance_blowup") for x in sums])
        rows.append({"setting": label, "s": s_val, "bound": sums[0].get("variance_bound"),
                     "blowup": blow, "blowup_exact": _mean([x.get("expected_variance_blowup") for x in sums]),
                     "reached": f"{sum(bool(x.get('reached')) for x in sums)}/{len(sums)}",
                     "iters_to_eps": _mean([x.get("iterations_to_eps") for x in sums]),
                     "iters_vs_fp32": None, "1+blowup": None if blow is None else 1.0 + blow,
                     "bits_per_iter": _mean([x.get("bits_per_iteration") for x in sums]),
                     "bits_per_iter_data": _mean([x.get("bits_per_iteration_data") for x in sums]),
                     "bits_per_iter_fixed": _mean([x.get("bits_per_iteration_fixed") for x in sums]),
                     "bits_to_eps": _mean([x.get("bits_to_eps") for x in sums]),
                     "data_bits_to_eps": _mean([x.get("data_bits_to_eps") for x in sums])})
    base = next((r["iters_to_eps"] for r in rows if r["s"] is None), None)
    if base:
        for r in rows:
            if r["iters_to_eps"] is not None:
                r["iters_vs_fp32"] = r["iters_to_eps"] / base
    rows.sort(key=lambda r: -1 if r["s"] is None else r["s"])
    return rows



def plot_tradeoff(table: Sequence[dict[str, Any]], path: str | Path) -> Optional[Path]:
    """Draw the trade-off from :func:`tradeoff_table` into ``path`` (PNG): left, bits to reach ε against
    ``s`` (on the wire and without payload headers; fp32 as a horizontal line); right, iterations to ε
    relative to fp32 against ``s``, next to the ``1 + blow-up`` measured and the ``1 + bound`` of
    Lemma 3.1. Returns ``None`` (drawing nothing) without matplotlib or without a quantized setting that
    reached ε."""
    from ..train.report_figures import have_matplotlib

    rows = [r for r in table if r["s"] is not None and r["bits_to_eps"] is not None]
    if not rows or not have_matplotlib():
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    s = [r["s"] for r in rows]
    left.plot(s, [r["bits_to_eps"] for r in rows], "o-", label="QSGD, on the wire (payload header included)")
    left.plot(s, [r["data_bits_to_eps"] for r in rows], "s--", label="QSGD, codes only")
    base = next((r for r in table if r["s"] is None and r["bits_to_eps"] is not None), None)
    if base is not None:
        left.axhline(base["bits_to_eps"], color="k", lw=1, ls=":", label="fp32")
    left.set(yscale="log", xlabel="levels s (log scale)", ylabel="bits sent by all workers to reach ε",
             title="Bits to reach ε against s")
    if base is not None and base["iters_to_eps"]:
        right.plot(s, [r["iters_vs_fp32"] for r in rows], "o-", label="iterations to ε ÷ fp32's")
    right.plot(s, [r["1+blowup"] for r in rows], "s--", label="1 + measured variance blow-up")
    right.plot(s, [1 + r["bound"] for r in rows], "^:", label="1 + min(n/s², √n/s) (Lemma 3.1)")
    right.set(yscale="log", xlabel="levels s (log scale)", ylabel="ratio",
              title="Iterations to ε against the variance blow-up")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(s, [str(v) for v in s])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    right.yaxis.set_major_formatter(ScalarFormatter())
    right.yaxis.set_minor_formatter(ScalarFormatter())
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    return out
