"""Prefill schedules (cacheidx/prefix/schedule.py): the table's laws on their own, then the
tiny Llama decoder run through a schedule against every prompt computed alone."""

from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_cases import SPEC

import cacheidx as ci
from cacheidx import prefix
from cacheidx.models.llama import Config, empty_pools, forward, random_params

# The module, not the function `prefix.schedule` that shadows it as an attribute.
schedule_module = importlib.import_module("cacheidx.prefix.schedule")

CFG = Config.tiny()
RTOL = 1e-4

# The same below the tiny decoder's vocabulary of 64; it sorts and shares as the spec's.
SPEC_IDS = [[t % CFG.vocab for t in p] for p in SPEC]

CONCRETE = {  # name: (prompts, page size)
    "spec": (SPEC_IDS, 2),
    "one-token prompts": ([[5], [5], [7], [5, 6], [5]], 1),
    "prefixes of one another": ([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3], [1, 2, 3, 4, 5], [1]], 2),
    "copies with a partial last page": ([[3, 1, 4], [3, 1, 4], [3, 1, 4, 1, 5], [3, 1, 4]], 2),
    "a deep chain": ([list(range(1, k + 1)) for k in range(1, 7)], 1),
}


# -- prompt sets that share a lot ----------------------------------------------------------


@st.composite
def prompt_sets(draw, max_prompts: int = 7):
    """A few stems; each prompt a cut of a stem plus a short tail over a tiny alphabet, or a
    copy of an earlier prompt: copies, prefixes of one another and one-token prompts abound."""
    stems = draw(st.lists(st.lists(st.integers(0, CFG.vocab - 1), min_size=1, max_size=9),
                          min_size=1, max_size=3))
    prompts = []
    for _ in range(draw(st.integers(1, max_prompts))):
        if prompts and draw(st.booleans()) and draw(st.booleans()):
            prompts.append(list(draw(st.sampled_from(prompts))))
            continue
        stem = draw(st.sampled_from(stems))
        p = stem[: draw(st.integers(0, len(stem)))] + draw(st.lists(st.integers(0, 2),
                                                                    max_size=3))
        prompts.append(p or [draw(st.integers(0, 2))])
    return prompts


page_sizes = st.integers(1, 4)


# -- the table's laws, in NumPy --------------------------------------------------------------


def writes(s) -> list[tuple[int, int, int]]:
    """``(when, prompt, column)`` of every token's store: wave ``w`` at ``w``, decoding
    after every wave."""
    out = [(w, int(p), j) for w, wave in enumerate(s.waves)
           for p, a, b in zip(wave.prompts, wave.start, wave.stop) for j in range(a, b)]
    room = s.lengths + s.max_new_tokens
    return out + [(len(s.waves), p, j) for p in range(len(room))
                  for j in range(int(s.lengths[p]), int(room[p]))]


def test_the_spec_example_runs_in_three_waves():
    """On the spec's example, waves are depths of the tree: 0 and 2, then 3 and 4, then 1;
    each lane computes its tokens past ``shared``, left padded; the table names the parent's
    pages for the shared columns (page size 2: slot = page * 2 + offset)."""
    s = prefix.schedule(prefix.plan(SPEC, 2), max_new_tokens=1)
    assert [w.prompts.tolist() for w in s.waves] == [[0, 2], [3, 4], [1]]
    assert [w.start.tolist() for w in s.waves] == [[0, 0], [2, 2], [4]]
    assert s.waves[0].positions.tolist() == [[0, 1, 2, 3], [-1, 0, 1, 2]]
    assert s.waves[1].positions.tolist() == [[2, 3], [2, 3]]
    # plan pages: 0 -> [0 1], 3 -> [0 2], 4 -> [0 3], 1 -> [0 3 4], 2 -> [5 6]
    assert s.table[1, :6].tolist() == [0, 1, 6, 7, 8, 9]
    assert s.table[3, :4].tolist() == [0, 1, 4, 5]
    assert s.table[2, :4].tolist() == [10, 11, 12, 13]  # position 3 on its own last page
    assert s.copy_of.tolist() == [-1] * 5
    ix = s.waves[1].index()
    assert ix.batch == 2 and ix.seq == 2 and ix.context == 4


