"""The numba kernels compile into a cache directory keyed by a hash of all their sources; the numba
codecs into one keyed by theirs."""

from __future__ import annotations

import os

import pytest

from gradq import kernels
from gradq.kernels import numba_cache


def test_hash_follows_every_source(tmp_path):
    files = []
    for name in numba_cache.SOURCES:
        p = tmp_path / name
        p.write_text(f"# {name}\n")
        files.append(str(p))
    before = numba_cache.source_hash(files)
    assert numba_cache.source_hash(files) == before
    (tmp_path / numba_cache.SOURCES[-1]).write_text("# an edit of a helper module\n")
    assert numba_cache.source_hash(files) != before


def test_cache_dir_settings():
    h = numba_cache.source_hash()
    assert numba_cache.cache_dir({"GRADQ_NUMBA_CACHE": "/a"}) == os.path.join("/a", h)
    assert numba_cache.cache_dir({"NUMBA_CACHE_DIR": "/b"}) == os.path.join("/b", "gradq", h)
    assert numba_cache.cache_dir({"XDG_CACHE_HOME": "/c"}) == os.path.join("/c", "gradq", "numba", h)
    c = numba_cache.source_hash(group="codecs")
    assert c != h
    assert numba_cache.cache_dir({"GRADQ_NUMBA_CACHE": "/a"}, group="codecs") == os.path.join("/a", f"codecs-{c}")


def test_kernel_hash_covers_every_numba_kernel_module():
    """Every module of gradq.kernels that compiles cached numba functions is in the kernels' hash
    (the cached functions inline helpers across these modules, so one left out could load stale
    code after a split or an edit)."""
    folder = os.path.dirname(numba_cache.__file__)
    jitted = sorted(name for name in os.listdir(folder) if name.endswith(".py") and name != "numba_cache.py"
                    and "cache=True" in open(os.path.join(folder, name)).read())
    assert "cpu_sort.py" in jitted and set(jitted) <= set(numba_cache.SOURCES)


def test_codec_hash_covers_every_numba_codec_module():
    """Every module of gradq.codecs that compiles numba functions is in the codecs' hash (a module
    left out could load stale code after an edit of a helper it inlines)."""
    import gradq.codecs

    folder = os.path.dirname(gradq.codecs.__file__)
    jitted = sorted(name for name in os.listdir(folder) if name.endswith(".py")
                    and any(k in open(os.path.join(folder, name)).read() for k in ("@_jit", "@_pjit", "@_inline")))
    assert jitted and sorted(numba_cache.CODEC_SOURCES) == jitted


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
def test_kernels_use_the_keyed_directory():
    from numba.core import config

    from gradq.kernels import binary, cpu, levels

    binary._cpu()
    levels._mod()
    from gradq.kernels import cpu_binary, cpu_levels

    want = numba_cache.cache_dir()
    for fn in (cpu.maxabs_scales, cpu_levels.run, cpu_binary.binary_encode):
        assert fn._cache._cache_path.startswith(want), fn
    assert config.CACHE_DIR != want   # numba's own setting is restored for other code


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
def test_codecs_use_their_keyed_directory():
    from numba.core import config

    from gradq.codecs import elias, qsgd_chunks, qsgd_chunks_read, qsgd_fields, qsgd_stream

    want = numba_cache.cache_dir(group="codecs")
    for fn in (elias.read_omega, qsgd_fields.read_sparse, qsgd_stream._write_dense, qsgd_chunks._chunk_bodies,
               qsgd_chunks_read._read_chunks):
        assert fn._cache._cache_path.startswith(want), fn
    assert config.CACHE_DIR != want


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
def test_the_first_compile_of_a_gradq_function_is_noted_once(monkeypatch, caplog):
    """numba's compile events (a cache hit loads without one): the first compile of a gradq function
    in a process logs one note, naming the cache and ``gradq compile``; numba's own functions, later
    compiles and compiles inside ``quiet_compiles()`` (``gradq compile``'s) log nothing."""
    import logging
    from types import SimpleNamespace

    from numba.core import event

    numba_cache._listen_for_compiles()
    monkeypatch.setattr(numba_cache, "_NOTED", False)

    def compile_of(module: str) -> None:
        fn = SimpleNamespace(__module__=module, __name__="f")
        data = {"dispatcher": SimpleNamespace(py_func=fn)}
        event.start_event("numba:compile", data=data)
        event.end_event("numba:compile", data=data)

    with caplog.at_level(logging.WARNING, logger="gradq.kernels.numba_cache"):
        compile_of("numba.np.arrayobj")
        with numba_cache.quiet_compiles():
            compile_of("gradq.kernels.cpu")
        assert caplog.records == []
        compile_of("gradq.kernels.cpu")
        compile_of("gradq.codecs.elias")
    (note,) = [r.getMessage() for r in caplog.records]
    assert os.path.dirname(numba_cache.cache_dir()) in note and "gradq compile" in note


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
def test_a_cold_cache_says_so_and_a_warm_one_does_not(tmp_path):
    """For real, in fresh processes: a gradq function compiled into an empty cache draws the note on
    stderr; the next process loads it from the cache and says nothing."""
    import subprocess
    import sys

    env = dict(os.environ, GRADQ_NUMBA_CACHE=str(tmp_path))
    code = "from gradq.codecs import elias; assert elias.bitlen(5) == 3"
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    assert "numba is compiling gradq's CPU kernels" in runs[0].stderr and str(tmp_path) in runs[0].stderr
    assert "compiling" not in runs[1].stderr


