"""Decode tokens per second for a batch of 8 chat prompts: SmolLM2-135M-Instruct served
through cacheidx beside transformers' generate, same machine, same prompts, one run.

cacheidx: ``cacheidx.demo.serve`` (prefix-shared prefill over paged pools, then one token per
lane per call with ``advance``) on NumPy eagerly, on JAX compiled with ``jax.jit`` and on
PyTorch eagerly, where installed. transformers: ``generate(do_sample=False)`` on the same GGUF
file, the batch left-padded, its decode rate taken as the time of ``max_new_tokens = N`` less
that of ``max_new_tokens = 1`` (its prefill). Every lane makes N tokens (no stop at the end of
a turn), so both sides compute the same number of tokens. Rates are tokens computed per second
over the whole batch, best of the repeats; cacheidx's first decode step (which compiles under
JAX) is timed apart and left out. Every library runs on ``--threads`` threads (1 by default, set
before NumPy, PyTorch and JAX load: on a shared machine their spinning thread pools otherwise
measure the neighbours; 0 leaves each library's default).

    python benchmarks/decode.py [--json PATH] [--quick] [--new-tokens N] [--repeat R]
                                [--threads T] [--backend NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's cacheidx

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "What is the capital of Japan?",
    "Give me a synonym for happy.",
    "Explain gravity in one sentence.",
    "What is 12 times 12?",
    "Name a famous painter.",
]


def say(msg: str) -> None:
    # indented: run_all.py keeps only the unindented lines (the tables) for the page
    print(f"    {msg}", flush=True)


def ours(params, config, ids, backend: str, new: int, repeat: int) -> dict:
    from cacheidx import demo

    best = None
    for _ in range(repeat):
        s = demo.serve(params, config, ids, max_new_tokens=new, page_size=16,
                       backend=backend, compile=backend == "jax", stop=False)
        say(f"cacheidx {backend}: prefill {s.prefill_s:.2f}s, first decode step "
            f"{s.warmup_s:.2f}s, {s.decode_tokens_per_s:.1f} tokens/s")
        if best is None or s.decode_tokens_per_s > best.decode_tokens_per_s:
            best = s
    return {
        "engine": "cacheidx",
        "backend": backend,
        "compiled": best.compiled,
        "batch": len(ids),
        "new_tokens": new,
        "prefill_s": round(best.prefill_s, 3),
        "prefill_tokens_computed": best.computed,
        "decode_tokens_per_s": round(best.decode_tokens_per_s, 1),
        "tokens": best.tokens,
    }


def transformers_rate(ids, new: int, repeat: int) -> dict:
    import torch

    from cacheidx.models import gguf

    model = gguf.transformers_model()
    pad = model.generation_config.pad_token_id or 0
    width = max(len(i) for i in ids)
    inputs = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])

    def timed(n):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0, out

    timed(2)  # warm up
    full = min(timed(new)[0] for _ in range(repeat))
    first = min(timed(1)[0] for _ in range(repeat))
    rate = len(ids) * (new - 1) / max(full - first, 1e-9)
    say(f"transformers: generate {new} tokens {full:.2f}s, prefill {first:.2f}s, "
        f"{rate:.1f} tokens/s")
    return {
        "engine": "transformers",
        "backend": f"torch {torch.__version__} eager",
        "compiled": False,
        "batch": len(ids),
        "new_tokens": new,
        "prefill_s": round(first, 3),
        "prefill_tokens_computed": int(mask.sum()),
        "decode_tokens_per_s": round(rate, 1),
        "threads": torch.get_num_threads(),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true", help="8 new tokens, one repeat")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--backend", action="append",
                   help="cacheidx backends to run (default: numpy, jax, torch where usable)")
    p.add_argument("--threads", type=int, default=1,
                   help="threads for every library (0: each library's default)")
    args = p.parse_args(argv)
    new, repeat = (8, 1) if args.quick else (args.new_tokens, args.repeat)
    if args.threads > 0:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
        if args.threads == 1:
            flags = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
            os.environ["XLA_FLAGS"] = flags.strip()

    import cacheidx as ci
    from cacheidx.models import gguf

    try:
        t0 = time.perf_counter()
        config, params = gguf.load_smollm2()
        ids = [gguf.chat_ids(q) for q in PROMPTS]
        say(f"loaded SmolLM2 and its tokenizer in {time.perf_counter() - t0:.1f}s")
    except gguf.ModelMissing as e:
        print(f"skipped: {e}", file=sys.stderr)
        return 1
    usable = ci.backends.available()
    backends = args.backend or [b for b in ("numpy", "jax", "torch") if b in usable]
    rows = [ours(params, config, ids, b, new, repeat) for b in backends]
    try:
        reference = transformers_rate(ids, new, repeat)
        rows.append(reference)
    except gguf.ModelMissing as e:
        say(f"transformers not measured: {e}")
        reference = None

    threads = args.threads if args.threads > 0 else "each library's default"
    print(f"Batch of {len(ids)} chat prompts ({min(map(len, ids))} to {max(map(len, ids))} "
          f"tokens, sharing the system prompt), {new} greedy tokens each, on this machine, "
          f"threads: {threads}.\n")
    print("| engine | backend | compiled | prefill (s) | decode tokens/s | vs transformers |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        ratio = (f"{r['decode_tokens_per_s'] / reference['decode_tokens_per_s']:.2f}x"
                 if reference else "")
        print(f"| {r['engine']} | {r['backend']} | {'yes' if r['compiled'] else 'no'} | "
              f"{r['prefill_s']:.2f} | {r['decode_tokens_per_s']:.1f} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": len(ids), "new_tokens": new, "threads": args.threads,
                       "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
