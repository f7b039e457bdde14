"""The prefix planner of ``spec/prefix-sharing.txt``: which prompt computes which tokens.

Laws, for prompts ``t[0..n)`` and a page size ``P`` (every array is aligned with ``order``:
entry ``i`` is about prompt ``order[i]``):

1. ``order`` sorts the prompts lexicographically by token, a prompt before every longer
   prompt it is a prefix of, equal prompts by id (a stable sort).
2. ``lcp[i]`` is the common prefix length of prompt ``order[i]`` with ``order[i - 1]``
   (0 for ``i = 0``). Sorted, that is the longest prefix it shares with any earlier prompt.
3. ``shared[i] = floor(min(lcp[i], len - 1) / P) * P``: what it reuses, capped so it computes
   at least its last token, rounded down to whole pages because a page is never half borrowed.
4. ``parent[i]`` is the id of the nearest earlier prompt in order whose ``shared`` is smaller
   than ``shared[i]``, -1 when ``shared[i] = 0``. That prompt computed (owns) the last page
   ``order[i]`` borrows; its own parent owns the pages before, and so on up to a root. Sorted
   order is a depth-first walk of this tree, so every parent runs before its children.
5. Pages: prompt ``order[i]`` owns ``owned[i]`` fresh pages for its tokens past ``shared[i]``,
   numbered consecutively in order, and borrows its first ``borrowed[i]`` pages from its
   ancestors. Token ``k`` of a prompt lives in slot ``table[k // P] * P + k % P``.
6. With ``dedupe=True``, a prompt equal to the previous one in order (an exact duplicate;
   law 1 makes copies adjacent) gets ``shared = len``: it computes nothing, borrows every page
   of the first copy, last partial page included, and its parent is the first copy, whose
   last-token output it reuses. Without it (the spec), law 3's cap makes each copy recompute
   its last page.

Sorting runs in C on big-endian byte keys: timsort with ``memcmp``, which orders bytes
exactly as law 1 orders tokens. (``np.lexsort`` over a padded array makes one pass per column:
on 100,000 prompts of 2,176 tokens it took 6.3 s against 0.2 s.) Everything else is
whole-array NumPy over the tokens; Python loops only over prompts, to read them and cut their
keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .. import _arguments as arguments

__all__ = ["Plan", "plan"]

_WHERE = "cacheidx.prefix.plan"

# Common prefixes are measured over blocks of about this many tokens, and prompts are read
# this many at a time: bounded, reused buffers (fresh memory costs more than reading it).
_CELLS = 1 << 22
_BATCH = 1024


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A prefix-sharing plan (see the module's laws). Arrays are int64 and aligned with
    ``order``; ``parent`` holds prompt ids, like ``order``."""

    order: np.ndarray
    shared: np.ndarray
    parent: np.ndarray
    lengths: np.ndarray  #: tokens in each prompt
    lcp: np.ndarray  #: common prefix with the previous prompt in order, uncapped, unrounded
    page_size: int
    dedupe: bool = False

    def __len__(self) -> int:
        return int(self.order.size)

    @property
    def computed(self) -> np.ndarray:
        """Tokens each prompt computes: ``lengths - shared``."""
        return self.lengths - self.shared

    @property
    def duplicate(self) -> np.ndarray:
        """Whether each prompt equals the previous one in order (bool)."""
        prev = np.concatenate([[-1], self.lengths[:-1]])
        return (self.lcp == self.lengths) & (prev == self.lengths)

    @property
    def npages(self) -> np.ndarray:
        """Pages in each prompt's table: ``ceil(len / P)``."""
        return -(-self.lengths // self.page_size)

    @property
    def borrowed(self) -> np.ndarray:
        """Pages each prompt reads from its ancestors: ``ceil(shared / P)`` (whole pages,
        except a deduplicated copy's last partial one)."""
        return -(-self.shared // self.page_size)

    @property
    def owned(self) -> np.ndarray:
        """Fresh pages each prompt allocates and writes: ``npages - borrowed``."""
        return self.npages - self.borrowed

    @property
    def pages(self) -> int:
        """Pages the plan allocates in all, none reused."""
        return int(self.owned.sum())

    @property
    def first_page(self) -> np.ndarray:
        """The first page each prompt owns; its pages are ``first_page + range(owned)``."""
        return np.cumsum(self.owned) - self.owned

    def tables(self, width: int | None = None) -> np.ndarray:
        """Page tables, ``[n, width]`` int64 aligned with ``order``: row ``i`` names the pages
        holding prompt ``order[i]``'s tokens, ``borrowed[i]`` ancestors' pages then its
        ``owned[i]`` own, padded with -1. ``width`` defaults to the longest table.

        Law: page ``k`` of row ``i`` is owned by the last row ``j <= i`` that starts computing
        at or before token ``k * P`` (a deduplicated copy starts nowhere). Raises
        ``ValueError`` when ``width`` is shorter than a table.
        """
        need = int(self.npages.max(initial=0))
        if width is not None:
            width = arguments.integer("prefix.plan.tables", "width", width)
        width = need if width is None else width
        if width < need:
            raise ValueError(f"{_WHERE}.tables: width {width} is shorter than a table of {need}")
        n, P = len(self), self.page_size
        start = np.where(self.duplicate & self.dedupe, np.iinfo(np.int64).max, self.shared)
        k = np.arange(width, dtype=np.int64)
        rows = np.arange(n, dtype=np.int64)[:, None]
        owner = np.maximum.accumulate(np.where(start[:, None] <= k * P, rows, -1), axis=0)
        safe = np.maximum(owner, 0)
        table = self.first_page[safe] + k - start[safe] // P
        return np.where(k < self.npages[:, None], table, -1)


def plan(prompts, page_size: int, *, lengths=None, dedupe: bool = False) -> Plan:
    """Plan prefix sharing for ``prompts`` (see the module's laws).

    ``prompts`` is a sequence of token sequences (lists, NumPy arrays), or one 2-D integer
    array, every row a prompt; with ``lengths``, row ``r`` holds its first ``lengths[r]``
    tokens and the rest is ignored padding. Tokens are non-negative integers.

    Raises ``ValueError`` for a page size below 1, an empty prompt, a negative token, a ragged
    array without ``lengths`` or lengths that do not fit; ``TypeError`` for non-integer tokens,
    page size or lengths.
    """
    P = arguments.integer("prefix.plan", "page_size", page_size)
    if P < 1:
        raise ValueError(f"{_WHERE}: page_size must be >= 1, got {P}")
    prompts, lens = _read(prompts, lengths)
    keys = _keys(prompts)
    order = np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
    slen = lens[order]
    lcp = _lcp([keys[i] for i in order], slen)
    shared = np.minimum(lcp, slen - 1) // P * P
    if dedupe:
        prev = np.concatenate([[-1], slen[:-1]])
        shared = np.where((lcp == slen) & (prev == slen), slen, shared)
    above = _previous_smaller(shared)
    parent = np.where(above >= 0, order[np.maximum(above, 0)], -1)
    return Plan(order, shared, parent, slen, lcp, P, bool(dedupe))


# -- reading prompts -----------------------------------------------------------------------


def _read(prompts, lengths) -> tuple[list[np.ndarray], np.ndarray]:
    """The prompts as 1-D integer arrays (views where they can be), and their lengths."""
    if isinstance(prompts, np.ndarray) and prompts.dtype != object:
        return _from_array(prompts, lengths)
    if lengths is not None:
        raise ValueError(f"{_WHERE}: lengths= goes with a padded 2-D array, not a sequence")
    return _from_sequences(prompts)


def _from_array(prompts: np.ndarray, lengths) -> tuple[list[np.ndarray], np.ndarray]:
    """A 2-D array, every row a prompt, or its first ``lengths[r]`` tokens."""
    if prompts.ndim != 2:
        raise ValueError(
            f"{_WHERE}: an array of prompts must be 2-D (one row each), got shape "
            f"{prompts.shape}; pass a single prompt as [prompt]"
        )
    _integers(prompts, "prompts")
    n, width = prompts.shape
    if lengths is None:
        if width == 0 and n:
            raise ValueError(f"{_WHERE}: prompt 0 is empty")
        return list(prompts), np.full(n, width, dtype=np.int64)
    lens = np.asarray(lengths)
    _integers(lens, "lengths")
    if lens.shape != (n,):
        raise ValueError(f"{_WHERE}: lengths has shape {lens.shape}, the prompts {n} rows")
    bad = np.flatnonzero((lens < 1) | (lens > width))
    if bad.size:
        r = int(bad[0])
        what = "is empty" if lens[r] < 1 else f"has length {int(lens[r])} > width {width}"
        raise ValueError(f"{_WHERE}: prompt {r} {what}")
    lens = lens.astype(np.int64)
    return [row[:k] for row, k in zip(prompts, lens.tolist())], lens


def _from_sequences(prompts) -> tuple[list[np.ndarray], np.ndarray]:
    """A sequence of 1-D token sequences (one loop over prompts, none over tokens)."""
    if isinstance(prompts, np.ndarray):  # object dtype: rows of different lengths
        raise ValueError(
            f"{_WHERE}: a ragged array (dtype object) needs a padded 2-D array with lengths=, "
            f"or a list of prompts"
        )
    if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
        raise TypeError(f"{_WHERE}: prompts must be a sequence of prompts, got {prompts!r:.80}")
    arrays = []
    for p, prompt in enumerate(prompts):
        a = np.asarray(prompt)
        if a.ndim != 1:
            raise ValueError(f"{_WHERE}: prompt {p} must be 1-D tokens, got shape {a.shape}")
        if a.size == 0:
            raise ValueError(f"{_WHERE}: prompt {p} is empty")
        _integers(a, f"prompt {p}")
        arrays.append(a)
    return arrays, np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))


