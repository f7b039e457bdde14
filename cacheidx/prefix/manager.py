"""One manager per kind of group of layers, behind one interface (as vLLM's
``single_type_kv_cache_manager.py``): what a request holds of one group's pool, and what of
it the tree keeps. :class:`PrefixCache <.cache.PrefixCache>` calls each operation on every
group in turn; :mod:`.full` and :mod:`.sliding` are the kinds, and the only one the cache
knows is the full group, whose readers are the tree's.

A request's part in one group is a :class:`~.hold.GroupHold`; the
:class:`~.hold.Hold` of a request holds its path in the tree and one part per group.
"""

from __future__ import annotations

from .hold import GroupHold
from .pool import Pool
from .tree import CachedPage, Tree

__all__ = ["GroupManager", "Slid"]

#: a group's pages changed by a call: ``(low, low', top, top')``, it gave back pages ``low``
#: to ``low' - 1`` and took ``top`` to ``top' - 1``
Slid = tuple[int, int, int, int]


class GroupManager:
    """Group ``g`` of layers reading back ``window`` positions (``None``: every one), over
    ``pools[g]``; ``pools`` are every group's, as a node evicted with its full page frees
    its other pages too. The defaults are those of a group that holds every page of its table
    until release (nothing to slide, keep or miss); the kinds override the rest."""

    kind = "full"  #: "full", "sliding" or "state" (:mod:`.states`)

    def __init__(self, g: int, window: int | None, pools: list[Pool], tree: Tree,
                 page_size: int):
        self.g = g
        self.window = window
        self.pool = pools[g]
        self.pools = pools
        self.tree = tree
        self.size = page_size

    def pages_for(self, tokens: int) -> int:
        return -(-int(tokens) // self.size)

    # -- admission (laws 4 and 7) ---------------------------------------------------------------
    def most_pages(self, total: int, call: int = 1) -> int:
        """The most pages a request of ``total`` tokens holds at once, in calls of at most
        ``call`` tokens."""
        raise NotImplementedError

    def too_large(self, total: int) -> str | None:
        """Why the pool can never hold a request of ``total`` tokens (``None``: it can)."""
        raise NotImplementedError

    def room(self, nodes: list[CachedPage], total: int, longest: int) -> int | None:
        """The pages a request matching ``nodes``, of ``total`` tokens fed in calls of at
        most ``longest``, reserves (0: none), or ``None`` when the pool cannot give them now.
        Raises :class:`~.pages.PageError` when it never can."""
        raise NotImplementedError

    def admit(self, nodes: list[CachedPage], want: int, most: int) -> GroupHold:
        """The request's part: the matched ``nodes`` (read already, law 3) and ``want``
        pages in all, ``most`` reserved (what :meth:`room` said)."""
        raise NotImplementedError

    # -- matching (law 8) ---------------------------------------------------------------------
    def missing(self, nodes: list[CachedPage], depth: int) -> int:
        """The deepest page of a hit at ``depth`` pages of the path ``nodes`` that this
        group lacks (-1: none)."""
        return -1

    # -- a request's calls (laws 7 and 10) ----------------------------------------------------
    def reach(self, hold: GroupHold, nodes: list[CachedPage], first: int,
              last: int) -> Slid | None:
        """What the call of positions ``first`` to ``last`` changes (``None``: nothing).
        Raises ``ValueError`` if it reads more pages than the hold reserved."""
        return None

    def slide(self, hold: GroupHold, nodes: list[CachedPage], slid: Slid) -> None:
        """Gives back and takes what :meth:`reach` said."""

    def keeping(self, hold: GroupHold, nodes: list[CachedPage], depth: int) -> set[int] | None:
        """The pages more the hold would keep for a hit at ``depth`` pages (law 10), or
        ``None`` when it cannot."""
        return set()

    def keep(self, hold: GroupHold, more: set[int]) -> None:
        """Keeps what :meth:`keeping` said."""

    # -- caching and letting go (laws 5, 6, 8) --------------------------------------------------
    def insert(self, hold: GroupHold, nodes: list[CachedPage], start: int, full: int) -> int:
        """Law 5: the hold's path ``nodes`` grew from ``start`` on, to the ``full`` pages of
        the prefix it caches; its pages join the new nodes where they may. Returns how many
        did."""
        raise NotImplementedError

    def release(self, hold: GroupHold, nodes: list[CachedPage]) -> None:
        """Law 6: the request, whose readers of ``nodes`` are dropped already, lets go of
        this group's pages."""
        raise NotImplementedError

    # -- eviction (laws 4 and 9) --------------------------------------------------------------
    def readers(self, node: CachedPage) -> int:
        """The holds reading ``node``'s page of this group."""
        raise NotImplementedError

    def current(self, entry: tuple) -> bool:
        """Whether a heap entry still names a page that may go."""
        raise NotImplementedError

    def evict(self) -> None:
        """The first page that may go, in the policy's order, goes."""
        raise NotImplementedError

    def alloc(self, k: int) -> list[int]:
        """``k`` free pages, evicting as law 4 says."""
        pool = self.pool
        while pool.free < k:
            self.evict()
        return pool.take(k)

    def uncache(self, node: CachedPage, g: int) -> None:
        """``node``'s page of group ``g`` is evicted."""
        self.pools[g].uncache(node.pages[g])
        node.pages[g] = -1
