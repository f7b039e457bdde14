"""The index's laws, each a small concrete case a reader can check by hand.

Every law runs on every backend, eagerly and in every compiled mode (``case.call`` demands the
two agree bit for bit). A law reads an index through two steps, ``observe`` (what a layer gets:
extend's seen and pool, the mask, the positions) and ``look`` (mask, visible, positions), so a
compiled run builds one program per index a law reads. Pools start with NaN wherever the law
says a read must be zero, so a zero that is really a NaN times a zero weight shows up.
"""

from __future__ import annotations

import numpy as np

from .. import build, pytree
from .suite import Case, agree, law

nan = np.nan


# -- steps run eagerly and compiled ---------------------------------------------------------
def extend(index, values, pool):
    return index.extend(values, pool)


def observe(index, values, pool):
    """What one layer reads of an index: ``(seen, pool, mask, positions)``."""
    seen, pool = index.extend(values, pool)
    return seen, pool, index.mask(), index.positions()


def look(index):
    """What an index says without pools: ``(mask, visible, positions)``."""
    return index.mask(), index.visible(), index.positions()


# -- small helpers ----------------------------------------------------------------------------
def ramp(batch: int, seq: int, width: int = 2) -> np.ndarray:
    """Values a reader can trace: lane b, token i, element e holds 100(b+1) + 10i + e."""
    b, i, e = np.meshgrid(np.arange(batch), np.arange(seq), np.arange(width), indexing="ij")
    return (100 * (b + 1) + 10 * i + e).astype(np.float32)


def stored(slots: int, known: dict[int, float], width: int = 2) -> np.ndarray:
    """A pool of NaN but for the slots in ``known``, which hold their value."""
    pool = np.full((slots, width), nan, dtype=np.float32)
    for s, v in known.items():
        pool[s] = v
    return pool


def same(case: Case, got, want, what: str) -> None:
    got = case.numpy(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    assert np.array_equal(got, want, equal_nan=got.dtype.kind == "f"), (
        f"{what}:\ngot\n{got}\nwant\n{want}")


def index(case: Case, pos, table, **kw):
    arr = case.array
    if "row" in kw and kw["row"] is not None:
        kw["row"] = arr(kw["row"])
    if "every" in kw:
        kw["every"] = [(m, arr(b)) for m, b in kw["every"]]
    return build.make(arr(pos), arr(table), **kw)


def on(case: Case) -> dict:
    return {"xp": case.backend.name, "device": case.device}


# -- column is position; a token stores at its own column -----------------------------------
@law
def law_column_is_position(case: Case) -> None:
    """Column j of a lane's seen holds position j of its sequence; rows pads on the left."""
    ix = build.rows(6, [2, 4], **on(case))
    v = ramp(2, 4)
    seen, pool, _, at = case.call(observe, ix, case.array(v), case.array(stored(12, {})))
    want = np.zeros((2, 6, 2), np.float32)
    want[0, :2], want[1, :4] = v[0, 2:], v[1]
    same(case, seen, want, "seen")
    want_pool = stored(12, {})
    want_pool[0:2], want_pool[6:10] = v[0, 2:], v[1]
    same(case, pool, want_pool, "pool")
    same(case, at, [[0, 0, 0, 1], [0, 1, 2, 3]], "positions")


@law
def law_a_token_stores_at_its_own_column(case: Case) -> None:
    """A token stores at the slot its table names at its position, through the row map; every
    other slot keeps what it held, NaN included."""
    ix = index(case, [[0, 1], [1, 2]], [[5, 2, 7, -1], [0, 3, -1, 6]], row=[1, 0])
    before = stored(8, {5: -5.0, 2: -2.0, 7: -7.0, 0: -0.5, 3: -3.0})
    v = ramp(2, 2)
    seen, pool, _, _ = case.call(observe, ix, case.array(v), case.array(before))
    want = before.copy()
    want[0], want[3], want[2], want[7] = v[0, 0], v[0, 1], v[1, 0], v[1, 1]
    same(case, pool, want, "pool")
    want_seen = np.zeros((2, 4, 2), np.float32)
    want_seen[0, 0], want_seen[0, 1] = v[0, 0], v[0, 1]  # sequence 1: slots 0, 3, hole, 6
    want_seen[1, 0], want_seen[1, 1], want_seen[1, 2] = before[5], v[1, 0], v[1, 1]
    same(case, seen, want_seen, "seen")


@law
def law_drop_means_drop(case: Case) -> None:
    """A store at -1, at the pool's size, at a huge slot or any other negative one is dropped,
    and a read of one is zero; a kept store beside dropped ones is exact."""
    huge = case.int_max
    before = stored(4, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0})
    v = ramp(1, 5)
    ix = index(case, [[0, 1, 2, 3, 4]], [[-1, 4, huge, -7, 0]])
    seen, pool, _, _ = case.call(observe, ix, case.array(v), case.array(before))
    want = before.copy()
    want[0] = v[0, 4]
    same(case, pool, want, "pool with one kept store")
    want_seen = np.zeros((1, 5, 2), np.float32)
    want_seen[0, 4] = v[0, 4]
    same(case, seen, want_seen, "seen")
    # the shapes of the first case (one program for both), its one kept store sent past too
    ix = index(case, [[0, 1, 2, 3, 4]], [[-1, 4, huge, -7, 4]])
    _, pool, _, _ = case.call(observe, ix, case.array(v), case.array(before))
    same(case, pool, before, "pool with every store dropped")


