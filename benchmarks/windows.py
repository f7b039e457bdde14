"""A sliding-window layer keeps only its window: KV bytes held per sequence at 4k, 32k and 128k
tokens of context for Gemma-2-, Gemma-3- and Ministral-shaped layer mixes, one table and pool
per group of layers against one table for every layer; and the prefix hit rate of the chat
and agents workloads of `serve.py` with sliding models, with and without windowed reuse.

Every figure is the engine's own accounting (``cacheidx.serve.Engine`` with a scripted
executor in place of the model, as ``serve.py`` does): nothing is computed at 128k, the
scheduler and the prefix cache run as they do for a real model, and the pages a group's pool
has in use at the peak of one sequence's life are read from ``Engine.figures()["groups"]``.
Bytes are those pages times the page size times the group's layers times keys and values of
``kv_heads * head_dim`` bfloat16 numbers. The layer mixes, kv heads, head dims and windows are
the public configs' (Gemma-2-9B, Gemma-3-4B, Ministral-8B-Instruct-2410), read into
transformers' config classes and through ``cacheidx.integrations.transformers.layer_windows``.
The figures are counts, not timings: the same on every run (no spread).

    python benchmarks/windows.py [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from cacheidx.serve import Engine, Request  # noqa: E402

P = 16  # tokens a page, as serve.py
CHUNK = 256  # prompt tokens a call computes (the engine's eager default)
NEW = 64  # tokens each sequence generates
CONTEXTS = [4096, 8192, 32768, 131072]  # 8k: Gemma 2's own context, the RFC's 25%
BYTES = 2  # bfloat16


def say(msg: str) -> None:
    # indented: run_all.py keeps only the unindented lines (the tables) for the page
    print(f"    {msg}", flush=True)


def mixes() -> dict:
    """name -> (per-layer windows, kv_heads, head_dim, where the numbers come from)."""
    import transformers as tr

    from cacheidx.integrations.transformers import layer_windows

    gemma2 = tr.Gemma2Config(num_hidden_layers=42, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=256, sliding_window=4096)
    gemma3 = tr.Gemma3TextConfig(num_hidden_layers=34, num_attention_heads=8,
                                 num_key_value_heads=4, head_dim=256, sliding_window=1024)
    ministral = tr.MinistralConfig(num_hidden_layers=36, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128, sliding_window=32768,
                                   layer_types=(["full_attention"] + ["sliding_attention"] * 3)
                                   * 9)
    return {
        "Gemma-2 (9B)": (layer_windows(gemma2), 8, 256, "42 layers alternating window 4096 "
                         "and full"),
        "Gemma-3 (4B)": (layer_windows(gemma3), 4, 256, "34 layers, 5 of window 1024 to 1 "
                         "full"),
        "Ministral (8B)": (layer_windows(ministral), 8, 128, "36 layers, 3 of window 32768 "
                           "to 1 full"),
    }


class Scripted:
    """An executor that computes nothing: each lane's next token is given."""

    def __init__(self, answers: dict):
        self.answers = answers

    def run(self, batch, table, version):
        chosen = [self.answers[lane.request.id][len(lane.result.tokens)] for lane in batch.lanes]
        return np.asarray(chosen), None, False


