"""A request that fails fails alone: in the engine (``cacheidx.serve.Engine``) and in its command
(``python -m cacheidx.serve``), a bad request gets an error naming it (and its line) in its own
result, its pages are released, the others are served, nothing hangs, and the engine serves the
next run. Concrete cases first (the repros of issue 20), then Hypothesis over random bad
requests and arguments.

Everything runs the tiny Llama on NumPy (its context cut to 24 tokens, so that the model's
context is a limit a small test reaches) with the steps clock, in process.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import tempfile

import numpy as np
import pytest
from deadline import within
from hypothesis import event, given, settings
from hypothesis import strategies as st

import cacheidx as ci
from cacheidx.devices import to_host
from cacheidx.models import llama
from cacheidx.serve import Engine, LlamaModel, Request, TableError
from cacheidx.serve import __main__ as cli

CONFIG = llama.Config.tiny(context=24)
PARAMS = llama.random_params(CONFIG, seed=5)
POISON = 63  # a token the checking model refuses to be fed, and never chooses


class Poisoned:
    """The tiny Llama, except that a call fed ``POISON`` raises (a model's own failure, which
    no check of the request foresees) and that it never chooses ``POISON``."""

    def __init__(self):
        self.inner = LlamaModel(CONFIG, PARAMS)
        self.vocab, self.context = CONFIG.vocab, CONFIG.context

    def place(self, xp, device):
        return self.inner.place(xp, device)

    def pools(self, weights, slots):
        return self.inner.pools(weights, slots)

    def forward(self, weights, tokens, index, pools):
        if (to_host(tokens) == POISON).any():
            raise ValueError("poisoned")
        logits, pools = self.inner.forward(weights, tokens, index, pools)
        xp = index.backend.xp
        never = xp.arange(logits.shape[-1]) == POISON
        return xp.where(never, xp.asarray(-xp.inf, dtype=logits.dtype), logits), pools


@functools.cache
def alone(prompt: tuple, max_new: int, stop: frozenset = frozenset()) -> list[int]:
    """The greedy tokens of ``prompt`` computed alone, whole, on NumPy (``POISON`` never)."""
    seq, out = list(prompt), []
    while len(out) < max_new:
        logits, _ = llama.forward(PARAMS, CONFIG, np.asarray([seq]), ci.whole(1, len(seq)),
                                  llama.empty_pools(CONFIG, 1), last=True)
        row = logits[0, 0].copy()
        row[POISON] = -np.inf
        out.append(int(np.argmax(row)))
        seq.append(out[-1])
        if out[-1] in stop:
            break
    return out


def engine(pages=32, page_size=4, **kw):
    return Engine(Poisoned(), pages=pages, page_size=page_size, lanes=3, chunk=4,
                  clock="steps", debug=True, **kw)


def check_laws(e: Engine) -> None:
    """Every page free or cached with no reader, and a later run serves."""
    cache = e.cache
    cache.check()
    assert cache.free + cache.cached == cache.capacity, "pages leaked"
    assert cache.evictable == cache.cached, "a cached page still has a reader"
    assert not e.busy
    if cache.capacity >= cache.pages_for(4):
        (later,) = e.run([Request("later", (1, 2, 3), 2)])
        assert later.error is None and later.tokens == alone((1, 2, 3), 2)


# -- the engine: concrete cases ------------------------------------------------------------------
def test_a_token_past_the_vocabulary_fails_alone_and_the_engine_serves_on():
    """Issue 20, repro 1: the model's IndexError once escaped run, lost the others' results
    and broke every later run."""
    e = Engine(LlamaModel(CONFIG, PARAMS), pages=16, page_size=4, clock="steps")
    good, bad = e.run([Request("good", (1, 2, 3), 3), Request("bad", (1, 64, 3), 3)])
    assert good.error is None and good.tokens == alone((1, 2, 3), 3)
    assert bad.tokens == [] and bad.error == ("request 'bad' holds token id 64 at prompt "
                                              "position 1; the model's vocabulary is ids 0 to 63")
    (good2,) = e.run([Request("good2", (4, 5, 6), 3)])
    assert good2.error is None and good2.tokens == alone((4, 5, 6), 3)
    assert e.figures()["failed"] == 1
    check_laws(e)


def test_a_request_longer_than_the_models_context_fails_when_submitted():
    """Issue 20, repro 4: the model's context (a GGUF file's context_length) is a limit."""
    e = engine(pages=64)
    fits, long = e.run([Request("fits", tuple(range(20)), 5),
                        Request("long", tuple(range(20)), 6)])
    assert fits.error is None and fits.tokens == alone(tuple(range(20)), 5)
    assert long.error == ("request 'long' holds 25 tokens (20 prompt tokens and up to 6 new "
                          "ones); the model's context is 24") and long.admitted is None
    check_laws(e)


def test_smollm2s_context_is_its_gguf_files_and_a_longer_prompt_is_refused():
    """Issue 20, repro 4: the eager command once took a 9,031-token prompt past SmolLM2's
    8,192. The config read from the GGUF file carries its context_length; the engine's
    scheduler refuses a request past it (the pool here would hold it)."""
    from cacheidx.models import gguf, gguf_file
    from cacheidx.prefix import PrefixCache
    from cacheidx.serve import Scheduler

    try:
        path = gguf.smollm2_path()
    except gguf.ModelMissing as e:
        pytest.skip(f"SmolLM2 is not installed: {e}")
    config = gguf.read_config(gguf_file.open_gguf(path))
    assert (config.vocab, config.context) == (49152, 8192)
    model = LlamaModel(config, params=None)
    scheduler = Scheduler(PrefixCache(1024, 16), lanes=1, chunk=64, vocab=model.vocab,
                          longest=model.context)
    assert scheduler.refusal(Request("long", (1,) * 9031, 32)) == (
        "request 'long' holds 9062 tokens (9031 prompt tokens and up to 32 new ones); the "
        "model's context is 8192")
    assert scheduler.refusal(Request("fits", (1,) * 8161, 32)) is None


def test_a_call_that_raises_fails_only_the_lanes_that_raise_alone():
    """The model raises for one lane of a call: the call is tried lane by lane, that lane's
    request fails with the model's error and releases its pages, the others are served."""
    e = engine()
    requests = [Request("a", (1, 2, 3, 4, 5), 3), Request("poisoned", (1, 2, POISON, 4), 3),
                Request("b", (1, 2, 3, 4, 7), 3)]
    a, poisoned, b = e.run(requests)
    assert poisoned.error == "the model's prefill call failed: ValueError: poisoned"
    assert poisoned.tokens == []
    assert (a.tokens, b.tokens) == (alone((1, 2, 3, 4, 5), 3), alone((1, 2, 3, 4, 7), 3))
    assert e.figures()["failed"] == 1 and e.figures()["requests"] == 3
    check_laws(e)


