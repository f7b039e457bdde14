"""The manager of a group of sliding layers of window ``w``, which read the last ``w``
positions (:mod:`.reach`): a request holds only the pages its calls still read.

Laws 7 to 10 of :mod:`.cache` for that group: a hold gives back the pages below its next
call's reach and takes those of its positions, never more at once than it reserved when
admitted; a cached prefix keeps the pages of its last window and one page more; a hit needs
them; a page read by no one may go on its own, its node staying (or, without a full group,
going once it holds no page); a hold told to keep a window keeps it past its reach until it
is cached.
"""

from __future__ import annotations

from .hold import GroupHold
from .keys import WHERE
from .manager import GroupManager, Slid
from .pages import PageError
from .pool import Pool
from .reach import first_page, hit_pages, pages_at_once
from .tree import CachedPage, Tree

__all__ = ["SlidingManager"]


class SlidingManager(GroupManager):
    """A group of sliding layers of ``window`` positions; ``prunes``: there is no full group,
    so a node goes with its last page (law 9)."""

    kind = "sliding"

    def __init__(self, g: int, window: int, pools: list[Pool], tree: Tree, page_size: int, *,
                 prunes: bool):
        super().__init__(g, window, pools, tree, page_size)
        self.prunes = prunes

    def most_pages(self, total: int, call: int = 1) -> int:
        return min(self.pages_for(total), pages_at_once(self.window, call, self.size))

    def too_large(self, total: int) -> str | None:
        least, w = self.most_pages(total), self.window
        if least > self.pool.capacity:
            return (f"a window of {w} tokens needs {least} pages of {self.size} at once; the "
                    f"pool of window {w} has {self.pool.capacity}")
        return None

    def room(self, nodes: list[CachedPage], total: int, longest: int) -> int | None:
        pool, w = self.pool, self.window
        most = self.most_pages(total, longest)
        if most > pool.capacity:
            raise PageError(f"{WHERE}.admit: calls of {longest} tokens read up to {most} "
                            f"pages of window {w} at once; the pool of window {w} has "
                            f"{pool.capacity}")
        return None if most > pool.capacity - pool.reserved else most  # every hold's most fits

    def admit(self, nodes: list[CachedPage], want: int, most: int) -> GroupHold:
        """The matched window (law 8) read, the rest taken by :meth:`slide`, ``most``
        reserved (law 7)."""
        g, pool, d = self.g, self.pool, len(nodes)
        window = hit_pages(self.window, d, self.size)
        table = [-1] * want
        for k in window:
            x = nodes[k]
            table[k] = x.pages[g]
            if x.seers[g] == 0:
                pool.unread -= 1
                x.stamps[g] += 1  # its heap entry, if any, is stale now
            x.seers[g] += 1
        pool.reserved += most
        return GroupHold(table, low=window.start if window else d, top=d, most=most)

    def missing(self, nodes: list[CachedPage], depth: int) -> int:
        g = self.g
        for k in reversed(hit_pages(self.window, depth, self.size)):
            if nodes[k].pages[g] < 0:
                return k
        return -1

    def reach(self, hold: GroupHold, nodes: list[CachedPage], first: int,
              last: int) -> Slid | None:
        lo, hi = first_page(self.window, first, self.size), last // self.size + 1
        low, top = hold.low, hold.top
        if lo <= low and hi <= top:
            return None
        new_low, new_top = max(low, lo), max(top, hi)
        kept = len(hold.kept) + sum(  # its own pages given back into law 10's keeping
            1 for k in range(low, min(new_low, top))
            if k in hold.keeps and not _reads(hold, nodes, k, self.g))
        if new_top - new_low + kept > hold.most:
            raise ValueError(f"{WHERE}.slide: positions {first} to {last} read "
                             f"{new_top - new_low} pages of window {self.window}"
                             f"{f' beside {kept} kept' if kept else ''}; the hold was "
                             f"admitted for {hold.most} at once")
        return low, new_low, top, new_top

    def slide(self, hold: GroupHold, nodes: list[CachedPage], slid: Slid) -> None:
        low, new_low, top, new_top = slid
        for k in range(low, min(new_low, top)):
            self._drop(hold, nodes, k)
        start = max(top, new_low)
        if new_top > start:
            got = self.alloc(new_top - start)
            hold.table[start:new_top] = got
            hold.own.update(got)
        hold.low, hold.top = new_low, new_top

    def keeping(self, hold: GroupHold, nodes: list[CachedPage], depth: int) -> set[int] | None:
        g, span = self.g, hit_pages(self.window, depth, self.size)
        if any(k not in hold.kept and not (k < len(nodes) and nodes[k].pages[g] >= 0)
               for k in range(span.start, min(span.stop, hold.low))):
            return None  # given back already
        more = set(span) - hold.keeps
        return None if self.pool.reserved + len(more) > self.pool.capacity else more

    def keep(self, hold: GroupHold, more: set[int]) -> None:
        hold.keeps |= more
        hold.most += len(more)
        self.pool.reserved += len(more)

    def insert(self, hold: GroupHold, nodes: list[CachedPage], start: int, full: int) -> int:
        """Law 8: of the new nodes, those a hit at the prefix's end, or one page short of it
        (a prompt of whole pages is matched one page short), reads take the hold's pages,
        and those law 10 kept."""
        keep, added = hit_pages(self.window, max(0, full - 1), self.size).start, 0
        for k in range(start, len(nodes)):
            if k in hold.kept:
                added += self._adopt_kept(hold, nodes[k], k)
            elif k >= keep or k in hold.keeps:
                added += self._adopt(hold, nodes[k], k)
        return added

    def release(self, hold: GroupHold, nodes: list[CachedPage]) -> None:
        pool = self.pool
        for k in range(hold.low, hold.top):
            self._drop(hold, nodes, k, keep=False)
        for page in hold.kept.values():
            hold.own.discard(page)
            pool.freed.append(page)
        hold.kept.clear()
        pool.reserved -= hold.most
        hold.low = hold.top

    def readers(self, node: CachedPage) -> int:
        return node.seers[self.g]

    def push(self, node: CachedPage) -> None:
        node.stamps[self.g] += 1
        self.pool.push(node, node.stamps[self.g], self.current)

    def current(self, entry: tuple) -> bool:
        node, g = entry[3], self.g
        if node.parent is None:
            return False
        return entry[2] == node.stamps[g] and node.pages[g] >= 0 and node.seers[g] == 0

    def evict(self) -> None:
        """Law 9: the first page without readers in the policy's order goes, its node
        staying (without a full group, going once it holds nothing)."""
        node = self.pool.pop(self.current)
        self.uncache(node, self.g)
        if self.prunes:
            self.tree.prune(node)

    # -- one page of a hold -------------------------------------------------------------------
    def _adopt(self, hold: GroupHold, node: CachedPage, k: int) -> int:
        """Law 8: the hold's page ``k``, where it holds one and the node has none, becomes
        the node's (still read by the hold). Returns 1 if it did."""
        g, page = self.g, hold.table[k]
        if page < 0 or node.pages[g] >= 0:
            return 0  # given back already, or the node has its own: the hold keeps its copy
        node.pages[g] = page
        node.seers[g] = 1
        hold.own.discard(page)
        self.pool.cached += 1
        return 1

    def _adopt_kept(self, hold: GroupHold, node: CachedPage, k: int) -> int:
        """Law 10: a page kept past the hold's reach joins the node, read by no one (or is
        freed, where the node has its own). Returns 1 if it joined."""
        g, pool = self.g, self.pool
        page = hold.kept.pop(k)
        hold.own.discard(page)
        if node.pages[g] >= 0:
            pool.freed.append(page)
            return 0
        node.pages[g] = page
        pool.cached += 1
        pool.unread += 1
        self.push(node)
        return 1

    def _drop(self, hold: GroupHold, nodes: list[CachedPage], k: int, keep: bool = True) -> None:
        """Law 7: the hold gives back its page ``k``: read from a node, it stays cached (read
        by one fewer); its own, it is freed, or kept (law 10)."""
        page, pool = hold.table[k], self.pool
        hold.table[k] = -1
        if k < len(nodes) and nodes[k].pages[self.g] == page:
            x = nodes[k]
            x.seers[self.g] -= 1
            if x.seers[self.g] == 0:
                pool.unread += 1
                self.push(x)
        elif keep and k in hold.keeps:
            hold.kept[k] = page
        else:
            hold.own.discard(page)
            pool.freed.append(page)


def _reads(hold: GroupHold, nodes: list[CachedPage], k: int, g: int) -> bool:
    """Whether the hold's page ``k`` of group ``g`` is read from the tree (not its own)."""
    return k < len(nodes) and nodes[k].pages[g] == hold.table[k]
