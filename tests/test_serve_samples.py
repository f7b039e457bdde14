"""Parallel samples of one prompt (``Request(..., n=N)``, issue 28 item 4): one request asks
for ``N`` continuations; its prompt is computed once (the later samples read its whole pages
from the prefix cache and compute only the tokens past them, into pages of their own), and
greedy gives ``N`` equal continuations, each that of the request with ``n=1``. Its result
holds ``N`` lists of tokens; a request of one sample is what it always was.

The ledger models of ``test_serve`` and ``test_serve_windows`` (a token is a hash of every
token its lane reads) catch a page read from the wrong lane; the tiny Llama checks real
tokens and logits, eager and compiled, and the command reads ``"n"`` per line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_serve import Ledger, alone, check_no_leak, pages_for
from test_serve_windows import WindowedLedger

from cacheidx.conformance.pytest_plugin import backend_or_skip
from cacheidx.models import llama
from cacheidx.serve import Engine, LlamaModel, Request, Result, Sampling
from cacheidx.serve import __main__ as cli


def own(prompt, page_size):
    """The prompt tokens each later sample computes: those past the prompt's whole pages a
    hit reads (``match`` caps at ``(len - 1) // P`` pages), 1 to ``page_size``."""
    return len(prompt) - (len(prompt) - 1) // page_size * page_size


# -- the prompt once, N equal continuations ---------------------------------------------------
@pytest.mark.parametrize("length", [9, 8, 3, 21])
def test_the_prompt_of_n_samples_is_computed_once(length):
    """Pages of 4: 9 tokens are 2 whole pages and 1 token of the third (each later sample
    computes that 1); 8 tokens are 2 whole pages, of which a hit reads 1 (the last token is
    always computed: 4 each); 3 tokens have no whole page to share (each computes them)."""
    model = Ledger()
    prompt = [(5 * i + 1) % 50 for i in range(length)]
    engine = Engine(model=model, pages=64, page_size=4, lanes=4, clock="steps", debug=True)
    (result,) = engine.run([Request("s", prompt, 5, n=4)])
    assert result.error is None and result.n == 4
    assert result.tokens == [model.alone(prompt, 5)] * 4
    f = engine.figures()
    assert f["computed_tokens"] == result.computed_tokens == length + 3 * own(prompt, 4)
    assert f["cached_tokens"] == result.cached_tokens == 3 * (length - own(prompt, 4))
    assert f["prompt_tokens"] == 4 * length and f["generated_tokens"] == 20
    assert f["requests"] == 1 and f["failed"] == 0
    check_no_leak(engine)


def test_the_samples_share_the_prompt_pages_through_the_table_and_write_their_own():
    """Mid-run, the rows of the four samples name the same slots for the prompt's whole
    pages (read once, written by the first) and pairwise disjoint slots from the page where
    each one's continuation begins: no page is written by two lanes."""
    model = Ledger()
    prompt = list(range(10))  # pages of 4: 2 whole pages shared, the third each sample's own
    engine = Engine(model=model, pages=64, page_size=4, lanes=4, clock="steps", debug=True)
    engine.submit(Request("s", prompt, 8, n=4))
    while len(engine.scheduler.running) < 4 or any(
            lane.prefilling for lane in engine.scheduler.running):
        engine.step()
    rows = [lane.row for lane in engine.scheduler.running]
    table = engine.scheduler.table[rows]
    assert (table[:, :8] == table[0, :8]).all() and (table[:, :8] >= 0).all()
    mine = [set(row[8:][row[8:] >= 0].tolist()) for row in table]
    assert all(len(s) >= 4 for s in mine)
    assert sum(map(len, mine)) == len(set().union(*mine)), "two samples share a written page"
    assert not set(table[0, :8].tolist()) & set().union(*mine)
    while engine.busy:
        engine.step()
    check_no_leak(engine)


def test_samples_and_single_requests_mix_in_one_run():
    """A request of three samples and one of one under the same prompt, another of two
    samples of a prompt of its own, arriving at different steps: each sample's tokens are
    those of its prompt alone, a request of one sample keeps its plain list, and the shared
    prompt is computed once for all four lanes."""
    model = Ledger()
    p, q = list(range(13)), [7, 3, 9, 1, 4, 4, 2]
    requests = [Request("three", p, 4, n=3), Request("one", p, 4, arrival=1),
                Request("two", q, 6, n=2, arrival=1), Request("plain", [5, 5, 5], 3)]
    for cache in (True, False):
        engine = Engine(model=model, pages=64, page_size=4, lanes=4, clock="steps",
                        cache=cache, debug=True)
        three, one, two, plain = engine.run(requests)
        assert three.tokens == [model.alone(p, 4)] * 3
        assert one.tokens == model.alone(p, 4) and one.n == 1 and one.samples == [one.tokens]
        assert two.tokens == [model.alone(q, 6)] * 2 and two.samples == two.tokens
        assert plain.tokens == model.alone([5, 5, 5], 3)
        assert "n" not in one.as_json() and two.as_json()["n"] == 2
        f = engine.figures()
        assert f["requests"] == 4 and f["failed"] == 0
        if cache:  # p: 3 whole pages computed once, its 1 last token by each of 4 lanes
            assert three.computed_tokens + one.computed_tokens == 13 + 3
            assert two.computed_tokens == 7 + own(q, 4)
        else:  # nothing shared: every sample computes its prompt whole
            assert f["computed_tokens"] == 3 * 13 + 13 + 2 * 7 + 3
        check_no_leak(engine)


def test_more_samples_than_lanes_run_in_waves_and_still_read_the_prompt():
    model = Ledger()
    prompt = list(range(17))
    engine = Engine(model=model, pages=64, page_size=4, lanes=2, clock="steps", debug=True)
    (result,) = engine.run([Request("w", prompt, 6, n=5)])
    assert result.tokens == [model.alone(prompt, 6)] * 5
    assert result.computed_tokens == 17 + 4 * own(prompt, 4)
    assert engine.figures()["peak_pages_in_use"] <= 2 * pages_for(Request(0, prompt, 6), 4)
    check_no_leak(engine)


def test_a_stop_token_ends_every_sample_alike():
    model = Ledger()
    prompt = list(range(11))
    want = model.alone(prompt, 8)
    stop = {want[2]}
    engine = Engine(model=model, pages=64, page_size=4, lanes=3, clock="steps")
    (result,) = engine.run([Request("s", prompt, 8, stop=stop, n=3)])
    assert result.tokens == [want[:3]] * 3
    check_no_leak(engine)


# -- random mixes: every sample its prompt's tokens, refusals exactly as stated ----------------
@settings(max_examples=30, deadline=None)
@given(drawn=st.lists(st.tuples(st.integers(0, 1), st.lists(st.integers(0, 3), min_size=1,
                                                            max_size=6),
                                st.integers(1, 4), st.integers(1, 4), st.integers(0, 4)),
                      min_size=1, max_size=5),
       page_size=st.integers(1, 4), pages=st.integers(2, 24), lanes=st.integers(1, 4),
       chunk=st.integers(1, 6))
def test_every_sample_gets_its_prompts_tokens_whatever_the_mix(drawn, page_size, pages, lanes,
                                                               chunk):
    """Random prompts (two stems), sample counts, arrivals, pools and lanes, with the cache
    and without: each sample's tokens are its prompt's alone, or the request fails, exactly
    when one lane or ``min(n, lanes)`` lanes at once (the prompt's whole pages counted once
    with the cache) exceed the pool; nothing leaks; with the cache a request computes no
    more."""
    model = Ledger()
    stems = [[1, 2, 3, 1, 2, 3, 0], [3, 3]]
    requests = [Request(i, stems[s] + tail, new, arrival=at, n=n)
                for i, (s, tail, new, n, at) in enumerate(drawn)]
    computed = {}
    for cache in (True, False):
        engine = Engine(model=model, pages=pages, page_size=page_size, lanes=lanes,
                        chunk=chunk, cache=cache, clock="steps", debug=True)
        results = engine.run(requests)
        for request, result in zip(requests, results, strict=True):
            need = pages_for(request, page_size)
            shared = (len(request.prompt) - 1) // page_size if cache else 0
            at_once = min(request.n, lanes)
            if need > pages or need + (at_once - 1) * (need - shared) > pages:
                assert result.error is not None, (request, result)
                continue
            assert result.error is None, result.error
            want = model.alone(request.prompt, request.max_new_tokens)
            assert result.samples == [want] * request.n
        assert engine.figures()["requests"] == len(requests)
        check_no_leak(engine)
        computed[cache] = [r.computed_tokens if r.error is None else None for r in results]
    for on, off in zip(computed[True], computed[False]):  # the cache off refuses more
        assert off is None or on <= off


# -- bad input, pools too small, a failing sample ---------------------------------------------
@pytest.mark.parametrize("n, error, match", [
    (0, ValueError, "n must be a positive integer, got 0"),
    (-2, ValueError, "n must be a positive integer, got -2"),
    (2.0, TypeError, "n must be a positive integer, got 2.0"),
    (True, TypeError, "n must be a positive integer, got True"),
    ("3", TypeError, "n must be a positive integer, got '3'"),
    (None, TypeError, "n must be a positive integer, got None"),
])
def test_a_bad_n_is_refused_naming_the_request(n, error, match):
    with pytest.raises(error, match=rf"cacheidx.serve.Request 'a': {match}"):
        Request("a", [1, 2, 3], 4, n=n)


def test_an_integer_n_of_numpy_is_taken():
    assert Request("a", [1, 2], n=np.int64(3)).n == 3 and Request("a", [1, 2]).n == 1


def test_samples_that_cannot_fit_the_pool_fail_alone():
    """Pages of 4, a pool of 10: one lane of 10 prompt tokens and 10 new needs 5 pages, of
    which 2 whole prompt pages are shared; 3 samples at once need 5 + 2 * 3 = 11. Without the
    cache nothing is shared: 2 samples need 10 (they fit), 3 need 15. The request fails
    alone, the others are served; with lanes=2 only 2 run at once, and 8 pages fit."""
    model = Ledger()
    prompt = list(range(10))
    requests = [Request("a", [1, 2, 3], 4), Request("many", prompt, 10, n=3),
                Request("b", prompt, 10, n=2)]
    engine = Engine(model=model, pages=10, page_size=4, lanes=4, clock="steps")
    a, many, b = engine.run(requests)
    assert many.error == ("request 'many' needs 11 pages of 4 tokens for its 3 samples at "
                          "once: 5 each (10 prompt tokens and up to 10 new ones), 2 of them "
                          "the prompt's whole pages, shared; the pool has 10")
    assert many.tokens == [[], [], []]
    assert a.tokens == model.alone([1, 2, 3], 4)
    assert b.error is None and b.tokens == [model.alone(prompt, 10)] * 2
    assert engine.figures()["failed"] == 1 and engine.figures()["requests"] == 3
    check_no_leak(engine)
    engine = Engine(model=model, pages=14, page_size=4, lanes=4, clock="steps", cache=False)
    (many,) = engine.run([Request("many", prompt, 10, n=3)])
    assert many.error.endswith("for its 3 samples at once: 5 each (10 prompt tokens and up "
                               "to 10 new ones), none shared (the cache is off); the pool "
                               "has 14")
    engine = Engine(model=model, pages=10, page_size=4, lanes=2, clock="steps")
    (many,) = engine.run([Request("many", prompt, 10, n=3)])
    assert many.error is None and many.tokens == [model.alone(prompt, 10)] * 3
    engine = Engine(model=model, pages=7, page_size=4, lanes=2, clock="steps")
    (many,) = engine.run([Request("many", prompt, 10, n=3)])
    assert "for 2 of its 3 samples at once: 5 each" in many.error
    assert "the pool has 7" in many.error


def test_a_sample_whose_call_fails_fails_its_request_alone():
    """The tiny Llama poisoned by a token (``test_serve_failures``): every sample of a
    poisoned prompt fails its prefill; the request comes back once, failed, counted once,
    the error its first sample's; the request beside it is served."""
    from test_serve_failures import POISON, Poisoned
    from test_serve_failures import alone as poisoned_alone

    engine = Engine(Poisoned(), pages=32, page_size=4, lanes=4, clock="steps")
    bad, good = engine.run([Request("bad", [1, 2, 3, 4, 5, POISON, 7], 3, n=3),
                            Request("good", [1, 2, 3, 4, 5, 6, 7], 3, n=2)])
    assert bad.error == "sample 0: the model's prefill call failed: ValueError: poisoned"
    assert bad.tokens == [[], [], []]
    assert good.error is None
    assert good.tokens == [poisoned_alone((1, 2, 3, 4, 5, 6, 7), 3)] * 2
    f = engine.figures()
    assert f["failed"] == 1 and f["requests"] == 2
    check_no_leak(engine)


# -- sliding groups ---------------------------------------------------------------------------
def test_samples_share_the_prompt_with_sliding_groups():
    """A full layer and a window of 4, pages of 2: the first sample keeps the last window of
    the prompt it caches (the cache's law 8), so the others read all of its whole pages."""
    model = WindowedLedger([None, 4])
    prompt = [(3 * i + 2) % 40 for i in range(13)]
    engine = Engine(model, pages=32, page_size=2, lanes=3, clock="steps", debug=True)
    (result,) = engine.run([Request("s", prompt, 5, n=3)])
    assert result.tokens == [model.alone(prompt, 5)] * 3
    assert result.computed_tokens == 13 + 2 * own(prompt, 2)
    from test_serve_windows import check_no_leak as no_leak_in_groups

    no_leak_in_groups(engine)


# -- the tiny Llama: real tokens and logits, eager and compiled --------------------------------
@pytest.fixture(scope="module")
def tiny():
    config = llama.Config.tiny()
    params = llama.random_params(config, seed=11)
    return config, params, LlamaModel(config, params)


def test_tiny_llama_samples_equal_a_single_requests_tokens_and_logits(tiny):
    config, params, model = tiny
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 64, 14).tolist()
    tokens, logits = alone(config, params, prompt, 5)
    single = Engine(model, pages=64, page_size=4, lanes=4, keep_logits=True, clock="steps")
    (one,) = single.run([Request("one", prompt, 5)])
    assert one.tokens == tokens
    engine = Engine(model, pages=64, page_size=4, lanes=4, keep_logits=True, clock="steps")
    (result,) = engine.run([Request("s", prompt, 5, n=4)])
    assert result.tokens == [tokens] * 4
    assert result.last_logits.shape == (4, config.vocab)
    np.testing.assert_allclose(result.last_logits, np.stack([one.last_logits] * 4),
                               atol=1e-4, rtol=0)
    assert engine.figures()["computed_tokens"] == 14 + 3 * own(prompt, 4)
    check_no_leak(engine)


