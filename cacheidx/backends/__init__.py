"""The registry of backends: one small adapter per array library.

The built-in adapters are :data:`BUILTIN`; others are found through the entry-point group
``cacheidx.backends`` (:class:`cacheidx.registry.Registry`, the loader attention's paths use
too), so a third party adds a library without touching cacheidx. An adapter's module is
imported only when asked for by name or when the user's arrays come from its library:
``import cacheidx`` imports neither torch nor jax.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from functools import cache
from typing import Any

from ..laws import inside
from ..registry import Registry
from .base import Backend, Node, redirect_dropped
from .protocols import Arrays, Checking, Compiling, Serving

__all__ = ["BUILTIN", "Arrays", "Backend", "Checking", "Compiling", "Node", "Serving",
           "available", "get", "inside", "names", "redirect_dropped", "use", "when_made"]

GROUP = "cacheidx.backends"

#: the built-in adapters, the one list of them (the tests' backends fixture, the law suite and
#: the registry read it): a third party adds its own under the entry-point group
BUILTIN = {
    "numpy": "cacheidx.backends.numpy:NumpyBackend",
    "strict": "cacheidx.backends.strict:StrictBackend",
    "torch": "cacheidx.backends.torch:TorchBackend",
    "jax": "cacheidx.backends.jax:JaxBackend",
    "cupy": "cacheidx.backends.cupy:CupyBackend",
}
_ALIASES = {"array_api_strict": "strict", "jax.numpy": "jax"}
_REGISTRY = Registry(GROUP, BUILTIN)


def _targets() -> dict[str, str]:
    return _REGISTRY.targets()


def names() -> list[str]:
    """Every registered backend name, usable here or not."""
    return list(_targets())


@cache
def _class(name: str) -> type[Backend]:
    cls = _REGISTRY.load(name)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"cacheidx.backends: entry point {name!r} is not a Backend subclass")
    return cls


#: name -> the one backend made for it
_MADE: dict[str, Backend] = {}
#: what the layers above ask of every backend once it is made (:func:`when_made`)
_HOOKS: list[Callable[[Backend], None]] = []
_LOCK = threading.RLock()


def when_made(hook: Callable[[Backend], None]) -> None:
    """Call ``hook(backend)`` for every backend made, now and from now on: how a layer above
    hooks into the registry without the registry importing it (the index registers its
    pytree node; attention makes a library's path before any compiler traces a call)."""
    with _LOCK:
        _HOOKS.append(hook)
        made = list(_MADE.values())
    for backend in made:
        hook(backend)


def _instance(name: str) -> Backend:
    with _LOCK:
        backend = _MADE.get(name)
        if backend is None:
            backend = _MADE[name] = _class(name)()
            for hook in _HOOKS:
                hook(backend)
        return backend


def available() -> list[str]:
    """Names of the backends usable on this machine (their library is installed)."""
    return [name for name in _targets() if _class(name).usable()[0]]


def _name(spec: Any) -> str:
    if isinstance(spec, str):
        name = _ALIASES.get(spec, spec)
    else:  # a namespace module: numpy, torch, jax.numpy, cupy, array_api_strict, ...
        top = getattr(spec, "__name__", "")
        name = _ALIASES.get(top, top.split(".")[-1] if top.startswith("array_api_compat.")
                            else top.split(".")[0])
        name = _ALIASES.get(name, name)
    if name not in _targets():
        raise ValueError(
            f"cacheidx.backends.get: no backend named {spec!r}; registered: {names()}"
        )
    return name


def get(spec: Any = None) -> Backend:
    """A backend by name, by namespace module, or the one an array's library needs.

    ``None`` gives the default backend (``use``, else ``CACHEIDX_BACKEND``, else numpy).
    """
    if spec is None:
        return _instance(_default[0])
    if isinstance(spec, str) or _is_module(spec):
        return _instance(_name(spec))
    for name in _targets():
        if _class(name).owns(spec):
            return _instance(name)
    return _generic(spec)


def _is_module(x: Any) -> bool:
    import types

    return isinstance(x, types.ModuleType)


def _generic(x: Any) -> Backend:
    """Any other namespace array-api-compat understands gets the standard-only base."""
    import array_api_compat

    try:
        xp = array_api_compat.array_namespace(x)
    except TypeError:
        raise TypeError(
            f"cacheidx: {type(x).__name__} is not an array of any array API library"
        ) from None
    return Backend(xp)


_default = [os.environ.get("CACHEIDX_BACKEND", "numpy")]


def use(name: str) -> Backend:
    """Make ``name`` the backend constructors build on when given no ``xp``."""
    backend = get(name)
    _default[0] = backend.name
    return backend

