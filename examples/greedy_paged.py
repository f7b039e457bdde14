"""Greedy decoding of a batch of prompts over a paged KV cache, one token per call with `advance`.

Pages of 4 slots are handed out from a shuffled free list as each sequence needs them (the
vLLM picture: a block table per sequence). The index's table names one slot per position:
column j of a sequence is slot ``page * 4 + j % 4`` of its page ``j // 4``, -1 while that page
is not allocated. Prefill is one call over the left-padded prompts; every decoding call after
it is ``index.advance()`` (and ``cacheidx.make`` with the new table when a lane crosses into a
fresh page).

Checks: the tokens equal greedy decoding of each prompt alone with no cache, the logits agree,
and each sequence holds exactly the pages its tokens need.

    python examples/greedy_paged.py --backend numpy|torch|jax
"""

from __future__ import annotations

import numpy as np
from _common import Checks, Env, greedy_alone, paged_slots, parser

import cacheidx as ci

PAGE, WIDTH = 4, 16  # slots per page; columns of the table (the longest sequence)


def main(argv=None) -> Checks:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=6, help="new tokens per prompt")
    args = p.parse_args(argv)
    env = Env(args.backend, seed=args.seed)
    checks = Checks(f"greedy decoding over a paged cache ({args.backend})")
    prompts = [env.prompt(n) for n in (5, 9, 3)]
    lens = np.array([len(q) for q in prompts])
    batch, seq = len(prompts), int(lens.max())

    free = list(env.rng.permutation(12))  # 12 pages of 4 slots: 48 rows per pool
    pools = env.pools(12 * PAGE)
    pages = np.full((batch, WIDTH // PAGE), -1)
    for b, n in enumerate(lens):
        for k in range(-(-n // PAGE)):
            pages[b, k] = free.pop()

    # prefill: the prompts left padded to the longest, padding at position -1
    pos = np.arange(seq)[None, :] - (seq - lens)[:, None]
    pos = np.where(pos >= 0, pos, -1)
    tokens = np.zeros((batch, seq), np.int64)
    for b, q in enumerate(prompts):
        tokens[b, seq - len(q):] = q
    index = ci.make(env.ints(pos), env.ints(paged_slots(pages, PAGE, WIDTH)))
    print(f"  prefill {index}, pages per lane {(pages >= 0).sum(1).tolist()}")
    logits, pools = env.forward(tokens, index, pools, last=True)

    out, chosen = [[] for _ in prompts], [[] for _ in prompts]
    for step in range(args.steps):
        nxt = logits[:, -1].argmax(-1)
        for b in range(batch):
            out[b].append(int(nxt[b]))
            chosen[b].append(logits[b, -1])
        if step == args.steps - 1:
            break
        index = index.advance()  # one token per lane, one past the lane's last position
        at = env.numpy(index.positions())[:, 0]
        crossing = [b for b in range(batch) if at[b] % PAGE == 0]
        for b in crossing:  # a lane entering a new page gets one from the free list
            pages[b, at[b] // PAGE] = free.pop()
        if crossing:
            index = ci.make(index.positions(), env.ints(paged_slots(pages, PAGE, WIDTH)))
        logits, pools = env.forward(nxt[:, None], index, pools)

    for b, q in enumerate(prompts):
        want, want_logits = greedy_alone(env, q, args.steps)
        checks.equal(f"lane {b} ({len(q)}-token prompt): tokens equal decoding it alone",
                     out[b], want)
        checks.close(f"lane {b}: logits equal decoding it alone", np.stack(chosen[b]),
                     want_logits)
    fed = lens + args.steps - 1  # the last token chosen is never fed
    checks.equal("pages held per lane = ceil(tokens fed / 4)", (pages >= 0).sum(1),
                 -(-fed // PAGE))
    print(f"  page table:\n{pages}")
    checks.note("tokens", out)
    return checks.done()


if __name__ == "__main__":
    main()
