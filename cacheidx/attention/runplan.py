"""The runs' plan: which runs of slots each lane's views read, worked out on the host in NumPy
alone (FlashInfer's ``plan``; :mod:`cacheidx.attention.runs` is its ``run``).

``rows`` gives a lane one run of slots and a paged table one run per page, often longer when
pages were taken in order. Where every column some token of a lane sees names a slot inside
the pool, and those slots fall into few runs of consecutive slots (no hole, nothing dropped),
a lane's keys are ``kpool[s0:s0 + n]`` for each run. This module finds those runs, once per
index, from the index's host values (:func:`cacheidx.plan.host`): the laws' own helpers
over NumPy arrays, nothing read from a device and nothing placed on one. Law: a plan is a
function of the index's structure, its host values and the call's shape (pool slots, scores,
heads, tile); the same inputs give an equal plan.

A lane's queries are cut in blocks of :data:`ROWS` and each run in :class:`Piece`\\ s of the
caller's ``tile`` columns, or as wide as keeps their scores within ``scores``; a piece no
query of the block sees is left out, and one every query sees in full is marked ``full`` (read
without a mask). Short runs (a paged lane's pages of its own: fewer than :data:`GATHER`
columns each, seen whole) but the last are gathered into :class:`Gathered` tiles of slots.

Lanes whose tables name the same slots at their first columns, every query of each seeing
them, form a :class:`Group` (:func:`prefixes`) where that prefix holds at least :data:`SHARED`
columns: its pieces are read once for all its lanes. Their own columns past it, where each
holds at most :data:`OWN`, are one :class:`Own` tile for all of them.

:func:`carry` gives the next decode step's plan from this one (``index.advance()``) where it
follows, one column longer a lane.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from .. import masks
from ..laws import inside

__all__ = ["GATHER", "MOST_RUNS", "OWN", "ROWS", "SCATTERED", "SHARED", "WHOLE", "Gathered",
           "Group", "Own",
           "Piece", "Runs", "carry", "one_lane", "plan", "prefixes", "reads", "shares",
           "unshared"]

#: queries a block holds: a long prefill's scores stay within bounds with wide column tiles
ROWS = 256
#: the most elements of a call's mask the host holds at once (a decode step's [batch, 1, width]);
#: past it, each piece's part of the mask
WHOLE = 1 << 22
#: the most runs a lane may hold for views to pay: past it, the tiles' batched reads win
MOST_RUNS = 16
#: pieces shorter than this, every query seeing them whole, are gathered into one tile
GATHER = 256
#: the most columns of its own a lane sharing a prefix may hold for its lanes' own columns to
#: be read as one tile (a decode step's few since the prefix); past it, each lane's runs
OWN = 512
#: the fewest columns a shared prefix must hold to be read once for its lanes (below, each
#: lane reads it as its own: docs/attention.md, "Shared prefixes")
SHARED = 64
#: the most columns of one gathered tile of a scattered shared prefix (3 MB a pool at 3 kv heads
#: of 64 in float32, 16 MB at 8 of 128): a copy made once a layer for all its lanes
SCATTERED = 4096
_SHARING = [True]


class Piece(NamedTuple):
    """A tile of one lane's block of queries: columns ``c0:c1`` at slots ``s0:s0 + c1 - c0``,
    and whether every query of the block sees every column (no mask)."""

    c0: int
    c1: int
    s0: int
    full: bool


class Gathered(NamedTuple):
    """Short pieces every query of the block sees whole, read together as one tile: ``width``
    columns at ``slots`` (a paged lane's pages of its own hold a few columns each; a view of
    each would cost a product per page)."""

    width: int
    slots: np.ndarray
    full: bool = True


#: one lane's blocks of queries: ``(i0, i1, pieces)``
Blocks = list[tuple[int, int, list[Piece | Gathered]]]


class Group(NamedTuple):
    """Lanes whose tables name the same slots at columns ``0:width``, every one of their
    queries seeing every one of those columns: their queries read those columns together, each
    piece once (a shared prefix), and each lane reads its own columns from ``width`` on."""

    lanes: tuple[int, ...]
    width: int
    pieces: list[Piece | Gathered]


class Own(NamedTuple):
    """The columns of their own of the lanes that share a prefix, read as one tile for all of
    them: ``slots`` ``[len(lanes), width]`` (-1 past a lane's own) and ``mask``
    ``[len(lanes), seq, width]`` (a column past a lane's own is seen by none of its tokens)."""

    lanes: tuple[int, ...]
    width: int
    slots: np.ndarray
    mask: np.ndarray


class Runs(NamedTuple):
    """A call's runs: each lane's blocks of its own pieces, the groups sharing a prefix, and
    (where they are short) the sharing lanes' own columns as one tile."""

    lanes: list[Blocks]
    groups: list[Group]
    own: Own | None = None


@contextlib.contextmanager
def unshared() -> Iterator[None]:
    """Within it, every lane reads a shared prefix as its own (what the figures compare with).
    A plan made within it keeps its lanes apart (it is kept under a key of its own)."""
    _SHARING.append(False)
    try:
        yield
    finally:
        _SHARING.pop()


def shares() -> bool:
    """Whether a plan made now reads shared prefixes once (not within :func:`unshared`)."""
    return _SHARING[-1]


def reads(index: Any) -> bool:
    """Whether the runs read a call over ``index`` (eager): a table's columns alone, neither a
    selection's nor a draft's, nor a whole or packed index's tokens."""
    return index.kind == "tabled" and index.columns is None and index.draft_slots is None


def _spans(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + size)) for a in range(0, n, size)]


