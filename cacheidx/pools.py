"""Pools, whatever their kind: what a store and a read need of one.

A pool is one or more arrays, its **parts**, each with slot axis 0: a float pool is one array;
a quantized pool (:class:`cacheidx.quantized.Quantized`) is its codes and its scales. Every law
of the index holds of each part unchanged (a store writes each part's rows where the call's
tokens sit; a read takes each part's rows at the slots a column names, zero where none), so
the readers (the index's store and read, attention's tiles, runs and paths) need of a pool
only what this module asks of its :class:`Kind`:

- ``parts(pool)`` and ``remade(parts)``: the arrays, and the pool of this kind over others of
  the same leading axes (a read's rows, a view, a copy: :func:`map`);
- ``encode(pool, values, xp)``: what each part stores of rows ``values`` ``[..., d]``;
- ``decode(read, xp)``: the values a read of the parts stands for (law Q2 for codes);
- ``factors(read, dtype, xp)``: the same as ``(floats, scales)``, ``floats`` ``[..., d]`` in
  ``dtype`` and ``scales`` ``[...]`` (one per row) or ``None``, the values being
  ``floats * scales[..., None]``: a product folds the scales into its scores and weights
  rather than scaling the rows (:class:`~cacheidx.attention.softmax.Online`);
- ``check`` and ``takes``: the pool's own obligations and the rows it stores, refused naming
  the function;
- ``name``; ``cast``, whether the parts are codes a product casts to floats as it reads
  them, a chunk at a time (otherwise they are floats, cast to the work dtype once a tile);
  ``kernel``, the reads that the CPU kernel (:mod:`cacheidx.attention.native`) computes for
  the kind: ``"paged"`` (a decode step through each lane's row of the table) and ``"run"``
  (the core's runs of slots every query sees whole, through the same entry), a frozenset.

An array is a float pool (:data:`FLOATS`); a new kind of pool (keys scaled per channel, say)
is a class and its :class:`Kind`, :func:`register`-ed: no reader changes.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["FLOATS", "Kind", "decode", "kind", "map", "named", "parts", "register",
           "stands_for"]


class Kind(Protocol):
    """What a store and a read need of one kind of pool (the module says each)."""

    name: str
    cast: bool
    kernel: frozenset[str]

    def parts(self, pool: Any) -> tuple[Any, ...]: ...

    def remade(self, parts: Any) -> Any: ...

    def check(self, fn: str, name: str, pool: Any, backend: Any) -> None: ...

    def takes(self, fn: str, name: str, values: Any, pool: Any, xp: Any) -> None: ...

    def encode(self, pool: Any, values: Any, xp: Any) -> tuple[Any, ...]: ...

    def decode(self, read: Any, xp: Any) -> Any: ...

    def factors(self, read: Any, dtype: Any, xp: Any) -> tuple[Any, Any]: ...


class _Floats:
    """A float pool: one array, storing the rows as they are, read back as they were."""

    name = "floats"
    cast = False
    kernel = frozenset({"paged"})

    def parts(self, pool: Any) -> tuple[Any, ...]:
        return (pool,)

    def remade(self, parts: Any) -> Any:
        (pool,) = parts
        return pool

    def check(self, fn: str, name: str, pool: Any, backend: Any) -> None:
        if not backend.same_library(pool):
            raise TypeError(f"cacheidx.{fn}: {name} must be an array of the index's library "
                            f"({backend.name}), got {type(pool).__name__}")

    def takes(self, fn: str, name: str, values: Any, pool: Any, xp: Any) -> None:
        if values.dtype != pool.dtype:
            raise TypeError(f"cacheidx.{fn}: {name} are {values.dtype} but the pool holds "
                            f"{pool.dtype}")

    def encode(self, pool: Any, values: Any, xp: Any) -> tuple[Any, ...]:
        return (values,)

    def decode(self, read: Any, xp: Any) -> Any:
        return read

    def factors(self, read: Any, dtype: Any, xp: Any) -> tuple[Any, Any]:
        return (read if read.dtype == dtype else xp.astype(read, dtype)), None


#: the kind of an array: a float pool
FLOATS: Kind = _Floats()
#: the registered kinds, each with the class of its pools (:func:`register`)
_KINDS: list[tuple[type, Kind]] = []


def register(cls: type, of: Kind) -> None:
    """Pools of class ``cls`` (and its subclasses) are of kind ``of``."""
    _KINDS[:] = [(c, k) for c, k in _KINDS if c is not cls] + [(cls, of)]


def kind(pool: Any) -> Kind:
    """The kind of ``pool``: a registered class's, else a float pool's. By ``isinstance``, here
    alone (which every compiler traces)."""
    for cls, of in _KINDS:
        if isinstance(pool, cls):
            return of
    return FLOATS


def named(name: str) -> Kind:
    """The kind called ``name`` (an operator carries a pool's kind by its name)."""
    for _, of in _KINDS:
        if of.name == name:
            return of
    if name == FLOATS.name:
        return FLOATS
    raise ValueError(f"cacheidx.pools.named: no kind of pool is called {name!r} (known: "
                     f"{[FLOATS.name, *(k.name for _, k in _KINDS)]})")


def parts(pool: Any) -> tuple[Any, ...]:
    """The arrays ``pool`` is: itself, or a quantized pool's codes and scales."""
    return kind(pool).parts(pool)


def map(pool: Any, fn: Any) -> Any:  # noqa: A001  (the pytree word: fn of every part)
    """The pool of ``pool``'s kind whose every part is ``fn`` of ``pool``'s: what a law over
    slots (a read, a view, a copy) does to each."""
    of = kind(pool)
    return of.remade([fn(p) for p in of.parts(pool)])


def decode(read: Any, xp: Any) -> Any:
    """The values a read of a pool's parts stands for: itself, or dequantized (float32)."""
    return kind(read).decode(read, xp)


def stands_for(pool: Any, values: Any, xp: Any) -> Any:
    """``values`` as ``pool`` gives them back once stored: themselves in a float pool, their
    round trip through a quantized one (:func:`~cacheidx.quantized.roundtrip`)."""
    of = kind(pool)
    return of.decode(of.remade(of.encode(pool, values, xp)), xp)
