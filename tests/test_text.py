"""The laws of a sample's text read as it grows (:mod:`cacheidx.serve.text`): each token's
text read once, a stop string searched for in the new text and the tail before it alone, found
where ``cut`` of the whole text finds it, a stream shown what ``safe`` of the whole allows; and
the engine's stop strings at a cost linear in the answer (the whole continuation was
detokenized and searched again at every token: quadratic).
"""

from __future__ import annotations

import random

import pytest

from cacheidx.models import llama
from cacheidx.serve import Engine, LlamaModel, Request, Sampling
from cacheidx.serve.sampling import cut, safe
from cacheidx.serve.text import Text


def letters(ids):
    return "".join(chr(97 + t % 26) for t in ids)


def test_a_stop_string_is_found_where_cut_of_the_whole_text_finds_it():
    """Laws 2 and 3 against the whole text, token by token: the first token whose text holds
    a stop string is the one the whole text's ``cut`` first finds, the text is cut there, and
    until then the stream may show what ``safe`` of the whole allows."""
    for trial in range(400):
        r = random.Random(trial)
        ids = [r.randrange(26) for _ in range(r.randrange(1, 40))]
        whole = letters(ids)
        at = r.randrange(len(whole))
        stops = [whole[at:at + r.randrange(1, 5)], "zzq"]
        t = Text(letters, stops)
        found = None
        for k, token in enumerate(ids):
            if t.extend([token]):
                found = k
                break
            assert t.shown == safe(letters(ids[:k + 1]), stops), (trial, k)
        first = next(k for k in range(len(ids)) if cut(letters(ids[:k + 1]), stops)[1])
        assert found == first, trial
        assert t.text == cut(letters(ids[:found + 1]), stops)[0]


def test_half_a_character_waits_for_the_token_that_completes_it():
    """Law 1: a byte-level tokenizer's half character is not taken (nor shown) until the next
    token completes it; the text is then the whole's."""
    words = "é🙂x".encode()

    def decode(ids):
        return bytes(words[i] for i in ids).decode("utf-8", "replace")

    t = Text(decode, ["x"], streamed=True)
    t.extend([0])  # half of é
    assert t.take() == "" and t.text == ""
    t.extend([1])
    assert t.take() == "é"
    for i in range(2, 6):
        t.extend([i])  # 🙂 is four bytes
    assert t.take() == "🙂"
    assert t.extend([6])  # "x", the stop string
    assert t.text == "é🙂" and t.take() == ""  # cut before it


def test_stop_tokens_are_dropped_and_a_stream_takes_each_character_once():
    t = Text(letters, ["cd"], drop={25}, streamed=True)
    shown = []
    for token in (0, 25, 1, 2, 25, 3, 4):
        if t.extend([token]):
            break
        shown.append(t.take())
    shown.append(t.take())
    assert "".join(shown) == "ab" == t.text  # "c" held back: it begins "cd"


def test_reading_a_long_answer_costs_its_length():
    """Law 1 and 2's cost: over 20,000 tokens, each step detokenizes its window and searches
    its new text with the look-behind; the whole rescanned at each token would be 2 * 10**8."""
    t = Text(letters, ["!stop", "?"])
    n = 20_000
    for token in random.Random(1).choices(range(26), k=n):
        assert not t.extend([token])
    assert t.detokenized <= 3 * n and t.searched <= 5 * n
    assert t.length == n


def test_the_engines_stop_strings_cost_linear_work():
    """The scheduler's stop strings through a counting detokenizer: a 400-token answer that
    holds none detokenizes at most 5 tokens a token, its whole text once at its end included
    (the whole at each token: 80,000), and
    a stop string still ends it where the whole text's ``cut`` finds one."""
    config = llama.Config.tiny()
    model = LlamaModel(config, llama.random_params(config, seed=11))
    given = []

    def counting(ids):
        given.append(len(ids))
        return letters(ids)

    e = Engine(model, pages=128, page_size=4, lanes=2, clock="steps", detokenize=counting)
    hot = Sampling(temperature=30.0, seed=42, stop=("!",))  # never in a letter's text
    (r,) = e.run([Request("long", [1, 2, 3], 400, sampling=hot)])
    assert len(r.tokens) == 400 and r.finish_reason == "length"
    assert sum(given) <= 5 * 400, sum(given)
    text = letters(r.tokens)
    stop = text[300:303]
    at = text.index(stop)
    given.clear()
    (s,) = e.run([Request("stops", [1, 2, 3], 400, sampling=Sampling(
        temperature=30.0, seed=42, stop=("!", stop)))])
    assert s.finish_reason == "stop" and s.text == text[:at]
    assert s.tokens == r.tokens[:at + len(stop)]
    assert sum(given) <= 5 * 400, sum(given)


def test_a_streams_deltas_cost_linear_work_and_never_show_cut_text():
    """The HTTP stream's choice (``app.Choice``) reads its sample's new tokens alone: over a
    2,000-token answer its deltas detokenize at most 3 tokens a token (the whole text at each
    step: 2,000,000), the stop token is never shown, and the deltas joined are the text cut
    before the stop string, none of which a delta showed past it."""
    pytest.importorskip("fastapi", reason="the HTTP server's extra (cacheidx[serve]) is not "
                        "installed")
    from cacheidx.serve.http.app import Choice

    given = []

    def counting(ids):
        given.append(len(ids))
        return letters(ids)

    class Job:
        request = Request("r", [1], 4000, stop={25})

        class sample:
            tokens: list = []

        samples = [sample]

    tokens = [t for t in random.Random(3).choices(range(25), k=2000) if t != 2] + [2, 3]
    stop = letters([2, 3])  # "cd": first met at the end
    c = Choice(Job(), 0, 0)
    deltas = []
    for k, t in enumerate(tokens):
        Job.sample.tokens.append(t)
        if k % 7 == 0:
            Job.sample.tokens.append(25)  # the model's stop token: dropped from the text
        deltas.append(c.advance(counting, (stop,)))
    assert "".join(deltas) == letters(tokens[:-2])
    assert sum(given) <= 3 * len(Job.sample.tokens), sum(given)
