"""Beam search over a cache whose beams share their prompt and their common past, copying no key.

The prompt is prefilled once, into pages of 4 slots. Forking a beam is copying a row of slot
numbers: every beam's table names the prompt's slots at columns 0 to n - 1, the partial last
page included (a table names one slot per position, so a beam never writes into a slot another
beam reads: each new position gets a fresh slot). When beam search keeps child i of parent k,
child i's table is parent k's row plus one fresh slot; slots no row names any more go back to
the free list (reference counts, the picture of vLLM's copy-on-write blocks without the copy).

Checks: each final beam's score equals the log-probability of its tokens computed alone with no
cache; its last logits agree; the prompt's slots were written once and never again; the slots
in use are fewer than beams each holding a copy of their past.

    python examples/forked_beam.py --backend numpy|torch|jax
"""

from __future__ import annotations

import numpy as np
from _common import Checks, Env, parser

import cacheidx as ci

PAGE, WIDTH, SLOTS = 4, 16, 64


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main(argv=None) -> Checks:
    p = parser(__doc__)
    p.add_argument("--beams", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="tokens fed per beam after the prompt")
    args = p.parse_args(argv)
    env = Env(args.backend, seed=args.seed)
    checks = Checks(f"beam search, {args.beams} beams sharing their past ({args.backend})")
    K = args.beams
    prompt = env.prompt(6)
    n = len(prompt)

    # the prompt: two pages of the free list, one call
    pages = [7, 2]
    free = [s for s in range(SLOTS) if s // PAGE not in pages]
    table = np.full((1, WIDTH), -1)
    table[0, :n] = [pages[j // PAGE] * PAGE + j % PAGE for j in range(n)]
    pools = env.pools(SLOTS)
    logits, pools = env.forward([prompt], ci.make(env.ints([list(range(n))]), env.ints(table)),
                                pools, last=True)
    prompt_rows = [env.numpy(k)[table[0, :n]].copy() for k, _ in pools]

    # fork: the K best first tokens, every beam naming the prompt's slots
    first = log_softmax(logits[0, -1])
    top = np.argsort(-first, kind="stable")[:K]
    tokens, scores = top.copy(), first[top]
    seqs = [[int(t)] for t in top]
    tables = np.repeat(table, K, axis=0)
    live = set(table[0, :n].tolist())
    peak = len(live)
    for t in range(args.steps):
        col = n + t
        for k in range(K):  # each beam's new position gets a slot of its own
            tables[k, col] = free.pop(0)
        index = ci.make(env.ints(np.full((K, 1), col)), env.ints(tables))
        logits, pools = env.forward(tokens[:, None], index, pools)
        last_logits = logits[:, 0]
        if t == args.steps - 1:
            break
        cand = (scores[:, None] + log_softmax(last_logits)).reshape(-1)
        best = np.argsort(-cand, kind="stable")[:K]
        parent, tokens = best // env.cfg.vocab, best % env.cfg.vocab
        scores = cand[best]
        tables = tables[parent]  # a child's table is its parent's row: slot numbers, no keys
        seqs = [seqs[k] + [int(v)] for k, v in zip(parent, tokens)]
        named = set(tables[tables >= 0].tolist())
        free += sorted(live - named)  # slots no beam names any more are free again
        live = named
        peak = max(peak, len(live) + K)
        print(f"  step {t}: parents {parent.tolist()}, tokens {tokens.tolist()}, "
              f"slots in use {len(live)}")

    for k in range(K):
        fed = seqs[k]  # the beam's tokens after the prompt, each fed in one call
        ref = env.alone(prompt + fed)
        lp = log_softmax(ref[n - 1:n - 1 + len(fed)])  # row j predicts fed[j]
        want = sum(float(lp[j, v]) for j, v in enumerate(fed))
        checks.close(f"beam {k} {fed}: score equals its log-probability alone", scores[k], want,
                     atol=5e-4)
        checks.close(f"beam {k}: last logits equal its tokens alone", last_logits[k], ref[-1])
    after = [env.numpy(k)[table[0, :n]] for k, _ in pools]
    checks.check("the prompt's slots were written once, by the prefill",
                 all(np.array_equal(a, b) for a, b in zip(prompt_rows, after)))
    checks.check("every beam names the prompt's slots at columns 0..n-1",
                 bool((tables[:, :n] == table[0, :n]).all()))
    copies = K * (n + args.steps)
    checks.check(f"slots in use at most {peak}, below {copies} for beams holding copies",
                 peak < copies, f"peak {peak}")
    checks.note("beams", seqs)
    return checks.done()


if __name__ == "__main__":
    main()
