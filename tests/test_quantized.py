"""Quantized pools (cacheidx.quantized): the quantizer against the law suite's slow reference
(cacheidx/conformance/quantized.py, law Q1 written out row by row in NumPy) on rows Hypothesis
draws, the round trip's error bound (Q3), and bad input.

The conformance suite checks the laws on every backend and mode on concrete rows; here
Hypothesis draws the rows: every float32 (or float16) value, subnormals, NaN and infinities
among them, at any scale of magnitude, of any length, at both widths and both scale dtypes.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import cacheidx as ci
from cacheidx import quantized
from cacheidx.conformance.quantized import LARGEST
from cacheidx.conformance.quantized import quantize as nearest_reference

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
law = settings(max_examples=300 if CI else 100, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
#: the libraries the quantizer is drawn on here: each is quick eagerly (JAX compiles every
#: operation for every new shape; the law suite checks it on concrete rows)
LIBRARIES = ("numpy", "torch")
HEADS, KV, D = 4, 2, 8


def reference(x: np.ndarray, bits: int, scale_dtype=np.float32):
    """Law Q1 by hand: the law suite's reference, whose narrow scales round to nearest, and
    row by row here the rows whose float16 scale falls below float16's smallest normal, where
    Q1 rounds the scale up (so that Q3 holds there)."""
    codes, scales = nearest_reference(x, bits, scale_dtype)
    if scale_dtype != np.float16:
        return codes, scales
    q = LARGEST[bits]
    rows = np.asarray(x).astype(np.float32).reshape(-1, x.shape[-1])
    w = codes.shape[-1]  # never -1: there may be no row
    codes, scales = codes.reshape(len(rows), w).copy(), scales.reshape(-1).copy()
    for r, row in enumerate(rows):
        a = np.max(np.abs(row))
        s = np.float32(a * np.float32(1 / q))
        if not np.isfinite(a) or not np.finfo(np.float32).smallest_normal <= s < 2.0**-14:
            continue
        s = np.float32(np.ceil(np.float64(s) * 2.0**24) * 2.0**-24)  # up, in float16's quanta
        scales[r] = np.float16(s)
        c = np.clip(np.round(row * (np.float32(1) / s)), -q, q).astype(np.int8)
        if bits == 4:
            n = (c.astype(np.int16) + 8).astype(np.uint8)
            c = n[:len(n) // 2] | (n[len(n) // 2:] << 4)
        codes[r] = c
    return codes.reshape(*x.shape[:-1], w), scales.reshape(x.shape[:-1])


def host(x):
    return np.asarray(x.detach() if hasattr(x, "detach") else x)


def on(library: str, x: np.ndarray):
    """``x`` as an array of ``library``, its dtype kept."""
    if library == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(x))
    return x


def scale_dtype(library: str, name: str):
    if library == "torch":
        import torch

        return getattr(torch, name)
    return getattr(np, name)


@st.composite
def rows(draw, finite: bool = False):
    """``(x, bits)``: rows ``[n, d]`` of float32 or float16, each row scaled by a power of ten
    of its own (so rows of one array differ in magnitude by up to 1e76), ``d`` even at 4
    bits, every row's scale zero or a normal float32 (subnormal elements beside larger ones).
    ``finite``: no NaN or infinity, and every row's scale normal (Q3's domain)."""
    bits = draw(st.sampled_from([8, 4]))
    d = draw(st.integers(1, 32)) * (2 if bits == 4 else 1) + draw(st.sampled_from([0, 0, 32]))
    n = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    width = 32 if dtype == np.float32 else 16
    if finite:
        elements = st.floats(-1, 1, width=width)
    else:
        elements = st.floats(width=width, allow_nan=True, allow_infinity=True)
    x = draw(hnp.arrays(dtype, (n, d), elements=elements))
    if finite:  # each row's largest magnitude at least 1/2 before scaling: a normal scale
        x[:, 0] = np.where(np.abs(x[:, 0]) < 0.5, np.copysign(0.5, x[:, 0]), x[:, 0])
    if dtype == np.float32:
        top = 30 if finite else 38
        exponents = draw(hnp.arrays(np.int64, (n, 1), elements=st.integers(-top, top)))
        with np.errstate(all="ignore"):
            x = (x.astype(np.float64) * 10.0 ** exponents).astype(np.float32)
            # a row whose scale would be subnormal (its largest magnitude under Q 2**-126),
            # scaled up by 2**100, exactly: Q1 does not say what such a row stores, and the
            # libraries differ there (XLA flushes the scale to zero; elsewhere the reciprocal
            # of a scale under 2**-128 is infinite and every nonzero code saturates)
            a = np.nanmax(np.abs(np.where(np.isinf(x), np.nan, x)), axis=-1, initial=0)
            x[(a > 0) & (a < 128 * 2.0**-126)] *= np.float32(2.0**100)
    if draw(st.booleans()):  # an all-zero row, or one of -0
        x[draw(st.integers(0, n - 1))] = draw(st.sampled_from([0.0, -0.0]))
    return x, bits


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # float16 scales
@law
@given(drawn=rows(), library=st.sampled_from(LIBRARIES),
       scales=st.sampled_from(["float32", "float16"]))
def test_quantize_is_the_reference_quantizer(drawn, library, scales):
    """quantize's codes and scales are the reference's bit for bit: any float32 or float16
    rows (NaN, infinities, subnormals, rows of zeros), either width, either scale dtype."""
    x, bits = drawn
    codes, got = quantized.quantize(on(library, x), bits,
                                    scale_dtype=scale_dtype(library, scales))
    want_codes, want = reference(x, bits, getattr(np, scales))
    codes, got = host(codes), host(got)
    assert codes.dtype == want_codes.dtype and got.dtype == want.dtype
    assert np.array_equal(codes, want_codes), f"codes\n{codes}\nwant\n{want_codes}\nof\n{x!r}"
    assert np.array_equal(got, want, equal_nan=True), f"scales {got}, want {want}, of\n{x!r}"


@law
@given(drawn=rows(finite=True), library=st.sampled_from(LIBRARIES))
def test_the_round_trip_is_within_half_a_scale(drawn, library):
    """|x - roundtrip(x)| <= s / 2 (a / 254 at 8 bits, a / 14 at 4), beyond float32's
    roundings of 1 / s, x (1 / s) and c s, for rows whose scale is a normal float32."""
    x, bits = drawn
    x32 = x.astype(np.float32)
    _, s = quantized.quantize(on(library, x), bits)
    back = host(quantized.roundtrip(on(library, x), bits)).astype(np.float64)
    s = host(s).astype(np.float64)[:, None]
    top = np.abs(x32).max(-1, keepdims=True).astype(np.float64)
    assert np.all(s <= top / LARGEST[bits] * (1 + 2.0**-22))
    err = np.abs(x32.astype(np.float64) - back)
    assert np.all(err <= quantized.bound(x32, s)), (
        f"error {err.max()} past half a scale {s.ravel() / 2}")
    assert np.all(back[top[:, 0] == 0] == 0), "an all-zero row reads back as zero"


# -- bad input --------------------------------------------------------------------------------
def call_arrays(backend, bits=8):
    """An index, q, k, v and an empty quantized pool of 16 slots on ``backend``."""
    ix = ci.rows(8, [3, 4], xp=backend.name)
    xp = ix.backend.xp
    rng = np.random.default_rng(0)

    def a(*shape):
        return xp.asarray(rng.standard_normal(shape).astype(np.float32))

    pool = quantized.zeros(16, KV, D, bits=bits, xp=backend.name)
    return ix, a(2, 4, HEADS, D), a(2, 4, KV, D), a(2, 4, KV, D), pool


@contextlib.contextmanager
def raises(error, *names):
    """``pytest.raises(error)``, its message naming each of ``names``."""
    with pytest.raises(error) as e:
        yield
    for name in names:
        assert name in str(e.value), f"{name!r} not in {e.value}"


def test_a_float_pool_as_codes_is_a_type_error(backend):
    """Codes must be int8 or uint8: a float pool wrapped as codes is a TypeError naming the
    call, before anything is stored."""
    ix, q, k, v, pool = call_arrays(backend)
    xp = ix.backend.xp
    floats = quantized.Quantized(xp.zeros((16, KV, D), dtype=xp.float32), pool.scales)
    with raises(TypeError, "cacheidx.extend", "codes"):
        ix.extend(k, floats)
    with raises(TypeError, "cacheidx.attend", "kpool"):
        ix.attend(q, k, v, floats, pool)
    with raises(TypeError, "cacheidx.attend", "vpool"):
        ix.attend(q, k, v, pool, floats)


def test_scales_of_other_slots_than_the_codes_are_a_value_error(backend):
    """Scales are ``[slots, kv_heads]`` of the codes' slots: one slot short, or another count
    of kv heads, is a ValueError naming the call."""
    ix, q, k, v, pool = call_arrays(backend)
    xp = ix.backend.xp
    for shape in ((15, KV), (16, KV + 1), (16,)):
        bad = quantized.Quantized(pool.codes, xp.zeros(shape, dtype=xp.float32))
        with raises(ValueError, "cacheidx.extend", "scales"):
            ix.extend(k, bad)
        with raises(ValueError, "cacheidx.attend", "kpool"):
            ix.attend(q, k, v, bad, pool)


def test_int_values_into_a_quantized_pool_are_a_type_error(backend):
    """What a call stores into a quantized pool must be real floats; the pool is left as it
    was, donated or not."""
    ix, q, k, v, pool = call_arrays(backend)
    xp = ix.backend.xp
    ints = xp.astype(k, xp.int32)
    with raises(TypeError, "cacheidx.extend", "real floats"):
        ix.extend(ints, pool, donate=True)
    with raises(TypeError, "cacheidx.attend", "k stored"):
        ix.attend(q, ints, v, pool, pool)
    with raises(TypeError, "cacheidx.attend", "v stored"):
        ix.attend(q, k, ints, pool, pool)
    assert not np.any(host(pool.codes)) and not np.any(host(pool.scales)), "a pool changed"


def test_an_odd_dim_at_4_bits_is_a_value_error():
    with raises(ValueError, "cacheidx.quantized.zeros", "even"):
        quantized.zeros(4, KV, 7, bits=4)
    assert quantized.zeros(4, KV, 7, bits=8).shape == (4, KV, 7)


@pytest.mark.parametrize("bits", [3, 16, 0, True, 8.5, "8"])
def test_bits_other_than_8_or_4_are_a_value_error(bits):
    with raises(ValueError, "cacheidx.quantized.zeros", "bits"):
        quantized.zeros(4, KV, D, bits=bits)


@pytest.mark.parametrize("bits", [3, 16])
def test_quantize_refuses_bits_other_than_8_or_4(bits):
    """quantize and roundtrip are public: another width is a ValueError naming them, not a
    KeyError from inside."""
    x = np.ones((2, D), np.float32)
    with raises(ValueError, "cacheidx.quantized.quantize", "bits"):
        quantized.quantize(x, bits)
    with raises(ValueError, "cacheidx.quantized.roundtrip", "bits"):
        quantized.roundtrip(x, bits)


def test_loading_the_cpu_kernel_keeps_subnormal_numbers():
    """The kernel is built without -ffast-math: a shared library linked with it sets the
    processor to flush subnormals to zero for the whole process on load (which broke other
    tests' arithmetic once it loaded)."""
    from cacheidx.attention import native

    if native.kernel() is None:
        pytest.skip("the CPU kernel could not be built here (no C compiler)")
    tiny = np.float32(1e-40)  # a float32 subnormal
    assert tiny * np.float32(1.0) != 0
    assert np.nextafter(np.float32(0), np.float32(1)) > 0


# -- narrow scales (issue 37, items 5 and 6) ---------------------------------------------------
def spanning_rows(seed: int = 0, n: int = 1000, d: int = 128) -> np.ndarray:
    """Rows whose largest magnitudes span float16's scales, subnormal ones included (``a``
    from ``1e-9`` to ``1e4``), the issue's row of maximum ``1e-5`` among them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-9, 4, (n, 1))
    x[0] = np.linspace(-1e-5, 1e-5, d)
    return x.astype(np.float32)


def compiled_quantizers(library: str):
    """``(name, quantize)`` of ``library``'s compilers over (x, bits, scale dtype name)."""
    if library == "torch":
        torch = pytest.importorskip("torch")
        import array_api_compat.torch as txp

        def compiled(backend):
            def run(x, bits, name):
                torch._dynamo.reset()
                fn = torch.compile(lambda a: quantized.quantize(
                    a, bits, scale_dtype=getattr(torch, name), xp=txp), backend=backend,
                    fullgraph=True)
                return fn(torch.from_numpy(x))
            return run
        return [("inductor", compiled("inductor")), ("aot_eager", compiled("aot_eager"))]
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    def jitted(x, bits, name):
        return jax.jit(lambda a: quantized.quantize(a, bits, scale_dtype=getattr(jnp, name)))(
            jnp.asarray(x))
    return [("jit", jitted)]


def eager_quantize(library: str, x: np.ndarray, bits: int, name: str):
    if library == "torch":
        import torch

        return quantized.quantize(torch.from_numpy(x), bits, scale_dtype=getattr(torch, name))
    import jax.numpy as jnp

    return quantized.quantize(jnp.asarray(x), bits, scale_dtype=getattr(jnp, name))


@pytest.mark.parametrize("library", ["torch", "jax"])
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_narrow_scale_is_rounded_alike_compiled_and_eager(library, name, bits):
    """Q1 under a compiler: the codes follow the scale rounded to its dtype, bit for bit as
    eagerly (inductor kept the rounded scale in float32 within its kernel: 845 of 128,000
    codes differed at float16, 6,346 at bfloat16), and the round trip keeps Q3."""
    x = spanning_rows()
    want_codes, want_scales = eager_quantize(library, x, bits, name)
    want_codes, want_scales = host(want_codes), host32(want_scales)
    for compiler, quantize in compiled_quantizers(library):
        codes, scales = quantize(x, bits, name)
        codes, scales = host(codes), host32(scales)
        assert np.array_equal(scales, want_scales), compiler
        differ = int((codes != want_codes).sum())
        assert differ == 0, f"{compiler}: {differ} of {codes.size} codes differ from eager"
        back = host(quantized.dequantize((codes, scales), xp=np_xp()))
        err = np.abs(x.astype(np.float64) - back)
        assert np.all(err <= quantized.bound(x, scales)), compiler


def host32(x):
    """A scale array of any library and float dtype as float32 NumPy (bfloat16 has none)."""
    if hasattr(x, "detach"):
        x = x.detach().float()
    return np.asarray(x).astype(np.float32)


def np_xp():
    import array_api_compat.numpy as xp

    return xp


@pytest.mark.parametrize("library", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("bits", [8, 4])
def test_q3_holds_for_every_float16_scale_subnormal_included(library, bits):
    """Q3 with float16 scales over every scale a float16 can hold, subnormal ones included: a
    row of maximum 1e-5 once gave a scale of 5.96e-8 and codes of 127, 80 times the bound."""
    top = 2.0 ** np.arange(-24, 16, 0.125) * LARGEST[bits]  # scales 2**-24 .. 2**16
    top = top[top / LARGEST[bits] <= 65504]
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, (len(top), 32)) * top[:, None]
    x[:, 0] = top  # the row's largest magnitude, exactly
    x = np.concatenate([x, spanning_rows(n=200, d=32)]).astype(np.float32)
    if library == "numpy":
        codes, scales = quantized.quantize(x, bits, scale_dtype=np.float16)
    else:
        pytest.importorskip(library)
        codes, scales = eager_quantize(library, x, bits, "float16")
    codes, scales = host(codes), host(scales).astype(np.float32)
    back = host(quantized.dequantize((codes, scales), xp=np_xp()))
    err = np.abs(x.astype(np.float64) - back)
    bound = quantized.bound(x, scales)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), (
        f"|x - c s| = {err[worst]:.3g}, {err[worst] / bound[worst]:.3g} times the bound, at a "
        f"row of scale {scales[worst[0]]!r}")
    assert np.all(scales > 0), "no nonzero row's float16 scale rounds to zero"


