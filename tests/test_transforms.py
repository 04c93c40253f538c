"""Error feedback: residual bookkeeping, checkpointing, spec spellings."""

from __future__ import annotations

import io

import pytest
import torch

import gradq
from gradq import ErrorFeedback, SpecError


def test_spellings_build_the_same_wrapper():
    a = gradq.build("ef(qsgd:bits=2)")
    b = gradq.build("qsgd:bits=2,ef=1")
    assert isinstance(a, ErrorFeedback) and a == b
    assert str(a) == "ef(qsgd:bits=2,bucket=512,norm=max)"
    assert gradq.build(str(a)) == a
    assert not isinstance(gradq.build("qsgd:bits=2,ef=0"), ErrorFeedback)


def test_double_wrapping_is_refused():
    with pytest.raises(SpecError, match="already has error feedback"):
        gradq.build("ef(qsgd:ef=1)")
    with pytest.raises(SpecError):
        ErrorFeedback(gradq.build("ef(qsgd)"))


def test_residual_keeps_the_sum_of_updates_on_track():
    """Σ decoded = Σ inputs − final residual, exactly (up to float rounding), for a biased quantizer."""
    ef = gradq.build("ef(topk:k=3)")
    total_in = torch.zeros(50)
    total_out = torch.zeros(50)
    for step in range(30):
        x = torch.randn(50, generator=torch.Generator().manual_seed(step))
        total_in += x
        total_out += ef.roundtrip(x, seed=step, name="w")
    assert torch.allclose(total_out, total_in - ef.residuals["w"], atol=1e-4)


def test_residuals_are_per_name_and_shape_checked():
    ef = gradq.build("ef(signsgd)")
    ef.encode(torch.randn(10), seed=0, name="a")
    ef.encode(torch.randn(4, 4), seed=0, name="b")
    assert ef.residuals["a"].shape == (10,) and ef.residuals["b"].shape == (4, 4)
    with pytest.raises(ValueError, match="residual for 'a'"):
        ef.encode(torch.randn(11), seed=0, name="a")


