"""Wrappers that take a quantizer and return one: error feedback.

**Error feedback** (Seide et al.'s 1BitSGD; docs/algorithms.md): keep the part of each gradient that
quantization lost and add it to the next one,

    u = g + e,   send Q(u),   e ← u − decode(Q(u)),

per tensor. It makes biased quantizers (signs, Top-K) converge, at the price of per-step bias. The
residuals are keyed by the ``name=`` given to ``encode`` (one per parameter in the DDP hook) and can be
saved with :meth:`ErrorFeedback.state_dict` and restored with :meth:`ErrorFeedback.load_state_dict`.

Spec: ``ef(qsgd:bits=2)`` or, equivalently, the option ``qsgd:bits=2,ef=1``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .errors import SpecError
from .payload import Payload
from .quantizers.base import EncodeContext, Quantizer, SharedStat
from .spec import make, register_wrapper

__all__ = ["ErrorFeedback"]


class ErrorFeedback(Quantizer):
    """Error feedback around any quantizer (see the module docstring).

    ``encode(x, name=k)`` quantizes ``x + e[k]`` and updates ``e[k]``; ``decode`` is the inner
    quantizer's. Not unbiased (the residual carries one step's error into the next). Summable when the
    inner quantizer is; in that case use :meth:`encode_codes`, which updates the residual from the
    worker's own codes under the shared stats.
    """

    name = "ef"
    unbiased = False

    def __init__(self, inner: Quantizer | str) -> None:
        inner = inner if isinstance(inner, Quantizer) else make(inner)
        if isinstance(inner, ErrorFeedback):
            raise SpecError(f"{inner} already has error feedback")
        self.inner = inner
        self._values = {}
        self.residuals: dict[str, torch.Tensor] = {}

    # -- identity ----------------------------------------------------------------------------------
    @property
    def spec(self) -> str:  # type: ignore[override]
        inner = self.inner.spec
        if self.inner.default_ef:
            return inner.replace(",ef=0", "").replace(":ef=0", "")
        return f"ef({inner})"

    @property
    def summable(self) -> bool:  # type: ignore[override]
        return self.inner.summable

    @property
    def needs_shared_seed(self) -> bool:  # type: ignore[override]
        return self.inner.needs_shared_seed

    @property
    def layerwise(self) -> bool:  # type: ignore[override]
        return self.inner.layerwise

    @property
    def max_code(self) -> Any:
        return self.inner.max_code  # type: ignore[attr-defined]

    def field_layout(self, numel: int) -> Optional[dict[str, tuple[torch.dtype, int]]]:
        return self.inner.field_layout(numel)

    def wire_fields(self, numel: int) -> tuple[str, ...]:
        return self.inner.wire_fields(numel)

    # -- residual state ----------------------------------------------------------------------------
    def _key(self, name: Optional[str]) -> str:
        return "" if name is None else str(name)

    def residual(self, x: torch.Tensor, name: Optional[str]) -> torch.Tensor:
        """The stored residual for ``name`` (zeros if none yet), checked against ``x``'s shape."""
        key = self._key(name)
        e = self.residuals.get(key)
        if e is None:
            return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if e.shape != x.shape:
            raise ValueError(f"error-feedback residual for {key!r} has shape {tuple(e.shape)}, "
                             f"tensor has {tuple(x.shape)}; use distinct name= per tensor")
        return e.to(x.device)

    def _corrected(self, x: torch.Tensor, name: Optional[str]) -> torch.Tensor:
        self._flatten(x, name)  # validate (finite, floating) before mixing with the residual
        return x.detach().to(torch.float32) + self.residual(x, name)

    def reset(self) -> None:
        """Forget every residual."""
        self.residuals.clear()

    def state_dict(self) -> dict[str, Any]:
        """The residuals (CPU copies) and the spec, for checkpoints."""
        return {"spec": self.spec, "residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore residuals saved by :meth:`state_dict` (the spec must match)."""
        if state.get("spec") != self.spec:
            raise ValueError(f"error-feedback state was saved for {state.get('spec')!r}, not {self.spec!r}")
        self.residuals = {k: torch.as_tensor(v).to(torch.float32).clone() for k, v in state["residuals"].items()}

    # -- quantizer interface -----------------------------------------------------------------------
    def shared_stats(self, x: torch.Tensor, *, shared_seed: Optional[int] = None,
                     name: Optional[str] = None) -> dict[str, SharedStat]:
        return self.inner.shared_stats(self._corrected(x, name), shared_seed=shared_seed, name=name)

    def encode(self, x: torch.Tensor, *, seed: Optional[int] = None,
               generator: Optional[torch.Generator] = None,
               shared: Optional[Mapping[str, torch.Tensor]] = None,
               shared_seed: Optional[int] = None, name: Optional[str] = None) -> Payload:
        u = self._corrected(x, name)
        payload = self.inner.encode(u, seed=seed, generator=generator, shared=shared,
                                    shared_seed=shared_seed, name=name)
        self.residuals[self._key(name)] = (u - self.inner.decode(payload).to(torch.float32)).detach()
        return Payload(self.spec, tuple(x.shape), x.dtype, payload.numel, payload.fields)

    def decode(self, payload: Payload, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if payload.spec != self.spec:
            from .errors import PayloadError

            raise PayloadError(f"payload was encoded by {payload.spec!r}, cannot decode with {self.spec!r}")
        inner = Payload(self.inner.spec, payload.shape, payload.dtype, payload.numel, payload.fields)
        return self.inner.decode(inner, out=out)

    def encode_codes(self, x: torch.Tensor, *, shared: Optional[Mapping[str, torch.Tensor]] = None,
                     seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                     shared_seed: Optional[int] = None, name: Optional[str] = None) -> torch.Tensor:
        """Codes of ``x + e`` under the shared stats; updates ``e`` from this worker's own codes."""
        if not self.inner.summable:
            raise TypeError(f"{self.inner.name} codes are not summable")
        u = self._corrected(x, name)
        if shared is None:
            shared = {k: s.value for k, s in self.inner.shared_stats(u, shared_seed=shared_seed).items()}
        codes = self.inner.encode_codes(u, shared=shared, seed=seed, generator=generator,  # type: ignore[attr-defined]
                                        shared_seed=shared_seed, name=name)
        mine = self.inner.decode_codes(codes, shared=shared, count=1, like=u,  # type: ignore[attr-defined]
                                       shared_seed=shared_seed)
        self.residuals[self._key(name)] = (u - mine).detach()
        return codes

    def decode_codes(self, codes: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.inner.decode_codes(codes, **kwargs)  # type: ignore[attr-defined]

    def _check_fields(self, payload: Payload) -> None:
        self.inner._check_fields(payload)

    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError("ErrorFeedback overrides encode")


def _ef_wrapper(inner: Quantizer, **params: str) -> Quantizer:
    if params:
        raise SpecError(f"ef(...) takes no parameters, got {sorted(params)}")
    return ErrorFeedback(inner)


register_wrapper("ef", _ef_wrapper)
