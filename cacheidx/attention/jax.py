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
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

from ..laws import inside
from ..quantized import Quantized
from .softmax import Online

__all__ = ["JaxPath"]


class JaxPath:
    def attend(self, call: Any) -> tuple[Any, Any, Any]:
        from . import standard, stored

        index = call.index
        if not index.backend.tracing(index.pos):
            return _jitted(call.donate)(index, call.q, call.k, call.v, call.kpool, call.vpool,
                                        call.sinks, scale=call.scale, softcap=call.softcap,
                                        tile=call.tile)
        call = stored(call)
        if index.kind != "tabled" or index.columns is not None:
            return standard(call), call.kpool, call.vpool
        return _looped(call), call.kpool, call.vpool


def _looped(call: Any) -> Any:
    """The output of a traced call over a table (its pools holding its stores)."""
    from jax import lax

    index = call.index
    xp, kpool, vpool = index.xp, call.kpool, call.vpool
    table, some = index.lane_table, index.seen_by_some()
    width = int(table.shape[1])
    size = min(call.tile_width, width)
    draft = index.draft_slots is not None
    state = Online.start(xp, call.q, "lane", int(vpool.shape[-1]), int(kpool.shape[1]),
                         scale=call.scale, softcap=call.softcap)
    state.masked = True  # every tile comes with its mask: each loop step's state is a copy
    state.split = False  # one product: XLA lays out the tile as it likes

    def read(pool: Any, slots: Any, ok: Any) -> Any:
        if isinstance(pool, Quantized):  # its codes and scales, each so
            return pool.map(lambda part: read(part, slots, ok))
        got = index.backend.gather(pool, xp.reshape(slots, (-1,)),
                                   xp.reshape(ok & inside(slots, pool.shape[0]), (-1,)))
        return xp.reshape(got, (*slots.shape, *pool.shape[1:]))

    def body(i: Any, carry: tuple) -> tuple:
        j = i * size + index.arange(size)  # this tile's columns; past the width: none
        there = j < width
        at = xp.where(there, j, 0)
        slots = xp.take(table, at, axis=1)
        ok = xp.take(some, at, axis=1) & there[None, :]
        cols = j[None, None, :]
        mask = index.draft_sees_table(cols) & there if draft else index.sees_columns(cols)
        s = dataclasses.replace(state, m=carry[0], l=carry[1], acc=carry[2])
        s.add(read(kpool, slots, ok), read(vpool, slots, ok), mask)
        return s.m, s.l, s.acc

    # the first tile outside the loop: its carry then derives from the call's arrays, so under
    # shard_map it varies over the mesh as the loop's output does
    first = body(0, (state.m, state.l, state.acc))
    state.m, state.l, state.acc = lax.fori_loop(1, -(-width // size), body, first)
    if draft:
        from .tiles import draft

        state.add(*draft(index, call.k, call.v))
    return state.result(call.sinks)


@cache
def _jitted(donate: bool) -> Any:
    """A whole call as one program, donating the pools when the call does."""
    import jax

    from . import Call

    def run(index, q, k, v, kpool, vpool, sinks, *, scale, softcap, tile):
        call = Call(index, q, k, v, kpool, vpool, scale, softcap, sinks, tile, donate)
        return JaxPath().attend(call)

    return jax.jit(run, static_argnames=("scale", "softcap", "tile"),
                   donate_argnums=(4, 5) if donate else ())
