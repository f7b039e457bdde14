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

An operation that cannot be done raises :class:`~cacheidx.prefix.PageError` or a
``ValueError`` and changes nothing; ``admit`` returns ``None`` when the pages are not there
yet (running requests hold them).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _check as check
from .pages import PageError
from .reach import first_page, hit_pages, pages_at_once

__all__ = ["CachedPage", "GroupPages", "Hold", "Match", "PrefixCache", "lru"]

_WHERE = "cacheidx.prefix.PrefixCache"


class CachedPage:
    """A node of the tree: one cached page (one per group). Read-only for a policy."""

    __slots__ = ("pages", "depth", "key", "parent", "children", "readers", "last_used", "hits",
                 "seers", "_stamp", "_stamps")

    def __init__(self, pages: list[int], depth: int, key: bytes, parent: CachedPage | None,
                 sliding: bool = False):
        self.pages = pages  #: the page of each group's pool holding it, -1 where none does
        self.depth = depth  #: its place in the sequence: it holds tokens ``depth * P`` on
        self.key = key
        self.parent = parent
        self.children: dict[bytes, CachedPage] = {}
        self.readers = 0  #: requests holding it now
        self.last_used = 0  #: the cache's clock when its last reader let go
        self.hits = 0  #: admissions that matched it
        #: of each sliding group: requests reading its page now (None without one)
        self.seers = [0] * len(pages) if sliding else None
        self._stamp = 0  #: which heap entry of it is current (the full group's, or the tree's)
        self._stamps = [0] * len(pages) if sliding else None  #: the same, per sliding group

    @property
    def page(self) -> int:
        """The page of the first group's pool holding it (-1: none)."""
        return self.pages[0]

    def __repr__(self) -> str:
        return (f"CachedPage(pages={self.pages}, depth={self.depth}, readers={self.readers}, "
                f"last_used={self.last_used}, hits={self.hits})")


def lru(page: CachedPage) -> Any:
    """The default policy: the least recently released page goes first."""
    return page.last_used


@dataclasses.dataclass(frozen=True)
class Match:
    """The cached prefix of a prompt: ``pages`` (the first group's, -1 where a sliding group
    keeps none) hold its first ``tokens`` tokens."""

    pages: tuple[int, ...]
    tokens: int
    _nodes: tuple[CachedPage, ...] = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(eq=False)
class Hold:
    """What one request holds: ``pages`` is its page table (page ``k`` holds its tokens
    ``k * P`` to ``k * P + P - 1``), the first ``cached // P`` of them read from the cache.
    With groups, ``tables[g]`` is group ``g``'s (``pages`` is the first's), -1 where a
    sliding group holds no page: below ``low[g]`` (given back, law 7) or from ``top[g]`` on
    (not yet taken)."""

    pages: list[int]
    cached: int  #: tokens the request found cached when admitted
    nodes: list[CachedPage] = dataclasses.field(repr=False)  #: its path in the tree
    own: set[int] = dataclasses.field(repr=False)  #: its pages not in the tree (first group)
    released: bool = False
    tables: list[list[int]] = dataclasses.field(default_factory=list, repr=False)
    owns: list[set[int]] = dataclasses.field(default_factory=list, repr=False)
    low: list[int] = dataclasses.field(default_factory=list, repr=False)
    top: list[int] = dataclasses.field(default_factory=list, repr=False)
    #: per sliding group, the most pages it holds at once (reserved when admitted, law 7)
    most: list[int] = dataclasses.field(default_factory=list, repr=False)
    #: per sliding group, the pages to keep past its reach (law 10), and those kept: page k
    #: of its sequence -> its page of the pool
    keeps: list[set[int]] = dataclasses.field(default_factory=list, repr=False)
    kept: list[dict[int, int]] = dataclasses.field(default_factory=list, repr=False)

    def held(self, group: int = 0) -> int:
        """Pages of group ``group``'s pool it holds now (cached ones it reads included)."""
        if not self.most or self.most[group] == 0:  # a full group: every page of its table
            return len(self.tables[group] if self.tables else self.pages)
        return max(0, self.top[group] - self.low[group]) + len(self.kept[group])


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


