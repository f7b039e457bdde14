"""Small cases of the spec's laws a reader can check by hand, each checked against both the
slow reference (tests/reference.py) and the core, so the reference earns its place as the
yardstick of tests/test_against_reference.py.

Values are one number per token (rows of width 1); a pool's slots that no table names hold
NaN, so any that reaches `seen` where the law says zero shows.
"""

import importlib

import numpy as np
import pytest
import reference

N = np.nan
T, F = True, False


@pytest.fixture(params=["reference", "cacheidx"])
def api(request):
    """The module under test: the slow reference, or the core; both have one API."""
    return reference if request.param == "reference" else importlib.import_module("cacheidx")


def col(*xs):
    """A pool or a lane's values as rows of width 1."""
    return np.array(xs, dtype=np.float64).reshape(len(xs), 1)


def vals(*lanes):
    """values [batch, seq, 1] from one list of numbers per lane."""
    return np.array(lanes, dtype=np.float64)[..., None]


def same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(got, want, equal_nan=True), f"\n{got!r}\n!=\n{want!r}"


def i64(x):
    return np.array(x, dtype=np.int64)


def test_rows_pads_on_the_left_and_clamps_positions(api):
    ix = api.rows(4, [2, 3])
    assert (ix.batch, ix.seq, ix.context) == (2, 3, 4)
    same(ix.positions(), [[0, 0, 1], [0, 1, 2]])
    same(
        ix.mask(),
        [
            [[F, F, F, F], [T, F, F, F], [T, T, F, F]],
            [[T, F, F, F], [T, T, F, F], [T, T, T, F]],
        ],
    )


def test_a_token_stores_at_its_column_and_seen_reads_the_pool_after(api):
    ix = api.rows(4, [2, 3])
    pool = col(*[N] * 8)
    seen, pool2 = ix.extend(vals([10, 11, 12], [20, 21, 22]), pool)
    same(pool2, col(11, 12, N, N, 20, 21, 22, N))
    same(seen, [[[11], [12], [0], [0]], [[20], [21], [22], [0]]])
    same(pool, col(*[N] * 8))  # the caller's pool is untouched


def test_advance_is_one_past_the_lanes_greatest_position(api):
    ix = api.rows(4, [2, 3]).advance()
    assert (ix.batch, ix.seq, ix.context) == (2, 1, 4)
    same(ix.positions(), [[2], [3]])
    same(ix.mask(), [[[T, T, T, F]], [[T, T, T, T]]])
    seen, pool2 = ix.extend(vals([5], [6]), col(11, 12, N, N, 20, 21, 22, N))
    same(pool2, col(11, 12, 5, N, 20, 21, 22, 6))
    same(seen, [[[11], [12], [5], [0]], [[20], [21], [22], [6]]])


def test_a_lane_of_padding_advances_to_position_zero(api):
    ix = api.make(i64([[-1, -1], [3, 4], [1, 2]]), i64([[0, 1], [2, 3]]), row=i64([0, 1, -1]))
    # lane 1 advances to 5, clamped to the table's last column 1; lane 2, whose row is -1,
    # counts its positions alone (notes/decisions.md 10) and is still padding throughout
    same(ix.advance().positions(), [[0], [1], [1]])
    same(ix.advance().mask(), [[[T, F]], [[T, T]], [[F, F]]])


def test_window_sees_the_last_w_positions(api):
    ix = api.make(i64([[3]]), i64([[0, 1, 2, 3]])).window(2)
    same(ix.mask(), [[[F, F, T, T]]])
    seen, pool2 = ix.extend(vals([9]), col(1, 2, 3, 4))
    same(pool2, col(1, 2, 3, 9))
    same(seen, [[[0], [0], [3], [9]]])


