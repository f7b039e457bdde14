"""The core against the slow reference (tests/reference.py), on random indices of every kind
(tests/strategies.py): one test per law family.

Values are copied, never computed, so the comparison is exact: same shape, same dtype, equal
elements with NaN equal to NaN. What the laws leave unspecified is left out: a slot two of a
call's stores aim at (write targets are distinct, an obligation on the caller), and the entries
of seen that read one.
"""

import os

import numpy as np
import reference
from hypothesis import HealthCheck, given, settings
from strategies import build, cases

import cacheidx as ci

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

law = settings(
    max_examples=2000 if CI else 200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def exactly(got, want, unsure=None):
    """got equals want element for element (NaN equal to NaN), outside `unsure`."""
    got = np.asarray(got)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    if unsure is not None:
        got, want = got[~unsure], want[~unsure]
    nan = want.dtype.kind in "fc"
    assert np.array_equal(got, want, equal_nan=nan), f"\ngot\n{got!r}\nwant\n{want!r}"


def both(case):
    return build(ci, case), build(reference, case)


def positions_agree(index, ref):
    assert (index.batch, index.seq, index.context) == (ref.batch, ref.seq, ref.context)
    exactly(index.positions(), ref.positions())


def stores_agree(case, index, ref):
    """extend stores at the tokens' columns and nowhere else, donated or not."""
    want = ref.extend(case.values, case.pool)[1]
    unsure = ref.unsure(len(case.pool))[1]
    pool = case.pool.copy()
    exactly(index.extend(case.values, pool)[1], want, unsure)
    exactly(pool, case.pool)  # donate=False never touches the caller's pool
    exactly(index.extend(case.values, pool, donate=True)[1], want, unsure)


def seen_agrees(case, index, ref):
    """extend's seen is the reference's: zero wherever no token sees; under a draft the table
    then the tokens."""
    want = ref.extend(case.values, case.pool)[0]
    unsure = ref.unsure(len(case.pool))[0]
    exactly(index.extend(case.values, case.pool.copy())[0], want, unsure)


def advance_agrees(case, index, ref):
    index, ref = index.advance(), ref.advance()
    positions_agree(index, ref)
    exactly(index.mask(), ref.mask())
    values = case.values[:, :1]
    seen, pool = index.extend(values, case.pool.copy())
    want_seen, want_pool = ref.extend(values, case.pool)
    unsure_seen, unsure_pool = ref.unsure(len(case.pool))
    exactly(pool, want_pool, unsure_pool)
    exactly(seen, want_seen, unsure_seen)


# One test checks every law family on each case it draws: drawing a case costs Hypothesis more
# than checking it, so each family gets as many cases as it had as a test of its own, at a
# fraction of the time. A failure names its family (the assertion's traceback) and Hypothesis
# shrinks the case for it.
@law
@given(case=cases())
def test_positions_mask_stores_seen_and_advance_agree(case):
    index, ref = both(case)
    positions_agree(index, ref)
    exactly(index.mask(), ref.mask())
    stores_agree(case, index, ref)
    seen_agrees(case, index, ref)
    if case.tabled:  # a whole index has no next token
        advance_agrees(case, index, ref)


@law
@given(case=cases(kinds=("make", "rows"), drafts=True))
def test_extend_seen_under_a_draft_is_the_table_then_the_tokens(case):
    seen_agrees(case, *both(case))
