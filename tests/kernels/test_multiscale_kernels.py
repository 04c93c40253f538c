"""MultiScale's numba kernels against the plain-torch reference: the same indices, bytes and floats."""

from __future__ import annotations

import numba
import pytest
import torch

from gradq import kernels as K
from gradq.errors import PayloadError
from gradq.kernels import numba_ops as N
from gradq.kernels import reference as R
from gradq.random import RandomStream

pytestmark = pytest.mark.skipif(not K.available(), reason="numba kernels unavailable")

LEVELS = [((1, 31), 2, 1), ((1, 3, 15, 127), 2, 2), ((7,), 4, 0), ((3, 31, 127), 3, 2), ((1, 7), 2, 1)]


def data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
    x[::13] = 0.0
    x[3::17] = -0.0
    x[5::29] = 1e-42
    return x


@pytest.mark.parametrize("n", [1, 8, 9, 1000, 70_001])
@pytest.mark.parametrize("bucket", [None, 1, 7, 512, 65_537])
def test_kernels_match_the_reference(n, bucket):
    x = data(n, n)
    for levels, w, iw in LEVELS:
        for sc in (R.maxabs_scales(x, bucket), R.maxabs_scales(x, bucket) * 1.7, R.l2_scales(x, bucket)):
            idx = R.multiscale_indices(x, sc, levels, bucket)
            assert torch.equal(N.multiscale_indices(x, sc, levels, bucket), idx), levels
            a, b = RandomStream(n), RandomStream(n)
            a.offset = b.offset = 2**32 - 300   # the counters cross 2**32 in the longer cases
            enc = N.multiscale_encode(x, sc, idx, levels, bucket, w, iw, a)
            ref = R.multiscale_encode(x, sc, idx, levels, bucket, w, iw, b)
            assert a.offset == b.offset == 2**32 - 300 + n
            assert torch.equal(enc[0], ref[0]) and (iw == 0 or torch.equal(enc[1], ref[1])), levels
            c = RandomStream(n)
            c.offset = 2**32 - 300
            own = N.multiscale_encode(x, sc, None, levels, bucket, w, iw, c)  # own indices, in the kernel
            assert torch.equal(own[0], enc[0]) and (iw == 0 or torch.equal(own[1], enc[1])), levels
            got = N.multiscale_decode(*ref, sc, levels, bucket, w, iw, n)
            want = R.multiscale_decode(*ref, sc, levels, bucket, w, iw, n)
            assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


def test_zero_scales_and_exact_index_limits():
    """Buckets of zeros (scale 0 divides by 1), and values on both sides of every index limit."""
    sc = torch.tensor([0.0, 31.0, 1e-40])
    x = torch.zeros(24)
    x[8:16] = torch.tensor([1.0, 1.0000001, 0.9999999, 31.0, 0.5, 2.0, -1.0, -1.0000001])
    x[16:] = torch.tensor([1e-40, 3e-42, 1e-45, 0.0, -1e-40, 5e-41, 1e-41, 2e-41])
    idx = R.multiscale_indices(x, sc, (1, 31), 8)
    assert torch.equal(N.multiscale_indices(x, sc, (1, 31), 8), idx)
    assert idx[8:16].tolist() == [1, 0, 1, 0, 1, 0, 1, 0]


def test_errors():
    x = data(100, 1)
    sc = R.maxabs_scales(x, None)
    idx = R.multiscale_indices(x, sc, (1, 31), None)
    with pytest.raises(ValueError, match="MIN over workers"):
        N.multiscale_encode(x, sc, torch.ones_like(idx), (1, 31), None, 2, 1, 0)
    with pytest.raises(ValueError, match="MIN over workers"):
        R.multiscale_encode(x, sc, torch.ones_like(idx), (1, 31), None, 2, 1, 0)
    # unchecked (a caller that made the MIN over workers itself): no error, the reference's bytes
    got = N.multiscale_encode(x, sc, torch.ones_like(idx), (1, 31), None, 2, 1, 0, check=False)
    want = R.multiscale_encode(x, sc, torch.ones_like(idx), (1, 31), None, 2, 1, 0, check=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    bad = torch.full((25,), 0xFF, dtype=torch.uint8)  # 2-bit indices of 3 = out of 3 scales
    with pytest.raises(PayloadError, match="corrupt scale index"):
        N.multiscale_decode(torch.zeros(25, dtype=torch.uint8), bad, sc, (1, 3, 15), None, 2, 2, 100)


def test_two_scale_decode_sees_one_corrupt_index_anywhere():
    """With two scales the decode checks the indices by their maximum; one index of 2 or 3 among
    valid ones, first, in the middle or last, still raises."""
    n = 1000
    sc = R.maxabs_scales(data(n, 2), 64)
    codes = torch.zeros((2 * n + 7) // 8, dtype=torch.uint8)
    for i in (0, 517, n - 1):
        index = torch.zeros((2 * n + 7) // 8, dtype=torch.uint8)
        index[i // 4] = 2 << (2 * (i % 4))
        with pytest.raises(PayloadError, match="corrupt scale index"):
            N.multiscale_decode(codes, index, sc, (1, 31), 64, 2, 2, n)
    N.multiscale_decode(codes, torch.zeros_like(codes), sc, (1, 31), 64, 2, 2, n)   # and none raises nothing


def test_thread_count_does_not_change_bytes():
    x = data(300_007, 2)
    sc = R.maxabs_scales(x, 1000)
    threads = numba.get_num_threads()
    outs = []
    try:
        for t in (1, threads):
            numba.set_num_threads(t)
            idx = N.multiscale_indices(x, sc, (1, 31), 1000)
            outs.append((idx, *N.multiscale_encode(x, sc, idx, (1, 31), 1000, 2, 1, 9)))
    finally:
        numba.set_num_threads(threads)
    assert all(torch.equal(p, q) for p, q in zip(*outs))
