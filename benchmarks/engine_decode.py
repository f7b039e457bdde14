"""Decode through the serving engine against transformers' static cache: tokens/s of the decode
steps of ``cacheidx.serve.Engine`` (eager torch, the CPU kernel reading its paged pools, the
prefix cache on) beside ``generate`` with ``cache_implementation="static"`` on the same model
and prompts, greedy, one thread (``--threads N``: both sides at N intra-op threads, the
kernel on torch's pool). ``--engine jax-jit``: the engine on JAX compiled instead, each call
one program jitted whole, its decode calls reading the shared prompt once by the index's hint.

Workloads (issue 38's "through the engine"): 32 distinct prompts of 4k tokens (nothing shared),
and 8 and 32 lanes under one 4k-token prompt (the shared prompt, then a few tokens of each
lane's own; one request of the shared prompt alone runs first, so that the prefix cache holds
its pages and every lane's table names them: the lanes read it once), each decoding ``--new``
tokens. The model is ``long_context.py``'s (SmolLM2-135M's shape cut to 2 layers, random
weights, the same on both sides). The engine's rate is its decode tokens over its decode calls'
seconds (``Engine.figures()``: prefill left out); transformers' is the lanes
over the median of its decode steps, each timed inside ``generate`` (the gap between two
calls of a logits processor, made once a token). Both give the same greedy tokens (checked
per row), and under a shared prompt the engine gives them with the prefix cache on and off.
Each workload runs ``--repeat`` times in turn; the table gives the run of median ratio and
every run's ratio beside it (this machine's speed drifts by a fifth within minutes).
The floor is the bytes a decode step must read (the weights, every lane's keys and values, a
shared prompt once: codes, scales and zero points for ``--kv int8`` or ``int4-turned``, the
engine's pools there; transformers' static cache stays float32, so quantized pools may part
the tokens) over the machine's one-thread bandwidth.

    python benchmarks/engine_decode.py [--json PATH] [--workloads distinct shared8 shared32]
                                       [--new N] [--context 4096] [--repeat 3]
                                       [--engine torch|jax-jit] [--threads N]
                                       [--kv float32 int8 int4-turned]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import long_context as lc  # noqa: E402  (sets one thread before numpy and torch load)
import numpy as np  # noqa: E402
import paged_reads as pr  # noqa: E402

WORKLOADS = {"distinct": (32, False), "shared8": (8, True), "shared32": (32, True)}
OWN = 8  # a lane's own tokens after a shared prompt
PAGE = 16


def say(msg: str) -> None:
    print(f"    {msg}", flush=True)


def prompts(config, lanes: int, context: int, shared: bool, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if not shared:
        return [rng.integers(1, config.vocab, context).tolist() for _ in range(lanes)]
    common = rng.integers(1, config.vocab, context).tolist()
    return [common + rng.integers(1, config.vocab, OWN).tolist() for _ in range(lanes)]


#: the engines measured: eager torch (the CPU kernel), or JAX compiled (each call one program
#: jitted whole, a decode call's index with its hint of the shared prefix: step law 10)
ENGINES = {"torch": ("torch", False), "jax-jit": ("jax", True)}


def engine_rate(config, params, asked: list[list[int]], new: int, shared: bool, cache: bool,
                engine_name: str = "torch", kv: str = "float32"):
    """The engine's decode tokens/s over ``asked`` and each prompt's tokens."""
    from cacheidx.serve import Engine, LlamaModel, Request

    lanes = len(asked)
    pages = lanes * (-(-(len(asked[0]) + new) // PAGE)) + 64
    backend, compiled = ENGINES[engine_name]
    engine = Engine(LlamaModel(config, params), backend=backend, pages=pages, page_size=PAGE,
                    lanes=lanes, cache=cache, compile=compiled,
                    kv=None if kv == "float32" else kv)
    if shared:  # the shared prompt alone first: its pages then lie in the prefix cache
        engine.run([Request("shared", asked[0][:-OWN], 1)])
        before = engine.figures()
    else:
        before = {"decode_seconds": 0.0, "generated_tokens": 0, "decode_calls": 0}
    results = engine.run([Request(i, p, new) for i, p in enumerate(asked)])
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    f = engine.figures()
    return f, [r.tokens for r in sorted(results, key=lambda r: r.id)], before


def hf_rate(model, asked: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """transformers' decode tokens/s under its static cache (``generate``; each step's time is
    the gap between two calls of a logits processor, which ``generate`` makes once a token:
    the median of the steps after its prefill), and its greedy tokens."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor(asked)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0,
                             cache_implementation="static",
                             logits_processor=LogitsProcessorList([Stamp()]))
    steps = np.diff(stamps)[1:]  # the first gap holds the static cache's first decode call
    return len(asked) / float(np.median(steps)), out[:, ids.shape[1]:].tolist()


