"""Chunked prefill: long prompts fed a few tokens per call, each chunk attending over the chunks
before it in the cache.

Two prompts of 21 and 13 tokens, each with its own run of 32 slots, are fed 8 positions per
call: chunk k holds positions 8k to 8k + 7 of every lane, -1 (padding) past a lane's end, so a
short prompt is done early and its lane is padding afterwards. A chunk is just an index whose
positions do not start at 0; nothing else changes.

Checks: the chunks' logits are the logits of each whole prompt computed alone; the pools hold
exactly what one call over the whole prompts stores; the first decoded token agrees.

    python examples/chunked_prefill.py --backend numpy|torch|jax
"""

from __future__ import annotations

import numpy as np
from _common import Checks, Env, parser

import cacheidx as ci

CONTEXT = 32


def main(argv=None) -> Checks:
    p = parser(__doc__)
    p.add_argument("--chunk", type=int, default=8, help="positions per call")
    args = p.parse_args(argv)
    env = Env(args.backend, seed=args.seed)
    checks = Checks(f"chunked prefill, {args.chunk} positions per call ({args.backend})")
    prompts = [env.prompt(21), env.prompt(13)]
    lens = np.array([len(q) for q in prompts])
    batch = len(prompts)
    table = env.ints(np.arange(batch * CONTEXT).reshape(batch, CONTEXT))  # lane b: its own run
    ids = np.zeros((batch, CONTEXT), np.int64)
    for b, q in enumerate(prompts):
        ids[b, :len(q)] = q

    pools = env.pools(batch * CONTEXT)
    got = np.zeros((batch, int(lens.max()), env.cfg.vocab), np.float32)
    for start in range(0, int(lens.max()), args.chunk):
        at = np.arange(start, start + args.chunk)[None, :].repeat(batch, 0)
        pos = np.where(at < lens[:, None], at, -1)  # padding past each prompt's end
        index = ci.make(env.ints(pos), table)
        logits, pools = env.forward(ids[:, start:start + args.chunk], index, pools)
        print(f"  chunk at {start}: positions {pos.tolist()}")
        for b in range(batch):
            keep = pos[b] >= 0
            got[b, at[b, keep]] = logits[b, keep]

    for b, q in enumerate(prompts):
        checks.close(f"lane {b}: chunk logits equal the {len(q)}-token prompt alone",
                     got[b, :len(q)], env.alone(q))

    # the same prompts in one call: the pools must match slot for slot
    at = np.arange(int(lens.max()))[None, :].repeat(batch, 0)
    one = ci.make(env.ints(np.where(at < lens[:, None], at, -1)), table)
    _, once = env.forward(ids[:, :int(lens.max())], one, env.pools(batch * CONTEXT))
    diff = max(float(np.max(np.abs(env.numpy(a) - env.numpy(b))))
               for layer, ref in zip(pools, once) for a, b in zip(layer, ref))
    checks.check("pools after the chunks equal pools after one call", diff <= 2e-5,
                 f"max |difference| {diff:.1e}")

    # decode the next token of each lane from the chunked cache
    nxt = got[np.arange(batch), lens - 1].argmax(-1)
    step = ci.make(env.ints(lens[:, None]), table)
    logits, pools = env.forward(nxt[:, None], step, pools)
    for b, q in enumerate(prompts):
        checks.close(f"lane {b}: the first decoded token's logits equal the prompt alone",
                     logits[b, 0], env.alone(q + [int(nxt[b])])[-1])
    return checks.done()


if __name__ == "__main__":
    main()