@law
def law_padding_stores_nothing(case: Case) -> None:
    """A position of -1, a lane whose row is -1 and a row outside the table are padding: they
    store nothing, see nothing and read zero."""
    ix = index(case, [[-1, 0], [1, 2], [0, 1]], [[0, 1, 2], [3, 4, 5]], row=[0, -1, 5])
    before = stored(6, {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0})
    v = ramp(3, 2)
    seen, pool, got_mask, _ = case.call(observe, ix, case.array(v), case.array(before))
    want = before.copy()
    want[0] = v[0, 1]
    same(case, pool, want, "pool")
    want_seen = np.zeros((3, 3, 2), np.float32)
    want_seen[0, 0] = v[0, 1]
    same(case, seen, want_seen, "seen")
    m = np.zeros((3, 2, 3), bool)
    m[0, 1, 0] = True
    same(case, got_mask, m, "mask")


@law
def law_a_token_past_the_last_column_stores_nothing(case: Case) -> None:
    """A token whose position is past the table's last column stores nothing; positions clamp
    to the last column."""
    ix = index(case, [[2, 3, 9]], [[0, 1, 2]])
    before = stored(3, {0: 1.0, 1: 2.0})
    v = ramp(1, 3)
    _, pool, _, at = case.call(observe, ix, case.array(v), case.array(before))
    want = before.copy()
    want[2] = v[0, 0]
    same(case, pool, want, "pool")
    same(case, at, [[2, 2, 2]], "positions")


# -- a column no token sees is zero -----------------------------------------------------------
@law
def law_unseen_columns_are_zero(case: Case) -> None:
    """An unallocated column, one past every position of its lane and one below the window for
    every token read as exactly zero whatever their slot holds; a hole is still masked in."""
    ix = index(case, [[2, 3]], [[0, -1, 2, 3, 4, 5]])
    seen, _, m, _ = case.call(observe, ix, case.array(ramp(1, 2)), case.array(stored(6, {0: 7.0})))
    want = np.zeros((1, 6, 2), np.float32)
    want[0, 0], want[0, 2:4] = 7.0, ramp(1, 2)[0]
    same(case, seen, want, "seen: hole and columns past the lane")
    m = case.numpy(m)
    assert m[0, :, 1].all(), "a hole inside the range is masked in (it reads as a zero key)"

    ix = index(case, [[4, 5]], [[0, 1, 2, 3, 4, 5]]).window(2)
    seen, *_ = case.call(observe, ix, case.array(ramp(1, 2)), case.array(stored(6, {3: 3.0})))
    want = np.zeros((1, 6, 2), np.float32)
    want[0, 3], want[0, 4:] = 3.0, ramp(1, 2)[0]
    same(case, seen, want, "seen: columns below the window")

    # the window and shapes of the last case (one program for both): column 2 lies between
    # the two tokens' windows, 0 and 3 inside them
    ix = index(case, [[1, 4]], [[0, 1, 2, 3, 4, 5]]).window(2)
    seen, *_ = case.call(observe, ix, case.array(ramp(1, 2)),
                         case.array(stored(6, {0: 5.0, 3: 6.0})))
    want = np.zeros((1, 6, 2), np.float32)
    want[0, 0], want[0, 3] = 5.0, 6.0
    want[0, 1], want[0, 4] = ramp(1, 2)[0]
    same(case, seen, want, "seen: a gap between two tokens' windows")


