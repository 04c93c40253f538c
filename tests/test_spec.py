"""The spec grammar (gradq.spec): canonical round trips for every registered quantizer, clear errors.

Written generically over ``gradq.registry()`` so that every scheme added later is covered too.
"""

from __future__ import annotations

import pytest
import torch

import gradq
from gradq.spec import BoolParam, ChoiceParam, FloatParam, IntParam, IntTupleParam, Param

REGISTRY = gradq.registry()
NAMES = sorted(REGISTRY)


def _plain(q):
    """The quantizer inside an error-feedback wrapper (or q itself)."""
    return q.inner if isinstance(q, gradq.ErrorFeedback) else q


def _candidates(p: Param) -> list:
    """Valid, non-default values of a parameter (some may still clash with another parameter)."""
    out: list = []
    if isinstance(p, BoolParam):
        out = [not p.default]
    elif isinstance(p, ChoiceParam):
        out = [c for c in p.choices]
    elif isinstance(p, IntParam):
        lo = p.lo if p.lo is not None else 0
        out = [lo, lo + 3, 64, p.hi, (p.default + 1) if isinstance(p.default, int) else None]
        out = [v for v in out if v is not None and (p.hi is None or v <= p.hi)]
    elif isinstance(p, FloatParam):
        lo = p.lo if p.lo is not None else 0.0
        hi = p.hi if p.hi is not None else lo + 4.0
        out = [lo + 0.5 * (hi - lo), lo + 0.25 * (hi - lo), hi] + ([] if p.lo_open or p.lo is None else [p.lo])
    elif isinstance(p, IntTupleParam):
        out = [(p.lo,), (p.lo, p.hi), tuple(range(p.lo, p.lo + p.max_len))]
        out = [t for t in out if p.min_len <= len(t) <= p.max_len and t[-1] <= p.hi]
    if p.allow_none:
        out.append(None)
    return [v for v in out if v != p.default]


def _variants(name: str) -> list[tuple[Param, object, str]]:
    return [(p, v, f"{name}:{p.name}={p.format(v)}") for p in REGISTRY[name].params for v in _candidates(p)]


def _x() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(96, generator=g)


def _assert_fixed_point(q) -> None:
    s = str(q)
    q2 = gradq.build(s)
    assert type(q2) is type(q) and q2 == q and str(q2) == s
    assert type(_plain(q2)) is type(_plain(q))


# -- round trips -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_default_round_trip(name):
    q = gradq.build(name)
    assert isinstance(_plain(q), REGISTRY[name])
    assert str(q) == name or str(q).startswith(name + ":")
    _assert_fixed_point(q)
    assert repr(q) == f"gradq.build({str(q)!r})"
    # every key of the canonical spec is a declared parameter (or the ef switch)
    body = str(q).partition(":")[2]
    keys = {item.split("=")[0] for item in body.split(",")} if body else set()
    assert keys <= {p.name for p in REGISTRY[name].params} | {"ef"}


@pytest.mark.parametrize("name", NAMES)
def test_defaults_spelled_out_build_an_equal_quantizer(name):
    params = REGISTRY[name].params
    if not params:
        pytest.skip("no parameters")
    spelled = name + ":" + ",".join(f"{p.name}={p.format(p.default)}" for p in params)
    assert gradq.build(spelled) == gradq.build(name)


@pytest.mark.parametrize("name", NAMES)
def test_non_default_round_trips(name):
    x = _x()
    built = 0
    for p, value, spec in _variants(name):
        try:
            q = gradq.build(spec)
        except gradq.SpecError:
            continue  # a value that clashes with another parameter's default: not this test's concern
        built += 1
        assert _plain(q).get_params()[p.name] == value, spec
        _assert_fixed_point(q)
        # the canonical spelling describes the same quantizer: identical bytes under one seed
        q2 = gradq.build(str(q))
        assert q.encode(x, seed=3).same_bytes(q2.encode(x, seed=3)), (spec, str(q))
    if REGISTRY[name].params:
        assert built, f"no non-default value of {name} could be built"


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_can_leave_its_default(name):
    for p in REGISTRY[name].params:
        ok = []
        for _, v, spec in [t for t in _variants(name) if t[0] is p]:
            try:
                ok.append(_plain(gradq.build(spec)).get_params()[p.name] == v)
            except gradq.SpecError:
                pass
        assert any(ok), f"{name}: no buildable non-default value of {p.name}"


