"""The laws of state beside keys and values (:mod:`cacheidx.state`'s laws 1 to 4), each a small
concrete case a reader can check by hand.

The layer is a toy recurrence, ``s <- s/2 + x`` elementwise, one token at a time, whose
padding leaves ``s`` as it was (:func:`recur`). Its inputs are small integers, so every state
is a dyadic number float32 holds exactly: the state a chunk computes from a snapshot and the
one computed from scratch over the whole prefix (:func:`scratch`, by hand in NumPy) are equal
bit for bit, whatever order a compiler adds in. Pools start with NaN in every slot a law says
is never read, and keep it in every slot a law says is never written.

Every tabled case shares one structure and one shape (3 lanes of 4 tokens, a row map, a table
of blocks of :data:`M` positions, a running pool of :data:`ROWS` rows and a snapshot pool of
:data:`SLOTS`), so a compiled mode compiles :func:`recur` once for all of them; whole and
packed indices once more each.
"""

from __future__ import annotations

import numpy as np

from .. import build, masks, pytree, state
from .laws import index, same
from .suite import Case, law

nan = np.nan
M = 2  #: the block size of the snapshots
ROWS, CONTEXT, SLOTS, WIDTH = 4, 8, 6, 2  #: the table's rows and columns, snapshot slots, state


# -- the layer, run eagerly and compiled ----------------------------------------------------
def recur(index, x, pools):
    """One toy recurrent layer through the index: ``(first, states, pools')``, the state each
    lane starts from (law 1), the state after every token and the pools after
    :func:`state.store` (law 2)."""
    xp, be = index.backend.xp, index.backend
    first = s = state.start(index, pools)
    valid = masks.valid(index)
    states = []
    for i in range(index.seq):
        # padding keeps the state (its input may be NaN: where never reads the other branch)
        s = xp.where(valid[:, i:i + 1], s * 0.5 + x[:, i, ...], s)
        states.append(s)
    states = xp.stack(states, axis=1)
    tokens, ok = state.closing(index)
    k = int(tokens.shape[1])
    lane = masks.arange(index, index.batch)[:, None] * index.seq
    flat = xp.reshape(lane + xp.where(ok, tokens, 0), (-1,))
    closed = be.gather(xp.reshape(states, (-1, WIDTH)), flat, xp.reshape(ok, (-1,)))
    closed = xp.reshape(closed, (index.batch, k, WIDTH))
    return first, states, state.store(index, s, pools, closed)


def bare(index, last, pools):
    """What a layer reads and stores of a whole or packed index, ``(start, pools')``: both
    stay out of the compiled loop, which the tabled laws compile."""
    return state.start(index, pools), state.store(index, last, pools)


# -- the reference, by hand -----------------------------------------------------------------
def feed(x: list) -> list[np.ndarray]:
    """The state after each of a sequence's inputs ``x`` (from position 0), in float32."""
    s, out = np.zeros(WIDTH, np.float32), []
    for v in x:
        s = s * np.float32(0.5) + np.asarray(v, np.float32)
        out.append(s)
    return out


def token(r: int, p: int) -> list[float]:
    """Sequence ``r``'s input at position ``p``: small integers a reader can follow."""
    return [float(r + p + 1), float(r - p)]


def scratch(r: int, p: int, prefix: tuple[int, int] = (-1, 0)) -> np.ndarray:
    """The state of sequence ``r`` after position ``p``, from scratch; with ``prefix``
    ``(q, n)`` its positions below ``n`` are sequence ``q``'s (a fork, a prefix hit)."""
    q, n = prefix
    return feed([token(q if t < n else r, t) for t in range(p + 1)])[-1]


def inputs(pos, row, prefix: dict | None = None) -> np.ndarray:
    """The call's inputs ``[batch, seq, WIDTH]``: each lane's sequence's token at its
    position, NaN on padding (which the layer must never read)."""
    prefix = prefix or {}
    pos = np.asarray(pos)
    x = np.full((*pos.shape, WIDTH), nan, np.float32)
    for b, r in enumerate(row):
        for i, p in enumerate(pos[b]):
            if p >= 0 and 0 <= r < ROWS:
                q, n = prefix.get(r, (-1, 0))
                x[b, i] = token(q if p < n else r, p)
    return x