def held(windows: list, context: int, one_table: bool) -> list[tuple]:
    """(window, layers, pages at peak) of each group, for one sequence of ``context`` tokens
    (prompt and generated) served alone."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 30000, context - NEW + 1).tolist()
    answer = rng.integers(0, 30000, NEW).tolist()
    told = [None] * len(windows) if one_table else windows
    # pools are counts here: as large as the sequence, or as one window and one chunk
    pages = max([-(-context // P)] + [-(-(w + CHUNK) // P) + 1 for w in windows if w])
    engine = Engine(executor=Scripted({"s": answer}), windows=told, pages=pages, page_size=P,
                    lanes=1, chunk=CHUNK, clock="steps")
    (result,) = engine.run([Request("s", prompt, NEW)])
    assert result.error is None and result.tokens == answer
    f = engine.figures()
    groups = f.get("groups") or [{"window": None, "peak_pages_in_use": f["peak_pages_in_use"]}]
    layers = {w: told.count(w) for w in set(told)}
    return [(g["window"], layers[g["window"]], g["peak_pages_in_use"]) for g in groups]


def bytes_of(groups: list[tuple], kv_heads: int, head_dim: int) -> int:
    return sum(pages * P * layers * 2 * kv_heads * head_dim * BYTES
               for _, layers, pages in groups)


def memory(contexts: list[int]) -> list[dict]:
    rows = []
    for name, (windows, kv, dim, about) in mixes().items():
        for context in contexts:
            say(f"{name} at {context} tokens")
            grouped = held(windows, context, one_table=False)
            one = held(windows, context, one_table=True)
            ours, base = bytes_of(grouped, kv, dim), bytes_of(one, kv, dim)
            rows.append({"mix": name, "layers": about, "context": context,
                         "kv_bytes_grouped": ours, "kv_bytes_one_table": base,
                         "saved": 1 - ours / base,
                         "pages": {str(w): p for w, _, p in grouped},
                         "pages_one_table": one[0][2]})
    return rows


def hit_rates(quick: bool) -> list[dict]:
    """The chat and agents workloads of serve.py served by the engine (an unbounded pool) for
    sliding models: one table for every layer, groups with windowed reuse, groups without the
    cache."""
    import serve

    rng = np.random.default_rng(0)
    loads = ([("chat", serve.chat(rng, 8, 3, 512)), ("agents", serve.agents(rng, 6, 3, 1024))]
             if quick else [("chat", serve.chat(rng)), ("agents", serve.agents(rng))])
    models = {"Gemma-3 mix (window 1024, 1 full in 6)": [1024] * 5 + [None],
              "every layer sliding, window 512": [512] * 2}
    rows = []
    for load, (first, messages, answers, turns) in loads:
        for name, windows in models.items():
            for run, told, cache in (("one table for every layer", [None] * len(windows), True),
                                     ("groups, windowed reuse", windows, True),
                                     ("groups, no prefix cache", windows, False)):
                say(f"{load}, {name}: {run}")
                engine = Engine(executor=serve.Scripted(answers), windows=told,
                                pages=1 << 20, page_size=P, lanes=16, chunk=CHUNK, cache=cache,
                                clock="steps")

                def follow(result, engine=engine, messages=messages, answers=answers,
                           turns=turns):
                    c, t = result.id
                    if t + 1 < turns:
                        engine.submit(Request((c, t + 1), result.prompt_ids + result.tokens
                                              + messages[c, t + 1], len(answers[c, t + 1])))

                results = engine.run([Request((c, 0), p, len(answers[c, 0]))
                                      for c, p in enumerate(first)], on_finish=follow)
                assert all(r.error is None and r.tokens == answers[r.id] for r in results)
                f = engine.figures()
                groups = f.get("groups") or [{"window": None, "peak_pages_in_use":
                                              f["peak_pages_in_use"]}]
                # one sliding layer's pool: the sliding group's, or the one table's
                sliding = [g for g in groups if g["window"] is not None] or groups
                rows.append({"workload": load, "model": name, "run": run,
                             "requests": len(results), "prompt_tokens": f["prompt_tokens"],
                             "computed": f["computed_tokens"], "hit_rate": f["hit_rate"],
                             "sliding_peak_pages": sliding[-1]["peak_pages_in_use"]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true", help="4k and 32k only, a smaller chat")
    args = p.parse_args(argv)
    contexts = CONTEXTS[:3] if args.quick else CONTEXTS
    rows = memory(contexts)
    print(f"KV bytes one sequence holds at its peak (bfloat16 keys and values; pages of {P}, "
          f"prefill in chunks of {CHUNK}, {NEW} tokens generated, the context counting "
          "both), per group of layers against one table for every layer. vLLM's RFC #11382 "
          "measured 25% saved for Gemma-2 (at its 8k context) and 56% for Ministral (at "
          "128k).\n")
    print("| layer mix | context | one table (MiB) | groups (MiB) | saved | pages held per "
          "group (window: pages) |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        pages = ", ".join(f"{w}: {n}" for w, n in r["pages"].items())
        print(f"| {r['mix']}: {r['layers']} | {r['context'] // 1024}k | "
              f"{r['kv_bytes_one_table'] / 2**20:,.0f} | {r['kv_bytes_grouped'] / 2**20:,.0f} "
              f"| {r['saved']:.1%} | {pages} |")
    hits = hit_rates(args.quick)
    print("\nThe chat and agents workloads of `serve.py` (chat: conversations sharing a "
          "512-token system prompt, each turn sent back with its answer; agents: a 2,048-token "
          "shared prompt, tool results sent back)" + (" (--quick: smaller)" if args.quick
                                                       else "") + ", an unbounded pool, 16 "
          "requests at once; the most pages of one sliding layer's pool the running "
          "requests held at once.\n")
    print("| workload | model | run | prompt tokens | computed | hit rate | sliding pages held "
          "at peak |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in hits:
        print(f"| {r['workload']} | {r['model']} | {r['run']} | {r['prompt_tokens']:,} | "
              f"{r['computed']:,} | {r['hit_rate']:.1%} | {r['sliding_peak_pages']:,} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"memory": rows, "hits": hits}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