def test_slots_outside_the_pool_address_nothing(api):
    # -1 a hole, 2**40 past the pool, -2 another negative (never slot 1 counted from the end)
    ix = api.make(i64([[0, 1, 2, 3]]), i64([[-1, 2**40, -2, 1]]))
    same(ix.mask()[0], np.tril(np.ones((4, 4), bool)))  # holes are still columns
    seen, pool2 = ix.extend(vals([1, 2, 3, 4]), col(N, 7, N))
    same(pool2, col(N, 4, N))
    same(seen, [[[0], [0], [0], [4]]])


def test_lanes_naming_one_sequence_see_each_others_stores(api):
    table = i64([[-1, -1, -1, -1], [0, 1, 2, 3]])
    ix = api.make(i64([[2], [5], [3]]), table, row=i64([1, -1, 1]))
    same(ix.mask(), [[[T, T, T, F]], [[F, F, F, F]], [[T, T, T, T]]])
    seen, pool2 = ix.extend(vals([10], [20], [30]), col(1, 2, N, N))
    same(pool2, col(1, 2, 10, 30))
    same(seen, [[[1], [2], [10], [0]], [[0], [0], [0], [0]], [[1], [2], [10], [30]]])


def test_only_a_blocks_last_token_stores_and_a_block_is_seen_once_closed(api):
    ix = api.rows(4, [4], every=(2,)).every(2)
    assert ix.context == 2
    same(ix.positions(), [[0, 1, 2, 3]])  # positions do not depend on every
    same(ix.mask(), [[[F, F], [T, F], [T, F], [T, T]]])
    seen, pool2 = ix.extend(vals([1, 2, 3, 4]), col(N, N))
    same(pool2, col(2, 4))
    same(seen, [[[2], [4]]])
    same(ix.window(2).mask(), [[[F, F], [T, F], [T, F], [F, T]]])


def test_the_last_block_closes_only_past_the_context(api):
    ix = api.rows(3, [3], every=(2,)).every(2)
    same(ix.mask(), [[[F, F], [T, F], [T, F]]])
    seen, pool2 = ix.extend(vals([1, 2, 3]), col(N, N))
    same(pool2, col(2, N))
    same(seen, [[[2], [0]]])


def test_advance_keeps_blocks_and_window(api):
    ix = api.rows(6, [3], every=(2,)).every(2).window(2).advance()
    same(ix.positions(), [[3]])
    same(ix.mask(), [[[F, T, F]]])
    seen, pool2 = ix.extend(vals([7]), col(1, N, N))
    same(pool2, col(1, 7, N))
    same(seen, [[[0], [7], [0]]])


def test_packed_tokens_see_their_own_sequence_only(api):
    ix = api.packed(6, [[2, 3]])
    same(ix.positions(), [[0, 0, 1, 0, 1, 2]])
    same(
        ix.mask(),
        [
            [
                [F, F, F, F, F, F],
                [F, T, F, F, F, F],
                [F, T, T, F, F, F],
                [F, F, F, T, F, F],
                [F, F, F, T, T, F],
                [F, F, F, T, T, T],
            ]
        ],
    )
    pool = col(N, 1)
    seen, pool2 = ix.extend(vals([N, 1, 2, 3, 4, 5]), pool)
    same(seen, vals([0, 1, 2, 3, 4, 5]))  # a padded token's value reads as zero
    same(pool2, pool)


def test_one_sequence_per_lane_packs_as_whole(api):
    a, b = api.packed(4, [[2], [4]]), api.whole(2, 4, lens=[2, 4])
    same(a.positions(), [[0, 0, 0, 1], [0, 1, 2, 3]])
    same(a.mask(), b.mask())
    v = vals([N, N, 1, 2], [3, 4, 5, 6])
    same(a.extend(v, col(0))[0], b.extend(v, col(0))[0])
    same(b.extend(v, col(0))[0], vals([0, 0, 1, 2], [3, 4, 5, 6]))