def _integers(a: np.ndarray, name: str) -> None:
    if a.dtype.kind not in "iu":
        raise TypeError(f"{_WHERE}: {name} must hold integers, got dtype {a.dtype}")


def _keys(prompts: list[np.ndarray]) -> list[bytes]:
    """Each prompt as fixed-width big-endian bytes, as few per token as the largest needs.
    Such keys compare as law 1 orders prompts: ``bytes`` compares the first differing byte,
    which sits in the first differing token, and puts a prefix before its extensions.
    ``ValueError`` for a negative token."""
    top = 0
    for at in range(0, len(prompts), _BATCH):
        low, high = _extremes(prompts[at : at + _BATCH])
        if low < 0:
            p = next(p for p in range(at, len(prompts)) if prompts[p].min() < 0)
            raise ValueError(f"{_WHERE}: prompt {p} has a negative token, {int(prompts[p].min())}")
        top = max(top, high)
    dtype = ">u" + str(next(w for w in (1, 2, 4, 8) if top < 1 << (8 * w)))
    return [a.astype(dtype).tobytes() for a in prompts]


def _extremes(prompts: list[np.ndarray]) -> tuple[int, int]:
    """The smallest and largest token of a batch of prompts."""
    if np.result_type(*{a.dtype for a in prompts}).kind == "f":  # uint64 beside signed
        return min(int(a.min()) for a in prompts), max(int(a.max()) for a in prompts)
    tokens = np.concatenate(prompts)
    return int(tokens.min()), int(tokens.max())


