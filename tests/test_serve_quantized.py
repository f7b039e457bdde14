"""Serving over quantized pools (issue 27, item 4): ``Engine(kv="int8")`` (or ``"int4"``) keeps
every layer's keys and values as codes and scales (:mod:`cacheidx.quantized`), and every law of
the engine holds of them unchanged.

What is checked, and why it is the honest check:

- A prefix hit reads the codes and scales its first request stored, so an engine over int8
  pools gives the same tokens with the cache on and off (and under eviction pressure).
- A call through a quantized pool is the call through a float pool holding its values' round
  trip (the quantized module's law Q2), and a whole index (``cacheidx.whole``) stores
  nothing: its seen is that round trip. So each request computed alone, whole, over quantized
  pools is the paged engine's reference: the same tokens, the last logits within a small
  tolerance (the keys a chunked prefill computes may differ from the whole call's in their
  last bits, which can move a code by one).
- Against float32 pools there is no law of equality: the greedy tokens of a random tiny model
  may part where two logits are close. The test asserts only that int8 agrees with float32 on
  most tokens and that the first step's logits are near (int8's error is at most ``a / 254``
  of each row's largest element).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import serving
from serving import alone

import cacheidx as ci
from cacheidx.conformance.pytest_plugin import backend_or_skip
from cacheidx.models import llama
from cacheidx.quantized import Quantized
from cacheidx.serve import Engine, LlamaModel, Request, Step
from cacheidx.serve import __main__ as cli
from cacheidx.serve.model import token_bytes


@pytest.fixture(scope="module")
def tiny():
    config = llama.Config.tiny()
    params = llama.random_params(config, seed=3)
    return config, params, LlamaModel(config, params)


#: the chat workload of ``serving.chat``, six conversations unless told
chat = functools.partial(serving.chat, conversations=6)


def check_no_leak(engine):
    cache = engine.cache
    cache.check()
    assert cache.free + cache.cached == cache.capacity, "pages leaked"
    assert cache.evictable == cache.cached, "a cached page still has a reader"


COMMON = dict(page_size=4, lanes=5, chunk=16, keep_logits=True, clock="steps", context=64)


# -- (a) int8 pools: a multi-turn chat with prefix hits --------------------------------------------
@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_int8_pools_serve_a_chat_with_prefix_hits_as_without_the_cache(tiny, name):
    backend_or_skip(name)
    config, params, model = tiny
    runs = {}
    for label, cache in (("cache", True), ("none", False), ("pressure", True)):
        # under pressure, the pages of the largest request and a few more: evictions
        pages = 256 if label != "pressure" else 2 + max(
            -(-(len(r.prompt_ids) + 3) // 4) for r in runs["cache"][1].values())
        engine = Engine(model, backend=name, pages=pages, cache=cache, kv="int8", debug=True,
                        **COMMON)
        (k, v) = engine.executor.pools[0]
        assert isinstance(k, Quantized) and k.bits == 8 and k.scales.dtype == \
            engine.executor.xp.float32
        runs[label] = (engine, {r.id: r for r in chat(engine)})
        assert not any(r.error for r in runs[label][1].values()), label
        check_no_leak(engine)
    figures = {label: e.figures() for label, (e, _) in runs.items()}
    assert {f["kv"] for f in figures.values()} == {"int8"}
    assert figures["cache"]["cached_tokens"] > 0 and figures["none"]["cached_tokens"] == 0
    assert figures["cache"]["computed_tokens"] < figures["none"]["computed_tokens"]
    assert runs["pressure"][0].cache.evictions > 0, "the pressure run evicted nothing"
    cached = runs["cache"][1]
    hits = [r for r in cached.values() if r.cached_tokens > 0]
    assert len(hits) >= 6, "every second turn and most first turns read the cache"
    for label in ("none", "pressure"):  # hits read the same codes and scales
        assert {i: r.tokens for i, r in runs[label][1].items()} == \
            {i: r.tokens for i, r in cached.items()}, label
    # the law of the round trip: each request alone, whole, through int8 pools
    for r in cached.values():
        tokens, logits = alone(config, params, r.prompt_ids, 4, kv="int8")
        assert r.tokens == tokens, r.id
        np.testing.assert_allclose(r.last_logits, logits, atol=2e-3, rtol=0)
    # float32 pools: no law of equality, only nearness
    floats = Engine(model, backend=name, pages=256, **COMMON)
    base = {r.id: r for r in chat(floats)}
    first = base[0, 0]
    one = Engine(model, backend=name, pages=64, kv="int8", **COMMON)
    (got,) = one.run([Request("first", first.prompt_ids, 1)])
    want = Engine(model, backend=name, pages=64, **COMMON).run(
        [Request("first", first.prompt_ids, 1)])[0]
    np.testing.assert_allclose(got.last_logits, want.last_logits, atol=0.1, rtol=0)
    same = [a == b for i in base for a, b in zip(base[i].tokens, cached[i].tokens)]
    assert sum(same) >= 0.75 * len(same), f"int8 agrees with float32 on {sum(same)} of " \
                                          f"{len(same)} tokens"


def test_the_extend_path_serves_int8_pools_in_the_models_dtype(tiny):
    """``Config(attention="extend")``: extend's seen of a quantized pool is float32; a layer
    attends in it and gives the model's dtype back (here bfloat16 weights on torch)."""
    backend_or_skip("torch")
    import torch

    config, params, model = tiny
    spec = llama.Config.tiny(attention="extend")
    want = [r.tokens for r in chat(Engine(model, pages=128, kv="int8", **COMMON),
                                   conversations=3)]
    got = [r.tokens for r in chat(Engine(LlamaModel(spec, params), backend="torch", pages=128,
                                         kv="int8", **COMMON), conversations=3)]
    assert got == want
    weights = llama.convert(params, xp="torch", dtype=torch.bfloat16)
    pools = llama.empty_pools(spec, 16, like=weights["embed"], kv="int8")
    assert pools[0][0].scales.dtype == torch.float32  # not like's dtype
    index = ci.make(torch.arange(5)[None], torch.arange(16)[None])
    for c in (spec, config):
        logits, out = llama.forward(weights, c, torch.arange(5)[None], index, pools)
        assert logits.dtype == torch.bfloat16 and isinstance(out[0][0], Quantized)


