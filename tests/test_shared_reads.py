"""Lanes sharing a prefix read it once (the runs' views, JAX's program, the tiles:
cacheidx.attention.shared), and nothing a user sees changes: the engine's tokens and
transformers' families' tokens are the same with shared reads and without
(``runs.unshared()``), and the shared reads did happen.

The conformance suite checks the law itself (``lanes_sharing_a_prefix_read_it_once_...``: the
prefixes each path reads once, counted, and the output against the reference); here, the
users' paths, and each path's reads where the law's cases do not reach them.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from cacheidx.attention import runs
from cacheidx.models import llama
from cacheidx.serve import Engine, LlamaModel, Request

SYSTEM = [(7 * i + 3) % 60 + 1 for i in range(96)]  # six pages of 16: a shared prompt


def placed(on, a, dtype=None):
    """``a`` (nested lists, a NumPy array) as an array of backend ``on``: of ``dtype``, or int64
    where it holds integers and bool otherwise."""
    a = np.asarray(a)
    return on.from_host(a, dtype or (on.xp.int64 if a.dtype.kind == "i" else on.xp.bool), None)


def host(x):
    """``x`` as a NumPy array (a tensor detached, any other library's through DLPack)."""
    return np.asarray(x.detach() if hasattr(x, "detach") else np.from_dlpack(x))


def prompts(count: int) -> list[list[int]]:
    return [SYSTEM + [11 + k, 40 + 3 * k, 50 + k] for k in range(count)]


@pytest.fixture
def shared_reads(monkeypatch):
    """The number of shared prefixes read (a call of the plan's shared read), while on."""
    calls = []
    real = runs._shared

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(runs, "_shared", counted)
    return calls


def serve(backend: str, requests, *, compile=False, share=True):
    config = llama.Config.tiny()
    model = LlamaModel(config, llama.random_params(config, seed=5))
    engine = Engine(model, backend=backend, pages=96, page_size=16, lanes=6, compile=compile)
    if share:
        return [r.tokens for r in engine.run(requests)]
    with runs.unshared():
        return [r.tokens for r in engine.run(requests)]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_the_engine_gives_the_same_tokens_with_shared_reads(backend, shared_reads):
    """Six requests under one 96-token prompt (the later ones hit the prefix cache and share its
    pages) and four samples of one prompt: the same tokens with shared reads and without, and
    shared reads were made."""
    reqs = [Request(k, p, 8) for k, p in enumerate(prompts(6))]
    reqs.append(Request("samples", SYSTEM + [7, 8, 9], 8, n=4))
    got = serve(backend, reqs)
    made = len(shared_reads)
    want = serve(backend, reqs, share=False)
    assert got == want
    assert made > 0, "no shared prefix was read once"
    assert len(shared_reads) == made, "runs.unshared() still shared"


def test_a_compiled_engine_shares_through_the_operator(shared_reads):
    """torch.compile's step calls the eager path through its operator: it shares too."""
    reqs = [Request(k, p, 6) for k, p in enumerate(prompts(4))]
    got = serve("torch", reqs, compile="aot_eager")
    assert shared_reads, "the compiled step read no shared prefix once"
    assert got == serve("torch", reqs, share=False)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2"])
def test_transformers_families_give_the_same_tokens_with_shared_reads(name, shared_reads):
    """transformers' models served by cacheidx (``cit.generate``): the same greedy tokens with
    shared reads and without, for families with and without sliding layers."""
    from hf_models import tiny

    from cacheidx.integrations import transformers as cit

    model = tiny(name)
    ps = [[(t % 100) + 1 for t in p] for p in prompts(4)]
    got = cit.generate(model, ps, max_new_tokens=6)
    with runs.unshared():
        want = cit.generate(model, ps, max_new_tokens=6)
    assert got == want
    assert shared_reads, f"{name}: no shared prefix was read once"


# -- JAX's program reads a shared prefix once ------------------------------------------------------
PAGE, HEADS, KV, DIM = 16, 4, 2, 6  #: DIM: the programs these tests count are theirs alone


def pages(*numbers: int) -> list[int]:
    """The slots of pages ``numbers``, in order: one row of a paged table."""
    return [p * PAGE + i for p in numbers for i in range(PAGE)]


def jax_cases() -> dict:
    """``(pos, table, draft)`` and the groups JAX's program reads once: pages 0-4 (and 10-14)
    are prefixes of 80 columns, each lane's sixth page its own; a draft's two tokens store in
    its own page; lanes past a table they share whole (storing nothing) read no column of
    their own."""
    one = [pages(0, 1, 2, 3, 4, 5 + b) for b in range(3)]
    two = [pages(0, 1, 2, 3, 4, 20 + b) for b in range(2)] + [
        pages(10, 11, 12, 13, 14, 22 + b) for b in range(2)] + [pages(30, 31, 32, 33, 34, 35)]
    return {
        "one group": ([[85], [86], [90]], one, False, (((0, 1, 2), 80),)),
        "two groups and a lane alone": ([[85], [86], [87], [88], [89]], two, False,
                                        (((0, 1), 80), ((2, 3), 80))),
        "two tokens a lane": ([[84, 85], [84, 85], [90, 91]], one, False, (((0, 1, 2), 80),)),
        "a draft": ([[88, 89], [88, 89], [90, 91]], one, True, (((0, 1, 2), 80),)),
        "the whole table shared": ([[80], [81]], [pages(0, 1, 2, 3, 4)] * 2, False,
                                   (((0, 1), 80),)),
        # a prefix of 18 pages in reverse order (too scattered for the runs' views): a gather
        # reads it once all the same, its 288 columns rounded down to 256
        "a scattered prefix": ([[290], [291], [295]],
                               [pages(*range(17, -1, -1), 20 + b) for b in range(3)], False,
                               (((0, 1, 2), 256),)),
        # 144 shared columns are rounded down to 128 (the program's key): each lane reads the
        # last 16 as its own
        "a prefix rounded down": ([[150], [151], [152]],
                                  [pages(*range(9), 40 + b) for b in range(3)], False,
                                  (((0, 1, 2), 128),)),
    }


def jax_call(pos, table, drafted, seed, *, bits=None):
    """A JAX index over ``table`` and a call's queries, keys, values and pools (quantized to
    ``bits`` where given), drawn from ``seed``."""
    jnp = pytest.importorskip("jax.numpy")
    import cacheidx as ci
    from cacheidx import quantized

    ix = ci.make(jnp.asarray(pos, dtype=jnp.int32), jnp.asarray(table, dtype=jnp.int32))
    if drafted:
        slots = np.asarray(table)[np.arange(len(pos))[:, None], np.asarray(pos)]
        ix = ix.draft(jnp.asarray(slots, dtype=jnp.int32),
                      jnp.asarray(np.tril(np.ones((len(pos), 2, 2), bool))))
    rng = np.random.default_rng(seed)
    n = max(max(row) for row in table) + 1

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

    b, s = ix.batch, ix.seq
    arrays = [draw(b, s, HEADS, DIM), draw(b, s, KV, DIM), draw(b, s, KV, DIM),
              draw(n, KV, DIM), draw(n, KV, DIM)]
    if bits is not None:
        arrays[3:] = [quantized.Quantized(*quantized.quantize(p, bits)) for p in arrays[3:]]
    return ix, arrays


@pytest.fixture
def jax_programs(monkeypatch):
    """JAX's programs made in the test (a jit cache of its own), as the ``share`` each was
    traced with, and the prefixes read once by them, as ``(lanes, width)``."""
    pytest.importorskip("jax")
    from functools import cache

    from cacheidx.attention import jax as path

    traced, prefixes = [], []
    looped, prefix = path._looped, path._prefix

    def counted(call, share=(), hint=False):
        traced.append(share)  # Python runs only while JAX traces: once per program
        return looped(call, share, hint)

    def read_once(call, q, row, lanes, read):
        prefixes.append((lanes, int(row.shape[0])))
        return prefix(call, q, row, lanes, read)

    monkeypatch.setattr(path, "_jitted", cache(path._jitted.__wrapped__))
    monkeypatch.setattr(path, "_looped", counted)
    monkeypatch.setattr(path, "_prefix", read_once)
    return traced, prefixes


def assert_same_call(shared, alone, what):
    """Outputs within float32's few roundings of each other (only the order of the sums
    differs), pools bit for bit."""

    from cacheidx.quantized import parts

    np.testing.assert_allclose(np.asarray(shared[0]), np.asarray(alone[0]), rtol=1e-5,
                               atol=1e-5, err_msg=f"{what}: the output")
    for got, want in zip(shared[1:], alone[1:]):
        for a, b in zip(parts(got), parts(want)):
            assert np.array_equal(np.asarray(a), np.asarray(b)), f"{what}: a pool"


@pytest.mark.parametrize("capped", [False, True])
@pytest.mark.parametrize("what", list(jax_cases()))
def test_jax_reads_a_shared_prefix_once_and_attends_as_without(what, capped, jax_programs):
    """One group, two groups beside a lane sharing nothing, two tokens a lane, a draft and a
    table shared whole: an eager JAX call reads each group's prefix once (the program's
    ``share`` names the groups and reads each prefix once), and its output is the unshared
    call's, its pools bit for bit.
    ``capped``: a softcap and sinks, and ``tile=24``, which reads an 80-column prefix in three
    tiles and a rest of 8."""
    import jax.numpy as jnp

    from cacheidx.attention import jax as path

    traced, prefixes = jax_programs
    pos, table, drafted, groups = jax_cases()[what]
    ix, arrays = jax_call(pos, table, drafted, seed=len(what))
    options = {} if not capped else {
        "tile": 24, "softcap": 2.5, "sinks": jnp.asarray([0.5, -1.0, 2.0, 0.0])}
    assert path.sharing(ix, int(arrays[3].shape[0]), HEADS) == groups
    shared = ix.attend(*arrays, **options)
    assert traced == [groups], f"{what}: the program shared {traced}, want {groups}"
    assert prefixes == list(groups), f"{what}: prefixes read {prefixes}"
    with runs.unshared():
        alone = ix.attend(*arrays, **options)
    assert traced == [groups, ()], "runs.unshared() still shared"
    assert prefixes == list(groups)
    assert_same_call(shared, alone, what)


@pytest.mark.parametrize("bits", [8, 4])
def test_jax_reads_a_quantized_prefix_once_as_without(bits, jax_programs):
    """Quantized pools: the prefix's codes and scales read once, the output the unshared
    call's, the pools' codes and scales bit for bit."""
    traced, _ = jax_programs
    pos, table, drafted, groups = jax_cases()["two groups and a lane alone"]
    ix, arrays = jax_call(pos, table, drafted, seed=bits, bits=bits)
    shared = ix.attend(*arrays, tile=24)
    with runs.unshared():
        alone = ix.attend(*arrays, tile=24)
    assert traced == [groups, ()]
    assert_same_call(shared, alone, f"{bits} bits")


def test_a_jax_decode_loop_sharing_a_prefix_compiles_once(jax_programs, monkeypatch):
    """Six decode steps (``advance()``) of lanes whose groups stay the same: one program, the
    prefix read once in it, each step's output the unshared call's, and the groups found once
    (the plan carries them across ``advance()``)."""
    from cacheidx.attention import jax as path

    traced, prefixes = jax_programs
    found, real = [], path.sharing
    monkeypatch.setattr(path, "sharing", lambda *a, **k: found.append(1) or real(*a, **k))
    pos, table, _, groups = jax_cases()["two groups and a lane alone"]
    ix, arrays = jax_call(pos, table, False, seed=3)
    q, k, v, kpool, vpool = arrays
    for step in range(6):
        with runs.unshared():
            alone = ix.attend(q, k, v, kpool, vpool)
        out = ix.attend(q, k, v, kpool, vpool)
        assert_same_call(out, alone, f"step {step}")
        kpool, vpool = out[1:]
        ix = ix.advance()
    assert traced == [(), groups], f"programs traced: {traced}"
    assert prefixes == list(groups)
    assert len(found) == 1, f"the groups were found {len(found)} times in 6 steps"


def test_the_jax_engine_gives_the_same_tokens_with_shared_reads(jax_programs):
    """The eager JAX engine over requests under one prompt (the prefix cache shares its pages)
    and samples of one prompt: the same tokens with shared reads and without, and some program
    read a prefix once."""
    traced, prefixes = jax_programs
    # few and short: eager JAX compiles each operation for each new shape
    reqs = [Request(k, p, 3) for k, p in enumerate(prompts(2))]
    reqs.append(Request("samples", SYSTEM + [7, 8, 9], 3, n=2))
    got = serve("jax", reqs)
    assert prefixes, "no program read a shared prefix once"
    made = len(traced)
    assert got == serve("jax", reqs, share=False)
    assert all(share == () for share in traced[made:]), "runs.unshared() still shared"


# -- a step jitted whole reads the hint's prefixes once ------------------------------------------
def hinted(ix, groups):
    """``ix.share(groups)``'s hint on the host: each lane's group and each group's width."""
    shared = ix.share(groups)
    return shared, np.asarray(shared.share_lanes).tolist(), np.asarray(shared.share_widths).tolist()


@pytest.mark.parametrize("what", list(jax_cases()))
def test_a_jax_step_jitted_whole_reads_the_hints_prefixes_once(what):
    """``index.share()`` names each case's groups and their exact widths (no rounding: they are
    values); a call jitted whole with the index as its argument reads each group's prefix once
    (a note per group as it is traced) and attends as the eager unshared call, its pools bit
    for bit; without a hint the same program reads none once."""
    import jax

    from cacheidx.attention import shared as sharing

    pos, table, drafted, groups = jax_cases()[what]
    ix, arrays = jax_call(pos, table, drafted, seed=len(what) + 7)
    want_lanes = [-1] * ix.batch
    for g, (lanes, _) in enumerate(groups):
        for b in lanes:
            want_lanes[b] = g
    hint, lanes, widths = hinted(ix, len(groups))
    exact = {"a scattered prefix": [288], "a prefix rounded down": [144]}
    assert lanes == want_lanes and widths == exact.get(what, [w for _, w in groups]), (
        f"{what}: hint {lanes}, {widths}")
    with runs.unshared():
        alone = ix.attend(*arrays)
    step = jax.jit(lambda ix, *a: ix.attend(*a))
    with sharing.counted() as reads:
        got = step(hint, *arrays)
    assert reads == [((), g) for g in range(len(groups))], f"{what}: read once {reads}"
    assert_same_call(got, alone, what)
    with sharing.counted() as reads:
        assert_same_call(step(ix, *arrays), alone, f"{what}, no hint")
    assert reads == []


def test_any_hint_attends_as_without_and_holds_only_the_lanes_that_keep_it():
    """Hints drawn at random (each lane's group -1 or one of two, widths 0 to past the table)
    over the two groups' case: the program jitted once attends as the eager unshared call
    for every one; :func:`~cacheidx.attention.shared.held` (here on NumPy, eagerly) holds a
    lane to a group exactly where its table and mask keep the group's first member's slots
    up to the width, against a slow loop; the index's own hint is what held keeps whole."""
    import jax
    import jax.numpy as jnp

    import cacheidx as ci
    from cacheidx.attention import shared as sharing

    pos, table, _, groups = jax_cases()["two groups and a lane alone"]
    ix, arrays = jax_call(pos, table, False, seed=11)
    with runs.unshared():
        alone = ix.attend(*arrays)
    step = jax.jit(lambda ix, *a: ix.attend(*a)[0])
    hint = ix.share(2)
    rng = np.random.default_rng(5)
    t, p, n = np.asarray(table), np.asarray(pos), int(arrays[3].shape[0])
    width = t.shape[1]
    for draw in range(12):
        lanes = rng.integers(-1, 2, ix.batch)
        widths = rng.integers(0, width + 40, 2)
        given = ci.make(p, t)
        object.__setattr__(given, "share_lanes", lanes)
        object.__setattr__(given, "share_widths", widths)
        member, kept = (np.asarray(x) for x in sharing.held(given, n))
        for g in range(2):
            mine = np.flatnonzero(lanes == g)
            w = min(int(widths[g]), width)
            lead = mine[0] if mine.size else 0
            want = [bool(lanes[b] == g and np.all(t[b, :w] == t[lead, :w])
                         and np.all(p[b, 0] >= np.arange(w))) for b in range(ix.batch)]
            assert member[g].tolist() == want, f"draw {draw}, group {g}"
            assert kept[g] == (w if any(want) else 0)
        probe = dataclasses.replace(hint, share_lanes=jnp.asarray(lanes, dtype=jnp.int32),
                                    share_widths=jnp.asarray(widths, dtype=jnp.int32))
        np.testing.assert_allclose(np.asarray(step(probe, *arrays)), np.asarray(alone[0]),
                                   rtol=1e-5, atol=1e-5, err_msg=f"draw {draw}")
    member, kept = (np.asarray(x) for x in sharing.held(ci.make(p, t).share(2), n))
    assert [tuple(np.flatnonzero(m)) for m in member] == [g for g, _ in groups]
    assert kept.tolist() == [w for _, w in groups]


def test_a_jitted_decode_loop_keeps_its_hint_and_its_gradients():
    """A decode step jitted whole, its index advanced inside the program: one program for six
    steps, the hint kept by ``advance()`` (the table and groups unchanged), each step's output
    the eager unshared call's; ``jax.grad`` through the hinted program equals it through the
    program without a hint."""
    import jax
    import jax.numpy as jnp

    pos, table, _, _ = jax_cases()["one group"]
    ix, (q, k, v, kpool, vpool) = jax_call(pos, table, False, seed=2)
    traces = []

    def decode(ix, q, k, v, kpool, vpool):
        traces.append(1)
        out, kpool, vpool = ix.attend(q, k, v, kpool, vpool)
        return out, kpool, vpool, ix.advance()

    step = jax.jit(decode)
    hint = ix.share()
    for n in range(6):
        with runs.unshared():
            alone = ix.attend(q, k, v, kpool, vpool)
        out, kpool, vpool, hint = step(hint, q, k, v, kpool, vpool)
        assert_same_call((out, kpool, vpool), alone, f"step {n}")
        assert np.asarray(hint.share_widths).tolist() == [80]
        ix = ix.advance()
    assert len(traces) == 1, f"{len(traces)} programs for six steps"
    loss = jax.jit(lambda ix, q: jnp.sum(ix.attend(q, k, v, kpool, vpool)[0] ** 2))
    np.testing.assert_allclose(np.asarray(jax.grad(loss, argnums=1)(ix.share(), q)),
                               np.asarray(jax.grad(loss, argnums=1)(ix, q)), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_share_keeps_the_pytree_and_refuses_naming_itself(backend):
    """The hint is two leaves of the index's pytree (its walk names them, its structure counts
    its groups), kept by a flatten and unflatten of the backend's registry, by ``advance()``
    and the derived indices; ``share(0)`` drops it; a whole index, a traced one and a negative
    count are refused naming ``share``."""
    import cacheidx as ci
    from cacheidx import backends, pytree

    pytest.importorskip(backend)
    on = backends.get(backend)
    dtype = on.xp.int32 if backend == "jax" else None  # JAX without x64
    pos, table, _, _ = jax_cases()["one group"]
    ix = ci.make(placed(on, pos, dtype), placed(on, table, dtype))
    hint = ix.share(3)
    assert hint.structure.shared == 3 and ix.structure.shared == 0
    assert pytree.leaf_names(hint.structure)[-2:] == ["shared.lanes", "shared.widths"]
    again = pytree.rebuild(hint.structure, pytree.leaves(hint))
    for a, b in ((again.share_lanes, [0, 0, 0]), (again.share_widths, [80, 0, 0]),
                 (hint.advance().share_widths, [80, 0, 0]), (hint.window(40).share_lanes,
                                                             [0, 0, 0])):
        assert host(a).tolist() == b
    assert hint.share(0).structure.shared == 0
    for bad, match in ((lambda: ci.whole(2, 3, xp=backend).share(), "whole index"),
                       (lambda: ix.share(-1), "at least 0")):
        with pytest.raises(ValueError, match=r"cacheidx\.share: .*" + match):
            bad()
    with pytest.raises(TypeError, match=r"cacheidx\.share: groups"):
        ix.share(True)
    if backend == "jax":
        import jax

        with pytest.raises(ValueError, match=r"cacheidx\.share: a traced index"):
            jax.jit(lambda ix: ix.share().pos)(ix)


def test_the_compiled_jax_engine_reads_the_hints_prefix_once():
    """The JAX engine compiled (its decode step jitted whole) over samples of one prompt and
    requests under one system prompt: each decode program is traced with the hint and reads
    its group's prefix once (the hints name the shared prompt's pages), and the tokens are the
    same with shared reads off (the hints then name no prefix, so the same programs read
    none once)."""
    pytest.importorskip("jax")
    import cacheidx.attention as attention
    from cacheidx.attention import shared as sharing

    hints, real = [], attention.share

    def noted(index, groups=1):
        got = real(index, groups)
        hints.append(int(np.asarray(got.share_widths).max()))
        return got

    reqs = [Request(k, p, 4) for k, p in enumerate(prompts(3))]
    reqs.append(Request("samples", SYSTEM + [7, 8, 9], 4, n=2))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "share", noted)
        with sharing.counted() as reads:
            got = serve("jax", reqs, compile=True)
        assert reads and set(reads) == {((), 0)}, f"read once: {reads}"
        assert max(hints) >= len(SYSTEM), f"the hints' widths: {hints}"
        made = len(hints)
        assert got == serve("jax", reqs, compile=True, share=False)
        assert hints[made:] and not any(hints[made:]), f"unshared hints: {hints[made:]}"


# -- runs.sharing names what the runs read once --------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_sharing_names_what_the_runs_read_once_and_the_tiles_read_a_drafts_prefix_once(
        backend, shared_reads):
    """Three lanes under one 80-column prefix: as a chunk of two tokens a lane, runs.sharing
    names the group and the runs read its prefix once; as a draft of those tokens (whose own
    columns the tiles read) it names none, and the tiles read the prefix once; under a
    selection and on a whole or packed index nothing is read once. (runs.sharing raised
    NumPy's broadcast error on a draft.)"""
    import cacheidx as ci
    from cacheidx import backends
    from cacheidx.attention import shared

    on = backends.get(backend)
    pos, table, _, _ = jax_cases()["a draft"]  # JAX's program reads its prefix once
    n = max(max(row) for row in table) + 1

    arr = functools.partial(placed, on)

    chunk = ci.make(arr(pos), arr(table))
    slots = np.asarray(table)[np.arange(len(pos))[:, None], np.asarray(pos)]
    drafted = chunk.draft(arr(slots), arr(np.tril(np.ones((len(pos), 2, 2), bool))))
    selected = chunk.select(arr(np.zeros((len(pos), 2, 3), np.int64)))
    rng = np.random.default_rng(9)

    def attend(ix):
        draw = [rng.standard_normal(s).astype(np.float32) for s in (
            (ix.batch, ix.seq, HEADS, DIM), (ix.batch, ix.seq, KV, DIM),
            (ix.batch, ix.seq, KV, DIM), (n, KV, DIM), (n, KV, DIM))]
        with shared.counted() as reads:
            ix.attend(*(arr(a, on.xp.float32) for a in draw))
        return reads

    group = [((0, 1, 2), 80)]
    for what, ix, names, read in (("a chunk", chunk, group, group),
                                  ("a draft", drafted, [], group),
                                  ("a selection", selected, [], []),
                                  ("whole", ci.whole(3, 2, xp=backend), [], []),
                                  ("packed", ci.packed(2, [[1, 1], [2], [2]], xp=backend), [],
                                   [])):
        assert runs.sharing(ix, n, HEADS) == names, what
        before = len(shared_reads)
        assert attend(ix) == read, f"{what}: prefixes read once"
        assert len(shared_reads) - before == len(names), f"{what}: the runs' reads"


