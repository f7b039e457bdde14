"""Hybrid and state-space transformers decoders, their recurrent layers over cacheidx's state
pools (``cacheidx.state``) and their attention through the index, give transformers' own greedy
tokens.

Every family of ``hf_hybrids`` (tiny, random, built offline) is compared with its own
``generate`` (eager attention, its own cache), each prompt alone: through the wrapped model's
``forward`` over indices built here as an engine builds them (``cacheidx.make(pos, table,
row=rows, every=[(m, blocks)])``), a prompt prefilled whole or in chunks that end at block
ends, then decoded with another sequence side by side; a prompt resumed from another one's
snapshot and pages; and served by the engine (``cacheidx.serve.Engine``, ``cit.generate``) with
the prefix cache on, off and under eviction. Families it cannot serve are refused, naming
why.
"""

from __future__ import annotations

import numpy as np
import pytest

for _module in ("torch", "transformers"):
    pytest.importorskip(_module, reason=f"the transformers integration needs `{_module}`")

import torch  # noqa: E402
from hf_hybrids import FAMILIES, VOCAB, greedy, refused_configs, tiny  # noqa: E402

import cacheidx as ci  # noqa: E402
from cacheidx import state  # noqa: E402
from cacheidx.integrations import transformers as cit  # noqa: E402
from cacheidx.serve import Engine, Request  # noqa: E402

NEW = 6
PAGE = 4
M = 4  # a snapshot every 4 positions (a page's)
CONTEXT = 32  # each sequence's columns


def prompts_() -> list[list[int]]:
    """Prompts of 11 and 7 tokens, and a third that begins with the first's first 8 (two
    blocks) and goes on with 5 of its own."""
    rng = np.random.default_rng(3)
    a, b, c = (rng.integers(0, VOCAB, n).tolist() for n in (11, 7, 5))
    return [a, b, a[:8] + c]


PROMPTS = prompts_()


@pytest.fixture(scope="module")
def reference():
    """``reference(name) -> (wrapped, tokens)``: the family's tiny model wrapped, and
    transformers' greedy tokens for each prompt (computed before the wrap), once a family."""
    import transformers

    transformers.logging.set_verbosity_error()  # (the kernels' torch fallbacks warn once)
    made: dict = {}
    yield lambda name: made[name] if name in made else made.setdefault(name, _made(name))
    for wrapped, _ in made.values():
        wrapped.restore()


def _made(name):
    model = tiny(name)
    tokens = [greedy(model, p, NEW) for p in PROMPTS]
    assert all(len(set(t)) > 1 for t in tokens), f"{name}: greedy tokens repeat one id"
    return cit.model(model), tokens


class Served:
    """Sequences over one set of pools as an engine keeps them: sequence ``r`` is row ``r``
    of the table (``CONTEXT`` slots from ``r * CONTEXT``; its running state slot ``r``) and
    of the table of blocks of ``M`` (snapshot slots from ``r * CONTEXT / M``)."""

    def __init__(self, wrapped, rows: int):
        self.wrapped, self.rows = wrapped, rows
        per = CONTEXT // M
        self.table = torch.arange(rows * CONTEXT).reshape(rows, CONTEXT)
        self.blocks = torch.arange(rows * per).reshape(rows, per)
        self.pools = wrapped.pools(None, [(rows, rows * per) if i in wrapped.state_kinds
                                          else rows * CONTEXT
                                          for i in range(len(wrapped.layout))])
        self.seqs: dict[int, list[int]] = {}

    def index(self, pos, row):
        return ci.make(torch.tensor(pos), self.table, row=torch.tensor(row),
                       every=[(M, self.blocks)])

    def call(self, tokens, pos, row):
        logits, self.pools = self.wrapped.forward(None, torch.tensor(tokens),
                                                  self.index(pos, row), self.pools)
        return logits

    def prefill(self, r, prompt, cuts=None, start=0):
        """Sequence ``r``'s prompt from position ``start`` on, one lane a call, in the chunks
        ``cuts`` names (each chunk's end; the prompt's end last); its first greedy token."""
        self.seqs[r] = list(prompt)
        ends = [len(prompt)] if cuts is None else list(cuts)
        for a, b in zip([start] + ends, ends, strict=False):
            logits = self.call([prompt[a:b]], [list(range(a, b))], [r])
        self.seqs[r].append(int(logits[0].argmax()))

    def decode(self, new):
        """Every sequence side by side, one token a call, until each has ``new`` tokens past
        its prompt; a lane whose sequence has them is padding (position -1, row -1)."""
        rows = sorted(self.seqs)
        out = {r: [self.seqs[r][-1]] for r in rows}
        while any(len(out[r]) < new for r in rows):
            live = [len(out[r]) < new for r in rows]
            tokens = [[self.seqs[r][-1] if ok else 0] for r, ok in zip(rows, live, strict=True)]
            pos = [[len(self.seqs[r]) - 1 if ok else -1] for r, ok in zip(rows, live, strict=True)]
            row = [r if ok else -1 for r, ok in zip(rows, live, strict=True)]
            logits = self.call(tokens, pos, row)
            for b, r in enumerate(rows):
                if live[b]:
                    chosen = int(logits[b].argmax())
                    self.seqs[r].append(chosen)
                    out[r].append(chosen)
        return [out[r] for r in rows]


