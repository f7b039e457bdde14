"""A pytest plugin (entry point ``pytest11: cacheidx``): the ``cacheidx_case`` fixture runs a
test once per backend and mode (eager, compiled, and the backend's other compiled modes), so an
adapter's author checks a new library against every law with one file::

    # test_my_adapter.py
    import pytest
    from cacheidx.conformance import LAWS

    @pytest.mark.parametrize("law", LAWS, ids=[law.name for law in LAWS])
    def test_law(law, cacheidx_case):
        law(cacheidx_case)

and ``pytest --cacheidx-backend mylib``. A backend or mode that cannot run is skipped with its
reason. The cases of one backend and mode share a session (one compiled step per step function,
as ``python -m cacheidx.conformance`` runs them), so the plugin runs them one after another.
"""

from __future__ import annotations

import pytest

from .. import backends
from .precision import Precision
from .suite import DEFAULT_MODES, MODES, Case, Session, compiler_for


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cacheidx")
    group.addoption("--cacheidx-backend", action="append", default=None, metavar="NAME",
                    help="run cacheidx_case tests on this backend only (repeatable; default: "
                    "every registered backend)")
    group.addoption("--cacheidx-mode", action="append", default=None, choices=MODES,
                    help="run cacheidx_case tests in this mode only (repeatable; default: "
                    f"{', '.join(DEFAULT_MODES)})")
    group.addoption("--cacheidx-compiler", default=None, metavar="NAME",
                    help="torch.compile backend for compiled cases (default: aot_eager for "
                    "compiled, eager for dynamic and automatic)")
    group.addoption("--cacheidx-precision", default="highest",
                    choices=["highest", "default", "tf32"],
                    help="the model laws' numerical policy (default highest)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cacheidx_case" not in metafunc.fixturenames:
        return
    names = metafunc.config.getoption("cacheidx_backend") or backends.names()
    modes = metafunc.config.getoption("cacheidx_mode") or DEFAULT_MODES
    params = [(n, m) for n in names for m in modes]
    metafunc.parametrize("cacheidx_case", params, indirect=True,
                         ids=[f"{n}-{m}" for n, m in params])


def _group(item: pytest.Item) -> tuple:
    spec = getattr(item, "callspec", None)
    param = spec.params.get("cacheidx_case") if spec else None
    return ("",) if param is None else (param[0], MODES.index(param[1]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # one backend and mode at a time: their cases share compiled steps
    items.sort(key=_group)


def backend_or_skip(name: str) -> backends.Backend:
    """The backend ``name``, or a skip that prints why it cannot run here."""
    ok, why = backends._class(name).usable()
    if not ok:
        pytest.skip(f"backend {name} cannot run here: {why}")
    return backends.get(name)


_sessions: dict[tuple, Session] = {}


@pytest.fixture
def cacheidx_case(request: pytest.FixtureRequest):
    """A law's case: a backend, its first device, a mode, in the session of that backend and
    mode (made when the first of its cases runs)."""
    name, mode = request.param
    backend = backend_or_skip(name)
    if mode != "eager" and mode not in backend.modes:
        why = "has no compiler" if not backend.modes else f"has no {mode} mode"
        pytest.skip(f"{name} {why}: its compiled runs are its eager run")
    device = backend.devices()[0]
    key = (name, mode, request.config.getoption("cacheidx_precision"))
    if key not in _sessions:
        _sessions.clear()  # the last backend and mode is done: forget its programs
        backend.forget()
        _sessions[key] = Session(policy=Precision.named(key[2], backend, device),
                                 compiler=compiler_for(backend, mode, request.config.getoption(
                                     "cacheidx_compiler")))
    session = _sessions[key]
    with backend.many_programs(), session.policy.applied(backend):
        yield Case(backend, device, mode=mode, session=session)
