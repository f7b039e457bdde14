"""Eagerly, where each lane's slots form runs: the pools read as views, never copied (attention's
law 6, by views; its law 2 by each block's own mask: :mod:`cacheidx.attention`).

The runs are planned on the host in NumPy alone (:mod:`cacheidx.attention.runplan`, once per
index, kept for every layer as its read plans are, carried across ``advance()``); this module
runs that plan: it places the plan's gathered slots on the device once (:func:`place`, the
backend's read plans) and reads each layer's pools through it. A traced call has no values to
look at and never comes here.

Each lane attends on its own, its queries in blocks of :data:`~.runplan.ROWS` and each run in
tiles of the caller's ``tile`` columns, or (a view costing no copy) as wide as keeps their
scores within :data:`~cacheidx.attention.SCORES`; a tile no query of the block sees is skipped
(the causal half of a prefill, the columns below a window) and one every query sees in full is
weighed without a mask. The law is the same as the tiles': the mask of a block is the lane's
own index's ``mask`` (a one-lane index cut from the call's), so a tile holds what ``extend``'s
seen and ``mask`` hold there.

**Shared prefixes are read once.** Lanes whose tables name the same slots at their first
columns (a prompt's pages shared through the prefix cache, a forked beam, parallel samples)
read those columns together (:func:`sharing`; where that prefix holds at least :data:`SHARED`
columns): its runs are read once for all the group's lanes, their queries stacked as one lane's
heads, each kv head's product over a piece serving all of them (Hydragen's and FlashInfer's
cascade; a prefix of scattered pages, where a view of each would cost a product, as gathered
tiles of at most :data:`~.runplan.SCATTERED` columns, each gathered once a layer), and each
lane's state over it is merged exactly into the state over its own columns
(:meth:`~cacheidx.attention.softmax.Online.merge`), which the group's lanes read as one tile
for all of them where each holds at most :data:`~.runplan.OWN` (a decode step's through the CPU
kernel's paged entry, nothing gathered). The law is attend's own; only the order of the sums
changes. A lane whose window starts inside the prefix, a padding lane and a call of more than
:data:`~.runplan.ROWS` tokens a lane (a long prefill) read their columns as their own; a prefix
with a hole is read by the tiles, as every call with a hole is, and the tiles read a shared
prefix once too (:mod:`.shared`: up to the hole, and a draft's); torch's compiled operator runs
this code, so it does, and JAX's eager program reads once the groups :func:`prefixes` finds
(:func:`cacheidx.attention.jax.sharing`); a step the user compiles whole has no values to find
them in. Each path records the prefixes it reads once (:func:`.shared.note`).

A lane's short runs (the pages of its own a paged table scatters) but the last are gathered
into one tile, read through the backend's read plan: a view of each would cost a product per
page.

A lane at a time, not all lanes as one strided view: where lanes' runs sit a fixed stride
apart (``rows`` of one length) they could be, but the products over a view whose lanes lie
far apart run slower than one per lane (measured: a fifth slower for 8 lanes of 4,096).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import numpy as np

from .. import masks, pools
from .. import plan as plans
from ..backends.protocols import Arrays
from . import layout, paths, runplan
from .runplan import (
    SHARED,
    Blocks,
    Gathered,
    Group,
    Own,
    Piece,
    Runs,
    one_lane,
    prefixes,
    reads,
    shares,
    unshared,
)
from .shared import note
from .softmax import Online, group, ungroup
from .tiles import rows

__all__ = ["SHARED", "place", "prefixes", "read", "shares", "sharing", "unshared"]

#: bytes of a view's keys past which its products read it in chunks (:attr:`Online.chunk`),
#: and the bytes of a chunk: about what a core's own cache keeps between a chunk's products
#: (measured against other sizes and SDPA: docs/attention.md, "How it reads")
LONG, CHUNK = 1 << 20, 1 << 20


class Placed(NamedTuple):
    """A plan of runs (:class:`~.runplan.Runs`) with what its reads need on the device: the
    backend's read plan of each :class:`~.runplan.Gathered` tile (by its identity in ``runs``,
    which keeps it alive) and the :class:`~.runplan.Own` tile's read plan and mask."""

    runs: Runs
    gathered: dict[int, Any]
    own: tuple[Any, Any] | None


