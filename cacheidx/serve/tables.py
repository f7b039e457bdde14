"""The scheduler's slot tables: one table per group of layers, a row per running request, and
the rows free to give out. Plain NumPy on the host; a call reads them as
``cacheidx.make(pos, table, row=rows)`` (:mod:`cacheidx.serve.step`).

Laws, for pages of ``P`` tokens:

1. Row ``r`` of group ``g``'s table is the slots, in group ``g``'s pool, of the request in
   row ``r``: page ``k`` of its page table holds its positions ``k*P`` to ``k*P + P - 1``, so
   column ``c`` is slot ``pages[c // P] * P + c % P``, and -1 where it holds no page (past
   its pages, a page a sliding group gave back or has not taken yet, a free row).
2. Every group's table is as wide as the others: a power of two of pages, doubled until the
   longest row fits; growing keeps every row's columns.
3. ``versions[g]`` is bumped whenever group ``g``'s table changes, ``version`` whenever any
   does: an unchanged version is an unchanged table.
4. With snapshots every ``m`` positions (a model's recurrent layers, :mod:`cacheidx.state`),
   :attr:`SlotTables.blocks` is one table more: row ``r``, column ``j`` the snapshot slot of
   block ``j`` (positions ``j*m`` to ``j*m + m - 1``) of the request in row ``r``, -1 where
   none; ``ceil(width / m)`` columns, growing with the tables. ``blocks_version`` is bumped
   whenever it changes, and ``version`` with it.
5. A row belongs to one running request at a time. Rows are given out from row 0 up, and a
   row given back is the next given out (last freed, first taken).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["SlotTables"]


class SlotTables:
    """``groups`` tables of ``lanes`` rows, each ``pages`` pages of ``page_size`` slots wide
    at first (rounded up to a power of two, law 2)."""

    def __init__(self, groups: int, lanes: int, page_size: int, pages: int = 1,
                 every: int | None = None):
        self.lanes, self.P, self.every = lanes, page_size, every
        width = (1 << (pages - 1).bit_length()) * page_size
        #: per group, [lanes, width] slots of each row's positions, -1 where none (law 1)
        self.tables = [np.full((lanes, width), -1, dtype=np.int64) for _ in range(groups)]
        #: [lanes, ceil(width / every)] snapshot slots of each row's blocks (law 4), or None
        self.blocks = None if every is None else np.full((lanes, -(-width // every)), -1,
                                                         dtype=np.int64)
        self.version = 0  #: bumped whenever a table changes (law 3)
        self.versions = [0] * groups  #: the same, per group
        self.blocks_version = 0  #: the same, of the table of blocks (law 4)
        self._rows = list(range(lanes - 1, -1, -1))  # popped from the end: row 0 first

    @property
    def free(self) -> int:
        """Rows no running request holds."""
        return len(self._rows)

    def take(self) -> int:
        """A free row (law 5); ``IndexError`` when none is."""
        return self._rows.pop()

    def place(self, row: int, tables: Sequence[Sequence[int]],
              blocks: Sequence[int] | None = None) -> None:
        """Row ``row`` becomes the slots of page tables ``tables`` (one per group, -1 for a
        page not held) and, with snapshots, of ``blocks`` (law 4), the tables widened first
        where the first group's pages do not fit (law 2)."""
        size = len(tables[0]) * self.P
        if size > self.tables[0].shape[1]:
            width = self.tables[0].shape[1]
            while width < size:
                width *= 2
            for g, table in enumerate(self.tables):
                grown = np.full((self.lanes, width), -1, dtype=np.int64)
                grown[:, : table.shape[1]] = table
                self.tables[g] = grown
            if self.blocks is not None:
                grown = np.full((self.lanes, -(-width // self.every)), -1, dtype=np.int64)
                grown[:, : self.blocks.shape[1]] = self.blocks
                self.blocks = grown
        if self.blocks is not None:
            given = np.asarray(blocks if blocks is not None else [], dtype=np.int64)
            if len(given) > self.blocks.shape[1]:
                raise ValueError(f"cacheidx.serve.SlotTables.place: {len(given)} blocks do not "
                                 f"fit a table of {self.blocks.shape[1]}")
            self.blocks[row] = -1
            self.blocks[row, : len(given)] = given
            self.blocks_version += 1
        for g, table in enumerate(self.tables):
            pages = np.asarray(tables[g], dtype=np.int64)
            slots = pages[:, None] * self.P + np.arange(self.P)
            table[row] = -1
            table[row, :size] = np.where(pages[:, None] >= 0, slots, -1).reshape(-1)
            self.versions[g] += 1
        self.version += 1

    def slide(self, row: int, g: int, low: int, new_low: int, top: int, new_top: int,
              pages: Sequence[int]) -> None:
        """Group ``g``'s row ``row`` held pages ``low`` to ``top`` of page table ``pages``
        and holds ``new_low`` to ``new_top`` now (``PrefixCache.slide``): the columns of the
        pages given back become -1, those of the pages taken their slots."""
        P, table = self.P, self.tables[g]
        table[row, low * P : new_low * P] = -1
        start = max(top, new_low)
        taken = np.asarray(pages[start:new_top], dtype=np.int64)
        table[row, start * P : new_top * P] = (taken[:, None] * P + np.arange(P)).reshape(-1)
        self.versions[g] += 1
        self.version += 1

    def clear(self, row: int) -> None:
        """Row ``row``'s request stops running: its columns become -1 in every table and the
        row is free again (law 5)."""
        for g, table in enumerate(self.tables):
            table[row] = -1
            self.versions[g] += 1
        if self.blocks is not None:
            self.blocks[row] = -1
            self.blocks_version += 1
        self.version += 1
        self._rows.append(row)
