"""The cache index: for one call, which position each token holds and which slots hold the
positions of its sequence.

The cases are one ``kind`` (``"whole"``, ``"packed"``, ``"tabled"``) plus optional parts: a
window, the block size read (``every``), a selection and a draft. Each operation branches
once on them, near the top; the laws themselves live in :mod:`cacheidx.laws`.

The index holds its fields, its structure, the indices derived from it (``window``,
``select``, ``draft``, ``every``, ``advance``), its positions and the host's values of its
tensors (``known``, read through :func:`cacheidx.plan.host`); what it computes lives in
modules of their own, which take an index: what each token sees in :mod:`cacheidx.masks`,
where a call's rows are stored and read in :mod:`cacheidx.storage`, what a call is given
checked in :mod:`cacheidx.validation`, the pytree in :mod:`cacheidx.pytree`, a pool's kind in
:mod:`cacheidx.pools`, and attention in :func:`cacheidx.attention.attend`. ``mask``,
``visible``, ``extend`` and ``attend`` are the API's facades over them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import _arguments as arguments
from . import backends, masks, pools, pytree, storage, validation
from . import plan as plans
from .plan import Plan

__all__ = ["CacheIndex", "Structure"]


class Structure(NamedTuple):
    """What a compiled program depends on beyond the index's tensors (the spec's ``walk``).

    Two indices whose tensors have the same shapes share a compiled program iff their
    structures are equal.
    """

    kind: str  #: "whole", "packed" or "tabled"
    row: bool  #: whether a row map is present
    blocks: tuple[int, ...]  #: the block size of each table of blocks, in order
    every: int  #: the block size read, 1 for positions
    window: int | None  #: the window, None when unset
    columns: bool  #: whether a selection is present
    draft: bool  #: whether a draft is present
    #: the groups a hint of shared prefixes names (:meth:`CacheIndex.share`), 0 without one
    shared: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class CacheIndex:
    """The index of ``batch`` lanes of ``seq`` tokens each. Immutable: every derived index is
    a new one. Build it with :func:`cacheidx.make`, :func:`cacheidx.rows`,
    :func:`cacheidx.whole` or :func:`cacheidx.packed`."""

    kind: str
    pos: Any
    table: Any = None
    row: Any = None
    blocks: tuple[tuple[int, Any], ...] = ()
    block: int = 1
    window_size: int | None = None
    columns: Any = None
    draft_slots: Any = None
    draft_sees: Any = None
    #: a hint of the lanes sharing prefixes (:meth:`share`), for a program traced whole:
    #: each lane's group ``[batch]`` (-1: none) and each group's width ``[groups]``
    share_lanes: Any = None
    share_widths: Any = None
    #: the adapter of the tensors' library (its :class:`~cacheidx.backends.Arrays`); static,
    #: so a compiler never looks it up
    backend: backends.Arrays = dataclasses.field(default=None, repr=False)
    #: what the host derives from the index's values for every layer (:mod:`cacheidx.plan`);
    #: every derived index starts a plan of its own (``dataclasses.replace`` never copies it),
    #: and a traced one has none (its parts are computed inside the program)
    plan: Plan | None = dataclasses.field(init=False, default=None, repr=False, compare=False)
    #: the host's values of its tensors (:func:`cacheidx.plan.host`): a constructor's, those
    #: ``advance()`` works out, a writer's word (:func:`cacheidx.plan.refilled`); like the
    #: plan, never copied by ``dataclasses.replace`` (a derived index is handed the values of
    #: the tensors it keeps: :meth:`_derived`)
    known: plans.Known = dataclasses.field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.backend is None:
            object.__setattr__(self, "backend", backends.get(self.pos))
        if not self.backend.tracing(self.pos):
            object.__setattr__(self, "plan", Plan())
        object.__setattr__(self, "known", plans.Known())

    # -- what the index is ------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return int(self.pos.shape[0])

    @property
    def seq(self) -> int:
        return int(self.pos.shape[1])

    @property
    def context(self) -> int:
        """The number of columns a token's mask runs over without a selection."""
        if self.kind != "tabled":
            return -(-self.seq // self.block)
        width = int(masks.columns_table(self).shape[1])
        return width + self.seq if self.draft_slots is not None else width

    @property
    def structure(self) -> Structure:
        return Structure(
            kind=self.kind,
            row=self.row is not None,
            blocks=tuple(m for m, _ in self.blocks),
            every=self.block,
            window=self.window_size,
            columns=self.columns is not None,
            draft=self.draft_slots is not None,
            shared=0 if self.share_widths is None else int(self.share_widths.shape[0]),
        )

    def __getstate__(self) -> dict:
        # the plan and the host values belong to this process's arrays: never pickled
        return {k: v for k, v in self.__dict__.items() if k not in ("plan", "known")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__["plan"] = None if self.backend.tracing(self.pos) else Plan()
        self.__dict__["known"] = plans.Known()

    def _derived(self, **changes: Any) -> CacheIndex:
        """``dataclasses.replace(self, **changes)``, knowing this index's host values of the
        tensors it keeps (the same arrays)."""
        nxt = dataclasses.replace(self, **changes)
        known = self.known.values
        if known:
            mine = dict(zip(pytree.leaf_names(self.structure), pytree.leaves(self), strict=True))
            for name, t in zip(pytree.leaf_names(nxt.structure), pytree.leaves(nxt), strict=True):
                if name in known and mine.get(name) is t:
                    nxt.known.values[name] = known[name]
        return nxt

    def __repr__(self) -> str:
        s = self.structure
        parts = [f"{s.kind}", f"batch={self.batch}", f"seq={self.seq}", f"context={self.context}"]
        if s.row:
            parts.append("row")
        if s.blocks:
            parts.append(f"blocks={list(s.blocks)}")
        if s.every != 1:
            parts.append(f"every={s.every}")
        if s.window is not None:
            parts.append(f"window={s.window}")
        if s.columns:
            parts.append(f"select={self.columns.shape[-1]}")
        if s.draft:
            parts.append("draft")
        if s.shared:
            parts.append(f"shared={s.shared}")
        return f"CacheIndex({', '.join(parts)})"

    # -- derived indices --------------------------------------------------------------------
    def window(self, w: int) -> CacheIndex:
        """Tokens see only the last ``w`` positions at or before their own, themselves
        included. Replaces the window the index had. Raises if ``w`` is not positive."""
        w = arguments.integer("window", "w", w)
        if w < 1:
            raise arguments.fail("window", f"w must be positive, got {w}")
        return self._derived(window_size=w)

    def select(self, columns: Any) -> CacheIndex:
        """Token ``i`` of lane ``b`` reads only the columns ``columns[b, i]``, of shape
        ``[batch, seq, k]``. Keeps the window, replaces any selection.

        Raises if ``columns`` does not have that shape, ``k`` is 0 or the index is a draft."""
        xp = arguments.namespace("select", ("pos", self.pos), ("columns", columns))
        if self.draft_slots is not None:
            raise arguments.fail("select", "a draft cannot select columns")
        if len(columns.shape) == 3 and columns.shape[2] == 0:
            raise arguments.fail("select", "k is 0: columns has shape "
                             f"{list(columns.shape)}")
        arguments.array("select", "columns", columns, xp, (self.batch, self.seq, None))
        return self._derived(columns=columns)

    def draft(self, slots: Any, sees: Any) -> CacheIndex:
        """The call's tokens are a draft verified in one call: token ``i`` stores at
        ``slots[b, i]`` and sees token ``j`` of its lane where ``sees[b, i, j]``. The columns
        are the table's, then the call's tokens. Keeps the window, replaces any draft.

        Raises if a shape is wrong, or the index is whole, reads blocks or selects columns."""
        xp = arguments.namespace("draft", ("pos", self.pos), ("slots", slots), ("sees", sees))
        if self.kind != "tabled":
            raise arguments.fail("draft", f"a {self.kind} index has no table to draft over")
        if self.block != 1:
            raise arguments.fail("draft", f"the index reads blocks of {self.block} positions")
        if self.columns is not None:
            raise arguments.fail("draft", "the index selects columns")
        arguments.array("draft", "slots", slots, xp, (self.batch, self.seq))
        arguments.array("draft", "sees", sees, xp, (self.batch, self.seq, self.seq), kind="bool")
        return self._derived(draft_slots=slots, draft_sees=sees)

    def every(self, m: int) -> CacheIndex:
        """The index read in blocks of ``m`` positions: column ``j`` is block ``j``, positions
        ``j*m`` to ``j*m + m - 1``, and stands at the block's last. Only the token closing a
        block stores. ``every(m)`` of an index already reading blocks of ``m`` is that index.

        Raises if ``m`` is not positive or, unless the index reads blocks of ``m`` already, if
        it reads another block size, selects columns, is a draft or packed, or has a table and
        none for blocks of ``m`` positions."""
        m = arguments.integer("every", "m", m)
        if m < 1:
            raise arguments.fail("every", f"m must be positive, got {m}")
        if m == self.block:
            return self
        if self.block != 1:
            raise arguments.fail("every", f"the index reads blocks of {self.block} positions, "
                             f"not {m}")
        if self.columns is not None:
            raise arguments.fail("every", "the index selects columns")
        if self.draft_slots is not None:
            raise arguments.fail("every", "the index is a draft")
        if self.kind == "packed":
            raise arguments.fail("every", "a packed index cannot read blocks")
        if self.kind == "tabled" and m not in dict(self.blocks):
            raise arguments.fail("every", f"the index has no table of blocks of {m} positions "
                             f"(it has {[b for b, _ in self.blocks]})")
        return self._derived(block=m)

    def advance(self, table: Any = None, blocks: Any = None, *,
                host: Sequence[Any] | None = None) -> CacheIndex:
        """The index of the next token of every lane: ``seq`` is 1 and the position is one
        past the lane's greatest (a lane of padding advances to 0). Keeps the window and the
        block size, drops the selection and the draft. The plan's parts follow where they can
        (:meth:`Plan.advanced <cacheidx.plan.Plan.advanced>`).

        With ``table`` (the serving engine's table after its scheduler wrote to it), the next
        token's index over ``table`` instead, the row map and positions as without it. Law:
        its plan carries this one's parts only where ``table`` holds, on every lane's row, the
        values this index's table holds at every one of its columns (compared on the host;
        ``table`` may be wider, its new columns read as they are); a table changed at an old
        column, or narrower, gets a plan made anew.

        ``blocks`` (with ``table``, where the index has tables of blocks: the engine's
        snapshots) are its tables of blocks after the scheduler wrote to them, one per ``m``
        in order, checked as ``table`` is; they take the old ones' place, and a plan's part
        that reads them is made anew.

        The next positions are computed on the host too (:func:`cacheidx.plan.host`), and
        ``host`` (with ``table``) gives the values ``table`` and ``blocks`` hold, ``[table,
        *blocks]`` in NumPy, as their writer wrote them (:func:`cacheidx.plan.refilled`'s
        word): the plan is carried by comparing those, so nothing is read back from a device.
        Without it, a new table on a device is read back once.

        Raises on a whole or packed index; with ``table``, if it is not an array of the
        index's library and dtype, of 2 axes and as many rows as the index's table, on its
        device, or if the index reads tables of blocks and ``blocks`` does not give one for
        each (they would not follow ``table``)."""
        if self.kind != "tabled":
            what = "no table to advance over" if table is not None else "no next token"
            raise arguments.fail("advance", f"a {self.kind} index has {what}")
        if blocks is not None and table is None:
            raise arguments.fail("advance", "blocks come with the table they follow: give "
                                 "table= too")
        if host is not None and table is None:
            raise arguments.fail("advance", "host gives the values of a new table: give "
                                 "table= too")
        if table is not None:
            validation.next_table(self, table, blocks)
        xp = self.backend.xp
        last = xp.max(self.pos, axis=1, keepdims=True)
        nxt = self._derived(pos=xp.clip(last, -1, None) + 1, columns=None,
                            draft_slots=None, draft_sees=None,
                            table=self.table if table is None else table,
                            blocks=self.blocks if blocks is None else tuple(
                                (m, b) for (m, _), b in zip(self.blocks, blocks)))
        if self.backend.tracing(self.pos):
            return nxt
        # the host's values of the next index: its positions worked out here, its tables
        # the writer's; taken as the host knows them, compared with no tensor: the next
        # index's first call compares its tensors in host memory with them (plan.host), so a
        # write behind the library's back is seen there, and a step's advance() costs no pass
        # over its table (issue 36.2)
        with plans.taken():
            return self._advanced_host(nxt, table, blocks, host)

    def _advanced_host(self, nxt: CacheIndex, table: Any, blocks: Any,
                       host: Sequence[Any] | None) -> CacheIndex:
        """:meth:`advance`'s host half: ``nxt``'s host values and the plan carried to it."""
        now = plans.host(self)
        nxt.known.values["tokens.pos"] = np.clip(np.max(now.pos, axis=1, keepdims=True), -1,
                                                 None) + 1
        if host is not None:
            named = ["tokens.table"]
            if blocks is not None:
                named += [f"tokens.blocks.{i}" for i in range(len(nxt.blocks))]
            given = list(host)
            if len(given) != len(named):
                raise arguments.fail("advance", f"host must hold the values of table"
                                     f"{' and of each of blocks' if blocks is not None else ''}"
                                     f" ({len(named)} arrays), got {len(given)}")
            plans.declare("advance", nxt, named, given, wrong="host's values of {short} have "
                          "shape {values}, the array {tensor}")
        # the parts that follow from this plan's
        object.__setattr__(nxt, "plan", self.plan.advanced(self, nxt))
        return nxt

    def to_device(self, device: Any) -> CacheIndex:
        """The index with every tensor placed whole on ``device`` (a JAX ``Sharding``
        included: each tensor is replicated, never cut)."""
        move = self.backend.to_device
        moved = pytree.rebuild(self.structure, [move(x, device) for x in pytree.leaves(self)],
                                   backend=self.backend)
        moved.known.values.update(self.known.values)  # the same values, elsewhere
        return moved

    # -- the call's tokens ------------------------------------------------------------------
    def positions(self) -> Any:
        """The tokens' positions clamped to 0 and the last column of the positions' table
        (``seq - 1`` without one), for rotating: padding is 0. Independent of ``every``."""
        return self._one_call(CacheIndex._positions)

    def _positions(self) -> Any:
        last = self.seq if self.table is None else int(self.table.shape[1])
        return masks.clamp(self.backend.xp, self.pos, 0, last - 1)

    # -- what each token sees: mask -----------------------------------------------------------
    def mask(self) -> Any:
        """Which columns of ``extend``'s seen each token sees: ``[batch, seq, context]``, or
        ``[batch, seq, k]`` under a selection. A token sees the columns standing at or before
        its position, under a window only the last ``w`` of them; a padded token sees none."""
        return self._one_call(masks.mask)

    def visible(self) -> Any:
        """``mask`` broadcastable to attention's ``[batch, heads, seq, context]``."""
        return self._one_call(CacheIndex._visible)

    def _visible(self) -> Any:
        return masks.mask(self)[:, None, ...]

    # -- pools: extend ------------------------------------------------------------------------
    def extend(self, values: Any, pool: Any, *, donate: bool = False) -> tuple[Any, Any]:
        """``(seen, pool')``: ``pool'`` is ``pool`` with ``values`` ``[batch, seq, ...]``
        stored where the call's tokens sit, one scatter that drops every store addressing
        nothing; ``seen`` ``[batch, context, ...]`` is what the tokens attend over, read from
        ``pool'``, with every column no token of its lane sees exactly zero. On a whole or
        packed index nothing is stored and ``pool'`` is ``pool`` itself (the object given,
        eagerly on every backend; its values, where a compiled step returns it).

        With ``donate`` the caller gives ``pool`` up and the backend writes into its memory
        where it can; without it the caller's pool is never changed. Raises if ``values`` does
        not have the shape ``[batch, seq, *pool.shape[1:]]``, or a donated pool does not own a
        row per slot (an expanded or broadcast array).

        A :class:`~cacheidx.quantized.Quantized` pool stores each row's codes and scale
        (:func:`~cacheidx.quantized.quantize`) and ``seen`` holds what they stand for, in
        float32: the call as through a float pool holding its values'
        :func:`~cacheidx.quantized.roundtrip` (:mod:`cacheidx.quantized`'s laws)."""
        validation.values(self, values, pool)
        if self.kind != "tabled":
            # a whole index stores nothing: pool' is the pool given, never a program's copy
            return self._one_call(CacheIndex._seen_whole_of, values, pool), pool
        donate = bool(donate)
        if donate:
            for part in pools.parts(pool):
                arguments.owned("extend", "pool", part)
        return self._one_call(CacheIndex._extend, values, pool, donate, donated=1, static=2)

    def _seen_whole_of(self, values: Any, pool: Any) -> Any:
        """A whole or packed index's seen (``pool`` gives only its kind: float or quantized)."""
        return storage.seen_whole(self, pools.stands_for(pool, values, self.backend.xp))

    def _extend(self, values: Any, pool: Any, donate: bool) -> tuple[Any, Any]:
        plans.follow(self)
        pool = storage.store(self, values, pool, donate)
        # the call's own values are read only under a draft (its tail of columns)
        return storage.read(self, pool, values if self.draft_slots is None
                            else pools.stands_for(pool, values, self.backend.xp)), pool

    def attend(self, q: Any, k: Any, v: Any, kpool: Any, vpool: Any, *,
               scale: float | None = None, softcap: float | None = None, sinks: Any = None,
               donate: bool = False, tile: int | None = None) -> tuple[Any, Any, Any]:
        """``(out, kpool', vpool')``: ``k`` and ``v`` ``[batch, seq, kv_heads, d]`` stored as
        ``extend`` stores them, and ``out`` ``[batch, seq, heads, dv]``, softmax attention of
        ``q`` ``[batch, seq, heads, d]`` over ``extend``'s seen under ``visible``, read from
        the pools where they are, ``tile`` columns at a time (``None``: chosen from the
        call's shape), never a lane's whole context at once. See :mod:`cacheidx.attention`
        for the law, ``scale``, ``softcap`` and ``sinks``, and what it raises.

        A facade API.md pins: it is :func:`cacheidx.attention.attend`."""
        # imported here, not at the top: attention is the floor above the index, which
        # pyproject's layers contract lets it import only in this facade (ignore_imports says
        # why), and by the time an index exists ``import cacheidx`` has imported it
        from .attention import attend

        return attend(self, q, k, v, kpool, vpool, scale=scale, softcap=softcap, sinks=sinks,
                      donate=donate, tile=tile)

    def share(self, groups: int = 1) -> CacheIndex:
        """This index with a hint of the ``groups`` groups of lanes sharing a prefix that read
        the most columns once, found on the host's values, for a program traced whole (a step
        the user jits or compiles with the index as its argument), which has no values to find
        them in. Eager calls find their groups themselves and need none. The program checks
        the hint against the index it is given (a lane that does not keep its group's columns
        reads its prefix as its own), so attend's law holds for every value of it, and one
        program serves every value; ``advance()`` and the derived indices keep it.
        ``groups=0``: the index without one.

        A facade: it is :func:`cacheidx.attention.share`, which says what it raises."""
        from .attention import share  # the floor above, as attend's facade (pyproject says)

        return share(self, groups)

    def _one_call(self, fn: Callable[..., Any], *args: Any, donated: int | None = None,
                 static: int | None = None) -> Any:
        """``fn(self, *args)``, run as the library runs an eager call best: one program of the
        whole call, kept per structure and shape, where it compiles each eager operation apart
        (JAX; :meth:`Arrays.one_program <cacheidx.backends.Arrays.one_program>`), ``fn``
        itself elsewhere and wherever a value is traced (inside the caller's own program).
        ``args[donated]`` is given up to the program where ``args[static]`` (a flag) is true;
        ``args[static]`` is part of its key."""
        backend = self.backend
        given = () if donated is None or not args[static] else (donated + 1,)
        kept = () if static is None else (static + 1,)
        run = backend.one_program(fn, donate_argnums=given, static_argnums=kept)
        if run is fn or any(backend.tracing(a) for a in (self.pos, *plans.arrays(args))):
            return fn(self, *args)
        return run(self, *args)


#: the index as a pytree node, for every library with a pytree registry
NODE = pytree.node(CacheIndex, Structure)
backends.when_made(lambda backend: backend.register(NODE))