# -- one process of a machine compiles ---------------------------------------------------------------------
def test_the_compile_lock_is_reentrant_exclusive_and_gives_up_after_its_timeout(tmp_path, caplog):
    import fcntl
    import logging

    folder = str(tmp_path / "cache")
    lock_file = os.path.join(folder, ".compile.lock")

    def free() -> bool:   # another open file description: what another process would see
        fd = os.open(lock_file, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    with numba_cache.compile_lock(folder) as held:
        assert held and not free()
        with numba_cache.compile_lock(folder) as again:   # a kernel's compile inside another's
            assert again and not free()
        assert not free()
        with caplog.at_level(logging.WARNING, logger="gradq.kernels.numba_cache"):
            assert numba_cache._acquire(folder, timeout=0.1) is None   # as another process would wait
        (msg,) = [r.getMessage() for r in caplog.records]
        assert "compiling here instead" in msg and folder in msg
    assert free()
    # a folder that cannot be made: no lock, and no error (each process compiles on its own)
    (tmp_path / "file").write_text("")
    with numba_cache.compile_lock(str(tmp_path / "file" / "cache")) as held:
        assert not held


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
def test_gradq_dispatchers_look_in_the_cache_before_they_lock():
    from gradq.codecs import elias
    from gradq.kernels import binary, cpu

    binary._cpu()
    from gradq.kernels import cpu_binary

    assert vars(elias.bitlen)["_gradq_compile"] == numba_cache.cache_dir(group="codecs")
    for fn in (cpu.maxabs_scales, cpu_binary.binary_encode):
        assert vars(fn)["_gradq_compile"] == numba_cache.cache_dir(), fn
    import numba

    @numba.njit
    def not_ours(x):
        return x

    assert numba_cache._one_compiles(not_ours, "/nowhere") is not_ours and "_gradq_compile" not in vars(not_ours)


CHILD = r'''
import os, sys, time
from numba.core import event
from gradq.codecs import elias   # (registers gradq's listener, which stops a look in the cache that missed)
from gradq.kernels import numba_cache as nc

role, ready, go = sys.argv[1:4]
nc.LOCK_TIMEOUT = float(os.environ.get("LOCK_TIMEOUT", nc.LOCK_TIMEOUT))
compiled = []

class Count(event.Listener):   # notified after gradq's listener: only compiles that go ahead
    def on_start(self, ev):
        fn = getattr(ev.data.get("dispatcher"), "py_func", None)
        if str(getattr(fn, "__module__", "")).startswith("gradq."):
            compiled.append(fn.__name__)
    def on_end(self, ev):
        pass

event.register("numba:compile", Count())

if role == "holder":     # holds the machine's lock until told to go, then compiles under it
    with nc.compile_lock(nc.cache_dir(group="codecs")) as held:
        assert held
        open(ready, "w").close()
        while not os.path.exists(go):
            time.sleep(0.02)
        assert elias.bitlen(5) == 3
else:
    print("calling", flush=True)
    assert elias.bitlen(5) == 3
print("compiled", len(compiled), flush=True)
'''


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
def test_ranks_on_an_empty_cache_compile_once_and_load_without_the_lock(tmp_path):
    """For real, in processes on one empty cache: while one holds the lock (compiling, in effect), a
    second that needs the same kernel waits for it and then loads what it compiled, compiling
    nothing; a third that gives up waiting (a timeout of 0.5 s) compiles on its own, which is what
    the second would have done without the lock. Then, with the lock held by this test, a process
    on the warm cache loads without waiting for it."""
    import subprocess
    import sys
    import time

    env = dict(os.environ, GRADQ_NUMBA_CACHE=str(tmp_path / "cache"))
    env.pop("GRADQ_COMPILE_LOCK", None)
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")

    def finish(proc: subprocess.Popen) -> tuple[int, str]:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        return int(out.split("compiled")[-1]), err

    procs: list[subprocess.Popen] = []

    def start(role: str, **extra: str) -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, role, ready, go], env={**env, **extra},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return procs[-1]

    try:
        holder = start("holder")
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            assert holder.poll() is None and time.monotonic() < deadline, holder.communicate()[1][-3000:]
            time.sleep(0.05)
        waiter, impatient = start("waiter"), start("impatient", LOCK_TIMEOUT="0.5")
        assert waiter.stdout.readline().startswith("calling")
        assert impatient.stdout.readline().startswith("calling")
        n_impatient, err = finish(impatient)          # it compiled while the lock was held
        assert n_impatient >= 1 and "compiling here instead" in err
        time.sleep(0.5)                               # (the waiter is waiting by now)
        open(go, "w").close()
        finish(holder)
        n_waiter, err = finish(waiter)
        assert n_waiter == 0 and "compiling here instead" not in err and "numba is compiling" not in err

        folder = os.path.join(env["GRADQ_NUMBA_CACHE"], os.path.basename(numba_cache.cache_dir(group="codecs")))
        with numba_cache.compile_lock(folder) as held:
            assert held
            warm = start("warm", LOCK_TIMEOUT="0.5")
            n_warm, err = finish(warm)
        assert n_warm == 0 and "compiling here instead" not in err
    finally:   # (a failed assertion must not leave a holder waiting for its go)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
