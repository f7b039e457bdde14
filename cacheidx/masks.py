"""What each token of an index sees: the mask's laws over an index's tensors.

A token sees the columns standing at or before its position (:func:`cacheidx.laws.sees`), under
a window only the last ``w`` of them; a padded token (not :func:`valid`) sees none. Whole and
packed indices see their own lane's tokens of the same sequence; a draft's tokens see the
table's columns before the lane's least position and the call's tokens its ``sees`` names.
:meth:`CacheIndex.mask <cacheidx.index.CacheIndex.mask>` and ``visible`` are :func:`mask`;
attention's tiles and runs build their pieces of it from :func:`sees_columns`,
:func:`draft_sees_table` and :func:`draft_tail`, so a tile's mask is the index's mask there by
construction.

The columns are those of :func:`columns_table` (the positions' table, or the blocks' under
``every``), each lane reading its row of it (:func:`lane_table`); :func:`seen_by_some` says
which columns some token of a lane sees, the zeroing law's mask that every read
(:mod:`cacheidx.storage`, attention's runs and tiles) keeps without a ``[batch, seq, width]``
array. Nothing here stores or reads a pool, nor asks the plan: the host's NumPy planners
(:mod:`cacheidx.attention.runplan`) call these on the host index.
"""

from __future__ import annotations

from typing import Any

from .laws import inside, sees, stands

__all__ = ["arange", "clamp", "columns_table", "draft_sees_table", "draft_tail", "lane_lookup",
           "lane_table", "largest", "last", "least", "mask", "sees_columns", "seen_by_some",
           "valid", "valid_positions", "window"]


def arange(index: Any, n: int) -> Any:
    """``0 .. n - 1`` in the index's dtype, on its device."""
    return index.backend.xp.arange(n, dtype=index.pos.dtype, device=index.backend.device(index.pos))


def lane_lookup(index: Any, table: Any, cols: Any, ok: Any) -> Any:
    """``table[b, cols[b, ...]]`` where ``ok``, -1 elsewhere (lane-wise gather, flat): a
    column's position (whole and packed indices) and a column's slot (:mod:`cacheidx.storage`)
    alike."""
    xp = index.backend.xp
    width = int(table.shape[1])
    lane = xp.reshape(arange(index, index.batch), (index.batch,) + (1,) * (cols.ndim - 1))
    flat = lane * width + xp.where(ok, cols, 0)
    got = index.backend.take(xp.reshape(table, (-1,)), xp.reshape(flat, (-1,)))
    return xp.where(ok, xp.reshape(got, cols.shape), -1)


def valid(index: Any) -> Any:
    """[batch, seq] bool. Law: a token is padding when its position is negative or its lane's
    row addresses no sequence of the table; padding stores nothing and sees nothing."""
    ok = index.pos >= 0
    if index.row is not None:
        ok = ok & inside(index.row, int(index.table.shape[0]))[:, None]
    return ok


def valid_positions(index: Any) -> Any:
    """Positions with padding at -1, for reductions over a lane."""
    return index.backend.xp.where(valid(index), index.pos, -1)


def last(index: Any) -> Any:
    """[batch, 1]: each lane's greatest valid position, -1 for a lane of padding."""
    return index.backend.xp.max(valid_positions(index), axis=1, keepdims=True)


def window(index: Any) -> int | None:
    """The window, at most the index dtype's largest value: a wider one sees as far."""
    w = index.window_size
    return w if w is None else min(w, largest(index))


def largest(index: Any) -> int:
    """The index dtype's largest value: the sentinel of a lane with no such token (a Python
    number, which every operation takes in the index's dtype)."""
    return int(index.backend.xp.iinfo(index.pos.dtype).max)


def least(index: Any) -> Any:
    """[batch, 1]: each lane's least valid position; a lane of padding has none, and gets the
    dtype's largest value, which no column stands before."""
    xp = index.backend.xp
    return xp.min(xp.where(valid(index), index.pos, largest(index)), axis=1, keepdims=True)


def mask(index: Any) -> Any:
    """Which columns of ``extend``'s seen each token sees: ``[batch, seq, context]``, or
    ``[batch, seq, k]`` under a selection (the module's law)."""
    if index.draft_slots is not None:
        j = arange(index, int(index.table.shape[1]))[None, None, :]
        return index.backend.xp.concat([draft_sees_table(index, j), draft_tail(index)], axis=2)
    if index.columns is not None:
        return sees_columns(index, index.columns)
    return sees_columns(index, arange(index, index.context)[None, None, :])


