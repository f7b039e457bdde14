"""Fuzzing cacheidx.quantized (issue 37): quantize and dequantize on every backend, eager and
compiled, over every dtype a row, a scale or a code may come in, and gradients through attend
over quantized pools.

Hypothesis draws the dtype (float16, bfloat16, float32, float64, complex, int, bool), the shape
(rows of no element and lanes of none among them), the width and the scales' dtype (real floats,
and integers and complex ones to refuse) on numpy, strict, torch and JAX, each eagerly and
(torch, JAX) compiled: torch.compile with backend aot_eager, jax.jit. A refused input raises a
TypeError or ValueError naming ``quantized.quantize`` or ``quantized.dequantize`` (compiled
too: torch.compile without ``fullgraph``, under which dynamo wraps any exception raised while it
traces in its own ``Unsupported``, naming the function in its message); an accepted one keeps
Q1 to Q3 (:func:`cacheidx.quantized.bound`) and equals NumPy's result bit for bit, but for JAX's
stated flush of subnormal elements (``bound(..., flushed=True)``).

Kept cheap: few examples, and shapes from a small menu (JAX compiles each eager operation for
each new shape, torch.compile each new signature).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_quantized import reference

import cacheidx as ci
from cacheidx import quantized

fuzz = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.data_too_large])
#: examples a (library, mode): compiled ones compile a program each, and so does eager JAX
#: (each of its operations, for each new shape and dtype: about a second an example)
EXAMPLES = {"eager": 12, "compiled": 5, "jax eager": 5}
#: (library, mode) pairs: every backend eagerly, torch and JAX compiled too
RUNS = [("numpy", "eager"), ("strict", "eager"), ("torch", "eager"), ("torch", "compiled"),
        ("jax", "eager"), ("jax", "compiled")]
#: the rows' leading shapes and lengths, those of most examples first (Hypothesis begins from
#: the first of each, and shrinks toward it)
LEADING = [(3,), (2, 2), (1,), (0,)]
DIMS = [8, 5, 2, 1, 0]
X_DTYPES = ["float32", "float16", "bfloat16", "float64", "complex64", "int8", "int32", "bool"]
#: the scales' dtypes quantize is asked for (None: its default, float32)
SCALE_DTYPES = [None, "float32", "float16", "bfloat16", "int8", "complex64"]
FLOATS = {"float16", "bfloat16", "float32", "float64"}
TINY = 2.0**-126  #: float32's smallest normal


def library(name: str):
    """The backend ``name``, or a skip naming why it cannot run here."""
    from cacheidx.conformance.pytest_plugin import backend_or_skip

    return backend_or_skip(name)


def dtype(lib: str, name: str | None):
    """The dtype ``name`` of ``lib`` (NumPy's bfloat16 is ml_dtypes'), None where it has none
    (strict: no float16 or bfloat16; JAX without x64: no float64)."""
    if name is None:
        return None
    if lib == "numpy":
        if name == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(name)
    if lib == "strict":
        import array_api_strict as xs

        return getattr(xs, name, None)
    if lib == "torch":
        import torch

        return getattr(torch, name)
    import jax
    import jax.numpy as jnp

    return None if name == "float64" and not jax.config.jax_enable_x64 else getattr(jnp, name)


def numpy_dtype(name: str | None):
    return None if name is None else dtype("numpy", name)


def array(lib: str, x: np.ndarray, name: str):
    """``x`` (float64 NumPy) as an array of ``lib`` of dtype ``name``."""
    if name == "bool":
        x = x != 0
    elif "int" in name:  # wrapped into the dtype's range where it must be
        x = np.clip(np.nan_to_num(x), -128, 255).astype(np.int64)
    want = dtype(lib, name)
    if lib == "numpy":
        with np.errstate(all="ignore"):
            return x.astype(want)
    if lib == "strict":
        import array_api_strict as xs

        with np.errstate(all="ignore"):
            return xs.asarray(x.astype(np.dtype(name)))
    if lib == "torch":
        import torch

        # np.array, not np.ascontiguousarray: that makes a 0-d array 1-d
        return torch.from_numpy(np.array(x, order="C")).to(want)
    import jax.numpy as jnp

    with np.errstate(all="ignore"):
        # through float32: JAX without x64 holds no float64
        return jnp.asarray(x.astype(np.float32) if x.dtype.kind == "f" else x).astype(want)


def host(x) -> np.ndarray:
    """``x`` as NumPy, bfloat16 as float32 (which holds it exactly)."""
    if hasattr(x, "detach"):
        import torch

        x = x.detach()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    if type(x).__module__.startswith("array_api_strict"):
        x = np.from_dlpack(x)
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype.name == "bfloat16" else x


def compiled(lib: str, fn):
    """``fn`` compiled as the mode says: torch.compile (aot_eager, a fresh program: dynamo's
    cache of recompiles would fall back to eager past its limit) or jax.jit."""
    if lib == "torch":
        import torch

        torch._dynamo.reset()
        return torch.compile(fn, backend="aot_eager")
    import jax

    return jax.jit(fn)


def run(lib: str, mode: str, fn, *args):
    return (compiled(lib, fn) if mode == "compiled" else fn)(*args)


@st.composite
def rows(draw):
    """Rows ``[*leading, d]`` as float64 NumPy: elements of every float32 magnitude, NaN and
    infinities among them, each row scaled by a power of ten of its own, and rows of zeros."""
    shape = (*draw(st.sampled_from(LEADING)), draw(st.sampled_from(DIMS)))
    x = draw(hnp.arrays(np.float64, shape, elements=st.floats(
        -1, 1, width=32) | st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40]) |
        st.floats(width=32)))
    scale = draw(hnp.arrays(np.float64, (*shape[:-1], 1), elements=st.sampled_from(
        [1.0, 1e-42, 1e-38, 1e-30, 1e-6, 1e-3, 1e3, 1e30])))
    with np.errstate(all="ignore"):
        return x * scale


def mostly(names: list, rare: list):
    """One of ``names`` three times in four, one of ``rare`` otherwise (where there is one)."""
    usual = st.sampled_from(names)
    return st.one_of(usual, usual, usual, st.sampled_from(rare)) if rare else usual


def refusal(x_name: str, scale_name: str | None, d: int, bits: int):
    """``(error, words)`` quantize raises for the drawn input, ``None`` where it takes it."""
    if x_name not in FLOATS:
        return TypeError, "x must hold real floats"
    if scale_name is not None and scale_name not in FLOATS:
        return TypeError, "scale_dtype must be a real float dtype"
    if d == 0:
        return ValueError, "at least one element"
    if bits == 4 and d % 2:
        return ValueError, "pack two to a byte"
    return None


def differ_only_by_the_flush(got: np.ndarray, want: np.ndarray, x: np.ndarray, what: str):
    """JAX's codes (as floats) are NumPy's but where XLA's CPU read a subnormal element as zero
    (cacheidx.quantized's Q1: stated, not mended)."""
    differ = got != want
    assert np.all(np.abs(x[differ]) < TINY) and np.all(got[differ] == 0), (
        f"{what}: codes differ from NumPy's beyond JAX's flush of subnormal elements:\n"
        f"{got[differ]} against {want[differ]} at {x[differ]}")


def keeps_the_laws(lib: str, x32: np.ndarray, bits: int, scale_name: str | None, codes,
                   scales, back):
    """Q1 (NumPy's codes and scales, which are the by-hand reference's), Q2 (the values are
    codes times scales in float32, NumPy's bit for bit) and Q3 (within the bound)."""
    nsd = numpy_dtype(scale_name) or np.float32
    want_codes, want_scales = quantized.quantize(x32, bits, scale_dtype=nsd)
    ref_codes, ref_scales = reference(x32, bits, nsd)
    assert np.array_equal(want_codes, ref_codes), "NumPy's codes are the reference's (Q1)"
    assert np.array_equal(host(want_scales), host(ref_scales), equal_nan=True), "(Q1)"
    codes, scales, back = host(codes), host(scales), host(back)
    assert codes.dtype == want_codes.dtype and codes.shape == want_codes.shape
    assert tuple(scales.shape) == x32.shape[:-1], f"scales of shape {scales.shape}"
    assert np.array_equal(scales.astype(np.float32), host(want_scales).astype(np.float32),
                          equal_nan=True), f"scales {scales}, NumPy's {host(want_scales)}"
    got_c = host(quantized.floats(codes)).astype(np.float32)
    want_c = host(quantized.floats(want_codes)).astype(np.float32)
    if lib == "jax":
        differ_only_by_the_flush(got_c, want_c, x32, "quantize")
    else:
        assert np.array_equal(got_c, want_c), f"codes\n{got_c}\nNumPy's\n{want_c}"
    # Q2: the codes given back times the scales given back, in float32, NumPy's bit for bit
    by_hand = got_c * scales.astype(np.float32)[..., None]
    assert back.dtype == np.float32 and np.array_equal(back, by_hand, equal_nan=True), "Q2"
    # Q3 over the rows whose scale is a normal float32 before its rounding, kept finite
    top = np.max(np.abs(x32), axis=-1)
    s32 = top.astype(np.float32) * np.float32(1 / quantized.LARGEST[bits])
    domain = np.isfinite(top) & (s32 >= TINY) & np.isfinite(scales.astype(np.float32))
    err = np.abs(x32.astype(np.float64) - back.astype(np.float64))
    bound = quantized.bound(x32, scales, flushed=lib == "jax")
    bad = domain[..., None] & ~(err <= bound)
    assert not bad.any(), f"Q3: |x - c s| {err[bad]} past {bound[bad]} at {x32[bad]}"


@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's notes on array_api_compat
@pytest.mark.parametrize("lib, mode", RUNS, ids=[f"{lib}-{mode}" for lib, mode in RUNS])
def test_quantize_keeps_q1_to_q3_as_numpy_does_or_refuses_naming_itself(lib, mode):
    """quantize over drawn dtypes, shapes, widths and scale dtypes: a TypeError or ValueError
    naming ``quantized.quantize`` where the law refuses the input (not real floats, a scale
    dtype that is not one, a row of no element, an odd row at 4 bits); otherwise its codes and
    scales are NumPy's bit for bit (JAX: but its stated flush), dequantize gives codes times
    scales, and the round trip keeps Q3."""
    backend = library(lib)
    xp = backend.xp
    # the dtypes the library has (strict: no float16 or bfloat16; JAX without x64: no
    # float64), the real floats drawn three times in four, so that most examples are taken
    has = [n for n in X_DTYPES if dtype(lib, n) is not None]
    scale_has = [n for n in SCALE_DTYPES if n is None or dtype(lib, n) is not None]
    x_names = mostly([n for n in has if n in FLOATS], [n for n in has if n not in FLOATS])
    scale_names = mostly([n for n in scale_has if n is None or n in FLOATS],
                         [n for n in scale_has if n is not None and n not in FLOATS])
    # one taken and one refused every run, whatever is drawn: a row of every kind at 4 bits
    # (zeros, a NaN, a subnormal element beside a normal one, a huge one), and complex rows
    every_kind = np.asarray([[0.0, -0.0, 0.0, 0.0], [1.0, np.nan, 2.0, 3.0],
                             [1e-39, 1.0, -0.5, 0.25], [3e38, -1e38, 1.0, 0.0]])

    @settings(fuzz, max_examples=EXAMPLES.get(f"{lib} {mode}", EXAMPLES[mode]))
    @given(x=rows(), x_name=x_names, bits=st.sampled_from([8, 4]), scale_name=scale_names)
    @example(x=every_kind, x_name="float32", bits=4, scale_name=None)
    @example(x=every_kind, x_name="complex64", bits=8, scale_name=None)
    def check(x, x_name, bits, scale_name):
        a = array(lib, x, x_name)
        sd = dtype(lib, scale_name)

        def step(a):
            codes, scales = quantized.quantize(a, bits, scale_dtype=sd, xp=xp)
            return codes, scales, quantized.dequantize((codes, scales), xp=xp)

        refused = refusal(x_name, scale_name, x.shape[-1], bits)
        if refused is not None:
            error, words = refused
            with pytest.raises(error, match=rf"cacheidx\.quantized\.quantize: .*{words}"):
                run(lib, mode, step, a)
            return
        codes, scales, back = run(lib, mode, step, a)
        keeps_the_laws(lib, host(a).astype(np.float32), bits, scale_name, codes, scales, back)

    check()


CODE_DTYPES = ["int8", "uint8", "int16", "int32", "float32"]
SCALES_OF = ["float32", "float16", "bfloat16", "int32", "bool"]
#: the scales' shape against the codes': theirs but the last axis, or one of the wrong ones
SHAPES = ["right", "one", "kept last axis", "none"]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("lib, mode", RUNS, ids=[f"{lib}-{mode}" for lib, mode in RUNS])
def test_dequantize_is_codes_times_scales_or_refuses_naming_itself(lib, mode):
    """dequantize over drawn codes (int8, uint8, and int16, int32, float32 to refuse), scales
    (real floats, and int32, bool to refuse) and the scales' shape (the codes' but the last
    axis, or another: a TypeError or ValueError naming ``quantized.dequantize``, never a
    broadcast): codes times scales in float32, NumPy's by-hand product bit for bit."""
    backend = library(lib)
    xp = backend.xp

    @settings(fuzz, max_examples=EXAMPLES.get(f"{lib} {mode}", EXAMPLES[mode]))
    @given(lead=st.sampled_from(LEADING), d=st.sampled_from([1, 4]),
           code_name=st.sampled_from(CODE_DTYPES), scale_name=st.sampled_from(SCALES_OF),
           shape=st.sampled_from(SHAPES), data=st.data())
    def check(lead, d, code_name, scale_name, shape, data):
        if dtype(lib, scale_name) is None:
            return
        lo, hi = (0, 255) if code_name == "uint8" else (-127, 127)
        c = data.draw(hnp.arrays(np.int64, (*lead, d), elements=st.integers(lo, hi)))
        s_shape = {"right": lead, "one": (1,), "kept last axis": (*lead, 1), "none": ()}[shape]
        s = data.draw(hnp.arrays(np.float64, s_shape, elements=st.floats(
            0, 1e4, width=16) | st.sampled_from([np.nan, np.inf, 2.0**-20])))
        codes = array(lib, c.astype(np.float64), code_name)
        scales = array(lib, s, scale_name)

        def step(codes, scales):
            return quantized.dequantize((codes, scales), xp=xp)

        if code_name not in ("int8", "uint8"):
            refused = TypeError, "codes must be int8"
        elif scale_name not in FLOATS:
            refused = TypeError, "scales must hold real floats"
        elif s_shape != lead:
            refused = ValueError, "scales must have the codes' shape"
        else:
            refused = None
        if refused is not None:
            error, words = refused
            with pytest.raises(error, match=rf"cacheidx\.quantized\.dequantize: {words}"):
                run(lib, mode, step, codes, scales)
            return
        got = host(run(lib, mode, step, codes, scales))
        want = host(quantized.floats(host(codes))).astype(np.float32) * host(scales).astype(
            np.float32)[..., None]
        assert got.dtype == np.float32 and np.array_equal(got, want, equal_nan=True), (
            f"{got}\nby hand\n{want}")

    check()


# -- gradients through attend over quantized pools -------------------------------------------
HEADS, KV, D, WIDTH = 4, 2, 8, 8


@st.composite
def calls(draw, shapes=((1, 1), (1, 2), (2, 1), (2, 2)), jax: bool = False):
    """``(pos, table, slots, bits of keys and values, scale dtype, seed)``: lanes of tokens at
    the end of their sequences (``(batch, seq)`` from ``shapes``), each lane's slots a random
    set of the pool's, columns past the sequence unallocated. ``jax``: 8-bit keys, 4-bit
    values and bfloat16 scales, always (one program to compile)."""
    batch, seq = draw(st.sampled_from(shapes))
    lens = [draw(st.integers(seq, WIDTH)) for _ in range(batch)]
    slots = batch * WIDTH + 2
    order = draw(st.permutations(range(slots)))
    table = np.asarray(order[:batch * WIDTH]).reshape(batch, WIDTH)
    for b, n in enumerate(lens):
        table[b, n:] = -1
    pos = np.asarray([[n - seq + i for i in range(seq)] for n in lens])
    if jax:
        return pos, table, slots, (8, 4), "bfloat16", draw(st.integers(0, 2**16))
    bits = (draw(st.sampled_from([8, 4])), draw(st.sampled_from([8, 4])))
    return pos, table, slots, bits, draw(st.sampled_from(["float32", "float16", "bfloat16"])), (
        draw(st.integers(0, 2**16)))


def drawn_arrays(pos, slots, seed):
    rng = np.random.default_rng(seed)
    batch, seq = pos.shape
    q = rng.standard_normal((batch, seq, HEADS, D)).astype(np.float32)
    k, v = (rng.standard_normal((batch, seq, KV, D)).astype(np.float32) for _ in range(2))
    kp, vp = (rng.standard_normal((slots, KV, D)).astype(np.float32) * 3 for _ in range(2))
    w = rng.standard_normal((batch, seq, HEADS, D)).astype(np.float32)
    return q, k, v, kp, vp, w


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("lib", ["torch", "jax"])
def test_gradients_through_quantized_pools_are_a_float_pools_holding_the_round_trip(lib):
    """The gradient of a loss of attend's output with respect to q (torch: q.requires_grad,
    the CPU kernel declining; JAX: jax.grad) over quantized pools, any width of keys and of
    values and any scale dtype, is the gradient over float pools holding their round trip (and
    the call's keys and values round-tripped as the pools give them back), as is the output."""
    library(lib)

    # JAX compiles a program for each new shape and dtype, eagerly and under grad (about 5 s
    # each here): one shape and one pair of widths and scale dtype, its positions, tables and
    # values drawn (each later example reuses the programs: about 20 ms)
    @settings(fuzz, max_examples=8 if lib == "torch" else 4)
    @given(drawn=calls() if lib == "torch" else calls(shapes=((2, 1),), jax=True))
    def check(drawn):
        pos, table, slots, (kbits, vbits), scale_name, seed = drawn
        q, k, v, kp, vp, w = drawn_arrays(pos, slots, seed)
        if lib == "torch":
            import torch

            def put(a):
                return torch.from_numpy(a)
        else:
            import jax
            import jax.numpy as jnp

            put = jnp.asarray
        index = ci.make(put(pos), put(table))
        # the pools quantized by NumPy, whose codes and scales the library's are (the fuzz
        # above; no subnormal element here), and moved: JAX compiles each eager operation
        nsd = numpy_dtype(scale_name)
        pools, floats = [], []
        for p, bits in ((kp, kbits), (vp, vbits)):
            codes, scales = quantized.quantize(p, bits, scale_dtype=nsd)
            pools.append(quantized.Quantized(put(codes), array(lib, host(scales).astype(
                np.float64), scale_name)))
            floats.append(put(quantized.dequantize((codes, scales))))
        trips = [put(quantized.roundtrip(a, bits, scale_dtype=nsd))
                 for a, bits in ((k, kbits), (v, vbits))]

        def loss(q, keys, values, kpool, vpool):
            out = index.attend(q, keys, values, kpool, vpool)[0]
            return (out * put(w)).sum(), out

        if lib == "torch":
            got_q, want_q = (torch.from_numpy(q).requires_grad_() for _ in range(2))
            got, got_out = loss(got_q, put(k), put(v), *pools)
            want, want_out = loss(want_q, *trips, *floats)
            assert got_out.requires_grad, "the output over quantized pools has no gradient"
            got.backward()
            want.backward()
            got_g, want_g = got_q.grad.numpy(), want_q.grad.numpy()
            got_out, want_out = got_out.detach().numpy(), want_out.detach().numpy()
        else:
            (_, got_out), got_g = jax.value_and_grad(
                lambda a: loss(a, put(k), put(v), *pools), has_aux=True)(put(q))
            (_, want_out), want_g = jax.value_and_grad(
                lambda a: loss(a, *trips, *floats), has_aux=True)(put(q))
            got_out, want_out, got_g, want_g = map(np.asarray, (got_out, want_out, got_g,
                                                                want_g))
        np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-5, err_msg="output")
        np.testing.assert_allclose(got_g, want_g, rtol=1e-4, atol=1e-4, err_msg="d loss / d q")

    check()


