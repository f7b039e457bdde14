"""An online prefix cache over a fixed pool of pages: pages computed by one request are kept
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

__all__ = ["CachedPage", "Hold", "Match", "PrefixCache", "lru"]

_WHERE = "cacheidx.prefix.PrefixCache"


class CachedPage:
    """A node of the tree: one cached page. Read-only for a policy."""

    __slots__ = ("page", "depth", "key", "parent", "children", "readers", "last_used", "hits",
                 "_stamp")

    def __init__(self, page: int, depth: int, key: bytes, parent: CachedPage | None):
        self.page = page  #: the pool page holding it
        self.depth = depth  #: its place in the sequence: it holds tokens ``depth * P`` on
        self.key = key
        self.parent = parent
        self.children: dict[bytes, CachedPage] = {}
        self.readers = 0  #: requests holding it now
        self.last_used = 0  #: the cache's clock when its last reader let go
        self.hits = 0  #: admissions that matched it
        self._stamp = 0  #: which heap entry of it is current

    def __repr__(self) -> str:
        return (f"CachedPage(page={self.page}, depth={self.depth}, readers={self.readers}, "
                f"last_used={self.last_used}, hits={self.hits})")


def lru(page: CachedPage) -> Any:
    """The default policy: the least recently released page goes first."""
    return page.last_used


@dataclasses.dataclass(frozen=True)
class Match:
    """The cached prefix of a prompt: ``pages`` hold its first ``tokens`` tokens."""

    pages: tuple[int, ...]
    tokens: int
    _nodes: tuple[CachedPage, ...] = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(eq=False)
class Hold:
    """What one request holds: ``pages`` is its page table (page ``k`` holds its tokens
    ``k * P`` to ``k * P + P - 1``), the first ``cached // P`` of them read from the cache."""

    pages: list[int]
    cached: int  #: tokens the request found cached when admitted
    nodes: list[CachedPage] = dataclasses.field(repr=False)  #: its path in the tree
    own: set[int] = dataclasses.field(repr=False)  #: its pages not in the tree
    released: bool = False


