"""Fixed-size pages with reference counts, and a plan walked through them.

Laws of :class:`Pages`, a pool of ``capacity`` pages:

1. A page is free or live; a live page has a count >= 1, a free page 0.
2. ``alloc(k)`` makes ``k`` free pages live with count 1; ``retain`` adds 1 to live pages;
   ``release`` subtracts 1 and frees a page at 0. Nothing else frees a page, so a page
   is never freed while a count on it is held.
3. An operation that cannot be done in full (too few free pages, a free or foreign page)
   raises a :class:`PageError` naming the operation and the value, and changes nothing.

The two strategies of ``spec/prefix-sharing.txt``, walking a plan in order, one prompt at
a time, each prompt allocating its own pages when it arrives:

* ``"keep"``: once a prompt has computed, it keeps only the pages its descendants will read
  (its own pages below the largest ``shared`` of its children) and frees the rest at once; a
  kept page counts its readers to come, each reader releases it after computing, and it is
  freed after the last.
* ``"count"``: a page counts the prompts holding it, its owner and every borrower. A child
  retains the pages it borrows when it arrives; a prompt releases all its pages once it has
  computed and all its children have arrived (before that it is held, so its pages cannot
  be freed before a child retains them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from .plan import Plan

__all__ = ["STRATEGIES", "PageError", "Pages", "Simulation", "simulate", "walk"]

STRATEGIES = ("keep", "count")
_WHERE = "cacheidx.prefix.Pages"


class PageError(RuntimeError):
    """An allocator operation that could not be done; the allocator is unchanged."""


class Pages:
    """A pool of ``capacity`` pages with reference counts (see the module's laws)."""

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise TypeError(f"{_WHERE}: capacity must be an integer, got {capacity!r}")
        if capacity < 0:
            raise ValueError(f"{_WHERE}: capacity must be >= 0, got {capacity}")
        self._counts = np.zeros(int(capacity), dtype=np.int64)
        # Free pages are a stack: the most recently freed page is reused first, which is
        # what exposes a page freed too early in the tests.
        self._free = np.arange(int(capacity) - 1, -1, -1, dtype=np.int64)
        self._top = int(capacity)
        self.peak = 0  #: the most pages live at once so far

    @property
    def capacity(self) -> int:
        return int(self._counts.size)

    @property
    def live(self) -> int:
        """Pages live now."""
        return self.capacity - self._top

    @property
    def counts(self) -> np.ndarray:
        """Each page's count, a copy."""
        return self._counts.copy()

    def alloc(self, k: int) -> np.ndarray:
        """``k`` free pages, now live with count 1 (law 2); ``PageError`` when fewer are free."""
        k = int(k)
        if k < 0:
            raise ValueError(f"{_WHERE}.alloc: cannot allocate {k} pages")
        if k > self._top:
            raise PageError(
                f"{_WHERE}.alloc: out of pages, {k} asked, {self._top} free of {self.capacity}"
            )
        pages = self._free[self._top - k : self._top][::-1].copy()
        self._top -= k
        self._counts[pages] = 1
        self.peak = max(self.peak, self.live)
        return pages

    def retain(self, pages) -> None:
        """Adds 1 to each live page named (a page named twice, 2); ``PageError`` on a free one."""
        pages = self._live(pages, "retain")
        np.add.at(self._counts, pages, 1)

    def release(self, pages) -> None:
        """Subtracts 1 from each page named and frees those reaching 0; ``PageError`` when a
        page is released more often than it is held (a double release)."""
        pages = self._live(pages, "release")
        pages = np.sort(pages)
        # Sorted, repeats are neighbours; they are rare, so counting them is the slow path.
        repeats = pages[1:] == pages[:-1]
        if repeats.any():
            pages, times = np.unique(pages, return_counts=True)
        else:
            times = np.ones(pages.size, dtype=np.int64)
        over = np.flatnonzero(times > self._counts[pages])
        if over.size:
            p, t = int(pages[over[0]]), int(times[over[0]])
            raise PageError(
                f"{_WHERE}.release: page {p} released {t} times, held "
                f"{int(self._counts[p])} (double release)"
            )
        self._counts[pages] -= times
        freed = pages[self._counts[pages] == 0]
        self._free[self._top : self._top + freed.size] = freed[::-1]
        self._top += freed.size

    def _live(self, pages, op: str) -> np.ndarray:
        """``pages`` as int64, checked to be live pages of this pool."""
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        foreign = pages[(pages < 0) | (pages >= self.capacity)]
        if foreign.size:
            raise PageError(
                f"{_WHERE}.{op}: page {int(foreign[0])} is not in a pool of {self.capacity}"
            )
        dead = pages[self._counts[pages] == 0]
        if dead.size:
            what = "double release" if op == "release" else "read after free"
            raise PageError(f"{_WHERE}.{op}: page {int(dead[0])} is free ({what})")
        return pages


@dataclasses.dataclass(frozen=True)
class Simulation:
    """What walking a plan through a pool took."""

    strategy: str
    peak: int  #: the most pages live at once
    pages: int  #: pages allocated in all (the plan's ``pages``)
    #: the pool pages of each prompt while it computed, aligned with order, padded with -1
    tables: np.ndarray = dataclasses.field(repr=False)


def walk(plan: Plan, strategy: str = "count", pool: Pages | None = None) -> Iterator:
    """Walks ``plan`` in order through ``pool`` (by default one of ``plan.pages`` pages) under
    ``strategy``, yielding ``(i, table)`` while prompt ``order[i]`` computes: ``table`` names the
    pool pages holding its tokens, all of them live. Raises :class:`PageError` when the pool
    runs out, or if a page read were free."""
    if strategy not in STRATEGIES:
        raise ValueError(
            f"cacheidx.prefix.walk: strategy must be one of {STRATEGIES}, got {strategy!r}"
        )
    pool = Pages(plan.pages) if pool is None else pool
    tables, npages, borrowed = plan.tables(), plan.npages, plan.borrowed
    where = np.full(plan.pages, -1, dtype=np.int64)  # plan page -> pool page
    step = _keep if strategy == "keep" else _count
    for i, table in step(plan, pool, tables, npages, borrowed, where):
        free = table[pool._counts[table] == 0]
        if free.size:
            raise PageError(
                f"cacheidx.prefix.walk: prompt {int(plan.order[i])} reads free page {int(free[0])}"
            )
        yield i, table


def _keep(plan, pool, tables, npages, borrowed, where):
    """Strategy "keep": a page's count is its owner while computing, then its readers to come."""
    readers = np.bincount(tables[tables >= 0], minlength=plan.pages) - 1
    for i in range(len(plan)):
        row = tables[i, : npages[i]]
        own = row[borrowed[i] :]
        where[own] = pool.alloc(own.size)
        table = where[row]
        yield i, table
        # Readers first, then the owner lets go: pages nobody reads are freed now.
        pool.retain(np.repeat(table[borrowed[i] :], readers[own]))
        pool.release(table[borrowed[i] :])
        pool.release(table[: borrowed[i]])


def _count(plan, pool, tables, npages, borrowed, where):
    """Strategy "count": a page's count is the prompts holding it."""
    n = len(plan)
    at = np.empty(n, dtype=np.int64)
    at[plan.order] = np.arange(n)
    up = np.where(plan.parent >= 0, at[np.maximum(plan.parent, 0)], -1)
    waiting = np.bincount(up[up >= 0], minlength=n)  # children yet to arrive
    for i in range(n):
        row = tables[i, : npages[i]]
        own = row[borrowed[i] :]
        where[own] = pool.alloc(own.size)
        table = where[row]
        pool.retain(table[: borrowed[i]])
        p = up[i]
        if p >= 0:
            waiting[p] -= 1
            if not waiting[p]:  # its last child has arrived: the parent lets go
                pool.release(where[tables[p, : npages[p]]])
        yield i, table
        if not waiting[i]:
            pool.release(table)


def simulate(plan: Plan, strategy: str = "count", pool: Pages | None = None) -> Simulation:
    """Walks ``plan`` (see :func:`walk`) and reports pages at peak; raises :class:`PageError`
    if pages leak (some still live at the end)."""
    pool = Pages(plan.pages) if pool is None else pool
    before = pool.live
    tables = np.full((len(plan), int(plan.npages.max(initial=0))), -1, dtype=np.int64)
    for i, table in walk(plan, strategy, pool):
        tables[i, : table.size] = table
    if pool.live != before:
        raise PageError(f"cacheidx.prefix.simulate: {pool.live - before} pages leaked")
    return Simulation(strategy, pool.peak, plan.pages, tables)
