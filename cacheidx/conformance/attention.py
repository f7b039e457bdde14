"""The laws of ``attend``: attention over the pools in place is softmax attention over
``extend``'s seen under ``visible``, for every kind of index, and stores what ``extend`` stores.

The right-hand side is the spec's path: ``extend`` on both pools, then
:func:`cacheidx.attention.reference` under ``mask``, computed by NumPy on the same index (the
index laws hold ``extend`` and ``mask`` equal on every backend, bit for bit). The two sum in
different orders (tiles and an online softmax against one softmax), so outputs agree to
:func:`tolerance`; the pools agree bit for bit. Compiled, eager and compiled outputs agree to
the same tolerance. Pools come in both memory orders (:mod:`cacheidx.attention.layout`), in
turn: the law is the same, the reads differ.

Compiling a step costs seconds (more under torch's symbolic shapes), and the suite keeps to a
minute, so compiled modes compile what nothing else does (:func:`compiles`): with static
shapes the kinds of index the model laws do not compile through a decoder layer (a window,
over positions in two tiles and over blocks; rows, pages, row maps, selections, drafts, whole
and packed indices, lanes of padding and pools of NaN are theirs) and the options over a
selection; with symbolic shapes nothing here, as the model laws compile ``attend`` under them
for every kind they read, and the index laws the window's reads.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backends
from ..attention import reference
from ..index import _flatten, _unflatten
from .laws import index, same, variants
from .suite import Case, law

TILE = 8  #: columns a tile reads in these laws: a table 11 wide takes two tiles
HEADS, KV, DIM = 4, 2, 8


def tolerance(case: Case, columns: int) -> float:
    """How far ``attend``'s output may stray from the reference's, relative to the largest
    value weighed: ``(3 * columns + 2 * DIM + 8) * 2**-p`` for products keeping ``p`` mantissa
    bits (docs/attention.md derives it). Each output is a convex combination of values, so
    its error is the relative error of its weights: the two sums over ``columns`` terms
    (numerator and denominator, each reordered), the rescaling by ``exp(m_old - m_new)`` a few
    roundings per tile, and the scores' own products over ``DIM`` terms."""
    return (3 * columns + 2 * DIM + 8) * 2.0 ** -case.policy.mantissa


def attend(ix, q, k, v, kpool, vpool):
    return ix.attend(q, k, v, kpool, vpool, tile=TILE)


def attend_capped(ix, q, k, v, kpool, vpool, sinks):
    """Gemma 2's soft-capping, gpt-oss's sinks and a scale of one's own, together."""
    return ix.attend(q, k, v, kpool, vpool, tile=TILE, scale=0.3, softcap=2.5, sinks=sinks)


def spec_path(case: Case, ix, q, k, v, kpool, vpool, **options):
    """The law's right-hand side on NumPy: ``extend`` on both pools, then the materialised
    softmax under ``mask``."""
    leaves, (structure, _) = _flatten(ix)
    host = _unflatten((structure, backends.get("numpy")), [case.numpy(t) for t in leaves])
    arrays = [case.numpy(a) for a in (q, k, v, kpool, vpool)]
    sinks = options.pop("sinks", None)
    if sinks is not None:
        options["sinks"] = case.numpy(sinks)
    seen_k, kpool = host.extend(arrays[1], arrays[3])
    seen_v, vpool = host.extend(arrays[2], arrays[4])
    return reference(arrays[0], seen_k, seen_v, host.mask(), **options), kpool, vpool


def inputs(case: Case, ix, slots: int, seed: int, fill: dict | None = None):
    """Random queries, keys and values for ``ix``, and pools of ``slots`` slots: random where
    ``fill`` is None, else NaN but for the slots ``fill`` names."""
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q, k, v = draw(ix.batch, ix.seq, HEADS, DIM), draw(ix.batch, ix.seq, KV, DIM), draw(
        ix.batch, ix.seq, KV, DIM)
    kpool, vpool = draw(slots, KV, DIM), draw(slots, KV, DIM)
    if fill is not None:
        for pool in (kpool, vpool):
            keep = np.zeros(slots, bool)
            keep[list(fill)] = True
            pool[~keep] = np.nan
    return q, k, v, kpool, vpool


