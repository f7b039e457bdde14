"""What each token of an index sees: the mask's laws over an index's tensors.

A token sees the columns standing at or before its position (:func:`cacheidx.laws.sees`), under
a window only the last ``w`` of them; a padded token (:attr:`CacheIndex.valid
<cacheidx.index.CacheIndex.valid>`) sees none. Whole and packed indices see their own lane's
tokens of the same sequence; a draft's tokens see the table's columns before the lane's least
position and the call's tokens its ``sees`` names. :meth:`CacheIndex.mask
<cacheidx.index.CacheIndex.mask>` and ``visible`` are :func:`mask`; attention's tiles and runs
build their pieces of it from :func:`sees_columns`, :func:`draft_sees_table` and
:func:`draft_tail`, so a tile's mask is the index's mask there by construction.
"""

from __future__ import annotations

from typing import Any

from .laws import inside, sees, stands

__all__ = ["arange", "clamp", "draft_sees_table", "draft_tail", "lane_lookup", "largest", "last",
           "least", "mask", "sees_columns", "valid_positions", "window"]


def arange(index: Any, n: int) -> Any:
    """``0 .. n - 1`` in the index's dtype, on its device."""
    return index.xp.arange(n, dtype=index.pos.dtype, device=index.device)


def lane_lookup(index: Any, table: Any, cols: Any, ok: Any) -> Any:
    """``table[b, cols[b, ...]]`` where ``ok``, -1 elsewhere (lane-wise gather, flat): a
    column's position (whole and packed indices) and a column's slot (:mod:`cacheidx.storage`)
    alike."""
    xp = index.xp
    width = int(table.shape[1])
    lane = xp.reshape(arange(index, index.batch), (index.batch,) + (1,) * (cols.ndim - 1))
    flat = lane * width + xp.where(ok, cols, 0)
    got = index.backend.take(xp.reshape(table, (-1,)), xp.reshape(flat, (-1,)))
    return xp.where(ok, xp.reshape(got, cols.shape), -1)


def valid_positions(index: Any) -> Any:
    """Positions with padding at -1, for reductions over a lane."""
    return index.xp.where(index.valid, index.pos, -1)


def last(index: Any) -> Any:
    """[batch, 1]: each lane's greatest valid position, -1 for a lane of padding."""
    return index.xp.max(valid_positions(index), axis=1, keepdims=True)


def window(index: Any) -> int | None:
    """The window, at most the index dtype's largest value: a wider one sees as far."""
    w = index.window_size
    return w if w is None else min(w, largest(index))


def largest(index: Any) -> int:
    """The index dtype's largest value: the sentinel of a lane with no such token (a Python
    number, which every operation takes in the index's dtype)."""
    return int(index.xp.iinfo(index.pos.dtype).max)


def least(index: Any) -> Any:
    """[batch, 1]: each lane's least valid position; a lane of padding has none, and gets the
    dtype's largest value, which no column stands before."""
    xp = index.xp
    return xp.min(xp.where(index.valid, index.pos, largest(index)), axis=1, keepdims=True)


def mask(index: Any) -> Any:
    """Which columns of ``extend``'s seen each token sees: ``[batch, seq, context]``, or
    ``[batch, seq, k]`` under a selection (the module's law)."""
    if index.draft_slots is not None:
        j = arange(index, int(index.table.shape[1]))[None, None, :]
        return index.xp.concat([draft_sees_table(index, j), draft_tail(index)], axis=2)
    if index.columns is not None:
        return sees_columns(index, index.columns)
    return sees_columns(index, arange(index, index.context)[None, None, :])


def sees_columns(index: Any, cols: Any) -> Any:
    """[batch, seq, k]: whether token ``i`` of lane ``b`` sees column ``cols[b, i, k]``
    (``cols`` broadcasts against ``[batch, seq, k]``). A column outside the context is seen by
    no one."""
    xp = index.xp
    t = index.pos[:, :, None]
    w = window(index)
    ok = index.valid[:, :, None] & inside(cols, index.context)
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
    valid, t = index.valid, index.pos
    return (valid[:, :, None] & (j < least(index)[:, :, None])
            & sees(j, t[:, :, None], window(index)))


def draft_tail(index: Any) -> Any:
    """[batch, seq, seq]: token ``i`` sees the call's token ``j`` where the draft says so, at
    or before its position and within the window."""
    valid, t = index.valid, index.pos
    return (valid[:, :, None] & valid[:, None, :] & index.draft_sees
            & sees(t[:, None, :], t[:, :, None], window(index)))


def clamp(xp: Any, x: Any, lo: int, hi: Any) -> Any:
    """``x`` clamped to ``[lo, hi]``. Not ``xp.clip``: its wrappers ask on the host whether a
    bound is NaN, which a shape that ``torch.compile(dynamic=True)`` keeps symbolic cannot
    answer."""
    return xp.where(x < lo, lo, xp.where(x > hi, hi, x))
