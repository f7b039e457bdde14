"""Eagerly, where each lane's slots form runs: the pools read as views, never copied (attention's
law 6, by views; its law 2 by each block's own mask: :mod:`cacheidx.attention`).

``rows`` gives a lane one run of slots and a paged table one run per page, often longer when
pages were taken in order. Where every column some token of a lane sees names a slot inside
the pool, and those slots fall into few runs of consecutive slots (no hole, nothing dropped),
a lane's keys are ``kpool[s0:s0 + n]`` for each run: a view, read by the products in place.
The host finds the runs once per index (it keeps them for every layer, as it keeps its read
plans) from the index's tensors; a traced call has no values to look at and never comes here.

Each lane then attends on its own, its queries in blocks of :data:`ROWS` and each run in tiles
of the caller's ``tile`` columns, or (a view costing no copy) as wide as keeps their scores
within :data:`~cacheidx.attention.SCORES`; a tile no query of the block sees is skipped (the
causal half of a prefill, the columns below a window) and one every query sees in full is
weighed without a mask. The law is the same as the tiles': the mask of a block is the lane's
own index's ``mask`` (a one-lane index cut from the call's), so a tile holds what ``extend``'s
seen and ``mask`` hold there.

**Shared prefixes are read once.** Lanes whose tables name the same slots at their first
columns (a prompt's pages shared through the prefix cache, a forked beam, parallel samples)
read those columns together: the plan finds, per group of lanes whose first columns name one
slot, the columns from 0 at which all of them name the same slots and every query of each sees
the column (:func:`sharing`); where that prefix holds at least :data:`SHARED` columns, its runs
are read once for all the group's lanes, their queries stacked as one lane's heads, each kv
head's product over a piece serving all of them (Hydragen's and FlashInfer's cascade), and each
lane's state over it is merged exactly into the state over its own columns
(:meth:`~cacheidx.attention.softmax.Online.merge`), which the group's lanes read as one tile
for all of them where each holds at most :data:`OWN` (:class:`_Own`). The law is attend's own;
only the order of the sums changes. A lane whose window starts inside the prefix, a padding
lane and a call of more than :data:`ROWS` tokens a lane (a long prefill) read their columns as
their own; a prefix with a hole is read by the tiles, as every call with a hole is. The
standard's tiles do not share (each lane reads its columns; the law holds the same); torch's
compiled operator runs this code, so it does, and JAX's eager program reads once the groups
:func:`prefixes` finds (:func:`cacheidx.attention.jax.sharing`); a step the user compiles whole
has no values to find them in.

A lane's short runs (the pages of its own a paged table scatters: fewer than :data:`GATHER`
columns each, seen whole) but the last are gathered into one tile, read through the backend's
read plan: a view of each would cost a product per page.

A lane at a time, not all lanes as one strided view: where lanes' runs sit a fixed stride
apart (``rows`` of one length) they could be, but the products over a view whose lanes lie
far apart run slower than one per lane (measured: a fifth slower for 8 lanes of 4,096).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from .. import plan as plans
from .. import pools
from ..laws import inside
from . import layout, paths
from .softmax import Online, group, ungroup
from .tiles import rows

__all__ = ["SHARED", "prefixes", "read", "shares", "sharing", "unshared"]

#: queries a block holds: a long prefill's scores stay within bounds with wide column tiles
ROWS = 256
#: the most elements of a call's mask the host holds at once (a decode step's [batch, 1, width]);
#: past it, each piece's part of the mask
WHOLE = 1 << 22
#: the most runs a lane may hold for views to pay: past it, the tiles' batched reads win
MOST_RUNS = 16
#: bytes of a view's keys past which its products read it in chunks (:attr:`Online.chunk`),
#: and the bytes of a chunk: about what a core's own cache keeps between a chunk's products
#: (measured against other sizes and SDPA: docs/attention.md, "How it reads")
LONG, CHUNK = 1 << 20, 1 << 20


class _Piece(NamedTuple):
    """A tile of one lane's block of queries: columns ``c0:c1`` at slots ``s0:s0 + c1 - c0``,
    and whether every query of the block sees every column (no mask)."""

    c0: int
    c1: int
    s0: int
    full: bool


class _Gathered(NamedTuple):
    """Short pieces every query of the block sees whole, read together as one tile: ``width``
    columns gathered through the backend's read plan ``read`` (a paged lane's pages of its own
    hold a few columns each; a view of each would cost a product per page)."""

    width: int
    read: Any
    full: bool = True


#: pieces shorter than this, every query seeing them whole, are gathered into one tile
GATHER = 256

#: one lane's blocks of queries: ``(i0, i1, pieces)``
_Blocks = list[tuple[int, int, list[_Piece]]]


class _Group(NamedTuple):
    """Lanes whose tables name the same slots at columns ``0:width``, every one of their
    queries seeing every one of those columns: their queries read those columns together, each
    piece once (a shared prefix), and each lane reads its own columns from ``width`` on."""

    lanes: tuple[int, ...]
    width: int
    pieces: list[_Piece]


class _Own(NamedTuple):
    """The columns of their own of the lanes that share a prefix, read as one tile for all of
    them: ``[len(lanes), width]`` slots through the backend's read plan ``read``, ``mask``
    ``[len(lanes), seq, width]`` (a column past a lane's own is seen by none of its tokens)."""

    lanes: tuple[int, ...]
    width: int
    read: Any
    mask: Any


class _Runs(NamedTuple):
    """A call's runs: each lane's blocks of its own pieces, the groups sharing a prefix, and
    (where they are short) the sharing lanes' own columns as one tile."""

    lanes: list[_Blocks]
    groups: list[_Group]
    own: _Own | None = None


#: the most columns of its own a lane sharing a prefix may hold for its lanes' own columns to
#: be read as one tile (a decode step's few since the prefix); past it, each lane's runs
OWN = 512


#: the fewest columns a shared prefix must hold to be read once for its lanes (below, each
#: lane reads it as its own: docs/attention.md, "Shared prefixes")
SHARED = 64
_SHARING = [True]


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


def _spans(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + size)) for a in range(0, n, size)]


