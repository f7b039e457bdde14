"""extend against a plain hand-written NumPy scatter + gather doing the same work.

Decode: batch 32, one token each, context 4096, pool rows of 128 float32, a donated pool.
Prefill: batch 4, 512 new tokens each after 1024 cached, same context and rows.
"New index" times a step's first layer (the index is built and its slots computed); "later
layers" reuse what the index kept. The baseline stores with fancy indexing, reads with
``take`` and zeroes the columns past each lane's last position, which is the work extend's
laws ask for on these indices.

    python benchmarks/extend.py [--json PATH] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import cacheidx as ci

CONTEXT, WIDTH = 4096, 128


def shapes(batch: int, seq: int, cached: int, seed: int = 0):
    """A paged allocation: each lane's context scattered over a permuted pool."""
    rng = np.random.default_rng(seed)
    slots = batch * CONTEXT
    table = rng.permutation(slots).reshape(batch, CONTEXT).astype(np.int64)
    pos = np.broadcast_to(np.arange(cached, cached + seq), (batch, seq)).astype(np.int64)
    values = rng.standard_normal((batch, seq, WIDTH), dtype=np.float32)
    pool = rng.standard_normal((slots, WIDTH), dtype=np.float32)
    return pos, table, values, pool


def baseline(pos, table, values, pool):
    b = np.arange(pos.shape[0])[:, None]
    pool[table[b, pos]] = values
    seen = pool.take(table, axis=0)
    seen[np.arange(CONTEXT)[None, :] > pos[:, -1:]] = 0
    return seen, pool


def with_index(index, values, pool):
    return index.extend(values, pool, donate=True)


def with_fresh_index(pos, table, values, pool):
    """A decode step's first layer: the index is new, nothing of it is kept yet."""
    return ci.make(pos, table).extend(values, pool, donate=True)


def best(fn, *args, repeat: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return min(times)


def measure(name: str, batch: int, seq: int, cached: int, repeat: int) -> dict:
    pos, table, values, pool = shapes(batch, seq, cached)
    index = ci.make(pos, table)
    want, _ = baseline(pos, table, values, pool.copy())
    got, _ = with_index(index, values, pool.copy())
    assert np.array_equal(want, got), "extend and the baseline disagree"
    t_fresh = best(with_fresh_index, pos, table, values, pool, repeat=repeat)
    t_index = best(with_index, index, values, pool, repeat=repeat)
    t_base = best(baseline, pos, table, values, pool, repeat=repeat)
    return {"case": name, "batch": batch, "seq": seq, "context": CONTEXT, "row": WIDTH,
            "first_layer_ms": round(t_fresh * 1e3, 3), "extend_ms": round(t_index * 1e3, 3),
            "baseline_ms": round(t_base * 1e3, 3), "ratio_first": round(t_fresh / t_base, 3),
            "ratio": round(t_index / t_base, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    rows = [measure("decode", 32, 1, 2048, args.repeat),
            measure("prefill", 4, 512, 1024, max(3, args.repeat // 4))]
    print("| case | batch x seq | hand-written (ms) | extend, new index (ms) | ratio "
          "| extend, later layers (ms) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['batch']} x {r['seq']} | {r['baseline_ms']} | "
              f"{r['first_layer_ms']} | {r['ratio_first']} | {r['extend_ms']} | {r['ratio']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": "numpy", "numpy": np.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