def test_build_returns_a_quantizer_unchanged_and_registry_is_a_copy():
    q = gradq.build("qsgd:bits=2")
    assert gradq.build(q) is q
    reg = gradq.registry()
    reg.pop("qsgd")
    assert "qsgd" in gradq.registry() and gradq.available() == sorted(gradq.registry())


# -- error feedback --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_ef_wrapper_equals_ef_option(name):
    cls = REGISTRY[name]
    plain = gradq.build(f"{name}:ef=0")
    assert not isinstance(plain, gradq.ErrorFeedback) and isinstance(plain, cls)
    _assert_fixed_point(plain)
    a, b = gradq.build(f"{name}:ef=1"), gradq.build(f"ef({name}:ef=0)")
    assert isinstance(a, gradq.ErrorFeedback) and isinstance(b, gradq.ErrorFeedback)
    assert a == b and str(a) == str(b)
    _assert_fixed_point(a)
    if cls.default_ef:
        assert gradq.build(name) == a and "ef=0" in str(plain)
    else:
        assert gradq.build(name) == plain and gradq.build(f"ef({name})") == a
        assert str(a) == f"ef({plain})"
    with pytest.raises(gradq.SpecError, match="already has error feedback"):
        gradq.build(f"ef({name}:ef=1)")


def test_ef_with_parameters():
    assert gradq.build("ef(qsgd:bits=2)") == gradq.build("qsgd:bits=2,ef=1") == gradq.build("qsgd:ef=1,bits=2")
    assert str(gradq.build("qsgd:bits=2,ef=true")) == "ef(qsgd:bits=2,bucket=512,norm=max)"
    for bad, match in [("ef(qsgd):bits=2", "takes no parameters"), ("ef(ef(qsgd))", "already has error feedback"),
                       ("qsgd:ef=2", "1/0"), ("zz(qsgd)", "unknown wrapper 'zz'; valid: ef")]:
        with pytest.raises(gradq.SpecError, match=match):
            gradq.build(bad)


def test_onebit_defaults_to_error_feedback():
    if "onebit" not in REGISTRY:
        pytest.skip("onebit is not registered")
    q = gradq.build("onebit")
    assert isinstance(q, gradq.ErrorFeedback) and REGISTRY["onebit"].default_ef
    assert "ef=" not in str(q) and str(q).startswith("onebit")
    assert not isinstance(gradq.build("onebit:ef=0"), gradq.ErrorFeedback)
    _assert_fixed_point(q)


# -- errors ----------------------------------------------------------------------------------------
def test_spec_error_is_a_value_error():
    assert issubclass(gradq.SpecError, ValueError) and issubclass(gradq.SpecError, gradq.GradqError)


@pytest.mark.parametrize("bad", ["nosuch", "QSGD", "qsgd2", "9bits", "q sgd", "nosuch:bits=4", "ef(nosuch)", "_x"])
def test_unknown_name_lists_every_quantizer(bad):
    with pytest.raises(gradq.SpecError) as e:
        gradq.build(bad)
    for name in NAMES:
        assert name in str(e.value), (bad, str(e.value))


@pytest.mark.parametrize("name", NAMES)
def test_unknown_key_lists_the_valid_keys(name):
    with pytest.raises(gradq.SpecError, match="zzz") as e:
        gradq.build(f"{name}:zzz=1")
    valid = ", ".join([p.name for p in REGISTRY[name].params] + ["ef"])
    assert f"valid: {valid}" in str(e.value)


