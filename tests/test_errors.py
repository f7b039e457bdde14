"""Every "Raises" of the spec: a ValueError (TypeError for a wrong type) naming the function
and the value, raised before anything is written."""

import numpy as np
import pytest

import cacheidx as ci

I = np.int64


def ix(pos=((0, 1),), table=((0, 1, 2),), **kw):
    return ci.make(np.asarray(pos, I), np.asarray(table, I), **kw)


@pytest.mark.parametrize("call, error, words", [
    (lambda: ci.make(np.zeros(3, I), np.zeros((1, 3), I)), ValueError, "make: pos must have"),
    (lambda: ci.make(np.zeros((1, 0), I), np.zeros((1, 3), I)), ValueError, "empty axis"),
    (lambda: ci.make(np.zeros((1, 2), I), np.zeros((1, 0), I)), ValueError, "empty axis"),
    (lambda: ci.make(np.zeros((2, 2), I), np.zeros((1, 3), I)), ValueError, "one row per lane"),
    (lambda: ix(row=np.zeros(2, I)), ValueError, "make: row must have shape [1]"),
    (lambda: ix(every=[(1, np.zeros((1, 2), I))]), ValueError, "below 2: 1"),
    (lambda: ix(every=[(2, np.zeros((1, 2), I)), (2, np.zeros((1, 2), I))]), ValueError,
     "two tables of blocks have m = 2"),
    (lambda: ix(every=[(2, np.zeros((3, 2), I))]), ValueError, "blocks of 2 must have shape"),
    (lambda: ci.make(np.zeros((1, 2)), np.zeros((1, 3), I)), TypeError, "pos must hold integers"),
    (lambda: ci.make(np.zeros((1, 2), I), np.zeros((1, 3), np.float32)), TypeError,
     "table must hold integers"),
    (lambda: ci.make([[0, 1]], np.zeros((1, 3), I)), TypeError, "pos must be an array"),
    # an unsigned table cannot hold -1, and extend's -1 would overflow it
    (lambda: ci.make(np.zeros((1, 2), np.uint8), np.zeros((1, 3), I)), TypeError,
     "make: pos must hold signed integers (-1 marks none), got dtype uint8"),
    (lambda: ci.make(np.zeros((1, 2), I), np.zeros((1, 3), np.uint64)), TypeError,
     "table must hold signed integers"),
    (lambda: ix(row=np.zeros(1, np.uint32)), TypeError, "row must hold signed integers"),
    (lambda: ix(every=[(2, np.zeros((1, 2), np.uint16))]), TypeError,
     "the table of blocks of 2 must hold signed integers"),
    (lambda: ix(every=5), TypeError, "make: every must be a sequence, got int"),
    (lambda: ci.rows(8, [2], every=3), TypeError, "rows: every must be a sequence, got int"),
    (lambda: ci.rows(8, [2], every="24"), TypeError, "rows: every must be a sequence, got '24'"),
    (lambda: ix().select(np.zeros((1, 2, 1), np.uint8)), TypeError,
     "select: columns must hold signed integers"),
    (lambda: ix().draft(np.zeros((1, 2), np.uint8), np.zeros((1, 2, 2), bool)), TypeError,
     "draft: slots must hold signed integers"),
    (lambda: ci.rows(8, []), ValueError, "rows: there is no lane"),
    (lambda: ci.rows(0, [1]), ValueError, "context must be positive, got 0"),
    (lambda: ci.rows(8, [-1]), ValueError, "a length is negative: -1"),
    (lambda: ci.rows(8, [12]), ValueError, "a lane of 12 tokens does not fit a context of 8"),
    (lambda: ci.rows(8, [2], every=[1]), ValueError, "below 2: 1"),
    (lambda: ci.rows(8, [2], every=[2, 2]), ValueError, "m = 2 appears twice"),
    (lambda: ci.rows(8.0, [2]), TypeError, "context must be an integer"),
    (lambda: ci.rows(2**70, [0]), ValueError,
     "rows: 1 lanes of a context of 1180591620717411303424 are more slots than int64 numbers"),
    (lambda: ci.whole(1, 2**63), ValueError, "is more positions than int64 numbers"),
    (lambda: ci.packed(2**63, [[1]]), ValueError, "is more positions than int64 numbers"),
    (lambda: ci.whole(0, 3), ValueError, "whole: batch and seq must be positive"),
    (lambda: ci.whole(1, 0), ValueError, "whole: batch and seq must be positive"),
    (lambda: ci.whole(1, 3, lens=[4]), ValueError, "a lane of 4 tokens does not fit seq=3"),
    (lambda: ci.whole(2, 3, lens=[1]), ValueError, "lens names 1 lanes for a batch of 2"),
    (lambda: ci.packed(4, []), ValueError, "packed: there is no lane"),
    (lambda: ci.packed(0, [[1]]), ValueError, "seq must be positive, got 0"),
    (lambda: ci.packed(4, [[-1]]), ValueError, "a length is negative"),
    (lambda: ci.packed(4, [[3, 2]]), ValueError, "lane 0 holds 5 tokens, past seq=4"),
    (lambda: ix().window(0), ValueError, "window: w must be positive, got 0"),
    (lambda: ix().window(True), TypeError, "window: w must be an integer"),
    (lambda: ix().select(np.zeros((1, 2), I)), ValueError, "columns must have shape [1, 2, ?]"),
    (lambda: ix().select(np.zeros((1, 2, 0), I)), ValueError, "k is 0"),
    (lambda: ix().select(np.zeros((1, 2, 1))), TypeError, "columns must hold integers"),
    (lambda: ix().draft(np.zeros((1, 2), I), np.zeros((1, 2, 2), bool))
     .select(np.zeros((1, 2, 1), I)), ValueError, "select: a draft cannot select"),
    (lambda: ix().draft(np.zeros((1, 3), I), np.zeros((1, 2, 2), bool)), ValueError,
     "slots must have shape [1, 2]"),
    (lambda: ix().draft(np.zeros((1, 2), I), np.zeros((1, 2, 2), I)), TypeError,
     "sees must hold booleans"),
    (lambda: ci.whole(1, 2).draft(np.zeros((1, 2), I), np.zeros((1, 2, 2), bool)), ValueError,
     "draft: a whole index has no table"),
    (lambda: ci.packed(2, [[2]]).draft(np.zeros((1, 2), I), np.zeros((1, 2, 2), bool)),
     ValueError, "draft: a packed index"),
    (lambda: ci.rows(8, [2], every=[2]).every(2).draft(np.zeros((1, 2), I),
                                                      np.zeros((1, 2, 2), bool)),
     ValueError, "reads blocks of 2"),
    (lambda: ix().select(np.zeros((1, 2, 1), I)).draft(np.zeros((1, 2), I),
                                                      np.zeros((1, 2, 2), bool)),
     ValueError, "draft: the index selects columns"),
    (lambda: ix().every(0), ValueError, "every: m must be positive, got 0"),
    (lambda: ix().every(2), ValueError, "no table of blocks of 2 positions"),
    (lambda: ci.rows(8, [2], every=[2, 4]).every(2).every(4), ValueError,
     "reads blocks of 2 positions, not 4"),
    (lambda: ci.rows(8, [2], every=[2]).every(2).every(1), ValueError, "not 1"),
    (lambda: ci.rows(8, [2], every=[2]).select(np.zeros((1, 2, 1), I)).every(2), ValueError,
     "every: the index selects columns"),
    (lambda: ci.rows(8, [2], every=[2]).draft(np.zeros((1, 2), I), np.zeros((1, 2, 2), bool))
     .every(2), ValueError, "every: the index is a draft"),
    (lambda: ci.packed(4, [[2]]).every(2), ValueError, "every: a packed index"),
    (lambda: ci.whole(1, 2).advance(), ValueError, "advance: a whole index"),
    (lambda: ci.packed(2, [[2]]).advance(), ValueError, "advance: a packed index"),
    (lambda: ix().extend(np.zeros((1, 3, 2), np.float32), np.zeros((3, 2), np.float32)),
     ValueError, "extend: values must have shape [1, 2, 2]"),
    (lambda: ix().extend(np.zeros((1, 2, 2), np.float32), np.zeros((3, 2), np.float64)),
     TypeError, "extend: values are float32 but the pool holds float64"),
    (lambda: ix().extend(np.zeros((1, 2), np.float32), np.float32(0)), ValueError,
     "pool must have a slot axis"),
    (lambda: ci.backends.get("tensorflowish"), ValueError, "no backend named 'tensorflowish'"),
])
def test_bad_input_raises_naming_the_function(call, error, words):
    with pytest.raises(error) as e:
        call()
    assert "cacheidx." in str(e.value) and words in str(e.value), str(e.value)


def test_every_one_of_a_constructors_index_is_that_index():
    a = ci.rows(8, [2])
    assert a.every(1) is a
    b = a.window(2)
    assert b is not a and a.structure.window is None, "an index is never changed"


def test_a_raising_extend_leaves_pool_and_index_as_they_were():
    index = ci.rows(4, [2])
    pool = np.arange(8, dtype=np.float32).reshape(4, 2)
    before, pos = pool.copy(), index.pos.copy()
    with pytest.raises(ValueError):
        index.extend(np.zeros((1, 3, 2), np.float32), pool, donate=True)
    assert np.array_equal(pool, before) and np.array_equal(index.pos, pos)


def test_import_loads_no_framework():
    import subprocess
    import sys

    code = ("import sys, cacheidx as ci; ci.rows(4, [2]); "
            "bad = [m for m in ('torch', 'jax', 'cupy') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    subprocess.run([sys.executable, "-c", code], check=True)