def place(index: Any, runs: Runs | None, n: int, kept: dict[int, Any] | None = None
          ) -> Placed | None:
    """``runs`` placed for ``index``'s backend and device over pools of ``n`` slots: each
    gathered tile's slots and the own tile's slots and mask copied from the host once (never
    read back), the read plans of tiles ``kept`` already holds reused. ``None`` for no runs."""
    if not runs:
        return None
    backend: Arrays = index.backend  # all a placement asks of the backend
    put = functools.partial(backend.from_host, device=backend.device(index.pos))
    kept = kept or {}
    gathered = {}
    every = [pieces for blocks in runs.lanes for _, _, pieces in blocks]
    for pieces in [*every, *(g.pieces for g in runs.groups)]:
        for p in pieces:
            if isinstance(p, Gathered):
                gathered[id(p)] = kept.get(id(p)) or backend.read_plan(
                    put(p.slots), put(np.ones(p.slots.shape, dtype=bool)), n)
    own = None
    if runs.own is not None:
        slots = runs.own.slots
        at = put(np.reshape(np.maximum(slots, 0), (-1,)))
        own = (backend.read_plan(at, put(np.reshape(slots >= 0, (-1,))), n), put(runs.own.mask))
    return Placed(runs, gathered, own)


def carry(index: Any, nxt: Any, key: tuple, placed: Placed | tuple) -> Placed | None:
    """The placed runs of ``nxt = index.advance()`` (:func:`.runplan.carry` where the plan
    follows), the gathered tiles' read plans kept; ``None`` where the plan does not follow or
    there were no runs (``()``, the part kept where the runs decline a call)."""
    if not isinstance(placed, Placed):
        return None
    runs = runplan.carry(index, plans.host(nxt), key, placed.runs)
    return None if runs is None else place(nxt, runs, key[0], placed.gathered)


plans.CARRY["runs"] = carry


def sharing(index: Any, n: int, heads: int, tile: int | None = None,
            scores: int | None = None) -> list[tuple[tuple[int, ...], int]]:
    """The groups of lanes of ``index`` (eager) whose shared prefix a call over pools of ``n``
    slots with ``heads`` query heads reads once: each group's lanes and its shared columns
    ``0:width`` (what the plan finds; empty where nothing is shared).

    A call the runs do not read (:func:`read` declines it) shares
    nothing here: a draft (its columns end in the call's own tokens, which the tiles read;
    JAX's eager program does read a draft's shared prefix once,
    :func:`cacheidx.attention.jax.sharing`), a selection, a whole or packed index. Raises
    ``ValueError`` for a traced index (no values to find groups in)."""
    from . import SCORES

    if index.backend.tracing(index.pos):
        raise ValueError("cacheidx.attention.runs.sharing: the index is traced (inside a "
                         "compiled step): the groups are found from an eager index's values")
    if not reads(index):
        return []
    found = runplan.plan(plans.host(index), n, scores or SCORES, heads, tile, True)
    return [] if not found else [(g.lanes, g.width) for g in found.groups]


