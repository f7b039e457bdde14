"""One group's pool of pages for the online prefix cache, and the heap it evicts from (as
vLLM keeps its ``BlockPool`` apart from the managers that use it).

Law 1 of :mod:`.cache`, counted: every page of the pool is free, owned by one request, or
cached. Free pages are those freed since, a stack, then those from ``fresh`` on, never used
(a number, so that a pool of any size costs nothing to make). Cached pages that may go sit
in a heap ordered by the cache's ``policy``; an entry whose node changed since it was pushed
is stale, skipped when popped and dropped when the heap is rebuilt. Which entry is current is
the group manager's law (:mod:`.full`, :mod:`.sliding`); the pool only keeps the order.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable
from typing import Any

from .tree import CachedPage

__all__ = ["GroupPages", "Pool"]

#: whether a heap entry ``(key, push, stamp, node)`` still names a page that may go
Current = Callable[[tuple], bool]


@dataclasses.dataclass(frozen=True)
class GroupPages:
    """One group's pool, now: its ``window`` (``None``: full layers) and pages ``free``,
    ``cached``, ``evictable`` (cached, read by no one), ``in_use`` (held by requests) and,
    of a sliding group, ``reserved``: the most pages each running request holds at once,
    summed (law 7: never more than ``capacity``, and never less than ``in_use``)."""

    window: int | None
    capacity: int
    free: int
    cached: int
    evictable: int
    in_use: int
    reserved: int


class Pool:
    """``capacity`` pages, counted (law 1), and the heap of those that may be evicted, in the
    order of ``policy`` (the smallest key first, then the earliest pushed)."""

    __slots__ = ("capacity", "freed", "fresh", "cached", "unread", "reserved", "heap",
                 "policy", "evicted", "_pushes")

    def __init__(self, capacity: int, policy: Callable[[CachedPage], Any]):
        self.capacity = capacity
        self.freed: list[int] = []
        self.fresh = 0
        self.cached = 0
        self.unread = 0  # cached pages without readers: what eviction can free
        self.reserved = 0  # the most pages each running hold holds at once, summed (law 7)
        self.heap: list[tuple[Any, int, int, CachedPage]] = []
        self.policy = policy
        self.evicted = 0  #: pages evicted so far
        self._pushes = itertools.count()

    @property
    def free(self) -> int:
        return len(self.freed) + self.capacity - self.fresh

    @property
    def in_use(self) -> int:
        """Pages running requests hold: their own and the cached ones they read."""
        return self.capacity - self.free - self.unread

    def take(self, k: int) -> list[int]:
        """``k`` free pages: the freed ones first, the last freed first."""
        taken = min(k, len(self.freed))
        got = self.freed[len(self.freed) - taken :][::-1]
        del self.freed[len(self.freed) - taken :]
        got += range(self.fresh, self.fresh + k - taken)
        self.fresh += k - taken
        return got

    def uncache(self, page: int) -> None:
        """A cached page read by no one is evicted: it is free again."""
        self.freed.append(page)
        self.cached -= 1
        self.unread -= 1
        self.evicted += 1

    def push(self, node: CachedPage, stamp: int, current: Current) -> None:
        """``node``'s page may go, under ``stamp``; once stale entries outnumber the cached
        pages twice over, the heap keeps only the ``current`` ones."""
        heapq.heappush(self.heap, (self.policy(node), next(self._pushes), stamp, node))
        if len(self.heap) > 2 * self.cached + 64:
            self.heap = [e for e in self.heap if current(e)]
            heapq.heapify(self.heap)

    def pop(self, current: Current) -> CachedPage:
        """The node of the first ``current`` entry in the policy's order, its entry gone.
        Only called while a page is evictable, so the heap holds a current entry."""
        while True:
            entry = heapq.heappop(self.heap)
            if current(entry):
                return entry[3]

    def now(self, window: int | None) -> GroupPages:
        """What the pool holds now, for a group of ``window``."""
        return GroupPages(window, self.capacity, self.free, self.cached, self.unread,
                          self.in_use, self.reserved)
