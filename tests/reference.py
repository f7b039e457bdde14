"""A slow reference for the cache index, written from the laws of spec/cache-index.txt.

Plain Python loops over nested lists, one law per helper and no cleverness: it is the second
opinion the core is compared with (tests/test_against_reference.py). It was written from the
spec and notes/decisions.md alone, never from cacheidx/.

It mirrors the core's API (`make`, `rows`, `whole`, `packed` and an index's methods), so one
recipe builds both. NumPy only holds arrays: the pools' rows and the results. Its errors are
sanity checks; the error laws are tested elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


def _lists(x):
    return None if x is None else np.asarray(x).tolist()


def inside(i, n):
    """An index addresses something only inside [0, n): -1, n and beyond, other negatives not."""
    return 0 <= i < n


def stands(j, m):
    """Where column j stands: at its position (m = 1), or at its block's last position."""
    return j * m + m - 1


def sees(t, s, w):
    """A token at t sees a column standing at s: at or before t and, under a window w, inside it."""
    return s <= t and (w is None or s > t - w)


def left_padded(seq, lens):
    """Positions of lanes of lens tokens padded on the left to seq (rows, whole)."""
    return [[i - (seq - n) if i >= seq - n else -1 for i in range(seq)] for n in lens]


@dataclass(frozen=True)
class Ref:
    """An index as plain data.

    kind: 'whole' | 'packed' | 'tabled'; pos [batch][seq]; table [rows][width] (tabled);
    row [batch] or None; blocks {m: [rows][width_m]}; m the block size read (1 = positions);
    w the window or None; columns [batch][seq][k] or None; draft_slots [batch][seq] and
    draft_sees [batch][seq][seq] or None.
    """

    kind: str
    pos: list
    table: list | None = None
    row: list | None = None
    blocks: dict = field(default_factory=dict)
    m: int = 1
    w: int | None = None
    columns: list | None = None
    draft_slots: list | None = None
    draft_sees: list | None = None

    # -- shape --------------------------------------------------------------------------------

    @property
    def batch(self):
        return len(self.pos)

    @property
    def seq(self):
        return len(self.pos[0])

    def read_table(self):
        """The table the index reads and stores through: positions', or blocks of m."""
        return self.table if self.m == 1 else self.blocks[self.m]

    def width(self):
        """Columns of the table read (tabled), or of the lane (whole, packed)."""
        if self.kind == "tabled":
            return len(self.read_table()[0])
        return self.seq if self.m == 1 else (self.seq + self.m - 1) // self.m

    @property
    def context(self):
        if self.draft_slots is not None:
            return self.width() + self.seq
        return self.width()

    # -- derived indices ----------------------------------------------------------------------

    def window(self, w):
        return replace(self, w=int(w))

    def select(self, columns):
        if self.draft_slots is not None:
            raise ValueError("reference select: a draft")
        return replace(self, columns=_lists(columns))

    def draft(self, slots, sees):
        if self.kind != "tabled" or self.m != 1 or self.columns is not None:
            raise ValueError("reference draft: whole, blocks or a selection")
        return replace(self, draft_slots=_lists(slots), draft_sees=_lists(sees))

    def every(self, m):
        if m == self.m:
            return self
        if self.m != 1 or self.columns is not None or self.draft_slots is not None:
            raise ValueError("reference every: already blocks, a selection or a draft")
        if self.kind == "packed" or (self.kind == "tabled" and m not in self.blocks):
            raise ValueError(f"reference every: no blocks of {m}")
        return replace(self, m=m)

    def advance(self):
        """Law: seq 1, one past the lane's greatest position, a lane of padding -> 0.

        Decision 10: max(greatest position of the lane, -1) + 1, from the positions alone,
        so a lane whose row is -1 still counts its positions."""
        if self.kind != "tabled":
            raise ValueError("reference advance: a whole index")
        pos = [[max(max(lane), -1) + 1] for lane in self.pos]
        return replace(self, pos=pos, columns=None, draft_slots=None, draft_sees=None)

    # -- tokens -------------------------------------------------------------------------------

    def lane_row(self, b):
        return b if self.row is None else self.row[b]

    def valid(self, b, i):
        """A token is valid when its lane names a row of the table and its position is >= 0."""
        if self.kind == "tabled" and not inside(self.lane_row(b), len(self.table)):
            return False
        return self.pos[b][i] >= 0

    def least(self, b):
        """The least position of the lane's valid tokens (a draft sees the table below it)."""
        return min(self.pos[b][i] for i in range(self.seq) if self.valid(b, i))

    def positions(self):
        """Law: positions clamped to 0 and the last column of the positions' table (seq - 1)."""
        last = len(self.table[0]) - 1 if self.kind == "tabled" else self.seq - 1
        return np.array([[min(max(t, 0), last) for t in lane] for lane in self.pos], np.int64)

    # -- which columns a token sees -----------------------------------------------------------

    def column_seen(self, b, i, j):
        """Whether token i of lane b sees column j (False outside [0, context))."""
        if not inside(j, self.context) or not self.valid(b, i):
            return False
        t = self.pos[b][i]
        if self.kind != "tabled" and self.m == 1:
            # whole, packed: column j is token j of the lane, seen within its own sequence
            same = j - self.pos[b][j] == i - t
            return self.valid(b, j) and same and sees(t, self.pos[b][j], self.w)
        if self.draft_slots is None:
            return sees(t, stands(j, self.m), self.w)
        width = self.width()
        if j < width:
            return j < self.least(b) and sees(t, j, self.w)
        k = j - width
        return (
            self.valid(b, k) and bool(self.draft_sees[b][i][k]) and sees(t, self.pos[b][k], self.w)
        )

    def mask(self):
        if self.columns is None:
            out = [
                [[self.column_seen(b, i, j) for j in range(self.context)] for i in range(self.seq)]
                for b in range(self.batch)
            ]
            shape = (self.batch, self.seq, self.context)
        else:
            out = [
                [[self.column_seen(b, i, c) for c in self.columns[b][i]] for i in range(self.seq)]
                for b in range(self.batch)
            ]
            shape = (self.batch, self.seq, len(self.columns[0][0]))
        return np.array(out, dtype=bool).reshape(shape)

    # -- stores and reads ---------------------------------------------------------------------

    def target(self, b, i):
        """The slot token i of lane b stores at, or None: its own column, the draft's slot."""
        if self.kind != "tabled" or not self.valid(b, i):
            return None
        if self.draft_slots is not None:
            return self.draft_slots[b][i]
        t = self.pos[b][i]
        if (t + 1) % self.m:
            return None  # only a block's last token stores
        j = t // self.m
        if j >= self.width():
            return None  # past the last column
        return self.read_table()[self.lane_row(b)][j]

    def read_slot(self, b, j):
        """The slot column j of lane b reads from pool', or None where it reads no slot."""
        r = self.lane_row(b)
        if self.kind != "tabled" or j >= self.width() or not inside(r, len(self.table)):
            return None
        return self.read_table()[r][j]

    def column_value(self, b, j, values, pool, zero):
        """What column j of lane b holds before zeroing: pool'[slot], a draft token, a token."""
        if self.kind == "tabled":
            if j >= self.width():
                return values[b, j - self.width()]
            slot = self.read_slot(b, j)
            return pool[slot] if inside(slot, len(pool)) else zero
        if self.m == 1:
            return values[b, j]
        for k in range(self.seq):  # whole under every: the token closing block j, if any
            if self.valid(b, k) and self.pos[b][k] == stands(j, self.m):
                return values[b, k]
        return zero

    def extend(self, values, pool, donate=False):
        """Law: pool' is pool with the tokens' stores; seen reads pool', zero where unseen."""
        values, pool = np.asarray(values), np.asarray(pool)
        new = pool.copy()
        for b in range(self.batch):
            for i in range(self.seq):
                slot = self.target(b, i)
                if slot is not None and inside(slot, len(new)):
                    new[slot] = values[b, i]
        dtype = values.dtype if self.kind != "tabled" else np.result_type(values, pool)
        zero = np.zeros(values.shape[2:], dtype)
        seen = []
        for b in range(self.batch):
            if self.columns is None:
                lane = []
                for j in range(self.context):
                    if any(self.column_seen(b, i, j) for i in range(self.seq)):
                        lane.append(self.column_value(b, j, values, new, zero))
                    else:
                        lane.append(zero)
            else:
                lane = [
                    [
                        self.column_value(b, c, values, new, zero)
                        if self.column_seen(b, i, c)
                        else zero
                        for c in self.columns[b][i]
                    ]
                    for i in range(self.seq)
                ]
            seen.append(lane)
        lead = (self.batch, self.context) if self.columns is None else self.mask().shape
        return np.array(seen, dtype=dtype).reshape(lead + values.shape[2:]), new

    # -- what the laws leave unspecified ------------------------------------------------------

    def clashes(self, slots):
        """Slots (of a pool of `slots`) that two of the call's stores aim at: which one wins
        is unspecified (law: write targets are distinct, an obligation on the caller)."""
        count = {}
        for b in range(self.batch):
            for i in range(self.seq):
                slot = self.target(b, i)
                if slot is not None and inside(slot, slots):
                    count[slot] = count.get(slot, 0) + 1
        return {slot for slot, n in count.items() if n > 1}

    def unsure(self, slots):
        """(seen entries, pool' slots) whose value the laws leave unspecified: those a clash
        wrote, and the seen entries reading one. Each a bool array of seen's or pool's lead."""
        clash = self.clashes(slots)
        pool_unsure = np.array([s in clash for s in range(slots)], dtype=bool)
        if self.columns is None:
            out = [
                [
                    self.read_slot(b, j) in clash
                    and any(self.column_seen(b, i, j) for i in range(self.seq))
                    for j in range(self.context)
                ]
                for b in range(self.batch)
            ]
            shape = (self.batch, self.context)
        else:
            out = [
                [
                    [
                        self.column_seen(b, i, c) and self.read_slot(b, c) in clash
                        for c in self.columns[b][i]
                    ]
                    for i in range(self.seq)
                ]
                for b in range(self.batch)
            ]
            shape = self.mask().shape
        return np.array(out, dtype=bool).reshape(shape), pool_unsure


