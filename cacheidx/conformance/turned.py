"""The laws of turned 4-bit pools (:mod:`cacheidx.turned`'s T1 to T4), each checked against a
slow quantizer written here, by hand, in plain NumPy, one row and one element pair at a time.

As for :mod:`cacheidx.conformance.quantized`: the reference shares no code with the library; a
call through a turned pool is compared with the spec's path, the call through a float pool
holding the reference's round trip, on NumPy over the same index: ``seen`` and the stored parts
bit for bit, ``attend`` to attention's tolerance. Keys take two groups a row and float16 scales
(as the engine's keys), values one group a row and float32 scales.

Compiled modes compile one store (keys) and ``attend`` over a window; the rest run eagerly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import pytree
from .. import turned as library  # the code the laws hold of
from ..attention import reference
from ..turned import Turned
from .attention import DIM, HEADS, KV, TILE, close
from .laws import variants
from .quantized import ROWS, SLOTS, exact, unseen
from .suite import Case, law

F32 = np.float32
#: (group, scales' dtype) of each pool the laws fill: keys' (two groups a row of DIM), then
#: values' (one group a row)
POOLS = ((DIM // 2, np.float16), (DIM, np.float32))


# -- the reference: T1 to T3 by hand ----------------------------------------------------------
def turn(row: np.ndarray) -> np.ndarray:
    """T1 on one float32 row: stage ``h`` takes elements ``i`` and ``i + h`` of each run of
    ``2h`` to their sum and difference, for ``h`` below the largest power of two dividing d."""
    y = row.astype(F32).copy()
    d = len(y)
    h = 1
    with np.errstate(over="ignore", invalid="ignore"):
        while h < (d & -d):
            out = y.copy()
            for start in range(0, d, 2 * h):
                for j in range(start, start + h):
                    out[j], out[j + h] = y[j] + y[j + h], y[j] - y[j + h]
            y, h = out, 2 * h
    return y


def narrowed(s: F32, dtype: Any) -> F32:
    """A float32 scale as T2 stores it in ``dtype``: to nearest, up below a normal float16."""
    if dtype == np.float32 or not np.isfinite(s) or s == 0:
        return F32(s)
    tiny, quantum = 2.0**-14, 2.0**-24
    if s < tiny:
        return F32(np.ceil(float(s) / quantum) * quantum)
    with np.errstate(over="ignore"):
        return F32(np.float16(s))


def quantize(x: np.ndarray, group: int, scale_dtype: Any) -> tuple:
    """``(codes, scales, zeros)`` of rows ``x`` as T1 and T2 state them, group by group."""
    x = np.asarray(x).astype(F32)
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    n = d // group
    codes = np.zeros(rows.shape, np.uint8)
    scales = np.zeros((len(rows), n), F32)
    zeros = np.zeros((len(rows), n), np.int8)
    for r, row in enumerate(rows):
        y = turn(row)
        for g in range(n):
            part = y[g * group:(g + 1) * group]
            lo, hi = part.min(), part.max()
            with np.errstate(over="ignore", invalid="ignore"):
                s = max(F32(F32(hi - lo) * F32(1 / 15)), F32(abs(lo) * F32(1 / 126)))
            if not (np.all(np.isfinite(row)) and np.isfinite(s)):
                scales[r, g] = np.nan
                continue
            if s < np.finfo(F32).smallest_normal:
                continue  # scale, codes and zero point 0
            s = scales[r, g] = narrowed(F32(s), scale_dtype)
            if not np.isfinite(s):
                continue  # past the dtype's largest: infinite, codes 0
            inverse = F32(1) / s
            z = np.round(F32(-lo * inverse))
            zeros[r, g] = z
            for i, e in enumerate(part):
                codes[r, g * group + i] = np.clip(np.round(F32(e * inverse)) + z, 0, 15)
    half = d // 2
    packed = codes[:, :half] | (codes[:, half:] << 4)
    lead = x.shape[:-1]
    return (packed.reshape(*lead, half), scales.astype(scale_dtype).reshape(*lead, n),
            zeros.reshape(*lead, n))


def dequantize(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """T3 by hand: ``(c - z) s`` element by element, turned back, times ``1 / b``."""
    d = 2 * codes.shape[-1]
    c = np.concatenate([codes & 15, codes >> 4], axis=-1).reshape(-1, d)
    s, z = scales.astype(F32).reshape(len(c), -1), zeros.reshape(len(c), -1)
    group = d // s.shape[1]
    out = np.zeros(c.shape, F32)
    for r in range(len(c)):
        y = np.array([F32(F32(int(c[r, i]) - int(z[r, i // group])) * s[r, i // group])
                      for i in range(d)], F32)
        out[r] = turn(y) * F32(1 / (d & -d))
    return out.reshape(*codes.shape[:-1], d)


# -- rows, pools and the spec's path ----------------------------------------------------------
def awkward(seed: int, n: int = ROWS) -> np.ndarray:
    """Rows every quantizer must agree on: all zero, -0, a NaN, +Inf, -Inf, a lone element,
    tiny ones (a float16 scale rounded up), a constant row and one of one sign (the zero point
    at its bound), then rows of magnitudes 1e-20 to 1e20 (float16 scales past their largest)."""
    rng = np.random.default_rng(seed)
    special = rng.standard_normal((9, DIM)).astype(F32)
    special[0], special[1] = 0.0, -0.0
    special[2, 3], special[3, 0], special[4, 5] = np.nan, np.inf, -np.inf
    special[5] = 0.0
    special[5, 6] = -3.0
    special[6] *= F32(1e-30)
    special[7] = 2.5
    special[8] = 40.0 + special[8] * 0.01
    m = n - len(special)
    scaled = rng.standard_normal((m, DIM)) * 10.0 ** rng.uniform(-20, 20, (m, 1))
    return np.concatenate([special, scaled.astype(F32)])


def pooled(case: Case, parts: tuple, head: bool) -> Turned:
    """Host ``(codes, scales, zeros)`` as a turned pool of the case, head-major where ``head``."""
    xp = case.xp
    dtypes = (xp.uint8, scale_dtype(case, parts[1].dtype), xp.int8)
    if not head:
        return Turned(*(case.array(p, dtype=t) for p, t in zip(parts, dtypes)))
    return Turned(*(xp.permute_dims(case.array(np.ascontiguousarray(p.transpose(1, 0, 2)),
                                               dtype=t), (1, 0, 2))
                    for p, t in zip(parts, dtypes)))


def filled(case: Case, slots: int, which: int, seed: int, nan: tuple[int, ...] = ()) -> tuple:
    """Host parts of random rows ``[slots, KV, DIM]``, NaN rows at the slots of ``nan``."""
    rows = np.random.default_rng(seed).standard_normal((slots, KV, DIM)).astype(F32)
    rows[list(nan)] = np.nan
    group, dtype = POOLS[which]
    return quantize(rows, group, host_dtype(case, dtype))


def spec_path(case: Case, ix, values, pool: tuple, which: int):
    """``(seen, parts)`` on NumPy: extend of the reference's round trip over a float pool
    holding ``pool``'s, and the reference's parts stored as extend stores any rows."""
    host = pytree.map(ix, case.numpy)
    group, dtype = POOLS[which]
    parts = quantize(case.numpy(values), group, host_dtype(case, dtype))
    seen, _ = host.extend(dequantize(*parts), dequantize(*pool))
    return seen, tuple(host.extend(p, q)[1] for p, q in zip(parts, pool))


def same_pool(case: Case, got: Any, want: tuple, what: str) -> None:
    assert isinstance(got, Turned), f"{what}: a {type(got).__name__}, not a turned pool"
    for name, g, w in zip(Turned._fields, got, want):
        exact(case, g, w, f"{what}: the {name}")


def scale_dtype(case: Case, dtype: Any) -> Any:
    """The case's library's dtype for NumPy's ``dtype`` (float16 or float32)."""
    return case.xp.float32 if dtype == np.float32 else library.half(case.xp)


