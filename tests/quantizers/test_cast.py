"""Casts: none / fp16 / bf16."""

from __future__ import annotations

import pytest
import torch

import gradq


@pytest.mark.parametrize("spec,dtype,size", [("none", torch.float32, 4), ("fp16", torch.float16, 2),
                                             ("bf16", torch.bfloat16, 2)])
def test_wire_is_the_cast(spec, dtype, size):
    x = torch.randn(1000)
    q = gradq.build(spec)
    p = q.encode(x)
    assert p["values"].dtype == dtype and p.data_nbytes == size * 1000
    assert torch.equal(q.decode(p), x.to(dtype).float())


def test_none_is_exact_and_unbiased():
    x = torch.randn(77)
    q = gradq.build("none")
    assert q.unbiased and torch.equal(q.roundtrip(x), x)


def test_fp16_overflow_is_refused():
    with pytest.raises(ValueError, match="overflows float16"):
        gradq.build("fp16").encode(torch.tensor([1.0, 7e4]))
    assert torch.isfinite(gradq.build("bf16").roundtrip(torch.tensor([1.0, 7e4]))).all()
