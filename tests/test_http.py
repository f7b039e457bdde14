"""The OpenAI-compatible server (``cacheidx.serve.http``) as its users use it: the official
``openai`` client against a server on 127.0.0.1 that the test starts (a free port, a tiny
random Llama, a tokenizer of one character a token) and stops, each call bounded in time.

What a stream shows is checked against what the engine gives offline for the same request
(:func:`offline`), token for token (``return_token_ids``) and as text.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from deadline import within

from cacheidx.models import llama
from cacheidx.serve import Engine, LlamaModel, Request
from cacheidx.serve.sampling import Sampling

openai = pytest.importorskip("openai", reason="the server's tests need the openai client "
                             "(pip install -e \".[test]\")")
http = pytest.importorskip("cacheidx.serve.http", reason="the server needs fastapi and "
                           "uvicorn (pip install -e \".[serve]\")")

V = 64
NAME = "tiny"
PAGE = 4
BASE = 0x4E00  # token t is the character chr(BASE + t): text and ids map one to one


def decode(ids):
    return "".join(chr(BASE + int(t)) for t in ids)


def encode(text):
    return [ord(c) - BASE if BASE <= ord(c) < BASE + V else ord(c) % V for c in text]


def template(messages):
    return encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


def tiny_model():
    """Weights three times :func:`llama.random_params`' scale: greedy tokens that vary."""
    config = llama.Config.tiny(vocab=V)
    params = llama.tree_map(lambda x: x * 3 if x.ndim == 2 else x,
                            llama.random_params(config, seed=1))
    return LlamaModel(config, params)


MODEL = tiny_model()


class Held(LlamaModel):
    """:data:`MODEL`, whose calls past the first ``calls`` wait until :attr:`go` is set (at
    most 30 s): a request stays in flight for as long as a test needs it, however fast the
    machine."""

    def __init__(self, calls):
        super().__init__(MODEL.config, MODEL.params)
        self.calls, self.go = calls, threading.Event()

    def forward(self, *args):
        self.calls -= 1
        if self.calls < 0:
            self.go.wait(30)
        return super().forward(*args)


def engine(**options):
    return Engine(options.pop("model", MODEL), pages=options.pop("pages", 512), page_size=PAGE,
                  lanes=options.pop("lanes", 8), detokenize=decode, **options)


def start(**options):
    queue = options.pop("queue", 256)
    return http.Running(engine(**options), queue=queue, name=NAME, template=template,
                        decode=decode, encode=encode, stop=(), max_tokens=16, context=None)


def client(server, **options):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=options.pop("timeout", 30))


def offline(prompt, new, **sampling):
    """The engine's tokens for the request alone, offline."""
    (r,) = engine().run([Request("offline", prompt, new, sampling=Sampling(**sampling))])
    assert r.error is None, r.error
    return r.tokens


def metrics(server):
    """``/metrics``'s samples without labels, as numbers."""
    out = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def chat(text, system="You are a test."):
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server():
    s = start()
    yield s
    s.stop()


