"""Constructors: ``make`` from tensors, and ``rows``, ``whole``, ``packed`` from lengths."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from . import _arguments as arguments
from . import backends, plan
from .index import CacheIndex

__all__ = ["make", "rows", "whole", "packed"]

_LARGEST = (1 << 63) - 1  # index tensors hold int64 (or less): no slot or position past it


def make(pos: Any, table: Any, *, row: Any = None,
         every: Iterable[tuple[int, Any]] | None = None) -> CacheIndex:
    """The index of tokens at positions ``pos`` ``[batch, seq]`` (-1 for padding) in sequences
    held at the slots ``table`` ``[rows, context]`` (-1 for an unallocated column).

    ``row`` ``[batch]`` names each lane's sequence (-1 for a lane of padding); without it lane
    ``b`` is sequence ``b`` and ``rows`` must equal ``batch``. ``every`` gives, for a layer
    keeping one entry per block of ``m`` positions, pairs ``(m, blocks)`` with ``blocks``
    ``[rows, context_m]`` naming the slot of each block.

    Raises if a shape is wrong, an axis is empty, an ``m`` is below 2 or two pairs share one.
    """
    pairs = [] if every is None else _items("make", "every", every)
    named = [("pos", pos), ("table", table)]
    named += [("row", row)] if row is not None else []
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise TypeError(f"cacheidx.make: every must hold (m, blocks) pairs, item {i} is "
                            f"{pair!r}")
        named.append((f"blocks of {pair[0]!r}", pair[1]))
    xp = arguments.namespace("make", *named)
    arguments.array("make", "pos", pos, xp, (None, None))
    arguments.array("make", "table", table, xp, (None, None))
    batch, rows_ = pos.shape[0], table.shape[0]
    if row is None:
        if rows_ != batch:
            raise arguments.fail("make", f"without row the table must have one row per lane: "
                             f"{rows_} rows for a batch of {batch}")
    else:
        arguments.array("make", "row", row, xp, (batch,))
    blocks = []
    for m, b in pairs:
        m = arguments.integer("make", "m", m)
        if m < 2:
            raise arguments.fail("make", f"an m of every is below 2: {m}")
        if m in dict(blocks):
            raise arguments.fail("make", f"two tables of blocks have m = {m}")
        blocks.append((m, arguments.array("make", f"the table of blocks of {m}", b, xp,
                                      (rows_, None))))
    arguments.one_device("make", named)
    return CacheIndex(kind="tabled", pos=pos, table=table, row=row, blocks=tuple(blocks))


def rows(context: int, lens: Any, *, every: Iterable[int] = (), xp: Any = None,
         device: Any = None) -> CacheIndex:
    """Sequence ``b`` gets its own run of ``context`` slots, ``b*context`` to
    ``b*context + context - 1``, and its ``lens[b]`` tokens sit at positions 0 to
    ``lens[b] - 1``, padded on the left to the longest (the last token of every lane is in the
    last column). Pools hold ``len(lens) * context`` slots. For each ``m`` of ``every``
    sequence ``b`` also owns ``c = ceil(context / m)`` block slots from ``b * c``.

    Raises if there is no lane, ``context`` is not positive, a length is negative or exceeds
    ``context``, or an ``m`` is below 2 or appears twice."""
    context = arguments.integer("rows", "context", context)
    if context < 1:
        raise arguments.fail("rows", f"context must be positive, got {context}")
    lens = arguments.lengths("rows", "lens", lens)
    if not lens:
        raise arguments.fail("rows", "there is no lane: lens is empty")
    for n in lens:
        if n > context:
            raise arguments.fail("rows",
                                 f"a lane of {n} tokens does not fit a context of {context}")
    ms = [arguments.integer("rows", "m", m) for m in _items("rows", "every", every)]
    for i, m in enumerate(ms):
        if m < 2:
            raise arguments.fail("rows", f"an m of every is below 2: {m}")
        if m in ms[:i]:
            raise arguments.fail("rows", f"m = {m} appears twice in every")
    batch = len(lens)
    if batch * context > _LARGEST:
        raise arguments.fail("rows", f"{batch} lanes of a context of {context} are more slots than "
                         f"int64 numbers")
    pos = _left_padded(lens, max(max(lens), 1))
    try:
        table = np.arange(batch * context).reshape(batch, context)
        blocks = []
        for m in ms:
            c = -(-context // m)
            blocks.append((m, np.arange(batch * c).reshape(batch, c)))
    except MemoryError:
        # the host's table is every slot: a context past memory is refused by name, not
        # left to a bare MemoryError
        raise arguments.fail("rows", f"{batch} lanes of a context of {context} need a table of "
                             f"{8 * batch * context} bytes, more than the host could "
                             "allocate") from None
    to = _converter(xp, device)
    index = CacheIndex(kind="tabled", pos=to(pos), table=to(table),
                       blocks=tuple((m, to(b)) for m, b in blocks))
    # the host keeps the values it built (cacheidx.plan's host-first law)
    return plan.refilled(index, [pos, table, *(b for _, b in blocks)])


def whole(batch: int, seq: int, *, lens: Any = None, xp: Any = None,
          device: Any = None) -> CacheIndex:
    """Whole sequences at positions 0 to ``seq - 1``: nothing is read and nothing is kept, so a
    layer given it leaves its cache as it was. With ``lens``, lane ``b`` holds ``lens[b]``
    tokens padded on the left.

    Raises if ``batch`` or ``seq`` is not positive or a length does not fit."""
    batch = arguments.integer("whole", "batch", batch)
    seq = arguments.integer("whole", "seq", seq)
    if batch < 1 or seq < 1:
        raise arguments.fail("whole", f"batch and seq must be positive, got batch={batch}, "
                         f"seq={seq}")
    if seq > _LARGEST:
        raise arguments.fail("whole", f"seq={seq} is more positions than int64 numbers")
    if lens is None:
        lens = [seq] * batch
    lens = arguments.lengths("whole", "lens", lens)
    if len(lens) != batch:
        raise arguments.fail("whole", f"lens names {len(lens)} lanes for a batch of {batch}")
    for n in lens:
        if n > seq:
            raise arguments.fail("whole", f"a lane of {n} tokens does not fit seq={seq}")
    pos = _left_padded(lens, seq)
    return plan.refilled(CacheIndex(kind="whole", pos=_converter(xp, device)(pos)), [pos])


def packed(seq: int, lens: Any, *, xp: Any = None, device: Any = None) -> CacheIndex:
    """Lanes that each hold several whole sequences one after another: lane ``b`` holds
    sequences of ``lens[b][0]``, ``lens[b][1]``, ... tokens, padded on the left to ``seq``;
    each sequence's tokens are at positions 0 to ``n - 1`` and see only their own sequence.

    Raises if there is no lane, ``seq`` is not positive, a length is negative or a lane's
    lengths sum past ``seq``."""
    seq = arguments.integer("packed", "seq", seq)
    if seq < 1:
        raise arguments.fail("packed", f"seq must be positive, got {seq}")
    if seq > _LARGEST:
        raise arguments.fail("packed", f"seq={seq} is more positions than int64 numbers")
    lanes = [arguments.lengths("packed", f"lens[{b}]", lane) for b, lane in enumerate(lens)]
    if not lanes:
        raise arguments.fail("packed", "there is no lane: lens is empty")
    pos = np.full((len(lanes), seq), -1, dtype=np.int64)
    for b, lane in enumerate(lanes):
        if sum(lane) > seq:
            raise arguments.fail("packed", f"lane {b} holds {sum(lane)} tokens, past seq={seq}")
        start = seq - sum(lane)
        for n in lane:
            pos[b, start:start + n] = np.arange(n)
            start += n
    return plan.refilled(CacheIndex(kind="packed", pos=_converter(xp, device)(pos)), [pos])


def _items(fn: str, name: str, items: Any) -> list:
    """``items`` as a list; a ``TypeError`` naming ``fn`` when it is no iterable."""
    if isinstance(items, str | bytes):
        raise TypeError(f"cacheidx.{fn}: {name} must be a sequence, got {items!r:.40}")
    try:
        return list(items)
    except TypeError:
        raise TypeError(f"cacheidx.{fn}: {name} must be a sequence, got "
                        f"{type(items).__name__}") from None


def _left_padded(lens: list[int], seq: int) -> np.ndarray:
    """Positions ``[len(lens), seq]``: lane ``b``'s tokens at 0..lens[b]-1, -1 before them."""
    i = np.arange(seq)[None, :]
    pos = i - (seq - np.asarray(lens, dtype=np.int64))[:, None]
    return np.where(pos >= 0, pos, -1)


def _converter(xp: Any, device: Any):
    """Build tensors in ``xp`` (a namespace or backend name; the default backend without one)
    with its default integer dtype (int32 for JAX without x64)."""
    backend = backends.get(xp)
    info = getattr(backend.xp, "__array_namespace_info__", None)
    dtype = info().default_dtypes(device=device)["integral"] if info else backend.xp.int64

    def to(a: np.ndarray) -> Any:
        return backend.from_host(a, dtype, device)

    return to