# -- the tiles read a shared prefix once -----------------------------------------------------------
def tiles_cases() -> dict:
    """``(pos, table, draft)`` the runs leave to the tiles, and the groups the tiles read once:
    a hole at column 70 (where the prefix ends), a draft, a prefix of 18 pages in reverse order
    with a hole in a lane's own columns past it, two groups and a lane alone past a hole of its
    own."""
    holed = [pages(0, 1, 2, 3, 4, 5 + b) for b in range(3)]
    for row in holed:
        row[70] = -1
    scattered = [pages(*range(17, -1, -1), 20 + b) for b in range(3)]
    scattered[2][289] = -1  # lane 2's own hole: the runs leave the call to the tiles
    two = [r[:] for r in jax_cases()["two groups and a lane alone"][1]]
    two[4][90] = -1  # the lane alone's hole: the runs leave the call to the tiles
    return {
        "a hole": ([[85], [86], [90]], holed, False, [((0, 1, 2), 70)]),
        "a draft": ([[88, 89], [88, 89], [90, 91]], jax_cases()["a draft"][1], True,
                    [((0, 1, 2), 80)]),
        "scattered pages and a hole": ([[290, 291], [290, 291], [294, 295]], scattered, False,
                                       [((0, 1, 2), 288)]),
        "two groups": ([[85], [86], [87], [88], [92]], two, False,
                       [((0, 1), 80), ((2, 3), 80)]),
    }


