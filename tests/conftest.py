"""Suite-wide pytest configuration: the hypothesis settings profile and the ``--full`` tier.

**``--full``.** Some grids run kernels under Triton's interpreter, which executes every operation of
every program in Python (a launch of one small program costs 50–80 ms). Their cases beyond a covering
set (each kernel, each code path, each edge case at least once) carry the ``full`` mark and run only
with ``pytest --full`` or ``GRADQ_FULL_TESTS=1``; the default suite stays within its time on two
cores. :func:`gradq_testing.grid` builds such parameter lists.

One profile, "gradq", is registered and loaded for the whole suite. Another registered profile can be
chosen with the environment variable GRADQ_HYPOTHESIS_PROFILE (for example hypothesis's built-in
"default" or "ci"), or with hypothesis's own ``--hypothesis-profile`` option, which its pytest plugin
applies after this file is imported and so wins over both.

Tests keep their own ``max_examples`` and ``suppress_health_check`` in ``@settings``; they must not
set ``deadline``: an explicit value in ``@settings`` overrides the profile.
"""

import os

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


def pytest_collection_modifyitems(config, items):
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
