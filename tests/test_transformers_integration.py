"""transformers' own decoders, attending through the index (``cacheidx.integrations.transformers``),
give transformers' own greedy tokens.

Every architecture of ``hf_models`` (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Phi-3, SmolLM3,
gpt-oss: tiny, random, built offline) is compared with its own ``generate`` (eager attention,
its default cache), each prompt alone: served by the engine over paged pools, prompts of
different lengths in one batch, a prefix read from the cache, prefill in chunks; compiled,
token by token over a scattered page table; and a forked beam reading its prompt's pages where
they are. Models it cannot serve are refused, naming what they lack.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

for _module in ("torch", "transformers"):
    pytest.importorskip(_module, reason=f"the transformers integration needs `{_module}`")

import torch  # noqa: E402
from hf_models import ARCHITECTURES, VOCAB, configs, greedy, tiny  # noqa: E402

import cacheidx as ci  # noqa: E402
from cacheidx.integrations import transformers as cit  # noqa: E402
from cacheidx.serve import Engine, Request  # noqa: E402

NEW = 6
PAGE = 4


def prompts_() -> list[list[int]]:
    """Prompts of 9, 5 and 13 tokens; the third begins with the first's first 8 (two pages)."""
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(0, VOCAB, n).tolist() for n in (9, 5, 13))
    return [a, b, a[:8] + c[8:]]


PROMPTS = prompts_()


@pytest.fixture(scope="module")
def reference():
    """``reference(name) -> (model, tokens)``: the tiny model (eager attention) and
    transformers' greedy tokens for each prompt, computed once per architecture."""
    made: dict = {}

    def get(name):
        if name not in made:
            model = tiny(name)
            tokens = [greedy(model, p, NEW) for p in PROMPTS]
            assert all(len(set(t)) > 1 for t in tokens), f"{name}: greedy tokens repeat one id"
            made[name] = model, tokens
        return made[name]

    return get


@pytest.fixture
def served():
    """``served(model)``: the model wrapped for the engine, its attention set back after."""
    wrapped = []

    def wrap(model):
        wrapped.append(cit.model(model))
        return wrapped[-1]

    yield wrap
    for w in wrapped:
        w.restore()


# -- which layers slide ------------------------------------------------------------------------
def eager_masks(model, n):
    """What transformers' eager attention sees in each layer for a prompt of ``n`` tokens:
    ``[layers][n, n]`` bool."""
    seen = {}

    def hook(module, args, kwargs):
        mask = kwargs["attention_mask"][0, 0]
        seen[module.layer_idx] = (mask == 0).numpy() if mask.dtype != torch.bool \
            else mask.numpy()

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
               for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.arange(n)[None] % VOCAB)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(seen))]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_layer_slides_where_transformers_own_mask_does(name):
    """``layer_windows`` names transformers' windows, and ``index.window(w)`` sees what its
    eager mask sees (the token itself counted), full layers what the causal mask sees."""
    config, windows = configs()[name]
    assert cit.layer_windows(config) == windows
    n = 10
    index = ci.rows(n, [n], xp="numpy")
    for layer, (window, mask) in enumerate(zip(windows, eager_masks(tiny(name), n),
                                               strict=True)):
        ours = (index if window is None else index.window(window)).mask()[0]
        np.testing.assert_array_equal(ours, mask, err_msg=f"{name} layer {layer}")


def test_a_kind_of_layer_it_cannot_serve_is_named():
    config, _ = configs()["qwen2"]
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="layer 1 is 'chunked_attention'; cacheidx serves "
                                         "full_attention and sliding_attention layers"):
        cit.layer_windows(config)


