"""gradq.fsdp_layout: the policy's cut of an FSDP2 buffer, and the non-finite screen (no process group)."""

from __future__ import annotations

import torch

from gradq.fsdp_layout import Plan, screen


def test_plan_split_and_scatter_are_inverse():
    # a block of 10: compressed [0, 4) and [6, 9), full precision [4, 6) and [9, 10)
    plan = Plan(10, [(0, 4), (6, 9)], [(4, 6), (9, 10)], [4, 3])
    rows = torch.arange(30, dtype=torch.float32).reshape(3, 10)
    comp, full = plan.split(rows)
    assert comp.tolist()[1] == [10, 11, 12, 13, 16, 17, 18] and full.tolist()[1] == [14, 15, 19]
    assert plan.parts == [(0, 4), (4, 7)] and (plan.n_comp, plan.n_full) == (7, 3)   # one part per parameter
    out = torch.empty(10)
    Plan.scatter_into(out, plan.comp, comp[2])
    Plan.scatter_into(out, plan.full, full[2])
    assert torch.equal(out, rows[2])
    assert Plan(10, [(0, 10)], []).parts == [(0, 10)]      # not layer-wise: one part
    assert Plan(10, [], [(0, 10)]).parts == []              # everything in full precision


def test_screen_counts_only_real_non_finite_values():
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.0])
    n, clean = screen(x)
    assert n == 3 and clean.tolist() == [1.0, 0.0, 0.0, 0.0, 2.0] and torch.isnan(x[1])   # x itself untouched
    big = torch.tensor([3e38, 3e38])          # a finite input whose sum overflows: counted exactly, none found
    n, same = screen(big)
    assert n == 0 and same is big
    assert screen(torch.empty(0))[0] == 0
    n, clean = screen(torch.tensor([1.0, float("nan")], dtype=torch.bfloat16))
    assert n == 1 and clean.dtype == torch.bfloat16 and clean.tolist() == [1.0, 0.0]