# -- what the fuzz found, as concrete cases ---------------------------------------------------
@pytest.mark.parametrize("lib", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("scale_name", ["float16", "bfloat16"])
def test_narrow_scales_of_rows_under_kv_heads_are_numpys(lib, scale_name):
    """A pool's rows ``[slots, kv_heads, d]`` give scales of two axes: rounded to a narrow
    dtype as NumPy rounds them (torch's ``index_select`` refused the powers of two's 2-d
    indices: every float16 or bfloat16 pool on torch raised an IndexError)."""
    library(lib)
    x = np.random.default_rng(4).standard_normal((3, 2, 8)) * np.asarray([1e-6, 1.0, 1e3])[
        :, None, None]
    want_codes, want_scales = quantized.quantize(x.astype(np.float32), 8,
                                                 scale_dtype=numpy_dtype(scale_name))
    codes, scales = quantized.quantize(array(lib, x, "float32"), 8,
                                       scale_dtype=dtype(lib, scale_name))
    assert np.array_equal(host(codes), want_codes)
    assert np.array_equal(host(scales).astype(np.float32), host(want_scales).astype(np.float32))


def test_numpy_takes_bfloat16_rows_and_scales_as_jax_gives_them():
    """A JAX array of bfloat16 comes to NumPy as ml_dtypes' bfloat16: quantize and dequantize
    take it as the real floats it holds (both raised NumPy's own TypeError, naming neither)."""
    import ml_dtypes

    x = np.linspace(-2, 3, 16, dtype=np.float32).reshape(2, 8)
    codes, scales = quantized.quantize(x.astype(ml_dtypes.bfloat16), 8)
    want_codes, want_scales = quantized.quantize(x.astype(ml_dtypes.bfloat16).astype(
        np.float32), 8)
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)
    narrow = want_scales.astype(ml_dtypes.bfloat16)
    assert np.array_equal(quantized.dequantize((codes, narrow)),
                          quantized.dequantize((codes, narrow.astype(np.float32))))
