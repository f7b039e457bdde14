"""Greedy decoding of SmolLM2-135M-Instruct through a page table, on one rank or tensor-parallel.

    python -m cacheidx.parallel.greedy --backend torch                          # one process
    torchrun --nproc-per-node 3 -m cacheidx.parallel.greedy --backend torch --tensor-parallel 3
    XLA_FLAGS=--xla_force_host_platform_device_count=3 \\
        python -m cacheidx.parallel.greedy --backend jax --tensor-parallel 3     # one mesh

Every prompt gets its own pages (drawn shuffled), is prefilled in one call left-padded, then
decodes ``--max-new-tokens`` tokens with ``index.advance()``, never stopping early, so that two
runs compare token for token. Tensor-parallel, every rank holds a third of the heads (SmolLM2
has 9 query and 3 key-value heads) and of the MLP, and all read the same index; the lead rank
prints the tokens (``--json``: one JSON object).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import cacheidx as ci

from ..models import llama

__all__ = ["greedy", "main"]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


def _host(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def greedy(params: dict, config: llama.Config, prompts: Sequence[Sequence[int]], *,
           max_new_tokens: int = 16, backend: str = "numpy", group: Any = None,
           compile: bool = False, page_size: int = 16, timings: dict | None = None
           ) -> list[list[int]]:
    """The ``max_new_tokens`` greedy tokens of each prompt (lists of ids). ``params`` are the
    host (NumPy) weights; with ``group`` (:func:`cacheidx.parallel.group`) every rank runs
    its share. ``timings``, if given, receives the seconds of the prefill, of the first decode
    step (which compiles) and of the ``decode_steps`` after it."""
    if max_new_tokens < 1:
        raise ValueError(f"cacheidx.parallel.greedy: max_new_tokens must be positive, got "
                         f"{max_new_tokens}")
    be = ci.backends.get(backend)
    xp = be.xp
    if group is None:
        cfg, weights, reduce = config, llama.convert(params, xp=xp), None
        place, place_index, host = (lambda x: x), (lambda i: i), _host
    else:
        cfg, weights = group.shard(config, params)
        reduce, place, host = group.reduce, group.place, group.host

        def place_index(index: Any) -> Any:
            return index.to_device(group.replicated)

    def step(weights: dict, tokens: Any, index: Any, pools: list) -> Any:
        return llama.forward(weights, cfg, tokens, index, pools, donate=True, last=True,
                             reduce=reduce)

    run = step if group is None else group.map(step)
    if compile:
        run = be.jit(run, donate_argnums=(3,))

    lens = [len(p) for p in prompts]
    width = max(lens)
    per_lane = -(-(width + max_new_tokens) // page_size)
    pages = np.random.default_rng(0).permutation(len(prompts) * per_lane)
    pages = pages.reshape(len(prompts), per_lane)
    table = (pages[:, :, None] * page_size + np.arange(page_size)).reshape(len(prompts), -1)
    pos = np.full((len(prompts), width), -1)
    tokens = np.zeros((len(prompts), width), dtype=np.int64)
    for b, p in enumerate(prompts):
        pos[b, width - len(p):] = np.arange(len(p))
        tokens[b, width - len(p):] = p

    info = getattr(xp, "__array_namespace_info__", None)
    int_dtype = info().default_dtypes()["integral"] if info else xp.int64

    def ints(a: Any) -> Any:
        return xp.asarray(np.asarray(a), dtype=int_dtype)

    slots = len(prompts) * per_lane * page_size
    if group is None:
        pools = llama.empty_pools(cfg, slots, like=weights["embed"])
    else:
        pools = group.pools(cfg, slots, like=weights["embed"])
    t0 = time.perf_counter()
    index = place_index(ci.make(ints(pos), ints(table)))
    logits, pools = run(weights, place(ints(tokens)), index, pools)
    current = np.argmax(host(logits)[:, -1, :], axis=-1)
    out = [[int(t)] for t in current]
    t1 = t2 = time.perf_counter()
    for k in range(max_new_tokens - 1):
        index = index.advance()
        logits, pools = run(weights, place(ints(current[:, None])), index, pools)
        current = np.argmax(host(logits)[:, -1, :], axis=-1)
        for b, t in enumerate(current):
            out[b].append(int(t))
        if k == 0:  # the first step compiles where the backend does: timed apart
            t2 = time.perf_counter()
    if timings is not None:
        timings.update(prefill_s=t1 - t0, first_step_s=t2 - t1,
                       decode_s=time.perf_counter() - t2, decode_steps=max(max_new_tokens - 2, 0))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cacheidx.parallel.greedy",
        description="Greedy tokens of SmolLM2-135M-Instruct through a page table, on one rank "
        "or tensor-parallel (torchrun for torch; a mesh of devices for jax).")
    parser.add_argument("--backend", default="torch", help="torch, jax or numpy (default torch)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="K",
                        help="ranks that split the heads and the MLP (a divisor of 3 for "
                        "SmolLM2); torch needs K processes (torchrun), jax K devices")
    parser.add_argument("--prompt", action="append", help="a user message (repeatable)")
    parser.add_argument("--ids", help="the prompts' token ids as a JSON list of lists (in "
                        "place of --prompt: no tokenizer is loaded)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="compile the step")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    from ..models import gguf
    from . import group as make_group
    from . import initialize

    if args.backend in ("torch", "jax"):
        initialize(args.backend)
    group = make_group(args.backend, args.tensor_parallel) if args.tensor_parallel > 1 else None
    lead = group is None or group.lead
    try:
        config, params = gguf.load_smollm2()
        if args.ids:
            ids = json.loads(args.ids)
            prompts = [f"ids {i}" for i in ids]
        else:
            prompts = args.prompt or PROMPTS
            ids = [gguf.chat_ids(p) for p in prompts]
    except gguf.ModelMissing as e:
        print(e, file=sys.stderr)
        return 2
    if group is not None:  # the clear error, before any weight is cut
        from .tensor import split

        split(config, group.size)
    timings: dict = {}
    tokens = greedy(params, config, ids, max_new_tokens=args.max_new_tokens,
                    backend=args.backend, group=group, compile=args.compile,
                    page_size=args.page_size, timings=timings)
    if group is not None and args.backend == "torch":
        import torch.distributed as dist

        # a process group left to the interpreter's exit can abort the rank (SIGABRT, "terminate
        # called without an active exception": pytorch/pytorch#190489); only after success, as
        # ending it while another rank is in a collective would wait for that rank
        dist.destroy_process_group()
    if not lead:
        return 0
    figures = {"backend": args.backend, "tensor_parallel": args.tensor_parallel,
               "compiled": args.compile, **{k: round(v, 3) if isinstance(v, float) else v
                                            for k, v in timings.items()}}
    if args.json:
        print(json.dumps({"tokens": tokens, "figures": figures}))
        return 0
    for p, t in zip(prompts, tokens, strict=True):
        print(f"> {p}\n{t}")
        if not args.ids:
            print(f"{gguf.decode(t)!r}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
