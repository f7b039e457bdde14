"""The page allocator's laws (cacheidx/prefix/pages.py), and plans walked through it under
both strategies of the spec."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_cases import SPEC, page_sizes, prompt_sets

from cacheidx import prefix
from cacheidx.prefix import PageError, Pages


def state(pool: Pages):
    return pool.counts.tolist(), pool.live, pool.peak, pool._free.tolist(), pool._top


# -- the allocator, by hand -------------------------------------------------------------------


def test_alloc_retain_release_count_readers():
    pool = Pages(4)
    a = pool.alloc(2)
    assert sorted(a.tolist()) == [0, 1] and pool.live == 2
    pool.retain([a[0], a[0]])
    assert pool.counts[a[0]] == 3
    pool.release(a)  # a[1] reaches 0 and is freed, a[0] is still read twice
    assert pool.live == 1 and pool.counts[a[1]] == 0
    pool.release([a[0], a[0]])
    assert pool.live == 0 and pool.peak == 2


def test_a_freed_page_is_reused():
    pool = Pages(2)
    a = pool.alloc(2)
    pool.release(a[1:])
    assert pool.alloc(1).tolist() == a[1:].tolist()


def test_running_out_of_pages_raises_and_changes_nothing():
    pool = Pages(3)
    pool.alloc(2)
    before = state(pool)
    with pytest.raises(PageError, match=r"Pages.alloc: out of pages, 2 asked, 1 free of 3"):
        pool.alloc(2)
    assert state(pool) == before
    assert isinstance(PageError("x"), RuntimeError)


def test_a_double_release_raises_and_changes_nothing():
    pool = Pages(3)
    a = pool.alloc(2)
    pool.release(a[:1])
    before = state(pool)
    with pytest.raises(PageError, match=rf"Pages.release: page {a[0]} is free \(double release\)"):
        pool.release(a)
    assert state(pool) == before


def test_releasing_a_page_twice_in_one_call_raises_and_changes_nothing():
    pool = Pages(2)
    a = pool.alloc(2)
    before = state(pool)
    with pytest.raises(PageError, match=rf"page {a[1]} released 2 times, held 1"):
        pool.release([a[0], a[1], a[1]])
    assert state(pool) == before


@pytest.mark.parametrize("op", ["retain", "release"])
def test_free_and_foreign_pages_are_refused(op):
    pool = Pages(2)
    pool.alloc(1)
    before = state(pool)
    with pytest.raises(PageError, match=rf"Pages.{op}: page 1 is free"):
        getattr(pool, op)([1])
    with pytest.raises(PageError, match=rf"Pages.{op}: page 7 is not in a pool of 2"):
        getattr(pool, op)([7])
    assert state(pool) == before


def test_capacity_must_be_a_count():
    with pytest.raises(ValueError, match="capacity must be >= 0, got -1"):
        Pages(-1)
    with pytest.raises(TypeError, match="capacity must be an integer"):
        Pages(2.0)


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "retain", "release"]), st.lists(st.integers(0, 5), max_size=4)
    ),
    max_size=40,
)


@given(ops)
@settings(max_examples=300, deadline=None)
def test_the_pool_follows_a_dictionary_of_counts(steps):
    # A page is live iff its count is positive; an operation that fails changes nothing.
    pool, counts = Pages(5), {}
    for op, pages in steps:
        before = state(pool)
        if op == "alloc":
            k = len(pages)
            if k > 5 - len(counts):
                with pytest.raises(PageError):
                    pool.alloc(k)
            else:
                new = pool.alloc(k).tolist()
                assert not set(new) & set(counts) and len(set(new)) == k
                counts.update(dict.fromkeys(new, 1))
        else:
            held = {p: counts.get(p, 0) for p in pages}
            ok = all(held.values()) and (
                op == "retain" or all(pages.count(p) <= held[p] for p in pages)
            )
            if not ok:
                with pytest.raises(PageError):
                    getattr(pool, op)(pages)
                assert state(pool) == before
                continue
            getattr(pool, op)(pages)
            for p in pages:
                counts[p] += 1 if op == "retain" else -1
            counts = {p: c for p, c in counts.items() if c}
        assert pool.live == len(counts)
        assert {p: c for p, c in enumerate(pool.counts.tolist()) if c} == counts


# -- plans walked through the pool ------------------------------------------------------------


def test_the_spec_example_peaks():
    p = prefix.plan(SPEC, 2)
    assert prefix.simulate(p, "keep").peak == 3
    assert prefix.simulate(p, "count").peak == 3


def test_keep_frees_what_no_child_reads_at_once():
    # 0 owns 4 pages, its child 1 reads only the first. Keep: 0 lets 3 go before 1 allocates
    # its 3 (peak 4). Count: 0 is held until 1 arrives (peak 7).
    p = prefix.plan([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 9, 9, 9, 9, 9]], 2)
    assert p.shared.tolist() == [0, 2]
    assert prefix.simulate(p, "keep").peak == 4
    assert prefix.simulate(p, "count").peak == 7


def test_a_pool_too_small_for_the_plan_runs_out():
    p = prefix.plan(SPEC, 2)
    with pytest.raises(PageError, match="out of pages, 1 asked, 0 free of 2"):
        prefix.simulate(p, "count", Pages(2))


def test_an_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="strategy must be one of"):
        prefix.simulate(prefix.plan(SPEC, 2), "lru")


def live_pages_keep(p, tables, i):
    """Strategy keep, while row ``i`` computes: pages owned by rows up to ``i`` that row ``i``
    or a later row reads."""
    own = {int(tables[j, k]) for j in range(i + 1) for k in range(p.borrowed[j], p.npages[j])}
    read = {int(x) for x in tables[i:].ravel() if x >= 0}
    return own & read


def live_pages_count(p, tables, i):
    """Strategy count, while row ``i`` computes: the pages of row ``i`` and of every earlier
    row with a child still to arrive."""
    at = {int(q): j for j, q in enumerate(p.order)}
    held = {i} | {at[int(q)] for q in p.parent[i + 1 :] if q >= 0 and at[int(q)] < i}
    return {int(x) for j in held for x in tables[j] if x >= 0}


@given(prompt_sets, page_sizes, st.booleans(), st.sampled_from(prefix.STRATEGIES))
@settings(max_examples=200, deadline=None)
def test_a_walk_never_frees_a_page_still_read_and_leaks_none(prompts, P, dedupe, strategy):
    # Owners write their tokens into pool pages; a page freed early is reused by the next
    # allocation (the free list is a stack) and overwritten, so a later reader would see it.
    p = prefix.plan(prompts, P, dedupe=dedupe)
    tables, pool, content = p.tables(), Pages(p.pages), {}
    live = live_pages_keep if strategy == "keep" else live_pages_count
    for i, table in prefix.walk(p, strategy, pool):
        t = prompts[p.order[i]]
        pages = [t[k * P : (k + 1) * P] for k in range(p.npages[i])]
        assert [content[x] for x in table[: p.borrowed[i]]] == pages[: p.borrowed[i]]
        content.update(zip(table[p.borrowed[i] :].tolist(), pages[p.borrowed[i] :]))
        assert (pool.counts[table] > 0).all()
        assert pool.live == len(live(p, tables, i))
    assert pool.live == 0 and not pool.counts.any()


@given(prompt_sets, page_sizes, st.booleans())
@settings(max_examples=100, deadline=None)
def test_keep_never_holds_more_than_count(prompts, P, dedupe):
    p = prefix.plan(prompts, P, dedupe=dedupe)
    keep, count = prefix.simulate(p, "keep"), prefix.simulate(p, "count")
    assert keep.peak <= count.peak <= p.pages
    assert keep.peak >= int(p.owned.max(initial=0))


def test_keep_holds_the_largest_shared_of_the_children():
    # 0 owns pages 0..3; children share 2 and 6 tokens: it keeps 3 pages (6 / 2).
    p = prefix.plan([[1] * 8, [1, 1, 2, 2], [1] * 6 + [3, 3]], 2)
    assert p.parent.tolist() == [-1, 0, 0] and p.shared.tolist() == [0, 6, 2]
    pool = Pages(p.pages)
    steps = prefix.walk(p, "keep", pool)
    next(steps)
    assert pool.live == 4
    next(steps)  # 0 has computed and kept 3 pages; 1 allocates 1
    assert pool.live == 3 + 1
