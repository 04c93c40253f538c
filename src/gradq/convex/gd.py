"""Quantized gradient descent with top-component sign quantization (QSGD paper, appendix F).

Appendix F applies lossy compression to plain (full-gradient, single-machine) gradient descent: the
machine that computes ``∇f(x)`` sends a quantized version to the one holding ``x``. The quantizer
(**[reconstructed]**: the formulas are lost from our copy of the paper; this is the definition its prose
— "preserve the sign for each index in I(v), the 2-norm of v, and cancel out all remaining components"
— and Lemma F.1's three claims pin down):

* sort the coordinates by ``|v_i|``; ``I(v)`` = the smallest set of largest-magnitude indices with
  ``Σ_{i∈I} |v_i| ≥ ‖v‖₂``;
* ``Q(v)_i = ‖v‖₂·sgn(v_i)`` for ``i ∈ I(v)``, 0 elsewhere.

Lemma F.1: ``⟨v, Q(v)⟩ = ‖v‖₂·Σ_{i∈I}|v_i| ≥ ‖v‖₂²``; ``|I(v)| ≤ √n`` (``⌈√n⌉`` when ``√n`` is not an
integer: ``v = (1, …, 1)`` needs ``⌈√n⌉`` components); ``‖Q(v)‖² = |I(v)|·‖v‖² ≤ √n‖v‖²``.

Convergence (Theorem F.2, reconstructed from the lemma): for ``L``-smooth, ``mu``-strongly convex ``f`` and
``η = 1/(L√n)``, smoothness gives ``f(x − ηQ) ≤ f(x) − η‖∇f‖² + Lη²|I|‖∇f‖²/2`` and strong convexity
``‖∇f‖² ≥ 2mu(f − f*)``, so every step contracts the suboptimality by at least

    ρ_t = 1 − (2mu/(L√n))·(1 − |I_t|/(2√n))      (≈ 1 − mu/(L√n) when |I_t| ≈ √n),

about ``√n`` times more iterations than unquantized GD (``1 − mu/L`` with ``η = 1/L``).

Encoding counted here: 32 bits for the norm plus ``|I|·(⌈log₂ n⌉ + 1)`` bits (an index and a sign
per kept component) — at most ``32 + √n(log n + 1)`` bits per step against ``32n`` for a float32 gradient.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from .problems import ConvexProblem, make_problem
from .runlog import DivergedError, open_log, run_subdir, summary_groups

__all__ = ["top_sign_quantize", "top_sign_bits", "step_contraction_bound", "GDConfig", "run_gd", "run_gd_one",
           "gd_table", "TOPSIGN"]

#: the compressor name written to config.json for appendix F's quantizer (not a gradq wire scheme)
TOPSIGN = "topsign (appendix F)"


def top_sign_quantize(v: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Appendix F's ``Q(v)`` (module docstring) and ``|I(v)|``; a zero vector gives zeros and ``k = 0``."""
    v = v.reshape(-1)
    norm = v.norm()
    if v.numel() == 0 or float(norm) == 0.0:
        return torch.zeros_like(v), 0
    mags, order = v.abs().sort(descending=True)
    # smallest k with prefix sum >= ||v||; the last prefix sum is ||v||_1 >= ||v||_2, so k <= n
    # (compared in the vector's own precision; the min() guards against a rounding shortfall)
    k = min(int((mags.cumsum(0) < norm).sum()) + 1, v.numel())
    out = torch.zeros_like(v)
    keep = order[:k]
    out[keep] = norm * torch.sign(v[keep])
    return out, k


def top_sign_bits(k: int, n: int) -> int:
    """Bits of one quantized message: 32 (norm) + ``k·(⌈log₂ n⌉ + 1)`` (index and sign per component)."""
    return 32 + k * (max(1, math.ceil(math.log2(n))) + 1)


def step_contraction_bound(mu: float, L: float, n: int, k: int, lr: Optional[float] = None) -> float:
    """Guaranteed ``(f(x_{t+1}) − f*)/(f(x_t) − f*)`` for one quantized step with ``|I| = k`` and step ``lr``
    (default ``1/(L√n)``): ``1 − 2mu·lr·(1 − L·lr·k/2)``, from smoothness and strong convexity."""
    lr = 1.0 / (L * math.sqrt(n)) if lr is None else lr
    return 1.0 - 2.0 * mu * lr * (1.0 - L * lr * k / 2.0)


