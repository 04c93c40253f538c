"""The quantizer interface every scheme implements.

A quantizer is pure math: it never touches the network. It turns a tensor into a :class:`Payload`
(``encode``) and back (``decode``), and declares

* ``unbiased`` — whether ``E[decode(encode(x))] = x`` (over the encode's randomness);
* ``summable`` — whether integer codes from different workers may be added inside an all-reduce,
  *provided* the quantities in :meth:`Quantizer.shared_stats` were first reduced across workers
  (e.g. the MAX of per-bucket norms); such quantizers also offer :meth:`SummableQuantizer.encode_codes`
  and :meth:`SummableQuantizer.decode_codes`;
* :meth:`Quantizer.shared_stats` — what must be shared, and with which reduction. In a single process
  nothing needs sharing: ``encode`` falls back to the tensor's own values.

Subclasses implement ``_encode(v, ctx) -> fields`` and ``_decode(fields, numel) -> v̂`` on flat float32
vectors; the base class validates inputs (finite, floating point), resolves randomness, builds the
payload and restores shape, dtype and device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, NamedTuple, Optional, Sequence

import torch

from .. import kernels
from ..errors import NonFiniteError, PayloadError, SpecError
from ..kernels.checks import refuse_invalid
from ..payload import FIELD_HEADER_BYTES, HEADER_BYTES, Payload
from ..random import RandomStream, resolve_seed, signed64
from ..spec import Param, format_value

__all__ = ["Quantizer", "SharedStat", "EncodeContext", "check_finite"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SHARED_SEED_KEY = 0x5EED   # the child stream an encode draws its own shared seed from, where none is given


class SharedStat(NamedTuple):
    """A quantity that workers must agree on before encoding: its local ``value`` and the
    reduction (``"max"``, ``"min"`` or ``"sum"``) that combines the workers' values."""

    value: torch.Tensor
    op: str

    @staticmethod
    def carrying(value: torch.Tensor, op: str, aux: Any) -> "SharedStat":
        """A statistic (still the pair ``(value, op)``) that also carries ``aux``: what the same pass
        found that this worker's own encode needs besides (never reduced; TernGrad's clip bound), so
        that an encode given these statistics as ``own=`` need not compute them again."""
        stat = _Carrying(value, op)
        stat.aux = aux
        return stat


class _Carrying(SharedStat):
    """:meth:`SharedStat.carrying`'s statistic: a ``SharedStat`` with an ``aux`` attribute."""

    aux: Any


@dataclass
class EncodeContext:
    """Everything an encode call may use besides the vector itself."""

    rng: RandomStream
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    shared_seed: Optional[int] = None
    name: Optional[str] = None
    #: this worker's own shared stats (before any reduction), for validating ``shared``
    own: dict[str, SharedStat] = field(default_factory=dict)
    #: per-call values a scheme computes once in ``_own_stats`` and reuses in ``_encode``
    scratch: dict[str, Any] = field(default_factory=dict)
    #: ``shared`` is a reduction that includes ``own`` (the caller says so: ``own=``), so it is not
    #: checked against it (a host read on a GPU)
    trusted: bool = False


def check_finite(x: torch.Tensor, name: Optional[str] = None) -> None:
    """Raise :class:`NonFiniteError` naming the tensor if ``x`` holds NaN or Inf.

    Screens with one sum (float32 accumulation): in IEEE arithmetic a NaN or Inf element makes the sum
    NaN or Inf whatever the order, so a finite sum proves every element finite. Only a non-finite sum
    (a real NaN/Inf, or finite values whose sum overflows) pays for the exact element-wise check. The
    screen runs at memory speed, far faster than ``isfinite().all()``."""
    if not x.numel():
        return
    acc = x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    if bool(torch.isfinite(acc)):
        return
    if not bool(torch.isfinite(x).all()):
        nan = int(torch.isnan(x).sum())
        inf = int(torch.isinf(x).sum())
        label = f"tensor {name!r}" if name else "the input tensor"
        raise NonFiniteError(
            f"{label} holds {nan} NaN and {inf} Inf values out of {x.numel()}; "
            "gradq does not encode non-finite gradients (skip the step or fix the model)")


def _screen(x: torch.Tensor, name: Optional[str]) -> None:
    check_finite(x, name)   # (the function that encode's check_finite= argument shadows)