# -- the engine: paged pools, a batch of lengths, prefix hits, chunks ---------------------------
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_engine_gives_transformers_greedy_tokens(name, reference, served):
    """Three prompts of 9, 5 and 13 tokens arrive together: computed in chunks of 4, side by
    side in calls left padded to one length, over pages of 4 scattered in one pool; the third
    reads the first's two pages from the cache. Each gets the tokens it gets alone from
    transformers."""
    model, want = reference(name)
    engine = Engine(served(model), backend="torch", pages=32, page_size=PAGE, lanes=3,
                    chunk=4, clock="steps", debug=True)
    results = engine.run([Request(k, p, NEW) for k, p in enumerate(PROMPTS)])
    assert [r.tokens for r in results] == want
    assert [r.cached_tokens for r in results] == [0, 0, 8]
    assert engine.figures()["prefill_calls"] >= 4, "13 - 8 tokens in chunks of 4, and more"


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_a_sliding_group_keeps_only_its_window_and_gives_the_same_tokens(name, reference,
                                                                         served):
    """Mistral (every layer sliding) and Gemma 2 (sliding and full layers), window 4, pages of
    4: the sliding layers' pool holds 3 pages, fewer than the 13-token prompt fills, and each
    prompt still gets transformers' greedy tokens; the full layers' pool holds every page."""
    model, want = reference(name)
    wrapped = served(model)
    pages = {4: 3} if name == "mistral" else {None: 32, 4: 3}
    engine = Engine(wrapped, backend="torch", pages=pages, page_size=PAGE, lanes=3, chunk=4,
                    clock="steps", debug=True)
    results = engine.run([Request(k, p, NEW) for k, p in enumerate(PROMPTS)])
    assert [r.tokens for r in results] == want
    groups = engine.figures()["groups"]
    assert [g["window"] for g in groups] == ([4] if name == "mistral" else [None, 4])
    assert groups[-1]["peak_pages_in_use"] <= 3
    cache = engine.cache
    cache.check()
    assert cache.free + cache.cached == cache.capacity and cache.evictable == cache.cached


def test_generate_stops_at_the_models_end_token_and_gives_its_attention_back(reference):
    model, want = reference("llama")
    eos = want[0][2]
    model.generation_config.eos_token_id = [eos, VOCAB + 5]
    try:
        got = cit.generate(model, PROMPTS, max_new_tokens=NEW, page_size=PAGE, lanes=2,
                           chunk=8)
    finally:
        model.generation_config.eos_token_id = None
    for tokens, full in zip(got, want, strict=True):
        end = full.index(eos) + 1 if eos in full else NEW
        assert tokens == full[:end]
    assert model.config._attn_implementation == "eager"
    assert greedy(model, PROMPTS[1], NEW) == want[1], "transformers' own generate runs again"
    with pytest.raises(TypeError, match="generate: prompt 1: the prompt must hold integer "
                                        "token ids, got 2.5"):
        cit.generate(model, [[1, 2], [1, 2.5]])


# -- compiled: one program, token by token over scattered pages ---------------------------------
def stepwise(forward, pools, prompts, new, pages):
    """Every lane fed one token a call at the same position: its prompt, then its own greedy
    tokens, then padding once it has ``new``. Lane ``b``'s page ``k`` is page
    ``pages[b][k]`` of the pool. Returns each lane's tokens and the pools."""
    seqs, out = [list(p) for p in prompts], [[] for _ in prompts]
    table = torch.tensor([[page * PAGE + s for page in row for s in range(PAGE)]
                          for row in pages])
    for t in range(max(len(p) for p in prompts) + new - 1):
        live = [len(o) < new for o in out]
        tokens = torch.tensor([[seqs[b][t] if live[b] else 0] for b in range(len(seqs))])
        pos = torch.tensor([[t if live[b] else -1] for b in range(len(seqs))])
        logits, pools = forward(None, tokens, ci.make(pos, table), pools)
        for b, chosen in enumerate(torch.argmax(logits, dim=-1).tolist()):
            if live[b] and t >= len(prompts[b]) - 1:
                seqs[b].append(chosen)
                out[b].append(chosen)
    return out, pools


@pytest.mark.parametrize("name", [a for a in ARCHITECTURES if a != "gpt_oss"])
def test_compiled_gives_transformers_greedy_tokens(name, reference, served):
    """``torch.compile(fullgraph=True)`` of the wrapped model: dynamo captures each
    architecture's code whole, and one program serves every call. (Its ``eager`` backend runs
    the captured graph as it is; the functionalised stores of ``aot_eager``, which cost a
    second and a half more each, are the compiled engine's, below, with gpt-oss.)"""
    model, want = reference(name)
    wrapped = served(model)
    backend = ci.backends.get("torch")
    per_lane = -(-(len(PROMPTS[2]) + NEW - 1) // PAGE)
    pages = np.random.default_rng(2).permutation(3 * per_lane).reshape(3, per_lane).tolist()
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512):
        before = backend.programs(wrapped.forward)
        forward = torch.compile(wrapped.forward, backend="eager", fullgraph=True,
                                dynamic=False)
        got, _ = stepwise(forward, wrapped.pools(None, 3 * per_lane * PAGE), PROMPTS, NEW,
                          pages)
        assert backend.programs(wrapped.forward) == before + 1
    assert got == want