def plan(index: Any, n: int, scores: int, heads: int, tile: int | None, share: bool
         ) -> Runs | None:
    """Each lane's blocks and pieces over pools of ``n`` slots, and (with ``share``) the groups
    of lanes sharing a prefix, or ``None`` where some lane's seen columns are not a few runs of
    slots inside the pool. Worked out on the index's host values: ``index`` is the host's
    (:func:`cacheidx.plan.host`), which the caller asks for (this module places nothing)."""
    on_host = index
    table, some = masks.lane_table(on_host), masks.seen_by_some(on_host)
    width = int(table.shape[1])
    # a short call's whole mask at once; a long one's per piece, so that the host never holds
    # [batch, seq, width]
    whole = on_host.mask() if index.batch * index.seq * width <= WHOLE else None
    groups = prefixes(table, some, whole, n, index.seq, heads, scores, tile) if share else []
    own = {b: g.width for g in groups for b in g.lanes}  # a lane's first column of its own
    lanes = []
    for b in range(index.batch):
        cols = np.flatnonzero(some[b])
        cols = cols[cols >= own.get(b, 0)]
        slots = table[b, cols]
        if not np.all(inside(slots, n)):
            return None  # a hole or a dropped slot: the tiles read it as zero
        breaks: np.ndarray = np.flatnonzero((np.diff(cols) != 1) | (np.diff(slots) != 1)) + 1
        if breaks.size >= MOST_RUNS:
            return None
        starts, ends = np.r_[0, breaks].astype(int), np.r_[breaks, cols.size].astype(int)
        one: Any = None if whole is not None else one_lane(on_host, b)
        blocks: Blocks = []
        for i0, i1 in _spans(index.seq, ROWS):
            size = tile or max(16, scores // ((i1 - i0) * heads))
            pieces: list[Piece] = []
            short: set[int] = set()
            for a, e in zip(starts, ends):
                if a == e:
                    continue  # a lane no token sees
                first = len(pieces)
                c_first = int(cols[a])
                for p0, p1 in _spans(int(e - a), size):
                    c0, c1 = c_first + p0, c_first + p1
                    if whole is not None:
                        seen = whole[b, i0:i1, c0:c1]
                    else:
                        part = dataclasses.replace(one, pos=one.pos[:, i0:i1])
                        seen = masks.sees_columns(part, np.arange(c0, c1)[None, None, :])
                    if seen.any():
                        pieces.append(Piece(c0, c1, int(slots[a]) + p0, bool(seen.all())))
                if e - a < GATHER:  # a short run's pieces (a page or a few of a paged lane)
                    short.update(range(first, len(pieces)))
            blocks.append((i0, i1, _gather(pieces, short, max(size, GATHER))))
        lanes.append(blocks)
    return Runs(lanes, groups, _own(index, table, some, whole, groups, n))


def _own(index: Any, table: np.ndarray, some: np.ndarray, whole: np.ndarray | None,
         groups: list[Group], n: int) -> Own | None:
    """The sharing lanes' own columns (past their prefix, seen by some token of the lane) as
    one tile (:class:`Own`), where each lane holds at most :data:`OWN` of them inside the
    pool; ``None`` otherwise."""
    if not groups or whole is None:
        return None
    lanes, cols = [], []
    for g in groups:
        for b in g.lanes:
            mine = np.flatnonzero(some[b])
            mine = mine[mine >= g.width]
            if mine.size > OWN or not np.all(inside(table[b, mine], n)):
                return None
            lanes.append(b)
            cols.append(mine)
    width = max(1, max(c.size for c in cols))
    slots = np.full((len(lanes), width), -1, dtype=np.int64)
    mask = np.zeros((len(lanes), index.seq, width), dtype=bool)
    for i, (b, c) in enumerate(zip(lanes, cols)):
        slots[i, :c.size] = table[b, c]
        mask[i, :, :c.size] = whole[b][:, c]
    return Own(tuple(lanes), width, slots, mask)


def _gather(pieces: list[Piece], short: set[int], most: int) -> list[Piece | Gathered]:
    """``pieces`` with those of short runs (their places in ``short``) every query sees whole,
    but the last (the one a decode step grows, :func:`carry`), read as :class:`Gathered`
    tiles of at most ``most`` columns each, where several would be read together."""
    chosen = [p for i, p in enumerate(pieces[:-1]) if i in short and p.full]
    if len(chosen) < 2:
        return list(pieces)
    tiles: list[list[Piece]] = []
    now: list[Piece] = []
    width = 0
    for p in chosen:
        if now and width + p.c1 - p.c0 > most:
            tiles.append(now)
            now, width = [], 0
        now.append(p)
        width += p.c1 - p.c0
    tiles.append(now)
    gathered: list[Piece | Gathered] = []
    for tile in tiles:
        slots = np.concatenate([np.arange(p.s0, p.s0 + p.c1 - p.c0) for p in tile])
        gathered.append(Gathered(int(slots.size), slots))
    taken = {id(p) for p in chosen}
    return [*gathered, *(p for p in pieces if id(p) not in taken)]


def prefixes(table: np.ndarray, some: np.ndarray, whole: np.ndarray | None, n: int, seq: int,
             heads: int, scores: int, tile: int | None, *, views: bool = True) -> list[Group]:
    """The groups of lanes that share a prefix (:class:`Group`): lanes whose first columns
    name the same slot, and of them the columns from 0 at which all name the same slots inside
    the pool and every query of each sees the column; a group holding at least :data:`SHARED`
    such columns and two lanes. A call of one block of queries a lane (a decode step, a short
    chunk: at most :data:`ROWS` tokens) whose whole mask the host holds; none otherwise.
    ``views``: the prefix is read as views of its runs, and one of scattered pages (at least
    :data:`MOST_RUNS` runs, where a view of each would cost a product) as :class:`Gathered`
    tiles of at most :data:`SCATTERED` columns, each gathered once for the group; a reader
    that gathers itself (the tiles, JAX's program) passes False: its pieces are the runs."""
    if whole is None or seq > ROWS or table.shape[1] < SHARED:
        return []
    seen = whole.all(axis=1) & some & inside(table, n)  # [batch, width]: all a lane's see it
    by: dict[int, list[int]] = {}
    for b in np.flatnonzero(seen[:, 0]):
        by.setdefault(int(table[b, 0]), []).append(int(b))
    groups = []
    for lanes in by.values():
        if len(lanes) < 2:
            continue
        same = np.all(table[lanes] == table[lanes[:1]], axis=0) & np.all(seen[lanes], axis=0)
        width = int(same.size if same.all() else np.argmin(same))
        if width < SHARED:
            continue
        slots = table[lanes[0], :width]
        breaks: np.ndarray = np.flatnonzero(np.diff(slots) != 1) + 1
        size = tile or max(16, scores // (len(lanes) * seq * heads))
        pieces: list[Piece | Gathered]
        if views and breaks.size >= MOST_RUNS:  # scattered pages: gathered, a tile at a time
            size = min(size, SCATTERED)
            pieces = [Gathered(int(c1 - c0), slots[c0:c1].copy())
                      for c0, c1 in _spans(width, size)]
        else:
            pieces = [Piece(c0 + p0, c0 + p1, int(slots[c0]) + p0, True)
                      for c0, c1 in zip(np.r_[0, breaks].astype(int),
                                        np.r_[breaks, width].astype(int))
                      for p0, p1 in _spans(int(c1 - c0), size)]
        groups.append(Group(tuple(lanes), width, pieces))
    return groups


def carry(index: Any, nxt: Any, key: tuple, runs: Runs) -> Runs | None:
    """The runs of ``nxt = index.advance()`` from ``index``'s, where they follow: a decode step
    after a decode step (one token a lane, no window, positions not blocks), each lane's one
    new column continuing its last run of its own (its slot the next one) or starting its
    first, past any prefix it shares (the groups then stay as they were: their columns are
    still seen by every token). The new column is seen by the lane's only token, as every
    column before it is: every piece is read whole. ``key`` is the plan's ``(n, scores, heads,
    tile, share)``. ``None`` (the runs found anew) wherever that is not so."""
    n, scores, heads, tile, _ = key
    if (not runs or index.seq != 1 or nxt.seq != 1 or index.block != 1
            or index.window_size is not None):
        return None
    lanes, groups = runs.lanes, runs.groups
    own = {b: g.width for g in groups for b in g.lanes}
    on_host = nxt  # the host's (the caller's cacheidx.plan.host)
    table, pos = masks.lane_table(on_host), on_host.pos[:, 0]
    valid = masks.valid(on_host)[:, 0]
    width, size = int(table.shape[1]), tile or max(16, scores // heads)
    out = []
    for b, blocks in enumerate(lanes):
        (i0, i1, pieces), = blocks
        if not valid[b]:  # still padding (a row map's -1 at position 0): it reads nothing
            if pieces:
                return None
            out.append(blocks)
            continue
        c = int(pos[b])
        if not 0 <= c < width or not inside(table[b, c], n):
            return None
        s = int(table[b, c])
        last = pieces[-1] if pieces else None
        if c < own.get(b, 0):
            return None  # a new column inside a shared prefix (lanes naming one sequence)
        if last is None and c == own.get(b, 0):
            pieces = [Piece(c, c + 1, s, True)]
        elif (isinstance(last, Piece) and last.c1 == c
              and last.s0 + (c - last.c0) == s):
            grown = last.c1 - last.c0 < size
            pieces = pieces[:-1] + [last._replace(c1=c + 1)] if grown else [
                *pieces, Piece(c, c + 1, s, True)]
        else:
            return None  # a new run: found anew, with the runs' bound
        out.append([(i0, i1, pieces)])
    tile_ = None
    if runs.own is not None:  # the own tile, one column longer: made again (a host pass)
        tile_ = _own(nxt, table, masks.seen_by_some(on_host), on_host.mask(), groups, n)
        if tile_ is None:
            return None
    return Runs(out, groups, tile_)


def one_lane(index: Any, b: int) -> Any:
    """Lane ``b`` of ``index`` as an index of its own (its row of the table, or its row map's
    entry), for the masks of its blocks."""
    if index.row is not None:
        return dataclasses.replace(index, pos=index.pos[b:b + 1, :], row=index.row[b:b + 1])
    table = index.table[b:b + 1, :]
    blocks = tuple((m, t[b:b + 1, :]) for m, t in index.blocks)
    return dataclasses.replace(index, pos=index.pos[b:b + 1, :], table=table, blocks=blocks)
