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

``--serve`` times the engine itself: :class:`cacheidx.serve.Engine` serving ``--lanes``
requests of about ``--context`` prompt tokens each (lane ``b``'s ``3 b`` fewer, so that the
lanes reach their pages on different steps), ``--repeat`` tokens each, through a model of two
attention layers of one head of one element (what a step reads costs next to nothing, so that
its time is its plan's), on ``--backend``. Host planning per decode step is the time from the
step's start (:meth:`cacheidx.serve.step.Step.run`: the scheduler's batch in hand) to the end
of its first layer's call, less its second layer's call (the same index, its plan kept: a
layer's own work), in the thread's CPU time (``time.thread_time``: another job's time on a
loaded machine is not counted; one thread computes it all). ``carried`` is the engine as it
is; ``anew`` every decode call's index made afresh (``ci.make``, as the engine made it before
it carried its plan). It also counts the plan's read parts made on the steps where no lane
joined, left or reached a page.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

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
    # the writer's word: cacheidx.plan.refilled (CacheIndex.refilled before it moved there;
    # neither on the commits before host-first plans)
    refill = getattr(ci.plan, "refilled", None) or getattr(ci.CacheIndex, "refilled", None)
    declares = refill is not None
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
                    refill(ix, [row, pos, h])
            ix.attend(q, k, v, *pools, donate=True)
            t1 = time.perf_counter()
            ix.attend(q, k, v, *pools, donate=True)  # the same layer again: its plan kept
            t2 = time.perf_counter()
            if i:  # the first step warms up
                out[way].append((t1 - t0) - (t2 - t1))
    return out


class _PlanningModel:
    """Two attention layers of one kv head of one element over ``index``, the first and
    second call timed (``self.calls``): a model whose step costs its plan and little else."""

    vocab = 64

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, float]] = []

    def place(self, xp, device):
        return {"xp": xp, "device": device}

    def pools(self, weights, slots, kv=None):
        xp, device = weights["xp"], weights["device"]
        return [tuple(xp.zeros((slots, 1, 1), dtype=xp.float32, device=device)
                      for _ in range(2))]

    def forward(self, weights, tokens, index, pools):
        xp, device = weights["xp"], weights["device"]
        b, s = tokens.shape
        q = xp.ones((b, s, 1, 1), dtype=xp.float32, device=device)
        (kpool, vpool), = pools
        t0 = time.thread_time()
        _, kpool, vpool = index.attend(q, q, q, kpool, vpool, donate=True)
        t1 = time.thread_time()
        _, kpool, vpool = index.attend(q, q, q, kpool, vpool, donate=True)
        t2 = time.thread_time()
        self.calls.append((t0, t1, t2))
        return xp.zeros((b, self.vocab), dtype=xp.float32, device=device), [(kpool, vpool)]


def serve(lanes: int, context: int, repeat: int, backend: str = "numpy",
          page_size: int = 16) -> dict[str, Any]:
    """Seconds of host planning in each engine decode step, carried (the engine as it is: the
    first ``repeat`` decode steps) then made anew (every decode call's index a fresh
    ``ci.make``: the next ``repeat``), in one engine (its prompts computed once), and the read
    parts made on steady steps (no lane joined, left or reached a page), each way."""
    from cacheidx.plan import Plan
    from cacheidx.serve import Engine, Request
    from cacheidx.serve.step import Step

    model, steps, parts = _PlanningModel(), [], [0]
    run, part = Step.run, Plan.part

    def timed(self, batch, *args, **kwargs):
        anew = batch.kind == "decode" and sum(s[0] == "decode" for s in steps) > repeat
        if anew:
            self._fed = None
        quiet = batch.kind == "decode" and batch.follows and not np.any(
            batch.pos % page_size == 0)
        before, start = parts[0], time.thread_time()
        got = run(self, batch, *args, **kwargs)
        steps.append((batch.kind, "anew" if anew else "carried", start, len(model.calls) - 1,
                      quiet, parts[0] - before))
        return got

    def counted(self, kind, key, make, keep=None):
        def making():
            value = make()
            if kind != "store":  # a step's own slots: made every step by nature
                parts[0] += 1
            return value
        return part(self, kind, key, making, keep)

    Step.run, Plan.part = timed, counted
    try:
        engine = Engine(model, backend=backend, page_size=page_size, lanes=lanes,
                        pages=lanes * (-(-(context + 2 * repeat) // page_size) + 1) + 8,
                        chunk=min(4096, context), clock="steps", cache=False)
        engine.run([Request(b, [1] * (context - 3 * b), 2 * repeat + 2) for b in range(lanes)])
    finally:
        Step.run, Plan.part = run, part
    out: dict[str, Any] = {"carried": [], "anew": [], "parts": {"carried": [0, 0],
                                                                 "anew": [0, 0]},
                           "index": {"carried": [], "anew": []}}
    decode = [s for s in steps if s[0] == "decode"]
    for k, (_, way, start, call, quiet, made) in enumerate(decode):
        if k in (0, repeat + 1):  # each way's first step warms up (anew: it starts over)
            continue
        t0, t1, t2 = model.calls[call]
        out[way].append((t1 - start) - (t2 - t1))
        out["index"][way].append(t0 - start)  # the step's index made, before any layer
        if quiet:
            out["parts"][way][0] += made
            out["parts"][way][1] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--native-off", action="store_true")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--backend", default="numpy")
    a = ap.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    if a.serve:
        import contextlib

        from cacheidx.attention import native

        with native.off() if a.native_off else contextlib.nullcontext():
            found = serve(a.lanes, a.context, a.repeat, a.backend)
        for name in ("carried", "anew"):
            ms = sorted(1e3 * x for x in found[name])
            made, steps = found["parts"][name]
            print(f"{a.backend} {a.lanes} x {a.context} engine planning {name:>8}: median "
                  f"{statistics.median(ms):.3f} ms, min {ms[0]:.3f}, quartiles "
                  f"{statistics.quantiles(ms, n=4)[0]:.3f} to "
                  f"{statistics.quantiles(ms, n=4)[2]:.3f} ({len(ms)} steps), the index "
                  f"made before the layers {1e3 * statistics.median(found['index'][name]):.3f}"
                  f" ms; read parts made on {steps} steady steps: {made}")
        return
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
