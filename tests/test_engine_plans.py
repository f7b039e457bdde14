"""The serving engine carries its decode step's plan across steps (issues 25.3 and 28.1):
:meth:`CacheIndex.advance(table=) <cacheidx.CacheIndex.advance>` carries the plan's parts
where the new table kept the old one's columns, and an eager decode call that follows the last
one over the same lanes is the last one's index advanced so (:mod:`cacheidx.serve.step`'s law
4), its tokens those of a fresh index."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from serving import alone

import cacheidx as ci
from cacheidx.conformance.pytest_plugin import backend_or_skip
from cacheidx.models import llama
from cacheidx.plan import Plan
from cacheidx.serve import Engine, LlamaModel, Request
from cacheidx.serve.step import Step, TableError

LIBS = ["numpy", "torch"]


#: the parts that say what a call reads: the core's runs, or the paged kernel's plan (a decode
#: step over CPU pools: cacheidx.attention.paged)
READS = ("runs", "paged")


def reads(made: dict) -> int:
    """The read parts made so far (either kind)."""
    return sum(made.get(kind, 0) for kind in READS)


def reads_in(plan) -> bool:
    return any(kind in repr(plan) for kind in READS)


@contextlib.contextmanager
def counting(monkeypatch):
    """Counts the parts made (``make`` called, not found in a plan) by kind."""
    made: dict[str, int] = {}
    part = Plan.part

    def spy(self, kind, key, make, keep=None):
        def counted():
            value = make()
            if kind != "paged" or value:  # the paged kernel's refusal reads nothing
                made[kind] = made.get(kind, 0) + 1
            return value

        return part(self, kind, key, counted, keep)

    with monkeypatch.context() as m:
        m.setattr(Plan, "part", spy)
        yield made


def arrays(lib, *xs):
    if lib == "numpy":
        return xs
    torch = pytest.importorskip("torch")
    return tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in xs)


def host(x):
    return np.asarray(x.cpu() if hasattr(x, "cpu") else x)


def qkv(lib, batch, seq, seed, kv=2, heads=4, d=8):
    rng = np.random.default_rng(seed)
    return arrays(lib, *(rng.standard_normal(s, dtype=np.float32) for s in
                         ((batch, seq, heads, d), (batch, seq, kv, d), (batch, seq, kv, d))))


def equal(a, b):
    return all(np.array_equal(host(x), host(y)) for x, y in zip(a, b, strict=True))


# -- the index: advance(table=) ------------------------------------------------------------------
#: three rows of eight columns; lanes read rows 0 and 2 (row 1 is another request's)
TABLE = np.array([np.arange(0, 8), np.arange(32, 40), np.arange(16, 24)], dtype=np.int64)
ROW = np.array([0, 2], dtype=np.int64)


def decoding(lib, table=TABLE):
    """A decode step past a prompt (lane 0 at position 7, the table's last column; lane 1 at
    3), attended once so that its plan holds its runs, and the pools after it."""
    backend_or_skip(lib)
    pos = np.array([[0, 1, 2, 3, 4, 5, 6], [-1, -1, -1, -1, 0, 1, 2]], dtype=np.int64)
    pos, table_, row = arrays(lib, pos, table, ROW)
    kpool, vpool = arrays(lib, *(np.zeros((64, 2, 8), np.float32) for _ in range(2)))
    prompt = ci.make(pos, table_, row=row)
    _, kpool, vpool = prompt.attend(*qkv(lib, 2, 7, 0), kpool, vpool)
    step = prompt.advance()
    _, kpool, vpool = step.attend(*qkv(lib, 2, 1, 1), kpool, vpool)
    assert reads_in(step.plan)
    return step, kpool, vpool


def widened(pages=1, page=4):
    """TABLE one page wider: each row's next slots follow its last (row 1's page another)."""
    more = np.stack([np.arange(8, 8 + page * pages), np.arange(60, 60 + page * pages),
                     np.arange(24, 24 + page * pages)])
    return np.concatenate([TABLE, more], axis=1)


def same_as_fresh(lib, nxt, kpool, vpool, made):
    """``nxt``'s attend output, pools and extend's seen equal a fresh index's over its table;
    returns the runs ``nxt.attend`` made."""
    fresh = ci.make(*arrays(lib, host(nxt.pos), host(nxt.table)), row=arrays(lib, ROW)[0])
    q, k, v = qkv(lib, 2, 1, 2)
    copies = [arrays(lib, host(kpool), host(vpool)) for _ in range(2)]
    before = reads(made)
    got = nxt.attend(q, k, v, *copies[0])
    runs = reads(made) - before
    assert equal(got, fresh.attend(q, k, v, *copies[1]))
    assert equal(nxt.extend(k, kpool)[0], fresh.extend(k, kpool)[0])
    return runs


@pytest.mark.parametrize("lib", LIBS)
def test_a_wider_table_keeping_the_old_columns_carries_the_runs(lib, monkeypatch):
    """A page more (lane 0's next column in it, its slot the next one) and another request's
    row rewritten: the lanes' rows keep every old column, so the runs are carried, and attend
    and extend equal a fresh index's over the wider table."""
    step, kpool, vpool = decoding(lib)
    wide = widened()
    wide[1, :8] = 48 + np.arange(8)  # row 1 is no lane's: it may change
    with counting(monkeypatch) as made:
        nxt = step.advance(table=arrays(lib, wide)[0])
        assert host(nxt.pos).tolist() == [[8], [4]]
        assert int(nxt.table.shape[1]) == 12
        assert same_as_fresh(lib, nxt, kpool, vpool, made) == 0, made
        # and once more over the same table: carried again
        nnxt = nxt.advance(table=nxt.table)
        assert same_as_fresh(lib, nnxt, kpool, vpool, made) == 0, made


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("where", ["lane 0's column 2", "lane 1's column 0", "narrower"])
def test_a_table_changed_at_an_old_column_gets_a_plan_made_anew(lib, where, monkeypatch):
    """A lane's row changed at a column the old table had (a page remapped), or a table
    without the old columns: the runs are made anew, never carried, and the output is a
    fresh index's."""
    step, kpool, vpool = decoding(lib)
    table = widened()
    if where == "lane 0's column 2":
        table[0, 2] = 40
    elif where == "lane 1's column 0":
        table[2, 0] = 41
    else:
        table = table[:, :6].copy()
    with counting(monkeypatch) as made:
        nxt = step.advance(table=arrays(lib, table)[0])
        assert not reads_in(nxt.plan)
        assert same_as_fresh(lib, nxt, kpool, vpool, made) == 1, made


def test_without_a_row_map_every_row_is_a_lanes():
    """Without a row map lane ``b`` reads row ``b``: a table changed at an old column of any
    row gets a plan made anew; one only wider, the runs carried."""
    q, k, v = qkv("numpy", 2, 1, 1)
    kpool, vpool = (np.zeros((64, 2, 8), np.float32) for _ in range(2))
    step = ci.rows(32, [3, 5]).advance()
    _, kpool, vpool = step.attend(q, k, v, kpool, vpool)
    table = np.asarray(step.table)
    wider = np.concatenate([table, table[:, -4:] + 4], axis=1)
    changed = wider.copy()
    changed[1, 0] = 63
    assert reads_in(step.advance(table=wider).plan)
    assert not reads_in(step.advance(table=changed).plan)


@pytest.mark.parametrize("lib", LIBS)
def test_advance_over_a_bad_table_raises_naming_advance(lib):
    backend_or_skip(lib)
    step, _, _ = decoding(lib)
    other = "torch" if lib == "numpy" else "numpy"
    cases = [
        (TypeError, "int32", arrays(lib, TABLE.astype(np.int32))[0]),
        (TypeError, "hold integers", arrays(lib, TABLE.astype(np.float32))[0]),
        (ValueError, r"\[3, \?\], got \[8\]", arrays(lib, TABLE[0])[0]),
        (ValueError, r"\[3, \?\], got \[1, 3, 8\]", arrays(lib, TABLE[None])[0]),
        (ValueError, r"\[3, \?\], got \[2, 8\]", arrays(lib, TABLE[:2])[0]),
        (ValueError, "empty axis", arrays(lib, TABLE[:, :0])[0]),
        (TypeError, "index's library", arrays(other, TABLE)[0] if other == "numpy"
         else TABLE.tolist()),
    ]
    for error, match, table in cases:
        with pytest.raises(error, match=rf"cacheidx\.advance: .*{match}"):
            step.advance(table=table)
    whole = ci.whole(2, 3)
    with pytest.raises(ValueError, match=r"cacheidx\.advance: a whole index has no table"):
        whole.advance(table=arrays(lib, TABLE)[0])
    pos, table, quarter = arrays(lib, np.zeros((3, 1), np.int64), TABLE, TABLE[:, :2])
    blocks = ci.make(pos, table, every=[(4, quarter)])
    with pytest.raises(ValueError, match=r"cacheidx\.advance: .*tables of blocks of \[4\]"):
        blocks.advance(table=blocks.table)
    with pytest.raises(ValueError, match=r"cacheidx\.advance: blocks come with the table"):
        blocks.advance(blocks=[quarter])
    with pytest.raises(ValueError, match=r"cacheidx\.advance: the table of blocks of 4 must "
                                         r"have shape \[3, \?\]"):
        blocks.advance(table=blocks.table, blocks=[arrays(lib, TABLE[:2, :2])[0]])


def test_advance_takes_the_tables_of_blocks_the_scheduler_wrote():
    """``advance(table=, blocks=)``: the next token's index over the new table and tables of
    blocks (the engine's snapshots), the positions one on."""
    pos, table = np.array([[3], [5]]), np.arange(16, dtype=np.int64).reshape(2, 8)
    blocks = np.array([[0, 1], [2, -1]])
    ix = ci.make(pos, table, every=[(4, blocks)])
    grown = np.array([[0, 1], [2, 3]])
    nxt = ix.advance(table=table.copy(), blocks=[grown])
    assert nxt.pos.tolist() == [[4], [6]] and nxt.blocks[0][0] == 4
    assert nxt.blocks[0][1] is grown and ix.blocks[0][1] is blocks


def test_a_lane_of_padding_advanced_reads_nothing():
    """A lane whose row is -1 stays padding after advance (its position 0): its output is a
    fresh index's, zero."""
    rng = np.random.default_rng(0)
    table, row = np.arange(16, dtype=np.int64).reshape(2, 8), np.array([0, -1])
    kpool, vpool = (rng.standard_normal((16, 2, 8), dtype=np.float32) for _ in range(2))
    step = ci.make(np.array([[2], [-1]]), table, row=row)
    _, kpool, vpool = step.attend(*qkv("numpy", 2, 1, 1), kpool, vpool)
    nxt = step.advance()
    q, k, v = qkv("numpy", 2, 1, 2)
    got = nxt.attend(q, k, v, kpool.copy(), vpool.copy())
    assert equal(got, ci.make(nxt.pos.copy(), table, row=row).attend(q, k, v, kpool, vpool))


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    config = llama.Config.tiny()
    params = llama.random_params(config, seed=3)
    return config, params, LlamaModel(config, params)


def requests(shared, n=4, new=24, seed=0):
    """``n`` requests, each ``new`` tokens: a 70-token prompt they share (its first page of 64
    read once, attention's shared prefix) and a few tokens of their own, or their own
    prompts."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 64, 70).tolist()
    return [Request(i, (system if shared else rng.integers(0, 64, 70).tolist())
                    + rng.integers(0, 64, 3 + i).tolist(), new) for i in range(n)]


def serve(monkeypatch, model, backend, shared, fresh, **options):
    """The engine's results and its decode calls: how many, how many start over (follow no
    decode call over the same lanes: a lane admitted or finished) and the runs they made; with
    ``fresh``, every call's index made anew (``ci.make``, as before the plan was carried)."""
    calls = {"decode": 0, "start over": 0, "runs": 0}
    last = [None]
    run = Step.run

    def counted(self, batch, table, version):
        if fresh:
            self._fed = None
        before = reads(made)
        out = run(self, batch, table, version)
        if batch.kind == "decode":
            calls["decode"] += 1
            calls["start over"] += not (batch.follows and last[0] == "decode")
            calls["runs"] += reads(made) - before
        last[0] = batch.kind
        return out

    with counting(monkeypatch) as made:
        monkeypatch.setattr(Step, "run", counted)
        engine = Engine(model, backend=backend, page_size=64, pages=32, lanes=4,
                        clock="steps", keep_logits=True, debug=True, **options)
        results = sorted(engine.run(requests(shared)), key=lambda r: r.id)
        monkeypatch.setattr(Step, "run", run)
    return results, calls


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("shared", [False, True], ids=["own prompts", "a shared prompt"])
def test_the_eager_engine_carries_its_plan_and_gives_the_same_tokens(tiny, lib, shared,
                                                                      monkeypatch):
    """Decoding 24 tokens for 4 requests: the tokens and last logits of every request equal
    those of an engine whose every call's index is made anew, and each request's alone; the
    carried engine makes the runs once per run of decode calls over the same lanes (once
    per admission or finish: here three), the other once per call."""
    config, params, model = tiny
    backend_or_skip(lib)
    got, carried = serve(monkeypatch, model, lib, shared, fresh=False)
    want, anew = serve(monkeypatch, model, lib, shared, fresh=True)
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens, g.id
        np.testing.assert_allclose(g.last_logits, w.last_logits, atol=1e-5, rtol=0)
    for r in got[:2]:
        tokens, logits = alone(config, params, r.prompt_ids, len(r.tokens))
        assert r.tokens == tokens
        np.testing.assert_allclose(r.last_logits, logits, atol=1e-4, rtol=0)
    assert anew["decode"] == carried["decode"] >= 23
    assert anew["runs"] == anew["decode"]
    assert carried["runs"] == carried["start over"] <= 3, carried


