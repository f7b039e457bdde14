"""Where a call's rows are stored and read: an index's storage plans over its pools.

A token stores at the slot its table names at the column standing at its position (in blocks,
only a block's closing token), or at the slot its draft names; padding and a token past the
last column store nothing. ``extend``'s seen is the table's columns read from the pool, exactly
zero where no token of the lane sees a column or the slot addresses nothing (the zeroing law);
on a whole or packed index it is the call's own rows. Each store and read goes through the
backend's plan of it, kept by the index for every layer (:func:`cacheidx.plan.planned`),
and through the pool's kind (:mod:`cacheidx.pools`), so
a quantized pool's codes and scales are stored and read by the same plan.

:meth:`CacheIndex.extend <cacheidx.index.CacheIndex.extend>` is :func:`store` then
:func:`read`; attention's tiles, runs and paths read the same helpers, so what they read is
``extend``'s seen by construction.
"""

from __future__ import annotations

from typing import Any

from . import masks, pools
from . import plan as plans
from .laws import block_of, closes, inside, stands
from .masks import arange, lane_lookup, last

__all__ = ["read", "read_plan", "seen_whole", "store", "store_slots", "zero_where"]


def store(index: Any, values: Any, pool: Any, donate: bool) -> Any:
    """``pool`` with ``values`` stored where the call's tokens sit (one scatter with drop,
    through the plan's store for every layer's pool of this size); each part of a pool of
    several (a quantized pool's codes and scales) stores what its kind encodes, through the
    one plan."""
    backend, xp, n = index.backend, index.backend.xp, int(pool.shape[0])
    plan = plans.planned(index, "store", (n,), lambda: backend.store_plan(
        xp.reshape(store_slots(index), (-1,)), n))
    kind = pools.kind(pool)
    return kind.remade([backend.store(p, plan, xp.reshape(r, (-1, *r.shape[2:])),
                                      donate=donate)
                        for p, r in zip(kind.parts(pool), kind.encode(pool, values, xp),
                                        strict=True)])


def store_slots(index: Any) -> Any:
    """Law: a token stores at its own column, the slot its table names at the column standing
    at its position (in blocks, only a block's closing token), or at the slot the draft names;
    padding and a token past the last column store nothing (-1)."""
    xp = index.backend.xp
    if index.draft_slots is not None:
        return xp.where(masks.valid(index), index.draft_slots, -1)
    m, table = index.block, masks.lane_table(index)
    col = block_of(index.pos, m)
    ok = masks.valid(index) & (col < int(table.shape[1]))
    if m != 1:
        ok = ok & closes(index.pos, m)
    return lane_lookup(index, table, col, ok)


def read(index: Any, pool: Any, values: Any) -> Any:
    """Columns of the table read from ``pool``, zero where no token of the lane sees them or
    the slot addresses nothing (a pool of several parts read so, each, then decoded: a
    quantized pool's codes and scales, dequantized). Under a draft, ``values`` are the call's
    own, as the pool gives them back."""
    xp, n = index.backend.xp, int(pool.shape[0])
    shape, plan = plans.planned(index, "read", (n,), lambda: read_plan(index, n))

    def part(p: Any) -> Any:
        return xp.reshape(index.backend.read(p, plan), (*shape, *p.shape[1:]))

    seen = pools.decode(pools.map(pool, part), xp)
    if index.draft_slots is None:
        return seen
    some = xp.any(masks.draft_tail(index), axis=1)
    return xp.concat([seen, zero_where(index, values, some)], axis=1)


def read_plan(index: Any, n: int) -> tuple[tuple[int, ...], Any]:
    """The shape of a read of a pool of ``n`` slots, and the backend's plan of it (from the
    slots it takes, flat, and where it is not zero)."""
    xp = index.backend.xp
    if index.columns is not None:
        ok = masks.sees_columns(index, index.columns)
        slots = lane_lookup(index, masks.lane_table(index), index.columns, ok)
    else:
        slots, ok = masks.lane_table(index), masks.seen_by_some(index)
    ok = ok & inside(slots, n)
    return tuple(slots.shape), index.backend.read_plan(xp.reshape(slots, (-1,)),
                                                       xp.reshape(ok, (-1,)), n)


def zero_where(index: Any, values: Any, ok: Any) -> Any:
    """``values`` [batch, n, ...] with rows where ``ok`` is False replaced by zero."""
    xp = index.backend.xp
    gate = xp.reshape(ok, (*ok.shape, *(1,) * (values.ndim - 2)))
    return xp.where(gate, values, 0)


def seen_whole(index: Any, values: Any) -> Any:
    """On a whole index the columns are the lane's tokens (or the tokens closing its blocks),
    read from ``values``; a column no token of the lane sees is zero."""
    xp = index.backend.xp
    if index.columns is None and index.block == 1:
        return zero_where(index, values, masks.valid(index))
    if index.columns is not None:
        ok = masks.sees_columns(index, index.columns)
        cols = index.columns
    else:
        cols = arange(index, index.context)[None, :]
        ok = stands(cols, index.block) <= last(index)
    # the token holding a column: itself, or the one closing its block (left padding first)
    src = cols if index.block == 1 else (index.seq - 1 - _last_of(index, cols)) + stands(
        cols, index.block)
    src = xp.broadcast_to(src, ok.shape)
    lane = xp.reshape(arange(index, index.batch), (index.batch,) + (1,) * (ok.ndim - 1))
    flat = xp.reshape(lane * index.seq + xp.where(ok, src, 0), (-1,))
    rows = xp.reshape(values, (-1, *values.shape[2:]))
    got = index.backend.gather(rows, flat, xp.reshape(ok, (-1,)))
    return xp.reshape(got, (*ok.shape, *values.shape[2:]))


def _last_of(index: Any, cols: Any) -> Any:
    """Each lane's greatest position, shaped to broadcast against ``cols``."""
    return index.backend.xp.reshape(last(index), (index.batch,) + (1,) * (cols.ndim - 1))

