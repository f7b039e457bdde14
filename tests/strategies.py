"""Hypothesis strategies for random cache indices of every kind.

A `Case` is a recipe: a constructor (`make`, `rows`, `whole`, `packed`) and its arguments, a
chain of derived-index operations (`every`, `window`, `select`, `draft`), and the values and
pool to extend. `build(api, case)` cooks it with cacheidx or with tests/reference.py, which
share one API, so a failing case prints as code that rebuilds it.

Shapes stay small (batch <= 3, seq <= 5, context <= 8, rows <= 4, rows of width <= 2). Tables
are permuted slots with -1 holes, slots past the pool, 2**40 and negatives other than -1;
rows may share a prefix; row maps hold -1 and rows outside the table; several lanes may name
one sequence; selections repeat columns and choose ones outside the context; drafts are
trees (sees = ancestors and self) at slots no table names. A pool's slots that the table read
does not name hold NaN (or a sentinel for integer pools), so one that reaches `seen` where
the law says zero shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

HUGE = 2**40
SENTINEL = -999_999  # the NaN of an integer pool


@dataclass(frozen=True, repr=False)
class Case:
    ctor: str
    args: tuple
    kwargs: dict
    ops: tuple  # (name, args) pairs, applied in order
    values: np.ndarray
    pool: np.ndarray

    @property
    def tabled(self):
        return self.ctor in ("make", "rows")

    def _repr_pretty_(self, p, cycle):  # Hypothesis prints a failing case as code
        p.text(repr(self))

    def __repr__(self):
        def show(x):
            if isinstance(x, np.ndarray):
                return f"np.array({x.tolist()!r}, dtype=np.{x.dtype})"
            if isinstance(x, (list, tuple)) and x and isinstance(x[0], tuple):
                return "[" + ", ".join(f"({m}, {show(b)})" for m, b in x) + "]"
            return repr(x)

        args = [show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs.items()]
        chain = "".join(f".{name}({', '.join(show(a) for a in a_)})" for name, a_ in self.ops)
        return (
            f"ix = ci.{self.ctor}({', '.join(args)}){chain}\n"
            f"values = {show(self.values)}\npool = {show(self.pool)}"
        )


def build(api, case):
    """The index `case` describes, built by `api` (cacheidx, or tests/reference.py)."""
    index = getattr(api, case.ctor)(*case.args, **case.kwargs)
    for name, args in case.ops:
        index = getattr(index, name)(*args)
    return index


def i64(x):
    return np.array(x, dtype=np.int64)


def mostly(usual, rare):
    """usual three times in four, rare otherwise."""
    return st.one_of(usual, usual, usual, rare)


# -- tables -----------------------------------------------------------------------------------


@st.composite
def tables(draw, rows, width, spare=4):
    """A table [rows][width] of distinct slots of a pool, with holes and slots that address
    nothing; rows may share a prefix. Returns (table, pool slots)."""
    slots = rows * width + draw(st.integers(0, spare))
    perm = draw(st.permutations(range(slots)))
    table = [list(perm[r * width : (r + 1) * width]) for r in range(rows)]
    if rows > 1 and draw(st.booleans()):  # two sequences share a prefix, at the same columns
        q, r = draw(st.permutations(range(rows)))[:2]
        k = draw(st.integers(1, width))
        table[r][:k] = table[q][:k]
    nothing = st.sampled_from(["hole", "hole", "past", "huge", "negative"])
    for r in range(rows):
        for j in range(width):
            kind = draw(st.one_of(st.just("slot"), st.just("slot"), nothing))
            if kind == "hole":
                table[r][j] = -1
            elif kind == "past":
                table[r][j] = slots + draw(st.integers(0, 2))
            elif kind == "huge":
                table[r][j] = HUGE
            elif kind == "negative":
                table[r][j] = draw(st.sampled_from([-2, -3, -slots, -HUGE]))
    return table, slots


def named(table, slots):
    return {s for line in table for s in line if 0 <= s < slots}


# -- positions --------------------------------------------------------------------------------

pads = st.sampled_from([-1, -1, -1, -2, -7])


@st.composite
def chunk(draw, seq, start):
    """A lane of n tokens at start .. start + n - 1, padded on the left."""
    n = draw(st.integers(0, seq))
    return [draw(pads) for _ in range(seq - n)] + list(range(start, start + n)), start + n


@st.composite
def lane_positions(draw, seq, width, follows):
    """A lane's positions: a chunk (after the previous lane of its sequence, `follows`, or
    anywhere) or arbitrary positions."""
    mode = draw(st.sampled_from(["chunk", "chunk", "chunk", "any"]))
    if mode == "any":
        return [draw(st.integers(-3, width + 2)) for _ in range(seq)], None
    start = follows if follows is not None and draw(st.booleans()) else None
    if start is None:
        start = draw(st.integers(0, width + 1))
    return draw(chunk(seq, start))


@st.composite
def tree(draw, seq, pad):
    """Depths and sees of a draft tree over tokens pad .. seq - 1 (ancestors and self)."""
    parent = [None] * seq
    depth = [0] * seq
    sees = [[False] * seq for _ in range(seq)]
    for i in range(pad, seq):
        p = draw(st.integers(pad - 1, i - 1))
        if p >= pad:
            parent[i], depth[i] = p, depth[p] + 1
        a = i
        while a is not None:
            sees[i][a] = True
            a = parent[a]
    if draw(st.integers(0, 5)) == 0:  # now and then, sees of no tree at all
        sees = [[draw(st.booleans()) for _ in range(seq)] for _ in range(seq)]
    return depth, sees


# -- the plan: every, window, select or draft -------------------------------------------------


@st.composite
def plan(draw, ms, drafts):
    """(m, ops before the selection or draft, the extra one: None, 'select' or 'draft').

    drafts: True for a draft always, False for none, None for now and then."""
    ops = []
    m = 1
    if ms and not drafts and draw(st.booleans()):
        m = draw(st.sampled_from(ms))
        ops.append(("every", (m,)))
        if draw(st.integers(0, 4)) == 0:  # every m of an index read in blocks of m is itself
            ops.append(("every", (m,)))
    if draw(st.booleans()):
        ops.insert(draw(st.integers(0, len(ops))), ("window", (draw(st.integers(1, 9)),)))
    if drafts:
        return m, ops, "draft"
    extras = [None, "select"] + (["draft"] if drafts is None and m == 1 else [])
    return m, ops, draw(st.sampled_from(extras))


@st.composite
def column_choices(draw, batch, seq, context):
    """columns [batch, seq, k]: repeats, and columns outside [0, context)."""
    k = draw(st.integers(1, 3))
    out = st.sampled_from([-1, -2, context, context + 1, HUGE, -HUGE])
    column = mostly(st.integers(0, context - 1), out)
    return i64([[[draw(column) for _ in range(k)] for _ in range(seq)] for _ in range(batch)])


@st.composite
def closing(draw, ops, context, batch, seq):
    """Now and then a later window or selection, replacing the earlier one."""
    ops = list(ops)
    if draw(st.integers(0, 4)) == 0:
        ops.append(("window", (draw(st.integers(1, 9)),)))
    if draw(st.integers(0, 6)) == 0:
        ops.append(("select", (draw(column_choices(batch, seq, context)),)))
    return tuple(ops)


# -- values and pools -------------------------------------------------------------------------


@st.composite
def filling(draw, batch, seq, slots, valid, known):
    """values [batch, seq, *row] and pool [slots, *row]: distinct numbers, so a read from the
    wrong place shows; NaN (a sentinel) in every slot outside `known` and in some tokens."""
    dtype = draw(st.sampled_from([np.float64, np.float64, np.float32, np.int64]))
    shape = draw(st.sampled_from([(1,), (1,), (2,), (), (1, 2)]))
    width = int(np.prod(shape, dtype=int))
    blank = SENTINEL if dtype == np.int64 else np.nan
    values = (1000 + np.arange(batch * seq * width)).reshape((batch, seq) + shape).astype(dtype)
    pool = -(1 + np.arange(slots * width)).reshape((slots,) + shape).astype(dtype)
    for s in range(slots):
        if s not in known:
            pool[s] = blank
    mode = draw(st.sampled_from(["none", "padding", "some"]))
    for b in range(batch):
        for i in range(seq):
            if (mode == "padding" and not valid[b][i]) or (mode == "some" and draw(st.booleans())):
                values[b, i] = blank
    return values, pool


# -- the constructors -------------------------------------------------------------------------


@st.composite
def tabled_cases(draw, drafts=None):
    """ci.make with random tables, blocks, row maps and positions."""
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    has_row = draw(st.booleans())
    nrows = draw(st.integers(1, 4)) if has_row else batch
    width = draw(st.integers(1, 8))
    table, slots = draw(tables(nrows, width))
    ms = draw(st.lists(st.sampled_from([2, 3, 4]), unique=True, max_size=2))
    blocks = {}
    for m in ms:
        blocks[m] = draw(tables(nrows, draw(st.integers(1, (width + m - 1) // m + 1))))
    row = list(range(batch))
    if has_row:
        outside = st.sampled_from([-1, -1, nrows, nrows + 1, -2, HUGE])
        row = [draw(mostly(st.integers(0, nrows - 1), outside)) for _ in range(batch)]
    m, ops, extra = draw(plan(ms, drafts))
    read, read_slots = (table, slots) if m == 1 else blocks[m]
    read_width = len(read[0])

    pos, follows = [], {}
    draft_slots = None
    if extra == "draft":
        # the table holds each sequence up to the call; the draft's slots are ones it leaves
        # (fresh slots start past the table's 'past' entries, which the pool now holds)
        spare = [s for s in range(read_slots) if s not in named(table, read_slots)]
        fresh = spare + list(range(read_slots + 3, read_slots + 3 + batch * seq))
        fresh = draw(st.permutations(fresh))
        read_slots += 3 + batch * seq
        draft_slots, sees = [], []
        for b in range(batch):
            pad = draw(st.integers(0, seq - 1))
            base = follows.get(row[b])
            if base is None or draw(st.booleans()):
                base = draw(st.integers(0, width))
            depth, lane_sees = draw(tree(seq, pad))
            pos.append([draw(pads) for _ in range(pad)] + [base + d for d in depth[pad:]])
            follows[row[b]] = base + max(depth) + 1
            nothing = st.sampled_from([-1, -1, read_slots, HUGE, -2])
            draft_slots.append(
                [draw(mostly(st.just(fresh[b * seq + i]), nothing)) for i in range(seq)]
            )
            sees.append(lane_sees)
        ops.append(("draft", (i64(draft_slots), np.array(sees, dtype=bool))))
    else:
        for b in range(batch):
            lane, end = draw(lane_positions(seq, width, follows.get(row[b])))
            if end is not None:
                follows[row[b]] = end
            pos.append(lane)
        if extra == "select":
            ops.append(("select", (draw(column_choices(batch, seq, read_width)),)))
    context = read_width + (seq if extra == "draft" else 0)
    if extra != "draft":
        ops = list(draw(closing(ops, context, batch, seq)))
    else:
        ops = ops + ([("window", (draw(st.integers(1, 9)),))] if draw(st.booleans()) else [])

    valid = [[0 <= row[b] < nrows and t >= 0 for t in pos[b]] for b in range(batch)]
    values, pool = draw(filling(batch, seq, read_slots, valid, named(read, read_slots)))
    kwargs = {}
    if has_row:
        kwargs["row"] = i64(row)
    if blocks:
        kwargs["every"] = [(m, i64(blocks[m][0])) for m in sorted(blocks)]
    return Case("make", (i64(pos), i64(table)), kwargs, tuple(ops), values, pool)


@st.composite
def rows_cases(draw, drafts=None):
    """ci.rows: contiguous runs of slots, lanes padded on the left, maybe blocks."""
    context = draw(st.integers(1, 8))
    lens = draw(st.lists(st.integers(0, context), min_size=1, max_size=3))
    if max(lens) == 0:
        lens[0] = draw(st.integers(1, context))
    batch, seq = len(lens), max(lens)
    ms = draw(st.lists(st.sampled_from([2, 3, 4]), unique=True, max_size=2))
    m, ops, extra = draw(plan(ms, drafts))
    read_width = context if m == 1 else (context + m - 1) // m
    slots = batch * read_width
    if extra == "draft":
        fresh = draw(st.permutations(range(slots, slots + batch * seq)))
        nothing = st.sampled_from([-1, HUGE, -2])
        draft_slots = [
            [draw(mostly(st.just(fresh[b * seq + i]), nothing)) for i in range(seq)]
            for b in range(batch)
        ]
        sees = [draw(tree(seq, seq - n))[1] for n in lens]
        ops.append(("draft", (i64(draft_slots), np.array(sees, dtype=bool))))
        if draw(st.booleans()):
            ops.append(("window", (draw(st.integers(1, 9)),)))
    else:
        if extra == "select":
            ops.append(("select", (draw(column_choices(batch, seq, read_width)),)))
        ops = list(draw(closing(ops, read_width, batch, seq)))
    total = slots + (batch * seq if extra == "draft" else 0) + draw(st.integers(0, 2))
    valid = [[i >= seq - n for i in range(seq)] for n in lens]
    values, pool = draw(filling(batch, seq, total, valid, set(range(slots))))
    return Case("rows", (context, lens), {"every": tuple(ms)}, tuple(ops), values, pool)


@st.composite
def whole_cases(draw):
    """ci.whole (maybe with lens) and ci.packed: every (whole), window, select."""
    packed = draw(st.booleans())
    seq = draw(st.integers(1, 5))
    if packed:
        batch = draw(st.integers(1, 3))
        lens = []
        for _ in range(batch):
            lane, room = [], seq
            for _ in range(draw(st.integers(0, 3))):
                n = draw(st.integers(0, room))
                lane.append(n)
                room -= n
            lens.append(lane)
        ctor, args, kwargs = "packed", (seq, lens), {}
        valid = [[i >= seq - sum(lane) for i in range(seq)] for lane in lens]
    else:
        batch = draw(st.integers(1, 3))
        lens = draw(st.none() | st.lists(st.integers(0, seq), min_size=batch, max_size=batch))
        ctor, args = "whole", (batch, seq)
        kwargs = {} if lens is None else {"lens": lens}
        valid = [[i >= seq - n for i in range(seq)] for n in (lens or [seq] * batch)]
    ms = [] if packed else [1, 2, 3, 4]
    m, ops, extra = draw(plan(ms, drafts=False))
    context = seq if m == 1 else (seq + m - 1) // m
    if extra == "select":
        ops.append(("select", (draw(column_choices(batch, seq, context)),)))
    ops = draw(closing(ops, context, batch, seq))
    values, pool = draw(filling(batch, seq, draw(st.integers(1, 3)), valid, {0}))
    return Case(ctor, args, kwargs, ops, values, pool)


def cases(kinds=("make", "rows", "whole"), drafts=None):
    """Random cases of the named constructors ('whole' covers whole and packed); drafts: True
    for drafts alone (make, rows), False for none, None for now and then."""
    pick = {
        "make": tabled_cases(drafts),
        "rows": rows_cases(drafts),
        "whole": whole_cases(),
    }
    return st.one_of(*[pick[k] for k in kinds if not (drafts and k == "whole")])
