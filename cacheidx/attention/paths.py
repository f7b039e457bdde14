"""Fast paths of ``attend``: one small object per array library, found by backend name.

A path computes a call faster than the standard's tiles where its library can (one compiled
program, a compiler's rolled loop) and keeps the same law: ``attend(call)`` returns
``(out, kpool', vpool')`` of a :class:`~cacheidx.attention.Call`, or ``None`` where it does not
apply, which leaves the call to the core. :func:`~cacheidx.attention.stored` and
:func:`~cacheidx.attention.standard` are the core's two halves, for a path to reuse.

Paths live beside the core rather than on :class:`~cacheidx.backends.Backend`, which says how
to store, read and compile, not how to attend. A third party registers one under the entry-point
group ``cacheidx.attention``, keyed by its backend's name; a path's module is imported when its
backend is first made (a compiler tracing a call could not import it), never before.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..backends.protocols import Arrays
from ..registry import Registry

__all__ = ["Path", "Products", "fast", "products"]

GROUP = "cacheidx.attention"

_BUILTIN = {
    "jax": "cacheidx.attention.jax:JaxPath",
    "numpy": "cacheidx.attention.numpy:NumpyPath",
    "torch": "cacheidx.attention.torch:TorchPath",
}


class Path(Protocol):
    """A library's path. Beside ``attend`` it may offer ``layout(pool)``: ``"head"`` or
    ``"token"``, the memory order (:mod:`~cacheidx.attention.layout`) it reads fastest for a
    pool like ``pool`` (token-major without it), and ``products`` (:class:`Products`)."""

    def attend(self, call: Any) -> tuple[Any, Any, Any] | None:
        """``(out, kpool', vpool')`` of ``call``, or ``None`` where this path does not apply."""


class Products(Protocol):
    """A library's own matrix products for one lane's views (optional: a path may offer them
    through ``products(backend, kpool, vpool)``, returning ``None`` where they do not pay)."""

    def scores(self, q: Any, keys: Any) -> Any:
        """``q`` ``[1, kv, m, d]`` against ``keys`` ``[1, T, kv, d]``: ``[1, kv, m, T]``."""

    def weigh(self, p: Any, values: Any) -> Any:
        """``p`` ``[1, kv, m, T]`` times ``values`` ``[1, T, kv, dv]``: ``[1, kv, m, dv]``."""

    def run(self, q: Any, keys: Any, values: Any) -> tuple[Any, Any, Any] | None:
        """The online softmax's state ``(m, l, acc)`` (``[1, kv, m, 1]`` twice,
        ``[1, kv, m, dv]``) of ``q`` over float ``keys`` and ``values`` every query sees whole,
        by one fused call, or ``None`` where it does not pay or a result is not finite
        (:meth:`~.softmax.Online.add` then computes it)."""


_REGISTRY = Registry(GROUP, _BUILTIN)
#: backend name -> its path's "module:attribute", read once at import (never under a tracer)
_TARGETS = _REGISTRY.targets()
#: backend name -> its path, made when an index of its library first attends
_MADE: dict[str, Any] = {}


def fast(backend: Arrays) -> Path | None:
    """The fast path of ``backend``'s library, or ``None`` where it has none."""
    name = backend.name
    if name not in _TARGETS:
        return None
    path = _MADE.get(name)
    if path is None:
        path = _MADE[name] = _REGISTRY.load(name)()
    return path


def products(backend: Arrays, kpool: Any, vpool: Any) -> Products | None:
    """The products ``backend``'s path offers for views of these pools, or ``None``."""
    make = getattr(fast(backend), "products", None)
    return None if make is None else make(backend, kpool, vpool)
