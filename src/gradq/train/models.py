"""Small models for experiments on this machine."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["build_model", "MODELS"]


def _mlp(features: int, classes: int, image_shape) -> nn.Module:
    return nn.Sequential(nn.Linear(features, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, classes))


def _logreg(features: int, classes: int, image_shape) -> nn.Module:
    return nn.Linear(features, classes)


def _lenet(features: int, classes: int, image_shape) -> nn.Module:
    h, w = image_shape
    conv = nn.Sequential(nn.Unflatten(1, (1, h, w)), nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
    with torch.no_grad():
        n = conv(torch.zeros(1, features)).shape[1]
    return nn.Sequential(conv, nn.Linear(n, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, classes))


MODELS = {"mlp": _mlp, "logreg": _logreg, "lenet": _lenet}


def build_model(name: str, features: int, classes: int, image_shape=(8, 8), seed: int = 0) -> nn.Module:
    """Build ``mlp``, ``logreg`` or ``lenet`` with parameters initialised from ``seed``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    torch.manual_seed(seed)
    return MODELS[name](features, classes, image_shape)