def host_dtype(case: Case, dtype: Any) -> Any:
    """``dtype`` as the case's library can hold it: float16 only where it has one."""
    return np.float16 if dtype == np.float16 and hasattr(case.xp, "float16") else np.float32


def extend(ix, values, pool):
    return ix.extend(values, pool)


# -- the laws -------------------------------------------------------------------------------
@law
def law_a_turned_store_holds_the_reference_codes_scales_and_zeros(case: Case) -> None:
    """What extend stores into a turned pool, and quantize returns, is the reference's codes,
    scales and zero points bit for bit (T1, T2): keys in two groups a row with float16
    scales, values in one with float32 ones; a zero row all zero, a row with NaN or Inf NaN
    scales and zero codes, a float16 scale past its largest infinite, a tiny one rounded up,
    a row of one sign at the zero point's bound; every other slot keeps its zeros; seen is the
    reference's round trip (T3). (Compiled: the keys' store, agreeing with eager.)"""
    from .. import build

    ix = build.rows(6, [6, 6], xp=case.name, device=case.device)
    for which, (group, dtype) in enumerate(POOLS):
        x = awkward(seed=70 + which)
        values = case.array(x.reshape(2, 6, KV, DIM))
        pool = library.zeros(16, KV, DIM, group=group, xp=case.name, device=case.device,
                             scale_dtype=scale_dtype(case, dtype),
                             layout="head" if which else "token")
        before = tuple(case.numpy(p) for p in pool)
        args = (ix, values, pool)
        seen, got = case.call(extend, *args) if which == 0 else extend(*args)
        want_seen, want = spec_path(case, ix, values, before, which)
        what = f"rows, groups of {group}"
        same_pool(case, got, want, what)
        exact(case, seen, want_seen, f"{what}: seen")
        direct = library.quantize(values, group, scale_dtype=pool.scales.dtype, xp=case.xp)
        want = quantize(x.reshape(2, 6, KV, DIM), group, host_dtype(case, dtype))
        for name, g, w in zip(Turned._fields, direct, want):
            exact(case, g, w, f"quantize, groups of {group}: the {name}")