# -- constructors -----------------------------------------------------------------------------


def make(pos, table, *, row=None, every=None):
    blocks = {int(m): _lists(b) for m, b in (every or ())}
    return Ref("tabled", _lists(pos), _lists(table), _lists(row), blocks)


def rows(context, lens, *, every=(), xp=None):
    """Lane b owns slots b * context .. b * context + context - 1, and for each m the run of
    c = ceil(context / m) block slots from b * c; lanes padded on the left to the longest."""
    lens = list(lens)
    table = [[b * context + j for j in range(context)] for b in range(len(lens))]
    blocks = {}
    for m in every:
        c = (context + m - 1) // m
        blocks[m] = [[b * c + j for j in range(c)] for b in range(len(lens))]
    return Ref("tabled", left_padded(max(lens), lens), table, None, blocks)


def whole(batch, seq, *, lens=None, xp=None):
    lens = [seq] * batch if lens is None else list(lens)
    return Ref("whole", left_padded(seq, lens))


def packed(seq, lens, *, xp=None):
    """Lane b holds sequences of lens[b][0], lens[b][1], ... tokens at positions 0 .. n - 1,
    one after another, padded on the left to seq."""
    pos = []
    for lane in lens:
        held = [p for n in lane for p in range(n)]
        pos.append([-1] * (seq - len(held)) + held)
    return Ref("packed", pos)


# The laws by name, as functions of an index.
ref_positions = Ref.positions
ref_mask = Ref.mask
ref_extend = Ref.extend
ref_advance = Ref.advance


def ref_context(index):
    return index.context
