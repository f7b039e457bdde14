"""cacheidx.models.deltanet (a Gated DeltaNet layer, its states under the index) against an
independent float64 reference from scratch, across chunk splits, snapshots and libraries; and
a hybrid decoder (attention and DeltaNet layers) through cacheidx.models.llama."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cacheidx as ci
from cacheidx import state
from cacheidx.models import deltanet, llama
from cacheidx.serve.model import LlamaModel

SHAPE = deltanet.Shape(dim=16, key_heads=2, value_heads=4, key_dim=4, value_dim=3, kernel=4)
#: float32 against the float64 reference: a few thousand roundings of numbers near 1
TOL = 2e-5


def params(seed=0):
    return deltanet.random_params(SHAPE, np.random.default_rng(seed))


# -- the reference: one sequence from scratch, in float64, by the module's formulas -------------
def reference(p, h):
    """Outputs ``[n, dim]`` of one sequence's normed inputs ``h`` ``[n, dim]`` from position 0,
    and the states ``(conv, recurrent)`` after each token."""
    c, p = SHAPE, {k: np.asarray(v, np.float64) for k, v in p.items()}
    h = np.asarray(h, np.float64)
    n = len(h)
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    u = h @ p["w_qkv"]
    padded = np.concatenate([np.zeros((c.kernel - 1, c.conv_dim)), u])
    z = (h @ p["w_z"]).reshape(n, c.value_heads, c.value_dim)
    beta = 1 / (1 + np.exp(-(h @ p["w_b"])))
    g = -np.exp(p["A_log"]) * np.log1p(np.exp(h @ p["w_a"] + p["dt_bias"]))
    S = np.zeros((c.value_heads, c.key_dim, c.value_dim))
    out, convs, recs = [], [], []
    for t in range(n):
        window = padded[t:t + c.kernel]  # the inputs t - kernel + 1 .. t
        y = silu((window * p["conv"]).sum(0))
        q = y[:c.keys].reshape(c.key_heads, c.key_dim)
        k = y[c.keys:2 * c.keys].reshape(c.key_heads, c.key_dim)
        v = y[2 * c.keys:].reshape(c.value_heads, c.value_dim)
        o = np.zeros((c.value_heads, c.value_dim))
        for head in range(c.value_heads):
            kh = c.key_heads * head // c.value_heads
            qn = q[kh] / math.sqrt(q[kh] @ q[kh] + 1e-6) / math.sqrt(c.key_dim)
            kn = k[kh] / math.sqrt(k[kh] @ k[kh] + 1e-6)
            S[head] = math.exp(g[t, head]) * S[head]
            S[head] = S[head] + np.outer(kn, beta[t, head] * (v[head] - kn @ S[head]))
            o[head] = qn @ S[head]
        o = o / np.sqrt((o * o).mean(-1, keepdims=True) + c.eps) * p["norm"] * silu(z[t])
        out.append(o.reshape(-1) @ p["w_out"])
        convs.append(padded[t + 1:t + c.kernel].copy())
        recs.append(S.copy())
    return np.stack(out), convs, recs


def run(p, h, ix, pools, xp="numpy"):
    """The layer through ``ix``: outputs ``[batch, seq, dim]`` on the host, and the pools."""
    be = ci.backends.get(xp)
    out, pools = deltanet.mix(p, SHAPE, be.from_host(h.reshape(-1, SHAPE.dim), be.xp.float32),
                              ix, pools)
    return host(out).reshape(ix.batch, ix.seq, SHAPE.dim), pools


def host(x):
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def nan_pools(rows, snapshots):
    return tuple(state.Pools(np.full((rows, *s), np.nan, np.float32),
                             np.full((snapshots, *s), np.nan, np.float32))
                 for s in deltanet.state_shapes(SHAPE))


def close(got, want, what, tol=TOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    err = np.max(np.abs(got - want) / (1 + np.abs(want))) if got.size else 0.0
    assert err <= tol, f"{what}: off by {err:.2e} (tolerance {tol:.0e})"


# -- laws ------------------------------------------------------------------------------------------
def test_outputs_and_states_equal_the_float64_reference():
    """Two left-padded lanes of one call: each token's output, the running states and the
    snapshots at each block end (m = 3) equal the reference from scratch; padding outputs
    zero and a row's NaN running slot is never read (both start at position 0)."""
    p, m, rng = params(), 3, np.random.default_rng(1)
    lens = [8, 5]
    h = rng.standard_normal((2, 8, SHAPE.dim)).astype(np.float32)
    ix = ci.rows(8, lens, every=[m])  # blocks: sequence b's at slots 3b .. 3b + 2
    out, (conv, rec) = run(p, h, ix, nan_pools(2, 6))
    for b, n in enumerate(lens):
        want, convs, recs = reference(p, h[b, 8 - n:])
        close(out[b, 8 - n:], want, f"lane {b}'s outputs")
        assert not out[b, :8 - n].any(), "padding outputs zero"
        close(conv.running[b], convs[-1], f"lane {b}'s conv state")
        close(rec.running[b], recs[-1], f"lane {b}'s recurrent state")
        for j in range(3):
            if j * m + m - 1 < n:
                close(rec.snapshots[3 * b + j], recs[j * m + m - 1], f"lane {b}'s block {j}")
                close(conv.snapshots[3 * b + j], convs[j * m + m - 1], f"lane {b}'s block {j}")
            else:
                assert np.isnan(rec.snapshots[3 * b + j]).all(), "a block not closed is stored"


