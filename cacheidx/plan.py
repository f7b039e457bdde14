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
(:func:`host`): the NumPy arrays the index was built
from, the next positions :meth:`~cacheidx.CacheIndex.advance` works out on the host, or those
a writer declares (:func:`refilled`, ``advance(table=, host=)``: the
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

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from . import _arguments as arguments
from . import backends, pytree
from .devices import to_host

__all__ = ["CARRY", "Known", "Plan", "Recent", "declare", "host", "keeps_columns", "refilled",
           "taken"]

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
        #: the index's host values (:func:`host`) the parts were made from; None before any
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
        order: ``pytree.leaves(host(index))``)."""
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
        "shared": "(n, heads): the lanes sharing a prefix and its width, that the tiles read "
                  "once",
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
        if not parts or not self.fits(pytree.leaves(host(index))):  # nothing to carry
            return plan
        if nxt.table is not index.table and not keeps_columns(index, nxt):
            return plan
        for (kind, *key), part in parts.items():
            carry = CARRY.get(kind)
            got = None if carry is None else carry(index, nxt, tuple(key), part)
            if got is not None:
                plan._parts[(kind, *key)] = got
        if plan._parts:
            plan._values = tuple(pytree.leaves(host(nxt)))
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
    (:func:`host`)."""
    index, nxt = host(index), host(nxt)
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
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _int64(a: np.ndarray) -> np.ndarray:
    """Index values as an index's host keeps them (:func:`host`): integers as int64."""
    return a.astype(np.int64) if a.dtype.kind in "iu" and a.dtype != np.int64 else a


def follow(index: Any) -> Plan:
    """``index.plan``, its parts dropped first where the index's host values
    (:func:`host`) are no longer those they were made
    from (:meth:`Plan.follow`). Every eager call asks it once, before any layer reads a part;
    traced, it does nothing."""
    if not index.backend.tracing(index.pos):
        index.plan.follow(pytree.leaves(host(index)))
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


# -- the host's values of an index --------------------------------------------------------------
class Known:
    """The host's values of one index's tensors (its ``known`` field): NumPy arrays by leaf
    name (:func:`cacheidx.pytree.leaf_names`), never written to, and the host index last made
    of them (:func:`host`). Not an index's field of value: ``dataclasses.replace`` never copies
    it, and a derived index is handed the values of the tensors it keeps."""

    __slots__ = ("index", "values")

    def __init__(self) -> None:
        self.values: dict[str, np.ndarray] = {}
        self.index: Any = None


def host(index: Any) -> Any:
    """``index`` over NumPy arrays of the values its tensors hold, as the host knows them: the
    values it was built from (a constructor's, ``advance()``'s next positions, a writer's
    declaration: :func:`refilled`), never read back from a device. A tensor in host memory
    (NumPy's, a CPU tensor: ``Backend.on_host``) is compared with them, which costs no copy,
    and copied again where it holds other values now (written in place behind the library's
    back); a device tensor the host was never told the values of (an array handed to
    :func:`~cacheidx.make` or ``select``) is read once, the first time they are asked for.
    Integers are int64 on the host. The plan is made from these values, and so are the runs a
    call reads.

    Raises on a traced index, which has no values."""
    backend = index.backend
    if backend.tracing(index.pos):
        raise arguments.fail("plan.host", "a traced index has no values on the host")
    names, tensors = pytree.leaf_names(index.structure), pytree.leaves(index)
    kept = getattr(_TAKEN, "on", False)  # inside advance(): the known values as they are
    with _HOST:
        known = index.known
        values, changed = known.values, known.index is None
        for name, t in zip(names, tensors, strict=True):
            have = values.get(name)
            if kept and have is not None:
                continue
            if backend.on_host(t):
                now = _int64(to_host(t))
                if have is None or not _same(have, now):
                    values[name] = np.array(now, copy=True)
                    changed = True
            elif have is None:  # never told: read back once
                values[name] = np.array(_int64(to_host(t)), copy=True)
                changed = True
        if changed:
            known.index = pytree.rebuild(index.structure, [values[n] for n in names],
                                         backend=backends.get("numpy"))
        return known.index


def refilled(index: Any, values: Sequence[Any]) -> Any:
    """Declares that ``index``'s tensors hold ``values`` now (NumPy, one for each of
    :func:`~cacheidx.pytree.leaves`, in its order): the writer's word, where it wrote them in
    place (a CUDA graph's buffers refilled, the engine's copies) or made them from these
    values. The plan follows (its parts are made anew where the values differ from those they
    were made from), and nothing is read back from the device. The index keeps ``values``: the
    caller writes no more into them. Returns the index.

    Raises if ``values`` does not hold one array of each tensor's shape."""
    names = pytree.leaf_names(index.structure)
    values = list(values)
    if len(values) != len(names):
        raise arguments.fail("plan.refilled", f"the index has {len(names)} tensors "
                             f"({', '.join(names)}), got {len(values)} values")
    declare("plan.refilled", index, names, values)
    with _HOST:
        index.known.index = None
    return index


def declare(fn: str, index: Any, names: Sequence[str], values: Sequence[Any], *,
            wrong: str = "{name} has shape {tensor}, its values {values}") -> None:
    """The writer's word that ``index``'s tensors named ``names`` (leaf names) hold ``values``
    (NumPy, in that order): kept as their host values (:func:`refilled`'s, and ``advance``'s
    ``host=``). Raises naming ``fn`` if a value's shape is not its tensor's (``wrong`` says it:
    a format of ``name``, ``short``, the name past ``tokens.``, and the two shapes)."""
    tensors = dict(zip(pytree.leaf_names(index.structure), pytree.leaves(index), strict=True))
    given = {}
    for name, v in zip(names, values, strict=True):
        t, v = tensors[name], _int64(np.asarray(v))
        if tuple(v.shape) != tuple(t.shape):
            raise arguments.fail(fn, wrong.format(
                name=name, short=name.removeprefix("tokens."), tensor=list(t.shape),
                values=list(v.shape)))
        if index.backend.on_host(t) and np.may_share_memory(v, to_host(t)):
            v = np.array(v, copy=True)  # compared with the tensor: not its memory
        given[name] = v
    with _HOST:
        index.known.values.update(given)


@contextlib.contextmanager
def taken() -> Iterator[None]:
    """Within it (in this thread), :func:`host` takes the values it knows without comparing a
    tensor: ``advance()`` works out the next index's host values and plan so, and the next
    index's first call compares its tensors in host memory with them."""
    _TAKEN.on = True
    try:
        yield
    finally:
        _TAKEN.on = False


#: one lock for every index's host values (each section under it a few comparisons)
_HOST = threading.Lock()
#: set (in this thread) inside :func:`taken`
_TAKEN = threading.local()


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b))
