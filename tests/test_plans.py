"""The plan (:mod:`cacheidx.plan`): a function of the index's structure and values, never of
identity or version counters; compiled steps guard on structure alone.

Each test here failed before the plan became a visible value (issue 26, items 1, 3, 4, 5 and
10): programs are counted through a ``backend=`` callable of ``torch.compile`` (public), not
dynamo's caches.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cacheidx as ci
from cacheidx.models import llama

torch = pytest.importorskip("torch")


class Counting:
    """A ``torch.compile`` backend that counts the graphs dynamo hands it and runs them as
    captured: one graph per program compiled."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def compiled(fn, *, dynamic=False):
    count = Counting()
    return torch.compile(fn, backend=count, fullgraph=True, dynamic=dynamic), count


def inputs(lib, batch=2, seq=5, kv=2, heads=4, d=8, slots=32, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s, dtype=np.float32) for s in
              ((batch, seq, heads, d), (batch, seq, kv, d), (batch, seq, kv, d))]
    pools = [np.zeros((slots, kv, d), np.float32) for _ in range(2)]
    if lib == "torch":
        return [torch.from_numpy(a) for a in arrays + pools]
    return arrays + pools


def equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_table_refilled_in_place_is_read_through_its_new_values(lib):
    """Refilling a table in place (the CUDA-graph idiom): the index's plan follows the values,
    so ``attend`` and ``extend`` equal a fresh index's over the new table."""
    pos, tab = np.arange(5)[None, :], np.arange(8)[None, :].copy()
    to = torch.from_numpy if lib == "torch" else np.asarray
    q, k, v, kpool, vpool = inputs(lib, batch=1, slots=16)
    ix = ci.make(to(pos), to(tab))
    ix.attend(q, k, v, kpool, vpool)
    tab[0, :5] = [9, 10, 11, 12, 13]
    assert equal(ix.attend(q, k, v, kpool, vpool),
                 ci.make(to(pos), to(tab)).attend(q, k, v, kpool, vpool))
    assert equal(ix.extend(k, kpool), ci.make(to(pos), to(tab)).extend(k, kpool))


def test_a_write_behind_torchs_back_reaches_the_compiled_operator():
    """A table written through NumPy (no version counter moves): the compiled operator's plan
    is checked by value, so it stores and reads where the new table says."""
    pos, tab = np.arange(5)[None, :], np.arange(8)[None, :].copy()
    q, k, v, kpool, vpool = inputs("torch", batch=1, slots=16)
    step, _ = compiled(lambda i, q, k, v, kp, vp: i.attend(q, k, v, kp, vp))
    ix = ci.make(torch.from_numpy(pos), torch.from_numpy(tab))
    step(ix, q, k, v, kpool, vpool)
    tab[0, :5] = [9, 10, 11, 12, 13]
    assert equal(step(ix, q, k, v, kpool, vpool), ix.attend(q, k, v, kpool, vpool))


GRAD_MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad,
              "inference": torch.inference_mode}


def decode_tokens(config, params, prompt, steps, forward, mode, kv=None):
    """Greedy tokens: an eager prefill, then ``steps`` decode calls of ``forward``, each on a
    new ``ci.make`` of the next positions, all under ``mode``, over pools of ``kv``."""
    batch, seq = prompt.shape
    slots = seq + steps
    with GRAD_MODES[mode]():
        pools = llama.empty_pools(config, batch * slots, xp="torch", kv=kv)
        index = ci.rows(slots, [seq] * batch, xp="torch")
        table = index.table
        logits, pools = llama.forward(params, config, prompt, index, pools, last=True)
        out, pos = [], seq
        for _ in range(steps):
            tok = torch.argmax(logits[:, -1, :], dim=-1)[:, None]
            out.append(tok)
            step = ci.make(torch.full((batch, 1), pos), table.clone())
            logits, pools = forward(params, config, tok, step, pools)
            pos += 1
    return torch.cat(out, dim=1)


