"""The plan: what the host derives from one index's values, made once and read by every layer.

FlashInfer splits attention into ``plan`` (host work derived from the page table, once per
batch) and ``run`` (once per layer). Here the model passes only the index to its layers (the
spec's rule), so the plan rides with the index: ``index.plan`` is one :class:`Plan`, and its
parts (:meth:`Plan.part`, of the kinds :attr:`Plan.KINDS` names) are what an eager call would
otherwise derive again in every layer: where each pool of ``n`` slots is stored to and read
from, what each tile of a table reads and the runs of slots a lane's views read.

Law: a plan is a function of the index's structure and of the values its tensors hold, never
of their identity or version counters. A part is made the first time a layer asks for it and
kept for the next; every call first asks :meth:`Plan.follow`, which drops every part when the
tensors no longer hold the values the parts were made from (a table refilled in place, the
CUDA-graph idiom, or written behind the library's back through NumPy): a plan never outlives
its values. Traced, there is no plan: a compiled step derives its parts inside the program,
where the compiler shares them between layers.

:meth:`CacheIndex.advance <cacheidx.CacheIndex.advance>` carries its index's plan to the next
token's index where the next plan follows from the last (:meth:`Plan.advanced`), over the same
table or over one that holds the same values at the old table's columns (:func:`keeps_columns`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .devices import to_host

__all__ = ["CARRY", "Plan", "Recent", "keeps_columns"]

#: kind of part -> ``carry(index, nxt, key, part)``: the part again for ``nxt =
#: index.advance()`` (or ``index.advance(table=...)``, whose lanes' rows hold the old table's
#: values at its columns: :meth:`Plan.advanced` makes sure; a carrier reads ``nxt``'s table for
#: any other column), or ``None`` where it does not follow; the layer that makes parts of a
#: kind registers its carrier here (attention registers ``"runs"``)
CARRY: dict[str, Callable[[Any, Any, tuple, Any], Any]] = {}


class Plan:
    """The host's plan of one index: named parts, each made once by a ``make`` the caller
    gives and kept while the index's tensors hold the values they were made from."""

    def __init__(self) -> None:
        # plain attributes only: a compiler rebuilding an index inside a trace makes one too
        #: host copies of the index's tensors the parts were made from; None before any
        self._values: tuple[np.ndarray, ...] | None = None
        self._parts: dict[tuple, Any] = {}
        #: parts made so far (by every ``make`` called): what a test or benchmark counts
        self.made = 0

    # -- the values the parts were made from -------------------------------------------------
    def fits(self, tensors: Sequence[Any]) -> bool:
        """Whether the parts were made from the values ``tensors`` (an index's, in its walk
        order) hold now."""
        values = self._values
        return values is not None and _equal(values, [to_host(t) for t in tensors])

    def follow(self, tensors: Sequence[Any]) -> Plan:
        """This plan, its parts dropped first where ``tensors`` no longer hold the values they
        were made from. Called once per call, before any part is read."""
        now = [to_host(t) for t in tensors]
        with _LOCK:
            if self._values is None or not _equal(self._values, now):
                self._values = tuple(np.array(v, copy=True) for v in now)
                self._parts = {}
        return self

    # -- its parts ---------------------------------------------------------------------------
    #: the kinds of part, each keyed by what it depends on beyond the index's values
    KINDS = {
        "store": "(n,): the backend's plan of the call's stores into a pool of n slots",
        "read": "(n,): the shape and backend's plan of extend's read of a pool of n slots",
        "tile": "(columns..., n): one tile's read of a pool of n slots",
        "runs": "(n, shape of tiles...): each lane's runs of slots and the pieces its views read",
        "share": "(n, heads, tile): the lanes sharing a prefix and its width, JAX's static "
                 "argument",
    }

    def part(self, kind: str, key: tuple, make: Callable[[], Any],
             keep: Callable[[Any], bool] | None = None) -> Any:
        """The part ``kind`` (one of :attr:`KINDS`) for ``key``: the one kept, else
        ``make()``, kept for the next layer unless ``keep`` says no (a traced value)."""
        full = (kind, *key)
        with _LOCK:
            if full in self._parts:
                return self._parts[full]
        value = make()
        if keep is None or keep(value):
            with _LOCK:
                self.made += 1
                self._parts.setdefault(full, value)
        return value

    # -- across advance() --------------------------------------------------------------------
    def advanced(self, index: Any, nxt: Any) -> Plan:
        """The plan of ``nxt``, ``index.advance()``: each part of this one that a carrier
        registered for its kind (:data:`CARRY`) gives again for ``nxt``; the rest are made
        anew when asked. Nothing is carried from a plan that no longer fits ``index``, nor to
        an ``nxt`` over another table that differs from ``index``'s at one of its columns on
        a lane's row (:func:`keeps_columns`)."""
        plan = Plan()
        with _LOCK:
            parts = {k: p for k, p in self._parts.items() if k[0] in CARRY}
        if not parts or not self.fits(index.tensors()):  # nothing to carry: no comparison
            return plan
        if nxt.table is not index.table and not keeps_columns(index, nxt):
            return plan
        for (kind, *key), part in parts.items():
            carry = CARRY.get(kind)
            got = None if carry is None else carry(index, nxt, tuple(key), part)
            if got is not None:
                plan._parts[(kind, *key)] = got
        if plan._parts:
            plan._values = tuple(np.array(to_host(t), copy=True) for t in nxt.tensors())
        return plan

    def __repr__(self) -> str:
        names = sorted({k[0] for k in self._parts})
        return f"Plan({', '.join(names) or 'empty'}, made={self.made})"


#: one lock for every plan's parts (each section under it is a few dictionary operations)
_LOCK = threading.Lock()


class Recent:
    """The last few plans made for indices rebuilt from their tensors (a compiled step's
    operator gets tensors, never the index): one is handed out again only where it
    :meth:`~Plan.fits` the tensors' values, so every layer of a step shares one."""

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._plans: list[tuple[Any, Plan]] = []

    def plan(self, structure: Any, tensors: Sequence[Any]) -> Plan:
        """A plan of ``structure`` that fits ``tensors``, or a new one kept for the next (the
        call's own :meth:`~Plan.follow` takes its values)."""
        with _LOCK:
            found = [p for s, p in self._plans if s == structure]
        for p in found:
            if p.fits(tensors):
                return p
        p = Plan()
        with _LOCK:
            self._plans = [(structure, p), *self._plans][: self._size]
        return p


def keeps_columns(index: Any, nxt: Any) -> bool:
    """Whether ``nxt``'s table holds, on the row each lane of ``index`` reads (its row map's,
    row 0 for a lane of padding, as :attr:`~cacheidx.CacheIndex.lane_table` reads), the values
    ``index``'s table holds at every one of its columns; compared on the host."""
    old, new = to_host(index.table), to_host(nxt.table)
    rows, width = old.shape
    if new.shape[0] != rows or new.shape[1] < width or new.dtype != old.dtype:
        return False
    if index.row is None:
        return bool(np.array_equal(new[:, :width], old))
    row = to_host(index.row)
    lanes = np.unique(np.where((row >= 0) & (row < rows), row, 0))
    return bool(np.array_equal(new[lanes, :width], old[lanes]))


def _equal(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))
