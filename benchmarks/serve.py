"""Serving with an online prefix cache: prompt tokens computed on a multi-turn chat and a
shared-prompt agent workload (no cache, the cache at 25/50/100% of the pages an unbounded
one uses, an offline least-recently-used simulation, the ideal), matching speed, and SmolLM2
end to end beside transformers (and over int8 pools, ``Engine(kv="int8")``).

The token figures come from ``cacheidx.serve.Engine`` itself (its scheduler and prefix cache)
with a scripted executor in place of the model: each request "generates" its scripted
answer, and the next turn of a conversation (its prompt, that answer and a new message)
arrives when the answer is back. The ideal is an unbounded cache replaying the same trace one
request at a time; the offline simulation replays it one at a time with LRU over a bounded
number of pages (a plain-Python model written apart from ``PrefixCache``). Matching is
``PrefixCache.match`` beside a hand-written chained-hash lookup (vLLM's automatic prefix
caching, in plain Python). End to end: SmolLM2-135M-Instruct on this CPU, chat turns sent
back with the model's own answers, tokens generated per second of wall time, beside
transformers' ``generate`` computing each request from scratch (one thread each). Agents end
to end: 8 agents under one 2,048-token system prompt (the agents workload's first steps), 32
new tokens each, SmolLM2 through the engine on its eager torch backend with the prefix cache,
lanes that share the prompt's pages reading them once and, within
``cacheidx.attention.runs.unshared()``, each as its own (the same answers, checked).

    python benchmarks/serve.py [--json PATH] [--quick] [--full] [--no-model] [--only-agents]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")  # a shared machine's spinning pools measure the neighbours
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from cacheidx.prefix import PrefixCache  # noqa: E402
from cacheidx.serve import Engine, Request  # noqa: E402

P = 16  # tokens a page


def say(msg: str) -> None:
    # indented: run_all.py keeps only the unindented lines (the tables) for the page
    print(f"    {msg}", flush=True)


# -- workloads: token traces --------------------------------------------------------------------
def chat(rng, conversations=64, turns=4, system=512):
    """Conversations sharing a ``system``-token prompt; turns of 16 to 256 user tokens,
    answers of 16 to 192. Returns ``(first turns, next message of each turn, answers)``."""
    head = rng.integers(1000, 30000, system).tolist()
    users = {(c, t): rng.integers(1000, 30000, rng.integers(16, 257)).tolist()
             for c in range(conversations) for t in range(turns)}
    answers = {(c, t): rng.integers(1000, 30000, rng.integers(16, 193)).tolist()
               for c in range(conversations) for t in range(turns)}
    return [head + users[c, 0] for c in range(conversations)], users, answers, turns


def agents(rng, count=32, steps=4, shared=2048):
    """Agents sharing a ``shared``-token system prompt and tool list; each step a tool result
    of 64 to 512 tokens comes back and the agent answers with 16 to 96 tokens."""
    head = rng.integers(1000, 30000, shared).tolist()
    tasks = {(a, 0): rng.integers(1000, 30000, rng.integers(32, 129)).tolist()
             for a in range(count)}
    tasks.update({(a, s): rng.integers(1000, 30000, rng.integers(64, 513)).tolist()
                  for a in range(count) for s in range(1, steps)})
    answers = {(a, s): rng.integers(1000, 30000, rng.integers(16, 97)).tolist()
               for a in range(count) for s in range(steps)}
    return [head + tasks[a, 0] for a in range(count)], tasks, answers, steps


class Scripted:
    """An executor that computes nothing: each lane's next token is its scripted answer's."""

    def __init__(self, answers):
        self.answers = answers

    def run(self, batch, table, version):
        chosen = [self.answers[lane.request.id][len(lane.result.tokens)] for lane in batch.lanes]
        return np.asarray(chosen), None, False


def serve_trace(workload, pages, cache=True, lanes=16):
    """The engine over the closed-loop workload; returns its figures and the trace (prompt,
    answer) in admission order."""
    first, messages, answers, turns = workload
    engine = Engine(executor=Scripted(answers), pages=pages, page_size=P, lanes=lanes,
                    chunk=256, cache=cache, clock="steps")

    def follow(result):
        c, t = result.id
        if t + 1 < turns:
            engine.submit(Request((c, t + 1), result.prompt_ids + result.tokens
                                  + messages[c, t + 1], len(answers[c, t + 1])))

    results = engine.run([Request((c, 0), p, len(answers[c, 0])) for c, p in enumerate(first)],
                         on_finish=follow)
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    assert all(r.tokens == answers[r.id] for r in results)
    trace = [(r.prompt_ids, r.tokens) for r in sorted(results, key=lambda r: (r.admitted,
                                                                            r.ticket))]
    engine.cache.check()
    return engine.figures(), trace


class OfflineLRU:
    """The trace one request at a time over ``capacity`` pages (None: unbounded): a request
    reads its longest cached prefix of whole pages (capped below its length), computes the
    rest, then caches the whole pages it wrote; when pages run out the least recently used
    cached page that no cached page extends goes. Plain Python, apart from PrefixCache."""

    def __init__(self, capacity=None):
        self.capacity = capacity
        self.used = {}  # prefix key -> last use; a key is (parent key, page tokens)
        self.children = {}  # prefix key -> how many cached keys extend it
        self.clock = self.computed = self.prompt = 0

    def serve(self, prompt, answer):
        self.clock += 1
        keys, parent = [], None
        written = prompt + answer[:-1]
        for k in range(len(written) // P):
            parent = (parent, tuple(written[k * P : (k + 1) * P]))
            keys.append(parent)
        hit = 0
        while hit < (len(prompt) - 1) // P and keys[hit] in self.used:
            hit += 1
        self.prompt += len(prompt)
        self.computed += len(prompt) - hit * P
        own = -(-len(written) // P) - hit
        reading = set(keys[:hit])
        if self.capacity is not None:
            while len(self.used) + own > self.capacity:  # the pool: cached pages, its own
                self.evict(reading)
        for key in keys:
            if key not in self.used:  # (a capped last page may be cached already)
                self.children[key] = 0
                if key[0] is not None:
                    self.children[key[0]] += 1
            self.used[key] = self.clock

    def evict(self, reading):
        leaves = [k for k, n in self.children.items() if n == 0 and k not in reading]
        victim = min(leaves, key=self.used.__getitem__)
        del self.used[victim], self.children[victim]
        if victim[0] is not None:
            self.children[victim[0]] -= 1


def offline(trace, capacity=None):
    sim = OfflineLRU(capacity)
    for prompt, answer in trace:
        sim.serve(prompt, answer)
    return sim


def workload_rows(name, workload):
    say(f"{name}: the engine, no cache")
    none, _ = serve_trace(workload, 1 << 20, cache=False)
    say(f"{name}: the engine, an unbounded pool")
    unbounded, trace = serve_trace(workload, 1 << 20)
    ideal = offline(trace)
    need = unbounded["peak_pages_used"]
    rows = [{"workload": name, "run": "no cache", "pages": None,
             "computed": none["computed_tokens"], "hit_rate": 0.0},
            {"workload": name, "run": "ideal (unbounded, one at a time)", "pages": None,
             "computed": ideal.computed, "hit_rate": 1 - ideal.computed / ideal.prompt}]
    largest = max(-(-(len(p) + len(a) - 1) // P) for p, a in trace)
    for share in (1.0, 0.5, 0.25):
        pages = max(int(need * share), largest)
        say(f"{name}: the engine at {share:.0%} of {need} pages ({pages})")
        f, _ = serve_trace(workload, pages)
        rows.append({"workload": name, "run": f"engine, {share:.0%} of the pages",
                     "pages": pages, "computed": f["computed_tokens"], "hit_rate": f["hit_rate"],
                     "evictions": f["evictions"]})
        if share in (1.0, 0.5):
            sim = offline(trace, pages)
            rows.append({"workload": name, "run": f"offline LRU, {share:.0%} of the pages",
                         "pages": pages, "computed": sim.computed,
                         "hit_rate": 1 - sim.computed / sim.prompt})
    for r in rows:
        r["prompt_tokens"] = ideal.prompt
    return rows, need, len(trace)


# -- matching speed -------------------------------------------------------------------------------
def chained_hash_match(table, tokens, most):
    """vLLM's automatic prefix caching by hand: a hash per page chained with its prefix's,
    looked up page by page."""
    h, hit = None, 0
    for k in range(most):
        h = hash((h, tuple(tokens[k * P : (k + 1) * P])))
        if h not in table:
            break
        hit += 1
    return hit * P


def matching(rng, quick):
    cached_pages, prompt_tokens = (1000, 10_000) if quick else (10_000, 100_000)
    sequence = rng.integers(0, 50_000, cached_pages * P)
    cache = PrefixCache(cached_pages, P)
    hold = cache.admit(sequence, len(sequence))
    cache.insert(hold, sequence)
    cache.release(hold)
    prompt = sequence[:prompt_tokens]
    as_list = prompt.tolist()
    table, h = set(), None
    for k in range(cached_pages):
        h = hash((h, tuple(sequence[k * P : (k + 1) * P].tolist())))
        table.add(h)
    most = (prompt_tokens - 1) // P

    def best(f, n=7):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            got = f()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3, got

    ours_array, a = best(lambda: cache.match(prompt).tokens)
    ours_list, b = best(lambda: cache.match(as_list).tokens)
    miss, _ = best(lambda: cache.match(np.concatenate([[7], prompt[1:]])).tokens)
    base, c = best(lambda: chained_hash_match(table, as_list, most))
    assert a == b == c == most * P
    return {"cached_pages": cached_pages, "prompt_tokens": prompt_tokens,
            "matched_tokens": a, "match_ms_array": round(ours_array, 3),
            "match_ms_list": round(ours_list, 3), "first_page_misses_ms": round(miss, 3),
            "chained_hash_ms": round(base, 3)}


# -- SmolLM2 end to end -------------------------------------------------------------------------
QUESTIONS = [
    ["What is the capital of France?", "And its population?", "Name a famous museum there.",
     "Thank you."],
    ["Name a prime number.", "Another one?", "Which is larger?", "Thanks."],
    ["Write a haiku about the sea.", "Now one about the sky.", "Which do you prefer?",
     "Why?"],
    ["What is 12 times 12?", "And 13 times 13?", "What is their sum?", "Thanks!"],
]


def end_to_end(full):
    from cacheidx.models import gguf
    from cacheidx.serve import LlamaModel

    conversations, turns, new = (64, 4, 32) if full else (4, 3, 16)
    t0 = time.perf_counter()
    config, params = gguf.load_smollm2()
    say(f"loaded SmolLM2 in {time.perf_counter() - t0:.1f}s")
    model = LlamaModel(config, params)
    rows, runs = [], {}
    for label, cache, kv in (("cacheidx numpy, cache", True, None),
                             ("cacheidx numpy, no cache", False, None),
                             ("cacheidx numpy, cache, int8 pools", True, "int8")):
        engine = Engine(model, pages=1024, page_size=P, lanes=8, cache=cache, kv=kv)
        talks = {c: [{"role": "user", "content": QUESTIONS[c % 4][0] + f" ({c})"
                      if c >= 4 else QUESTIONS[c % 4][0]}] for c in range(conversations)}

        def follow(result, engine=engine, talks=talks):
            c, t = result.id
            if t + 1 < turns:
                answer = gguf.decode([x for x in result.tokens if x != 2]).strip()
                talks[c] += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": QUESTIONS[c % 4][t + 1]}]
                engine.submit(Request((c, t + 1), gguf.conversation_ids(talks[c]), new,
                                      stop={2}))

        first = [Request((c, 0), gguf.conversation_ids(talks[c]), new, stop={2})
                 for c in range(conversations)]
        results = engine.run(first, on_finish=follow)
        f = engine.figures()
        runs[label] = results
        say(f"{label}: {f['generated_tokens']} tokens in {f['seconds']:.1f}s, "
            f"{f['computed_tokens']} of {f['prompt_tokens']} prompt tokens computed")
        rows.append({"engine": label, "requests": len(results), "seconds": f["seconds"],
                     "generated": f["generated_tokens"], "computed": f["computed_tokens"],
                     "prompt_tokens": f["prompt_tokens"], "cached": f["cached_tokens"],
                     "tokens_per_s": f["tokens_per_second"]})
        if kv is not None:  # quantized pools: how many answers equal float32 pools' answers
            base = {r.id: r.tokens for r in runs["cacheidx numpy, cache"]}
            rows[-1]["same_answers_as_float32"] = sum(base.get(r.id) == r.tokens
                                                      for r in results)
    # transformers, each request of the cached run's trace alone, from scratch
    import torch

    hf = gguf.transformers_model()
    trace = sorted(runs["cacheidx numpy, cache"], key=lambda r: r.ticket)
    t0 = time.perf_counter()
    same = generated = 0
    with torch.no_grad():
        for r in trace:
            out = hf.generate(torch.tensor([r.prompt_ids]), max_new_tokens=new, do_sample=False,
                              attention_mask=torch.ones(1, len(r.prompt_ids), dtype=torch.long),
                              eos_token_id=2, pad_token_id=2)
            tokens = out[0, len(r.prompt_ids):].tolist()
            generated += len(tokens)
            same += tokens == r.tokens
    seconds = time.perf_counter() - t0
    say(f"transformers: {generated} tokens in {seconds:.1f}s; {same} of {len(trace)} answers "
        f"equal cacheidx's")
    rows.append({"engine": "transformers generate, each from scratch", "requests": len(trace),
                 "seconds": round(seconds, 3), "generated": generated,
                 "computed": sum(len(r.prompt_ids) for r in trace),
                 "prompt_tokens": sum(len(r.prompt_ids) for r in trace),
                 "tokens_per_s": round(generated / seconds, 1), "same_answers": same})
    return rows, conversations, turns, new


def agents_end_to_end(count=8, system=2048, new=32, rounds=3):
    """SmolLM2 on the engine's eager torch backend (the prefix cache on, 8 lanes) over
    ``count`` agents' first steps under one ``system``-token prompt, ``new`` tokens each, with
    shared reads and without (``runs.unshared()``): one round to warm up, then ``rounds`` of
    each alternating (off on on off ...), so that a slow spell of the machine hits both. Each
    mode's row: its median round, the fastest and slowest, and how many answers equal the
    other mode's."""
    import statistics

    from cacheidx.attention import runs
    from cacheidx.models import gguf
    from cacheidx.serve import LlamaModel

    config, params = gguf.load_smollm2()
    model = LlamaModel(config, params)
    first, _, _, _ = agents(np.random.default_rng(1), count, 1, system)

    def serve(shared):
        engine = Engine(model, backend="torch", pages=1024, page_size=P, lanes=8)
        with contextlib.nullcontext() if shared else runs.unshared():
            results = engine.run([Request(a, p, new) for a, p in enumerate(first)])
        assert all(r.error is None for r in results), [r.error for r in results if r.error]
        f = engine.figures()
        say(f"agents, shared reads {'on' if shared else 'off'}: {f['generated_tokens']} tokens "
            f"in {f['seconds']:.1f}s (decode {f['decode_tokens_per_second']} tokens/s), "
            f"{f['computed_tokens']} of {f['prompt_tokens']} prompt tokens computed")
        return f, {r.id: r.tokens for r in results}

    serve(True)  # to warm up: the first round in a process is the slowest, whichever it is
    got, answers = {True: [], False: []}, {}
    order = [False, True] * rounds
    order = order[:2] + order[2:][::-1]  # off on on off ...
    for shared in order:
        f, answers[shared] = serve(shared)
        got[shared].append(f)
    rows = []
    for shared in (True, False):
        fs = got[shared]
        rate = [f["tokens_per_second"] for f in fs]
        decode = [f["decode_tokens_per_second"] for f in fs]
        rows.append({"shared_reads": shared, "requests": count, "rounds": len(fs),
                     "seconds": statistics.median(f["seconds"] for f in fs),
                     "generated": fs[0]["generated_tokens"],
                     "computed": fs[0]["computed_tokens"],
                     "prompt_tokens": fs[0]["prompt_tokens"],
                     "prefill_seconds": statistics.median(f["prefill_seconds"] for f in fs),
                     "decode_seconds": statistics.median(f["decode_seconds"] for f in fs),
                     "tokens_per_s": statistics.median(rate), "fastest_tokens_per_s": max(rate),
                     "slowest_tokens_per_s": min(rate),
                     "decode_tokens_per_s": statistics.median(decode),
                     "decode_fastest_tokens_per_s": max(decode),
                     "decode_slowest_tokens_per_s": min(decode),
                     "same_answers": sum(answers[True][i] == answers[False][i]
                                         for i in answers[True])})
    return rows, count, system, new


