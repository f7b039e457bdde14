"""The columns a call attends over, a tile at a time, read where they are (attention's laws 3,
5 and 6: :mod:`cacheidx.attention`).

A tile is ``(keys, values, mask)``: the keys and values of ``T`` consecutive columns of
``extend``'s seen, exactly as ``extend`` reads them (a column no token of the lane sees, an
unallocated one or a hole reads as zero), and ``mask`` ``[batch, seq, T]``, those columns of
``index.mask()`` (``None`` where every token sees every column of the tile). Each function
here takes the index's own helpers for both, so a tile holds what ``extend``'s seen and
``mask`` hold there, by construction.

What a tile reads depends only on the index and the pool's size: eagerly, the index keeps each
tile's read plan for every layer (FlashInfer's plan/run split), together with what the host
learnt making it: whether some token sees a column of the tile (a tile nobody sees is skipped,
so a sliding window's decode reads its window, not the context) and whether every token sees
every column (its mask is then never built). Traced, every tile is read and masked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from .. import masks, pools, storage
from .. import plan as plans
from ..laws import inside

__all__ = ["Tile", "draft", "read", "rows"]


class Tile(NamedTuple):
    #: [batch, T, kv, d] (shared by a lane's tokens) or [batch, seq, T, kv, d]; read from a
    #: pool of several parts (:mod:`cacheidx.pools`: a quantized one's codes and scales), a
    #: pool of its kind over each part's rows
    keys: Any
    values: Any
    mask: Any  #: [batch, seq, T], or None where every token sees every column


class _Plan(NamedTuple):
    """One tile's read of a pool of ``n`` slots, kept by the index for every layer."""

    shape: tuple[int, ...]  #: the read's leading shape, [batch, T] or [batch, seq, T]
    read: Any  #: the backend's read plan
    live: bool  #: some token sees some column (always True when traced)
    full: bool  #: every token sees every column (always False when traced)


def read(index: Any, k: Any, v: Any, kpool: Any, vpool: Any, size: int,
         offsets: tuple[int, ...] | None = None) -> Iterator[Tile]:
    """The tiles of ``size`` columns of a call through ``index`` whose keys and values are
    ``k`` and ``v`` and whose pools (after its stores) are ``kpool`` and ``vpool``.
    ``offsets`` (a table's, eager): each lane's first column, its columns before it read
    elsewhere (a prefix its group reads once: :mod:`.shared`); a tile then holds each lane's
    columns from its own offset, and masks out those past the table."""
    if index.kind != "tabled":
        yield from _whole(index, k, v, size)
    elif index.columns is not None:
        yield from _selected(index, kpool, vpool, size)
    else:
        yield from _table(index, kpool, vpool, size, offsets)
        if index.draft_slots is not None:
            yield draft(index, k, v)


def _spans(width: int, size: int) -> Iterator[tuple[int, int]]:
    for c0 in range(0, width, size):
        yield c0, min(width, c0 + size)


def rows(index: Any, pool: Any, read: Any, shape: tuple[int, ...]) -> Any:
    """The rows of ``pool`` the backend's read plan ``read`` reads, ``[*shape, ...]`` (of a
    pool of several parts, each so: :func:`cacheidx.pools.map`)."""
    xp, backend = index.backend.xp, index.backend
    return pools.map(pool, lambda part: xp.reshape(backend.read(part, read),
                                                   (*shape, *part.shape[1:])))


def _rows(index: Any, pool: Any, plan: _Plan) -> Any:
    """A tile's rows of ``pool``."""
    return rows(index, pool, plan.read, plan.shape)


def _plans(index: Any, key: tuple, pools: tuple[Any, Any], make: Any,
           seen: Any = None) -> list[_Plan]:
    """Each pool's plan of one tile, kept by the index under ``key`` and the pool's size;
    ``make()`` gives the tile's ``(slots, ok, mask)``, and is called only to make one;
    ``seen(host)`` the tile's mask on the host index ``host`` (:func:`cacheidx.plan.host`),
    which says whether some token sees a column and whether every token sees every one, read
    there rather than from the device."""
    xp, backend = index.backend.xp, index.backend

    def plan(n: int) -> _Plan:
        slots, ok, _ = make()
        gate = ok & inside(slots, n)
        read = backend.read_plan(xp.reshape(slots, (-1,)), xp.reshape(gate, (-1,)), n)
        if backend.tracing(index.pos):
            return _Plan(tuple(slots.shape), read, True, False)
        mask = seen(plans.host(index))
        return _Plan(tuple(slots.shape), read, bool(mask.any()), bool(mask.all()))

    return [plans.planned(index, "tile", (*key, int(p.shape[0])), lambda p=p: plan(int(p.shape[0])))
            for p in pools]


