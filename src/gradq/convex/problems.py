"""Smooth, strongly convex test problems with a known optimum, for the theory side of QSGD.

Every problem is an L2-regularized empirical risk over ``N`` samples ``(a_j, b_j)``, ``a_j ∈ R^n``::

    f(x) = (1/N) Σ_j ℓ(a_j·x, b_j) + (reg/2)·‖x‖²

* least squares (``lsq-*``): ``ℓ(z, b) = ½(z − b)²``. ``f`` is a quadratic with Hessian
  ``H = AᵀA/N + reg·I``; ``L = λ_max(H)``, ``mu = λ_min(H)`` exactly, and ``x* = H⁻¹Aᵀb/N`` in closed form.
* logistic regression (``logreg-*``, labels ``b ∈ {−1, +1}``): ``ℓ(z, b) = log(1 + exp(−b·z))``.
  ``ℓ'' ≤ 1/4`` gives ``L = λ_max(AᵀA)/(4N) + reg``; ``mu = reg``; ``x*`` by damped Newton to a gradient
  norm ≤ 1e-13 (quadratic convergence, so f* is exact to float64 rounding).

These are the ``f`` of the QSGD paper's convex results ([QSGD], [QSGD-full], section 3: Theorem 3.4 for SGD
with ``Q_s``, Theorem 3.6 for QSVRG, appendix F for quantized gradient descent): smooth, strongly
convex, with ``f* = min f`` known to float64 precision so the suboptimality ``f(x) − f*`` can be
followed down to ~1e-10 and below (least squares evaluates it as ``½(x − x*)ᵀH(x − x*)``, free of
cancellation; logistic regression as ``f(x) − f*``, good to ~1e-16·f*). ``L_max`` is the largest
smoothness constant of a single sample's ``f_j`` (what SVRG-type steps must respect). All arithmetic
is float64 on the CPU; matrix-vector products are written as broadcast sums, which on these small
matrices avoids the BLAS thread pool (far slower than the arithmetic when the cores are busy).

Problems (``make_problem(name)``; defaults in brackets):

* ``lsq-synthetic`` [N=512, n=32, reg=1e-3]: Gaussian rows with column scales from 1 down to 0.3
  (``L/mu`` ≈ 14), targets ``A·x_true + 0.5·noise`` (the noise keeps per-sample gradients
  nonzero at ``x*``, so SGD sees real gradient variance there).
* ``logreg-synthetic`` [N=512, n=32, reg=1e-2]: Gaussian rows, labels ``sign(a·w + 0.5·noise)`` (not
  separable).
* ``lsq-digits`` / ``logreg-digits`` [all 1797 samples, reg=1e-3 / 1e-2]: scikit-learn's 8×8 digits,
  binary task "digit < 5" (+1) vs "digit ≥ 5" (−1) — the ±1 label is the least-squares target too;
  constant pixels are dropped, the remaining 61 features standardized and clipped to [−3, 3] **[decided:
  a few almost-always-blank pixels would otherwise reach |z| ≈ 40 and make single samples ~50× stiffer
  than the average]**, and a bias column appended (n = 62 on all samples). ``n_samples`` takes a
  seeded random subset; ``dim`` cannot be chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["ConvexProblem", "make_problem", "shard", "PROBLEMS"]

PROBLEMS: tuple[str, ...] = ("lsq-synthetic", "logreg-synthetic", "lsq-digits", "logreg-digits")

_DEFAULT_REG = {"lsq": 1e-3, "logreg": 1e-2}
_SYNTH_SAMPLES, _SYNTH_DIM = 512, 32


@dataclass(eq=False)
class ConvexProblem:
    """``f(x) = mean_j ℓ(a_j·x, b_j) + reg/2·‖x‖²`` on float64 data (see the module docstring).

    Build one with :func:`make_problem`. ``x`` arguments are 1-D tensors of length :attr:`dim` (any float
    dtype; they are cast to float64). ``x_star``, ``f_star``, ``L`` and ``mu`` are filled in at construction.
    """

    name: str
    kind: str                 # "lsq" or "logreg"
    A: torch.Tensor           # (n_samples, dim) float64
    b: torch.Tensor           # (n_samples,) float64 targets (±1 for logreg)
    reg: float
    L: float = field(init=False)
    mu: float = field(init=False)
    L_max: float = field(init=False)  # largest smoothness constant of one sample's f_j
    x_star: torch.Tensor = field(init=False)
    f_star: float = field(init=False)

    def __post_init__(self) -> None:
        if self.kind not in ("lsq", "logreg"):
            raise ValueError(f"problem kind must be 'lsq' or 'logreg', got {self.kind!r}")
        if self.reg <= 0:
            raise ValueError(f"reg must be > 0 so the problem is strongly convex, got {self.reg}")
        self.A = self.A.to(torch.float64).contiguous()
        self.b = self.b.to(torch.float64).contiguous()
        N = self.n_samples
        gram = self.A.T @ self.A / N
        eig = torch.linalg.eigvalsh(gram)
        row_sq = (self.A * self.A).sum(dim=1)
        if self.kind == "lsq":
            self.L = float(eig[-1]) + self.reg
            self.mu = float(eig[0].clamp_min(0.0)) + self.reg
            self.L_max = float(row_sq.max()) + self.reg
            self._H = gram + self.reg * torch.eye(self.dim, dtype=torch.float64)
            self._c = self.A.T @ self.b / N
            self.x_star = torch.linalg.solve(self._H, self._c)
        else:
            self.L = float(eig[-1]) / 4.0 + self.reg
            self.mu = self.reg
            self.L_max = float(row_sq.max()) / 4.0 + self.reg
            self.x_star = self._newton()
        self.f_star = self._direct_loss(self.x_star)

    # -- sizes -----------------------------------------------------------------------------------------
    @property
    def n_samples(self) -> int:
        return int(self.A.shape[0])

    @property
    def dim(self) -> int:
        return int(self.A.shape[1])

    @property
    def condition_number(self) -> float:
        """``L / mu`` (an upper bound for logistic regression)."""
        return self.L / self.mu

    # -- values ----------------------------------------------------------------------------------------
    def _x(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(x).to(torch.float64).reshape(-1)
        if x.numel() != self.dim:
            raise ValueError(f"x has {x.numel()} entries but problem {self.name!r} has dim {self.dim}")
        return x

    def _direct_loss(self, x: torch.Tensor) -> float:
        z = _mv(self.A, x)
        if self.kind == "lsq":
            data = 0.5 * torch.mean((z - self.b) ** 2)
        else:
            data = torch.mean(torch.nn.functional.softplus(-self.b * z))
        return float(data + 0.5 * self.reg * torch.dot(x, x))

    def loss(self, x: torch.Tensor) -> float:
        """``f(x)``: mean per-sample loss over all samples plus ``reg/2·‖x‖²``.

        For least squares this is evaluated as ``f* + ½(x − x*)ᵀH(x − x*)`` (exact for a quadratic, and
        free of the cancellation that would otherwise put a ~1e-16·f floor under the suboptimality)."""
        x = self._x(x)
        if self.kind == "lsq":
            return self.f_star + self._quad(x)
        return self._direct_loss(x)

    def _quad(self, x: torch.Tensor) -> float:
        e = x - self.x_star
        return 0.5 * float(torch.dot(e, self._H @ e))

    def grad(self, x: torch.Tensor, idx: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Gradient of the mean loss over samples ``idx`` (a LongTensor; ``None`` = all), ``reg·x`` included.

        So ``grad(x, torch.tensor([j]))`` is ``∇f_j(x)`` and the mean of the ``∇f_j`` is ``∇f``.
        """
        x = self._x(x)
        if idx is None:
            if self.kind == "lsq":
                return self._H @ x - self._c
            A, b = self.A, self.b
        else:
            idx = torch.as_tensor(idx, dtype=torch.long).reshape(-1)
            if idx.numel() == 0:
                raise ValueError("idx is empty; pass at least one sample index (or None for all samples)")
            A, b = self.A[idx], self.b[idx]
        z = _mv(A, x)
        if self.kind == "lsq":
            r = z - b
        else:
            r = -b * torch.sigmoid(-b * z)
        return (A * r[:, None]).sum(dim=0) / A.shape[0] + self.reg * x

    def suboptimality(self, x: torch.Tensor) -> float:
        """``max(f(x) − f*, 0.0)``."""
        x = self._x(x)
        if self.kind == "lsq":
            return max(self._quad(x), 0.0)
        return max(self._direct_loss(x) - self.f_star, 0.0)

    def _newton(self, tol: float = 1e-13, max_iter: int = 100) -> torch.Tensor:
        """Damped Newton (backtracking on f) for the logistic problem, from x = 0."""
        x = torch.zeros(self.dim, dtype=torch.float64)
        eye = torch.eye(self.dim, dtype=torch.float64)
        fx = self._direct_loss(x)
        for _ in range(max_iter):
            g = self.grad(x)
            if float(g.norm()) <= tol:
                break
            p = torch.sigmoid(_mv(self.A, x))
            H = (self.A.T * (p * (1 - p))) @ self.A / self.n_samples + self.reg * eye
            step = torch.linalg.solve(H, g)
            decrease = float(torch.dot(g, step))  # Newton decrement squared (> 0)
            t = 1.0
            while True:
                x_new = x - t * step
                f_new = self._direct_loss(x_new)
                if f_new <= fx - 0.25 * t * decrease or decrease < 1e-24:
                    break
                t *= 0.5
                if t < 1e-12:  # no decrease left at float64 precision: x is the optimum to rounding
                    return x
            x, fx = x_new, f_new
        return x

    def __repr__(self) -> str:
        return (f"ConvexProblem({self.name!r}, n_samples={self.n_samples}, dim={self.dim}, reg={self.reg:g}, "
                f"L={self.L:.4g}, mu={self.mu:.4g}, f*={self.f_star:.12g})")


