"""attend against the spec's path: the slow reference's extend and mask (tests/reference.py),
weighed by a softmax written here in float64 loops; and its errors, its tiles and its memory.

The conformance suite checks the law on every backend and mode on concrete cases; here
Hypothesis draws indices of every kind (tests/strategies.py), tile sizes, scales, soft-caps and
sinks, on NumPy, whose eager path reads runs of slots as views where it can and tiles elsewhere.
"""

import math
import os
import tracemalloc

import numpy as np
import pytest
import reference
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import build, cases

import cacheidx as ci
from cacheidx import attention
from cacheidx.attention import runplan, tiles
from cacheidx.attention import runs as runs_module

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
law = settings(max_examples=300 if CI else 100, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
KV, D = 2, 3


def softmax_attention(q, seen_k, seen_v, mask, scale, softcap, sinks):
    """The law's right-hand side, one query and head at a time, in float64: the weights of the
    columns a query sees, and the sink's, sum to one; a query that sees none gets zero."""
    q, seen_k, seen_v = (np.asarray(a, np.float64) for a in (q, seen_k, seen_v))
    b, s, heads, _ = q.shape
    g = heads // seen_k.shape[-2]
    out = np.zeros(q.shape[:3] + seen_v.shape[-1:])
    for lane in range(b):
        for i in range(s):
            # this token's columns: shared by its lane, or its own under a selection
            ks = seen_k[lane, i] if seen_k.ndim == 5 else seen_k[lane]
            vs = seen_v[lane, i] if seen_v.ndim == 5 else seen_v[lane]
            cols = [j for j in range(mask.shape[2]) if mask[lane, i, j]]
            for h in range(heads):
                if not cols:
                    continue
                z = [scale * float(q[lane, i, h] @ ks[j, h // g]) for j in cols]
                if softcap is not None:
                    z = [softcap * math.tanh(x / softcap) for x in z]
                top = max(z + ([sinks[h]] if sinks is not None else []))
                e = [math.exp(x - top) for x in z]
                total = sum(e) + (math.exp(sinks[h] - top) if sinks is not None else 0.0)
                out[lane, i, h] = sum(w * vs[j, h // g] for w, j in zip(e, cols)) / total
    return out


@st.composite
def calls(draw, kinds=("make", "rows", "whole"), drafts=None):
    """A random index (its values and pool give the slots and which hold numbers), queries,
    keys and values for it, and attend's options."""
    case = draw(cases(kinds, drafts))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    index = build(ci, case)
    b, s, slots = index.batch, index.seq, len(case.pool)
    heads = KV * draw(st.sampled_from([1, 2]))
    q = rng.standard_normal((b, s, heads, D))
    k, v = rng.standard_normal((b, s, KV, D)), rng.standard_normal((b, s, KV, D))
    # a slot the recipe left blank (NaN) stays NaN: a read the law says is zero shows
    blank = np.isnan(case.pool.reshape(slots, -1).astype(float)).any(axis=1)
    kpool, vpool = rng.standard_normal((slots, KV, D)), rng.standard_normal((slots, KV, D))
    kpool[blank] = vpool[blank] = np.nan
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    options = {
        "scale": draw(st.none() | st.floats(0.1, 2.0)),
        "softcap": draw(st.none() | st.floats(0.5, 5.0)),
        "sinks": draw(st.none() | st.just(rng.standard_normal(heads).astype(dtype))),
        "tile": draw(st.none() | st.integers(1, 4)),
    }
    return case, [a.astype(dtype) for a in (q, k, v, kpool, vpool)], options


@law
@given(call=calls())
def test_attend_is_softmax_attention_over_what_extend_sees(call):
    case, (q, k, v, kpool, vpool), options = call
    index, ref = build(ci, case), build(reference, case)
    unsure_seen, _ = ref.unsure(len(kpool))
    assume(not unsure_seen.any())  # two stores at one slot: the laws leave what is read open
    seen_k, want_k = ref.extend(k, kpool)
    seen_v, want_v = ref.extend(v, vpool)
    mask = ref.mask()
    # a valid token whose seen columns read a slot nothing wrote (NaN) has no defined output
    scale = options["scale"] if options["scale"] is not None else 1 / math.sqrt(D)
    want = softmax_attention(q, np.nan_to_num(seen_k), np.nan_to_num(seen_v), mask, scale,
                             options["softcap"], options["sinks"])
    blank = _reads_a_blank(seen_k, mask)
    out, got_k, got_v = index.attend(q, k, v, kpool.copy(), vpool.copy(), **options)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)
    tol = 64 * np.finfo(q.dtype).eps
    np.testing.assert_allclose(out[~blank], want[~blank], rtol=tol, atol=tol)
    assert np.all(out[~mask.any(axis=-1)] == 0), "a query that sees nothing gets exactly zero"


def _reads_a_blank(seen, mask):
    """[batch, seq]: whether a token sees a column that reads NaN (a slot nothing wrote)."""
    nan = np.isnan(seen).any(axis=tuple(range(seen.ndim - 2, seen.ndim)))
    if nan.ndim == 2:  # [batch, context]: shared by the lane's tokens
        nan = nan[:, None, :]
    return (mask & nan).any(axis=-1)


@settings(law, max_examples=150 if CI else 50)
@given(call=calls(kinds=("rows",)))
def test_views_of_runs_and_tiles_give_one_output(call):
    """Where the eager path reads runs of slots as views, the tiles give the same output
    (``rows`` gives runs; a random table seldom does, and the other law covers it)."""
    case, (q, k, v, kpool, vpool), options = call
    index = build(ci, case)
    options["tile"] = options["tile"] or 3
    scale = options["scale"] or 1 / math.sqrt(D)
    c = attention.stored(attention.Call(index, q, k, v, kpool.copy(), vpool.copy(), scale,
                                        options["softcap"], options["sinks"], options["tile"]))
    viewed = runs_module.read(c, 2 * q.shape[2] * max(1, index.seq))
    assume(viewed is not None)
    tiled = attention.standard(c)
    tol = 64 * np.finfo(q.dtype).eps
    np.testing.assert_allclose(viewed, tiled, rtol=tol, atol=tol, equal_nan=True)


def test_a_sliding_window_decode_reads_only_its_window():
    """A decode step under a window reads the tiles its window reaches, not the context."""
    index = ci.rows(1024, [1000, 700]).advance().window(16)
    kpool = np.zeros((2048, KV, D), np.float32)
    read = list(tiles.read(index, None, None, kpool, kpool, 64))
    assert len(read) == 2, f"{len(read)} tiles read for two windows of 16"


def test_a_long_prefill_holds_one_tile_of_scores_at_a_time():
    """Memory beyond the inputs and outputs is O(seq x tile), not O(seq x context): a prefill
    of 2048 tokens with tiles of 64 columns peaks far below its 64 MB of scores."""
    n, heads = 2048, 4
    rng = np.random.default_rng(0)
    index = ci.rows(n, [n])
    q = rng.standard_normal((1, n, heads, 16), dtype=np.float32)
    k = rng.standard_normal((1, n, KV, 16), dtype=np.float32)
    kpool = np.zeros((n, KV, 16), np.float32)
    for viewed in (True, False):  # runs of slots as views, then the gathered tiles
        old = runplan.MOST_RUNS
        runplan.MOST_RUNS = old if viewed else -1
        try:
            tracemalloc.start()
            out, _, _ = index.attend(q, k, k, kpool, kpool.copy(), tile=64)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            runplan.MOST_RUNS = old
        scores = heads * n * n * 4
        assert peak < scores / 4, f"peak {peak / 2**20:.1f} MB, scores {scores / 2**20:.0f} MB"
        assert np.isfinite(out).all()


@pytest.mark.parametrize("bad, error, words", [
    ({"q": np.zeros((2, 3, 3, 4), np.float32)}, ValueError, "not a multiple"),
    ({"q": np.zeros((2, 3, 4, 5), np.float32)}, ValueError, "q must have shape"),
    ({"q": np.zeros((2, 3, 4, 4), np.int32)}, TypeError, "real floats"),
    ({"k": np.zeros((2, 2, 2, 4), np.float32)}, ValueError, "k must have shape"),
    ({"v": np.zeros((2, 3, 2, 4), np.float64)}, TypeError, "v are float64"),
    ({"kpool": np.zeros((8, 8), np.float32)}, ValueError, "kpool must be [slots"),
    ({"vpool": np.zeros((8, 1, 4), np.float32)}, ValueError, "kv heads"),
    ({"scale": True}, TypeError, "scale must be a real number"),
    ({"scale": float("nan")}, ValueError, "scale must be a finite"),
    ({"softcap": 0.0}, ValueError, "softcap must be a finite positive"),
    ({"softcap": "2"}, TypeError, "softcap must be a real number"),
    ({"sinks": np.zeros(3, np.float32)}, ValueError, "sinks must have shape [4]"),
    ({"sinks": np.zeros(4, np.int64)}, TypeError, "sinks must hold real floats"),
    ({"sinks": [0.0] * 4}, TypeError, "sinks must be an array"),
    ({"tile": 0}, ValueError, "tile must be at least 1"),
    ({"q": [[0.0]]}, TypeError, "q must be an array"),
])
def test_a_bad_argument_raises_naming_attend_and_stores_nothing(bad, error, words):
    index = ci.rows(4, [2, 3])
    args = {"q": np.zeros((2, 3, 4, 4), np.float32), "k": np.ones((2, 3, 2, 4), np.float32),
            "v": np.ones((2, 3, 2, 4), np.float32), "kpool": np.zeros((8, 2, 4), np.float32),
            "vpool": np.zeros((8, 2, 4), np.float32)}
    args.update(bad)
    before = [np.array(args[p], copy=True) for p in ("kpool", "vpool")]
    options = {key: args.pop(key) for key in ("scale", "softcap", "sinks", "tile") if key in args}
    with pytest.raises(error) as e:
        index.attend(*args.values(), donate=True, **options)
    assert "cacheidx.attend" in str(e.value) and words in str(e.value), str(e.value)
    for name, old in zip(("kpool", "vpool"), before):
        np.testing.assert_array_equal(np.asarray(args[name]), old)


@pytest.mark.parametrize("name", ["numpy", "torch", "jax"])
def test_without_donation_the_callers_pools_are_unchanged(name):
    """attend with donate=False stores into new pools, as extend does; donated, NumPy and
    torch store into the caller's memory."""
    backend = ci.backends.get(name) if name in ci.backends.available() else None
    if backend is None:
        pytest.skip(f"{name} is not installed")
    xp = backend.xp
    index = ci.rows(4, [2, 3], xp=name)
    rng = np.random.default_rng(0)
    q, k, v = (xp.asarray(rng.standard_normal(s, dtype=np.float32))
               for s in ((2, 3, 4, 8), (2, 3, 2, 8), (2, 3, 2, 8)))
    kpool, vpool = xp.zeros((8, 2, 8), dtype=xp.float32), xp.ones((8, 2, 8), dtype=xp.float32)
    _, k2, v2 = index.attend(q, k, v, kpool, vpool)
    assert np.all(np.asarray(kpool) == 0) and np.all(np.asarray(vpool) == 1)
    assert not np.all(np.asarray(k2) == 0)
    _, k3, _ = index.attend(q, k, v, kpool, vpool, donate=True)
    np.testing.assert_array_equal(np.asarray(k3), np.asarray(k2))
    if backend.donates and name != "jax":  # JAX gives the donated buffer up, not back
        assert backend.wrote_in_place(kpool, k3)


def test_a_long_view_read_in_chunks_gives_what_it_gives_whole(monkeypatch):
    """A run longer than ``LONG`` bytes is weighed a chunk at a time: the same output."""
    rng = np.random.default_rng(1)
    index = ci.rows(300, [290, 299]).advance().window(250)
    q = rng.standard_normal((2, 1, 4, D)).astype(np.float32)
    k = rng.standard_normal((2, 1, KV, D)).astype(np.float32)
    kpool, vpool = (rng.standard_normal((600, KV, D)).astype(np.float32) for _ in range(2))
    whole, _, _ = index.attend(q, k, k, kpool.copy(), vpool.copy())
    monkeypatch.setattr(runs_module, "LONG", 64 * KV * D * 4)
    monkeypatch.setattr(runs_module, "CHUNK", 48 * KV * D * 4)  # chunks of 64 columns
    chunked, _, _ = ci.rows(300, [290, 299]).advance().window(250).attend(
        q, k, k, kpool.copy(), vpool.copy())
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["numpy", "torch", "jax"])
def test_pools_are_head_major_where_the_librarys_path_prefers_it(name):
    """``empty_pools`` lays each head's slots one after another where the library's attention
    path prefers it (NumPy, torch on the CPU); ``layout="token"`` gives the row-major order
    anywhere; JAX keeps no strides and lays out its own. ``layout="head"`` asks for head-major
    where strides exist."""
    from cacheidx.attention import layout
    from cacheidx.models import llama

    if name not in ci.backends.available():
        pytest.skip(f"{name} is not installed")
    xp = ci.backends.get(name).xp
    config = llama.Config(vocab=8, dim=12, layers=1, heads=3, kv_heads=3, hidden=8, head_dim=4)
    (k, v), = llama.empty_pools(config, 10, xp=name)
    assert tuple(k.shape) == (10, 3, 4) and np.all(np.asarray(v) == 0)
    assert layout.head_major(k) == (name != "jax")
    (k, _), = llama.empty_pools(config, 10, xp=name, layout="token")
    assert not layout.head_major(k)
    (k, _), = llama.empty_pools(config, 10, xp=name, layout="head")
    assert layout.head_major(k) == (name != "jax") and tuple(k.shape) == (10, 3, 4)
    with pytest.raises(ValueError, match="layout.zeros: layout must be one of"):
        layout.zeros(xp, 10, 3, 4, dtype=xp.float32, layout="nhd")


def test_both_memory_orders_give_one_output_and_one_store(monkeypatch):
    """A head-major pool and a token-major one of the same values: the same stores, and outputs
    equal to the tolerance (the token-major run is read in chunks, the head-major one whole)."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 1, 4, D)).astype(np.float32)
    k = rng.standard_normal((2, 1, KV, D)).astype(np.float32)
    token = [rng.standard_normal((600, KV, D)).astype(np.float32) for _ in range(2)]
    head = [np.ascontiguousarray(p.transpose(1, 0, 2)).transpose(1, 0, 2) for p in token]
    monkeypatch.setattr(runs_module, "LONG", 64 * KV * D * 4)
    monkeypatch.setattr(runs_module, "CHUNK", 48 * KV * D * 4)
    got = [ci.rows(300, [290, 299]).advance().attend(q, k, k, *pools, donate=True)
           for pools in (token, head)]
    np.testing.assert_allclose(got[1][0], got[0][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[1][1], got[0][1])
    assert got[1][1] is head[0] and not head[0].flags.c_contiguous  # stored in place
