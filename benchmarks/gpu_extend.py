"""One decode step's extend on a GPU, against the store and gather a static-cache decoder writes
by hand and a device copy of the gather's bytes (the floor), on every GPU backend present.

A decode step: B lanes of one token, tables CTX wide, pool rows of W float32, random paged
tables (every lane's slots drawn without replacement from the whole pool), each lane at
position CTX/2 + lane (so about half the columns are seen and the rest must read zero).
"Hand-written" is what a static-cache decoder does, with no dropping and no zeroing:
``index_copy_`` + ``index_select`` (torch), ``.at[].set`` + ``take`` (jax), ``pool[w] = v`` +
``take`` (cupy). "Copy" is a device copy of as many bytes as the gather writes. Backends: torch
eager, torch inductor (``torch.compile``), jax jit, cupy, where each is installed and sees a
GPU. Timed with CUDA events (torch, cupy) or ``block_until_ready`` (jax): the median of 20 calls
after warm-up. Then the donated extend at 2^24 slots against 2^17 (the same table, drawn from
the first 2^17 slots): a cost in the slots would show as a ratio above 1.

    python benchmarks/gpu_extend.py [--json PATH] [--backend NAME ...] [--cpu] [--quick]

Without a GPU it says so and exits 0 (its JSON says so too); ``--cpu`` measures the same rows on
the CPU instead (a check of the script: ``--quick`` makes the sizes tiny).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cacheidx as ci  # noqa: E402

SIZES = [(32, 4096, 128), (64, 8192, 1024)]
QUICK = [(4, 64, 8), (8, 128, 32)]
DONATED = (17, 24)  # log2 slots: the same table in a pool of 2^17 and of 2^24 slots
REPEAT, WARMUP = 20, 3


def say(msg: str) -> None:
    print(f"    {msg}", flush=True)  # indented: run_all.py keeps only the tables


# -- the workload, in NumPy ------------------------------------------------------------------
def workload(batch: int, context: int, width: int, slots: int, *, within: int | None = None,
             seed: int = 0):
    """pos [B, 1], table [B, CTX] (distinct slots, from the first ``within`` where given),
    values [B, 1, W], pool [slots, W], the written slots [B]."""
    rng = np.random.default_rng(seed)
    table = rng.choice(within or slots, size=batch * context, replace=False)
    table = table.reshape(batch, context).astype(np.int64)
    pos = (context // 2 + np.arange(batch))[:, None].astype(np.int64)
    values = rng.standard_normal((batch, 1, width), dtype=np.float32)
    pool = rng.standard_normal((slots, width), dtype=np.float32)
    writes = np.take_along_axis(table, pos, axis=1)[:, 0]
    return pos, table, values, pool, writes


def pool_slots(batch: int, context: int) -> int:
    """The smallest power of two holding every lane's slots (the tables are distinct)."""
    return 1 << max(0, int(batch * context - 1).bit_length())


# -- one backend: how to place arrays, and how to time ---------------------------------------
class Torch:
    def __init__(self, device: str, compiled: bool):
        import torch

        self.torch, self.device, self.compiled = torch, torch.device(device), compiled
        self.name = "torch " + ("inductor" if compiled else "eager")

    def put(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def time(self, fn) -> list[float]:
        """Milliseconds of each of REPEAT calls after WARMUP, by CUDA events on a GPU."""
        torch = self.torch
        for _ in range(WARMUP):
            fn()
        self.sync()
        out = []
        for _ in range(REPEAT):
            if self.device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t) * 1e3)
        return out

    def steps(self, pos, table, values, pool, writes):
        """(extend, hand-written, copy) as calls of no argument, and a check of extend."""
        torch = self.torch
        index = ci.make(self.put(pos), self.put(table))
        v, p = self.put(values), self.put(pool)
        w, flat = self.put(writes), self.put(table.reshape(-1))
        rows = v.reshape(-1, v.shape[-1])
        src = torch.empty(flat.shape[0] * p.shape[1], dtype=p.dtype, device=self.device)
        dst = torch.empty_like(src)

        def extend(index, v, p):
            return index.extend(v, p, donate=True)

        def hand(p, w, rows, flat):
            p.index_copy_(0, w, rows)
            return p.index_select(0, flat), p

        if self.compiled:
            extend = torch.compile(extend, fullgraph=True, dynamic=False)
            hand = torch.compile(hand, fullgraph=True, dynamic=False)
        seen, after = extend(index, v, p)
        check(seen, after, p, self.sync)
        return (lambda: extend(index, v, p), lambda: hand(p, w, rows, flat),
                lambda: dst.copy_(src))

    def donated(self, pos, table, values, pool):
        index = ci.make(self.put(pos), self.put(table))
        v, p = self.put(values), self.put(pool)
        def step(i, v, p):
            return i.extend(v, p, donate=True)

        if self.compiled:
            step = self.torch.compile(step, fullgraph=True, dynamic=False)
        return lambda: step(index, v, p)


