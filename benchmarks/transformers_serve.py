"""SmolLM2 through transformers' own modeling code served by the cacheidx engine, beside
transformers' `generate` (static cache) and its continuous batching (paged, prefix sharing),
on the multi-turn chat workload of `serve.py`: tokens per second and prompt tokens computed.

The workload is ``serve.py``'s end-to-end chat (``QUESTIONS``: each conversation's next turn
is sent once its answer is back). A first run of the engine fixes the trace (every turn's
prompt, with the model's own answers in it); every engine then serves that trace, closed
loop where it can (a turn submitted when the previous turn of its conversation finishes), on
one thread, eagerly:

- cacheidx's ``Engine`` over ``cacheidx.integrations.transformers.model(SmolLM2)``: the
  transformers Llama attending through ``index.attend`` (paged pools, prefix cache on and off);
- cacheidx's own Llama (``cacheidx.models.llama``, NumPy as in ``serve.py``) under the same
  engine, for context;
- transformers' ``generate`` with ``cache_implementation="static"``, each request alone, in
  the trace's order (its default attention, sdpa);
- transformers' continuous batching (``ContinuousBatchingManager``: paged attention cache,
  pages of 16, block sharing for prefixes), closed loop.

Each is run once to warm up, then ``--repeats`` rounds, each running every engine in turn (a
neighbour's load falls on all of them); the table gives the best, median and worst tokens/s
(the spread), the prompt tokens computed (transformers' continuous batching:
the prompt tokens less the prefix its cache matched) and how many answers equal the trace's
(in every round).

    python benchmarks/transformers_serve.py [--json PATH] [--quick] [--conversations N]
                                            [--turns T] [--new N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")  # a shared machine's spinning pools measure the neighbours
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from serve import QUESTIONS  # noqa: E402

EOS = 2  # SmolLM2's <|im_end|>
P = 16  # tokens a page


def say(msg: str) -> None:
    # indented: run_all.py keeps only the unindented lines (the tables) for the page
    print(f"    {msg}", flush=True)


def first_turns(conversations: int) -> dict:
    return {c: [{"role": "user", "content": QUESTIONS[c % 4][0] + (f" ({c})" if c >= 4 else "")}]
            for c in range(conversations)}


def make_trace(model, gguf, conversations, turns, new):
    """The engine, closed loop, each next turn its conversation with the model's answer and
    the next question: ``{(c, t): (prompt ids, answer ids)}``."""
    from cacheidx.serve import Engine, Request

    engine = Engine(model, backend="torch", pages=1024, page_size=P, lanes=8)
    talks = first_turns(conversations)

    def follow(result):
        c, t = result.id
        if t + 1 < turns:
            answer = gguf.decode([x for x in result.tokens if x != EOS]).strip()
            talks[c] += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": QUESTIONS[c % 4][t + 1]}]
            engine.submit(Request((c, t + 1), gguf.conversation_ids(talks[c]), new,
                                  stop={EOS}))

    results = engine.run([Request((c, 0), gguf.conversation_ids(talks[c]), new, stop={EOS})
                          for c in range(conversations)], on_finish=follow)
    return {r.id: (list(r.prompt_ids), list(r.tokens)) for r in results}


def engine_run(model, trace, turns, new, cache, backend="torch"):
    """cacheidx's engine over the trace, closed loop: ``(seconds, answers, computed)``."""
    from cacheidx.serve import Engine, Request

    engine = Engine(model, backend=backend, pages=1024, page_size=P, lanes=8, cache=cache)
    conversations = sorted({c for c, _ in trace})

    def follow(result):
        c, t = result.id
        if t + 1 < turns:
            engine.submit(Request((c, t + 1), trace[c, t + 1][0], new, stop={EOS}))

    t0 = time.perf_counter()
    results = engine.run([Request((c, 0), trace[c, 0][0], new, stop={EOS})
                          for c in conversations], on_finish=follow)
    seconds = time.perf_counter() - t0
    return seconds, {r.id: list(r.tokens) for r in results}, \
        engine.figures()["computed_tokens"]


def static_run(hf, trace, new):
    """transformers' generate with a static cache, each request alone."""
    import torch

    answers = {}
    t0 = time.perf_counter()
    with torch.no_grad():
        for key in sorted(trace, key=lambda k: (k[1], k[0])):
            ids = trace[key][0]
            out = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                              cache_implementation="static", eos_token_id=EOS,
                              pad_token_id=EOS,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            answers[key] = out[0, len(ids):].tolist()
    seconds = time.perf_counter() - t0
    return seconds, answers, sum(len(p) for p, _ in trace.values())