@dataclass
class GDConfig:
    """Settings of the quantized-GD experiment. ``lr=None``: ``1/(L√n)`` quantized (the analysis' step) and
    ``1/L`` unquantized; ``eps`` is the target suboptimality; ``fp32`` adds plain GD."""

    problem: str = "lsq-synthetic"
    lr: Optional[float] = None
    eps: float = 1e-10
    max_iters: int = 20000
    fp32: bool = True
    problem_seed: int = 0
    log_every: int = 1

    def validate(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0 (the target suboptimality f(x) - f*), got {self.eps}")
        if self.max_iters < 1 or self.log_every < 1:
            raise ValueError(f"max_iters and log_every must be >= 1, got {self.max_iters}, {self.log_every}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


def run_gd_one(problem: ConvexProblem, cfg: GDConfig, quantized: bool, run_dir: Optional[Path] = None, *,
               progress: bool = False) -> dict[str, Any]:
    """One gradient-descent run from ``x = 0`` (deterministic); returns its summary, writing ``run_dir``."""
    n = problem.dim
    lr = cfg.lr if cfg.lr is not None else (1.0 / (problem.L * math.sqrt(n)) if quantized else 1.0 / problem.L)
    label = "QGD top-sign" if quantized else "GD fp32"
    config = {"label": label, "compressor": TOPSIGN if quantized else "fp32", "experiment": "gd",
              "problem": problem.name, "workers": 1, "seed": 0, "lr": lr, "eps": cfg.eps,
              "max_iters": cfg.max_iters, "dim": n, "n_samples": problem.n_samples,
              "problem_seed": cfg.problem_seed, "L": problem.L, "mu": problem.mu}
    x = torch.zeros(n, dtype=torch.float64)
    sub = problem.suboptimality(x)
    bits, ks, ratios, bounds = 0, [], [], []
    hit: Optional[int] = None
    hit_bits: Optional[int] = None
    t = 0
    t0 = time.perf_counter()
    with open_log(run_dir, config) as log:
        for t in tqdm(range(1, cfg.max_iters + 1), desc=label, disable=None if progress else True, leave=False):
            g = problem.grad(x)
            if quantized:
                q, k = top_sign_quantize(g)
                bits += top_sign_bits(k, n)
                ks.append(k)
                bounds.append(step_contraction_bound(problem.mu, problem.L, n, k, lr))
            else:
                q, k = g.to(torch.float32).to(torch.float64), n
                bits += 32 * n
            x = x - lr * q
            prev, sub = sub, problem.suboptimality(x)
            if not math.isfinite(sub) or sub > 1e12:
                raise DivergedError(f"{label} diverged at iteration {t}; lower --lr (now {lr:.3g})")
            if prev > 0:
                ratios.append(sub / prev)
            done = sub <= cfg.eps
            if t % cfg.log_every == 0 or t == 1 or done or t == cfg.max_iters:
                log.row(kind="step", iteration=t, suboptimality=sub, bits=bits, k=k)
            if done:
                hit, hit_bits = t, bits
                break
        geo = math.exp(sum(math.log(max(r, 1e-300)) for r in ratios) / len(ratios)) if ratios else None
        summary = {"quantized": quantized, "eps": cfg.eps, "reached": hit is not None, "iterations_to_eps": hit,
                   "bits_to_eps": hit_bits, "iterations": t, "bits": bits, "final_suboptimality": sub,
                   "bits_per_iteration": bits / max(t, 1), "bits_fp32_per_iteration": 32 * n,
                   "mean_k": sum(ks) / len(ks) if ks else None, "max_k": max(ks) if ks else None,
                   "k_bound": math.ceil(math.sqrt(n)), "contraction_per_iteration": geo,
                   "worst_step_ratio": max(ratios) if ratios else None,
                   "rate_bound": (max(bounds) if quantized and bounds
                                  else 1.0 - 2.0 * problem.mu * lr * (1.0 - problem.L * lr / 2.0)),
                   "wall_s": time.perf_counter() - t0}
        log.summary(**summary)
    return summary


def run_gd(cfg: GDConfig, out: Optional[str | Path] = None, *, progress: bool = False,
           problem: Optional[ConvexProblem] = None) -> list[dict[str, Any]]:
    """Quantized GD (and plain GD when ``cfg.fp32``); one run directory each under ``out`` when given.
    Returns the summary rows with ``label`` added."""
    cfg.validate()
    problem = problem or make_problem(cfg.problem, seed=cfg.problem_seed)
    rows = []
    for quantized in ([False] if cfg.fp32 else []) + [True]:
        label = "QGD top-sign" if quantized else "GD fp32"
        d = run_subdir(out, label) if out is not None else None
        rows.append({"label": label, **run_gd_one(problem, cfg, quantized, d, progress=progress)})
    return rows


def gd_table(source: str | Path | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method: ``method``, ``iters_to_eps``, ``bits_per_iter``, ``fp32_bits_per_iter``,
    ``bits_to_eps``, ``mean_k`` / ``max_k`` / ``k_bound`` (kept components vs ⌈√n⌉), ``contraction`` (geometric
    mean per iteration), ``worst_ratio`` and ``rate_bound`` (the guaranteed per-step contraction)."""
    rows = []
    for label, items in summary_groups(source, "gd").items():
        s = items[0][1]
        rows.append({"method": label, "iters_to_eps": s.get("iterations_to_eps"),
                     "bits_per_iter": s.get("bits_per_iteration"),
                     "fp32_bits_per_iter": s.get("bits_fp32_per_iteration"),
                     "bits_to_eps": s.get("bits_to_eps"), "mean_k": s.get("mean_k"), "max_k": s.get("max_k"),
                     "k_bound": s.get("k_bound") if s.get("quantized") else None,
                     "contraction": s.get("contraction_per_iteration"), "worst_ratio": s.get("worst_step_ratio"),
                     "rate_bound": s.get("rate_bound"), "final_subopt": s.get("final_suboptimality")})
    return rows
