"""A decode step over paged pools on the CPU, in one call of the native kernel: each lane's
pages read in their table's order, whatever it is, at the speed of a contiguous run
(attention's laws 2 to 6, by the same online softmax; :mod:`cacheidx.attention`).

A paged lane's pages each hold a few columns (16 slots), in any order a server's allocator
leaves them. The core reads a lane's runs of slots as views, each its own product, and its
short runs gathered into a tile (:mod:`.runs`): a product per page, or a copy. The kernel of
:func:`~cacheidx.attention.native.paged` walks the table itself instead: for every lane and kv
head (split over the caller's threads: torch's intra-op threads for tensors), each seen column's
slot is read from the lane's row of the table, its key and value rows read where they lie
(float32, float16, bfloat16, or 8- and 4-bit codes with their scales, cast in registers), and
weighed by the online softmax of :class:`~cacheidx.attention.softmax.Online`; the states it
returns are normalised by ``Online``'s own code (sinks, queries that weigh nothing). Only the
order of the sums differs from the core's, as the tiles' does (docs/attention.md derives the
tolerance); the kernel's sums are in one order on every machine.

It computes a call where all of these hold, and leaves every other to the core, before
storing anything: NumPy arrays or CPU tensors, no gradient asked (torch's grad mode on and an
input requiring grad: the kernel has no backward), a tabled index without a selection or a
draft, one token a lane (a decode step; GQA's grouped heads are its rows, at most
:data:`~cacheidx.attention.native.ROWS` a kv head), no softcap, pools the kernel reads. After
the stores it needs the plan (:func:`plan`): each lane's seen columns one range ``start:stop``
(a window's too) whose slots all lie inside the pools (no hole, nothing dropped); and, where
shared prefixes are read once (:func:`~.runs.shares`), no group of lanes sharing one
(:func:`~.runs.prefixes`: the core reads those once for the group). Where the kernel refuses
the values (a query not finite, a score NaN or ``+inf``, a value or scale not finite), the
core weighs the call as its laws say.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import numpy as np

from .. import masks, pools
from .. import plan as plans
from ..laws import inside
from . import native, runs
from .softmax import Online, group

__all__ = ["Plan", "applies", "attend", "plan", "read"]


class Plan(NamedTuple):
    """What the kernel reads of one index over pools of ``n`` slots: each lane's row of the
    table ``[batch, width]`` (int64, the host's copy) and its seen columns
    ``start[b]:stop[b]``."""

    table: np.ndarray
    start: np.ndarray
    stop: np.ndarray


def applies(call: Any) -> bool:
    """Whether the kernel may compute ``call`` (the module's first list, before the stores)."""
    index, q = call.index, call.q
    if (index.kind != "tabled" or index.seq != 1 or index.columns is not None
            or index.draft_slots is not None or call.softcap is not None
            or index.backend.tracing(index.pos)):
        return False
    if not all("paged" in pools.kind(pool).kernel for pool in (call.kpool, call.vpool)):
        return False  # the kinds the kernel's paged entry reads
    arrays = [q, call.k, call.v, *pools.parts(call.kpool), *pools.parts(call.vpool)]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(q, torch.Tensor):
        if any(a.device.type != "cpu" for a in arrays):
            return False
        if native.grad_asked(*arrays, call.sinks):
            return False  # no backward of its own: autograd follows the core's products
    elif not all(isinstance(a, np.ndarray) for a in arrays):
        return False
    kv = int(call.kpool.shape[1])
    return int(q.shape[2]) // kv <= native.ROWS and native.kernel() is not None


def attend(call: Any) -> tuple[Any, Any, Any] | None:
    """``(out, kpool', vpool')`` of ``call`` with the kernel reading its pools where it
    :func:`applies` (the core's stores first, and the core's reads where the plan or the
    values refuse the kernel); ``None`` where it does not apply (nothing stored)."""
    if not applies(call):
        return None
    from . import SCORES, standard, stored

    plans.follow(call.index)
    call = stored(call)
    out = read(call)
    if out is None:
        out = runs.read(call, SCORES)
    if out is None:
        out = standard(call)
    return out, call.kpool, call.vpool


def plan(index: Any, n: int, heads: int, share: bool) -> Plan | None:
    """The kernel's :class:`Plan` of ``index`` (one token a lane) over pools of ``n`` slots,
    or ``None`` where some lane's seen columns are not one range of slots inside the pool,
    or (``share``) some lanes share a prefix the core reads once. Made on the host from its
    copy of the index (:func:`cacheidx.plan.host`), once for every layer."""
    on_host = plans.host(index)
    table = np.ascontiguousarray(masks.lane_table(on_host), dtype=np.int64)
    some = np.asarray(masks.seen_by_some(on_host), dtype=bool)
    count = some.sum(axis=1)
    start = np.where(count > 0, np.argmax(some, axis=1), 0).astype(np.int64)
    stop = start + count
    cols = np.arange(some.shape[1])[None, :]
    if not np.array_equal(some, (cols >= start[:, None]) & (cols < stop[:, None])):
        return None  # a lane's seen columns with a gap
    if not np.all(inside(table, n) | ~some):
        return None  # a hole or a dropped slot: the tiles read it as zero
    if share and runs.prefixes(table, some, on_host.mask(), n, index.seq, heads, 1 << 22,
                               None):
        return None
    return Plan(table, start, stop)


def carry(index: Any, nxt: Any, key: tuple, part: Any) -> Plan | None:
    """The plan of ``nxt = index.advance()`` from ``index``'s, where it follows: a decode step
    after a decode step (one token a lane, no window, positions not blocks), each lane's new
    column the one after its last, its slot inside the pool, a padding lane still reading
    nothing. ``None`` (made anew) wherever that is not so. A refusal (``()``: a lane's gap or
    hole, a shared prefix) is carried as it is: over the old columns, kept by the new table,
    it still holds."""
    n = key[0]
    if index.seq != 1 or nxt.seq != 1 or index.block != 1 or index.window_size is not None:
        return None
    if not part:
        return part
    on_host, old = plans.host(nxt), plans.host(index)
    if on_host.table is old.table and on_host.row is old.row:  # the host's same values
        table = part.table  # a step over the same table: no pass over it (issue 36.2)
    else:
        table = np.ascontiguousarray(masks.lane_table(on_host), dtype=np.int64)
    pos, valid = np.asarray(on_host.pos)[:, 0], np.asarray(masks.valid(on_host))[:, 0]
    start, stop = part.start, part.stop
    if np.any(stop[~valid] != start[~valid]) or not np.array_equal(pos[valid], stop[valid]):
        return None
    if np.any(pos[valid] >= table.shape[1]) or not np.all(inside(table[valid, pos[valid]], n)):
        return None
    return Plan(table, start.copy(), stop + valid)


plans.CARRY["paged"] = carry


def read(call: Any) -> Any | None:
    """``call``'s output (its pools holding its stores) through the kernel, or ``None`` where
    the plan or the kernel refuses it."""
    index, xp, q = call.index, call.index.backend.xp, call.q
    n = int(call.kpool.shape[0])
    if int(call.vpool.shape[0]) != n:
        return None
    heads, share = int(q.shape[2]), runs.shares()
    found = plans.planned(index, "paged", (n, heads, share),
                          lambda: plan(index, n, heads, share) or ())
    if not found:
        return None
    kv, dv = int(call.kpool.shape[1]), int(call.vpool.shape[-1])
    grouped = group(xp, q, "lane", kv, call.scale)  # [batch, kv, g, 1, d]
    b, _, g, _, d = grouped.shape
    got = native.paged(xp.reshape(grouped, (b, kv, g, d)), found.table, found.start,
                       found.stop, call.kpool, call.vpool)
    if got is None:
        return None
    m, l, acc = got
    state = Online(xp, "lane", grouped, dv, None, q.dtype)
    state.merge(xp.reshape(m, (b, kv, g, 1, 1)), xp.reshape(l, (b, kv, g, 1, 1)),
                xp.reshape(acc, (b, kv, g, 1, dv)))
    state.masked = True  # a lane may weigh no column: its l is zero, selected around
    return state.result(call.sinks)