# -- whole and streamed -----------------------------------------------------------------------
def test_a_whole_and_a_streamed_chat_completion_give_the_engines_tokens(server):
    messages = chat("hello")
    want = offline(template(messages), 12, temperature=0)
    with within(30):
        c = client(server)
        whole = c.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                          max_tokens=12)
        chunks = list(c.chat.completions.create(
            model=NAME, messages=messages, temperature=0, max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    assert whole.object == "chat.completion" and whole.model == NAME
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.message.content == decode(want)
    assert choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == len(template(messages))
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    # the stream: its role first, its deltas the whole text, its finish, then its usage alone
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.usage is None for ch in chunks[:-1])
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == decode(want)
    ids = [t for ch in body for t in (ch.choices[0].model_extra.get("token_ids") or [])]
    assert ids == want
    assert [ch.choices[0].finish_reason for ch in body].count("length") == 1
    assert body[-1].choices[0].finish_reason == "length"


def test_a_completion_of_text_of_ids_and_of_several_prompts(server):
    c = client(server)
    a, b = "abcdefgh", [3, 1, 4, 1, 5, 9, 2, 6]
    with within(30):
        one = c.completions.create(model=NAME, prompt=a, max_tokens=6, temperature=0)
        ids = c.completions.create(model=NAME, prompt=b, max_tokens=6, temperature=0)
        both = c.completions.create(model=NAME, prompt=[b, b[:5]], max_tokens=6,
                                    temperature=0)
        streamed = list(c.completions.create(model=NAME, prompt=b, max_tokens=6,
                                             temperature=0, stream=True))
    assert one.object == "text_completion"
    assert one.choices[0].text == decode(offline(encode(a), 6, temperature=0))
    assert ids.choices[0].text == decode(offline(b, 6, temperature=0))
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [decode(offline(p, 6, temperature=0))
                                              for p in (b, b[:5])]
    assert both.usage.prompt_tokens == len(b) + 5
    assert "".join(ch.choices[0].text for ch in streamed) == ids.choices[0].text


def test_a_stop_string_cuts_the_answer_and_the_stream_never_shows_it(server):
    messages = chat("stop here")
    text = decode(offline(template(messages), 16, temperature=0))
    stop = text[5:8]
    want = text[: text.index(stop)]
    c = client(server)
    with within(30):
        whole = c.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                          max_tokens=16, stop=[stop])
        chunks = list(c.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                                max_tokens=16, stop=stop, stream=True))
    assert whole.choices[0].message.content == want
    assert whole.choices[0].finish_reason == "stop"
    shown = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert shown == want
    assert whole.usage.completion_tokens < 16  # the engine stopped there too


# -- sampling ---------------------------------------------------------------------------------
def test_n_samples_with_a_temperature_differ_and_compute_the_prompt_once(server):
    messages = chat("four answers, one prompt", system="A system prompt of its own. " * 3)
    prompt = template(messages)
    before = metrics(server)
    with within(30):
        r = client(server).chat.completions.create(
            model=NAME, messages=messages, n=4, temperature=2.0, seed=7, max_tokens=16)
    after = metrics(server)
    texts = [ch.message.content for ch in r.choices]
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert len(set(texts)) == 4, texts
    # the first sample computes the prompt (but what earlier requests cached: "<system>");
    # each later one only its tokens past the whole pages it reads (the scheduler's law 6)
    own = len(prompt) - (len(prompt) - 1) // PAGE * PAGE
    cached = r.usage.prompt_tokens_details.cached_tokens
    computed = after["cacheidx_computed_tokens_total"] - before["cacheidx_computed_tokens_total"]
    assert computed == len(prompt) - cached + 3 * own
    assert after["cacheidx_prompt_tokens_total"] - before["cacheidx_prompt_tokens_total"] \
        == 4 * len(prompt)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 64
    (alone,) = engine().run([Request("n", prompt, 16, n=4,
                                     sampling=Sampling(temperature=2.0, seed=7))])
    assert texts == [decode(t) for t in alone.tokens]


def test_a_seed_gives_the_same_tokens_alone_and_beside_seven_other_requests(server):
    messages = chat("the same seed")
    ask = dict(model=NAME, messages=messages, temperature=1.2, top_p=0.9, seed=1234,
               max_tokens=12, extra_body={"return_token_ids": True})
    c = client(server)
    with within(30):
        first = c.chat.completions.create(**ask).choices[0].model_extra["token_ids"]
        again = c.chat.completions.create(**ask).choices[0].model_extra["token_ids"]
    assert first == again == offline(template(messages), 12, temperature=1.2, top_p=0.9,
                                     seed=1234)

    async def crowd():
        a = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               timeout=30)
        others = [a.chat.completions.create(model=NAME, messages=chat(f"other {k}"),
                                            temperature=0.9, seed=k, max_tokens=12 + k)
                  for k in range(7)]
        mine = a.chat.completions.create(**ask)
        got = await asyncio.gather(mine, *others)
        await a.close()
        return got

    import asyncio
    with within(30):
        beside = asyncio.run(crowd())
    assert beside[0].choices[0].model_extra["token_ids"] == first
    assert all(r.choices[0].finish_reason == "length" for r in beside)


