"""Nothing a token does not see reaches its output, infinities included (issue 26, items 7 and
13): a value that is not finite reaches only the tokens that see its column (NaN at that kv
head's query heads), never through ``0 * inf``; a NaN sink is NaN in, NaN out for the tokens
that weigh a column, and a padded token's output stays exactly zero. ``attend`` (every read
path: views of runs, the tiles, JAX's program, torch's operator and its traced tiles) and the
reference keep the same law. (Every backend and mode: the conformance law
``a_value_a_token_does_not_see_never_reaches_it_infinities_included``.)"""

from __future__ import annotations

import numpy as np
import pytest

import cacheidx as ci
from cacheidx.attention import reference

HEADS, KV, D = 4, 2, 8


def call(xp_name: str, inf_at=(0, -1, 0, 0)):
    """The issue's call: ``rows(8, [3, 4])`` (lane 0 left-padded), lane 0's last value Inf."""
    ix = ci.rows(8, [3, 4], xp=xp_name)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, HEADS, D)).astype(np.float32)
    k = rng.standard_normal((2, 4, KV, D)).astype(np.float32)
    v = rng.standard_normal((2, 4, KV, D)).astype(np.float32)
    finite = v.copy()
    v[inf_at] = np.inf
    return ix, q, k, v, finite


def run(ix, q, k, v, **options):
    xp = ix.backend.xp
    pool = np.zeros((16, KV, D), np.float32)
    got = ix.attend(*(xp.asarray(a) for a in (q, k, v, pool, pool.copy())), **options)[0]
    return np.asarray(got.detach() if hasattr(got, "detach") else got)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_an_inf_value_reaches_only_the_tokens_that_see_it(backend):
    ix, q, k, v, finite = call(backend.name)
    got, clean = run(ix, q, k, v), run(ix, q, k, finite)
    assert np.all(got[0, 0] == 0), "lane 0's padded token is promised exactly zero"
    # lane 0's tokens at positions 0 and 1 do not see its last token's value
    np.testing.assert_allclose(got[0, 1:3], clean[0, 1:3], rtol=1e-6, atol=1e-6)
    # the last token sees it: NaN at kv head 0's query heads (0 and 1), every component
    assert np.isnan(got[0, 3, :2]).all()
    np.testing.assert_allclose(got[0, 3, 2:], clean[0, 3, 2:], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], clean[1], rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_reference_keeps_the_same_law():
    ix, q, k, v, finite = call("numpy")
    pool = np.zeros((16, KV, D), np.float32)
    want = []
    for values in (v, finite):
        seen_k, _ = ix.extend(k, pool)
        seen_v, _ = ix.extend(values, pool)
        want.append(reference(q, seen_k, seen_v, ix.mask()))
    got, clean = want
    assert np.all(got[0, 0] == 0)
    np.testing.assert_array_equal(got[0, 1:3], clean[0, 1:3])
    assert np.isnan(got[0, 3, :2]).all() and np.isfinite(got[0, 3, 2:]).all()
    np.testing.assert_allclose(got, run(ix, q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_seen_value_whose_weight_underflows_still_makes_nan():
    # lane 1's token at position 3 sees position 0, whose key scores far below the rest: its
    # weight underflows to zero, yet the column is seen, so its NaN value makes NaN
    ix, q, k, v, _ = call("numpy", inf_at=(1, 0, 0, 0))
    k[1, 0, 0] = -100 * np.sign(q[1, 3, 0])
    v[1, 0, 0, 0] = np.nan
    got = run(ix, q, k, v)
    assert np.isnan(got[1, :, :2]).all() and np.isfinite(got[1, :, 2:]).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_torch_traced_tiles_keep_it():
    # a query that wants a gradient keeps the traced tiles under torch.compile (the operator
    # has no backward): the careful product there is the only one
    torch = pytest.importorskip("torch")
    ix, q, k, v, finite = call("torch")

    def step(ix, q, k, v, kpool, vpool):
        return ix.attend(q, k, v, kpool, vpool)[0]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    pools = [torch.zeros(16, KV, D) for _ in range(2)]
    tq = torch.tensor(q, requires_grad=True)
    got = compiled(ix, tq, torch.tensor(k), torch.tensor(v), *pools).detach().numpy()
    clean = run(ix, q, k, finite)
    assert np.all(got[0, 0] == 0)
    np.testing.assert_allclose(got[0, 1:3], clean[0, 1:3], rtol=1e-5, atol=1e-6)
    assert np.isnan(got[0, 3, :2]).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_nan_sink_is_nan_in_nan_out_and_a_padded_token_stays_zero(backend):
    ix, q, k, _, finite = call(backend.name)
    sinks = np.array([0.5, np.nan, 3.0, 0.0], np.float32)
    got = run(ix, q, k, finite, sinks=ix.backend.xp.asarray(sinks))
    assert np.all(got[0, 0] == 0), "a padded token weighs no column: exactly zero"
    assert np.isnan(got[:, :, 1]).sum() == 7 * D, "NaN at head 1 of every token seeing a column"
    pool = np.zeros((16, KV, D), np.float32)
    host = ci.rows(8, [3, 4])
    want = reference(q, host.extend(k, pool)[0], host.extend(finite, pool)[0], host.mask(),
                     sinks=sinks)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
