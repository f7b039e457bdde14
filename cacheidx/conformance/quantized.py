"""The laws of quantized pools (:mod:`cacheidx.quantized`'s Q1 to Q3), each checked against a
slow quantizer written here, by hand, in plain NumPy.

The reference (:func:`quantize`) shares no code with :mod:`cacheidx.quantized`: it walks the
rows one by one, so a law that holds holds of the law as written, not of one implementation
against itself. A call through a quantized pool is then compared with the spec's path, the call
through a float pool holding the reference's round trip, on NumPy over the same index: ``seen``
and the stored codes and scales bit for bit, ``attend``'s output to attention's
:func:`~cacheidx.conformance.attention.tolerance`.

Pools start holding codes and scales of random rows, with a row of NaN (scale NaN) in slots a
law says must read as zero or stay untouched, so a zero that is really a NaN scale times a zero
code shows up. They come in both memory orders, token-major and head-major, in turn.

Compiled modes compile little (a quantized pool is a new pytree to every step, so nothing the
other laws compile serves, and a compile costs about a second): ``extend`` over rows at one
width a mode (8 bits with static shapes, 4 under symbolic ones) and ``attend`` over a window,
keys 8 bits and values 4, with static shapes. The other kinds and widths are checked eagerly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import pytree
from .. import quantized as library  # the code the laws hold of
from ..attention import reference
from ..quantized import Quantized
from .attention import DIM, HEADS, KV, TILE, close
from .laws import variants
from .suite import Case, law

#: the largest code of each width
LARGEST = {8: 127, 4: 7}


# -- the reference: law Q1 and Q2 by hand, one row at a time ---------------------------------
def quantize(x: np.ndarray, bits: int, scale_dtype: Any = np.float32
             ) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)`` of rows ``x`` ``[..., d]`` as law Q1 states them: per row, in
    float32, ``a = max|x|``, ``s = float32(a * float32(1 / Q))`` rounded to ``scale_dtype``,
    ``c = clip(round(x * float32(1 / s)), -Q, Q)`` from that rounded scale, rounding half to
    even (NumPy's ``round``); an all-zero row (or one whose float32 scale falls below float32's
    smallest normal, or rounds to zero) scale 0 and codes 0; a row holding NaN or an infinity
    scale NaN and codes 0. At 4 bits byte ``i`` holds ``c_i + 8`` in its low nibble and
    ``c_{i + d/2} + 8`` in its high one."""
    q = LARGEST[bits]
    x = np.asarray(x).astype(np.float32)
    rows = x.reshape(-1, x.shape[-1])
    codes = np.zeros(rows.shape, np.int8)
    scales = np.zeros(len(rows), np.float32)
    inverse = np.float32(1 / q)  # rounded to float32 once, as Q1 says
    for r, row in enumerate(rows):
        a = np.max(np.abs(row))
        if not np.isfinite(a):
            scales[r] = np.nan  # codes stay 0: the row reads as NaN throughout
            continue
        s = np.float32(a * inverse)  # a float32 product, rounded once
        if s < np.finfo(np.float32).smallest_normal:
            s = np.float32(0)  # Q1: below float32's smallest normal a scale is zero
        with np.errstate(over="ignore"):
            s = scales[r] = np.float32(np.asarray(s).astype(scale_dtype))  # as stored
        if s == 0:
            continue
        reciprocal = np.float32(1) / s  # rounded to float32 once a row, as Q1 says
        codes[r] = np.clip(np.round(row * reciprocal), -q, q)  # a float32 product, half to even
    if bits == 4:
        half = rows.shape[-1] // 2
        nibbles = (codes.astype(np.int16) + 8).astype(np.uint8)
        codes = nibbles[:, :half] | (nibbles[:, half:] << 4)
    return (codes.reshape(*x.shape[:-1], codes.shape[-1]),  # no row too: never -1
            scales.astype(scale_dtype).reshape(x.shape[:-1]))


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Law Q2 by hand: element ``i`` of a row is ``c_i * s`` in float32 (4-bit codes unpacked
    first: low nibbles, then high ones, each less 8)."""
    if codes.dtype == np.uint8:
        low, high = (codes & 15).astype(np.int16), (codes >> 4).astype(np.int16)
        codes = np.concatenate([low, high], axis=-1) - 8
    return codes.astype(np.float32) * scales.astype(np.float32)[..., None]


# -- rows a quantizer can get wrong ----------------------------------------------------------
#: scales at which the half-way rows sit, per width: each is ``a * float32(1 / Q)`` exactly for
#: ``a = Q * s`` (so a row whose largest element is ``Q * s`` gets it), and ``k + 0.5`` times
#: it is a float32 whose quotient by it is exactly ``k + 0.5``. At the powers of two the
#: reciprocal is exact, so the product is half-way too and pins rounding half to even; at the
#: last of each the product by the float32 reciprocal misses half-way (8 bits: -126.5 at
#: 0.8125; 4 bits: 3.5 and -3.5 at 2.5625), so a quantizer that divides by the scale, where
#: Q1 multiplies by its reciprocal, shows
HALFWAY_SCALES = {8: (2.0**-3, 1.0, 32.0, 0.8125), 4: (2.0**-3, 1.0, 2.5625)}
#: the quotients ``k + 0.5`` of a half-way row: ``k`` even and odd, of both signs, next to Q
HALFWAY = {8: (0.5, 1.5, 2.5, -0.5, -1.5, 125.5, -126.5), 4: (0.5, 1.5, 3.5, 6.5, -0.5, -2.5, -3.5)}
ROWS = 24  #: rows the store law writes: two lanes of six tokens, at both kv heads


def halfway(bits: int) -> np.ndarray:
    """Rows ``[n, DIM]`` of the largest element ``Q * s``, then elements half-way between two
    codes: ``x / s`` is exactly one of :data:`HALFWAY`, for each of :data:`HALFWAY_SCALES`."""
    q = LARGEST[bits]
    ks = np.array(HALFWAY[bits], np.float32)
    rows = []
    for s in map(np.float32, HALFWAY_SCALES[bits]):
        row = np.concatenate([[np.float32(q) * s], ks * s]).astype(np.float32)
        # the rows' premise, checked rather than trusted
        assert quantize(row, bits)[1] == s, f"{bits} bits: scale {s} is not Q1's for {row}"
        assert np.all(row[1:] / s == ks), f"{bits} bits: x / s is not half-way at scale {s}"
        if s == 2.0 ** np.round(np.log2(s)):  # a power of two: the product is half-way too
            assert np.all(row[1:] * (np.float32(1) / s) == ks), f"{bits} bits: at scale {s}"
        rows.append(row)
    return np.stack(rows)


def awkward(bits: int, seed: int, n: int = ROWS) -> np.ndarray:
    """``n`` rows ``[n, DIM]`` every quantizer must agree on: all zero, all -0, a NaN, +Inf,
    -Inf, a lone nonzero element, tiny ones, the half-way rows, then random rows of magnitudes
    from 1e-20 to 1e20."""
    rng = np.random.default_rng(seed)
    special = rng.standard_normal((7, DIM)).astype(np.float32)
    special[0] = 0.0
    special[1] = -0.0
    special[2, 3], special[3, 0], special[4, 5] = np.nan, np.inf, -np.inf
    special[5] = 0.0
    special[5, 6] = -3.0  # a lone element: every other code 0
    special[6] *= np.float32(1e-30)
    fixed = np.concatenate([special, halfway(bits)])
    m = n - len(fixed)
    scaled = rng.standard_normal((m, DIM)) * 10.0 ** rng.uniform(-20, 20, (m, 1))
    return np.concatenate([fixed, scaled.astype(np.float32)])


# -- pools, and the spec's path ---------------------------------------------------------------
def pooled(case: Case, codes: np.ndarray, scales: np.ndarray, head: bool) -> Quantized:
    """``(codes, scales)`` as a quantized pool of the case, its memory head-major where
    ``head`` (as ``quantized.zeros(layout="head")`` lays it): the laws hold in either."""
    xp = case.xp
    dtype = xp.int8 if codes.dtype == np.int8 else xp.uint8
    if not head:
        return Quantized(case.array(codes, dtype=dtype), case.array(scales))
    by_head = case.array(np.ascontiguousarray(codes.transpose(1, 0, 2)), dtype=dtype)
    return Quantized(xp.permute_dims(by_head, (1, 0, 2)),
                     xp.permute_dims(case.array(np.ascontiguousarray(scales.T)), (1, 0)))


def filled(slots: int, bits: int, seed: int, nan: tuple[int, ...] = ()) -> tuple:
    """Host codes and scales of random rows ``[slots, KV, DIM]``, a row of NaN (scale NaN,
    codes 0) at each slot of ``nan``."""
    rows = np.random.default_rng(seed).standard_normal((slots, KV, DIM)).astype(np.float32)
    rows[list(nan)] = np.nan
    return quantize(rows, bits)


def spec_path(case: Case, ix, values: np.ndarray, pool: tuple, bits: int):
    """The right-hand side on NumPy: ``(seen, codes, scales)``. ``seen`` is ``extend`` of the
    reference's round trip of ``values`` over a float pool holding ``pool`` dequantized; the
    codes and scales are the reference's, stored by ``extend`` as it stores any rows (the index
    laws hold that store on every backend)."""
    host = pytree.map(ix, case.numpy)
    values = case.numpy(values)
    codes, scales = quantize(values, bits)
    seen, _ = host.extend(dequantize(codes, scales), dequantize(*pool))
    _, want_codes = host.extend(codes, pool[0])
    _, want_scales = host.extend(scales, pool[1])
    return seen, want_codes, want_scales


def exact(case: Case, got, want: np.ndarray, what: str) -> None:
    """``got`` equals ``want`` bit for bit (NaN where NaN); else the first rows (along the
    last axis) that differ, each beside the reference's."""
    got = case.numpy(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    nan = got.dtype.kind == "f"
    if np.array_equal(got, want, equal_nan=nan):
        return
    shape = got.shape if got.ndim > 1 else (*got.shape, 1)  # a vector's rows: its elements
    g, w = got.reshape(-1, shape[-1]), want.reshape(-1, shape[-1])
    equal = (g == w) | (np.isnan(g) & np.isnan(w)) if nan else g == w
    bad = np.flatnonzero(~equal.all(-1))
    lines = [f"{what}: {len(bad)} rows differ from the reference's, the first:"]
    for r in bad[:4]:
        at = tuple(int(i) for i in np.unravel_index(r, shape[:-1]))
        lines.append(f"  at {at}: got {g[r]}, want {w[r]}")
    raise AssertionError("\n".join(lines))


def same_pool(case: Case, got: Quantized, want_codes, want_scales, what: str) -> None:
    """A quantized pool's codes and scales, each bit for bit."""
    assert isinstance(got, Quantized), f"{what}: a {type(got).__name__}, not a quantized pool"
    exact(case, got.codes, want_codes, f"{what}: the codes")
    exact(case, got.scales, want_scales, f"{what}: the scales")


def extend(ix, values, pool):
    return ix.extend(values, pool)


#: the width each compiled mode compiles ``extend`` at (a compile costs about a second a
#: width, torch's symbolic shapes twice that): 8 bits with static shapes (where attend's law
#: compiles 4-bit values), 4 bits under symbolic shapes (the packing's half of a row)
COMPILED_WIDTH = {"compiled": 8, "dynamic": 4, "automatic": 4}


def holds(case: Case, ix, values, before: tuple, bits: int, seen, pool, what: str) -> None:
    """``(seen, pool)``, extend's of ``values`` into the quantized pool ``before`` (host codes
    and scales), against the spec's path: the codes and scales, then seen, bit for bit."""
    want_seen, codes, scales = spec_path(case, ix, values, before, bits)
    same_pool(case, pool, codes, scales, f"{what}, {bits} bits")
    exact(case, seen, want_seen, f"{what}, {bits} bits: seen")


def host(case: Case, pool: Quantized) -> tuple:
    return case.numpy(pool.codes), case.numpy(pool.scales)


# -- the laws -------------------------------------------------------------------------------
@law
def law_a_quantized_store_holds_the_reference_codes_and_scales(case: Case) -> None:
    """What extend stores into a quantized pool, and quantize returns, is the reference
    quantizer's codes and scales bit for bit at 8 and 4 bits: an all-zero row scale 0, a row
    with NaN or Inf scale NaN and codes 0, a half-way product by the scale's reciprocal rounded
    to even (and the product, never a quotient); every other slot keeps its zeros; seen is
    their round trip. (Compiled: one width a mode, agreeing with eager bit for bit, the one
    compiled extend of a quantized pool here; the other width eagerly.)"""
    from .. import build

    rows = {bits: awkward(bits, seed=bits) for bits in LARGEST}
    # two lanes of six tokens: token i of lane b stores at slot 6b + i; slots 12 to 15 stay
    ix = build.rows(6, [6, 6], xp=case.name, device=case.device)
    values = {bits: case.array(x.reshape(2, 6, KV, DIM)) for bits, x in rows.items()}
    pools = {bits: library.zeros(16, KV, DIM, bits=bits, xp=case.name, device=case.device,
                                 layout="head" if bits == 4 else "token") for bits in LARGEST}
    before = {bits: host(case, pool) for bits, pool in pools.items()}
    for bits in LARGEST:
        args = (ix, values[bits], pools[bits])
        compiles = COMPILED_WIDTH.get(case.mode) == bits
        seen, pool = case.call(extend, *args) if compiles else extend(*args)
        holds(case, ix, values[bits], before[bits], bits, seen, pool, "rows")
    for bits, x in values.items():
        codes, scales = library.quantize(x, bits, xp=case.xp)
        want_codes, want_scales = quantize(case.numpy(x), bits)
        exact(case, codes, want_codes, f"quantize, {bits} bits: the codes")
        exact(case, scales, want_scales, f"quantize, {bits} bits: the scales")


SLOTS = 22  #: every slot the kinds of index of ``variants(case, 2, 11)`` name


#: the kinds of index extend is checked over, each a read of its own (JAX compiles every
#: operation of each kind's plan, eagerly, about half a second a kind): a window's seen is a
#: row's, masked, and attend's law stores through one; a packed index's is a whole one's
EXTENDED = ("rows", "blocks", "row map", "select", "draft", "whole")


@law(eager_only=True)
def law_extend_sees_codes_times_scales_as_it_sees_a_float_pool(case: Case) -> None:
    """For every kind of index's reads (rows, blocks, a row map, a selection, a draft, whole),
    extend's seen of a quantized pool is its codes times their scales read as extend reads a
    float pool: bit for bit extend over a float pool holding the round trip (NaN across a
    stored row that held NaN or Inf), unseen columns zero though a NaN scale sits there; its
    codes and scales are the reference's where the float store writes (whole: the pool
    given itself). The kinds take 8 and 4
    bits in turn, each width both memory orders. (Compiled, the store law's step reads its
    rows.)"""
    kinds = variants(case, 2, 11)
    for seed, kind in enumerate(EXTENDED):
        ix = kinds[kind]
        # a width a kind, in turn (the reads are the index's, whatever the codes' dtype)
        bits, head = (8, 4)[seed % 2], seed // 2 % 2 == 1
        x = np.random.default_rng(50 + seed).standard_normal((ix.batch, ix.seq, KV, DIM))
        x[0, 0, 1, 3], x[-1, -1, 0, 2] = np.nan, -np.inf  # rows that read as NaN
        values = case.array(x)
        # rows of NaN (scale NaN) at slots some kinds read and others do not
        before = filled(SLOTS, bits, seed, nan=(5, 9, 17))
        given = pooled(case, *before, head)
        seen, pool = ix.extend(values, given)
        assert ix.kind == "tabled" or pool is given, (
            f"{kind}: extend returned another pool than the one it was given")
        holds(case, ix, values, before, bits, seen, pool,
              f"{kind} ({'head' if head else 'token'}-major)")


@law(eager_only=True)
def law_the_round_trip_is_within_half_a_scale(case: Case) -> None:
    """An element's round trip is within half its row's scale, a / 254 at 8 bits and a / 14 at
    4 bits (a the row's largest magnitude), beyond the float32 roundings of 1 / s, x (1 / s)
    and c s: rows of magnitudes 1e-30 to 1e30, the half-way rows among them."""
    rng = np.random.default_rng(7)
    for bits, q in LARGEST.items():
        x = rng.uniform(-1, 1, (ROWS, DIM)) * 10.0 ** rng.uniform(-30, 30, (ROWS, 1))
        h = halfway(bits)
        x = np.concatenate([h, x[len(h):]]).astype(np.float32)
        # shaped as the store law's values, so that JAX's eager operations are its programs
        on = case.array(x.reshape(2, -1, KV, DIM))
        _, scales = library.quantize(on, bits, xp=case.xp)
        back = case.numpy(library.roundtrip(on, bits, xp=case.xp)).reshape(x.shape)
        s = case.numpy(scales).astype(np.float64).reshape(-1, 1)
        top = np.max(np.abs(x), axis=-1, keepdims=True).astype(np.float64)
        assert np.all(s <= top / q * (1 + 2.0**-22)), f"{bits} bits: a scale past a / Q"
        err = np.abs(x.astype(np.float64) - back.astype(np.float64))
        bound = library.bound(x, s)  # Q3's, as cacheidx.quantized states it
        r, i = np.unravel_index(np.argmax(err - bound), err.shape)
        assert np.all(err <= bound), (
            f"{bits} bits: |x - c s| = {err[r, i]:.6g} > s / 2 = {s[r, 0] / 2:.6g} at "
            f"x = {x[r, i]!r}, element {i} of a row of scale {s[r, 0]!r}")


def attend_quantized(ix, q, k, v, kpool, vpool):
    return ix.attend(q, k, v, kpool, vpool, tile=TILE)


#: the widths of keys and values, kind by kind in turn: both 8, both 4, and each mixed
WIDTHS = ((8, 8), (4, 4), (8, 4), (4, 8))
#: the kinds attend is checked over, one of each way it reads the pools (JAX compiles a
#: program for each, eagerly too): views of runs of slots (a window), blocks, tiles of chosen
#: columns (a selection), a draft beside the table, and none (whole: the call's own values)
KINDS = ("window", "blocks", "select", "draft", "whole")
#: the kind the static-shape mode compiles attend over (a quantized pool is a new structure
#: to every step, so nothing the other laws compile serves): a window, read as views of runs
#: eagerly, through torch's operator and JAX's loop compiled
COMPILED = "window"


def unseen(case: Case, ix, slots: int) -> list[int]:
    """The slots whose rows no token of ``ix`` sees (nor stores at): extend over a pool of
    slot numbers, the call's own values -1, reads every slot some token sees."""
    host = pytree.map(ix, case.numpy)
    ids = np.arange(1, slots + 1, dtype=np.float32)[:, None]
    seen, _ = host.extend(np.full((ix.batch, ix.seq, 1), -1, np.float32), ids)
    return sorted(set(range(slots)) - {int(i) - 1 for i in seen.ravel() if i > 0})


@law(family="attention", modes=("eager", "compiled"))
def law_attend_over_quantized_pools_is_attention_over_the_round_trip(case: Case) -> None:
    """For every way of reading pools (views of runs, blocks, a selection's tiles, a draft, a
    whole index), attend over quantized ones is softmax attention over extend's seen of them
    (the codes times their scales) under mask, within attention's tolerance, and its pools'
    codes and scales are extend's bit for bit: keys and values at 8 and 4 bits, each width
    with the other, in both memory orders; a NaN scale in a slot no token sees reaches no
    output. (Compiled: a window, keys 8 bits and values 4, agreeing with eager to the same
    tolerance.)"""
    kinds = variants(case, 2, 11)
    for seed, kind in enumerate(KINDS):
        if case.compiled and kind != COMPILED:
            continue
        ix = kinds[kind]
        kbits, vbits = WIDTHS[seed % 4] if not case.compiled else (8, 4)
        rng = np.random.default_rng(60 + seed)
        q, k, v = (case.array(rng.standard_normal((ix.batch, ix.seq, h, DIM)))
                   for h in (HEADS, KV, KV))
        # rows of NaN wherever no token sees: a scale folded into a score or a weight it
        # should not reach would poison the output
        nan = tuple(unseen(case, ix, SLOTS))
        host_k = filled(SLOTS, kbits, 2 * seed, nan=nan)
        host_v = filled(SLOTS, vbits, 2 * seed + 1, nan=nan)
        head = seed % 2 == 1
        kpool, vpool = pooled(case, *host_k, head), pooled(case, *host_v, head)
        what = f"{kind}, keys {kbits} bits, values {vbits}"
        outs = [("eager", attend_quantized(ix, q, k, v, kpool, vpool))]
        seen_k, kcodes, kscales = spec_path(case, ix, k, host_k, kbits)
        seen_v, vcodes, vscales = spec_path(case, ix, v, host_v, vbits)
        want = reference(case.numpy(q), seen_k, seen_v, pytree.map(ix, case.numpy).mask())
        columns = ix.context if ix.columns is None else int(ix.columns.shape[-1])
        if case.compiled:
            outs.append(("compiled", case.jit(attend_quantized)(ix, q, k, v, kpool, vpool)))
            close(case, outs[1][1][0], outs[0][1][0], seen_v, columns,
                  f"{what}: eager and compiled")
        for mode, (out, kp, vp) in outs:
            close(case, out, want, seen_v, columns, f"{what} ({mode})")
            same_pool(case, kp, kcodes, kscales, f"{what} ({mode}): the key pool")
            same_pool(case, vp, vcodes, vscales, f"{what} ({mode}): the value pool")
