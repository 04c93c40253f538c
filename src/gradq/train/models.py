"""Models for the training runner and the gradient studies.

Every model takes **flattened** features ``(N, C*H*W)`` (the data loaders flatten images) and returns
logits ``(N, classes)``; the convolutional ones unflatten internally using ``image_shape``, which may be
``(C, H, W)`` or ``(H, W)`` (meaning one channel).

=========  ===================================================================================  ========
name       what                                                                                 params*
=========  ===================================================================================  ========
logreg     one linear layer (multinomial logistic regression)                                    7,850
mlp        784-256-128-classes ReLU perceptron                                                  235,146
mlp-wide   784-2048-2048-classes ReLU perceptron (communication-heavy)                        5,824,522
lenet      LeNet-5-like: two 5x5 conv + max-pool stages, FC 120-84-classes                       ~0.11M
resnet20   CIFAR ResNet-20 (He et al. 2016, §4.2), option-A shortcuts, BatchNorm                ~0.27M
vgg        VGG-style: four 3x3 conv layers, two max-pools, FC 1024-1024-classes; >98% FC         4.34M
=========  ===================================================================================  ========

\\* for MNIST input (1, 28, 28) and 10 classes, except resnet20 quoted for CIFAR (3, 32, 32). Use
:func:`count_parameters` / :func:`parameter_summary` for exact numbers on any shape.

:func:`build_model` seeds PyTorch's global generator with ``seed`` before building, so the same
``(name, features, classes, image_shape, seed)`` always gives the same initial parameters.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_model", "MODELS", "count_parameters", "parameter_summary", "ResNet20", "image_chw"]

Shape = Sequence[int]


def image_chw(image_shape: Shape, features: int) -> tuple[int, int, int]:
    """Return ``image_shape`` as ``(C, H, W)`` (``(H, W)`` means ``C = 1``) and check it against ``features``.

    Raises ``ValueError`` when ``C*H*W != features``, naming both, since a mismatch means the data set
    and the model were built for different inputs.
    """
    dims = tuple(int(d) for d in image_shape)
    if len(dims) == 2:
        dims = (1,) + dims
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"image_shape must be (C, H, W) or (H, W) with positive sizes, got {tuple(image_shape)}")
    c, h, w = dims
    if c * h * w != features:
        raise ValueError(f"image_shape {tuple(image_shape)} holds {c * h * w} values but the data has {features} "
                         f"features per sample; pass the data set's image_shape (Dataset.image_shape)")
    return c, h, w


def count_parameters(model: nn.Module) -> int:
    """Total number of scalar parameters of ``model`` (trainable or not; buffers excluded)."""
    return sum(p.numel() for p in model.parameters())


def parameter_summary(model: nn.Module) -> list[tuple[str, int]]:
    """``(name, numel)`` for every parameter tensor of ``model``, in registration order."""
    return [(name, p.numel()) for name, p in model.named_parameters()]


# --------------------------------------------------------------------------------------------------
# small models


def _mlp(features: int, classes: int, image_shape: Shape) -> nn.Module:
    """Perceptron ``features-256-128-classes`` with ReLU; ``image_shape`` is ignored."""
    return nn.Sequential(nn.Linear(features, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, classes))


def _mlp_wide(features: int, classes: int, image_shape: Shape) -> nn.Module:
    """Wide perceptron ``features-2048-2048-classes`` with ReLU: little computation per parameter, so its
    steps are dominated by communication (the communication-heavy model of the network benchmarks)."""
    return nn.Sequential(nn.Linear(features, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, classes))


def _logreg(features: int, classes: int, image_shape: Shape) -> nn.Module:
    """One linear layer ``features -> classes``; ``image_shape`` is ignored."""
    return nn.Linear(features, classes)


def _lenet(features: int, classes: int, image_shape: Shape) -> nn.Module:
    """LeNet-5-like: conv5x5(6)-pool-conv5x5(16)-pool, then FC 120-84-classes (ReLU, 'same' padding).

    The input must be at least 4x4 (two 2x2 max-pools).
    """
    c, h, w = image_chw(image_shape, features)
    conv = nn.Sequential(nn.Unflatten(1, (c, h, w)), nn.Conv2d(c, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
    n = 16 * (h // 2 // 2) * (w // 2 // 2)
    if n == 0:
        raise ValueError(f"lenet needs images of at least 4x4, got {h}x{w}; use mlp, resnet20 or vgg")
    return nn.Sequential(conv, nn.Linear(n, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, classes))


# --------------------------------------------------------------------------------------------------
# ResNet-20


class _BasicBlock(nn.Module):
    """Two 3x3 conv + BatchNorm layers with an identity (option-A) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.stride = stride
        self.pad = cout - cin  # extra channels of the shortcut, filled with zeros

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        """Option A: subsample by ``stride`` and zero-pad the new channels (no parameters)."""
        if self.stride > 1:
            x = x[:, :, ::self.stride, ::self.stride]
        if self.pad:
            x = F.pad(x, (0, 0, 0, 0, 0, self.pad))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """CIFAR-style ResNet-20 (He, Zhang, Ren, Sun 2016, "Deep Residual Learning", §4.2).

    A 3x3 conv (16 channels), then 3 stages of 3 basic blocks with 16, 32 and 64 channels (stride 2 at
    the first block of stages 2 and 3), global average pooling and a linear head: 6*3 + 2 = 20 weighted
    layers. Shortcuts are **option A** — identity, strided subsampling and zero-padded channels — so they
    add no parameters, as in the paper's CIFAR experiments. Every conv is followed by BatchNorm (convs
    carry no bias). Convs use He (Kaiming) normal initialisation, BatchNorm starts at scale 1 / shift 0,
    the head uses PyTorch's default.

    Parameters for 10 classes: 269,722 on CIFAR input (3, 32, 32) and 269,434 on one-channel input
    (MNIST, digits); the image size does not change the count. Any image of at least 1x1 works: each
    stride-2 stage maps a side ``s`` to ``ceil(s / 2)``.

    Under DDP, BatchNorm uses each worker's own batch statistics; the running statistics (buffers) are
    broadcast from rank 0 at every forward by default, so workers stay in step.

    ``image_shape`` is ``(C, H, W)`` or ``(H, W)``; ``features`` must equal ``C*H*W`` (inputs arrive
    flattened). ``blocks`` (default 3) basic blocks per stage give ResNet-(6*blocks+2).
    """

    def __init__(self, features: int, classes: int, image_shape: Shape = (3, 32, 32), blocks: int = 3) -> None:
        super().__init__()
        self.chw = image_chw(image_shape, features)
        self.conv = nn.Conv2d(self.chw[0], 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers: list[nn.Module] = []
        cin = 16
        for stage, cout in enumerate((16, 32, 64)):
            for b in range(blocks):
                layers.append(_BasicBlock(cin, cout, stride=2 if (stage > 0 and b == 0) else 1))
                cin = cout
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(64, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.chw)
        x = F.relu(self.bn(self.conv(x)))
        x = self.blocks(x)
        return self.head(x.mean(dim=(2, 3)))


def _resnet20(features: int, classes: int, image_shape: Shape) -> nn.Module:
    return ResNet20(features, classes, image_shape)


# --------------------------------------------------------------------------------------------------
# VGG-style, dominated by fully connected layers


def _pooled(side: int) -> int:
    """Side after a 2x2 max-pool with ``ceil_mode=True``: ``ceil(side / 2)``."""
    return (side + 1) // 2


def _vgg(features: int, classes: int, image_shape: Shape) -> nn.Module:
    """VGG-style network whose parameters sit mostly in large fully connected layers.

    ``conv3x3(32)-conv3x3(32)-maxpool2-conv3x3(64)-conv3x3(64)-maxpool2`` (ReLU, 'same' padding, max-pools
    with ``ceil_mode`` so any size >= 1x1 works), flatten, then ``FC 1024 - FC 1024 - classes`` with ReLU,
    no dropout and no BatchNorm. Like AlexNet/VGG in the QSGD and TernGrad experiments, the communication
    is dominated by the FC matrices, which is where gradient quantization matters most.

    Parameter counts for 10 classes (conv / FC / total):

    * MNIST (1, 28, 28): 64,992 / 4,272,138 / 4,337,130 — 98.5% in FC layers
    * digits (1, 8, 8): 64,992 / 1,323,018 / 1,388,010 — 95.3% in FC layers
    * CIFAR (3, 32, 32): 65,568 / 5,255,178 / 5,320,746 — 98.8% in FC layers
    """
    c, h, w = image_chw(image_shape, features)
    conv = nn.Sequential(
        nn.Unflatten(1, (c, h, w)),
        nn.Conv2d(c, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2, ceil_mode=True),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2, ceil_mode=True),
        nn.Flatten())
    n = 64 * _pooled(_pooled(h)) * _pooled(_pooled(w))
    return nn.Sequential(conv, nn.Linear(n, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, classes))


#: name -> builder ``(features, classes, image_shape) -> nn.Module``
MODELS: dict[str, Callable[[int, int, Shape], nn.Module]] = {
    "mlp": _mlp, "mlp-wide": _mlp_wide, "logreg": _logreg, "lenet": _lenet, "resnet20": _resnet20, "vgg": _vgg}


def build_model(name: str, features: int, classes: int, image_shape: Shape = (8, 8), seed: int = 0) -> nn.Module:
    """Build one of :data:`MODELS` with parameters initialised from ``seed``.

    ``name``: ``logreg``, ``mlp``, ``mlp-wide``, ``lenet``, ``resnet20`` or ``vgg``. ``features``: flattened input size
    ``C*H*W``. ``classes``: number of logits. ``image_shape`` (default ``(8, 8)``, the digits images):
    ``(C, H, W)`` or ``(H, W)``; used by the convolutional models only. ``seed`` (default 0): passed to
    ``torch.manual_seed`` before building, so equal arguments give equal parameters.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    torch.manual_seed(seed)
    return MODELS[name](features, classes, image_shape)
