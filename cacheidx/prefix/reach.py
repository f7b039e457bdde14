"""How far back a group of layers reads, in pages: the arithmetic behind the spec's law "a
column is freed and becomes -1 once it is below every reach still to be fed".

A group's ``window`` is ``None`` for full layers (they read every position) or ``w`` for
sliding ones (a token at ``t`` reads ``t - w + 1`` to ``t``). With pages of ``P`` positions:

1. A call whose first token is at ``first`` reaches back to :func:`reach` ``= max(0, first -
   w + 1)``; the later calls of the sequence reach no further back, so every page wholly below
   it may be freed: :func:`first_page`.
2. A call of at most ``n`` tokens reads at most :func:`pages_at_once` ``= ceil((n + w - 2) /
   P) + 1`` pages of a sliding group (its tokens and the ``w - 1`` positions before the first,
   misaligned on pages at both ends), whatever the sequence's length; one decode token reads
   ``window_pages``. :func:`largest_call` is the most tokens a call may feed so that
   ``pages`` pages hold what it reads.
3. A cached prefix of ``d`` whole pages is read back by a group only if it still holds the
   pages the next token reads: ``first_page(w, d * P)`` to ``d - 1`` (:func:`hit_pages`).
"""

from __future__ import annotations

__all__ = ["first_page", "hit_pages", "largest_call", "pages_at_once", "reach",
           "window_pages"]


def reach(window: int | None, first: int) -> int:
    """Law 1: the first position a call whose first token is at ``first`` reads."""
    return 0 if window is None else max(0, first - window + 1)


def first_page(window: int | None, first: int, page_size: int) -> int:
    """Law 1: the first page such a call reads; every page below it may be freed."""
    return reach(window, first) // page_size


def pages_at_once(window: int, tokens: int, page_size: int) -> int:
    """Law 2: the most pages a call of ``tokens`` tokens reads through ``window``."""
    return -(-(tokens + window - 2) // page_size) + 1


def window_pages(window: int, page_size: int) -> int:
    """Law 2: the most pages one decode token reads through ``window``: what a sliding group's
    pool must hold at the least."""
    return pages_at_once(window, 1, page_size)


def largest_call(window: int, pages: int, page_size: int) -> int:
    """Law 2: the most tokens a call may feed so that what it reads fits ``pages`` pages
    (below 1 when even one token's window does not)."""
    return (pages - 1) * page_size - window + 2


def hit_pages(window: int | None, depth: int, page_size: int) -> range:
    """Law 3: the pages of a cached prefix of ``depth`` whole pages that a group must still
    hold for the prefix to be read back."""
    return range(first_page(window, depth * page_size, page_size), depth)