@law
def law_mask_is_causal_and_windowed(case: Case) -> None:
    """A token sees the columns at or before its position, under a window only the last w; a
    padded token sees none."""
    for w in (None, 1, 2, 7):
        ix = build.rows(5, [3, 5], **on(case))
        ix = ix if w is None else ix.window(w)
        pos = case.numpy(ix.pos)
        want = np.zeros((2, 5, 5), bool)
        for b in range(2):
            for i in range(5):
                for j in range(5):
                    t = pos[b, i]
                    want[b, i, j] = t >= 0 and j <= t and (w is None or j > t - w)
        got_mask, got_visible, _ = case.call(look, ix)
        same(case, got_mask, want, f"mask, window {w}")
        same(case, got_visible, want[:, None], f"visible, window {w}")


@law
def law_lanes_naming_one_sequence_see_each_other(case: Case) -> None:
    """Lanes that name one sequence see each other's stores of this call, as one lane would."""
    ix = index(case, [[2], [3], [4]], [[0, 1, 2, 3, 4, 5]], row=[0, 0, 0])
    v = ramp(3, 1)
    seen, *_ = case.call(observe, ix, case.array(v), case.array(stored(6, {0: 1.0, 1: 2.0})))
    want = np.zeros((3, 6, 2), np.float32)
    for b, t in enumerate((2, 3, 4)):
        want[b, 0], want[b, 1] = 1.0, 2.0
        for j in range(2, t + 1):
            want[b, j] = v[j - 2, 0]
    same(case, seen, want, "seen")


# -- blocks of m positions ------------------------------------------------------------------
@law
def law_blocks_store_only_closing_tokens(case: Case) -> None:
    """In blocks of m only the token closing a block stores, at its block's slot; a block is
    seen once closed."""
    ix = build.rows(8, [6], every=[4], **on(case)).every(4)
    assert ix.context == 2
    v = ramp(1, 6)
    seen, pool, got_mask, at = case.call(observe, ix, case.array(v), case.array(stored(2, {})))
    want = stored(2, {})
    want[0] = v[0, 3]
    same(case, pool, want, "blocks pool")
    want_seen = np.zeros((1, 2, 2), np.float32)
    want_seen[0, 0] = v[0, 3]
    same(case, seen, want_seen, "seen")
    m = np.zeros((1, 6, 2), bool)
    m[0, 3:, 0] = True
    same(case, got_mask, m, "mask")
    same(case, at, [[0, 1, 2, 3, 4, 5]], "positions ignore every")
    assert ix.every(4) is ix and build.rows(8, [6], **on(case)).every(1).context == 8


@law
def law_a_window_over_blocks_reads_the_blocks_it_reaches(case: Case) -> None:
    """Under a window w a token at t sees block j once closed and while j*m + m - 1 > t - w."""
    ix = build.rows(12, [12], every=[4], **on(case)).every(4).window(5)
    want = np.zeros((1, 12, 3), bool)
    for t in range(12):
        for j in range(3):
            s = 4 * j + 3
            want[0, t, j] = s <= t and s > t - 5
    before = stored(3, {})
    v = ramp(1, 12)
    seen, _, got_mask, _ = case.call(observe, ix, case.array(v), case.array(before))
    same(case, got_mask, want, "mask")
    want_seen = np.stack([v[0, 3], v[0, 7], v[0, 11]])[None]
    same(case, seen, want_seen, "seen: every block is seen by some token")


