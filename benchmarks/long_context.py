"""Long-context decode: tokens per second of a batch of 8 lanes whose caches hold 1k, 4k or
16k tokens, cacheidx's attention over the pools in place beside transformers' static and
dynamic caches, on two models; one decode layer's attention over token- and head-major pools
against SDPA; and the peak memory of a one-layer prefill of 4k to 16k tokens.

The models are SmolLM2-135M's shape cut to 2 layers with a 4,096-token vocabulary (random
weights, one transformers ``LlamaForCausalLM`` and the same weights as ``cacheidx.models.llama``
params), at 1k, 4k and 16k tokens, and the real SmolLM2-135M-Instruct from its GGUF file (30
layers), at 1k and 4k (``--smollm2-contexts``; ``--smollm2``: that model alone). Every engine
starts from the same cache: each lane's ``L`` keys and values, random, written once into
cacheidx's pools (``ci.rows``, one run of slots per lane) and into transformers' caches, so no
engine computes a prefill and all of them decode the same tokens (checked). A decode step is one
forward of one token per lane and its argmax; the rate is 8 lanes over the median step of
``--steps``, and the spread is the fastest and slowest step. transformers runs its model's
forward in a plain loop (no ``generate`` around it, which only adds to its time), SDPA
attention, ``torch.inference_mode``. Everything runs on one thread.

The floor is the bytes a step must read, the weights and the cache it attends over, divided by
this machine's memory bandwidth (the fastest one-thread read of 400 MB): the time no engine
can beat.

    python benchmarks/long_context.py [--json PATH] [--quick] [--contexts 1024 4096 ...]
                                      [--smollm2-contexts 1024 ...] [--smollm2] [--steps N]
                                      [--engines NAME ...] [--prefill 4096 ...]
                                      [--layer 4096 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_multi_thread_eigen=false").strip()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's cacheidx

import numpy as np  # noqa: E402

BATCH = 8
ENGINES = ["transformers static", "transformers dynamic", "cacheidx torch",
           "cacheidx torch compiled", "cacheidx jax jit", "cacheidx numpy"]


def say(msg: str) -> None:
    print(f"    {msg}", flush=True)  # indented: run_all.py keeps only the tables


# -- the model, on both sides ---------------------------------------------------------------
def shaped_model(layers: int = 2, vocab: int = 4096, seed: int = 0):
    """transformers' Llama of SmolLM2-135M's shape (2 layers, a small vocabulary), random."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=32768,
                         initializer_range=0.05)
    return LlamaForCausalLM(config).eval()


def ours(model):
    """``(Config, params)`` of cacheidx's Llama holding the transformers model's weights."""
    from cacheidx.models import llama

    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    layer = "model.layers.{}.".format
    params = {
        "embed": sd["model.embed_tokens.weight"],
        "norm": sd["model.norm.weight"],
        "layers": [{
            "attn_norm": sd[layer(i) + "input_layernorm.weight"],
            "wq": sd[layer(i) + "self_attn.q_proj.weight"].T.copy(),
            "wk": sd[layer(i) + "self_attn.k_proj.weight"].T.copy(),
            "wv": sd[layer(i) + "self_attn.v_proj.weight"].T.copy(),
            "wo": sd[layer(i) + "self_attn.o_proj.weight"].T.copy(),
            "ffn_norm": sd[layer(i) + "post_attention_layernorm.weight"],
            "w_gate": sd[layer(i) + "mlp.gate_proj.weight"].T.copy(),
            "w_up": sd[layer(i) + "mlp.up_proj.weight"].T.copy(),
            "w_down": sd[layer(i) + "mlp.down_proj.weight"].T.copy(),
        } for i in range(c.num_hidden_layers)],
    }
    tied = bool(c.tie_word_embeddings)
    if not tied:
        params["out"] = sd["lm_head.weight"].T.copy()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    config = llama.Config(vocab=c.vocab_size, dim=c.hidden_size, layers=c.num_hidden_layers,
                          heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                          hidden=c.intermediate_size, head_dim=head_dim,
                          rope_base=float(getattr(c, "rope_theta", None)
                                          or c.rope_parameters["rope_theta"]),
                          eps=c.rms_norm_eps, tied=tied)
    return config, params


def weight_bytes(params) -> int:
    from cacheidx.models import llama

    sizes = []
    llama.tree_map(lambda a: sizes.append(a.nbytes), params)
    return sum(sizes)