# -- (b) sliding-window groups over int8 pools --------------------------------------------------
@pytest.mark.parametrize("windows", [(3, 3), (None, 3, 6)], ids=["all sliding", "mixed"])
def test_sliding_groups_over_int8_pools(windows):
    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(0, 64, n).tolist() for n in (12, 7, 3))
    prompts = [a, b, a + c]
    requests = [Request(i, p, 4) for i, p in enumerate(prompts)]
    config = llama.Config.tiny(layers=len(windows), windows=windows)
    params = llama.random_params(config, seed=3)
    model = LlamaModel(config, params)
    want = [alone(config, params, p, 4, kv="int8")[0] for p in prompts]
    pages = {None: 48, 3: 6, 6: 12} if None in windows else 8
    engine = Engine(model, pages=pages, page_size=2, lanes=2, chunk=4, clock="steps",
                    debug=True, kv="int8")
    step = engine.executor
    assert engine.groups.sliding and all(isinstance(k, Quantized) for k, _ in step.pools)
    if None in windows:  # each group's pool of its own slots
        assert sorted({int(k.shape[0]) for k, _ in step.pools}) == [6 * 2, 12 * 2, 48 * 2]
    results = engine.run(requests)
    assert [r.tokens for r in results] == want
    assert [r.cached_tokens for r in results] == [0, 0, 12]
    check_no_leak(engine)


# -- (c) compiled -------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", ["int8", "int4-turned"])
def test_the_compiled_engine_over_quantized_pools_gives_the_eager_tokens(tiny, kv):
    """torch.compile (aot_eager): the quantized pools are fixed, given up to the program and
    refilled at one address (every part alike), and the tokens are eager's."""
    backend_or_skip("torch")
    config, params, model = tiny
    eager = [r.tokens for r in chat(Engine(model, backend="torch", pages=128, kv=kv,
                                           **COMMON), conversations=3)]
    engine = Engine(model, backend="torch", compile="aot_eager", pages=128, kv=kv,
                    shapes="fixed", **COMMON)
    step = engine.executor
    where = [tuple(p.data_ptr() for pool in pair for p in pool) for pair in step.pools]
    got = chat(engine, conversations=3)
    assert [r.tokens for r in got] == eager, [r.error for r in got]
    assert engine.figures()["cached_tokens"] > 0
    assert [tuple(p.data_ptr() for pool in pair for p in pool) for pair in step.pools] == where
    assert all(getattr(p, "_dynamo_static_input_type", None) is not None
               for pair in step.pools for pool in pair for p in pool)
    assert {k: len(v) for k, v in step.shapes.items()} == {"prefill": 1, "decode": 1}


def test_a_sharded_jax_model_serves_int8_pools_cut_on_their_heads(tiny):
    """``ShardedModel`` over a JAX mesh of one device, compiled: the codes and the scales are
    each cut on their heads; the tokens are one process's."""
    backend_or_skip("jax")
    import jax

    from cacheidx import parallel
    from cacheidx.serve import ShardedModel

    config, params, model = tiny
    want = [r.tokens for r in chat(Engine(model, pages=64, kv="int8", **COMMON),
                                   conversations=3)]
    group = parallel.JaxGroup(jax.devices()[:1])
    engine = Engine(ShardedModel(config, params, group), backend="jax", compile=True, pages=64,
                    kv="int8", shapes="fixed", **COMMON)
    assert [r.tokens for r in chat(engine, conversations=3)] == want
    assert isinstance(engine.executor.pools[0][0], Quantized)