# -- JAX's subnormal elements (issue 37, item 9) ---------------------------------------------
def test_jax_quantizes_a_subnormal_element_as_zero_within_the_stated_bound():
    """XLA's CPU reads subnormal float32 as zero: under a normal scale below 2**-125 a
    subnormal element's code is 0 on JAX where NumPy's is ±1 (``[7, 1, 1, -1]`` against
    ``[7, 0, 0, 0]``). Everywhere else JAX's codes are NumPy's; there its error is within the
    bound the module states for it (``bound(..., flushed=True)``: below 2**-126)."""
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(2)
    for bits in (8, 4):
        q = LARGEST[bits]
        tiny = np.float32(2.0**-126)
        # rows of scale 2**-126 .. 2**-124, their elements subnormal and normal alike
        a = tiny * q * rng.uniform(1, 4, (64, 1))
        x = (rng.uniform(-1, 1, (64, 16)) * a).astype(np.float32)
        x[:, 0] = a[:, 0]
        x[0, :4] = np.float32([7, 1, 1, -1]) / 7 * np.float32(a[0, 0])
        want, ws = quantized.quantize(x, bits)
        got, gs = (np.asarray(y) for y in quantized.quantize(jnp.asarray(x), bits))
        assert np.array_equal(gs, ws), "the scales agree"
        want, got = (host(quantized.floats(c, xp=np_xp())) for c in (want, got))
        differ = want != got
        assert np.all(np.abs(x[differ]) < tiny), "JAX differs only at subnormal elements"
        assert np.all(got[differ] == 0), "which it reads as zero"
        assert np.all(ws[np.any(differ, axis=-1)] < 2.0**-125), "under scales below 2**-125"
        back = host(quantized.dequantize((np.asarray(quantized.quantize(jnp.asarray(x), bits)[0]),
                                          gs), xp=np_xp()))
        err = np.abs(x.astype(np.float64) - back)
        assert np.all(err <= quantized.bound(x, gs, flushed=True))


