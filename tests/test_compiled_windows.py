"""A compiled engine over a model with a sliding layer guards on structure, never on identity
(issue 26, item 1): every call is a new index, and its programs are those of its first run."""

from __future__ import annotations

import numpy as np
import torch

from cacheidx.conformance.pytest_plugin import backend_or_skip
from cacheidx.models import llama
from cacheidx.serve import Engine, LlamaModel, Request

OPTIONS = dict(page_size=2, lanes=2, chunk=4, clock="steps", context=48,
               pages={None: 48, 4: 16})


def conversations(engine, n=5, turns=4):
    """``n`` conversations of ``turns`` turns, one run a turn: each prompt is the last one,
    its answer and three new tokens (a prefix hit from the second turn on)."""
    rng = np.random.default_rng(11)
    out, cached = [], []
    for c in range(n):
        prompt = rng.integers(0, 64, 6).tolist()
        for t in range(turns):
            (result,) = engine.run([Request(f"{c}.{t}", prompt, 3)])
            out.append(result.tokens)
            cached.append(result.cached_tokens)
            prompt = prompt + result.tokens + rng.integers(0, 64, 3).tolist()
    return out, cached


def test_a_compiled_windowed_engine_serves_twenty_multi_turn_runs_on_its_first_programs():
    """20 runs (5 conversations x 4 turns) through a compiled engine whose model has a sliding
    layer: one prefill and one decode program, built in the first run and never again, and
    the tokens and prefix hits of the eager engine. Under the user's
    ``torch.inference_mode()``, as inference runs."""
    backend_or_skip("torch")
    config = llama.Config.tiny(windows=(4, None))
    model = LlamaModel(config, llama.random_params(config, seed=3))
    want, hits = conversations(Engine(model, backend="numpy", **OPTIONS))
    backend = backend_or_skip("torch")
    # the step's programs live on its code, shared by every engine of the process: start with
    # none, whichever tests ran before in this process
    backend.forget()
    engine = Engine(model, backend="torch", compile="aot_eager", shapes="fixed", **OPTIONS)
    step = engine.executor
    with torch.inference_mode():
        engine.run([Request("warm", list(range(6)), 3)])
        first = [backend.programs(f) for f in (step._prefill, step._decode)]
        got, cached = conversations(engine)
    assert got == want and cached == hits
    assert sum(cached) > 0
    assert first == [1, 1]
    assert [backend.programs(f) for f in (step._prefill, step._decode)] == first