class _Pool:
    """One group's pages (law 1): free ones are those freed since, a stack, then those from
    ``fresh`` on, never used (a number, so that a pool of any size costs nothing to make)."""

    __slots__ = ("capacity", "freed", "fresh", "cached", "unread", "reserved", "heap")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.freed: list[int] = []
        self.fresh = 0
        self.cached = 0
        self.unread = 0  # cached pages without readers: what eviction can free
        self.reserved = 0  # the most pages each running hold holds at once, summed (law 7)
        self.heap: list[tuple[Any, int, int, CachedPage]] = []

    @property
    def free(self) -> int:
        return len(self.freed) + self.capacity - self.fresh

    def take(self, k: int) -> list[int]:
        """``k`` free pages: the freed ones first, the last freed first."""
        taken = min(k, len(self.freed))
        got = self.freed[len(self.freed) - taken :][::-1]
        del self.freed[len(self.freed) - taken :]
        got += range(self.fresh, self.fresh + k - taken)
        self.fresh += k - taken
        return got


class PrefixCache:
    """A pool of ``pages`` pages of ``page_size`` tokens, cached as a tree (see the module's
    laws). ``policy`` maps a :class:`CachedPage` to a key; among the pages that may go, the
    smallest key is evicted first (:func:`lru` by default).

    ``windows`` names the groups of layers, one pool each (laws 7 to 9): ``None`` for full
    layers, a positive ``w`` for sliding layers of window ``w``, at most one of each; one full
    group by default. ``pages`` is then every group's pool, or a sequence of one per group."""

    def __init__(self, pages: int | Sequence[int], page_size: int, *,
                 policy: Callable[[CachedPage], Any] = lru,
                 windows: Sequence[int | None] = (None,)):
        self._size = _integer("page_size", page_size, 1)
        self.windows = _windows(windows)
        counts = _counts(pages, len(self.windows))
        for c in counts:
            if c * self._size > _LARGEST:  # a table names slots in int64
                raise ValueError(f"{_WHERE}: {c} pages of {self._size} tokens are more slots "
                                 f"than int64 numbers")
        if not callable(policy):
            raise TypeError(f"{_WHERE}: policy must be callable, got {policy!r}")
        self.policy = policy
        self._pools = [_Pool(c) for c in counts]
        #: the full group, whose pages make the tree: a node is cached with its page
        self._anchor = self.windows.index(None) if None in self.windows else None
        self._sliding = tuple(g for g, w in enumerate(self.windows) if w is not None)
        self._root = CachedPage([-1] * len(self.windows), -1, b"", None)
        self._clock = 0
        self._pushes = itertools.count()
        self._holds: dict[int, Hold] = {}
        self.evictions = 0  #: pages evicted so far (every group's)

    # -- what the pool holds ------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return sum(p.capacity for p in self._pools)

    @property
    def page_size(self) -> int:
        return self._size

    @property
    def free(self) -> int:
        """Pages holding nothing."""
        return sum(p.free for p in self._pools)

    @property
    def cached(self) -> int:
        """Pages in the tree, read or not."""
        return sum(p.cached for p in self._pools)

    @property
    def evictable(self) -> int:
        """Cached pages no request reads: what admissions may evict."""
        return sum(p.unread for p in self._pools)

    @property
    def in_use(self) -> int:
        """Pages running requests hold: their own and the cached ones they read."""
        return sum(p.capacity - p.free - p.unread for p in self._pools)

    def group(self, g: int) -> GroupPages:
        """Group ``g``'s pool now."""
        p = self._pools[g]
        return GroupPages(self.windows[g], p.capacity, p.free, p.cached, p.unread,
                          p.capacity - p.free - p.unread, p.reserved)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return -(-int(tokens) // self._size)

    def most_pages(self, g: int, total: int, call: int = 1) -> int:
        """The most pages of group ``g``'s pool a request of ``total`` tokens holds at once,
        fed in calls of at most ``call`` tokens (law 7)."""
        want = self.pages_for(total)
        w = self.windows[g]
        return want if w is None else min(want, pages_at_once(w, call, self._size))

    # -- matching -----------------------------------------------------------------------------
    def match(self, tokens: Sequence[int] | np.ndarray) -> Match:
        """Laws 2 and 8: the longest cached prefix of whole pages of ``tokens``, at most
        ``(len - 1) // P`` pages, that every group can read back. Changes nothing. Costs one
        dictionary lookup per page matched, after one pass turning the tokens into bytes
        (and, with sliding groups, a look at each matched page at most once per group)."""
        data = _bytes("match", tokens)
        n = len(data) // 8
        if n == 0:
            raise ValueError(f"{_WHERE}.match: the prompt is empty")
        nodes = self._hit(data, (n - 1) // self._size)
        return Match(tuple(x.pages[0] for x in nodes), len(nodes) * self._size, tuple(nodes))

    def _walk(self, data: bytes, most: int) -> list[CachedPage]:
        width = 8 * self._size
        node, nodes = self._root, []
        for k in range(most):
            node = node.children.get(data[k * width : (k + 1) * width])
            if node is None:
                break
            nodes.append(node)
        return nodes

    def _hit(self, data: bytes, most: int) -> list[CachedPage]:
        """Law 8: the path, cut to the deepest node below which every sliding group holds
        its window. A page missing at ``k`` rules out every depth from ``k + 1`` to the one
        tried, so each page is looked at once per group."""
        nodes = self._walk(data, most)
        d = len(nodes)
        while d > 0 and self._sliding:
            missing = -1
            for g in self._sliding:
                for k in reversed(hit_pages(self.windows[g], d, self._size)):
                    if nodes[k].pages[g] < 0:
                        missing = max(missing, k)
                        break
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
        data = _bytes("admit", tokens)
        n = len(data) // 8
        if n == 0:
            raise ValueError(f"{_WHERE}.admit: the prompt is empty")
        total = n if total is None else check.integer("prefix.PrefixCache.admit", "total",
                                                      total, least=n)
        if call is not None:
            call = check.integer("prefix.PrefixCache.admit", "call", call, least=1)
        want = self.pages_for(total)
        for g, pool in enumerate(self._pools):
            least = want if self.windows[g] is None else self.most_pages(g, total)
            if least > pool.capacity:
                w = self.windows[g]
                what = (f"{total} tokens need {least} pages of {self._size}" if w is None else
                        f"a window of {w} tokens needs {least} pages of {self._size} at once")
                raise PageError(f"{_WHERE}.admit: {what}; the "
                                f"{'pool' if w is None else f'pool of window {w}'} has "
                                f"{pool.capacity}")
        nodes = self._hit(data, (n - 1) // self._size) if reuse else []
        d = len(nodes)
        longest = max(1, min(n if call is None else call, n - d * self._size))
        most, windows = [0] * len(self._pools), [range(0)] * len(self._pools)
        for g, pool in enumerate(self._pools):
            if g == self._anchor:
                # the matched pages without readers stop being evictable once held
                need, losing = want - d, sum(1 for x in nodes if x.readers == 0)
                if need > pool.free + pool.unread - losing:
                    return None
                continue
            windows[g] = hit_pages(self.windows[g], d, self._size)
            most[g] = self.most_pages(g, total, longest)
            if most[g] > pool.capacity:
                raise PageError(f"{_WHERE}.admit: calls of {longest} tokens read up to "
                                f"{most[g]} pages of window {self.windows[g]} at once; the "
                                f"pool of window {self.windows[g]} has {pool.capacity}")
            if most[g] > pool.capacity - pool.reserved:  # law 7: every hold's most fits
                return None
        for x in nodes:
            self._read(x)
            x.hits += 1
        tables, owns = [], []
        for g, pool in enumerate(self._pools):
            if g == self._anchor:
                own = self._alloc(g, want - d)
                tables.append([x.pages[g] for x in nodes] + own)
                owns.append(set(own))
                continue
            table = [-1] * want
            for k in windows[g]:
                x = nodes[k]
                table[k] = x.pages[g]
                if x.seers[g] == 0:
                    pool.unread -= 1
                    x._stamps[g] += 1  # its heap entry, if any, is stale now
                x.seers[g] += 1
            pool.reserved += most[g]
            tables.append(table)
            owns.append(set())
        hold = Hold(tables[0], d * self._size, nodes, owns[0], tables=tables, owns=owns,
                    low=[w.start if w else d for w in windows], top=[d] * len(tables),
                    most=most, keeps=[set() for _ in tables], kept=[{} for _ in tables])
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
            raise ValueError(f"{_WHERE}.slide: positions {first} to {last} are not in the "
                             f"hold's {len(hold.pages) * P} slots")
        plans = []
        for g in self._sliding:
            lo, hi = first_page(self.windows[g], first, P), last // P + 1
            low, top = hold.low[g], hold.top[g]
            if lo <= low and hi <= top:
                continue
            new_low, new_top = max(low, lo), max(top, hi)
            kept = len(hold.kept[g]) + sum(  # its own pages given back into law 10's keeping
                1 for k in range(low, min(new_low, top)) if k in hold.keeps[g]
                and not (k < len(hold.nodes) and hold.nodes[k].pages[g] == hold.tables[g][k]))
            if new_top - new_low + kept > hold.most[g]:
                raise ValueError(f"{_WHERE}.slide: positions {first} to {last} read "
                                 f"{new_top - new_low} pages of window {self.windows[g]}"
                                 f"{f' beside {kept} kept' if kept else ''}; the hold was "
                                 f"admitted for {hold.most[g]} at once")
            plans.append((g, low, new_low, top, new_top))
        for g, low, new_low, top, new_top in plans:
            for k in range(low, min(new_low, top)):
                self._drop(hold, g, k)
            start = max(top, new_low)
            if new_top > start:
                got = self._alloc(g, new_top - start)
                hold.tables[g][start:new_top] = got
                hold.owns[g].update(got)
            hold.low[g], hold.top[g] = new_low, new_top
        return plans

    def keep(self, hold: Hold, depth: int) -> bool:
        """Law 10: the hold keeps, of each sliding group, its pages a hit at ``depth`` pages
        reads, past its reach, until :meth:`insert` caches them. Returns whether it will:
        ``False`` (changing nothing) when a group's pool cannot hold them beside every
        running request's most pages, or when the hold has given some back already. Raises
        ``ValueError`` for a depth outside the hold's pages."""
        self._live(hold, "keep")
        if not 0 < depth <= len(hold.pages):
            raise ValueError(f"{_WHERE}.keep: depth {depth} is not 1 to the hold's "
                             f"{len(hold.pages)} pages")
        extra = {}
        for g in self._sliding:
            span = hit_pages(self.windows[g], depth, self._size)
            if any(k not in hold.kept[g] and not (k < len(hold.nodes)
                                                  and hold.nodes[k].pages[g] >= 0)
                   for k in range(span.start, min(span.stop, hold.low[g]))):
                return False  # given back already
            extra[g] = set(span) - hold.keeps[g]
            pool = self._pools[g]
            if pool.reserved + len(extra[g]) > pool.capacity:
                return False
        for g, more in extra.items():
            hold.keeps[g] |= more
            hold.most[g] += len(more)
            self._pools[g].reserved += len(more)
        return True

    def insert(self, hold: Hold, tokens: Sequence[int] | np.ndarray) -> int:
        """Laws 5 and 8: the whole pages of ``tokens`` (the hold's sequence, written up to its
        end) past those the hold already reads from the tree, into the tree, with the pages
        of each sliding group's last window that the hold still holds. Returns how many of the
        hold's pages became cached. Raises ``ValueError`` if the tokens need more pages than
        the hold has or do not start with the pages it matched."""
        self._live(hold, "insert")
        data = _bytes("insert", tokens)
        full = len(data) // 8 // self._size
        if full > len(hold.pages):
            raise ValueError(f"{_WHERE}.insert: {len(data) // 8} tokens fill {full} pages, the "
                             f"hold has {len(hold.pages)}")
        width = 8 * self._size
        for k, x in enumerate(hold.nodes):
            if data[k * width : (k + 1) * width] != x.key:
                raise ValueError(f"{_WHERE}.insert: page {k} of the tokens is not the page "
                                 f"the hold reads from the cache")
        parent = hold.nodes[-1] if hold.nodes else self._root
        added, a = 0, self._anchor
        # law 8: of a sliding group, the pages a hit at the prefix's end, or one page short
        # of it (a prompt of whole pages is matched one page short), reads
        keep = {g: hit_pages(self.windows[g], max(0, full - 1), self._size).start
                for g in self._sliding}
        for k in range(len(hold.nodes), full):
            key = data[k * width : (k + 1) * width]
            node = parent.children.get(key)
            if node is None:  # the hold's page joins the tree, still read by the hold
                pages = [-1] * len(self._pools)
                node = CachedPage(pages, k, key, parent, bool(self._sliding))
                if a is not None:
                    pages[a] = hold.tables[a][k]
                    hold.owns[a].discard(pages[a])
                    self._pools[a].cached += 1
                    added += 1
                parent.children[key] = node
                node.readers = 1
            else:  # cached meanwhile by another request: the hold keeps its own copy
                self._read(node)
            for g in self._sliding:
                if k in hold.kept[g]:
                    added += self._adopt_kept(hold, node, g, k)
                elif k >= keep[g] or k in hold.keeps[g]:
                    added += self._adopt(hold, node, g, k)
            hold.nodes.append(node)
            parent = node
        return added

    def release(self, hold: Hold) -> None:
        """Law 6: the request lets go of its pages. Raises :class:`PageError` on a second
        release."""
        self._live(hold, "release")
        self._clock += 1
        a = self._anchor
        for x in hold.nodes:
            x.readers -= 1
            x.last_used = self._clock
            if x.readers == 0 and a is not None:
                self._pools[a].unread += 1
        for g in self._sliding:
            for k in range(hold.low[g], hold.top[g]):
                self._drop(hold, g, k, keep=False)
            for page in hold.kept[g].values():
                hold.owns[g].discard(page)
                self._pools[g].freed.append(page)
            hold.kept[g].clear()
            self._pools[g].reserved -= hold.most[g]
            hold.low[g] = hold.top[g]
        if a is not None:
            # a path's only node that can be a leaf is its last
            for x in reversed(hold.nodes):
                if x.readers == 0 and not x.children:
                    self._push(x, a)
            self._pools[a].freed.extend(sorted(hold.owns[a], reverse=True))
            hold.owns[a].clear()
        elif hold.nodes:
            self._prune(hold.nodes[-1])
        hold.released = True
        del self._holds[id(hold)]

    # -- inside -------------------------------------------------------------------------------
    def _read(self, node: CachedPage) -> None:
        if node.readers == 0 and self._anchor is not None:
            self._pools[self._anchor].unread -= 1
            node._stamp += 1  # its heap entry, if any, is stale now
        node.readers += 1

    def _adopt(self, hold: Hold, node: CachedPage, g: int, k: int) -> int:
        """Law 8: the hold's page ``k`` of sliding group ``g``, where it holds one and the node
        has none, becomes the node's (still read by the hold). Returns 1 if it did."""
        page = hold.tables[g][k]
        if page < 0 or node.pages[g] >= 0:
            return 0  # given back already, or the node has its own: the hold keeps its copy
        node.pages[g] = page
        node.seers[g] = 1
        hold.owns[g].discard(page)
        self._pools[g].cached += 1
        return 1

    def _adopt_kept(self, hold: Hold, node: CachedPage, g: int, k: int) -> int:
        """Law 10: a page kept past the hold's reach joins the node, read by no one (or is
        freed, where the node has its own). Returns 1 if it joined."""
        page = hold.kept[g].pop(k)
        hold.owns[g].discard(page)
        pool = self._pools[g]
        if node.pages[g] >= 0:
            pool.freed.append(page)
            return 0
        node.pages[g] = page
        pool.cached += 1
        pool.unread += 1
        self._push(node, g)
        return 1

    def _drop(self, hold: Hold, g: int, k: int, keep: bool = True) -> None:
        """Law 7: the hold gives back its page ``k`` of sliding group ``g``: read from a node,
        it stays cached (read by one fewer); its own, it is freed, or kept (law 10)."""
        page = hold.tables[g][k]
        hold.tables[g][k] = -1
        pool = self._pools[g]
        if k < len(hold.nodes) and hold.nodes[k].pages[g] == page:
            x = hold.nodes[k]
            x.seers[g] -= 1
            if x.seers[g] == 0:
                pool.unread += 1
                self._push(x, g)
        elif keep and k in hold.keeps[g]:
            hold.kept[g][k] = page
        else:
            hold.owns[g].discard(page)
            pool.freed.append(page)

    def _push(self, node: CachedPage, g: int) -> None:
        pool = self._pools[g]
        if g == self._anchor:
            node._stamp += 1
            stamp = node._stamp
        else:
            node._stamps[g] += 1
            stamp = node._stamps[g]
        heapq.heappush(pool.heap, (self.policy(node), next(self._pushes), stamp, node))
        if len(pool.heap) > 2 * pool.cached + 64:  # stale entries: rebuild
            pool.heap = [e for e in pool.heap if self._current(e, g)]
            heapq.heapify(pool.heap)

    def _current(self, entry: tuple, g: int) -> bool:
        node = entry[3]
        if node.parent is None:
            return False
        if g == self._anchor:
            return entry[2] == node._stamp and node.readers == 0 and not node.children
        return entry[2] == node._stamps[g] and node.pages[g] >= 0 and node.seers[g] == 0

    def _evict(self, g: int) -> None:
        """Laws 4 and 9: the first page without readers in the policy's order goes: of the
        full group a leaf, with its node; of a sliding group any, its node staying."""
        pool = self._pools[g]
        while True:
            entry = heapq.heappop(pool.heap)  # never empty while a page is evictable
            if self._current(entry, g):
                break
        node = entry[3]
        if g != self._anchor:
            self._free_page(node, g)
            if self._anchor is None:
                self._prune(node)
            return
        parent = node.parent
        del parent.children[node.key]
        node.parent = None
        for h in range(len(self._pools)):
            if node.pages[h] >= 0:
                self._free_page(node, h)
        if parent is not self._root and parent.readers == 0 and not parent.children:
            self._push(parent, g)

    def _free_page(self, node: CachedPage, g: int) -> None:
        pool = self._pools[g]
        pool.freed.append(node.pages[g])
        node.pages[g] = -1
        pool.cached -= 1
        pool.unread -= 1
        self.evictions += 1

    def _prune(self, node: CachedPage) -> None:
        """Law 9, without a full group: a node holding no page, no child and no reader goes,
        and so may its parent then."""
        while (node is not self._root and node.parent is not None and node.readers == 0
               and not node.children and max(node.pages) < 0):
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            node = parent

    def _alloc(self, g: int, k: int) -> list[int]:
        pool = self._pools[g]
        while pool.free < k:
            self._evict(g)
        return pool.take(k)

    def _live(self, hold: Hold, op: str) -> None:
        if self._holds.get(id(hold)) is not hold:
            what = "released already" if hold.released else "not of this cache"
            raise PageError(f"{_WHERE}.{op}: the hold is {what}")

    def check(self) -> None:
        """Asserts laws 1, 3, 7 and 9 (for tests): in each group's pool every page in exactly
        one place, readers equal to the holds that read a node, holds are root paths, the
        reservations what the holds may still take."""
        G = len(self._pools)
        seen: list[dict[int, str]] = [{} for _ in range(G)]

        def put(g: int, page: int, where: str) -> None:
            if page in seen[g]:
                raise AssertionError(f"page {page} of group {g} is {seen[g][page]} and {where}")
            seen[g][page] = where

        for g, pool in enumerate(self._pools):
            for p in pool.freed:
                put(g, p, "free")
        readers: dict[int, int] = {}
        seers: dict[tuple[int, int], int] = {}
        cached, unread = [0] * G, [0] * G
        stack = list(self._root.children.values())
        while stack:
            x = stack.pop()
            for g in range(G):
                if x.pages[g] >= 0:
                    put(g, x.pages[g], "cached")
                    cached[g] += 1
                    unread[g] += (x.readers if g == self._anchor else x.seers[g]) == 0
                    seers[id(x), g] = 0
            if self._anchor is not None:
                assert x.pages[self._anchor] >= 0, "a node of the tree without its full page"
            else:
                assert x.children or x.readers or max(x.pages) >= 0, "an empty leaf is kept"
            readers[id(x)] = 0
            assert x.parent is not None and x.parent.children.get(x.key) is x
            assert x.parent is self._root or x.parent.readers >= x.readers
            stack.extend(x.children.values())
        reserved = [0] * G
        for hold in self._holds.values():
            for g in range(G):
                for p in hold.owns[g]:
                    put(g, p, "owned")
            parent = self._root
            for x in hold.nodes:
                assert x.parent is parent, "a hold's nodes are a path from the root"
                readers[id(x)] += 1
                parent = x
            for g in self._sliding:
                table = hold.tables[g]
                assert all(p < 0 for p in table[: hold.low[g]] + table[hold.top[g]:])
                for k in range(hold.low[g], hold.top[g]):
                    assert table[k] >= 0, "a hold's window has a hole"
                    if k < len(hold.nodes) and hold.nodes[k].pages[g] == table[k]:
                        seers[id(hold.nodes[k]), g] += 1
                    else:
                        assert table[k] in hold.owns[g], "a held page is neither own nor read"
                reserved[g] += hold.most[g]
                assert hold.held(g) <= hold.most[g]
        stack = list(self._root.children.values())
        while stack:
            x = stack.pop()
            assert x.readers == readers[id(x)], f"{x} has {readers[id(x)]} holds"
            for g in self._sliding:
                if x.pages[g] >= 0:
                    assert x.seers[g] == seers[id(x), g], f"{x} is read by {seers[id(x), g]}"
            stack.extend(x.children.values())
        for g, pool in enumerate(self._pools):
            assert all(p < pool.fresh for p in seen[g]), "a page never used is in use or freed"
            assert len(seen[g]) == pool.fresh, f"{pool.fresh - len(seen[g])} pages leaked"
            assert cached[g] == pool.cached and unread[g] == pool.unread
            assert reserved[g] == pool.reserved, f"group {g} reserves {pool.reserved}"
            if g != self._anchor:
                assert pool.capacity - pool.free - pool.unread <= pool.reserved <= pool.capacity


def _windows(windows: Any) -> tuple[int | None, ...]:
    """The groups' windows: ``None`` or a positive integer each, at most one of each."""
    if isinstance(windows, str | bytes) or not hasattr(windows, "__iter__"):
        raise TypeError(f"{_WHERE}: windows must be a sequence of None and positive "
                        f"integers, got {windows!r:.60}")
    out = tuple(windows)
    if not out:
        raise ValueError(f"{_WHERE}: windows names no group")
    for w in out:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int | np.integer)):
            raise TypeError(f"{_WHERE}: a window must be None or a positive integer, got "
                            f"{w!r:.40}")
        if w is not None and w < 1:
            raise ValueError(f"{_WHERE}: a window must be None or a positive integer, got {w}")
    out = tuple(None if w is None else int(w) for w in out)
    if len(set(out)) != len(out):
        raise ValueError(f"{_WHERE}: windows {list(out)} name a group twice")
    return out


def _counts(pages: Any, groups: int) -> list[int]:
    """Pages of each group's pool: one number for every group, or one per group."""
    if isinstance(pages, Sequence) and not isinstance(pages, str | bytes):
        if len(pages) != groups:
            raise ValueError(f"{_WHERE}: pages gives {len(pages)} pools for {groups} groups")
        return [_integer("pages", p, 0) for p in pages]
    return [_integer("pages", pages, 0)] * groups


def _integer(name: str, value: Any, least: int) -> int:
    return check.integer("prefix.PrefixCache", name, value, least=least)


_LARGEST = np.iinfo(np.int64).max


def _bytes(op: str, tokens: Any) -> bytes:
    """Tokens as little-endian int64 bytes: page keys are slices of it, equal exactly when
    the tokens are. Only integers that int64 holds: a float is never truncated into
    another prompt's key, nor a uint64 past 2**63 wrapped to a negative one."""
    if not isinstance(tokens, np.ndarray):
        if isinstance(tokens, str | bytes | dict) or not hasattr(tokens, "__iter__"):
            raise TypeError(f"{_WHERE}.{op}: tokens must be a sequence of integers, got "
                            f"{tokens!r:.80}")
        items = tokens if hasattr(tokens, "__len__") else list(tokens)
        # one pass in C over the items' types: a bool or a float among ints would convert
        if not all(k is not bool and issubclass(k, int | np.integer)
                   for k in set(map(type, items))):
            _name_the_bad_token(op, items)
        try:
            tokens = np.asarray(items, dtype=np.int64)
        except OverflowError:
            _name_the_bad_token(op, items)
    if tokens.ndim != 1:
        raise ValueError(f"{_WHERE}.{op}: tokens must be a 1-D array of integers, got "
                         f"{tokens.dtype} of shape {tokens.shape}")
    if tokens.size and tokens.dtype.kind not in "iu":
        raise TypeError(f"{_WHERE}.{op}: tokens must be integers, got dtype {tokens.dtype}")
    if tokens.dtype.kind == "u" and tokens.size and tokens.max() > _LARGEST:
        raise ValueError(f"{_WHERE}.{op}: token {int(tokens.max())} is past the largest id a "
                         f"key holds, {_LARGEST}")
    return tokens.astype("<i8", copy=False).tobytes()


def _name_the_bad_token(op: str, items: list) -> None:
    """Raises naming the first item of ``items`` that is no integer int64 holds."""
    for k, t in enumerate(items):
        if isinstance(t, bool | np.bool_) or not isinstance(t, int | np.integer):
            raise TypeError(f"{_WHERE}.{op}: token {k} must be an integer, got {t!r:.40}")
        if not -_LARGEST - 1 <= int(t) <= _LARGEST:
            raise ValueError(f"{_WHERE}.{op}: token {k} is {int(t)}, past the int64 a key "
                             f"holds")
