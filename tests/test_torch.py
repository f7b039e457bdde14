"""The torch backend: scatter with drop, donation, pytrees, torch.compile and torch.export,
compile counts, and attention (SDPA and FlexAttention) under an index's masks.

The generic laws run on torch in the conformance suite (cacheidx/conformance); what is here is
what only torch has. Compiled runs use ``fullgraph=True`` (a graph break fails the test) and
``dynamic=False``; most use ``aot_eager`` or a counting backend, a few ``inductor``, which
takes seconds per compile.
"""

from __future__ import annotations

import dataclasses
import io
import os
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("torch", reason="the torch backend and these tests need PyTorch")

import reference  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from strategies import HUGE, build, cases  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import cacheidx as ci  # noqa: E402
from cacheidx.backends import onednn  # noqa: E402
from cacheidx.backends import torch as torch_backend  # noqa: E402

BACKEND = ci.backends.get("torch")
T = torch.tensor


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test starts with no compiled code and zeroed counters."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compiled(fn, backend="aot_eager"):
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


def run(fn, mode):
    """``fn`` eagerly (mode "eager") or compiled by the torch.compile backend ``mode``."""
    return fn if mode == "eager" else compiled(fn, mode)


def same(got, want):
    """Equal shapes, dtypes and elements, NaN equal to NaN."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got, want)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def store(pool, slots, rows, *, donate=False):
    return BACKEND.scatter(pool, slots, rows, donate=donate)


# -- scatter with drop ---------------------------------------------------------------------------

DROPPED = [-1, 6, 7, HUGE, -2, -6, -HUGE, 2**62]  # for a pool of 6 slots: all address nothing


def pool_of(n=6, width=3, dtype=torch.float32):
    return (-1 - torch.arange(n * width)).reshape(n, width).to(dtype)


def rows_of(k, width=3, dtype=torch.float32):
    return (10 + torch.arange(k * width)).reshape(k, width).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64,
                                   torch.int8, torch.bool])
@pytest.mark.parametrize("row", [(), (2, 3)])
def test_scatter_with_drop_is_exact_for_every_dtype_and_row_shape(dtype, row):
    width = int(np.prod(row, dtype=int))
    pool, rows = pool_of(6, width), rows_of(5, width)
    if dtype == torch.bool:
        pool, rows = pool < -10, rows > 0
    pool, rows = pool.reshape(6, *row).to(dtype), rows.reshape(5, *row).to(dtype)
    want = pool.clone()
    want[2], want[0] = rows[1], rows[3]
    same(store(pool, T([-1, 2, HUGE, 0, -3]), rows), want)


def test_a_store_of_nothing_leaves_a_nan_at_slot_0_as_it_was():
    pool = pool_of()
    pool[0] = torch.nan
    before = pool.clone()
    same(store(pool, T([-1, HUGE]), rows_of(2), donate=True), before)


def test_scatter_with_drop_under_inductor():
    """Inductor checks its indirect indices; the redirected targets pass those checks."""
    step = compiled(lambda p, s, r: store(p, s, r, donate=True), "inductor")
    for slots in ([-1, 0, HUGE, 3], [HUGE, -1, -2, -HUGE]):
        pool, rows = pool_of(), rows_of(4)
        want = pool.clone()
        for i, s in enumerate(slots):
            if 0 <= s < 6:
                want[s] = rows[i]
        same(step(pool, T(slots), rows), want)
        same(pool, want)  # donated: written into the caller's tensor


# -- donation ------------------------------------------------------------------------------------

def decode_index():
    """Four lanes decoding one token each: three store (at slots 2, 5 and 0), one is at a hole
    of its table and stores nothing, just before the store at slot 0."""
    return ci.make(T([[3], [1], [2], [0]]),
                   T([[4, 7, 6, 2, -1], [1, 5, -1, -1, 3], [HUGE, -2, -1, -1, -1],
                      [0, -1, -1, -1, -1]]))


WRITTEN, UNTOUCHED = [2, 5, 0], [1, 3, 4, 6, 7]


# -- torch eager against the reference, on random indices ------------------------------------

class TorchCtors:
    """cacheidx's constructors taking a case's NumPy arrays as torch tensors."""

    @staticmethod
    def make(pos, table, row=None, every=None):
        return ci.make(torch.from_numpy(pos), torch.from_numpy(table),
                       row=None if row is None else torch.from_numpy(row),
                       every=None if every is None else [(m, torch.from_numpy(b))
                                                         for m, b in every])

    @staticmethod
    def rows(context, lens, every=()):
        return ci.rows(context, lens, every=every, xp="torch")

    @staticmethod
    def whole(batch, seq, lens=None):
        return ci.whole(batch, seq, lens=lens, xp="torch")

    @staticmethod
    def packed(seq, lens):
        return ci.packed(seq, lens, xp="torch")


def on_torch(case):
    ops = tuple((name, tuple(torch.from_numpy(a) if isinstance(a, np.ndarray) else a
                             for a in args)) for name, args in case.ops)
    return build(TorchCtors, dataclasses.replace(case, ops=ops))


def exactly(got, want, unsure=None):
    got = got.numpy() if got.dtype != torch.bool else got.numpy().astype(bool)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.dtype, want.dtype)
    if unsure is not None:
        got, want = got[~unsure], want[~unsure]
    assert np.array_equal(got, want, equal_nan=want.dtype.kind == "f"), f"\n{got}\n{want}"


@settings(max_examples=150 if os.environ.get("CI") else 60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_eager_torch_agrees_with_numpy(case):
    """The adapter's scatter and gather against NumPy's, on random indices: holes, slots past
    the pool, 2**40, negatives, NaN in slots no token may read. (The core against the slow
    reference is tests/test_against_reference.py's; the reference here only says which
    entries two stores at one slot leave unspecified.)"""
    index, ref = on_torch(case), build(ci, case)
    exactly(index.positions(), ref.positions())
    exactly(index.mask(), ref.mask())
    want_seen, want_pool = ref.extend(case.values, case.pool.copy())
    unsure_seen, unsure_pool = build(reference, case).unsure(len(case.pool))
    for donate, host in ((False, True), (True, True), (True, False)):
        pool = torch.from_numpy(case.pool.copy())
        with mock.patch.object(torch_backend, "_on_host", lambda *_, h=host: h):
            seen, out = index.extend(torch.from_numpy(case.values), pool, donate=donate)
        exactly(seen, want_seen, unsure_seen)
        exactly(out, want_pool, unsure_pool)
        exactly(pool, want_pool if donate else case.pool, unsure_pool)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.bool])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("host", [True, False])
def test_seen_is_exact_for_every_dtype_and_layout(dtype, layout, host, monkeypatch):
    """Eager reads find the rows to zero on the host on the CPU, and without a value-dependent
    shape elsewhere (CUDA); both read the same rows and zero the same columns."""
    monkeypatch.setattr(torch_backend, "_on_host", lambda *_: host)
    index = ci.make(T([[2], [0]]), T([[3, -1, 0, 6], [4, 5, HUGE, 2]])).window(2)
    full = (torch.arange(7 * 2 * 4).reshape(7, 2, 4) % 5).to(dtype)
    pool = full if layout == "contiguous" else full.transpose(1, 2).contiguous().transpose(1, 2)
    values = torch.ones(2, 1, 2, 4).to(dtype)
    seen, _ = index.extend(values, pool.clone())
    zero = torch.zeros(2, 4, dtype=dtype)
    want = torch.stack([torch.stack([zero, zero, values[0, 0], zero]),
                        torch.stack([values[1, 0], zero, zero, zero])])
    same(seen, want)


def test_seen_is_differentiable_through_a_whole_index():
    """A training step reads its values through a whole index; gradients flow to the values
    each token sees and nowhere else."""
    index = ci.packed(4, [[2, 1], [3]], xp="torch")
    values = torch.arange(8.0).reshape(2, 4, 1).requires_grad_()
    seen, _ = index.extend(values, torch.zeros(1, 1))
    seen.sum().backward()
    same(values.grad, ci.masks.valid(index)[..., None].to(values.dtype))


# -- pytrees, torch.compile and torch.export ----------------------------------------------------

def kinds():
    """One index of each kind a layer meets, with its values and pool (no NaN: compiled and
    eager results are compared with NaN unequal)."""
    rows_w = ci.rows(8, [3, 5], xp="torch").window(3)
    blocks = ci.rows(12, [7, 10], every=[4], xp="torch").every(4)
    select = ci.rows(8, [3, 5], xp="torch").select(T([[[0, 2]] * 5, [[4, 9], [1, -1], [3, 3],
                                                                     [0, 4], [2, HUGE]]]))
    draft = ci.make(T([[4, 5, 5], [-1, 2, 3]]),
                    T([[0, 1, 2, 3, -1, -1], [6, 7, -1, -1, -1, -1]])).draft(
        T([[20, 21, -1], [HUGE, 24, 25]]),
        T([[[1, 0, 0], [1, 1, 0], [1, 0, 1]], [[1, 0, 0], [0, 1, 0], [0, 1, 1]]]).bool())
    row_map = ci.make(T([[3, 4], [-1, 0], [5, 6]]),
                      T([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, -1, 30, HUGE, -2]]),
                      row=T([0, 1, -1]))
    found = {
        "rows+window": (rows_w, 16),
        "blocks": (blocks, 6),
        "select": (select, 16),
        "draft": (draft, 26),
        "row map": (row_map, 12),
        "whole": (ci.whole(2, 5, lens=[3, 5], xp="torch").every(2), 1),
        "packed": (ci.packed(6, [[2, 3], [1, 1, 4]], xp="torch").window(2), 1),
    }
    out = {}
    for name, (index, slots) in found.items():
        values = (100 + torch.arange(index.batch * index.seq * 2.0)).reshape(
            index.batch, index.seq, 2)
        out[name] = (index, values, -1 - torch.arange(slots * 2.0).reshape(slots, 2))
    return out


KINDS = kinds()


@pytest.mark.parametrize("name", list(KINDS))
def test_pytree_round_trip(name):
    index = KINDS[name][0]
    leaves, spec = pytree.tree_flatten(index)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    assert [x.data_ptr() for x in leaves] == [x.data_ptr() for x in ci.pytree.leaves(index)]
    back = pytree.tree_unflatten([x.clone() for x in leaves], spec)
    assert back.structure == index.structure and back.backend is index.backend
    same(back.mask(), index.mask())
    # the context serialises (torch.export.save needs it) and keys name the walk's paths
    assert pytree.treespec_loads(pytree.treespec_dumps(spec)) == spec
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(index)[0]]
    assert all(p.startswith(("['tokens.", "['columns", "['draft.")) for p in paths), paths


def step(index, values, pool):
    seen, pool = index.extend(values, pool, donate=True)
    return seen, pool, index.mask(), index.visible(), index.positions()


@pytest.mark.parametrize("name", list(KINDS))
def test_compiled_equals_eager(name):
    index, values, pool = KINDS[name]
    want = step(index, values, pool.clone())
    got = compiled(step)(index, values, pool.clone())
    for g, w in zip(got, want, strict=True):
        same(g, w)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rows+window", "draft"])
def test_inductor_equals_eager_and_writes_in_place(name):
    index, values, pool = KINDS[name]
    want = step(index, values, pool.clone())
    mine = pool.clone()
    got = compiled(step, "inductor")(index, values, mine)
    for g, w in zip(got, want, strict=True):
        same(g, w)
    assert got[1].data_ptr() == mine.data_ptr()
    same(mine, want[1])


def test_backend_jit_compiles_with_the_compiler_it_is_given():
    """``jit(fn, compiler=...)`` names torch.compile's backend for that call alone: the
    registry's backend is never changed."""
    index, values, pool = KINDS["blocks"]
    got = BACKEND.jit(step, compiler="aot_eager")(index, values, pool.clone())
    assert BACKEND.compiler == "inductor"
    same(got[0], step(index, values, pool.clone())[0])
    assert counters["stats"]["unique_graphs"] == 1


