"""A sliding-window layer keeps only its window (issue 19): the engine keeps one table and one
pool of pages per group of layers of one window, a sliding group gives back what no call
still to come reads, and the tokens are those of one table for every layer.

Most laws run on a *windowed ledger*: each of its layers stores ``token + 1`` at each token's
slot and hashes what its last token reads through ``index.window(w)``; the next token is the
sum of the layers' hashes. A page given back too early, a column read below the window, a
page another request overwrote: each changes the hash. It computes in milliseconds, so
Hypothesis draws windows, pools, chunks and arrivals. The tiny Llama then checks real tokens
on NumPy, PyTorch and JAX, and the window arithmetic is checked against a brute force.
"""

from __future__ import annotations

import numpy as np
import pytest
from array_api_compat import array_namespace
from array_api_compat import device as device_of
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheidx as ci
from cacheidx.conformance.pytest_plugin import backend_or_skip
from cacheidx.models import llama
from cacheidx.prefix import reach
from cacheidx.serve import Engine, LlamaModel, Request

V = 101  # a prime: one wrong token always changes the hash


class WindowedLedger:
    """Layer ``l`` (window ``windows[l]``, ``None``: every position) stores ``token + 1``; a
    lane's next token is ``sum over l of (l + 1) * sum((t_c + 1) * w_c)`` over the columns
    ``c`` its last token sees in layer ``l``, mod ``V``."""

    def __init__(self, windows, columns: int = 1024):
        self.windows = list(windows)
        self.w = 1 + (np.arange(columns) * 7 + 3) % 100

    def place(self, xp, device):
        return {"w": xp.asarray(self.w, device=device)}

    def pools(self, weights, slots):
        xp, w = array_namespace(weights["w"]), weights["w"]
        each = [slots] * len(self.windows) if isinstance(slots, int) else slots
        return [(xp.zeros((n, 1), dtype=w.dtype, device=device_of(w)),) for n in each]

    def forward(self, weights, tokens, index, pools):
        indices = index if isinstance(index, list) else [index] * len(self.windows)
        first = indices[0]
        xp = first.backend.xp
        h, out = 0, []
        for layer, ((pool,), ix, window) in enumerate(zip(pools, indices, self.windows)):
            ix = ix if window is None else ix.window(window)
            values = xp.reshape(xp.astype(tokens + 1, pool.dtype), (*tokens.shape, 1))
            seen, pool = ix.extend(values, pool, donate=True)
            sees = ix.mask()[:, -1, :]
            terms = seen[:, :, 0] * weights["w"][None, : seen.shape[1]] * (layer + 1)
            h = h + xp.sum(xp.where(sees, terms, xp.zeros_like(terms)), axis=1)
            out.append((pool,))
        h = h % V
        vocab = xp.arange(V, dtype=h.dtype, device=device_of(h))
        return xp.astype(h[:, None] == vocab[None, :], xp.float32), out

    def alone(self, prompt, max_new, stop=()):
        """The tokens a request gets computed alone, on the host."""
        seq, out = list(prompt), []
        while len(out) < max_new:
            t, h = len(seq) - 1, 0
            for layer, window in enumerate(self.windows):
                start = 0 if window is None else max(0, t - window + 1)
                h += (layer + 1) * sum((seq[j] + 1) * int(self.w[j]) for j in range(start, t + 1))
            out.append(h % V)
            seq.append(out[-1])
            if out[-1] in stop:
                break
        return out


def check_no_leak(engine):
    """Every page of every group free or cached with no reader, nothing reserved."""
    cache = engine.cache
    cache.check()
    for g in range(len(cache.windows)):
        pool = cache.group(g)
        assert pool.free + pool.cached == pool.capacity, f"group {g}: pages leaked"
        assert pool.evictable == pool.cached, f"group {g}: a cached page still has a reader"
        assert pool.reserved == 0 and pool.in_use == 0


