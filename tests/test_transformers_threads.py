"""Threads sharing one transformers model through ``cacheidx.integrations.transformers``
(issue 26, item 2): each ``generate`` gets the tokens it gets alone, transformers' own
``generate`` on the same model meanwhile gets its own, and the model is left as it was found
(its attention implementation, transformers' ``generate`` on it), a call that raises included.

What a call computes follows from what it passes (``attention`` law 5): a call with an index
attends through it, any other is the model's own; the model-wide setting only counts holds.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

for _module in ("torch", "transformers"):
    pytest.importorskip(_module, reason=f"the transformers integration needs `{_module}`")

from hf_models import VOCAB, greedy, tiny  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cacheidx.integrations import transformers as cit  # noqa: E402

PAGE = 4
_rng = np.random.default_rng(3)
PROMPTS = [_rng.integers(0, VOCAB, n).tolist() for n in (9, 5, 13)]
OWN = PROMPTS[1][:4]  # transformers' own generate's prompt
TOO_LONG = _rng.integers(0, VOCAB, 300).tolist()  # past max_position_embeddings (256)


class Alone:
    """One tiny model and what each call gives on it alone, single-threaded, computed once."""

    def __init__(self, name: str):
        self.model = tiny(name)
        self.made: dict = {}
        self.own = greedy(self.model, OWN, 8)

    def tokens(self, new: int) -> list[list[int]]:
        if new not in self.made:
            self.made[new] = cit.generate(self.model, PROMPTS, max_new_tokens=new,
                                          page_size=PAGE)
        return self.made[new]


@pytest.fixture(scope="module")
def alone():
    made: dict = {}

    def get(name):
        if name not in made:
            made[name] = Alone(name)
        return made[name]

    return get


def together(model, calls: list[tuple[float, object]]) -> list[tuple[object, float, float]]:
    """Runs each ``(delay, call)`` in a thread of its own, ``delay`` seconds after they all
    begin; returns each one's result (or the exception it raised), start and end."""
    start = threading.Barrier(len(calls))
    out: list = [None] * len(calls)

    def run(k, delay, call):
        start.wait()
        time.sleep(delay)
        began = time.perf_counter()
        try:
            got = call()
        except Exception as e:  # noqa: BLE001 (the test reads what it raised)
            got = e
        out[k] = (got, began, time.perf_counter())

    threads = [threading.Thread(target=run, args=(k, d, c)) for k, (d, c) in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread never returned"
    return out


def generating(model, new: int, prompts=PROMPTS):
    return lambda: cit.generate(model, prompts, max_new_tokens=new, page_size=PAGE)


def owns(model):
    return lambda: greedy(model, OWN, 8)


def assert_left_as_found(case: Alone) -> None:
    model = case.model
    assert model.config._attn_implementation == "eager"
    assert greedy(model, OWN, 8) == case.own, "transformers' own generate runs as before"


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_two_threads_on_one_model_each_get_the_tokens_they_get_alone(name, alone):
    """The issue's case: a call of 30 new tokens, and one of 6 begun while the first is
    mid-run, and transformers' own ``generate`` on the same model in a third thread meanwhile.
    Each gets what it gets alone; the model is left eager.

    The overlap is made, not hoped for: the long call's third forward waits until the short
    call has begun (a pre-hook on the embedding, which every forward runs), so a loaded
    machine cannot run the two one after the other."""
    case = alone(name)
    model = case.model
    want6, want30 = case.tokens(6), case.tokens(30)
    short_began = threading.Event()
    long_thread: list = []
    forwards = [0]

    def gate(_module, _args):
        if long_thread and threading.current_thread() is long_thread[0]:
            forwards[0] += 1
            if forwards[0] == 3:
                assert short_began.wait(60), "the short call never began"

    def long_call():
        long_thread.append(threading.current_thread())
        return generating(model, 30)()

    def short_call():
        deadline = time.perf_counter() + 60
        while forwards[0] < 3 and time.perf_counter() < deadline:  # (its third forward waits)
            time.sleep(0.001)
        short_began.set()
        return generating(model, 6)()

    hook = model.get_input_embeddings().register_forward_pre_hook(gate)
    try:
        (got30, begin30, end30), (got6, begin6, end6), (own, _, _) = together(
            model, [(0.0, long_call), (0.0, short_call), (0.01, owns(model))])
    finally:
        hook.remove()
    assert begin30 < end6 and begin6 < end30, "the calls overlapped"
    assert got6 == want6
    assert got30 == want30
    assert own == case.own
    assert_left_as_found(case)


def test_a_call_that_raises_beside_others_leaves_the_model_as_found(alone):
    """A call whose prompt the engine refuses (past the model's context) raises, in a thread
    beside a call that serves: the other gets its tokens, and the model is left eager."""
    case = alone("llama")
    model = case.model
    want = case.tokens(12)
    (bad, _, _), (good, _, _) = together(
        model, [(0.01, generating(model, 4, PROMPTS[:1] + [TOO_LONG])),
                (0.0, generating(model, 12))])
    assert isinstance(bad, ValueError) and "generate: prompt 1" in str(bad), bad
    assert good == want
    assert_left_as_found(case)


@settings(max_examples=8)
@given(calls=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 10)), min_size=2,
                      max_size=3),
       own=st.booleans())
def test_threads_at_any_timing_get_what_they_get_alone(calls, own, alone):
    """Two or three ``generate`` calls of 1 to 10 new tokens, each begun 0 to 40 ms after
    the start, with transformers' own ``generate`` beside them or not: each gets what it gets
    alone, and the model is left as found."""
    case = alone("llama")
    model = case.model
    for _, new in calls:
        case.tokens(new)  # (alone, before the threads)
    runs = [(ms / 1000, generating(model, new)) for ms, new in calls]
    got = together(model, runs + ([(0.005, owns(model))] if own else []))
    for (_, new), (tokens, _, _) in zip(calls, got, strict=False):
        assert tokens == case.tokens(new), f"{new} new tokens"
    if own:
        assert got[-1][0] == case.own
    assert_left_as_found(case)


def test_wrappers_share_one_hold_and_the_last_gives_the_model_back(alone):
    """Two wrappers of one model (a long-running engine's and a ``generate``'s): giving the
    first back leaves the model set for the second; the second gives it back; giving either
    back again changes nothing."""
    model = alone("llama").model
    first, second = cit.model(model), cit.model(model)
    assert first.previous == second.previous == "eager"
    first.restore()
    assert model.config._attn_implementation == "cacheidx:eager"
    first.restore()
    assert model.config._attn_implementation == "cacheidx:eager", "again: the same"
    second.restore()
    assert model.config._attn_implementation == "eager"
    second.restore()
    assert model.config._attn_implementation == "eager"



@pytest.mark.slow
def test_a_forward_the_user_compiled_serves_and_leaves_the_model_as_found():
    """``model.forward = torch.compile(model.forward)`` (dynamo's graph run as captured; its
    tracing of transformers' forward is what takes the time): ``generate`` through it, under
    the engine's inference mode, gives the tokens it gives uncompiled, and leaves the model
    eager."""
    import torch

    model = tiny("llama")
    want = generating(model, 3, PROMPTS[1:2])()
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        with torch._dynamo.config.patch(recompile_limit=64):
            assert generating(model, 3, PROMPTS[1:2])() == want
    finally:
        del model.forward  # (the instance's attribute: the class's forward again)
    assert model.config._attn_implementation == "eager"