class Step(torch.nn.Module):
    def forward(self, index, values, pool):
        seen, pool = index.extend(values, pool)
        return seen, pool, index.mask()


@pytest.mark.parametrize("strict", [False, True])
def test_export_takes_an_index(strict):
    index, values, pool = KINDS["row map"]
    program = torch.export.export(Step(), (index, values, pool), strict=strict)
    names = tuple(program.graph_signature.user_inputs)
    assert names[:3] == ("index_tokens_row", "index_tokens_pos", "index_tokens_table")
    other = ci.make(T([[7, 8], [0, 1], [-1, 2]]), index.table.flip(1), row=T([1, -1, 0]))
    for ix in (index, other):
        for g, w in zip(program.module()(ix, values, pool), Step()(ix, values, pool),
                        strict=True):
            same(g, w)
    buf = io.BytesIO()
    torch.export.save(program, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    same(loaded.module()(other, values, pool)[0], Step()(other, values, pool)[0])


# -- compile counts: a tiny decoder --------------------------------------------------------------

class TinyDecoder(torch.nn.Module):
    """One attention layer whose keys and values live in pools, read through the index."""

    def __init__(self, vocab=11, dim=8, heads=2, context=16):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.where = torch.nn.Embedding(context, dim)  # indexed by index.positions()
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, index, tokens, k_pool, v_pool):
        b, s = tokens.shape
        x = self.embed(tokens) + self.where(index.positions())
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, -1).unbind(2)
        k_seen, k_pool = index.extend(k, k_pool, donate=True)  # [b, context, heads, dim]
        v_seen, v_pool = index.extend(v, v_pool, donate=True)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k_seen.transpose(1, 2),
                                           v_seen.transpose(1, 2), attn_mask=index.visible())
        return self.out(o.transpose(1, 2).reshape(b, s, -1)), k_pool, v_pool


