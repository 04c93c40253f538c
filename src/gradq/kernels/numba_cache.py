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
process keeps its cache.

**One process of a machine compiles a kernel; the others load it.** Ranks started together on an
empty cache (a ``torchrun`` of your own, a fresh CI runner) would each compile the same kernels on the
same cores. Every gradq dispatcher first looks in the cache without a lock; only where that misses
does it take an exclusive lock on a file in the cache directory (``.compile.lock``), look again (another
process may have compiled the kernel meanwhile) and compile only if it must. A cache that holds the
kernels therefore loads them without waiting. ``GRADQ_COMPILE_LOCK=0`` turns the lock off; where the
directory cannot be locked (no ``fcntl``, a read-only folder) each process compiles on its own, as
without it, and a process that waited :data:`LOCK_TIMEOUT` seconds says so and compiles."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Callable, Iterator, Optional

__all__ = ["SOURCES", "CODEC_SOURCES", "source_hash", "cache_dir", "keyed_cache", "keyed_njit", "compile_lock",
           "LOCK_TIMEOUT"]

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
            disp = (ev.data or {}).get("dispatcher") if isinstance(ev.data, dict) else None
            if disp is not None and disp is getattr(_PROBE, "dispatcher", None):
                raise _MustCompile   # (a look in the cache that missed: stop before any work)
            try:
                fn = getattr(disp, "py_func", None)
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
    before = set(sys.modules)
    try:
        yield path
    finally:
        config.CACHE_DIR = old
        for name in set(sys.modules) - before:   # the modules imported here: their dispatchers
            if name.startswith("gradq."):
                for obj in list(getattr(sys.modules.get(name), "__dict__", {}).values()):
                    _one_compiles(obj, path)


def keyed_njit(group: str, **options: Any) -> Callable[[Callable], Callable]:
    """A decorator: ``numba.njit(cache=True, **options)``, cached in ``group``'s keyed directory
    (the codecs decorate their functions with it)."""
    import numba

    def decorate(fn: Callable) -> Callable:
        with keyed_cache(group) as path:
            return _one_compiles(numba.njit(cache=True, **options)(fn), path)

    return decorate


# == one process of a machine compiles ============================================================
#: seconds a process waits for the lock (other processes compiling) before it compiles on its own
LOCK_TIMEOUT = 900.0
_LOCK_NAME = ".compile.lock"


class _MustCompile(Exception):
    """Raised from the compile event of a dispatcher that only looks in its cache."""


_PROBE = threading.local()      # .dispatcher: the one whose compile may only load, in this thread
_MUTEX = threading.RLock()      # this process's threads take the machine's lock one at a time
_HELD: dict[str, int] = {}      # folder -> open descriptor of its lock file, while held


def _lock_wanted() -> bool:
    return os.environ.get("GRADQ_COMPILE_LOCK", "").strip().lower() not in ("0", "off", "false", "no")


@contextmanager
def compile_lock(folder: str, timeout: Optional[float] = None) -> Iterator[bool]:
    """Hold the machine's lock on compiling into ``folder``: an exclusive ``flock`` of
    ``folder/.compile.lock``, re-entrant within a process. Yields whether the lock is held: False
    where the folder cannot be locked, or after ``timeout`` seconds (default :data:`LOCK_TIMEOUT`) of
    waiting, which is logged; the caller then goes on without it."""
    with _MUTEX:
        if folder in _HELD:
            yield True
            return
        fd = _acquire(folder, LOCK_TIMEOUT if timeout is None else timeout)
        if fd is None:
            yield False
            return
        _HELD[folder] = fd
        try:
            yield True
        finally:
            del _HELD[folder]
            os.close(fd)   # (closing the descriptor releases the lock)


def _acquire(folder: str, timeout: float) -> Optional[int]:
    try:
        import fcntl

        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666)
    except (ImportError, OSError):
        return None
    start = time.monotonic()
    pause = 0.02
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() - start >= timeout:
                logger.warning("gradq: waited %.0f s for another process to compile gradq's kernels into %s "
                               "(%s); compiling here instead", timeout, folder, _LOCK_NAME)
                break
            time.sleep(pause)
            pause = min(2 * pause, 0.25)
        except OSError:   # (a file system without flock)
            break
    os.close(fd)
    return None


@lru_cache(maxsize=None)
def _numba_parts() -> Optional[tuple[type, Any]]:
    try:
        from numba.core.compiler_lock import global_compiler_lock
        from numba.core.dispatcher import Dispatcher
    except ImportError:
        return None
    return Dispatcher, global_compiler_lock


def _one_compiles(obj: Any, folder: str) -> Any:
    """Make a gradq dispatcher compile under :func:`compile_lock` after a look in its cache (see the
    module docstring); anything else is returned as it is."""
    parts = _numba_parts()
    if parts is None:
        return obj
    Dispatcher, global_compiler_lock = parts
    if (not isinstance(obj, Dispatcher) or "_gradq_compile" in vars(obj)
            or not str(getattr(obj.py_func, "__module__", "")).startswith("gradq.")):
        return obj
    inner = obj.compile   # numba's own (a bound method)

    def compile(sig: Any) -> Any:
        # inside another compile (a kernel's helpers), numba's lock is held: compile there, as the
        # caller holds the machine's lock already if it needed it (ordering both locks one way)
        if global_compiler_lock.is_locked() or not _lock_wanted():
            return inner(sig)
        _PROBE.dispatcher = obj
        try:
            return inner(sig)     # in memory or in the cache: no lock, no wait
        except _MustCompile:
            pass
        finally:
            _PROBE.dispatcher = None
        with compile_lock(folder):
            return inner(sig)     # loads what another process compiled meanwhile, else compiles

    obj.compile = compile
    obj._gradq_compile = folder
    return obj