class PrefixCache:
    """A pool of ``pages`` pages of ``page_size`` tokens, cached as a tree (see the module's
    laws). ``policy`` maps a :class:`CachedPage` to a key; among the pages that may go, the
    smallest key is evicted first (:func:`lru` by default)."""

    def __init__(self, pages: int, page_size: int, *, policy: Callable[[CachedPage], Any] = lru):
        self._capacity = _integer("pages", pages, 0)
        self._size = _integer("page_size", page_size, 1)
        if self._capacity * self._size > _LARGEST:  # a table names slots in int64
            raise ValueError(f"{_WHERE}: {self._capacity} pages of {self._size} tokens are "
                             f"more slots than int64 numbers")
        if not callable(policy):
            raise TypeError(f"{_WHERE}: policy must be callable, got {policy!r}")
        self.policy = policy
        self._root = CachedPage(-1, -1, b"", None)
        # free pages: those freed since, a stack, then the pages from ``_fresh`` on, never
        # used (kept as a number, so that a pool of any size costs nothing to make)
        self._free: list[int] = []
        self._fresh = 0
        self._clock = 0
        self._heap: list[tuple[Any, int, int, CachedPage]] = []
        self._pushes = itertools.count()
        self._cached = 0
        self._unread = 0  # cached pages without readers: what eviction can free
        self._holds: dict[int, Hold] = {}
        self.evictions = 0  #: pages evicted so far

    # -- what the pool holds ------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def page_size(self) -> int:
        return self._size

    @property
    def free(self) -> int:
        """Pages holding nothing."""
        return len(self._free) + self._capacity - self._fresh

    @property
    def cached(self) -> int:
        """Pages in the tree, read or not."""
        return self._cached

    @property
    def evictable(self) -> int:
        """Cached pages no request reads: what admissions may evict."""
        return self._unread

    @property
    def in_use(self) -> int:
        """Pages running requests hold: their own and the cached ones they read."""
        return self._capacity - self.free - self._unread

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return -(-int(tokens) // self._size)

    # -- matching -----------------------------------------------------------------------------
    def match(self, tokens: Sequence[int] | np.ndarray) -> Match:
        """Law 2: the longest cached prefix of whole pages of ``tokens``, at most
        ``(len - 1) // P`` pages. Changes nothing. Costs one dictionary lookup per page
        matched, after one pass turning the tokens into bytes."""
        data = _bytes("match", tokens)
        n = len(data) // 8
        if n == 0:
            raise ValueError(f"{_WHERE}.match: the prompt is empty")
        nodes = self._walk(data, (n - 1) // self._size)
        return Match(tuple(x.page for x in nodes), len(nodes) * self._size, tuple(nodes))

    def _walk(self, data: bytes, most: int) -> list[CachedPage]:
        width = 8 * self._size
        node, nodes = self._root, []
        for k in range(most):
            node = node.children.get(data[k * width : (k + 1) * width])
            if node is None:
                break
            nodes.append(node)
        return nodes

    # -- a request's life: admit, insert, release -----------------------------------------------
    def admit(self, tokens: Sequence[int] | np.ndarray, total: int | None = None, *,
              reuse: bool = True) -> Hold | None:
        """A hold for a request of prompt ``tokens`` that will hold ``total`` tokens (its prompt
        and the tokens it will generate; the prompt by default): its matched pages (none
        without ``reuse``), retained, then fresh pages, evicting cached ones without readers
        as law 4 says. ``None`` when the pool cannot give them now.

        Raises :class:`PageError` when ``total`` tokens need more pages than the pool has, and
        ``ValueError`` for an empty prompt or a ``total`` below its length."""
        data = _bytes("admit", tokens)
        n = len(data) // 8
        if n == 0:
            raise ValueError(f"{_WHERE}.admit: the prompt is empty")
        total = n if total is None else check.integer("prefix.PrefixCache.admit", "total",
                                                      total, least=n)
        want = self.pages_for(total)
        if want > self._capacity:
            raise PageError(f"{_WHERE}.admit: {total} tokens need {want} pages of "
                            f"{self._size}; the pool has {self._capacity}")
        nodes = self._walk(data, (n - 1) // self._size) if reuse else []
        need = want - len(nodes)
        # the matched pages without readers stop being evictable once held
        if need > self.free + self._unread - sum(1 for x in nodes if x.readers == 0):
            return None
        for x in nodes:
            self._read(x)
            x.hits += 1
        own = self._alloc(need)
        hold = Hold([x.page for x in nodes] + own, len(nodes) * self._size, nodes, set(own))
        self._holds[id(hold)] = hold
        return hold

    def insert(self, hold: Hold, tokens: Sequence[int] | np.ndarray) -> int:
        """Law 5: the whole pages of ``tokens`` (the hold's sequence, written up to its end)
        past those the hold already reads from the tree, into the tree. Returns how many of
        the hold's pages became cached. Raises ``ValueError`` if the tokens need more pages
        than the hold has or do not start with the pages it matched."""
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
        added = 0
        for k in range(len(hold.nodes), full):
            key = data[k * width : (k + 1) * width]
            node = parent.children.get(key)
            if node is None:  # the hold's page joins the tree, still read by the hold
                page = hold.pages[k]
                node = CachedPage(page, k, key, parent)
                parent.children[key] = node
                node.readers = 1
                hold.own.discard(page)
                self._cached += 1
                added += 1
            else:  # cached meanwhile by another request: the hold keeps its own copy
                self._read(node)
            hold.nodes.append(node)
            parent = node
        return added

    def release(self, hold: Hold) -> None:
        """Law 6: the request lets go of its pages. Raises :class:`PageError` on a second
        release."""
        self._live(hold, "release")
        self._clock += 1
        for x in hold.nodes:
            x.readers -= 1
            x.last_used = self._clock
            if x.readers == 0:
                self._unread += 1
        # a path's only node that can be a leaf is its last
        for x in reversed(hold.nodes):
            if x.readers == 0 and not x.children:
                self._push(x)
        self._free.extend(sorted(hold.own, reverse=True))
        hold.own.clear()
        hold.released = True
        del self._holds[id(hold)]

    # -- inside -------------------------------------------------------------------------------
    def _read(self, node: CachedPage) -> None:
        if node.readers == 0:
            self._unread -= 1
            node._stamp += 1  # its heap entry, if any, is stale now
        node.readers += 1

    def _push(self, node: CachedPage) -> None:
        node._stamp += 1
        heapq.heappush(self._heap, (self.policy(node), next(self._pushes), node._stamp, node))
        if len(self._heap) > 2 * self._cached + 64:  # stale entries: rebuild
            self._heap = [e for e in self._heap if self._current(e)]
            heapq.heapify(self._heap)

    @staticmethod
    def _current(entry: tuple) -> bool:
        node = entry[3]
        return (entry[2] == node._stamp and node.readers == 0 and not node.children
                and node.parent is not None)

    def _evict(self) -> None:
        """Law 4: the first leaf without readers in the policy's order goes."""
        while True:
            entry = heapq.heappop(self._heap)  # never empty while a page is evictable
            if self._current(entry):
                break
        node = entry[3]
        parent = node.parent
        del parent.children[node.key]
        node.parent = None
        self._cached -= 1
        self._unread -= 1
        self.evictions += 1
        self._free.append(node.page)
        if parent is not self._root and parent.readers == 0 and not parent.children:
            self._push(parent)

    def _alloc(self, k: int) -> list[int]:
        while self.free < k:
            self._evict()
        taken = min(k, len(self._free))  # the freed pages first, the last freed first
        got = self._free[len(self._free) - taken :][::-1]
        del self._free[len(self._free) - taken :]
        got += range(self._fresh, self._fresh + k - taken)
        self._fresh += k - taken
        return got

    def _live(self, hold: Hold, op: str) -> None:
        if self._holds.get(id(hold)) is not hold:
            what = "released already" if hold.released else "not of this cache"
            raise PageError(f"{_WHERE}.{op}: the hold is {what}")

    def check(self) -> None:
        """Asserts laws 1 and 3 (for tests): every page in exactly one place, readers equal
        to the holds that read a node, holds are root paths."""
        seen: dict[int, str] = {}

        def put(page: int, where: str) -> None:
            if page in seen:
                raise AssertionError(f"page {page} is {seen[page]} and {where}")
            seen[page] = where

        for p in self._free:
            put(p, "free")
        readers: dict[int, int] = {}
        stack, unread, cached = list(self._root.children.values()), 0, 0
        while stack:
            x = stack.pop()
            put(x.page, "cached")
            cached += 1
            unread += x.readers == 0
            readers[id(x)] = 0
            assert x.parent is not None and x.parent.children.get(x.key) is x
            assert x.parent is self._root or x.parent.readers >= x.readers
            stack.extend(x.children.values())
        for hold in self._holds.values():
            for p in hold.own:
                put(p, "owned")
            parent = self._root
            for x in hold.nodes:
                assert x.parent is parent, "a hold's nodes are a path from the root"
                readers[id(x)] += 1
                parent = x
        stack = list(self._root.children.values())
        while stack:
            x = stack.pop()
            assert x.readers == readers[id(x)], f"{x} has {readers[id(x)]} holds"
            stack.extend(x.children.values())
        assert all(p < self._fresh for p in seen), "a page never used is also in use or freed"
        assert len(seen) == self._fresh, f"{self._fresh - len(seen)} pages leaked"
        assert cached == self._cached and unread == self._unread


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