# -- transformers' tokens ------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_forward_gives_transformers_greedy_tokens(name, reference):
    """Two prompts of 11 and 7 tokens, each prefilled whole into its own row, then decoded
    side by side (the second lane padding once it has its tokens): each gets the tokens it
    gets alone from transformers' own ``generate``."""
    wrapped, want = reference(name)
    assert wrapped.recurrent_layers and wrapped.final_states_only
    assert wrapped.lanes_per_prefill == 1
    served = Served(wrapped, 2)
    served.prefill(0, PROMPTS[0])
    served.prefill(1, PROMPTS[1])
    assert served.decode(NEW) == want[:2]


@pytest.mark.parametrize("name", FAMILIES)
def test_chunks_that_end_at_block_ends_give_the_same_tokens_and_snapshots(name, reference):
    """The 11-token prompt in chunks of 4, 4 and 3 (each but the last closing a block of
    ``M``): the same tokens; the snapshots of blocks 0 and 1 are the running states after 4
    and 8 tokens computed whole (law 2 of ``cacheidx.state``), and block 4's slot, which no
    token closed (the last decoded token fed sits at position 15), holds zeros."""
    wrapped, want = reference(name)
    served = Served(wrapped, 1)
    served.prefill(0, PROMPTS[0], cuts=[4, 8, 11])
    assert served.decode(NEW) == want[:1]
    for end, block in ((4, 0), (8, 1)):
        whole = Served(wrapped, 1)
        whole.prefill(0, PROMPTS[0][:end])
        for layer in wrapped.recurrent_layers:
            for kind, mine, theirs in zip(wrapped.state_kinds[layer], served.pools[layer],
                                          whole.pools[layer], strict=True):
                torch.testing.assert_close(mine.snapshots[block], theirs.running[0],
                                           rtol=1e-4, atol=1e-4,
                                           msg=f"{name} layer {layer} {kind.what} {block}")
    for layer in wrapped.recurrent_layers:
        for p in served.pools[layer]:
            assert p.snapshots[3].any() and not p.snapshots[4].any()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_prompt_resumed_from_another_ones_snapshot_gives_the_same_tokens(name, reference):
    """The third prompt shares the first's first 8 tokens: its row's first 8 columns name the
    first's slots and its blocks 0 and 1 the first's snapshots, so only its last 5 tokens are
    computed, from the snapshot of block 1 (its own running slot holds zeros). It gets
    transformers' tokens for the whole prompt, and the first's pages and snapshots are as
    they were."""
    wrapped, want = reference(name)
    served = Served(wrapped, 2)
    served.prefill(0, PROMPTS[0], cuts=[4, 8, 11])
    served.table[1, :8] = served.table[0, :8]
    served.blocks[1, :2] = served.blocks[0, :2]
    kept = [[p.snapshots[:2].clone() for p in served.pools[i]] for i in wrapped.recurrent_layers]
    served.prefill(1, PROMPTS[2], start=8)
    assert served.decode(NEW) == [want[0], want[2]]
    for i, layer in enumerate(wrapped.recurrent_layers):
        for before, p in zip(kept[i], served.pools[layer], strict=True):
            assert torch.equal(before, p.snapshots[:2])


@pytest.mark.parametrize("name", ["qwen3_5", "mamba2", "lfm2"])
def test_a_zero_start_is_no_previous_state(name, reference):
    """A recurrent layer is always told it has a previous state; from zero pools the logits
    of a prompt's call are transformers' own without any cache."""
    wrapped, _ = reference(name)
    served = Served(wrapped, 1)
    prompt = PROMPTS[0]
    logits = served.call([prompt], [list(range(len(prompt)))], [0])
    with torch.no_grad():
        own = wrapped.hf(torch.tensor([prompt]), use_cache=False).logits[:, -1]
    torch.testing.assert_close(logits, own, rtol=1e-4, atol=1e-4)