def test_groups_of_layers_carry_the_full_groups_plan(monkeypatch):
    """Law 6: one index per group, each advanced over its own table; a model of a full layer
    and a sliding one gives the same tokens as one whose indices are made anew, and its full
    group's runs are carried (the sliding layer's ``window(w)`` is a new index each call, its
    runs made anew)."""
    config = llama.Config.tiny(windows=(None, 8))
    model = LlamaModel(config, llama.random_params(config, seed=3))
    got, carried = serve(monkeypatch, model, "numpy", False, fresh=False)
    want, anew = serve(monkeypatch, model, "numpy", False, fresh=True)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert anew["runs"] == 2 * anew["decode"]
    assert carried["runs"] == anew["decode"] + carried["start over"], carried


def test_with_debug_an_advanced_index_off_the_schedulers_positions_is_the_engines_bug(tiny):
    """Law 4 with ``debug``: the engine checks the advanced index's positions against the
    scheduler's; an index a token ahead is a :class:`TableError`."""
    _, _, model = tiny
    engine = Engine(model, page_size=64, pages=32, lanes=2, clock="steps", debug=True)
    for r in requests(False, n=2, new=8):
        engine.submit(r)
    while engine.executor._fed is None:  # past the prefill, into decoding
        engine.step()
    fed = engine.executor._fed
    fed.indices = tuple(ix.advance() for ix in fed.indices)
    with pytest.raises(TableError, match="advanced index has positions"):
        engine.step()