def test_logprobs_are_the_models_own_of_the_chosen_tokens(server):
    messages = chat("logprobs")
    with within(30):
        r = client(server).chat.completions.create(
            model=NAME, messages=messages, temperature=0, max_tokens=5, logprobs=True,
            top_logprobs=3, extra_body={"return_token_ids": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    ids = r.choices[0].model_extra["token_ids"]
    for item, t in zip(content, ids):
        assert item.token == decode([t]) and item.logprob <= 0
        assert len(item.top_logprobs) == 3
        # greedy: the chosen token is the likeliest
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


# -- the prefix cache -------------------------------------------------------------------------
def test_a_second_request_sharing_a_system_prompt_reads_it_from_the_cache(server):
    system = "You answer questions about the prefix cache, briefly and well. " * 2
    c = client(server)
    with within(30):
        a = c.chat.completions.create(model=NAME, messages=chat("first", system),
                                      temperature=0, max_tokens=4)
        b = c.chat.completions.create(model=NAME, messages=chat("second", system),
                                      temperature=0, max_tokens=4)
    shared = len(template([{"role": "system", "content": system}]))
    assert a.usage.prompt_tokens_details.cached_tokens < shared
    assert b.usage.prompt_tokens_details.cached_tokens >= shared // PAGE * PAGE - PAGE
    assert b.usage.prompt_tokens_details.cached_tokens > 0


# -- a client that leaves ---------------------------------------------------------------------
def test_an_aborted_stream_is_cancelled_and_its_pages_freed(server):
    assert wait_for(lambda: metrics(server)["cacheidx_pages_in_use"] == 0)
    before = metrics(server)
    with within(30):
        stream = client(server).chat.completions.create(
            model=NAME, messages=chat("a long answer nobody reads"), temperature=0,
            max_tokens=400, stream=True)
        seen = 0
        for _ in stream:
            seen += 1
            if seen == 3:
                break
        during = metrics(server)
        stream.close()
        assert during["cacheidx_pages_in_use"] > 0
        assert wait_for(lambda: metrics(server)["cacheidx_pages_in_use"] == 0)
    after = metrics(server)
    assert after["cacheidx_samples_in_flight"] == 0
    assert wait_for(lambda: metrics(server)["cacheidx_generated_tokens_total"]
                    - before["cacheidx_generated_tokens_total"] < 400)
    cancelled = 'cacheidx_requests_total{outcome="cancelled"}'
    text = httpx.get(f"{server.url}/metrics").text
    n = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(cancelled)]
    assert n and n[0] >= 1


def test_a_client_that_leaves_before_a_whole_answer_cancels_it(server):
    assert wait_for(lambda: metrics(server)["cacheidx_pages_in_use"] == 0)
    before = metrics(server)
    body = {"model": NAME, "messages": chat("an answer nobody waits for"), "temperature": 0,
            "max_tokens": 1000}  # some seconds: the client leaves after 0.3
    with within(30):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=0.3)
        assert wait_for(lambda: metrics(server)["cacheidx_samples_in_flight"] == 0)
    after = metrics(server)
    assert after["cacheidx_pages_in_use"] == 0
    assert after["cacheidx_generated_tokens_total"] - before["cacheidx_generated_tokens_total"] \
        < 1000


