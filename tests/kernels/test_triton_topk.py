"""Top-K's selection on the Triton backend (gradq.kernels.triton_topk): a radix select on the device.

Under Triton's interpreter (CPU tensors): the reference's indices and values bit for bit on every
kind of data the numba path is tested on (ties across programs included), with few and many radix
levels; the dispatch; and an allocation count (nothing input-sized, no host read). On a GPU: the
same bytes for 25M values, and the selection's peak memory.
"""

from __future__ import annotations

import math

import pytest
import torch

import gradq
from gradq import kernels
from gradq.kernels import reference as R

T = pytest.importorskip("gradq.kernels.triton_ops", reason="triton is not installed")
from gradq.kernels import triton_topk as TK  # noqa: E402
from test_subset_kernels import _vector  # noqa: E402
from test_triton_randk import Allocations, _counted  # noqa: E402

interpreted = pytest.mark.skipif(not T.INTERPRETED, reason="interpreter tests")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

KINDS = ["randn", "sparse", "grid", "few", "constant", "tiny", "layers"]


def _same_topk(x: torch.Tensor, k: int, dtype: torch.dtype = torch.int32) -> None:
    got_v, got_i = TK.topk_select(x, k, dtype)
    ref_v, ref_i = R.topk_select(x.cpu(), k, dtype)
    assert got_i.dtype == dtype and got_v.dtype == torch.float32 and got_i.numel() == k
    assert torch.equal(got_i.cpu(), ref_i)
    assert torch.equal(got_v.cpu().view(torch.int32), ref_v.view(torch.int32))   # bit for bit (−0.0, NaN)


@interpreted
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(2, 1), (65, 64), (1000, 1), (1000, 999), (9_001, 90), (9_001, 4_500)])
def test_topk_same_as_reference(monkeypatch, kind, n, k):
    """Programs of 1,024 values (so 9,001 values make nine, the last one partial), ties within and
    across programs: the kept ties are the first in index order."""
    monkeypatch.setitem(T.TUNING, "topk_elems", 1024)
    _same_topk(_vector(kind, n, seed=n + k), k)


@interpreted
@pytest.mark.parametrize("bins", [2, 64, 2048])
def test_topk_with_any_number_of_radix_levels(monkeypatch, bins):
    """One bit a level (31 levels), six (six levels, the last of one bit) and eleven (three): the
    same selection, on data whose k-th largest is tied with values in other programs."""
    monkeypatch.setitem(T.TUNING, "topk_bins", bins)
    monkeypatch.setitem(T.TUNING, "topk_elems", 2048)
    for kind in ("grid", "layers"):
        _same_topk(_vector(kind, 20_003, seed=bins), 2_000, torch.int64)


@interpreted
def test_topk_plan_over_several_steps(monkeypatch):
    """The one-program plan takes the programs' counts 4 at a time here (1,024 shipped): the ties
    and the positions carried from step to step, with ties in many programs."""
    monkeypatch.setattr(TK, "_SCAN", 4)
    monkeypatch.setitem(T.TUNING, "topk_elems", 1024)
    for kind, k in (("few", 4_000), ("constant", 2_500), ("grid", 300), ("randn", 5_000)):
        _same_topk(_vector(kind, 18_001, seed=k), k)