# -- a step carries its plan: remade only where the batch changed (issue 36.2) -----------------
def staggered(P=16):
    """Three requests arriving over time: the later ones join while the first decodes, the
    second's prompt computed chunk by chunk over several steps (a prefill call between two
    decode calls), and each lane reaching pages of ``P`` on steps of its own."""
    rng = np.random.default_rng(5)
    return [Request(0, rng.integers(0, 64, 20).tolist(), 40),
            Request(1, rng.integers(0, 64, 70).tolist(), 20, arrival=3),
            Request(2, rng.integers(0, 64, 30).tolist(), 12, arrival=12)]


def parts_per_decode(monkeypatch, model, backend, fresh, P=16):
    """The engine's results and, for each decode call, ``(steady, after a prefill, parts)``:
    whether no lane joined, left or reached a page of ``P`` (its batch follows the last decode
    call's, and no lane's position is a page's first), whether a prefill call came between it
    and the last decode call, and the plan's parts it made (of every kind but ``store``: a
    step's own slots, made every step by nature); ``fresh``: every index made anew."""
    calls, last, made = [], [None], []
    run, part = Step.run, Plan.part

    def counted(self, batch, table, version):
        if fresh:
            self._fed = None
        before = len(made)
        out = run(self, batch, table, version)
        if batch.kind == "decode":
            steady = batch.follows and not np.any(batch.pos % P == 0)
            calls.append((steady, last[0] == "prefill", made[before:]))
        last[0] = batch.kind
        return out

    def spy(self, kind, key, make, keep=None):
        def counted_part():
            value = make()
            if kind != "store":
                made.append(kind)
            return value

        return part(self, kind, key, counted_part, keep)

    monkeypatch.setattr(Step, "run", counted)
    monkeypatch.setattr(Plan, "part", spy)
    engine = Engine(model, backend=backend, page_size=P, pages=32, lanes=4, chunk=16,
                    clock="steps", keep_logits=True, debug=True)
    results = sorted(engine.run(staggered(P)), key=lambda r: r.id)
    monkeypatch.setattr(Step, "run", run)
    monkeypatch.setattr(Plan, "part", part)
    return results, calls


