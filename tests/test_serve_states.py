"""The engine serves a hybrid decoder (a recurrent layer beside an attention layer,
``state_model.ToyHybrid``) over state pools (:mod:`cacheidx.state`) and snapshots kept in the
prefix cache (:mod:`cacheidx.prefix.states`): its tokens equal the model's own from scratch,
with the cache on, off and under eviction, eagerly and compiled, on every backend; a hit
resumes at a block's end, never computing more than ``m - 1`` tokens past the pages' hit."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from state_model import ToyHybrid, reference

from cacheidx.prefix import PrefixCache
from cacheidx.serve import Engine, Request
from cacheidx.serve.engine import state_every

NEW, P, M = 6, 4, 8


def prompts_() -> list[list[int]]:
    """A 30-token prompt; one sharing its first 20; a short one; the first and 4 more."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 61, 30).tolist()
    return [base, base[:20] + rng.integers(0, 61, 7).tolist(), rng.integers(0, 61, 5).tolist(),
            base + [3, 4, 5, 6]]


PROMPTS = prompts_()


@pytest.fixture(scope="module")
def want():
    return {final: [reference(ToyHybrid(final=final), p, NEW) for p in PROMPTS]
            for final in (False, True)}


def serve(model, *, cache=True, backend="numpy", compile=False, repeat=1, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the notes, checked apart
        engine = Engine(model, backend=backend, compile=compile, pages=64, page_size=P,
                        chunk=5, cache=cache, state_every=M, clock="steps", debug=not compile,
                        **{"lanes": 3, **options})
        results = engine.run([Request(i, p, max_new_tokens=NEW, arrival=3 * i)
                              for i, p in enumerate(PROMPTS * repeat)])
    assert [r.error for r in results] == [None] * len(results)
    engine.cache.check()
    return [r.tokens for r in results], engine.figures()


@pytest.mark.parametrize("final", [False, True], ids=["every-block", "last-token-only"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_tokens_equal_the_model_from_scratch(want, final, cache):
    tokens, f = serve(ToyHybrid(final=final), cache=cache)
    assert tokens == want[final]
    # prompt 1 shares 20 tokens with prompt 0 and resumes at its block's end (16); prompt 3
    # reads prompt 0's 7 whole pages, and resumes at its junction (28: law 14)
    assert f["cached_tokens"] == (16 + 28 if cache else 0)
    assert f["computed_tokens"] == sum(map(len, PROMPTS)) - f["cached_tokens"]


@pytest.mark.parametrize("backend, compile", [("torch", False), ("jax", False),
                                              ("strict", False), ("torch", "aot_eager"),
                                              ("jax", True)])
def test_every_backend_and_compiler_gives_the_tokens(want, backend, compile):
    pytest.importorskip({"strict": "array_api_strict"}.get(backend, backend),
                        reason=f"{backend} is not installed")
    tokens, f = serve(ToyHybrid(), backend=backend, compile=compile)
    assert tokens == want[False] and f["cached_tokens"] == 44


@pytest.mark.parametrize("snapshots", [7, 9])
def test_tokens_hold_under_eviction_of_snapshots(want, snapshots):
    tokens, f = serve(ToyHybrid(), lanes=1, snapshots=snapshots, repeat=3)
    assert tokens == want[False] * 3
    assert f["snapshots"]["evictions"] > 0 and f["snapshots"]["slots"] == snapshots


def test_a_hit_waits_for_its_snapshot_and_recomputes_less_than_a_block():
    """The pages alone would give 7 pages (28 tokens) of prompt 0's 30; the snapshots cut the
    hit to 24, and with prompt 0's snapshot of block 2 evicted, to 16."""
    cache = PrefixCache(64, P, states=(M, 16))
    hold = cache.admit(PROMPTS[0], 36)
    cache.insert(hold, PROMPTS[0])
    cache.release(hold)
    assert cache.match(PROMPTS[3]).tokens == 24
    node = cache._tree.walk(np.asarray(PROMPTS[3], np.int64).tobytes(), 6)[5]
    cache._state.uncache(node, cache._state.g)
    assert cache.match(PROMPTS[3]).tokens == 16
    cache.check()


def test_a_model_whose_kernels_give_final_states_prefills_aligned_chunks_one_lane_a_call():
    model = ToyHybrid(final=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        engine = Engine(model, pages=64, page_size=P, chunk=12, state_every=M, clock="steps")
    calls = []
    run = engine.executor.run

    def spy(batch, *args, **kw):
        if batch.kind == "prefill":
            calls.append([(int(p[p >= 0][0]), int(p[p >= 0][-1])) for p in batch.pos])
        return run(batch, *args, **kw)

    engine.executor.run = spy
    engine.run([Request(0, PROMPTS[0], max_new_tokens=2), Request(1, PROMPTS[1],
                                                                  max_new_tokens=2)])
    assert all(len(c) == 1 for c in calls)  # one lane a call
    # each call ends at a block's end, at the prompt's, or at its junction (its last whole
    # page before its last token: 28 of 30, and 24, a block's end, of 27)
    assert all((last + 1) % M == 0 or last + 1 in (30, 27, 28) for ((_, last),) in calls)


def test_the_engine_says_once_why_a_prompt_is_never_resumed():
    engine = Engine(ToyHybrid(), pages=64, page_size=P, state_every=M, clock="steps")
    with pytest.warns(UserWarning, match="at most 8 tokens") as told:
        engine.run([Request(i, PROMPTS[2], max_new_tokens=2) for i in range(3)])
    assert len([w for w in told if "at most 8" in str(w.message)]) == 1
    assert engine.figures()["notes"] == [engine.notes[0]] and "at most 8" in engine.notes[0]


def test_the_block_costs_about_what_its_pages_do():
    assert state_every(32, 64, 4) == 4  # a snapshot lighter than a page: one page
    assert state_every(2_000_000, 1024, 16) == 16 * 123  # 2 MB against 16 KiB a page
    assert state_every(100, 8, 16, chunk=64) == 64  # a multiple of the kernel's chunk
    assert state_every(100, 0, 16) == 256  # no attention layer: 16 pages


@pytest.mark.parametrize("bad, match", [
    ({"state_every": 6}, "state_every must be a multiple of the page size"),
    ({"state_every": 0}, "state_every must be at least 1"),
    ({"snapshots": 0}, "snapshots must be at least 1"),
])
def test_bad_state_arguments_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=f"cacheidx.serve.Engine: {match}"):
        Engine(ToyHybrid(), pages=64, page_size=P, **{"state_every": M, **bad})


def test_a_request_needing_more_snapshot_slots_than_the_pool_has_fails_alone():
    """A snapshot pool of 6 slots holds the blocks of 8 and two junctions of a request of up
    to 32 tokens: the 30- and 34-token prompts with 6 new tokens (35 and 39 positions, 5
    blocks) fail when submitted, naming their need and the pool, and the others are served
    with their tokens."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        engine = Engine(ToyHybrid(), pages=64, page_size=P, state_every=M, snapshots=6,
                        clock="steps")
        results = engine.run([Request(i, p, max_new_tokens=NEW) for i, p in enumerate(PROMPTS)])
    assert results[0].error == ("request 0 (30 prompt tokens and up to 6 new ones): 35 tokens "
                                "need 7 snapshot slots (one per block of 8 positions, and two "
                                "junctions); the snapshot pool has 6")
    assert results[3].error.startswith("request 3 (34 prompt tokens and up to 6 new ones): "
                                       "39 tokens need 7 snapshot slots")
    assert [r.error for r in results[1:3]] == [None] * 2
    assert [r.tokens for r in results[1:3]] == [reference(ToyHybrid(), p, NEW)
                                                for p in PROMPTS[1:3]]


def test_the_default_snapshot_pool_holds_a_request_of_the_whole_pool():
    """By default the snapshot pool holds every block of the pages and two junctions more
    than one a lane: a request of all 16 pages (64 tokens) is served."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        engine = Engine(ToyHybrid(), pages=16, page_size=P, state_every=M, lanes=2,
                        clock="steps")
        (result,) = engine.run([Request(0, list(range(1, 60)), max_new_tokens=6)])
    assert result.error is None and len(result.tokens) == 6
    assert engine.figures()["snapshots"]["slots"] == 16 * P // M + 2 + 2


def test_state_arguments_for_a_model_without_recurrent_layers_are_refused():
    model = ToyHybrid()
    model.recurrent_layers = ()
    with pytest.raises(ValueError, match="state_every and snapshots are for a model with "
                                         "recurrent layers"):
        Engine(model, pages=64, page_size=P, state_every=8)


def test_a_snapshot_block_that_is_no_multiple_of_the_page_is_refused():
    with pytest.raises(ValueError, match="m must be a multiple of the page size, 4"):
        PrefixCache(64, P, states=(6, 8))
    with pytest.raises(ValueError, match="need a group of full layers"):
        PrefixCache(64, P, windows=(8,), states=(8, 8))
