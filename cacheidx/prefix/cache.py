"""An online prefix cache over fixed pools of pages: pages computed by one request are kept
after it ends and read by later requests that start with the same tokens.

The cached pages form a tree, one node a page: a node's key is its page's ``page_size``
tokens, its parent the page before it, so a path from the root spells a prefix of whole
pages (a radix tree whose edges are pages; see ``docs/prefix.md`` for why pages and exact
keys rather than chained hashes). Laws, for a cache of ``capacity`` pages of ``P`` tokens:

1. Every page is exactly one of: free, owned by one request (its own, not in the tree), or
   cached (a node of the tree). Nothing else exists, so nothing leaks.
2. ``match(tokens)`` is the longest prefix of whole pages of ``tokens`` that the tree holds,
   capped at ``(len(tokens) - 1) // P`` pages so that the last token is always computed (as
   the planner caps).
3. A request holds its matched nodes and every node it inserts (``readers``): what it holds
   is always a path from the root, so a node with readers has readers on all its ancestors.
4. ``admit`` gives a request its matched pages and fresh pages for the rest of its tokens,
   evicting cached pages to make room. Only a node without readers and without children is
   evicted, least recently released first (``policy`` orders them): never a page a
   running request reads, and never a page under a cached one.
5. ``insert(hold, tokens)`` puts the hold's whole pages of ``tokens`` (whose keys and values
   are now written) into the tree. A page whose prefix the tree already holds stays the
   request's own (freed on release) and the request reads on from the tree's node.
6. ``release(hold)`` drops the request's readers, stamping each node with the release time,
   and frees its own pages.

Groups of layers (``windows``). A model whose layers reach back differently keeps one pool
of pages per group: ``None`` for its full layers, which read every position, ``w`` for its
sliding layers of window ``w``, which read the last ``w`` positions (:mod:`.reach`). A node
then holds one page per group (``pages``), each of its group's pool, or none (-1):

7. A hold holds, of the full group, a page for each of its positions (laws 3 to 6), and of a
   sliding group only the pages its calls still read: ``slide(hold, first, last)``, before
   the call of positions ``first`` to ``last``, gives back every page below the call's reach
   (a cached one stays cached, read by no one; an own one is freed) and takes pages for the
   call's positions. It never holds more at once than the pages of its longest call (``call``
   tokens), and a pool admits a request only while those of every running request fit it:
   its holds, shared pages counted once per hold, never outgrow it, so a running request
   never waits for a page.
8. ``insert`` keeps, of each sliding group, the pages of the last window of the prefix it
   caches, and one page more (what a hit one page short reads), where the hold still holds
   them; the others stay its own, freed once below its reach. A hit needs the full group's
   pages of every node of the prefix and, of each sliding group, the pages of its last window
   (``reach.hit_pages``): ``match`` is the longest prefix, capped as in law 2, that has both.
9. Law 1 holds in each group's pool. A sliding page read by no hold may be evicted alone (its
   node stays, without it); a node goes with its full page (law 4), or, without a full group,
   once it holds no page, no child and no reader.
10. ``keep(hold, depth)`` makes a hold keep, past its reach, its own pages of the window a hit
    at ``depth`` pages reads, until ``insert`` caches them (read by no one): a prefix another
    request is known to share keeps its window where the two part. The pages count among the
    hold's most; a pool that cannot hold them beside every running request's most, or a
    hold that gave some back already, refuses (``False``).

A model with recurrent layers (``states``: their snapshots every ``m`` positions, a pool of
slots of their own) keeps one group more, of snapshots (:mod:`.states`, laws 11 to 13):
a hit then also needs, for every recurrent layer, the snapshot at its junction.

An operation that cannot be done raises :class:`~cacheidx.prefix.PageError` or a
``ValueError`` and changes nothing; ``admit`` returns ``None`` when the pages are not there
yet (running requests hold them).

This module holds :class:`PrefixCache`, whose operations ask each group's manager in turn
(:mod:`.manager`: :mod:`.full`, :mod:`.sliding`), over :mod:`.keys`, :mod:`.tree`,
:mod:`.pool` and :mod:`.hold`; :mod:`.audit` checks the laws whole, for tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _arguments as arguments
from . import audit
from .full import FullManager
from .hold import Hold
from .keys import LARGEST, WHERE, token_bytes
from .manager import GroupManager
from .pages import PageError
from .pool import GroupPages, Pool
from .sliding import SlidingManager
from .states import StateManager
from .tree import CachedPage, Tree, lru

__all__ = ["CachedPage", "GroupPages", "Hold", "Match", "PrefixCache", "lru"]


@dataclasses.dataclass(frozen=True)
class Match:
    """The cached prefix of a prompt: ``pages`` (the first group's, -1 where a sliding group
    keeps none) hold its first ``tokens`` tokens."""

    pages: tuple[int, ...]
    tokens: int
    _nodes: tuple[CachedPage, ...] = dataclasses.field(repr=False, compare=False)


class PrefixCache:
    """A pool of ``pages`` pages of ``page_size`` tokens, cached as a tree (see the module's
    laws). ``policy`` maps a :class:`CachedPage` to a key; among the pages that may go, the
    smallest key is evicted first (:func:`lru` by default).

    ``windows`` names the groups of layers, one pool each (laws 7 to 9): ``None`` for full
    layers, a positive ``w`` for sliding layers of window ``w``, at most one of each; one full
    group by default. ``pages`` is then every group's pool, or a sequence of one per group.
    ``states``, ``(m, slots)``: the recurrent layers' snapshots, one every ``m`` positions (a
    multiple of ``page_size``) in a pool of ``slots`` (laws 11 to 13; it needs a full group).

    Each group has a manager of its kind (:mod:`.full`, :mod:`.sliding`) behind one interface
    (:mod:`.manager`); the cache holds the tree (:mod:`.tree`) and the requests' holds, and
    asks every group in turn."""

    def __init__(self, pages: int | Sequence[int], page_size: int, *,
                 policy: Callable[[CachedPage], Any] = lru,
                 windows: Sequence[int | None] = (None,),
                 states: tuple[int, int] | None = None):
        self._size = _integer("page_size", page_size, 1)
        self.windows = _windows(windows)
        states = _states(states, self._size, self.windows)
        counts = _counts(pages, len(self.windows))
        for c in counts:
            if c * self._size > LARGEST:  # a table names slots in int64
                raise ValueError(f"{WHERE}: {c} pages of {self._size} tokens are more slots "
                                 f"than int64 numbers")
        if not callable(policy):
            raise TypeError(f"{WHERE}: policy must be callable, got {policy!r}")
        self._pools = [Pool(c, policy) for c in counts]
        if states is not None:
            self._pools.append(Pool(states[1], policy))
        full = None in self.windows
        self._tree = Tree(len(self._pools), self._size,
                          sliding=any(w is not None for w in self.windows) or bool(states))
        self._groups: list[GroupManager] = [
            FullManager(g, w, self._pools, self._tree, self._size) if w is None else
            SlidingManager(g, w, self._pools, self._tree, self._size, prunes=not full)
            for g, w in enumerate(self.windows)]
        #: the snapshot group (laws 11 to 13), the last, or None
        self._state = None if states is None else StateManager(
            len(self.windows), states[0], self._pools, self._tree, self._size)
        if self._state is not None:
            self._groups.append(self._state)
        self._pages = self._pools[: len(self.windows)]  # the pools of pages (not snapshots)
        #: the full group, whose pages make the tree: a node is cached with its page, and
        #: the tree's readers are its readers
        self._full = next((m for m in self._groups if isinstance(m, FullManager)), None)
        self._clock = 0
        self._holds: dict[int, Hold] = {}

    # -- what the pool holds ------------------------------------------------------------------
    @property
    def policy(self) -> Callable[[CachedPage], Any]:
        """Maps a page to its eviction key (the smallest goes first)."""
        return self._pools[0].policy

    @policy.setter
    def policy(self, policy: Callable[[CachedPage], Any]) -> None:
        for pool in self._pools:
            pool.policy = policy

    @property
    def evictions(self) -> int:
        """Pages evicted so far (every group's)."""
        return sum(p.evicted for p in self._pages)

    @property
    def capacity(self) -> int:
        return sum(p.capacity for p in self._pages)

    @property
    def page_size(self) -> int:
        return self._size

    @property
    def free(self) -> int:
        """Pages holding nothing."""
        return sum(p.free for p in self._pages)

    @property
    def cached(self) -> int:
        """Pages in the tree, read or not."""
        return sum(p.cached for p in self._pages)

    @property
    def evictable(self) -> int:
        """Cached pages no request reads: what admissions may evict."""
        return sum(p.unread for p in self._pages)

    @property
    def in_use(self) -> int:
        """Pages running requests hold: their own and the cached ones they read."""
        return sum(p.in_use for p in self._pages)

    @property
    def snapshot_evictions(self) -> int:
        """Snapshots evicted so far (alone, or with their node)."""
        return 0 if self._state is None else self._state.pool.evicted

    @property
    def every(self) -> int | None:
        """The block size of the recurrent layers' snapshots (``None``: no snapshot group)."""
        return None if self._state is None else self._state.every

    @property
    def snapshots(self) -> GroupPages | None:
        """The snapshot pool now (``None`` without recurrent layers): its slots free, cached,
        evictable and in use."""
        return None if self._state is None else self._state.pool.now(None)

    def group(self, g: int) -> GroupPages:
        """Group ``g``'s pool now."""
        return self._pools[g].now(self.windows[g])

    def too_large(self, total: int) -> str | None:
        """Why a request holding ``total`` tokens can never be admitted (a group's pool holds
        fewer pages, or snapshot slots, than it holds at once), or ``None``."""
        for m in self._groups:
            why = m.too_large(total)
            if why is not None:
                return why
        return None

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return -(-int(tokens) // self._size)

    def most_pages(self, g: int, total: int, call: int = 1) -> int:
        """The most pages of group ``g``'s pool a request of ``total`` tokens holds at once,
        fed in calls of at most ``call`` tokens (law 7)."""
        return self._groups[g].most_pages(total, call)

    # -- matching -----------------------------------------------------------------------------
    def match(self, tokens: Sequence[int] | np.ndarray) -> Match:
        """Laws 2 and 8: the longest cached prefix of whole pages of ``tokens``, at most
        ``(len - 1) // P`` pages, that every group can read back. Changes nothing. Costs one
        dictionary lookup per page matched, after one pass turning the tokens into bytes
        (and, with sliding groups, a look at each matched page at most once per group)."""
        data = token_bytes("match", tokens)
        n = len(data) // 8
        if n == 0:
            raise ValueError(f"{WHERE}.match: the prompt is empty")
        nodes = self._hit(data, (n - 1) // self._size)
        return Match(tuple(x.pages[0] for x in nodes), len(nodes) * self._size, tuple(nodes))

    def _hit(self, data: bytes, most: int) -> list[CachedPage]:
        """Law 8: the path, cut to the deepest node below which every sliding group holds
        its window. A page missing at ``k`` rules out every depth from ``k + 1`` to the one
        tried, so each page is looked at once per group."""
        nodes = self._tree.walk(data, most)
        d = len(nodes)
        while d > 0:
            missing = max(m.missing(nodes, d) for m in self._groups)
            if missing < 0:
                break
            d = missing
        del nodes[d:]
        return nodes

    # -- a request's life: admit, slide, insert, release ---------------------------------------
    def admit(self, tokens: Sequence[int] | np.ndarray, total: int | None = None, *,
              reuse: bool = True, call: int | None = None) -> Hold | None:
        """A hold for a request of prompt ``tokens`` that will hold ``total`` tokens (its prompt
        and the tokens it will generate; the prompt by default): its matched pages (none
        without ``reuse``), retained, then fresh pages, evicting cached ones without readers
        as law 4 says; of a sliding group, the matched window and a reservation for the
        pages its calls of at most ``call`` tokens (the whole uncached prompt by default)
        will take (law 7). ``None`` when the pools cannot give them now.

        Raises :class:`PageError` when a group's pool has fewer pages than the request holds
        at once (all its tokens' for the full group; one window for a sliding one), and
        ``ValueError`` for an empty prompt or a ``total`` below its length."""
        data = token_bytes("admit", tokens)
        n = len(data) // 8
        if n == 0:
            raise ValueError(f"{WHERE}.admit: the prompt is empty")
        total = n if total is None else arguments.integer("prefix.PrefixCache.admit", "total",
                                                      total, least=n)
        if call is not None:
            call = arguments.integer("prefix.PrefixCache.admit", "call", call, least=1)
        why = self.too_large(total)
        if why is not None:
            raise PageError(f"{WHERE}.admit: {why}")
        nodes = self._hit(data, (n - 1) // self._size) if reuse else []
        d = len(nodes)
        longest = max(1, min(n if call is None else call, n - d * self._size))
        most = []
        for m in self._groups:  # every group has room, or nothing changes
            room = m.room(nodes, total, longest)
            if room is None:
                return None
            most.append(room)
        for x in nodes:
            self._read(x)
            x.hits += 1
        want = self.pages_for(total)
        groups = [m.admit(nodes, want, r) for m, r in zip(self._groups, most)]
        hold = Hold(groups[0].table, d * self._size, nodes, groups)
        self._holds[id(hold)] = hold
        return hold

    def slide(self, hold: Hold, first: int, last: int) -> list[tuple[int, int, int, int, int]]:
        """Law 7: before the hold's call of positions ``first`` to ``last``, each sliding
        group gives back the pages below the call's reach and takes pages for its
        positions. Returns ``(group, low, low', top, top')`` for each group whose pages
        changed: it gave back pages ``low`` to ``low' - 1`` and took ``top`` to ``top' - 1``.

        Raises ``ValueError`` for positions outside the hold's tokens or a call that reads
        more pages than the hold reserved (changing nothing)."""
        self._live(hold, "slide")
        P = self._size
        if not 0 <= first <= last < len(hold.pages) * P:
            raise ValueError(f"{WHERE}.slide: positions {first} to {last} are not in the "
                             f"hold's {len(hold.pages) * P} slots")
        plans = []
        for m in self._groups:  # every group's call checked before any changes
            slid = m.reach(hold.groups[m.g], hold.nodes, first, last)
            if slid is not None:
                plans.append((m, slid))
        for m, slid in plans:
            m.slide(hold.groups[m.g], hold.nodes, slid)
        return [(m.g, *slid) for m, slid in plans]

    def keep(self, hold: Hold, depth: int) -> bool:
        """Law 10: the hold keeps, of each sliding group, its pages a hit at ``depth`` pages
        reads, past its reach, until :meth:`insert` caches them. Returns whether it will:
        ``False`` (changing nothing) when a group's pool cannot hold them beside every
        running request's most pages, or when the hold has given some back already. Raises
        ``ValueError`` for a depth outside the hold's pages."""
        self._live(hold, "keep")
        if not 0 < depth <= len(hold.pages):
            raise ValueError(f"{WHERE}.keep: depth {depth} is not 1 to the hold's "
                             f"{len(hold.pages)} pages")
        extra = []
        for m in self._groups:
            more = m.keeping(hold.groups[m.g], hold.nodes, depth)
            if more is None:
                return False
            extra.append((m, more))
        for m, more in extra:
            m.keep(hold.groups[m.g], more)
        return True

    def insert(self, hold: Hold, tokens: Sequence[int] | np.ndarray) -> int:
        """Laws 5 and 8: the whole pages of ``tokens`` (the hold's sequence, written up to its
        end) past those the hold already reads from the tree, into the tree, with the pages
        of each sliding group's last window that the hold still holds. Returns how many of the
        hold's pages became cached. Raises ``ValueError`` if the tokens need more pages than
        the hold has or do not start with the pages it matched."""
        self._live(hold, "insert")
        data = token_bytes("insert", tokens)
        full = len(data) // 8 // self._size
        if full > len(hold.pages):
            raise ValueError(f"{WHERE}.insert: {len(data) // 8} tokens fill {full} pages, the "
                             f"hold has {len(hold.pages)}")
        tree, nodes = self._tree, hold.nodes
        for k, x in enumerate(nodes):
            if tree.key(data, k) != x.key:
                raise ValueError(f"{WHERE}.insert: page {k} of the tokens is not the page "
                                 f"the hold reads from the cache")
        start = len(nodes)
        parent = nodes[-1] if nodes else tree.root
        for k in range(start, full):
            key = tree.key(data, k)
            node = parent.children.get(key)
            if node is None:  # a new node, read by the hold; each group gives it its page
                node = tree.grow(parent, key, k)
            else:  # cached meanwhile by another request: the hold keeps its own copy
                self._read(node)
            nodes.append(node)
            parent = node
        # each group's part touches only its own pool and pages, so group by group is
        # node by node
        return sum(m.insert(hold.groups[m.g], nodes, start, full) for m in self._groups)

    def mark(self, hold: Hold, page: int) -> int:
        """Law 14: the hold's junction is to hold the state after its page ``page`` (the
        caller copies the running state there); returns that snapshot slot, -1 for none (no
        snapshot group, or ``page`` ends a block, whose snapshot the call stores)."""
        self._live(hold, "mark")
        return -1 if self._state is None else self._state.mark(hold.groups[-1], page)

    def release(self, hold: Hold) -> None:
        """Law 6: the request lets go of its pages. Raises :class:`PageError` on a second
        release."""
        self._live(hold, "release")
        self._clock += 1
        for x in hold.nodes:
            x.readers -= 1
            x.last_used = self._clock
        for m in self._groups:
            m.release(hold.groups[m.g], hold.nodes)
        if self._full is None and hold.nodes:
            self._tree.prune(hold.nodes[-1])
        hold.released = True
        del self._holds[id(hold)]

    def check(self) -> None:
        """Asserts laws 1, 3, 7 and 9 (for tests): in each group's pool every page in exactly
        one place, readers equal to the holds that read a node, holds are root paths, the
        reservations what the holds may still take (:func:`.audit.check`)."""
        audit.check(self._tree.root, self._groups, self._holds.values())

    # -- inside -------------------------------------------------------------------------------
    def _read(self, node: CachedPage) -> None:
        """Law 3: one more request holds ``node``."""
        if node.readers == 0 and self._full is not None:
            self._full.claim(node)
        if node.readers == 0 and self._state is not None:
            self._state.claim(node)
        node.readers += 1

    def _live(self, hold: Hold, op: str) -> None:
        if self._holds.get(id(hold)) is not hold:
            what = "released already" if hold.released else "not of this cache"
            raise PageError(f"{WHERE}.{op}: the hold is {what}")


def _windows(windows: Any) -> tuple[int | None, ...]:
    """The groups' windows: ``None`` or a positive integer each, at most one of each."""
    if isinstance(windows, str | bytes) or not hasattr(windows, "__iter__"):
        raise TypeError(f"{WHERE}: windows must be a sequence of None and positive "
                        f"integers, got {windows!r:.60}")
    out = tuple(windows)
    if not out:
        raise ValueError(f"{WHERE}: windows names no group")
    for w in out:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int | np.integer)):
            raise TypeError(f"{WHERE}: a window must be None or a positive integer, got "
                            f"{w!r:.40}")
        if w is not None and w < 1:
            raise ValueError(f"{WHERE}: a window must be None or a positive integer, got {w}")
    out = tuple(None if w is None else int(w) for w in out)
    if len(set(out)) != len(out):
        raise ValueError(f"{WHERE}: windows {list(out)} name a group twice")
    return out


def _states(states: Any, page_size: int, windows: tuple[int | None, ...]
            ) -> tuple[int, int] | None:
    """``(m, slots)`` of the snapshot group: ``m`` a positive multiple of the page size, a
    full group beside it."""
    if states is None:
        return None
    if not (isinstance(states, tuple | list) and len(states) == 2):
        raise TypeError(f"{WHERE}: states must be a pair (m, slots), got {states!r:.60}")
    m = _integer("states' m", states[0], 1)
    slots = _integer("states' slots", states[1], 0)
    if m % page_size:
        raise ValueError(f"{WHERE}: snapshots every {m} positions: m must be a multiple of the "
                         f"page size, {page_size}")
    if None not in windows:
        raise ValueError(f"{WHERE}: snapshots need a group of full layers beside them (the "
                         f"windows are {list(windows)})")
    return m, slots


def _counts(pages: Any, groups: int) -> list[int]:
    """Pages of each group's pool: one number for every group, or one per group."""
    if isinstance(pages, Sequence) and not isinstance(pages, str | bytes):
        if len(pages) != groups:
            raise ValueError(f"{WHERE}: pages gives {len(pages)} pools for {groups} groups")
        return [_integer("pages", p, 0) for p in pages]
    return [_integer("pages", pages, 0)] * groups


def _integer(name: str, value: Any, least: int) -> int:
    return arguments.integer("prefix.PrefixCache", name, value, least=least)