def sees_columns(index: Any, cols: Any) -> Any:
    """[batch, seq, k]: whether token ``i`` of lane ``b`` sees column ``cols[b, i, k]``
    (``cols`` broadcasts against ``[batch, seq, k]``). A column outside the context is seen by
    no one."""
    xp = index.backend.xp
    t = index.pos[:, :, None]
    w = window(index)
    ok = valid(index)[:, :, None] & inside(cols, index.context)
    if index.kind == "tabled" or index.block != 1:
        ok = ok & sees(stands(cols, index.block), t, w)
        if index.kind != "tabled":  # a whole lane closes the blocks up to its last token
            ok = ok & (stands(cols, index.block) <= last(index)[:, :, None])
        return ok
    # whole and packed: column j is token j of the lane, seen from the same sequence
    cols = xp.broadcast_to(cols, ok.shape)
    p = lane_lookup(index, index.pos, cols, ok)
    i = arange(index, index.seq)[None, :, None]
    same = (cols - p) == (i - t)
    return ok & (p >= 0) & same & sees(p, t, w)


def draft_sees_table(index: Any, j: Any) -> Any:
    """[batch, seq, k]: under a draft, whether a token sees the table's column ``j``
    (broadcasting against ``[batch, seq, k]``): one before its lane's least position, at or
    before its own and within the window."""
    ok, t = valid(index), index.pos
    return (ok[:, :, None] & (j < least(index)[:, :, None])
            & sees(j, t[:, :, None], window(index)))


def draft_tail(index: Any) -> Any:
    """[batch, seq, seq]: token ``i`` sees the call's token ``j`` where the draft says so, at
    or before its position and within the window."""
    ok, t = valid(index), index.pos
    return (ok[:, :, None] & ok[:, None, :] & index.draft_sees
            & sees(t[:, None, :], t[:, :, None], window(index)))


def columns_table(index: Any) -> Any:
    """The table whose columns the index reads: positions', or blocks' under ``every``."""
    return index.table if index.block == 1 else dict(index.blocks)[index.block]


def lane_table(index: Any) -> Any:
    """[batch, width]: each lane's row of the table it reads; a lane of padding reads the
    table's row 0, which its invalid tokens never use."""
    table = columns_table(index)
    if index.row is None:
        return table
    xp = index.backend.xp
    safe = xp.where(inside(index.row, int(table.shape[0])), index.row, 0)
    return index.backend.take(table, safe)


def seen_by_some(index: Any) -> Any:
    """[batch, width]: whether some token of each lane sees each column of the table (the
    zeroing law). Costs O(batch * (seq + width)), never a [batch, seq, width] array."""
    xp, w = index.backend.xp, window(index)
    width = int(columns_table(index).shape[1])
    j = arange(index, width)[None, :]
    if index.draft_slots is not None:  # columns before the least position, within reach
        lo = least(index)
        ok = (j < lo) & xp.any(valid(index), axis=1, keepdims=True)
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
    xp = index.backend.xp
    top = stands(stand.shape[1] - 1, index.block)
    big = largest(index)
    ok, t = valid(index), index.pos
    past = xp.min(xp.where(ok & (t > top), t, big), axis=1, keepdims=True)
    near = (past < big) & (past - stand < w)
    t = xp.where(ok & (t <= top), t, top + 1)
    lane = arange(index, index.batch)[:, None] * (top + 2)
    keys = xp.sort(xp.reshape(t + lane, (-1,)))
    wanted = stand + lane
    at = clamp(xp, xp.searchsorted(keys, xp.reshape(wanted, (-1,))), 0, keys.shape[0] - 1)
    found = xp.reshape(index.backend.take(keys, at), wanted.shape) - lane
    return near | ((found >= stand) & (found <= top) & (found - stand < w))


def clamp(xp: Any, x: Any, lo: int, hi: Any) -> Any:
    """``x`` clamped to ``[lo, hi]``. Not ``xp.clip``: its wrappers ask on the host whether a
    bound is NaN, which a shape that ``torch.compile(dynamic=True)`` keeps symbolic cannot
    answer."""
    return xp.where(x < lo, lo, xp.where(x > hi, hi, x))
