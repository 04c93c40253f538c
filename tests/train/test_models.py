"""Models: shapes, backward, seeding, parameter counts (ResNet-20, FC-heavy VGG), image_shape handling."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradq.train.models import MODELS, build_model, count_parameters, image_chw, parameter_summary

SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32), (8, 8)]


def _features(shape) -> int:
    return math.prod(shape)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_gives_logits_and_gradients(name, shape):
    f = _features(shape)
    model = build_model(name, f, 7, image_shape=shape, seed=0)
    x = torch.rand(4, f, generator=torch.Generator().manual_seed(1))
    out = model(x)
    assert out.shape == (4, 7) and torch.isfinite(out).all()
    nn.functional.cross_entropy(out, torch.arange(4) % 7).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    # the classifier's weights always receive a non-zero gradient
    assert any(float(p.grad.abs().sum()) > 0 for p in model.parameters())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_same_seed_same_parameters(name):
    shape = (1, 8, 8)
    a, b, c = (build_model(name, 64, 10, shape, seed=s) for s in (3, 3, 4))
    pa, pb, pc = (torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb)
    assert not torch.equal(pa, pc)


def test_two_and_three_dim_image_shapes_build_the_same_model():
    for name in MODELS:
        a = build_model(name, 64, 10, (8, 8), seed=5)
        b = build_model(name, 64, 10, (1, 8, 8), seed=5)
        assert [(n, p.shape) for n, p in a.named_parameters()] == [(n, p.shape) for n, p in b.named_parameters()]
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_resnet20_parameter_count():
    # Counted by hand: stem conv 3*16*9 = 432; stage 1: six 16->16 convs 6*2304 = 13,824; stage 2: one
    # 16->32 conv 4,608 + five 32->32 convs 5*9,216 = 46,080; stage 3: one 32->64 conv 18,432 + five 64->64
    # convs 5*36,864 = 184,320; BatchNorm scale+shift 2*(16 + 6*16 + 6*32 + 6*64) = 1,376; head 64*10+10 = 650.
    # Total 269,722 (the paper's "0.27M"); the option-A shortcuts add nothing.
    expected = 432 + 13_824 + 4_608 + 46_080 + 18_432 + 184_320 + 1_376 + 650
    assert expected == 269_722
    model = build_model("resnet20", 3 * 32 * 32, 10, (3, 32, 32))
    assert count_parameters(model) == expected
    # one input channel: the stem conv has 2*16*9 = 288 fewer weights; image size does not matter
    assert count_parameters(build_model("resnet20", 784, 10, (1, 28, 28))) == expected - 288
    assert count_parameters(build_model("resnet20", 64, 10, (8, 8))) == expected - 288
    # 20 weighted layers: 19 convs and one linear layer
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs) == 19 and len(linears) == 1
    assert all(m.kernel_size == (3, 3) for m in convs)
    assert sum(m.stride == (2, 2) for m in convs) == 2


def test_resnet20_eval_mode_single_sample_and_odd_sizes():
    model = build_model("resnet20", 784, 10, (1, 28, 28)).eval()  # 28 -> 14 -> 7 -> 4
    with torch.no_grad():
        assert model(torch.rand(1, 784)).shape == (1, 10)
    model = build_model("resnet20", 512, 10, (1, 1, 512))  # non-square synthetic features
    assert model(torch.rand(2, 512)).shape == (2, 10)


def test_resnet20_learns_a_fixed_batch():
    # Wiring check (BatchNorm, residuals, head): 15 Adam steps on 64 random images with random labels must
    # bring the loss well below the chance level ln(10) = 2.30; a broken block stalls near 2.3.
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
    model = build_model("resnet20", 64, 10, (1, 8, 8), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(15):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    assert loss.item() < 1.0


def _fc_share(model: nn.Module) -> float:
    fc = sum(p.numel() for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters())
    return fc / count_parameters(model)


def test_vgg_is_dominated_by_fully_connected_layers():
    mnist = build_model("vgg", 784, 10, (1, 28, 28))
    assert count_parameters(mnist) == 4_337_130  # the docstring's number
    assert _fc_share(mnist) > 0.98
    digits = build_model("vgg", 64, 10, (1, 8, 8))
    assert count_parameters(digits) == 1_388_010 and _fc_share(digits) > 0.95
    cifar = build_model("vgg", 3072, 10, (3, 32, 32))
    assert count_parameters(cifar) == 5_320_746 and _fc_share(cifar) > 0.98
    # non-square synthetic features: the ceil-mode pools keep a 1-pixel-high image alive
    assert build_model("vgg", 512, 10, (1, 1, 512))(torch.rand(2, 512)).shape == (2, 10)


def test_wide_mlp_parameter_count():
    # 784*2048+2048 + 2048*2048+2048 + 2048*10+10, the number the module docstring quotes
    assert count_parameters(build_model("mlp-wide", 784, 10, (1, 28, 28))) == 5_824_522
    assert count_parameters(build_model("mlp-wide", 64, 10, (8, 8))) == 64 * 2048 + 2048 + 2048 * 2048 + 2048 + 20490


def test_parameter_summary_matches_count():
    model = build_model("lenet", 784, 10, (1, 28, 28))
    summary = parameter_summary(model)
    assert sum(n for _, n in summary) == count_parameters(model) == 107_786
    assert summary[0][0].endswith("weight") and summary[0][1] == 6 * 1 * 25


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="valid: .*resnet20.*vgg"):
        build_model("alexnet", 64, 10)
    with pytest.raises(ValueError, match="holds 784 values but the data has 64"):
        build_model("resnet20", 64, 10, (1, 28, 28))
    with pytest.raises(ValueError, match=r"\(C, H, W\) or \(H, W\)"):
        image_chw((64,), 64)
    with pytest.raises(ValueError, match="at least 4x4"):
        build_model("lenet", 512, 10, (1, 1, 512))