def read(call: Any, scores: int) -> Any | None:
    """``call``'s output read through views of runs of slots, or ``None`` where the call is
    traced, selects columns, is a draft or whole, or some lane's slots are not a few runs."""
    index = call.index
    if index.backend.tracing(index.pos) or not reads(index):
        return None
    xp, q, kpool, vpool = index.backend.xp, call.q, call.kpool, call.vpool
    n = int(kpool.shape[0])
    if int(vpool.shape[0]) != n:
        return None
    heads = int(q.shape[2])

    share = shares()
    key = (n, scores, heads, call.tile, share)
    placed = plans.planned(index, "runs", key, lambda: place(
        index, runplan.plan(plans.host(index), n, scores, heads, call.tile, share), n) or ())
    if not placed:
        return None
    lanes, groups, own = placed.runs
    kv, dv = int(kpool.shape[1]), int(vpool.shape[-1])
    grouped = group(xp, q, "lane", kv, call.scale)  # [batch, kv, g, seq, d], once for all
    # a head-major pool's heads are each a contiguous block: a product streams one whole
    interleaved = not (layout.head_major(kpool) and layout.head_major(vpool))
    products = paths.products(index.backend, kpool, vpool)
    # each shared prefix read once, for all its lanes: its group's states, lane-major
    states = [(g.lanes, _shared(call, g, grouped, dv, interleaved, products, placed.gathered))
              for g in groups]
    done: dict[int, Any] = {}
    if own is not None:
        out = _owned(call, own, placed.own, grouped, dv, [st for _, st in states])
        if own.lanes == tuple(range(len(lanes))):  # every lane shares: its output as it is
            return ungroup(xp, out, "lane", q.dtype)
        done = {b: out[i:i + 1, ...] for i, b in enumerate(own.lanes)}
    shared: dict[int, list[tuple[Any, Any, Any]]] = {}
    for members, st in states:
        for i, b in enumerate(members):
            shared.setdefault(b, []).append(tuple(x[i:i + 1, ...] for x in st))
    out = xp.concat([done[b] if b in done else
                     _lane(call, lambda b=b: one_lane(index, b), blocks, placed.gathered,
                           grouped[b:b + 1, ...], dv, interleaved, products, shared.get(b, ()))
                     for b, blocks in enumerate(lanes)], axis=0)
    return ungroup(xp, out, "lane", q.dtype)


def _along(xp: Any, x: Any, lanes: tuple[int, ...]) -> Any:
    """Rows ``lanes`` of ``x`` along its first axis: a view where they are consecutive."""
    lo = lanes[0]
    if lanes == tuple(range(lo, lo + len(lanes))):
        return x[lo:lo + len(lanes), ...]
    return xp.concat([x[b:b + 1, ...] for b in lanes], axis=0)


def _owned(call: Any, own: Own, placed: tuple[Any, Any], grouped: Any, dv: int,
           states: list[tuple[Any, Any, Any]]) -> Any:
    """The outputs of the lanes sharing a prefix (``[len(own.lanes), kv, g, seq, dv]``, as
    :meth:`~.softmax.Online.normalised` has them), their own columns read as one tile for all
    of them (a product per kv head over ``[lanes, width]`` gathered rows, through ``placed``:
    the tile's read plan and mask on the device; a decode step's through the kernel), each
    lane's state over its prefix merged in first (``states``: each group's, whose lanes are
    ``own.lanes`` in order): one online softmax for every such lane, not one a lane."""
    xp, index = call.index.backend.xp, call.index
    state = Online(xp, "lane", _along(xp, grouped, own.lanes), dv, call.softcap, call.q.dtype,
                   host=_in_host_memory(call))
    state.merge(*(states[0] if len(states) == 1 else
                  (xp.concat([st[i] for st in states], axis=0) for i in range(3))))
    shape, (at, mask) = (len(own.lanes), own.width), placed
    if not _native_own(call, own, state):
        state.add(rows(index, call.kpool, at, shape), rows(index, call.vpool, at, shape), mask)
    return state.normalised(call.sinks)


def _native_own(call: Any, own: Own, state: Online) -> bool:
    """Fold a decode step's own columns (one token a lane, no softcap) into ``state`` through
    the CPU kernel's paged entry (:func:`.native.paged`): each lane's own slots its row of the
    table, read where they lie, every lane in one call, where a tile would gather them first
    (a product per kv head over the gathered rows). False, nothing done, where the kernel
    does not apply or refuses the values."""
    if call.index.seq != 1 or call.softcap is not None:
        return False
    from .native import paged

    xp = state.xp
    b, kv, g, _, d = state.q.shape
    count = np.count_nonzero(own.slots >= 0, axis=1)  # a lane's own columns come first
    got = paged(xp.reshape(state.q, (b, kv, g, d)), own.slots, np.zeros_like(count), count,
                call.kpool, call.vpool)
    if got is None:
        return False
    m, l, acc = got
    state.merge(xp.reshape(m, (b, kv, g, 1, 1)), xp.reshape(l, (b, kv, g, 1, 1)),
                xp.reshape(acc, (b, kv, g, 1, state.dv)))
    state.masked = True  # a lane's scores may all be -inf: its l is zero, selected around
    return True


