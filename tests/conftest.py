"""Shared fixtures: one parametrisation over backends and modes, and the Hypothesis profile."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import cacheidx as ci
from cacheidx.conformance import Case

# CI never depends on luck: the same examples every run.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") == "true" else "dev")

BACKENDS = ["numpy", "strict", "torch", "jax", "cupy"]


def _backend(name: str) -> ci.backends.Backend:
    ok, why = ci.backends._class(name).usable()
    if not ok:
        pytest.skip(f"backend {name} cannot run here: {why}")
    return ci.backends.get(name)


@pytest.fixture(params=BACKENDS)
def backend(request) -> ci.backends.Backend:
    """Every backend; one that cannot run here is skipped with its reason."""
    return _backend(request.param)


@pytest.fixture(params=[(n, m) for n in BACKENDS for m in ("eager", "compiled")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def case(request) -> Case:
    """A law's case on every backend, eager and compiled (torch compiles with aot_eager)."""
    name, mode = request.param
    backend = _backend(name)
    if mode == "compiled" and not backend.compiles:
        pytest.skip(f"{name} has no compiler: its compiled run is its eager run")
    if hasattr(backend, "compiler"):
        backend.compiler = "aot_eager"
    if mode == "compiled":
        backend.forget()
    return Case(backend, backend.devices()[0], compiled=mode == "compiled")