def feed_in_chunks(p, h, size, m=4, xp="numpy"):
    """One sequence (lane 0) fed ``size`` tokens a call through a table of 16 columns, lane 1
    padding throughout: every output, and the pools after the last call."""
    be = ci.backends.get(xp)
    to = lambda a: be.from_host(np.asarray(a, np.int64))  # noqa: E731
    n = len(h)
    pools = tuple(tuple(be.from_host(a) for a in q) for q in nan_pools(2, 8))
    pools = tuple(state.Pools(*q) for q in pools)
    table, blocks = np.arange(32).reshape(2, 16), np.arange(8).reshape(2, 4)
    outs = []
    for a in range(0, n, size):
        k = min(size, n - a)
        pos = np.full((2, size), -1)
        pos[0, size - k:] = np.arange(a, a + k)
        x = np.zeros((2, size, SHAPE.dim), np.float32)
        x[0, size - k:] = h[a:a + k]
        ix = ci.make(to(pos), to(table), every=[(m, to(blocks))])
        out, pools = run(p, x, ix, pools, xp)
        outs.append(out[0, size - k:])
    return np.concatenate(outs), pools


@pytest.mark.parametrize("size", [1, 3, 5])
def test_a_prompt_fed_in_chunks_equals_it_fed_whole(size):
    """Chunks of 1, 3 and 5 tokens carry the running states and store each block's snapshot
    (m = 4) as the prompt fed in one call does. The arithmetic per token is the same, but the
    projections multiply other numbers of rows at once, so agreement is to float32 rounding
    (1e-6 relative), not bit for bit; the padding lane's NaN slots stay NaN."""
    p, h = params(), np.random.default_rng(2).standard_normal((11, SHAPE.dim)).astype(
        np.float32)
    whole, (conv_w, rec_w) = feed_in_chunks(p, h, 11)
    got, (conv, rec) = feed_in_chunks(p, h, size)
    close(got, whole, "outputs", 1e-6)
    for name, a, b in (("conv", conv, conv_w), ("recurrent", rec, rec_w)):
        close(a.running[0], b.running[0], f"{name} running state", 1e-6)
        close(a.snapshots[:2], b.snapshots[:2], f"{name} snapshots", 1e-6)
        assert np.isnan(a.running[1]).all() and np.isnan(a.snapshots[2:]).all()
    want, convs, recs = reference(p, h)
    close(got, want, "outputs against the reference")
    close(rec.snapshots[1], recs[7], "block 1's snapshot against the reference")


