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

from .. import pytree
from ..attention import reference
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
    host = pytree.map(ix, case.numpy)
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
    if ix.kind != "tabled":  # nothing stored: the pools given themselves, as extend's
        assert eager[1] is kpool and eager[2] is vpool, (
            f"{what}: attend returned other pools than the ones it was given")
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
    under mask, and its pools are extend's, bit for bit (whole, packed: the pools given)."""
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


def poisoned(case: Case, host, got, want, v_seen, what: str, sinks=None) -> None:
    """``got`` NaN exactly where the reference ``want`` is, which is where a token sees a
    value that is not finite (at that kv head) or has a NaN sink at a head and sees some
    column (every score here is finite), and within tolerance elsewhere."""
    got, want = case.numpy(got), case.numpy(want)
    bad = ~np.isfinite(case.numpy(v_seen)).all(-1)  # [b, c, kv] or [b, s, k, kv]
    sees = host.mask()
    hits = (np.einsum("bsc,bck->bsk", sees, bad) if bad.ndim == 3 else (sees[..., None] & bad)
            .any(2))
    expect = np.repeat(hits, HEADS // KV, axis=2)
    if sinks is not None:
        expect = expect | (np.isnan(case.numpy(sinks)) & sees.any(-1)[..., None])
    expect = expect[..., None].repeat(got.shape[-1], -1)
    assert np.array_equal(np.isnan(want), expect), f"{what}: the reference's NaN misplaced"
    assert np.array_equal(np.isnan(got), expect), (
        f"{what}: NaN where a token sees no value that is not finite, or none where it "
        f"does\n{np.isnan(got).any(-1)}\nwant\n{expect.any(-1)}")
    assert np.isfinite(got[~expect]).all(), f"{what}: an infinity reached an output"
    columns = host.context if host.columns is None else int(host.columns.shape[-1])
    err = float(np.max(np.abs(got - want), where=~expect, initial=0.0))
    assert err <= tolerance(case, columns), f"{what}: max difference {err:.3g}"


#: each kind's pools head-major as the laws above lay them, so that a compiled step's guards
#: on strides find its programs
HEAD = {"rows": False, "window": True, "select": True, "draft": False}


def unseen_infinities(case: Case, ix, what: str, arrays, step=attend, extra=(), *,
                      head: bool, **options):
    """``step`` over ``arrays`` (NaN and Inf among them) against the reference, eager and
    compiled: NaN only where a token sees one, padded tokens exactly zero."""
    q, k, v = (case.array(a) for a in arrays[:3])
    kpool, vpool = (laid(case, a, head) for a in arrays[3:])
    got = step(ix, q, k, v, kpool, vpool, *extra)
    outs = [("eager", got[0])]
    if case.compiled:
        outs.append(("compiled", case.jit(step)(ix, q, k, v, kpool, vpool, *extra)[0]))
    host = pytree.map(ix, case.numpy)
    seen_v, _ = host.extend(arrays[2], arrays[4])
    want = spec_path(case, ix, q, k, v, kpool, vpool, **options)[0]
    padded = case.numpy(ix.positions()) < 0 if ix.kind == "tabled" else None
    for mode, out in outs:
        poisoned(case, host, out, want, seen_v, f"{what} ({mode})", options.get("sinks"))
        if padded is not None:
            assert np.all(case.numpy(out)[padded] == 0), f"{what} ({mode}): a padded token"


@law(family="attention", modes=MODES)
def law_a_value_a_token_does_not_see_never_reaches_it_infinities_included(case: Case) -> None:
    """Inf and NaN in values other tokens see (the call's own and the pools'): a token that
    does not see them gets what it would get without them, a padded token exactly zero, and
    one that sees one NaN at that kv head's heads, as the reference does: through views of runs
    (rows, a window), the tiles (a draft, a selection), with sinks and a softcap; and a NaN
    sink NaN at its head for every token that sees a column, a padded token still zero. (The
    kinds, shapes and options of the laws above, so that compiled steps and JAX's programs are
    theirs.)"""
    sinks = case.array(np.array([0.5, -1.0, 3.0, 0.0], np.float32))
    capped = {"scale": 0.3, "softcap": 2.5, "sinks": sinks}
    kinds = variants(case, 2, 11)
    for seed, kind in enumerate(("rows", "window", "select", "draft")):
        at = kinds[kind]
        q, k, v, kpool, vpool = inputs(case, at, 22, 40 + seed)
        v[:, -1, 0, 1] = np.inf  # the last token's own value: only it sees it
        v[:, 0, 1, :] = np.nan  # the first token's: not the last under a window of 2
        vpool[8, 0, 2], vpool[19, 1, 0] = -np.inf, np.nan  # columns the draft's first misses
        vpool[3:6] = np.inf  # under rows, columns no token sees
        arrays = (q, k, v, kpool, vpool)
        if compiles(case, kind):
            unseen_infinities(case, at, kind, arrays, head=HEAD[kind])
        if compiles(case, f"{kind}, capped") and kind != "rows":
            unseen_infinities(case, at, f"{kind}, capped", arrays, attend_capped, (sinks,),
                              head=HEAD[kind], **capped)
    # a NaN sink: NaN in, NaN out at its head for every token that sees a column, and a
    # padded token still exactly zero (the first law's window, its program again)
    nan_sinks = case.array(np.array([0.5, np.nan, 3.0, 0.0], np.float32))
    at = kinds["select" if case.compiled else "window"]
    unseen_infinities(case, at, "a NaN sink", inputs(case, at, 22, 44), attend_capped,
                      (nan_sinks,), head=True, **{**capped, "sinks": nan_sinks})


# -- shared prefixes ---------------------------------------------------------------------------
PAGE = 16  #: a page's slots in the shared-prefix cases: five pages make the 80-column prefix


def _pages(*pages: int) -> list[int]:
    """The slots of ``pages``, in order: one row of a paged table."""
    return [p * PAGE + i for p in pages for i in range(PAGE)]


def sharing_cases() -> dict:
    """Indices whose lanes share a prefix, each with the prefixes read once for the lanes
    sharing them (lanes, shared columns), as ``(pos, table, row, window, draft, groups)``:
    pages 0-4 (and 10-14) are prefixes, every lane's sixth page its own. The runs read the
    first cases' prefixes as views, and the last (a prefix of 18 pages in reverse order, too
    scattered for views) as gathered tiles; the tiles those of a hole (which the runs leave to
    them: it is where a prefix ends) and a draft."""
    one = [_pages(0, 1, 2, 3, 4, 5 + b) for b in range(4)]
    two = [_pages(0, 1, 2, 3, 4, 20 + b) for b in range(2)] + [
        _pages(10, 11, 12, 13, 14, 22 + b) for b in range(2)]
    holed = [row[:] for row in one[:3]]
    for row in holed:
        row[70] = -1  # a hole in the prefix: the tiles read the call (they read it as zero)
    wide = [_pages(0, 1, 2, 3, 4, 5 + b, 9, 15) for b in range(3)]  # 128 columns
    scattered = [_pages(*range(17, -1, -1), 20 + b) for b in range(3)]  # 288 shared
    return {
        "one prefix": ([[85], [85], [90], [84]], one, None, None, False, [((0, 1, 2, 3), 80)]),
        "two tokens a lane": ([[84, 85], [84, 85], [90, 91], [84, 85]], one, None, None, False,
                              [((0, 1, 2, 3), 80)]),
        "two groups": ([[85], [86], [87], [88]], two, None, None, False,
                       [((0, 1), 80), ((2, 3), 80)]),
        "a window starting inside it": ([[90], [90], [125]], wide, None, 100, False,
                                        [((0, 1), 80)]),
        "a padding lane": ([[85], [-1], [90], [84]], one, None, None, False,
                           [((0, 2, 3), 80)]),
        "lanes naming one sequence": ([[85], [86], [88]], one[:2], [0, 0, 1], None, False,
                                      [((0, 1, 2), 80)]),
        "a hole in the prefix": ([[85], [85], [90]], holed, None, None, False,
                                 [((0, 1, 2), 70)]),
        "a draft": ([[88, 89], [88, 89], [90, 91]], one[:3], None, None, True,
                    [((0, 1, 2), 80)]),
        "scattered pages": ([[290, 291], [290, 291], [294, 295]], scattered, None, None, False,
                            [((0, 1, 2), 288)]),
    }


def read_once(case: Case, groups: list, q: Any, compiled: bool) -> list:
    """The prefixes ``case``'s call reads once (``(lanes, width)`` each) where the eager path
    reads ``groups`` once. JAX's eager program rounds a width down (one program for a quarter of
    an octave of widths: :func:`cacheidx.attention.jax.rounded`). Compiled, over the index's
    hint (``index.share``), torch's operator on the CPU attends eagerly and reads them; a JAX
    step jitted whole has no values to find groups in, and reads the hint's groups once, each
    recorded as it is traced as ``((), g)`` (its lanes and width are the program's values);
    torch's traced tiles on a GPU read none once (they take no hint)."""
    if compiled:
        on_cpu = getattr(getattr(q, "device", None), "type", None) == "cpu"
        if case.backend.name == "jax":
            return [((), g) for g in range(len(groups))]
        return groups if case.backend.name == "torch" and on_cpu else []
    if case.backend.name == "jax":
        from ..attention.jax import rounded

        return [(lanes, rounded(width)) for lanes, width in groups]
    return groups


#: the tiles' cases JAX's program reads once as it reads the others, checked in
#: tests/test_shared_reads.py rather than here (a JAX program is compiled for each case: about
#: 2 s apiece, against the suite's minute)
JAX_TESTS = ("a draft", "scattered pages")


@law(family="attention", modes=(*MODES, "dynamic"))
def law_lanes_sharing_a_prefix_read_it_once_and_attend_as_the_reference(case: Case) -> None:
    """Lanes whose tables name the same slots from column 0 and whose every query sees them
    read that prefix once for all of them, on every path (the prefixes each call reads once,
    counted: all lanes under one prefix, two groups, a lane whose window starts inside it, a
    padding lane, lanes naming one sequence, through the runs' views; a prefix of scattered
    pages through the runs' gathered tiles; a prefix ending at a hole and a draft through the
    tiles) and attend's output is
    softmax attention over extend's seen all the same, its pools extend's bit for bit.
    Compiled: the first case, one program, over the index with its hint (``index.share``:
    :func:`read_once` says which compiled paths read it once)."""
    from ..attention import shared

    slots = 30 * PAGE
    for seed, (what, (pos, table, row, window, drafted, groups)) in enumerate(
            sharing_cases().items()):
        if case.compiled and seed:
            break
        if what in JAX_TESTS and case.backend.name == "jax":
            continue
        ix = index(case, pos, table, row=row)
        if window is not None:
            ix = ix.window(window)
        if drafted:
            at = np.asarray(table)[np.arange(len(pos))[:, None], np.asarray(pos)]
            ix = ix.draft(case.array(at), case.array(np.tril(np.ones((len(pos), 2, 2), bool))))
        arrays = inputs(case, ix, slots, 60 + seed)
        q = case.array(arrays[0])
        want = read_once(case, groups, q, False)
        if case.compiled:
            ix = ix.share(len(groups))
            want = want + read_once(case, groups, q, True)
        with shared.counted() as reads:
            check(case, ix, arrays, what, head=seed % 2 == 0)
        assert reads == want, f"{what}: prefixes read once {reads}, want {want}"