def batching_run(hf, trace, turns, new):
    """transformers' continuous batching, closed loop: a turn is added when the previous turn
    of its conversation comes back. The prompt tokens its prefix sharing matched are counted
    where its cache reports them (``PagedAttentionCache.search_prefix_match``)."""
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    matched = []
    search = PagedAttentionCache.search_prefix_match

    def counting(self, request_id, prompt_ids):
        n = search(self, request_id, prompt_ids)
        matched.append(n)
        return n

    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=EOS,
                              pad_token_id=EOS)
    longest = max(len(p) for p, _ in trace.values()) + new
    batching = ContinuousBatchingConfig(page_size=P, num_blocks=1024 // P * 16,
                                        max_batch_tokens=max(256, longest),
                                        allow_block_sharing=True)
    conversations = sorted({c for c, _ in trace})
    answers = {}
    PagedAttentionCache.search_prefix_match = counting
    try:
        t0 = time.perf_counter()
        with torch.no_grad(), hf.continuous_batching_context_manager(
                generation_config=config, continuous_batching_config=batching, block=True,
                timeout=60, warmup=False) as manager:
            names = {}
            for c in conversations:
                names[manager.add_request(trace[c, 0][0], request_id=f"{c}-0",
                                          max_new_tokens=new)] = (c, 0)
            while len(answers) < len(trace):
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError("transformers' continuous batching returned nothing "
                                       "for 60 s")
                if not result.is_finished():
                    continue
                c, t = names[result.request_id]
                answers[c, t] = list(result.generated_tokens)
                if t + 1 < turns:
                    names[manager.add_request(trace[c, t + 1][0], request_id=f"{c}-{t + 1}",
                                              max_new_tokens=new)] = (c, t + 1)
        seconds = time.perf_counter() - t0
    finally:
        PagedAttentionCache.search_prefix_match = search
    return seconds, answers, sum(len(p) for p, _ in trace.values()) - sum(matched)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true", help="2 conversations x 2 turns, 1 repeat")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new", type=int, default=16, help="most new tokens a turn")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.new, args.repeats = 2, 2, 8, 1
    import torch

    torch.set_num_threads(1)
    import transformers

    from cacheidx.integrations import transformers as cit
    from cacheidx.models import gguf
    from cacheidx.serve import LlamaModel

    t0 = time.perf_counter()
    hf = gguf.transformers_model()
    config, params = gguf.load_smollm2()
    say(f"loaded SmolLM2 in {time.perf_counter() - t0:.1f}s")
    own = cit.model(hf)  # (restored before transformers' own runs)
    trace = make_trace(own, gguf, args.conversations, args.turns, args.new)
    native = LlamaModel(config, params)
    runs = [("cacheidx engine, transformers modeling code, prefix cache",
             lambda: engine_run(own, trace, args.turns, args.new, True), own),
            ("cacheidx engine, transformers modeling code, no cache",
             lambda: engine_run(own, trace, args.turns, args.new, False), own),
            ("cacheidx engine, cacheidx's own Llama (NumPy, as serve.py), prefix cache",
             lambda: engine_run(native, trace, args.turns, args.new, True, "numpy"), None),
            ("transformers generate, static cache, each request alone",
             lambda: static_run(hf, trace, args.new), None),
            ("transformers continuous batching (paged, prefix sharing)",
             lambda: batching_run(hf, trace, args.turns, args.new), None)]
    prompt_tokens = sum(len(p) for p, _ in trace.values())

    def measure(label, fn, wrapped):
        if wrapped is None:
            own.restore()  # transformers' own attention (sdpa) for its own runs
        else:
            hf.set_attn_implementation(cit.NAME)
        seconds, answers, computed = fn()
        generated = sum(len(a) for a in answers.values())
        same = sum(answers.get(key) == tokens for key, (_, tokens) in trace.items())
        say(f"{label}: {generated} tokens in {seconds:.2f}s ({generated / seconds:.1f}/s), "
            f"{computed} of {prompt_tokens} prompt tokens computed")
        return generated / seconds, generated, computed, same

    for label, fn, wrapped in runs:  # first calls, allocations: not counted
        measure(f"warming up: {label}", fn, wrapped)
    seen = {label: [] for label, _, _ in runs}
    for k in range(args.repeats):  # interleaved: a neighbour's load falls on every engine
        for label, fn, wrapped in runs:
            seen[label].append(measure(f"round {k + 1}: {label}", fn, wrapped))
    rows = []
    for label, _, _ in runs:
        rates = [m[0] for m in seen[label]]
        _, generated, computed, same = seen[label][-1]
        rows.append({"engine": label, "requests": len(trace), "generated": generated,
                     "prompt_tokens": prompt_tokens, "computed": computed,
                     "best_tokens_per_s": round(max(rates), 2),
                     "median_tokens_per_s": round(statistics.median(rates), 2),
                     "worst_tokens_per_s": round(min(rates), 2),
                     "same_answers": min(m[3] for m in seen[label])})
    own.restore()
    base = next(r for r in rows if r["engine"].startswith("transformers generate"))
    print(f"SmolLM2-135M-Instruct (float32) on this CPU, one thread, eager: {args.conversations}"
          f" conversations x {args.turns} turns of `serve.py`'s chat (each next turn sent back "
          f"with the model's answer), up to {args.new} new tokens a turn, {len(trace)} "
          f"requests; best, median and worst of {args.repeats} interleaved rounds after one "
          f"to warm up; transformers {transformers.__version__}, torch {torch.__version__}.\n")
    print("| engine | prompt tokens computed | generated | tokens/s best | median | worst | "
          "best vs generate (static) | answers equal the trace's |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['engine']} | {r['computed']:,} of {r['prompt_tokens']:,} | "
              f"{r['generated']} | {r['best_tokens_per_s']:.1f} | {r['median_tokens_per_s']:.1f}"
              f" | {r['worst_tokens_per_s']:.1f} | "
              f"{r['best_tokens_per_s'] / base['best_tokens_per_s']:.2f}x | "
              f"{r['same_answers']} of {r['requests']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "conversations":
                                               args.conversations, "turns": args.turns,
                                               "new": args.new, "repeats": args.repeats},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