def agents_table(rows, count, system, new) -> None:
    off = next(r for r in rows if not r["shared_reads"])
    print(f"\nAgents end to end: SmolLM2-135M-Instruct through the engine on its eager torch "
          f"backend, {count} agents under one {system:,}-token system prompt (the agents "
          f"workload's first steps), {new} new tokens each, 8 lanes, the prefix cache on, one "
          f"thread; shared reads on (lanes sharing the prompt's pages read them once) and off "
          f"(`runs.unshared()`): the median of {off['rounds']} rounds each, alternating after "
          "one to warm up, with the fastest and slowest round; decode is the engine's decode "
          "calls alone.\n")
    print("| shared reads | requests | prompt tokens computed | generated | seconds (prefill, "
          "decode) | tokens/s (fastest-slowest) | vs off | decode tokens/s (fastest-slowest) "
          "| vs off | same answers |")
    print("|---|---:|---:|---:|---|---|---:|---|---:|---:|")
    for r in rows:
        print(f"| {'on' if r['shared_reads'] else 'off'} | {r['requests']} | "
              f"{r['computed']:,} of {r['prompt_tokens']:,} | {r['generated']} | "
              f"{r['seconds']:.1f} ({r['prefill_seconds']:.1f}, {r['decode_seconds']:.1f}) | "
              f"{r['tokens_per_s']:.1f} ({r['fastest_tokens_per_s']:.1f}-"
              f"{r['slowest_tokens_per_s']:.1f}) | "
              f"{r['tokens_per_s'] / off['tokens_per_s']:.2f}x | "
              f"{r['decode_tokens_per_s']:.1f} ({r['decode_fastest_tokens_per_s']:.1f}-"
              f"{r['decode_slowest_tokens_per_s']:.1f}) | "
              f"{r['decode_tokens_per_s'] / off['decode_tokens_per_s']:.2f}x | "
              f"{r['same_answers']} of {r['requests']} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true", help="small workloads, no model")
    p.add_argument("--full", action="store_true",
                   help="SmolLM2 on 64 conversations x 4 turns (default 4 x 3)")
    p.add_argument("--no-model", action="store_true", help="leave SmolLM2 out")
    p.add_argument("--only-agents", action="store_true",
                   help="only SmolLM2's agents end to end, shared reads on and off")
    args = p.parse_args(argv)
    if args.only_agents:
        out = {"agents_end_to_end": agents_table_run()}
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0
    rng = np.random.default_rng(0)
    out = {}
    loads = ([("chat", chat(rng, 8, 3, 512)), ("agents", agents(rng, 6, 3, 1024))]
             if args.quick else [("chat", chat(rng)), ("agents", agents(rng))])
    rows, about = [], {}
    for name, w in loads:
        r, need, n = workload_rows(name, w)
        rows += r
        about[name] = (need, n)
    out["workloads"] = rows
    print("Prompt tokens computed (page size 16, 16 requests at once, chunks of 256). The "
          "chat workload: 64 conversations x 4 turns sharing a 512-token system prompt, user "
          "turns of 16 to 256 tokens, answers of 16 to 192; agents: 32 agents x 4 steps "
          "sharing a 2,048-token prompt, tool results of 64 to 512 tokens, answers of 16 to 96."
          + (" (--quick: smaller.)" if args.quick else "") + "\n")
    print("| workload | run | pages | prompt tokens | computed | hit rate | vs ideal |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        ideal = next(x["computed"] for x in rows if x["workload"] == r["workload"]
                     and x["run"].startswith("ideal"))
        print(f"| {r['workload']} | {r['run']} | {r['pages'] or '-'} | {r['prompt_tokens']:,} "
              f"| {r['computed']:,} | {r['hit_rate']:.1%} | {r['computed'] / ideal:.3f} |")
    print()
    for name in about:
        by = {r["run"]: r["computed"] for r in rows if r["workload"] == name}
        full, ideal = by["engine, 100% of the pages"], by["ideal (unbounded, one at a time)"]
        half, lru = by["engine, 50% of the pages"], by["offline LRU, 50% of the pages"]
        print(f"- {name} ({about[name][1]} requests, an unbounded pool used {about[name][0]} "
              f"pages): at 100% of the pages the engine computes {full / ideal:.3f}x the ideal "
              f"(goal 1); at 50%, {half / lru:.3f}x the offline LRU simulation (goal within "
              f"10%).")
    m = matching(rng, args.quick)
    out["matching"] = m
    print(f"\nMatching a prompt of {m['prompt_tokens']:,} tokens against {m['cached_pages']:,} "
          f"cached pages (all of its {m['matched_tokens']:,} cappable tokens cached), best of "
          f"7:\n")
    print("| lookup | ms | vs hand-written |")
    print("|---|---:|---:|")
    for label, key in (("PrefixCache.match, NumPy prompt", "match_ms_array"),
                       ("PrefixCache.match, list prompt", "match_ms_list"),
                       ("PrefixCache.match, first page differs", "first_page_misses_ms"),
                       ("hand-written chained page hashes (vLLM-style), list", "chained_hash_ms")):
        print(f"| {label} | {m[key]:.3f} | {m[key] / m['chained_hash_ms']:.2f}x |")
    if not (args.quick or args.no_model):
        try:
            e2e, conversations, turns, new = end_to_end(args.full)
        except Exception as e:  # the model is an extra: say why it is missing
            say(f"SmolLM2 not measured: {type(e).__name__}: {e}")
            e2e = None
        if e2e:
            out["end_to_end"] = e2e
            base = e2e[-1]["tokens_per_s"]
            print(f"\nSmolLM2-135M-Instruct on this CPU, {conversations} conversations x "
                  f"{turns} turns (each next turn sent back with the model's answer), up to "
                  f"{new} new tokens a turn, one thread:\n")
            print("| engine | requests | prompt tokens computed | generated | seconds | "
                  "tokens/s | vs transformers |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for r in e2e:
                print(f"| {r['engine']} | {r['requests']} | {r['computed']:,} of "
                      f"{r['prompt_tokens']:,} | {r['generated']} | {r['seconds']:.1f} | "
                      f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x |")
            print(f"\ntransformers' greedy answers equal cacheidx's for {e2e[-1]['same_answers']} "
                  f"of {e2e[-1]['requests']} requests.")
            for r in e2e:
                if "same_answers_as_float32" in r:
                    print(f"Over int8 pools: {r['same_answers_as_float32']} of {r['requests']} "
                          f"answers equal float32 pools'; prompt tokens read from the cache "
                          f"{r['cached']:,} of {r['prompt_tokens']:,} "
                          f"({100 * r['cached'] / max(1, r['prompt_tokens']):.0f}%).")
        out["agents_end_to_end"] = agents_table_run()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def agents_table_run() -> list | None:
    """The agents end to end, printed; its rows (None where SmolLM2 is missing, said so)."""
    try:
        rows, count, system, new = agents_end_to_end()
    except Exception as e:  # the model is an extra: say why it is missing
        say(f"SmolLM2 agents not measured: {type(e).__name__}: {e}")
        return None
    agents_table(rows, count, system, new)
    return rows


if __name__ == "__main__":
    sys.exit(main())