def test_the_compiled_engine_gives_transformers_greedy_tokens(reference, served):
    """gpt-oss (sinks, a mixture of experts, alternating windows) served by the engine
    compiled (aot_eager; inductor on a device): one prefill and one decode program, the
    weights and pools at fixed addresses, the same tokens as transformers."""
    model, want = reference("gpt_oss")
    backend = ci.backends.get("torch")
    engine = Engine(served(model), backend="torch", compile="aot_eager", shapes="fixed",
                    context=32, pages=32, page_size=PAGE, lanes=3, chunk=8, clock="steps")
    step = engine.executor
    jitted = (step._prefill, step._decode)
    before = [backend.programs(f) for f in jitted]  # (the process's other engines' programs)
    results = engine.run([Request(k, p, NEW) for k, p in enumerate(PROMPTS)])
    assert [r.tokens for r in results] == want
    assert results[2].cached_tokens == 8
    assert {k: len(v) for k, v in step.shapes.items()} == {"prefill": 1, "decode": 1}
    # one program each: no second one for a guard that failed (pools that required grad)
    assert [backend.programs(f) for f in jitted] == [n + 1 for n in before]


# -- a forked beam ----------------------------------------------------------------------------
def test_a_forked_beam_reads_its_prompts_pages_where_they_are(reference, served):
    """Gemma 2 (a window of 4 and full layers): the 8-token prompt is computed once into
    pages 5 and 2; two beams fork from it, each with its own next pages (7 and 1) and the
    prompt's pages in its table: no page is copied (transformers' ``reorder_cache``), the
    prompt's pages are never written again, and each beam's greedy tokens are transformers'
    for the prompt and its first token alone."""
    model, _ = reference("gemma2")
    wrapped = served(model)
    prompt = PROMPTS[0][:8]
    pools = wrapped.pools(None, 8 * PAGE)
    slots = [[page * PAGE + s for page in row for s in range(PAGE)] for row in ([5, 2, 7, 3],
                                                                                 [5, 2, 1, 6])]
    index = ci.make(torch.arange(8)[None], torch.tensor(slots[:1]))
    logits, pools = wrapped.forward(None, torch.tensor([prompt]), index, pools)
    first = torch.topk(logits[0], 2).indices.tolist()  # the two beams' first tokens
    shared = [p.clone() for kv in pools for p in kv]
    prompt_slots = torch.tensor(slots[0][:8])
    table, beams = torch.tensor(slots), [[f] for f in first]
    for step in range(NEW - 1):
        pos = torch.full((2, 1), 8 + step)
        tokens = torch.tensor([[b[-1]] for b in beams])
        logits, pools = wrapped.forward(None, tokens, ci.make(pos, table), pools)
        for b, chosen in zip(beams, torch.argmax(logits, dim=-1).tolist(), strict=True):
            b.append(chosen)
    for before, after in zip(shared, (p for kv in pools for p in kv), strict=True):
        assert torch.equal(before[prompt_slots], after[prompt_slots])
    wrapped.restore()
    for beam in beams:
        assert beam[1:] == greedy(model, prompt + beam[:1], NEW - 1)


# -- what it cannot serve ---------------------------------------------------------------------
def test_a_model_it_cannot_serve_is_refused_naming_what_it_lacks():
    import transformers as tr
    from transformers import AutoModelForCausalLM, BertConfig, BertForMaskedLM

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4)
    with pytest.raises(ValueError, match="BertForMaskedLM cannot generate .*an encoder"):
        cit.model(BertForMaskedLM(BertConfig(**small)))
    latent = tr.DeepseekV3Config(**small, num_key_value_heads=4, kv_lora_rank=16,
                                 q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                 v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=16, first_k_dense_replace=1)
    with pytest.raises(ValueError, match=r"multi-head latent attention \(config.kv_lora_rank "
                                         "= 16\\)"):
        cit.model(AutoModelForCausalLM.from_config(latent))
    with pytest.raises(TypeError, match="expected a transformers PreTrainedModel, got Module"):
        cit.model(torch.nn.Module())


