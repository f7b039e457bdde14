"""Jitted extend with a donated pool, at 2^12 and 2^22 slots, against a hand-written jitted
``.at[].set(mode="drop")`` + ``take`` doing the same work.

Decode: batch 32, one token each, context 4096, pool rows of 128 float32 (a 2^22-slot pool is
2 GiB). The index is the same for both pool sizes, so the tokens, the context and every slot
read are the same and only the pool's size differs: 32 samples drawn from one prompt of 4064
tokens, which all hold slots 0 to 4063 (a shared prefix), each storing its first own token at
slot 4064 + lane; columns 4065 to 4095 are unallocated (-1). The spec's law: with the pool
donated, a step costs the call's tokens and context, never the pool's slots, so
time(2^22) / time(2^12) stays near 1.

A second layout, "paged", gives every lane its own 4096 slots scattered over the whole 2^22
pool (a random permutation), so the read really ranges over 2 GiB; it is compared with the
baseline only (a 2^12 pool cannot hold it).

The baseline stores with ``pool.at[slots].set(values, mode="drop")`` and reads with
``jnp.take(..., mode="fill")`` after sending every column no token sees to a slot past the pool,
which is what extend's laws ask for on these indices; the two are checked equal before timing.
Both are ``jax.jit`` programs with the pool donated (``donate_argnums``) and threaded from one
call to the next, as a decode loop does.

    python benchmarks/extend_jax.py [--json PATH] [--repeat N] [--width W] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import cacheidx as ci

BATCH, CONTEXT = 32, 4096


def shared_prefix(context: int) -> tuple[np.ndarray, np.ndarray]:
    """pos [32, 1], table [32, context]: one prompt of context - 32 tokens at slots shared by
    every lane, then one own slot per lane (``context`` slots in all)."""
    prefix = context - BATCH
    table = np.full((BATCH, context), -1, np.int64)
    table[:, :prefix] = np.arange(prefix)
    table[:, prefix] = prefix + np.arange(BATCH)
    return np.full((BATCH, 1), prefix, np.int64), table


def paged(slots: int, context: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """pos [32, 1], table [32, context]: every lane's slots drawn at random from the whole
    pool, at the same positions as ``shared_prefix``."""
    prefix = context - BATCH
    rng = np.random.default_rng(seed)
    table = rng.choice(slots, size=(BATCH, context), replace=False).astype(np.int64)
    table[:, prefix + 1:] = -1
    return np.full((BATCH, 1), prefix, np.int64), table


def with_index(index, values, pool):
    return index.extend(values, pool)


def by_hand(pos, table, values, pool):
    """The same store and read written directly: slots of the tokens' columns, a store that
    drops what addresses nothing, a read that is zero past each lane's position and at -1."""
    n, context = pool.shape[0], table.shape[1]
    t = pos[:, 0]
    slot = jnp.take_along_axis(table, pos, axis=1)[:, 0]
    slot = jnp.where((t >= 0) & (t < context) & (slot >= 0) & (slot < n), slot, n)
    pool = pool.at[slot].set(values[:, 0], mode="drop")
    ok = (table >= 0) & (table < n) & (jnp.arange(context)[None, :] <= t[:, None])
    seen = jnp.take(pool, jnp.where(ok, table, n), axis=0, mode="fill", fill_value=0)
    return seen, pool


EXTEND = jax.jit(with_index, donate_argnums=2)
BASELINE = jax.jit(by_hand, donate_argnums=3)


class Pool:
    """A donated pool, threaded from one compiled call to the next (one per pool size)."""

    def __init__(self, slots: int, width: int):
        # row s holds s: cheap to build at 2 GiB, and a read from the wrong slot shows
        self.array = jax.lax.broadcasted_iota(jnp.float32, (slots, width), 0)


class Runner:
    """One compiled step over a shared donated pool."""

    def __init__(self, step, args, pool: Pool):
        self.step, self.args, self.pool = step, args, pool

    def once(self) -> float:
        start = time.perf_counter()
        seen, self.pool.array = self.step(*self.args, self.pool.array)
        seen.block_until_ready()
        self.pool.array.block_until_ready()
        return time.perf_counter() - start


def timed(runners: dict, repeat: int, warmup: int = 2) -> dict:
    """Median seconds per call of each runner, calls interleaved so that drift (frequency,
    other load, the allocator) hits all of them alike."""
    for _ in range(warmup):
        for r in runners.values():
            r.once()
    times = {k: [] for k in runners}
    for _ in range(repeat):
        for k, r in runners.items():
            times[k].append(r.once())
    return {k: statistics.median(v) for k, v in times.items()}