def test_a_lane_resumed_from_a_snapshot_equals_it_from_scratch():
    """A prefix hit: sequence 1 shares sequence 0's first 8 positions (its table of blocks
    names sequence 0's first two snapshots), its running slots hold NaN, and it resumes at
    position 8 from the snapshot: its outputs and states are those from scratch."""
    p, m = params(), 4
    h = np.random.default_rng(3).standard_normal((12, SHAPE.dim)).astype(np.float32)
    table, blocks = np.arange(32).reshape(2, 16), np.array([[0, 1, 2, 3], [0, 1, 4, 5]])
    pools = nan_pools(2, 6)
    ix = ci.make(np.array([np.arange(8), np.full(8, -1)]), table, every=[(m, blocks)])
    _, pools = run(p, np.stack([h[:8], np.zeros_like(h[:8])]), ix, pools)
    ix = ci.make(np.array([[-1] * 4, [8, 9, 10, 11]]), table, every=[(m, blocks)])
    out, (conv, rec) = run(p, np.stack([np.zeros_like(h[8:]), h[8:]]), ix, pools)
    want, convs, recs = reference(p, h)
    close(out[1], want[8:], "the resumed lane's outputs")
    close(rec.running[1], recs[11], "its recurrent state")
    close(conv.running[1], convs[11], "its conv state")
    close(rec.snapshots[4], recs[11], "its block 2's snapshot")
    close(rec.running[0], recs[7], "the first sequence, untouched by a lane of padding")


def test_a_packed_lane_computes_each_sequence_alone():
    """A token at position 0 starts from zero: two sequences packed in one lane (a packed
    index stores nothing) give the outputs each gives alone."""
    p = params()
    h = np.random.default_rng(4).standard_normal((1, 7, SHAPE.dim)).astype(np.float32)
    out, pools = run(p, h, ci.packed(7, [[3, 4]]), nan_pools(1, 0))
    close(out[0, :3], reference(p, h[0, :3])[0], "the first sequence")
    close(out[0, 3:], reference(p, h[0, 3:])[0], "the second sequence")
    assert all(np.isnan(a).all() for q in pools for a in q), "a packed index stores nothing"


@pytest.mark.parametrize("xp", ["torch", "jax", "strict"])
def test_other_libraries_agree_with_numpy(xp):
    """The same chunked feed on another library: outputs and pools within float32 rounding
    of NumPy's (their sums may reassociate)."""
    pytest.importorskip({"strict": "array_api_strict"}.get(xp, xp))
    p = params()
    h = np.random.default_rng(5).standard_normal((9, SHAPE.dim)).astype(np.float32)
    want, (conv_w, rec_w) = feed_in_chunks(p, h, 3)
    placed = llama.convert(p, xp=xp)
    got, (conv, rec) = feed_in_chunks(placed, h, 3, xp=xp)
    close(got, want, f"{xp} outputs", 1e-5)
    for a, b in ((conv, conv_w), (rec, rec_w)):
        close(host(a.running)[0], b.running[0], f"{xp} running state", 1e-5)
        close(host(a.snapshots)[:2], b.snapshots[:2], f"{xp} snapshots", 1e-5)


# -- a hybrid decoder --------------------------------------------------------------------------
HYBRID = llama.Config.tiny(layers=3, layer_types=("linear_attention", "attention",
                                                  "linear_attention"),
                           linear_key_dim=4, linear_value_dim=4)


def greedy_whole(p, prompt, steps):
    """Each next token, and its logits, from the whole sequence fed again (an index that
    keeps nothing)."""
    seq, every = list(prompt), []
    for _ in range(steps):
        logits, _ = llama.forward(p, HYBRID, np.array([seq]), ci.whole(1, len(seq)),
                                  llama.empty_pools(HYBRID, [(1, 0), 1, (1, 0)]), last=True)
        every.append(logits[0, -1])
        seq.append(int(np.argmax(logits[0, -1])))
    return seq[len(prompt):], every


