"""Helpers of the engine's tests: a prompt computed alone as the reference, and a chat workload
of conversations sharing a system prompt."""

from __future__ import annotations

import numpy as np

import cacheidx as ci
from cacheidx.models import llama
from cacheidx.serve import Request


def alone(config, params, prompt, max_new, kv=None):
    """Greedy tokens and the last step's logits of ``prompt`` computed alone, whole, on NumPy,
    through pools of ``kv`` (float ones by default; a whole index's seen of quantized ones is
    the round trip of the call's keys and values)."""
    seq, out, logits = list(prompt), [], None
    for _ in range(max_new):
        logits, _ = llama.forward(params, config, np.asarray([seq]), ci.whole(1, len(seq)),
                                  llama.empty_pools(config, 1, kv=kv), last=True)
        logits = logits[0, 0]
        out.append(int(np.argmax(logits)))
        seq.append(out[-1])
    return out, logits


def chat(engine, conversations=10, turns=2, new=4, seed=0):
    """Conversations sharing a system prompt; each next turn is the previous prompt, its answer
    and a new user message (sent once the answer is back)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 64, 21).tolist()
    users = {(c, t): rng.integers(0, 64, rng.integers(2, 9)).tolist()
             for c in range(conversations) for t in range(turns)}

    def follow(result):
        c, t = result.id
        if t + 1 < turns:
            engine.submit(Request((c, t + 1), result.prompt_ids + result.tokens
                                  + users[c, t + 1], new))

    first = [Request((c, 0), system + users[c, 0], new) for c in range(conversations)]
    return engine.run(first, on_finish=follow)
