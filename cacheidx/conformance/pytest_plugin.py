"""A pytest plugin (entry point ``pytest11: cacheidx``): the ``cacheidx_case`` fixture runs a
test once per backend and mode (eager, compiled), so an adapter's author checks a new library
against every law with one file::

    # test_my_adapter.py
    import pytest
    from cacheidx.conformance import LAWS

    @pytest.mark.parametrize("law", LAWS, ids=[law.name for law in LAWS])
    def test_law(law, cacheidx_case):
        law(cacheidx_case)

and ``pytest --cacheidx-backend mylib``. A backend or mode that cannot run is skipped with
its reason.
"""

from __future__ import annotations

import pytest

from .. import backends
from .suite import Case


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cacheidx")
    group.addoption("--cacheidx-backend", action="append", default=None, metavar="NAME",
                    help="run cacheidx_case tests on this backend only (repeatable; default: "
                    "every registered backend)")
    group.addoption("--cacheidx-compiler", default="aot_eager", metavar="NAME",
                    help="torch.compile backend for compiled cases (default aot_eager)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cacheidx_case" not in metafunc.fixturenames:
        return
    names = metafunc.config.getoption("cacheidx_backend") or backends.names()
    params = [(n, m) for n in names for m in ("eager", "compiled")]
    metafunc.parametrize("cacheidx_case", params, indirect=True,
                         ids=[f"{n}-{m}" for n, m in params])


def backend_or_skip(name: str) -> backends.Backend:
    """The backend ``name``, or a skip that prints why it cannot run here."""
    ok, why = backends._class(name).usable()
    if not ok:
        pytest.skip(f"backend {name} cannot run here: {why}")
    return backends.get(name)


@pytest.fixture
def cacheidx_case(request: pytest.FixtureRequest) -> Case:
    """A law's case: a backend, its first device, eager or compiled."""
    name, mode = request.param
    backend = backend_or_skip(name)
    if mode == "compiled" and not backend.compiles:
        pytest.skip(f"{name} has no compiler: its compiled run is its eager run")
    if hasattr(backend, "compiler"):
        backend.compiler = request.config.getoption("cacheidx_compiler")
    if mode == "compiled":
        backend.forget()
    return Case(backend, backend.devices()[0], compiled=mode == "compiled")