# -- the engine ----------------------------------------------------------------------------------
def engine_run(wrapped, prompts, *, cache=True, repeat=1, **options):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the engine's notes
        engine = Engine(wrapped, backend="torch", page_size=PAGE, clock="steps", debug=True,
                        cache=cache, state_every=M,
                        **{"pages": 32, "lanes": 3, "chunk": 4, **options})
        results = engine.run([Request(k, p, NEW) for k, p in enumerate(prompts * repeat)])
    assert [r.error for r in results] == [None] * len(results)
    engine.cache.check()
    return results, engine.figures()


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_engine_gives_transformers_greedy_tokens(name, cache, reference):
    """The three prompts served together by the engine (pages of 4, a snapshot every 4
    positions, chunks of 4, three lanes): each gets transformers' tokens; with the prefix
    cache the third resumes from the first's pages and its snapshot of block 1 (8 tokens),
    without it every prompt is computed whole."""
    wrapped, want = reference(name)
    results, f = engine_run(wrapped, PROMPTS, cache=cache)
    assert [r.tokens for r in results] == want
    assert [r.cached_tokens for r in results] == ([0, 0, 8] if cache else [0, 0, 0])
    assert f["snapshots"]["every"] == M


#: the families the engine's eviction, ``generate`` and the serve command are run on: one of
#: each kind of recurrent layer (Gated DeltaNet, short convolution, Mamba 2, Mamba) and the
#: families beside them, pure state-space ones among them
SOME = ["qwen3_5", "lfm2", "bamba", "granitemoehybrid", "nemotron_h", "mamba", "mamba2"]


@pytest.mark.parametrize("name", SOME)
def test_the_engine_under_eviction_of_snapshots_gives_the_same_tokens(name, reference):
    """The prompts three times over a pool of 8 snapshots and 10 pages: snapshots and pages
    are evicted, and every request still gets transformers' tokens."""
    wrapped, want = reference(name)
    results, f = engine_run(wrapped, PROMPTS, repeat=3, snapshots=8, pages=10)
    assert [r.tokens for r in results] == want * 3
    assert f["snapshots"]["evictions"] > 0 and f["evictions"] > 0


@pytest.mark.filterwarnings("ignore::UserWarning")  # the engine's notes
@pytest.mark.parametrize("name", SOME)
def test_generate_gives_transformers_greedy_tokens(name, reference):
    """``cit.generate`` (the engine's default snapshot block and pools) with the prefix cache
    on and off, and under eviction (pools of 5 pages, fewer than the prompts' 14, and 8
    snapshots, the prompts twice, one lane)."""
    wrapped, want = reference(name)
    for cache in (True, False):
        assert cit.generate(wrapped.hf, PROMPTS, max_new_tokens=NEW, page_size=PAGE,
                            cache=cache, lanes=2) == want, f"cache {cache}"
    assert cit.generate(wrapped.hf, PROMPTS * 2, max_new_tokens=NEW, page_size=PAGE, pages=5,
                        snapshots=8, lanes=1) == want * 2, "under eviction"


@pytest.mark.parametrize("name", ["qwen3_5", "mamba"])
def test_compiled_decode_is_one_program_and_gives_transformers_tokens(name, reference):
    """``torch.compile(fullgraph=True)`` of the wrapped forward (its ``eager`` backend): dynamo
    captures the call's cache and the modeling code whole, and one program serves every
    decode call of both lanes."""
    wrapped, want = reference(name)
    backend = ci.backends.get("torch")
    served = Served(wrapped, 2)
    served.prefill(0, PROMPTS[0])
    served.prefill(1, PROMPTS[1])
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512):
        before = backend.programs(wrapped.forward)
        eager, served.wrapped = wrapped, type("Compiled", (), {"forward": staticmethod(
            torch.compile(wrapped.forward, backend="eager", fullgraph=True, dynamic=False))})
        try:
            assert served.decode(NEW) == want[:2]
        finally:
            served.wrapped = eager
        assert backend.programs(wrapped.forward) == before + 1