def _shared(call: Any, group: Group, grouped: Any, dv: int, interleaved: bool,
            products: Any, gathered: dict[int, Any]) -> tuple[Any, Any, Any]:
    """The online softmax's state ``(m, l, acc)`` of the lanes of ``group`` over its shared
    columns, each ``[len(group.lanes), kv, g, seq, ...]``: the lanes' queries stacked as one
    lane's heads (``[1, kv, lanes x g, seq, d]``), so that each kv head's product reads a piece
    once for all of them (a scattered prefix's gathered tiles through ``gathered``, their read
    plans)."""
    xp = call.index.backend.xp
    _, kv, g, seq, d = grouped.shape
    lanes = len(group.lanes)
    q = _along(xp, grouped, group.lanes)
    q = xp.reshape(xp.permute_dims(q, (1, 0, 2, 3, 4)), (1, kv, lanes * g, seq, d))
    state = Online(xp, "lane", q, dv, call.softcap, call.q.dtype, products=products,
                   host=_in_host_memory(call))
    _fold(call, state, q, 0, seq, list(group.pieces), None, gathered, interleaved)
    note(group.lanes, group.width)
    return tuple(xp.permute_dims(xp.reshape(x, (kv, lanes, g, seq, int(x.shape[-1]))),
                                 (1, 0, 2, 3, 4)) for x in (state.m, state.l, state.acc))


def _lane(call: Any, own: Any, blocks: Blocks, gathered: dict[int, Any], grouped: Any, dv: int,
          interleaved: bool, products: Any, shared: Any = ()) -> Any:
    """One lane's output (its keys the lane's: ``keys_of`` "lane"), each block of its queries
    over its pieces, after the states ``shared`` of the prefixes it shares (a lane that shares
    one is read in one block).
    ``own()`` is the lane's own index, made only when a piece needs a mask; ``gathered`` the
    read plans of its gathered tiles (:class:`Placed`); a long piece of
    ``interleaved`` pools (token-major) is read in chunks; ``products`` are the library's own
    (:func:`~.paths.products`), or None."""
    xp = call.index.backend.xp
    parts = []
    for i0, i1, pieces in blocks:
        state = Online(xp, "lane", grouped[:, :, :, i0:i1, :], dv, call.softcap, call.q.dtype,
                       products=products, host=_in_host_memory(call))
        for m, l, acc in shared:
            state.merge(m, l, acc)
        _fold(call, state, grouped, i0, i1, pieces, own, gathered, interleaved)
        parts.append(state.normalised(call.sinks))
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=3)


