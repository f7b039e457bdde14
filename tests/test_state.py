"""cacheidx.state against a slow NumPy reference written here from its laws (1 to 4), on random
tables, row maps, paddings, block sizes and chunk splits; and each bad input's error.

The reference walks lanes and tokens one by one and shares no code with cacheidx.state. The
conformance suite (cacheidx/conformance/state.py) holds the same laws on every backend and
compiled mode in small cases a reader checks by hand; here Hypothesis looks for the case
nobody wrote (derandomized under CI=true: tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import i64, pads, tables

import cacheidx as ci
from cacheidx import state

WIDTH = 2  # a state's row: two numbers, enough to tell rows apart


# -- the reference ------------------------------------------------------------------------------
def lane_rows(pos, row, rows):
    """Each lane's sequence, or None for a lane of padding throughout (a row of -1 or outside
    the table)."""
    if row is None:
        return list(range(len(pos)))
    return [int(r) if 0 <= r < rows else None for r in row]


def valid_tokens(pos, r):
    return [] if r is None else [i for i, p in enumerate(pos) if p >= 0]


def ref_start(pos, row, rows, m, blocks, running, snaps):
    """Law 1, lane by lane."""
    out = np.zeros((len(pos), *running.shape[1:]), running.dtype)
    for b, r in enumerate(lane_rows(pos, row, rows)):
        tokens = valid_tokens(pos[b], r)
        if not tokens:
            continue
        p0 = min(pos[b][i] for i in tokens)
        if p0 == 0:
            continue
        if m > 1 and p0 % m == 0 and p0 // m - 1 < len(blocks[r]):
            s = blocks[r][p0 // m - 1]
            if 0 <= s < len(snaps):
                out[b] = snaps[s]
                continue
        if r < len(running):
            out[b] = running[r]
    return out


def ref_closing(pos, row, rows, m):
    """Law 4: the tokens whose position closes a block, in order, -1 past the last."""
    k = -(-len(pos[0]) // m) if m > 1 else 0
    tokens = np.full((len(pos), k), -1, np.int64)
    for b, r in enumerate(lane_rows(pos, row, rows)):
        closing = [i for i in valid_tokens(pos[b], r) if m > 1 and (pos[b][i] + 1) % m == 0]
        tokens[b, :len(closing)] = closing
    return tokens


def ref_store(pos, row, rows, m, blocks, running, snaps, last, closed):
    """Law 2: the running slot gets ``last``, each closed block's slot its state."""
    running, snaps = running.copy(), snaps.copy()
    tokens = ref_closing(pos, row, rows, m)
    for b, r in enumerate(lane_rows(pos, row, rows)):
        valid = valid_tokens(pos[b], r)
        if not valid:
            continue
        if r < len(running):
            running[r] = last[b]
        if m == 1:
            continue
        if closed is None:  # only the last token may close a block: its state is last
            p1 = max(pos[b][i] for i in valid)
            stores = [(p1, last[b])] if (p1 + 1) % m == 0 else []
        else:
            stores = [(pos[b][i], closed[b, c]) for c, i in enumerate(tokens[b]) if i >= 0]
        for p, value in stores:
            if p // m < len(blocks[r]) and 0 <= blocks[r][p // m] < len(snaps):
                snaps[blocks[r][p // m]] = value
    return running, snaps


def snapshot_targets(pos, row, rows, m, blocks, n_snap):
    """The snapshot slots a call stores at (to keep write targets distinct: law 3)."""
    out = []
    for b, r in enumerate(lane_rows(pos, row, rows)):
        for i in valid_tokens(pos[b], r):
            p = pos[b][i]
            if m > 1 and (p + 1) % m == 0 and p // m < len(blocks[r]) \
                    and 0 <= blocks[r][p // m] < n_snap:
                out.append(blocks[r][p // m])
    return out


# -- random calls ---------------------------------------------------------------------------------
@st.composite
def lane(draw, seq, context):
    """A chunk of n consecutive positions from p0, padded on the left, the right or both."""
    n = draw(st.integers(0, seq))
    p0 = draw(st.integers(0, context + 1))
    before = draw(st.integers(0, seq - n))
    return ([draw(pads) for _ in range(before)] + list(range(p0, p0 + n))
            + [draw(pads) for _ in range(seq - n - before)])


def values(draw, shape, nan=True):
    """Small integers, NaN now and then: a state the reference copies and compares exactly."""
    elements = st.integers(-9, 9).map(float)
    if nan:
        elements = st.one_of(elements, elements, elements, st.just(float("nan")))
    flat = draw(st.lists(elements, min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    return np.asarray(flat, np.float32).reshape(shape)


@st.composite
def calls(draw):
    """One call: positions, a row map or none, block size, tables, pools, states."""
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    context = draw(st.integers(1, 8))
    mapped = draw(st.booleans())
    rows = draw(st.integers(1, 4)) if mapped else batch
    pos = [draw(lane(seq, context)) for _ in range(batch)]
    row = None
    if mapped:  # distinct rows (law 3), and now and then -1 or one outside the table
        order = draw(st.permutations(range(rows + batch)))[:batch]
        row = [r if r < rows else draw(st.sampled_from([-1, rows, rows + 3])) for r in order]
    m = draw(st.sampled_from([1, 2, 3, 4]))
    blocks, n_snap = draw(tables(rows, draw(st.integers(1, 4)))) if m > 1 else ([], 0)
    n_snap = draw(st.integers(0, n_snap + 1)) if m > 1 else 0
    n_run = draw(st.integers(0, rows + 1))
    assume(len(set(t := snapshot_targets(pos, row, rows, m, blocks, n_snap))) == len(t))
    read_blocks = m > 1 and draw(st.booleans())  # the index read through every(m), or not
    window = draw(st.one_of(st.none(), st.integers(1, 9)))
    running = values(draw, (n_run, WIDTH))
    snaps = values(draw, (n_snap, WIDTH))
    last = values(draw, (batch, WIDTH), nan=False)
    k = -(-seq // m)
    closed = values(draw, (batch, k, WIDTH), nan=False) if draw(st.booleans()) else None
    return dict(pos=pos, row=row, rows=rows, context=context, m=m, blocks=blocks,
                read_blocks=read_blocks, window=window, running=running, snaps=snaps,
                last=last, closed=closed)


def build(c, xp="numpy"):
    be = ci.backends.get(xp)
    to = lambda a: be.from_host(i64(a))  # noqa: E731
    table = np.arange(c["rows"] * c["context"]).reshape(c["rows"], c["context"])
    every = [(c["m"], to(c["blocks"]))] if c["m"] > 1 else None
    ix = ci.make(to(c["pos"]), to(table), row=None if c["row"] is None else to(c["row"]),
                 every=every)
    if c["read_blocks"]:
        ix = ix.every(c["m"])
    return ix if c["window"] is None else ix.window(c["window"])


def host(x):
    return np.asarray(x) if not hasattr(x, "_array") else np.asarray(x._array)


@pytest.mark.parametrize("xp", ["numpy", "strict"])
@given(c=calls())
def test_start_closing_store_equal_the_reference(xp, c):
    be = ci.backends.get(xp)
    ix = build(c, xp)
    arr = lambda a: be.from_host(a, be.xp.float32)  # noqa: E731
    pools = state.Pools(arr(c["running"]), arr(c["snaps"]))
    args = (c["pos"], c["row"], c["rows"], c["m"])
    got = host(state.start(ix, pools))
    want = ref_start(*args, c["blocks"], c["running"], c["snaps"])
    np.testing.assert_array_equal(got, want, err_msg="start")
    tokens, ok = state.closing(ix)
    want_tokens = ref_closing(*args)
    np.testing.assert_array_equal(host(tokens), want_tokens, err_msg="closing tokens")
    np.testing.assert_array_equal(host(ok), want_tokens >= 0, err_msg="closing gate")
    closed = None if c["closed"] is None else arr(c["closed"])
    if c["m"] == 1 and closed is not None:
        closed = arr(np.zeros((len(c["pos"]), 0, WIDTH), np.float32))
    after = state.store(ix, arr(c["last"]), pools, closed)
    want_run, want_snaps = ref_store(*args, c["blocks"], c["running"], c["snaps"], c["last"],
                                     c["closed"])
    np.testing.assert_array_equal(host(after.running), want_run, err_msg="running pool")
    np.testing.assert_array_equal(host(after.snapshots), want_snaps, err_msg="snapshots")
    # the caller's pools are never changed without donate
    np.testing.assert_array_equal(host(pools.running), c["running"])
    np.testing.assert_array_equal(host(pools.snapshots), c["snaps"])


# -- a prompt fed in chunks: a toy recurrence through start, closing and store -----------------
def scratch(x):
    """The state after each input of a sequence, from zero: s <- s/2 + x (exact on small
    integers, so any order of the same arithmetic agrees bit for bit)."""
    s, out = np.zeros(WIDTH, np.float32), []
    for v in x:
        s = s * np.float32(0.5) + v
        out.append(s)
    return out


def layer(ix, x, pools):
    """The toy layer: start, a token at a time (padding keeps the state), closing, store."""
    s = np.array(state.start(ix, pools))
    states = np.zeros((*ix.pos.shape, WIDTH), np.float32)
    valid = np.asarray(ci.masks.valid(ix))
    for i in range(ix.seq):
        s = np.where(valid[:, i:i + 1], s * np.float32(0.5) + x[:, i], s)
        states[:, i] = s
    tokens, ok = (np.asarray(a) for a in state.closing(ix))
    closed = np.where(ok[..., None], np.take_along_axis(
        states, np.where(ok, tokens, 0)[..., None], axis=1), 0).astype(np.float32)
    return states, state.store(ix, s, pools, closed)


@given(lens=st.lists(st.integers(1, 10), min_size=1, max_size=3), m=st.integers(2, 4),
       data=st.data())
def test_a_prompt_fed_in_chunks_equals_it_fed_whole(lens, m, data):
    """Every lane feeds its prompt in chunks of its own sizes, padded left or right to the
    call's longest: every state, every snapshot and the running state equal those from scratch
    (and a lane that has finished or not started is padding, its state untouched)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    batch, context = len(lens), 10
    width = -(-context // m)
    prompts = [rng.integers(-5, 6, (n, WIDTH)).astype(np.float32) for n in lens]
    want = [scratch(p) for p in prompts]
    table = np.arange(batch * context).reshape(batch, context)
    blocks = np.arange(batch * width).reshape(batch, width)
    pools = state.Pools(np.full((batch, WIDTH), np.nan, np.float32),
                        np.full((batch * width, WIDTH), np.nan, np.float32))
    fed = [0] * batch
    while any(f < n for f, n in zip(fed, lens)):
        # every call feeds the first unfinished lane one token at least (no call of padding
        # alone, so the loop ends), the others a chunk of any size or none
        first = min(b for b in range(batch) if fed[b] < lens[b])
        sizes = [data.draw(st.integers(int(b == first), n - f))
                 for b, (f, n) in enumerate(zip(fed, lens))]
        seq = max(max(sizes), 1)
        pos = np.full((batch, seq), -1, np.int64)
        x = np.full((batch, seq, WIDTH), np.nan, np.float32)
        for b, k in enumerate(sizes):
            at = data.draw(st.integers(0, seq - k))  # the chunk's place among its padding
            pos[b, at:at + k] = np.arange(fed[b], fed[b] + k)
            x[b, at:at + k] = prompts[b][fed[b]:fed[b] + k]
        ix = ci.make(pos, table, every=[(m, blocks)])
        before = pools
        states, pools = layer(ix, x, pools)
        for b, k in enumerate(sizes):
            for i in np.flatnonzero(pos[b] >= 0):
                np.testing.assert_array_equal(states[b, i], want[b][pos[b, i]])
            if k == 0:  # a lane of padding: its running slot is as it was
                np.testing.assert_array_equal(pools.running[b], before.running[b])
            fed[b] += k
    for b, n in enumerate(lens):
        np.testing.assert_array_equal(pools.running[b], want[b][n - 1])
        for j in range(width):
            got = pools.snapshots[blocks[b, j]]
            if j * m + m - 1 < n:
                np.testing.assert_array_equal(got, want[b][j * m + m - 1])
            else:
                assert np.isnan(got).all(), f"lane {b}'s block {j} was stored, never closed"


def test_a_lane_resumes_from_a_snapshot_another_sequence_stored():
    """A prefix hit: sequence 1 names sequence 0's first two blocks, starts at position 4
    from its snapshot (its running slot holds NaN) and ends as from scratch."""
    m, prompt = 2, np.arange(14, dtype=np.float32).reshape(7, WIDTH) % 5
    table = np.arange(16).reshape(2, 8)
    blocks = np.array([[0, 1, 2, 3], [0, 1, 4, 5]])
    pools = state.Pools(np.full((2, WIDTH), np.nan, np.float32),
                        np.full((6, WIDTH), np.nan, np.float32))
    ix = ci.make(np.array([[0, 1, 2, 3], [-1, -1, -1, -1]]), table, every=[(m, blocks)])
    _, pools = layer(ix, np.concatenate([prompt[None, :4], np.full((1, 4, WIDTH), np.nan,
                                                                   np.float32)]), pools)
    ix = ci.make(np.array([[-1, -1, -1], [4, 5, 6]]), table, every=[(m, blocks)])
    x = np.concatenate([np.full((1, 3, WIDTH), np.nan, np.float32), prompt[None, 4:]])
    states, pools = layer(ix, x, pools)
    want = scratch(prompt)
    np.testing.assert_array_equal(states[1], np.stack(want[4:]))
    np.testing.assert_array_equal(pools.running[1], want[6])
    np.testing.assert_array_equal(pools.snapshots[4], want[5])
    np.testing.assert_array_equal(pools.running[0], want[3])


# -- bad input ------------------------------------------------------------------------------------
def plain():
    """An index of 2 lanes of 3 tokens with a table of blocks of 2, and its pools."""
    ix = ci.rows(6, [3, 2], every=[2])
    return ix, state.Pools(np.zeros((2, WIDTH), np.float32), np.zeros((6, WIDTH), np.float32))


def raises(error, fn, call, *words):
    with pytest.raises(error) as got:
        call()
    text = str(got.value)
    assert text.startswith(f"cacheidx.{fn}: "), text
    for w in words:
        assert w in text, text


@pytest.mark.parametrize("fn", ["start", "closing", "store"])
def test_a_draft_and_a_selection_raise(fn):
    ix, pools = plain()
    base = ci.rows(6, [3, 2])
    drafted = base.draft(i64([[6, 7, 8], [9, 10, 11]]), np.tril(np.ones((2, 3, 3), bool)))
    selected = ix.select(i64(np.zeros((2, 3, 1))))
    for bad, word in ((drafted, "draft"), (selected, "selects columns")):
        call = {"start": lambda bad=bad: state.start(bad, pools),
                "closing": lambda bad=bad: state.closing(bad),
                "store": lambda bad=bad: state.store(bad, np.zeros((2, WIDTH), np.float32),
                                                     pools)}[fn]
        raises(ValueError, f"state.{fn}", call, word)


def test_two_tables_of_blocks_raise_unless_one_is_read():
    ix = ci.rows(6, [3, 2], every=[2, 3])
    _, pools = plain()
    for fn, call in (("start", lambda: state.start(ix, pools)),
                     ("closing", lambda: state.closing(ix)),
                     ("store", lambda: state.store(ix, np.zeros((2, WIDTH), np.float32), pools)),
                     ("every", lambda: state.every(ix))):
        raises(ValueError, f"state.{fn}", call, "[2, 3]")
    assert state.every(ix.every(3)) == 3
    assert state.closing(ix.every(3))[0].shape == (2, 1)


def test_bad_pools_raise():
    ix, pools = plain()
    f32 = np.float32
    for bad, error, words in (
            ((np.zeros((2, WIDTH), f32),), TypeError, ("state.Pools", "tuple")),
            ([pools.running, pools.snapshots], TypeError, ("state.Pools", "list")),
            (state.Pools(pools.running, np.zeros((6, 3), f32)), ValueError, ("[2]", "[3]")),
            (state.Pools(pools.running, np.zeros((6, WIDTH), np.float64)), TypeError,
             ("float32", "float64")),
            (state.Pools(np.zeros((), f32), pools.snapshots), ValueError, ("running", "0-d")),
            (state.Pools(pools.running, [[0.0, 0.0]]), TypeError, ("snapshots", "list"))):
        raises(error, "state.start", lambda bad=bad: state.start(ix, bad), *words)
        raises(error, "state.store",
               lambda bad=bad: state.store(ix, np.zeros((2, WIDTH), f32), bad), *words)


def test_bad_states_raise():
    ix, pools = plain()
    f32 = np.float32
    last, closed = np.zeros((2, WIDTH), f32), np.zeros((2, 2, WIDTH), f32)
    for kw, error, words in (
            ({"last": np.zeros((3, WIDTH), f32)}, ValueError, ("last", "[2, 2]", "[3, 2]")),
            ({"last": np.zeros((2, WIDTH, 1), f32)}, ValueError, ("last", "[2, 2, 1]")),
            ({"last": np.zeros((2, WIDTH), np.float64)}, TypeError, ("last", "float64")),
            ({"last": [[0.0, 0.0]] * 2}, TypeError, ("last", "list")),
            ({"closed": np.zeros((2, 3, WIDTH), f32)}, ValueError,
             ("closed", "[2, 2, 2]", "[2, 3, 2]")),
            ({"closed": np.zeros((2, 2, WIDTH), np.int64)}, TypeError, ("closed", "int64"))):
        args = {"last": last, "closed": closed, **kw}
        raises(error, "state.store",
               lambda a=args: state.store(ix, a["last"], pools, a["closed"]), *words)
    # without a table of blocks closing names no token, and closed is not read
    bare = ci.rows(6, [3, 2])
    assert state.closing(bare)[0].shape == (2, 0)
    state.store(bare, last, pools, np.zeros((2, 5, WIDTH), f32))


def test_a_pool_of_another_library_raises():
    torch = pytest.importorskip("torch")
    ix, pools = plain()
    bad = state.Pools(torch.zeros(2, WIDTH), pools.snapshots)
    raises(TypeError, "state.start", lambda: state.start(ix, bad), "numpy", "Tensor")


def test_zeros():
    pools = state.zeros(3, 4, (2, 5), xp="numpy")
    assert pools.running.shape == (3, 2, 5) and pools.snapshots.shape == (4, 2, 5)
    assert pools.running.dtype == np.float32 and not pools.running.any()
    raises(ValueError, "state.zeros", lambda: state.zeros(-1, 0, (2,)), "rows", "-1")
    raises(TypeError, "state.zeros", lambda: state.zeros(1, 1.5, (2,)), "snapshots", "1.5")
