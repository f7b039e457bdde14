"""``attend``'s bad input (issue 26, items 9, 11, 12 and 14): a ``ValueError`` naming
``cacheidx.attend`` and the value, raised before anything is stored, on every backend.

- ``scale`` and ``softcap`` must be finite in the dtype the scores are kept in (float32 for
  float32 and narrower pools), and a softcap at most ``eps / smallest_normal`` of it (about
  1e31 for float32): past it, a score divided by it is subnormal, which XLA flushes to zero.
- One array donated as both pools would store the values over the keys; not donated, it is a
  call like any other (each pool's stores go to a copy of its own).
- Pools with no kv head or a head dim of 0 hold nothing to attend over.
- A donated pool whose slots share memory (stride 0) cannot take one row per slot.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import cacheidx as ci

HEADS, KV, D = 4, 2, 8


def arrays(backend, slots=16, kv=KV, d=D):
    ix = ci.rows(8, [3, 4], xp=backend.name)
    rng = np.random.default_rng(0)
    xp = ix.backend.xp

    def a(*shape):
        return xp.asarray(rng.standard_normal(shape).astype(np.float32))

    q, k, v = a(2, 4, HEADS, d), a(2, 4, kv, d), a(2, 4, kv, d)
    return ix, q, k, v, xp.zeros((slots, kv, d), dtype=xp.float32)


def host(x):
    return np.asarray(x.detach() if hasattr(x, "detach") else x)


@pytest.mark.parametrize(("name", "value"), [("softcap", 1e39), ("softcap", 1e38),
                                             ("softcap", 1e32), ("softcap", 1e-39),
                                             ("scale", 1e39), ("scale", -1e39)])
def test_a_scale_or_softcap_the_scores_dtype_cannot_hold_is_refused(backend, name, value):
    ix, q, k, v, pool = arrays(backend)
    kpool, vpool = pool, ix.backend.xp.asarray(host(pool).copy())
    with pytest.raises(ValueError, match=rf"cacheidx\.attend: {name} .*float32.*"
                       rf"{re.escape(repr(value))}"):
        ix.attend(q, k, v, kpool, vpool, donate=True, **{name: value})
    assert not np.any(host(kpool)) and not np.any(host(vpool)), "nothing stored"


def test_the_largest_softcap_allowed_is_no_cap(backend):
    # at eps / smallest_normal every score's cap is its own to float32's rounding, on JAX too
    # (where a cap of 1e38 flushed small scores to zero: off by 1.6)
    ix, q, k, v, pool = arrays(backend)
    most = float(np.finfo(np.float32).eps / np.finfo(np.float32).smallest_normal)
    capped = host(ix.attend(q, k, v, pool, pool, softcap=most)[0])
    plain = host(ix.attend(q, k, v, pool, pool)[0])
    np.testing.assert_allclose(capped, plain, rtol=1e-5, atol=1e-6)


def test_one_pool_donated_as_both_is_refused(backend):
    ix, q, k, v, pool = arrays(backend)
    with pytest.raises(ValueError, match=r"cacheidx\.attend: kpool and vpool are one array"):
        ix.attend(q, k, v, pool, pool, donate=True)
    assert not np.any(host(pool)), "nothing stored"


def test_one_pool_not_donated_is_two_copies(backend):
    ix, q, k, v, pool = arrays(backend)
    out, kpool, vpool = ix.attend(q, k, v, pool, pool)
    want, kwant, vwant = ix.attend(q, k, v, pool, ix.backend.xp.asarray(host(pool).copy()))
    np.testing.assert_array_equal(host(out), host(want))
    np.testing.assert_array_equal(host(kpool), host(kwant))
    np.testing.assert_array_equal(host(vpool), host(vwant))
    assert not np.any(host(pool)), "the caller's pool is unchanged"


@pytest.mark.parametrize(("kv", "d"), [(0, D), (KV, 0)])
def test_pools_with_no_kv_head_or_an_empty_head_dim_are_refused(backend, kv, d):
    ix, q, k, v, pool = arrays(backend, kv=kv, d=d)
    with pytest.raises(ValueError, match=r"cacheidx\.attend: pools must have at least one kv "
                       rf"head .*\[16, {kv}, {d}\]"):
        ix.attend(q, k, v, pool, ix.backend.xp.asarray(host(pool).copy()))


def test_a_donated_pool_of_shared_rows_is_refused():
    torch = pytest.importorskip("torch")
    ix = ci.rows(8, [3, 4], xp="torch")
    q, k = torch.ones(2, 4, HEADS, D), torch.ones(2, 4, KV, D)
    kpool = torch.zeros(1, KV, D).expand(16, KV, D)
    with pytest.raises(ValueError, match=r"cacheidx\.attend: kpool is donated but its slots "
                       r"share memory \(strides \[0, 8, 1\]"):
        ix.attend(q, k, k, kpool, torch.zeros(16, KV, D), donate=True)
    shared = np.broadcast_to(np.zeros((1, KV, D), np.float32), (16, KV, D))
    with pytest.raises(ValueError, match=r"cacheidx\.attend: vpool is donated but its slots"):
        ci.rows(8, [3, 4]).attend(q.numpy(), k.numpy(), k.numpy(),
                                  np.zeros((16, KV, D), np.float32), shared, donate=True)
    with pytest.raises(ValueError, match=r"cacheidx\.extend: pool is donated but its slots"):
        ix.extend(k, kpool, donate=True)
    seen, _ = ix.extend(k, kpool)  # not donated: stored into a copy of its own
    assert float(seen.sum()) == float(k[0, 1:].sum() + k[1].sum())