# -- selections -----------------------------------------------------------------------------
@law
def law_a_selection_reads_the_chosen_columns(case: Case) -> None:
    """Each token reads its k chosen columns: one chosen twice is read twice; one after its
    position, outside the context or unallocated reads zero, masked but for the hole."""
    ix = index(case, [[0, 1, 2, 3]], [[0, -1, 2, 3, 4, 5]])
    cols = [[[1, -1, 6], [1, 0, 1], [2, 3, 0], [0, 0, 5]]]
    sel = ix.select(case.array(cols))
    before = stored(6, {})
    v = ramp(1, 4)
    seen, pool, got_mask, _ = case.call(observe, sel, case.array(v), case.array(before))
    at = {0: v[0, 0], 2: v[0, 2], 3: v[0, 3]}
    m = np.zeros((1, 4, 3), bool)
    want = np.zeros((1, 4, 3, 2), np.float32)
    for i in range(4):
        for c, j in enumerate(cols[0][i]):
            m[0, i, c] = 0 <= j <= i
            if m[0, i, c] and j in at:
                want[0, i, c] = at[j]
    same(case, seen, want, "seen")
    same(case, got_mask, m, "mask")
    _, plain, _, _ = case.call(observe, ix, case.array(v), case.array(before))
    same(case, pool, case.numpy(plain), "a selection does not change what is stored")


@law
def law_a_selection_on_a_whole_index_reads_tokens_and_blocks(case: Case) -> None:
    """On a whole index a chosen column is a token of the lane, or a block under every."""
    v = ramp(1, 4)
    cols = [[[0, 3], [1, 0], [2, 2], [3, 1]]]
    ix = build.whole(1, 4, **on(case)).select(case.array(cols))
    seen, *_ = case.call(observe, ix, case.array(v), case.array(stored(1, {})))
    want = np.zeros((1, 4, 2, 2), np.float32)
    for i in range(4):
        for c, j in enumerate(cols[0][i]):
            if j <= i:
                want[0, i, c] = v[0, j]
    same(case, seen, want, "seen over tokens")
    ix = build.whole(1, 4, **on(case)).every(2).select(case.array([[[0], [0], [1], [1]]]))
    seen, *_ = case.call(observe, ix, case.array(v), case.array(stored(1, {})))
    want = np.zeros((1, 4, 1, 2), np.float32)
    want[0, 1:, 0] = v[0, 1]
    want[0, 3, 0] = v[0, 3]
    want[0, 2, 0] = 0.0  # block 1 closes at position 3
    same(case, seen, want, "seen over blocks")


# -- drafts ---------------------------------------------------------------------------------
def _tree(case: Case, window: int | None = None):
    """A table holding positions 0-2 and a draft tree: token 0 at 3; tokens 1 and 2 at 4,
    children of 0; token 3 at 5, child of 1."""
    parent = [-1, 0, 0, 1]
    sees = np.zeros((1, 4, 4), bool)
    for i in range(4):
        j = i
        while j >= 0:
            sees[0, i, j] = True
            j = parent[j]
    ix = index(case, [[3, 4, 4, 5]], [[0, 1, 2, -1, -1, -1]])
    ix = ix if window is None else ix.window(window)
    return ix.draft(case.array([[6, 7, 8, 9]]), case.array(sees)), sees


@law
def law_a_draft_stores_at_its_slots_and_sees_as_told(case: Case) -> None:
    """Draft tokens store at the draft's slots, never in the table's columns; they see the
    table's columns before the lane's least position and the call's tokens as sees says."""
    ix, tree = _tree(case)
    assert ix.context == 10
    before = stored(10, {0: 1.0, 1: 2.0, 2: 3.0})
    v = ramp(1, 4)
    seen, pool, got_mask, _ = case.call(observe, ix, case.array(v), case.array(before))
    want = before.copy()
    want[6:10] = v[0]
    same(case, pool, want, "pool")
    want_seen = np.zeros((1, 10, 2), np.float32)
    want_seen[0, :3] = before[:3]
    want_seen[0, 6:] = v[0]
    same(case, seen, want_seen, "seen")
    m = np.zeros((1, 4, 10), bool)
    m[0, :, :3] = True
    m[0, :, 6:] = tree[0]
    same(case, got_mask, m, "mask")


