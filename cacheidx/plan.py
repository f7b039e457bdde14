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
index's values are no longer those the parts were made from (a table refilled in place, the
CUDA-graph idiom, or written behind the library's back through NumPy): a plan never outlives
its values. Traced, there is no plan: a compiled step derives its parts inside the program,
where the compiler shares them between layers.

Law (host first): **an eager decode step on a device backend copies nothing from the device
to the host except the sampled tokens.** The values a plan is made from are the host's own
(:meth:`CacheIndex.host <cacheidx.CacheIndex.host>`): the NumPy arrays the index was built
from, the next positions :meth:`~cacheidx.CacheIndex.advance` works out on the host, or those
a writer declares (:meth:`~cacheidx.CacheIndex.refilled`, ``advance(table=, host=)``: the
serving engine declares every table it writes), never a device tensor read back. Only a tensor
in host memory (``Backend.on_host``: NumPy's, a CPU tensor) is compared with them, which costs
no copy. Attention keeps the rest of the law: its runs and tiles are found on the host index,
and a tile's product on a device is weighed with its non-finite values selected out, never
asked whether it is finite (:class:`~cacheidx.attention.softmax.Online`).
tests/test_device_reads.py counts every read of an engine's decode steps on torch and JAX.
(FlashInfer's ``plan()`` copies its page table's ``indptr`` to the host once per batch for the
same reason; here the host keeps the values it wrote.)

:meth:`CacheIndex.advance <cacheidx.CacheIndex.advance>` carries its index's plan to the next
token's index where the next plan follows from the last (:meth:`Plan.advanced`), over the same
table or over one that holds the same values at the old table's columns (:func:`keeps_columns`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import pytree
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
        #: the index's host values (:meth:`CacheIndex.host
        #: <cacheidx.CacheIndex.host>`) the parts were made from; None before any
        self._values: tuple[np.ndarray, ...] | None = None
        self._parts: dict[tuple, Any] = {}
        #: parts made so far (by every ``make`` called): what a test or benchmark counts
        self.made = 0

    # -- the values the parts were made from -------------------------------------------------
    @property
    def values(self) -> tuple[np.ndarray, ...] | None:
        """The host values the parts were made from (``None`` before any): never written to."""
        return self._values

    def fits(self, values: Sequence[np.ndarray]) -> bool:
        """Whether the parts were made from ``values`` (an index's host values, in its walk
        order: ``pytree.leaves(index.host())``)."""
        kept = self._values
        return kept is not None and _equal(kept, values)

    def follow(self, values: Sequence[np.ndarray]) -> Plan:
        """This plan, its parts dropped first where ``values`` (an index's host values, which
        it keeps and never writes to) are not those they were made from. Called once per call,
        before any part is read."""
        with _LOCK:
            if self._values is None or not _equal(self._values, values):
                self._values = tuple(values)
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
        if not parts or not self.fits(pytree.leaves(index.host())):  # nothing to carry
            return plan
        if nxt.table is not index.table and not keeps_columns(index, nxt):
            return plan
        for (kind, *key), part in parts.items():
            carry = CARRY.get(kind)
            got = None if carry is None else carry(index, nxt, tuple(key), part)
            if got is not None:
                plan._parts[(kind, *key)] = got
        if plan._parts:
            plan._values = tuple(pytree.leaves(nxt.host()))
        return plan

    def __repr__(self) -> str:
        names = sorted({k[0] for k in self._parts})
        return f"Plan({', '.join(names) or 'empty'}, made={self.made})"


#: one lock for every plan's parts (each section under it is a few dictionary operations)
_LOCK = threading.Lock()


class Recent:
    """The last few plans made for indices rebuilt from their tensors (a compiled step's
    operator gets tensors, never the index): one is handed out again only where it
    :meth:`~Plan.fits` the tensors' values, so every layer of a step shares one. The tensors
    lie in host memory (torch's operator runs on the CPU alone), read with no copy."""

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._plans: list[tuple[Any, Plan]] = []

    def plan(self, structure: Any, tensors: Sequence[Any]) -> Plan:
        """A plan of ``structure`` that fits ``tensors``, or a new one kept for the next (the
        call's own :meth:`~Plan.follow` takes its values)."""
        with _LOCK:
            found = [p for s, p in self._plans if s == structure]
        values = [_int64(to_host(t)) for t in tensors] if found else []
        for p in found:
            if p.fits(values):
                return p
        p = Plan()
        with _LOCK:
            self._plans = [(structure, p), *self._plans][: self._size]
        return p


def keeps_columns(index: Any, nxt: Any) -> bool:
    """Whether ``nxt``'s table holds, on the row each lane of ``index`` reads (its row map's,
    row 0 for a lane of padding, as :func:`cacheidx.masks.lane_table` reads), the values
    ``index``'s table holds at every one of its columns; compared on the host's values
    (:meth:`~cacheidx.CacheIndex.host`)."""
    index, nxt = index.host(), nxt.host()
    old, new = index.table, nxt.table
    rows, width = old.shape
    if new.shape[0] != rows or new.shape[1] < width or new.dtype != old.dtype:
        return False
    if index.row is None:
        return bool(np.array_equal(new[:, :width], old))
    row = index.row
    lanes = np.unique(np.where((row >= 0) & (row < rows), row, 0))
    return bool(np.array_equal(new[lanes, :width], old[lanes]))


def _equal(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x is y or (
        x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y))
        for x, y in zip(a, b))


def _int64(a: np.ndarray) -> np.ndarray:
    """Index values as an index's host keeps them (:meth:`~cacheidx.CacheIndex.host`)."""
    return a.astype(np.int64) if a.dtype.kind in "iu" and a.dtype != np.int64 else a


def follow(index: Any) -> Plan:
    """``index.plan``, its parts dropped first where the index's host values
    (:meth:`CacheIndex.host <cacheidx.CacheIndex.host>`) are no longer those they were made
    from (:meth:`Plan.follow`). Every eager call asks it once, before any layer reads a part;
    traced, it does nothing."""
    if not index.backend.tracing(index.pos):
        index.plan.follow(pytree.leaves(index.host()))
    return index.plan


def planned(index: Any, kind: str, key: tuple, make: Any) -> Any:
    """The part ``kind`` of ``index.plan`` for ``key`` (:meth:`Plan.part`), kept for every
    later layer; traced, ``make()`` itself, computed inside the program (so is a part whose
    values are traced: an index a compiled step closes over)."""
    backend = index.backend
    if backend.tracing(index.pos):
        return make()
    return index.plan.part(kind, key, make,
                           keep=lambda v: not any(backend.tracing(a) for a in arrays(v)))


def arrays(value: Any) -> list[Any]:
    """The arrays in ``value``: itself, or those of a (named) tuple, nested."""
    if isinstance(value, tuple):
        return [a for part in value for a in arrays(part)]
    return [value] if hasattr(value, "shape") else []
