"""SmolLM2-135M-Instruct served through the cache index gives transformers' greedy tokens.

Three chat prompts sharing the model's system prompt, 16 greedy tokens each, against
``generate(do_sample=False)`` on the same GGUF file: prefix-shared prefill over paged pools,
chunked prefill without sharing, one token per call in decode with ``advance``; eagerly on NumPy
and compiled with ``jax.jit``. The forward alone (no cache) is checked in test_llama_forward.py.
"""

import numpy as np
import pytest
from smollm2_support import smollm2_or_skip

from cacheidx import demo

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
NEW_TOKENS = 16

pytestmark = pytest.mark.slow  # loads a real model


@pytest.fixture(scope="module")
def smollm2():
    """(config, params, prompt ids, transformers' (tokens, last logits) per prompt, gguf)."""
    config, params, gguf = smollm2_or_skip()
    ids = [gguf.chat_ids(p) for p in PROMPTS]
    return config, params, ids, gguf.transformers_greedy(ids, NEW_TOKENS), gguf


def check_equal_to_transformers(served, reference, gguf, logits=True):
    for got, last, (want, want_logits) in zip(served.tokens, served.last_logits, reference,
                                              strict=True):
        assert got == want, f"{gguf.decode(got)!r} != {gguf.decode(want)!r}"
        if logits:
            err = np.max(np.abs(last - want_logits)) / np.max(np.abs(want_logits))
            assert err < 1e-3, f"last-step logits differ by {err:.2e} relative"


def test_prefix_shared_prefill_then_advance_equals_transformers(smollm2):
    config, params, ids, reference, gguf = smollm2
    served = demo.serve(params, config, ids, max_new_tokens=NEW_TOKENS, page_size=8)
    assert served.computed < served.unshared, "the prompts share the system prompt"
    assert served.pages < served.pages_unshared
    assert served.waves == 2
    check_equal_to_transformers(served, reference, gguf)


def test_chunked_prefill_equals_transformers(smollm2):
    config, params, ids, reference, gguf = smollm2
    served = demo.serve(params, config, ids, max_new_tokens=NEW_TOKENS, page_size=16,
                        share=False, chunk=7)
    assert served.computed == served.unshared
    check_equal_to_transformers(served, reference, gguf)


def test_compiled_with_jax_equals_transformers(smollm2):
    pytest.importorskip("jax", reason="the compiled run needs jax")
    import cacheidx as ci

    if "jax" not in ci.backends.available():
        pytest.skip("the jax backend is not usable here")
    config, params, ids, reference, gguf = smollm2
    served = demo.serve(params, config, ids, max_new_tokens=NEW_TOKENS, page_size=16,
                        backend="jax", compile=True)
    assert served.compiled
    check_equal_to_transformers(served, reference, gguf)


def test_torch_eager_equals_transformers(smollm2):
    pytest.importorskip("torch", reason="the torch run needs torch")
    config, params, ids, reference, gguf = smollm2
    served = demo.serve(params, config, ids, max_new_tokens=NEW_TOKENS, page_size=16,
                        backend="torch")
    check_equal_to_transformers(served, reference, gguf)