def test_run_refuses_what_is_no_request_and_submits_nothing():
    e = engine()
    with pytest.raises(TypeError, match=r"Engine.run: item 1 of requests is a dict, not a "
                                        r"Request; nothing was submitted"):
        e.run([Request("a", (1, 2), 2), {"id": "b", "prompt": (1, 2)}])
    assert not e.busy and e.run([]) == []


@pytest.mark.parametrize("kw, error, message", [
    (dict(prompt=(1, 2), arrival=math.nan), ValueError, "arrival must be a finite number at or "
     "after 0, got nan"),
    (dict(prompt=(1, 2), arrival=math.inf), ValueError, "got inf"),
    (dict(prompt=(1, 2), arrival=-1), ValueError, "got -1.0"),
    (dict(prompt=(1, 2), arrival="x"), TypeError, "arrival must be a number, got 'x'"),
    (dict(prompt=(1, 2), stop=2), TypeError, "stop must be a collection of integer token ids, "
     "got 2"),
    (dict(prompt=(1, 2), max_new_tokens=2.9), TypeError, "max_new_tokens must be a positive "
     "integer, got 2.9"),
    (dict(prompt=(1, 2), max_new_tokens=0), ValueError, "max_new_tokens must be a positive "
     "integer, got 0"),
    (dict(prompt=(True, 2)), TypeError, "the prompt holds True, not an integer token id"),
    (dict(prompt=(1, 2**63)), ValueError, "the prompt holds token id 9223372036854775808, "
     "outside 0 to 2**63 - 1"),
    (dict(prompt=()), ValueError, "the prompt is empty"),
    (dict(prompt="abc"), TypeError, "the prompt must be a collection of integer token ids"),
])
def test_a_bad_request_is_refused_naming_request_and_field(kw, error, message):
    """Issue 20, repros 2 and 8: nothing is truncated (2.9), taken as an id (True), or left
    to hang the engine (NaN) or overflow its sleep (infinity)."""
    with pytest.raises(error) as e:
        Request("r", **kw)
    assert str(e.value).startswith("cacheidx.serve.Request 'r': ") and message in str(e.value)


