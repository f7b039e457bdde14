"""The tree of cached pages of the online prefix cache: one node a page, its key the page's
tokens (:mod:`.keys`), its parent the page before it, so a path from the root spells a prefix
of whole pages (a radix tree whose edges are pages).

The tree keeps the shape of laws 3 and 9 of :mod:`.cache`: a node's ``readers`` are the
requests holding it, always on a path from the root; a node leaves the tree only as a leaf.
Which pages a node holds, and when one goes, is each group's manager's business
(:mod:`.full`, :mod:`.sliding`); the tree only walks, grows and cuts.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CachedPage", "Tree", "lru"]


class CachedPage:
    """A node of the tree: one cached page (one per group). Read-only for a policy."""

    __slots__ = ("pages", "depth", "key", "parent", "children", "readers", "last_used", "hits",
                 "seers", "stamp", "stamps")

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
        #: eviction's bookkeeping: which heap entry of it is current (the full group's), and
        #: the same per sliding group; a heap entry with another stamp is stale
        self.stamp = 0
        self.stamps = [0] * len(pages) if sliding else None

    def __repr__(self) -> str:
        return (f"CachedPage(pages={self.pages}, depth={self.depth}, readers={self.readers}, "
                f"last_used={self.last_used}, hits={self.hits})")


def lru(page: CachedPage) -> Any:
    """The default policy: the least recently released page goes first."""
    return page.last_used


class Tree:
    """The root and the walks over it, for pages of ``page_size`` tokens over ``groups``
    pools (``sliding``: whether a node counts its sliding groups' readers, ``seers``)."""

    __slots__ = ("root", "width", "sliding")

    def __init__(self, groups: int, page_size: int, sliding: bool):
        self.root = CachedPage([-1] * groups, -1, b"", None)
        self.width = 8 * page_size  #: bytes of a page's key
        self.sliding = sliding

    def key(self, data: bytes, k: int) -> bytes:
        """Page ``k``'s key in the tokens' bytes."""
        return data[k * self.width : (k + 1) * self.width]

    def walk(self, data: bytes, most: int) -> list[CachedPage]:
        """The path of at most ``most`` pages that spells the start of ``data``: one
        dictionary lookup per page."""
        width = self.width
        node, nodes = self.root, []
        for k in range(most):
            node = node.children.get(data[k * width : (k + 1) * width])
            if node is None:
                break
            nodes.append(node)
        return nodes

    def grow(self, parent: CachedPage, key: bytes, depth: int) -> CachedPage:
        """A new leaf under ``parent``, holding no page yet, read by the request adding it
        (law 3: its path from the root is held already)."""
        node = CachedPage([-1] * len(self.root.pages), depth, key, parent, self.sliding)
        parent.children[key] = node
        node.readers = 1
        return node

    def cut(self, node: CachedPage) -> CachedPage:
        """Takes the leaf ``node`` out of the tree; returns its parent."""
        parent = node.parent
        del parent.children[node.key]
        node.parent = None
        return parent

    def prune(self, node: CachedPage) -> None:
        """Law 9, without a full group: a node holding no page, no child and no reader goes,
        and so may its parent then."""
        while (node is not self.root and node.parent is not None and node.readers == 0
               and not node.children and max(node.pages) < 0):
            node = self.cut(node)