def _mv(A: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``A @ x`` as a broadcast multiply and row sum: on these small matrices it avoids the BLAS thread
    pool, which costs far more than the arithmetic when the cores are busy."""
    return (A * x).sum(dim=1)


def _synthetic(kind: str, seed: int, n_samples: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(int(seed))
    if kind == "lsq":
        scales = torch.logspace(0.0, -0.52, dim, dtype=torch.float64)  # 1 .. 0.3: eigenvalues 1 .. 0.09
        A = torch.randn(n_samples, dim, generator=g, dtype=torch.float64) * scales
        x_true = torch.randn(dim, generator=g, dtype=torch.float64)
        b = A @ x_true + 0.5 * torch.randn(n_samples, generator=g, dtype=torch.float64)
    else:
        A = torch.randn(n_samples, dim, generator=g, dtype=torch.float64) / dim ** 0.5 * 2.0
        w = torch.randn(dim, generator=g, dtype=torch.float64)
        z = A @ w + 0.5 * torch.randn(n_samples, generator=g, dtype=torch.float64)
        b = torch.where(z >= 0, 1.0, -1.0).to(torch.float64)
    return A, b


def _digits(seed: int, n_samples: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    from ..train.data import load_dataset

    ds = load_dataset("digits", test_fraction=0.0, seed=int(seed))  # all 1797 samples, seeded order
    X = ds.x_train.to(torch.float64)
    Y = ds.y_train
    if n_samples is not None:
        if not 1 <= n_samples <= X.shape[0]:
            raise ValueError(f"digits has {X.shape[0]} samples; n_samples must be in 1..{X.shape[0]}, "
                             f"got {n_samples}")
        X, Y = X[:n_samples], Y[:n_samples]
    std = X.std(dim=0)
    keep = std > 1e-12
    X = ((X[:, keep] - X[:, keep].mean(dim=0)) / std[keep]).clamp(-3.0, 3.0)  # rare pixels: |z| <= 3
    X = torch.cat([X, torch.ones(X.shape[0], 1, dtype=torch.float64)], dim=1)
    b = torch.where(Y < 5, 1.0, -1.0).to(torch.float64)
    return X, b


def make_problem(name: str, *, seed: int = 0, n_samples: Optional[int] = None, dim: Optional[int] = None,
                 reg: Optional[float] = None) -> ConvexProblem:
    """Build problem ``name`` (one of :data:`PROBLEMS`; see the module docstring for the defaults).

    ``seed`` draws the synthetic data (or the digits subset when ``n_samples`` is given); ``reg`` is the L2
    weight (default 1e-3 for least squares, 1e-2 for logistic regression).
    """
    if name not in PROBLEMS:
        raise ValueError(f"unknown convex problem {name!r}; choose one of: {', '.join(PROBLEMS)}")
    kind, source = name.split("-", 1)
    reg = _DEFAULT_REG[kind] if reg is None else float(reg)
    if not reg > 0:
        raise ValueError(f"reg must be > 0 (it makes the problem strongly convex), got {reg}")
    if source == "synthetic":
        n_samples = _SYNTH_SAMPLES if n_samples is None else int(n_samples)
        dim = _SYNTH_DIM if dim is None else int(dim)
        if n_samples < 1 or dim < 1:
            raise ValueError(f"n_samples and dim must be >= 1, got n_samples={n_samples}, dim={dim}")
        A, b = _synthetic(kind, seed, n_samples, dim)
    else:
        if dim is not None:
            raise ValueError(f"{name} has a fixed dimension (the non-constant pixels + a bias: 62 for all "
                             "1797 samples); leave dim unset "
                             "or use a synthetic problem")
        A, b = _digits(seed, n_samples)
    return ConvexProblem(name=name, kind=kind, A=A, b=b, reg=reg)


def shard(n_samples: int, workers: int, rank: int) -> torch.Tensor:
    """Sample indices held by worker ``rank`` of ``workers``: the strided set ``rank, rank+workers, …``.

    The shards are disjoint and together cover ``0..n_samples-1``; their sizes differ by at most one.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not 0 <= rank < workers:
        raise ValueError(f"rank must be in 0..{workers - 1}, got {rank}")
    if n_samples < workers:
        raise ValueError(f"cannot shard {n_samples} samples over {workers} workers; use at most {n_samples} "
                         "workers or more samples")
    return torch.arange(rank, n_samples, workers, dtype=torch.long)