@pytest.mark.parametrize("xp", ["numpy", "torch"])
def test_a_hybrid_decoder_decodes_through_the_index_as_fed_whole(xp):
    """Prefill of two left-padded prompts through ci.rows (snapshots every 4 positions), then
    one token a call through advance (crossing block ends at 7 and 11): the greedy tokens
    equal those of each sequence fed whole, token by token, and so do the logits to float32
    rounding; and the model says which layers keep state and what it costs."""
    if xp != "numpy":
        pytest.importorskip(xp)
    p = llama.random_params(HYBRID, seed=1)  # a seed whose tokens change as it decodes
    model = LlamaModel(HYBRID, p)
    assert model.recurrent_layers == (0, 2)
    c = HYBRID.linear
    assert model.state_bytes() == 2 * 4 * ((c.kernel - 1) * c.conv_dim
                                           + c.value_heads * c.key_dim * c.value_dim)
    prompts = [[5, 9, 2, 33, 7, 1, 60], [11, 3, 8, 20, 4]]
    steps, ctx, m = 6, 16, 4
    want, want_logits = zip(*(greedy_whole(p, q, steps) for q in prompts))
    weights = model.place(xp, None)
    pools = model.pools(weights, [(2, 2 * (ctx // m)), 2 * ctx, (2, 2 * (ctx // m))])
    be = ci.backends.get(xp)
    ix = ci.rows(ctx, [len(q) for q in prompts], every=[m], xp=xp)
    tokens = np.zeros((2, 7), np.int64)
    for b, q in enumerate(prompts):
        tokens[b, 7 - len(q):] = q
    got = [[], []]
    for step in range(steps):
        logits, pools = model.forward(weights, be.from_host(tokens), ix, pools)
        nxt = np.argmax(host(logits), axis=-1)
        for b in range(2):
            got[b].append(int(nxt[b]))
            # float32 rounding, in another order than fed whole (NumPy's decode reads the
            # pages in the native kernel): lane 1's third step is the worst, near 1e-4
            close(host(logits)[b], want_logits[b][step], f"lane {b}'s logits at step {step}",
                  3e-4)
        tokens, ix = nxt[:, None].astype(np.int64), ix.advance()
    assert got == list(want)
    assert len(set(got[0])) > 1, "the tokens change as the prompt is decoded"


def test_pools_of_a_hybrid_decoder():
    p = llama.random_params(HYBRID, seed=0)
    pools = llama.empty_pools(HYBRID, [(3, 5), 8, (3, 0)])
    conv, rec = pools[0]
    assert isinstance(conv, state.Pools) and conv.running.shape == (3, 3, HYBRID.linear.conv_dim)
    assert rec.snapshots.shape == (5, 4, 4, 4) and pools[2][1].snapshots.shape[0] == 0
    assert pools[1][0].shape[0] == 8
    assert set(p["layers"][0]) >= {"attn_norm", "linear", "ffn_norm"}
    assert "wq" not in p["layers"][0] and "wq" in p["layers"][1]
    with pytest.raises(ValueError, match=r"^cacheidx\.models\.llama\.empty_pools: layer 0 "):
        llama.empty_pools(HYBRID, 8)
    with pytest.raises(ValueError, match=r"^cacheidx\.models\.llama\.empty_pools: layer 1 "):
        llama.empty_pools(HYBRID, [(3, 5), (3, 5), (3, 5)])
    with pytest.raises(ValueError, match=r"^cacheidx\.models\.llama\.Config: layer_types\[1\]"):
        llama.Config.tiny(layers=2, layer_types=("attention", "mamba"))
    with pytest.raises(ValueError, match=r"^cacheidx\.models\.llama\.Config: layer 0 .*window"):
        llama.Config.tiny(layers=2, layer_types=("linear_attention", "attention"),
                          windows=(4, None))
    with pytest.raises(ValueError, match=r"^cacheidx\.models\.deltanet\.Shape: kernel"):
        llama.Config.tiny(layers=1, layer_types=("linear_attention",), linear_kernel=1)
    # an all-attention config draws the weights it always drew
    plain = llama.Config.tiny()
    a, b = llama.random_params(plain, seed=0), llama.random_params(
        llama.Config.tiny(layer_types=("attention", "attention")), seed=0)
    assert all(np.array_equal(a["layers"][1][k], b["layers"][1][k]) for k in a["layers"][1])


# -- served by the engine ------------------------------------------------------------------------
def served_prompts():
    """A 9-token prompt, a 5-token one, and one sharing the first's first 8 (two pages, two
    blocks of 4) then 3 of its own."""
    a = [5, 9, 2, 33, 7, 1, 60, 12, 40]
    return [a, [11, 3, 8, 20, 4], a[:8] + [8, 3, 50]]


@pytest.fixture(scope="module")
def own_greedy():
    """The hybrid decoder's weights and its own greedy tokens of each prompt, fed whole."""
    p = llama.random_params(HYBRID, seed=1)
    return p, [greedy_whole(p, q, 5)[0] for q in served_prompts()]


@pytest.mark.parametrize("xp", ["numpy", "torch"])
@pytest.mark.parametrize("mode", ["cache", "no-cache", "eviction"])
def test_the_engine_serves_the_hybrid_decoder_with_its_own_greedy_tokens(xp, mode, own_greedy):
    """``serve.Engine`` over the DeltaNet hybrid (``LlamaModel``; pages of 4, a snapshot every
    4 positions, chunks of 3 that cross block ends, one lane so each request follows the
    last): each request gets the tokens the decoder gives fed whole, with the prefix cache on
    (the third resumes from the first's snapshot of block 1: 8 tokens), off, and under
    eviction (the prompts twice over 6 snapshot slots and 8 pages)."""
    import warnings

    from cacheidx.serve import Engine, Request

    if xp != "numpy":
        pytest.importorskip(xp)
    p, want = own_greedy
    prompts = served_prompts() * (2 if mode == "eviction" else 1)
    options = {"snapshots": 6, "pages": 8} if mode == "eviction" else {"pages": 32}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the engine's notes
        engine = Engine(LlamaModel(HYBRID, p), backend=xp, page_size=4, state_every=4, lanes=1,
                        chunk=3, cache=mode != "no-cache", clock="steps", debug=True, **options)
        results = engine.run([Request(k, q, 5) for k, q in enumerate(prompts)])
    assert [r.error for r in results] == [None] * len(prompts)
    assert [r.tokens for r in results] == want * (len(prompts) // 3)
    engine.cache.check()
    f = engine.figures()
    if mode == "cache":
        assert [r.cached_tokens for r in results] == [0, 0, 8]
    elif mode == "no-cache":
        assert f["cached_tokens"] == 0
    else:
        assert f["snapshots"]["evictions"] > 0 and f["evictions"] > 0


# -- bad input -------------------------------------------------------------------------------------
def test_pools_that_are_not_the_layers_state_raise_naming_the_kind():
    """Pools of another row shape than the layer's conv or recurrent state, a pools argument
    that is no pair of state.Pools, and inputs of another shape are refused by name, before
    any arithmetic."""
    p, ix = params(), ci.rows(8, [3, 2], every=[4])
    h = np.zeros((ix.batch * ix.seq, SHAPE.dim), np.float32)
    conv, rec = deltanet.state_shapes(SHAPE)
    good = nan_pools(2, 4)
    fn = "cacheidx.models.deltanet.mix"
    for pools, words in (
            ((state.zeros(2, 4, (conv[0], conv[1] + 1)), good[1]),
             f"the conv running pool holds rows of [{conv[0]}, {conv[1] + 1}]; the layer's "
             f"conv state is [{conv[0]}, {conv[1]}]"),
            ((good[0], state.Pools(good[1].running, np.zeros((4, 4, 3, 4), np.float32))),
             "the recurrent snapshots pool holds rows of [4, 3, 4]; the layer's recurrent "
             "state is [4, 4, 3]")):
        with pytest.raises(ValueError, match=f"^{fn}: ") as got:
            deltanet.mix(p, SHAPE, h, ix, pools)
        assert words in str(got.value)
    with pytest.raises(TypeError, match=f"^{fn}: pools must be a pair of state.Pools"):
        deltanet.mix(p, SHAPE, h, ix, good[:1])
    with pytest.raises(ValueError, match=rf"^{fn}: h must have shape \[6, 16\] .*got \[5, 16\]"):
        deltanet.mix(p, SHAPE, h[:5], ix, good)