class Counting:
    """A torch.compile backend that counts compiles and runs the captured graph as is."""

    def __init__(self):
        self.compiles = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return gm.forward


def serving(steps, seed=0, lanes=3, rows=4, context=16, slots=64):
    """Indices of ``steps`` decode steps of a paged server: each step every live lane takes a
    free slot, chosen at random, for its next position; a sequence that reaches the context or
    ends at random frees its slots and a new one takes its row, often in another lane; a lane
    may be padding. Every index has the same shapes; positions, tables, row maps change."""
    rng = np.random.default_rng(seed)
    table = np.full((rows, context), -1)
    length = np.zeros(rows, dtype=int)
    free = list(rng.permutation(slots))
    lane_row = np.array([0, 1, 2][:lanes])
    out = []
    for _ in range(steps):
        pos = np.full((lanes, 1), -1)
        for b, r in enumerate(lane_row):
            if r < 0:
                continue
            table[r, length[r]] = free.pop(rng.integers(len(free)))
            pos[b, 0] = length[r]
        out.append(ci.make(T(pos), T(table.copy()), row=T(lane_row.copy())))
        for b, r in enumerate(lane_row):
            if r < 0:
                lane_row[b] = rng.choice([q for q in range(rows) if q not in lane_row])
                continue
            length[r] += 1
            if length[r] == context or rng.random() < 0.08:
                free += [s for s in table[r] if s >= 0]
                table[r], length[r] = -1, 0
                idle = [q for q in range(rows) if q not in lane_row or q == r]
                lane_row[b] = rng.choice(idle + [-1])
    return out