@law
def law_a_draft_under_a_window_sees_only_its_reach(case: Case) -> None:
    """Under a window the draft's tokens see table columns and tokens within the last w."""
    ix, tree = _tree(case, window=2)
    pos = [3, 4, 4, 5]
    m = np.zeros((1, 4, 10), bool)
    for i in range(4):
        for j in range(3):
            m[0, i, j] = j > pos[i] - 2
        for j in range(4):
            m[0, i, 6 + j] = tree[0, i, j] and pos[j] <= pos[i] and pos[j] > pos[i] - 2
    before = stored(10, {0: 1.0, 1: 2.0, 2: 3.0})
    seen, _, got_mask, _ = case.call(observe, ix, case.array(ramp(1, 4)), case.array(before))
    same(case, got_mask, m, "mask")
    want = np.zeros((1, 10, 2), np.float32)
    want[0, 2] = 3.0  # only token 0 (at 3) reaches back to column 2
    want[0, 6:] = ramp(1, 4)[0]
    same(case, seen, want, "seen")


# -- whole and packed -------------------------------------------------------------------------
@law
def law_a_whole_index_reads_values_and_keeps_the_pool(case: Case) -> None:
    """On a whole index seen is values (padding zero) and the pool is left as it was: eagerly
    the pool given itself, on a packed index too (spec: pool' is pool), compiled its values;
    under every seen holds the tokens closing each block."""
    ix = build.whole(2, 3, lens=[2, 3], **on(case))
    v = ramp(2, 3)
    before = stored(2, {0: 1.0})
    given = case.array(before)
    # the object itself, asked eagerly (the eager run asks it; a compiled step gives values)
    for kind, at in () if case.compiled else (
            ("whole", ix), ("packed", build.packed(3, [[1, 2], [3]], **on(case)))):
        assert at.extend(case.array(v), given)[1] is given, (
            f"{kind}: extend returned another pool than the one it was given")
    seen, pool, got_mask, _ = case.call(observe, ix, case.array(v), given)
    want = v.copy()
    want[0, 0] = 0.0
    same(case, seen, want, "seen")
    same(case, pool, before, "pool")
    m = np.zeros((2, 3, 3), bool)
    m[0, 1, 1] = m[0, 2, 1] = m[0, 2, 2] = True
    m[1] = np.tril(np.ones((3, 3), bool))
    same(case, got_mask, m, "mask")
    ix = build.whole(1, 5, **on(case)).every(2)
    assert ix.context == 3
    seen, *_ = case.call(observe, ix, case.array(ramp(1, 5)), case.array(before))
    same(case, seen, np.stack([ramp(1, 5)[0, 1], ramp(1, 5)[0, 3], np.zeros(2)])[None],
         "seen over blocks")


@law
def law_packed_tokens_see_their_own_sequence(case: Case) -> None:
    """In a packed lane a token sees the tokens of its own sequence at or before its own."""
    ix = build.packed(6, [[2, 3], [6]], **on(case))
    got_mask, _, at = case.call(look, ix)
    same(case, at, [[0, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5]], "positions")
    m = np.zeros((2, 6, 6), bool)
    for i, j in [(1, 1), (2, 1), (2, 2), (3, 3), (4, 3), (4, 4), (5, 3), (5, 4), (5, 5)]:
        m[0, i, j] = True
    m[1] = np.tril(np.ones((6, 6), bool))
    same(case, got_mask, m, "mask")
    same(case, case.call(look, ix.window(2))[0], m & ~np.tril(np.ones((6, 6), bool), -2),
         "mask under a window")


# -- the call's tokens ----------------------------------------------------------------------
@law
def law_positions_are_clamped(case: Case) -> None:
    """positions clamps to 0 and the last column of the positions' table: padding is 0."""
    ix = index(case, [[-1, 0, 3, 9]], [[0, 1, 2, 3]])
    same(case, case.call(look, ix)[2], [[0, 0, 3, 3]], "tabled")
    same(case, case.call(look, build.whole(1, 3, lens=[2], **on(case)))[2], [[0, 0, 1]],
         "whole")


@law
def law_advance_is_one_past_the_greatest(case: Case) -> None:
    """advance gives one token per lane one past the lane's greatest position (0 for a lane of
    padding), keeps the window and block size, drops the selection and draft."""
    ix = index(case, [[1, 2], [-1, -1], [0, -1]], [[0, 1, 2]] * 3).window(2)
    nxt = ix.advance()
    same(case, nxt.pos, [[3], [0], [1]], "positions")
    assert nxt.structure == ix.structure and nxt.seq == 1
    sel = ix.select(case.array(np.zeros((3, 2, 1), np.int64))).advance()
    assert not sel.structure.columns
    drafted, _ = _tree(case)
    assert not drafted.advance().structure.draft
    blocks = build.rows(8, [3], every=[2], **on(case)).every(2).advance()
    assert blocks.structure.every == 2