def _plan(index: Any, n: int, scores: int, heads: int, tile: int | None, share: bool
          ) -> _Runs | None:
    """Each lane's blocks and pieces over pools of ``n`` slots, and (with ``share``) the groups
    of lanes sharing a prefix, or ``None`` where some lane's seen columns are not a few runs of
    slots inside the pool. Worked out on the host, on the index's host values
    (:meth:`~cacheidx.CacheIndex.host`): the laws' own helpers, nothing read from a device."""
    on_host = _host_index(index)
    table, some = on_host.lane_table, on_host.seen_by_some()
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
        breaks = np.flatnonzero((np.diff(cols) != 1) | (np.diff(slots) != 1)) + 1
        if breaks.size >= MOST_RUNS:
            return None
        starts, ends = np.r_[0, breaks].astype(int), np.r_[breaks, cols.size].astype(int)
        one = None if whole is not None else _one_lane(on_host, b)
        blocks = []
        for i0, i1 in _spans(index.seq, ROWS):
            size = tile or max(16, scores // ((i1 - i0) * heads))
            pieces, short = [], set()
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
                        seen = part.sees_columns(np.arange(c0, c1)[None, None, :])
                    if seen.any():
                        pieces.append(_Piece(c0, c1, int(slots[a]) + p0, bool(seen.all())))
                if e - a < GATHER:  # a short run's pieces (a page or a few of a paged lane)
                    short.update(range(first, len(pieces)))
            blocks.append((i0, i1, _gather(index, pieces, short, n, max(size, GATHER))))
        lanes.append(blocks)
    return _Runs(lanes, groups, _own(index, table, some, whole, groups, n))


def _own(index: Any, table: np.ndarray, some: np.ndarray, whole: np.ndarray | None,
         groups: list[_Group], n: int) -> _Own | None:
    """The sharing lanes' own columns (past their prefix, seen by some token of the lane) as
    one tile (:class:`_Own`), where each lane holds at most :data:`OWN` of them inside the
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
    put = functools.partial(index.backend.from_host, device=index.device)
    at = put(np.reshape(np.maximum(slots, 0), (-1,)))
    read = index.backend.read_plan(at, put(np.reshape(slots >= 0, (-1,))), n)
    return _Own(tuple(lanes), width, read, put(mask))


def sharing(index: Any, n: int, heads: int, tile: int | None = None,
            scores: int | None = None) -> list[tuple[tuple[int, ...], int]]:
    """The groups of lanes of ``index`` (eager) whose shared prefix a call over pools of ``n``
    slots with ``heads`` query heads reads once: each group's lanes and its shared columns
    ``0:width`` (what the plan finds; empty where nothing is shared).

    A call the runs do not read (:func:`read` declines it) shares nothing here: a draft (its
    columns end in the call's own tokens, which the tiles read; JAX's eager program does read
    a draft's shared prefix once, :func:`cacheidx.attention.jax.sharing`), a selection, a
    whole or packed index. Raises ``ValueError`` for a traced index (no values to find groups
    in)."""
    from . import SCORES

    if index.backend.tracing(index.pos):
        raise ValueError("cacheidx.attention.runs.sharing: the index is traced (inside a "
                         "compiled step): the groups are found from an eager index's values")
    if not _reads(index):
        return []
    found = _plan(index, n, scores or SCORES, heads, tile, True)
    return [] if not found else [(g.lanes, g.width) for g in found.groups]


def _gather(index: Any, pieces: list[_Piece], short: set[int], n: int, most: int
            ) -> list[Any]:
    """``pieces`` with those of short runs (their places in ``short``) every query sees whole,
    but the last (the one a decode step grows, :func:`carry`), read as :class:`_Gathered`
    tiles of at most ``most`` columns each, where several would be read together."""
    chosen = [p for i, p in enumerate(pieces[:-1]) if i in short and p.full]
    if len(chosen) < 2:
        return pieces
    tiles, now, width = [], [], 0
    for p in chosen:
        if now and width + p.c1 - p.c0 > most:
            tiles.append(now)
            now, width = [], 0
        now.append(p)
        width += p.c1 - p.c0
    tiles.append(now)
    gathered = []
    put = functools.partial(index.backend.from_host, device=index.device)
    for tile in tiles:
        slots = np.concatenate([np.arange(p.s0, p.s0 + p.c1 - p.c0) for p in tile])
        read = index.backend.read_plan(put(slots), put(np.ones(slots.shape, dtype=bool)), n)
        gathered.append(_Gathered(int(slots.size), read))
    taken = {id(p) for p in chosen}
    return [*gathered, *(p for p in pieces if id(p) not in taken)]


def prefixes(table: np.ndarray, some: np.ndarray, whole: np.ndarray | None, n: int, seq: int,
            heads: int, scores: int, tile: int | None) -> list[_Group]:
    """The groups of lanes that share a prefix (:class:`_Group`): lanes whose first columns
    name the same slot, and of them the columns from 0 at which all name the same slots inside
    the pool and every query of each sees the column; a group holding at least :data:`SHARED`
    such columns and two lanes. A call of one block of queries a lane (a decode step, a short
    chunk: at most :data:`ROWS` tokens) whose whole mask the host holds; none otherwise."""
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
        breaks = np.flatnonzero(np.diff(slots) != 1) + 1
        if breaks.size >= MOST_RUNS:
            continue  # a prefix of scattered pages: each lane's tiles read it
        size = tile or max(16, scores // (len(lanes) * seq * heads))
        pieces = [_Piece(c0 + p0, c0 + p1, int(slots[c0]) + p0, True)
                  for c0, c1 in zip(np.r_[0, breaks].astype(int), np.r_[breaks, width].astype(int))
                  for p0, p1 in _spans(int(c1 - c0), size)]
        groups.append(_Group(tuple(lanes), width, pieces))
    return groups


def carry(index: Any, nxt: Any, key: tuple, runs: Any) -> _Runs | None:
    """The runs of ``nxt = index.advance()`` from ``index``'s, where they follow: a decode step
    after a decode step (one token a lane, no window, positions not blocks), each lane's one
    new column continuing its last run of its own (its slot the next one) or starting its
    first, past any prefix it shares (the groups then stay as they were: their columns are
    still seen by every token). The new column is seen by the lane's only token, as every
    column before it is: every piece is read whole. ``None`` (the runs found anew) wherever
    that is not so."""
    n, scores, heads, tile, _ = key
    if (not runs or index.seq != 1 or nxt.seq != 1 or index.block != 1
            or index.window_size is not None):
        return None
    lanes, groups = runs.lanes, runs.groups
    own = {b: g.width for g in groups for b in g.lanes}
    on_host = _host_index(nxt)
    table, pos = on_host.lane_table, on_host.pos[:, 0]
    valid = on_host.valid[:, 0]
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
            pieces = [_Piece(c, c + 1, s, True)]
        elif last is not None and last.c1 == c and last.s0 + (c - last.c0) == s:
            grown = last.c1 - last.c0 < size
            pieces = pieces[:-1] + [last._replace(c1=c + 1)] if grown else [
                *pieces, _Piece(c, c + 1, s, True)]
        else:
            return None  # a new run: found anew, with the runs' bound
        out.append([(i0, i1, pieces)])
    tile = None
    if runs.own is not None:  # the own tile, one column longer: made again (a host pass)
        tile = _own(nxt, table, on_host.seen_by_some(), on_host.mask(), groups, n)
        if tile is None:
            return None
    return _Runs(out, groups, tile)


plans.CARRY["runs"] = carry


def _host_index(index: Any) -> Any:
    """``index`` over its host values (:meth:`~cacheidx.CacheIndex.host`: never read back
    from a device)."""
    return index.host()


def _one_lane(index: Any, b: int) -> Any:
    """Lane ``b`` of ``index`` as an index of its own (its row of the table, or its row map's
    entry), for the masks of its blocks."""
    if index.row is not None:
        return dataclasses.replace(index, pos=index.pos[b:b + 1, :], row=index.row[b:b + 1])
    table = index.table[b:b + 1, :]
    blocks = tuple((m, t[b:b + 1, :]) for m, t in index.blocks)
    return dataclasses.replace(index, pos=index.pos[b:b + 1, :], table=table, blocks=blocks)


def _reads(index: Any) -> bool:
    """Whether the runs read a call over ``index`` (eager): a table's columns alone, neither a
    selection's nor a draft's, nor a whole or packed index's tokens."""
    return index.kind == "tabled" and index.columns is None and index.draft_slots is None


def read(call: Any, scores: int) -> Any | None:
    """``call``'s output read through views of runs of slots, or ``None`` where the call is
    traced, selects columns, is a draft or whole, or some lane's slots are not a few runs."""
    index = call.index
    if index.backend.tracing(index.pos) or not _reads(index):
        return None
    xp, q, kpool, vpool = index.xp, call.q, call.kpool, call.vpool
    n = int(kpool.shape[0])
    if int(vpool.shape[0]) != n:
        return None
    heads = int(q.shape[2])

    share = shares()
    runs = index.planned("runs", (n, scores, heads, call.tile, share),
                         lambda: _plan(index, n, scores, heads, call.tile, share) or ())
    if not runs:
        return None
    lanes, groups, own = runs
    kv, dv = int(kpool.shape[1]), int(vpool.shape[-1])
    grouped = group(xp, q, "lane", kv, call.scale)  # [batch, kv, g, seq, d], once for all
    # a head-major pool's heads are each a contiguous block: a product streams one whole
    interleaved = not (layout.head_major(kpool) and layout.head_major(vpool))
    products = paths.products(index.backend, kpool, vpool)
    shared: dict[int, list[tuple[Any, Any, Any]]] = {}
    for g in groups:  # each shared prefix read once, for all its lanes
        for b, state in zip(g.lanes, _shared(call, g, grouped, dv, interleaved, products)):
            shared.setdefault(b, []).append(state)
    outs = {} if own is None else _owned(call, own, grouped, dv, shared)
    out = xp.concat([outs[b] if b in outs else
                     _lane(call, lambda b=b: _one_lane(index, b), blocks,
                           grouped[b:b + 1, ...], dv, interleaved, products, shared.get(b, ()))
                     for b, blocks in enumerate(lanes)], axis=0)
    return ungroup(xp, out, "lane", q.dtype)


def _owned(call: Any, own: _Own, grouped: Any, dv: int, shared: dict) -> dict[int, Any]:
    """The outputs of the lanes sharing a prefix, their own columns read as one tile for all
    of them (a product per kv head over ``[lanes, width]`` gathered rows), each lane's states
    over its prefix merged in first: one online softmax for every such lane, not one a lane."""
    xp, index = call.index.xp, call.index
    lanes = list(own.lanes)
    state = Online(xp, "lane", xp.concat([grouped[b:b + 1, ...] for b in lanes], axis=0), dv,
                   call.softcap, call.q.dtype, host=_in_host_memory(call))
    parts = [shared[b][0] for b in lanes]  # a lane shares one prefix: its group's
    state.merge(*(xp.concat([p[i] for p in parts], axis=0) for i in range(3)))

    shape = (len(lanes), own.width)
    state.add(rows(index, call.kpool, own.read, shape), rows(index, call.vpool, own.read, shape),
              own.mask)
    out = state.normalised(call.sinks)
    return {b: out[i:i + 1, ...] for i, b in enumerate(lanes)}


def _shared(call: Any, group: _Group, grouped: Any, dv: int, interleaved: bool,
            products: Any) -> list[tuple[Any, Any, Any]]:
    """The online softmax's state ``(m, l, acc)`` of each lane of ``group`` over its shared
    columns: the lanes' queries stacked as one lane's heads (``[1, kv, lanes x g, seq, d]``),
    so that each kv head's product reads a piece once for all of them."""
    xp = call.index.xp
    _, kv, g, seq, d = grouped.shape
    lanes = len(group.lanes)
    q = xp.concat([grouped[b:b + 1, ...] for b in group.lanes], axis=0)
    q = xp.reshape(xp.permute_dims(q, (1, 0, 2, 3, 4)), (1, kv, lanes * g, seq, d))
    state = Online(xp, "lane", q, dv, call.softcap, call.q.dtype, products=products,
                   host=_in_host_memory(call))
    _fold(call, state, q, 0, seq, group.pieces, None, interleaved)
    split = [xp.reshape(x, (kv, lanes, g, seq, int(x.shape[-1])))
             for x in (state.m, state.l, state.acc)]
    return [tuple(x[None, :, i, ...] for x in split) for i in range(lanes)]


def _lane(call: Any, own: Any, blocks: _Blocks, grouped: Any, dv: int, interleaved: bool,
          products: Any, shared: Any = ()) -> Any:
    """One lane's output (its keys the lane's: ``keys_of`` "lane"), each block of its queries
    over its pieces, after the states ``shared`` of the prefixes it shares (a lane that shares
    one is read in one block).
    ``own()`` is the lane's own index, made only when a piece needs a mask; a long piece of
    ``interleaved`` pools (token-major) is read in chunks; ``products`` are the library's own
    (:func:`~.paths.products`), or None."""
    xp = call.index.xp
    parts = []
    for i0, i1, pieces in blocks:
        state = Online(xp, "lane", grouped[:, :, :, i0:i1, :], dv, call.softcap, call.q.dtype,
                       products=products, host=_in_host_memory(call))
        for m, l, acc in shared:
            state.merge(m, l, acc)
        _fold(call, state, grouped, i0, i1, pieces, own, interleaved)
        parts.append(state.normalised(call.sinks))
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=3)


def _fold(call: Any, state: Any, grouped: Any, i0: int, i1: int, pieces: list[_Piece],
          own: Any, interleaved: bool) -> None:
    """Fold ``pieces`` into ``state``, the queries ``i0:i1`` of ``grouped`` (one lane's, or a
    group's stacked): each piece a view of the pools, masked by the lane's own index (``own()``)
    where not every query sees it whole."""
    kpool, vpool = call.kpool, call.vpool

    def view(pool: Any, s0: int, width: int) -> Any:
        return pools.map(pool, lambda part: part[s0:s0 + width, ...][None, ...])

    kinds = pools.kind(kpool), pools.kind(vpool)
    quantized = kinds[0].cast or kinds[1].cast
    # the CPU kernel reads a run every query sees whole, its codes cast in registers
    native_ok = kinds[0].kernel and kinds[1].kernel and call.softcap is None
    # quantized, a product reads its codes cast to floats: a chunk's worth at a time, so that
    # no float copy of the run is made (and the cast stays in the core's cache)
    row = int(kpool.shape[1]) * int(kpool.shape[2]) * (
        4 if quantized else _bytes(call.index.xp, kpool.dtype))
    longest = max((p.c1 - p.c0 for p in pieces if isinstance(p, _Piece)), default=0) * row
    if (interleaved or quantized) and longest > (CHUNK if quantized else LONG):
        state.chunk = max(64, CHUNK // row)
    part = None
    for piece in pieces:
        if isinstance(piece, _Gathered):
            shape = (1, piece.width)
            state.add(rows(call.index, kpool, piece.read, shape),
                      rows(call.index, vpool, piece.read, shape), None)
            continue
        c0, c1, s0, full = piece
        if full and native_ok and _native(state, grouped, i0, i1, kpool, vpool, s0, c1 - c0):
            continue
        mask = None
        if not full:
            if part is None:
                lane = own()
                part = dataclasses.replace(lane, pos=lane.pos[:, i0:i1])
            mask = part.sees_columns(part.arange(c1 - c0)[None, None, :] + c0)
        state.add(view(kpool, s0, c1 - c0), view(vpool, s0, c1 - c0), mask)


def _native(state: Any, grouped: Any, i0: int, i1: int, kpool: Any, vpool: Any, s0: int,
            width: int) -> bool:
    """Fold slots ``s0:s0 + width`` of quantized pools into ``state`` through the CPU kernel
    (:mod:`.native`); False (nothing done) where it does not apply."""
    from .native import states

    xp = state.xp
    _, kv, g, _, d = grouped.shape
    q = xp.reshape(grouped[0, :, :, i0:i1, :], (kv, g * (i1 - i0), d))
    got = states(q, kpool.map(lambda a: a[s0:s0 + width, ...]),
                 vpool.map(lambda a: a[s0:s0 + width, ...]))
    if got is None:
        return False
    m, l, acc = got
    if not state.masked and (not state.host or bool(xp.any(m == -xp.inf))):
        # a query that weighed no column of the run (its scores all -inf): its l may stay zero,
        # which the state then selects around, as after a mask (asked only in host memory;
        # selecting around a positive l changes nothing)
        state.masked = True
    shape = (1, kv, g, i1 - i0)
    state.merge(xp.reshape(m, (*shape, 1)), xp.reshape(l, (*shape, 1)),
                xp.reshape(acc, (*shape, state.dv)))
    return True


def _in_host_memory(call: Any) -> bool:
    """Whether the call's queries lie in host memory (``Backend.on_host``), where a tile's
    product is asked whether it is finite at no cost (:class:`~.softmax.Online`)."""
    return call.index.backend.on_host(call.q)


def _bytes(xp: Any, dtype: Any) -> int:
    """Bytes an element of ``dtype`` takes."""
    info = xp.finfo(dtype) if xp.isdtype(dtype, "real floating") else xp.iinfo(dtype)
    return info.bits // 8
