"""Random arguments into every entry point a user calls directly: the constructors (``make``,
``rows``) and the derived indices (``window``, ``select``, ``draft``), the online prefix cache
(``PrefixCache``) and the planner's command (``python -m cacheidx.prefix``). Each call ends,
within a time bound, in a clear error (a ``ValueError`` or ``TypeError`` that names the
function) or in a correct answer; an operation that raised changed nothing. (The engine and
its command: ``test_serve_failures.py``.)"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile

import numpy as np
import pytest
from deadline import memory, within
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import cacheidx as ci
from cacheidx.prefix import PageError, PrefixCache

DTYPES = [np.int64, np.int32, np.int8, np.uint8, np.uint64, np.float32, np.bool_]


def arrays(max_dims=3):
    """Small arrays of any dtype and shape, empty axes included, values around the ones an
    index holds (-1, slots, positions) and a few far from them."""
    return st.sampled_from(DTYPES).flatmap(lambda dtype: hnp.arrays(
        dtype, hnp.array_shapes(min_dims=0, max_dims=max_dims, min_side=0, max_side=3),
        elements=_elements(dtype)))


def _elements(dtype):
    kind = np.dtype(dtype).kind
    if kind == "b":
        return st.booleans()
    if kind == "f":
        return st.floats(-2, 9, width=32)
    info = np.iinfo(dtype)
    return st.integers(max(info.min, -2), 9) | st.sampled_from([info.max, max(info.min, -2**62)])


junk = st.one_of(st.integers(-3, 9), st.sampled_from([2**70, -2**70]), st.booleans(),
                 st.floats(allow_nan=True), st.text(max_size=3), st.none(),
                 st.lists(st.integers(-2, 9), max_size=3),
                 st.lists(st.lists(st.integers(-2, 9), max_size=2), max_size=2))
anything = junk | arrays()


def mostly(good, bad, one_in: int = 4):
    """``good``, but one draw in ``one_in`` ``bad`` (``one_of`` would merge equal branches)."""
    return st.integers(1, one_in).flatmap(lambda k: bad if k == 1 else good)


def clearly(fn: str, call):
    """``call()``'s value, or ``None`` after a ``ValueError``/``TypeError`` naming ``fn``; any
    other exception, a message that names no function, or a hang fails."""
    try:
        with within(10):
            return call()
    except (ValueError, TypeError) as e:
        assert str(e).startswith(f"cacheidx.{fn}: "), f"{type(e).__name__}: {e}"
        event(f"{fn}: {type(e).__name__}")
        return None


def reads(index: ci.CacheIndex) -> None:
    """A built index answers: its mask, positions and extend have the shapes the laws say,
    and ``check`` passes or names a broken obligation."""
    event(f"built: {index.kind}")
    batch, seq = index.batch, index.seq
    assert tuple(index.positions().shape) == (batch, seq)
    mask = index.mask()
    assert mask.shape[:2] == (batch, seq) and mask.dtype == np.bool_
    values = np.ones((batch, seq, 2), np.float32)
    pool = np.full((16, 2), 7.0, np.float32)
    seen, after = index.extend(values, pool)
    assert seen.shape[0] == batch and after.shape == pool.shape
    assert np.array_equal(pool, np.full((16, 2), 7.0, np.float32)), "extend changed the pool"
    assert set(np.unique(after)) <= {1.0, 7.0}, "extend stored something no token holds"
    clearly("check", lambda: ci.check(index))


# -- the constructors and the derived indices ------------------------------------------------------
def spoiled(draw, args: dict) -> dict:
    """``args`` (good ones), or with one replaced by any value: half the examples each."""
    which = draw(st.sampled_from([None] * len(args) + sorted(args)))
    if which is not None:
        args = dict(args, **{which: draw(anything)})
    event("spoiled" if which is not None else "good arguments")
    return args


@st.composite
def make_args(draw):
    batch, seq, rows, width = (draw(st.integers(1, 3)) for _ in range(4))
    ints = st.integers(-1, 9)
    pos = draw(hnp.arrays(np.int64, (batch, seq), elements=ints))
    mapped = draw(st.booleans())
    table = draw(hnp.arrays(np.int64, (rows if mapped else batch, width), elements=ints))
    row = draw(hnp.arrays(np.int64, (batch,), elements=st.integers(-1, rows))) if mapped \
        else None
    every = [(2, draw(hnp.arrays(np.int64, (len(table), -(-width // 2)), elements=ints)))] \
        if draw(st.booleans()) else None
    return spoiled(draw, {"pos": pos, "table": table, "row": row, "every": every})


@settings(max_examples=200)
@given(args=make_args())
def test_make_ends_in_a_clear_error_or_an_index_that_reads(args):
    index = clearly("make", lambda: ci.make(args["pos"], args["table"], row=args["row"],
                                            every=args["every"]))
    if index is not None:
        reads(index)


@st.composite
def rows_args(draw):
    return spoiled(draw, {"context": draw(st.integers(1, 8)),
                          "lens": draw(st.lists(st.integers(0, 8), min_size=1, max_size=3)),
                          "every": draw(st.lists(st.integers(2, 4), max_size=2))})


@settings(max_examples=150)
@given(args=rows_args())
def test_rows_ends_in_a_clear_error_or_an_index_that_reads(args):
    """A context whose table would pass memory (``2**31 - 1``: 16 GiB a lane) is refused by
    name: under a bound of 1 GiB more, as the host's memory would be were the system not
    overcommitting (which lets the table fill memory until the process is killed)."""
    context, lens = args["context"], args["lens"]
    with memory(1 << 30):
        index = clearly("rows", lambda: ci.rows(context, lens, every=args["every"]))
    if index is not None:
        assert index.context == context and list(index.table.shape) == [len(lens), context]
        reads(index)


def test_rows_refuses_a_context_whose_table_passes_memory():
    with memory(1 << 30), pytest.raises(ValueError, match=r"^cacheidx\.rows: 2 lanes of a "
                                        r"context of 2147483647 need a table of 34359738352"):
        ci.rows(2**31 - 1, [1, 2])
    assert ci.rows(2**10, [1, 2]).table.shape == (2, 2**10)  # the bound is gone after


bases = st.sampled_from([
    lambda: ci.rows(6, [2, 3], every=[2]),
    lambda: ci.make(np.asarray([[3, 4]]), np.asarray([[0, 1, 2, 3, -1, -1]])),
    lambda: ci.whole(2, 3),
    lambda: ci.packed(4, [[2, 2]]),
    lambda: ci.rows(6, [2, 3], every=[2]).every(2),
])


@settings(max_examples=200)
@given(base=bases, op=st.sampled_from(["window", "select", "draft"]), a=anything, b=anything,
       shaped=st.booleans(), values=st.lists(st.integers(-2, 11), min_size=1, max_size=8))
def test_window_select_and_draft_end_in_a_clear_error_or_an_index_that_reads(base, op, a, b,
                                                                             shaped, values):
    """Random arguments; half the time, for select and draft, arrays of the right shapes
    holding random columns, slots and sees."""
    index = base()
    batch, seq = index.batch, index.seq
    if shaped and op == "select":
        a = np.resize(np.asarray(values, np.int64), (batch, seq, 2))
    if shaped and op == "draft":
        a = np.resize(np.asarray(values, np.int64), (batch, seq))
        b = np.resize(np.asarray(values) % 2 == 0, (batch, seq, seq))
    derived = clearly(op, lambda: index.draft(a, b) if op == "draft" else getattr(index, op)(a))
    if derived is not None:
        assert derived is not index and index.structure == base().structure, "never changed"
        reads(derived)


# -- the online prefix cache --------------------------------------------------------------------
good_tokens = st.lists(st.integers(0, 2), min_size=1, max_size=9)
tokens = mostly(good_tokens | good_tokens.map(np.asarray),
               arrays(max_dims=2) | junk
               | st.lists(st.sampled_from([1.5, True, 2**64, -2**70, "a", None, [1]]),
                          min_size=1, max_size=3).map(lambda bad: [1, 2] + bad))
totals = mostly(st.none() | st.integers(0, 12), junk)
ops = st.lists(st.tuples(st.sampled_from(["admit", "admit", "match", "insert", "release"]),
                         tokens, totals, st.integers(0, 9)), min_size=1, max_size=12)


@settings(max_examples=150)
@given(pages=mostly(st.integers(0, 12), junk | st.just(2**40)),
       page_size=mostly(st.integers(1, 4), junk), ops=ops)
def test_prefix_cache_operations_end_in_a_clear_error_or_keep_every_law(pages, page_size, ops):
    """Random sizes (any value; 2**40 pages cost nothing), then random operations with random
    tokens and totals, on holds live and released: each ends in a clear error that changes
    nothing (``PageError`` for a hold that is gone or a pool too small) or an answer, and
    the cache's laws hold after each."""
    cache = clearly("prefix.PrefixCache", lambda: PrefixCache(pages, page_size))
    if cache is None:
        return
    holds, gone = [], []
    for op, data, total, which in ops:
        before = (cache.free, cache.cached, cache.evictable)
        try:
            with within(10):
                if op == "admit":
                    hold = cache.admit(data, total)
                    if hold is not None:
                        holds.append(hold)
                elif op == "match":
                    m = cache.match(data)
                    assert m.tokens % cache.page_size == 0 and len(m.pages) * cache.page_size \
                        == m.tokens < max(1, len(np.asarray(data).reshape(-1)))
                elif holds or gone:
                    hold = (holds + gone)[which % len(holds + gone)]
                    if op == "insert":
                        cache.insert(hold, data)
                    else:
                        cache.release(hold)
                        holds.remove(hold)
                        gone.append(hold)
            event(f"{op}: done")
        except (ValueError, TypeError, PageError) as e:
            assert str(e).startswith("cacheidx.prefix.PrefixCache."), f"{type(e).__name__}: {e}"
            assert (cache.free, cache.cached, cache.evictable) == before, "an error changed it"
            event(f"{op}: {type(e).__name__}")
        cache.check()
    for hold in holds:
        cache.release(hold)
    cache.check()
    assert cache.free + cache.cached == cache.capacity and cache.evictable == cache.cached