# -- structure and storage ------------------------------------------------------------------
@law
def law_structure_names_what_compiles(case: Case) -> None:
    """Values vary, structure does not: indices of other positions and tables share a
    structure; another window, block size, selection or draft does not. The tensors are the
    pytree's leaves and rebuild the same index."""
    a = build.rows(8, [2, 4], every=[2], **on(case))
    b = build.rows(8, [4, 1], every=[2], **on(case))
    assert a.structure == b.structure
    variants = [a, a.window(2), a.window(3), a.every(2),
                a.select(case.array(np.zeros((2, 4, 1), np.int64)))]
    assert len({v.structure for v in variants}) == len(variants)
    c = index(case, [[1]], [[0, 1]], row=[0])
    assert c.structure != index(case, [[1]], [[0, 1]]).structure
    leaves = pytree.leaves(a)
    back = pytree.rebuild(a.structure, leaves)
    assert back.structure == a.structure
    assert all(x is y for x, y in zip(pytree.leaves(back), leaves))


@law(compiled_only=True)
def law_one_program_serves_every_position_and_allocation(case: Case) -> None:
    """Compiled, one program serves indices of other positions, tables and row maps."""

    def step(index, values, pool):
        seen, pool = index.extend(values, pool)
        return seen, index.mask(), pool

    jitted = case.jit(step)
    before = case.backend.programs(jitted)
    rng = np.random.default_rng(0)
    for k in range(4):
        table = rng.permutation(12).reshape(3, 4)
        ix = index(case, rng.integers(-1, 4, (2, 3)), table, row=rng.integers(-1, 3, 2))
        jitted(ix.window(2), case.array(ramp(2, 3) + k), case.array(stored(12, {})))
    n = case.backend.programs(jitted) - before
    case.facts["programs for 4 allocations"] = n
    assert n == 1, f"compiled {n} programs for 4 allocations"


