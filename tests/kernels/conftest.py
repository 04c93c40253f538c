"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from gradq import kernels


@pytest.fixture
def triton_backend():
    """The Triton backend for every tensor (CPU tensors run under Triton's interpreter) during the test."""
    was = kernels.get_backend()
    kernels.set_backend("triton")
    yield
    kernels.set_backend(was)