def test_whole_in_blocks_holds_the_closing_tokens(api):
    seen, _ = api.whole(1, 4).every(2).extend(vals([1, 2, 3, 4]), col(0))
    same(seen, [[[2], [4]]])
    ix = api.whole(2, 4, lens=[3, 4]).every(2)
    assert ix.context == 2
    same(ix.mask()[0], [[F, F], [F, F], [T, F], [T, F]])
    seen, _ = ix.extend(vals([N, 1, 2, 3], [4, 5, 6, 7]), col(0))
    same(seen, [[[2], [0]], [[5], [7]]])  # block 1 of lane 0 is never closed


def test_select_reads_chosen_columns_twice_and_masks_the_unseen(api):
    ix = api.rows(4, [3]).select(i64([[[0, 0, 5], [-1, 1, 2], [2, 1, 0]]]))
    same(ix.mask(), [[[T, T, F], [F, T, F], [T, T, T]]])
    seen, pool2 = ix.extend(vals([1, 2, 3]), col(N, N, N, N))
    same(pool2, col(1, 2, 3, N))
    same(seen, np.array([[[1, 1, 0], [0, 2, 0], [3, 2, 1]]], float)[..., None])


def test_select_on_a_whole_index_reads_the_lanes_tokens(api):
    ix = api.whole(1, 3).select(i64([[[2, 0], [1, 1], [0, 3]]]))
    same(ix.mask(), [[[F, T], [T, T], [T, F]]])
    seen, _ = ix.extend(vals([4, 5, 6]), col(0))
    same(seen, np.array([[[0, 4], [5, 5], [4, 0]]], float)[..., None])


def _tree_draft(api):
    # token 0 at position 2 is the root; tokens 1 and 2, both at 3, are its children
    sees = np.array([[[T, F, F], [T, T, F], [T, F, T]]])
    ix = api.make(i64([[2, 3, 3]]), i64([[0, 1, -1, -1]]))
    return ix, i64([[4, 5, 6]]), sees


def test_a_draft_sees_the_table_below_it_and_its_ancestors(api):
    ix, slots, sees = _tree_draft(api)
    d = ix.draft(slots, sees)
    assert d.context == 7
    same(
        d.mask(),
        [[[T, T, F, F, T, F, F], [T, T, F, F, T, T, F], [T, T, F, F, T, F, T]]],
    )
    seen, pool2 = d.extend(vals([10, 11, 12]), col(1, 2, N, N, N, N, N))
    same(pool2, col(1, 2, N, N, 10, 11, 12))
    same(seen, vals([1, 2, 0, 0, 10, 11, 12]))
    same(d.positions(), [[2, 3, 3]])


def test_a_draft_keeps_the_window(api):
    ix, slots, sees = _tree_draft(api)
    d = ix.window(2).draft(slots, sees)
    same(
        d.mask(),
        [[[F, T, F, F, T, F, F], [F, F, F, F, T, T, F], [F, F, F, F, T, F, T]]],
    )
    seen, _ = d.extend(vals([10, 11, 12]), col(1, 2, N, N, N, N, N))
    same(seen, vals([0, 2, 0, 0, 10, 11, 12]))
    same(d.advance().positions(), [[3]])
    same(d.advance().mask(), [[[F, F, F, T]]])


def test_a_draft_lane_that_sees_nothing_reads_zero(api):
    # lane 0's row is -1 (padding throughout); lane 1 holds only padding: neither sees a
    # column, so every column of theirs reads zero, whatever the table names
    ix = api.make(i64([[0], [-1]]), i64([[0, 1], [2, 3]]), row=i64([-1, 1]))
    d = ix.draft(i64([[4], [5]]), np.array([[[T]], [[T]]]))
    same(d.mask(), np.zeros((2, 1, 3), bool))
    seen, pool2 = d.extend(vals([9], [8]), col(1, 2, 3, 4, N, N))
    same(pool2, col(1, 2, 3, 4, N, N))
    same(seen, vals([0, 0, 0], [0, 0, 0]))
