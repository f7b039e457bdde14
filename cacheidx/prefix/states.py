"""The manager of a model's recurrent layers' snapshots: one slot per block of ``m`` positions
(``m`` a multiple of the page size), holding every recurrent layer's state after the block's
last position (:mod:`cacheidx.state`), kept in the tree beside the pages.

Laws (the cache's, for the snapshot group; ``k = m / P`` pages a block):

11. A request holds a snapshot slot for each block of its tokens (its table of blocks: block
    ``j`` holds the state after position ``j*m + m - 1``), the first ones the cached
    snapshots of its hit; a slot is free, owned by one request, or cached (law 1).
12. A node that closes a block (depth ``d`` with ``(d + 1) % k == 0``) may hold the
    snapshot of that block; ``insert`` gives it the hold's where it has none. A hit resumes
    a recurrent layer from the snapshot at its junction alone, so ``match`` is the longest
    prefix, capped as law 2 says, that ends at a block's end whose node holds its snapshot:
    at most ``m - 1`` tokens short of the pages' hit, never the whole prompt.
13. A cached snapshot is read by the requests holding its node (law 3's readers); one read by
    no one may be evicted alone, least recently released first, its node staying without
    it (of those one release let go, the shallowest first: the deepest is where a chat's
    next turn resumes); a node evicted takes its snapshot with it. The pool's slots are its
    own budget: an admission evicts snapshots for snapshots, pages for pages.
14. Junctions. A request also holds one slot more, its junction: the caller copies its running
    state there after a call whose last token closes a page (:meth:`StateManager.mark`, at
    the end of the prompt's last whole page before its last token, and at each page end
    while it decodes), and ``insert`` gives it to that page's node where the node is no
    block's end and has none, the request taking a fresh slot for the next. So a prompt's
    samples, and the next turn of a chat (the last one's prompt and answer, then a new
    message), resume where the pages alone would, at a whole page, whatever ``m``. A hit
    may end at any node holding a snapshot; one that is no block's end names the snapshot
    to copy into the request's running slot before its first call (``hold.resume``).
"""

from __future__ import annotations

from .hold import GroupHold
from .manager import GroupManager
from .pool import Pool
from .tree import CachedPage, Tree

__all__ = ["StateManager"]


class StateManager(GroupManager):
    """The snapshot group ``g`` of blocks of ``every`` positions over ``pools[g]``."""

    kind = "state"

    def __init__(self, g: int, every: int, pools: list[Pool], tree: Tree, page_size: int):
        super().__init__(g, None, pools, tree, page_size)
        self.every = every
        self.k = every // page_size  #: pages a block

    def blocks_for(self, tokens: int) -> int:
        return -(-int(tokens) // self.every)

    def closes(self, depth: int) -> bool:
        """Whether the node at ``depth`` (its tokens ``depth * P`` on) closes a block."""
        return (depth + 1) % self.k == 0

    # -- admission (law 11) ---------------------------------------------------------------------
    def most_pages(self, total: int, call: int = 1) -> int:
        # and its junction, and the junction a hit resumes from, pinned (law 14)
        return self.blocks_for(total) + 2

    def too_large(self, total: int) -> str | None:
        least = self.most_pages(total)
        if least > self.pool.capacity:
            return (f"{total} tokens need {least} snapshot slots (one per block of "
                    f"{self.every} positions, and two junctions); "
                    f"the snapshot pool has {self.pool.capacity}")
        return None

    def _held(self, nodes: list[CachedPage]) -> int:
        return len(nodes) // self.k

    def room(self, nodes: list[CachedPage], total: int, longest: int) -> int | None:
        pool, g = self.pool, self.g
        need = self.blocks_for(total) - self._held(nodes) + 1  # and a junction (law 14)
        losing = sum(1 for x in nodes if x.pages[g] >= 0 and x.readers == 0)
        return None if need > pool.free + pool.unread - losing else 0

    def admit(self, nodes: list[CachedPage], want: int, most: int) -> GroupHold:
        g, k = self.g, self.k
        matched = [nodes[(b + 1) * k - 1].pages[g] for b in range(self._held(nodes))]
        own = self.alloc(self.blocks_for(want * self.size) - len(matched) + 1)
        hold = GroupHold(matched + own[1:], set(own), junction=[-1, own[0]])
        if nodes and len(nodes) % k:  # a junction's hit: its snapshot is copied in (law 14)
            hold.resume = nodes[-1].pages[g]
        return hold

    def mark(self, hold: GroupHold, page: int) -> int:
        """Law 14: the hold's junction is to hold the state after its page ``page``; returns
        the slot to copy the running state into (-1: none, or the page ends a block, whose
        snapshot the call stores itself)."""
        if self.closes(page) or hold.junction[1] < 0:
            return -1
        hold.junction[0] = page
        return hold.junction[1]

    def claim(self, node: CachedPage) -> None:
        """A node read again by its first reader: its snapshot may no longer go."""
        if node.pages[self.g] >= 0:
            self.pool.unread -= 1
            node.stamps[self.g] += 1  # its heap entry, if any, is stale now

    # -- matching (law 12) ----------------------------------------------------------------------
    def missing(self, nodes: list[CachedPage], depth: int) -> int:
        """Laws 12 and 14: a hit ends at a node holding a snapshot, else at the deepest one
        before it that does."""
        g = self.g
        if depth == 0 or nodes[depth - 1].pages[g] >= 0:
            return -1
        depth -= 1
        while depth > 0 and nodes[depth - 1].pages[g] < 0:
            depth -= 1
        return depth

    # -- caching and letting go -----------------------------------------------------------------
    def insert(self, hold: GroupHold, nodes: list[CachedPage], start: int, full: int) -> int:
        g, pool, added = self.g, self.pool, 0
        for d in range(start, len(nodes)):
            if not self.closes(d):
                continue
            node, slot = nodes[d], hold.table[(d + 1) // self.k - 1]
            if node.pages[g] < 0 and slot in hold.own:  # else the node keeps its own (law 5)
                node.pages[g] = slot
                hold.own.discard(slot)
                pool.cached += 1
                added += 1
        page, slot = hold.junction
        if slot >= 0 and start <= page < len(nodes) and nodes[page].pages[g] < 0:  # law 14
            nodes[page].pages[g] = slot
            hold.own.discard(slot)
            pool.cached += 1
            added += 1
            fresh = self.alloc(1) if pool.free + pool.unread > 0 else [-1]
            hold.own.update(s for s in fresh if s >= 0)
            hold.junction = [-1, fresh[0]]
        return added

    def release(self, hold: GroupHold, nodes: list[CachedPage]) -> None:
        g, pool = self.g, self.pool
        for x in nodes:  # the shallowest first in the heap: it goes first (law 13)
            if x.readers == 0 and x.pages[g] >= 0:
                pool.unread += 1
                self.push(x)
        pool.freed.extend(sorted(hold.own, reverse=True))
        hold.own.clear()

    # -- eviction (law 13) ----------------------------------------------------------------------
    def readers(self, node: CachedPage) -> int:
        return node.readers

    def push(self, node: CachedPage) -> None:
        node.stamps[self.g] += 1
        self.pool.push(node, node.stamps[self.g], self.current)

    def current(self, entry: tuple) -> bool:
        node, g = entry[3], self.g
        if node.parent is None:
            return False
        return entry[2] == node.stamps[g] and node.pages[g] >= 0 and node.readers == 0

    def evict(self) -> None:
        """Law 13: the first snapshot read by no one, in the policy's order, goes; its node
        stays."""
        self.uncache(self.pool.pop(self.current), self.g)
