"""Experiment helpers on top of the library: data sets, small models, gradient studies."""

from .data import load_dataset
from .gradients import compare_quantizers, model_gradients
from .models import build_model

__all__ = ["load_dataset", "build_model", "model_gradients", "compare_quantizers"]
