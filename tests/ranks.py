"""What each rank of the multi-process tests runs, and the scenario they share with the
one-process reference (tests/test_parallel.py starts the ranks under a timeout through
tests/processes.py: torchrun for torch, plain processes for jax).

    torchrun --standalone --nproc-per-node 2 tests/ranks.py torch-decode   # torch.distributed
    torchrun --standalone --nproc-per-node 2 tests/ranks.py torch-raise    # rank 1 raises
    python tests/ranks.py jax-decode    # one process of a jax.distributed mesh (RANK, ...)
    python tests/ranks.py jax-raise     # process 1 raises while process 0 waits in a sum
    python tests/ranks.py sleep         # prints its process id, then outlives any timeout

The scenario: the tiny decoder, two prompts prefilled over a shuffled page table, then
``STEPS`` decode steps with ``index.advance()``, the tokens fed from a fixed draw (not argmax,
so that a last-bit difference cannot change what later steps compute). A rank prints one JSON
line: every step's logits and what it saw of placement and compiling.
"""

from __future__ import annotations

import json
import sys

import numpy as np

PAGE = 4
PAGES = 16
LENS = (5, 7)
STEPS = 16


def config():
    from cacheidx.models.llama import Config

    # 4 key-value heads: one per device of 2 processes x 2 devices, two per rank of 2
    return Config.tiny(heads=8, kv_heads=4, dim=64, hidden=64)


def scenario() -> dict:
    """Everything the run needs, as NumPy: weights, the prompts left-padded with their
    positions, the page table, and the token each decode step feeds."""
    from cacheidx.models.llama import random_params

    cfg = config()
    rng = np.random.default_rng(13)
    width = max(LENS)
    pos = np.full((len(LENS), width), -1, dtype=np.int64)
    for b, n in enumerate(LENS):
        pos[b, width - n:] = np.arange(n)
    per_lane = -(-(width + STEPS) // PAGE)
    pages = rng.permutation(PAGES)[: len(LENS) * per_lane].reshape(len(LENS), per_lane)
    table = (pages[:, :, None] * PAGE + np.arange(PAGE)).reshape(len(LENS), -1)
    return {
        "config": cfg,
        "params": random_params(cfg, seed=13),
        "prompt": rng.integers(0, cfg.vocab, pos.shape),
        "pos": pos,
        "table": table,
        "feed": rng.integers(0, cfg.vocab, (STEPS, len(LENS), 1)),
        "slots": PAGES * PAGE,
    }


def decode(xp, step, params, pools, *, place=lambda x: x, place_index=lambda i: i,
           host=np.asarray, after=lambda index, pools: None) -> list[np.ndarray]:
    """The scenario's prefill and decode steps through ``step(params, tokens, index, pools)``;
    ``after`` sees the index and pools after every call. Returns each call's logits."""
    import cacheidx as ci

    s = scenario()

    def ints(a):
        return xp.asarray(np.asarray(a))

    index = place_index(ci.make(ints(s["pos"]), ints(s["table"])))
    logits, pools = step(params, place(ints(s["prompt"])), index, pools)
    seen = [host(logits)]
    after(index, pools)
    for tokens in s["feed"]:
        index = index.advance()
        logits, pools = step(params, place(ints(tokens)), index, pools)
        seen.append(host(logits))
        after(index, pools)
    return seen


def jax_decode() -> dict:
    import jax

    from cacheidx import parallel, pytree
    from cacheidx.models.llama import forward

    parallel.initialize("jax")
    group = parallel.group("jax", len(jax.devices()))
    s = scenario()
    local, params = group.shard(s["config"], s["params"])
    pools = group.pools(local, s["slots"])

    traces = []

    def step(params, tokens, index, pools):
        traces.append(tokens.shape)  # Python runs once a trace: once a program compiled
        return forward(params, local, tokens, index, pools, donate=True, reduce=group.reduce)

    run = jax.jit(group.map(step), donate_argnums=3)
    checks = {"pools_cut": [], "shard_shapes": [], "index_whole": [], "programs": []}

    def after(index, pools):
        leaves = [p for pair in pools for p in pair]
        checks["pools_cut"].append(all(p.sharding.is_equivalent_to(group.cut, 3)
                                       for p in leaves))
        checks["shard_shapes"].append(sorted({tuple(sh.data.shape) for p in leaves
                                              for sh in p.addressable_shards}))
        checks["index_whole"].append(all(
            x.sharding.is_fully_replicated and len(x.sharding.device_set) == group.size
            for x in pytree.leaves(index)))
        checks["programs"].append(len(traces))

    logits = decode(jax.numpy, run, params, pools, place=group.place,
                    place_index=lambda i: i.to_device(group.replicated), host=group.host,
                    after=after)
    return {"rank": jax.process_index(), "processes": jax.process_count(),
            "devices": len(jax.devices()), "local_devices": len(jax.local_devices()),
            "logits": [x.tolist() for x in logits], **checks}


def torch_decode() -> dict:
    """Eagerly, then compiled (full graph: the functional all-reduce traces into the step's
    graph), the graphs counted by the backend that receives them."""
    import torch

    from cacheidx import parallel
    from cacheidx.models.llama import forward

    parallel.initialize("torch")
    group = parallel.group("torch", int(torch.distributed.get_world_size()))
    s = scenario()
    local, params = group.shard(s["config"], s["params"])

    def step(params, tokens, index, pools):
        return forward(params, local, tokens, index, pools, donate=True, reduce=group.reduce)

    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return graph.forward  # run as traced, as the "eager" backend does

    out = {"rank": group.rank, "size": group.size}
    for mode in ("eager", "compiled"):
        run = group.map(step)
        if mode == "compiled":
            run = torch.compile(run, backend=counting, fullgraph=True, dynamic=False)
        shapes = []

        def after(index, pools, shapes=shapes):
            shapes.append(sorted({tuple(p.shape) for pair in pools for p in pair}))

        pools = group.pools(local, s["slots"], like=params["embed"])
        logits = decode(torch, run, params, pools, host=group.host, after=after)
        out[mode] = {"logits": [x.tolist() for x in logits], "pool_shapes": shapes,
                     "graphs": len(graphs)}
    torch.distributed.destroy_process_group()
    return out


PLANTED = "planted failure on rank 1"


def torch_raise() -> None:
    import torch

    from cacheidx import parallel

    parallel.initialize("torch")
    if torch.distributed.get_rank() == 1:
        raise RuntimeError(PLANTED)
    # rank 0 waits for a partner that never comes (gloo's own timeout is 30 minutes)
    torch.distributed.all_reduce(torch.ones(4))


def jax_raise() -> None:
    import jax
    import jax.numpy as jnp

    from cacheidx import parallel

    parallel.initialize("jax")
    if jax.process_index() == 1:
        raise RuntimeError(PLANTED)
    # process 0 waits for a partner in a sum over every device
    group = parallel.group("jax", len(jax.devices()))
    x = jax.device_put(jnp.ones((group.size, 1, 1)), group.cut)
    jax.block_until_ready(jax.jit(jnp.sum)(x))


def sleep() -> None:
    import os
    import time

    print(json.dumps({"pid": os.getpid()}), flush=True)
    time.sleep(600)


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "jax-decode":
        print(json.dumps(jax_decode()))
    elif mode == "torch-decode":
        print(json.dumps(torch_decode()))
    elif mode == "torch-raise":
        torch_raise()
    elif mode == "jax-raise":
        jax_raise()
    elif mode == "sleep":
        sleep()
    else:
        raise SystemExit(f"tests/ranks.py: unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