def test_a_compiled_engine_serves_samples(tiny):
    """Torch compiled (aot_eager), one fixed shape of each call (compiling is what costs):
    the samples' tokens are the prompt's alone, beside a request of one sample, and the
    prompt is computed once; seeded sampled samples are an eager engine's, with no program
    more. (Samples are the host's: every backend's step runs them alike.)"""
    backend_or_skip("torch")
    config, params, model = tiny
    rng = np.random.default_rng(4)
    p, q = rng.integers(0, 64, 10).tolist(), rng.integers(0, 64, 6).tolist()
    engine = Engine(model, backend="torch", compile="aot_eager", pages=64, page_size=4,
                    lanes=4, chunk=16, clock="steps", context=32, shapes="fixed", debug=True)
    hot = Request("h", q, 4, n=2, sampling=Sampling(temperature=30.0, seed=42))
    sampled, single, drawn = engine.run([Request("s", p, 4, n=3), Request("one", q, 4), hot])
    assert sampled.tokens == [alone(config, params, p, 4)[0]] * 3
    # seeded samples beside the others: an eager NumPy engine's tokens, the programs the same
    (eager,) = Engine(model, pages=64, page_size=4, lanes=4, clock="steps").run([hot])
    assert drawn.tokens == eager.tokens and drawn.tokens[0] != drawn.tokens[1]
    assert single.tokens == alone(config, params, q, 4)[0]
    assert sampled.computed_tokens == 10 + 2 * own(p, 4)
    assert {k: len(v) for k, v in engine.executor.shapes.items()} == {"prefill": 1, "decode": 1}
    check_no_leak(engine)


