"""A model whose layers differ: sliding-window layers and full layers over the same pools.

Layer 0 attends to the last 4 positions (``index.window(4)``), layer 1 to everything (the
Mistral / Gemma 2 pattern). The model is handed one index and one set of pools; the forward
below (a few lines around ``cacheidx.models.llama.layer``) passes ``index.window(4)`` to the
sliding layer and ``index`` to the other. Both read the same slots: the window is a property of
the read, not of the pools. Under the window, ``extend`` returns exactly zero for the columns
below every token's window, so they cost no weight and need not be kept.

Checks: prefill and decoding over the cache equal a hand-written reference (no cache, a banded
causal mask for the sliding layer), lane by lane; the window changes the outputs; the sliding
layer's seen columns below the window are zero.

    python examples/mixed_window.py --backend numpy|torch|jax
"""

from __future__ import annotations

import dataclasses

import numpy as np
from _common import Checks, Env, parser
from array_api_compat import array_namespace

import cacheidx as ci
from cacheidx.models import llama

WINDOW, SLIDING, CONTEXT = 4, {0}, 24


def forward(params, cfg, tokens, index, pools, window=WINDOW, sliding=frozenset(SLIDING)):
    """``llama.forward`` with ``index.window(window)`` for the layers in ``sliding``."""
    xp = array_namespace(tokens, params["embed"])
    b, s = tokens.shape
    x = xp.take(params["embed"], xp.reshape(tokens, (-1,)), axis=0)
    cos, sin = llama.rotary(index.positions(), cfg.head_dim, cfg.rope_base, x.dtype)
    out = []
    for i, (p, pool) in enumerate(zip(params["layers"], pools)):
        x, pool = llama.layer(p, cfg, x, cos, sin, index.window(window) if i in sliding
                              else index, pool)
        out.append(pool)
    x = llama.rms_norm(x, params["norm"], cfg.eps)
    logits = x @ (params["out"] if "out" in params else xp.matrix_transpose(params["embed"]))
    return xp.reshape(logits, (b, s, -1)), out


class Band:
    """A hand-written stand-in for an index (no cacheidx): one whole sequence, each token seeing
    itself and the ``w - 1`` before it (everything before it without ``w``)."""

    def __init__(self, n, w=None):
        self.n, self.w = n, w

    def positions(self):
        return np.arange(self.n)[None, :]

    def window(self, w):
        return Band(self.n, w)

    def extend(self, values, pool, donate=False):
        return values, pool

    def mask(self):
        i, j = np.arange(self.n)[:, None], np.arange(self.n)[None, :]
        ok = j <= i if self.w is None else (j <= i) & (j > i - self.w)
        return ok[None]


def reference(env, tokens, sliding=frozenset(SLIDING)):
    # Band is no CacheIndex: the reference takes the spec's path, extend then attend
    cfg = dataclasses.replace(env.cfg, attention="extend")
    logits, _ = forward(env.reference, cfg, np.asarray([tokens]), Band(len(tokens)),
                        [(None, None)] * env.cfg.layers, sliding=sliding)
    return logits[0]


def main(argv=None) -> Checks:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    env = Env(args.backend, seed=args.seed)
    checks = Checks(f"sliding-window ({WINDOW}) and full layers over one cache ({args.backend})")
    step = env.compile(lambda params, tokens, index, pools: forward(params, env.cfg, tokens,
                                                                     index, pools))
    prompts = [env.prompt(12), env.prompt(7)]
    lens = [len(q) for q in prompts]
    seq = max(lens)
    index = ci.rows(CONTEXT, lens, xp=args.backend)  # lane b: slots 24b.., left padded
    tokens = np.zeros((2, seq), np.int64)
    for b, q in enumerate(prompts):
        tokens[b, seq - len(q):] = q
    pools = env.pools(2 * CONTEXT)
    logits, pools = step(env.params, env.ints(tokens), index, pools)
    got = [[env.numpy(logits)[b, -1]] for b in range(2)]
    seqs = [list(q) for q in prompts]
    for _ in range(args.steps):
        nxt = [int(np.argmax(g[-1])) for g in got]
        for b in range(2):
            seqs[b].append(nxt[b])
        index = index.advance()
        logits, pools = step(env.params, env.ints(np.array(nxt)[:, None]), index, pools)
        for b in range(2):
            got[b].append(env.numpy(logits)[b, 0])

    for b in range(2):
        want = reference(env, seqs[b])[lens[b] - 1:]
        checks.close(f"lane {b}: prefill and {args.steps} decoding steps equal the banded "
                     "reference", np.stack(got[b]), want)
    full = reference(env, seqs[0], sliding=frozenset())[lens[0] - 1:]
    err = float(np.abs(np.stack(got[0]) - full).max())
    checks.check("the window changes the outputs (against all layers full)", err > 1e-2,
                 f"max |difference| {err:.2f}")

    # the sliding layer's read at the last step: columns below the window are exactly zero
    t = int(env.numpy(index.positions())[0, 0])
    k = env.xp.zeros((2, 1, env.cfg.kv_heads, env.cfg.head_dim), dtype=env.params["embed"].dtype)
    seen, _ = index.window(WINDOW).extend(k, pools[0][0])
    seen = env.numpy(seen)[0]
    checks.check(f"sliding layer, token at {t}: columns 0..{t - WINDOW} read as zero",
                 bool((seen[:t - WINDOW + 1] == 0).all()))
    checks.check(f"sliding layer: columns {t - WINDOW + 1}..{t - 1} hold the cached keys",
                 bool((np.abs(seen[t - WINDOW + 1:t]).sum(axis=(1, 2)) > 0).all()))
    mask = env.numpy(index.window(WINDOW).mask())[0, 0]
    print(f"  mask of lane 0 under window({WINDOW}): {mask.astype(int).tolist()}")
    checks.equal("its mask is the last 4 positions", np.flatnonzero(mask),
                 np.arange(t - WINDOW + 1, t + 1))
    return checks.done()


if __name__ == "__main__":
    main()