def tiny_decoder():
    """(step, fresh pools, vocabulary) of the TinyDecoder above."""
    torch.manual_seed(0)
    model = TinyDecoder().eval()

    def step(tokens, index, pools):
        logits, k_pool, v_pool = model(index, tokens, *pools)
        return logits, (k_pool, v_pool)

    return step, lambda: (torch.zeros(64, 2, 4), torch.zeros(64, 2, 4)), 11


def llama_decoder():
    """(step, fresh pools, vocabulary) of cacheidx.models.llama's tiny configuration."""
    llama = pytest.importorskip("cacheidx.models.llama", reason="no Llama forward here")
    config = llama.Config.tiny()
    params = llama.random_params(config, xp="torch")

    def step(tokens, index, pools):
        return llama.forward(params, config, tokens, index, pools, donate=True)

    return step, lambda: llama.empty_pools(config, 64, like=params["embed"]), config.vocab


@pytest.mark.parametrize("decoder, compiler", [
    ("tiny", "counting"),
    ("llama", "counting"),
    pytest.param("tiny", "inductor", marks=pytest.mark.slow),
])
def test_decoding_64_steps_compiles_once(decoder, compiler):
    step, fresh, vocab = {"tiny": tiny_decoder, "llama": llama_decoder}[decoder]()
    counting = Counting()
    fast = torch.compile(step, backend=counting if compiler == "counting" else compiler,
                         fullgraph=True, dynamic=False)
    mine, theirs = fresh(), fresh()
    tokens = torch.zeros(3, 1, dtype=torch.long)
    indices = serving(64)
    assert len({tuple(ix.pos.flatten().tolist()) for ix in indices}) > 10
    with torch.no_grad():
        for t, index in enumerate(indices):
            tokens = (tokens * 7 + t) % vocab
            want, theirs = step(tokens, index, theirs)
            got, mine = fast(tokens, index, mine)
            if compiler == "counting" and decoder == "tiny":
                same(got, want)
            else:  # fused kernels may round differently, and eager attend reads runs of
                # slots as views where a traced one tiles (sums in another order)
                torch.testing.assert_close(got, want)
            if decoder == "tiny":  # the pools hold copies, exactly
                for g, w in zip(pytree.tree_leaves(mine), pytree.tree_leaves(theirs),
                                strict=True):
                    same(g, w)
            else:  # a layer's keys come from the one before: within rounding, as its output
                torch.testing.assert_close(mine, theirs)
    assert counting.compiles == (compiler == "counting")
    assert counters["stats"]["unique_graphs"] == 1
    assert dict(counters["graph_break"]) == {}


