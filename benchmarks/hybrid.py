"""Hybrid models on a multi-turn chat: prompt tokens computed with snapshots every m
positions beside an attention-only model, no reuse, and a block-aligned policy like vLLM's;
what the snapshots weigh at each m; and decode tokens/s with and without state pools.

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
configs' sizes in bfloat16. The snapshots each ``m`` leaves cached on the chat are weighed
at those models' sizes beside the pages' keys and values.

Decode tokens/s with and without state pools, on one thread (``torch.set_num_threads(1)``,
one OpenMP/BLAS thread, XLA's eigen pool off): 8 lanes of distinct 64-token prompts, 64 new
tokens each, the engine's ``decode_tokens_per_second`` (decode calls that compiled nothing).
Two tiny models of one size (width 256, 4 layers, vocabulary 4,096, random weights, float32):
a Qwen3.5-shaped transformers decoder (3 Gated DeltaNet layers over state pools, then one
attention layer; ``cacheidx.integrations.transformers``) beside the same config with 4
attention layers, each also by transformers' own ``generate`` (its own cache); and the
project's own decoder (``cacheidx.models.llama``, ``layer_types``: 3 Gated DeltaNet layers of
``cacheidx.models.deltanet`` and one attention layer) beside its attention-only twin, on
NumPy and torch. Each row is the median of ``--runs`` runs (interleaved, after one warm-up)
with the slowest and fastest; the machine is shared, so the spread is part of the figure.

    python benchmarks/hybrid.py [--json PATH] [--quick] [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

# one thread for every library, set before NumPy, PyTorch and JAX load (as decode.py does)
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_multi_thread_eigen=false").strip()

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


# -- decode tokens/s with and without state pools ----------------------------------------------
WIDTH, LAYERS, VOCAB = 256, 4, 4096
HYBRID = ("linear_attention",) * 3 + ("attention",)


def hf_model(hybrid: bool):
    """The Qwen3.5-shaped transformers decoder: 3 Gated DeltaNet layers and one attention layer,
    or 4 attention layers (float32, eager attention, random weights, no end token)."""
    import torch
    import transformers as tr

    torch.manual_seed(0)
    kinds = ["linear_attention"] * 3 + ["full_attention"] if hybrid else ["full_attention"] * 4
    config = tr.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
        num_hidden_layers=LAYERS, layer_types=kinds, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    model = tr.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def own_model(hybrid: bool):
    """The project's own decoder of the same size: 3 Gated DeltaNet layers and one attention
    layer, or 4 attention layers."""
    from cacheidx.models import llama
    from cacheidx.serve.model import LlamaModel

    config = llama.Config(vocab=VOCAB, dim=WIDTH, layers=LAYERS, heads=4, kv_heads=2,
                          hidden=2 * WIDTH, layer_types=HYBRID if hybrid else None,
                          linear_key_heads=2, linear_value_heads=4, linear_key_dim=64,
                          linear_value_dim=64)
    return LlamaModel(config, llama.random_params(config, seed=0))


def engine_decode(model, backend, prompts, new, cache=True):
    """The engine's decode tokens/s (decode calls that compiled nothing), and its ``m``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the engine's notes
        engine = Engine(model, backend=backend, page_size=P, lanes=len(prompts), cache=cache,
                        pages=len(prompts) * -(-(len(prompts[0]) + new) // P))
        results = engine.run([Request(k, p, new) for k, p in enumerate(prompts)])
    assert all(r.error is None and len(r.tokens) == new for r in results)
    f = engine.figures()
    return f["decode_tokens_per_second"], f.get("snapshots", {}).get("every")


def hf_generate(model, prompts, new):
    """transformers' own ``generate`` (greedy, its own cache) of the batch: decode tokens/s
    from the time of ``new`` tokens less that of one (the prefill and the first token)."""
    import torch

    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def timed(n):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False)
        return time.perf_counter() - t

    return round(len(prompts) * (new - 1) / (timed(new) - timed(1)), 1), None


def decode(runs: int, new: int, lanes: int = 8, prompt: int = 64) -> list[dict]:
    """The decode rows: each case's median tokens/s over ``runs`` interleaved runs (after a
    warm-up run), its slowest and fastest."""
    import torch
    import transformers

    from cacheidx.integrations import transformers as cit

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, prompt).tolist() for _ in range(lanes)]
    hf = {h: hf_model(h) for h in (True, False)}
    wrapped = {h: cit.model(hf[h]) for h in (True, False)}
    own = {h: own_model(h) for h in (True, False)}
    tiny = "Qwen3.5-shaped (transformers)"
    cases = [
        (tiny, "3 Gated DeltaNet + 1 attention", "cacheidx engine, state pools, cache on",
         lambda: engine_decode(wrapped[True], "torch", prompts, new)),
        (tiny, "3 Gated DeltaNet + 1 attention", "cacheidx engine, state pools, cache off",
         lambda: engine_decode(wrapped[True], "torch", prompts, new, cache=False)),
        (tiny, "3 Gated DeltaNet + 1 attention", "transformers generate (its own cache)",
         lambda: hf_generate(hf[True], prompts, new)),
        (tiny, "4 attention", "cacheidx engine, cache on",
         lambda: engine_decode(wrapped[False], "torch", prompts, new)),
        (tiny, "4 attention", "transformers generate (its own cache)",
         lambda: hf_generate(hf[False], prompts, new)),
    ]
    for backend in ("numpy", "torch"):
        cases += [("cacheidx.models.llama", "3 Gated DeltaNet + 1 attention",
                   f"cacheidx engine on {backend}, state pools, cache on",
                   lambda b=backend: engine_decode(own[True], b, prompts, new)),
                  ("cacheidx.models.llama", "4 attention", f"cacheidx engine on {backend}, "
                   "cache on", lambda b=backend: engine_decode(own[False], b, prompts, new))]
    try:
        for *_, fn in cases:  # warm-up
            fn()
        rates: list[list[float]] = [[] for _ in cases]
        every: list = [None] * len(cases)
        for _ in range(runs):  # interleaved: a slow spell of the machine hits every case
            for k, (*_, fn) in enumerate(cases):
                rate, every[k] = fn()
                rates[k].append(rate)
    finally:
        for w in wrapped.values():
            w.restore()
    return [{"model": m, "layers": layers, "engine": e, "m": every[k],
             "tokens_per_s": round(statistics.median(rates[k]), 1),
             "slowest": min(rates[k]), "fastest": max(rates[k]), "runs": runs}
            for k, (m, layers, e, _) in enumerate(cases)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true",
                   help="8 conversations of 3 turns; 2 decode runs of 16 tokens")
    p.add_argument("--runs", type=int, default=None, help="decode runs a case (default 5)")
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
    per_m = []
    for m in (16, 64, 256, 512):
        f, _ = served(workload, pages, every=m)
        rows.append({"policy": f"hybrid, snapshots every {m}", "m": m,
                     "computed": f["computed_tokens"],
                     "over_attention_per_request": round((f["computed_tokens"]
                                                          - attention["computed_tokens"])
                                                         / requests, 1)})
        per_m.append({"m": m, "reuse": f["computed_tokens"], "no_reuse": none["computed_tokens"],
                      "attention_only": attention["computed_tokens"],
                      "block_aligned": block_aligned(prompts, m),
                      "snapshots_cached": f["snapshots"]["cached"],
                      "pages_cached": f["pages_cached"]})
    print(f"{requests} requests, {none['prompt_tokens']} prompt tokens\n")
    print("| policy | prompt tokens computed | vs attention only, a request | vs block-aligned |")
    print("|---|---|---|---|")
    for r in rows:
        extra = r.get("over_attention_per_request")
        print(f"| {r['policy']} | {r['computed']} | {'' if extra is None else f'+{extra}'} | "
              f"{r['computed'] / aligned:.2f}x |")
    print("\nPer m, the block-aligned policy keeps its one checkpoint a request at the last "
          "multiple of m\n(vLLM's align mode at a block of m):\n")
    print("| m | hybrid, with reuse | block-aligned at m | no reuse | attention only |")
    print("|---|---|---|---|---|")
    for r in per_m:
        print(f"| {r['m']} | {r['reuse']} | {r['block_aligned']} | {r['no_reuse']} | "
              f"{r['attention_only']} |")
    print("\n| model | snapshot (all recurrent layers) | keys and values a token "
          "| m (pages of 16) |")
    print("|---|---|---|---|")
    ms = []
    for name, att, kv, dim, rec, state in MODELS:
        token = att * 2 * kv * dim * 2
        m = state_every(rec * state, token, P)
        ms.append({"model": name, "snapshot_bytes": rec * state, "token_bytes": token, "m": m})
        print(f"| {name} | {rec * state / 2**20:.1f} MiB | {token / 2**10:.0f} KiB | {m} |")
    print("\nWhat the chat leaves cached at each m (its pages and snapshots: junctions and "
          "block ends), weighed at each model's size:\n")
    print("| m | snapshots cached | pages cached | "
          + " | ".join(f"{x['model']}: snapshots / pages' keys and values" for x in ms) + " |")
    print("|---|---|---|" + "---|" * len(ms))
    for r in per_m:
        weighed = []
        for x in ms:
            snaps = r["snapshots_cached"] * x["snapshot_bytes"]
            kv = r["pages_cached"] * P * x["token_bytes"]
            weighed.append(f"{snaps / 2**30:.1f} / {kv / 2**30:.1f} GiB")
        print(f"| {r['m']} | {r['snapshots_cached']} | {r['pages_cached']} | "
              + " | ".join(weighed) + " |")
    runs = args.runs or (2 if args.quick else 5)
    new = 16 if args.quick else 64
    rates = decode(runs, new)
    print(f"\nDecode, 8 lanes of 64-token prompts, {new} new tokens each, one thread: "
          f"tokens/s, the median of {runs} runs (slowest-fastest).\n")
    print("| model | layers | engine | m | decode tokens/s (slowest-fastest) |")
    print("|---|---|---|---|---|")
    for r in rates:
        print(f"| {r['model']} | {r['layers']} | {r['engine']} | {r['m'] or ''} | "
              f"{r['tokens_per_s']} ({r['slowest']}-{r['fastest']}) |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "models": ms, "per_m": per_m,
                                               "requests": requests, "hybrid_decode": rates},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
