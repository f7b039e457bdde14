"""Hybrid models on a multi-turn chat: prompt tokens computed with snapshots every m
positions beside an attention-only model, no reuse, and a block-aligned policy like vLLM's.

The token figures come from ``cacheidx.serve.Engine`` itself (its scheduler, prefix cache and
snapshot group, ``cacheidx.prefix.states``) with a scripted executor in place of the model, on
the chat workload of ``serve.py`` (64 conversations under one 512-token system prompt, four
turns each, each turn the last one's prompt, its answer and a new message). The hybrid's
hits end at a block's end whose snapshot is cached; the attention-only model's at any whole
page; the block-aligned policy (vLLM's ``--mamba-cache-mode align`` with the attention block
raised to the state's 528 tokens) keeps one checkpoint per request, at the last multiple of
528 before its prompt ends, and a request resumes from the longest checkpoint its prompt
starts with (an unbounded store: its best case). ``m`` for real models is the engine's rule
(``state_every``: the fewest pages whose keys and values weigh one snapshot), from their
configs' sizes in bfloat16.

    python benchmarks/hybrid.py [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from serve import P, Scripted, chat  # noqa: E402

from cacheidx.serve import Engine, Request  # noqa: E402
from cacheidx.serve.engine import state_every  # noqa: E402

ALIGN = 528  # vLLM's block for Qwen3.5-4B's state in align mode


class ScriptedStates(Scripted):
    """The scripted executor for an engine with snapshots: it is given the table of blocks."""

    def run(self, batch, table, version, blocks=None):
        return super().run(batch, table, version)


def served(workload, pages, every=None, cache=True):
    """The engine's figures over the closed-loop workload (snapshots every ``every``)."""
    first, messages, answers, turns = workload
    executor = ScriptedStates(answers) if every else Scripted(answers)
    engine = Engine(executor=executor, pages=pages, page_size=P, lanes=16, chunk=256,
                    cache=cache, clock="steps", state_every=every)

    def follow(result):
        c, t = result.id
        if t + 1 < turns:
            engine.submit(Request((c, t + 1), result.prompt_ids + result.tokens
                                  + messages[c, t + 1], len(answers[c, t + 1])))

    results = engine.run([Request((c, 0), p, len(answers[c, 0])) for c, p in enumerate(first)],
                         on_finish=follow)
    assert all(r.error is None and r.tokens == answers[r.id] for r in results)
    engine.cache.check()
    order = sorted(results, key=lambda r: (r.admitted, r.ticket))
    return engine.figures(), [r.prompt_ids for r in order]


def block_aligned(prompts, block=ALIGN):
    """Prompt tokens computed by one checkpoint per request at its last block of ``block``
    before its prompt ends, replayed in admission order (unbounded)."""
    kept: set[bytes] = set()
    computed = 0
    for p in prompts:
        data = np.asarray(p, np.int64).tobytes()
        hit = 0
        for c in range((len(p) - 1) // block * block, 0, -block):
            if data[: 8 * c] in kept:
                hit = c
                break
        computed += len(p) - hit
        last = (len(p) - 1) // block * block
        if last:
            kept.add(data[: 8 * last])
    return computed


#: (name, attention layers, kv heads, head dim, recurrent layers, state bytes a layer) in bf16
MODELS = [
    # Qwen3.5-4B-like: 8 gated-attention layers (4 kv heads of 256), 24 Gated DeltaNet layers
    # of 32 value heads of 128 by 16 key heads of 128 (state 32 x 128 x 128, conv 4 x 8192)
    ("Qwen3.5-4B", 8, 4, 256, 24, 2 * (32 * 128 * 128 + 3 * 8192)),
    # Granite-4.0-H-Small-like: 4 attention layers (8 kv heads of 128), 36 Mamba 2 layers of
    # 128 heads of 64 by a state of 128 (state 128 x 64 x 128, conv 3 x 10240)
    ("Granite-4.0-H", 4, 8, 128, 36, 2 * (128 * 64 * 128 + 3 * 10240)),
    # LFM2-1.2B-like: 6 attention layers (8 kv heads of 64), 10 short convolutions of 3 x 2048
    ("LFM2-1.2B", 6, 8, 64, 10, 2 * 3 * 2048),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true", help="8 conversations of 3 turns")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    workload = chat(rng, *((8, 3) if args.quick else (64, 4)))
    pages = 1 << 14
    attention, prompts = served(workload, pages)
    none, _ = served(workload, pages, cache=False)
    requests = len(prompts)
    aligned = block_aligned(prompts)
    rows = [{"policy": "no reuse", "m": None, "computed": none["computed_tokens"]},
            {"policy": "attention only (pages of 16)", "m": None,
             "computed": attention["computed_tokens"]},
            {"policy": f"block-aligned, one checkpoint a request ({ALIGN})", "m": ALIGN,
             "computed": aligned}]
    for m in (16, 64, 256, 512):
        f, _ = served(workload, pages, every=m)
        rows.append({"policy": f"hybrid, snapshots every {m}", "m": m,
                     "computed": f["computed_tokens"],
                     "over_attention_per_request": round((f["computed_tokens"]
                                                          - attention["computed_tokens"])
                                                         / requests, 1)})
    print(f"{requests} requests, {none['prompt_tokens']} prompt tokens\n")
    print("| policy | prompt tokens computed | vs attention only, a request | vs block-aligned |")
    print("|---|---|---|---|")
    for r in rows:
        extra = r.get("over_attention_per_request")
        print(f"| {r['policy']} | {r['computed']} | {'' if extra is None else f'+{extra}'} | "
              f"{r['computed'] / aligned:.2f}x |")
    print("\n| model | snapshot (all recurrent layers) | keys and values a token "
          "| m (pages of 16) |")
    print("|---|---|---|---|")
    ms = []
    for name, att, kv, dim, rec, state in MODELS:
        token = att * 2 * kv * dim * 2
        m = state_every(rec * state, token, P)
        ms.append({"model": name, "snapshot_bytes": rec * state, "token_bytes": token, "m": m})
        print(f"| {name} | {rec * state / 2**20:.1f} MiB | {token / 2**10:.0f} KiB | {m} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "models": ms,
                                               "requests": requests}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