def test_a_structural_change_compiles_again_and_only_once():
    counting = Counting()
    fast = compiled(step, counting)
    values, pool = torch.ones(2, 10, 3), torch.zeros(24, 3)
    base = ci.rows(12, [7, 10], every=[2, 4], xp="torch")
    structures = [base, base.window(4), base.window(5), base.every(4), base.every(2),
                  base.every(4).window(4)]
    for n, index in enumerate(structures, start=1):
        fast(index, values, pool)
        assert counting.compiles == n, index
    for index in structures:  # each structure again, at other positions: no compile
        fast(dataclasses.replace(index, pos=index.pos.flip(1)), values, pool)
    assert counting.compiles == len(structures)
    assert dict(counters["graph_break"]) == {}


# -- attention: SDPA and FlexAttention --------------------------------------------------------

MASKED = {name: KINDS[name][0] for name in ("rows+window", "blocks", "draft", "row map",
                                               "whole", "packed")}
MASKED["whole, no window"] = ci.whole(3, 5, lens=[3, 5, 0], xp="torch")
MASKED["blocks+window"] = ci.rows(12, [7, 10], every=[4], xp="torch").every(4).window(5)


def attention_inputs(index, heads=2, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(index.batch, heads, index.seq, dim, generator=g)
    k, v = (torch.randn(index.batch, heads, index.context, dim, generator=g) for _ in "kv")
    return q, k, v


def by_hand(q, k, v, mask):
    """Softmax attention under a [batch, seq, context] mask, rows that see nothing left NaN."""
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("name", list(MASKED))
def test_visible_is_the_attn_mask_of_sdpa(name):
    """Rows that see something agree with attention by hand under mask(). A row that sees
    nothing (a padded token) is NaN in SDPA on older torch and zero on recent CPU kernels; its
    output is unspecified, so only that it is one of the two is checked."""
    index = MASKED[name]
    q, k, v = attention_inputs(index)
    visible = index.visible()
    assert visible.dtype == torch.bool and visible.shape == (index.batch, 1, index.seq,
                                                              index.context)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    want = by_hand(q, k, v, index.mask())
    some = index.mask().any(-1)[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[some], want[some])
    nothing = got[~some]
    assert bool((torch.isnan(nothing) | (nothing == 0)).all())


@pytest.mark.parametrize("name", list(MASKED))
def test_flex_mask_mod_equals_mask(name):
    from torch.nn.attention.flex_attention import create_mask

    from cacheidx import flex

    index = MASKED[name]
    mod = flex.mask_mod(index)
    got = create_mask(mod, index.batch, 3, index.seq + 2, index.context + 5, device="cpu")
    same(got[:, 1, : index.seq, : index.context], index.mask())
    assert torch.equal(got[:, 0], got[:, 2])  # whatever the head
    assert not got[:, :, index.seq :].any() and not got[:, :, :, index.context :].any()


@pytest.mark.parametrize("name", ["whole, no window", "packed", "rows+window", "blocks+window"])
def test_flex_attention_under_the_block_mask_equals_sdpa(name):
    from torch.nn.attention.flex_attention import flex_attention

    from cacheidx import flex

    index = MASKED[name]
    q, k, v = attention_inputs(index)
    got = flex_attention(q, k, v, block_mask=flex.block_mask(index))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=index.visible())
    some = index.mask().any(-1)[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[some], want[some])


def test_flex_refuses_a_selection_and_other_libraries():
    from cacheidx import flex

    with pytest.raises(ValueError, match="selects columns"):
        flex.mask_mod(KINDS["select"][0])
    with pytest.raises(TypeError, match="torch tensors"):
        flex.mask_mod(ci.rows(4, [2], xp="numpy"))