class Quantizer:
    """Base class of every gradq quantizer (see the module docstring)."""

    name: ClassVar[str] = "?"
    params: ClassVar[tuple[Param, ...]] = ()
    #: whether E[decode(encode(x))] == x; may be overridden by a property
    unbiased: ClassVar[bool] = False
    #: whether integer codes can be summed across workers once shared_stats are shared
    summable: ClassVar[bool] = False
    #: whether ``build(name)`` wraps this scheme in error feedback by default (1BitSGD)
    default_ef: ClassVar[bool] = False
    #: whether shared_stats/encode need a seed common to all workers (e.g. shared random coordinates)
    needs_shared_seed: ClassVar[bool] = False
    #: whether the scheme is meant to see one layer per call (TernGrad's layer-wise scalers)
    layerwise: ClassVar[bool] = False
    #: whether every backend's encode runs on NaN/Inf harmlessly although no payload field holds every
    #: one of them (the Rand-K family sends a few coordinates): then a caller that screened ``x`` itself
    #: (``check_finite=False``) gets no screen, and the checked encode still screens up front
    runs_on_nonfinite: ClassVar[bool] = False

    def __init__(self, **values: Any) -> None:
        known = {p.name: p for p in self.params}
        for key in values:
            if key not in known:
                raise SpecError(f"{self.name} has no parameter {key!r}; valid: {', '.join(known) or 'none'}")
        self._values: dict[str, Any] = {}
        for p in self.params:
            v = values.get(p.name, p.default)
            try:
                self._values[p.name] = p.check(v)
            except SpecError as e:
                raise SpecError(f"{self.name}: {e}") from None
            setattr(self, p.name, self._values[p.name])

    # -- spec --------------------------------------------------------------------------------------
    @classmethod
    def from_params(cls, text: Mapping[str, str]) -> "Quantizer":
        """Build from a spec's ``key=value`` texts (the generic ``ef`` option is the factory's:
        :func:`gradq.factory.build`)."""
        known = {p.name: p for p in cls.params}
        values: dict[str, Any] = {}
        for key, val in text.items():
            p = known.get(key)
            if p is None:
                valid = ", ".join([*known, "ef"])
                raise SpecError(f"{cls.name} has no parameter {key!r}; valid: {valid}")
            try:
                values[key] = p.parse(val)
            except SpecError as e:
                raise SpecError(f"{cls.name}: {e}") from None
        return cls(**values)

    def _spec_items(self) -> list[tuple[str, str]]:
        """``(name, text)`` pairs of the canonical spec; override to drop redundant spellings."""
        return [(p.name, p.format(self._values[p.name])) for p in self.params]

    @property
    def spec(self) -> str:
        """Canonical spec string (every parameter, declaration order); built once (a quantizer's
        parameters do not change after construction) since every encode and decode compares it."""
        cached = self.__dict__.get("_spec_text")
        if cached is not None:
            return cached
        parts = [f"{k}={v}" for k, v in self._spec_items()]
        if self.default_ef:
            parts.append("ef=0")
        text = self.__dict__["_spec_text"] = self.name + (":" + ",".join(parts) if parts else "")
        return text

    def __str__(self) -> str:
        return self.spec

    def __repr__(self) -> str:
        return f"gradq.build({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, str(self)))

    def get_params(self) -> dict[str, Any]:
        """The parameter values, by name."""
        return dict(self._values)

    # -- what must be shared -----------------------------------------------------------------------
    def shared_stats(self, x: torch.Tensor, *, shared_seed: Optional[int] = None,
                     name: Optional[str] = None, check_finite: bool = True) -> dict[str, SharedStat]:
        """Quantities the workers must reduce before encoding ``x`` (empty for most schemes);
        ``check_finite`` as in :meth:`encode`."""
        return self._shared_stats(self._flatten(x, name, self._screens(x, check_finite)), shared_seed)

    def _screens(self, x: torch.Tensor, check_finite: bool) -> bool:
        """Whether a summable entry point (:meth:`shared_stats`, ``encode_codes``, ``encode_fields``)
        screens ``x`` up front: always, unless the caller screened it (``check_finite=False``) and
        this scheme's kernels run on NaN/Inf harmlessly (the property :meth:`skips_finite_check`
        states of its own-scale encode; the same kernels run under shared statistics)."""
        return check_finite or not self.skips_finite_check(x)

    def _shared_stats(self, v: torch.Tensor, shared_seed: Optional[int]) -> dict[str, SharedStat]:
        return {}

    def _take_own(self, own: Mapping[str, SharedStat], ctx: EncodeContext) -> Optional[dict[str, SharedStat]]:
        """This worker's :meth:`shared_stats` of the tensor, given (``own=``), as the encode's own
        statistics, or None where the encode must compute them (:meth:`_own_stats`) again. They
        serve as they are where :meth:`_own_stats` is :meth:`_shared_stats`; a scheme whose
        :meth:`_own_stats` keeps by-products in ``ctx.scratch`` takes them from the stats' ``aux``."""
        return dict(own) if type(self)._own_stats is Quantizer._own_stats else None

    def _own_stats(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, SharedStat]:
        """The encode-time version of :meth:`_shared_stats`: the same names and shapes (the encode
        checks reduced values against them), but a scheme may override it to stash by-products in
        ``ctx.scratch`` (e.g. TernGrad's clipping bound) instead of recomputing them, or to stand in
        for a statistic its kernels compute as they encode (MultiScale's per-value indices)."""
        return self._shared_stats(v, ctx.shared_seed)

    # -- encode / decode ---------------------------------------------------------------------------
    def _flatten(self, x: torch.Tensor, name: Optional[str], screen: bool = True) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{self.name}: expected a floating-point tensor "
                            f"(float16, bfloat16, float32, float64), got {x.dtype}")
        if screen:
            check_finite(x, name)
        return x.detach().reshape(-1).to(torch.float32)

    def _context(self, v: torch.Tensor, rng: RandomStream, shared: Optional[Mapping[str, torch.Tensor]],
                 shared_seed: Optional[int], name: Optional[str],
                 own: Optional[Mapping[str, SharedStat]] = None) -> EncodeContext:
        """The encode context every encoding entry point starts from: its randomness, this worker's
        own statistics (``ctx.own``) and the ones to encode under (``ctx.shared``: the reduced
        ``shared`` after a check of their names and shapes, or without it the worker's own).

        ``own``: this worker's :meth:`shared_stats` of the same tensor, which ``shared`` was reduced
        from (as the all-reduce protocol has them). They are taken as ``ctx.own`` where a scheme's
        own statistics are its shared ones (no second pass over ``v``), and ``shared`` is then
        trusted: a reduction that includes them is not checked against them."""
        if own is not None and shared is None:
            raise ValueError(f"{self.name}: own= describes the statistics shared= was reduced from; pass both")
        ctx = EncodeContext(rng=rng, shared_seed=shared_seed, name=name, trusted=own is not None)
        taken = None if own is None else self._take_own(own, ctx)
        ctx.own = taken if taken is not None else self._own_stats(v, ctx)
        ctx.shared = ({k: s.value for k, s in ctx.own.items()} if shared is None
                      else self._check_shared(shared, ctx.own))
        return ctx

    def encode(self, x: torch.Tensor, *, seed: Optional[int] = None,
               generator: Optional[torch.Generator] = None,
               shared: Optional[Mapping[str, torch.Tensor]] = None,
               shared_seed: Optional[int] = None, name: Optional[str] = None,
               check_finite: bool = True) -> Payload:
        """Encode ``x`` into a :class:`Payload`.

        Args:
            x: a floating-point tensor of any shape (float16/bfloat16/float32/float64), on any device.
            seed / generator: randomness of this call (at most one); neither draws a seed from
                torch's global generator. The same seed gives the same bytes.
            shared: reduced values of :meth:`shared_stats` (e.g. the MAX over workers of the scales);
                omitted, the tensor's own values are used.
            shared_seed: a seed common to all workers, for schemes with ``needs_shared_seed``
                (omitted, one is derived from this call's randomness and sent in the payload).
            name: the tensor's name, used in error messages and as the key of per-tensor state.
            check_finite: ``False`` for a caller that has screened ``x`` itself (the DDP hook does, on
                the device): a scheme whose kernels run on NaN/Inf harmlessly then skips its check,
                which on a GPU is a host read that waits for the encode (a synchronization), so the
                host can queue the next call while the device works. Non-finite input then gives a
                payload whose decode is not meaningful. The schemes without such a property
                (:meth:`skips_finite_check` is False) check anyway.

        Raises:
            NonFiniteError: ``x`` holds NaN or Inf (with ``check_finite=False``, only where the
                scheme checks anyway).
            TypeError: ``x`` is not a floating-point tensor.
        """
        witness = self._nonfinite_witness(x, shared)
        # with a witness the encode runs on NaN/Inf harmlessly: no screen first, and unless the caller
        # screened x itself (check_finite=False), one look at the witness afterwards; without one, a
        # scheme that runs on them harmlessly skips only the screen the caller has made
        read = witness is not None and check_finite
        v = self._flatten(x, name, screen=witness is None and (check_finite or not self.runs_on_nonfinite))
        rng = RandomStream(resolve_seed(seed, generator))
        if self.needs_shared_seed and shared_seed is None:
            shared_seed = rng.child(_SHARED_SEED_KEY).seed
        ctx = self._context(v, rng, shared, shared_seed, name)
        try:
            fields = self._encode(v, ctx)
        except NonFiniteError:  # a kernel that found NaN/Inf itself: raise the error that names x
            if witness is not None:
                _screen(v, name)
            raise
        # one look at a small field and one host read (finite values whose sum overflows, where the
        # look is a sum, only cost the exact screen, which then passes)
        if read and not kernels.witness_is_finite(fields[witness]):
            _screen(v, name)  # raises if x really holds NaN/Inf (not just an overflowing norm)
        return Payload(self.spec, tuple(x.shape), x.dtype, v.numel(), fields)

    def skips_finite_check(self, x: torch.Tensor, shared: Optional[Mapping[str, torch.Tensor]] = None) -> bool:
        """Whether ``encode(x, shared=shared, check_finite=False)`` skips the non-finite check (no
        screen of ``x``, no host read): True where this scheme's encode runs on NaN/Inf harmlessly on
        every backend (see :meth:`_nonfinite_witness` and :attr:`runs_on_nonfinite`)."""
        return self.runs_on_nonfinite or self._nonfinite_witness(x, shared) is not None

    def _nonfinite_witness(self, x: torch.Tensor, shared: Optional[Mapping[str, torch.Tensor]]) -> Optional[str]:
        """The name of a payload field that holds a NaN or Inf whenever ``x`` does, where this
        scheme's encode of ``x`` (with these ``shared`` values, if any) runs on non-finite data
        harmlessly on every backend; None (the default) where no field is such a witness. With a
        witness the up-front screen (one extra pass over ``x``) is replaced by a look at that field
        (a value per bucket) afterwards."""
        return None

    def _check_shared(self, shared: Mapping[str, torch.Tensor],
                      own: Mapping[str, SharedStat]) -> dict[str, torch.Tensor]:
        if set(shared) != set(own):
            raise ValueError(f"{self.name}: shared= must hold exactly {sorted(own)}, got {sorted(shared)}")
        out = {}
        for k, stat in own.items():
            val = torch.as_tensor(shared[k])
            if val.shape != stat.value.shape:
                raise ValueError(f"{self.name}: shared[{k!r}] has shape {tuple(val.shape)}, "
                                 f"expected {tuple(stat.value.shape)}")
            out[k] = val.to(device=stat.value.device, dtype=stat.value.dtype)
        return out

    def decode(self, payload: Payload, *, out: Optional[torch.Tensor] = None,
               shared_seed: Optional[int] = None) -> torch.Tensor:
        """Decode a payload made by an equal quantizer; returns a tensor of the original shape,
        dtype and device (the device of the payload's fields).

        ``out``: a tensor of the payload's shape and dtype to decode into (returned). A contiguous
        float32 CPU ``out`` is written directly by the fused kernels, which saves allocating (and
        page-faulting) a fresh output — what a communication hook decoding into its bucket wants.

        ``shared_seed``: the shared seed the payload was encoded under, where the caller knows it
        (the protocols chose it; :meth:`implied_shared_seed` where the encode drew its own). A scheme
        that sends its shared seed (the Rand-K family's ``seed`` field) then decodes with it instead
        of reading the field, which on a GPU is a host read: the field is compared with it on its
        device, and a payload whose field differs is refused (:class:`gradq.PayloadError`; inside
        :func:`gradq.kernels.deferred_checks` it is counted there instead, and the decode goes on
        with the given seed). The other schemes ignore it."""
        self._check_payload(payload)
        fields = self._given_seed([payload.fields], shared_seed)[0]
        if out is not None:
            if tuple(out.shape) != tuple(payload.shape) or out.dtype != payload.dtype:
                raise ValueError(f"{self.name}: out= must have shape {tuple(payload.shape)} and dtype "
                                 f"{payload.dtype}, got {tuple(out.shape)} {out.dtype}")
            if out.dtype == torch.float32 and out.is_contiguous() and out.device == payload.device:
                if self._decode_into(fields, payload.numel, out.view(-1)):
                    return out
            return out.copy_(self._decode(fields, payload.numel).reshape(out.shape))
        v = self._decode(fields, payload.numel)
        return v.reshape(payload.shape).to(payload.dtype)

    @staticmethod
    def implied_shared_seed(seed: int) -> int:
        """The shared seed ``encode(x, seed=seed)`` of a ``needs_shared_seed`` scheme draws for itself
        where none is given (and sends in its payload): what a decoder that knows ``seed`` passes as
        :meth:`decode`'s ``shared_seed``."""
        return RandomStream(resolve_seed(seed, None)).child(_SHARED_SEED_KEY).seed

    def _given_seed(self, fields: Sequence[Mapping[str, torch.Tensor]],
                    shared_seed: Optional[int]) -> list[Mapping[str, torch.Tensor]]:
        """Each payload's ``fields`` with the ``seed`` field replaced by a host copy of
        ``shared_seed``, after one comparison of them all on their device (refused or counted, as
        :meth:`decode` says); the fields as they are without a ``shared_seed`` or a ``seed`` field."""
        if shared_seed is None or not fields or "seed" not in fields[0]:
            return list(fields)
        want = signed64(shared_seed)
        got = torch.cat([f["seed"].reshape(-1) for f in fields])
        refuse_invalid((got != want).sum(), lambda _: (
            f"{self.name}: the payload's seed field is not the shared seed it was sent under "
            f"({want}); corrupt payload"), "shared seeds")
        host = torch.full((1,), want, dtype=torch.int64)
        return [{**f, "seed": host} for f in fields]

    def _check_payload(self, payload: Payload) -> None:
        if not isinstance(payload, Payload):
            raise TypeError(f"{self.name}: expected a gradq Payload, got {type(payload).__name__}")
        if payload.spec != self.spec:
            raise PayloadError(f"payload was encoded by {payload.spec!r}, cannot decode with {self.spec!r}")
        self._check_fields(payload)

    def _decode_into(self, fields: Mapping[str, torch.Tensor], numel: int, out: torch.Tensor) -> bool:
        """Decode straight into the flat float32 ``out`` if this scheme has such a path (return True)."""
        return False

    def subtract_decode_(self, u: torch.Tensor, payload: Payload, *, trusted: bool = False) -> bool:
        """``u −= decode(payload)`` in place, bit for bit, where the scheme can without a dense decode
        (the sparse schemes: their ``K`` values at their positions); ``False`` where it cannot, and
        ``u`` is then untouched. ``u``: float32, the payload's coordinates, sharing no memory with its
        fields (error feedback's residual of a payload it just encoded). ``trusted``: the payload is
        this quantizer's own, just encoded and untouched since, so its fields are not checked again
        (on a GPU each check is a host read; error feedback passes True)."""
        return False

    def decode_mean(self, payloads: Sequence[Payload], *, out: Optional[torch.Tensor] = None,
                    shared_seed: Optional[int] = None) -> torch.Tensor:
        """The mean of the decodes of several payloads of one shape and dtype (e.g. every worker's
        payload for one chunk): ``(((d_0 + d_1) + d_2) + …) / M``, added in list order in the payloads'
        dtype. Schemes with a fused kernel (QSGD, MaxNorm, TernGrad on CPU) compute it in one pass
        without materialising each decode; the result is bit for bit the same.

        ``out``: optional tensor of the payloads' shape and dtype to write the mean into (returned).
        ``shared_seed``: the one shared seed every payload was encoded under, as in :meth:`decode`."""
        if isinstance(payloads, Payload) or not payloads:
            raise ValueError(f"{self.name}: decode_mean needs a non-empty sequence of payloads")
        first = payloads[0]
        for p in payloads:
            self._check_payload(p)
            if tuple(p.shape) != tuple(first.shape) or p.dtype != first.dtype:
                raise ValueError(f"{self.name}: decode_mean needs payloads of one shape and dtype, got "
                                 f"{tuple(first.shape)} {first.dtype} and {tuple(p.shape)} {p.dtype}")
        if out is not None and (tuple(out.shape) != tuple(first.shape) or out.dtype != first.dtype):
            raise ValueError(f"{self.name}: out= must have shape {tuple(first.shape)} and dtype "
                             f"{first.dtype}, got {tuple(out.shape)} {out.dtype}")
        if out is None:  # never a view of a payload's field (the sum is made in place)
            out = torch.empty(first.shape, dtype=first.dtype, device=first.device)
        if first.dtype == torch.float32 and out.is_contiguous() and out.device == first.device:
            if self._decode_mean_into(self._given_seed([p.fields for p in payloads], shared_seed), first.numel,
                                      out.view(-1)):
                return out
        acc = self.decode(first, out=out, shared_seed=shared_seed)
        tmp = torch.empty_like(out)  # decoded into: a decode may return a view of the payload's field
        for p in payloads[1:]:
            tmp = self.decode(p, out=tmp, shared_seed=shared_seed)
            acc += tmp
        return acc.div_(len(payloads))

    def _decode_mean_into(self, fields: Sequence[Mapping[str, torch.Tensor]], numel: int,
                          out: torch.Tensor) -> bool:
        """Write the mean of the decodes of ``fields`` into the flat float32 ``out`` in one fused
        pass if this scheme has one (return True); the generic loop of :meth:`decode_mean` otherwise."""
        return False

    def roundtrip(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``decode(encode(x, **kwargs))``."""
        return self.decode(self.encode(x, **kwargs))

    # -- wire layout -------------------------------------------------------------------------------
    def field_layout(self, numel: int) -> Optional[dict[str, tuple[torch.dtype, int]]]:
        """Field name → (dtype, element count) for a tensor of ``numel`` coordinates, in wire order;
        ``None`` when sizes depend on the data (variable-length codes)."""
        return None

    def wire_fields(self, numel: int) -> tuple[str, ...]:
        """Names of the payload's fields, in wire order."""
        layout = self.field_layout(numel)
        if layout is None:
            raise NotImplementedError(f"{self.name} must define wire_fields")
        return tuple(layout)

    def expected_nbytes(self, numel: int) -> Optional[int]:
        """Wire bytes of a payload for ``numel`` coordinates, or ``None`` if data-dependent."""
        layout = self.field_layout(numel)
        if layout is None:
            return None
        data = sum(cnt * torch.empty((), dtype=dt).element_size() for dt, cnt in layout.values())
        return HEADER_BYTES + FIELD_HEADER_BYTES * len(layout) + data

    def payload_from_bytes(self, buf: torch.Tensor | bytes, shape: Sequence[int],
                           dtype: torch.dtype = torch.float32, copy: bool = True) -> Payload:
        """Parse bytes from :meth:`Payload.to_bytes` made by this quantizer (``copy``: as
        :meth:`Payload.from_bytes`)."""
        numel = 1
        for s in shape:
            numel *= int(s)
        layout = self.field_layout(numel)
        return Payload.parse(buf, names=self.wire_fields(numel) if layout is None else tuple(layout), layout=layout,
                             spec=self.spec, shape=shape, dtype=dtype, copy=copy, check=self._check_fields)

    def _check_fields(self, payload: Payload) -> None:
        layout = self.field_layout(payload.numel)
        if layout is None:
            return
        if tuple(payload.fields) != tuple(layout):
            raise PayloadError(f"{self.name}: payload fields {list(payload.fields)} != expected {list(layout)}")
        for k, (dt, cnt) in layout.items():
            t = payload.fields[k]
            if t.dtype != dt or t.numel() != cnt:
                raise PayloadError(f"{self.name}: field {k!r} is {t.dtype}[{t.numel()}], expected {dt}[{cnt}]")

    # -- subclass hooks ----------------------------------------------------------------------------
    def _encode(self, v: torch.Tensor, ctx: EncodeContext) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _decode(self, fields: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        raise NotImplementedError


def describe_params(cls: type[Quantizer]) -> str:
    """A human-readable list of a quantizer class's parameters and defaults."""
    return ", ".join(f"{p.name}={format_value(p.default)}" for p in cls.params)
