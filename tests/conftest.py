"""Suite-wide pytest configuration: the hypothesis settings profile and the ``--full`` tier.

**``--full``.** Some grids run kernels under Triton's interpreter, which executes every operation of
every program in Python (a launch of one small program costs 50–80 ms). Their cases beyond a covering
set (each kernel, each code path, each edge case at least once) carry the ``full`` mark and run only
with ``pytest --full`` or ``GRADQ_FULL_TESTS=1``; the default suite stays within its time on two
cores. :func:`gradq_testing.grid` builds such parameter lists.

**Order, and the numba cache.** The tests of Triton's interpreter (``tests/kernels/test_triton_*.py``)
run first, the Elias and compile tests last among them. They are single-threaded Python. When the
run is large (the whole suite) and numba's cache holds no gradq kernels yet (a fresh clone in CI, or
an edited kernel file), a background ``gradq compile`` (:mod:`gradq.precompile`) compiles every
scheme's CPU kernels on the other core meanwhile. The tests after them then load those kernels
instead of compiling them one test at a time, and ranks started together no longer each compile the
same ones. ``GRADQ_TEST_PRECOMPILE=0`` turns that off.

One profile, "gradq", is registered and loaded for the whole suite. Another registered profile can be
chosen with the environment variable GRADQ_HYPOTHESIS_PROFILE (for example hypothesis's built-in
"default" or "ci"), or with hypothesis's own ``--hypothesis-profile`` option, which its pytest plugin
applies after this file is imported and so wins over both.

Tests keep their own ``max_examples`` and ``suppress_health_check`` in ``@settings``; they must not
set ``deadline``: an explicit value in ``@settings`` overrides the profile.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

PROFILE = "gradq"

settings.register_profile(
    PROFILE,
    # No per-example deadline. The suite runs on shared machines and under pytest-xdist with one
    # worker per core, next to other jobs; a single example then takes whatever the scheduler gives
    # it (test_elias.py::test_corrupted_streams[gamma] measured 7.8 s against a 2 s deadline with 14
    # workers on 16 cores), and numba compiles a kernel on its first call inside whichever example
    # reaches it first. A deadline measures the machine's load, not the code; a real hang is the
    # job of a suite-level timeout, and slowness is what benchmarks/ is for.
    deadline=None,
    # too_slow fires when *generating* the inputs is slow relative to the run, which under load is the
    # same wall-clock artefact as above, not a property of the strategies (they are small: lists of
    # at most a few hundred integers, short byte strings). The other health checks stay on. A test
    # that lists suppress_health_check itself replaces this list for that test (hypothesis does not
    # merge the two), so the tests that suppress too_slow keep saying so.
    suppress_health_check=[HealthCheck.too_slow],
)

settings.load_profile(os.environ.get("GRADQ_HYPOTHESIS_PROFILE", PROFILE))


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the exhaustive cases marked 'full' (or set GRADQ_FULL_TESTS=1)")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: an exhaustive case beyond the covering set; runs with --full")


def _full(config) -> bool:
    return bool(config.getoption("--full")) or os.environ.get("GRADQ_FULL_TESTS", "").strip() == "1"


def _interpreted(item) -> bool:
    """A test of Triton's interpreter (single-threaded Python: the background compile's time)."""
    path = Path(str(item.fspath))
    return path.parent.name == "kernels" and path.name.startswith("test_triton_")


#: the interpreter test files that run last among them: the Elias tests compare with the CPU codec,
#: whose numba kernels the background compile has built by then (it takes that spec second); the
#: sm_90 compile test runs two compiling processes, which would share the cores with the background
#: compile if they ran first
_INTERPRETED_LAST = ("test_triton_elias.py", "test_triton_compile.py")
#: the background compile's order: the specs the early tests need first
_PRECOMPILE_FIRST = ("qsgd:bits=4", "qsgd:bits=4,coding=elias")


def _order(item) -> tuple[int, int]:
    """Interpreter tests first, those of :data:`_INTERPRETED_LAST` last among them; then the rest."""
    if not _interpreted(item):
        return (2, 0)
    name = Path(str(item.fspath)).name
    return (1, _INTERPRETED_LAST.index(name)) if name in _INTERPRETED_LAST else (0, 0)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_order)  # stable: the files keep their order within each group
    if _full(config):
        return
    skip = pytest.mark.skip(reason="exhaustive case: run with --full (or GRADQ_FULL_TESTS=1)")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def full_tests(request) -> bool:
    """True when the exhaustive tier runs (``--full``): tests that loop over cases use it to choose."""
    return _full(request.config)


#: a run of at least this many tests starts the background compile on a cold cache
_PRECOMPILE_MIN_TESTS = 500
_background: list[subprocess.Popen] = []


def _cold_numba_cache() -> bool:
    """Whether the CPU kernels would be compiled here: numba is the CPU backend and its cache for
    this version of the kernel sources holds nothing yet."""
    import torch

    from gradq.kernels import backend_for
    from gradq.kernels.numba_cache import cache_dir

    return backend_for(torch.zeros(1)) == "numba" and not any(Path(cache_dir()).rglob("*.nbi"))


def pytest_collection_finish(session):
    if (os.environ.get("GRADQ_TEST_PRECOMPILE", "1").strip() == "0" or os.environ.get("PYTEST_XDIST_WORKER")
            or len(session.items) < _PRECOMPILE_MIN_TESTS or not _cold_numba_cache()):
        return
    from gradq.precompile import SPECS

    order = [*_PRECOMPILE_FIRST, *(s for s in SPECS if s not in _PRECOMPILE_FIRST)]
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    args = [a for spec in order for a in ("-c", spec)]
    _background.append(subprocess.Popen([sys.executable, "-m", "gradq.cli", "compile", *args], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def pytest_sessionfinish(session, exitstatus):
    for p in _background:  # a short or interrupted run: what compiled so far stays in the cache
        if p.poll() is None:
            p.kill()
        p.wait()