# -- what each keeps ---------------------------------------------------------------------------
def test_each_family_says_its_layers_and_the_bytes_of_its_states(reference):
    """Which layers are recurrent, each kind's row shape (transformers' own cache's, less its
    batch axis), and the bytes a sequence's states take (float32 here)."""
    want = {
        # conv window [2 * keys + values, kernel] and delta-rule state [v heads, d_k, d_v]
        "qwen3_5": ((0, 2), [(64, 4), (4, 8, 8)]),
        "lfm2": ((0, 2), [(32, 3)]),
        # Mamba 2: conv [intermediate + 2 * groups * d_state, kernel], SSM [heads, d_head, d_state]
        "bamba": ((0,), [(80, 4), (4, 16, 8)]),
        "mamba2": ((0, 1), [(80, 4), (4, 16, 8)]),
        # Mamba: conv [intermediate, kernel], SSM [intermediate, d_state]
        "mamba": ((0, 1), [(64, 4), (64, 8)]),
        "nemotron_h": ((0,), [(80, 4), (4, 16, 8)]),
    }
    for name, (layers, shapes) in want.items():
        wrapped, _ = reference(name)
        assert wrapped.recurrent_layers == layers, name
        assert [k.shape for k in wrapped.state_kinds[layers[0]]] == shapes, name
        per_layer = sum(4 * int(np.prod(s)) for s in shapes)
        assert wrapped.state_bytes() == len(layers) * per_layer, name
    nemotron, _ = reference("nemotron_h")
    assert nemotron.layout[1] == nemotron.layout[3] == "nothing"  # its MLP and MoE layers
    assert [p for p in nemotron.pools(None, [(1, 0), 4, 4, 4])[1]] == []
    assert reference("mamba")[0].stepwise and not reference("qwen3_5")[0].stepwise
    assert reference("mamba")[0].token_bytes() == 0


@pytest.mark.parametrize("name", ["qwen3_5", "mamba"])
def test_a_lane_padded_beside_its_tokens_is_computed_one_token_a_call(name, reference):
    """Two prompts of 11 and 7 tokens side by side, the second left padded, then a chunk of
    each resumed, the first right padded and the second left padded: the modeling code would
    take the padding into its states, so each call is computed a column at a time, and each
    sequence gets the tokens it gets alone."""
    wrapped, want = reference(name)
    served = Served(wrapped, 2)
    a, b = PROMPTS[0], PROMPTS[1]
    served.call([a[:8], [0, 0, 0, 0] + b[:4]], [list(range(8)), [-1] * 4 + list(range(4))],
                [0, 1])
    logits = served.call([a[8:10] + [0, 0], [0] + b[4:]], [[8, 9, -1, -1], [-1, 4, 5, 6]],
                         [0, 1])
    first = int(logits[1].argmax())  # (the first lane's last column is padding: its token next)
    logits = served.call([[a[10]], [0]], [[10], [-1]], [0, 1])
    served.seqs = {0: a + [int(logits[0].argmax())], 1: b + [first]}
    assert served.decode(NEW) == want[:2]


# -- what it refuses ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(refused_configs()))
def test_a_layer_keeping_keys_and_a_state_is_refused(name):
    model = tiny(name)
    with pytest.raises(ValueError, match="keeps both keys and values and a recurrent state "
                                         r"\(LinearAttentionAndFullAttentionLayer\)"):
        cit.model(model)
    assert model.config._attn_implementation == "eager"


def test_a_model_whose_state_does_not_carry_is_refused():
    """A Gated DeltaNet whose layer stores its state but never reads it back (its cache says
    it has none): a prompt computed whole and one token a call differ, so it is refused at
    wrap time."""
    model = tiny("qwen3_5")
    cache_type = type(model.model.layers[0].linear_attn)
    forward = cache_type.forward

    class Forgetful:
        def __init__(self, cache):
            self.cache = cache

        def __getattr__(self, name):
            return getattr(self.cache, name)

        def get_conv_state(self, *args, **kwargs):
            return None

        get_recurrent_state = get_conv_state

    def forgetting(self, hidden_states, cache=None, attention_mask=None, **kw):
        return forward(self, hidden_states, cache and Forgetful(cache), attention_mask, **kw)

    cache_type.forward = forgetting
    try:
        with pytest.raises(ValueError, match="recurrent layers do not carry their state from "
                                             "one call to the next"):
            cit.model(model)
    finally:
        cache_type.forward = forward
    assert model.config._attn_implementation == "eager"


