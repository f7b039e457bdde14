"""Nothing silent (issue 37): what a new user's probes found, each mended at its root.

The CPU kernel for quantized runs (items 2 and 3): it declines where a gradient is asked, and
weighs a block of ``-inf`` scores as the online softmax does. (Item 4, a kernel file that fails
its check, is tests/test_native_build.py's now: the kernel is built at install time and
checked by its struct layouts before it is called.)"""

from __future__ import annotations

import numpy as np
import pytest

import cacheidx as ci
from cacheidx import quantized
from cacheidx.attention import native

KV, D, T = 2, 64, 200


def kernel_or_skip():
    if native.kernel() is None:
        pytest.skip("no C compiler builds the CPU kernel here")


def decode_step(lib: str, *, overflow: bool):
    """A lane of ``T`` tokens in quantized pools, then its decode step: ``(step, q, k, v,
    kpool, vpool)``. With ``overflow`` the step's query is huge against the first 64 keys, so
    that every score of the kernel's first block of columns is -inf (a product that
    overflowed: float32 can not hold it) and the others are zero."""
    rng = np.random.default_rng(0)
    ix = ci.rows(256, [T], xp=lib)
    xp = ix.backend.xp
    k = rng.standard_normal((1, T, KV, D)).astype(np.float32)
    if overflow:
        k[:] = 0
        k[:, :64] = 1e10
    v = rng.standard_normal((1, T, KV, D)).astype(np.float32)
    q = rng.standard_normal((1, T, 4, D)).astype(np.float32)
    kp, vp = quantized.zeros(256, KV, D, xp=lib), quantized.zeros(256, KV, D, xp=lib)
    _, kp, vp = ix.attend(*(xp.asarray(a) for a in (q, k, v)), kp, vp)
    q1 = (np.full((1, 1, 4, D), -1e30, np.float32) if overflow
          else rng.standard_normal((1, 1, 4, D)).astype(np.float32))
    k1 = np.zeros((1, 1, KV, D), np.float32)
    v1 = rng.standard_normal((1, 1, KV, D)).astype(np.float32)
    return ix.advance(), q1, k1, v1, kp, vp


def used_kernel(monkeypatch) -> list[bool]:
    """Whether each run the core offered the kernel (or each decode step offered the paged
    kernel, :mod:`cacheidx.attention.paged`) went through it."""
    calls: list[bool] = []
    for name in ("paged",):
        real = getattr(native, name)

        def spy(*args, real=real):
            got = real(*args)
            calls.append(got is not None)
            return got

        monkeypatch.setattr(native, name, spy)
    return calls


# -- item 3: a leading block of -inf scores ---------------------------------------------------
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_leading_block_of_minus_inf_scores_weighs_nothing_through_the_kernel(lib,
                                                                              monkeypatch):
    """A query weighs no column of score -inf: its output is that of the other columns, the
    kernel's as the core's (the law of :mod:`cacheidx.attention.softmax`), never NaN."""
    if lib == "torch":
        pytest.importorskip("torch")
    kernel_or_skip()
    step, q, k, v, kp, vp = decode_step(lib, overflow=True)
    xp = step.backend.xp
    calls = used_kernel(monkeypatch)
    got = np.asarray(step.attend(*(xp.asarray(a) for a in (q, k, v)), kp, vp)[0])
    assert calls and all(calls), "the run went through the kernel"
    with native.off():
        want = np.asarray(step.attend(*(xp.asarray(a) for a in (q, k, v)), kp, vp)[0])
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} NaN outputs"
    # the columns weighed are 64..T (the stored ones, scores 0) and the step's own
    seen = np.asarray(step.extend(xp.asarray(v), vp)[0])
    mean = seen[0, 64:T + 1].mean(axis=0)  # [kv, d]: every weighed score is 0
    np.testing.assert_allclose(got[0, 0], np.repeat(mean, 2, axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_query_whose_every_score_is_minus_inf_weighs_no_column_in_the_kernel():
    """The kernel's state for a run whose scores are all -inf: m = -inf, l = 0, acc = 0."""
    kernel_or_skip()
    q = np.full((KV, 1, D), -1e30, np.float32)
    codes = np.full((8, KV, D), 127, np.int8)
    scales = np.full((8, KV), 1e10, np.float32)
    pool = quantized.Quantized(codes, scales)
    got = native.paged(q[None], np.arange(8, dtype=np.int64)[None], np.zeros(1, np.int64),
                       np.full(1, 8, np.int64), pool, pool)
    assert got is not None
    m, l, acc = (x[0] for x in got)
    assert np.all(m == -np.inf) and np.all(l == 0) and np.all(acc == 0), (m, l, acc)


# -- item 2: gradients --------------------------------------------------------------------------
def test_the_kernel_declines_where_a_gradient_is_asked(monkeypatch):
    """A decode step over quantized pools with ``q.requires_grad``: the output requires grad and
    its gradient is the core's (the kernel has no backward), whether or not the kernel is on."""
    torch = pytest.importorskip("torch")
    kernel_or_skip()
    step, q, k, v, kp, vp = decode_step("torch", overflow=False)
    calls = used_kernel(monkeypatch)
    grads = []
    for off in (False, True):
        qt = torch.tensor(q, requires_grad=True)
        with native.off() if off else _nothing():
            out = step.attend(qt, torch.tensor(k), torch.tensor(v), kp, vp)[0]
        assert out.requires_grad, "the output of a query that asks a gradient"
        (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
        grads.append(qt.grad.clone())
    assert calls and not any(calls), "the kernel declines where a gradient is asked"
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    calls.clear()
    # without a gradient asked, the same step goes through it
    with torch.no_grad():
        step.attend(torch.tensor(q, requires_grad=True), torch.tensor(k), torch.tensor(v), kp,
                    vp)
    assert calls and all(calls), "under no_grad the kernel reads the run"


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
