"""Where the numba kernels keep their compiled code: a directory keyed by a hash of their sources.

numba's on-disk cache (``cache=True``) checks only the timestamp and size of the file that defines a
kernel, not of the helpers it inlines from other modules. After an edit of :mod:`gradq.kernels.cpu`,
a kernel of :mod:`gradq.kernels.cpu_levels` that inlines its helpers could therefore load stale
machine code. Here every kernel module is compiled under ``<base>/<hash>``, where the hash covers
the sources of all of them, so any edit of any kernel file starts a fresh cache.

``<base>`` is ``$GRADQ_NUMBA_CACHE`` if set, else ``$NUMBA_CACHE_DIR/gradq`` if that is set, else
``$XDG_CACHE_HOME/gradq/numba`` (``~/.cache/gradq/numba``). numba's own setting is changed only while
gradq's kernel modules are imported, so other numba code in the process keeps its cache.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from typing import Iterator, Optional

__all__ = ["SOURCES", "source_hash", "cache_dir", "keyed_cache"]

#: the modules whose jitted functions are cached (they inline each other's helpers)
SOURCES = ("numba_common.py", "cpu.py", "cpu_levels.py", "cpu_binary.py", "cpu_multiscale.py", "cpu_subset.py")
_HERE = os.path.dirname(os.path.abspath(__file__))


def source_hash(files: Optional[list[str]] = None) -> str:
    """SHA-256 (first 16 hex digits) of the kernel sources, in order."""
    h = hashlib.sha256()
    for path in files if files is not None else [os.path.join(_HERE, f) for f in SOURCES]:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


def cache_dir(env: Optional[dict] = None) -> str:
    """The directory the kernels compile into (see the module docstring)."""
    env = os.environ if env is None else env
    base = env.get("GRADQ_NUMBA_CACHE", "").strip()
    if not base:
        numba_dir = env.get("NUMBA_CACHE_DIR", "").strip()
        if numba_dir:
            base = os.path.join(numba_dir, "gradq")
        else:
            xdg = env.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
            base = os.path.join(xdg, "gradq", "numba")
    return os.path.join(base, source_hash())


@contextmanager
def keyed_cache() -> Iterator[str]:
    """Point numba's cache at :func:`cache_dir` while the kernel modules are imported (numba picks
    a function's cache location when it is decorated)."""
    from numba.core import config

    path = cache_dir()
    old = config.CACHE_DIR
    config.CACHE_DIR = path
    try:
        yield path
    finally:
        config.CACHE_DIR = old