# -- bad requests -----------------------------------------------------------------------------
BAD = [
    # (what, body, status, param)
    ("no JSON", b'{"model": "tiny", "messages": [', 400, None),
    ("no object", b"[1, 2]", 400, None),
    ("a temperature out of range", {"temperature": 2.5}, 422, "temperature"),
    ("n of 0", {"n": 0}, 422, "n"),
    ("max_tokens of text", {"max_tokens": "many"}, 422, "max_tokens"),
    ("no messages", {"messages": []}, 422, "messages"),
    ("a role that is none", {"messages": [{"role": "wizard", "content": "x"}]}, 422,
     "messages.0.role"),
    ("an unknown model", {"model": "gpt-9"}, 404, "model"),
    ("a prompt past the pool", {"max_tokens": 10**6}, 400, "messages"),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("logit_bias", {"logit_bias": {"3": 5}}, 400, "logit_bias"),
    ("an image", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
]


def test_bad_requests_get_openais_error_objects_while_a_stream_goes_on(server):
    messages = chat("a stream that outlives the bad requests")
    want = offline(template(messages), 60, temperature=0)
    good = {"model": NAME, "messages": chat("good"), "max_tokens": 2}
    with within(40):
        stream = client(server).chat.completions.create(
            model=NAME, messages=messages, temperature=0, max_tokens=60, stream=True,
            extra_body={"return_token_ids": True})
        chunks = [next(stream), next(stream)]
        for what, body, status, param in BAD:
            if isinstance(body, dict):
                body = json.dumps({**good, **body}).encode()
            r = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                           headers={"Content-Type": "application/json"}, timeout=10)
            assert r.status_code == status, (what, r.text)
            e = r.json()["error"]
            assert set(e) == {"message", "type", "param", "code"} and e["message"], what
            assert e["param"] == param, (what, e)
        chunks += list(stream)
    ids = [t for ch in chunks for ch_ in ch.choices for t in (ch_.model_extra.get("token_ids")
                                                              or [])]
    assert ids == want
    assert chunks[-1].choices[0].finish_reason == "length"
    # and the openai client reads them as its errors
    c = client(server)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-9", messages=messages)
    with pytest.raises(openai.UnprocessableEntityError):
        c.chat.completions.create(model=NAME, messages=messages, temperature=9)
    with pytest.raises(openai.BadRequestError, match="pool"):
        c.chat.completions.create(model=NAME, messages=messages, max_tokens=10**6)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_past_the_queue_limit_a_request_gets_429():
    with start(lanes=1, queue=1) as s, within(30):
        c = client(s)
        running = c.chat.completions.create(model=NAME, messages=chat("one"), temperature=0,
                                            max_tokens=300, stream=True)
        next(running)
        waiting = c.chat.completions.create(model=NAME, messages=chat("two"), temperature=0,
                                            max_tokens=300, stream=True)
        assert wait_for(lambda: metrics(s)["cacheidx_samples_in_flight"] == 2)
        with pytest.raises(openai.RateLimitError, match="busy"):
            c.chat.completions.create(model=NAME, messages=chat("three"), max_tokens=2)
        running.close()
        waiting.close()
        assert wait_for(lambda: metrics(s)["cacheidx_samples_in_flight"] == 0)
        r = c.chat.completions.create(model=NAME, messages=chat("four"), temperature=0,
                                      max_tokens=2)
        assert r.choices[0].finish_reason == "length"


# -- the other endpoints ----------------------------------------------------------------------
def test_models_health_and_metrics(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.get(f"{server.url}/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {line.split()[2] for line in r.text.splitlines() if line.startswith("# TYPE")}
    assert {"cacheidx_http_requests_total", "cacheidx_requests_total",
            "cacheidx_prompt_tokens_total", "cacheidx_cached_tokens_total",
            "cacheidx_generated_tokens_total", "cacheidx_pages_in_use",
            "cacheidx_requests_waiting", "cacheidx_prefix_hit_rate"} <= names
    assert 'cacheidx_http_requests_total{endpoint="/health",status="200"}' in r.text
    assert httpx.get(f"{server.url}/v2/nothing").status_code == 404


def test_a_drain_answers_503_and_lets_the_stream_in_flight_end():
    """What SIGTERM does (the server's law 1), through the handler uvicorn calls for it."""
    import signal

    held = Held(calls=4)  # the stream stays in flight until the drain has been seen
    with start(model=held) as s, within(30):
        c = client(s)
        messages = chat("draining")
        want = offline(template(messages), 40, temperature=0)
        stream = c.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                           max_tokens=40, stream=True,
                                           extra_body={"return_token_ids": True})
        chunks = [next(stream)]
        assert wait_for(lambda: held.calls < 0)  # a call waits: the stream is in flight
        s.server.handle_exit(signal.SIGTERM, None)
        assert httpx.get(f"{s.url}/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model=NAME, messages=chat("late"), max_tokens=2)
        assert e.value.status_code == 503
        held.go.set()
        chunks += list(stream)
        ids = [t for ch in chunks for x in ch.choices for t in (x.model_extra.get("token_ids")
                                                                or [])]
        assert ids == want and chunks[-1].choices[0].finish_reason == "length"
        assert wait_for(lambda: s.server.should_exit)