# -- the command ------------------------------------------------------------------------------
def _template(messages):
    return [ord(c) % 60 for m in messages for c in m["content"]] + [1]


def _served(model):
    return lambda: cli.Served("the tiny Llama", model, _template,
                              lambda ids: " ".join(map(str, ids)))


def _serve(model, argv, lines):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "requests.jsonl")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli.main([path, *argv], served=_served(model))
        return status, out.getvalue(), err.getvalue().replace(path, "FILE")


def test_the_cli_takes_n_per_line_and_writes_n_token_lists(tiny):
    config, params, model = tiny
    prompt = list(range(3, 16))
    want = alone(config, params, prompt, 4)[0]
    lines = [json.dumps({"id": "s", "prompt_ids": prompt, "n": 3}),
             json.dumps({"id": "one", "prompt_ids": prompt}),
             json.dumps({"id": "bad", "prompt_ids": prompt, "n": 0}),
             json.dumps({"id": "worse", "prompt_ids": prompt, "n": 1.5})]
    status, out, err = _serve(model, ["--max-new-tokens", "4", "--page-size", "4", "--json"],
                              lines)
    assert status == 1  # two bad lines
    got = json.loads(out)
    s, one, bad, worse = got["requests"]
    assert s["n"] == 3 and s["tokens"] == [want] * 3
    assert s["text"] == [" ".join(map(str, want))] * 3
    assert one["tokens"] == want and "n" not in one and one["text"] == " ".join(map(str, want))
    assert bad["error"].endswith("line 3: n must be a positive integer, got 0")
    assert worse["error"].endswith("line 4: n must be a positive integer, got 1.5")
    assert "FILE line 1: request 's': 13 prompt tokens (" in err and "3 samples of 4 new" in err
    assert got["figures"]["requests"] == 4 and got["figures"]["failed"] == 2
    # the prompt: 3 whole pages computed once, each later sample computes its 1 last token;
    # the request of one sample behind them reads the same pages
    assert s["computed_tokens"] == 13 + 2 and one["computed_tokens"] == 1
    status, out, _ = _serve(model, ["--max-new-tokens", "4", "--page-size", "4"], lines[:2])
    assert status == 0
    text = " ".join(map(str, want))
    assert out.splitlines() == [f"[s sample {k}] {text}" for k in range(3)] + [f"[one] {text}"]