# each grad mode once, inference mode (how users serve) with static and symbolic shapes
@pytest.mark.parametrize("mode, dynamic", [("grad", True), ("no_grad", False),
                                           ("inference", False), ("inference", True)])
def test_a_compiled_windowed_decode_compiles_once_and_gives_eagers_tokens(mode, dynamic):
    """An eager prefill, then compiled decode steps of a model with a sliding layer, each step
    a new index: one program for every step (guards on structure, never on an index's id),
    under grad, ``no_grad`` and ``inference_mode``, static shapes or ``dynamic=True`` (no
    ``specialize_int`` patch), and eager's tokens."""
    config = llama.Config.tiny(windows=(4, None))
    params = llama.random_params(config, xp="torch")
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    want = decode_tokens(config, params, prompt, 8, llama.forward, mode)
    step, count = compiled(lambda p, c, t, i, q: llama.forward(p, c, t, i, q), dynamic=dynamic)
    got = decode_tokens(config, params, prompt, 8, step, mode)
    assert torch.equal(got, want)
    assert count.graphs == 1


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_a_compiled_decode_over_quantized_pools_under_inference_mode_gives_eagers_tokens(kv):
    """The same over quantized pools (codes and scales, the compiled operator's four pools),
    under ``torch.inference_mode()`` as users serve: one program, eager's tokens."""
    config = llama.Config.tiny(windows=(4, None))
    params = llama.random_params(config, xp="torch")
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    want = decode_tokens(config, params, prompt, 6, llama.forward, "inference", kv)
    step, count = compiled(lambda p, c, t, i, q: llama.forward(p, c, t, i, q))
    got = decode_tokens(config, params, prompt, 6, step, "inference", kv)
    assert torch.equal(got, want)
    assert count.graphs == 1


def test_dynamic_shapes_compile_attend_for_several_lengths_without_patches():
    """``torch.compile(dynamic=True)`` of ``attend`` (an index's numbers symbolic) gives
    eager's output for calls of several lengths."""
    step, count = compiled(lambda i, q, k, v, kp, vp: i.attend(q, k, v, kp, vp), dynamic=True)
    for seq in (3, 5, 7):
        q, k, v, kpool, vpool = inputs("torch", seq=seq)
        ix = ci.rows(16, [seq - 1, seq], xp="torch").window(4)
        assert equal(step(ix, q, k, v, kpool.clone(), vpool.clone()),
                     ix.attend(q, k, v, kpool.clone(), vpool.clone()))
    assert count.graphs <= 2  # the first shape static, then one symbolic program


def test_every_layer_of_a_call_reads_one_plan():
    """The plan's parts are made by the first layer and read by every later one: a model of
    four layers makes as many parts as one of one layer."""
    made = []
    for layers in (1, 4):
        config = llama.Config.tiny(layers=layers)
        params = llama.random_params(config)
        index = ci.rows(8, [3, 5])
        llama.forward(params, config, np.ones((2, 5), np.int64), index,
                      llama.empty_pools(config, 16))
        made.append(index.plan.made)
    assert made[0] == made[1] > 0


def test_advance_carries_the_runs_a_decode_step_reads():
    """``advance()``'s index starts from its last plan's read part where it follows (one more
    column per lane): the core's runs, or the paged kernel's plan where a decode step over CPU
    pools goes through it (``cacheidx.attention.paged``). Reading it makes no read part again,
    and the output equals a fresh index's."""
    q, k, v, kpool, vpool = inputs("numpy", seq=1, slots=64)
    index = ci.rows(32, [3, 5])
    prompt = inputs("numpy", seq=5, slots=64)
    _, kpool, vpool = index.attend(*prompt[:3], kpool, vpool)
    step = index.advance()
    for _ in range(4):
        _, kpool, vpool = step.attend(q, k, v, kpool, vpool)
        nxt = step.advance()
        carried = {key: part for key, part in nxt.plan._parts.items()
                   if key[0] in ("runs", "paged")}
        assert carried, nxt.plan
        fresh = ci.make(nxt.pos.copy(), nxt.table.copy())
        assert equal(nxt.attend(q, k, v, kpool.copy(), vpool.copy()),
                     fresh.attend(q, k, v, kpool.copy(), vpool.copy()))
        read = {key: part for key, part in nxt.plan._parts.items()
                if key[0] in ("runs", "paged")}
        assert read.keys() == carried.keys() and all(
            read[key] is carried[key] for key in read), "the carried part was read, not remade"
        step = nxt


