"""Speculative decoding: a tree of draft tokens verified in one call, the accepted path kept by
writing its slots into the next call's table.

After the prompt, the model's next token g0 is the root of a tree of guesses (here built from
the true greedy continuation g1, g2, g3 with wrong siblings, as a draft model would propose).
One call verifies the whole tree: ``index.draft(slots, sees)`` stores each draft token at a
slot no table names and lets it see the table's columns (the prompt) and its ancestors in the
tree (``sees``: FlashInfer's and SpecInfer's tree mask). Greedy acceptance walks from the root,
keeping a child whose token is its parent's argmax. The kept path becomes the sequence by naming
its slots in the next table, ``table[p_j] = slots[j]``: nothing is copied, the other slots are
free again.

Checks: every node's logits equal its root-to-node path computed alone; the accepted tokens and
their logits equal decoding them one by one over a cache; the call after acceptance, over the
new table, gives the logits one-by-one decoding gives.

    python examples/speculative_tree.py --backend numpy|torch|jax
"""

from __future__ import annotations

import numpy as np
from _common import Checks, Env, greedy_alone, parser

import cacheidx as ci

WIDTH, SLOTS = 24, 48


def tree(g: list[int], vocab: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the draft: the root g0, true children g1 -> g2 and wrong siblings."""
    def wrong(t, k=1):
        return (t + k) % vocab

    nodes = [  # (token, parent)
        (g[0], -1),          # 0  root: the token the prompt's last logits chose
        (wrong(g[1]), 0),    # 1
        (g[1], 0),           # 2  accepted
        (wrong(g[1], 2), 0),  # 3
        (g[2], 2),           # 4  accepted
        (wrong(g[2]), 2),    # 5
        (wrong(g[3]), 4),    # 6  rejected: g3 comes back as the bonus token
        (g[2], 1),           # 7  under a rejected branch
    ]
    return [t for t, _ in nodes], [p for _, p in nodes]


def main(argv=None) -> Checks:
    args = parser(__doc__).parse_args(argv)
    env = Env(args.backend, seed=args.seed)
    checks = Checks(f"speculative decoding with a draft tree ({args.backend})")
    prompt = env.prompt(7)
    n = len(prompt)
    truth, _ = greedy_alone(env, prompt, 5)

    # one by one over a cache: the reference for the accepted path
    pools = env.pools(SLOTS)
    table = np.full((1, WIDTH), -1)
    table[0, :n] = np.arange(n) + 20  # the prompt at slots 20..26
    index = ci.make(env.ints([list(range(n))]), env.ints(table))
    logits, pools = env.forward([prompt], index, pools, last=True)
    g0 = int(logits[0, -1].argmax())
    one = {"table": table.copy(), "pools": pools, "logits": []}
    seq_table = table.copy()
    step, tok = index, g0
    for k in range(4):  # feed g0, g1, g2, g3 one call each
        step = step.advance()
        seq_table[0, n + k] = 40 + k
        step = ci.make(step.positions(), env.ints(seq_table))
        lg, one["pools"] = env.forward([[tok]], step, one["pools"])
        one["logits"].append(lg[0, 0])
        tok = int(lg[0, 0].argmax())
    one_logits = np.stack(one["logits"])  # row k: after feeding the k-th accepted token

    # the draft tree, verified in one call over the pools after the prompt
    tokens, parents = tree(truth, env.cfg.vocab)
    m = len(tokens)
    depth = np.zeros(m, int)
    sees = np.eye(m, dtype=bool)
    for i in range(m):
        j = parents[i]
        while j >= 0:  # a node sees its ancestors and itself
            sees[i, j] = True
            depth[i] += 1
            j = parents[j]
    slots = np.array([30, 35, 31, 36, 32, 37, 33, 38])  # slots no table names
    draft = ci.make(env.ints([n + depth]), env.ints(table)).draft(env.ints([slots]),
                                                                    env.bools([sees]))
    print(f"  {draft}: tokens {tokens}, parents {parents}, positions {(n + depth).tolist()}")
    logits, pools = env.forward([tokens], draft, pools)
    logits = logits[0]

    for i in range(m):
        path, j = [], i
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        checks.close(f"node {i} (depth {depth[i]}): logits equal its path {path} alone",
                     logits[i], env.alone(prompt + path)[-1])

    # greedy acceptance: from the root, the child whose token is its parent's argmax
    accepted, node = [0], 0
    while True:
        want = int(logits[node].argmax())
        kids = [c for c in range(m) if parents[c] == node and tokens[c] == want]
        if not kids:
            bonus = want
            break
        node = kids[0]
        accepted.append(node)
    kept = [tokens[i] for i in accepted]
    checks.equal("accepted tokens and the bonus equal greedy decoding", kept + [bonus],
                 truth[:len(kept) + 1])
    checks.close("logits on the accepted path equal decoding one by one", logits[accepted],
                 one_logits[:len(accepted)])

    # keep the path: name its slots at its positions; the rest of the draft's slots are free
    nxt = table.copy()
    for i in accepted:
        nxt[0, n + depth[i]] = slots[i]
    nxt[0, n + len(accepted)] = 34  # and a slot for the bonus token's own position
    print(f"  next table: {nxt[0, :n + len(accepted) + 1].tolist()}")
    follow = ci.make(env.ints([[n + len(accepted)]]), env.ints(nxt))
    lg, pools = env.forward([[bonus]], follow, pools)
    checks.close("the next call over the kept path equals decoding one by one", lg[0, 0],
                 one_logits[len(accepted)])
    checks.note("accepted", kept)
    return checks.done()


if __name__ == "__main__":
    main()