@pytest.mark.parametrize("lib,kernel", [("numpy", True), ("numpy", False), ("torch", True)],
                         ids=["numpy", "numpy, the core's runs", "torch"])
def test_a_decode_step_where_no_lane_joined_left_or_reached_a_page_makes_no_plan(
        tiny, lib, kernel, monkeypatch):
    """Law 4 of :mod:`cacheidx.serve.step`: a decode call whose lanes are the last decode
    call's, none at a page's first position, carries its plan whole: it makes no part of it
    (the paged kernel's plan, the core's runs, the shared groups), also when a prefill call of
    a joining lane came between the two; and the tokens and logits are those of an engine
    whose every index is made anew, which makes its read part on every call. (Before the
    engine carried its plan across a prefill call, each decode call after one made it anew.)"""
    from cacheidx.attention import native

    _, _, model = tiny
    backend_or_skip(lib)
    with contextlib.nullcontext() if kernel else native.off():
        got, calls = parts_per_decode(monkeypatch, model, lib, fresh=False)
        want, anew = parts_per_decode(monkeypatch, model, lib, fresh=True)
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens, g.id
        np.testing.assert_allclose(g.last_logits, w.last_logits, atol=1e-5, rtol=0)
    steady = [parts for quiet, _, parts in calls if quiet]
    after_prefill = [parts for quiet, between, parts in calls if quiet and between]
    assert len(steady) >= 30 and len(after_prefill) >= 3, calls
    assert steady == [[]] * len(steady), calls
    assert all(parts for quiet, _, parts in anew if quiet), anew


@pytest.mark.parametrize("lib", LIBS)
def test_a_table_written_behind_the_librarys_back_before_advance_is_seen_by_the_next_call(
        lib, monkeypatch):
    """``advance()`` takes the values the host knows as they are (it compares no tensor: a
    step costs no pass over its table); a table in host memory written in place behind the
    library's back after the last call is seen by the next index's first call, which compares
    its tensors with them: its read part made anew, its output a fresh index's."""
    step, kpool, vpool = decoding(lib, TABLE.copy())
    step.table[0, 2] = 40  # lane 0's column 2, in place (NumPy's array, torch's CPU tensor)
    with counting(monkeypatch) as made:
        nxt = step.advance()
        assert same_as_fresh(lib, nxt, kpool, vpool, made) == 1, made
