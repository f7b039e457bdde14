"""The HTTP server under load: requests/s, time to first token (TTFT) and inter-token latency
(ITL, p50 and p99) at 1, 8 and 32 concurrent streaming clients on a multi-turn chat, with and
without the prefix cache.

Each client holds conversations under one shared system prompt; each turn it streams its
answer through the official ``openai`` client (``AsyncOpenAI``, ``stream=True``, a
temperature of 0.7 and the conversation's seed), then sends the conversation back with the
answer and a new question. TTFT is from the request's send to its first chunk holding a
token; ITL the gap between two chunks holding tokens, divided over the tokens of the later
(one step's tokens arrive together). Each answer ends at the model's end of turn or
``--max-tokens``. SmolLM2-135M-Instruct (numpy, eager, 8 lanes) through ``python -m
cacheidx.serve --http`` in a process of its own, one request warming each server before the
clients start (the tokenizer's first load); ``--tiny`` serves the tests' random two-layer
model on a thread of this process instead (a smoke run: its clients share the server's
interpreter, so its ITL is not the server's).

    python benchmarks/http_server.py [--tiny] [--clients 1,8,32] [--turns 2]
                                     [--max-tokens 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from cacheidx.serve import Engine  # noqa: E402

SYSTEM = ("You are a helpful assistant. Answer each question in one short sentence, and "
          "keep to the facts you are sure of. ") * 3
QUESTIONS = ["What is the capital of France?", "And what river runs through it?",
             "Name a famous museum there.", "What is it known for?"]


def tiny():
    sys.path.insert(0, str(ROOT / "tests"))
    import test_http as t

    return t.NAME, t.MODEL, t.template, t.decode, t.encode, (), None


def counts(url):
    """``/metrics``' prompt token counters."""
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        for key in ("computed", "prompt"):
            if line.startswith(f"cacheidx_{key}_tokens_total "):
                out[f"{key}_tokens"] = int(float(line.split()[1]))
    return out


@contextlib.contextmanager
def server(small, cache, max_tokens):
    """The server's URL: SmolLM2 through the command in a process of its own (its engine
    thread never shares an interpreter with the clients), or the tiny model on a thread."""
    if small:
        from cacheidx.serve.http import Running

        name, model, template, decode, encode, stop, _ = tiny()
        engine = Engine(model, pages=1024, page_size=16, lanes=8, cache=cache,
                        detokenize=decode)
        with Running(engine, queue=256, name=name, template=template, decode=decode,
                     encode=encode, stop=stop, max_tokens=max_tokens) as s:
            yield s.url
        return
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "cacheidx.serve", "--http",
                             f"127.0.0.1:{port}", "--lanes", "8", "--pages", "1024",
                             "--max-new-tokens", str(max_tokens)]
                            + ([] if cache else ["--no-cache"]), cwd=ROOT,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        # one request first: the tokenizer's first load and the first calls are no figure
        httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hello."}]})
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def percentiles(xs):
    if not xs:
        return None, None
    return (round(float(np.percentile(xs, 50)) * 1000, 1),
            round(float(np.percentile(xs, 99)) * 1000, 1))


async def conversation(client, name, c, turns, max_tokens, ttft, itl):
    messages = [{"role": "system", "content": SYSTEM}]
    tokens = 0
    for t in range(turns):
        messages.append({"role": "user", "content": f"{QUESTIONS[t % 4]} ({c})"})
        sent = time.perf_counter()
        last, answer, first = None, [], True
        stream = await client.chat.completions.create(
            model=name, messages=messages, max_tokens=max_tokens, temperature=0.7, seed=c,
            stream=True, extra_body={"return_token_ids": True})
        async for chunk in stream:
            for choice in chunk.choices:
                ids = choice.model_extra.get("token_ids") or []
                answer.append(choice.delta.content or "")
                if not ids:
                    continue
                now = time.perf_counter()
                if first:
                    ttft.append(now - sent)
                    first = False
                else:
                    itl.extend([(now - last) / len(ids)] * len(ids))
                last = now
                tokens += len(ids)
        messages.append({"role": "assistant", "content": "".join(answer)})
    return tokens


async def load(url, name, clients, conversations, turns, max_tokens):
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=600)
    ttft, itl = [], []
    queue = list(range(conversations))

    async def worker():
        n = 0
        while queue:
            c = queue.pop()
            n += await conversation(client, name, c, turns, max_tokens, ttft, itl)
        return n

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(worker() for _ in range(clients))))
    seconds = time.perf_counter() - t0
    await client.close()
    return seconds, tokens, ttft, itl


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tests' random model (a smoke run)")
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    name = tiny()[0] if args.tiny else "SmolLM2-135M-Instruct"
    rows = []
    print("| clients | prefix cache | requests | requests/s | tokens/s | TTFT p50 (ms) | "
          "TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | prompt tokens computed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for clients in (int(c) for c in args.clients.split(",")):
        conversations = max(clients, 8)
        for cache in (True, False):
            with server(args.tiny, cache, args.max_tokens) as url:
                seconds, tokens, ttft, itl = asyncio.run(load(
                    url, name, clients, conversations, args.turns, args.max_tokens))
                f = counts(url)
            requests = conversations * args.turns
            row = {"clients": clients, "cache": cache, "requests": requests,
                   "seconds": round(seconds, 2),
                   "requests_per_s": round(requests / seconds, 2),
                   "tokens_per_s": round(tokens / seconds, 1),
                   "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl),
                   "computed": f["computed_tokens"], "prompt_tokens": f["prompt_tokens"]}
            rows.append(row)
            print(f"| {clients} | {'on' if cache else 'off'} | {requests} | "
                  f"{row['requests_per_s']} | {row['tokens_per_s']} | {row['ttft_ms'][0]} | "
                  f"{row['ttft_ms'][1]} | {row['itl_ms'][0]} | {row['itl_ms'][1]} | "
                  f"{row['computed']} of {row['prompt_tokens']} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": name, "turns": args.turns,
                                               "max_tokens": args.max_tokens, "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
