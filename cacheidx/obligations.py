"""``cacheidx.check``: the table's obligations, checked on the host (a debug tool).

The spec leaves three obligations to whoever fills the table, because no operation can keep
them without looking at every slot: within a row a slot appears once; two sequences share a
slot only at the same column (after the same tokens); within a call the targets that address
a slot are distinct, and a slot another sequence's table names is never one of them. Broken,
they break nothing loudly: an earlier token reads a later token's value, or one sequence
overwrites what another reads, and the text comes out wrong. :func:`check` reads one index's
tensors on the host and names the first one broken.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import backends, pytree
from .devices import to_host
from .index import CacheIndex

__all__ = ["check"]

_ONCE = "within a row a slot appears once"
_SHARED = "two sequences share a slot only at the same column"
_DISTINCT = "within a call write targets are distinct"
_FOREIGN = "a slot another sequence's table names is never a write target"


def check(index: CacheIndex) -> CacheIndex:
    """``index`` itself, once its tables keep the obligations the spec puts on the caller;
    otherwise a ``ValueError`` naming the first broken, its lane or row, its column and its
    slot. Checked, in this order, for the positions' table and then each table of blocks
    (each addresses its own pools):

    1. *Within a row a slot appears once*: no row names one slot at two columns.
    2. *Two sequences share a slot only at the same column*: rows that name one slot name it
       at one column.
    3. *Within a call write targets are distinct*: no two tokens of the call store at one
       slot. A token stores where ``extend`` stores it: a token that is not padding (position
       at least 0, its lane's row inside the table) at the slot its row names at the column
       of its position, when that column exists and names a slot; through a table of blocks
       of ``m`` only a token closing a block, at its block's column; under a draft at the
       draft's slot, and nothing through the tables of blocks (a draft reads no blocks).
    4. *A slot another sequence's table names is never a write target*: no row but the
       storing token's own names the slot it stores at; under a draft no row at all names a
       draft slot (the caller takes them from the slots no table names).

    Not checkable from one index, so not checked: that shared slots follow the same tokens
    (the index holds no tokens), and whether a slot lies inside the pool (the index knows no
    pool: every slot at or above 0 counts). An index without a table (``whole``, ``packed``)
    stores nothing and reads nothing stored, and passes. Windows and selections change no
    obligation.

    It reads every tensor on the host (one copy off the device for each): a host-side debug
    check, for eager code, tests and ``Engine(debug=True)``. Inside a compiled step it cannot
    read them: under ``jax.jit`` it raises ``TypeError`` (:data:`HOST_ONLY`); under
    ``torch.compile`` it is a graph break, run eagerly on the step's tensors, which
    ``fullgraph=True`` refuses with dynamo's error naming :data:`HOST_ONLY` as its reason.
    """
    if not isinstance(index, CacheIndex):
        raise TypeError(f"cacheidx.check: expected a CacheIndex, got {type(index).__name__}")
    if index.kind != "tabled":
        return index
    if any(index.backend.tracing(x) for x in pytree.leaves(index)):
        eager = _EAGER.get(index.backend.name)
        if eager is None:
            raise TypeError(HOST_ONLY)
        return eager(index)
    return _checked(index)


#: why ``check`` cannot run inside a compiled step
HOST_ONLY = ("cacheidx.check: the index's tensors are being traced by a compiler, and check is "
             "a host-side debug check that reads them on the host: call it on the index "
             "before the compiled step (or, under torch.compile, without fullgraph=True: a "
             "graph break then runs it eagerly)")

#: backend name -> ``_checked`` as its compiler runs a function eagerly from a compiled step
_EAGER: dict[str, Any] = {}


def _made(backend: Any) -> None:
    """Made before any step is traced (a compiler cannot wrap a function while it traces):
    torch's compiler runs ``_checked`` eagerly, a graph break. (A backend method for "run
    this on the host" would let the registry say so rather than this module.)"""
    torch = sys.modules.get("torch")
    if backend.name == "torch" and torch is not None:
        _EAGER["torch"] = torch.compiler.disable(_checked, reason=HOST_ONLY)


def _checked(index: CacheIndex) -> CacheIndex:
    """:func:`check` of a tabled index whose tensors the host can read."""
    calls = _Call(index)
    tables = [(calls.table, "the table", 1)]
    tables += [(to_host(b), f"the table of blocks of {m}", m) for m, b in index.blocks]
    for table, name, _ in tables:
        _once(calls, table, name)
    for table, name, _ in tables:
        _shared(calls, table, name)
    stores = [(table, name, calls.stores(table, m)) for table, name, m in tables
              if m == 1 or calls.draft is None]
    for _, name, (lane, token, slot, _) in stores:
        _distinct(calls, name, lane, token, slot)
    for table, name, store in stores:
        _foreign(calls, table, name, *store)
    return index


class _Call:
    """One index's tensors on the host, and the words that name its lanes and rows."""

    def __init__(self, index: CacheIndex):
        self.pos = to_host(index.pos).astype(np.int64)
        self.table = to_host(index.table).astype(np.int64)
        rows = self.table.shape[0]
        batch = self.pos.shape[0]
        self.mapped = index.row is not None
        row = to_host(index.row).astype(np.int64) if self.mapped else np.arange(batch)
        self.row = np.where((row >= 0) & (row < rows), row, -1)  # -1: a lane of padding
        self.draft = None if index.draft_slots is None else \
            to_host(index.draft_slots).astype(np.int64)

    def rows(self, r: int) -> str:
        """Row ``r`` of a table, with the lanes that read it."""
        if not self.mapped:
            return f"row {r} (lane {r})"
        lanes = np.flatnonzero(self.row == r).tolist()
        if not lanes:
            return f"row {r} (no lane reads it)"
        return f"row {r} (lane{'s' if len(lanes) > 1 else ''} {', '.join(map(str, lanes))})"

    def token(self, b: int, i: int) -> str:
        return f"lane {b} token {i} (position {int(self.pos[b, i])})"

    def stores(self, table: np.ndarray, m: int) -> tuple[np.ndarray, ...]:
        """``(lane, token, slot, column)`` of every token that stores through ``table`` (read
        in blocks of ``m``): where ``extend`` stores it, as the docstring of :func:`check`
        says; ``column`` is -1 for a draft slot."""
        valid = (self.pos >= 0) & (self.row >= 0)[:, None]
        if m == 1 and self.draft is not None:
            lane, token = np.nonzero(valid & (self.draft >= 0))
            slot = self.draft[lane, token]
            return lane, token, slot, np.full_like(slot, -1)
        closes = (self.pos + 1) % m == 0
        column = self.pos // m
        lane, token = np.nonzero(valid & closes & (column < table.shape[1]))
        column = column[lane, token]
        slot = table[self.row[lane], column]
        keep = slot >= 0
        return lane[keep], token[keep], slot[keep], column[keep]


def _named(table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(row, column, slot)`` of every entry of ``table`` that names a slot."""
    r, j = np.nonzero(table >= 0)
    return r, j, table[r, j]


def _once(calls: _Call, table: np.ndarray, name: str) -> None:
    """Obligation 1: within a row a slot appears once."""
    r, j, s = _named(table)
    order = np.lexsort((j, s, r))
    r, j, s = r[order], j[order], s[order]
    again = np.flatnonzero((r[1:] == r[:-1]) & (s[1:] == s[:-1])) + 1
    if again.size:
        # the earliest row, and in it the repeat at the earliest column
        k = again[np.lexsort((j[again], r[again]))[0]]
        first = k
        while first > 0 and r[first - 1] == r[k] and s[first - 1] == s[k]:
            first -= 1
        raise ValueError(f"cacheidx.check: {name} names slot {s[k]} twice in "
                         f"{calls.rows(int(r[k]))}, at columns {j[first]} and {j[k]}: {_ONCE}")


def _shared(calls: _Call, table: np.ndarray, name: str) -> None:
    """Obligation 2: two sequences share a slot only at the same column."""
    r, j, s = _named(table)
    order = np.lexsort((j, r, s))
    r, j, s = r[order], j[order], s[order]
    start = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])  # each slot's first entry
    first = np.repeat(start, np.diff(np.r_[start, s.size]))
    off = np.flatnonzero(j != j[first])
    if off.size:
        k = off[np.lexsort((j[off], r[off]))[0]]
        f = first[k]
        raise ValueError(f"cacheidx.check: {name} names slot {s[k]} in {calls.rows(int(r[f]))} "
                         f"at column {j[f]} and in {calls.rows(int(r[k]))} at column {j[k]}: "
                         f"{_SHARED}")


def _distinct(calls: _Call, name: str, lane: np.ndarray, token: np.ndarray,
              slot: np.ndarray) -> None:
    """Obligation 3: no two tokens of the call store at one slot."""
    order = np.lexsort((token, lane, slot))
    lane, token, slot = lane[order], token[order], slot[order]
    again = np.flatnonzero(slot[1:] == slot[:-1]) + 1
    if again.size:
        k = again[np.lexsort((token[again], lane[again]))[0]]
        f = k
        while f > 0 and slot[f - 1] == slot[k]:
            f -= 1
        through = "a draft" if calls.draft is not None and name == "the table" else name
        raise ValueError(f"cacheidx.check: {calls.token(int(lane[f]), int(token[f]))} and "
                         f"{calls.token(int(lane[k]), int(token[k]))} both store at slot "
                         f"{slot[k]} through {through}: {_DISTINCT}")


def _foreign(calls: _Call, table: np.ndarray, name: str, lane: np.ndarray, token: np.ndarray,
             slot: np.ndarray, column: np.ndarray) -> None:
    """Obligation 4: a slot another sequence's table names is never a write target."""
    r, j, s = _named(table)
    order = np.argsort(s, kind="stable")
    r, j, s = r[order], j[order], s[order]
    lo, hi = np.searchsorted(s, slot, "left"), np.searchsorted(s, slot, "right")
    drafted = column < 0
    # a stored slot is named by its own row (once, by obligation 1) unless it is a draft's
    bad = np.flatnonzero((hi - lo) > np.where(drafted, 0, 1))
    if not bad.size:
        return
    k = bad[np.lexsort((token[bad], lane[bad]))[0]]
    b, i = int(lane[k]), int(token[k])
    own = calls.row[b]
    other = next(e for e in range(lo[k], hi[k]) if drafted[k] or r[e] != own)
    where = f"{calls.rows(int(r[other]))} at column {j[other]}"
    if drafted[k]:
        raise ValueError(f"cacheidx.check: {calls.token(b, i)} stores its draft at slot "
                         f"{slot[k]}, which {name} names in {where}: {_FOREIGN} (a draft's "
                         f"slots are those no table names)")
    raise ValueError(f"cacheidx.check: {calls.token(b, i)} stores at slot {slot[k]}, its row "
                     f"{own}'s column {column[k]}, which {name} also names in {where}: "
                     f"{_FOREIGN}")


backends.when_made(_made)
