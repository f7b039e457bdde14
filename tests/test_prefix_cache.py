"""The online prefix cache (``cacheidx.prefix.PrefixCache``) keeps its laws: hand-checkable
cases first, then random request lives (arrival orders, pool and page sizes) against a slow
plain-Python reference that keeps cached prefixes as tuples of tokens."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheidx import prefix
from cacheidx.prefix import PageError, PrefixCache


def serve_one(cache, prompt, generated=(), room=None):
    """A request's whole life: admit, insert the prompt, insert what it wrote, release."""
    total = len(prompt) + (len(generated) if room is None else room)
    hold = cache.admit(prompt, total)
    assert hold is not None
    cache.insert(hold, prompt)
    cache.insert(hold, list(prompt) + list(generated))
    cache.release(hold)
    return hold


# -- cases a reader can check by hand ---------------------------------------------------------
def test_match_is_whole_pages_capped_below_the_prompt_length():
    cache = PrefixCache(8, 4)
    serve_one(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # pages [1 2 3 4] [5 6 7 8] cached
    assert cache.cached == 2
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).tokens == 8
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]).tokens == 4  # the last token is computed
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 0, 9]).tokens == 4  # page 2 differs
    assert cache.match([0, 2, 3, 4, 5, 6, 7, 8, 9]).tokens == 0
    assert cache.match([1, 2, 3]).tokens == 0


def test_a_hold_reads_the_cached_pages_then_its_own():
    cache = PrefixCache(8, 2)
    first = serve_one(cache, [5, 6, 7, 8, 9])  # pages of [5 6] [7 8] cached, [9] freed
    hold = cache.admit([5, 6, 7, 8, 1, 2], 8)
    assert hold.cached == 4
    assert hold.pages[:2] == first.pages[:2]
    assert len(hold.pages) == 4 and not set(hold.pages[2:]) & set(first.pages[:2])
    cache.release(hold)
    cache.check()


def test_least_recently_released_goes_first():
    cache = PrefixCache(4, 1)
    serve_one(cache, [1, 2])  # caches [1], [1 2]
    serve_one(cache, [7, 8])  # caches [7], [7 8]; the pool is full
    assert cache.free == 0 and cache.cached == 4
    hold = cache.admit([4, 5], 2)  # two pages: the branch [1 2] is older, it goes
    assert cache.evictions == 2
    assert cache.match([1, 2, 3]).tokens == 0 and cache.match([7, 8, 9]).tokens == 2
    cache.release(hold)


def test_a_page_with_readers_is_never_evicted():
    cache = PrefixCache(4, 1)
    serve_one(cache, [1, 2])  # [1], [1 2] cached
    reader = cache.admit([1, 2, 3], 3)  # reads both, owns one
    assert reader.cached == 2
    assert cache.admit([9, 9], 2) is None  # one page free, nothing evictable
    other = cache.admit([9], 1)  # the free page
    assert other is not None and cache.evictions == 0
    cache.release(other)
    cache.release(reader)
    assert cache.admit([4, 4, 4, 4], 4) is not None  # now everything may go
    assert cache.evictions == 2


def test_the_policy_hook_orders_evictions():
    newest_first = PrefixCache(4, 1, policy=lambda page: -page.last_used)
    serve_one(newest_first, [1, 2])
    serve_one(newest_first, [7, 8])
    hold = newest_first.admit([4, 5], 2)
    assert newest_first.match([1, 2, 3]).tokens == 2 and newest_first.match([7, 8, 9]).tokens == 0
    newest_first.release(hold)


def test_a_page_cached_meanwhile_stays_the_requests_own():
    cache = PrefixCache(8, 2)
    a, b = cache.admit([1, 2, 3, 4, 5], 5), cache.admit([1, 2, 3, 4, 6], 5)
    assert a.cached == b.cached == 0
    assert cache.insert(a, [1, 2, 3, 4, 5]) == 2
    assert cache.insert(b, [1, 2, 3, 4, 6]) == 0  # both pages were cached by a
    assert cache.cached == 2 and cache.match([1, 2, 3, 4, 7]).pages == tuple(a.pages[:2])
    cache.check()
    cache.release(a)
    cache.release(b)
    assert cache.free == 6
    cache.check()