def variants(case: Case, batch: int, width: int) -> dict:
    """Every kind of index over ``batch`` lanes of 3 tokens and tables ``width`` columns wide
    (whole and packed: ``width`` tokens). No two sizes of the first shape fed agree by chance,
    which torch's dynamic shapes would take for a rule ("duck sizing")."""
    o, arr = on(case), case.array
    lens = [3, 2, 3, 1][:batch]
    rows_ = build.rows(width, lens, **o)
    blocks = build.rows(width, lens, every=[3], **o).every(3)
    table = np.arange(batch * width).reshape(batch, width)
    pos = np.array([[width - 3, width - 2, width - 1]] * batch) - np.arange(batch)[:, None]
    # lanes 0 and 2 name sequence 0 at positions of their own; rows 2 and 3 are unused
    apart = np.array([[width - 3 - 3 * (b // 2) + i for i in range(3)] for b in range(batch)])
    mapped = index(case, apart, np.arange(4 * width).reshape(4, width),
                   row=[b % 2 for b in range(batch)])
    cols = np.stack([np.arange(3), np.full(3, width - 1), np.zeros(3, int), np.ones(3, int)],
                    -1)[None].repeat(batch, 0)
    sees = np.tril(np.ones((batch, 3, 3), bool))
    drafted = index(case, pos - 1, table).draft(arr(table[:, -3:]), arr(sees))
    return {"rows": rows_, "window": rows_.window(2), "blocks": blocks,
            "window over blocks": blocks.window(4), "row map": mapped,
            "select": rows_.select(arr(cols)), "draft": drafted,
            "whole": build.whole(batch, width, lens=[width - 1] + [width] * (batch - 1), **o),
            "packed": build.packed(width, [[2, width - 3]] + [[width]] * (batch - 1), **o)}


def through(index, values, pool):
    """``observe``'s twin, so that the next law counts its own programs (torch keeps them on
    the function's code)."""
    seen, pool = index.extend(values, pool)
    return seen, pool, index.mask(), index.positions()


def across(index, values, pool):
    """``through``'s twin for automatic dynamic shapes, compiled beside it."""
    seen, pool = index.extend(values, pool)
    return seen, pool, index.mask(), index.positions()


def feed(case: Case, step, kinds: list[str], shapes: list[tuple[int, int]]) -> dict:
    """Feed ``step`` the given kinds of index at each shape (compiled, each result must equal
    the eager one); for each kind, the programs it built, and those it built past the first
    shape."""
    built = {shape: variants(case, *shape) for shape in shapes}
    programs = {}
    for kind in kinds:
        counts = [case.backend.programs(step) if case.compiled else 0]
        for batch, width in shapes:
            ix = built[batch, width][kind]
            slots = batch * width
            v = case.array(ramp(batch, ix.seq, width=5))
            pool = case.array(stored(slots, {s: float(s) for s in range(slots)}, width=5))
            got = step(ix, v, pool)
            if case.compiled:
                agree(case, through(ix, v, pool), got, what=f"{kind} at {batch} x {width}")
            counts.append(case.backend.programs(step) if case.compiled else 0)
        programs[kind] = (counts[-1] - counts[0], counts[-1] - counts[1])
    return programs


@law
def law_one_step_serves_two_batch_sizes_and_two_context_widths(case: Case) -> None:
    """One step fed two batch sizes and two context widths gives the eager results for every
    kind of index. Compiled with static shapes it builds one program per shape; with symbolic
    shapes none past the first shape's; with torch's automatic dynamic shapes (its default:
    static until a size changes) one more when the sizes first change. (With symbolic shapes
    the step is :func:`observe`, which the other laws compiled for every kind already: the
    shapes must be served by what is there, or by one program more; a window is a number, never
    a size, so the kinds fed are those whose sizes differ: the windowed and blocked kinds are
    fed as the window over blocks, which takes every branch either takes.)"""
    four = [(2, 11), (3, 11), (3, 14), (2, 14)]
    kinds = list(variants(case, *four[0]))
    if case.mode in ("eager", "compiled"):
        # static shapes: the plain kind at two shapes (every kind compiles with static shapes
        # in the other laws, and a program per shape is dynamo's rule, not a kind's)
        step = case.jit(through) if case.compiled else through
        got = feed(case, step, ["rows"], four[::2])
        want = {"rows": (2, 1)}
        if case.compiled:
            case.facts["programs per kind of index (static)"] = {k: n for k, (n, _) in
                                                                 got.items()}
        assert not case.compiled or got == want, (
            f"(programs, those past the first shape) per kind of index with static shapes: "
            f"{got}, want {want}")
        return
    checks = [(case.jit(observe), case.mode, [k for k in kinds if k not in ("window", "blocks")])]
    if case.mode == "dynamic" and "automatic" in case.backend.modes:
        # the symbolic-shape run checks the step users compile too (automatic dynamic shapes),
        # on the kind whose reads take every branch the others take (windowed over blocks):
        # dynamo's switch to symbolic sizes is the same for each kind
        checks.append((case.backend.jit(across, mode="automatic",
                                        compiler=case.session.compiler), "automatic",
                       ["window over blocks"]))
    for step, mode, fed in checks:
        # both sizes change at the second call: automatic dynamic shapes recompile once
        got = feed(case, step, fed, [four[0], four[2], four[1], four[3]])
        case.facts[f"programs per kind of index ({mode})"] = {k: n for k, (n, _) in got.items()}
        most = {"dynamic": (1, 0), "automatic": (2, 1)}[mode]
        wrong = {k: n for k, n in got.items() if n[0] > most[0] or n[1] > most[1]}
        assert not wrong, (f"(programs, those past the first shape) per kind over {four}, "
                           f"{mode}: {wrong} (at most {most})")


@law(eager_only=True)
def law_donation_is_in_place_and_its_absence_copies(case: Case) -> None:
    """extend never changes the caller's pool unless donated; donated, the backend stores into
    the pool's memory where it can."""
    ix = build.rows(4, [2, 3], **on(case))
    before = stored(8, {0: 1.0, 5: 2.0})
    pool = case.array(before)
    _, after = ix.extend(case.array(ramp(2, 3)), pool)
    same(case, pool, before, "the caller's pool after donate=False")
    _, donated = ix.extend(case.array(ramp(2, 3)), pool, donate=True)
    same(case, donated, case.numpy(after), "donated result")
    in_place = case.facts["donation in place"] = case.backend.wrote_in_place(pool, donated)
    if case.backend.donates:
        assert in_place, "donate=True copied the pool"


@law(eager_only=True)
def law_a_raising_call_changes_nothing(case: Case) -> None:
    """Bad input raises ValueError (TypeError for a dtype) naming the function, and leaves the
    caller's pool as it was."""
    ix = build.rows(4, [2, 3], **on(case))
    before = stored(8, {0: 1.0})
    pool = case.array(before)
    for values, error in ((ramp(2, 2), ValueError), (ramp(2, 3, width=3), ValueError),
                          (case.array(ramp(2, 3), dtype=case.xp.int32), TypeError)):
        values = values if not isinstance(values, np.ndarray) else case.array(values)
        try:
            ix.extend(values, pool, donate=True)
        except error as e:
            assert "cacheidx.extend" in str(e), str(e)
        else:
            raise AssertionError(f"extend took values of shape {values.shape}")
        same(case, pool, before, "pool after a raising call")
    for bad, fn in ((lambda: ix.window(0)), "window"), ((lambda: ix.every(3)), "every"):
        try:
            bad()
        except ValueError as e:
            assert f"cacheidx.{fn}" in str(e), str(e)
        else:
            raise AssertionError(f"{fn} took a bad argument")


@law
def law_colliding_stores_leave_one_of_them_and_every_other_slot_exact(case: Case) -> None:
    """Two tokens aimed at one slot (the caller's fault) leave it holding, element by element,
    one of their stores, eager or compiled; every other slot is exact."""
    ix = index(case, [[0, 1], [0, 1]], [[0, 1, 2], [3, 1, 4]])
    before = stored(5, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0})
    v = ramp(2, 2)
    step = case.jit(extend) if case.compiled else extend
    _, pool = step(ix, case.array(v), case.array(before))
    got = case.numpy(pool)
    want = before.copy()
    want[0], want[3] = v[0, 0], v[1, 0]
    for s in (0, 2, 3, 4):
        same(case, got[s], want[s], f"slot {s}")
    assert np.all((got[1] == v[0, 1]) | (got[1] == v[1, 1])), f"slot 1 holds {got[1]}"


@law
def law_freeing_columns_below_every_reach_changes_nothing(case: Case) -> None:
    """Under a window, a column below the reach of every token still to be fed may be freed
    (-1): what the tokens see does not change."""
    v = ramp(1, 2)
    before = stored(8, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0, 5: 6.0})
    kept = index(case, [[6, 7]], [[0, 1, 2, 3, 4, 5, 6, 7]]).window(3)
    freed = index(case, [[6, 7]], [[-1, -1, -1, -1, 4, 5, 6, 7]]).window(3)
    a, _, mask_a, _ = case.call(observe, kept, case.array(v), case.array(before))
    b, _, mask_b, _ = case.call(observe, freed, case.array(v), case.array(before))
    same(case, a, case.numpy(b), "seen")
    same(case, mask_a, case.numpy(mask_b), "mask")


@law(eager_only=True)
def law_placing_an_index_keeps_its_values_and_structure(case: Case) -> None:
    """to_device places every tensor whole on the device; values and structure are kept."""
    ix = build.rows(4, [2, 3], every=[2], **on(case)).window(2)
    moved = ix.to_device(case.device)
    assert moved.structure == ix.structure
    for a, b in zip(pytree.leaves(ix), pytree.leaves(moved)):
        same(case, b, case.numpy(a), "a placed tensor")


@law
def law_a_window_wider_than_every_position_is_no_window(case: Case) -> None:
    """A window as wide as the index dtype allows sees what no window sees: nothing wraps."""
    plain = build.rows(4, [1, 2, 3, 4], **on(case))
    v, before = ramp(4, 4), stored(16, {s: float(s) for s in range(16)})
    want_seen, _, want_mask, _ = case.call(observe, plain, case.array(v), case.array(before))
    w = case.int_max  # the widest the dtype holds: a reach computed as t - w would wrap
    seen, _, got_mask, _ = case.call(observe, plain.window(w), case.array(v), case.array(before))
    same(case, got_mask, case.numpy(want_mask), f"mask, w={w}")
    same(case, seen, case.numpy(want_seen), f"seen, w={w}")
