"""The law suite's frame: a registry of laws, and the case (backend, device, mode) each law
runs in.

A law is a function of a :class:`Case` that raises ``AssertionError`` when the law breaks. It
builds its arrays with ``case.array`` and runs its computation through ``case.call``, which in a
compiled mode runs it both eagerly and compiled and demands they agree bit for bit.

A mode is ``"eager"`` or one of the backend's ``jit`` modes (``"compiled"``: static shapes;
torch also ``"dynamic"`` and ``"automatic"``). The cases of one run share a :class:`Session`:
one compiled step per step function, fed every law's shapes and structures, so a run compiles
each (step, structure, shape) once and automatic dynamic shapes meet many batch sizes and
context widths, as a served model's step does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import backends
from .precision import Precision

__all__ = ["COMPILERS", "Case", "DEFAULT_MODES", "Law", "LAWS", "MODES", "Session", "law",
           "agree"]

#: every mode a law can run in, in the order a run takes them
MODES = ("eager", "compiled", "dynamic", "automatic")
#: the modes a run takes unless told: all but automatic, whose behaviour across shapes the
#: one-step law checks in the dynamic run
DEFAULT_MODES = ("eager", "compiled", "dynamic")

#: the torch.compile backend of each mode unless the caller names one: aot_eager traces through
#: AOTAutograd's functionalisation; the symbolic-shape modes check what dynamo captures and how
#: it guards, which its own "eager" backend runs as captured
COMPILERS = {"compiled": "aot_eager", "dynamic": "eager", "automatic": "eager"}


@dataclasses.dataclass(frozen=True)
class Law:
    name: str
    fn: Callable[[Case], None]
    doc: str
    eager_only: bool = False
    compiled_only: bool = False
    #: ``"index"`` (the index's own laws, the one across shapes among them), ``"attention"``
    #: (attend's) or ``"model"`` (the decoder's through it): a runner's jobs split the laws by
    #: family
    family: str = "index"
    #: the modes the law checks, ``None`` for all
    modes: tuple[str, ...] | None = None

    def runs(self, mode: str | bool) -> bool:
        """Whether the law has something to check in ``mode`` (``True``: any compiled one)."""
        compiled = mode not in ("eager", False)
        if self.modes is not None and isinstance(mode, str) and mode not in self.modes:
            return False
        return not (self.eager_only and compiled or self.compiled_only and not compiled)

    @property
    def checks(self) -> str:
        """Which calls the law checks, in words (a skipped mode's reason)."""
        if self.modes is not None:
            return "only " + " and ".join(self.modes) + " calls"
        return f"only {'eager' if self.eager_only else 'compiled'} calls"

    def __call__(self, case: Case) -> None:
        self.fn(case)


LAWS: list[Law] = []


def law(fn: Callable | None = None, *, eager_only: bool = False, compiled_only: bool = False,
        family: str | None = None, modes: tuple[str, ...] | None = None) -> Any:
    """Register a law; its name is the function's, less ``law_``; its doc the docstring's
    first line; its family ``family``, else its module's (``model`` for the decoder's); the
    modes it checks ``modes`` (all by default)."""

    def register(f: Callable) -> Callable:
        doc = (f.__doc__ or "").strip().splitlines()[0] if f.__doc__ else ""
        kind = family or ("model" if f.__module__.endswith(".model") else "index")
        LAWS.append(Law(f.__name__.removeprefix("law_"), f, doc, eager_only, compiled_only,
                        kind, modes))
        return f

    return register(fn) if fn is not None else register


def compiler_for(backend: backends.Backend, mode: str, named: str | None = None) -> str | None:
    """The compiler a run in ``mode`` names to ``backend`` (``named``, else the suite's choice
    for the mode), or ``None`` where the backend's ``jit`` takes no name or the run is eager."""
    if backend.compiler is None or mode == "eager":
        return None
    return named or COMPILERS.get(mode, "aot_eager")


@dataclasses.dataclass
class Session:
    """What the cases of one run (backend, device, mode) share: the compiled steps, the model
    laws' reference outputs and the numerical policy."""

    policy: Precision = dataclasses.field(default_factory=Precision.highest)
    #: the compiler named to the backend's ``jit`` (torch.compile's backend), None: its own
    compiler: str | None = None
    steps: dict = dataclasses.field(default_factory=dict)
    memo: dict = dataclasses.field(default_factory=dict)


class Case:
    """Where a law runs: a backend, a device and a mode (``compiled=True``: the backend's
    static-shape compiler), in a session shared with the other laws of the run."""

    def __init__(self, backend: backends.Backend, device: Any = None, compiled: bool = False,
                 *, mode: str | None = None, session: Session | None = None):
        mode = mode or ("compiled" if compiled else "eager")
        if mode != "eager" and mode not in backend.modes:
            raise ValueError(f"cacheidx.conformance: {backend.name} has no mode {mode!r} (it "
                             f"has eager and {list(backend.modes)})")
        self.backend, self.device, self.mode = backend, device, mode
        self.session = session if session is not None else Session()
        #: what a law measured beside passing (compile counts, donation), for the report
        self.facts: dict = {}

    def __repr__(self) -> str:
        return f"Case({self.backend.name}, {self.device}, {self.mode})"

    @property
    def compiled(self) -> bool:
        return self.mode != "eager"

    @property
    def policy(self) -> Precision:
        return self.session.policy

    def jit(self, fn: Callable) -> Callable:
        """``fn`` compiled in this case's mode, once per session."""
        jitted = self.session.steps.get(fn)
        if jitted is None:
            jitted = self.session.steps[fn] = self.backend.jit(fn, mode=self.mode,
                                                               compiler=self.session.compiler)
        return jitted

    @property
    def xp(self) -> Any:
        return self.backend.xp

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def int_dtype(self) -> Any:
        info = getattr(self.xp, "__array_namespace_info__", None)
        return info().default_dtypes(device=self.device)["integral"] if info else self.xp.int64

    @property
    def int_max(self) -> int:
        return int(self.xp.iinfo(self.int_dtype).max)

    def array(self, a: Any, dtype: Any = None) -> Any:
        """A NumPy-like value as an array of this case: integers in the index dtype, floats
        as float32, bools as bool."""
        a = np.asarray(a)
        if dtype is None:
            if a.dtype.kind in "iu":
                dtype = self.int_dtype
            elif a.dtype.kind == "b":
                dtype = self.xp.bool
            else:
                dtype = self.xp.float32
                a = a.astype(np.float32)
        return self.backend.from_host(a, dtype, self.device)

    def numpy(self, x: Any) -> np.ndarray:
        """``x`` back on the host as NumPy, for comparing with plain expectations."""
        if hasattr(x, "detach"):
            return x.detach().cpu().numpy()
        if hasattr(x, "get") and type(x).__module__.startswith("cupy"):
            return x.get()
        try:
            return np.asarray(x)
        except Exception:
            return np.from_dlpack(x)

    def call(self, fn: Callable, *args: Any, tol: float = 0.0) -> Any:
        """``fn(*args)``; compiled, it runs eagerly too, and the two must agree bit for bit
        (within ``tol`` for a model, whose compiled matmuls may reassociate)."""
        eager = fn(*args)
        if not self.compiled:
            return eager
        compiled = self.jit(fn)(*args)
        agree(self, eager, compiled, what=getattr(fn, "__name__", "step"), tol=tol)
        return compiled


def agree(case: Case, a: Any, b: Any, *, what: str = "step", tol: float = 0.0) -> None:
    """Eager and compiled results are equal bit for bit (NaN where NaN), or within ``tol``."""
    if isinstance(a, tuple | list):
        assert len(a) == len(b), f"{what}: {len(a)} eager outputs, {len(b)} compiled"
        for x, y in zip(a, b):
            agree(case, x, y, what=what, tol=tol)
        return
    x, y = case.numpy(a), case.numpy(b)
    assert x.shape == y.shape, f"{what}: eager shape {x.shape}, compiled {y.shape}"
    if tol and x.dtype.kind == "f":
        same = np.allclose(x, y, rtol=tol, atol=tol, equal_nan=True)
    else:
        same = np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
    assert same, f"{what}: eager and compiled results differ\neager={x}\ncompiled={y}"
