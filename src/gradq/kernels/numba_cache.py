"""Where the numba kernels and codecs keep their compiled code: a directory keyed by a hash of their sources.

numba's on-disk cache (``cache=True``) checks only the timestamp and size of the file that defines a
kernel, not of the helpers it inlines from other modules. After an edit of :mod:`gradq.kernels.cpu`,
a kernel of :mod:`gradq.kernels.cpu_levels` that inlines its helpers could therefore load stale
machine code. Here every kernel module is compiled under ``<base>/<hash>``, where the hash covers
the sources of all of them, so any edit of any kernel file starts a fresh cache. The numba codecs of
:mod:`gradq.codecs` (Elias streams) are a second group, under ``<base>/codecs-<hash>`` with a hash
of their own sources (:func:`keyed_njit`), so that an edit of one group leaves the other compiled.

``<base>`` is ``$GRADQ_NUMBA_CACHE`` if set, else ``$NUMBA_CACHE_DIR/gradq`` if that is set, else
``$XDG_CACHE_HOME/gradq/numba`` (``~/.cache/gradq/numba``). numba's own setting is changed only while
gradq's kernel modules are imported, or a codec function decorated, so other numba code in the
process keeps its cache."""

from __future__ import annotations

import hashlib
import logging
import os
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Callable, Iterator, Optional

__all__ = ["SOURCES", "CODEC_SOURCES", "source_hash", "cache_dir", "keyed_cache", "keyed_njit"]

#: the modules whose jitted functions are cached (they inline each other's helpers)
SOURCES = ("numba_common.py", "numba_pack.py", "cpu.py", "cpu_index.py", "cpu_sort.py", "cpu_sort_lanes.py",
           "cpu_orq_rows.py", "cpu_orq_lanes.py", "cpu_levels.py", "cpu_binary.py", "cpu_pb.py", "cpu_multiscale.py",
           "cpu_subset.py")
#: the same for the numba codecs in gradq/codecs
CODEC_SOURCES = ("elias.py", "qsgd_fields.py", "qsgd_stream.py", "qsgd_chunks.py", "qsgd_chunks_read.py")
_HERE = os.path.dirname(os.path.abspath(__file__))
_GROUPS = {"kernels": (_HERE, SOURCES),
           "codecs": (os.path.join(os.path.dirname(_HERE), "codecs"), CODEC_SOURCES)}


def source_hash(files: Optional[list[str]] = None, group: str = "kernels") -> str:
    """SHA-256 (first 16 hex digits) of the sources of ``group`` (or of ``files``), in order."""
    if files is None:
        return _group_hash(group)
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


@lru_cache(maxsize=None)
def _group_hash(group: str) -> str:
    """:func:`source_hash` of a group's files, read once per process (every codec function asks)."""
    folder, names = _GROUPS[group]
    return source_hash([os.path.join(folder, f) for f in names])


def cache_dir(env: Optional[dict] = None, group: str = "kernels") -> str:
    """The directory the kernels (or ``group="codecs"``) compile into (see the module docstring)."""
    env = os.environ if env is None else env
    base = env.get("GRADQ_NUMBA_CACHE", "").strip()
    if not base:
        numba_dir = env.get("NUMBA_CACHE_DIR", "").strip()
        if numba_dir:
            base = os.path.join(numba_dir, "gradq")
        else:
            xdg = env.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
            base = os.path.join(xdg, "gradq", "numba")
    key = source_hash(group=group)
    return os.path.join(base, key if group == "kernels" else f"{group}-{key}")


logger = logging.getLogger(__name__)

_LISTENING = False   # the compile listener is registered with numba
_NOTED = False       # this process said that it compiles
_QUIET = 0           # > 0 inside quiet_compiles()


def _note_first_compile() -> None:
    global _NOTED
    if _NOTED or _QUIET:
        return
    _NOTED = True
    logger.warning("gradq: numba is compiling gradq's CPU kernels (once per machine and gradq version, about "
                   "10-30 s a scheme: only the first steps are slow). They are kept in %s. To compile them "
                   "before a launch, run `gradq compile` (every scheme) or `gradq compile -c SPEC`.",
                   os.path.dirname(cache_dir()))


def _listen_for_compiles() -> None:
    """Register (once) a numba event listener that notes the first compile of a gradq function in this
    process: a cache that already holds the kernels loads them without a compile event, and says nothing."""
    global _LISTENING
    if _LISTENING:
        return
    _LISTENING = True
    try:
        from numba.core import event
    except ImportError:   # (a numba without the event API: no note)
        return

    class FirstCompile(event.Listener):
        def on_start(self, ev: Any) -> None:
            try:
                fn = getattr((ev.data or {}).get("dispatcher"), "py_func", None)
                if str(getattr(fn, "__module__", "")).startswith("gradq."):
                    _note_first_compile()
            except Exception:   # noqa: BLE001 — a note must never break a compile
                pass

        def on_end(self, ev: Any) -> None:
            pass

    event.register("numba:compile", FirstCompile())


@contextmanager
def quiet_compiles() -> Iterator[None]:
    """No note of compiles inside (``gradq compile`` shows its own progress)."""
    global _QUIET
    _QUIET += 1
    try:
        yield
    finally:
        _QUIET -= 1


@contextmanager
def keyed_cache(group: str = "kernels") -> Iterator[str]:
    """Point numba's cache at :func:`cache_dir` while the kernel modules are imported (numba picks
    a function's cache location when it is decorated)."""
    from numba.core import config

    _listen_for_compiles()
    path = cache_dir(group=group)
    old = config.CACHE_DIR
    config.CACHE_DIR = path
    try:
        yield path
    finally:
        config.CACHE_DIR = old


def keyed_njit(group: str, **options: Any) -> Callable[[Callable], Callable]:
    """A decorator: ``numba.njit(cache=True, **options)``, cached in ``group``'s keyed directory
    (the codecs decorate their functions with it)."""
    import numba

    def decorate(fn: Callable) -> Callable:
        with keyed_cache(group):
            return numba.njit(cache=True, **options)(fn)

    return decorate