def test_threads_sharing_an_index_read_one_plan():
    """Four threads attending through one index at once (a barrier starts them together) each
    get a lone call's output, and leave the index one plan: a lone call's parts, no more,
    which a later call reads without making any."""
    q, k, v, kpool, vpool = inputs("numpy")
    index = ci.rows(16, [3, 5])
    lone = ci.rows(16, [3, 5])
    want = lone.attend(q, k, v, kpool, vpool)
    got, errors = [], []
    start = threading.Barrier(4)

    def run():
        try:
            start.wait(timeout=60)
            got.append(index.attend(q, k, v, kpool, vpool))
        except Exception as e:  # pragma: no cover - what the test reports
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(got) == 4
    assert all(equal(g, want) for g in got)
    assert lone.plan._parts and set(index.plan._parts) == set(lone.plan._parts), index.plan
    made = index.plan.made
    assert equal(index.attend(q, k, v, kpool, vpool), want)
    assert index.plan.made == made, "a call after the threads made a part again"


#: one compiled step for every example: Hypothesis feeds it indices of many kinds
_STEP = {}


@settings(max_examples=12, deadline=None, derandomize=bool(os.environ.get("CI")),
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_compiled_step_over_random_indices_equals_eager_and_compiles_per_kind(data):
    """A compiled step fed random paged indices (pages in any order, windows, chunks of any
    length): eager's output and pools, and one program per kind of call (its structure and
    shapes), never one per index."""
    if not _STEP:
        _STEP["fn"], _STEP["count"] = compiled(
            lambda i, q, k, v, kp, vp: i.attend(q, k, v, kp, vp, donate=True))
        _STEP["kinds"] = set()
    page, pages, batch = 4, 4, 2
    seq = data.draw(st.sampled_from([1, 3, 4]), label="chunk")
    window = data.draw(st.sampled_from([None, 3, 6]), label="window")
    perm = np.array(data.draw(st.permutations(range(batch * pages)), label="pages"))
    table = (perm.reshape(batch, pages)[:, :, None] * page + np.arange(page)).reshape(batch, -1)
    start = np.array([data.draw(st.integers(0, page * pages - seq), label=f"start{b}")
                      for b in range(batch)])
    pos = start[:, None] + np.arange(seq)
    ix = ci.make(torch.from_numpy(pos), torch.from_numpy(table))
    ix = ix if window is None else ix.window(window)
    q, k, v, kpool, vpool = inputs("torch", batch=batch, seq=seq, slots=batch * pages * page,
                                   seed=data.draw(st.integers(0, 99), label="seed"))
    kpool, vpool = torch.randn_like(kpool), torch.randn_like(vpool)
    want = ix.attend(q, k, v, kpool.clone(), vpool.clone())
    # 9 kinds (3 chunks x 3 windows) may each compile once: past dynamo's limit of 8 a code
    # object, which fullgraph turns into a failure (a run that drew all 9 did)
    with torch._dynamo.config.patch(recompile_limit=16):
        got = _STEP["fn"](ix, q, k, v, kpool.clone(), vpool.clone())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    _STEP["kinds"].add((ix.structure, seq))
    assert _STEP["count"].graphs == len(_STEP["kinds"])
