"""JAX: a call is one ``jax.jit`` program, and under it the tiles of a table one
``lax.fori_loop``.

Eagerly, ``attend`` runs as one program kept by JAX per structure and shape (op by op, JAX
would compile each of the tiles' small operations for every new shape), donating the pools
when the call does. Traced, the tiles of a table are a ``lax.fori_loop``, so a program's size
and its compile time do not grow with the context (a Python loop would unroll every tile).

The loop's body is :mod:`cacheidx.attention.tiles`' read of a table at a tile start that is a
loop variable: the columns ``c0`` to ``c0 + T - 1`` taken from the lane table, those past its
width reading nothing (outside the context, they are seen by no one and read as zero), and the
online softmax's running maximum, sum and output its carry. Selections and whole indices take
the standard tiles, unrolled.

**Shared prefixes are read once** (:mod:`cacheidx.attention.runs`' cascade, attention's law 2
all the same). Eagerly, the host finds the groups of lanes sharing a prefix by runs' rules
(:func:`sharing`) and hands them to the program as a static argument, ``share``: each group's
lanes and its shared columns ``0:width``. The program reads each group's prefix in a loop of
its own, once, the group's queries stacked as one lane's heads, and each lane's loop reads its
columns from its group's width on (from 0 for a lane that shares nothing); each lane's state
over its prefix is merged into its own (:meth:`~cacheidx.attention.softmax.Online.merge`). The
groups are part of the program's key: one compile per kind of grouping, so a decode loop whose
groups stay the same compiles once, and no sharing (``share`` empty, or within
:func:`runs.unshared() <cacheidx.attention.runs.unshared>`) is the program without it. A
traced call (a step the user compiles whole) has no values to find groups in: each lane reads
its prefix as its own (the groups as a static argument of the user's program would make a
program for every grouping, where one serves every value of positions and tables). Each eager
call records the groups its program reads once (:func:`.shared.note`).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import numpy as np

from .. import masks, pools
from .. import plan as plans
from ..laws import inside
from . import runplan
from .shared import carry, held, lanes_states, note
from .softmax import Online

__all__ = ["JaxPath", "sharing"]

#: groups of lanes sharing a prefix, as the program's static argument: ``((lanes, width), ...)``
Share = tuple[tuple[tuple[int, ...], int], ...]


class JaxPath:
    def attend(self, call: Any) -> tuple[Any, Any, Any]:
        index = call.index
        if index.backend.tracing(index.pos):
            return _traced(call)
        # a whole or packed index stores nothing: its pools' are the pools given (extend's
        # law), never the program's copies of them, and nothing is donated
        whole = index.kind != "tabled"
        share = _share(call)
        out, kpool, vpool = _jitted(call.donate and not whole)(
            index, call.q, call.k, call.v, call.kpool, call.vpool, call.sinks, scale=call.scale,
            softcap=call.softcap, tile=call.tile, share=share)
        for lanes, width in share:  # the program reads each once (_prefixes; its tests trace it)
            note(lanes, width)
        return (out, call.kpool, call.vpool) if whole else (out, kpool, vpool)


def _traced(call: Any, share: Share = (), hinted: bool = True) -> tuple[Any, Any, Any]:
    """``(out, kpool', vpool')`` of a call whose index is traced: the stores, then the table's
    loop (reading the prefixes of ``share`` once, or, ``hinted``, those of the index's hint)
    or the standard tiles."""
    from . import standard, stored

    index = call.index
    call = stored(call)
    if index.kind != "tabled" or index.columns is not None:
        return standard(call), call.kpool, call.vpool
    # as the host's rules: a call of at most ROWS tokens a lane whose whole mask (which the
    # program's check of the hint makes) is at most WHOLE, over pools of one size
    hint = (hinted and not share and index.share_widths is not None
            and index.seq <= runplan.ROWS
            and index.batch * index.seq * int(masks.lane_table(index).shape[1]) <= runplan.WHOLE
            and int(call.vpool.shape[0]) == int(call.kpool.shape[0]))
    return _looped(call, share, hint), call.kpool, call.vpool


def sharing(index: Any, n: int, heads: int, tile: int | None = None) -> Share:
    """The groups of lanes of the eager ``index`` whose shared prefix a call over pools of
    ``n`` slots with ``heads`` query heads reads once (runs' rules, :func:`runs.sharing
    <cacheidx.attention.runs.sharing>`'s groups without its views: holes and scattered pages
    past the prefix, and a prefix of scattered pages, do not matter to a gather): each group's
    lanes and its columns ``0:width``,
    empty where nothing is shared. The width is part of the program's key, so it is rounded
    down (:func:`rounded`): a prefix that differs by a few pages is the same program."""
    from . import SCORES

    on_host = plans.host(index)  # the host's values: nothing read back (cacheidx.plan's law)
    table = masks.lane_table(on_host)
    width = int(table.shape[1])
    if index.seq > runplan.ROWS or index.batch * index.seq * width > runplan.WHOLE:
        return ()  # as runs' plan: the host never holds a larger mask
    whole = on_host.mask()[:, :, :width]  # the table's columns (a draft's own come after)
    found = runplan.prefixes(table, masks.seen_by_some(on_host), whole, n, index.seq, heads,
                             SCORES, tile, views=False)
    return tuple((g.lanes, rounded(g.width)) for g in found)


def rounded(width: int) -> int:
    """``width`` rounded down to a multiple of a quarter of its greatest power of two (64 and
    more stay at least 64): at most four programs an octave of prefix widths, where each kept
    its own would compile one per prompt; the columns cut off (under a quarter of the prefix)
    are read by each lane as its own."""
    step = max(1, (1 << (width.bit_length() - 1)) // 4)
    return width - width % step


def _share(call: Any) -> Share:
    """The groups the eager ``call`` reads once (:func:`sharing`, kept by the index's plan for
    every layer); none within ``runs.unshared()``, for a selection or a whole index, or where
    the pools differ in size."""
    index, kpool, vpool = call.index, call.kpool, call.vpool
    n = int(kpool.shape[0])
    if (not runplan.shares() or index.kind != "tabled" or index.columns is not None
            or int(vpool.shape[0]) != n or index.seq > runplan.ROWS
            or int(masks.columns_table(index).shape[1]) < runplan.SHARED):
        return ()
    plans.follow(index)  # the plan of these values (every eager numpy or torch call asks it too)
    heads = int(call.q.shape[2])
    return plans.planned(index, "share", (n, heads, call.tile),
                         lambda: sharing(index, n, heads, call.tile))


plans.CARRY["share"] = carry  # the groups follow as the tiles' do


def _reader(index: Any) -> Any:
    """``read(pool, slots, ok)``: the rows of ``pool`` at ``slots`` ``[lanes, T]`` where ``ok``
    and inside the pool, zero elsewhere (of a pool of several parts, each so:
    :func:`cacheidx.pools.map`)."""
    xp = index.backend.xp

    def read(pool: Any, slots: Any, ok: Any) -> Any:
        def part(p: Any) -> Any:
            got = index.backend.gather(p, xp.reshape(slots, (-1,)),
                                       xp.reshape(ok & inside(slots, p.shape[0]), (-1,)))
            return xp.reshape(got, (*slots.shape, *p.shape[1:]))

        return pools.map(pool, part)

    return read


def _looped(call: Any, share: Share = (), hint: bool = False) -> Any:
    """The output of a traced call over a table (its pools holding its stores): each group of
    ``share``'s prefix read once (:func:`_prefixes`), or of the index's hint (``hint``:
    :func:`_hinted`, the lanes that hold to it), then each lane's columns from its offset (its
    group's width, else 0) in one loop, the prefixes' states merged in. A hint's offsets are
    values: the loop then runs as many tiles as the table's width needs and skips, by a
    ``lax.cond`` (which differentiates), those past every lane's rest."""
    from jax import lax

    index = call.index
    xp, kpool, vpool = index.backend.xp, call.kpool, call.vpool
    table, some = masks.lane_table(index), masks.seen_by_some(index)
    width = int(table.shape[1])
    offsets = _offsets(index.batch, share)
    # a sharing lane's columns start past its prefix: the loop spans the longest rest
    span = width - min(offsets)
    size = max(1, min(call.tile_width, span))
    member = None
    if hint:
        member, widths = held(index, int(kpool.shape[0]))
        off = xp.sum(xp.where(member, widths[:, None], xp.zeros_like(widths[:, None])), axis=0)
        rest = width - xp.min(off)  # the longest rest of a lane, a value
    draft = index.draft_slots is not None
    state = Online.start(xp, call.q, "lane", int(vpool.shape[-1]), int(kpool.shape[1]),
                         scale=call.scale, softcap=call.softcap)
    state.masked = True  # every tile comes with its mask: each loop step's state is a copy
    state.split = False  # one product: XLA lays out the tile as it likes
    read = _reader(index)
    if hint:
        off = off[:, None]
    else:
        off = None if not share else xp.asarray(offsets, dtype=index.pos.dtype)[:, None]

    def body(i: Any, carry: tuple) -> tuple:
        j = i * size + masks.arange(index, size)[None, :]  # [1, T], or [batch, T] from each offset
        j = j if off is None else j + off
        there = j < width  # past the width: none
        at = xp.where(there, j, 0)
        slots, ok = _take(xp, table, at), _take(xp, some, at) & there
        cols = j[:, None, :]
        mask = (masks.draft_sees_table(index, cols) & there[:, None, :] if draft
                else masks.sees_columns(index, cols))
        s = dataclasses.replace(state, m=carry[0], l=carry[1], acc=carry[2])
        s.add(read(kpool, slots, ok), read(vpool, slots, ok), mask)
        return s.m, s.l, s.acc

    tiles = -(-span // size)
    if tiles:
        # the first tile outside the loop: its carry then derives from the call's arrays, so
        # under shard_map it varies over the mesh as the loop's output does
        first = body(0, (state.m, state.l, state.acc))
        step = body if not hint else (lambda i, carry: lax.cond(
            i * size < rest, body, lambda i, carry: carry, i, carry))
        state.m, state.l, state.acc = lax.fori_loop(1, tiles, step, first)
    if share:
        state.merge(*_prefixes(call, state.q, table, share, read))
    if hint:
        state.merge(*_hinted(call, state.q, table, member, widths, read))
    if draft:
        from .tiles import draft

        state.add(*draft(index, call.k, call.v))
    return state.result(call.sinks)


def _offsets(batch: int, share: Share) -> list[int]:
    """Each lane's first column of its own: its group's width, 0 for a lane sharing none."""
    off = [0] * batch
    for lanes, width in share:
        for b in lanes:
            off[b] = width
    return off


def _take(xp: Any, a: Any, at: Any) -> Any:
    """``a[b, at[b]]`` of a lane-major ``a`` ``[batch, width]``: ``at`` ``[1, T]`` (every lane's
    same columns: one take) or ``[batch, T]``."""
    if int(at.shape[0]) == 1:
        return xp.take(a, at[0], axis=1)
    return xp.take_along_axis(a, at, axis=1)


def _prefixes(call: Any, q: Any, table: Any, share: Share, read: Any
              ) -> tuple[Any, Any, Any]:
    """Every lane's state ``(m, l, acc)`` over its shared prefix, ``[batch, kv, g, seq, ...]``
    (:func:`_prefix`, once per group), placed at its lanes by :func:`.shared.lanes_states`."""
    xp = call.index.backend.xp
    return lanes_states(
        call, q, share, lambda lanes, width: _prefix(call, q, table[lanes[0], :width], lanes,
                                                     read), xp.asarray)


def _prefix(call: Any, q: Any, row: Any, lanes: tuple[int, ...], read: Any
            ) -> tuple[Any, Any, Any]:
    """The states ``(m, l, acc)`` ``[len(lanes), kv, g, seq, ...]`` of ``lanes`` over their
    shared prefix, the slots ``row`` (each of them names those at its first columns, and every
    one of their queries sees every column: :func:`sharing`), read once: the lanes' queries
    ``q`` (grouped) stacked as one lane's heads, ``[1, kv, lanes x g, seq, d]``, a gather of
    ``[1, T]`` slots a tile, in a loop of its own and with no mask."""
    from jax import lax

    from . import tile_size

    index = call.index
    xp = index.backend.xp
    _, kv, g, seq, d = q.shape
    n = len(lanes)
    stacked = xp.permute_dims(xp.take(q, xp.asarray(np.asarray(lanes)), axis=0), (1, 0, 2, 3, 4))
    state = Online(xp, "lane", xp.reshape(stacked, (1, kv, n * g, seq, d)),
                   int(call.vpool.shape[-1]), call.softcap, call.q.dtype)
    state.split = False  # one product: XLA lays out the tile as it likes
    width = int(row.shape[0])
    size = min(call.tile or tile_size(1, seq, n * kv * g), width)

    def fold(carry: tuple, c0: Any, t: int) -> tuple:
        slots = xp.take(row, c0 + masks.arange(index, t))[None, :]
        ok = xp.ones(slots.shape, dtype=xp.bool)
        s = dataclasses.replace(state, m=carry[0], l=carry[1], acc=carry[2])
        s.add(read(call.kpool, slots, ok), read(call.vpool, slots, ok), None)
        return s.m, s.l, s.acc

    full, rest = divmod(width, size)  # width >= size: one whole tile at least
    got = fold((None, None, None), 0, size)  # outside the loop, as the lanes' first tile
    got = lax.fori_loop(1, full, lambda i, carry: fold(carry, i * size, size), got)
    if rest:
        got = fold(got, full * size, rest)
    return tuple(xp.permute_dims(xp.reshape(x, (kv, n, g, seq, int(x.shape[-1]))),
                                 (1, 0, 2, 3, 4)) for x in got)


def _hinted(call: Any, q: Any, table: Any, member: Any, widths: Any, read: Any
            ) -> tuple[Any, Any, Any]:
    """Every lane's state ``(m, l, acc)`` over the prefix of the hint's group it holds to
    (:func:`.shared.held`'s ``member`` and ``widths``, values), ``[batch, kv, g, seq, ...]``,
    the state of no column for a lane that holds to none. Each group's prefix is read once, a
    tile of its first member's slots at a time against every lane's queries stacked as one
    lane's heads (a lane outside the group weighs them, and its state is dropped: the group's
    members are values, the queries' shape is not), tiles past its width skipped
    (``lax.cond``). One note a group, as it is traced (:func:`.shared.note`: ``((), g)``, its
    lanes and width being the program's values)."""
    from jax import lax

    from . import tile_size

    index = call.index
    xp = index.backend.xp
    batch, kv, g, seq, d = q.shape
    width = int(table.shape[1])
    stacked = xp.reshape(xp.permute_dims(q, (1, 0, 2, 3, 4)), (1, kv, batch * g, seq, d))
    state = Online(xp, "lane", stacked, int(call.vpool.shape[-1]), call.softcap, call.q.dtype)
    state.split = False  # one product: XLA lays out the tile as it likes
    state.masked = True  # a tile past a group's width sees nothing
    size = min(call.tile or tile_size(1, seq, batch * kv * g), width)
    tiles = -(-width // size)
    dv = int(call.vpool.shape[-1])
    got = (xp.full((batch, kv, g, seq, 1), -xp.inf, dtype=q.dtype),
           xp.zeros((batch, kv, g, seq, 1), dtype=q.dtype),
           xp.zeros((batch, kv, g, seq, dv), dtype=q.dtype))
    for group in range(int(widths.shape[0])):
        lead = xp.argmax(xp.astype(member[group], xp.int8))
        row = xp.reshape(xp.take(table, xp.reshape(lead, (1,)), axis=0), (width,))
        w = widths[group]

        def fold(i: Any, carry: tuple, row: Any = row, w: Any = w) -> tuple:
            j = i * size + masks.arange(index, size)
            at = xp.where(j < width, j, 0)
            ok = (j < w)[None, :]
            slots = xp.take(row, at)[None, :]
            s = dataclasses.replace(state, m=carry[0], l=carry[1], acc=carry[2])
            s.add(read(call.kpool, slots, ok), read(call.vpool, slots, ok),
                  xp.broadcast_to(ok[:, None, :], (1, seq, size)))
            return s.m, s.l, s.acc

        carry = fold(0, (None, None, None))  # outside the loop, as the lanes' first tile
        carry = lax.fori_loop(1, tiles, lambda i, c, fold=fold, w=w: lax.cond(
            i * size < w, fold, lambda i, c: c, i, c), carry)
        mine = member[group][:, None, None, None, None]
        got = tuple(xp.where(mine, xp.permute_dims(
            xp.reshape(x, (kv, batch, g, seq, int(x.shape[-1]))), (1, 0, 2, 3, 4)), have)
            for x, have in zip(carry, got, strict=True))
        note((), group)
    return got


@cache
def _jitted(donate: bool) -> Any:
    """A whole call as one program, donating the pools when the call does; ``share`` (the
    groups reading a prefix once, :func:`sharing`) is static: one compile per kind."""
    import jax

    from . import Call

    def run(index, q, k, v, kpool, vpool, sinks, *, scale, softcap, tile, share):
        call = Call(index, q, k, v, kpool, vpool, scale, softcap, sinks, tile, donate)
        return _traced(call, share, hinted=False)  # eager: its own groups, exact

    return jax.jit(run, static_argnames=("scale", "softcap", "tile", "share"),
                   donate_argnums=(4, 5) if donate else ())
