"""A process's life around ``torch.distributed``: start-up order, teardown in order, gradq's threads.

Why this module exists (measured with torch 2.13 and CPython 3.11 on gloo): worker processes that ran
DDP sometimes died at exit with ``terminate called without an active exception`` (SIGABRT, exit -6),
after their last line of Python had run. Two facts combine:

1. **A gloo worker thread that touches Python during interpreter finalization aborts the process.**
   Gloo runs every collective on its own C++ threads (``pt_gloo_runloop``); when such a thread drops
   the last reference to a finished operation whose tensors are owned by Python objects, it takes the
   GIL. During finalization CPython ends any thread that asks for the GIL with ``pthread_exit``; the
   forced unwind runs through a C++ destructor and ``std::terminate`` is called. Whether that happens
   is a race between the thread's release and the main thread's exit: a few percent of exits.
2. **Those threads were still alive at exit, because the process group outlived its destruction.**
   Importing ``torch._dynamo`` *after* ``init_process_group`` makes the default group survive
   ``destroy_process_group`` (its worker threads keep running until the process ends), and
   ``DistributedDataParallel``'s constructor imports it. With ``torch._dynamo`` imported *before* the
   group is created, ``destroy_process_group`` destroys the group and joins its threads (both measured:
   three gloo threads left after destroy in the first case, none in the second).

So the fix is an order, not a retry: :func:`before_init` imports ``torch._dynamo`` before a group
exists (``import gradq`` does it itself when a launcher has set ``RANK``/``WORLD_SIZE``), and
:func:`teardown` stops gradq's own threads, collects garbage and destroys the group while the
interpreter is fully alive, after which no gloo thread is left to race with the exit.
:func:`native_threads` lists a process's threads by name, which is how the tests check it.

**At exit, for scripts that never tear down.** Frameworks leave a gloo group alive at exit: Lightning
destroys its group at exit only on NCCL, and Accelerate and the Transformers Trainer not at all, and
their trainer objects (which hold the DDP model, which holds the group) live on in reference cycles
after ``fit`` returns. Such a process can abort at exit like the above (measured: the Lightning example
under torchrun, once in a CI run). So importing gradq also registers :func:`_exit_teardown` with
:mod:`atexit`: once the script has ended normally and Python has joined its threads, it runs
:func:`teardown` when the default group is still initialized and uses gloo. An exit by an uncaught
exception is left alone (a gloo thread may be blocked in a collective its peers never join, and
joining it would hang the exit for the group's timeout). Turn it off with :func:`exit_teardown`
``(False)`` or ``GRADQ_EXIT_TEARDOWN=0``, e.g. when an ``atexit`` handler of your own, registered
before gradq was imported, still uses the group.

gradq's own threads: the scatter protocol's communication lane (``gradq-comm``) is stopped and joined
by :func:`stop_threads`, which also runs automatically before interpreter shutdown (registered with
``threading``'s pre-shutdown hooks, the mechanism ``concurrent.futures`` uses); the ORQ/Linear kernels'
pool (``gradq-levels``) is a ``concurrent.futures`` pool that Python joins at exit itself.
"""

from __future__ import annotations

import atexit
import gc
import os
import threading
from collections import Counter
from typing import Any, Callable

__all__ = ["before_init", "teardown", "stop_threads", "native_threads", "GLOO_THREADS", "on_stop",
           "exit_teardown"]

#: names of the native threads a gloo process group runs (its work loop and its TCP event loop)
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")

_STOPPERS: list[Callable[[], None]] = []
_LOCK = threading.Lock()
_EXIT_TEARDOWN = os.environ.get("GRADQ_EXIT_TEARDOWN", "1").strip().lower() not in ("0", "false", "no", "off")


def before_init() -> None:
    """Import what must be loaded before ``init_process_group`` (``torch._dynamo``; see the module
    docstring). Idempotent; costs about one second once per process, which DDP would spend anyway."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # an exotic build without dynamo has nothing to leak the group either
        pass


def on_stop(fn: Callable[[], None]) -> None:
    """Register ``fn`` to be called by :func:`stop_threads` (gradq's components that own threads)."""
    with _LOCK:
        _STOPPERS.append(fn)


def stop_threads() -> None:
    """Stop and join the threads gradq started (idempotent; they restart on demand)."""
    with _LOCK:
        stoppers = list(_STOPPERS)
    for fn in stoppers:
        fn()


def teardown(*, destroy: bool = True) -> None:
    """Tear a worker down in order while the interpreter is alive: gradq's threads, then garbage
    (DDP models and hook states that hold the group), then the default process group.

    Call it after the last collective, with the models and states out of scope (or deleted).
    ``destroy=False`` stops threads and collects garbage but leaves the group to its owner."""
    import torch.distributed as dist

    stop_threads()
    gc.collect()
    if destroy and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


def native_threads() -> Counter:
    """This process's threads by name (Linux ``/proc/self/task``; an empty Counter elsewhere)."""
    names: Counter = Counter()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return names
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:  # the thread ended meanwhile
            continue
    return names


def gloo_threads() -> int:
    """How many gloo threads (:data:`GLOO_THREADS`) this process runs now."""
    live = native_threads()
    return sum(live[n] for n in GLOO_THREADS)


def _register_pre_shutdown(fn: Callable[[], Any]) -> None:
    # threading._register_atexit runs before Python joins non-daemon threads and finalizes; it is what
    # concurrent.futures uses. Fall back to atexit where it is missing.
    reg = getattr(threading, "_register_atexit", None)
    if reg is not None:
        try:
            reg(fn)
            return
        except RuntimeError:  # already shutting down
            return
    atexit.register(fn)


def exit_teardown(enabled: bool) -> None:
    """Turn the teardown at exit on or off for this process (on by default; see the module
    docstring). ``GRADQ_EXIT_TEARDOWN=0`` in the environment turns it off from the start."""
    global _EXIT_TEARDOWN
    _EXIT_TEARDOWN = bool(enabled)


def _gloo_group_alive() -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        backend = str(dist.get_backend())
    except Exception:  # a group in a state we cannot read: leave it to its owner
        return False
    return "gloo" in backend.lower()


def _exit_teardown() -> None:
    """:mod:`atexit` handler: :func:`teardown` a gloo default group the script left alive."""
    import sys

    if not _EXIT_TEARDOWN or "torch.distributed" not in sys.modules:
        return
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return   # ended by an uncaught exception: a gloo thread may be blocked in a collective
    try:   # (gradq's own threads were stopped already, by the pre-shutdown hook below)
        if _gloo_group_alive():
            teardown()
    except Exception:  # never turn a clean exit into a failing one
        pass


_register_pre_shutdown(stop_threads)
atexit.register(_exit_teardown)


def _launched_worker() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
