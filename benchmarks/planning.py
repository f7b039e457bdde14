"""Host time a decode step spends planning: a new index's plan against ``advance()``'s carried
one (8 lanes of 4,096 tokens by default, one attention layer's plan, one thread).

``python benchmarks/planning.py [--lanes 8] [--context 4096] [--repeat 50]`` prints the median
and spread of each (milliseconds): the plan found anew (a fresh ``ci.make`` each step), and
``advance()``'s (the runs carried, the rest anew). The pools have one head of one element, so
that a step's time is its plan's: what it reads is the same either way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import cacheidx as ci  # noqa: E402


def step(index, q, k, v, kpool, vpool):
    t0 = time.perf_counter()
    index.attend(q, k, v, kpool, vpool, donate=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=50)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    kv, heads, d, b = 1, 1, 1, a.lanes
    slots = a.context + a.repeat + 2
    kpool = rng.standard_normal((b * slots, kv, d), dtype=np.float32)
    vpool = rng.standard_normal((b * slots, kv, d), dtype=np.float32)
    q = rng.standard_normal((b, 1, heads, d), dtype=np.float32)
    k = rng.standard_normal((b, 1, kv, d), dtype=np.float32)
    v = rng.standard_normal((b, 1, kv, d), dtype=np.float32)
    index = ci.rows(slots, [a.context] * b).advance()
    fresh, carried = [], []
    step(index, q, k, v, kpool, vpool)
    for _ in range(a.repeat):
        nxt = index.advance()
        again = ci.make(nxt.pos.copy(), nxt.table.copy())
        fresh.append(step(again, q, k, v, kpool, vpool))
        carried.append(step(nxt, q, k, v, kpool, vpool))
        index = nxt
    for name, xs in (("found anew", fresh), ("carried by advance()", carried)):
        ms = [1e3 * x for x in xs]
        print(f"{name:>22}: median {statistics.median(ms):.3f} ms "
              f"(min {min(ms):.3f}, max {max(ms):.3f})")


if __name__ == "__main__":
    main()