def runners(layout: str, pool: Pool, width: int, context: int) -> dict:
    """extend and the baseline on one layout, after checking they give the same outputs."""
    slots = pool.array.shape[0]
    pos_np, table_np = (shared_prefix(context) if layout == "shared prefix"
                        else paged(slots, context))
    pos, table = jnp.asarray(pos_np), jnp.asarray(table_np)
    index = ci.make(pos, table)
    values = jax.random.normal(jax.random.key(1), (BATCH, 1, width), jnp.float32)
    got = jax.jit(with_index)(index, values, pool.array)
    want = jax.jit(by_hand)(pos, table, values, pool.array)
    for g, w in zip(got, want):
        assert np.array_equal(np.asarray(g), np.asarray(w)), f"{layout}: extend != baseline"
    del got, want
    return {(layout, slots, "extend"): Runner(EXTEND, (index, values), pool),
            (layout, slots, "baseline"): Runner(BASELINE, (pos, table, values), pool)}


def undonated(pool: Pool, width: int, context: int, repeat: int) -> float:
    """Milliseconds per jitted extend whose pool is not donated (so copied), for contrast."""
    pos, table = map(jnp.asarray, shared_prefix(context))
    step = jax.jit(with_index)
    values = jnp.zeros((BATCH, 1, width), jnp.float32)
    r = Runner(step, (ci.make(pos, table), values), pool)
    return round(timed({"x": r}, repeat, warmup=1)["x"] * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--width", type=int, default=128, help="floats per slot (default 128)")
    parser.add_argument("--context", type=int, default=CONTEXT, help="columns per lane")
    parser.add_argument("--small", type=int, default=12, help="log2 slots of the small pool")
    parser.add_argument("--large", type=int, default=22, help="log2 slots of the large pool")
    parser.add_argument("--copies", type=int, default=3,
                        help="calls of the undonated (copying) step to time, 0 for none")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: context 256, 2^8 and 2^14 slots, 3 calls each")
    args = parser.parse_args()
    if args.quick:
        args.context, args.small, args.large, args.repeat, args.copies = 256, 8, 14, 3, 1
    small, large, w, context = 2 ** args.small, 2 ** args.large, args.width, args.context
    if small < context or large < BATCH * context:
        parser.error(f"the small pool needs {context} slots and the large {BATCH * context}")
    pools = {n: Pool(n, w) for n in (small, large)}
    steps = {}
    for layout, n in (("shared prefix", small), ("shared prefix", large), ("paged", large)):
        steps.update(runners(layout, pools[n], w, context))
    t = timed(steps, args.repeat)
    rows = []
    for layout, n in (("shared prefix", small), ("shared prefix", large), ("paged", large)):
        e, b = t[(layout, n, "extend")], t[(layout, n, "baseline")]
        rows.append({"layout": layout, "slots": n, "log2_slots": n.bit_length() - 1,
                     "batch": BATCH, "seq": 1, "context": context, "row": w,
                     "pool_mib": n * w * 4 / 2**20, "extend_ms": round(e * 1e3, 3),
                     "baseline_ms": round(b * 1e3, 3), "extend_over_baseline": round(e / b, 3)})
    copy_ms = undonated(pools[large], w, context, args.copies) if args.copies else None
    scaling = round(rows[1]["extend_ms"] / rows[0]["extend_ms"], 3)
    base_scaling = round(rows[1]["baseline_ms"] / rows[0]["baseline_ms"], 3)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, batch {BATCH} x 1 token, "
          f"context {context}, rows of {w} float32, median of {args.repeat}\n")
    print("| layout | slots | pool (MiB) | extend (ms) | hand-written (ms) "
          "| extend / hand-written |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | 2^{r['log2_slots']} | {r['pool_mib']:.0f} | {r['extend_ms']} | "
              f"{r['baseline_ms']} | {r['extend_over_baseline']} |")
    print(f"\n| ratio | extend | hand-written | target |\n|---|---|---|---|\n"
          f"| time(2^{args.large}) / time(2^{args.small}), donated, compiled | {scaling} | "
          f"{base_scaling} | <= 1.2 |\n"
          f"| extend / hand-written, worst layout | "
          f"{max(r['extend_over_baseline'] for r in rows)} | - | <= 1.1 |")
    if copy_ms is not None:
        print(f"\nFor contrast, a jitted extend at 2^{args.large} slots whose pool is not "
              f"donated (so copied): {copy_ms} ms.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": "jax", "jax": jax.__version__,
                       "device": str(jax.devices()[0]), "machine": platform.machine(),
                       "rows": rows, "slots_ratio": scaling, "baseline_slots_ratio": base_scaling,
                       "undonated_ms": copy_ms, "targets": {"slots_ratio": 1.2,
                                                            "extend_over_baseline": 1.1}},
                      f, indent=2)


if __name__ == "__main__":
    main()
