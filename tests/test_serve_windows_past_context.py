"""No pool is asked for more pages than a request can hold (issue 26, item 15): a window that
never frees a page of a request the engine holds (the groups' law 4: ``w > context -
page_size``) is kept as a full one, and a sliding pool needs at most one request's pages. The
windowed ledger of ``test_serve_windows`` (whose tokens change with any column read wrong),
given a context of 16 tokens, and the tiny Llama of the issue's repro.
"""

from __future__ import annotations

import re

import pytest
from test_serve_windows import WindowedLedger, check_no_leak

from cacheidx.models import llama
from cacheidx.prefix import reach
from cacheidx.serve import Engine, LlamaModel, Request
from cacheidx.serve.groups import frees

CONTEXT, P = 16, 4
REQUESTS = [Request("long", (3, 1, 4, 1, 5, 9, 2, 6), 9),  # 16 positions: the context
            Request("short", (2, 7, 1), 4), Request("again", (3, 1, 4, 1, 5), 11)]


class Ledger(WindowedLedger):
    """The windowed ledger of a model whose requests hold at most ``CONTEXT`` tokens."""

    context = CONTEXT


def test_a_group_frees_a_page_exactly_when_some_position_reads_past_page_0():
    """Law 4 against a brute force over every position a request of ``context`` tokens
    holds."""
    for page in range(1, 6):
        for context in range(1, 20):
            for w in range(1, 24):
                some = any(reach.first_page(w, t, page) > 0 for t in range(context))
                assert frees(w, context, page) == some, (w, context, page)
    assert frees(4, None, 4) and not frees(None, 16, 4)


def test_the_issues_repro_is_served_with_a_pool_of_one_request():
    """``Config.tiny(windows=(100, None), context=16)`` with 5 pages of 4 tokens a group was
    refused ("needs 26") though a request holds 4 pages at most."""
    config = llama.Config.tiny(windows=(100, None), context=CONTEXT)
    params = llama.random_params(config, seed=1)
    engine = Engine(LlamaModel(config, params), pages={100: 5, None: 5}, page_size=P,
                    clock="steps", debug=True)
    every = Engine(LlamaModel(config, params), pages=8, page_size=P, clock="steps",
                   windows=[None, None])
    assert engine.groups.windows == (None,)
    assert [r.tokens for r in engine.run(REQUESTS)] == [r.tokens for r in every.run(REQUESTS)]
    check_no_leak(engine)


@pytest.mark.parametrize("windows, pages, groups", [
    ((100, None), {100: 4, None: 4}, (None,)),       # far past the context
    ((14, None), {14: 4, None: 4}, (None,)),         # its last position still reads page 0
    ((100, 14), {100: 4, 14: 5}, (None,)),           # no full layer: the windows become one
    ((4, 12, None), {4: 2, 12: 4, None: 4}, (None, 4, 12)),  # 12 = 16 - 4 frees page 0
])
def test_a_window_that_never_frees_a_page_is_kept_as_a_full_one(windows, pages, groups):
    engine = Engine(Ledger(windows), pages=pages, page_size=P, lanes=2, chunk=4,
                    clock="steps", debug=True)
    assert engine.groups.windows == groups
    results = engine.run(REQUESTS)
    assert [r.error for r in results] == [None] * 3
    assert [r.tokens for r in results] == [Ledger(windows).alone(r.prompt, r.max_new_tokens)
                                           for r in REQUESTS]
    check_no_leak(engine)


def test_the_engines_own_context_caps_a_window_as_the_models_does():
    engine = Engine(WindowedLedger((100, None)), pages={100: 4, None: 4}, page_size=P,
                    clock="steps", context=CONTEXT)
    assert engine.groups.windows == (None,)
    (result,) = engine.run(REQUESTS[:1])
    assert result.tokens == Ledger((100, None)).alone(REQUESTS[0].prompt, 9)


@pytest.mark.parametrize("windows, pages, message", [
    ((100, None), {100: 3, None: 5}, "the pool of the 1 layer of window 100 has 3 pages of 4 "
     "tokens; a request of 16 tokens, the most the engine holds, needs 4"),
    ((8, None), {8: 2, None: 5}, "the pool of the 1 layer of window 8 has 2 pages of 4 tokens; "
     "one window needs 3 (a token reads itself and the 7 positions before it)"),
])
def test_a_pool_below_a_window_or_a_request_is_refused_naming_both(windows, pages, message):
    with pytest.raises(ValueError, match=re.escape(f"cacheidx.serve.Engine: {message}")):
        Engine(Ledger(windows), pages=pages, page_size=P)
