"""Prefill schedules: a :class:`~cacheidx.prefix.plan.Plan` as cache indices over page tables.

Laws, for a plan of ``n`` prompts, page size ``P`` and ``max_new_tokens = G``:

1. One table of slots. ``table`` is ``[n, width]``, row ``p`` for prompt id ``p``: column
   ``j`` of prompt ``p`` holds position ``j`` at slot ``page * P + j % P``, where ``page`` is
   the plan's page ``j // P`` of ``p`` (``Plan.tables``) for ``j < len``: its ancestors'
   pages for the shared columns, its own for the rest. Columns ``len`` to
   ``ceil((len + G) / P) * P - 1`` are decoding room, on the prompt's own partial last page and
   then on fresh pages numbered after the plan's; the rest is -1. A deduplicated copy
   (``Plan(dedupe=True)``) borrows its first copy's partial last page for the columns below
   its length only: its columns from ``len`` on lie on a fresh page of its own, at the same
   offsets, so decoding never writes a slot another prompt reads. A pool holds ``slots``
   rows, ``pages * P``.
2. Waves. Prompt ``p`` computes positions ``shared`` to ``len - 1`` (at least its last one, by
   the plan's cap) in wave ``depth(p)``, its depth in the plan's parent tree: every ancestor,
   whose pages it reads, ran in an earlier wave. A wave is one call, one lane per prompt,
   ``row`` naming the prompt's row of ``table``, its tokens left padded with -1 positions to
   the wave's longest; the rows of other prompts are -1 in the wave's table. Within a wave no
   lane names a slot another lane writes, and no lane writes a slot that an earlier wave
   wrote: shared pages are written once.
3. Copies. A deduplicated copy computes nothing and is in no wave. ``copy_of[p]`` names the
   prompt whose last-token output it reuses (-1 for a prompt that computes);
   ``wave_of[p]``, ``lane_of[p]`` say where that output is: for a copy, its first copy's.
   :meth:`Schedule.last` gathers every prompt's last-token output from the waves' outputs.
4. Decoding. :meth:`Schedule.decode_index` is one lane per prompt, lane ``p`` at position
   ``len - 1`` of row ``p``; its ``advance()`` places each prompt's next token at position
   ``len``, at the prompt's own column, and so on for ``G`` tokens. A token past the room
   stores nothing (the spec's rule for a column that addresses nothing): give ``G``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _arguments as arguments
from .. import build
from ..index import CacheIndex
from .plan import Plan

__all__ = ["Schedule", "Wave", "schedule"]

_WHERE = "cacheidx.prefix.schedule"


@dataclasses.dataclass(frozen=True, eq=False)
class Wave:
    """One prefill call: lane ``b`` computes positions ``start[b]`` to ``stop[b] - 1`` of
    prompt ``prompts[b]``, left padded to ``seq`` tokens (law 2)."""

    prompts: np.ndarray  #: [lanes] prompt ids, in plan order
    start: np.ndarray  #: [lanes] first position computed: the plan's ``shared``
    stop: np.ndarray  #: [lanes] the prompts' lengths
    table: np.ndarray = dataclasses.field(repr=False)  #: the schedule's table of slots

    @property
    def lanes(self) -> int:
        return int(self.prompts.size)

    @property
    def seq(self) -> int:
        """Tokens per lane: the longest suffix the wave computes."""
        return int((self.stop - self.start).max())

    @property
    def positions(self) -> np.ndarray:
        """``[lanes, seq]`` int64: ``start .. stop - 1``, left padded with -1."""
        k = np.arange(self.seq, dtype=np.int64) - self.seq
        pos = self.stop[:, None] + k
        return np.where(pos >= self.start[:, None], pos, -1)

    def index(self, *, xp: Any = None, device: Any = None) -> CacheIndex:
        """The wave's cache index, its tensors built in ``xp`` (as ``cacheidx.rows``): ``pos``
        as :attr:`positions`, ``row`` the prompt ids, and the schedule's table up to the wave's
        longest prompt, with the rows of prompts not in the wave unallocated (-1): no sequence
        of the call names a slot the call writes but its writer (the spec's distinct
        write targets)."""
        to = build._converter(xp, device)
        width = int(self.stop.max())
        table = np.full((self.table.shape[0], width), -1, dtype=np.int64)
        table[self.prompts] = self.table[self.prompts, :width]
        return build.make(to(self.positions), to(table), row=to(self.prompts))

    def tokens(self, prompts: Sequence, *, pad: int = 0, xp: Any = None,
               device: Any = None) -> Any:
        """The token ids to feed, ``[lanes, seq]``: ``prompts[p][start:stop]`` of each lane's
        prompt ``p`` (``prompts`` as given to the plan, indexed by prompt id), left padded
        with ``pad``."""
        ids = np.full((self.lanes, self.seq), pad, dtype=np.int64)
        for b, (p, s, e) in enumerate(zip(self.prompts.tolist(), self.start.tolist(),
                                          self.stop.tolist())):
            got = np.asarray(prompts[p])[s:e]
            if got.shape != (e - s,):
                raise ValueError(f"{_WHERE}: prompt {p} has fewer tokens than the plan's {e}")
            ids[b, self.seq - (e - s):] = got
        return build._converter(xp, device)(ids)


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A plan's prefill waves and decoding table (see the module's laws)."""

    plan: Plan
    max_new_tokens: int
    table: np.ndarray  #: [n, width] int64 slots, row ``p`` for prompt id ``p`` (law 1)
    pages: int  #: pages a pool needs: the plan's and the decoding room's
    waves: tuple[Wave, ...]
    copy_of: np.ndarray  #: [n] the prompt a deduplicated copy reuses, -1 else (law 3)
    wave_of: np.ndarray  #: [n] the wave holding each prompt's last-token output
    lane_of: np.ndarray  #: [n] its lane in that wave

    @property
    def page_size(self) -> int:
        return self.plan.page_size

    @property
    def slots(self) -> int:
        """Rows a pool needs: ``pages * page_size``."""
        return self.pages * self.plan.page_size

    @property
    def lengths(self) -> np.ndarray:
        """Each prompt's length, by prompt id."""
        out = np.empty_like(self.plan.lengths)
        out[self.plan.order] = self.plan.lengths
        return out

    def decode_index(self, *, xp: Any = None, device: Any = None) -> CacheIndex:
        """One lane per prompt (lane ``p`` is prompt ``p``) at its last position ``len - 1``,
        over :attr:`table`: its ``advance()`` is the index of every prompt's first new token,
        at position ``len`` (law 4). Feed ``advance()``, not this index: its tokens were
        computed in the waves."""
        to = build._converter(xp, device)
        return build.make(to(self.lengths[:, None] - 1), to(self.table))

    def last(self, outputs: Sequence[Any]) -> Any:
        """Every prompt's last-token output, ``[n, ...]`` by prompt id, from ``outputs[w]``,
        the output of wave ``w`` (``[lanes, s, ...]``, its last token at ``s - 1``, as
        ``forward(..., last=True)`` gives). A deduplicated copy gets its first copy's (law 3).
        """
        from array_api_compat import array_namespace, device

        if len(outputs) != len(self.waves):
            raise ValueError(f"{_WHERE}.last: {len(outputs)} outputs for "
                             f"{len(self.waves)} waves")
        xp = array_namespace(*outputs)
        flat = xp.concat([o[:, -1, ...] for o in outputs], axis=0)
        first = np.cumsum([0] + [w.lanes for w in self.waves])
        at = first[self.wave_of] + self.lane_of
        return xp.take(flat, xp.asarray(at, device=device(flat)), axis=0)