def test_import_cacheidx_does_not_import_flex():
    import subprocess
    import sys

    code = "import sys, cacheidx; assert 'cacheidx.flex' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_benchmark_runs(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "extend_torch.py"
    spec = importlib.util.spec_from_file_location("extend_torch", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--quick", "--json", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text())["ratios"] == result["ratios"]
    assert {r["what"] for r in result["rows"]} == {"extend", "baseline"}


def test_the_linear_product_under_inference_mode_is_onednn_s_and_close():
    """A model's linear layers go through ``backend.matmul``: under inference mode (a serving
    step) on the CPU, oneDNN's linear (another summation order); elsewhere exactly ``@``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    a, b = torch.randn(8, 96), torch.randn(96, 40)
    with Names() as seen:
        same(BACKEND.matmul(a, b), a @ b)
    assert "_linear_pointwise" not in seen.names
    step = BACKEND.inference(lambda a, b: BACKEND.matmul(a, b))
    with Names() as seen:
        got = step(a, b)
    if onednn.available():
        assert "_linear_pointwise" in seen.names
    torch.testing.assert_close(got, a @ b, rtol=1e-5, atol=1e-5)
    assert not torch.is_inference_mode_enabled()
    with torch.inference_mode():  # anything else than float32 matrices: plain @
        same(BACKEND.matmul(a.double(), b.double()), a.double() @ b.double())


def test_a_weight_is_packed_once_for_onednn_and_again_after_a_write():
    """oneDNN's linear packs a weight once while it is unchanged (:mod:`cacheidx.backends.
    onednn`): the second product reuses the pack, an in-place write through torch makes a new
    one (a stale pack would give the old product), each view of one weight has its own, the
    packs go with their weight, and an inference tensor or ``packing(False)`` reads the weight
    as stored."""
    import gc

    if not onednn.available():
        pytest.skip("this torch has no oneDNN linear to pack for")
    kept = onednn._kept()
    before = len(kept)
    w = torch.randn(40, 96)  # [out, in], as llama.convert places a linear weight
    b, a = w.mT, torch.randn(8, 96)
    step = BACKEND.inference(lambda a, b: BACKEND.matmul(a, b))
    got = step(a, b)
    torch.testing.assert_close(got, a @ b, rtol=1e-5, atol=1e-5)
    (version, first), = kept[w].values()
    torch.testing.assert_close(step(a, b), got, rtol=0, atol=0)
    assert next(iter(kept[w].values()))[1] is first  # reused, not packed again
    with torch.no_grad():
        w.mul_(-2)
    torch.testing.assert_close(step(a, b), a @ b, rtol=1e-5, atol=1e-5)
    assert next(iter(kept[w].values()))[0] == version + 1
    torch.testing.assert_close(step(a, b[:, :24]), a @ b[:, :24], rtol=1e-5, atol=1e-5)
    assert len(kept[w]) == 2
    assert step(torch.randn(3, 5, 96), b).shape == (3, 5, 40)
    assert len(kept) == before + 1
    mine, held = sum(p.numel() * p.element_size() for _, p in kept[w].values()), \
        onednn.packed_bytes()
    assert mine >= (40 + 24) * 96 * 4  # the two views' packs, counted
    del w, b
    gc.collect()
    assert len(kept) == before and onednn.packed_bytes() == held - mine
    with torch.inference_mode():
        made = torch.randn(40, 96)  # an inference tensor: no version counter to watch
    with onednn.packing(False):
        alone = torch.randn(40, 96)
        torch.testing.assert_close(step(a, alone.mT), a @ alone.mT, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step(a, made.mT), a @ made.mT, rtol=1e-5, atol=1e-5)
    assert made not in kept and alone not in kept


def test_a_head_major_pools_rows_are_weighed_by_onednn_but_never_packed():
    """A pool's rows are no weight: they change every step, and a pack of each tile read would
    be made on every call and kept while the pool lives. The head-major products weigh a
    pool's values by oneDNN's linear, unpacked: no pack is made, and the product is ``p V``."""
    from cacheidx.attention import layout
    from cacheidx.attention.torch import SHORT, HeadMajor

    if not onednn.available():
        pytest.skip("this torch has no oneDNN linear to pack for")
    xp = BACKEND.xp
    pool = layout.zeros(xp, 4 * SHORT, 3, 64, dtype=xp.float32, layout="head")
    pool[...] = torch.randn(4 * SHORT, 3, 64)
    held = onednn.packed_bytes()
    with torch.inference_mode():
        for width in (SHORT, 2 * SHORT, 3 * SHORT):  # a tile growing, as a decode step's does
            values = pool[:width][None]
            p = torch.rand(1, 3, 4, width)
            got = HeadMajor().weigh(p, values)
            want = p @ values.permute(0, 2, 1, 3)  # sums of up to 1,536 products, reordered
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert onednn.packed_bytes() == held and pool not in onednn._kept()


@pytest.mark.parametrize("rows", [3, 2 * 128 + 5])
@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("wide", [False, True])
def test_stacked_rows_over_a_long_run_are_one_state_of_their_softmax(rows, inference, wide):
    """Rows every one of which sees a run whole (a shared prefix's stacked rows) are one call's
    state ``(m, l, acc)``: oneDNN's products in base 2 under inference mode where torch runs
    its AVX-512 kernels (``wide``: rows in blocks of ``ROWS``), torch's fused attention
    elsewhere. Either is the softmax's state to float32's rounding (``acc / l`` the output,
    ``m + log l`` the log-sum-exp, against float64), and a key or value that is not finite
    makes it decline, for the careful product."""
    from cacheidx.attention import layout
    from cacheidx.attention import torch as path

    if not onednn.available():
        pytest.skip("this torch has no oneDNN linear")
    assert rows < path.ROWS or rows > 2 * path.ROWS  # one block, or three, the last short
    cols, kv, d = 3 * path.SHORT, 3, 64
    xp, rng = BACKEND.xp, np.random.default_rng(rows)
    keys, values = (layout.zeros(xp, cols, kv, d, dtype=xp.float32, layout="head")
                    for _ in "kv")
    for pool in (keys, values):
        pool[...] = torch.from_numpy(rng.standard_normal((cols, kv, d), dtype=np.float32))
    q = torch.from_numpy(rng.standard_normal((1, kv, rows, d), dtype=np.float32)) * 0.4
    z = q[0].double() @ keys.double().permute(1, 2, 0)  # [kv, rows, cols], float64
    want = torch.softmax(z, -1) @ values.double().permute(1, 0, 2)
    want_lse = torch.logsumexp(z, -1, keepdim=True)
    ctx = torch.inference_mode() if inference else torch.no_grad()
    with (ctx, mock.patch.object(onednn, "linear", wraps=onednn.linear) as linear,
          mock.patch.object(path, "stacks_by_onednn", lambda: wide)):
        m, l, acc = path.HeadMajor().run(q, keys[None], values[None])
        assert linear.call_count == (2 * kv * -(-rows // path.ROWS) if inference and wide
                                     else 0)
        for pool in (keys, values):
            kept = pool[5, 1, 7].item()
            pool[5, 1, 7] = float("inf")
            assert path.HeadMajor().run(q, keys[None], values[None]) is None
            pool[5, 1, 7] = kept
    torch.testing.assert_close((acc / l).double(), want[None], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((m + l.log()).double(), want_lse[None], rtol=1e-6, atol=1e-5)


# -- attend compiled: one operator, the eager code inside -------------------------------------

def attend_inputs(seed=0):
    """A decode step over two lanes of rows (one windowed), with pools head-major in memory."""
    from cacheidx.attention import layout

    rng = np.random.default_rng(seed)
    index = ci.rows(8, [5, 3], xp="torch").advance()
    q, k, v = (torch.from_numpy(rng.standard_normal(s, dtype=np.float32))
               for s in ((2, 1, 4, 3), (2, 1, 2, 3), (2, 1, 2, 3)))
    pools = []
    for _ in "kv":
        pool = layout.zeros(torch_xp(), 16, 2, 3, dtype=torch.float32, layout="head")
        pools.append(pool.copy_(torch.from_numpy(rng.standard_normal((16, 2, 3),
                                                                      dtype=np.float32))))
    return index, q, k, v, *pools


def torch_xp():
    import array_api_compat.torch

    return array_api_compat.torch


def attend_step(index, q, k, v, kpool, vpool, donate):
    return index.attend(q, k, v, kpool, vpool, scale=0.5, softcap=3.0, donate=donate)


@pytest.mark.parametrize("window", [None, 2])
def test_compiled_attend_is_the_eager_call_in_one_operator(window):
    """Under torch.compile a call is ``cacheidx::attend``, which runs the eager code of a
    serving step (under inference mode): the same output and pools bit for bit; donated, it
    stores into the caller's pools; not donated, the caller's pools are unchanged. The
    operator's schema and fake pass torch's own checks."""
    index, q, k, v, kpool, vpool = attend_inputs()
    index = index if window is None else index.window(window)
    with torch.inference_mode():
        want = attend_step(index, q, k, v, kpool.clone(), vpool.clone(), True)
    fn = compiled(attend_step)
    before = kpool.clone()
    got = fn(index, q, k, v, kpool, vpool, False)
    same(kpool, before)
    for g, w in zip(got, want, strict=True):
        same(g, w)
    got = fn(index, q, k, v, kpool, vpool, True)
    assert got[1].data_ptr() == kpool.data_ptr()
    same(kpool, want[1])
    from cacheidx.attention.torch import operands

    torch.library.opcheck(torch.ops.cacheidx.attend,
                          (*operands(index), q, k, v, [kpool.clone(), vpool.clone()], None, 0.5,
                           3.0, None))
    # quantized pools travel as their codes and scales, four mutated tensors
    from cacheidx import quantized

    pools = [part for pool in (kpool, vpool)
             for part in quantized.quantize(pool, 8)]
    torch.library.opcheck(torch.ops.cacheidx.attend,
                          (*operands(index, "quantized"), q, k, v, pools, None, 0.5, 3.0,
                           None))


def test_compiled_attend_under_autograd_reads_tiles_and_gives_eagers_gradients():
    """Where gradients are wanted the operator (which has no backward) steps aside: the traced
    tiles compute the call, and the gradients of q and of the pools equal eager's."""
    index, q, k, v, kpool, vpool = attend_inputs(1)
    grads = []
    for fn in (attend_step, compiled(attend_step)):
        qq, kp = q.clone().requires_grad_(), kpool.clone().requires_grad_()
        out, _, _ = fn(index, qq, k, v, kp, vpool.clone(), False)
        out.square().sum().backward()
        grads.append((out.detach(), qq.grad, kp.grad))
    for g, w in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seq", [1, 600])
@pytest.mark.parametrize("inference", [False, True])
def test_head_major_products_give_the_standards_output(seq, inference):
    """Over head-major pools torch's own products (keys first for a decode's few queries,
    oneDNN's linear for the values under inference mode, each from ``SHORT`` columns) give the
    standard products' output to float32's rounding, a decode's and a prefill's; a store that
    is not donated keeps the pool's memory order (else the products would never see it)."""
    from cacheidx.attention import layout
    from cacheidx.attention import torch as path

    slots = 2 * 1100
    assert seq == 1 or seq > path.SHORT  # lanes long enough for the products to take over
    index = ci.rows(1100, [700, 1000], xp="torch").advance() if seq == 1 else ci.rows(
        1100, [seq, seq - 7], xp="torch")
    outs = []
    for lay in ("head", "token"):  # token-major: no products of torch's own
        rng = np.random.default_rng(seq)  # the same values for both
        q, k, v = (torch.from_numpy(rng.standard_normal((2, seq, h, 8), dtype=np.float32))
                   for h in (6, 2, 2))
        pools = [layout.zeros(torch_xp(), slots, 2, 8, dtype=torch.float32, layout=lay)
                 for _ in "kv"]
        for p in pools:
            p.copy_(torch.from_numpy(rng.standard_normal((slots, 2, 8), dtype=np.float32)))
        ctx = torch.inference_mode() if inference else torch.no_grad()
        with ctx:
            assert (path.TorchPath().products(ci.backends.get("torch"), *pools) is None) == (
                lay == "token")
            out, kpool, _ = index.attend(q, k, v, *[p.clone() for p in pools])
        outs.append(out)
        # not donated, the new pool keeps the memory order of the old
        assert layout.head_major(kpool) == (lay == "head")
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_a_host_read_of_a_head_major_pool_is_the_token_major_one():
    """The read plan's rows of a head-major CPU pool (each head's rows gathered from its own
    block) are the same rows as of the same pool token-major, the slots a plan does not see
    zero, and come back head-major."""
    import numpy as np
    import torch

    from cacheidx import backends
    from cacheidx.attention import layout

    be = backends.get("torch")
    rng = np.random.default_rng(2)
    values = torch.as_tensor(rng.standard_normal((50, 3, 8), dtype=np.float32))
    head = layout.zeros(be.xp, 50, 3, 8, dtype=torch.float32, layout="head")
    head[...] = values
    assert layout.head_major(head) and not layout.head_major(values)
    slots = torch.tensor([7, 3, 49, 0, 3, 12])
    ok = torch.tensor([True, True, False, True, True, True])
    plan = be.read_plan(slots, ok, 50)
    got, want = be.read(head, plan), be.read(values, plan)
    assert torch.equal(got, want)
    assert torch.equal(want[2], torch.zeros(3, 8)) and torch.equal(want[1], values[3])
    assert got.stride(1) > got.stride(0), "the rows of a head-major pool stay head-major"