def test_a_result_of_samples_reads_as_n_lists():
    r = Result("x", [1, 2], tokens=[[3], [3, 4]], n=2)
    assert r.samples == [[3], [3, 4]] and r.describe().endswith("2 samples of 1 to 2 new")
    assert Result("y", [1], tokens=[5]).samples == [[5]]


def test_a_cancelled_request_of_samples_ends_once_its_waiting_samples_never_started(tiny):
    """Engine.cancel on a request of 5 samples, 2 running and 3 waiting (2 lanes): it comes
    back once, its error the cancellation, its started samples' tokens kept and the others
    empty; the request beside it is served, and no page leaks."""
    from cacheidx.serve.engine import CANCELLED

    config, params, model = tiny
    e = Engine(model, pages=64, page_size=4, lanes=2, clock="steps")
    ticket = e.submit(Request("a", list(range(9)), 6, n=5,
                              sampling=Sampling(temperature=2.0, seed=1)))
    e.submit(Request("b", list(range(5)), 3))
    out = [r for _ in range(3) for r in e.step()]
    assert e.cancel(ticket) and not e.cancel(ticket)
    while e.busy:
        out += e.step()
    a, b = sorted(out, key=lambda r: r.id)
    assert a.error == CANCELLED and a.n == 5 and [len(t) for t in a.tokens] == [3, 2, 0, 0, 0]
    assert b.error is None and b.tokens == alone(config, params, list(range(5)), 3)[0]
    assert e.figures()["failed"] == 1
    check_no_leak(e)
