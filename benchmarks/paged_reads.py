"""Paged reads at the floor: decode tokens/s of 8 and 32 lanes whose caches hold 1k, 4k or 16k
tokens on pages of 16 slots in a shuffled order, read by the CPU kernel that walks the page
table itself, beside the core's reads of the same pools (the kernel off) and transformers'
static cache; float32 and int8 pools; and at 16k 1 thread against 2, transformers' static
cache too.

The model is ``long_context.py``'s (SmolLM2-135M's shape cut to 2 layers, random weights, the
same on both sides). Each lane's context is its own (nothing shared), its pages drawn in a
random order from one pool, as an allocator leaves them after a while of serving; a step is one
forward of one token per lane and its argmax under ``torch.inference_mode()``, the index
``advance()``d each step; one thread unless stated; the rate is the lanes over the median step,
with the fastest and slowest. Every engine decodes the same tokens as transformers' static
cache (float32: checked; int8's codes may move a token, which is said). Two floors: the bytes
a step must read (the weights and every lane's keys and values, codes and scales for int8) over
the machine's measured one-thread bandwidth, and the step's products (each weight matrix once a
lane, attention's two products over every lane's context) at the one-thread rate of torch's
float32 matrix product. Beside each step's wall time stands its CPU time
(the process's, all its threads): on a loaded machine a step's wall time also counts the time
other processes held the cores, its CPU time only its own, so the CPU ratio is the steadier one
there (at 1 thread; at 2 it is the cores' time the step cost).

    python benchmarks/paged_reads.py [--json PATH] [--contexts 1024 4096 16384] [--lanes 8 32]
                                     [--steps N] [--kv float32 int8 int4-turned]
                                     [--threads 1 2]

With ``--kernel`` it times the kernel alone instead: one layer's read (SmolLM2's 3 kv heads of
64, its 3 query heads a kv head) of every lane's pages, shuffled and in order (each lane's
pages one run), by one call of ``cacheidx.attention.native.paged``, the median and fastest CPU
time of ``--steps`` calls and the bytes a second that makes (codes and scales for int8). The
two orders read the same bytes with the same work, so their ratio is what this machine's
memory charges for a page met out of order.
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

PAGE = 16

#: each timed step's process CPU seconds, of the last :func:`timed_on_cpu`
CPU_SECONDS: list[float] = []


def timed_on_cpu(step, steps: int) -> tuple[list, list[float]]:
    """``long_context.timed_steps``'s tokens and wall seconds, each step's CPU seconds kept in
    :data:`CPU_SECONDS` (it stands in for ``timed_steps`` in this process: both engines time
    their steps through it)."""
    tokens, seconds = [step()], []
    CPU_SECONDS.clear()
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        tokens.append(step())
        seconds.append(time.perf_counter() - t0)
        CPU_SECONDS.append(time.process_time() - c0)
    return tokens, seconds


def say(msg: str) -> None:
    print(f"    {msg}", flush=True)


def shuffled_table(lanes: int, width: int, seed: int = 3) -> tuple[np.ndarray, int]:
    """``[lanes, width]`` slots, each lane's pages drawn in a random order from one pool."""
    per = -(-width // PAGE)
    order = np.random.default_rng(seed).permutation(lanes * per)
    pages = order.reshape(lanes, per)
    table = (pages[:, :, None] * PAGE + np.arange(PAGE)[None, None, :]).reshape(lanes, -1)
    return table[:, :width], lanes * per * PAGE


def cacheidx_paged(config, params, layers, first, context: int, steps: int, kv: str,
                   kernel: bool):
    """cacheidx on torch over paged pools (``kv``: float32, int8 or int4-turned), the kernel
    on or off."""
    import torch

    import cacheidx as ci
    from cacheidx import devices
    from cacheidx import pools as kinds
    from cacheidx.attention import native
    from cacheidx.models import llama

    be = ci.backends.get("torch")
    xp = be.xp
    lanes = len(first)
    table, slots = shuffled_table(lanes, context + steps + 2)
    weights = llama.convert(params, xp=xp)
    at = xp.asarray(table[:, :context].reshape(-1))
    pools = []
    empty = llama.empty_pools(config, slots, like=weights["embed"],
                              kv=None if kv == "float32" else kv)
    for (k, v), pair in zip(layers, empty):
        stored = []
        for x, pool in zip((k, v), pair):
            rows = torch.as_tensor(x.reshape(lanes * context, *x.shape[2:]))
            kind = kinds.kind(pool)  # each part stores what its kind encodes of the rows
            stored.append(kind.remade([be.scatter(p, at, r, donate=True) for p, r in zip(
                kind.parts(pool), kind.encode(pool, rows, xp), strict=True)]))
        pools.append(tuple(stored))
    index = ci.make(xp.asarray(np.full((lanes, 1), context - 1)), xp.asarray(table))

    def forward(weights, tokens, index, pools):
        logits, pools = llama.forward(weights, config, tokens, index, pools, donate=True,
                                      last=True)
        return xp.argmax(logits[:, 0, :], axis=-1), pools

    run = be.inference(forward)
    state = {"index": index.advance(), "tok": xp.reshape(xp.asarray(first), (lanes, 1)),
             "pools": pools}

    def step():
        with contextlib.nullcontext() if kernel else native.off():
            chosen, state["pools"] = run(weights, state["tok"], state["index"], state["pools"])
        state["tok"] = xp.reshape(chosen, (lanes, 1))
        state["index"] = state["index"].advance()
        return devices.to_host(chosen).reshape(-1).tolist()

    return lc.timed_steps(step, steps)


def hf_static(model, layers, first, context: int, steps: int):
    lc.BATCH = len(first)
    try:
        return lc.hf_engine(model, layers, first, context, steps, "static", "cpu")
    finally:
        lc.BATCH = 8


def caches(config, lanes: int, context: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    shape = (lanes, context, config.kv_heads, config.head_dim)
    layers = [(rng.standard_normal(shape, dtype=np.float32),
               rng.standard_normal(shape, dtype=np.float32)) for _ in range(config.layers)]
    return layers, rng.integers(0, config.vocab, lanes)


def flop_rate() -> float:
    """Floating-point operations a second one thread does here: the best of a few float32
    products of 1024-square matrices by torch's two CPU libraries, MKL's ``@`` and oneDNN's
    linear under inference mode (on this AMD machine oneDNN's reaches about twice MKL's: the
    rate the machine has, not one library's)."""
    import torch

    from cacheidx.backends import onednn

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    products = [lambda: a @ b]
    if onednn.available():
        def linear():
            with torch.inference_mode():
                onednn.linear(a, b, pack=False)
        products.append(linear)
    best = min(lc._time(f) for f in products for _ in range(6))  # the first of each warms
    return 2 * 1024 ** 3 / best


def step_flops(config, params, lanes: int, context: int) -> float:
    """A decode step's products: every weight matrix once per lane (two operations an element),
    and attention's two products over each lane's context at every query head and layer."""
    from cacheidx.models import llama

    matrices = []
    llama.tree_map(lambda a: matrices.append(a.size if a.ndim == 2 else 0), params)
    attention = 4 * lanes * context * config.heads * config.head_dim * config.layers
    return 2 * lanes * sum(matrices) + attention


def row_bytes(config, kv: str) -> int:
    """Bytes one token's keys and values cost over every layer (codes, scales and zero points
    for quantized pools): those of one slot of the pools the model makes."""
    from cacheidx import pools as kinds
    from cacheidx.models import llama

    empty = llama.empty_pools(config, 1, xp="numpy", kv=None if kv == "float32" else kv)
    return sum(part.nbytes for pair in empty for pool in pair for part in kinds.parts(pool))


def rows_for(model, config, params, bw, context, lanes, steps, kvs, threads,
             flops_s: float) -> list[dict]:
    import torch

    layers, first = caches(config, lanes, context)
    wbytes = lc.weight_bytes(params)
    out, ref = [], None
    engines = [("transformers static", "float32", True, 1)]
    if context >= 16384:  # each engine at every thread count, the static cache too
        engines += [("transformers static", "float32", True, t) for t in threads if t != 1]
    for kv in kvs:
        engines += [("cacheidx paged kernel", kv, True, 1), ("cacheidx core reads", kv, False, 1)]
        if context >= 16384:
            engines += [("cacheidx paged kernel", kv, True, t) for t in threads if t != 1]
    for engine, kv, kernel, t in engines:
        floor = (wbytes + row_bytes(config, kv) * lanes * context) / bw
        flop_floor = step_flops(config, params, lanes, context) / flops_s
        torch.set_num_threads(t)
        t0 = time.perf_counter()
        try:
            if engine == "transformers static":
                toks, seconds = hf_static(model, layers, first, context, steps)
            else:
                toks, seconds = cacheidx_paged(config, params, layers, first, context, steps,
                                               kv, kernel)
        finally:
            torch.set_num_threads(1)
        ref = toks if ref is None else ref
        med, cpu = statistics.median(seconds), statistics.median(CPU_SECONDS)
        out.append({"context": context, "lanes": lanes, "engine": engine, "kv": kv,
                    "threads": t, "tokens_per_s": lanes / med, "step_ms": 1e3 * med,
                    "cpu_ms": 1e3 * cpu,
                    "fastest_ms": 1e3 * min(seconds), "slowest_ms": 1e3 * max(seconds),
                    "floor_ms": 1e3 * floor, "flop_floor_ms": 1e3 * flop_floor,
                    "same_tokens": toks == ref,
                    "wall_s": time.perf_counter() - t0})
        say(f"{engine} {kv} x{t} thread(s), {lanes} lanes x {context}: {lanes / med:.1f} "
            f"tokens/s (step {1e3 * med:.1f} ms, {1e3 * min(seconds):.1f} to "
            f"{1e3 * max(seconds):.1f}; CPU {1e3 * cpu:.1f} ms); floor {1e3 * floor:.1f} ms")
    return out


def report(rows: list[dict], bw: float, steps: int, flops_s: float) -> None:
    print(f"Decode over paged pools (pages of {PAGE}, shuffled), SmolLM2-135M's shape cut to 2 "
          f"layers, nothing shared, {steps} steps after one to warm up; the bytes floor reads the "
          f"weights and every lane's keys and values ({bw / 1e9:.1f} GB/s), the FLOPs floor "
          f"does the step's products at the one-thread rate ({flops_s / 1e9:.1f} GFLOP/s); "
          f"floor / step is the larger floor's.\n")
    print("| lanes | context | engine | pools | threads | tokens/s | vs transformers static "
          "| vs static, same threads | step ms (fastest-slowest) | CPU ms a step "
          "| vs static (CPU) | bytes floor ms | FLOPs floor ms | floor / step | same tokens |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|")

    def static(r, threads):
        return next((x for x in rows if x["engine"] == "transformers static"
                     and x["threads"] == threads and x["lanes"] == r["lanes"]
                     and x["context"] == r["context"]), None)

    for r in rows:
        base, same = static(r, 1), static(r, r["threads"])
        floor = max(r["floor_ms"], r["flop_floor_ms"])
        alike = "-" if same is None else f"{r['tokens_per_s'] / same['tokens_per_s']:.2f}x"
        print(f"| {r['lanes']} | {r['context']} | {r['engine']} | {r['kv']} | {r['threads']} "
              f"| {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x "
              f"| {alike} "
              f"| {r['step_ms']:.1f} ({r['fastest_ms']:.1f}-{r['slowest_ms']:.1f}) "
              f"| {r['cpu_ms']:.1f} | {base['cpu_ms'] / r['cpu_ms']:.2f}x "
              f"| {r['floor_ms']:.1f} | {r['flop_floor_ms']:.1f} | {floor / r['step_ms']:.2f} "
              f"| {'yes' if r['same_tokens'] else 'no'} |")


def kernel_alone(lanes: int, context: int, kv: str, calls: int, shuffled: bool = True) -> dict:
    """One layer's paged read by the kernel alone (see the module), on torch, one thread; the
    pages ``shuffled``, or each lane's in order, one lane after another."""
    import torch

    import cacheidx as ci
    from cacheidx import pools as kinds
    from cacheidx import quantized, turned
    from cacheidx.attention import layout, native
    from cacheidx.models import llama

    heads, g, d = 3, 3, 64
    rng = np.random.default_rng(0)
    table, n = shuffled_table(lanes, context)
    if not shuffled:
        table = np.sort(table, axis=None).reshape(table.shape)
    start, stop = np.zeros(lanes, np.int64), np.full(lanes, context, np.int64)
    q = torch.as_tensor(rng.standard_normal((lanes, heads, g, d), dtype=np.float32)) / 8
    pools = []
    for part in range(2):  # head-major pools as the engine makes them (page-aligned memory)
        x = torch.as_tensor(rng.standard_normal((n, heads, d), dtype=np.float32))
        if kv == "int4-turned":  # the engine's groups: keys', then values'
            pool = turned.zeros(n, heads, d, group=llama.turned_groups(d)[part], xp="torch",
                                layout="head")
            for into, made in zip(pool, turned.quantize(x, pool.group), strict=True):
                into[...] = made
        elif kv == "int8":
            pool = quantized.zeros(n, heads, d, bits=8, xp="torch", layout="head")
            codes, scales = quantized.quantize(x, 8)
            pool.codes[...], pool.scales[...] = codes, scales
        else:
            xp = ci.backends.get("torch").xp
            pool = layout.zeros(xp, n, heads, d, dtype=xp.float32, layout="head")
            pool[...] = x
        pools.append(pool)
    seconds = []
    for _ in range(calls + 1):
        c0 = time.process_time()
        if native.paged(q, table, start, stop, *pools) is None:
            raise SystemExit("the CPU kernel is not built here (see docs/backends.md)")
        seconds.append(time.process_time() - c0)
    seconds = seconds[1:]
    row = lanes * context * sum(p.nbytes for pool in pools for p in kinds.parts(pool)) // n
    med = statistics.median(seconds)
    return {"lanes": lanes, "context": context, "kv": kv, "shuffled": shuffled,
            "cpu_ms": 1e3 * med,
            "fastest_ms": 1e3 * min(seconds), "gb_per_s": row / med / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--lanes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kv", nargs="+", default=["float32", "int8"],
                   choices=["float32", "int8", "int4-turned"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--kernel", action="store_true", help="time the kernel alone, one layer")
    args = p.parse_args(argv)
    if args.kernel:
        print("| lanes | context | pools | pages | kernel CPU ms, one layer (fastest) | GB/s |")
        print("|---:|---:|---|---|---|---:|")
        for lanes in args.lanes:
            for context in args.contexts:
                for kv in args.kv:
                    for shuffled in (True, False):
                        r = kernel_alone(lanes, context, kv, args.steps, shuffled)
                        print(f"| {lanes} | {context} | {kv} "
                              f"| {'shuffled' if shuffled else 'in order'} | {r['cpu_ms']:.1f} "
                              f"({r['fastest_ms']:.1f}) | {r['gb_per_s']:.2f} |", flush=True)
        return 0
    lc.timed_steps = timed_on_cpu
    bw, flops_s = lc.bandwidth(), flop_rate()
    say(f"one-thread read speed {bw / 1e9:.1f} GB/s, product rate {flops_s / 1e9:.1f} GFLOP/s")
    model, config, params, _ = lc.load("shaped")
    rows = []
    for lanes in args.lanes:
        for context in args.contexts:
            rows += rows_for(model, config, params, bw, context, lanes, args.steps, args.kv,
                             args.threads, flops_s)
    report(rows, bw, args.steps, flops_s)
    if args.json:
        Path(args.json).write_text(json.dumps({"decode": rows, "bandwidth": bw,
                                               "flop_rate": flops_s,
                                               "steps": args.steps}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