def pools(case: Case, running: dict, snapshots: dict) -> state.Pools:
    """Pools of NaN but for the slots named, which hold their value."""
    run = np.full((ROWS, WIDTH), nan, np.float32)
    snap = np.full((SLOTS, WIDTH), nan, np.float32)
    for pool, known in ((run, running), (snap, snapshots)):
        for s, v in known.items():
            pool[s] = v
    return state.Pools(case.array(run), case.array(snap))


def tabled(case: Case, pos, row, blocks, table=None):
    """The laws' one structure: a table of :data:`CONTEXT` columns (each row its own run
    unless given), a row map and a table of blocks of :data:`M` positions."""
    if table is None:
        table = np.arange(ROWS * CONTEXT).reshape(ROWS, CONTEXT)
    return index(case, pos, table, row=row, every=[(M, np.asarray(blocks))])


def run(case: Case, ix, x, before: state.Pools):
    """:func:`recur` through ``case.call``, and law 2's last sentence checked on its result:
    the snapshots stored are those ``every(M).extend`` stores of every state, on NumPy over the
    same index (the index laws hold extend equal on every backend)."""
    first, states, after = case.call(recur, ix, case.array(x), before)
    host = pytree.map(ix, case.numpy)
    _, want = host.every(M).extend(case.numpy(states), case.numpy(before.snapshots))
    same(case, after.snapshots, want, "snapshots against every(m).extend")
    return case.numpy(first), case.numpy(states), after


def expect(case: Case, after: state.Pools, running: dict, snapshots: dict) -> None:
    """Both pools hold exactly ``running`` and ``snapshots``, NaN everywhere else."""
    want = pools(case, running, snapshots)
    same(case, after.running, case.numpy(want.running), "running pool")
    same(case, after.snapshots, case.numpy(want.snapshots), "snapshot pool")