def test_state_dict_resumes_exactly():
    """Save after 3 steps, restore into a fresh wrapper: the next steps give identical bytes."""
    xs = [torch.randn(300, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    ref = gradq.build("ef(qsgd:bits=2,bucket=64)")
    for i in range(3):
        ref.encode(xs[i], seed=i, name="layer")
    buf = io.BytesIO()
    torch.save(ref.state_dict(), buf)
    buf.seek(0)
    resumed = gradq.build("ef(qsgd:bits=2,bucket=64)")
    resumed.load_state_dict(torch.load(buf))
    for i in range(3, 6):
        assert ref.encode(xs[i], seed=i, name="layer").same_bytes(resumed.encode(xs[i], seed=i, name="layer"))


def test_state_dict_refuses_another_spec():
    state = gradq.build("ef(qsgd:bits=2)").state_dict()
    with pytest.raises(ValueError, match="saved for"):
        gradq.build("ef(qsgd:bits=4)").load_state_dict(state)


@pytest.mark.parametrize("spec", ["ef(qsgd)", "ef(topk:ratio=0.5)", "ef(signsgd)", "ef(terngrad)"])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_non_finite_input_does_not_touch_the_residual(spec, bad_value):
    """NaN or Inf in x raises, naming the tensor, and leaves the residual (the inner encode screens
    x + e, or reads its witness: the wrapper does not screen x a second time)."""
    ef = gradq.build(spec)
    ef.encode(torch.ones(8), seed=0, name="w")
    before = ef.residuals["w"].clone()
    bad = torch.ones(8)
    bad[2] = bad_value
    with pytest.raises(gradq.NonFiniteError, match="w"):
        ef.encode(bad, seed=1, name="w")
    assert torch.equal(ef.residuals["w"], before)


def test_reset_and_properties():
    ef = gradq.build("ef(maxnorm:bits=2)")
    assert ef.summable and not ef.unbiased
    ef.encode(torch.randn(5), seed=0)
    ef.reset()
    assert ef.residuals == {}


def test_summable_codes_update_the_residual():
    """encode_codes under a shared scale: residual = input − own decoded codes."""
    ef = gradq.build("ef(maxnorm:bits=2)")
    x = torch.randn(100)
    w = torch.tensor([float(x.abs().max()) * 2])
    codes = ef.encode_codes(x, shared={"scale": w}, seed=3, name="p")
    mine = ef.decode_codes(codes, shared={"scale": w}, count=1, like=x)
    assert torch.allclose(ef.residuals["p"], x - mine)


def test_explicit_state_steps_equal_the_held_state_and_leave_their_input_alone():
    """encode_with(x, state) is the step encode() makes on the held state; the state passed in is not
    changed, so two runs can share one wrapper, and a state saved mid-run restores exactly."""
    from gradq.transforms import ErrorFeedbackState

    xs = [torch.randn(200, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    held = gradq.build("ef(qsgd:bits=2,bucket=32)")
    free = gradq.build("ef(qsgd:bits=2,bucket=32)")
    state = free.init_state()
    assert isinstance(state, ErrorFeedbackState) and state.residuals == {}
    for i, x in enumerate(xs):
        before = {k: v.clone() for k, v in state.residuals.items()}
        p_free, new = free.encode_with(x, state, seed=i, name="w")
        assert state.residuals.keys() == before.keys()
        assert all(torch.equal(state.residuals[k], before[k]) for k in before)   # untouched
        state = new
        assert held.encode(x, seed=i, name="w").same_bytes(p_free)
        assert torch.equal(held.residuals["w"], state.residuals["w"])
    assert free.residuals == {}   # the free wrapper's held state never moved
    other = gradq.build("ef(qsgd:bits=2,bucket=32)")
    other.load_state_dict({"spec": other.spec, "residuals": state.state_dict()})
    assert other.encode(xs[0], seed=9, name="w").same_bytes(free.encode_with(xs[0], state, seed=9, name="w")[0])


def test_explicit_state_for_summable_codes():
    ef = gradq.build("ef(maxnorm:bits=2,bucket=16)")
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    codes, state = ef.encode_codes_with(x, ef.init_state(), seed=1, name="p")
    assert torch.equal(codes, ef.encode_codes(x, seed=1, name="p"))
    assert torch.equal(state.residuals["p"], ef.residuals["p"])


@pytest.mark.parametrize("spec", ["ef(none)", "ef(fp16)", "ef(qsgd:bits=2)", "ef(terngrad)"])
def test_the_residual_is_the_input_less_its_decode_and_the_payload_is_kept(spec):
    """The residual is made in place in x + e where no field of the payload is that memory (``none``
    sends it as it is): the payload still holds what was encoded, and e = u − decode(payload)."""
    ef = gradq.build(spec)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    ef.encode(x, seed=0, name="w")
    e = ef.residuals["w"].clone()
    p = ef.encode(x, seed=1, name="w")
    u = x + e
    assert torch.equal(ef.residuals["w"], u - ef.decode(p))
    again = gradq.build(spec).inner.encode(u, seed=1, name="w")
    assert p.fields.keys() == again.fields.keys()
    assert all(torch.equal(p.fields[k], again.fields[k]) for k in p.fields)


@pytest.mark.parametrize("entry", ["shared_stats", "encode_codes"])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_non_finite_input_on_the_summable_path(entry, bad_value):
    """The same on the integer all-reduce's entry points: the inner screens x + e."""
    ef = gradq.build("ef(maxnorm:bits=4)")
    x = torch.randn(64)
    w = {"scale": torch.tensor([float(x.abs().max()) * 2])}
    ef.encode_codes(x, shared=w, seed=0, name="w")
    before = ef.residuals["w"].clone()
    bad = x.clone()
    bad[5] = bad_value
    with pytest.raises(gradq.NonFiniteError, match="w"):
        if entry == "shared_stats":
            ef.shared_stats(bad, name="w")
        else:
            ef.encode_codes(bad, shared=w, seed=1, name="w")
    assert torch.equal(ef.residuals["w"], before)


@pytest.mark.parametrize("spec", ["ef(maxnorm:bits=4)", "ef(maxnorm:bits=2,bucket=64)", "ef(maxnorm:bits=8)",
                                  "ef(terngrad)", "ef(randk-maxnorm:ratio=0.3,bits=4,rescale=1)",
                                  "ef(multiscale:bucket=512)", "ef(randk-multiscale:ratio=0.5)"])
def test_fields_and_codes_give_the_same_codes_and_residuals(spec):
    """The integer all-reduce's fast path under error feedback (encode_fields, the inner's fused
    kernels) gives the codes and residuals of encode_codes, bit for bit, step after step (the
    shared seed: GlobalRandK's coordinates; the others ignore it)."""
    a, b = gradq.build(spec), gradq.build(spec)
    if not a.summable:
        pytest.skip("not summable")
    for step in range(3):
        x = torch.randn(3000, generator=torch.Generator().manual_seed(step))
        ss = 40 + step
        shared = {k: s.value for k, s in a.shared_stats(x, name="w", shared_seed=ss).items()}
        assert all(torch.equal(v, b.shared_stats(x, name="w", shared_seed=ss)[k].value) for k, v in shared.items())
        fields = a.encode_fields(x, shared=shared, seed=step, name="w", shared_seed=ss)
        codes = b.encode_codes(x, shared=shared, seed=step, name="w", shared_seed=ss)
        assert fields is not None and fields.dtype == torch.uint8
        assert torch.equal(fields.to(torch.int64) - a.max_code, codes.to(torch.int64))
        ra, rb = a.residuals["w"], b.residuals["w"]
        assert torch.equal(ra.view(torch.int32), rb.view(torch.int32)), step
        avg = a.decode_field_sum(fields, shared=shared, count=1, like=x, shared_seed=ss)
        assert torch.equal(avg, b.decode_codes(codes, shared=shared, count=1, like=x, shared_seed=ss))


def test_fields_are_none_and_the_residual_untouched_without_a_fields_path():
    ef = gradq.build("ef(fp16)")   # (a cast: no integer codes, so no fields path)
    x = torch.randn(100)
    shared = {k: s.value for k, s in ef.shared_stats(x, shared_seed=3).items()}
    assert ef.encode_fields(x, shared=shared, seed=0, shared_seed=3, name="w") is None
    assert ef.residuals == {}


def _steps(ef, entry: str, xs, name="w"):
    """Run ``entry`` (encode, or encode_fields or encode_codes after shared_stats) on
    the held state over ``xs``: each step's output (cloned), residual (cloned) and residual's address."""
    outs, residuals, ptrs = [], [], []
    for i, x in enumerate(xs):
        if entry == "encode":
            out = ef.encode(x, seed=i, name=name)
            out = {k: v.clone() for k, v in out.fields.items()}
        else:
            shared = {k: s.value for k, s in ef.shared_stats(x, name=name).items()}
            out = getattr(ef, entry)(x, shared=shared, seed=i, name=name).clone()
        outs.append(out)
        residuals.append(ef.residuals[name].clone())
        ptrs.append(ef.residuals[name].data_ptr())
    return outs, residuals, ptrs


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("spec,entry", [("ef(topk:ratio=0.01)", "encode"), ("ef(qsgd:bits=2)", "encode"),
                                        ("ef(signsgd)", "encode"), ("ef(maxnorm:bits=4)", "encode_fields"),
                                        ("ef(maxnorm:bits=4)", "encode_codes"), ("ef(fp16)", "encode")])
def test_held_steps_reuse_the_replaced_residual_and_give_the_same_bits(spec, entry):
    """On CPU tensors the held state's steps write x + e into the residual that the step before
    replaced (the two buffers alternate from the third step: addresses 0, 1, 0, 1), and give the
    payloads and residuals of steps that allocate (``spares=False``) and of the explicit state, bit
    for bit."""
    xs = [torch.randn(5000, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(5)]
    reuse, fresh = gradq.build(spec), gradq.build(spec)
    fresh.spares = False
    got, got_r, ptrs = _steps(reuse, entry, xs)
    want, want_r, _ = _steps(fresh, entry, xs)
    assert all(_same(a, b) for a, b in zip(got, want)) and all(_same(a, b) for a, b in zip(got_r, want_r))
    assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[4] == ptrs[0] != ptrs[1], ptrs
    assert reuse.spare_bytes == 4 * 5000 and fresh.spare_bytes == 0
    if entry == "encode":
        state = reuse.init_state()
        for i, x in enumerate(xs):
            p, state = reuse.encode_with(x, state, seed=i, name="w")
            assert _same({k: v for k, v in p.fields.items()}, got[i]) and _same(state.residuals["w"], got_r[i])


def test_a_payload_that_holds_x_plus_e_is_not_overwritten():
    """``none`` sends ``x + e`` itself: that memory belongs to the payload, so no later step writes
    into it (each step's payload still holds what was sent)."""
    ef = gradq.build("ef(none)")
    xs = [torch.randn(300, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    payloads, sent = [], []
    for i, x in enumerate(xs):
        p = ef.encode(x, seed=i, name="w")
        payloads.append(p)
        sent.append({k: v.clone() for k, v in p.fields.items()})
    assert all(_same({k: v for k, v in p.fields.items()}, s) for p, s in zip(payloads, sent))


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_a_refused_step_leaves_the_residual_and_the_next_steps_exact(bad_value):
    """A NaN or Inf refused mid-run (after the spare holds x + e of the bad input) changes neither
    the residual nor the steps after it."""
    xs = [torch.randn(400, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    bad = xs[2].clone()
    bad[7] = bad_value
    a, b = gradq.build("ef(qsgd:bits=2,bucket=64)"), gradq.build("ef(qsgd:bits=2,bucket=64)")
    b.spares = False
    for i, x in enumerate(xs):
        if i == 2:
            before = a.residuals["w"].clone()
            with pytest.raises(gradq.NonFiniteError):
                a.encode(bad, seed=i, name="w")
            assert torch.equal(a.residuals["w"], before)
        assert a.encode(x, seed=i, name="w").same_bytes(b.encode(x, seed=i, name="w"))
        assert torch.equal(a.residuals["w"], b.residuals["w"])


def test_spares_are_dropped_with_the_state():
    ef = gradq.build("ef(signsgd)")
    for i in range(3):
        ef.encode(torch.randn(100), seed=i, name="w")
    assert ef.spare_bytes == 400
    ef.load_state_dict(ef.state_dict())
    assert ef.spare_bytes == 0
    for i in range(3):
        ef.encode(torch.randn(100), seed=i, name="w")
    ef.reset()
    assert ef.spare_bytes == 0 and ef.residuals == {}


class _Adds(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ``torch.add(..., out=)`` calls over ``n`` values (error feedback's ``x + e`` into a spare)."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.count = n, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__ == "add.out" and args and args[0].numel() == self.n:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("spec", ["ef(maxnorm:bits=4)", "ef(terngrad)", "ef(multiscale)",
                                  "ef(randk-maxnorm:ratio=0.25)"])
def test_the_fields_step_makes_no_tensor_of_the_gradients_size(spec):
    """On the held state the all-reduce's step (statistics, then fields) writes ``x + e`` into the
    spare and this worker's own decode into the residual it replaces, so from the third step on it
    makes no float32 tensor of the gradient's size (fresh CPU memory costs its page faults); the
    fields, a byte a value, are its only new tensor of that length. Fields and residuals: bit for
    bit those of a twin that never reuses memory."""
    from gradq_testing import NewStorage

    n = 4000
    a, b = gradq.build(spec), gradq.build(spec)
    b.spares = False
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        x = torch.randn(n, generator=g)
        with NewStorage() as made:
            stats = a.shared_stats(x, name="w", shared_seed=5)
            shared = {k: s.value for k, s in stats.items()}
            fields = a.encode_fields(x, shared=shared, seed=step, name="w", shared_seed=5, own=stats)
        want = b.encode_fields(x, shared=shared, seed=step, name="w", shared_seed=5)
        assert torch.equal(fields, want), step
        assert torch.equal(a.residuals["w"].view(torch.int32), b.residuals["w"].view(torch.int32)), step
        assert (made.largest < 4 * n) == (step >= 2), (step, made.largest)


@pytest.mark.parametrize("change", ["none", "x in place", "another x"])
def test_the_statistics_sum_serves_the_step_that_follows(change):
    """The all-reduce's order on the held state (statistics, then fields, per tensor): the spare that
    ``shared_stats`` filled with ``x + e`` is taken as it is by the step on the same ``x`` and ``e``
    (no second add over the tensor), and added again where ``x`` changed in place or is another
    tensor. Fields and residuals: bit for bit those of a twin that never reuses memory."""
    n = 4000
    a, b = gradq.build("ef(maxnorm:bits=4)"), gradq.build("ef(maxnorm:bits=4)")
    b.spares = False
    g = torch.Generator().manual_seed(7)
    for step in range(5):
        x = torch.randn(n, generator=g)
        y = x.clone()
        shared = {k: s.value for k, s in a.shared_stats(x, name="w").items()}
        assert all(torch.equal(v, b.shared_stats(x, name="w")[k].value) for k, v in shared.items())
        if step >= 2 and change == "x in place":
            x.mul_(0.5)
            y = x.clone()
        elif step >= 2 and change == "another x":
            x = x * 0.5                          # (a new tensor: its own scale stays below the shared one)
            y = x.clone()
        with _Adds(n) as mode:
            fields = a.encode_fields(x, shared=shared, seed=step, name="w")
        want = b.encode_fields(y, shared=shared, seed=step, name="w")
        assert torch.equal(fields, want), step
        assert torch.equal(a.residuals["w"].view(torch.int32), b.residuals["w"].view(torch.int32)), step
        # (a spare exists from the third step on, the residual the second replaced: the statistics
        # fill it; before, x + e goes to new memory, no add into a buffer)
        assert mode.count == (1 if step >= 2 and change != "none" else 0), (step, mode.count)
