"""Lanes sharing a prefix read it once (cacheidx.attention.runs), and nothing a user sees changes:
the engine's tokens and transformers' families' tokens are the same with shared reads and
without (``runs.unshared()``), and the shared reads did happen.

The conformance suite checks the law itself (``lanes_sharing_a_prefix_read_it_once_...``: the
groups the plan finds and the output against the reference); here, the users' paths.
"""

from __future__ import annotations

import pytest

from cacheidx.attention import runs
from cacheidx.models import llama
from cacheidx.serve import Engine, LlamaModel, Request

SYSTEM = [(7 * i + 3) % 60 + 1 for i in range(96)]  # six pages of 16: a shared prompt


def prompts(count: int) -> list[list[int]]:
    return [SYSTEM + [11 + k, 40 + 3 * k, 50 + k] for k in range(count)]


@pytest.fixture
def shared_reads(monkeypatch):
    """The number of shared prefixes read (a call of the plan's shared read), while on."""
    calls = []
    real = runs._shared

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(runs, "_shared", counted)
    return calls


def serve(backend: str, requests, *, compile=False, share=True):
    config = llama.Config.tiny()
    model = LlamaModel(config, llama.random_params(config, seed=5))
    engine = Engine(model, backend=backend, pages=96, page_size=16, lanes=6, compile=compile)
    if share:
        return [r.tokens for r in engine.run(requests)]
    with runs.unshared():
        return [r.tokens for r in engine.run(requests)]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_the_engine_gives_the_same_tokens_with_shared_reads(backend, shared_reads):
    """Six requests under one 96-token prompt (the later ones hit the prefix cache and share its
    pages) and four samples of one prompt: the same tokens with shared reads and without, and
    shared reads were made."""
    reqs = [Request(k, p, 8) for k, p in enumerate(prompts(6))]
    reqs.append(Request("samples", SYSTEM + [7, 8, 9], 8, n=4))
    got = serve(backend, reqs)
    made = len(shared_reads)
    want = serve(backend, reqs, share=False)
    assert got == want
    assert made > 0, "no shared prefix was read once"
    assert len(shared_reads) == made, "runs.unshared() still shared"


def test_a_compiled_engine_shares_through_the_operator(shared_reads):
    """torch.compile's step calls the eager path through its operator: it shares too."""
    reqs = [Request(k, p, 6) for k, p in enumerate(prompts(4))]
    got = serve("torch", reqs, compile="aot_eager")
    assert shared_reads, "the compiled step read no shared prefix once"
    assert got == serve("torch", reqs, share=False)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2"])
def test_transformers_families_give_the_same_tokens_with_shared_reads(name, shared_reads):
    """transformers' models served by cacheidx (``cit.generate``): the same greedy tokens with
    shared reads and without, for families with and without sliding layers."""
    from hf_models import tiny

    from cacheidx.integrations import transformers as cit

    model = tiny(name)
    ps = [[(t % 100) + 1 for t in p] for p in prompts(4)]
    got = cit.generate(model, ps, max_new_tokens=6)
    with runs.unshared():
        want = cit.generate(model, ps, max_new_tokens=6)
    assert got == want
    assert shared_reads, f"{name}: no shared prefix was read once"
