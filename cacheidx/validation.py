"""What a call is given, checked against its index before anything is stored: each refusal
names the function (``cacheidx.extend``, ``cacheidx.attend``, ``cacheidx.advance``) and the
value, a ``TypeError`` for a wrong library or dtype, a ``ValueError`` otherwise (API.md's
translation of the spec's ``Invalid_argument``)."""

from __future__ import annotations

from typing import Any

from . import _arguments as arguments
from . import pools

__all__ = ["next_table", "values"]


def values(index: Any, values: Any, pool: Any, fn: str = "extend", name: str = "values") -> None:
    """Raises naming ``cacheidx.{fn}`` where ``values`` cannot be stored into ``pool`` through
    ``index``: an array of the index's library, ``[batch, seq, *pool.shape[1:]]``, into a pool
    its kind takes (:mod:`cacheidx.pools`: its own dtype for a float pool, real floats for a
    quantized one)."""
    kind = pools.kind(pool)
    if not index.backend.same_library(values):
        raise TypeError(f"cacheidx.{fn}: {name} must be an array of the index's "
                        f"library ({index.backend.name}), got {type(values).__name__}")
    kind.check(fn, "pool" if fn == "extend" else f"{name}pool", pool, index.backend)
    if pool.ndim < 1:
        raise arguments.fail(fn, "pool must have a slot axis, got a 0-d array")
    want = (index.batch, index.seq, *pool.shape[1:])
    if tuple(values.shape) != want:
        raise arguments.fail(fn, f"{name} must have shape {list(want)} (batch, seq, then the "
                             f"pool's row), got {list(values.shape)}")
    kind.takes(fn, name, values, pool, index.backend.xp)


def next_table(index: Any, table: Any, blocks: Any = None) -> None:
    """Raises naming ``cacheidx.advance`` where ``table`` (and ``blocks``) cannot replace the
    index's: arrays of its library and dtypes, of 2 axes and as many rows as its table, on its
    device, and a table of blocks for each it reads."""
    given = [("table", table, index.table)]
    if index.blocks or blocks is not None:
        blocks = list(blocks) if blocks is not None else []
        if len(blocks) != len(index.blocks):
            raise arguments.fail("advance", "the index reads tables of blocks of "
                                 f"{[m for m, _ in index.blocks]} positions, which a new "
                                 f"table would not follow: give blocks= ({len(blocks)} "
                                 "given), one for each")
        given += [(f"the table of blocks of {m}", b, old)
                  for (m, old), b in zip(index.blocks, blocks)]
    rows = int(index.table.shape[0])
    for name, new, old in given:
        if not index.backend.same_library(new):
            raise TypeError(f"cacheidx.advance: {name} must be an array of the index's "
                            f"library ({index.backend.name}), got {type(new).__name__}")
        arguments.array("advance", name, new, index.backend.xp, (rows, None))
        if new.dtype != old.dtype:
            raise TypeError(f"cacheidx.advance: {name} holds {new.dtype} but the index's "
                            f"{old.dtype}")
    arguments.one_device("advance", [("the index's table", index.table),
                                     *((name, new) for name, new, _ in given)])
