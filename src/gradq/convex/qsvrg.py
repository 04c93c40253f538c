"""Quantized SVRG (QSVRG) against plain QSGD (QSGD paper, section 3.3, Theorem 3.6; docs/algorithms.md).

``f = (1/N) Σ_j f_j`` smooth and strongly convex, the samples split over ``K`` simulated workers.
QSVRG, epoch ``p`` (``y^(1) = 0``):

1. every worker sends its full local gradient ``h_i = ∇f_{S_i}(y^(p))`` **unquantized** (``32n`` bits per
   worker); everyone forms ``∇f(y^(p)) = Σ_i |S_i|/N · h_i``;
2. ``x_0 = y^(p)``; for ``t = 0 … T−1`` each worker draws ``j`` uniformly from its own shard and sends
   ``u_{t,i} = Q̃(∇f_j(x_t) − ∇f_j(y^(p)) + ∇f(y^(p)))`` with ``Q̃ = Q_√n`` (``s = ⌈√n⌉``, L2 norm, one
   bucket, Elias-coded by default: about ``2.8n + 32`` bits, Corollary 3.3); ``x_{t+1} = x_t − η·mean_i u_{t,i}``;
3. ``y^(p+1) = (1/T) Σ_{t=1..T} x_t`` (the mean of the epoch's iterates).

Theorem 3.6: with ``η = O(1/L)`` and ``T = O(L/ℓ)`` (``L`` the smoothness of the ``f_j``, ``ℓ`` the strong
convexity of ``f``), ``E f(y^(p+1)) − f* ≤ 0.9^p (f(y^(1)) − f*)`` — linear convergence, because the
message shrinks with ``x − x*`` and so does its quantization noise. It also bounds the traffic per
worker and epoch by ``(32 + 2.8n)(T + 1) + 32n`` bits (reported as ``theorem_bits_per_epoch``, for all
workers; compare ``bits_per_epoch_data``, which leaves out gradq's per-payload header and so counts the
Elias stream, the fp32 scale and gradq's 32-bit CRC). Plain QSGD with the same quantizer
only converges sublinearly (its gradient noise does not vanish at ``x*``).

The comparison spends the same number of sample-gradient evaluations per worker and epoch,
``|S_i| + 2T``: plain QSGD takes ``T`` steps per "epoch" with minibatches of ``round((|S_i| + 2T)/T)``
samples (so it also sends the same number of quantized messages), step ``min(lr, 2/(mu·t))``
(``schedule="decay"``, default) or ``lr`` (``"constant"``). Both log one ``epoch`` row per epoch
(``suboptimality``, cumulative ``bits``, ``grad_evals`` per worker); QSVRG's summary carries
``contraction_per_epoch`` — ``exp`` of the least-squares slope of ``log(f(y^(p)) − f*)`` against ``p``
over the epochs (from the first epoch's end on) above ``floor`` — and ``max_epoch_ratio``, the worst
single-epoch ratio there.

Defaults: ``lr = 0.2/L`` **[decided: the constant in η = O(1/L) is not given; 0.2/L contracts by ≈0.2 per
epoch on lsq-synthetic]**, ``T = |S_i|`` (one pass over a worker's shard per epoch).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from .problems import ConvexProblem, make_problem, shard
from .runlog import DivergedError, open_log, run_subdir, summary_groups
from .tradeoff import Channel, qsgd_spec, step_size

__all__ = ["QSVRGConfig", "run_qsvrg", "run_qsvrg_one", "run_plain_qsgd_one", "fit_contraction", "qsvrg_table"]


@dataclass
class QSVRGConfig:
    """Settings of the QSVRG-vs-QSGD comparison (``None`` = the default stated in the module docstring).

    ``levels=None`` means ``⌈√n⌉``; ``inner=None`` means ``|S_i|``; ``lr=None`` means ``0.2/L``.
    """

    problem: str = "lsq-synthetic"
    workers: int = 4
    epochs: int = 15
    inner: Optional[int] = None
    lr: Optional[float] = None
    levels: Optional[int] = None
    coding: str = "elias"
    schedule: str = "decay"
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    floor: float = 1e-12
    problem_seed: int = 0
    plain: bool = True

    def validate(self) -> None:
        for name in ("workers", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.inner is not None and self.inner < 1:
            raise ValueError(f"inner (steps per epoch) must be >= 1, got {self.inner}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.levels is not None and (int(self.levels) != self.levels or self.levels < 1):
            raise ValueError(f"levels must be an integer >= 1, got {self.levels}")
        if not self.floor > 0:
            raise ValueError(f"floor must be > 0, got {self.floor}")
        if not self.seeds:
            raise ValueError("give at least one seed")
        step_size(1.0, 1.0, 1, self.schedule)


def fit_contraction(subopts: list[float], floor: float = 1e-12) -> dict[str, Optional[float]]:
    """Fit ``subopt_p ≈ C·ρ^p`` on consecutive per-epoch suboptimalities above ``floor`` (the runs pass the
    values at the end of epochs 1, 2, …; the starting point is left out).

    Returns ``contraction_per_epoch`` (ρ; ``None`` with fewer than two points), ``max_epoch_ratio`` (the worst
    ``subopt_{p}/subopt_{p−1}`` among those points) and ``fit_epochs`` (how many epochs were used).
    """
    pts = [(p, math.log(v)) for p, v in enumerate(subopts) if v is not None and v > floor]
    # keep the leading run of epochs above the floor (later ones may bounce around it)
    run = []
    for p, lv in pts:
        if run and p != run[-1][0] + 1:
            break
        run.append((p, lv))
    if len(run) < 2:
        return {"contraction_per_epoch": None, "max_epoch_ratio": None, "fit_epochs": max(len(run) - 1, 0)}
    ps, ls = [p for p, _ in run], [lv for _, lv in run]
    pm, lm = sum(ps) / len(ps), sum(ls) / len(ls)
    slope = sum((p - pm) * (lv - lm) for p, lv in run) / sum((p - pm) ** 2 for p in ps)
    ratios = [math.exp(b - a) for a, b in zip(ls, ls[1:])]
    return {"contraction_per_epoch": math.exp(slope), "max_epoch_ratio": max(ratios), "fit_epochs": len(run) - 1}


def _setup(problem: ConvexProblem, cfg: QSVRGConfig) -> tuple[list[torch.Tensor], int, float, int]:
    shards = [shard(problem.n_samples, cfg.workers, i) for i in range(cfg.workers)]
    inner = cfg.inner if cfg.inner is not None else len(shards[0])
    lr = cfg.lr if cfg.lr is not None else 0.2 / problem.L
    s = cfg.levels if cfg.levels is not None else math.ceil(math.sqrt(problem.dim))
    return shards, inner, lr, s


def _config(problem: ConvexProblem, cfg: QSVRGConfig, label: str, spec: str, seed: int, lr: float,
            inner: int, s: int, **extra: Any) -> dict[str, Any]:
    return {"label": label, "compressor": spec, "experiment": "qsvrg", "problem": problem.name,
            "workers": cfg.workers, "seed": seed, "lr": lr, "epochs": cfg.epochs, "inner": inner, "levels": s,
            "coding": cfg.coding, "dim": problem.dim, "n_samples": problem.n_samples,
            "problem_seed": cfg.problem_seed, "L": problem.L, "L_max": problem.L_max, "mu": problem.mu, **extra}


def run_qsvrg_one(problem: ConvexProblem, cfg: QSVRGConfig, seed: int, run_dir: Optional[Path] = None, *,
                  progress: bool = False) -> dict[str, Any]:
    """One QSVRG run (module docstring); returns its summary row, writing ``run_dir`` when given."""
    shards, inner, lr, s = _setup(problem, cfg)
    chan = Channel(qsgd_spec(s, cfg.coding), seed=seed, levels=s)
    full = Channel(None)
    gen = torch.Generator().manual_seed(int(seed))
    label = f"QSVRG s={s}"
    config = _config(problem, cfg, label, chan.spec, seed, lr, inner, s, algorithm="qsvrg")
    y = torch.zeros(problem.dim, dtype=torch.float64)
    subs = [problem.suboptimality(y)]
    evals = 0
    t0 = time.perf_counter()
    with open_log(run_dir, config) as log:
        for epoch in tqdm(range(1, cfg.epochs + 1), desc=f"QSVRG seed {seed}", disable=None if progress else True,
                          leave=False):
            local = [full.send(problem.grad(y, sh)) for sh in shards]  # unquantized, 32n bits each
            g_y = sum(len(sh) * h for sh, h in zip(shards, local)) / problem.n_samples
            x, acc = y.clone(), torch.zeros_like(y)
            for _ in range(inner):
                msgs = []
                for sh in shards:
                    j = sh[torch.randint(len(sh), (1,), generator=gen)]
                    msgs.append(problem.grad(x, j) - problem.grad(y, j) + g_y)
                x = x - lr * chan.mean(msgs)
                acc += x
            y = acc / inner
            evals += len(shards[0]) + 2 * inner
            sub = problem.suboptimality(y)
            if not math.isfinite(sub) or sub > 1e12:
                raise DivergedError(f"QSVRG diverged in epoch {epoch} (f(y) - f* = {sub:.3g}); lower --lr "
                                         f"(now {lr:.3g})")
            subs.append(sub)
            log.row(kind="epoch", epoch=epoch, suboptimality=sub, bits=chan.bits + full.bits,
                    grad_evals=evals, ratio=sub / subs[-2] if subs[-2] > 0 else None)
        summary = {"algorithm": "qsvrg", "levels": s, "final_suboptimality": subs[-1],
                   "bits": chan.bits + full.bits, "bits_full_gradients": full.bits, "bits_quantized": chan.bits,
                   "bits_per_epoch": (chan.bits + full.bits) / cfg.epochs,
                   "bits_per_epoch_data": (chan.data_bits + full.data_bits) / cfg.epochs,
                   "theorem_bits_per_epoch": cfg.workers * ((32 + 2.8 * problem.dim) * (inner + 1) + 32 * problem.dim),
                   "grad_evals": evals,
                   "epoch_suboptimality": subs, **fit_contraction(subs[1:], cfg.floor), "floor": cfg.floor,
                   **chan.blowup(), "wall_s": time.perf_counter() - t0}
        log.summary(**summary)
    return summary


def run_plain_qsgd_one(problem: ConvexProblem, cfg: QSVRGConfig, seed: int, run_dir: Optional[Path] = None, *,
                       progress: bool = False) -> dict[str, Any]:
    """Plain QSGD with the same quantizer and gradient budget (module docstring); returns its summary."""
    shards, inner, lr, s = _setup(problem, cfg)
    batch = max(1, round((len(shards[0]) + 2 * inner) / inner))
    chan = Channel(qsgd_spec(s, cfg.coding), seed=seed, levels=s)
    gen = torch.Generator().manual_seed(int(seed))
    label = f"QSGD s={s} ({cfg.schedule} step)"
    config = _config(problem, cfg, label, chan.spec, seed, lr, inner, s, algorithm="qsgd", batch=batch,
                     schedule=cfg.schedule)
    x = torch.zeros(problem.dim, dtype=torch.float64)
    subs = [problem.suboptimality(x)]
    t, evals = 0, 0
    t0 = time.perf_counter()
    with open_log(run_dir, config) as log:
        for epoch in tqdm(range(1, cfg.epochs + 1), desc=f"QSGD seed {seed}", disable=None if progress else True,
                          leave=False):
            for _ in range(inner):
                t += 1
                grads = [problem.grad(x, sh[torch.randint(len(sh), (batch,), generator=gen)]) for sh in shards]
                x = x - step_size(lr, problem.mu, t, cfg.schedule) * chan.mean(grads)
            evals += inner * batch
            sub = problem.suboptimality(x)
            if not math.isfinite(sub) or sub > 1e12:
                raise DivergedError(f"plain QSGD diverged in epoch {epoch}; lower --lr (now {lr:.3g})")
            subs.append(sub)
            log.row(kind="epoch", epoch=epoch, suboptimality=sub, bits=chan.bits, grad_evals=evals)
        summary = {"algorithm": "qsgd", "levels": s, "final_suboptimality": subs[-1], "bits": chan.bits,
                   "bits_per_epoch": chan.bits / cfg.epochs, "bits_per_epoch_data": chan.data_bits / cfg.epochs,
                   "grad_evals": evals, "batch": batch,
                   "epoch_suboptimality": subs, **fit_contraction(subs[1:], cfg.floor), "floor": cfg.floor,
                   **chan.blowup(), "wall_s": time.perf_counter() - t0}
        log.summary(**summary)
    return summary


def run_qsvrg(cfg: QSVRGConfig, out: Optional[str | Path] = None, *, progress: bool = False,
              problem: Optional[ConvexProblem] = None) -> list[dict[str, Any]]:
    """QSVRG (and plain QSGD unless ``cfg.plain`` is False) for every seed; one run directory each under
    ``out`` when given. Returns the summary rows with ``label`` and ``seed`` added."""
    cfg.validate()
    problem = problem or make_problem(cfg.problem, seed=cfg.problem_seed)
    if cfg.coding == "fixed" and _setup(problem, cfg)[3] > 127:
        raise ValueError("fixed-width QSGD codes hold at most 127 levels; use coding=elias")
    rows = []
    runners = [(run_qsvrg_one, "QSVRG")] + ([(run_plain_qsgd_one, "QSGD")] if cfg.plain else [])
    for runner, name in runners:
        for seed in cfg.seeds:
            d = run_subdir(out, name, seed=seed) if out is not None else None
            row = runner(problem, cfg, seed, d, progress=progress)
            label = f"QSVRG s={row['levels']}" if name == "QSVRG" else f"QSGD s={row['levels']} ({cfg.schedule} step)"
            rows.append({"label": label, "seed": seed, **row})
    return rows


def qsvrg_table(source: str | Path | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per algorithm (seeds averaged, geometric mean for suboptimality): ``algorithm``, ``epochs``,
    ``grad_evals`` (per worker), ``final_subopt``, ``contraction`` (fitted per epoch), ``worst_ratio``,
    ``bits_per_epoch`` (all workers, on the wire), ``bits_per_epoch_data`` (without gradq's payload
    headers), ``thm3.6_bits_per_epoch`` (Theorem 3.6's bound, QSVRG only), ``blowup`` (measured
    quantization variance blow-up)."""
    rows = []
    for label, items in summary_groups(source, "qsvrg").items():
        sums = [s for _, s in items]
        finals = [max(float(s["final_suboptimality"]), 1e-300) for s in sums]
        contr = [s["contraction_per_epoch"] for s in sums if s.get("contraction_per_epoch") is not None]
        worst = [s["max_epoch_ratio"] for s in sums if s.get("max_epoch_ratio") is not None]
        rows.append({"algorithm": label, "seeds": len(sums),
                     "epochs": len(sums[0].get("epoch_suboptimality", [])) - 1,
                     "grad_evals": sums[0].get("grad_evals"),
                     "final_subopt": math.exp(sum(math.log(v) for v in finals) / len(finals)),
                     "contraction": sum(contr) / len(contr) if contr else None,
                     "worst_ratio": max(worst) if worst else None,
                     "bits_per_epoch": sum(s["bits_per_epoch"] for s in sums) / len(sums),
                     "bits_per_epoch_data": sum(s["bits_per_epoch_data"] for s in sums) / len(sums),
                     "thm3.6_bits_per_epoch": sums[0].get("theorem_bits_per_epoch"),
                     "blowup": sum(s.get("measured_variance_blowup") or 0.0 for s in sums) / len(sums)})
    return rows