# -- (d) int4 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", ["int4", "int4-turned"])
def test_int4_pools_serve(tiny, kv):
    config, params, model = tiny
    runs = []
    for cache in (True, False):
        engine = Engine(model, pages=128, cache=cache, kv=kv, debug=True, **COMMON)
        k, v = engine.executor.pools[0]
        assert k.bits == 4 and tuple(k.codes.shape) == (128 * 4, 2, 4) and k.shape[2] == 8
        if kv == "int4-turned":  # keys in groups of 8 (gcd(8, 16)), values of 8 (gcd(8, 64))
            assert isinstance(k, ci.turned.Turned) and (k.group, v.group) == (8, 8)
        runs.append({r.id: r for r in chat(engine, conversations=3)})
        check_no_leak(engine)
    assert {i: r.tokens for i, r in runs[0].items()} == {i: r.tokens for i, r in runs[1].items()}
    assert sum(r.cached_tokens for r in runs[0].values()) > 0
    for r in runs[0].values():
        tokens, logits = alone(config, params, r.prompt_ids, 4, kv=kv)
        assert r.tokens == tokens, r.id
        np.testing.assert_allclose(r.last_logits, logits, atol=2e-3, rtol=0)


def test_jax_compiled_serves_turned_pools_as_numpy_eager(tiny):
    """The JAX engine (its step jitted) over turned pools: NumPy's tokens, prefix hits alike."""
    backend_or_skip("jax")
    config, params, model = tiny
    runs, hits = [], []
    for backend in ("numpy", "jax"):
        engine = Engine(model, backend=backend, pages=128, kv="int4-turned", **COMMON)
        runs.append([r.tokens for r in chat(engine, conversations=3)])
        hits.append(engine.figures()["cached_tokens"])
    assert runs[0] == runs[1] and hits[0] == hits[1] > 0


def test_a_quantized_page_takes_its_codes_and_scales_bytes(tiny):
    config, params, model = tiny
    assert token_bytes(2, 8) == 2 * 2 * 8 * 4
    assert token_bytes(2, 8, "int8") == 2 * 2 * (8 + 4)
    assert token_bytes(2, 8, "int4") == 2 * 2 * (4 + 4)
    # turned: codes, then a float16 scale and an int8 zero point a group (8 channels here)
    assert token_bytes(2, 8, "int4-turned") == 2 * 2 * (4 + 3)
    assert token_bytes(3, 64, "int4-turned") == 3 * ((32 + 3 * 4) + (32 + 3))
    turned = llama.empty_pools(config, 64, kv="int4-turned")
    assert sum(p.nbytes for pair in turned for pool in pair for p in pool) == (
        64 * model.token_bytes("int4-turned"))
    assert model.token_bytes("int8") == config.layers * token_bytes(2, 8, "int8")
    # the command's default cap counts quantized pages in the bytes of its float pages
    assert cli.most_pages(model, None) == cli.MOST_PAGES
    assert cli.most_pages(model, "int8") == cli.MOST_PAGES * 32 // 12
    pools = llama.empty_pools(config, 64, kv="int8")
    nbytes = sum(p.nbytes for pair in pools for pool in pair for p in pool)
    assert nbytes == 64 * model.token_bytes("int8")


# -- (e) transformers ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transformers_generate_over_int8_pools(arch):
    """A tiny transformers decoder (qwen2: a full and a sliding layer) through its own modeling
    code over int8 pools: the same tokens with the cache on and off, and prefix hits."""
    pytest.importorskip("transformers")
    import hf_models

    from cacheidx.integrations import transformers as cit

    hf = hf_models.tiny(arch)
    rng = np.random.default_rng(0)
    system = rng.integers(0, hf_models.VOCAB, 9).tolist()
    prompts = [system + rng.integers(0, hf_models.VOCAB, 3).tolist() for _ in range(4)]
    on = cit.generate(hf, prompts, max_new_tokens=5, page_size=4, kv="int8")
    off = cit.generate(hf, prompts, max_new_tokens=5, page_size=4, kv="int8", cache=False)
    assert on == off and all(len(t) == 5 for t in on)
    floats = cit.generate(hf, prompts, max_new_tokens=5, page_size=4)
    same = [a == b for x, y in zip(on, floats) for a, b in zip(x, y)]
    assert sum(same) >= 0.75 * len(same)
    served = cit.model(hf)
    try:
        engine = Engine(served, backend="torch", pages=32, page_size=4, kv="int4",
                        clock="steps")
        pair = engine.executor.pools[0]
        assert all(isinstance(p, Quantized) and p.bits == 4 for p in pair)
        results = engine.run([Request(i, p, 3) for i, p in enumerate(prompts)])
        assert all(r.error is None and len(r.tokens) == 3 for r in results)
        assert engine.figures()["cached_tokens"] > 0
        turned = Engine(served, backend="torch", pages=32, page_size=4, kv="int4-turned",
                        clock="steps")
        assert all(isinstance(p, ci.turned.Turned) for p in turned.executor.pools[0])
        results = turned.run([Request(i, p, 3) for i, p in enumerate(prompts)])
        assert all(r.error is None and len(r.tokens) == 3 for r in results)
    finally:
        served.restore()
    assert hf.config._attn_implementation == "eager"