# -- the window arithmetic against a brute force ---------------------------------------------
def test_a_call_reads_at_most_pages_at_once_and_largest_call_fits_the_pool():
    """``pages_at_once(w, n, P)`` is the most pages a call of ``n`` tokens reads through a
    window of ``w`` (its tokens and the ``w - 1`` positions before the first), wherever it
    starts; ``largest_call`` is the longest call whose pages fit a pool."""
    for P in range(1, 6):
        for w in range(1, 10):
            for n in range(1, 8):
                spans = [(first + n - 1) // P - reach.first_page(w, first, P) + 1
                         for first in range(0, 4 * P + w)]
                assert max(spans) == reach.pages_at_once(w, n, P), (P, w, n)
            for pages in range(1, 8):
                fits = [n for n in range(1, 40) if reach.pages_at_once(w, n, P) <= pages]
                assert reach.largest_call(w, pages, P) == (max(fits) if fits else
                                                           reach.largest_call(w, pages, P))
                assert (reach.largest_call(w, pages, P) >= 1) == bool(fits)


# -- concrete cases ------------------------------------------------------------------------------
def test_a_long_prompt_runs_on_a_pool_of_one_window_and_one_chunk():
    """Window 8, pages of 4, a pool of 10 pages: a 120-token prompt (30 pages) runs, its
    chunks cut to 30 tokens (30 + 7 positions span at most 10 pages), and every call reads its
    tokens' own values."""
    model = WindowedLedger([8, 8])
    prompt = [(7 * i) % 50 for i in range(120)]
    engine = Engine(model, pages=10, page_size=4, lanes=2, clock="steps", debug=True)
    (result,) = engine.run([Request("long", prompt, 8)])
    assert result.error is None and result.tokens == model.alone(prompt, 8)
    f = engine.figures()
    assert f["chunk"] == 30 and f["groups"][0]["peak_pages_in_use"] == 10
    check_no_leak(engine)