@pytest.mark.parametrize("capped", [False, True])
@pytest.mark.parametrize("what", list(tiles_cases()))
@pytest.mark.parametrize("backend", ["numpy", "strict", "torch"])
def test_the_tiles_read_a_shared_prefix_once_and_attend_as_without(backend, what, capped,
                                                                   monkeypatch):
    """Calls the runs decline (a hole, a draft, scattered pages): the standard's tiles read each
    group's prefix once (``shared.prefix`` called once a group, and never within
    ``runs.unshared()``), each lane's own tiles from its group's width on, and the output is
    the unshared call's, its pools bit for bit. ``capped``: a softcap and sinks, and
    ``tile=24`` (an 80-column prefix in three tiles and a rest of 8)."""
    import cacheidx as ci
    from cacheidx import backends
    from cacheidx.attention import shared

    on = backends.get(backend)
    read, real = [], shared.prefix
    monkeypatch.setattr(shared, "prefix", lambda call, q, lanes, width: read.append(
        (lanes, width)) or real(call, q, lanes, width))
    pos, table, drafted, groups = tiles_cases()[what]
    n = max(max(row) for row in table) + 1

    arr = functools.partial(placed, on)

    ix = ci.make(arr(pos), arr(table))
    if drafted:
        slots = np.asarray(table)[np.arange(len(pos))[:, None], np.asarray(pos)]
        ix = ix.draft(arr(slots), arr(np.tril(np.ones((len(pos), 2, 2), bool))))
    rng = np.random.default_rng(len(what))
    arrays = [arr(rng.standard_normal(s).astype(np.float32), on.xp.float32) for s in (
        (ix.batch, ix.seq, HEADS, DIM), (ix.batch, ix.seq, KV, DIM),
        (ix.batch, ix.seq, KV, DIM), (n, KV, DIM), (n, KV, DIM))]
    options = {} if not capped else {
        "tile": 24, "softcap": 2.5,
        "sinks": arr(np.array([0.5, -1.0, 2.0, 0.0], np.float32), on.xp.float32)}
    assert runs.sharing(ix, n, HEADS) == [], f"{what}: the runs read it"
    got = ix.attend(*arrays, **options)
    assert read == groups, f"{what}: the tiles read {read} once, want {groups}"
    with runs.unshared():
        alone = ix.attend(*arrays, **options)
    assert read == groups, "runs.unshared() still shared"

    np.testing.assert_allclose(host(got[0]), host(alone[0]), rtol=1e-5, atol=1e-5,
                               err_msg=f"{what}: the output")
    for a, b in zip(got[1:], alone[1:]):
        assert np.array_equal(host(a), host(b)), f"{what}: a pool"


