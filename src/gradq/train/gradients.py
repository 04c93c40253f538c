"""How each quantizer treats a real model's gradients: bits per coordinate, error and bias.

:func:`model_gradients` trains a small model for a few SGD steps (so the gradients are those of a model
that is learning, not of its initialisation) and returns one minibatch gradient per parameter tensor.
:func:`compare_quantizers` encodes those tensors layer by layer with every spec, ``trials`` times with
different seeds, and reports

* ``bits_per_coord`` — ``8·Σ nbytes / Σ n`` over the layers, header bytes included;
* ``rel_error`` — mean over trials of ``Σ‖Q(v) − v‖² / Σ‖v‖²``;
* ``rel_bias`` — ``‖E[Q(v)] − v‖ / ‖v‖``, from the unbiased estimator of the squared bias
  ``U = Σ_{a≠b} ⟨e_a, e_b⟩ / (T(T−1))`` with ``e_t = Q_t(v) − v`` over the ``T`` trials (independent
  trials make every cross term an unbiased estimate of ``‖E e‖²``), reported as ``sqrt(max(0, U))/‖v‖``;
* ``bias_noise`` — the smallest relative bias the trials can resolve: three standard deviations of
  ``U`` when the true bias is zero, ``3·sqrt(2·Σ_i σ_i⁴ / (T(T−1)))``, with ``σ_i²`` the per-coordinate
  sample variances, as a relative norm. A ``rel_bias`` below it is indistinguishable from zero;
* ``encode_ms`` / ``decode_ms`` — median wall time of one pass over all layers.
"""

from __future__ import annotations

import statistics
import time
from typing import Iterable, Optional

import torch
from torch import nn

from ..quantizers.base import Quantizer
from ..factory import build
from .data import Dataset

__all__ = ["model_gradients", "compare_quantizers", "format_table"]


def model_gradients(model: nn.Module, data: Dataset, *, warm_steps: int = 50, batch: int = 64, lr: float = 0.1,
                    seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Train ``warm_steps`` SGD steps, then return ``(name, gradient)`` of one fresh minibatch."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    n = data.x_train.shape[0]
    for _ in range(warm_steps + 1):
        idx = torch.randint(0, n, (batch,), generator=g)
        opt.zero_grad()
        loss_fn(model(data.x_train[idx]), data.y_train[idx]).backward()
        if _ < warm_steps:
            opt.step()
    return [(name, p.grad.detach().clone()) for name, p in model.named_parameters() if p.grad is not None]


def _one_pass(q: Quantizer, grads, seed: int) -> tuple[list, list, float, float]:
    t0 = time.perf_counter()
    payloads = [q.encode(v, seed=seed * 1000 + i, name=name) for i, (name, v) in enumerate(grads)]
    t1 = time.perf_counter()
    outs = [q.decode(p) for p in payloads]
    t2 = time.perf_counter()
    return payloads, outs, t1 - t0, t2 - t1


def compare_quantizers(specs: Iterable[str], grads: list[tuple[str, torch.Tensor]], *, trials: int = 16,
                       progress: Optional[callable] = None) -> list[dict]:
    """One row per spec (see the module docstring for the columns)."""
    total_sq = sum(float((v.double() ** 2).sum()) for _, v in grads)
    total_n = sum(v.numel() for _, v in grads)
    rows = []
    for spec in specs:
        proto = build(spec)
        sums = [torch.zeros_like(v, dtype=torch.float64) for _, v in grads]
        sq_sums = [torch.zeros_like(v, dtype=torch.float64) for _, v in grads]
        errs, enc_t, dec_t, nbytes = [], [], [], 0
        for t in range(trials):
            q = build(spec)  # fresh state: error-feedback residuals start at zero in every trial
            payloads, outs, te, td = _one_pass(q, grads, t)
            nbytes = sum(p.nbytes for p in payloads)
            enc_t.append(te)
            dec_t.append(td)
            err = 0.0
            for (name, v), y, acc, acc2 in zip(grads, outs, sums, sq_sums):
                e = y.double() - v.double()
                err += float((e ** 2).sum())
                acc += e
                acc2 += e ** 2
            errs.append(err / total_sq)
        rel_error = statistics.fmean(errs)
        pairs = trials * (trials - 1)
        cross = sum(float((acc ** 2).sum() - acc2.sum()) for acc, acc2 in zip(sums, sq_sums))
        rel_bias = max(0.0, cross / pairs / total_sq) ** 0.5
        var4 = sum(float((((acc2 - acc ** 2 / trials) / (trials - 1)) ** 2).sum()) for acc, acc2 in zip(sums, sq_sums))
        bias_noise = (3 * (2 * var4 / pairs) ** 0.5 / total_sq) ** 0.5
        rows.append({
            "compressor": str(proto), "unbiased": bool(proto.unbiased), "summable": bool(proto.summable),
            "bits_per_coord": 8.0 * nbytes / total_n, "compression": 32.0 * total_n / (8.0 * nbytes),
            "rel_error": rel_error, "rel_bias": rel_bias, "bias_noise": bias_noise,
            "encode_ms": 1e3 * statistics.median(enc_t), "decode_ms": 1e3 * statistics.median(dec_t),
        })
        if progress:
            progress(rows[-1])
    return rows


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table of :func:`compare_quantizers` rows."""
    head = ["compressor", "bits/coord", "ratio", "rel. error", "rel. bias", "unbiased", "summable",
            "enc ms", "dec ms"]
    def bias(r):
        if r["rel_bias"] > r["bias_noise"] or r["bias_noise"] == 0:
            return f"{r['rel_bias']:.3g}"
        return f"<{r['bias_noise']:.2g}"

    body = [[r["compressor"], f"{r['bits_per_coord']:.3f}", f"{r['compression']:.1f}x", f"{r['rel_error']:.4g}",
             bias(r), "yes" if r["unbiased"] else "no", "yes" if r["summable"] else "no",
             f"{r['encode_ms']:.1f}", f"{r['decode_ms']:.1f}"] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])
