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