def test_a_far_arrival_sleeps_in_slices_never_one_overflowing_sleep(monkeypatch):
    """Issue 20, repro 2: a seconds clock once slept ``arrival - now`` in one call, which
    raised OverflowError for 1e12."""
    slept = []

    class Enough(Exception):
        pass

    def sleep(s):
        slept.append(s)
        if len(slept) == 3:
            raise Enough

    monkeypatch.setattr("cacheidx.serve.engine.time.sleep", sleep)
    e = Engine(Poisoned(), pages=8, page_size=4)
    with pytest.raises(Enough):
        e.run([Request("far", (1, 2), 2, arrival=1e12)])
    assert len(slept) == 3 and all(0 < s <= 1.0 for s in slept)


def test_the_debug_check_catches_a_scheduler_that_gives_one_page_to_two_requests(monkeypatch):
    """Engine(debug=True) checks each call's index (ci.check): a scheduler bug that puts two
    running requests on one page is raised as the engine's TableError, not charged to one."""
    from cacheidx.serve import scheduler

    place = scheduler.Scheduler._place

    def shared_first_page(self, lane):
        place(self, lane)
        self.table[lane.row, : self.P] = np.arange(self.P)  # every request on page 0

    monkeypatch.setattr(scheduler.Scheduler, "_place", shared_first_page)
    e = engine()
    with pytest.raises(TableError, match="the prefill call breaks an obligation of the table: "
                                         "cacheidx.check: .*two sequences share a slot only|"
                                         "write targets are distinct|never a write target"):
        e.run([Request("a", (1, 2, 3, 4, 5), 2), Request("b", (7, 7, 7, 7, 7), 2)])


# -- the engine: random bad requests ---------------------------------------------------------------
ids = st.integers(0, 7)
stems = st.lists(ids, max_size=8)
specs = st.tuples(
    st.integers(0, 2),  # which stem
    st.lists(ids, min_size=1, max_size=6),  # the tail
    st.integers(1, 4),  # max_new_tokens
    st.integers(0, 5),  # arrival step
    st.sampled_from(["good", "vocab", "poison", "long"]),  # what is wrong with it
    st.integers(0, 100),  # where
)


def spec_request(k, stems_, spec):
    s, tail, new, at, kind, where = spec
    prompt = list(stems_[s] + tail)
    if kind == "vocab":
        prompt[where % len(prompt)] = CONFIG.vocab + where % 5
    elif kind == "poison":
        prompt[where % len(prompt)] = POISON
    elif kind == "long":
        prompt = (prompt * 25)[: CONFIG.context - new + 1 + where % 3]
    return Request(k, tuple(prompt), new, arrival=at, stop=frozenset({5}))


@settings(max_examples=150)
@given(stems_=st.lists(stems, min_size=3, max_size=3),
       drawn=st.lists(specs, min_size=1, max_size=6), pages=st.integers(1, 24),
       page_size=st.integers(1, 4), cache=st.booleans())
def test_random_bad_requests_fail_alone_and_the_engine_keeps_its_laws(stems_, drawn, pages,
                                                                      page_size, cache):
    """Random requests, some with a token past the vocabulary, one the model raises on, or
    more tokens than its context; random pools: each request's result is its error (the
    reason the law names) or the tokens it gets alone, within a time bound; then nothing
    leaks and the engine serves a later run."""
    requests = [spec_request(k, stems_, spec) for k, spec in enumerate(drawn)]
    e = Engine(Poisoned(), pages=pages, page_size=page_size, lanes=3, chunk=3, cache=cache,
               clock="steps", debug=True)
    with within(30):
        results = e.run(requests)
    assert [r.id for r in results] == [r.id for r in requests]
    for request, result in zip(requests, results):
        event(next((why for why in ("vocabulary", "pool", "context", "call failed")
                    if why in (result.error or "")), "served"))
        total = len(request.prompt) + request.max_new_tokens - 1
        if max(request.prompt) >= CONFIG.vocab:
            assert "the model's vocabulary is ids 0 to 63" in result.error
        elif e.cache.pages_for(total) > pages:
            assert f"the pool has {pages}" in result.error
        elif total > CONFIG.context:
            assert "the model's context is 24" in result.error
        elif POISON in request.prompt:
            assert result.error == "the model's prefill call failed: ValueError: poisoned"
        else:
            assert result.error is None
            assert result.tokens == alone(request.prompt, request.max_new_tokens, request.stop)
            continue
        assert result.tokens == []
    assert e.figures()["failed"] == sum(r.error is not None for r in results)
    check_laws(e)


