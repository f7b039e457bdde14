"""The manager of a group of full layers, which read every position: its pages make the tree.

Laws 3 to 6 of :mod:`.cache` for that group: a request holds a page for each of its
positions, the first ones read from the tree; the pages it caches join the tree as nodes;
a node read by no one and without children may go, with every group's page of it, least
recently released first, so a cached page is never evicted under a cached one.
"""

from __future__ import annotations

from .hold import GroupHold
from .manager import GroupManager
from .tree import CachedPage

__all__ = ["FullManager"]


class FullManager(GroupManager):
    """A group of full layers (``window`` ``None``): the tree's readers are its readers."""

    def most_pages(self, total: int, call: int = 1) -> int:
        return self.pages_for(total)

    def too_large(self, total: int) -> str | None:
        least = self.pages_for(total)
        if least > self.pool.capacity:
            return (f"{total} tokens need {least} pages of {self.size}; the pool has "
                    f"{self.pool.capacity}")
        return None

    def room(self, nodes: list[CachedPage], total: int, longest: int) -> int | None:
        pool = self.pool
        # the matched pages without readers stop being evictable once held
        need, losing = self.pages_for(total) - len(nodes), sum(1 for x in nodes
                                                               if x.readers == 0)
        return None if need > pool.free + pool.unread - losing else 0

    def admit(self, nodes: list[CachedPage], want: int, most: int) -> GroupHold:
        d = len(nodes)
        own = self.alloc(want - d)
        return GroupHold([x.pages[self.g] for x in nodes] + own, set(own), low=d, top=d)

    def claim(self, node: CachedPage) -> None:
        """Law 4: a node read again, by its first reader, may no longer go."""
        self.pool.unread -= 1
        node.stamp += 1  # its heap entry, if any, is stale now

    def insert(self, hold: GroupHold, nodes: list[CachedPage], start: int, full: int) -> int:
        g, pool, added = self.g, self.pool, 0
        for k in range(start, len(nodes)):
            node = nodes[k]
            if node.pages[g] < 0:  # a new node (every node of the tree holds its full page)
                node.pages[g] = hold.table[k]
                hold.own.discard(node.pages[g])
                pool.cached += 1
                added += 1
            # else cached meanwhile by another request: the hold keeps its own copy (law 5)
        return added

    def release(self, hold: GroupHold, nodes: list[CachedPage]) -> None:
        pool = self.pool
        for x in nodes:
            if x.readers == 0:
                pool.unread += 1
        # a path's only node that can be a leaf is its last
        for x in reversed(nodes):
            if x.readers == 0 and not x.children:
                self.push(x)
        pool.freed.extend(sorted(hold.own, reverse=True))
        hold.own.clear()

    def readers(self, node: CachedPage) -> int:
        return node.readers

    def push(self, node: CachedPage) -> None:
        node.stamp += 1
        self.pool.push(node, node.stamp, self.current)

    def current(self, entry: tuple) -> bool:
        node = entry[3]
        if node.parent is None:
            return False
        return entry[2] == node.stamp and node.readers == 0 and not node.children

    def evict(self) -> None:
        """Law 4: the first leaf without readers in the policy's order goes, with its node
        and every group's page of it; its parent may go next once it is a leaf."""
        node = self.pool.pop(self.current)
        parent = self.tree.cut(node)
        for h in range(len(self.pools)):
            if node.pages[h] >= 0:
                self.uncache(node, h)
        if parent is not self.tree.root and parent.readers == 0 and not parent.children:
            self.push(parent)
