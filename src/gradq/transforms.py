"""Wrappers that take a quantizer and return one: error feedback.

**Error feedback** (Seide et al.'s 1BitSGD; docs/algorithms.md): keep the part of each gradient that
quantization lost and add it to the next one,

    u = g + e,   send Q(u),   e ← u − decode(Q(u)),

per tensor. It makes biased quantizers (signs, Top-K) converge, at the price of per-step bias. The
residuals are keyed by the ``name=`` given to ``encode`` (one per parameter in the DDP hook) and form
an explicit :class:`ErrorFeedbackState`: :meth:`ErrorFeedback.encode_with` takes one and returns the
next, and the wrapper holds one for the protocols and the hook, which call ``encode``. The held state
is saved with :meth:`ErrorFeedback.state_dict` and restored with :meth:`ErrorFeedback.load_state_dict`.

Spec: ``ef(qsgd:bits=2)`` or, equivalently, the option ``qsgd:bits=2,ef=1``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from .errors import SpecError
from .kernels.checks import deferred_checks
from .payload import Payload
from .quantizers.base import EncodeContext, Quantizer, SharedStat
from .spec import make, register_wrapper

__all__ = ["ErrorFeedback", "ErrorFeedbackState"]


def _key(name: Optional[str]) -> str:
    return "" if name is None else str(name)


def _versions(*tensors: torch.Tensor) -> Optional[tuple[int, ...]]:
    """The tensors' version counters (each in-place change moves one), or None where one has none
    (an inference-mode tensor)."""
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:
        return None


@dataclass
class ErrorFeedbackState:
    """The state of error feedback: one residual per tensor name (float32, the tensor's shape).

    Explicit state, as optimizer wrappers keep theirs: :meth:`ErrorFeedback.init_state` makes an
    empty one, :meth:`ErrorFeedback.encode_with` takes one and returns the next (the one passed in
    is left as it was), and :meth:`state_dict` / :meth:`from_state_dict` save and restore it."""

    residuals: dict[str, torch.Tensor] = field(default_factory=dict)

    def residual(self, x: torch.Tensor, name: Optional[str]) -> torch.Tensor:
        """The residual for ``name`` (zeros if none yet), checked against ``x``'s shape."""
        key = _key(name)
        e = self.residuals.get(key)
        if e is None:
            return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if e.shape != x.shape:
            raise ValueError(f"error-feedback residual for {key!r} has shape {tuple(e.shape)}, "
                             f"tensor has {tuple(x.shape)}; use distinct name= per tensor")
        return e.to(x.device)

    def with_residual(self, name: Optional[str], value: torch.Tensor) -> "ErrorFeedbackState":
        """A new state: this one with ``name``'s residual replaced (the other tensors are shared)."""
        return ErrorFeedbackState({**self.residuals, _key(name): value.detach()})

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies of the residuals."""
        return {k: v.detach().cpu().clone() for k, v in self.residuals.items()}

    @classmethod
    def from_state_dict(cls, residuals: Mapping[str, Any]) -> "ErrorFeedbackState":
        return cls({k: torch.as_tensor(v).to(torch.float32).clone() for k, v in residuals.items()})


class ErrorFeedback(Quantizer):
    """Error feedback around any quantizer (see the module docstring).

    ``encode(x, name=k)`` quantizes ``x + e[k]`` and updates ``e[k]``; ``decode`` is the inner
    quantizer's. Not unbiased (the residual carries one step's error into the next). Summable when the
    inner quantizer is; in that case use :meth:`encode_codes`, which updates the residual from the
    worker's own codes under the shared stats.

    The residuals form an :class:`ErrorFeedbackState`. The wrapper holds one (``.state``) for the
    protocols and the DDP hook, which call :meth:`encode`; :meth:`encode_with` is the same step on a
    state passed in and returned, for code that keeps its state itself.

    Memory: a step makes ``u = x + e``, which becomes the next residual. On the held state, for CPU
    tensors, ``u`` is written into the residual that the previous step replaced (its *spare*)
    rather than into new memory: fresh CPU memory costs a page fault every 4 KB, which made the
    add 3–4× slower at 25M values (docs/performance.md); the all-reduce's fields step also decodes
    the worker's own fields into the residual it replaces, once ``u`` is made. So a residual read
    from the held state stays valid only until the next step of its name replaces it: copy it to
    keep it (or use :meth:`state_dict`). ``spares=False`` (or setting ``.spares``) makes each step allocate
    instead, holding one buffer fewer per tensor between steps (the FSDP integration does);
    :meth:`encode_with` and the other ``…_with`` steps never reuse memory and never change the
    state they are given. CUDA tensors keep no spare: the caching allocator reuses freed memory.
    """

    name = "ef"
    unbiased = False

    def __init__(self, inner: Quantizer | str, state: Optional[ErrorFeedbackState] = None,
                 spares: bool = True) -> None:
        inner = inner if isinstance(inner, Quantizer) else make(inner)
        if isinstance(inner, ErrorFeedback):
            raise SpecError(f"{inner} already has error feedback")
        super().__init__()
        self.inner = inner
        self.state = ErrorFeedbackState() if state is None else state
        #: whether held-state steps reuse the replaced residual's memory for ``x + e`` (class docstring)
        self.spares = spares
        self._spare: dict[str, torch.Tensor] = {}   # per name: CPU memory no held state refers to any more
        self._made: dict[str, tuple] = {}   # per name: (spare, x, e, their versions) where the spare holds x + e

    @property
    def residuals(self) -> dict[str, torch.Tensor]:
        """The held state's residuals, by tensor name."""
        return self.state.residuals

    @residuals.setter
    def residuals(self, value: Mapping[str, torch.Tensor]) -> None:
        self.state = ErrorFeedbackState(dict(value))
        self._spare.clear()
        self._made.clear()

    @property
    def spare_bytes(self) -> int:
        """Bytes of the spare buffers the held-state steps write ``x + e`` into (class docstring)."""
        return sum(t.numel() * t.element_size() for t in self._spare.values())

    def init_state(self) -> ErrorFeedbackState:
        """An empty state (every residual zero)."""
        return ErrorFeedbackState()

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

    @property
    def has_fields(self) -> bool:
        """Whether :meth:`encode_fields` gives fields: where the inner scheme has them."""
        return bool(getattr(self.inner, "has_fields", False))

    def stat_layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        return self.inner.stat_layout(numel)  # type: ignore[attr-defined]

    def num_codes(self, numel: int) -> int:
        return self.inner.num_codes(numel)  # type: ignore[attr-defined]

    def field_layout(self, numel: int) -> Optional[dict[str, tuple[torch.dtype, int]]]:
        return self.inner.field_layout(numel)

    def wire_fields(self, numel: int) -> tuple[str, ...]:
        return self.inner.wire_fields(numel)

    # -- residual state ----------------------------------------------------------------------------
    def residual(self, x: torch.Tensor, name: Optional[str]) -> torch.Tensor:
        """The held residual for ``name`` (zeros if none yet), checked against ``x``'s shape."""
        return self.state.residual(x, name)

    def _corrected(self, x: torch.Tensor, name: Optional[str], state: ErrorFeedbackState,
                   screen: bool = True, into: Optional[torch.Tensor] = None, remember: bool = False) -> torch.Tensor:
        """``x + e[name]`` in float32: new memory, or ``into`` where that is a buffer of its shape
        that shares memory with neither term (the same float32 sum, bit for bit).

        ``remember`` (:meth:`shared_stats`, whose ``u`` is scratch in the spare): note that ``into``
        now holds ``x + e``, so that the step that follows on the same ``x`` and ``e`` (the
        all-reduce's fields or codes) takes it as it is instead of adding again. Each tensor's
        version counter must not have moved since (any in-place change moves it)."""
        self._flatten(x, name, screen)  # validate (finite, floating) before mixing with the residual
        xf, e = x.detach().to(torch.float32), state.residual(x, name)
        if (into is None or into.shape != e.shape or into.device != e.device or into.dtype != torch.float32
                or not into.is_contiguous()
                or into.untyped_storage().data_ptr() in (xf.untyped_storage().data_ptr(),
                                                         e.untyped_storage().data_ptr())):
            return xf + e
        made = self._made.pop(_key(name), None)
        if made is not None and made[0] is into and made[1] is x and made[2] is e and made[3] == _versions(into, x, e):
            return into
        torch.add(xf, e, out=into)
        if remember:
            versions = _versions(into, x, e)
            if versions is not None:
                self._made[_key(name)] = (into, x, e, versions)
        return into

    def _held(self, step: Any, x: torch.Tensor, name: Optional[str], lend: bool = False, **kwargs: Any) -> Any:
        """``step(x, self.state, into, name=name, **kwargs)`` → ``(result, next state)`` on the held
        state, ``into`` this name's spare; afterwards the residual the step replaced is the spare
        (CPU tensors, with ``spares`` on). ``lend``: the step also gets that residual as
        ``scratch=``, free once ``x + e`` is made (None where it will not become the spare)."""
        key = _key(name)
        old = self.state.residuals.get(key)
        if lend:
            kwargs["scratch"] = old if self.spares and old is not None and old.device.type == "cpu" \
                and old.is_contiguous() and old.dtype == torch.float32 else None
        out, new = step(x, self.state, self._spare.get(key) if self.spares else None, name=name, **kwargs)
        self.state = new
        if new.residuals.get(key) is old:   # (nothing replaced: no fields path)
            return out
        if self.spares and old is not None and old.device.type == "cpu" and old.is_contiguous():
            self._spare[key] = old
        else:
            self._spare.pop(key, None)
        return out

    def reset(self) -> None:
        """Forget every residual."""
        self.state = ErrorFeedbackState()
        self._spare.clear()
        self._made.clear()

    def state_dict(self) -> dict[str, Any]:
        """The residuals (CPU copies) and the spec, for checkpoints."""
        return {"spec": self.spec, "residuals": self.state.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore residuals saved by :meth:`state_dict` (the spec must match)."""
        if state.get("spec") != self.spec:
            raise ValueError(f"error-feedback state was saved for {state.get('spec')!r}, not {self.spec!r}")
        self.state = ErrorFeedbackState.from_state_dict(state["residuals"])
        self._spare.clear()
        self._made.clear()

    # -- quantizer interface -----------------------------------------------------------------------
    def shared_stats(self, x: torch.Tensor, *, shared_seed: Optional[int] = None,
                     name: Optional[str] = None, check_finite: bool = True) -> dict[str, SharedStat]:
        # (the inner screens u: encode_with; u is scratch here, in the spare that the step then fills)
        u = self._corrected(x, name, self.state, screen=False, into=self._spare.get(_key(name)) if self.spares else None,
                            remember=True)
        return self.inner.shared_stats(u, shared_seed=shared_seed, name=name, check_finite=check_finite)

    def encode_with(self, x: torch.Tensor, state: ErrorFeedbackState, *, seed: Optional[int] = None,
                    generator: Optional[torch.Generator] = None,
                    shared: Optional[Mapping[str, torch.Tensor]] = None, shared_seed: Optional[int] = None,
                    name: Optional[str] = None, check_finite: bool = True) -> tuple[Payload, ErrorFeedbackState]:
        """One error-feedback step on an explicit state: the payload of ``x + e[name]`` and the next
        state, whose ``e[name]`` is what the payload lost. ``state`` itself is not changed.
        ``check_finite``: as in :meth:`gradq.Quantizer.encode`."""
        return self._encode_step(x, state, None, seed=seed, generator=generator, shared=shared,
                                 shared_seed=shared_seed, name=name, check_finite=check_finite)

    def _encode_step(self, x: torch.Tensor, state: ErrorFeedbackState, into: Optional[torch.Tensor], *,
                     seed: Optional[int], generator: Optional[torch.Generator],
                     shared: Optional[Mapping[str, torch.Tensor]], shared_seed: Optional[int],
                     name: Optional[str], check_finite: bool) -> tuple[Payload, ErrorFeedbackState]:
        # (no screen of x here: the inner encode screens u = x + e, or reads its witness, wherever this
        # one would have screened x, and a NaN or Inf in x is one in u)
        u = self._corrected(x, name, state, screen=False, into=into)
        payload = self.inner.encode(u, seed=seed, generator=generator, shared=shared,
                                    shared_seed=shared_seed, name=name, check_finite=check_finite)
        # (u is this call's own: x + e, new or the spare; the payload is the inner's own, just encoded)
        if not self.inner.subtract_decode_(u, payload, trusted=True):
            decoded = self.inner.decode(payload).to(torch.float32)
            # in place unless a field of the payload is u's memory (a cast that kept u as its field)
            ours = u.untyped_storage().data_ptr()
            if all(f.untyped_storage().data_ptr() != ours for f in payload.fields.values()):
                u.sub_(decoded)
            else:
                u = u - decoded
        new = state.with_residual(name, u)
        return Payload(self.spec, tuple(x.shape), x.dtype, payload.numel, payload.fields), new

    def encode(self, x: torch.Tensor, *, seed: Optional[int] = None,
               generator: Optional[torch.Generator] = None,
               shared: Optional[Mapping[str, torch.Tensor]] = None,
               shared_seed: Optional[int] = None, name: Optional[str] = None,
               check_finite: bool = True) -> Payload:
        return self._held(self._encode_step, x, name, seed=seed, generator=generator, shared=shared,
                          shared_seed=shared_seed, check_finite=check_finite)

    def skips_finite_check(self, x: torch.Tensor, shared: Optional[Mapping[str, torch.Tensor]] = None) -> bool:
        return self.inner.skips_finite_check(x, shared)

    def decode(self, payload: Payload, *, out: Optional[torch.Tensor] = None,
               shared_seed: Optional[int] = None) -> torch.Tensor:
        if payload.spec != self.spec:
            from .errors import PayloadError

            raise PayloadError(f"payload was encoded by {payload.spec!r}, cannot decode with {self.spec!r}")
        inner = Payload(self.inner.spec, payload.shape, payload.dtype, payload.numel, payload.fields)
        return self.inner.decode(inner, out=out, shared_seed=shared_seed)

    def _summable_input(self, x: torch.Tensor, name: Optional[str], state: ErrorFeedbackState,
                        shared: Optional[Mapping[str, torch.Tensor]], shared_seed: Optional[int],
                        check_finite: bool, into: Optional[torch.Tensor] = None,
                        own: Optional[Mapping[str, SharedStat]] = None
                        ) -> tuple[torch.Tensor, Mapping[str, torch.Tensor], Optional[Mapping[str, SharedStat]]]:
        """``(x + e, shared, own)`` for the summable entry points: where no ``shared`` is given, the
        inner's own statistics of ``x + e``, which are then also ``own`` (what ``shared`` was
        reduced from: :meth:`gradq.SummableQuantizer.encode_codes`)."""
        if not self.inner.summable:
            raise TypeError(f"{self.inner.name} codes are not summable")
        if own is not None and shared is None:
            raise ValueError(f"{self.spec}: own= describes the statistics shared= was reduced from; pass both")
        u = self._corrected(x, name, state, screen=False, into=into)   # (the inner screens u: encode_with)
        if shared is None:
            own = self.inner.shared_stats(u, shared_seed=shared_seed, check_finite=check_finite)
            shared = {k: s.value for k, s in own.items()}
        return u, shared, own

    def encode_codes_with(self, x: torch.Tensor, state: ErrorFeedbackState, *,
                          shared: Optional[Mapping[str, torch.Tensor]] = None, seed: Optional[int] = None,
                          generator: Optional[torch.Generator] = None, shared_seed: Optional[int] = None,
                          name: Optional[str] = None, check_finite: bool = True,
                          own: Optional[Mapping[str, SharedStat]] = None) -> tuple[torch.Tensor, ErrorFeedbackState]:
        """:meth:`encode_codes` on an explicit state: the codes and the next state."""
        return self._codes_step(x, state, None, shared=shared, seed=seed, generator=generator,
                                shared_seed=shared_seed, name=name, check_finite=check_finite, own=own)

    def _codes_step(self, x: torch.Tensor, state: ErrorFeedbackState, into: Optional[torch.Tensor], *,
                    shared: Optional[Mapping[str, torch.Tensor]], seed: Optional[int],
                    generator: Optional[torch.Generator], shared_seed: Optional[int], name: Optional[str],
                    check_finite: bool, own: Optional[Mapping[str, SharedStat]] = None
                    ) -> tuple[torch.Tensor, ErrorFeedbackState]:
        u, shared, own = self._summable_input(x, name, state, shared, shared_seed, check_finite, into, own)
        codes = self.inner.encode_codes(u, shared=shared, seed=seed, generator=generator,  # type: ignore[attr-defined]
                                        shared_seed=shared_seed, name=name, check_finite=check_finite, own=own)
        mine = self.inner.decode_codes(codes, shared=shared, count=1, like=u,  # type: ignore[attr-defined]
                                       shared_seed=shared_seed)
        return codes, state.with_residual(name, u.sub_(mine))   # (u is the call's own; the codes are new)

    def encode_fields_with(self, x: torch.Tensor, state: ErrorFeedbackState, *,
                           shared: Optional[Mapping[str, torch.Tensor]] = None, seed: Optional[int] = None,
                           generator: Optional[torch.Generator] = None, shared_seed: Optional[int] = None,
                           name: Optional[str] = None, check_finite: bool = True,
                           own: Optional[Mapping[str, SharedStat]] = None, out: Optional[torch.Tensor] = None
                           ) -> tuple[Optional[torch.Tensor], ErrorFeedbackState]:
        """:meth:`encode_fields` on an explicit state: the inner scheme's uint8 fields of ``x + e``
        (its fused path, the same codes as :meth:`encode_codes_with`; into ``out`` where given) and
        the next state, whose residual subtracts this worker's own decode of them; ``(None, state)``
        where the inner scheme has no fields path (then use :meth:`encode_codes_with`)."""
        return self._fields_step(x, state, None, shared=shared, seed=seed, generator=generator,
                                 shared_seed=shared_seed, name=name, check_finite=check_finite, own=own, out=out)

    def _fields_step(self, x: torch.Tensor, state: ErrorFeedbackState, into: Optional[torch.Tensor], *,
                     shared: Optional[Mapping[str, torch.Tensor]], seed: Optional[int],
                     generator: Optional[torch.Generator], shared_seed: Optional[int], name: Optional[str],
                     check_finite: bool, own: Optional[Mapping[str, SharedStat]] = None,
                     scratch: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None
                     ) -> tuple[Optional[torch.Tensor], ErrorFeedbackState]:
        """``scratch``: a float32 buffer of ``e``'s size, free once ``u = x + e`` is made (the held
        residual, which becomes the spare): this worker's own decode goes there rather than into new
        memory, whose page faults cost a CPU more than the decode."""
        u, shared, own = self._summable_input(x, name, state, shared, shared_seed, check_finite, into, own)
        fields = self.inner.encode_fields(u, shared=shared, seed=seed, generator=generator,  # type: ignore[attr-defined]
                                          shared_seed=shared_seed, name=name, check_finite=check_finite, own=own,
                                          out=out)
        if fields is None:
            return None, state
        if scratch is not None and (scratch.shape != u.shape or scratch.device != u.device
                                    or scratch.untyped_storage().data_ptr() in (u.untyped_storage().data_ptr(),
                                                                                x.untyped_storage().data_ptr())):
            scratch = None
        # with own= the shared statistics are the protocol's reduction, which decodes their sum with
        # the same shared ones and refuses what does not decode there: this decode's checks (a host
        # read on a GPU, e.g. MultiScale's scale indices) are left to that one
        with deferred_checks() if own is not None else nullcontext():
            mine = self.inner.decode_field_sum(fields, shared=shared, count=1, like=u,  # type: ignore[attr-defined]
                                               shared_seed=shared_seed, out=scratch)
        return fields, state.with_residual(name, u.sub_(mine))   # (u is the call's own; the fields are new)

    def encode_fields(self, x: torch.Tensor, *, shared: Optional[Mapping[str, torch.Tensor]] = None,
                      seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                      shared_seed: Optional[int] = None, name: Optional[str] = None,
                      check_finite: bool = True, own: Optional[Mapping[str, SharedStat]] = None,
                      out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Fields of ``x + e`` under the shared stats through the inner scheme's fused path; updates
        ``e`` from this worker's own fields (``None``, ``e`` untouched, where there is no such path).
        ``own``: this wrapper's :meth:`shared_stats` of ``x`` (the inner's of ``x + e``), as in
        :meth:`gradq.SummableQuantizer.encode_codes`; ``out`` as there."""
        return self._held(self._fields_step, x, name, lend=True, shared=shared, seed=seed, generator=generator,
                          shared_seed=shared_seed, check_finite=check_finite, own=own, out=out)

    def decode_field_sum(self, total: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.inner.decode_field_sum(total, **kwargs)  # type: ignore[attr-defined]

    def encode_codes(self, x: torch.Tensor, *, shared: Optional[Mapping[str, torch.Tensor]] = None,
                     seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                     shared_seed: Optional[int] = None, name: Optional[str] = None,
                     check_finite: bool = True, own: Optional[Mapping[str, SharedStat]] = None) -> torch.Tensor:
        """Codes of ``x + e`` under the shared stats; updates ``e`` from this worker's own codes
        (``own`` as in :meth:`encode_fields`)."""
        return self._held(self._codes_step, x, name, shared=shared, seed=seed, generator=generator,
                          shared_seed=shared_seed, check_finite=check_finite, own=own)

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
