"""Turned 4-bit pools (:mod:`cacheidx.turned`): the quantizer against the suite's slow
reference on random rows of every length and group (the laws themselves run in the conformance
suite, on every backend and mode), and bad input refused by name."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cacheidx import turned
from cacheidx.conformance import turned as reference

#: row lengths and the groups that divide them: powers of two, and 96 (blocks of 32)
SHAPES = [(d, g) for d in (2, 8, 64, 96) for g in (1, 2, 8, 16, 32, 64, 96)
          if d % g == 0 and g <= d]


@settings(max_examples=30, deadline=None, derandomize=bool(os.environ.get("CI")),
          suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**16),
       magnitude=st.floats(-12, 12), offset=st.floats(-3, 3),
       half=st.booleans())
def test_the_quantizer_is_the_references_on_random_rows(shape, seed, magnitude, offset, half):
    d, group = shape
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((3, d)) * 10.0**magnitude + offset * 10.0**magnitude)
    x = x.astype(np.float32)
    dtype = np.float16 if half else np.float32
    got = turned.quantize(x, group, scale_dtype=dtype)
    want = reference.quantize(x, group, dtype)
    for name, g, w in zip(turned.Turned._fields, got, want):
        assert np.array_equal(g, w, equal_nan=g.dtype.kind == "f"), (name, g, w)
    assert np.array_equal(turned.dequantize(got), reference.dequantize(*want), equal_nan=True)


def test_a_row_of_96_is_turned_in_blocks_of_32():
    x = np.zeros((1, 96), np.float32)
    x[0, 40] = 1.0  # in the second block: only its 32 elements see it
    y = turned.turn(x)
    assert np.all(y[0, 32:64] != 0) and np.all(y[0, :32] == 0) and np.all(y[0, 64:] == 0)
    np.testing.assert_array_equal(turned.turn(y) / 32, x)


def test_bad_input_is_refused_naming_the_function():
    with pytest.raises(TypeError, match=r"cacheidx\.turned\.quantize: x must hold real floats"):
        turned.quantize(np.ones((2, 8), np.int32))
    with pytest.raises(ValueError, match=r"cacheidx\.turned\.quantize: x must be rows .* even"):
        turned.quantize(np.ones((2, 7), np.float32))
    with pytest.raises(ValueError, match=r"cacheidx\.turned\.quantize: group must divide the "
                                         r"rows' length 8, got 3"):
        turned.quantize(np.ones((2, 8), np.float32), 3)
    with pytest.raises(ValueError, match=r"cacheidx\.turned\.zeros: group must divide"):
        turned.zeros(4, 1, 8, group=16)
    with pytest.raises(TypeError, match=r"cacheidx\.turned\.dequantize: codes must be uint8"):
        turned.dequantize((np.zeros((2, 4), np.int8), np.zeros((2, 1), np.float32),
                           np.zeros((2, 1), np.int8)))
    with pytest.raises(ValueError, match=r"cacheidx\.turned\.dequantize: codes \[\.\.\., d // 2\]"):
        turned.dequantize((np.zeros((2, 4), np.uint8), np.zeros((2, 3), np.float32),
                           np.zeros((2, 3), np.int8)))


def test_a_pool_of_another_shape_is_refused_by_attend():
    import cacheidx as ci

    index = ci.rows(4, [2])
    good = turned.zeros(4, 1, 8, group=4)
    bad = turned.Turned(good.codes, good.scales[:, :, :1], good.zeros)
    q = np.zeros((1, 2, 1, 8), np.float32)
    with pytest.raises(ValueError, match=r"cacheidx\.attend: kpool must hold codes"):
        index.attend(q, q, q, bad, good)


def test_a_rows_width_is_a_constant_of_a_symbolic_program():
    """``static.constant`` (the turn's widths): under ``torch.compile(dynamic=True)`` a program
    holds a width it takes constant (a new width, a new program) and its batch symbolic (a new
    batch, the same program); an integer everywhere else."""
    torch = pytest.importorskip("torch")
    from torch._dynamo.testing import CompileCounter

    from cacheidx.static import constant

    assert constant(64) == 64 and constant(np.int64(8)) == 8
    counter = CompileCounter()

    def pairs(x):
        return x.reshape(*x.shape[:-1], constant(x.shape[-1]) // 2, 2).sum(-1)

    step = torch.compile(pairs, dynamic=True, backend=counter, fullgraph=True)
    for shape in [(3, 2, 16), (5, 2, 16), (3, 2, 8), (7, 2, 8)]:
        x = torch.randn(shape)
        assert torch.equal(step(x), pairs(x))
    assert counter.frame_count == 2, f"{counter.frame_count} programs for two widths"