def _table(index: Any, kpool: Any, vpool: Any, size: int,
           offsets: tuple[int, ...] | None = None) -> Iterator[Tile]:
    """Columns of the table (of blocks under ``every``), shared by a lane's tokens; with
    ``offsets``, each lane's from its own first column."""
    draft = index.draft_slots is not None
    found: dict[str, Any] = {}  # the lane table and the zeroing law, made once if needed
    width = int(masks.columns_table(index).shape[1])

    def lanes() -> tuple[Any, Any]:
        if not found:
            found["table"] = masks.lane_table(index)
            found["some"] = masks.seen_by_some(index)
        return found["table"], found["some"]

    def columns(of: Any, c0: int, c1: int) -> Any:
        """The tile's columns ``[1, T]``, or each lane's from its offset ``[batch, T]``."""
        j = masks.arange(of, c1 - c0)[None, :] + c0
        if offsets is None:
            return j
        on = of.backend
        return j + on.from_host(np.asarray(offsets), j.dtype, on.device(of.pos))[:, None]

    for c0, c1 in _spans(width - min(offsets or (0,)), size):

        def mask(c0: int = c0, c1: int = c1, of: Any = index) -> Any:
            j = columns(of, c0, c1)[:, None, :]
            seen = masks.draft_sees_table(of, j) if draft else masks.sees_columns(of, j)
            return seen if offsets is None else seen & (j < width)

        def make(c0: int = c0, c1: int = c1) -> tuple[Any, Any, Any]:
            table, some = lanes()
            if offsets is None:
                return table[:, c0:c1], some[:, c0:c1], None
            xp, j = index.backend.xp, columns(index, c0, c1)
            there = j < width
            at = xp.where(there, j, xp.zeros((), dtype=j.dtype))
            return (xp.take_along_axis(table, at, axis=1),
                    xp.take_along_axis(some, at, axis=1) & there, None)

        def seen(host: Any, mask: Any = mask) -> Any:
            return mask(of=host)

        key = ("attend", c0, c1) if offsets is None else ("attend", c0, c1, offsets)
        k_plan, v_plan = _plans(index, key, (kpool, vpool), make, seen)
        if k_plan.live:
            yield Tile(_rows(index, kpool, k_plan), _rows(index, vpool, v_plan),
                       None if k_plan.full else mask())


def draft(index: Any, k: Any, v: Any) -> Tile:
    """Under a draft, the call's own tokens: the columns after the table's."""
    xp = index.backend.xp
    tail = masks.draft_tail(index)
    some = xp.any(tail, axis=1)
    return Tile(storage.zero_where(index, k, some), storage.zero_where(index, v, some), tail)


def _selected(index: Any, kpool: Any, vpool: Any, size: int) -> Iterator[Tile]:
    """Each token's chosen columns, ``size`` of its choices at a time: the selection's tile is
    the index's selection cut to those choices."""
    columns = index.columns
    for c0, c1 in _spans(int(columns.shape[2]), size):
        part = dataclasses.replace(index, columns=columns[:, :, c0:c1])
        seen = masks.sees_columns(part, part.columns)

        def make(part: Any = part, seen: Any = seen) -> tuple[Any, Any, Any]:
            slots = masks.lane_lookup(part, masks.lane_table(part), part.columns, seen)
            return slots, seen, seen

        def seen_on(host: Any, c0: int = c0, c1: int = c1) -> Any:
            cut = dataclasses.replace(host, columns=host.columns[:, :, c0:c1])
            return masks.sees_columns(cut, cut.columns)

        k_plan, v_plan = _plans(index, ("attend select", c0, c1), (kpool, vpool), make,
                                seen_on)
        if k_plan.live:
            yield Tile(_rows(index, kpool, k_plan), _rows(index, vpool, v_plan),
                       None if k_plan.full else seen)


def _whole(index: Any, k: Any, v: Any, size: int) -> Iterator[Tile]:
    """On a whole index the columns are the lane's tokens (or the tokens closing its
    blocks), read from the call's own keys and values."""
    if index.columns is not None:
        columns = index.columns
        for c0, c1 in _spans(int(columns.shape[2]), size):
            part = dataclasses.replace(index, columns=columns[:, :, c0:c1])
            yield Tile(storage.seen_whole(part, k), storage.seen_whole(part, v),
                       masks.sees_columns(part, part.columns))
        return
    seen_k, seen_v = storage.seen_whole(index, k), storage.seen_whole(index, v)
    for c0, c1 in _spans(index.context, size):
        j = masks.arange(index, c1 - c0)[None, None, :] + c0
        yield Tile(seen_k[:, c0:c1, ...], seen_v[:, c0:c1, ...], masks.sees_columns(index, j))
