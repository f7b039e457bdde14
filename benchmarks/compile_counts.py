"""Compile counts: how many programs a decode step of the tiny Llama compiles over 64 steps
whose positions, tables and row maps change, and how many more a structural change costs.

    python benchmarks/compile_counts.py [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import cacheidx as ci
from cacheidx.models.llama import Config, empty_pools, forward, random_params

CFG = Config.tiny()


def steps(n: int, seed: int = 0):
    """Indices of one decode token for 4 lanes over 3 sequences: random positions, permuted
    tables, row maps with padding lanes."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        pos = rng.integers(0, 16, (4, 1))
        table = rng.permutation(64)[:48].reshape(3, 16)
        row = rng.integers(-1, 3, 4)
        yield pos, table, row


def count(name: str, n: int) -> dict:
    backend = ci.backends.get(name)
    xp = backend.xp
    if hasattr(backend, "compiler"):
        backend.compiler = "aot_eager"
    backend.forget()
    params = random_params(CFG, xp=xp)
    pools = empty_pools(CFG, 64, like=params["embed"])

    def step(params, tokens, index, pools):
        return forward(params, CFG, tokens, index, pools)

    jitted = backend.jit(step)
    tokens = xp.asarray(np.zeros((4, 1), np.int64))
    as_index = None
    for pos, table, row in steps(n):
        as_index = ci.make(xp.asarray(pos), xp.asarray(table), row=xp.asarray(row))
        _, pools = jitted(params, tokens, as_index, pools)
    values = backend.programs(jitted)
    changes = {}
    for label, changed in (("window 8", as_index.window(8)), ("window 4", as_index.window(4)),
                           ("select k=4", as_index.select(xp.asarray(np.zeros((4, 1, 4),
                                                                             np.int64))))):
        before = backend.programs(jitted)
        jitted(params, tokens, changed, pools)
        changes[label] = backend.programs(jitted) - before
    before = backend.programs(jitted)
    jitted(params, tokens, as_index, pools)
    return {"backend": name, "compiler": getattr(backend, "compiler", "jit"), "steps": n,
            "programs for the steps": values, "back to the first structure": (
                backend.programs(jitted) - before), **{f"+{k}": v for k, v in changes.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--quick", action="store_true", help="8 steps instead of 64")
    args = parser.parse_args()
    n = 8 if args.quick else 64
    rows = [count(name, n) for name in ("jax", "torch") if name in ci.backends.available()]
    keys = [k for k in rows[0] if k not in ("backend",)] if rows else []
    print("| backend | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['backend']} | " + " | ".join(str(r[k]) for k in keys) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
