"""Building quantizers from spec strings: the layer above the quantizer families and the wrappers.

:mod:`gradq.spec` holds the grammar (``name:key=value,...``, ``ef(...)``), the parameter types and the
registry that the families fill when they are imported; it imports none of them. This module imports
every family and wrapper (so that the registry is complete) and builds from the registry, so no
module below it needs a function-level import to reach :func:`build`.
"""

from __future__ import annotations

from typing import Any

from . import quantizers  # noqa: F401  (registers every family)
from . import transforms  # noqa: F401  (registers the ef(...) wrapper)
from .quantizers.base import Quantizer
from .spec import available, make, registry

__all__ = ["build", "available", "registry"]


def build(spec: Any) -> Quantizer:
    """Build a quantizer from a spec string (a quantizer instance is returned unchanged).

    ``ef=1`` on any scheme, or ``ef(...)`` around it, wraps it in error feedback; schemes with
    ``default_ef`` (1BitSGD) get it unless ``ef=0``.

    >>> q = build("qsgd:bits=4,bucket=512,norm=max")
    >>> str(q)
    'qsgd:bits=4,bucket=512,norm=max'
    """
    if isinstance(spec, Quantizer):
        return spec
    return make(spec)