# -- the planner's command ------------------------------------------------------------------------
prompt = st.lists(st.integers(0, 20), min_size=1, max_size=6).map(json.dumps)
line = mostly(prompt, st.one_of(
    st.dictionaries(st.sampled_from(["tokens", "prompt_ids", "input_ids", "other"]),
                    junk, min_size=1, max_size=2).map(lambda d: json.dumps(d, default=str)),
    junk.map(lambda x: json.dumps(x)),
    st.text(max_size=8),
    st.sampled_from(['{"tokens": [1, 2', "[1, 2.5]", "[true]", "[[1, 2], [3]]",
                     "[9223372036854775808]", "\udcff"]),
), one_in=6)


@settings(max_examples=100)
@given(lines=st.lists(line, min_size=0, max_size=5), page_size=st.integers(-1, 4),
       as_json=st.booleans())
def test_the_planner_command_plans_or_exits_2_naming_the_line(lines, page_size, as_json):
    """Random files through ``main(argv)`` in process: a file of prompts is planned (status 0,
    the report's prompt count is the file's); anything else exits 2 with one line of error
    naming the file and line (or the page size), within a time bound."""
    from cacheidx.prefix.__main__ import main

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "prompts.jsonl")
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write("\n".join(lines) + "\n")
        out, err = io.StringIO(), io.StringIO()
        argv = [path, "--page-size", str(page_size)] + (["--json"] if as_json else [])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), within(20):
            status = main(argv)
    prompts = [json.loads(x) for x in lines if x.strip() and _prompt(x)]
    if status == 0:
        event("planned")
        assert page_size >= 1 and len(prompts) == sum(1 for x in lines if x.strip())
        if as_json:
            assert json.loads(out.getvalue())["prompts"] == len(prompts)
    else:
        event("exit 2")
        assert status == 2 and out.getvalue() == ""
        message = err.getvalue()
        assert message.startswith("error: ") and message.count("\n") == 1
        assert f"{path}:" in message or "page_size" in message, message


def _prompt(text: str) -> bool:
    """Whether a line is a prompt the planner takes (the docstring of read_prompts)."""
    try:
        item = json.loads(text)
    except ValueError:
        return False
    if isinstance(item, dict):
        item = next((item[k] for k in ("tokens", "prompt_ids", "input_ids") if k in item), None)
    return (isinstance(item, list) and bool(item)
            and all(type(t) is int and 0 <= t < 2**63 for t in item))


@pytest.mark.parametrize("prompt", [[1.9, 2.9, 3.9, 4.9, 5.9], np.asarray([1.9, 2.9, 3.9])])
def test_a_float_prompt_never_matches_the_prompt_it_truncates_to(prompt):
    """Issue 20, repro 6: two different prompts once shared keys and values."""
    cache = PrefixCache(8, 2)
    hold = cache.admit([1, 2, 3, 4, 5])
    cache.insert(hold, [1, 2, 3, 4, 5])
    cache.release(hold)
    with pytest.raises(TypeError, match="cacheidx.prefix.PrefixCache.match: token"):
        cache.match(prompt)
