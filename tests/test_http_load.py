"""A bounded load on the server: 64 streaming clients at once through the official ``openai``
client (asyncio), none lost, each stream's tokens the engine's offline answer for its seed
(the sampling's law 1: a token is a function of its seed, sample and step, whatever else the
batch holds)."""

from __future__ import annotations

import asyncio

import pytest
from deadline import within
from test_http import NAME, chat, engine, metrics, start, template, wait_for

from cacheidx.serve import Request
from cacheidx.serve.sampling import Sampling

openai = pytest.importorskip("openai", reason="the server's tests need the openai client "
                             "(pip install -e \".[test]\")")

CLIENTS = 64


def asks(k):
    """Client ``k``'s request: a shared system prompt, its own question, its own seed and
    length; every fourth greedy."""
    return dict(messages=chat(f"question {k}", system="Answer in a few tokens."),
                temperature=0.0 if k % 4 == 0 else 1.0, seed=1000 + k, max_tokens=4 + k % 9)


def test_64_concurrent_streams_none_lost_each_the_engines_offline_answer():
    want = engine().run([Request(k, template(a["messages"]), a["max_tokens"],
                                 sampling=Sampling(temperature=a["temperature"], seed=a["seed"]))
                         for k, a in enumerate(map(asks, range(CLIENTS)))])
    assert all(r.error is None for r in want)

    async def one(client, k):
        stream = await client.chat.completions.create(
            model=NAME, stream=True, stream_options={"include_usage": True},
            extra_body={"return_token_ids": True}, **asks(k))
        ids, reasons, usage = [], [], None
        async for chunk in stream:
            for c in chunk.choices:
                ids += c.model_extra.get("token_ids") or []
                reasons.append(c.finish_reason)
            usage = chunk.usage or usage
        return ids, [r for r in reasons if r is not None], usage

    async def crowd(url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                    timeout=60)
        try:
            return await asyncio.gather(*(one(client, k) for k in range(CLIENTS)))
        finally:
            await client.close()

    with start(lanes=8, queue=CLIENTS) as s, within(60):
        got = asyncio.run(crowd(s.url))
        assert wait_for(lambda: metrics(s)["cacheidx_samples_in_flight"] == 0)
        m = metrics(s)
    assert len(got) == CLIENTS
    for k, ((ids, reasons, usage), r) in enumerate(zip(got, want)):
        assert ids == r.tokens, k
        assert reasons == ["length"], k
        assert usage.completion_tokens == len(r.tokens) == asks(k)["max_tokens"]
    assert m["cacheidx_pages_in_use"] == 0
    assert m["cacheidx_generated_tokens_total"] == sum(len(r.tokens) for r in want)
    assert m["cacheidx_cached_tokens_total"] > 0  # the system prompt, read from the cache