@law(eager_only=True)
def law_the_turned_round_trip_is_within_half_a_scale_of_the_turn(case: Case) -> None:
    """Each turned element's value is within T4's bound of the turn's (half its group's scale,
    and 15 float16 epsilons of it where the rounded scale clips), and each row's error in the
    2-norm is the turned one's over sqrt(b) beyond float32's roundings: rows of magnitudes
    1e-30 to 1e4, two groups a row and one."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((ROWS, DIM)) * 10.0 ** rng.uniform(-30, 4, (ROWS, 1)))
    x[:4] += rng.uniform(-50, 50, (4, 1))  # rows of one sign: the zero point's bound
    x = x.astype(F32)
    on = case.array(x.reshape(2, -1, KV, DIM))
    y = np.stack([turn(r) for r in x]).astype(np.float64)
    for group, dtype in POOLS:
        codes, scales, zeros = (case.numpy(p).reshape(ROWS, -1) for p in library.quantize(
            on, group, scale_dtype=scale_dtype(case, dtype), xp=case.xp))
        c = np.concatenate([codes & 15, codes >> 4], axis=-1).astype(np.float64)
        s = scales.astype(np.float64)
        zs = np.repeat(zeros.astype(np.float64), group, axis=-1)
        got = (c - zs) * np.repeat(s, group, axis=-1)
        err = np.abs(got - y).reshape(ROWS, -1, group)
        bound = library.bound(y.reshape(ROWS, -1, group), scales)
        r, g, i = np.unravel_index(np.argmax(err - bound), err.shape)
        assert np.all(err <= bound), (
            f"groups of {group}: |y - (c - z) s| = {err[r, g, i]:.6g} > {bound[r, g, i]:.6g} "
            f"at y = {y[r, g * group + i]!r}, scale {s[r, g]!r}")
        back = case.numpy(library.roundtrip(on, group, scale_dtype=scale_dtype(case, dtype),
                                            xp=case.xp)).reshape(x.shape).astype(np.float64)
        row = np.linalg.norm(back - x, axis=-1)
        want = np.linalg.norm(got - y, axis=-1) / np.sqrt(DIM)
        slack = 2.0**-18 * np.linalg.norm(x, axis=-1) + 2.0**-18 * want
        assert np.all(row <= want + slack), (
            f"groups of {group}: a row's error {row.max():.6g} past the turned one's over "
            f"sqrt(b)")


def attend_turned(ix, q, k, v, kpool, vpool):
    return ix.attend(q, k, v, kpool, vpool, tile=TILE)


#: the ways of reading pools attend is checked over (as for quantized pools); compiled, a window
KINDS = ("window", "blocks", "select", "draft", "whole")


@law(family="attention", modes=("eager", "compiled"))
def law_attend_over_turned_pools_is_attention_over_the_round_trip(case: Case) -> None:
    """For every way of reading pools (views of runs, blocks, a selection's tiles, a draft, a
    whole index), attend over turned pools (keys in two groups a row with float16 scales,
    values in one with float32) is softmax attention over extend's seen of them under mask, within
    attention's tolerance, and its pools' parts are extend's bit for bit, in both memory
    orders; a NaN row in a slot no token sees reaches no output. (Compiled: a window.)"""
    kinds = variants(case, 2, 11)
    for seed, kind in enumerate(KINDS):
        if case.compiled and kind != "window":
            continue
        ix = kinds[kind]
        rng = np.random.default_rng(80 + seed)
        q, k, v = (case.array(rng.standard_normal((ix.batch, ix.seq, h, DIM)))
                   for h in (HEADS, KV, KV))
        nan = tuple(unseen(case, ix, SLOTS))
        host = [filled(case, SLOTS, which, 2 * seed + which, nan=nan) for which in (0, 1)]
        head = seed % 2 == 1
        kpool, vpool = (pooled(case, h, head) for h in host)
        outs = [("eager", attend_turned(ix, q, k, v, kpool, vpool))]
        seen_k, want_k = spec_path(case, ix, k, host[0], 0)
        seen_v, want_v = spec_path(case, ix, v, host[1], 1)
        want = reference(case.numpy(q), seen_k, seen_v, pytree.map(ix, case.numpy).mask())
        columns = ix.context if ix.columns is None else int(ix.columns.shape[-1])
        if case.compiled:
            outs.append(("compiled", case.jit(attend_turned)(ix, q, k, v, kpool, vpool)))
            close(case, outs[1][1][0], outs[0][1][0], seen_v, columns,
                  f"{kind}: eager and compiled")
        for mode, (out, kp, vp) in outs:
            close(case, out, want, seen_v, columns, f"{kind} ({mode})")
            same_pool(case, kp, want_k, f"{kind} ({mode}): the key pool")
            same_pool(case, vp, want_v, f"{kind} ({mode}): the value pool")
