"""The array part of a backend: what the index and attention move data with (the protocol
:class:`~cacheidx.backends.protocols.Arrays`), each member written against the array API
standard alone, so that a library's part overrides only what it does better.

The standard has no scatter, so this is the one operation the core cannot express itself:
``scatter`` (store rows at slot numbers, dropping every number outside the pool); here it is
a sort and ``searchsorted``. Law (store with drop): a slot outside ``[0, len(pool))`` stores
nothing, and without ``donate`` the caller's pool never changes; a read is exactly zero where
not ``ok``, whatever the pool holds there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import array_api_compat as compat

from ..laws import expand, inside
from .hostmemory import PAGE_BYTES

__all__ = ["PAGE_BYTES", "StandardArrays", "redirect_dropped"]


class _Library(Protocol):
    """What the array part asks of the library part it is composed with."""

    xp: Any
    module: str | None

    def _made_by(self, x: Any) -> bool: ...


class StandardArrays:
    """Stores with drop, reads exactly zero where unseen, placement and where arrays lie:
    the standard's way. ``xp`` is the library part's namespace."""

    xp: Any

    def scatter(self, pool: Any, slots: Any, rows: Any, *, donate: bool = False) -> Any:
        """``pool`` with ``rows[i]`` stored at slot ``slots[i]``; a slot outside the pool stores
        nothing. With ``donate`` the pool's memory may be reused; without it the caller's pool is
        never changed.

        Standard-only: sort the targets, then let each slot find the token aimed at it with
        ``searchsorted``. Static shapes, no boolean indexing; costs O(slots) as it copies.
        """
        xp = self.xp
        n = pool.shape[0]
        if n == 0 or slots.shape[0] == 0:
            return pool
        every_slot = xp.arange(n, dtype=slots.dtype, device=compat.device(pool))
        target = xp.where(inside(slots, n), slots, -1)
        order = xp.argsort(target, stable=True)
        ranked = self.take(target, order)
        last = xp.searchsorted(ranked, every_slot, side="right") - 1
        last = xp.clip(last, 0, None)
        hit = self.take(ranked, last) == every_slot
        stored = self.take(rows, self.take(order, last))
        return xp.where(expand(xp, hit, pool.ndim), stored, pool)

    def gather(self, pool: Any, slots: Any, ok: Any) -> Any:
        """Rows ``pool[slots[i]]`` where ``ok[i]``, exactly zero elsewhere (whatever the pool
        holds there, NaN included). ``ok`` already implies the slot is inside the pool."""
        xp = self.xp
        if pool.shape[0] == 0:
            return xp.zeros((slots.shape[0], *pool.shape[1:]), dtype=pool.dtype,
                            device=compat.device(pool))
        safe = xp.where(ok, slots, 0)
        got = self.take(pool, safe)
        return xp.where(expand(xp, ok, pool.ndim), got, 0)

    # -- plans: what an index keeps for every layer's pool of the same size ----------------
    def store_plan(self, slots: Any, n: int) -> Any:
        """What ``store`` needs to store at ``slots`` in a pool of ``n`` slots. An index keeps
        it (eagerly) for every layer's pool, so a backend does here, once, the work that
        depends only on the slots: finding the dropped stores, say."""
        return slots

    def store(self, pool: Any, plan: Any, rows: Any, *, donate: bool = False) -> Any:
        """``scatter`` at the slots ``plan`` (from ``store_plan``) was made from."""
        return self.scatter(pool, plan, rows, donate=donate)

    def read_plan(self, slots: Any, ok: Any, n: int) -> Any:
        """What ``read`` needs to gather ``slots`` where ``ok`` from a pool of ``n`` slots,
        kept like ``store_plan``'s."""
        return slots, ok

    def read(self, pool: Any, plan: Any) -> Any:
        """``gather`` of the slots and gate ``plan`` (from ``read_plan``) was made from."""
        return self.gather(pool, *plan)

    def one_program(self, fn: Callable, *, donate_argnums: Sequence[int] = (),
                    static_argnums: Sequence[int] = ()) -> Callable:
        """``fn`` as an eager call of the index runs it: where the library compiles each eager
        operation apart (JAX), one compiled program of the whole call, kept per structure,
        shape and value of ``static_argnums``, given up ``donate_argnums``; ``fn`` itself
        elsewhere (the library's eager operations are its fast path)."""
        return fn

    def take(self, x: Any, at: Any, axis: int = 0) -> Any:
        """``xp.take(x, at, axis=axis)`` where every index is inside ``[0, x.shape[axis])``, as
        the core's are (it clamps or masks each first), so a library's handling of negative
        indices, which the standard leaves unspecified, has nothing to do."""
        return self.xp.take(x, at, axis=axis)

    def from_host(self, a: Any, dtype: Any = None, device: Any = None) -> Any:
        """``a`` (a NumPy array, or anything ``asarray`` takes) as an array of this library,
        in ``dtype`` (the library's choice for ``a`` without one) on ``device``."""
        return self.xp.asarray(a, dtype=dtype, device=device)

    def zeros(self, shape: tuple[int, ...], dtype: Any, device: Any = None) -> Any:
        """A pool's memory: zeros of ``shape`` and ``dtype`` on ``device``. Where the host
        reads it in place (NumPy, CPU tensors), its first element at a memory page's start
        (:data:`PAGE_BYTES`), so that a page of slots whose bytes are a multiple of a memory
        page's lies on whole memory pages: the processor's prefetcher stops at each memory page's
        end, and a pool page that straddles two is read in two pieces (one 16k-token layer of 8
        lanes, float32, the CPU kernel, one thread: 1.04x to 1.2x faster page-aligned than
        16 or 64 bytes past a page, where torch and NumPy start their arrays). The standard's
        ``zeros`` here."""
        return self.xp.zeros(shape, dtype=dtype, **({} if device is None else {"device": device}))

    def to_device(self, x: Any, device: Any) -> Any:
        return compat.to_device(x, device)

    def device(self, x: Any) -> Any:
        """Where ``x`` lies, for building arrays beside it."""
        return compat.device(x)

    def same_library(self: _Library, x: Any) -> bool:
        """Whether ``x`` is an array this backend computes on (cheap: no namespace lookup,
        so that it traces under a compiler)."""
        if self.module is not None:
            # an instance's library is imported (its namespace is resolved): no sys.modules
            # lookup, which a compiler would realise whole (60 ms a call under torch.compile)
            return self._made_by(x)
        try:
            return compat.array_namespace(x) is self.xp
        except TypeError:
            return False

    def tracing(self, x: Any) -> bool:
        """Whether ``x`` is a value being traced by a compiler (not a concrete array): the
        library's one tracing predicate, which every floor asks (the index has no plan, the
        runs and tiles find nothing on the host, a tile's product is never asked whether it
        is finite) rather than asking an array."""
        return False

    def on_host(self, x: Any) -> bool:
        """Whether ``x`` is concrete (not :meth:`tracing`) and lies in host memory that the host
        reads with no copy and no wait for a device: there an index compares its tensors with the
        host values its plan was made from (:func:`cacheidx.plan.host`), and a tile's product
        is asked whether it is finite. Elsewhere (a device: ``False``, the default) nothing is read
        back (:mod:`cacheidx.plan`'s law)."""
        return False


def redirect_dropped(xp: Any, pool: Any, slots: Any, rows: Any, *,
                     take: Any = None) -> tuple[Any, Any]:
    """Targets all inside the pool, and rows, whose plain indexed store equals a store with drop.

    Libraries whose indexed store wraps ``-1`` or raises on an outside index (torch, CuPy) get
    targets they cannot misread. A dropped row is sent to the slot of the first kept row and
    carries that row's values, so it repeats a store that happens anyway; with no kept row it
    rewrites slot 0 with what slot 0 holds. Sending it to slot 0 with its own values would
    clobber a real write there. Static shapes: no boolean indexing, no host sync. ``take``:
    the library's take of indices inside the array (:meth:`Backend.take`), ``xp.take`` without.
    """
    take = take or (lambda x, at: xp.take(x, at, axis=0))
    keep = inside(slots, pool.shape[0])
    first = xp.reshape(xp.argmax(xp.astype(keep, xp.int8)), (1,))
    some = xp.any(keep)
    anchor_slot = xp.where(some, take(slots, first), 0)
    anchor_row = xp.where(some, take(rows, first), pool[0:1, ...])
    target = xp.where(keep, slots, anchor_slot)
    return target, xp.where(expand(xp, keep, rows.ndim), rows, anchor_row)
