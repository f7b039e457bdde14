"""Tensor parallelism on this host: SmolLM2-135M's greedy decode step over 3 ranks (torch
ranks over gloo on loopback; one jax mesh of 3 CPU devices) against one process, and what
crosses between ranks per step.

    python benchmarks/parallel.py [--json PATH] [--quick]

Every run decodes the same prompts through a page table (``cacheidx.parallel.greedy``) and
gives the same tokens (checked here). The ratio is the tensor-parallel step's time over one
process's, measured in the same run, every process on one thread (XLA's CPU devices aside);
on a CPU host whose cores the ranks share it measures the
cost of the collectives, not a speed-up. Per step and lane each rank sums two activations of
``dim`` floats per layer; the index every rank reads is a few integers per lane; the pools
never move.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers."]


def worker(args: argparse.Namespace) -> None:
    """One rank: greedy decoding, then (tensor-parallel) the all-reduce of one layer's output
    alone, timed; the lead prints one JSON line."""
    import numpy as np

    from cacheidx import parallel
    from cacheidx.models import gguf
    from cacheidx.parallel.greedy import greedy

    ids = json.loads(args.ids)
    group = parallel.group(args.backend, args.k) if args.k > 1 else None
    config, params = gguf.load_smollm2()
    timings: dict = {}
    tokens = greedy(params, config, ids, max_new_tokens=args.tokens, backend=args.backend,
                    group=group, compile=args.backend == "jax", timings=timings)
    out = {"tokens": tokens, "step_s": timings["decode_s"] / max(timings["decode_steps"], 1),
           "prefill_s": timings["prefill_s"], "reduce_s": None}
    if group is not None and args.backend == "torch":
        import torch

        x = torch.ones(len(ids), config.dim)
        for _ in range(10):
            float(group.reduce(x)[0, 0])
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            y = group.reduce(x)
            float(y[0, 0])  # waits for the sum
        out["reduce_s"] = (time.perf_counter() - t0) / n
        np.testing.assert_allclose(y.numpy(), args.k)
    if group is None or group.lead:
        print(json.dumps(out), flush=True)
    if group is not None and args.backend == "torch":
        # a process group left to the interpreter's exit can abort the rank (SIGABRT, "terminate
        # called without an active exception": pytorch/pytorch#190489, the failed run quoted in
        # docs/performance.md)
        torch.distributed.destroy_process_group()


def run(backend: str, k: int, ids: list, tokens: int) -> dict:
    # one thread per process, one process or several: the ranks share this host's cores, and
    # a rank spinning on threads it cannot have would measure the host, not the collectives
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    env.pop("XLA_FLAGS", None)
    if backend == "jax" and k > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={k}"
    worker = [__file__, "--worker", "--backend", backend, "--k", str(k), "--ids", json.dumps(ids),
              "--tokens", str(tokens)]
    if backend == "torch" and k > 1:  # torch's ranks are processes: torchrun starts them
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={k}", *worker]
    else:
        argv = [sys.executable, *worker]
    return json.loads(finished(argv, env, timeout=900).strip().splitlines()[-1])


def finished(argv: list, env: dict, timeout: float) -> str:
    """``argv``'s stdout once it exited 0. Raises SystemExit with the end of its stderr when it
    failed, or when it outlived ``timeout`` seconds: then it is sent SIGTERM (on which torchrun
    ends its ranks before it exits), and killed if it is still running a minute later."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(argv, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
            p.terminate()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if code != 0:
        how = f"still running after {timeout:g} s" if code is None else f"exit code {code}"
        raise SystemExit(f"benchmarks/parallel.py: {' '.join(argv[:6])} ... failed ({how}); "
                         f"the end of its stderr:\n{stderr[-4000:]}")
    return stdout


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--backend", default="torch")
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--ids")
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    from cacheidx.models import gguf

    config, _ = gguf.load_smollm2()
    ids = [gguf.chat_ids(q) for q in PROMPTS]
    tokens = 6 if args.quick else 24
    k = 3
    rows = []
    for backend in ("torch", "jax"):
        one = run(backend, 1, ids, tokens)
        tp = run(backend, k, ids, tokens)
        if tp["tokens"] != one["tokens"]:
            raise SystemExit(f"benchmarks/parallel.py: {backend} over {k} ranks gave other "
                             f"tokens than one process")
        rows.append({"backend": backend, "ranks": k, "lanes": len(ids),
                     "one_step_ms": 1e3 * one["step_s"], "tp_step_ms": 1e3 * tp["step_s"],
                     "ratio": tp["step_s"] / one["step_s"],
                     "allreduce_ms": None if tp["reduce_s"] is None else 1e3 * tp["reduce_s"],
                     "same_tokens": True})
    lanes = len(ids)
    reduced = 2 * config.layers * lanes * config.dim * 4  # two float32 sums per layer
    width = -(-(max(map(len, ids)) + tokens) // 16) * 16
    index = lanes * 8 + lanes * width * 8  # positions and the table, int64
    kv_token = 2 * config.layers * config.kv_heads * config.head_dim * 4
    bytes_row = {"allreduce_bytes_per_step": reduced, "allreduces_per_step": 2 * config.layers,
                 "index_bytes_per_step": index, "kv_bytes_per_token": kv_token}

    print("| backend | ranks | lanes | one process, ms/step | tensor-parallel, ms/step | "
          "ratio | one all-reduce, ms | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ar = "-" if r["allreduce_ms"] is None else f"{r['allreduce_ms']:.3f}"
        print(f"| {r['backend']} | {r['ranks']} | {r['lanes']} | {r['one_step_ms']:.1f} | "
              f"{r['tp_step_ms']:.1f} | {r['ratio']:.2f} | {ar} | {r['same_tokens']} |")
    print()
    print("| per decode step of 3 lanes | bytes |")
    print("|---|---|")
    print(f"| summed by each rank ({2 * config.layers} all-reduces of 3 x {config.dim} float32) "
          f"| {reduced} |")
    print(f"| the index every rank reads (positions and table, int64) | {index} |")
    print(f"| one token's keys and values, all layers, float32 (never moved) | {kv_token} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "bytes": bytes_row}, f, indent=1)


if __name__ == "__main__":
    main()
