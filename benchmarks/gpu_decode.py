"""Decode tokens per second on a GPU: a SmolLM2-135M-shaped Llama with random weights served
through cacheidx beside transformers' generate (dynamic and static cache), same shape, batch,
lengths and device.

Batch 64 prompts of 128 random tokens, 64 new tokens each, no stop, float32. Rows, where their
library and a GPU are present:

- ``cacheidx.demo.serve`` on jax (compiled with ``jax.jit``; jax places its arrays on its default
  device, the GPU where jax has one) and on torch with ``device=`` (eager and compiled), where
  ``serve`` takes a ``device`` (it says so where it does not);
- ``cacheidx.models.llama.forward`` in a plain loop, torch eager on the GPU: prefill of the whole
  prompts, then one token per lane per call with ``index.advance()``;
- transformers ``generate(do_sample=False)``, dynamic cache and
  ``cache_implementation="static"`` (which transformers compiles itself where it does), on a
  ``LlamaForCausalLM`` of the same shape.

Rates are tokens computed per second over the batch in decode: cacheidx's steps after the
first (which compiles where the backend does); transformers' ``max_new_tokens=N`` less
``max_new_tokens=1`` (its prefill), after a warm-up call.

    python benchmarks/gpu_decode.py [--json PATH] [--cpu] [--quick] [--skip NAME ...]

Without a GPU it says so and exits 0; ``--cpu`` measures the rows on the CPU (a check of the
script: ``--quick`` makes the model, batch and lengths tiny).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cacheidx as ci  # noqa: E402
from cacheidx import demo  # noqa: E402
from cacheidx.models import llama  # noqa: E402

SMOLLM2 = dict(vocab=49152, dim=576, layers=30, heads=9, kv_heads=3, hidden=1536,
               rope_base=100000.0, eps=1e-5, tied=True)
FULL = dict(batch=64, prompt=128, new=64)
QUICK = dict(batch=4, prompt=12, new=6)


def say(msg: str) -> None:
    print(f"    {msg}", flush=True)  # indented: run_all.py keeps only the tables


def gpu_name() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import jax

        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        return gpus[0].device_kind if gpus else None
    except ImportError:
        return None


def serve_row(params, config, prompts, new, backend, compile, device) -> dict:
    kwargs = dict(max_new_tokens=new, backend=backend, compile=compile, stop=False,
                  share=False)
    if device is not None:
        kwargs["device"] = device
    s = demo.serve(params, config, prompts, **kwargs)
    return {"engine": "cacheidx.demo.serve", "backend": backend, "compiled": bool(compile),
            "prefill_s": round(s.prefill_s, 3), "first_step_s": round(s.warmup_s, 3),
            "tokens_per_s": round(s.decode_tokens_per_s, 1)}


def loop_row(params, config, prompts, new, device) -> dict:
    """``llama.forward`` eagerly on torch: prefill, then one token per lane per call."""
    import torch

    xp = "torch"
    weights = llama.convert(params, xp=xp, device=device)
    b, n = len(prompts), len(prompts[0])
    width = n + new
    table = torch.arange(b * width, device=device).reshape(b, width)
    pools = llama.empty_pools(config, b * width, like=weights["embed"])
    tokens = torch.tensor(prompts, device=device)
    index = ci.make(torch.arange(n, device=device).repeat(b, 1), table)

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        t0 = time.perf_counter()
        logits, pools = llama.forward(weights, config, tokens, index, pools, donate=True,
                                      last=True)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        sync()
        prefill = time.perf_counter() - t0
        index = index.advance()
        t0, steps = None, 0
        for k in range(new - 1):
            logits, pools = llama.forward(weights, config, nxt, index, pools, donate=True,
                                          last=True)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            index = index.advance()
            if k == 0:  # the first step is timed apart, as serve does
                sync()
                t0 = time.perf_counter()
            else:
                steps += 1
        sync()
        rate = b * steps / (time.perf_counter() - t0) if steps else float("nan")
    return {"engine": "llama.forward loop", "backend": "torch", "compiled": False,
            "prefill_s": round(prefill, 3), "first_step_s": None,
            "tokens_per_s": round(rate, 1)}


def transformers_rows(config, prompts, new, device) -> list[dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = config
    hf = LlamaConfig(vocab_size=c.vocab, hidden_size=c.dim, intermediate_size=c.hidden,
                     num_hidden_layers=c.layers, num_attention_heads=c.heads,
                     num_key_value_heads=c.kv_heads, head_dim=c.head_dim,
                     rope_theta=c.rope_base, rms_norm_eps=c.eps, tie_word_embeddings=c.tied,
                     max_position_embeddings=4096, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf).to(device).eval()
    inputs = torch.tensor(prompts, device=device)
    mask = torch.ones_like(inputs)
    rows = []
    for cache in ("dynamic", "static"):
        extra = {} if cache == "dynamic" else {"cache_implementation": "static"}

        def timed(n, extra=extra):
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(inputs, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, **extra)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t

        try:
            timed(new)  # warm-up (a static cache compiles here where transformers compiles it)
            full, first = timed(new), timed(1)
        except Exception as e:
            say(f"transformers {cache}: {type(e).__name__}: {e}")
            continue
        rows.append({"engine": f"transformers generate, {cache} cache", "backend": "torch",
                     "compiled": False, "prefill_s": round(first, 3),
                     "first_step_s": None,
                     "tokens_per_s": round(len(prompts) * (new - 1) / max(full - first, 1e-9),
                                           1)})
    return rows


def run(args) -> dict:
    shape = QUICK if args.quick else FULL
    config = llama.Config.tiny() if args.quick else llama.Config(**SMOLLM2)
    params = llama.random_params(config, seed=0)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, config.vocab, (shape["batch"], shape["prompt"])).tolist()
    new = shape["new"]
    device = "cpu" if args.cpu else "cuda"
    skip = set(args.skip or ())
    has_device = "device" in inspect.signature(demo.serve).parameters
    result = {"device": "cpu" if args.cpu else gpu_name(), "date": time.strftime("%Y-%m-%d"),
              **shape, "model": "tiny" if args.quick else "SmolLM2-135M shape, random weights",
              "rows": [], "notes": []}
    usable = ci.backends.available()

    def attempt(name, fn):
        if name in skip:
            return
        try:
            out = fn()
        except Exception as e:
            result["notes"].append(f"{name}: {type(e).__name__}: {e}")
            say(result["notes"][-1])
            return
        for row in out if isinstance(out, list) else [out]:
            result["rows"].append(row)
            say(f"{row['engine']} {row['backend']}{' compiled' if row['compiled'] else ''}: "
                f"{row['tokens_per_s']} tokens/s")

    if "jax" in usable:
        import jax

        on_gpu = any(d.platform == "gpu" for d in jax.devices())
        if on_gpu or args.cpu:
            attempt("serve-jax", lambda: serve_row(params, config, prompts, new, "jax", True,
                                                   None))
        else:
            result["notes"].append("serve on jax: jax has no GPU here")
    if "torch" in usable:
        if has_device or args.cpu:
            dev = device if has_device else None
            attempt("serve-torch", lambda: serve_row(params, config, prompts, new, "torch",
                                                     False, dev))
            attempt("serve-torch-compiled", lambda: serve_row(params, config, prompts, new,
                                                              "torch", True, dev))
        else:
            result["notes"].append("cacheidx.demo.serve takes no device: its torch rows would "
                                   "run on the CPU, so they are left out")
        attempt("loop-torch", lambda: loop_row(params, config, prompts, new, device))
        try:
            import transformers  # noqa: F401

            attempt("transformers", lambda: transformers_rows(config, prompts, new, device))
        except ImportError:
            result["notes"].append("transformers is not installed")
    for note in result["notes"]:
        say(note)
    return result


def markdown(result: dict) -> str:
    lines = [f"Device: {result['device']}, {result['date']}; {result['model']}; batch "
             f"{result['batch']}, prompts of {result['prompt']} tokens, {result['new']} new "
             "tokens each.", "",
             "| engine | backend | compiled | prefill s | decode tokens/s |",
             "|---|---|---|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['engine']} | {r['backend']} | {'yes' if r['compiled'] else 'no'} | "
                     f"{r['prefill_s']:.3f} | {r['tokens_per_s']:.1f} |")
    if result["notes"]:
        lines += ["", "Notes: " + "; ".join(result["notes"]) + "."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    p.add_argument("--cpu", action="store_true", help="measure on the CPU (checks the script)")
    p.add_argument("--quick", action="store_true", help="a tiny model, batch and lengths")
    p.add_argument("--skip", action="append", help="serve-jax, serve-torch, "
                   "serve-torch-compiled, loop-torch, transformers")
    args = p.parse_args(argv)
    if not args.cpu and gpu_name() is None:
        msg = "no GPU is present: nothing measured (--cpu measures the CPU rows)"
        print(msg)
        if args.json:
            empty = {"device": None, "note": msg, "notes": [msg], "rows": []}
            args.json.write_text(json.dumps(empty, indent=2) + "\n")
        return 0
    result = run(args)
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