def test_sharing_of_a_traced_index_raises_naming_the_function():
    """Inside a compiled step there are no values to find groups in: a ValueError naming
    runs.sharing, not an error from deep in the plan."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    import cacheidx as ci

    pos, table, _, _ = jax_cases()["one group"]
    with pytest.raises(ValueError, match=r"cacheidx\.attention\.runs\.sharing: the index is "
                                         r"traced"):
        jax.jit(lambda p, t: runs.sharing(ci.make(p, t), 16 * PAGE, HEADS) and p)(
            jnp.asarray(pos, dtype=jnp.int32), jnp.asarray(table, dtype=jnp.int32))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_the_tiles_read_a_quantized_prefix_once_as_without(backend, bits):
    """Quantized pools through the tiles (two groups past a hole): each group's codes and
    scales read once, the output the unshared call's, the pools' codes and scales bit for
    bit."""
    import cacheidx as ci
    from cacheidx import backends, quantized
    from cacheidx.attention import shared

    on = backends.get(backend)
    pos, table, _, groups = tiles_cases()["two groups"]
    n = max(max(row) for row in table) + 1
    rng = np.random.default_rng(bits)

    arr = functools.partial(placed, on)

    ix = ci.make(arr(pos, on.xp.int64), arr(table, on.xp.int64))
    q, k, v, kpool, vpool = (arr(rng.standard_normal(s).astype(np.float32), on.xp.float32)
                             for s in ((5, 1, HEADS, DIM), (5, 1, KV, DIM), (5, 1, KV, DIM),
                                       (n, KV, DIM), (n, KV, DIM)))
    kpool, vpool = (quantized.Quantized(*quantized.quantize(p, bits)) for p in (kpool, vpool))
    with shared.counted() as reads:
        got = ix.attend(q, k, v, kpool, vpool, tile=24)
    with runs.unshared(), shared.counted() as none:
        alone = ix.attend(q, k, v, kpool, vpool, tile=24)
    assert reads == groups and none == [], f"read once {reads}, unshared {none}"

    np.testing.assert_allclose(host(got[0]), host(alone[0]), rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], alone[1:]):
        for x, y in zip(quantized.parts(a), quantized.parts(b)):
            assert np.array_equal(host(x), host(y)), "a pool's codes or scales"


# -- torch's fused attention over a long run ---------------------------------------------------
@pytest.mark.parametrize("poisoned, dv", [(False, DIM), (True, DIM), (False, DIM - 2)])
def test_a_long_shared_run_is_torchs_fused_call_and_attends_as_numpy(poisoned, dv,
                                                                     monkeypatch):
    """Four lanes under a 640-column prefix over head-major torch pools, one decode token each:
    the runs read the prefix once, as one fused call of torch's CPU attention over the lanes'
    stacked rows (``HeadMajor.run``), and the output is NumPy's (the core's own products)
    within the law's tolerance. ``poisoned``: an infinite value in the prefix at kv head 1;
    the fused call declines its state (not finite), and that head's outputs are NaN in every
    lane, as the law (and NumPy) has them, the other head's NumPy's. Values of a narrower head
    than the keys': the fused call (one head size for all three) declines, the products
    read it."""
    import torch

    import cacheidx as ci
    from cacheidx import backends
    from cacheidx.attention import layout
    from cacheidx.attention import torch as path

    fused = []
    real = path.HeadMajor.run
    monkeypatch.setattr(path.HeadMajor, "run", lambda self, q, k, v: fused.append(
        real(self, q, k, v) is not None) or real(self, q, k, v))
    lanes, width = 4, 640
    table = [pages(*range(width // PAGE), 50 + b) for b in range(lanes)]
    pos = [[width + 3 + b] for b in range(lanes)]
    n = (50 + lanes) * PAGE
    rng = np.random.default_rng(12)
    q, k, v, kp, vp = (rng.standard_normal(s).astype(np.float32) for s in (
        (lanes, 1, HEADS, DIM), (lanes, 1, KV, DIM), (lanes, 1, KV, dv), (n, KV, DIM),
        (n, KV, dv)))
    if poisoned:
        vp[37, 1, 2] = np.inf
    want = ci.make(np.array(pos), np.array(table)).attend(q, k, v, kp, vp)[0]

    def pool(a):
        got = layout.zeros(backends.get("torch").xp, n, KV, a.shape[-1], dtype=torch.float32,
                           layout="head")
        got[...] = torch.from_numpy(a)
        return got

    ix = ci.make(torch.tensor(pos), torch.tensor(table))
    with torch.inference_mode():
        got = ix.attend(*map(torch.from_numpy, (q, k, v)), pool(kp), pool(vp))[0].numpy()
    assert fused == [not poisoned and dv == DIM], f"the fused call's results: {fused}"
    if poisoned:  # kv head 1's query heads are 2 and 3
        assert np.isnan(got[:, :, 2:]).all() and np.isnan(want[:, :, 2:]).all()
    np.testing.assert_allclose(got[:, :, :2], want[:, :, :2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("backend", ["numpy", "strict", "torch"])
def test_the_runs_read_a_scattered_prefix_once_as_gathered_tiles(backend, bits, shared_reads,
                                                                 monkeypatch):
    """A prefix of 18 pages in reverse order (too scattered for views): the runs read it once
    for its three lanes as gathered tiles (of at most ``SCATTERED`` columns: 100 here, so three
    tiles), each gathered through the backend's read plan, and the output is the unshared
    call's, its pools (float, or ``bits`` codes and scales) bit for bit."""
    import cacheidx as ci
    from cacheidx import backends, quantized
    from cacheidx.attention import runplan

    on = backends.get(backend)
    monkeypatch.setattr(runplan, "SCATTERED", 100)
    table = [pages(*range(17, -1, -1), 20 + b) for b in range(3)]
    pos = [[290], [291], [295]]
    n = max(max(row) for row in table) + 1

    arr = functools.partial(placed, on)

    ix = ci.make(arr(pos), arr(table))
    groups = runplan.prefixes(np.asarray(table), np.ones((3, len(table[0])), bool),
                              np.asarray(ci.make(np.asarray(pos), np.asarray(table)).mask()),
                              n, 1, HEADS, 1 << 22, None)
    assert [(g.lanes, g.width) for g in groups] == [((0, 1, 2), 288)]
    assert [type(p).__name__ for p in groups[0].pieces] == ["Gathered"] * 3
    assert [p.width for p in groups[0].pieces] == [100, 100, 88]
    assert runs.sharing(ix, n, HEADS) == [((0, 1, 2), 288)]
    rng = np.random.default_rng(3)
    arrays = [arr(rng.standard_normal(s).astype(np.float32), on.xp.float32) for s in (
        (3, 1, HEADS, DIM), (3, 1, KV, DIM), (3, 1, KV, DIM), (n, KV, DIM), (n, KV, DIM))]
    if bits is not None:
        arrays[3:] = [quantized.Quantized(*quantized.quantize(p, bits)) for p in arrays[3:]]
    got = ix.attend(*arrays)
    assert len(shared_reads) == 1, "the runs did not read the prefix once"
    with runs.unshared():
        alone = ix.attend(*arrays)

    np.testing.assert_allclose(host(got[0]), host(alone[0]), rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], alone[1:]):
        for x, y in zip(quantized.parts(a), quantized.parts(b)):
            assert np.array_equal(host(x), host(y)), "a pool's parts"
