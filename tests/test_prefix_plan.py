"""The prefix planner's laws (cacheidx/prefix/plan.py), by hand, then against a slow
pure-Python planner, then against every processing order of small prompt sets."""

from __future__ import annotations

import importlib
import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_cases import SPEC, page_sizes, prompt_sets, tokens

from cacheidx import prefix
from cacheidx.prefix.report import minimum

# The module, not the function `prefix.plan` that shadows it as an attribute.
plan_module = importlib.import_module("cacheidx.prefix.plan")


# -- a slow planner written from the spec, with sorted() and loops --------------------------


def common(s, t) -> int:
    k = 0
    while k < min(len(s), len(t)) and s[k] == t[k]:
        k += 1
    return k


def slow_plan(prompts, P, dedupe=False):
    prompts = [list(p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    shared = []
    for k, i in enumerate(order):
        t = prompts[i]
        s = prompts[order[k - 1]] if k else []
        shared.append(len(t) if dedupe and s == t else min(common(s, t), len(t) - 1) // P * P)
    parent = []
    for k in range(len(order)):
        j = k - 1
        while j >= 0 and shared[j] >= shared[k]:
            j -= 1
        parent.append(order[j] if j >= 0 else -1)
    return order, shared, parent


def order_cost(prompts, perm, P, dedupe=False) -> int:
    """Tokens computed processing ``prompts`` in ``perm``, each reusing the longest whole-page
    prefix, capped at its length - 1, of any prompt processed before it (with dedupe, a copy
    of one computes nothing)."""
    done, cost = [], 0
    for i in perm:
        t = list(prompts[i])
        if dedupe and t in done:
            continue
        best = max((common(s, t) for s in done), default=0)
        cost += len(t) - min(best, len(t) - 1) // P * P
        done.append(t)
    return cost


def same(plan, order, shared, parent):
    assert plan.order.tolist() == order
    assert plan.shared.tolist() == shared
    assert plan.parent.tolist() == parent


# -- by hand ---------------------------------------------------------------------------------


def test_the_spec_example():
    p = prefix.plan(SPEC, 2)
    same(p, [0, 3, 4, 1, 2], [0, 2, 2, 4, 0], [-1, 0, 0, 4, -1])
    for a in (p.order, p.shared, p.parent):
        assert a.dtype == np.int64 and a.shape == (5,)


def test_the_spec_example_tables_name_the_owners_pages():
    # Prompt 0 owns pages 0 1; 3 borrows 0, owns 2; 4 borrows 0, owns 3; 1 borrows 0 and 3
    # (from 4), owns 4; 2 owns 5 6.
    p = prefix.plan(SPEC, 2)
    assert p.tables().tolist() == [[0, 1, -1], [0, 2, -1], [0, 3, -1], [0, 3, 4], [5, 6, -1]]
    assert p.borrowed.tolist() == [0, 1, 1, 2, 0]
    assert p.owned.tolist() == [2, 1, 1, 1, 2]
    assert p.pages == 7
    assert p.computed.tolist() == [4, 2, 2, 2, 3]


def test_dedupe_lets_the_copy_compute_nothing():
    p = prefix.plan(SPEC, 2, dedupe=True)
    same(p, [0, 3, 4, 1, 2], [0, 2, 4, 4, 0], [-1, 0, 3, 3, -1])
    assert p.computed.tolist() == [4, 2, 0, 2, 3]
    assert p.tables().tolist() == [[0, 1, -1], [0, 2, -1], [0, 2, -1], [0, 2, 3], [4, 5, -1]]


def test_dedupe_copy_borrows_the_partial_last_page():
    p = prefix.plan([[1, 2, 3], [1, 2, 3]], 2, dedupe=True)
    same(p, [0, 1], [0, 3], [-1, 0])
    assert p.tables().tolist() == [[0, 1], [0, 1]]
    assert p.owned.tolist() == [2, 0]


def test_the_cap_makes_a_copy_recompute_its_last_page():
    same(prefix.plan([[5, 6, 7, 8], [5, 6, 7, 8]], 2), [0, 1], [0, 2], [-1, 0])


def test_one_token_prompts_share_nothing():
    same(prefix.plan([[3], [3], [1]], 1), [2, 0, 1], [0, 0, 0], [-1, -1, -1])


def test_a_prefix_comes_before_its_extensions():
    same(prefix.plan([[1, 2, 3], [1, 2], [1]], 1), [2, 1, 0], [0, 1, 2], [-1, 2, 1])


def test_shared_rounds_down_to_whole_pages():
    same(prefix.plan([[1] * 7, [1] * 6 + [2]], 4), [0, 1], [0, 4], [-1, 0])


def test_parent_is_the_owner_of_the_last_borrowed_page():
    # 2 shares 4 tokens: pages 0 from 0 and 1 from 1, so its parent is 1.
    same(
        prefix.plan([[1, 1, 5], [1, 1, 2, 2, 3], [1, 1, 2, 2, 4]], 2),
        [1, 2, 0],
        [0, 4, 2],
        [-1, 1, 1],
    )
    p = prefix.plan([[1, 1, 5], [1, 1, 2, 2, 3], [1, 1, 2, 2, 4]], 2)
    assert p.tables().tolist() == [[0, 1, 2], [0, 1, 3], [0, 4, -1]]


def test_no_prompts_is_an_empty_plan():
    p = prefix.plan([], 4)
    assert len(p) == 0 and p.pages == 0 and p.tables().shape == (0, 0)


def test_a_padded_array_with_lengths_reads_only_the_lengths():
    padded = np.array(
        [
            [10, 20, 30, 40, -1, -1],
            [10, 20, 30, 50, 60, 70],
            [80, 90, 70, 0, 0, 0],
            [10, 20, 30, 50, 9, 9],
            [10, 20, 30, 50, -7, 0],
        ]
    )
    p = prefix.plan(padded, 2, lengths=[4, 6, 3, 4, 4])
    same(p, [0, 3, 4, 1, 2], [0, 2, 2, 4, 0], [-1, 0, 0, 4, -1])


def test_a_2d_array_without_lengths_is_rows_of_equal_length():
    same(prefix.plan(np.array([[2, 2], [1, 2]], dtype=np.uint8), 1), [1, 0], [0, 0], [-1, -1])


def test_large_tokens_sort_by_value():
    big = [[2**40], [2**63 - 1], [255], [256], [2**63 - 2, 1]]
    same(prefix.plan(big, 1), [2, 3, 0, 4, 1], [0] * 5, [-1] * 5)


def test_tables_pad_to_a_given_width():
    assert prefix.plan([[1, 2, 3]], 2).tables(4).tolist() == [[0, 1, -1, -1]]
    with pytest.raises(ValueError, match=r"cacheidx.prefix.plan.tables: width 1"):
        prefix.plan([[1, 2, 3]], 2).tables(1)


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompts", "page_size", "kwargs", "error", "message"),
    [
        ([[1]], 0, {}, ValueError, "page_size must be >= 1, got 0"),
        ([[1]], -3, {}, ValueError, "page_size must be >= 1, got -3"),
        ([[1]], 1.5, {}, TypeError, "page_size must be an integer, got 1.5"),
        ([[1]], True, {}, TypeError, "page_size must be an integer, got True"),
        ([[1], []], 1, {}, ValueError, "prompt 1 is empty"),
        ([[1], [2, -4]], 1, {}, ValueError, "prompt 1 has a negative token, -4"),
        ([[1], [2.0]], 1, {}, TypeError, "prompt 1 must hold integers, got dtype float64"),
        ([[1], ["a"]], 1, {}, TypeError, "prompt 1 must hold integers"),
        ([[True]], 1, {}, TypeError, "prompt 0 must hold integers, got dtype bool"),
        ([[1], 5], 1, {}, ValueError, "prompt 1 must be 1-D tokens, got shape ()"),
        ([[[1, 2]]], 1, {}, ValueError, "prompt 0 must be 1-D tokens, got shape (1, 2)"),
        ("abc", 1, {}, TypeError, "prompts must be a sequence of prompts"),
        (np.array([1, 2]), 1, {}, ValueError, "must be 2-D (one row each), got shape (2,)"),
        (np.zeros((2, 2)), 1, {}, TypeError, "prompts must hold integers, got dtype float64"),
        (np.zeros((2, 0), int), 1, {}, ValueError, "prompt 0 is empty"),
        (np.ones((2, 3), int), 1, {"lengths": [3, 0]}, ValueError, "prompt 1 is empty"),
        (np.ones((2, 3), int), 1, {"lengths": [4, 1]}, ValueError, "prompt 0 has length 4"),
        (np.ones((2, 3), int), 1, {"lengths": [1]}, ValueError, "lengths has shape (1,)"),
        (np.ones((2, 3), int), 1, {"lengths": [1.0, 2.0]}, TypeError, "lengths must hold int"),
        ([[1], [2]], 1, {"lengths": [1, 1]}, ValueError, "lengths= goes with a padded 2-D"),
    ],
)
def test_bad_input_is_named(prompts, page_size, kwargs, error, message):
    with pytest.raises(error, match="^cacheidx.prefix.plan: ") as e:
        prefix.plan(prompts, page_size, **kwargs)
    assert message in str(e.value)


def test_a_ragged_array_without_lengths_is_refused():
    ragged = np.empty(2, dtype=object)
    ragged[:] = [[1, 2], [3]]
    with pytest.raises(ValueError, match="cacheidx.prefix.plan: a ragged array"):
        prefix.plan(ragged, 1)


# -- against the slow planner -----------------------------------------------------------------


@given(prompt_sets, page_sizes, st.booleans())
@settings(max_examples=300, deadline=None)
def test_plan_equals_the_slow_planner(prompts, P, dedupe):
    same(prefix.plan(prompts, P, dedupe=dedupe), *slow_plan(prompts, P, dedupe))


@given(prompt_sets.filter(len), page_sizes)
@settings(max_examples=100, deadline=None)
def test_every_input_form_plans_alike(prompts, P):
    want = prefix.plan(prompts, P)
    lens = [len(t) for t in prompts]
    padded = np.full((len(prompts), max(lens)), -1, dtype=np.int16)
    for r, t in enumerate(prompts):
        padded[r, : len(t)] = t
    arrays = [np.asarray(t, dtype=np.uint8) for t in prompts]
    for got in (prefix.plan(arrays, P), prefix.plan(padded, P, lengths=np.array(lens))):
        same(got, want.order.tolist(), want.shared.tolist(), want.parent.tolist())


@given(st.lists(st.integers(0, 3), min_size=2, max_size=8), st.integers(1, 400), page_sizes)
@settings(max_examples=50, deadline=None)
def test_long_common_prefixes_are_measured_in_blocks(tail, head, P):
    # With a tiny cell budget every pair is compared 64 columns at a time.
    base = list(range(head))
    prompts = [base + tail, base + tail[:1], base + tail[::-1], base]
    old = plan_module._CELLS
    plan_module._CELLS = 1
    try:
        got = prefix.plan(prompts, P)
    finally:
        plan_module._CELLS = old
    same(got, *slow_plan(prompts, P))


@given(st.lists(st.integers(0, 5), max_size=60))
@settings(deadline=None)
def test_previous_smaller_is_the_nearest_smaller_to_the_left(values):
    want = []
    for i, v in enumerate(values):
        j = i - 1
        while j >= 0 and values[j] >= v:
            j -= 1
        want.append(j)
    got = plan_module._previous_smaller(np.array(values, dtype=np.int64))
    assert got.tolist() == want


@given(prompt_sets, page_sizes, st.booleans())
@settings(max_examples=200, deadline=None)
def test_every_page_a_prompt_reads_holds_its_tokens(prompts, P, dedupe):
    # Owners write their pages; every prompt's table must then read its own tokens back.
    p = prefix.plan(prompts, P, dedupe=dedupe)
    tables, content = p.tables(), {}
    for i, row in enumerate(tables):
        t = prompts[p.order[i]]
        for k in range(p.borrowed[i], p.npages[i]):
            assert row[k] not in content  # a page has one owner
            content[row[k]] = t[k * P : (k + 1) * P]
    assert sorted(content) == list(range(p.pages))
    for i, row in enumerate(tables):
        t = prompts[p.order[i]]
        assert [content[row[k]] for k in range(p.npages[i])] == [
            t[k * P : (k + 1) * P] for k in range(p.npages[i])
        ]
        if p.parent[i] >= 0:  # the parent owns the last borrowed page
            up = int(np.flatnonzero(p.order == p.parent[i])[0])
            last = row[p.borrowed[i] - 1]
            assert p.first_page[up] <= last < p.first_page[up] + p.owned[up]


# -- against every order ----------------------------------------------------------------------


@given(st.lists(tokens, min_size=1, max_size=6), page_sizes, st.booleans())
@settings(max_examples=150, deadline=None)
def test_no_order_computes_fewer_tokens_than_the_plan(prompts, P, dedupe):
    p = prefix.plan(prompts, P, dedupe=dedupe)
    planned = int(p.computed.sum())
    assert planned == order_cost(prompts, p.order.tolist(), P, dedupe)
    best = min(
        order_cost(prompts, perm, P, dedupe) for perm in itertools.permutations(range(len(prompts)))
    )
    assert planned <= best
    assert planned == best == minimum(p)


@given(prompt_sets, page_sizes, st.booleans())
@settings(max_examples=200, deadline=None)
def test_the_minimum_counts_the_page_rounded_trie(prompts, P, dedupe):
    # Each distinct whole-page prefix once, every partial last page, and the last page again
    # for every further copy of a prompt of whole pages (the cap) unless deduplicated.
    nodes = {tuple(t[: k * P]) for t in prompts for k in range(1, len(t) // P + 1)}
    kept = list({tuple(t) for t in prompts}) if dedupe else [tuple(t) for t in prompts]
    whole = [t for t in kept if len(t) % P == 0]
    want = P * (len(nodes) + len(whole) - len(set(whole))) + sum(len(t) % P for t in kept)
    assert minimum(prefix.plan(prompts, P, dedupe=dedupe)) == want


def test_planning_many_prompts_is_vectorised():
    # 20,000 prompts of 300 tokens: seconds would mean a loop per token somewhere.
    import time

    rng = np.random.default_rng(0)
    heads = rng.integers(0, 50_000, (40, 256))
    padded = np.concatenate(
        [heads[rng.integers(0, 40, 20_000)], rng.integers(0, 50_000, (20_000, 44))], axis=1
    )
    start = time.perf_counter()
    p = prefix.plan(padded, 16)
    assert time.perf_counter() - start < 5
    assert int(p.computed.sum()) == minimum(p)


# -- the report and the command line ----------------------------------------------------------


def test_the_spec_example_report():
    r = prefix.report(prefix.plan(SPEC, 2))
    assert (r.prompts, r.distinct, r.tokens, r.computed, r.minimum) == (5, 4, 21, 13, 13)
    assert (r.dedupe_saves, r.pages_alone, r.pages, r.peak_keep, r.peak_count) == (2, 11, 7, 3, 3)
    d = prefix.report(prefix.plan(SPEC, 2, dedupe=True))
    assert (d.computed, d.minimum, d.dedupe_saves, d.pages) == (11, 11, 2, 6)


def test_the_command_line_prints_the_report_and_the_tree(tmp_path, capsys):
    from cacheidx.prefix.__main__ import main

    path = tmp_path / "prompts.jsonl"
    lines = [SPEC[0], {"tokens": SPEC[1]}, SPEC[2], SPEC[3], {"prompt_ids": SPEC[4]}]
    path.write_text(
        "\n".join(json.dumps(x) for x in lines[:3])
        + "\n\n"
        + "\n".join(json.dumps(x) for x in lines[3:])
        + "\n"
    )
    assert main([str(path), "--page-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "| tokens, page-rounded minimum | 13 |" in out
    assert out.rstrip().endswith(
        "0 [10 20 30 40]  (root)\n"
        "├── 3 [10 20 30 50]  (shares 2 from 0)\n"
        "└── 4 [10 20 30 50]  (shares 2 from 0)\n"
        "    └── 1 [10 20 30 50 60 70]  (shares 4 from 4)\n"
        "2 [80 90 70]  (root)"
    )
    assert main([str(path), "--page-size", "0"]) == 2
    assert "cacheidx.prefix.plan: page_size must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ('[1, 2]\n{"tokens": [1, 2\n', ":2: not JSON (Expecting ',' delimiter at column 17)"),
    ("[1, 2]\n\n[[1, 2], [3]]\n", ":3: token 0 must be an integer from 0 to 2**63 - 1, got [1, 2]"),
    ("[1, 2.5]\n", ":1: token 1 must be an integer from 0 to 2**63 - 1, got 2.5"),
    ("[true, 2]\n", ":1: token 0 must be an integer from 0 to 2**63 - 1, got true"),
    ("[1, 9223372036854775808]\n", ":1: token 1 must be an integer"),
    ('{"input_ids": []}\n', ":1: the prompt is empty"),
    ('"abc"\n', ":1: expected a list of token ids"),
])
def test_the_command_line_names_the_file_and_line_of_a_bad_prompt(tmp_path, capsys, text,
                                                                   message):
    """Lines count from 1, as the file's own; the exit status is 2 and nothing is planned."""
    from cacheidx.prefix.__main__ import main

    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    assert main([str(path)]) == 2
    captured = capsys.readouterr()
    assert f"error: {path}{message}" in captured.err and captured.out == ""
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