# -- the plan's steps ------------------------------------------------------------------------


def _lcp(keys: list[bytes], lens: np.ndarray) -> np.ndarray:
    """Law 2: for the keys of the prompts in order, the common prefix length of each with the
    one before. Compares consecutive rows of padded blocks of about ``_CELLS`` tokens."""
    n = lens.size
    lcp = np.zeros(n, dtype=np.int64)
    first = 1  # rows first - 1 .. last - 1 make one block
    while first < n:
        rows = max(1, _CELLS // int(lens[first - 1 : first + _CELLS // lens[first - 1]].max()))
        last = min(n, first + rows)
        block = _padded(keys[first - 1 : last], lens[first - 1 : last])
        differ = block[1:] != block[:-1]
        at = np.argmax(differ, axis=1)
        room = np.minimum(lens[first - 1 : last - 1], lens[first:last])
        # Padding compares as anything: a difference past the shorter prompt is its end.
        hit = differ[np.arange(at.size), at]
        lcp[first:last] = np.where(hit, np.minimum(at, room), room)
        first = last
    return lcp


def _padded(keys: list[bytes], lens: np.ndarray) -> np.ndarray:
    """Keys as rows of unsigned words (equal exactly when the tokens are), padded with zeros."""
    width = int(lens.max())
    run = np.frombuffer(b"".join(keys), dtype=f"u{len(keys[0]) // int(lens[0])}")
    if run.size == lens.size * width:
        return run.reshape(lens.size, width)
    block = np.zeros((lens.size, width), dtype=run.dtype)
    block[np.arange(width) < lens[:, None]] = run
    return block


def _previous_smaller(values: np.ndarray) -> np.ndarray:
    """For each ``i``, the largest ``j < i`` with ``values[j] < values[i]``, else -1.

    Binary lifting over a sparse table of range minima: ``low[h][j]`` is the minimum of
    ``values[j : j + 2**h]``; each ``i`` jumps left over whole blocks that are all
    ``>= values[i]``, largest blocks first. ``O(n log n)`` work, all of it vectorised.
    """
    n = values.size
    low = [values]
    while 1 << len(low) <= n:
        h = 1 << (len(low) - 1)
        low.append(np.minimum(low[-1][:-h], low[-1][h:]))
    end = np.arange(n, dtype=np.int64)  # values[end : i] are all >= values[i]
    for h in reversed(range(len(low))):
        step = end - (1 << h)
        can = step >= 0
        jump = can & (low[h][np.where(can, step, 0)] >= values)
        end = np.where(jump, step, end)
    return end - 1
