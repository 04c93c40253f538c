"""The spec grammar: one spelling of every quantizer and knob, for Python, the CLI and config files.

Grammar::

    spec    := wrapper "(" spec ")" [":" params] | name [":" params]
    params  := key "=" value ("," key "=" value)*
    value   := integer | float | "none" | boolean | word | integer ("+" integer)+

Examples: ``qsgd:bits=4,bucket=512,norm=max``, ``terngrad:clip=none``, ``multiscale:bits=2+6``,
``ef(qsgd:bits=2)`` (same as ``qsgd:bits=2,ef=1``), ``topk:ratio=0.01``.

``gradq.build(spec)`` returns a quantizer and ``str(quantizer)`` returns the canonical spec (every
parameter spelled out, in declaration order), which builds an equal quantizer. Any unknown name, key
or bad value raises :class:`gradq.SpecError` (a ``ValueError``) that lists the valid choices.

This module holds the grammar, the parameter types and the registry, and imports no quantizer
family: the families register themselves here on import, and :mod:`gradq.factory` (which imports
them all) builds from the registry.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from .errors import SpecError

__all__ = [
    "Param", "IntParam", "FloatParam", "ChoiceParam", "BoolParam", "IntTupleParam",
    "parse_spec", "format_value", "register", "register_wrapper", "registry", "available", "make", "EF_PARAM",
]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_\-]*$")


# ----------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """A declared quantizer parameter: its name, default and how to read, check and print it."""

    name: str
    default: Any = None
    doc: str = ""
    allow_none: bool = False

    def describe(self) -> str:  # what the valid values are, for error messages
        raise NotImplementedError

    def parse(self, text: str) -> Any:
        """Read a value from spec text."""
        if self.allow_none and text.lower() == "none":
            return None
        return self._parse(text)

    def _parse(self, text: str) -> Any:
        raise NotImplementedError

    def check(self, value: Any) -> Any:
        """Validate (and normalise) a Python value; raise :class:`SpecError` if invalid."""
        if value is None:
            if self.allow_none:
                return None
            raise SpecError(f"{self.name} cannot be none; valid: {self.describe()}")
        return self._check(value)

    def _check(self, value: Any) -> Any:
        return value

    def format(self, value: Any) -> str:
        return format_value(value)


@dataclass(frozen=True)
class IntParam(Param):
    lo: Optional[int] = None
    hi: Optional[int] = None

    def describe(self) -> str:
        rng = f"an integer in [{self.lo if self.lo is not None else '-inf'}, {self.hi if self.hi is not None else 'inf'}]"
        return rng + (" or none" if self.allow_none else "")

    def _parse(self, text: str) -> Any:
        try:
            return int(text)
        except ValueError:
            raise SpecError(f"{self.name}={text!r} is not valid; expected {self.describe()}") from None

    def _check(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise SpecError(f"{self.name}={value!r} is not valid; expected {self.describe()}")
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise SpecError(f"{self.name}={value} is out of range; expected {self.describe()}")
        return int(value)


@dataclass(frozen=True)
class FloatParam(Param):
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False

    def describe(self) -> str:
        left = "(" if self.lo_open else "["
        rng = f"a number in {left}{self.lo if self.lo is not None else '-inf'}, {self.hi if self.hi is not None else 'inf'}]"
        return rng + (" or none" if self.allow_none else "")

    def _parse(self, text: str) -> Any:
        try:
            return float(text)
        except ValueError:
            raise SpecError(f"{self.name}={text!r} is not valid; expected {self.describe()}") from None

    def _check(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{self.name}={value!r} is not valid; expected {self.describe()}")
        value = float(value)
        if not math.isfinite(value):
            raise SpecError(f"{self.name}={value} is not valid; expected {self.describe()}")
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            raise SpecError(f"{self.name}={value} is out of range; expected {self.describe()}")
        if self.hi is not None and value > self.hi:
            raise SpecError(f"{self.name}={value} is out of range; expected {self.describe()}")
        return value


@dataclass(frozen=True)
class ChoiceParam(Param):
    choices: tuple = ()

    def describe(self) -> str:
        return "one of " + ", ".join(str(c) for c in self.choices) + (", none" if self.allow_none else "")

    def _parse(self, text: str) -> Any:
        for c in self.choices:
            if str(c) == text:
                return c
        try:
            num = int(text)
        except ValueError:
            num = None
        if num is not None and num in self.choices:
            return num
        raise SpecError(f"{self.name}={text!r} is not valid; expected {self.describe()}")

    def _check(self, value: Any) -> Any:
        if value not in self.choices or isinstance(value, bool):
            raise SpecError(f"{self.name}={value!r} is not valid; expected {self.describe()}")
        return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class BoolParam(Param):
    def describe(self) -> str:
        return "1/0 (true/false)"

    def _parse(self, text: str) -> Any:
        t = text.lower()
        if t in _TRUE:
            return True
        if t in _FALSE:
            return False
        raise SpecError(f"{self.name}={text!r} is not valid; expected {self.describe()}")

    def _check(self, value: Any) -> Any:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise SpecError(f"{self.name}={value!r} is not valid; expected {self.describe()}")


@dataclass(frozen=True)
class IntTupleParam(Param):
    """A strictly increasing tuple of integers, written ``2+6`` in a spec."""

    lo: int = 1
    hi: int = 64
    min_len: int = 1
    max_len: int = 8

    def describe(self) -> str:
        return (f"{self.min_len} to {self.max_len} increasing integers in [{self.lo}, {self.hi}] "
                f"joined by '+', e.g. 2+6")

    def _parse(self, text: str) -> Any:
        try:
            return tuple(int(p) for p in text.split("+"))
        except ValueError:
            raise SpecError(f"{self.name}={text!r} is not valid; expected {self.describe()}") from None

    def _check(self, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = (value,)
        try:
            value = tuple(value)
        except TypeError:
            raise SpecError(f"{self.name}={value!r} is not valid; expected {self.describe()}") from None
        ok = (self.min_len <= len(value) <= self.max_len
              and all(isinstance(v, int) and not isinstance(v, bool) and self.lo <= v <= self.hi for v in value)
              and all(a < b for a, b in zip(value, value[1:])))
        if not ok:
            raise SpecError(f"{self.name}={value!r} is not valid; expected {self.describe()}")
        return value


def format_value(value: Any) -> str:
    """Canonical text of a parameter value (inverse of the parsers above)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return "+".join(str(v) for v in value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return repr(value)
        return repr(value)
    return str(value)


# ----------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------
@dataclass
class ParsedSpec:
    """A parsed spec: ``name``, its ``params`` as text, and ``wrappers`` from outermost in."""

    name: str
    params: dict[str, str] = field(default_factory=dict)
    wrappers: list[tuple[str, dict[str, str]]] = field(default_factory=list)


def _parse_params(text: str, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if text == "":
        raise SpecError(f"empty parameter list after ':' in {where!r}")
    for item in text.split(","):
        item = item.strip()
        if "=" not in item:
            raise SpecError(f"parameter {item!r} in {where!r} is not of the form key=value")
        key, val = (s.strip() for s in item.split("=", 1))
        if not key or not val:
            raise SpecError(f"parameter {item!r} in {where!r} is not of the form key=value")
        if key in out:
            raise SpecError(f"parameter {key!r} given twice in {where!r}")
        out[key] = val
    return out


def parse_spec(spec: str) -> ParsedSpec:
    """Split a spec string into name, parameters and wrappers (no validation of the values)."""
    if not isinstance(spec, str):
        raise SpecError(f"a spec must be a string, got {type(spec).__name__}")
    text = spec.strip()
    if not text:
        raise SpecError("empty spec; try e.g. 'qsgd:bits=4' (see gradq.available())")
    wrappers: list[tuple[str, dict[str, str]]] = []
    while True:
        m = re.match(r"^([a-z][a-z0-9_\-]*)\(", text)
        if not m:
            break
        depth, close = 0, -1
        for i in range(m.end() - 1, len(text)):
            if text[i] == "(":
                depth += 1
            elif text[i] == ")":
                depth -= 1
                if depth == 0:
                    close = i
                    break
        if close < 0:
            raise SpecError(f"unbalanced parentheses in spec {spec!r}")
        rest = text[close + 1:]
        wparams: dict[str, str] = {}
        if rest:
            if not rest.startswith(":"):
                raise SpecError(f"unexpected text {rest!r} after ')' in spec {spec!r}")
            wparams = _parse_params(rest[1:], spec)
        wrappers.append((m.group(1), wparams))
        text = text[m.end():close].strip()
    if "(" in text or ")" in text:
        raise SpecError(f"misplaced parentheses in spec {spec!r}")
    name, _, ptext = text.partition(":")
    name = name.strip()
    if not _NAME_RE.match(name):
        raise SpecError(f"invalid quantizer name {name!r} in spec {spec!r}; valid: {', '.join(available())}")
    params = _parse_params(ptext, spec) if _ else {}
    return ParsedSpec(name, params, wrappers)


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------
_REGISTRY: dict[str, type] = {}
_WRAPPERS: dict[str, Callable[..., Any]] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a quantizer class buildable by ``name``."""
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid quantizer name {name!r}")

    def deco(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"quantizer name {name!r} registered twice")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def register_wrapper(name: str, fn: Callable[..., Any]) -> None:
    """Register a wrapper usable as ``name(inner_spec)`` (e.g. ``ef``)."""
    _WRAPPERS[name] = fn


def registry() -> dict[str, type]:
    """Name → quantizer class, for every registered quantizer (all of them once :mod:`gradq` is
    imported: :mod:`gradq.factory` imports every family)."""
    return dict(_REGISTRY)


def available() -> list[str]:
    """Sorted names of every registered quantizer."""
    return sorted(_REGISTRY)


#: the generic option of every scheme: wrap it in error feedback
EF_PARAM = BoolParam("ef", False, "wrap in error feedback (same as ef(...))")


def make(spec: str) -> Any:
    """Build a quantizer from a spec string with the registered classes and wrappers (the
    implementation of :func:`gradq.build`, which also passes quantizer instances through).

    The generic ``ef=`` option is taken off the parameters here: ``ef=1`` (or a class's
    ``default_ef``, unless ``ef=0``) wraps the scheme in the ``ef`` wrapper."""
    parsed = parse_spec(spec)
    cls = _REGISTRY.get(parsed.name)
    if cls is None:
        hint = f"; wrappers: {', '.join(sorted(_WRAPPERS))}" if _WRAPPERS else ""
        raise SpecError(f"unknown quantizer {parsed.name!r}; valid: {', '.join(sorted(_REGISTRY))}{hint}")
    params = dict(parsed.params)
    ef_text = params.pop("ef", None)
    q = cls.from_params(params)
    if (cls.default_ef if ef_text is None else EF_PARAM.parse(ef_text)):
        q = _WRAPPERS["ef"](q)
    for wname, wparams in reversed(parsed.wrappers):
        fn = _WRAPPERS.get(wname)
        if fn is None:
            raise SpecError(f"unknown wrapper {wname!r}; valid: {', '.join(sorted(_WRAPPERS))}")
        q = fn(q, **wparams)
    return q


def params_doc(params: Sequence[Param]) -> str:
    """One line per parameter: ``name=default  valid values — doc``."""
    return "\n".join(f"{p.name}={format_value(p.default)}  ({p.describe()}) {p.doc}".rstrip() for p in params)


def __getattr__(name: str) -> Any:
    """``gradq.spec.build`` for code written before :mod:`gradq.factory` existed: the factory's
    :func:`gradq.factory.build` (imported on first access; nothing in gradq uses this spelling)."""
    if name == "build":
        from .factory import build

        return build
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
