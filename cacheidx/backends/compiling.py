"""The compiling part of a backend (the protocol :class:`~cacheidx.backends.protocols.Compiling`):
a library's compiler, its programs counted, donation. Here the library has none: ``jit`` is
``fn`` itself and ``modes`` is empty.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["Eager"]


class Eager:
    """No compiler: every step runs eagerly, nothing is counted or kept."""

    name: str
    #: the compiler ``jit`` uses when given none, where the library has several to name
    #: (torch.compile's backends); ``None`` where ``jit`` takes no name
    compiler: str | None = None
    #: whether ``scatter(..., donate=True)`` writes into the caller's memory
    donates: bool = False
    #: the ways ``jit`` compiles (its ``mode``): ``"compiled"``, the library's compiler with
    #: static shapes, and any others it has (torch: ``"dynamic"``, ``"automatic"``)
    modes: tuple[str, ...] = ()

    def named(self, compiler: str | None) -> str | None:
        """The compiler ``jit`` uses for ``compiler`` (:attr:`compiler` when ``None``); raises
        where the library has one compiler, which takes no name."""
        if compiler is not None and self.compiler is None:
            raise ValueError(f"cacheidx.jit: {self.name} has one compiler, which takes no "
                             f"name; got compiler={compiler!r}")
        return compiler or self.compiler

    def jit(self, fn: Callable, *, donate_argnums: Sequence[int] = (),
            mode: str = "compiled", compiler: str | None = None) -> Callable:
        """Compile ``fn`` where the library has a compiler (in one of its ``modes``, with the
        named ``compiler`` where it has several: :attr:`compiler` when ``None``); eager where
        it has none."""
        self.named(compiler)
        return fn

    def programs(self, jitted: Callable) -> int | None:
        """How many programs ``jitted`` (from ``jit``) has compiled; ``None`` without a
        compiler."""
        return None

    def forget(self) -> None:
        """Drop every compiled program, so that independent suites do not share caches."""

    @contextlib.contextmanager
    def many_programs(self) -> Iterator[None]:
        """A context in which one step may compile for many shapes and structures (the law
        suite feeds each step every law's cases), past the library's usual limits."""
        yield

    def wrote_in_place(self, before: Any, after: Any) -> bool:
        """Whether ``after`` (a pool returned by a donating store) reuses ``before``'s
        memory."""
        return False
