"""A backend: one array library as the core sees it, composed of one small part per concern.

Each floor above asks for one protocol of :mod:`~cacheidx.backends.protocols`, and each part
class here (or a library's own) implements one:

- :class:`Library`: which library, its namespace, whether an array is its own, its pytree
  registry (what the registry and the index's pytree node need);
- :class:`~.arrays.StandardArrays` (``Arrays``): stores with drop and reads, the index's and
  attention's;
- :class:`~.compiling.Eager` (``Compiling``): compiling a step, counting its programs;
- :class:`~.serving.PlainServing` (``Serving``): an engine's step;
- :class:`~.checking.HostChecking` (``Checking``): what the law suite reports and controls.

:class:`Backend` is the four standard parts over the library part, each member written
against the array API standard alone, so an adapter overrides only what its library does
better, part by part: torch's adapter is ``TorchArrays``, ``TorchCompiling``,
``TorchServing`` and ``TorchChecking`` over ``TorchLibrary``. One object serves every floor
(``ci.backends.get`` returns it, ``index.backend`` holds it); a floor's code is typed with the
protocol it uses, and mypy checks each part against its protocol (tests/test_typing.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

from ..laws import expand, inside
from .arrays import StandardArrays, redirect_dropped
from .checking import HostChecking
from .compiling import Eager
from .serving import PlainServing

__all__ = ["Backend", "Library", "Node", "expand", "inside", "redirect_dropped"]


class Node(NamedTuple):
    """A class a library's pytree registry takes apart and puts together again: its tensors
    the leaves, the rest one static value (how the index layer hands itself to the backends,
    which never import it)."""

    cls: type
    flatten: Callable[[Any], tuple[list[Any], Any]]  #: obj -> (leaves, static)
    unflatten: Callable[[Any, list[Any]], Any]  #: (static, leaves) -> obj
    keys: Callable[[Any], list[str]]  #: static -> the leaves' names (the spec's walk paths)
    dump: Callable[[Any], str]  #: static -> JSON (torch.export saves it)
    load: Callable[[str], Any]  #: JSON -> static
    safe: tuple[Any, ...] = ()  #: what unpickling the static value needs, weights-only


class Library:
    """Which array library, found without importing it: subclasses set ``name`` and
    ``module`` (the library's top-level module, looked up in ``sys.modules`` only, so that
    detecting an array never imports a framework) and give its ``namespace``."""

    name: str = "standard"
    module: ClassVar[str | None] = None

    def __init__(self, xp: Any | None = None):
        # resolved now, never lazily inside a traced step (a compiler would guard on it)
        self.xp = xp if xp is not None else self.namespace()

    @classmethod
    def usable(cls) -> tuple[bool, str]:
        """Whether this backend can run here, and why not."""
        import importlib.util

        if cls.module is None or importlib.util.find_spec(cls.module) is not None:
            return True, ""
        return False, f"{cls.module} is not installed"

    @classmethod
    def owns(cls, x: Any) -> bool:
        """Whether ``x`` is an array of this backend's library (never imports it)."""
        return cls.module is not None and cls.module in sys.modules and cls._made_by(x)

    @classmethod
    def _made_by(cls, x: Any) -> bool:
        """Whether ``x``'s type comes from one of the library's modules (by name alone)."""
        return type(x).__module__.split(".")[0] in cls._modules()

    @classmethod
    def _modules(cls) -> tuple[str, ...]:
        return () if cls.module is None else (cls.module,)

    def namespace(self) -> Any:
        """The array-API namespace (array-api-compat's wrapper where the library needs one)."""
        raise NotImplementedError(f"backend {self.name!r} names no namespace")

    def __reduce__(self) -> Any:
        # pickles as the registry's instance, never its namespace module
        from . import get

        return get, (self.name,)

    def register(self, node: Node) -> None:
        """Register ``node`` (the index) with the library's pytree registry, if it has one."""

    def __repr__(self) -> str:
        return f"<cacheidx backend {self.name}>"


class Backend(Library, StandardArrays, Eager, PlainServing, HostChecking):
    """One array library with the standard-only parts (:mod:`~cacheidx.backends.base`): an
    adapter subclasses it and overrides what its library does better (at least ``name``,
    ``module``, ``namespace`` and, where the standard's sort is too slow, ``scatter``)."""