def schedule(plan: Plan, *, max_new_tokens: int = 0) -> Schedule:
    """The prefill waves of ``plan`` and a table with room to decode ``max_new_tokens`` more
    tokens per prompt (see the module's laws). Raises ``ValueError`` for a negative
    ``max_new_tokens``, ``TypeError`` for a non-integer one or something not a plan."""
    if not isinstance(plan, Plan):
        raise TypeError(f"{_WHERE}: expected a cacheidx.prefix.Plan, got {type(plan).__name__}")
    G = arguments.integer("prefix.schedule", "max_new_tokens", max_new_tokens)
    if G < 0:
        raise ValueError(f"{_WHERE}: max_new_tokens must be >= 0, got {G}")
    n = len(plan)
    if n == 0:
        raise ValueError(f"{_WHERE}: the plan has no prompt")
    table, pages = _table(plan, G)
    copy = plan.duplicate & plan.dedupe  # aligned with order
    depth = _depth(plan)
    copy_of = np.full(n, -1, dtype=np.int64)
    copy_of[plan.order[copy]] = plan.parent[copy]
    # Plan order within a wave; copies (depth 0 here) come first and are cut off.
    depth = np.where(copy, 0, depth)
    by = np.argsort(depth, kind="stable")
    cuts = np.searchsorted(depth[by], np.arange(int(depth.max()) + 2))
    waves, wave_of, lane_of = [], np.zeros(n, np.int64), np.zeros(n, np.int64)
    for w in range(int(depth.max())):
        at = by[cuts[w + 1] : cuts[w + 2]]
        ids = plan.order[at]
        waves.append(Wave(ids, plan.shared[at], plan.lengths[at], table))
        wave_of[ids], lane_of[ids] = w, np.arange(at.size)
    src = copy_of[copy_of >= 0]
    wave_of[copy_of >= 0], lane_of[copy_of >= 0] = wave_of[src], lane_of[src]
    return Schedule(plan, G, table, pages, tuple(waves), copy_of, wave_of, lane_of)


