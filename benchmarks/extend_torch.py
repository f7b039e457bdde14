"""Donated ``extend`` on torch: does its cost stay in the tokens and the context, never in the
pool's slots, and how far is it from the write and read a static-cache decoder does by hand?

One decode step: ``batch`` lanes of one token each, tables ``context`` wide, rows of
``width`` float32. Each pool size runs, in one process and interleaved round by round:

- ``extend``: ``index.extend(values, pool, donate=True)``, eager and compiled
  (``torch.compile(fullgraph=True, dynamic=False)``, inductor);
- ``baseline``: ``pool.index_copy_(0, slots, values)`` then ``pool.index_select(0, table)``,
  eager and compiled, with no dropping and no zeroing (it trusts its inputs and leaves the
  unseen columns to the attention mask), the work a static-cache decoder does today.

Layouts: ``same`` reads the same slots at every pool size (so a cost that grows with the
pool is the pool's alone), ``spread`` reads slots spread over the whole pool (paged
allocation; a random read over a larger pool also costs the memory system more, which the
baseline pays too). Ratios use the fastest round (the machine may be shared), by the wall
clock and by the process's CPU clock (which a shared machine disturbs less; with
``--threads 1`` it is the work of the one thread); medians are shown beside them.

    python benchmarks/extend_torch.py [--slots 12 22] [--json PATH] [--no-compile] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cacheidx as ci  # noqa: E402


def workload(slots: int, batch: int, context: int, width: int, layout: str, seed: int = 0):
    """(index, values, pool, table, write slots) of one decode step over a pool of ``slots``."""
    g = torch.Generator().manual_seed(seed)
    lane = torch.arange(batch)[:, None]
    if layout == "same":  # lane b reads a run of the first 4096 slots from b * 128, wrapping
        table = (lane * 128 + torch.arange(context)[None, :]) % min(slots, 4096)
    else:  # distinct slots anywhere in the pool
        table = torch.randperm(slots, generator=g)[: batch * context].reshape(batch, context)
    pos = context // 2 + lane  # mid-decode: half the columns are seen
    index = ci.make(pos, table)
    values = torch.randn(batch, 1, width, generator=g)
    pool = torch.randn(slots, width, generator=g)
    writes = table.gather(1, pos).reshape(-1)
    assert writes.unique().numel() == batch, "write targets must be distinct"
    return index, values, pool, table, writes


def extend(index, values, pool):
    return index.extend(values, pool, donate=True)


def baseline(table, writes, values, pool):
    pool.index_copy_(0, writes, values.reshape(-1, values.shape[-1]))
    seen = pool.index_select(0, table.reshape(-1))
    return seen.reshape(*table.shape, pool.shape[-1]), pool


def measure(calls: dict, rounds: int) -> dict:
    """(wall, CPU) seconds of each call, interleaved round by round, after two warm-up calls
    each. The CPU time is the process's: on a shared machine it counts the work, not the wait
    for a core."""
    for fn in calls.values():
        fn()
        fn()
    times = {name: ([], []) for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[name][1].append(time.process_time() - c)
            times[name][0].append(time.perf_counter() - t)
    return times


def bench(args, log2: int, layout: str) -> list:
    """The rows of one pool size and layout."""
    index, values, pool, table, writes = workload(2**log2, args.batch, args.context,
                                                  args.width, layout)
    calls = {
        ("extend", "eager"): lambda: extend(index, values, pool),
        ("baseline", "eager"): lambda: baseline(table, writes, values, pool),
    }
    if args.compile:
        fast = torch.compile(extend, fullgraph=True, dynamic=False)
        fast_base = torch.compile(baseline, fullgraph=True, dynamic=False)
        calls[("extend", "compiled")] = lambda: fast(index, values, pool)
        calls[("baseline", "compiled")] = lambda: fast_base(table, writes, values, pool)
        # the compiled extend writes into the caller's pool and agrees with eager
        seen, out = fast(index, values, pool)
        assert out.data_ptr() == pool.data_ptr()
        assert torch.equal(seen, extend(index, values, pool)[0])
    times = measure(calls, args.rounds)
    return [{"slots_log2": log2, "layout": layout, "what": what, "mode": mode,
             "min_ms": min(wall) * 1e3, "median_ms": statistics.median(wall) * 1e3,
             "cpu_min_ms": min(cpu) * 1e3}
            for (what, mode), (wall, cpu) in times.items()]


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for log2 in args.slots:
        for layout in ["same"] + (["spread"] if 2**log2 >= args.batch * args.context else []):
            rows += bench(args, log2, layout)
            gc.collect()  # one pool at a time
            torch._dynamo.reset()
    return {"config": {**vars(args), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "machine": platform.machine(),
                       "processor": platform.processor()},
            "rows": rows, "ratios": ratios(rows, args.slots, "min_ms"),
            "cpu_ratios": ratios(rows, args.slots, "cpu_min_ms")}


def ratios(rows: list, slots: list, clock: str) -> dict:
    """The targets' ratios, from the fastest round by the wall clock ("min_ms") or by the
    CPU clock ("cpu_min_ms")."""
    def t(log2, what, mode, layout="same"):
        for r in rows:
            if (r["slots_log2"], r["what"], r["mode"], r["layout"]) == (log2, what, mode, layout):
                return r[clock]
        return None

    out = {}
    lo, hi = min(slots), max(slots)
    for mode in ("eager", "compiled"):
        a, b = t(lo, "extend", mode), t(hi, "extend", mode)
        if a and b and lo != hi:
            out[f"extend {mode}: 2^{hi} / 2^{lo} slots"] = b / a
        for log2 in slots:
            for layout in ("same", "spread"):
                e, base = t(log2, "extend", mode, layout), t(log2, "baseline", mode, layout)
                if e and base:
                    out[f"extend / baseline, {mode}, 2^{log2} slots, {layout}"] = e / base
    return out


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"extend, donated: batch {c['batch']}, context {c['context']}, rows of "
             f"{c['width']} float32; torch {c['torch']}, {c['threads']} threads; "
             f"{c['rounds']} rounds, interleaved", "",
             "| slots | layout | what | mode | min ms | median ms | min CPU ms |",
             "|---|---|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| 2^{r['slots_log2']} | {r['layout']} | {r['what']} | {r['mode']} | "
                     f"{r['min_ms']:.2f} | {r['median_ms']:.2f} | {r['cpu_min_ms']:.2f} |")
    lines += ["", "| ratio (fastest rounds) | wall | CPU |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.2f} | {result['cpu_ratios'][k]:.2f} |"
              for k, v in result["ratios"].items()]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, nargs="+", default=[12, 22],
                   help="log2 of each pool size (default 12 22)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: tiny sizes, eager only")
    p.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.slots, args.batch, args.context, args.width = [6, 10], 4, 16, 8
        args.rounds, args.compile = 3, False
    result = run(args)
    print(markdown(result))
    if args.json:
        cfg = result["config"]
        cfg["json"] = str(cfg["json"])
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
