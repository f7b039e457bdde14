"""``ci.check``: each of the table's obligations broken on purpose is named (its lane or row,
its column, its slot) on every backend; every index the library builds keeps them; and on
random small tables it names the obligation a slow reference finds broken first."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheidx as ci

I = np.int64


def index(backend, pos, table, *, row=None, every=(), draft=None):
    xp = backend.xp
    dtype = ci.rows(1, [1], xp=backend.name).pos.dtype  # the backend's index dtype

    def to(a, kind=dtype):
        return xp.asarray(np.asarray(a), dtype=kind)

    ix = ci.make(to(pos), to(table), row=None if row is None else to(row),
                 every=[(m, to(b)) for m, b in every])
    if draft is not None:
        slots, sees = draft
        ix = ix.draft(to(slots), to(sees, xp.bool))
    return ix


BROKEN = [
    # a slot at two columns of one row: token 0 would read token 2's value
    (dict(pos=[[0, 1, 2]], table=[[5, 6, 5]]),
     "the table names slot 5 twice in row 0 (lane 0), at columns 0 and 2: within a row a slot "
     "appears once"),
    (dict(pos=[[3]], table=[[0, 1, 2, 3]], every=[(2, [[7, 7]])]),
     "the table of blocks of 2 names slot 7 twice in row 0 (lane 0), at columns 0 and 1"),
    # two rows naming one slot at different columns
    (dict(pos=[[2], [2]], table=[[0, 1, 8], [1, 9, 10]]),
     "the table names slot 1 in row 0 (lane 0) at column 1 and in row 1 (lane 1) at column 0: "
     "two sequences share a slot only at the same column"),
    # two tokens of the call storing at one slot: two lanes on one row at one position
    (dict(pos=[[0, 1], [0, 1]], table=[[0, 1]], row=[0, 0]),
     "lane 0 token 0 (position 0) and lane 1 token 0 (position 0) both store at slot 0 through "
     "the table: within a call write targets are distinct"),
    (dict(pos=[[1, 1]], table=[[0, 1]]),
     "lane 0 token 0 (position 1) and lane 0 token 1 (position 1) both store at slot 1"),
    (dict(pos=[[2, 3]], table=[[0, 1, -1, -1]], draft=([[4, 4]], np.ones((1, 2, 2), bool))),
     "both store at slot 4 through a draft"),
    # a slot stored this call that another row's table names (at the same column)
    (dict(pos=[[2], [1]], table=[[0, 1, 2], [3, 4, 2]], row=[0, 1]),
     "lane 0 token 0 (position 2) stores at slot 2, its row 0's column 2, which the table also "
     "names in row 1 (lane 1) at column 2: a slot another sequence's table names is never a "
     "write target"),
    (dict(pos=[[2]], table=[[0, 1, 2], [0, 1, 2]], row=[0]),
     "which the table also names in row 1 (no lane reads it) at column 2"),
    (dict(pos=[[2, 3]], table=[[0, 1, -1, -1], [7, 8, -1, -1]], row=[0],
          draft=([[4, 8]], np.ones((1, 2, 2), bool))),
     "lane 0 token 1 (position 3) stores its draft at slot 8, which the table names in row 1 "
     "(no lane reads it) at column 1"),
]


@pytest.mark.parametrize("case, message", BROKEN)
def test_each_broken_obligation_is_named_with_its_lane_column_and_slot(backend, case, message):
    bad = index(backend, **case)
    with pytest.raises(ValueError) as e:
        ci.check(bad)
    assert str(e.value).startswith("cacheidx.check: ") and message in str(e.value), str(e.value)


def test_every_index_the_library_builds_keeps_the_obligations(backend):
    name = backend.name
    for ix in (ci.rows(8, [2, 5, 1], every=[2, 4], xp=name),
               ci.rows(8, [3], xp=name).window(2).advance(),
               ci.whole(2, 3, xp=name), ci.packed(4, [[2, 2]], xp=name)):
        assert ci.check(ix) is ix
    # shared prefix pages at the same columns, written by an earlier call; each lane stores
    # past them, into its own pages; padding lanes and unallocated columns store nothing
    shared = index(backend, [[4, 5], [4, -1], [-1, -1]], [[0, 1, 2, 3, 8, 9], [0, 1, 2, 3, 6, -1],
                                                          [0, 1, -1, -1, -1, -1]],
                   row=[0, 1, -1])
    assert ci.check(shared) is shared
    draft = index(backend, [[2, 3]], [[0, 1, -1, -1]], draft=([[4, 5]], np.ones((1, 2, 2), bool)))
    assert ci.check(draft) is draft
    chosen = shared.window(1).select(backend.xp.zeros((3, 2, 1), dtype=shared.pos.dtype))
    assert ci.check(chosen) is chosen, "windows and selections change no obligation"


def test_check_refuses_a_traced_index():
    jax = pytest.importorskip("jax")
    step = jax.jit(lambda ix: ci.check(ix).pos)
    with pytest.raises(TypeError, match="cacheidx.check: the index's tensors are being traced"):
        step(ci.rows(4, [2], xp="jax"))
    with pytest.raises(TypeError, match="expected a CacheIndex, got list"):
        ci.check([1, 2])


# -- random small tables against a slow reference -----------------------------------------------
def first_broken(pos, table, row, m_tables, draft):
    """The number (1-4) of the first obligation broken, by the docstring's words, slowly."""
    tables = [(table, 1)] + [(t, m) for m, t in m_tables]
    rows = len(table)
    lane_row = [r if 0 <= r < rows else -1
                for r in (row if row is not None else range(len(pos)))]
    for t, _ in tables:
        for r in t:
            named = [s for s in r if s >= 0]
            if len(named) != len(set(named)):
                return 1
    for t, _ in tables:
        where = {}
        for r in t:
            for j, s in enumerate(r):
                if s >= 0 and where.setdefault(s, j) != j:
                    return 2
    stores = []
    for t, m in tables:
        if m > 1 and draft is not None:
            continue
        out = []
        for b, lane in enumerate(pos):
            for i, p in enumerate(lane):
                if p < 0 or lane_row[b] < 0:
                    continue
                if m == 1 and draft is not None:
                    if draft[b][i] >= 0:
                        out.append((b, draft[b][i], None))
                    continue
                if (p + 1) % m or p // m >= len(t[0]) or t[lane_row[b]][p // m] < 0:
                    continue
                out.append((b, t[lane_row[b]][p // m], lane_row[b]))
        stores.append((t, out))
    for _, out in stores:
        slots = [s for _, s, _ in out]
        if len(slots) != len(set(slots)):
            return 3
    for t, out in stores:
        for _, s, own in out:
            if any(s in r for k, r in enumerate(t) if k != own):
                return 4
    return None


WORDS = {1: "within a row a slot appears once", 2: "share a slot only at the same column",
         3: "write targets are distinct", 4: "another sequence's table names"}


@st.composite
def calls(draw):
    rows, width, batch, seq = (draw(st.integers(1, 3)), draw(st.integers(1, 4)),
                               draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    slot = st.integers(-1, 7)
    table = draw(st.lists(st.lists(slot, min_size=width, max_size=width), min_size=rows,
                          max_size=rows))
    row = draw(st.none() | st.lists(st.integers(-1, rows), min_size=batch, max_size=batch))
    if row is None:
        batch = rows
    pos = draw(st.lists(st.lists(st.integers(-1, width), min_size=seq, max_size=seq),
                        min_size=batch, max_size=batch))
    blocks = []
    if draw(st.booleans()):
        c = -(-width // 2)
        blocks = [(2, draw(st.lists(st.lists(slot, min_size=c, max_size=c), min_size=rows,
                                    max_size=rows)))]
    draft = None
    if not blocks and draw(st.booleans()):
        draft = draw(st.lists(st.lists(slot, min_size=seq, max_size=seq), min_size=batch,
                              max_size=batch))
    return pos, table, row, blocks, draft


@settings(max_examples=150)
@given(calls())
def test_check_names_the_first_obligation_the_slow_reference_finds_broken(call):
    pos, table, row, blocks, draft = call
    ix = ci.make(np.asarray(pos, I), np.asarray(table, I),
                 row=None if row is None else np.asarray(row, I),
                 every=[(m, np.asarray(b, I)) for m, b in blocks])
    if draft is not None:
        seq = len(pos[0])
        ix = ix.draft(np.asarray(draft, I), np.ones((len(pos), seq, seq), bool))
    want = first_broken(pos, table, row, blocks, draft)
    if want is None:
        assert ci.check(ix) is ix
    else:
        with pytest.raises(ValueError, match=WORDS[want]):
            ci.check(ix)