class Jax:
    name = "jax jit"

    def __init__(self, device):
        import jax

        self.jax, self.device = jax, device

    def put(self, a):
        return self.jax.device_put(np.ascontiguousarray(a), self.device)

    def time(self, fn) -> list[float]:
        for _ in range(WARMUP):
            self.jax.block_until_ready(fn())
        out = []
        for _ in range(REPEAT):
            t = time.perf_counter()
            self.jax.block_until_ready(fn())
            out.append((time.perf_counter() - t) * 1e3)
        return out

    def steps(self, pos, table, values, pool, writes):
        jax, jnp = self.jax, self.jax.numpy
        index = ci.make(self.put(pos), self.put(table))
        v, state = self.put(values), {"p": self.put(pool), "h": self.put(pool)}
        w, flat = self.put(writes), self.put(table.reshape(-1))
        src = self.put(np.zeros(flat.shape[0] * pool.shape[1], np.float32))
        extend = jax.jit(lambda i, v, p: i.extend(v, p, donate=True), donate_argnums=2)
        hand = jax.jit(lambda p, w, rows, t: (jnp.take(p.at[w].set(rows), t, axis=0),
                                             p.at[w].set(rows)), donate_argnums=0)
        copy = jax.jit(lambda x: x.copy())

        def run_extend():
            seen, state["p"] = extend(index, v, state["p"])
            return seen

        def run_hand():
            seen, state["h"] = hand(state["h"], w, v.reshape(-1, v.shape[-1]), flat)
            return seen

        seen = run_extend()
        check(np.asarray(seen), np.asarray(state["p"]), None, lambda: None)
        return run_extend, run_hand, lambda: copy(src)

    def donated(self, pos, table, values, pool):
        index = ci.make(self.put(pos), self.put(table))
        v, state = self.put(values), {"p": self.put(pool)}
        step = self.jax.jit(lambda i, v, p: i.extend(v, p, donate=True), donate_argnums=2)

        def run():
            seen, state["p"] = step(index, v, state["p"])
            return seen

        return run


class Cupy:
    name = "cupy"

    def __init__(self):
        import cupy

        self.cupy = cupy

    def put(self, a):
        return self.cupy.asarray(np.ascontiguousarray(a))

    def time(self, fn) -> list[float]:
        cupy = self.cupy
        for _ in range(WARMUP):
            fn()
        cupy.cuda.Device().synchronize()
        out = []
        for _ in range(REPEAT):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(cupy.cuda.get_elapsed_time(a, b))
        return out

    def steps(self, pos, table, values, pool, writes):
        cupy = self.cupy
        index = ci.make(self.put(pos), self.put(table))
        v, p = self.put(values), self.put(pool)
        w, flat = self.put(writes), self.put(table.reshape(-1))
        rows = v.reshape(-1, v.shape[-1])
        src = cupy.empty(flat.shape[0] * p.shape[1], dtype=p.dtype)
        dst = cupy.empty_like(src)

        def hand():
            p[w] = rows
            return cupy.take(p, flat, axis=0)

        seen, after = index.extend(v, p, donate=True)
        check(seen.get(), after.get(), None, lambda: None)
        return (lambda: index.extend(v, p, donate=True), hand,
                lambda: cupy.copyto(dst, src))

    def donated(self, pos, table, values, pool):
        index = ci.make(self.put(pos), self.put(table))
        v, p = self.put(values), self.put(pool)
        return lambda: index.extend(v, p, donate=True)


def check(seen, after, _pool, sync) -> None:
    """The extend being timed reads what it stored and zeroes half the columns."""
    sync()
    seen = np.asarray(seen.cpu() if hasattr(seen, "cpu") else seen)
    zero = ~np.any(seen != 0, axis=-1)
    if not (0.3 < zero.mean() < 0.7):
        raise AssertionError(f"about half the columns should read zero, got {zero.mean():.2f}")


# -- which backends are here ----------------------------------------------------------------
def backends(wanted: list[str] | None, cpu: bool) -> tuple[list, list[str]]:
    """The backends to measure, and a line for each one left out."""
    found, skipped = [], []

    def want(name):
        return not wanted or name in wanted

    try:
        import torch

        if cpu or torch.cuda.is_available():
            dev = "cpu" if cpu else "cuda"
            if want("torch"):
                found.append(Torch(dev, compiled=False))
            if want("torch-inductor"):
                found.append(Torch(dev, compiled=True))
        else:
            skipped.append("torch: no CUDA device visible to torch")
    except ImportError:
        skipped.append("torch: not installed")
    try:
        import jax

        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if want("jax") and (gpus or cpu):
            found.append(Jax(gpus[0] if gpus and not cpu else jax.devices("cpu")[0]))
        elif want("jax"):
            skipped.append(f"jax: no GPU among its devices ({jax.devices()})")
    except ImportError:
        skipped.append("jax: not installed")
    from cacheidx.backends.cupy import CupyBackend

    ok, why = CupyBackend.usable()
    if ok and want("cupy") and not cpu:
        found.append(Cupy())
    elif want("cupy"):
        skipped.append(f"cupy: {why or 'measured on a GPU only'}")
    return found, skipped


