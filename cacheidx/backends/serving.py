"""The serving part of a backend (the protocol :class:`~cacheidx.backends.protocols.Serving`):
what an engine's step adds to compiling, a step compiled once per shape and called many times
with its arrays kept where they are. Here: ``jit`` and the arrays as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["Composed", "PlainServing"]


class Composed(Protocol):
    """What a serving part asks of the compiling and array parts it is composed with."""

    def jit(self, fn: Callable, *, donate_argnums: Sequence[int] = (),
            mode: str = "compiled", compiler: str | None = None) -> Callable: ...
    def named(self, compiler: str | None) -> str | None: ...
    def same_library(self, x: Any) -> bool: ...
    def device(self, x: Any) -> Any: ...
    def from_host(self, a: Any, dtype: Any = None, device: Any = None) -> Any: ...


class PlainServing:
    """A step is ``jit`` of it; nothing is replayed, fixed or written in place."""

    def jit_step(self: Composed, fn: Callable, *, donate_argnums: Sequence[int] = (),
                 programs: int = 8, compiler: str | None = None) -> Callable:
        """``jit`` for a step called over and over with its arrays kept where they are
        (``fix``): where the library replays a recorded program (CUDA graphs) it does, and it
        keeps up to ``programs`` compiled shapes."""
        return self.jit(fn, donate_argnums=donate_argnums, compiler=compiler)

    def static_shape(self, x: Any) -> Any:
        """``x``, whose shape a compiled step may take as fixed (a model's weights), even where
        it compiles with symbolic shapes. Returns ``x``."""
        return x

    def fix(self, x: Any) -> Any:
        """``x``, promised to every call of a ``jit_step`` program at this address (its memory
        is written between calls, never replaced). Returns ``x``."""
        return x

    def refill(self: Composed, buffer: Any, values: Any) -> Any:
        """An array holding ``values`` (host NumPy, or an array of this library of
        ``buffer``'s shape and dtype) on ``buffer``'s device: ``buffer`` itself, written in
        place, where the library writes in place; otherwise a new array."""
        if self.same_library(values):
            return values
        return self.from_host(values, buffer.dtype, self.device(buffer))

    def inference(self, fn: Callable) -> Callable:
        """``fn`` run eagerly with nothing recorded for differentiation (a serving step never
        needs it), where the library records by default; ``fn`` itself elsewhere."""
        return fn

    def matmul(self, a: Any, b: Any) -> Any:
        """``a @ b`` for a matrix ``b`` ``[in, out]``, a model's linear layer; a backend may
        use a faster kernel for it."""
        return a @ b
