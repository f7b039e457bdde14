"""Shared prefixes read once where the standard's tiles read an eager call, and the record of
every prefix read once, on every path (attention's law 2 all the same: only the order of the
sums changes).

Where the runs do not read an eager call (a hole, a lane's own columns on scattered pages, a
draft, pools of two sizes: :mod:`.runs`), the tiles still read a prefix several lanes share
once for all of them: the host finds the groups by the runs' rules (:func:`~.runplan.prefixes`:
lanes whose tables name the same slots from column 0, every query of each seeing every one of
those columns; as a gather, a prefix of scattered pages too), and each group's prefix is read a
tile at a time against all its lanes' queries stacked as one lane's heads (Hydragen's and
FlashInfer's cascade). Each lane's state over its prefix is merged into the state over its own
columns (:meth:`~.softmax.Online.merge`, exact), which the tiles read from its group's width on
(:func:`.tiles.read`'s ``offsets``). The groups are part of the index's plan, found once for
every layer.

Traced (a compiled step's standard tiles: torch under autograd or on a GPU, JAX's selections, a
step the user jits whole) there are no values to find groups in: each lane reads its prefix as
its own, the law the same, unless the index carries a **hint** (:func:`share`,
``index.share(groups)``): the groups the host found before the program, as values (each
lane's group, -1 for none, and each group's width, ``groups`` of them, the one static number).
A program traced whole (JAX's table loop, :mod:`.jax`) reads each group's prefix once for the
lanes that hold to it, and checks that they do (:func:`held`): a lane whose table or mask
does not keep its group's columns reads its prefix as its own, so law 2 holds for every value
of a hint, a stale one included; a hint decides only what is read once. One program serves
every value of the hint, as of positions and tables.

Every path that reads a prefix once for the lanes sharing it says so (:func:`note`): the runs'
views and gathered tiles, JAX's eager program and the tiles here. Within :func:`counted` the
prefixes read are recorded, as ``(lanes, width)``: what the conformance law and the tests
count.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import _arguments as arguments
from .. import masks, pytree
from .. import plan as plans
from ..laws import inside
from . import runplan
from .softmax import Online
from .tiles import rows

__all__ = ["carry", "counted", "groups", "held", "note", "offsets", "prefix", "share",
           "states"]

#: groups of lanes sharing a prefix: ``((lanes, width), ...)``
Share = tuple[tuple[tuple[int, ...], int], ...]

_COUNTING = threading.local()  # this thread's open records, innermost last


@contextlib.contextmanager
def counted() -> Iterator[list[tuple[tuple[int, ...], int]]]:
    """Within it (in this thread), every prefix a call reads once for the lanes sharing it,
    appended to the list it yields as ``(lanes, width)``, one entry a read."""
    record: list[tuple[tuple[int, ...], int]] = []
    stack = _COUNTING.__dict__.setdefault("stack", [])
    stack.append(record)
    try:
        yield record
    finally:
        stack.remove(record)


def note(lanes: tuple[int, ...], width: int) -> None:
    """A path read the prefix ``0:width`` of ``lanes`` once for all of them: recorded in
    every open :func:`counted` of this thread."""
    for record in getattr(_COUNTING, "stack", ()):
        record.append((tuple(int(b) for b in lanes), int(width)))


def groups(call: Any) -> Share:
    """The groups whose prefix the tiles read once for the eager ``call`` (its pools of one
    size): each group's lanes and its columns ``0:width``, kept by the index's plan. None for
    a traced call, within ``runs.unshared()``, for a selection or a whole index, or a call of
    more than :data:`~.runplan.ROWS` tokens a lane (a long prefill: as the runs')."""
    index, kpool, vpool = call.index, call.kpool, call.vpool
    n = int(kpool.shape[0])
    if (index.backend.tracing(index.pos) or not runplan.shares() or index.kind != "tabled"
            or index.columns is not None or int(vpool.shape[0]) != n
            or index.seq > runplan.ROWS):
        return ()
    heads = int(call.q.shape[2])
    return plans.planned(index, "shared", (n, heads), lambda: _find(index, n, heads))


def _find(index: Any, n: int, heads: int) -> Share:
    """:func:`groups`' work, on the host's values (nothing read from the device)."""
    from . import SCORES

    on_host = plans.host(index)
    table = masks.lane_table(on_host)
    width = int(table.shape[1])
    if index.batch * index.seq * width > runplan.WHOLE:
        return ()  # as the runs' plan: the host never holds a larger mask
    whole = on_host.mask()[:, :, :width]  # the table's columns (a draft's own come after)
    found = runplan.prefixes(table, masks.seen_by_some(on_host), whole, n, index.seq, heads,
                             SCORES, None, views=False)
    return tuple((g.lanes, g.width) for g in found)


def share(index: Any, groups: int = 1) -> Any:
    """``index`` with a hint of the (at most) ``groups`` groups of lanes sharing a prefix that
    read the most columns once (lanes times width), found on the host's values by the runs'
    rules (:func:`~.runplan.prefixes`, for pools of any size): each lane's group ``[batch]``
    (-1: none) and each group's width ``[groups]`` (0 where fewer are found), in the index's
    integer dtype on its device. ``groups=0``: the index without a hint. Any hint it had is
    replaced. A call of more than :data:`~.runplan.ROWS` tokens a lane, a selection, a table
    whose mask the host would not hold, or a call within ``runs.unshared()`` finds none (widths
    0: a program reads nothing once, whenever it was traced). The derived indices and
    ``advance()`` keep the hint (each program checks it: :func:`held`).

    Raises ``ValueError`` naming ``share`` on a whole or packed index, a traced one (make the
    hint before the program, where the values are) or ``groups`` below 0."""
    fn = "share"
    groups = arguments.integer(fn, "groups", groups, least=0)
    if index.kind != "tabled":
        raise arguments.fail(fn, f"a {index.kind} index has no table to share")
    if index.backend.tracing(index.pos):
        raise arguments.fail(fn, "a traced index has no values to find groups in: share it "
                             "before the program")
    tensors = pytree.leaves(index)[:len(pytree.leaves(index)) - 2 * index.structure.shared]
    if not groups:
        return pytree.rebuild(index.structure._replace(shared=0), tensors,
                              backend=index.backend)
    on_host = plans.host(index)
    table = masks.lane_table(on_host)
    width = int(table.shape[1])
    found: list = []
    if (runplan.shares() and index.columns is None and index.seq <= runplan.ROWS
            and index.batch * index.seq * width <= runplan.WHOLE):
        whole = on_host.mask()[:, :, :width]
        found = runplan.prefixes(table, masks.seen_by_some(on_host), whole,
                                 np.iinfo(np.int64).max, index.seq, 1, 1 << 22, None,
                                 views=False)
    found = sorted(found, key=lambda g: -len(g.lanes) * g.width)[:groups]
    lanes, widths = np.full(index.batch, -1, np.int64), np.zeros(groups, np.int64)
    for g, group in enumerate(found):
        lanes[list(group.lanes)], widths[g] = g, group.width
    backend, dtype = index.backend, index.pos.dtype
    device = backend.device(index.pos)
    nxt = pytree.rebuild(index.structure._replace(shared=groups),
                         [*tensors, backend.from_host(lanes, dtype, device),
                          backend.from_host(widths, dtype, device)], backend=backend)
    held_on_host = pytree.leaves(on_host)
    # the host's values of every tensor, the hint's as made here: nothing read back later
    plans.refilled(nxt, [*held_on_host[:len(tensors)], lanes, widths])
    return nxt


def held(index: Any, n: int) -> tuple[Any, Any]:
    """Of an index with a hint (:func:`share`), over pools of ``n`` slots, in the index's
    library (a traced program's own arrays): ``(member, widths)``, ``member`` ``[groups,
    batch]``, whether lane ``b`` reads group ``g``'s prefix once, and ``widths`` ``[groups]``,
    each group's width (clipped to the table's), 0 where no lane holds to it. Lane ``b`` holds
    to group ``g`` where its hint names ``g``, and at every column below the width it names
    the slot the group's first lane names there, inside the pool, and every one of its queries
    sees the column: the runs' rule, so a lane that holds reads the very columns it would read
    as its own. Costs ``O(groups * batch * width)`` and one ``[batch, seq, width]`` mask."""
    xp = index.backend.xp
    table = masks.lane_table(index)
    width = int(table.shape[1])
    cols = masks.arange(index, width)
    mask = (masks.draft_sees_table(index, cols[None, None, :]) if index.draft_slots is not None
            else masks.sees_columns(index, cols[None, None, :]))
    seen = xp.all(mask, axis=1) & masks.seen_by_some(index) & inside(table, n)
    members, widths = [], []
    for g in range(int(index.share_widths.shape[0])):
        mine = index.share_lanes == g
        w = xp.clip(index.share_widths[g], 0, width)
        lead = xp.argmax(xp.astype(mine, xp.int8))
        same = (table == xp.take(table, xp.reshape(lead, (1,)), axis=0)) & seen
        ok = mine & xp.all((cols[None, :] >= w) | same, axis=1)
        members.append(ok)
        widths.append(xp.where(xp.any(ok), w, xp.zeros_like(w)))
    return xp.stack(members), xp.stack(widths)


def offsets(batch: int, share: Share) -> tuple[int, ...]:
    """Each lane's first column of its own: its group's width, 0 for a lane sharing none."""
    off = [0] * batch
    for lanes, width in share:
        for b in lanes:
            off[b] = width
    return tuple(off)


def states(call: Any, q: Any, share: Share) -> tuple[Any, Any, Any]:
    """Every lane's state ``(m, l, acc)`` over its shared prefix, ``[batch, kv, g, seq, ...]``
    (``q``: the call's queries grouped, :func:`~.softmax.group`), each group's read once
    (:func:`prefix`), as :func:`lanes_states` places them."""
    backend = call.index.backend
    device = backend.device(call.index.pos)
    return lanes_states(
        call, q, share, lambda lanes, width: prefix(call, q, lanes, width),
        lambda where: backend.from_host(where, call.index.pos.dtype, device))


def lanes_states(call: Any, q: Any, share: Share, read: Any, rows: Any
                 ) -> tuple[Any, Any, Any]:
    """Each group's states ``read(lanes, width)`` (``[len(lanes), kv, g, seq, ...]``, read
    once) placed at its lanes, ``[batch, kv, g, seq, ...]``: a lane sharing none gets the
    state of no column (``-inf``, 0, 0), which a merge leaves exactly as it was. ``rows``
    makes the library's index array of a host one (the caller's: an eager call places it on
    the pool's device, a traced program takes it as a constant)."""
    xp = call.index.backend.xp
    batch, kv, g, seq, _ = q.shape
    dv = int(call.vpool.shape[-1])
    none = (xp.full((1, kv, g, seq, 1), -xp.inf, dtype=q.dtype),
            xp.zeros((1, kv, g, seq, 1), dtype=q.dtype),
            xp.zeros((1, kv, g, seq, dv), dtype=q.dtype))
    parts, where, at = [none], [0] * batch, 1  # lane b's state: row where[b] of the parts
    for lanes, width in share:
        parts.append(read(lanes, width))
        for b in lanes:
            where[b], at = at, at + 1
    taken = rows(np.asarray(where))
    return tuple(xp.take(xp.concat([p[k] for p in parts], axis=0), taken, axis=0)
                 for k in range(3))


def prefix(call: Any, q: Any, lanes: tuple[int, ...], width: int) -> tuple[Any, Any, Any]:
    """The states ``(m, l, acc)`` ``[len(lanes), kv, g, seq, ...]`` of ``lanes`` over their
    shared columns ``0:width``, read once: their queries ``q`` (grouped) stacked as one lane's
    heads, ``[1, kv, lanes x g, seq, d]``, each tile's keys and values ``[1, T, ...]`` through
    a read plan the index keeps, with no mask (every query sees every column)."""
    from . import tile_size

    index = call.index
    xp, backend = index.backend.xp, index.backend
    _, kv, g, seq, d = q.shape
    count = len(lanes)
    stacked = xp.concat([q[b:b + 1, ...] for b in lanes], axis=0)
    stacked = xp.reshape(xp.permute_dims(stacked, (1, 0, 2, 3, 4)), (1, kv, count * g, seq, d))
    state = Online(xp, "lane", stacked, int(call.vpool.shape[-1]), call.softcap, call.q.dtype,
                   host=backend.on_host(call.q))
    slots = plans.host(index)
    slots = masks.lane_table(slots)[lanes[0], :width]
    size = min(call.tile or tile_size(1, seq, count * kv * g), width)
    device = backend.device(index.pos)
    for c0 in range(0, width, size):
        c1 = min(width, c0 + size)
        shape = (1, c1 - c0)
        reads = [plans.planned(index, "tile", ("prefix", lanes, c0, c1, int(pool.shape[0])),
                               lambda pool=pool, c0=c0, c1=c1: backend.read_plan(
                                   backend.from_host(slots[c0:c1], index.pos.dtype, device),
                                   backend.from_host(np.ones(c1 - c0, bool), xp.bool, device),
                                   int(pool.shape[0])))
                 for pool in (call.kpool, call.vpool)]
        state.add(rows(index, call.kpool, reads[0], shape),
                  rows(index, call.vpool, reads[1], shape), None)
    note(lanes, width)
    return tuple(xp.permute_dims(xp.reshape(x, (kv, count, g, seq, int(x.shape[-1]))),
                                 (1, 0, 2, 3, 4)) for x in (state.m, state.l, state.acc))


def carry(index: Any, nxt: Any, key: tuple, share: Share) -> Share | None:
    """The groups of ``nxt = index.advance()`` (over the same table, or one that keeps its
    columns: :meth:`~cacheidx.plan.Plan.advanced` makes sure) from ``index``'s, where they
    follow: a decode step after a decode step (one token a lane, no window, positions not
    blocks), every lane of a group still past its prefix. Each group then holds as it was: its
    lanes name the same slots at its columns, and each lane's one token sees every column below
    it. A lane that joins none stays out (it reads its prefix as its own, the law the same).
    ``None`` (found anew) wherever that is not so. The tiles' groups and JAX's program's
    (:mod:`.jax`) follow alike."""
    if (index.seq != 1 or nxt.seq != 1 or index.block != 1 or index.window_size is not None
            or index.columns is not None):
        return None
    if not share:
        return share
    on_host = plans.host(nxt)
    pos, valid = on_host.pos[:, 0], masks.valid(on_host)[:, 0]
    if all(valid[b] and pos[b] >= width for lanes, width in share for b in lanes):
        return share
    return None


plans.CARRY["shared"] = carry