def test_a_request_larger_than_the_pool_raises_and_a_busy_pool_says_none():
    cache = PrefixCache(3, 4)
    with pytest.raises(PageError, match="13 tokens need 4 pages of 4; the pool has 3"):
        cache.admit([1] * 10, 13)
    hold = cache.admit([1] * 10, 12)
    assert cache.admit([2], 1) is None
    cache.release(hold)
    assert cache.free == 3


@pytest.mark.parametrize("call, error, message", [
    (lambda: PrefixCache(-1, 4), ValueError, "pages must be at least 0, got -1"),
    (lambda: PrefixCache(4, 0), ValueError, "page_size must be at least 1, got 0"),
    (lambda: PrefixCache(4, 2.0), TypeError, "page_size must be an integer"),
    (lambda: PrefixCache(4, 2).match([]), ValueError, "the prompt is empty"),
    (lambda: PrefixCache(4, 2).admit([1, 2], 1), ValueError, "total must be at least 2"),
    (lambda: PrefixCache(4, 2).match(np.zeros((2, 2), int)), ValueError, "1-D array"),
    # a float is never truncated into another prompt's key (1.9 is not 1), a bool is no id
    (lambda: PrefixCache(4, 2).match([1.9, 2.9, 3.9]), TypeError,
     "match: token 0 must be an integer, got 1.9"),
    (lambda: PrefixCache(4, 2).match(np.asarray([1.5, 2.0])), TypeError,
     "match: tokens must be integers, got dtype float64"),
    (lambda: PrefixCache(4, 2).admit([3, True]), TypeError, "token 1 must be an integer, got True"),
    (lambda: PrefixCache(4, 2).match("abc"), TypeError, "tokens must be a sequence of integers"),
    (lambda: PrefixCache(4, 2).match(7), TypeError, "tokens must be a sequence of integers, got 7"),
    # never wrapped to a negative key, never a bare OverflowError
    (lambda: PrefixCache(4, 2).match(np.asarray([2**63 + 5, 1], np.uint64)), ValueError,
     "token 9223372036854775813 is past the largest id a key holds"),
    (lambda: PrefixCache(4, 2).match([1, 2**64]), ValueError,
     "token 1 is 18446744073709551616, past the int64 a key holds"),
])
def test_bad_input_names_the_function_and_the_value(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_second_release_and_a_wrong_insert_raise():
    cache = PrefixCache(4, 2)
    serve_one(cache, [1, 2, 3])
    hold = cache.admit([1, 2, 3], 3)
    with pytest.raises(ValueError, match="page 0 of the tokens is not the page"):
        cache.insert(hold, [9, 9, 3])
    cache.release(hold)
    with pytest.raises(PageError, match="released already"):
        cache.release(hold)
    cache.check()


# -- the reference, in plain Python -----------------------------------------------------------
class Slow:
    """Cached prefixes as tuples of whole pages of tokens, each with its readers and the time
    its last reader let go; evicts, among prefixes without readers that no cached prefix
    extends by one page, the one let go of first."""

    def __init__(self, capacity, size):
        self.capacity, self.size = capacity, size
        self.cached = {}  # prefix -> [readers, last_used]
        self.free, self.clock = capacity, 0

    def match(self, tokens):
        k = 0
        while k < (len(tokens) - 1) // self.size and tuple(tokens[: (k + 1) * self.size]) \
                in self.cached:
            k += 1
        return k

    def admit(self, tokens, total):
        k = self.match(tokens)
        nodes = [tuple(tokens[: (i + 1) * self.size]) for i in range(k)]
        need = -(-total // self.size) - k
        unread = sum(r == 0 for r, _ in self.cached.values())
        if need > self.free + unread - sum(self.cached[n][0] == 0 for n in nodes):
            return None
        for n in nodes:
            self.cached[n][0] += 1
        while self.free < need:
            self.evict()
        self.free -= need
        return {"nodes": nodes, "own": need}

    def evict(self):
        leaves = [p for p, (r, _) in self.cached.items() if r == 0 and not any(
            len(q) == len(p) + self.size and q[: len(p)] == p for q in self.cached)]
        oldest = min(self.cached[p][1] for p in leaves)
        victims = [p for p in leaves if self.cached[p][1] == oldest]
        assert len(victims) == 1, "the reference has no tie to break"
        del self.cached[victims[0]]
        self.free += 1

    def insert(self, hold, tokens):
        for k in range(len(hold["nodes"]), len(tokens) // self.size):
            p = tuple(tokens[: (k + 1) * self.size])
            if p in self.cached:
                self.cached[p][0] += 1
            else:
                self.cached[p] = [1, 0]
                hold["own"] -= 1
            hold["nodes"].append(p)

    def release(self, hold):
        self.clock += 1
        for n in hold["nodes"]:
            self.cached[n][0] -= 1
            self.cached[n][1] = self.clock
        self.free += hold["own"]


def prefixes(cache):
    """The cache's tree as {prefix tuple: readers}."""
    out, stack = {}, [((), n) for n in cache._tree.root.children.values()]
    while stack:
        before, node = stack.pop()
        p = before + tuple(np.frombuffer(node.key, dtype="<i8").tolist())
        out[p] = node.readers
        stack.extend((p, c) for c in node.children.values())
    return out


prompts = st.lists(st.integers(0, 1), min_size=1, max_size=9)
request = st.tuples(prompts, st.lists(st.integers(0, 1), max_size=4))


@settings(max_examples=150)
@given(capacity=st.integers(1, 12), size=st.integers(1, 3),
       requests=st.lists(request, min_size=1, max_size=12), data=st.data())
def test_random_lives_keep_the_laws_of_the_slow_reference(capacity, size, requests, data):
    """Requests (prompts and their generated tokens) start and move on in a random order over
    a random pool; after each step the tree, the matches, the free pages and whether a
    request is admitted equal the reference's; every page is in one place (check); and a
    page a live request reads still holds its tokens (none was evicted under it)."""
    cache, slow = PrefixCache(capacity, size), Slow(capacity, size)
    content = {}  # page -> the tokens written on it
    waiting = list(range(len(requests)))
    live = {}  # request -> (hold, slow hold, phase)

    def written_by(r, hold, upto):
        """The pages of request r below token ``upto`` hold its tokens."""
        prompt, gen = requests[r]
        seq = list(prompt) + list(gen)
        for k in range(upto // size):
            page = hold.pages[k]
            want = tuple(seq[k * size : (k + 1) * size])
            if k * size >= hold.cached:  # its own page: it writes it now
                content.setdefault(page, want)
            assert content.get(page) == want, f"page {page} was given away under a reader"

    while waiting or live:
        choices = [("start", r) for r in waiting[:1]] + [("next", r) for r in live]
        kind, r = data.draw(st.sampled_from(choices))
        prompt, gen = requests[r]
        total = len(prompt) + len(gen)
        if kind == "start":
            assert cache.match(prompt).tokens == slow.match(prompt) * size
            if -(-total // size) > capacity:
                with pytest.raises(PageError):
                    cache.admit(prompt, total)
                waiting.pop(0)
                continue
            hold, ref = cache.admit(prompt, total), slow.admit(prompt, total)
            assert (hold is None) == (ref is None)
            if hold is None:
                assert live, "an idle pool always admits what fits it"
                continue
            for page in hold.pages[hold.cached // size :]:
                content.pop(page, None)  # fresh pages: whatever was there is gone
            waiting.pop(0)
            live[r] = (hold, ref, 0)
        else:
            hold, ref, phase = live[r]
            if phase == 0:
                written_by(r, hold, len(prompt))
                cache.insert(hold, prompt)
                slow.insert(ref, prompt)
                live[r] = (hold, ref, 1)
            elif phase == 1:
                written_by(r, hold, total)
                cache.insert(hold, list(prompt) + list(gen))
                slow.insert(ref, list(prompt) + list(gen))
                live[r] = (hold, ref, 2)
            else:
                written_by(r, hold, total)
                cache.release(hold)
                slow.release(ref)
                del live[r]
        cache.check()
        assert prefixes(cache) == {p: v[0] for p, v in slow.cached.items()}
        assert cache.free == slow.free
    # nothing leaks: every page free or cached with no reader
    assert cache.free + cache.cached == capacity and cache.evictable == cache.cached


def test_matching_walks_only_the_pages_it_matches():
    """A prompt of 10^5 tokens against 10^4 cached pages: the work is the matched pages (the
    speed itself is measured in benchmarks/serve.py)."""
    cache = PrefixCache(10_000, 16)
    tokens = np.arange(160_000) % 50_000
    hold = cache.admit(tokens, len(tokens))
    cache.insert(hold, tokens)
    cache.release(hold)
    assert cache.cached == 10_000
    assert cache.match(tokens[:100_000]).tokens == (100_000 - 1) // 16 * 16
    assert cache.match(np.concatenate([[7], tokens[1:100_000]])).tokens == 0
    assert prefix.lru(cache._tree.root.children[tokens[:16].astype("<i8").tobytes()]) == 1


# -- groups of layers: a sliding group keeps the last window ------------------------------------
def serve_windowed(cache, prompt, written=(), call=1):
    """A request's life over a cache with sliding groups: its prompt in calls of ``call``
    tokens, then what it wrote one a call, each slid to first; its prompt cached, then what
    it wrote; released."""
    seq = list(prompt) + list(written)
    hold = cache.admit(prompt, max(len(seq), len(prompt)), call=call)
    assert hold is not None
    for first in range(hold.cached, len(prompt), call):
        cache.slide(hold, first, min(first + call, len(prompt)) - 1)
    for first in range(len(prompt), len(seq)):
        cache.slide(hold, first, first)
    cache.insert(hold, prompt)
    cache.insert(hold, seq)
    cache.release(hold)
    cache.check()
    return hold


def test_a_cached_prefix_keeps_its_last_window_and_a_hit_needs_it():
    """Full layers and a window of 4, pages of 2: a 9-token prompt computed in one call keeps
    its 4 full pages and, of the sliding group, the pages a hit at 4 pages (positions 5 to
    7) or one page short (positions 3 to 5) reads: pages 1 to 3. A prompt sharing 2 pages
    would read position 0's page, given back: it hits nothing."""
    cache = PrefixCache((8, 8), 2, windows=(None, 4))
    serve_windowed(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9], call=9)
    assert (cache.group(0).cached, cache.group(1).cached) == (4, 3)
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).tokens == 8
    assert cache.match([1, 2, 3, 4, 5, 6, 0]).tokens == 6
    assert cache.match([1, 2, 3, 4, 0, 0, 0]).tokens == 0
    hold = cache.admit([1, 2, 3, 4, 5, 6, 7, 8, 0], 9)
    assert hold.cached == 8 and hold.tables[1][:2] == [-1, -1] and min(hold.tables[1][2:4]) >= 0
    cache.release(hold)
    cache.check()


def test_a_sliding_page_is_evicted_alone_and_the_hits_it_served_go_with_it():
    """Window 2, pages of 1, a sliding pool of 3: the prompt [1 2 3 4] keeps pages 2 and 3 of
    its sliding group. A request needing 2 fresh pages evicts one of them, the older-pushed:
    the full pages stay, a hit at 4 pages still reads, one at 3 no longer does."""
    cache = PrefixCache((8, 3), 1, windows=(None, 2))
    serve_windowed(cache, [1, 2, 3, 4])
    assert cache.match([1, 2, 3, 9]).tokens == 3 and cache.match([1, 2, 3, 4, 5]).tokens == 4
    hold = cache.admit([7, 8], 2)
    cache.slide(hold, 0, 1)
    assert cache.evictions == 1 and cache.group(0).cached == 4 and cache.group(1).cached == 1
    assert cache.match([1, 2, 3, 9]).tokens == 0 and cache.match([1, 2, 3, 4, 5]).tokens == 4
    cache.release(hold)
    cache.check()


def test_without_full_layers_a_node_goes_with_its_last_page():
    """Every layer sliding (window 2, pages of 1, a pool of 3): the cached prompt's nodes hold
    pages 2 and 3 only; once both are evicted for a request holding 3 pages, the tree holds
    nothing."""
    cache = PrefixCache(3, 1, windows=(2,))
    serve_windowed(cache, [1, 2, 3, 4])
    assert len(cache._tree.root.children) == 1 and cache.cached == 2
    hold = cache.admit([7, 8, 9], 3, call=2)  # calls of 2 read up to 3 pages at once
    cache.slide(hold, 0, 0)  # the free page
    assert cache.cached == 2 and cache.evictions == 0
    cache.slide(hold, 1, 2)
    assert cache.cached == 0 and not cache._tree.root.children
    cache.release(hold)
    cache.check()
    assert cache.free == 3


@pytest.mark.parametrize("call, error, message", [
    (lambda: PrefixCache(4, 2, windows=(None, None)), ValueError, "name a group twice"),
    (lambda: PrefixCache(4, 2, windows=(0,)), ValueError, "a window must be None or a "
     "positive integer, got 0"),
    (lambda: PrefixCache((4, 4), 2, windows=(None,)), ValueError, "pages gives 2 pools for 1 "
     "groups"),
    (lambda: PrefixCache(2, 2, windows=(8,)).admit([1, 2], 9), PageError, "a window of 8 "
     "tokens needs 5 pages of 2 at once; the pool of window 8 has 2"),
    (lambda: PrefixCache(8, 2, windows=(4,)).slide(PrefixCache(8, 2, windows=(4,)).admit(
        [1, 2], 2), 0, 1), PageError, "slide: the hold is not of this cache"),
    (lambda: PrefixCache(3, 2, windows=(4,)).admit(list(range(9)), 9), PageError, "calls of 9 "
     "tokens read up to 5 pages of window 4 at once; the pool of window 4 has 3"),
])
def test_bad_groups_name_the_function_and_the_value(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_kept_window_is_cached_where_the_last_window_alone_is_not():
    """Window 2, pages of 1: told to keep the window a hit at 2 pages reads (page 1: the next
    token reads positions 1 and 2), the hold keeps it past its reach, and once it caches its
    prompt a prompt sharing 2 pages reads them; one sharing 3 finds page 2 gone and reads 2.
    A pool without room for the kept pages, or a hold that gave them back, refuses, changing
    nothing."""
    cache = PrefixCache(8, 1, windows=(2,))
    hold = cache.admit([1, 2, 3, 4, 5, 6], 6, call=1)
    assert cache.keep(hold, 2) and hold.most[0] == 2 + 1
    for first in range(6):
        cache.slide(hold, first, first)
    assert list(hold.kept[0]) == [1] and hold.held(0) == 3
    cache.insert(hold, [1, 2, 3, 4, 5, 6])
    cache.release(hold)
    cache.check()
    assert cache.match([1, 2, 9]).tokens == 2 and cache.match([1, 2, 3, 9]).tokens == 2
    assert cache.match([1, 2, 3, 4, 5, 9]).tokens == 5
    small = PrefixCache(2, 1, windows=(2,))
    hold = small.admit([1, 2, 3, 4], 4, call=1)
    assert not small.keep(hold, 2) and small.group(0).reserved == 2
    for first in range(3):
        small.slide(hold, first, first)  # page 0 given back at position 2
    assert not small.keep(hold, 1) and hold.most[0] == 2
    small.release(hold)
    small.check()


def test_a_call_past_the_holds_reservation_is_refused_changing_nothing():
    cache = PrefixCache(8, 2, windows=(4,))
    hold = cache.admit(list(range(12)), 12, call=2)  # at most 3 pages at once
    with pytest.raises(ValueError, match="positions 0 to 7 read 4 pages of window 4; the hold "
                                         "was admitted for 3 at once"):
        cache.slide(hold, 0, 7)
    with pytest.raises(ValueError, match="positions 10 to 12 are not in the hold's 12 slots"):
        cache.slide(hold, 10, 12)
    cache.check()
    cache.release(hold)
    cache.check()


windowed = st.sampled_from([(None, 2), (3,), (None, 1, 3), (2, 4)])


@settings(max_examples=100)
@given(windows=windowed, size=st.integers(1, 3), extra=st.integers(0, 6),
       call=st.integers(1, 4), requests=st.lists(request, min_size=1, max_size=8),
       data=st.data())
def test_random_lives_with_windows_never_give_away_a_page_in_use(windows, size, extra, call,
                                                                 requests, data):
    """Requests start, compute their prompts in calls of ``call`` tokens and then decode, are
    told to keep a window (law 10), cache and end in a random order
    over pools from one window up: after each step every page is in one place and the
    reservations add up (check); a page a live request reads, cached or its own, still holds
    the tokens it was written with; nothing leaks at the end."""
    sliding = [w for w in windows if w is not None]
    pages = max([-(-(call + w - 2) // size) + 1 for w in sliding]) + extra
    cache = PrefixCache(pages, size, windows=windows)
    content = {}  # (group, page) -> the tokens written on it
    waiting, live = list(range(len(requests))), {}

    def reads(r, hold, upto):
        """Every page the hold holds below token ``upto`` holds its tokens."""
        prompt, gen = requests[r]
        seq = list(prompt) + list(gen)
        for g, table in enumerate(hold.tables):
            for k in range(min(upto // size, len(table))):
                if table[k] >= 0:
                    want = tuple(seq[k * size : (k + 1) * size])
                    assert content.get((g, table[k])) == want, f"group {g} page {table[k]}"

    while waiting or live:
        choices = [("start", r) for r in waiting[:1]] + [("next", r) for r in live] + \
            [("keep", r) for r in live]
        kind, r = data.draw(st.sampled_from(choices))
        prompt, gen = requests[r]
        seq = list(prompt) + list(gen)
        if kind == "keep":  # another request will read the window at some depth
            hold = live[r][0]
            depth = data.draw(st.integers(1, len(hold.pages)))
            before = [cache.group(g).reserved for g in range(len(windows))]
            if not cache.keep(hold, depth):
                assert [cache.group(g).reserved for g in range(len(windows))] == before
        elif kind == "start":
            if None in windows and -(-len(seq) // size) > pages:
                with pytest.raises(PageError):
                    cache.admit(prompt, len(seq), call=call)
                waiting.pop(0)
                continue
            hold = cache.admit(prompt, max(1, len(seq)), call=call)
            if hold is None:
                assert live, "an idle pool always admits what fits it"
                continue
            reads(r, hold, hold.cached)
            for g, table in enumerate(hold.tables):  # fresh pages are written now
                for k in range(hold.cached // size, len(table)):
                    if table[k] >= 0:
                        content[g, table[k]] = tuple(seq[k * size : (k + 1) * size])
            waiting.pop(0)
            live[r] = [hold, hold.cached]
        else:
            hold, done = live[r]
            if done < len(seq):  # the next call: its pages taken, then written
                # prompt tokens in calls of ``call``, then one token a call (decoding)
                last = min(done + call, len(prompt)) - 1 if done < len(prompt) else done
                for g, _, new_low, top, new_top in cache.slide(hold, done, last):
                    for k in range(max(top, new_low), new_top):
                        content[g, hold.tables[g][k]] = tuple(seq[k * size : (k + 1) * size])
                live[r][1] = last + 1
                reads(r, hold, last + 1)
                if last + 1 >= len(prompt) > done:
                    cache.insert(hold, prompt)
            else:
                cache.insert(hold, seq[: max(len(prompt), len(seq))])
                cache.release(hold)
                del live[r]
        cache.check()
    for g in range(len(windows)):
        pool = cache.group(g)
        assert pool.free + pool.cached == pool.capacity and pool.evictable == pool.cached
        assert pool.reserved == 0
