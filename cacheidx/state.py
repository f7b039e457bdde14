"""State beside keys and values: a recurrent layer's running state and its snapshots, under the
index its attention layers read.

A recurrent layer (a short convolution's window, a state-space or delta-rule state matrix)
keeps, per sequence, one state that each token updates. Under an index it keeps it in two
pools of one row shape and dtype, :class:`Pools`:

- ``running``: one slot per row of the table (lane ``b`` without a row map): slot ``r`` holds
  the state after the greatest position sequence ``r`` was fed.
- ``snapshots``: a pool read in blocks of ``m`` positions (the spec's ``every m``): the slot
  the table of blocks of ``m`` names at block ``j`` holds the state after position
  ``j*m + m - 1``, the block's closing token, which stores it. A snapshot is the entry of a
  layer "that keeps one entry per block", so it shares the index, its tables of blocks and the
  prefix cache's pages with every other pool. A pool of 0 slots keeps none.

The ``m`` is the index's: ``index.every(m)``'s where the index reads blocks, else the ``m`` of
its one table of blocks (an engine's index names one for its snapshots), else none (the
index reads positions and has no table of blocks: no snapshots are read or stored).

Laws, for lane ``b`` of row ``r`` whose valid tokens hold positions ``p0`` to ``p1``:

1. **Start** (:func:`start`). A lane starts from zero when ``p0`` is 0, when it has no valid
   token, and on a whole or packed index (nothing is read). Otherwise it starts from the
   snapshot its table of blocks names at block ``p0 / m - 1`` where ``p0`` is a multiple of
   ``m`` and that slot is inside the snapshot pool (a prefix hit, a fork: the sequence names
   a block another one closed), else from its running slot ``r`` (zero where ``r`` addresses
   no slot). Where both hold the state after ``p0 - 1`` they hold the same values, so which
   one is read never changes a result.
2. **Store** (:func:`store`). The running slot ``r`` gets the state after ``p1``, and the
   slot of each block the call closes (``p0 <= j*m + m - 1 <= p1``) the state after its
   closing token; every other slot is as it was. Padding stores nothing (a lane of padding,
   a row of -1 or outside the table), a slot that addresses nothing (-1, outside the pool)
   drops its store, and a whole or packed index stores nothing. The snapshots stored are
   ``index.every(m).extend(states, snapshots)``'s, ``states`` the state after every token.
3. **Order.** A lane's valid tokens hold consecutive positions in the call's order (a chunk
   of its sequence; padding anywhere else), and a table row is named by one lane of a call:
   obligations on the caller, as distinct write targets are. A draft and a selection are no
   chunk: both raise.
4. **Closing tokens** (:func:`closing`). The tokens of a lane that close a block, in order:
   at most ``ceil(seq / m)`` of them, whatever the positions, so the shape is static.

5. **Copies** (:func:`copy`). An engine moves a state between a running slot and a snapshot
   where no call stores it: a junction kept at a page's end, a hit resumed there.

A model passes the index to its layers and nothing else: a recurrent layer calls
:func:`start`, computes, and :func:`store` s, as an attention layer calls ``extend``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _arguments as arguments
from . import masks
from . import plan as plans
from .laws import closes, inside

__all__ = ["Pools", "closing", "copy", "every", "start", "store", "zeros"]


class Pools(NamedTuple):
    """A recurrent layer's pools of one kind of state: ``running`` ``[rows, ...]`` and
    ``snapshots`` ``[slots, ...]`` (the same row shape and dtype; 0 slots keeps none). A named
    tuple, so every pytree, compiler and ``tree_map`` takes it as two arrays."""

    running: Any
    snapshots: Any


def zeros(rows: int, snapshots: int, shape: tuple[int, ...], *, dtype: Any = None,
          xp: Any = None, device: Any = None) -> Pools:
    """Zeroed pools of a state of ``shape``: ``rows`` running slots and ``snapshots``
    snapshot slots, in ``xp`` (a namespace or backend name, the default backend's without)."""
    from . import backends

    be = backends.get(xp) if xp is None or isinstance(xp, str) else backends.get(
        xp.zeros(1))
    xp = be.xp
    rows = arguments.integer("state.zeros", "rows", rows, least=0)
    snapshots = arguments.integer("state.zeros", "snapshots", snapshots, least=0)
    dtype = xp.float32 if dtype is None else dtype
    make = lambda n: xp.zeros((n, *shape), dtype=dtype, device=device)  # noqa: E731
    return Pools(make(rows), make(snapshots))


def every(index: Any) -> int:
    """The block size of the index's snapshots (see the module): 1 where it keeps none.
    Raises where the index reads positions and has several tables of blocks."""
    return _every("state.every", index)


def _every(fn: str, index: Any) -> int:
    if index.block != 1:
        return index.block
    if len(index.blocks) > 1:
        raise arguments.fail(fn, "the index has tables of blocks of "
                             f"{[m for m, _ in index.blocks]} positions: name the snapshots' "
                             "with index.every(m)")
    return index.blocks[0][0] if index.blocks else 1


def _checked(fn: str, index: Any) -> int:
    if index.draft_slots is not None:
        raise arguments.fail(fn, "a draft is no chunk of a sequence: a recurrent layer "
                             "computes its tokens in order (law 3)")
    if index.columns is not None:
        raise arguments.fail(fn, "the index selects columns: a recurrent layer reads every "
                             "token of its lane in order (law 3)")
    return _every(fn, index)


def _pools(fn: str, index: Any, pools: Any) -> Pools:
    if not (isinstance(pools, tuple) and len(pools) == 2):
        raise TypeError(f"cacheidx.{fn}: pools must be a state.Pools (running, snapshots), got "
                        f"{type(pools).__name__}")
    running, snaps = pools
    for name, p in (("running", running), ("snapshots", snaps)):
        if not index.backend.same_library(p):
            raise TypeError(f"cacheidx.{fn}: the {name} pool must be an array of the index's "
                            f"library ({index.backend.name}), got {type(p).__name__}")
        if p.ndim < 1:
            raise arguments.fail(fn, f"the {name} pool must have a slot axis, got a 0-d array")
    if tuple(running.shape[1:]) != tuple(snaps.shape[1:]):
        raise arguments.fail(fn, f"the running pool holds rows of {list(running.shape[1:])} "
                             f"but the snapshots rows of {list(snaps.shape[1:])}: one state, "
                             "one row")
    if running.dtype != snaps.dtype:
        raise TypeError(f"cacheidx.{fn}: the running pool holds {running.dtype} but the "
                        f"snapshots {snaps.dtype}: one state, one dtype")
    return Pools(running, snaps)


def _span(index: Any) -> tuple[Any, Any, Any]:
    """``(has, p0, p1)``, each ``[batch, 1]``: whether a lane has a valid token, its least
    position (the dtype's largest where none) and its greatest (-1 where none)."""
    xp = index.backend.xp
    valid = masks.valid(index)
    largest = int(xp.iinfo(index.pos.dtype).max)
    p0 = xp.min(xp.where(valid, index.pos, largest), axis=1, keepdims=True)
    return xp.any(valid, axis=1, keepdims=True), p0, xp.max(masks.valid_positions(index),
                                                            axis=1, keepdims=True)


def _one_call(index: Any, fn: Any, *args: Any, donate: tuple[int, ...] = (),
              static: tuple[int, ...] = ()) -> Any:
    """``fn(index, *args)`` as one program where the library compiles each eager operation
    apart (JAX: :meth:`Arrays.one_program <cacheidx.backends.Arrays.one_program>`, as the
    index's own calls run), ``fn`` itself elsewhere and wherever a value is traced (inside the
    caller's program). ``donate``: the positions in ``args`` given up to the program;
    ``static``: those of Python values, part of its key."""
    be = index.backend
    run = be.one_program(fn, donate_argnums=tuple(i + 1 for i in donate),
                         static_argnums=tuple(i + 1 for i in static))
    leaves = [a for x in args for a in (x if isinstance(x, tuple) else (x,)) if a is not None]
    if run is fn or any(be.tracing(a) for a in (index.pos, *leaves)):
        return fn(index, *args)
    return run(index, *args)


def _rows(index: Any) -> Any:
    """[batch]: each lane's row of the table (its running slot)."""
    return masks.arange(index, index.batch) if index.row is None else index.row


def _blocks(index: Any, m: int) -> Any:
    """[batch, width]: each lane's row of the table of blocks of ``m`` positions."""
    return masks.lane_table(index.every(m))


def _starts(index: Any, m: int, n_run: int, n_snap: int) -> tuple[Any, Any, Any, Any]:
    """Law 1's slots: ``(running slot, read it, snapshot slot, read it)``, each ``[batch]``."""
    xp = index.backend.xp
    has, p0, _ = _span(index)
    has, p0 = has[:, 0], p0[:, 0]
    later = has & (p0 > 0)
    run = _rows(index)
    snap = xp.full_like(run, -1)
    from_snap = xp.zeros_like(has)
    if m > 1 and n_snap > 0:
        aligned = later & (p0 % m == 0)
        table = _blocks(index, m)
        j = xp.where(aligned, p0 // m - 1, 0)
        aligned = aligned & (j < int(table.shape[1]))
        snap = masks.lane_lookup(index, table, j[:, None], aligned[:, None])[:, 0]
        from_snap = aligned & inside(snap, n_snap)
    from_run = later & ~from_snap & inside(run, n_run)
    return run, from_run, snap, from_snap


def start(index: Any, pools: Pools) -> Any:
    """``[batch, ...]``: the state each lane starts from (law 1). Raises on a draft or a
    selection, or where the pools are no :class:`Pools` of one row of the index's library."""
    _checked("state.start", index)
    running, snaps = _pools("state.start", index, pools)
    xp, be = index.backend.xp, index.backend
    if index.kind != "tabled":
        return xp.zeros((index.batch, *running.shape[1:]), dtype=running.dtype,
                        device=be.device(running))
    return _one_call(index, _start, Pools(running, snaps))


def _start(index: Any, pools: Pools) -> Any:
    xp, be = index.backend.xp, index.backend
    running, snaps = pools
    m = every(index)
    n_run, n_snap = int(running.shape[0]), int(snaps.shape[0])
    run, from_run, snap, from_snap = plans.planned(index,
        "state start", (m, n_run, n_snap), lambda: _starts(index, m, n_run, n_snap))
    got = be.gather(running, run, from_run)
    if m > 1 and n_snap > 0:
        gate = xp.reshape(from_snap, (index.batch,) + (1,) * (running.ndim - 1))
        got = xp.where(gate, be.gather(snaps, snap, from_snap), got)
    return got


def _closing(index: Any, m: int) -> tuple[Any, Any, Any]:
    """Law 4: ``(token, closes, position)`` of each lane's closing tokens, ``[batch, k]``."""
    xp, seq = index.backend.xp, index.seq
    has, p0, p1 = _span(index)
    first = xp.min(xp.where(masks.valid(index), masks.arange(index, seq)[None, :], seq), axis=1,
                   keepdims=True)
    k = -(-seq // m)
    c = masks.arange(index, k)[None, :]
    top = xp.where(has, p0, 0)
    t = (top // m) * m + (m - 1) + c * m
    at = first + (t - top)
    ok = has & (t <= p1) & (at < seq)
    return xp.where(ok, at, -1), ok, t


def closing(index: Any) -> tuple[Any, Any]:
    """``(tokens, ok)``, each ``[batch, ceil(seq / m)]``: the call's tokens of each lane that
    close a block of the index's ``m`` (law 4), in order, -1 and ``False`` past the last. A
    layer gathers its states after these tokens for :func:`store`. With no snapshots (``m``
    of 1) the shape is ``[batch, 0]``."""
    m = _checked("state.closing", index)
    xp = index.backend.xp
    if m == 1:
        none = xp.zeros((index.batch, 0), dtype=index.pos.dtype,
                        device=index.backend.device(index.pos))
        return none, none > 0
    return _one_call(index, _closed_by)


def _closed_by(index: Any) -> tuple[Any, Any]:
    m = every(index)
    at, ok, _ = plans.planned(index, "state closing", (m,), lambda: _closing(index, m))
    return at, ok


def _targets(index: Any, m: int, n_run: int, k: int | None) -> tuple[Any, Any]:
    """Law 2's targets: the running slot of each lane ``[batch]`` (-1 for none) and the
    snapshot slots ``[batch, k]`` of the closing tokens' blocks (``k`` None: of the block the
    last token closes, ``[batch, 1]``)."""
    xp = index.backend.xp
    has, _, p1 = _span(index)
    has = has[:, 0]
    run = xp.where(has & inside(_rows(index), n_run), _rows(index), -1)
    if m == 1:
        return run, None
    table = _blocks(index, m)
    width = int(table.shape[1])
    if k is None:
        t = p1
        ok = has[:, None] & closes(t, m)
    else:
        _, ok, t = _closing(index, m)
    col = xp.where(ok, t // m, 0)
    ok = ok & (col < width)
    return run, masks.lane_lookup(index, table, col, ok)


def store(index: Any, last: Any, pools: Pools, closed: Any = None, *,
          donate: bool = False) -> Pools:
    """The pools after the call (law 2): ``last`` ``[batch, ...]`` is each lane's state after
    its last token, ``closed`` ``[batch, k, ...]`` its states after the tokens
    :func:`closing` names (``None``: the call closes no block but at its last token, whose
    state is ``last``: a caller whose kernel gives final states alone cuts its chunks so).
    With ``donate`` the pools are given up and written in place where the library can.

    Raises on a draft or a selection, for pools that are no :class:`Pools` of one row of the
    index's library, or for states of another shape or dtype."""
    fn = "state.store"
    m = _checked(fn, index)
    running, snaps = _pools(fn, index, pools)
    row = tuple(running.shape[1:])
    for name, x, want in (("last", last, (index.batch, *row)),
                          ("closed", closed, (index.batch, -(-index.seq // m), *row))):
        if x is None or (name == "closed" and m == 1):
            continue
        if not index.backend.same_library(x):
            raise TypeError(f"cacheidx.{fn}: {name} must be an array of the index's library "
                            f"({index.backend.name}), got {type(x).__name__}")
        if tuple(x.shape) != want:
            raise arguments.fail(fn, f"{name} must have shape {list(want)}, got "
                                 f"{list(x.shape)}")
        if x.dtype != running.dtype:
            raise TypeError(f"cacheidx.{fn}: {name} is {x.dtype} but the pools hold "
                            f"{running.dtype}")
    if index.kind != "tabled":
        return Pools(running, snaps)
    if donate:
        for name, p in (("running", running), ("snapshots", snaps)):
            arguments.owned(fn, f"the {name} pool", p)
    return _one_call(index, _store, last, Pools(running, snaps), closed, bool(donate),
                     donate=(1,) if donate else (), static=(3,))


def _store(index: Any, last: Any, pools: Pools, closed: Any, donate: bool) -> Pools:
    xp, be = index.backend.xp, index.backend
    running, snaps = pools
    m, row = every(index), tuple(running.shape[1:])
    n_run, n_snap = int(running.shape[0]), int(snaps.shape[0])
    k = None if closed is None else -(-index.seq // m)
    run, snap = plans.planned(index, "state store", (m, n_run, k),
                              lambda: _targets(index, m, n_run, k))
    running = be.store(running, be.store_plan(run, n_run), last, donate=donate)
    if snap is not None and n_snap > 0:
        rows = xp.expand_dims(last, axis=1) if closed is None else closed
        rows = xp.reshape(rows, (-1, *row))
        snaps = be.store(snaps, be.store_plan(xp.reshape(snap, (-1,)), n_snap), rows,
                         donate=donate)
    return Pools(running, snaps)


def copy(pools: Pools, pairs: Any, *, into: str, donate: bool = False) -> Pools:
    """The pools after copying states between the running slots and the snapshots, for
    ``(row, slot)`` ``pairs``: ``into="snapshots"`` copies running slot ``row`` into snapshot
    ``slot`` (a junction kept after a call), ``into="running"`` snapshot ``slot`` into
    running slot ``row`` (a hit resumed before its first call). A slot or row that
    addresses nothing drops its copy; every other slot is as it was. With ``donate`` the
    pools are given up and written in place where the library can. Raises naming
    ``cacheidx.state.copy`` for another ``into`` or pools that are no :class:`Pools`."""
    import numpy as np

    from . import backends

    fn = "state.copy"
    if into not in ("snapshots", "running"):
        raise arguments.fail(fn, f"into must be 'snapshots' or 'running', got {into!r}")
    if not (isinstance(pools, tuple) and len(pools) == 2):
        raise TypeError(f"cacheidx.{fn}: pools must be a state.Pools (running, snapshots), got "
                        f"{type(pools).__name__}")
    running, snaps = pools
    pairs = np.asarray(list(pairs), dtype=np.int64).reshape(-1, 2)
    if not len(pairs):
        return Pools(running, snaps)
    be = backends.get(running)
    source, target = (running, snaps) if into == "snapshots" else (snaps, running)
    take, put = (pairs[:, 0], pairs[:, 1]) if into == "snapshots" else (pairs[:, 1], pairs[:, 0])
    device = be.device(running)
    at = be.from_host(take, None, device)
    ok = be.from_host((take >= 0) & (take < int(source.shape[0])), None, device)
    rows = be.gather(source, at, ok)
    target = be.scatter(target, be.from_host(put, None, device), rows, donate=donate)
    return Pools(running, target) if into == "snapshots" else Pools(target, snaps)