def test_a_model_that_keeps_its_keywords_from_its_attention_is_refused():
    model = tiny("llama")
    for layer in model.model.layers:  # an attention forward that passes nothing down
        attention = layer.self_attn

        def dropping(hidden_states, position_embeddings, attention_mask, *a, _f=attention.forward,
                     **kw):
            return _f(hidden_states, position_embeddings, attention_mask)

        attention.forward = dropping
    with pytest.raises(ValueError, match="LlamaForCausalLM's forward does not pass its keyword "
                                         "arguments down to its attention function"):
        cit.model(model)
    assert model.config._attn_implementation == "eager", "given back on refusal"


def test_a_window_transformers_passes_against_its_mask_or_training_is_refused():
    """Qwen2's modules keep the window they were built with: told afterwards that layer 1 is
    full, transformers' mask and what it passes disagree, and nothing is attended. A model in
    training mode with dropout is refused too."""
    model = tiny("qwen2")
    model.config.layer_types = ["full_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer 1 of Qwen2Attention is passed sliding_window=4, "
                                         "but its mask slides by None"):
        cit.model(model)
    model = tiny("llama")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="in training mode with dropout 0.1; cacheidx attends "
                                         "for inference"):
        cit.model(model)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("own", ["eager", "sdpa"])
def test_a_wrapped_model_called_without_an_index_is_the_models_own(own, served):
    """Wrapped, Qwen2 (a full and a sliding layer) is set to ``"cacheidx:OWN"``: transformers'
    own ``generate`` on it, two prompts left padded in one batch, gives exactly the tokens it
    gives unwrapped (its own attention function and mask). Set to ``"cacheidx"`` by hand, a call
    without an index raises, naming the layer; off torch the engine says so."""
    model = tiny("qwen2")
    model.set_attn_implementation(own)
    batch = torch.tensor([[0, 0, 0, *PROMPTS[1]], PROMPTS[0][:8]])
    mask = (torch.arange(8) >= torch.tensor([[3], [0]])).long()

    def generate():
        with torch.no_grad():
            return model.generate(batch, attention_mask=mask, max_new_tokens=NEW,
                                  do_sample=False).tolist()

    want = generate()
    wrapped = served(model)
    assert model.config._attn_implementation == f"cacheidx:{own}"
    assert generate() == want
    model.set_attn_implementation(cit.register())
    with pytest.raises(cit.NoIndex, match="layer 0 .*called without cacheidx_index"):
        greedy(model, [1, 2, 3], 2)
    with pytest.raises(ValueError, match="runs on the torch backend, not"):
        Engine(wrapped, backend="numpy", pages=4, page_size=4)
    wrapped.restore()
    assert model.config._attn_implementation == own
    with pytest.raises(RuntimeError, match="attention implementation is '(eager|sdpa)' \\(set "
                                           "back since it was wrapped\\)"):
        wrapped.forward(None, torch.tensor([[1]]), ci.rows(1, [1], xp="torch"),
                        wrapped.pools(None, 1))