def gpu_name() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import jax

        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if gpus:
            return gpus[0].device_kind
    except ImportError:
        pass
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:
        return None


def run(args) -> dict:
    sizes = QUICK if args.quick else SIZES
    donated_logs = (8, 12) if args.quick else DONATED
    found, skipped = backends(args.backend, args.cpu)
    result = {"device": "cpu" if args.cpu else gpu_name(), "date": time.strftime("%Y-%m-%d"),
              "machine": platform.node(), "repeat": REPEAT, "skipped": skipped,
              "rows": [], "donated": []}
    for be in found:
        for batch, context, width in sizes:
            try:
                data = workload(batch, context, width, pool_slots(batch, context) * 2)
                extend, hand, copy = be.steps(*data)
                t = {k: statistics.median(be.time(f))
                     for k, f in (("extend", extend), ("hand", hand), ("copy", copy))}
            except Exception as e:  # out of memory, a backend that fails: said, not hidden
                skipped.append(f"{be.name} {batch}x{context}x{width}: {type(e).__name__}: {e}")
                continue
            row = {"backend": be.name, "case": f"{batch} x {context} x {width}",
                   "extend_ms": round(t["extend"], 4), "baseline_ms": round(t["hand"], 4),
                   "copy_ms": round(t["copy"], 4),
                   "ratio": round(t["extend"] / t["hand"], 3),
                   "extend_over_copy": round(t["extend"] / t["copy"], 3)}
            result["rows"].append(row)
            say(f"{row['backend']} {row['case']}: extend {row['extend_ms']:.3f} ms, "
                f"hand-written {row['baseline_ms']:.3f} ms, copy {row['copy_ms']:.3f} ms")
        batch, context, width = sizes[0]
        try:
            ms = {}
            for log2 in donated_logs:
                data = workload(batch, context, width, 1 << log2, within=1 << donated_logs[0])
                ms[log2] = statistics.median(be.time(be.donated(*data[:4])))
            small, large = donated_logs
            result["donated"].append({"backend": be.name, "case": f"{batch} x {context} x {width}",
                                      "small_slots_log2": small, "large_slots_log2": large,
                                      "small_ms": round(ms[small], 4),
                                      "large_ms": round(ms[large], 4),
                                      "ratio": round(ms[large] / ms[small], 3)})
        except Exception as e:
            skipped.append(f"{be.name} donated: {type(e).__name__}: {e}")
    return result


def markdown(result: dict) -> str:
    lines = [f"Device: {result['device']}, {result['date']}; median of {result['repeat']} "
             "calls after warm-up.", "",
             "| backend | B x CTX x W | extend ms | hand-written ms | ratio | copy ms | "
             "extend / copy |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['backend']} | {r['case']} | {r['extend_ms']:.3f} | "
                     f"{r['baseline_ms']:.3f} | {r['ratio']:.2f} | {r['copy_ms']:.3f} | "
                     f"{r['extend_over_copy']:.2f} |")
    if result["donated"]:
        lines += ["", "| donated extend | B x CTX x W | small pool ms | large pool ms | "
                  "large / small |", "|---|---|---:|---:|---:|"]
        for r in result["donated"]:
            lines.append(f"| {r['backend']} | {r['case']} | {r['small_ms']:.3f} "
                         f"(2^{r['small_slots_log2']}) | {r['large_ms']:.3f} "
                         f"(2^{r['large_slots_log2']}) | {r['ratio']:.2f} |")
    if result["skipped"]:
        lines += ["", "Not measured: " + "; ".join(result["skipped"]) + "."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    p.add_argument("--backend", action="append",
                   help="torch, torch-inductor, jax, cupy (default: every one present)")
    p.add_argument("--cpu", action="store_true", help="measure on the CPU (checks the script)")
    p.add_argument("--quick", action="store_true", help="tiny sizes")
    args = p.parse_args(argv)
    if not args.cpu and gpu_name() is None:
        msg = "no GPU is present: nothing measured (--cpu measures the CPU rows)"
        print(msg)
        if args.json:
            empty = {"device": None, "note": msg, "skipped": [msg], "rows": [], "donated": []}
            args.json.write_text(json.dumps(empty, indent=2) + "\n")
        return 0
    result = run(args)
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