# -- the command ---------------------------------------------------------------------------------
def template(messages):
    """A stand-in chat template: the characters of the contents, as ids below 60."""
    return [ord(c) % 60 for m in messages for c in m["content"]] + [1]


def tiny() -> cli.Served:
    return cli.Served("the tiny Llama", Poisoned(), template, lambda ids: " ".join(map(str, ids)),
                      stop=(5,))


def serve(argv, lines, stdin=None):
    """``main(argv)`` in process over a file of ``lines``: ``(status, stdout, stderr)``."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "requests.jsonl")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), within(60):
            try:
                status = cli.main([path, *argv], served=tiny)
            except SystemExit as e:  # argparse's bad usage
                status = e.code
        return status, out.getvalue().replace(path, "FILE"), err.getvalue().replace(path, "FILE")


BAD_LINES = [
    ('{"id": "c1", "messages": [{"role": "user", "content": 123}]}',
     "line 2: message 0's \"content\" must be a string, got 123"),
    ('{"id": "c2", "messages": [{"role": "user", "content": null}]}',
     "line 2: message 0's \"content\" must be a string, got null"),
    ('{"id": "m1", "prompt_ids": [1, 2], "max_new_tokens": null}',
     "line 2: max_new_tokens must be a positive integer, got None"),
    ('{"id": "m2", "prompt_ids": [1, 2], "max_new_tokens": "abc"}',
     "line 2: max_new_tokens must be a positive integer, got 'abc'"),
    ('{"id": "m3", "prompt_ids": [1, 2], "max_new_tokens": 2.9}',
     "line 2: max_new_tokens must be a positive integer, got 2.9"),
    ('{"id": "a1", "prompt_ids": [1, 2], "arrival": null}',
     "line 2: arrival must be a number, got None"),
    ('{"id": "a2", "prompt_ids": [1, 2], "arrival": NaN}',
     "line 2: arrival must be a finite number at or after 0, got nan"),
    ('{"id": "a3", "prompt_ids": [1, 2], "arrival": Infinity}',
     "line 2: arrival must be a finite number at or after 0, got inf"),
    ('{"id": "a4", "prompt_ids": [1, 2], "arrival": 1e12}',
     "line 2: arrival must be at most 86400 seconds, got 1e+12"),
    ('{"id": "v", "prompt_ids": [1, 64, 3]}', "line 2: request 'v' holds token id 64 at prompt "
     "position 1; the model's vocabulary is ids 0 to 63"),
    ('{"id": "b", "prompt_ids": [true, 2]}', "line 2: the prompt holds True"),
    ('{"id": "long", "prompt_ids": [1, 2, 3], "max_new_tokens": 30}',
     "line 2: request 'long' holds 32 tokens (3 prompt tokens and up to 30 new ones); the "
     "model's context is 24"),
    ('{"id": "x", "prompt_ids": [1, 2', "line 2: not JSON (Expecting ',' delimiter"),
    ("[1, 2]", "line 2: not a JSON object"),
    ('{"id": "both", "prompt_ids": [1], "messages": []}',
     'line 2: a request needs "messages" or "prompt_ids" (one of them)'),
]
GOOD = '{"id": "ok", "messages": [{"role": "user", "content": "hi"}]}'
LAST = '{"id": "last", "prompt_ids": [3, 1, 4, 1, 5]}'


@pytest.mark.parametrize("line, message", BAD_LINES, ids=[line[:40] for line, _ in BAD_LINES])
def test_the_command_serves_the_other_lines_and_names_the_bad_one(line, message):
    """Issue 20, repros 2 and 3: once a traceback, a hang, or the whole file rejected; now the
    line's own result names its line and the error, the others are answered, status 1."""
    status, out, err = serve(["--max-new-tokens", "3"], [GOOD, line, "", LAST])
    assert status == 1, err
    ok, bad, last = out.splitlines()
    assert ok == f"[ok] {answer(template([{'content': 'hi'}]), 3)}"
    assert bad.startswith("[") and f"] error: FILE {message}" in bad
    assert last == f"[last] {answer([3, 1, 4, 1, 5], 3)}"
    assert "cacheidx.serve: cacheidx.serve" not in err and "Traceback" not in err
    assert f"FILE {message.split(':')[0]}" in err, "the progress names the line too"