# -- one cache for every engine ---------------------------------------------------------------
def cache(config, context: int, room: int, seed: int = 1):
    """Each layer's keys and values of ``context`` tokens per lane, ``[batch, context, kv,
    dim]``, random (the scale of real ones), and the first token of each lane."""
    rng = np.random.default_rng(seed)
    shape = (BATCH, context, config.kv_heads, config.head_dim)
    layers = [(rng.standard_normal(shape, dtype=np.float32),
               rng.standard_normal(shape, dtype=np.float32)) for _ in range(config.layers)]
    first = rng.integers(0, config.vocab, BATCH)
    return layers, first


def timed_steps(step, steps: int) -> tuple[list[int], list[float]]:
    """Run ``step()`` (one decode step: the chosen tokens) ``steps`` times after one to warm
    up; the tokens of every step and the seconds of each timed one."""
    tokens, seconds = [step()], []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens.append(step())
        seconds.append(time.perf_counter() - t0)
    return tokens, seconds


def hf_engine(model, layers, first, context: int, steps: int, kind: str, device: str):
    import torch
    from transformers import DynamicCache, StaticCache

    dev = torch.device("cuda" if device != "cpu" else "cpu")
    model = model.to(dev)
    c = model.config
    if kind == "static":
        kv = StaticCache(config=c, max_cache_len=context + steps + 2)
    else:
        kv = DynamicCache(config=c)
    with torch.inference_mode():
        for i, (k, v) in enumerate(layers):
            # transformers' caches are head-major: [batch, kv_heads, context, dim]
            kt = torch.from_numpy(k).transpose(1, 2).contiguous().to(dev)
            vt = torch.from_numpy(v).transpose(1, 2).contiguous().to(dev)
            kv.update(kt, vt, i, {"cache_position": torch.arange(context, device=dev)})
    tok = torch.from_numpy(first).reshape(BATCH, 1).to(dev)
    at = [context]

    def step():
        nonlocal tok
        with torch.inference_mode():
            pos = torch.tensor([at[0]], device=dev)
            out = model(input_ids=tok, past_key_values=kv, cache_position=pos,
                        position_ids=pos.expand(BATCH, 1), use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        at[0] += 1
        return tok.reshape(-1).tolist()

    return timed_steps(step, steps)


def ci_engine(config, params, layers, first, context: int, steps: int, backend: str,
              compiled: bool, device: str, kv: str | None = None):
    """cacheidx's decode steps over the pools ``llama.empty_pools`` makes (quantized ones of
    ``kv``: "int8", "int4"), filled with ``layers``' keys and values."""
    import cacheidx as ci
    from cacheidx import devices
    from cacheidx import pools as kinds
    from cacheidx.models import llama

    be = ci.backends.get(backend)
    xp = be.xp
    where = devices.resolve(be, device)
    width = context + steps + 2
    index = ci.rows(width, [context] * BATCH, xp=backend, device=where)
    weights = llama.convert(params, xp=xp, device=where)
    # the library's own pools (head-major on the CPU: cacheidx.attention.layout), filled
    pools = []
    slots = xp.asarray(np.concat([np.arange(b * width, b * width + context)
                                  for b in range(BATCH)]), device=where)

    def filled(pool, x):
        rows = xp.asarray(x.reshape(BATCH * context, *x.shape[2:]), device=where)
        kind = kinds.kind(pool)  # each part stores what its kind encodes of the rows
        return kind.remade([be.scatter(p, slots, r, donate=True) for p, r in
                            zip(kind.parts(pool), kind.encode(pool, rows, xp), strict=True)])

    for (k, v), (pk, pv) in zip(layers, llama.empty_pools(config, BATCH * width,
                                                          like=weights["embed"], kv=kv)):
        pools.append((filled(pk, k), filled(pv, v)))

    def forward(weights, tokens, index, pools):
        logits, pools = llama.forward(weights, config, tokens, index, pools, donate=True,
                                      last=True)
        return xp.argmax(logits[:, 0, :], axis=-1), pools

    run = be.jit(forward, donate_argnums=(3,)) if compiled else be.inference(forward)
    state = {"index": index.advance(),
             "tok": xp.reshape(xp.asarray(first, device=where), (BATCH, 1)), "pools": pools}

    def step():
        chosen, state["pools"] = run(weights, state["tok"], state["index"], state["pools"])
        state["tok"] = xp.reshape(chosen, (BATCH, 1))
        state["index"] = state["index"].advance()
        return devices.to_host(chosen).reshape(-1).tolist()

    return timed_steps(step, steps)


def speedup(row: dict, base: dict | None, missing: str = "-") -> str:
    """``row``'s tokens/s over ``base``'s, as a table shows it (``missing`` without a base)."""
    return f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else missing


def bandwidth() -> float:
    """Bytes a second one thread reads here: the best of a few reads over 400 MB, each a sum
    and a maximum (NumPy's pairwise sum runs below the memory's speed on some machines; its
    maximum is a plain streaming read)."""
    a = np.ones(100_000_000, np.float32)
    best = min(_time(f) for f in (a.sum, a.max) for _ in range(3))
    return a.nbytes / best


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_rows(args, model, config, params, contexts, bw: float) -> list[dict]:
    """The decode rows of one model at ``contexts``; ``bw`` is the machine's read speed in
    bytes a second (infinite where not measured)."""
    rows = []
    wbytes = weight_bytes(params)
    say(f"weights {wbytes / 2**20:.0f} MB")
    for context in contexts:
        layers, first = cache(config, context, args.steps)
        cache_bytes = 2 * config.layers * BATCH * context * config.kv_heads * config.head_dim * 4
        floor = (wbytes + cache_bytes) / bw  # 0 where not measured (a GPU)
        tokens = {}
        for engine in args.engines:
            t0 = time.perf_counter()
            try:
                got = run_engine(engine, model, config, params, layers, first, context,
                                 args.steps, args.device)
            except Exception as e:  # an engine missing here is said so, not hidden
                say(f"{engine} at {context}: not measured ({type(e).__name__}: {e})")
                continue
            toks, seconds = got
            tokens[engine] = toks
            med = statistics.median(seconds)
            rows.append({"context": context, "engine": engine,
                         "tokens_per_s": BATCH / med, "step_ms": 1e3 * med,
                         "read_gb_per_s": (wbytes + cache_bytes) / med / 1e9,
                         "fastest_ms": 1e3 * min(seconds), "slowest_ms": 1e3 * max(seconds),
                         "floor_ms": 1e3 * floor if floor else None,
                         "floor_bw_gb": bw / 1e9 if floor else 0.0,
                         "wall_s": time.perf_counter() - t0})
            say(f"{engine} at {context}: {BATCH / med:.1f} tokens/s (step {1e3 * med:.1f} ms, "
                f"{1e3 * min(seconds):.1f} to {1e3 * max(seconds):.1f}); floor "
                f"{1e3 * floor:.1f} ms")
        ref = tokens.get("transformers static")
        for engine, toks in tokens.items():
            same = ref is None or toks == ref
            for r in rows:
                if r["context"] == context and r["engine"] == engine:
                    r["same_tokens"] = same
            if not same:
                say(f"{engine} at {context}: tokens differ from transformers static")
    return rows


# -- one decode layer: where the attention's time goes --------------------------------------
def layer_rows(contexts, sets: int = 4, repeats: int = 5) -> list[dict]:
    """One decode layer's attention in torch (8 lanes, 9 query and 3 kv heads of 64, float32,
    one thread, under inference mode): ``attend`` over token-major and head-major pools (the
    library's layout on the CPU), and SDPA over contiguous head-major keys as transformers'
    static cache reads them. ``sets`` sets of pools in turn, so that each call finds its keys
    in memory rather than in the caches (as in a model, whose other layers pass in between);
    milliseconds a call, the best and the median of ``repeats`` rounds."""
    rng = np.random.default_rng(2)
    return [row for n in contexts for row in _one_layer(n, rng, sets, repeats)]


def _one_layer(n: int, rng, sets: int, repeats: int) -> list[dict]:
    import array_api_compat.torch as xt
    import torch

    import cacheidx as ci
    from cacheidx.attention import layout

    kv, group, d = 3, 3, 64
    width = n + 16
    index = ci.rows(width, [n] * BATCH, xp="torch").advance()
    q, k, v = (torch.from_numpy(rng.standard_normal((BATCH, 1, h, d), dtype=np.float32))
               for h in (kv * group, kv, kv))
    filled = [[torch.from_numpy(rng.standard_normal((BATCH * width, kv, d), dtype=np.float32))
               for _ in "kv"] for _ in range(sets)]
    pools = {order: [[layout.zeros(xt, BATCH * width, kv, d, dtype=torch.float32,
                                   layout=order).copy_(p) for p in pair] for pair in filled]
             for order in ("token", "head")}
    # transformers' static cache: [batch, kv, width, d], each lane's context contiguous
    static = [[p.view(BATCH, width, kv, d).transpose(1, 2).contiguous() for p in pair]
              for pair in filled]
    qh = q.transpose(1, 2)

    def sdpa(s):
        kc, vc = static[s]
        return torch.nn.functional.scaled_dot_product_attention(
            qh, kc[:, :, :n + 1], vc[:, :, :n + 1], enable_gqa=True)

    def attend(order):
        return lambda s: index.attend(q, k, v, *pools[order][s], donate=True)[0]

    rows = []
    ways = [("attend, token-major pools", attend("token")),
            ("attend, head-major pools", attend("head")),
            ("SDPA, contiguous head-major keys", sdpa)]
    with torch.inference_mode():
        for name, fn in ways:
            for s in range(sets):
                fn(s)
            rounds = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for s in range(sets):
                    fn(s)
                rounds.append((time.perf_counter() - t0) / sets * 1e3)
            rows.append({"context": n, "way": name, "best_ms": min(rounds),
                         "median_ms": statistics.median(rounds)})
            say(f"layer at {n}, {name}: {min(rounds):.2f} ms")
    return rows


def run_engine(engine, model, config, params, layers, first, context, steps, device):
    if engine.startswith("transformers"):
        return hf_engine(model, layers, first, context, steps, engine.split()[-1], device)
    backend = engine.split()[1]
    return ci_engine(config, params, layers, first, context, steps, backend,
                     compiled=engine.endswith(("compiled", "jit")), device=device)


# -- a long prefill's memory ----------------------------------------------------------------
def prefill_memory(args) -> list[dict]:
    """Peak memory beyond the inputs, outputs and pools of one layer's prefill of ``n`` tokens
    (batch 1): the process's peak resident memory during the call (Linux's ``VmHWM``, reset
    first) less what it held before, each backend in a process of its own."""
    import subprocess

    out = []
    for n in args.prefill:
        for backend in ("numpy", "torch", "jax"):
            got = subprocess.run([sys.executable, __file__, "--one-prefill", backend, str(n)],
                                 capture_output=True, text=True)
            if got.returncode != 0:
                say(f"prefill {n} on {backend}: not measured ({got.stderr.strip()[-300:]})")
                continue
            peak, took = json.loads(got.stdout.strip().splitlines()[-1])
            materialised = 9 * n * n * 4
            out.append({"tokens": n, "backend": backend, "peak_mb": peak / 2**20,
                        "scores_mb": materialised / 2**20, "seconds": took})
            say(f"prefill {n} on {backend}: peak {peak / 2**20:.0f} MB beyond inputs "
                f"(the scores alone would be {materialised / 2**20:.0f} MB), {took:.1f}s")
    return out


def _resident(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def one_prefill(backend: str, n: int) -> tuple[float, float]:
    """In this process: the peak resident memory a prefill of ``n`` tokens adds, and its
    seconds (after a first call of 16 tokens has loaded the library's code)."""
    import cacheidx as ci
    from cacheidx.attention import layout

    rng = np.random.default_rng(0)
    be = ci.backends.get(backend)
    xp = be.xp

    def arrays(m):
        # the pools as the library lays them out (head-major on the CPU)
        pools = [layout.zeros(xp, m, 3, 64, dtype=xp.float32) for _ in "kv"]
        return [xp.asarray(a) for a in (
            rng.standard_normal((1, m, 9, 64), dtype=np.float32),
            rng.standard_normal((1, m, 3, 64), dtype=np.float32),
            rng.standard_normal((1, m, 3, 64), dtype=np.float32))] + pools

    run = be.inference(lambda index, *a: index.attend(*a, donate=True)[0])
    if backend == "jax":
        import jax

        run = jax.jit(lambda index, *a: index.attend(*a)[0])
    np.asarray(run(ci.rows(16, [16], xp=backend), *arrays(16)))  # load and compile code
    index, inputs = ci.rows(n, [n], xp=backend), arrays(n)
    out = xp.zeros((1, n, 9, 64))  # the output's memory, held before
    del out
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts from here
    before = _resident("VmRSS")
    t0 = time.perf_counter()
    got = run(index, *inputs)
    np.asarray(got)
    took = time.perf_counter() - t0
    peak = _resident("VmHWM") - before - n * 9 * 64 * 4  # less the output itself
    return max(peak, 0), took


def load(which: str):
    """``(transformers model, Config, params, name)`` of the shaped model or the real SmolLM2."""
    if which == "smollm2":
        from cacheidx.models import gguf

        config, params = gguf.load_smollm2()
        return (gguf.transformers_model(), config, params,
                "SmolLM2-135M-Instruct (30 layers, vocabulary 49,152)")
    model = shaped_model()
    config, params = ours(model)
    name = "SmolLM2-135M's shape, 2 layers, vocabulary 4,096 (random weights)"
    return model, config, params, name


def decode_table(name: str, rows: list[dict], steps: int) -> None:
    print(f"Decode, {name}: batch {BATCH}, {steps} steps after one to warm up, one "
          "thread; tokens/s over the median step, and the fastest and slowest step. The floor "
          "is the weights and the cache a step reads over the machine's one-thread bandwidth "
          f"({rows[0]['floor_bw_gb'] if rows else 0:.1f} GB/s).\n")
    print("| context | engine | tokens/s | vs transformers static | step ms (fastest-slowest) "
          "| floor ms | bytes read / step time | same tokens |")
    print("|---:|---|---:|---:|---|---:|---:|---|")
    for r in rows:
        ref = next((x for x in rows if x["context"] == r["context"]
                    and x["engine"] == "transformers static"), None)
        ratio = speedup(r, ref, "")
        print(f"| {r['context']} | {r['engine']} | {r['tokens_per_s']:.1f} | {ratio} | "
              f"{r['step_ms']:.1f} ({r['fastest_ms']:.1f}-{r['slowest_ms']:.1f}) | "
              f"{r['floor_ms'] or 0:.1f} | {r['read_gb_per_s']:.1f} GB/s | "
              f"{'yes' if r.get('same_tokens', True) else 'no'} |")
    print()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true", help="1k context, 4 steps, no prefill")
    p.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 16384])
    p.add_argument("--prefill", type=int, nargs="*", default=[4096, 8192, 16384])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layer", type=int, nargs="*", default=[4096, 16384],
                   help="contexts of the one-layer attention timings (none: leave them out)")
    p.add_argument("--smollm2-contexts", type=int, nargs="*", default=[1024, 4096],
                   help="contexts of the real SmolLM2-135M-Instruct (none: leave it out)")
    p.add_argument("--smollm2", action="store_true",
                   help="only the real SmolLM2-135M-Instruct, not the 2-layer shape")
    p.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda (a GPU: NumPy is left out, and no floor is drawn)")
    p.add_argument("--one-prefill", nargs=2, metavar=("BACKEND", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one_prefill:
        print(json.dumps(one_prefill(args.one_prefill[0], int(args.one_prefill[1]))))
        return 0
    if args.quick:
        args.contexts, args.steps, args.prefill, args.smollm2_contexts = [1024], 4, [], []
        args.layer = []
    if args.device != "cpu":
        args.engines = [e for e in args.engines if e != "cacheidx numpy"]
        args.prefill = []
    import torch

    torch.set_num_threads(1)
    models = [] if args.smollm2 else [("shaped", args.contexts)]
    models += [("smollm2", args.smollm2_contexts)] if args.smollm2_contexts else []
    # measured once, so that every model's floor is drawn from the same speed
    bw = bandwidth() if args.device == "cpu" else float("inf")
    say(f"memory bandwidth (one thread): {bw / 1e9:.1f} GB/s")
    rows = []
    for which, contexts in models:
        try:
            model, config, params, name = load(which)
        except Exception as e:  # SmolLM2's file missing here: said so, not hidden
            say(f"{which}: not measured ({type(e).__name__}: {e})")
            continue
        got = decode_rows(args, model, config, params, contexts, bw)
        for r in got:
            r["model"] = name
        rows += got
        del model, params
        decode_table(name, got, args.steps)
    layer = layer_rows(args.layer) if args.layer and args.device == "cpu" else []
    if layer:
        print("\nOne decode layer's attention in torch (8 lanes, 9 query and 3 kv heads of 64, "
              "one thread, 4 sets of pools in turn): ms a call, best and median of 5 rounds."
              "\n")
        print("| context | way | best ms | median ms |")
        print("|---:|---|---:|---:|")
        for r in layer:
            print(f"| {r['context']} | {r['way']} | {r['best_ms']:.2f} | {r['median_ms']:.2f} |")
    memory = prefill_memory(args) if args.prefill else []
    if memory:
        print("\nOne layer's prefill (batch 1, 9 query and 3 kv heads of 64, float32): peak "
              "memory beyond its inputs, outputs and pools.\n")
        print("| tokens | backend | peak MB | materialised scores MB | seconds |")
        print("|---:|---|---:|---:|---:|")
        for r in memory:
            print(f"| {r['tokens']} | {r['backend']} | {r['peak_mb']:.0f} | "
                  f"{r['scores_mb']:.0f} | {r['seconds']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": BATCH, "steps": args.steps, "decode": rows,  # rows name models
                       "layer": layer, "prefill": memory}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