def test_a_sequence_holds_one_window_and_one_chunk_whatever_its_length():
    """Mixed layers (full and window 6): the full group holds every page, the sliding one at
    most ``pages_at_once(6, chunk, P)``, for a prompt of 40 tokens as of 160."""
    model = WindowedLedger([None, 6])
    held = {}
    for n in (40, 160):
        prompt = [(3 * i + 1) % 60 for i in range(n)]
        engine = Engine(model, pages=64, page_size=4, chunk=8, clock="steps")
        (result,) = engine.run([Request(n, prompt, 4)])
        assert result.tokens == model.alone(prompt, 4)
        full, sliding = engine.figures()["groups"]
        assert full["window"] is None and full["peak_pages_in_use"] == -(-(n + 3) // 4)
        held[n] = sliding["peak_pages_in_use"]
        check_no_leak(engine)
    assert held[40] == held[160] == reach.pages_at_once(6, 8, 4) == 4


def test_a_turn_reads_the_last_window_its_previous_turn_cached():
    """All layers sliding (window 4, pages of 2): a conversation's next turn reads back the
    whole previous turn (the full group would), because the pages of its last window were
    kept; the tokens equal those of no cache."""
    model = WindowedLedger([4, 4])
    engine = Engine(model, pages=16, page_size=2, lanes=1, clock="steps", debug=True)
    first = Request("t1", list(range(11)), max_new_tokens=5)
    later = []

    def next_turn(result):
        if result.id == "t1":
            later.append(Request("t2", result.prompt_ids + result.tokens + [7, 8], 3))
            engine.submit(later[0])

    t1, t2 = engine.run([first], on_finish=next_turn)
    assert t2.tokens == model.alone(later[0].prompt, 3)
    assert t2.cached_tokens == 14  # prompt 11 + 4 fed answer tokens: 7 whole pages
    assert engine.cache.group(0).cached <= 2 * reach.window_pages(4, 2) + 2
    check_no_leak(engine)


def test_a_prefix_whose_window_was_not_kept_is_computed_again():
    """Full layers and a window of 4, pages of 2: ``a`` (16 tokens) keeps its last window
    only. ``b`` shares its first 5 pages (10 tokens): the full group has them, the sliding
    group has not the window a hit there reads, so ``b`` computes them (a hit needs both);
    ``c``, which extends ``a``, reads 16. Each gets the tokens of one table."""
    model = WindowedLedger([None, 4])
    a = list(range(16))
    b, c = a[:10] + [40, 41, 42], a + [50, 51]
    engine = Engine(model, pages=32, page_size=2, lanes=1, clock="steps", debug=True)
    results = engine.run([Request("a", a, 3), Request("b", b, 3, arrival=1),
                          Request("c", c, 3, arrival=2)])
    assert [r.tokens for r in results] == [model.alone(p, 3) for p in (a, b, c)]
    assert [r.cached_tokens for r in results] == [0, 0, 16]
    check_no_leak(engine)


def test_requests_sharing_a_prompt_longer_than_the_window_read_it_where_they_part():
    """Window 4, pages of 2: ``a`` and ``b`` arrive together and share a 20-token stem, then
    9 and 5 tokens of their own. ``b`` waits while ``a`` computes and keeps the window where
    they part (its last window would not hold it), then reads the whole stem."""
    model = WindowedLedger([None, 4])
    stem = [(5 * i + 2) % 40 for i in range(20)]
    a, b = stem + [1] * 9, stem + [2] * 5
    engine = Engine(model, pages=32, page_size=2, lanes=2, chunk=4, clock="steps", debug=True)
    results = engine.run([Request("a", a, 3), Request("b", b, 3)])
    assert [r.tokens for r in results] == [model.alone(a, 3), model.alone(b, 3)]
    assert [r.cached_tokens for r in results] == [0, 20]
    check_no_leak(engine)


def test_a_pool_too_small_for_one_window_is_refused_naming_the_numbers():
    model = WindowedLedger([None, 8, 8])
    with pytest.raises(ValueError, match=r"cacheidx.serve.Engine: the pool of the 2 layers of "
                                         r"window 8 has 2 pages of 4 tokens; one window needs "
                                         r"3 \(a token reads itself and the 7 positions before "
                                         r"it\)"):
        Engine(model, pages=2, page_size=4)
    with pytest.raises(ValueError, match=r"pool of the 2 layers of window 8 has 1 pages"):
        Engine(model, pages={None: 8, 8: 1}, page_size=4)
    with pytest.raises(ValueError, match=r"pages names the windows \[8\]; the groups' are "
                                         r"\[None, 8\]"):
        Engine(model, pages={8: 8}, page_size=4)
    with pytest.raises(ValueError, match="layer 1 reads a window of 8; the engine cannot keep "
                                         "only a window of 4 for it"):
        Engine(model, pages=8, page_size=4, windows=[None, 4, 8])
    with pytest.raises(ValueError, match="windows names 2 layers; the model has 3"):
        Engine(model, pages=8, page_size=4, windows=[None, None])
    with pytest.raises(TypeError, match=r"windows\[0\] must be None or a positive integer, "
                                        r"got 2.5"):
        Engine(model, pages=8, page_size=4, windows=[2.5, 8, 8])
    with pytest.raises(ValueError, match="windows names 1 layers of 2"):
        llama.Config.tiny(windows=(4,))
    with pytest.raises(ValueError, match=r"windows\[1\] must be None or a positive integer, "
                                         r"got 0"):
        llama.Config.tiny(windows=(4, 0))


# -- random windows, pools, chunks and arrivals ----------------------------------------------------
layer_windows = st.lists(st.one_of(st.none(), st.integers(1, 5)), min_size=1, max_size=3)
requests_ = st.lists(st.tuples(st.integers(0, 1), st.lists(st.integers(0, 3), min_size=1,
                                                           max_size=9),
                               st.integers(1, 5), st.integers(0, 12)),
                     min_size=1, max_size=6)


@settings(max_examples=40)
@given(windows=layer_windows, stems=st.lists(st.lists(st.integers(0, 3), min_size=4,
                                                      max_size=14), min_size=2, max_size=2),
       drawn=requests_, page_size=st.integers(1, 4), extra=st.integers(0, 8),
       lanes=st.integers(1, 3), chunk=st.integers(1, 9))
def test_every_request_gets_its_own_tokens_whatever_the_windows(windows, stems, drawn,
                                                               page_size, extra, lanes, chunk):
    """Random windows per layer, pools from one window up, page, lane and chunk sizes,
    prompts sharing prefixes arriving at random steps: each request gets the tokens it gets
    alone, with the cache and without, as with one table for every layer; a request fails
    only where the full group's pool cannot hold it; nothing leaks; every call keeps the
    table's obligations (``debug``)."""
    model = WindowedLedger(windows)
    requests = [Request(i, stems[s] + tail, new, arrival=at)
                for i, (s, tail, new, at) in enumerate(drawn)]
    sliding = [w for w in windows if w is not None]
    pages = max([reach.window_pages(w, page_size) for w in sliding] + [1]) + extra
    for told, cache in ((None, True), (None, False), ([None] * len(windows), True)):
        engine = Engine(model, pages=pages, page_size=page_size, lanes=lanes, chunk=chunk,
                        cache=cache, clock="steps", debug=True, windows=told)
        for request, result in zip(requests, engine.run(requests), strict=True):
            if told is None and None not in windows or -(-(len(request.prompt)
                                                            + request.max_new_tokens - 1)
                                                         // page_size) <= pages:
                assert result.error is None, result.error
                assert result.tokens == model.alone(request.prompt, request.max_new_tokens)
            else:
                assert "pages of" in result.error and result.tokens == []
        check_no_leak(engine)



# -- the tiny Llama with windows, on every backend ------------------------------------------------
KINDS = {"all sliding": (3, 3), "mixed, two windows": (None, 3, 6)}
CASES = [("numpy", False), ("torch", False), ("jax", True)]


def alone(config, params, prompt, max_new):
    """Greedy tokens of ``prompt`` computed alone, whole, on NumPy (the model slides itself)."""
    seq, out = list(prompt), []
    for _ in range(max_new):
        logits, _ = llama.forward(params, config, np.asarray([seq]), ci.whole(1, len(seq)),
                                  llama.empty_pools(config, 1), last=True)
        out.append(int(np.argmax(logits[0, 0])))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize("name, compile", CASES, ids=[n for n, _ in CASES])
def test_tiny_llama_with_windows_gives_the_tokens_of_one_table(name, compile):
    """An all-sliding tiny Llama and one with a full layer and two windows: through groups over
    small pools (with the cache: the third prompt reads the first's pages, its last windows
    among them) the tokens are each prompt's alone, as with one table for every layer.
    (JAX compiled, one shape of each call, is compared with each prompt alone only: its
    compiles are what cost.)"""
    backend_or_skip(name)
    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(0, 64, n).tolist() for n in (12, 7, 3))
    prompts = [a, b, a + c]
    requests = [Request(i, p, 4) for i, p in enumerate(prompts)]
    options = dict(backend=name, compile=compile, page_size=2, lanes=2, chunk=4,
                   clock="steps", debug=not compile, shapes="fixed" if compile else None,
                   context=24 if compile else None)
    for kind, windows in KINDS.items():
        config = llama.Config.tiny(layers=len(windows), windows=windows)
        params = llama.random_params(config, seed=3)
        model = LlamaModel(config, params)
        want = [alone(config, params, p, 4) for p in prompts]
        if not compile:
            one = Engine(model, pages=48, windows=[None] * len(windows), **options)
            assert [r.tokens for r in one.run(requests)] == want, kind
        pages = {None: 48, 3: 6, 6: 12} if None in windows else 8
        grouped = Engine(model, pages=pages, **options)
        results = grouped.run(requests)
        assert [r.tokens for r in results] == want, kind
        assert [r.cached_tokens for r in results] == [0, 0, 12], kind
        check_no_leak(grouped)