def test_a_deduplicated_copy_computes_nothing_and_decodes_on_its_own_page():
    """With dedupe, a copy is in no wave, reuses its first copy's output, reads the first
    copy's partial last page below its length and decodes on a fresh page at the same
    offsets."""
    prompts = [[3, 1, 4], [3, 1, 4]]
    s = prefix.schedule(prefix.plan(prompts, 2, dedupe=True), max_new_tokens=2)
    assert [w.prompts.tolist() for w in s.waves] == [[0]]
    assert s.copy_of.tolist() == [-1, 0]
    assert (s.wave_of.tolist(), s.lane_of.tolist()) == ([0, 0], [0, 0])
    assert s.table[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert s.table[1].tolist() == [0, 1, 2, 7, 8, 9]
    assert s.slots == 10


@settings(max_examples=60)
@given(prompt_sets(max_prompts=12), page_sizes, st.booleans(), st.integers(0, 5))
def test_write_targets_are_distinct_and_every_read_was_written_before(prompts, P, dedupe, G):
    """Every store of the prefill and of ``G`` decoding steps has a slot of its own inside the
    pool, so a shared page is written once; a lane writes its columns past ``shared``, and
    reads below ``shared`` only what an earlier wave wrote; a wave's table names only its
    own prompts' rows."""
    s = prefix.schedule(prefix.plan(prompts, P, dedupe=dedupe), max_new_tokens=G)
    ws = writes(s)
    slots = [int(s.table[p, j]) for _, p, j in ws]
    assert len(set(slots)) == len(slots)
    assert all(0 <= t < s.slots for t in slots)
    writer = {t: (w, p) for (w, p, _), t in zip(ws, slots)}
    for w, wave in enumerate(s.waves):
        table = host(wave.index().table)
        assert (np.delete(table, wave.prompts, axis=0) == -1).all()
        for p, a, b in zip(wave.prompts, wave.start, wave.stop):
            assert b == len(prompts[p]) and 0 <= a < b
            assert all(writer[int(s.table[p, j])][0] < w for j in range(a))
            assert all(writer[int(s.table[p, j])] == (w, p) for j in range(a, b))
    for p in np.flatnonzero(s.copy_of >= 0):
        assert prompts[p] == prompts[s.copy_of[p]]
        assert s.table[p, : len(prompts[p])].tolist() == \
            s.table[s.copy_of[p], : len(prompts[p])].tolist()
    computed = sum(int((w.stop - w.start).sum()) for w in s.waves)
    assert computed == int(s.plan.computed.sum())


def test_bad_arguments_name_the_schedule():
    p = prefix.plan(SPEC, 2)
    with pytest.raises(ValueError, match="cacheidx.prefix.schedule: max_new_tokens"):
        prefix.schedule(p, max_new_tokens=-1)
    with pytest.raises(TypeError, match="cacheidx.prefix.schedule"):
        prefix.schedule(p, max_new_tokens=1.5)
    with pytest.raises(TypeError, match="cacheidx.prefix.schedule"):
        prefix.schedule(SPEC)
    with pytest.raises(ValueError, match="cacheidx.prefix.schedule"):
        prefix.schedule(p).waves[0].tokens([[1]] * 5)


# -- the decoder through a schedule ----------------------------------------------------------


def namespace(name: str):
    """The backend ``name``'s namespace, skipping (with the reason) where it cannot run."""
    module = {"jax": "jax", "torch": "torch", "strict": "array_api_strict"}.get(name)
    if module:
        pytest.importorskip(module, reason=f"the {name} backend needs {module}")
    ok, why = ci.backends._class(name).usable()
    if not ok:
        pytest.skip(f"backend {name} cannot run here: {why}")
    return ci.backends.get(name).xp


def host(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except Exception:
        return np.from_dlpack(x)


def close(got, want, what: str) -> None:
    got = host(got)
    assert np.isfinite(got).all(), f"{what}: non-finite outputs"
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL, err_msg=what)


@functools.cache
def alone(ids: tuple[int, ...]) -> np.ndarray:
    """Logits of ``ids`` computed alone, on a ``whole`` index, in NumPy."""
    logits, _ = forward(PARAMS, CFG, np.asarray([ids]), ci.whole(1, len(ids), xp="numpy"),
                        empty_pools(CFG, 1))
    return logits[0]


PARAMS = random_params(CFG, seed=0)


def step(name: str):
    """The decoder's forward on backend ``name``, compiled where it compiles (one program per
    shape instead of one per operation per shape)."""
    def call(params, tokens, index, pools):
        return forward(params, CFG, tokens, index, pools)
    return ci.backends.get(name).jit(call) if name == "jax" else call


def run(name: str, prompts, P: int, dedupe: bool, G: int, seed: int = 0) -> None:
    """Prefill ``prompts`` as scheduled, then decode ``G`` teacher-forced tokens per prompt
    (random, different per prompt, so a slot written by two prompts would show), checking
    every logit against the prompt plus its new tokens computed alone, and that a wave
    changes no pool row but its own tokens'."""
    xp = namespace(name)
    s = prefix.schedule(prefix.plan(prompts, P, dedupe=dedupe), max_new_tokens=G)
    params, call = random_params(CFG, seed=0, xp=name), step(name)
    fed = np.random.default_rng(seed).integers(0, CFG.vocab, (len(prompts), G))
    want = [alone(tuple(ids) + tuple(fed[p].tolist())) for p, ids in enumerate(prompts)]
    # NaN everywhere: a read of a slot nobody wrote reaches an output.
    nan = np.full(empty_pools(CFG, s.slots)[0][0].shape, np.nan, np.float32)
    pools = [(xp.asarray(nan), xp.asarray(nan)) for _ in range(CFG.layers)]
    outputs = []
    for w, wave in enumerate(s.waves):
        before = [host(k).copy() for k, _ in pools]
        logits, pools = call(params, wave.tokens(prompts, xp=name), wave.index(xp=name), pools)
        outputs.append(logits)
        got = host(logits)
        for b, (p, a, e) in enumerate(zip(wave.prompts, wave.start, wave.stop)):
            close(got[b, wave.seq - (e - a):], want[p][a:e], f"wave {w}, prompt {p}")
        mine = np.zeros(s.slots, bool)
        for p, a, e in zip(wave.prompts, wave.start, wave.stop):
            mine[s.table[p, a:e]] = True
        for (k, _), old in zip(pools, before):
            assert np.array_equal(host(k)[~mine], old[~mine], equal_nan=True), (
                f"wave {w} changed a pool row that is not its own (a shared page rewritten?)")
    lengths = s.lengths
    last = host(s.last(outputs))
    for p in range(len(prompts)):
        close(last[p], want[p][lengths[p] - 1], f"last token of prompt {p}")
    ix = s.decode_index(xp=name)
    for i in range(G):
        ix = ix.advance()
        logits, pools = call(params, xp.asarray(fed[:, i : i + 1]), ix, pools)
        got = host(logits)
        for p in range(len(prompts)):
            close(got[p, 0], want[p][lengths[p] + i], f"decode step {i}, prompt {p}")


BACKENDS = ["numpy", "jax", "torch"]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dedupe", [False, True], ids=["spec", "dedupe"])
@pytest.mark.parametrize("case", list(CONCRETE))
def test_shared_prefill_then_decoding_equals_each_prompt_alone(name, case, dedupe):
    prompts, P = CONCRETE[case]
    run(name, prompts, P, dedupe, G=3)


def test_the_schedule_runs_on_array_api_strict():
    run("strict", SPEC_IDS, 2, True, G=2)


# JAX compiles one program per shape, and random prompt sets have many shapes.
EXAMPLES = {"numpy": 30, "torch": 25, "jax": 10}


@pytest.mark.parametrize("name", BACKENDS)
def test_random_prompt_sets_equal_each_prompt_alone(name):
    namespace(name)

    @settings(max_examples=EXAMPLES[name])
    @given(prompts=prompt_sets(), P=page_sizes, dedupe=st.booleans(), G=st.integers(0, 2),
           seed=st.integers(0, 2**16))
    def check(prompts, P, dedupe, G, seed):
        run(name, prompts, P, dedupe, G, seed)

    check()