def _bad_texts(p: Param) -> list[str]:
    if isinstance(p, BoolParam):
        return ["2", "maybe", "none"]
    if isinstance(p, ChoiceParam):
        return ["zzz", "-1"] + ([] if p.allow_none else ["none"])
    if isinstance(p, IntParam):
        out = ["abc", "1.5"] + ([] if p.allow_none else ["none"])
        out += [str(p.lo - 1)] if p.lo is not None else []
        return out + ([str(p.hi + 1)] if p.hi is not None else [])
    if isinstance(p, FloatParam):
        out = ["abc", "nan", "inf"] + ([] if p.allow_none else ["none"])
        if p.lo is not None:
            out.append(repr(p.lo) if p.lo_open else repr(p.lo - 1.0))
        return out + ([repr(p.hi + 1.0)] if p.hi is not None else [])
    if isinstance(p, IntTupleParam):
        return ["a+b", f"{p.hi}+{p.lo}", str(p.hi + 1), "+".join(str(p.lo) for _ in range(2)), "none"]
    return []


@pytest.mark.parametrize("name", NAMES)
def test_bad_values_say_what_is_valid(name):
    for p in REGISTRY[name].params:
        for text in _bad_texts(p):
            with pytest.raises(gradq.SpecError) as e:
                gradq.build(f"{name}:{p.name}={text}")
            msg = str(e.value)
            assert p.name in msg and p.describe() in msg, (name, p.name, text, msg)


@pytest.mark.parametrize("name", NAMES)
def test_duplicated_key(name):
    params = REGISTRY[name].params
    key = params[0].name if params else "ef"
    value = params[0].format(params[0].default) if params else "0"
    with pytest.raises(gradq.SpecError, match=f"'{key}' given twice"):
        gradq.build(f"{name}:{key}={value},{key}={value}")


@pytest.mark.parametrize("bad", ["qsgd:bits", "qsgd:bits=4,bucket", "qsgd:=4", "qsgd:bits=", "qsgd:bits=4,",
                                 "qsgd:,bits=4", "qsgd:bits 4"])
def test_missing_equals(bad):
    with pytest.raises(gradq.SpecError, match="key=value"):
        gradq.build(bad)


@pytest.mark.parametrize("bad,match", [
    ("ef(qsgd", "unbalanced"), ("ef(ef(qsgd)", "unbalanced"), ("qsgd(", "unbalanced"),
    ("ef(qsgd))", "unexpected text"), ("ef(qsgd)x", "unexpected text"),
    ("qsgd)", "parenthes"), ("(qsgd)", "parenthes"), ("ef((qsgd))", "parenthes"), ("qsgd:bits=(4)", "parenthes"),
])
def test_unbalanced_parentheses(bad, match):
    with pytest.raises(gradq.SpecError, match=match):
        gradq.build(bad)


@pytest.mark.parametrize("bad", ["", "   ", "\t\n", "qsgd:", "ef()", None, 3])
def test_empty_or_non_string_specs(bad):
    with pytest.raises(gradq.SpecError):
        gradq.build(bad)


@pytest.mark.parametrize("s", ["qsgd", "qsgd:bits=2", "qsgd:levels=7,bucket=none", "qsgd:levels=5",
                               "ef(qsgd:bits=3,norm=l2)", "qsgd:bits=8,ef=1", " qsgd : bits = 4 "]
                         + NAMES + [f"ef({n}:ef=0)" for n in NAMES])
def test_str_build_is_a_fixed_point(s):
    once = str(gradq.build(s))
    assert str(gradq.build(once)) == once


def test_build_is_still_importable_from_spec():
    """gradq.spec.build (the spelling before gradq.factory) still builds, through the factory."""
    from gradq.spec import build as old_build

    assert old_build("qsgd:bits=2") == gradq.build("qsgd:bits=2")
