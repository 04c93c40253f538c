"""Convex-side experiments of the QSGD paper ([QSGD], [QSGD-full], section 3 and appendix F).

* :mod:`.problems` — smooth, strongly convex problems with a known optimum (least squares, logistic
  regression; synthetic or scikit-learn digits) and sample sharding over simulated workers.
* :mod:`.runlog` — the run-directory format (``config.json`` + ``log.jsonl``) read by
  :func:`gradq.train.report.write_report`.
* :mod:`.tradeoff` — iterations and bits to reach ε against the number of levels ``s`` (Theorem 3.4).
* :mod:`.qsvrg` — quantized SVRG, linear convergence (Theorem 3.6) against plain QSGD.
* :mod:`.gd` — quantized full-gradient descent with top-component sign quantization (appendix F).
* :mod:`.async_ps` — asynchronous QSGD on a parameter server over torch.distributed (staleness).
* :mod:`.cli` — ``gradq convex tradeoff|qsvrg|async|gd``.
"""

from .problems import PROBLEMS, ConvexProblem, make_problem, shard
from .runlog import DivergedError, RunLog, run_subdir

__all__ = ["PROBLEMS", "ConvexProblem", "make_problem", "shard", "RunLog", "run_subdir", "DivergedError"]