# -- the serve command --------------------------------------------------------------------------
def write_gguf(path, seed=0):
    """A tiny Llama GGUF file of float32 random weights (no tokenizer)."""
    gguf = pytest.importorskip("gguf", reason="writing a GGUF file needs `gguf`")
    rng = np.random.default_rng(seed)
    dim, hidden, heads, kv, layers = 32, 64, 4, 2, 2
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in (("block_count", layers), ("context_length", 256),
                       ("embedding_length", dim), ("feed_forward_length", hidden),
                       ("head_count", heads), ("head_count_kv", kv),
                       ("layer_norm_rms_eps", 1e-5), ("rope_freq_base", 10000.0),
                       ("vocab_size", VOCAB), ("rope_dimension_count", dim // heads)):
        getattr(w, f"add_{add}")(value)

    def tensor(name, *shape):
        w.add_tensor(name, (0.5 * rng.standard_normal(shape)).astype(np.float32))

    tensor("token_embd.weight", VOCAB, dim)
    tensor("output.weight", VOCAB, dim)
    w.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    for i in range(layers):
        for name, shape in (("attn_q", (dim, dim)), ("attn_k", (kv * dim // heads, dim)),
                            ("attn_v", (kv * dim // heads, dim)), ("attn_output", (dim, dim)),
                            ("ffn_gate", (hidden, dim)), ("ffn_up", (hidden, dim)),
                            ("ffn_down", (dim, hidden))):
            tensor(f"blk.{i}.{name}.weight", *shape)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(dim, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_serve_command_serves_a_saved_folder_and_a_gguf_file(reference, tmp_path,
                                                                 capsys):
    """A folder ``save_pretrained`` wrote (Qwen2, no tokenizer: requests give ids, one with
    messages fails alone) and a GGUF file: the command's tokens are transformers' greedy
    ones."""
    from cacheidx.serve.__main__ import main

    model, want = reference("qwen2")
    model.save_pretrained(tmp_path / "qwen2")
    write_gguf(tmp_path / "tiny.gguf")
    lines = [{"id": k, "prompt_ids": p} for k, p in enumerate(PROMPTS)]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(x) for x in lines + [
        {"id": "chat", "messages": [{"role": "user", "content": "hi"}]}]) + "\n")
    rc = main([str(requests), "--model", str(tmp_path / "qwen2"), "--json", "--page-size",
               "4", "--max-new-tokens", str(NEW)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1, "the chat request failed"
    assert [r["tokens"] for r in out["requests"][:3]] == want
    assert "qwen2 has no tokenizer (the folder holds no tokenizer files): give " \
           "\"prompt_ids\"" in out["requests"][3]["error"]
    assert out["figures"]["cached_tokens"] == 8
    requests.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main([str(requests), "--model", str(tmp_path / "tiny.gguf"), "--json",
                 "--max-new-tokens", str(NEW)]) == 0
    out = json.loads(capsys.readouterr().out)
    gguf_model = cit.load(str(tmp_path / "tiny.gguf")).model
    assert [r["tokens"] for r in out["requests"]] == [greedy(gguf_model, p, NEW)
                                                      for p in PROMPTS]
    assert main([str(requests), "--model", str(tmp_path / "absent")]) == 2
    assert "neither a folder save_pretrained wrote" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main([str(requests), "--model", str(tmp_path / "qwen2"), "--backend", "numpy"])
    assert stop.value.code == 2
    assert "--model serves a transformers model on the torch backend" in \
        capsys.readouterr().err


def test_the_serve_command_serves_a_long_prompt_on_a_pool_of_one_window(tmp_path, capsys):
    """Issue 19: a Mistral-like model whose every layer slides over 8 tokens serves a
    120-token prompt and 8 new tokens through ``--pages 10 --page-size 4`` (40 slots: a third
    of the prompt), the chunks cut to fit, and gives transformers' greedy tokens. Two pages,
    fewer than one window reads, are refused; ``generate``'s default pool holds a window."""
    import transformers as tr

    from cacheidx.serve.__main__ import main

    config, _ = configs()["mistral"]
    config.sliding_window = 8
    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path / "mistral")
    prompt = np.random.default_rng(5).integers(0, VOCAB, 120).tolist()
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"id": "long", "prompt_ids": prompt}) + "\n")
    assert main([str(requests), "--model", str(tmp_path / "mistral"), "--json", "--pages", "10",
                 "--page-size", "4", "--max-new-tokens", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"][0]["tokens"] == greedy(model, prompt, 8)
    assert out["figures"]["chunk"] == 30 and out["figures"]["peak_pages_in_use"] == 10
    # a pool below one window is refused, naming the numbers; by default a pool holds one
    assert main([str(requests), "--model", str(tmp_path / "mistral"), "--pages", "2",
                 "--page-size", "4"]) == 2
    assert "the pool of the 2 layers of window 8 has 2 pages of 4 tokens; one window needs " \
           "3" in capsys.readouterr().err
    assert cit.generate(model, [prompt[:5]], max_new_tokens=3, page_size=4) == \
        [greedy(model, prompt[:5], 3)]


# -- SmolLM2, real weights ------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_through_transformers_modeling_code_equals_cacheidx_llama():
    """The same GGUF file, read by transformers into its Llama modeling code and attending
    through the index, and read by cacheidx into its own Llama: the same greedy tokens, chat
    conversations sharing a system prompt through the prefix cache."""
    from smollm2_support import smollm2_or_skip

    from cacheidx.serve import LlamaModel

    config, params, gguf = smollm2_or_skip()
    prompts = [gguf.conversation_ids([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name a prime number.",
                         "Write a haiku about the sea.")]
    ours = Engine(LlamaModel(config, params), pages=64, page_size=16, lanes=3)
    want = [r.tokens for r in ours.run([Request(k, p, 8, stop={2})
                                        for k, p in enumerate(prompts)])]
    hf = gguf.transformers_model()
    assert cit.stop_ids(hf) == {2}
    assert cit.generate(hf, prompts, max_new_tokens=8, lanes=3) == want
    assert hf.config._attn_implementation != cit.NAME