def answer(prompt, new):
    """The text the command prints for a request: its tokens but the stop token."""
    return " ".join(str(t) for t in alone(tuple(prompt), new, frozenset({5})) if t != 5)


def test_the_commands_json_keeps_every_line_in_its_place_and_counts_the_failed():
    status, out, _ = serve(["--json", "--max-new-tokens", "2"], [GOOD, BAD_LINES[0][0], LAST])
    got = json.loads(out)
    assert status == 1
    assert [(r["id"], r["line"], "error" in r) for r in got["requests"]] == \
        [("ok", 1, False), ("c1", 2, True), ("last", 3, False)]
    assert got["requests"][2]["tokens"] == alone((3, 1, 4, 1, 5), 2, frozenset({5}))
    assert (got["figures"]["requests"], got["figures"]["failed"]) == (3, 1)


@pytest.mark.parametrize("argv, words", [
    (["--page-size", "0"], "argument --page-size: expected a positive integer, got 0"),
    (["--page-size", "-4"], "argument --page-size: expected a positive integer, got -4"),
    (["--pages", "x"], "argument --pages: expected a positive integer, got 'x'"),
    (["--backend", "nosuch"], "no backend named 'nosuch'; registered: numpy"),
])
def test_bad_usage_exits_2_naming_the_option(argv, words):
    """Issue 20, repro 3: --page-size 0 was a ZeroDivisionError, -4 blamed the pages."""
    status, out, err = serve(argv, [GOOD])
    assert status == 2 and words in err and out == ""


def test_a_missing_or_empty_file_exits_2_before_the_model_loads(capsys, tmp_path):
    def never():
        raise AssertionError("the model loaded")

    assert cli.main([str(tmp_path / "missing.jsonl")], served=never) == 2
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    assert cli.main([str(tmp_path / "blank.jsonl")], served=never) == 2
    assert "holds no request" in capsys.readouterr().err


def test_a_byte_order_mark_before_line_1_is_skipped():
    """Issue 26, item 14: an editor's "UTF-8 with BOM" once made line 1 "not JSON"."""
    status, out, err = serve(["--max-new-tokens", "3"], ["\ufeff" + LAST, GOOD])
    assert status == 0, err
    assert out.splitlines() == [f"[last] {answer([3, 1, 4, 1, 5], 3)}",
                                f"[ok] {answer(template([{'content': 'hi'}]), 3)}"]


def test_a_lone_surrogate_fails_its_line_alone_and_prints_escaped():
    """Issue 26, item 14: JSON's ``\\ud800`` is half a UTF-16 pair, no text a tokenizer takes
    (it raised the tokenizer's TypeError); its line fails alone, naming the line and id, and an
    id holding one prints escaped on a strict UTF-8 stdout, never stopping the others."""
    lines = [GOOD, '{"id": "s\\ud800", "messages": [{"role": "user", "content": "a\\udc00"}]}',
             LAST]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "requests.jsonl")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        raw = io.BytesIO()
        out = io.TextIOWrapper(raw, encoding="utf-8", errors="strict", write_through=True)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), \
                within(60):
            status = cli.main([path, "--max-new-tokens", "3"], served=tiny)
    ok, bad, last = raw.getvalue().decode("utf-8").replace(path, "FILE").splitlines()
    assert status == 1
    assert bad == ("[s\\ud800] error: FILE line 2: message 0's \"content\" holds a lone "
                   "surrogate \"\\udc00\" at character 1: no Unicode text")
    assert ok.startswith("[ok] ") and last == f"[last] {answer([3, 1, 4, 1, 5], 3)}"