# -- loose checks (issue 37, item 10) --------------------------------------------------------
@pytest.mark.parametrize("dtype", ["complex64", "int32", "int8", "bool"])
def test_quantize_refuses_what_is_not_real_floats(backend, dtype):
    """Complex rows (their imaginary parts were dropped), integer and boolean rows: a TypeError
    naming quantize and the dtype, never a cast."""
    xp = backend.xp
    if not hasattr(xp, dtype):
        pytest.skip(f"{backend.name} has no {dtype}")
    x = xp.asarray(np.ones((2, D)).astype(dtype))
    with raises(TypeError, "cacheidx.quantized.quantize: ", dtype):
        quantized.quantize(x, 8, xp=xp)
    with raises(TypeError, "cacheidx.quantized.quantize: ", dtype):
        quantized.roundtrip(x, 4, xp=xp)


def test_quantize_refuses_rows_of_no_elements(backend):
    """A row of length 0 (NumPy's "zero-size array" error before): a ValueError naming
    quantize and the shape."""
    xp = backend.xp
    x = xp.zeros((3, 0), dtype=xp.float32)
    with raises(ValueError, "cacheidx.quantized.quantize: ", "[3, 0]"):
        quantized.quantize(x, 8, xp=xp)


def test_dequantize_refuses_scales_of_another_shape_and_codes_of_another_dtype(backend):
    """Scales that would broadcast against the codes, and int16 codes (read as 8-bit before):
    a ValueError, and a TypeError, naming dequantize and what came."""
    xp = backend.xp
    codes, scales = quantized.quantize(xp.ones((4, D), dtype=xp.float32), 8, xp=xp)
    with raises(ValueError, "cacheidx.quantized.dequantize: ", "[1]"):
        quantized.dequantize((codes, xp.ones((1,), dtype=xp.float32)), xp=xp)
    with raises(ValueError, "cacheidx.quantized.dequantize: ", "[4, 1]"):
        quantized.dequantize((codes, scales[:, None]), xp=xp)
    with raises(TypeError, "cacheidx.quantized.dequantize: ", "int16"):
        quantized.dequantize((xp.astype(codes, xp.int16), scales), xp=xp)
    with raises(TypeError, "cacheidx.quantized.dequantize: ", "int32"):
        quantized.dequantize((codes, xp.astype(scales, xp.int32)), xp=xp)
