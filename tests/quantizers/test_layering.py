"""The quantizers are pure math over the kernel primitives: no module of ``gradq.quantizers`` picks
code by device. ``gradq.kernels.backend_for`` is the one place that does; a quantizer that tested
``t.device.type`` (or ``is_cuda``, or the backend) itself would make a second dispatch point that the
kernels' switch (``GRADQ_KERNELS``) and their tests do not see."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gradq.quantizers

PACKAGE = Path(gradq.quantizers.__file__).parent


def device_tests(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each device test in ``source``: ``….device.type``, ``….is_cuda``,
    ``….is_cpu``, ``torch.cuda``, and any use of ``backend_for`` or ``get_backend``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if node.attr == "type" and isinstance(node.value, ast.Attribute) and node.value.attr == "device":
                found.append((node.lineno, "device.type"))
            elif node.attr in ("is_cuda", "is_cpu", "backend_for", "get_backend"):
                found.append((node.lineno, node.attr))
            elif node.attr == "cuda" and isinstance(node.value, ast.Name) and node.value.id == "torch":
                found.append((node.lineno, "torch.cuda"))
        elif isinstance(node, ast.Name) and node.id in ("backend_for", "get_backend"):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.alias) and node.name in ("backend_for", "get_backend"):
            found.append((getattr(node, "lineno", 0), node.name))
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_no_quantizer_module_tests_the_device(path):
    assert device_tests(path.read_text()) == [], (
        f"{path.name} picks code by device; move the choice into a primitive of gradq.kernels")


def test_the_scan_finds_each_kind_of_device_test():
    """The scan itself, on code with each pattern (so that the test above cannot pass by finding nothing)."""
    src = """
import torch
from gradq.kernels import backend_for
def f(v, out, kernels):
    a = v.device.type == "cpu"
    b = out.is_cuda
    c = kernels.backend_for(v) != "triton"
    d = torch.cuda.is_available()
    e = kernels.get_backend()
    g = v.device                      # passing the device on is fine
    return v.to(g)
"""
    kinds = [what for _, what in device_tests(src)]
    assert sorted(kinds) == sorted(["backend_for", "device.type", "is_cuda", "backend_for", "torch.cuda",
                                    "get_backend"])
