"""The Llama forward alone, with no cache: SmolLM2 from its GGUF file gives transformers' tokens.

The index here is a stand-in written in this file (causal attention over the call's own tokens,
positions 0 to seq - 1), so the model is checked before, and independently of, the cache index:
any difference in tests/test_smollm2.py is then the cache's.
"""

import dataclasses

import numpy as np
import pytest
from smollm2_support import smollm2_or_skip

from cacheidx.models import llama

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
NEW_TOKENS = 16


class Causal:
    """Whole sequences at positions 0..seq-1, each token seeing itself and those before it."""

    def __init__(self, batch, seq):
        self.batch, self.seq, self.context = batch, seq, seq

    def positions(self):
        return np.broadcast_to(np.arange(self.seq), (self.batch, self.seq))

    def extend(self, values, pool, donate=False):
        return values, pool

    def mask(self):
        causal = np.tril(np.ones((self.seq, self.seq), dtype=bool))
        return np.broadcast_to(causal, (self.batch, self.seq, self.seq))


def test_a_query_that_sees_nothing_gets_exactly_zero():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 4, 8), dtype=np.float32)
    k = rng.standard_normal((2, 5, 2, 8), dtype=np.float32)
    v = rng.standard_normal((2, 5, 2, 8), dtype=np.float32)
    mask = rng.random((2, 3, 5)) < 0.5
    mask[1, 2] = False
    out = llama.attend(q, k, v, mask)
    assert np.all(out[1, 2] == 0)
    assert np.all(np.isfinite(out))


def test_attention_matches_a_plain_softmax_per_head():
    rng = np.random.default_rng(1)
    b, s, heads, kv, d, c = 2, 3, 6, 2, 4, 5
    q = rng.standard_normal((b, s, heads, d))
    k = rng.standard_normal((b, c, kv, d))
    v = rng.standard_normal((b, c, kv, d))
    mask = np.tril(np.ones((s, c), bool), k=c - s)[None].repeat(b, 0)
    out = llama.attend(q, k, v, mask).reshape(b, s, heads, d)
    for h in range(heads):
        g = h // (heads // kv)
        scores = np.einsum("bsd,bcd->bsc", q[:, :, h], k[:, :, g]) / np.sqrt(d)
        scores = np.where(mask, scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        np.testing.assert_allclose(out[:, :, h], np.einsum("bsc,bcd->bsd", w, v[:, :, g]),
                                   rtol=1e-12, atol=1e-12)


def test_a_selection_reads_the_chosen_columns():
    rng = np.random.default_rng(2)
    b, s, heads, kv, d, c = 1, 4, 4, 2, 8, 6
    q = rng.standard_normal((b, s, heads, d))
    k = rng.standard_normal((b, c, kv, d))
    v = rng.standard_normal((b, c, kv, d))
    mask = np.tril(np.ones((s, c), bool), k=c - s)[None]
    columns = np.array([[[0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]])
    chosen = np.take_along_axis(mask, columns, axis=2)
    full = llama.attend(q, k, v, mask & np.any(columns[..., None] == np.arange(c), axis=2))
    picked = llama.attend(q, k[0][columns], v[0][columns], chosen)
    np.testing.assert_allclose(picked, full, rtol=1e-12, atol=1e-12)


def test_random_tiny_decoder_is_causal():
    # Causal is no CacheIndex: the layers take the spec's path, extend then attend
    config = llama.Config.tiny(attention="extend")
    params = llama.random_params(config, seed=0)
    tokens = np.array([[3, 1, 4, 1, 5, 9]])
    pools = llama.empty_pools(config, 1)
    full, _ = llama.forward(params, config, tokens, Causal(1, 6), pools)
    head, _ = llama.forward(params, config, tokens[:, :4], Causal(1, 4), pools)
    np.testing.assert_allclose(head, full[:, :4], rtol=1e-5, atol=1e-5)
    last, _ = llama.forward(params, config, tokens, Causal(1, 6), pools, last=True)
    # the head's product over one row and over six are differently blocked by BLAS: float32's
    # roundings apart (1.7e-6 seen at logits of 18), as the prefix's check above allows
    np.testing.assert_allclose(last, full[:, -1:], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_greedy_tokens_equal_transformers():
    """Each of transformers' greedy tokens is our argmax after the tokens before it (one causal
    call over the prompt and the answer, so greedy decoding would choose the same answer), and
    the logits of the last step agree within 1e-3 relative."""
    config, params, gguf = smollm2_or_skip()
    config = dataclasses.replace(config, attention="extend")  # Causal is no CacheIndex
    prompts = [gguf.chat_ids(p) for p in PROMPTS]
    reference = gguf.transformers_greedy(prompts, NEW_TOKENS)
    pools = llama.empty_pools(config, 1)
    for ids, (want, want_logits) in zip(prompts, reference, strict=True):
        seq = np.asarray([ids + want[:-1]])
        logits, _ = llama.forward(params, config, seq, Causal(1, seq.shape[1]), pools)
        got = np.argmax(logits[0, len(ids) - 1:], axis=-1).tolist()
        assert got == want, f"{gguf.decode(got)!r} != {gguf.decode(want)!r}"
        last = logits[0, -1]
        err = np.max(np.abs(last - want_logits)) / np.max(np.abs(want_logits))
        assert err < 1e-3, err
