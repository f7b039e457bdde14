"""Shared fixtures: the Hypothesis profile, and ``backend`` over every backend. The
``cacheidx_case`` fixture (every backend, eager and compiled) comes from cacheidx's own pytest
plugin, the one an adapter's author uses, in the modes ``python -m cacheidx.conformance`` runs:
eager, compiled and dynamic (torch's automatic mode across shapes is the one-step law of the
dynamic run; ``--cacheidx-mode automatic`` runs every law in it)."""

from __future__ import annotations

import os

# every tensor here is tiny: one thread a process, so that ranks and workers started by the
# tests never oversubscribe the cores (read by torch when it is first imported, below)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from cacheidx.backends.jax import JaxBackend  # noqa: E402  (the adapter imports no jax)

# the tests compile hundreds of tiny JAX programs, eagerly one per operation and shape, each run
# once or twice: the law suite's workers' XLA settings (no expensive optimisation; the same
# laws hold under them), set before anything imports jax
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ.update(JaxBackend.checking_env("cpu"))

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings

import cacheidx as ci
from cacheidx.conformance.pytest_plugin import backend_or_skip

# CI never depends on luck: the same examples every run.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") == "true" else "dev")

BACKENDS = list(ci.backends.BUILTIN)  # every built-in adapter, in the registry's order


@pytest.fixture(params=BACKENDS)
def backend(request) -> ci.backends.Backend:
    """Every backend; one that cannot run here is skipped with its reason."""
    return backend_or_skip(request.param)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items) -> None:
    # the law suite's cases first (after the plugin has grouped them by backend and mode): the
    # longest file, so that spread over the cores (README's test command) it starts first and
    # the other files fill the other cores meanwhile
    items.sort(key=lambda item: "cacheidx_case" not in getattr(item, "fixturenames", ()))