def test_bad_lanes_and_slots_are_refused(reference):
    wrapped, _ = reference("qwen3_5")
    served = Served(wrapped, 2)
    with pytest.raises(TypeError, match="layer 0 of Qwen3_5ForCausalLM is recurrent: its "
                                        "slots are a pair"):
        wrapped.pools(None, 4)
    with pytest.raises(TypeError, match="layer 1 of Qwen3_5ForCausalLM attends: its slots "
                                        r"are a number, got \(4, 0\)"):
        wrapped.pools(None, [(4, 0)] * 4)
    with pytest.raises(ValueError, match="slots names 2 layers; Qwen3_5ForCausalLM has 4"):
        wrapped.pools(None, [4, 4])
    pools = list(served.pools)
    pools[0] = (state.Pools(torch.zeros(2, 3), torch.zeros(8, 3)), pools[0][1])
    with pytest.raises(ValueError, match=r"forward: layer 0's conv running pool holds "
                                         r"torch.float32 rows of \[3\]; the layer's state is "
                                         r"torch.float32 of \[64, 4\]"):
        wrapped.forward(None, torch.tensor([[1]]), served.index([[0]], [0]), pools)
    pools[0] = pools[0][:1]
    with pytest.raises(TypeError, match="layer 0's pools must be a tuple of 2 state.Pools "
                                        r"\(conv, recurrent\), got tuple"):
        wrapped.forward(None, torch.tensor([[1]]), served.index([[0]], [0]), pools)


# -- the serve command ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(reference, tmp_path_factory):
    """``saved(name) -> folder``: the family's tiny model as ``save_pretrained`` writes it."""
    root, made = tmp_path_factory.mktemp("hybrids"), {}

    def folder(name):
        if name not in made:
            reference(name)[0].hf.save_pretrained(root / name)
            made[name] = root / name
        return made[name]

    return folder


def serve_command(folder, prompts, capsys, tmp_path, *options):
    """``python -m cacheidx.serve REQUESTS --model FOLDER --json`` (pages of 4, one lane, so
    each request is admitted once the one before it has finished): the printed requests and
    figures."""
    import json

    from cacheidx.serve.__main__ import main

    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps({"id": k, "prompt_ids": p})
                                  for k, p in enumerate(prompts)) + "\n")
    assert main([str(requests), "--model", str(folder), "--json", "--page-size", str(PAGE),
                 "--max-new-tokens", str(NEW), "--lanes", "1", *options]) == 0
    out = json.loads(capsys.readouterr().out)
    return out["requests"], out["figures"]


@pytest.mark.filterwarnings("ignore::UserWarning")  # the engine's notes
@pytest.mark.parametrize("mode", ["cache", "no-cache", "eviction"])
@pytest.mark.parametrize("name", ["qwen3_5", "lfm2", "bamba", "granitemoehybrid", "nemotron_h",
                                  "qwen3_next"])
def test_the_serve_command_gives_transformers_greedy_tokens(name, mode, reference, saved,
                                                            tmp_path, capsys):
    """``python -m cacheidx.serve --model FOLDER`` of a folder ``save_pretrained`` wrote (the
    engine's own snapshot block): the command's tokens are transformers' greedy ones with the
    prefix cache on (``--pages 32``, a snapshot pool with room for the junctions: the third
    prompt resumes at the first's junction, its 8 shared tokens), off (``--no-cache``:
    nothing read from the cache), and under eviction (``--pages 5``: pages and snapshots
    evicted, the prompts twice)."""
    wrapped, want = reference(name)
    options, prompts = {"cache": (["--pages", "32"], PROMPTS),
                        "no-cache": (["--no-cache"], PROMPTS),
                        "eviction": (["--pages", "5"], PROMPTS * 2)}[mode]
    got, f = serve_command(saved(name), prompts, capsys, tmp_path, *options)
    assert [r["tokens"] for r in got] == want * (len(prompts) // len(PROMPTS))
    assert f["snapshots"]["every"] == wrapped_every(wrapped)
    cached = [r["cached_tokens"] for r in got]
    if mode == "cache":
        assert cached == [0, 0, 8]
    elif mode == "no-cache":
        assert cached == [0] * 3 and f["cached_tokens"] == 0
    else:
        assert f["evictions"] > 0 and f["snapshots"]["evictions"] > 0


def wrapped_every(wrapped):
    """The engine's snapshot block for the model at pages of ``PAGE`` (its rule)."""
    from cacheidx.serve.engine import state_every

    return state_every(wrapped.state_bytes(), wrapped.token_bytes(), PAGE,
                       getattr(wrapped, "state_chunk", 1) or 1)


@pytest.mark.filterwarnings("ignore::UserWarning")  # the engine's notes
def test_the_serve_command_serves_a_saved_state_space_model(reference, saved, tmp_path, capsys):
    """A pure state-space model (Mamba: no attention layer, so ``m`` is 16 pages) served by the
    command with the cache on and off: transformers' greedy tokens."""
    _, want = reference("mamba")
    for options in ([], ["--no-cache"]):
        got, _ = serve_command(saved("mamba"), PROMPTS, capsys, tmp_path, *options)
        assert [r["tokens"] for r in got] == want, options
