"""Where a call's rows are stored and read: an index's storage plans over its pools.

A token stores at the slot its table names at the column standing at its position (in blocks,
only a block's closing token), or at the slot its draft names; padding and a token past the
last column store nothing. ``extend``'s seen is the table's columns read from the pool, exactly
zero where no token of the lane sees a column or the slot addresses nothing (the zeroing law);
on a whole or packed index it is the call's own rows. Each store and read goes through the
backend's plan of it, kept by the index for every layer (:meth:`CacheIndex.planned
<cacheidx.index.CacheIndex.planned>`), and through the pool's kind (:mod:`cacheidx.pools`), so
a quantized pool's codes and scales are stored and read by the same plan.

:meth:`CacheIndex.extend <cacheidx.index.CacheIndex.extend>` is :func:`store` then
:func:`read`; attention's tiles, runs and paths read the same helpers, so what they read is
``extend``'s seen by construction.
"""

from __future__ import annotations

from typing import Any

from . import masks, pools
from .laws import block_of, closes, inside, stands
from .masks import arange, lane_lookup, last

__all__ = ["columns_table", "lane_table", "read", "seen_by_some", "seen_whole", "store",
           "zero_where"]


def columns_table(index: Any) -> Any:
    """The table whose columns the index reads: positions', or blocks' under ``every``."""
    return index.table if index.block == 1 else dict(index.blocks)[index.block]


def lane_table(index: Any) -> Any:
    """[batch, width]: each lane's row of the table it reads; a lane of padding reads the
    table's row 0, which its invalid tokens never use."""
    table = columns_table(index)
    if index.row is None:
        return table
    xp = index.xp
    safe = xp.where(inside(index.row, int(table.shape[0])), index.row, 0)
    return index.backend.take(table, safe)


def store(index: Any, values: Any, pool: Any, donate: bool) -> Any:
    """``pool`` with ``values`` stored where the call's tokens sit (one scatter with drop,
    through the plan's store for every layer's pool of this size); each part of a pool of
    several (a quantized pool's codes and scales) stores what its kind encodes, through the
    one plan."""
    backend, xp, n = index.backend, index.xp, int(pool.shape[0])
    plan = index.planned("store", (n,), lambda: backend.store_plan(
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
    xp = index.xp
    if index.draft_slots is not None:
        return xp.where(index.valid, index.draft_slots, -1)
    m, table = index.block, lane_table(index)
    col = block_of(index.pos, m)
    ok = index.valid & (col < int(table.shape[1]))
    if m != 1:
        ok = ok & closes(index.pos, m)
    return lane_lookup(index, table, col, ok)


def read(index: Any, pool: Any, values: Any) -> Any:
    """Columns of the table read from ``pool``, zero where no token of the lane sees them or
    the slot addresses nothing (a pool of several parts read so, each, then decoded: a
    quantized pool's codes and scales, dequantized). Under a draft, ``values`` are the call's
    own, as the pool gives them back."""
    xp, n = index.xp, int(pool.shape[0])
    shape, plan = index.planned("read", (n,), lambda: read_plan(index, n))

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
    xp = index.xp
    if index.columns is not None:
        ok = masks.sees_columns(index, index.columns)
        slots = lane_lookup(index, lane_table(index), index.columns, ok)
    else:
        slots, ok = lane_table(index), seen_by_some(index)
    ok = ok & inside(slots, n)
    return tuple(slots.shape), index.backend.read_plan(xp.reshape(slots, (-1,)),
                                                       xp.reshape(ok, (-1,)), n)


def seen_by_some(index: Any) -> Any:
    """[batch, width]: whether some token of each lane sees each column of the table (the
    zeroing law). Costs O(batch * (seq + width)), never a [batch, seq, width] array."""
    xp, w = index.xp, masks.window(index)
    width = int(columns_table(index).shape[1])
    j = arange(index, width)[None, :]
    if index.draft_slots is not None:  # columns before the least position, within reach
        lo = masks.least(index)
        ok = (j < lo) & xp.any(index.valid, axis=1, keepdims=True)
        return ok if w is None else ok & (lo - j < w)
    stand = stands(j, index.block)
    if w is None:
        return stand <= last(index)
    return _some_token_within(index, stand, w)


def _some_token_within(index: Any, stand: Any, w: int) -> Any:
    """Whether some valid token of the lane sits in ``[stand, stand + w)``.

    Tokens at or before the last column's stand are found by one ``searchsorted`` over all
    lanes at once (each lane's positions offset into a range of its own, so no offset grows
    with the window); of the tokens past it only the lane's nearest can see a column."""
    xp = index.xp
    top = stands(stand.shape[1] - 1, index.block)
    big = masks.largest(index)
    valid, t = index.valid, index.pos
    past = xp.min(xp.where(valid & (t > top), t, big), axis=1, keepdims=True)
    near = (past < big) & (past - stand < w)
    t = xp.where(valid & (t <= top), t, top + 1)
    lane = arange(index, index.batch)[:, None] * (top + 2)
    keys = xp.sort(xp.reshape(t + lane, (-1,)))
    wanted = stand + lane
    at = masks.clamp(xp, xp.searchsorted(keys, xp.reshape(wanted, (-1,))), 0, keys.shape[0] - 1)
    found = xp.reshape(index.backend.take(keys, at), wanted.shape) - lane
    return near | ((found >= stand) & (found <= top) & (found - stand < w))


def zero_where(index: Any, values: Any, ok: Any) -> Any:
    """``values`` [batch, n, ...] with rows where ``ok`` is False replaced by zero."""
    xp = index.xp
    gate = xp.reshape(ok, (*ok.shape, *(1,) * (values.ndim - 2)))
    return xp.where(gate, values, 0)


def seen_whole(index: Any, values: Any) -> Any:
    """On a whole index the columns are the lane's tokens (or the tokens closing its blocks),
    read from ``values``; a column no token of the lane sees is zero."""
    xp = index.xp
    if index.columns is None and index.block == 1:
        return zero_where(index, values, index.valid)
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
    return index.xp.reshape(last(index), (index.batch,) + (1,) * (cols.ndim - 1))