def close(case: Case, got, want, v_seen, columns: int, what: str) -> None:
    got, want = case.numpy(got), case.numpy(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite outputs\n{got}"
    scale = max(1.0, float(np.nanmax(np.abs(case.numpy(v_seen)))))
    err = float(np.max(np.abs(got - want))) / scale
    tol = tolerance(case, columns)
    assert err <= tol, f"{what}: max difference {err:.3g} x the largest value (tolerance {tol:.3g})"


def laid(case: Case, pool: np.ndarray, head: bool) -> Any:
    """``pool`` as the case's array, its memory head-major where ``head`` and the library keeps
    strides (the layout ``empty_pools`` gives on the CPU): the laws hold in either order."""
    if not head:
        return case.array(pool)
    return case.xp.permute_dims(case.array(np.ascontiguousarray(pool.transpose(1, 0, 2))),
                                (1, 0, 2))


def check(case: Case, ix, arrays, what: str, step=attend, extra=(), *, head: bool = False,
          **options) -> None:
    """``step`` (eager, and compiled agreeing with it) against the spec's path, over pools
    head-major in memory where ``head``."""
    q, k, v = (case.array(a) for a in arrays[:3])
    kpool, vpool = (laid(case, a, head) for a in arrays[3:])
    columns = ix.context if ix.columns is None else int(ix.columns.shape[-1])
    eager = step(ix, q, k, v, kpool, vpool, *extra)
    got = eager
    if case.compiled:
        got = case.jit(step)(ix, q, k, v, kpool, vpool, *extra)
        close(case, got[0], eager[0], v, columns, f"{what}: eager and compiled")
    want, want_k, want_v = spec_path(case, ix, q, k, v, kpool, vpool, **options)
    close(case, got[0], want, v, columns, what)
    same(case, got[1], case.numpy(want_k), f"{what}: the key pool")
    same(case, got[2], case.numpy(want_v), f"{what}: the value pool")


#: what the static-shape mode compiles here: the model laws compile the other kinds of index
COMPILED = ("window", "window over blocks", "select, capped")
#: the modes these laws check: eager, and static shapes (the model laws compile attend under
#: symbolic shapes through every layer they run)
MODES = ("eager", "compiled")


def compiles(case: Case, what: str) -> bool:
    """Whether ``case`` checks ``what``: eagerly everything, compiled what :data:`COMPILED`
    names."""
    return not case.compiled or what in COMPILED


@law(family="attention", modes=MODES)
def law_attend_is_softmax_attention_over_what_extend_sees(case: Case) -> None:
    """For every kind of index (rows, window, blocks, a window over blocks, a row map, a
    selection, a draft, whole, packed) attend's output is softmax attention over extend's seen
    under mask, and its pools are extend's, bit for bit."""
    for seed, (kind, ix) in enumerate(variants(case, 2, 11).items()):
        if not compiles(case, kind):
            continue
        slots = 2 * 11 if ix.kind == "tabled" else 1
        check(case, ix, inputs(case, ix, slots, seed), kind, head=seed % 2 == 1)


@law(family="attention", modes=MODES)
def law_softcap_sinks_and_scale_weigh_as_the_reference_does(case: Case) -> None:
    """Soft-capping, a sink per head and a scale of one's own change attend's weights as they
    change the reference's: over a selection (each token its own keys), a window and a
    draft."""
    sinks = case.array(np.array([0.5, -1.0, 3.0, 0.0], np.float32))
    kinds = variants(case, 2, 11)
    for seed, kind in enumerate(("select", "window", "draft")):
        if not compiles(case, f"{kind}, capped"):
            continue
        ix = kinds[kind]
        check(case, ix, inputs(case, ix, 22, 20 + seed), f"{kind}, capped", step=attend_capped,
              extra=(sinks,), head=seed != 1, scale=0.3, softcap=2.5, sinks=sinks)


@law(family="attention", eager_only=True)
def law_attend_reads_nothing_a_token_does_not_see(case: Case) -> None:
    """Pools of NaN wherever no token sees: a padded token and a lane of padding get exactly
    zero, with or without sinks; a hole weighs as a zero key with a zero value; columns below
    a window, unallocated or past every position reach no output. (Compiled, the model law
    of NaN pools checks it through a layer.)"""
    # lane 0: a hole at column 1 and a padded token; lane 1: row -1 (padding throughout);
    # lane 2: positions 4 to 6 of row 1
    ix = index(case, [[-1, 2, 3], [1, 2, 3], [4, 5, 6]],
               [[0, -1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]], row=[0, -1, 1])
    sinks = case.array(np.array([4.0, 0.0, -2.0, 1.0], np.float32))
    # the call stores at 2, 3 and 12 to 14; of the other slots only those a token sees hold
    # numbers: 0, and 8 to 11 (lane 2 without a window) or 11 (within a window of 2)
    for w, named in ((None, {0, 8, 9, 10, 11}), (2, {11})):
        at = ix if w is None else ix.window(w)
        arrays = inputs(case, at, 16, 30, fill=named)
        for step, extra, options in ((attend, (), {}),
                                     (attend_capped, (sinks,),
                                      {"scale": 0.3, "softcap": 2.5, "sinks": sinks})):
            check(case, at, arrays, f"window {w}", step=step, extra=extra, head=w is None,
                  **options)
            out = case.numpy(step(at, *(case.array(a) for a in arrays), *extra)[0])
            assert np.all(out[0, 0] == 0), f"a padded token's output is {out[0, 0]}"
            assert np.all(out[1] == 0), f"a lane of padding's output is {out[1]}"
