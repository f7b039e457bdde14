"""A check of the online prefix cache's laws 1, 3, 7 and 9 (:mod:`.cache`) by a walk of all
it holds, for tests (:meth:`PrefixCache.check <.cache.PrefixCache.check>`); the cache's
operations never call it. It counts again, from the tree and the holds, what the pools count
as they go, and fails on the first difference.
"""

from __future__ import annotations

from collections.abc import Iterable

from .manager import GroupManager
from .tree import CachedPage

__all__ = ["check"]


def check(root: CachedPage, groups: list[GroupManager], holds: Iterable) -> None:
    """Asserts laws 1, 3, 7 and 9 of the tree under ``root`` over ``groups`` and the live
    ``holds`` (:class:`~.cache.Hold`): in each group's pool every page in exactly one place,
    readers equal to the holds that read a node, holds are root paths, the reservations what
    the holds may still take."""
    G = len(groups)
    full = [m for m in groups if m.kind == "full"]
    sliding = [m for m in groups if m.kind == "sliding"]
    seen: list[dict[int, str]] = [{} for _ in range(G)]

    def put(g: int, page: int, where: str) -> None:
        if page in seen[g]:
            raise AssertionError(f"page {page} of group {g} is {seen[g][page]} and {where}")
        seen[g][page] = where

    for m in groups:
        for p in m.pool.freed:
            put(m.g, p, "free")
    readers: dict[int, int] = {}
    seers: dict[tuple[int, int], int] = {}
    cached, unread = [0] * G, [0] * G
    stack = list(root.children.values())
    while stack:
        x = stack.pop()
        for m in groups:
            g = m.g
            if x.pages[g] >= 0:
                put(g, x.pages[g], "cached")
                cached[g] += 1
                unread[g] += m.readers(x) == 0
                seers[id(x), g] = 0
        if full:
            assert x.pages[full[0].g] >= 0, "a node of the tree without its full page"
        else:
            assert x.children or x.readers or max(x.pages) >= 0, "an empty leaf is kept"
        readers[id(x)] = 0
        assert x.parent is not None and x.parent.children.get(x.key) is x
        assert x.parent is root or x.parent.readers >= x.readers
        stack.extend(x.children.values())
    reserved = [0] * G
    for hold in holds:
        for g, part in enumerate(hold.groups):
            for p in part.own:
                put(g, p, "owned")
        parent = root
        for x in hold.nodes:
            assert x.parent is parent, "a hold's nodes are a path from the root"
            readers[id(x)] += 1
            parent = x
        for m in sliding:
            g, part = m.g, hold.groups[m.g]
            table = part.table
            assert all(p < 0 for p in table[: part.low] + table[part.top:])
            for k in range(part.low, part.top):
                assert table[k] >= 0, "a hold's window has a hole"
                if k < len(hold.nodes) and hold.nodes[k].pages[g] == table[k]:
                    seers[id(hold.nodes[k]), g] += 1
                else:
                    assert table[k] in part.own, "a held page is neither own nor read"
            reserved[g] += part.most
            assert part.held() <= part.most
    stack = list(root.children.values())
    while stack:
        x = stack.pop()
        assert x.readers == readers[id(x)], f"{x} has {readers[id(x)]} holds"
        for m in sliding:
            g = m.g
            if x.pages[g] >= 0:
                assert x.seers[g] == seers[id(x), g], f"{x} is read by {seers[id(x), g]}"
        stack.extend(x.children.values())
    for m in groups:
        g, pool = m.g, m.pool
        assert all(p < pool.fresh for p in seen[g]), "a page never used is in use or freed"
        assert len(seen[g]) == pool.fresh, f"{pool.fresh - len(seen[g])} pages leaked"
        assert cached[g] == pool.cached and unread[g] == pool.unread
        assert reserved[g] == pool.reserved, f"group {g} reserves {pool.reserved}"
        if m.kind == "sliding":
            assert pool.capacity - pool.free - pool.unread <= pool.reserved <= pool.capacity
