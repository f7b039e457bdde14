"""Host time a decode step spends planning: a new index's plan against ``advance()``'s carried
one (8 lanes of 4,096 tokens by default, one attention layer's plan, one thread).

``python benchmarks/planning.py [--lanes 8] [--context 4096] [--repeat 50]`` prints the median
and spread of each (milliseconds): the plan found anew (a fresh ``ci.make`` each step), and
``advance()``'s (the runs carried, the rest anew). The pools have one head of one element, so
that a step's time is its plan's: what it reads is the same either way.

``--engine`` times the serving engine's decode step as :mod:`cacheidx.serve.step` makes it:
the scheduler's host table (pages of 16 slots, a lane's next page written as it reaches it,
the table then put on the device again with its host copy) and each step's index the last
one's ``advance(table=, host=)`` (carried), against a fresh ``ci.make`` over the same table
each step (anew), each with the host values declared where the code has them (issue 36). With
``--native-off`` the CPU kernel is kept out, so that the core's runs plan is timed.
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


def engine(lanes: int, context: int, repeat: int) -> dict[str, list[float]]:
    """Seconds of host planning in each engine decode step (carried by ``advance(table=,
    host=)``, and made anew): the step's index made and its first layer's call, less a second
    call through the same index (its plan then kept: the layer's own work), over one table the
    steps write pages into."""
    P = 16
    rng = np.random.default_rng(0)
    width = -(-(context + repeat + 2) // P) * P
    pools = [rng.standard_normal((lanes * width, 1, 1), dtype=np.float32) for _ in range(2)]
    q, k, v = (rng.standard_normal((lanes, 1, 1, 1), dtype=np.float32) for _ in range(3))
    base = np.arange(lanes)[:, None] * width
    declares = hasattr(ci.CacheIndex, "refilled")
    row = np.arange(lanes, dtype=np.int64)
    out: dict[str, list[float]] = {"carried": [], "anew": []}
    for way in out:
        have = -(-(context + 1) // P) * P  # the columns a lane's pages cover
        t = np.full((lanes, width), -1, dtype=np.int64)
        t[:, :have] = base + np.arange(have)
        tab = h = ix = None
        for i in range(repeat + 1):
            at = context + i  # each lane's position
            if at >= have:  # the lane reaches a page it lacks: the scheduler writes it
                t[:, have:have + P] = base + np.arange(have, have + P)
                have, tab = have + P, None
            t0 = time.perf_counter()
            if tab is None:  # the engine puts a changed table again, with its host copy
                h = np.array(t)
                tab = h.copy()
            if way == "carried" and ix is not None:
                ix = (ix.advance(table=tab, host=[h]) if declares
                      else ix.advance(table=tab))
            else:
                pos = np.full((lanes, 1), at, dtype=np.int64)
                ix = ci.make(pos.copy(), tab, row=row.copy())
                if declares:
                    ix.refilled([row, pos, h])
            ix.attend(q, k, v, *pools, donate=True)
            t1 = time.perf_counter()
            ix.attend(q, k, v, *pools, donate=True)  # the same layer again: its plan kept
            t2 = time.perf_counter()
            if i:  # the first step warms up
                out[way].append((t1 - t0) - (t2 - t1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--native-off", action="store_true")
    a = ap.parse_args()
    if a.engine:
        import contextlib

        from cacheidx.attention import native

        with native.off() if a.native_off else contextlib.nullcontext():
            found = engine(a.lanes, a.context, a.repeat)
        for name, xs in found.items():
            ms = [1e3 * x for x in xs]
            q1, mid, q3 = statistics.quantiles(ms, n=4)
            print(f"{a.lanes} x {a.context} planning {name:>8}: median {mid:.3f} ms "
                  f"(quartiles {q1:.3f} to {q3:.3f}; a difference of two timings, so noise "
                  "makes some negative)")
        return
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
