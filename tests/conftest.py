"""Suite-wide pytest configuration: the hypothesis settings profile.

One profile, "gradq", is registered and loaded for the whole suite. Another registered profile can be
chosen with the environment variable GRADQ_HYPOTHESIS_PROFILE (for example hypothesis's built-in
"default" or "ci"), or with hypothesis's own ``--hypothesis-profile`` option, which its pytest plugin
applies after this file is imported and so wins over both.

Tests keep their own ``max_examples`` and ``suppress_health_check`` in ``@settings``; they must not
set ``deadline``: an explicit value in ``@settings`` overrides the profile.
"""

import os

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