def test_the_commands_help_states_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "Exit status: 0 every request served, 1 some request failed, 2 bad usage" in \
        " ".join(capsys.readouterr().out.split())


# -- the command: random lines and arguments ---------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                              max_size=2),
    max_leaves=6)
ALWAYS_BAD = {"max_new_tokens": [None, "abc", 2.9, True, 0, -1, [3]],
              "arrival": [None, "x", math.nan, math.inf, -1, 1e12, [0]],
              "prompt_ids": [[], [[1]], [1.5], [True], [-1], [64], "12", 7],
              "messages": [[], [{"role": "user"}], [{"role": "user", "content": 123}],
                           [{"role": "user", "content": None}], "hi", [["user", "hi"]]]}


@st.composite
def request_lines(draw, k):
    """A JSON line: a good request, one with a field that is always bad, one with a field
    replaced by any JSON value, or text that is no JSON object."""
    if draw(st.booleans()):
        base = {"id": k, "messages": [{"role": "user", "content": draw(st.text(max_size=8))}]}
    else:
        base = {"id": k, "prompt_ids": draw(st.lists(st.integers(0, 59), min_size=1,
                                                     max_size=8))}
    if draw(st.booleans()):
        base["max_new_tokens"] = draw(st.integers(1, 3))
    how = draw(st.sampled_from(["good", "always bad", "any value", "no object"]))
    if how == "always bad":
        field = draw(st.sampled_from(sorted(ALWAYS_BAD)))
        base.pop("messages" if field == "prompt_ids" else "prompt_ids", None)
        base[field] = draw(st.sampled_from(ALWAYS_BAD[field]))
    elif how == "any value":
        field = draw(st.sampled_from(["max_new_tokens", "arrival", "prompt_ids", "messages",
                                      "id"]))
        value = draw(json_values)
        if (field == "arrival" and isinstance(value, int | float)
                and not isinstance(value, bool) and 0 < value <= cli.LATEST):
            value = 0  # an arrival the command may wait for only makes the test wait
        base[field] = value
    elif how == "no object":
        return how, draw(st.sampled_from(["[1, 2]", '{"id": 1, "prompt_ids": [1', "nope",
                                          "3", '"text"', "{}"]))
    return how, json.dumps(base)


FLAGS = ["--page-size", "--lanes", "--max-new-tokens", "--pages", "--chunk"]


@settings(max_examples=100)
@given(data=st.data(), sizes=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3),
                                       st.none() | st.integers(1, 24)),
       bad=st.sampled_from([None] * 4 + FLAGS), bad_value=st.sampled_from(["0", "-4", "x", "1.5"]))
def test_random_lines_and_arguments_end_in_an_error_or_the_right_answer(data, sizes, bad,
                                                                        bad_value):
    """Random request files and sizes through main(argv) in process: a bad option exits 2; else
    every line gets its result in its place within a time bound, an error naming its line or
    the tokens it gets alone; a good line fails only when the pool cannot hold it; the status
    is 1 exactly when a line failed."""
    page_size, lanes, new, pages = sizes
    drawn = [data.draw(request_lines(k)) for k in range(data.draw(st.integers(1, 5)))]
    argv = ["--json", "--page-size", str(page_size), "--lanes", str(lanes), "--max-new-tokens",
            str(new), *(["--pages", str(pages)] if pages is not None else [])]
    if bad is not None:
        argv += [bad, bad_value]
    status, out, err = serve(argv, [text for _, text in drawn])
    if bad is not None:
        event("bad option: exit 2")
        assert status == 2 and f"argument {bad}: expected a positive integer" in err
        assert out == ""
        return
    assert "Traceback" not in err
    got = json.loads(out)["requests"]
    assert [r["line"] for r in got] == list(range(1, len(drawn) + 1))
    for (how, text), r in zip(drawn, got):
        event(f"{how}: {'failed' if 'error' in r else 'served'}")
        if "error" in r:
            assert r["error"].startswith(f"FILE line {r['line']}: ") and r["tokens"] == []
            assert how != "good" or "pages of" in r["error"], r["error"]
            continue
        assert how in ("good", "any value"), (text, r)
        line = json.loads(text)
        want = line.get("max_new_tokens", new)
        assert r["tokens"] == alone(tuple(r["prompt_ids"]), want, frozenset({5}))
    assert status == (1 if any("error" in r for r in got) else 0)
