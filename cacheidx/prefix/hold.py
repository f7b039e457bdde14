"""What one request holds in the online prefix cache: its path in the tree (law 3 of
:mod:`.cache`) and, of each group's pool, its part (a :class:`GroupHold`), kept by that
group's manager (:mod:`.full`, :mod:`.sliding`).
"""

from __future__ import annotations

import dataclasses

from .tree import CachedPage

__all__ = ["GroupHold", "Hold"]


@dataclasses.dataclass(eq=False)
class GroupHold:
    """What one request holds of one group's pool: ``table`` (page ``k`` holds its tokens
    ``k * P`` to ``k * P + P - 1``, -1 where it holds none: below ``low``, given back, or
    from ``top`` on, not yet taken) and ``own``, its pages not in the tree. Of a sliding
    group also ``most``, the most pages it holds at once (reserved when admitted, law 7; 0
    for a full group, which holds every page of its table), and law 10's ``keeps``, the
    pages to keep past its reach, and ``kept``: page ``k`` of its sequence -> its page of
    the pool."""

    table: list[int]
    own: set[int] = dataclasses.field(default_factory=set)
    low: int = 0
    top: int = 0
    most: int = 0
    keeps: set[int] = dataclasses.field(default_factory=set)
    kept: dict[int, int] = dataclasses.field(default_factory=dict)
    #: of the snapshot group (:mod:`.states`, law 14): ``[page, slot]``, the own slot that
    #: holds the state after page ``page`` (-1: not yet written; slot -1: none), and the
    #: cached snapshot a hit resumes from where it is no block's end (-1: none)
    junction: list[int] = dataclasses.field(default_factory=lambda: [-1, -1])
    resume: int = -1

    def held(self) -> int:
        """Pages of the pool it holds now (cached ones it reads included)."""
        if self.most == 0:  # a full group: every page of its table
            return len(self.table)
        return max(0, self.top - self.low) + len(self.kept)


@dataclasses.dataclass(eq=False)
class Hold:
    """What one request holds: ``pages`` is its page table (page ``k`` holds its tokens
    ``k * P`` to ``k * P + P - 1``), the first ``cached // P`` of them read from the cache.
    ``nodes`` is its path in the tree (law 3) and ``groups[g]`` its part of group ``g``'s
    pool (a :class:`GroupHold`); ``tables[g]`` is group ``g``'s table (``pages``
    is the first's), -1 where a sliding group holds no page: given back (law 7) or not yet
    taken."""

    pages: list[int]  #: the first group's table (the same list)
    cached: int  #: tokens the request found cached when admitted
    nodes: list[CachedPage] = dataclasses.field(repr=False)
    groups: list[GroupHold] = dataclasses.field(repr=False)
    released: bool = False

    @property
    def tables(self) -> list[list[int]]:
        """Each group's page table."""
        return [part.table for part in self.groups]

    @property
    def most(self) -> list[int]:
        """Per group, the most pages it holds at once (law 7; 0 for a full group)."""
        return [part.most for part in self.groups]

    @property
    def kept(self) -> list[dict[int, int]]:
        """Per group, the pages kept past its reach (law 10): page ``k`` of its sequence ->
        its page of the pool."""
        return [part.kept for part in self.groups]

    def held(self, group: int = 0) -> int:
        """Pages of group ``group``'s pool it holds now (cached ones it reads included)."""
        return self.groups[group].held()