def row_for(name, model, config, params, bw, context, new, engine_name="torch",
            kv="float32") -> dict:
    lanes, shared = WORKLOADS[name]
    asked = prompts(config, lanes, context, shared)
    t0 = time.perf_counter()
    f, tokens, before = engine_rate(config, params, asked, new, shared, cache=True,
                                    engine_name=engine_name, kv=kv)
    decode_s = f["decode_seconds"] - before["decode_seconds"]
    decoded = f["generated_tokens"] - before["generated_tokens"] - lanes  # the first is prefill's
    calls = f["decode_calls"] - before["decode_calls"]
    rate = f["decode_tokens_per_second"]
    same_off = off_rate = None
    if shared:
        f_off, off, _ = engine_rate(config, params, asked, new, shared, cache=False,
                                    engine_name=engine_name, kv=kv)
        same_off, off_rate = off == tokens, f_off["decode_tokens_per_second"]
    hf, hf_tokens = hf_rate(model, asked, new)
    per_lane = context + (OWN if shared else 0)
    token = pr.row_bytes(config, kv)  # a token's keys and values over every layer
    read = token * (per_lane + lanes * OWN if shared else lanes * per_lane)
    floor = (lc.weight_bytes(params) + read) / bw
    row = {"workload": name, "engine": engine_name, "kv": kv, "lanes": lanes, "context": context,
           "shared": shared, "new": new,
           "engine_tokens_per_s": rate, "decode_calls": calls, "decode_seconds": decode_s,
           "decoded": decoded, "hf_tokens_per_s": hf, "vs_static": rate / hf,
           "floor_ms": 1e3 * floor, "step_ms": 1e3 * lanes / rate,
           "same_tokens": tokens == hf_tokens, "same_without_cache": same_off,
           "without_cache_tokens_per_s": off_rate,
           "wall_s": time.perf_counter() - t0}
    say(f"{name}: engine {rate:.1f} tokens/s, transformers static {hf:.1f} "
        f"({rate / hf:.2f}x); step {row['step_ms']:.1f} ms, floor {row['floor_ms']:.1f} ms; "
        f"same tokens {row['same_tokens']}, without the cache {same_off}")
    return row


def repeated(runs: list[dict]) -> dict:
    """The run of median ratio among ``runs`` of one workload, with every run's ratio (the
    spread: this machine's speed drifts by a fifth within minutes, and each run times both
    sides within a minute of each other)."""
    ranked = sorted(runs, key=lambda r: r["vs_static"])
    row = dict(ranked[(len(ranked) - 1) // 2])
    row["runs"] = [r["vs_static"] for r in runs]
    row["same_tokens"] = all(r["same_tokens"] for r in runs)
    if row["same_without_cache"] is not None:
        row["same_without_cache"] = all(r["same_without_cache"] for r in runs)
    return row


def report(rows: list[dict], bw: float, threads: int = 1) -> None:
    what = ("eager torch, the CPU kernel" if rows[0].get("engine", "torch") == "torch" else
            "JAX compiled, each call one program, decode reading the hint's prefix once")
    print(f"\nDecode through cacheidx.serve.Engine ({what}, the prefix cache "
          f"on) against transformers' static cache (generate), SmolLM2-135M's shape cut to 2 "
          f"layers, greedy, {'one thread' if threads == 1 else f'{threads} threads'}; the "
          f"floor reads the weights and the keys and values a "
          f"step needs ({bw / 1e9:.1f} GB/s).\n")
    print("| workload | pools | lanes | context | engine tokens/s | transformers static tokens/s | "
          "vs static | runs' vs static | engine step ms | floor ms | floor / step | "
          "same tokens | same without the cache | without the cache tokens/s |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|---:|")
    for r in rows:
        alone = r.get("without_cache_tokens_per_s")
        off = "-" if r["same_without_cache"] is None else (
            "yes" if r["same_without_cache"] else "no")
        print(f"| {r['workload']} | {r['kv']} | {r['lanes']} | {r['context']} | "
              f"{r['engine_tokens_per_s']:.1f} | {r['hf_tokens_per_s']:.1f} | "
              f"{r['vs_static']:.2f}x | {', '.join(f'{x:.2f}' for x in r['runs'])} | "
              f"{r['step_ms']:.1f} | {r['floor_ms']:.1f} | "
              f"{r['floor_ms'] / r['step_ms']:.2f} | {'yes' if r['same_tokens'] else 'no'} | "
              f"{off} | {'-' if alone is None else f'{alone:.1f}'} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--engine", default="torch", choices=list(ENGINES),
                   help="eager torch, or JAX compiled (its decode calls read the hint's prefix "
                        "once)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each workload, one after another (the table: their median)")
    p.add_argument("--kv", nargs="+", default=["float32"],
                   choices=["float32", "int8", "int4-turned"],
                   help="the engine's pools (transformers' static cache stays float32)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch's intra-op threads on both sides (the floor stays one thread's)")
    args = p.parse_args(argv)
    bw = lc.bandwidth()
    if args.threads != 1:
        import torch

        torch.set_num_threads(args.threads)
    say(f"one-thread read speed {bw / 1e9:.1f} GB/s")
    model, config, params, _ = lc.load("shaped")
    rows = [repeated([row_for(w, model, config, params, bw, args.context, args.new,
                              args.engine, kv) for _ in range(args.repeat)])
            for kv in args.kv for w in args.workloads]
    report(rows, bw, args.threads)
    if args.json:
        Path(args.json).write_text(json.dumps({"decode": rows, "bandwidth": bw,
                                               "threads": args.threads}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