@interpreted
def test_topk_with_non_finite_values(monkeypatch):
    """NaN ranks above +Inf, as in the reference's keys (the kernels' callers screen for them)."""
    monkeypatch.setitem(T.TUNING, "topk_elems", 1024)
    x = _vector("randn", 5_000, seed=2)
    x[[7, 900, 4_000]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x[2_000] = -float("nan")
    for k in (1, 2, 3, 4, 5, 500):
        _same_topk(x, k)


@interpreted
def test_topk_several_loop_steps_a_program():
    """The shipped shape (8,192 values a program, 1,024 a step): steps that end inside the vector."""
    _same_topk(_vector("layers", 30_001, seed=4), 300, torch.int64)
    _same_topk(_vector("few", 30_001, seed=5), 12_345)


def _refuse(*args, **kwargs):
    raise AssertionError("the reference was called")


@interpreted
def test_dispatch(triton_backend, monkeypatch):
    """The Triton backend serves float32 vectors with 0 < k < n; k = 0, k = n and topk_path 2 take
    the reference, and other dtypes too (which then refuses them as before)."""
    x = _vector("randn", 3_000, seed=6)
    want = R.topk_select(x, 30, torch.int32)
    with monkeypatch.context() as m:
        m.setattr(R, "topk_select", _refuse)
        got = kernels.topk_select(x, 30, torch.int32)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    calls = []
    real = R.topk_select
    monkeypatch.setattr(R, "topk_select", lambda *a: calls.append(a[1]) or real(*a))
    assert kernels.topk_select(x, 0)[1].numel() == 0 and kernels.topk_select(x, 3_000)[1].numel() == 3_000
    monkeypatch.setitem(T.TUNING, "topk_path", 2)
    assert torch.equal(kernels.topk_select(x, 30, torch.int32)[1], want[1])
    assert calls == [0, 3_000, 30]
    assert not TK.takes(3_000, 30) and not TK.takes(TK.MAX_N + 1, 30)
    with pytest.raises(ValueError):
        TK.topk_select(x, 30)   # (topk_path 2)
    monkeypatch.setitem(T.TUNING, "topk_path", 1)
    with pytest.raises(TypeError):
        TK.topk_select(x, 30, torch.float32)
    with pytest.raises(ValueError):
        kernels.topk_select(x, 3_001)


class _Reads(Allocations):
    """:class:`Allocations`, and the host reads outside the launches: ``.item()``, ``int(t)``,
    ``float(t)``, ``bool(t)`` (each a ``_local_scalar_dense``) and ``torch.equal``."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_launch and func.__name__.split(".")[0] in ("_local_scalar_dense", "equal"):
            self.reads += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@interpreted
def test_topk_quantizer_holds_nothing_input_sized(triton_backend, monkeypatch):
    """Through the public API (``topk:ratio=0.01`` on 100,003 values): the encode allocates its
    payload, the histogram (4 bytes a bin), two int32 a program and a few scalars, nothing of the
    input's size (the reference's int64 keys alone are 8 bytes a value, 100× this payload). Its one
    host read (``.tolist()`` and the operators of :class:`_Reads`) is the look at the kept values
    for a NaN or Inf (as a CUDA tensor's: a sum and a read), and there is none without the check
    (``check_finite=False``, as the DDP hook encodes)."""
    n = 100_003
    q = gradq.build("topk:ratio=0.01")
    x = _vector("layers", n, seed=8)
    lists = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: lists.append(1) or tolist(t))
    monkeypatch.setattr(R, "topk_select", _refuse)
    monkeypatch.setattr(kernels, "witness_is_finite", lambda t: math.isfinite(float(t.sum())))   # (the CUDA branch)

    def measured(**kw):
        mode = _Reads()
        with pytest.MonkeyPatch.context() as m:
            _counted(m, mode, TK)
            with mode:
                return q.encode(x, seed=1, **kw), mode

    enc, mode = measured()
    programs = -(-n // T.TUNING["topk_elems"])
    selection = 4 * T.TUNING["topk_bins"] + 8 * programs + 32 + 512   # (the 512: a few scalars)
    assert enc.nbytes <= mode.total <= enc.nbytes + selection, (mode.total, enc.nbytes, selection)
    assert mode.largest <= max(4 * T.TUNING["topk_bins"], 4 * q.count(n)) < n   # (the histogram or the values)
    assert mode.reads == 1 and not lists, (mode.reads, lists)
    unchecked, mode = measured(check_finite=False)
    assert mode.reads == 0 and not lists, (mode.reads, lists)
    assert unchecked.same_bytes(enc)
    monkeypatch.undo()
    kernels.set_backend("torch")
    assert enc.same_bytes(q.encode(x, seed=1))


@pytest.mark.gpu
@gpu
def test_gpu_topk_bytes_and_peak():
    """On CUDA (histogram atomics in whatever order the programs run): the CPU reference's indices
    and values for 25M values of three kinds (three ``k`` on one); and the selection's peak extra
    memory at most 1.25× its output's bytes (the reference's keys and sort: about 24 bytes a value)."""
    n = 25_000_000
    for kind, ks in (("grid", (250_000,)), ("sparse", (250_000,)), ("layers", (1, 250_000, 2_500_000))):
        x = _vector(kind, n, seed=3)
        xc = x.cuda()
        for k in ks:
            got_v, got_i = TK.topk_select(xc, k, torch.int32)
            ref_v, ref_i = R.topk_select(x, k, torch.int32)
            assert torch.equal(got_i.cpu(), ref_i), (kind, k)
            assert torch.equal(got_v.cpu().view(torch.int32), ref_v.view(torch.int32)), (kind, k)
    k = 250_000
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got_v, got_i = TK.topk_select(xc, k, torch.int32)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 1.25 * (got_v.nbytes + got_i.nbytes), extra
