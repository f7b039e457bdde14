"""The serving engine (``cacheidx.serve``) gives every request the tokens it would get alone,
with the prefix cache, without it and under eviction pressure, on every backend, eager and
compiled; and the device names every backend answers to.

Most laws run on a *ledger* model: its keys are the tokens themselves, and its next token is
a hash of every token its lane reads through the index. A page read that another request
overwrote, a table naming the wrong page, a token stored at the wrong slot: each changes the
hash. It computes in milliseconds, so Hypothesis can draw arrival orders and pool sizes. The
tiny Llama and SmolLM2 then check real logits and tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from array_api_compat import array_namespace
from array_api_compat import device as device_of
from conftest import BACKENDS
from hypothesis import given, settings
from hypothesis import strategies as st
from serving import alone, chat

import cacheidx as ci
from cacheidx import demo, devices
from cacheidx.conformance.pytest_plugin import backend_or_skip
from cacheidx.models import llama
from cacheidx.serve import Engine, LlamaModel, Request

V = 101  # the ledger's vocabulary: a prime, so that one wrong token always changes the hash


class Ledger:
    """Stores ``token + 1`` at each token's slot; a lane's next token is ``sum((t_c + 1) * w_c)
    mod V`` over the columns ``c`` its last token sees, with ``w_c`` in ``1..100``."""

    def __init__(self, columns: int = 1024):
        self.w = 1 + (np.arange(columns) * 7 + 3) % 100

    def place(self, xp, device):
        return {"w": xp.asarray(self.w, device=device)}

    def pools(self, weights, slots):
        xp, w = array_namespace(weights["w"]), weights["w"]
        return [(xp.zeros((slots, 1), dtype=w.dtype, device=device_of(w)),)]

    def forward(self, weights, tokens, index, pools):
        xp = index.backend.xp
        ((pool,),) = pools
        values = xp.reshape(xp.astype(tokens + 1, pool.dtype), (*tokens.shape, 1))
        seen, pool = index.extend(values, pool, donate=True)
        sees = index.mask()[:, -1, :]
        terms = seen[:, :, 0] * weights["w"][None, : seen.shape[1]]
        h = xp.sum(xp.where(sees, terms, xp.zeros_like(terms)), axis=1) % V
        vocab = xp.arange(V, dtype=h.dtype, device=device_of(h))
        return xp.astype(h[:, None] == vocab[None, :], xp.float32), [(pool,)]

    def alone(self, prompt, max_new, stop=()):
        """The tokens a request gets computed alone, on the host."""
        seq, out = list(prompt), []
        while len(out) < max_new:
            t = int(sum((s + 1) * int(w) for s, w in zip(seq, self.w)) % V)
            out.append(t)
            seq.append(t)
            if t in stop:
                break
        return out


def pages_for(request, page_size):
    return -(-(len(request.prompt) + request.max_new_tokens - 1) // page_size)


def check_no_leak(engine):
    cache = engine.cache
    cache.check()
    assert cache.free + cache.cached == cache.capacity, "pages leaked"
    assert cache.evictable == cache.cached, "a cached page still has a reader"


# -- concrete cases -------------------------------------------------------------------------
def test_a_shared_system_prompt_is_computed_once():
    system = list(range(20))
    requests = [Request(i, system + [30 + i, 40 + i], max_new_tokens=3) for i in range(4)]
    model = Ledger()
    engine = Engine(executor=None, model=model, pages=64, page_size=4, lanes=4, clock="steps")
    results = engine.run(requests)
    assert [r.tokens for r in results] == [model.alone(r.prompt, 3) for r in requests]
    # the first computes all 22 tokens; the others wait for it, then read its 5 pages
    assert [r.cached_tokens for r in results] == [0, 20, 20, 20]
    assert engine.figures()["computed_tokens"] == 22 + 3 * 2
    check_no_leak(engine)


def test_a_request_larger_than_the_pool_fails_alone():
    model = Ledger()
    requests = [Request("small", [1, 2, 3], 4), Request("huge", list(range(40)), 4),
                Request("after", [1, 2, 3, 4], 4)]
    engine = Engine(model=model, pages=4, page_size=4, lanes=2, clock="steps")
    small, huge, after = engine.run(requests)
    assert "needs 11 pages of 4 tokens" in huge.error and "the pool has 4" in huge.error
    assert huge.tokens == []
    assert small.error is None and small.tokens == model.alone([1, 2, 3], 4)
    assert after.error is None and after.tokens == model.alone([1, 2, 3, 4], 4)
    assert engine.figures()["failed"] == 1
    check_no_leak(engine)


def test_a_turn_that_follows_its_answer_reads_the_answer_from_the_cache():
    model = Ledger()
    engine = Engine(model=model, pages=32, page_size=4, lanes=2, clock="steps")
    first = Request("t1", list(range(10)), max_new_tokens=6)
    later = []

    def next_turn(result):
        if result.id == "t1":  # the client sends the conversation back, with 3 more tokens
            later.append(Request("t2", result.prompt_ids + result.tokens + [7, 8, 9], 4))
            engine.submit(later[0])

    t1, t2 = engine.run([first], on_finish=next_turn)
    assert t2.id == "t2" and t2.tokens == model.alone(later[0].prompt, 4)
    # prompt 10 + 5 fed answer tokens are written: 3 whole pages; the 6th answer token is not
    assert t2.cached_tokens == 12
    check_no_leak(engine)


def test_requests_wait_for_their_arrival_in_seconds():
    model = Ledger()
    engine = Engine(model=model, pages=16, page_size=4, lanes=2)
    early, late = engine.run([Request("a", [1, 2], 2), Request("b", [3, 4], 2, arrival=0.05)])
    assert late.admitted >= 0.05 > early.admitted
    assert late.tokens == model.alone([3, 4], 2)


# -- random arrivals and pools (the ledger on NumPy) -------------------------------------------
stems = st.lists(st.integers(0, 3), min_size=0, max_size=10)
requests_ = st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), min_size=1,
                                                           max_size=5),
                               st.integers(1, 4), st.integers(0, 6)),
                     min_size=1, max_size=8)


@settings(max_examples=40)
@given(stems=st.lists(stems, min_size=3, max_size=3), drawn=requests_,
       page_size=st.integers(1, 4), pages=st.integers(1, 14), lanes=st.integers(1, 4),
       chunk=st.integers(1, 6), stop=st.sets(st.integers(0, V - 1), max_size=20),
       shapes=st.sampled_from(["exact", "buckets", "fixed"]))
def test_every_request_gets_its_own_tokens_whatever_arrives_when(stems, drawn, page_size,
                                                                pages, lanes, chunk, stop,
                                                                shapes):
    """Random prompts sharing prefixes, random arrival steps, pool, page, lane and chunk sizes,
    calls padded to buckets or one fixed shape: with the cache and without, each request's
    tokens are those it gets alone (or it fails, exactly when the pool cannot hold it);
    nothing leaks; the cache computes no more; every call's index keeps the table's
    obligations (``debug``: ``ci.check``)."""
    model = Ledger()
    requests = [Request(i, stems[s] + tail, new, arrival=at, stop=stop)
                for i, (s, tail, new, at) in enumerate(drawn)]
    computed = {}
    for cache in (True, False):
        engine = Engine(model=model, pages=pages, page_size=page_size, lanes=lanes,
                        chunk=chunk, cache=cache, clock="steps", shapes=shapes, debug=True)
        results = engine.run(requests)
        for request, result in zip(requests, results, strict=True):
            if pages_for(request, page_size) > pages:
                assert result.error is not None and result.tokens == []
            else:
                assert result.error is None
                assert result.tokens == model.alone(request.prompt, request.max_new_tokens,
                                                    stop)
        check_no_leak(engine)
        computed[cache] = engine.figures()["computed_tokens"]
    assert computed[True] <= computed[False]


# -- the step on every backend: eager, compiled, fixed addresses, bounded programs -------------
LEDGER_CASES = [(n, c) for n in BACKENDS for c in (False, True)
                if (n, c) not in (("torch", True), ("jax", False))]


@pytest.mark.parametrize("name, compile", LEDGER_CASES,
                         ids=[f"{n}-{'compiled' if c else 'eager'}" for n, c in LEDGER_CASES])
def test_the_ledger_runs_on_every_backend(name, compile):
    """Eager and compiled (where the backend has no compiler, compiled is eager); torch
    compiled and JAX eager, whose compiling is what costs, run with the tiny Llama below."""
    backend_or_skip(name)
    model = Ledger()
    system = [3, 1, 4, 1, 5, 9, 2, 6]
    requests = [Request(i, system + [i] * (i + 1), 3, arrival=i) for i in range(4)]
    engine = Engine(model=model, backend=name, device="cpu", compile=compile, pages=24,
                    page_size=4, lanes=2, chunk=4, clock="steps", debug=True)
    results = engine.run(requests)
    assert [r.tokens for r in results] == [model.alone(r.prompt, 3) for r in requests]
    assert engine.figures()["cached_tokens"] > 0
    check_no_leak(engine)


def test_compiled_calls_keep_every_array_at_one_address(tiny, monkeypatch):
    """Torch, compiled (aot_eager here; on CUDA, inductor records CUDA graphs over the same
    arrays): the pools are written in place and each index buffer is the same tensor, marked
    static for dynamo, on every call. (The tiny Llama's programs, built by the test above.)"""
    backend_or_skip("torch")
    config, params, model = tiny
    engine = Engine(model, backend="torch", compile="aot_eager", pages=256, page_size=4, lanes=5,
                    chunk=16, keep_logits=True, clock="steps", context=64, shapes="fixed")
    step = engine.executor
    pools = [(k.data_ptr(), v.data_ptr()) for k, v in step.pools]
    engine.submit(Request(0, list(range(9)), 6))
    engine.step()
    buffers = {k: (b, b.data_ptr()) for k, b in step._buffers.items()}
    assert {k[0] for k in buffers} == {"pos", "row", "tokens", "table"}
    while engine.busy:
        engine.step()
    assert engine.calls["decode"] >= 4, "decode calls fed by the previous call"
    assert [(k.data_ptr(), v.data_ptr()) for k, v in step.pools] == pools
    for key, (b, ptr) in buffers.items():
        assert step._buffers[key] is b and b.data_ptr() == ptr, key
        assert getattr(b, "_dynamo_static_input_type", None) is not None, key
    assert all(getattr(k, "_dynamo_static_input_type", None) for k, _ in step.pools)


def test_buckets_bound_the_compiled_programs():
    """JAX: prefill and decode programs are at most the buckets' products, however many
    shapes of calls the requests make; the pools are donated to them."""
    backend_or_skip("jax")
    model = Ledger()
    requests = [Request(i, [i % 3] * (3 + 5 * i), 1 + i % 4, arrival=i) for i in range(8)]
    engine = Engine(model=model, backend="jax", compile=True, pages=64, page_size=4,
                    lanes=4, chunk=16, clock="steps")
    step = engine.executor
    before = step.pools[0][0]
    results = engine.run(requests)
    assert [r.tokens for r in results] == [model.alone(r.prompt, r_.max_new_tokens)
                                           for r, r_ in zip(requests, requests)]
    assert before.is_deleted(), "the pool was donated to the program"
    backend = ci.backends.get("jax")
    for kind, jitted in (("prefill", step._prefill), ("decode", step._decode)):
        assert 1 <= backend.programs(jitted) <= step.bound[kind]
        assert len(step.shapes[kind]) == backend.programs(jitted)
    assert step.bound == {"prefill": 3 * 1 * 7, "decode": 3 * 7}  # lanes 1 2 4, pages 1..64


# -- devices -----------------------------------------------------------------------------------
class Fake:
    """A backend listing made-up devices, labelled as a backend labels its own."""

    name = "fake"

    def __init__(self, *labels):
        self.found = [object() for _ in labels]
        self.labels = dict(zip(map(id, self.found), labels))

    def devices(self):
        return self.found

    def device_label(self, device):
        return self.labels[id(device)]


def test_the_engine_takes_the_same_device_names_on_every_backend():
    backend = Fake("cpu", "cuda:0", "cuda:1")
    cpu, first, second = backend.found
    assert devices.resolve(backend, "cpu") is cpu
    assert devices.resolve(backend, "gpu") is first and devices.resolve(backend, "cuda") is first
    assert devices.resolve(backend, "gpu:1") is second and devices.resolve(backend, "CUDA:1") \
        is second
    assert devices.resolve(backend, None) is cpu
    with pytest.raises(ValueError, match=r"fake has no device 'gpu:2' \(cuda:2\); found: cpu, "
                                         r"cuda:0, cuda:1"):
        devices.resolve(backend, "gpu:2")


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_serves_on_cpu_and_names_what_it_has(name):
    backend = backend_or_skip(name)
    model = Ledger()
    if "cpu" not in [backend.device_label(d) for d in backend.devices()]:  # CuPy
        with pytest.raises(ValueError, match="found: cuda:0"):
            Engine(model=model, backend=name, device="cpu", pages=4, page_size=4)
        return
    engine = Engine(model=model, backend=name, device="cpu", pages=8, page_size=4,
                    clock="steps")
    assert backend.device_label(engine.executor.device) == "cpu"
    (result,) = engine.run([Request(0, [5, 6, 7], 2)])
    assert result.tokens == model.alone([5, 6, 7], 2)
    found = ", ".join(dict.fromkeys(backend.device_label(d) for d in backend.devices()))
    if "cuda:7" not in found:
        with pytest.raises(ValueError, match=f"has no device 'gpu:7' \\(cuda:7\\); found: "
                                             f"{found}"):
            Engine(model=model, backend=name, device="gpu:7", pages=4, page_size=4)


# -- the tiny Llama: logits and tokens ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    config = llama.Config.tiny()
    params = llama.random_params(config, seed=3)
    return config, params, LlamaModel(config, params)


CASES = [("numpy", False), ("numpy", True), ("torch", False), ("torch", True), ("jax", False),
         ("jax", True)]


@pytest.mark.parametrize("name, compile", CASES,
                         ids=[f"{n}-{'compiled' if c else 'eager'}" for n, c in CASES])
def test_tiny_llama_equal_with_and_without_the_cache_and_under_pressure(tiny, name, compile,
                                                                        monkeypatch):
    """Greedy tokens identical, and the last logits within 1e-4 of each request computed alone,
    with the cache, without it, and with a quarter of the pages the cache would use."""
    config, params, model = tiny
    backend_or_skip(name)
    if name == "torch" and compile:
        compile = "aot_eager"
    # one shape of each call (the ledger's test shows buckets): compiling is what costs here
    common = dict(backend=name, compile=compile, page_size=4, lanes=5, chunk=16,
                  keep_logits=True, clock="steps", context=64, debug=True,
                  shapes="fixed" if name != "numpy" else None)
    ideal = Engine(model, pages=256, **common)
    runs = {"cache": (ideal, chat(ideal))}
    need = ideal.figures()["peak_pages_used"]
    most = max(pages_for(Request(0, r.prompt_ids, 4), 4) for r in runs["cache"][1])
    assert need // 4 >= most, "a quarter of the pages holds the largest request"
    for label, pages, cache in (("none", 256, False), ("pressure", need // 4, True)):
        engine = Engine(model, pages=pages, cache=cache, **common)
        runs[label] = (engine, chat(engine))
    assert runs["pressure"][0].cache.evictions > 0, "the pressure run evicted nothing"
    expected = {}
    for label, (engine, results) in runs.items():
        check_no_leak(engine)
        for r in results:
            if r.id not in expected:
                expected[r.id] = alone(config, params, r.prompt_ids, 4)
            tokens, logits = expected[r.id]
            assert r.tokens == tokens, (label, r.id)
            np.testing.assert_allclose(r.last_logits, logits, atol=1e-4, rtol=0)
    computed = {k: e.figures()["computed_tokens"] for k, (e, _) in runs.items()}
    assert computed["cache"] < computed["pressure"] <= computed["none"]
    if compile and name != "numpy":
        assert {k: len(v) for k, v in ideal.executor.shapes.items()} == \
            {"prefill": 1, "decode": 1}


def test_demo_serve_is_the_engine_on_a_device(tiny):
    config, params, _ = tiny
    rng = np.random.default_rng(1)
    system = rng.integers(0, 64, 20).tolist()
    prompts = [system + rng.integers(0, 64, 3).tolist() for _ in range(3)]
    served = demo.serve(params, config, prompts, max_new_tokens=5, page_size=4, device="cpu",
                        stop=False)
    assert served.waves == 2 and served.computed == 23 + 2 * 3
    assert served.pages < served.pages_unshared and served.device == "cpu"
    for p, got, last in zip(prompts, served.tokens, served.last_logits, strict=True):
        tokens, logits = alone(config, params, p, 5)
        assert got == tokens
        np.testing.assert_allclose(last, logits, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="no device 'gpu:7'"):
        demo.serve(params, config, prompts, device="gpu:7")


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_a_sharded_model_on_a_group_of_one_gives_the_same_tokens(tiny, name, tmp_path):
    """The tensor-parallel model (``cacheidx.parallel`` groups; here of one rank: a JAX mesh
    of one device, compiled; a torch gloo group of one process) runs through the same engine
    and gives one process's tokens."""
    backend_or_skip(name)
    from cacheidx import parallel
    from cacheidx.serve import ShardedModel

    config, params, model = tiny
    if name == "jax":
        import jax

        group, compile = parallel.JaxGroup(jax.devices()[:1]), True
    else:
        import torch.distributed as dist

        if dist.is_initialized():
            pytest.skip("a torch process group is running already in this process")
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                                world_size=1)
        group, compile = parallel.TorchGroup(), False
    try:
        runs = []
        for m in (model, ShardedModel(config, params, group)):
            engine = Engine(m, backend=name, compile=compile, pages=64, page_size=4, lanes=3,
                            chunk=16, clock="steps", context=64, shapes="fixed")
            runs.append([r.tokens for r in chat(engine, conversations=3)])
        assert runs[0] == runs[1]
    finally:
        if name == "torch":
            dist.destroy_process_group()


# -- SmolLM2 (real weights, its chat template) --------------------------------------------------
CONVERSATION = [
    {"id": "a1", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "b1", "messages": [{"role": "user", "content": "Name a prime number."}]},
    {"id": "a2", "messages": [{"role": "user", "content": "What is the capital of France?"},
                              {"role": "assistant", "content": "Paris."},
                              {"role": "user", "content": "And of Spain?"}]},
    {"id": "b2", "messages": [{"role": "user", "content": "Name a prime number."},
                              {"role": "assistant", "content": "7."},
                              {"role": "user", "content": "Another one?"}]},
]


@pytest.fixture(scope="module")
def smollm2():
    from smollm2_support import smollm2_or_skip

    config, params, gguf = smollm2_or_skip()
    return config, params, gguf


@pytest.mark.slow
def test_smollm2_conversations_equal_with_and_without_the_cache(smollm2):
    config, params, gguf = smollm2
    model = LlamaModel(config, params)
    requests = [Request(c["id"], gguf.conversation_ids(c["messages"]), 5, stop={2})
                for c in CONVERSATION]
    runs = {}
    most, need = max(pages_for(r, 16) for r in requests), 0
    for label, cache in (("cache", True), ("none", False), ("pressure", True)):
        # under pressure: a quarter of the pages the cache used, or the largest request's
        pages = 64 if label != "pressure" else max(most, need // 4)
        engine = Engine(model, pages=pages, page_size=16, lanes=2, cache=cache,
                        clock="steps")
        runs[label] = (engine, [r.tokens for r in engine.run(requests)])
        check_no_leak(engine)
        if label == "cache":
            need = engine.figures()["peak_pages_used"]
    assert runs["cache"][1] == runs["none"][1] == runs["pressure"][1]
    assert runs["pressure"][0].cache.evictions > 0
    f = {k: e.figures() for k, (e, _) in runs.items()}
    assert f["cache"]["computed_tokens"] < f["none"]["computed_tokens"]
    assert f["cache"]["cached_tokens"] >= 3 * 16  # the system prompt, then turn 1 for turn 2


@pytest.mark.slow
def test_the_cli_serves_a_multi_turn_file_with_fewer_computed_tokens(smollm2, tmp_path,
                                                                     capsys):
    from cacheidx.serve.__main__ import main

    lines = CONVERSATION + [{"id": "too long", "max_new_tokens": 100_000,
                             "messages": [{"role": "user", "content": "Count to a million."}]}]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = {}
    for flag in ([], ["--no-cache"]):
        rc = main([str(path), "--max-new-tokens", "4", "--pages", "64", "--json", *flag])
        captured = capsys.readouterr()
        assert rc == 1, "one request failed"
        out[bool(flag)] = json.loads(captured.out)
        assert "hit rate" in captured.err and "request 'too long' failed" in captured.err
    with_cache, without = out[False], out[True]
    assert [r["tokens"] for r in with_cache["requests"]] == \
        [r["tokens"] for r in without["requests"]]
    assert [r["id"] for r in with_cache["requests"]] == [x["id"] for x in lines]
    assert "pages of 16 tokens (35 prompt tokens and up to 100000 new ones); the pool has 64" \
        in with_cache["requests"][-1]["error"]
    f, g = with_cache["figures"], without["figures"]
    assert f["prompt_tokens"] == g["prompt_tokens"]
    assert f["computed_tokens"] < g["computed_tokens"]
    assert f["computed_tokens"] + f["cached_tokens"] == f["prompt_tokens"]
    assert g["cached_tokens"] == 0 and f["hit_rate"] > 0