# -- the command --------------------------------------------------------------------------------
def test_the_command_serves_over_int8_pools(tiny, tmp_path, capsys):
    config, params, model = tiny

    def served():
        return cli.Served("the tiny Llama", model, lambda messages: [1],
                          lambda ids: " ".join(map(str, ids)))

    system = list(range(1, 22))
    lines = [{"id": i, "prompt_ids": system + [30 + i], "max_new_tokens": 3} for i in range(3)]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    out = {}
    for argv in ([], ["--no-cache"]):
        assert cli.main([str(path), "--json", "--kv", "int8", "--page-size", "4", *argv],
                        served=served) == 0
        captured = capsys.readouterr()
        assert "kv int8" in captured.err
        out[bool(argv)] = json.loads(captured.out)
    assert out[False]["figures"]["cached_tokens"] > 0
    assert [r["tokens"] for r in out[False]["requests"]] == \
        [r["tokens"] for r in out[True]["requests"]] == \
        [alone(config, params, x["prompt_ids"], 3, kv="int8")[0] for x in lines]
    with pytest.raises(SystemExit) as e:
        cli.main([str(path), "--kv", "int3"], served=served)
    assert e.value.code == 2
    assert "--kv: invalid choice: 'int3'" in capsys.readouterr().err


# -- (f) what is refused ------------------------------------------------------------------------
class FloatsOnly:
    """A model whose ``pools`` takes no ``kv``."""

    def place(self, xp, device):
        return {}

    def pools(self, weights, slots):
        return []

    def forward(self, weights, tokens, index, pools):
        raise AssertionError("never called")


@pytest.mark.parametrize("kv", ["int2", "fp8", 8, "INT8"])
def test_a_bad_kv_is_refused_naming_the_function(tiny, kv):
    config, params, model = tiny
    with pytest.raises(ValueError, match=r"cacheidx\.models\.llama\.empty_pools: kv must be "
                                         r"None \(float pools\), 'int8', 'int4' or 'int4-turned'"):
        llama.empty_pools(config, 4, kv=kv)
    with pytest.raises(ValueError, match=r"cacheidx\.serve\.Engine: kv must be"):
        Engine(model, pages=4, kv=kv)
    with pytest.raises(ValueError, match=r"cacheidx\.serve\.Step: kv must be"):
        Step(model, slots=4, lanes=1, chunk=4, page_size=4, kv=kv)


def test_what_cannot_make_quantized_pools_is_refused_by_name(tiny):
    config, params, model = tiny
    with pytest.raises(ValueError, match=r"cacheidx\.serve\.Step: FloatsOnly\.pools takes no "
                                         r"kv, so it makes no quantized pools"):
        Engine(FloatsOnly(), pages=4, kv="int8")
    with pytest.raises(ValueError, match=r"cacheidx\.serve\.Engine: kv='int8' is for the "
                                         r"engine's own step"):
        Engine(executor=object(), pages=4, kv="int8")
    with pytest.raises(ValueError, match=r"cacheidx\.models\.llama\.empty_pools: int4 packs "
                                         r"two codes a byte, so head_dim must be even"):
        # (a Config refuses an odd head_dim itself; a config-like object stands for one)
        llama.empty_pools(_OddHead(), 4, kv="int4")
    pytest.importorskip("transformers")
    import hf_models

    from cacheidx.integrations import transformers as cit

    with pytest.raises(ValueError, match=r"cacheidx\.integrations\.transformers\.generate: kv "
                                         r"must be None \(float pools\), 'int8', 'int4' or "
                                         r"'int4-turned', got 'int3'"):
        cit.generate(hf_models.tiny("llama"), [[1, 2, 3]], kv="int3")


class _OddHead:
    layers, kv_heads, head_dim = 1, 1, 7