def _depth(plan: Plan) -> np.ndarray:
    """Aligned with order: 1 for a root, one more than its parent for any other prompt.
    Pointer jumping: ``log2(depth)`` whole-array steps."""
    n = len(plan)
    where = np.empty(n, dtype=np.int64)
    where[plan.order] = np.arange(n)
    up = np.where(plan.parent >= 0, where[np.maximum(plan.parent, 0)], np.arange(n))
    depth = (plan.parent >= 0).astype(np.int64)  # edges from each to its ancestor `up`
    while True:
        further = up[up]
        if np.array_equal(further, up):
            return depth + 1
        depth = depth + depth[up]
        up = further


def _table(plan: Plan, G: int) -> tuple[np.ndarray, int]:
    """Law 1: the ``[n, width]`` table of slots by prompt id, and the pages it names."""
    P, L = plan.page_size, plan.lengths
    copy = plan.duplicate & plan.dedupe
    # Pages of room: through the page holding position len + G - 1. A prompt writes its own
    # partial last page; a copy's columns from len on go to a fresh page (none when G = 0).
    room = -(-(L + G) // P)
    fresh_from = np.where(copy, L // P, plan.npages)
    if G == 0:
        room = np.where(copy, fresh_from, room)
    fresh = np.maximum(room - fresh_from, 0)
    base = plan.pages + np.cumsum(fresh) - fresh
    pages = plan.tables()
    width = max(int(room.max()), pages.shape[1]) * P
    j = np.arange(width, dtype=np.int64)
    k = j // P
    planned = pages[:, np.minimum(k, pages.shape[1] - 1)]
    new = base[:, None] + k - fresh_from[:, None]
    page = np.where((j < L[:, None]) | (k < fresh_from[:, None]), planned, new)
    slots = np.where((j < L[:, None]) | (k < room[:, None]), page * P + j % P, -1)
    table = np.empty_like(slots)
    table[plan.order] = slots
    return table, int(plan.pages + fresh.sum())