def _fold(call: Any, state: Any, grouped: Any, i0: int, i1: int,
          pieces: list[Piece | Gathered], own: Any, gathered: dict[int, Any],
          interleaved: bool) -> None:
    """Fold ``pieces`` into ``state``, the queries ``i0:i1`` of ``grouped`` (one lane's, or a
    group's stacked): each piece a view of the pools, masked by the lane's own index (``own()``)
    where not every query sees it whole; a gathered tile read through its read plan in
    ``gathered``."""
    kpool, vpool = call.kpool, call.vpool

    def view(pool: Any, s0: int, width: int) -> Any:
        return pools.map(pool, lambda part: part[s0:s0 + width, ...][None, ...])

    kinds = pools.kind(kpool), pools.kind(vpool)
    quantized = kinds[0].cast or kinds[1].cast
    # the CPU kernel reads a run every query sees whole, its codes cast in registers
    native_ok = all("run" in kind.kernel for kind in kinds) and call.softcap is None
    # quantized, a product reads its codes cast to floats: a chunk's worth at a time, so that
    # no float copy of the run is made (and the cast stays in the core's cache)
    row = int(kpool.shape[1]) * int(kpool.shape[2]) * (
        4 if quantized else _bytes(call.index.backend.xp, pools.parts(kpool)[0].dtype))
    longest = max((p.c1 - p.c0 for p in pieces if isinstance(p, Piece)), default=0) * row
    if (interleaved or quantized) and longest > (CHUNK if quantized else LONG):
        state.chunk = max(64, CHUNK // row)
    part = None

    def fold(piece: Piece) -> None:  # a view of the pools, masked where a query sees part
        nonlocal part
        c0, c1, s0, full = piece
        mask = None
        if not full:
            if part is None:
                lane = own()
                part = dataclasses.replace(lane, pos=lane.pos[:, i0:i1])
            mask = masks.sees_columns(part, masks.arange(part, c1 - c0)[None, None, :] + c0)
        state.add(view(kpool, s0, c1 - c0), view(vpool, s0, c1 - c0), mask)

    whole = []  # runs every query sees whole, for the kernel once the others are folded
    for piece in pieces:
        if isinstance(piece, Gathered):
            shape, at = (1, piece.width), gathered[id(piece)]
            state.add(rows(call.index, kpool, at, shape), rows(call.index, vpool, at, shape),
                      None)
        elif piece.full and native_ok:
            whole.append(piece)
        else:
            fold(piece)
    for piece in _native(state, grouped, i0, i1, kpool, vpool, whole):
        fold(piece)


def _native(state: Any, grouped: Any, i0: int, i1: int, kpool: Any, vpool: Any,
            whole: list[Piece]) -> list[Piece]:
    """Fold runs every query sees whole (``whole``) into ``state`` through the CPU kernel
    (:mod:`.native`) and return those it did not fold: all of them in one call of its paged
    entry, their slots one after another as one lane's row of the table, the lanes' rows
    stacked as that lane's queries."""
    if not whole:
        return []
    from . import native

    xp = state.xp
    _, kv, g, _, d = grouped.shape
    q = xp.reshape(grouped[0, :, :, i0:i1, :], (1, kv, g * (i1 - i0), d))
    width = np.asarray([p.c1 - p.c0 for p in whole], np.int64)
    first = np.asarray([p.s0 for p in whole], np.int64)
    n = int(width.sum())  # each run's slots s0, s0 + 1, ... one after another
    slots = np.repeat(first - np.cumsum(width) + width, width) + np.arange(n)
    table = slots[None, :]
    start: np.ndarray = np.zeros(1, np.int64)
    stop: np.ndarray = np.full(1, n, np.int64)
    every = int(q.shape[2])
    got = []  # the rows in calls of at most ROWS each (lanes stacked under a shared prefix)
    for r0 in range(0, every, native.ROWS):
        part = native.paged(q[:, :, r0:r0 + native.ROWS, :], table, start, stop, kpool, vpool)
        if part is None:
            return whole
        got.append(part)
    m, l, acc = (xp.concat(x, axis=2) if len(x) > 1 else x[0] for x in zip(*got, strict=True))
    if not state.masked and (not state.host or bool(xp.any(m == -xp.inf))):
        # a query that weighed no column of the runs (its scores all -inf): its l may stay
        # zero, which the state then selects around, as after a mask (asked only in host
        # memory; selecting around a positive l changes nothing)
        state.masked = True
    shape = (1, kv, g, i1 - i0)
    state.merge(xp.reshape(m, (*shape, 1)), xp.reshape(l, (*shape, 1)),
                xp.reshape(acc, (*shape, state.dv)))
    return []


def _in_host_memory(call: Any) -> bool:
    """Whether the call's queries lie in host memory (``Backend.on_host``), where a tile's
    product is asked whether it is finite at no cost (:class:`~.softmax.Online`)."""
    return call.index.backend.on_host(call.q)


def _bytes(xp: Any, dtype: Any) -> int:
    """Bytes an element of ``dtype`` takes."""
    info = xp.finfo(dtype) if xp.isdtype(dtype, "real floating") else xp.iinfo(dtype)
    return info.bits // 8