# -- law 2 and 4: the token closing a block stores its snapshot -----------------------------
@law
def law_a_snapshot_is_the_state_after_its_block_from_scratch(case: Case) -> None:
    """A block's snapshot is stored by the token that closes it, and equals the state computed
    from scratch over the prefix: a left-padded lane from 0, a chunk crossing two block ends,
    a left-padded chunk from its running state; the running slot holds the state after the
    lane's last token."""
    pos = [[-1, 0, 1, 2], [1, 2, 3, 4], [-1, -1, 3, 4]]
    row = [0, 1, 2]
    # row r's block j at slot 2r + j (row 2's block 2 and row 3's lie past the pool)
    blocks = [[2 * r + j for j in range(CONTEXT // M)] for r in range(ROWS)]
    before = pools(case, {1: scratch(1, 0), 2: scratch(2, 2)}, {})
    first, states, after = run(case, tabled(case, pos, row, blocks), inputs(pos, row), before)
    same(case, first, [np.zeros(WIDTH), scratch(1, 0), scratch(2, 2)], "start")
    for b, r in enumerate(row):
        for i, p in enumerate(pos[b]):
            if p >= 0:
                same(case, states[b, i], scratch(r, p), f"lane {b}'s state after {p}")
    # lane 0 closes block 0 (slot 0); lane 1 blocks 0 and 1 (slots 2, 3); lane 2 block 1
    # (slot 5); slot 1 and 4 are closed by no token
    expect(case, after, {0: scratch(0, 2), 1: scratch(1, 4), 2: scratch(2, 4)},
           {0: scratch(0, 1), 2: scratch(1, 1), 3: scratch(1, 3), 5: scratch(2, 3)})


@law
def law_a_dropped_slot_stores_nothing(case: Case) -> None:
    """A snapshot slot of -1, at the pool's size or huge drops its store, as does a block past
    the table's last column and every store of a lane whose row is -1 or outside the table;
    every other slot is exact (NaN stays NaN, a value stays itself)."""
    huge = case.int_max
    pos = [[0, 1, 2, 3], [0, 1, 2, 3], [2, 3, 4, 5]]
    row = [0, -1, 3]
    blocks = [[-1, SLOTS, 1, 2], [3, 4, 5, 0], [0, 0, 0, 0], [-1, huge, 5, 5]]
    before = pools(case, {1: 7.0, 2: 8.0, 3: scratch(3, 1)}, {0: 9.0, 3: 10.0})
    first, _, after = run(case, tabled(case, pos, row, blocks), inputs(pos, row), before)
    same(case, first[1], np.zeros(WIDTH), "a lane of padding starts from zero")
    # lane 0 closes blocks 0 and 1 at -1 and the pool's size: no snapshot; lane 1 is padding
    # (its row's slots 3, 4 untouched); lane 2 closes block 1 (huge: dropped) and 2 (slot 5)
    expect(case, after, {0: scratch(0, 3), 1: 7.0, 2: 8.0, 3: scratch(3, 5)},
           {0: 9.0, 3: 10.0, 5: scratch(3, 5)})
    # the same shapes: a row outside the table (4) is padding throughout; lane 0 starts at 6
    # from block 2's snapshot (slot 5), closes block 3 (slot 0), and block 4 at 9, past the
    # table's last column, stores nothing (the next lane's first block, slot 4, keeps its
    # value); lane 1 starts from block 0's (slot 4) and closes blocks 1 (dropped) and 2
    pos, row = [[6, 7, 8, 9], [2, 3, 4, 5], [0, 1, 2, 3]], [1, 3, 4]
    blocks[3] = [4, huge, 2, -1]
    before = pools(case, {1: nan, 2: 8.0}, {5: scratch(1, 5), 4: scratch(3, 1), 3: 10.0})
    _, _, after = run(case, tabled(case, pos, row, blocks), inputs(pos, row), before)
    expect(case, after, {1: scratch(1, 9), 2: 8.0, 3: scratch(3, 5)},
           {5: scratch(1, 5), 4: scratch(3, 1), 3: 10.0, 0: scratch(1, 7), 2: scratch(3, 5)})


# -- law 1: where a lane starts ---------------------------------------------------------------
@law
def law_a_lane_starts_from_the_snapshot_its_table_names(case: Case) -> None:
    """A lane whose first position p0 is a multiple of m starts from the snapshot its table of
    blocks names at block p0/m - 1 (another sequence's, a fork), whatever its running slot
    holds; a lane not on a block's start, or whose block names no slot, from its running
    slot; a lane at position 0 from zero, even where its running slot holds NaN."""
    # row 2 forks from row 0 after position 3: its first two blocks are row 0's (slots 0, 1)
    pos = [[4, 5, 6, 7], [3, 4, 5, -1], [0, 1, 2, 3]]
    row = [2, 1, 3]
    blocks = [[0, 1, -1, -1], [-1, 2, -1, -1], [0, 1, 3, 4], [5, -1, -1, -1]]
    fork = {2: (0, 4)}
    before = pools(case, {1: scratch(1, 2)},
                   {0: scratch(0, 1), 1: scratch(0, 3), 2: nan, 5: 11.0})
    x = inputs(pos, row, fork)
    first, states, after = run(case, tabled(case, pos, row, blocks), x, before)
    same(case, first, [scratch(0, 3), scratch(1, 2), np.zeros(WIDTH)], "start")
    same(case, states[0, 3], scratch(2, 7, (0, 4)), "the fork's state from scratch")
    expect(case, after, {2: scratch(2, 7, (0, 4)), 1: scratch(1, 5), 3: scratch(3, 3)},
           {0: scratch(0, 1), 1: scratch(0, 3), 3: scratch(2, 5, (0, 4)),
            4: scratch(2, 7, (0, 4)), 2: scratch(1, 3), 5: scratch(3, 1)})
    # the same shapes: the fork's block names no slot (-1) or one past the pool, so it starts
    # from its running slot, which holds the same state
    for slot in (-1, SLOTS):
        blocks[2][1] = slot
        before = pools(case, {1: scratch(1, 2), 2: scratch(2, 3, (0, 4))}, {1: nan})
        first, _, _ = run(case, tabled(case, pos, row, blocks), x, before)
        same(case, first[0], scratch(2, 3, (0, 4)), f"start with block 1 at slot {slot}")


@law
def law_a_lane_of_padding_keeps_its_running_state(case: Case) -> None:
    """A lane with no valid token starts from zero, keeps its state through the call and
    stores nothing: its running slot holds what it held, NaN or a value."""
    pos = [[-1, -1, -1, -1], [3, 4, 5, 6], [-1, -1, -1, -1]]
    row = [1, 2, 0]
    blocks = [[0, 1, 2, 3]] * ROWS
    before = pools(case, {0: nan, 1: 3.0, 2: scratch(2, 2)}, {})
    first, states, after = run(case, tabled(case, pos, row, blocks), inputs(pos, row), before)
    same(case, first[[0, 2]], np.zeros((2, WIDTH)), "start of the lanes of padding")
    same(case, states[[0, 2]], np.zeros((2, 4, WIDTH)), "states of the lanes of padding")
    # lane 1 closes block 1 at position 3 and block 2 at 5 (its table's slots 1, 2)
    expect(case, after, {1: 3.0, 2: scratch(2, 6)}, {1: scratch(2, 3), 2: scratch(2, 5)})


# -- whole and packed ---------------------------------------------------------------------------
@law
def law_a_whole_or_packed_index_reads_zero_and_stores_nothing(case: Case) -> None:
    """On a whole index (over blocks too) and a packed one every lane starts from zero and the
    pools come back as given; closing names the tokens closing each block of a whole lane."""
    before = pools(case, {0: 1.0, 1: 2.0}, {0: 3.0})
    o = {"xp": case.backend.name, "device": case.device}
    last = case.array(np.ones((3, WIDTH), np.float32))
    for ix in (build.whole(3, 4, lens=[4, 2, 3], **o), build.packed(4, [[2, 2], [4], [1]], **o)):
        first, after = case.call(bare, ix, last, before)
        same(case, first, np.zeros((3, WIDTH)), f"start on {ix}")
        expect(case, after, {0: 1.0, 1: 2.0}, {0: 3.0})
    ix = build.whole(3, 4, lens=[4, 2, 3], **o).every(M)
    first, _, after = recur(ix, case.array(np.ones((3, 4, WIDTH), np.float32)), before)
    same(case, first, np.zeros((3, WIDTH)), f"start on {ix}")
    expect(case, after, {0: 1.0, 1: 2.0}, {0: 3.0})
    tokens, ok = state.closing(build.whole(2, 5, lens=[5, 2], **o).every(M))
    same(case, tokens, [[1, 3, -1], [4, -1, -1]], "closing tokens of whole lanes")
    same(case, ok, [[True, True, False], [True, False, False]], "closing tokens' gate")


@law
def law_snapshots_stored_are_every_m_extends(case: Case) -> None:
    """On random chunks of random tables (distinct slots, some -1 or past the pool) the
    snapshots store keeps are exactly ``index.every(m).extend(states, snapshots)``'s, and
    every state is the one from scratch, read from the running slot or the snapshot alike."""
    rng = np.random.default_rng(35)
    for _ in range(3):
        row = [int(r) for r in rng.permutation(ROWS)[:3]]
        blocks = rng.permutation(ROWS * CONTEXT // M).reshape(ROWS, -1) - 5
        table = rng.permutation(ROWS * CONTEXT).reshape(ROWS, CONTEXT)
        pos, running, snapshots = [], {}, {}
        for r in row:
            n = int(rng.integers(0, 5))
            p0 = int(rng.integers(0, CONTEXT - n + 1))
            pos.append([-1] * (4 - n) + list(range(p0, p0 + n)))
            if n and p0:  # both the running slot and the block before hold the state
                running[r] = scratch(r, p0 - 1)
                if p0 % M == 0 and 0 <= blocks[r, p0 // M - 1] < SLOTS:
                    snapshots[int(blocks[r, p0 // M - 1])] = running[r]
        before = pools(case, running, snapshots)
        _, states, _ = run(case, tabled(case, pos, row, blocks, table), inputs(pos, row),
                           before)
        for b, r in enumerate(row):
            for i, p in enumerate(pos[b]):
                if p >= 0:
                    same(case, states[b, i], scratch(r, p), f"lane {b}'s state after {p}")


@law(eager_only=True)
def law_store_changes_the_callers_pools_only_when_donated(case: Case) -> None:
    """store never changes the caller's pools unless donated; donated, the backend writes into
    their memory where it can."""
    pos = [[0, 1, 2, 3]] * 3
    ix = tabled(case, pos, [0, 1, 2], [[2 * r, 2 * r + 1, -1, -1] for r in range(ROWS)])
    before = pools(case, {}, {})
    last = case.array(np.ones((3, WIDTH), np.float32))
    closed = case.array(np.ones((3, 2, WIDTH), np.float32))
    after = state.store(ix, last, before, closed)
    expect(case, before, {}, {})
    expect(case, after, {r: 1.0 for r in range(3)}, {s: 1.0 for s in range(6)})
    donated = state.store(ix, last, before, closed, donate=True)
    expect(case, donated, {r: 1.0 for r in range(3)}, {s: 1.0 for s in range(6)})
    in_place = all(case.backend.wrote_in_place(a, b) for a, b in zip(before, donated))
    case.facts["state donated in place"] = in_place
    if case.backend.donates:
        assert in_place, "donate=True copied the pools"
