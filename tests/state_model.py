"""A tiny hybrid decoder for the engine's tests of recurrent state: layer 0 a recurrent layer
(``s <- a * s + W x`` per token, elementwise decay, its output ``tanh(s)``) over
:mod:`cacheidx.state` pools, layer 1 attention through the index. Written on the array API,
so it runs on every backend; ``reference`` computes a sequence from scratch over a whole
index (the state from zero, nothing kept), which every served token must equal."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import cacheidx as ci

VOCAB, DIM = 61, 8


class ToyHybrid:
    """Layers ``[recurrent, attention]``; ``final`` makes it store only the state after a
    call's last token, as transformers' kernels do (the engine then aligns its chunks and
    prefills one lane a call)."""

    vocab, context = VOCAB, 1024
    windows = (None, None)
    recurrent_layers = (0,)

    def __init__(self, seed: int = 0, final: bool = False):
        rng = np.random.default_rng(seed)
        f = np.float32
        self.params = {"E": rng.normal(size=(VOCAB, DIM)).astype(f),
                       "A": rng.uniform(0.5, 0.95, DIM).astype(f),
                       "W": (rng.normal(size=(DIM, DIM)) / math.sqrt(DIM)).astype(f),
                       "Q": rng.normal(size=(DIM, DIM)).astype(f),
                       "K": rng.normal(size=(DIM, DIM)).astype(f),
                       "V": rng.normal(size=(DIM, DIM)).astype(f),
                       "H": (3 * rng.normal(size=(DIM, VOCAB))).astype(f)}
        self.final = final
        if final:
            self.final_states_only, self.lanes_per_prefill = True, 1

    def place(self, xp: Any, device: Any) -> Any:
        return {k: xp.asarray(v, device=device) if device is not None else xp.asarray(v)
                for k, v in self.params.items()}

    def token_bytes(self, kv: str | None = None) -> int:
        return 2 * DIM * 4

    def state_bytes(self) -> int:
        return DIM * 4

    def pools(self, weights: Any, slots: Any, kv: str | None = None) -> list:
        like = weights["E"]
        xp = ci.backends.get(like).xp
        out = []
        for i, n in enumerate(slots):
            if i in self.recurrent_layers:
                rows, snaps = n
                out.append((ci.state.Pools(*(xp.zeros((c, DIM), dtype=xp.float32)
                                             for c in (rows, snaps))),))
            else:
                out.append(tuple(xp.zeros((n, 1, DIM), dtype=xp.float32) for _ in "kv"))
        return out

    def forward(self, weights: Any, tokens: Any, index: Any, pools: Any) -> tuple[Any, list]:
        ix = index[0] if isinstance(index, list) else index
        xp, w = ix.backend.xp, weights
        b, n = tokens.shape
        x = xp.take(w["E"], xp.reshape(tokens, (-1,)), axis=0)
        x = xp.reshape(x, (b, n, DIM))
        (state,) = pools[0]
        s = ci.state.start(ix, state)
        valid = ci.masks.valid(ix)
        outs, states = [], []
        for i in range(n):
            s = xp.where(valid[:, i, None], w["A"] * s + x[:, i, ...] @ w["W"], s)
            states.append(s)
            outs.append(xp.tanh(s))
        closed = None
        if not self.final:
            at, ok = ci.state.closing(ix)
            every = xp.stack(states, axis=1)
            pick = xp.reshape(xp.where(ok, at, 0), (b, -1, 1))
            closed = xp.take_along_axis(every, xp.broadcast_to(pick, (*pick.shape[:2], DIM)),
                                        axis=1)
        state = ci.state.store(ix, s, state, closed)
        h = xp.stack(outs, axis=1)
        q, k, v = (xp.reshape(h @ w[c], (b, n, 1, DIM)) for c in "QKV")
        kp, vp = pools[1]
        att, kp, vp = ix.attend(q, k, v, kp, vp)
        h = h + xp.reshape(att, (b, n, DIM))
        return h[:, -1, :] @ w["H"], [(state,), (kp, vp)]


def reference(model: ToyHybrid, prompt: list[int], new: int) -> list[int]:
    """Greedy tokens of ``prompt``, each step computed from scratch over a whole index."""
    w = model.place(np, None)
    seq = list(prompt)
    out = []
    for _ in range(new):
        pools = model.pools(w, [(1, 0), 1])
        logits, _ = model.forward(w, np.asarray([seq]), ci.whole(1, len(seq)), pools)
        out.append(int(np.argmax(logits[0])))
        seq.append(out[-1])
    return out
