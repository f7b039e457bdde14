"""One call of the engine on a backend and a device: a :class:`~cacheidx.serve.scheduler.Batch`
made into a cache index over the pools, the model called once, a token chosen per lane.

Laws of :class:`Step`:

1. The call's index is ``cacheidx.make(pos, table, row=rows)``: the scheduler's table (every
   row, as many columns as the call reads), a row map naming each lane's row, its positions.
   A lane of padding has row -1 and positions -1: it stores nothing and reads nothing.
2. Shapes (``shapes``). ``"exact"`` (eager's default): every call's own. ``"buckets"``
   (compiled's default, ``jax.jit``, ``torch.compile`` through the backend's ``jit_step``):
   lanes and table pages rounded up to a power of two (at most the scheduler's rows and
   table), prefill tokens to a power of two from 16 to the chunk, so at most
   ``len(lanes) * len(tokens) * len(pages)`` prefill programs and ``len(lanes) *
   len(pages)`` decode programs (:func:`buckets` lists each). ``"fixed"``: every call has all
   the rows as lanes, the whole chunk and the whole table: one program each, a new one only
   when a longer request widens the table. The programs of one model and backend are built
   once per process, whatever the engine. (JAX also compiles each eager operation per shape:
   eager on JAX wants buckets too.)
3. Compiled, every array a program reads stays at one address: the weights, the pools (given
   up to the program, which stores into them) and one buffer per bucket for each index
   tensor, into which each call's values are copied (``Backend.refill``). That is what a
   replayed CUDA graph needs; elsewhere it costs one small copy.
4. A decode call returns each lane's next token and ``index.advance()``'s positions; the next
   call over the same lanes is fed those, device to device, without the host. Eagerly, that
   next call's index is the last one's ``advance(table=...)`` over the scheduler's table now
   (one per group, law 6; ``advance()`` itself where that is the very table the last one read,
   its host values declared already), so its plan is carried wherever the table kept the
   columns the last one read (:meth:`cacheidx.CacheIndex.advance`), also when the table grew
   by a page since, and also across a prefill call in between (a lane joining, its prompt
   computed chunk by chunk: the decode lanes are the same); with ``debug``, its positions and
   row map are checked against the scheduler's. So a decode call makes its plan anew only where its
   batch changed (a lane joined or left: :mod:`cacheidx.serve.scheduler`'s ``follows``).
5. With ``debug``, every call's index is checked (:func:`cacheidx.check`) before the model
   reads it; a broken obligation is the engine's bug, never a request's: :class:`TableError`.
6. With ``groups`` (several groups of layers, :mod:`cacheidx.serve.groups`) the scheduler
   hands one table per group; the call makes one index per group over the same positions
   and row map, and the model is given one index per layer, its group's, and pools of its
   group's slots. Without, the model is given one index, as it always was.
7. With ``kv`` (``"int8"``, ``"int4"``) the model makes its pools quantized
   (``model.pools(weights, slots, kv=kv)``: :class:`cacheidx.quantized.Quantized` pools of
   codes and scales, a named tuple every ``tree_map``, compiler and ``Backend.refill``
   takes as two arrays). Every law above holds of them unchanged: a page's scales sit at its
   slots, so a prefix hit reads the codes and scales its first request stored.
9. Each lane's token is the argmax of its logits, the program's own choice, where every
   lane of the call is greedy without penalties; otherwise every lane's is
   :func:`cacheidx.serve.sampling.choose` of the logits under the lanes' draw
   (:func:`cacheidx.serve.sampling.draw`: its seed, sample number and step), one program
   after the model's (JAX: compiled once per shape; elsewhere the library's eager
   operations), so the model's programs and their count are the greedy engine's. A decode
   call's tokens are fed to the next call whichever chose them.
10. Compiled, a decode call's index carries the hint of the group of lanes whose shared
    prefix saves the most reads (``index.share(1)``), found on the host's table, positions
    and row map (cached while the table's version and the row map stay: a stale hint is read
    as no hint where a lane no longer keeps it), its two tensors in buffers of their own (law
    3): a program traced whole (JAX) reads that prefix once for the lanes sharing it; torch's
    operator finds its groups itself. Eager calls find theirs (their plan).
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Any

import numpy as np

import cacheidx as ci

from .. import devices, pytree
from ..devices import to_host
from ..models import llama
from ..models.llama import tree_map
from . import sampling
from .groups import Groups
from .sampling import Draw
from .scheduler import Batch

__all__ = ["Step", "TableError", "buckets", "to_host"]


class TableError(RuntimeError):
    """A call of the engine breaks an obligation of the table (:func:`cacheidx.check`): the
    scheduler's bug, raised out of the engine rather than charged to a request."""


def _power(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def buckets(most: int, least: int = 1) -> list[int]:
    """The sizes a compiled shape takes for up to ``most``: powers of two from ``least``, then
    ``most``."""
    out, n = [], min(_power(least), most)
    while n < most:
        out.append(n)
        n *= 2
    return out + [most]


@dataclasses.dataclass
class _Fed:
    """The last decode call's outputs, kept on the device for the next one."""

    key: tuple
    tokens: Any
    pos: Any  #: compiled: the next call's positions
    indices: tuple | None = None  #: eager: the call's indices, advanced by the next (law 4)


class Step:
    """Computes a scheduler's batches with ``model`` (see :mod:`cacheidx.serve.model`) on
    ``backend`` and ``device`` (a name :func:`cacheidx.devices.resolve` takes), over pools of
    ``slots`` slots, for ``lanes`` rows and prefill chunks of at most ``chunk`` tokens. With
    ``groups`` (law 6), ``slots`` is a list of each group's. ``compile``: ``True`` for the
    backend's compiler, or the name of one where the library has several (torch.compile's
    ``"aot_eager"``, say). ``kv``: ``None``, the model's float pools; ``"int8"`` or
    ``"int4"``, quantized pools (law 7)."""

    def __init__(self, model: Any, *, backend: str = "numpy", device: str | None = None,
                 compile: bool | str = False, slots: int | list[int], lanes: int, chunk: int,
                 page_size: int, keep_logits: bool = False, shapes: str | None = None,
                 debug: bool = False, groups: Groups | None = None, kv: str | None = None,
                 states: tuple[int, int] | None = None):
        llama.kv_bits("serve.Step", kv)
        shapes = shapes or ("buckets" if compile else "exact")
        if shapes not in ("exact", "buckets", "fixed"):
            raise ValueError(f"cacheidx.serve.Step: shapes must be 'exact', 'buckets' or "
                             f"'fixed', got {shapes!r}")
        be = ci.backends.get(backend)
        self.backend, self.xp = be, be.xp
        # a model placed by its own rules (a tensor-parallel group) says where inputs go
        placed = getattr(model, "device", None)
        self.device = placed if placed is not None else devices.resolve(be, device)
        self._host = getattr(model, "host", None) or to_host
        self.compiled = bool(compile)
        self.lanes, self.chunk, self.P, self.shapes_of = lanes, chunk, page_size, shapes
        self.keep_logits, self.debug = keep_logits, bool(debug)
        info = getattr(self.xp, "__array_namespace_info__", None)
        self.int = info().default_dtypes()["integral"] if info else self.xp.int64
        self.model, self.groups, self.kv, self.states = model, groups, kv, states
        self.weights = model.place(self.xp, self.device)
        self.recurrent = recurrent = set(getattr(model, "recurrent_layers", ()) or ())
        if groups is None and not recurrent:
            self.pools = _pools(model, self.weights, slots, kv)
        else:  # each layer's: its group's pages, or (law 8) a recurrent layer's pair
            of_layer = groups.of_layer if groups is not None else (0,) * len(
                getattr(model, "windows", None) or range(max(recurrent) + 1))
            sizes = slots if isinstance(slots, list) else [slots]
            # a layer's pool sizes: its group's slots, or a recurrent layer's (lanes, snapshots)
            each: list[Any] = [sizes[g] for g in of_layer] if groups is not None else [
                slots] * len(of_layer)
            if recurrent:
                if states is None:
                    raise ValueError(f"cacheidx.serve.Step: {type(model).__name__} has "
                                     f"recurrent layers {sorted(recurrent)}: give states "
                                     "(m, snapshot slots)")
                each = [(lanes, states[1]) if i in recurrent else n for i, n in enumerate(each)]
            self.pools = _pools(model, self.weights, each, kv)
        most = max(slots) if isinstance(slots, list) else slots
        pages = len(buckets(max(1, -(-most // page_size))))
        lane_sizes, token_sizes = len(buckets(lanes)), len(buckets(chunk, 16))
        #: the most programs (shapes) of each call, where bounded
        self.bound = {"fixed": {"prefill": pages, "decode": pages},
                      "buckets": {"prefill": lane_sizes * token_sizes * pages,
                                  "decode": lane_sizes * pages}}.get(shapes)
        if self.compiled:
            self.weights = tree_map(be.fix, self.weights)
            self.pools = tree_map(be.fix, self.pools)
            most = max(self.bound.values()) if self.bound else 64
            self._prefill, self._decode = _compiled(
                model, be, most, groups, compile if isinstance(compile, str) else None, kv)
        else:
            # eagerly, nothing recorded for differentiation (torch: its fast linear layers)
            self._prefill, self._decode = map(be.inference,
                                              _steps(model, self.xp, groups, eager=True))
        self._buffers: dict[tuple, Any] = {}
        self._tables: dict[int, tuple] = {}  # group -> (columns, version, array, its host's)
        self._fed: _Fed | None = None
        self._hints: dict[int, tuple] = {}  # group -> (key, lanes, widths): law 10
        self.shapes: dict[str, set] = {"prefill": set(), "decode": set()}

    @property
    def programs(self) -> int:
        """Distinct shapes called so far, compiled or not (law 2 bounds them when compiled)."""
        return sum(len(s) for s in self.shapes.values())

    def run(self, batch: Batch, table: np.ndarray | tuple, version: int | tuple,
            blocks: tuple[np.ndarray, int] | None = None
            ) -> tuple[np.ndarray, np.ndarray | None, bool]:
        """``(chosen, logits, new)``: the token each lane chose, its logits where kept, and
        whether the call had a shape not seen before (a compile, where compiled). With
        groups, ``table`` and ``version`` are tuples of each group's (law 6); with states,
        ``blocks`` is the table of blocks and its version (law 8)."""
        lanes, seq = batch.tokens.shape
        tables: tuple = table if isinstance(table, tuple) else (table,)
        versions: tuple = version if isinstance(version, tuple) else (version,)
        width = tables[0].shape[1]
        if self.shapes_of == "fixed":
            lanes_, columns = self.lanes, width
            seq_ = 1 if batch.kind == "decode" else self.chunk
        elif self.shapes_of == "buckets":
            lanes_ = min(_power(lanes), self.lanes)
            seq_ = 1 if batch.kind == "decode" else min(max(_power(seq), 16), self.chunk)
            columns = min(_power(-(-batch.columns // self.P)) * self.P, width)
        else:
            lanes_, seq_ = lanes, seq
            columns = min(-(-batch.columns // self.P) * self.P, width)
        key = (lanes_, seq_, columns)
        new = key not in self.shapes[batch.kind] and (self.compiled or not self.shapes[batch.kind])
        self.shapes[batch.kind].add(key)
        rows: np.ndarray = np.full(lanes_, -1, dtype=np.int64)
        rows[:lanes] = batch.rows
        pos: np.ndarray = np.full((lanes_, seq_), -1, dtype=np.int64)
        pos[:lanes, seq_ - seq :] = batch.pos
        tokens: np.ndarray = np.zeros((lanes_, seq_), dtype=np.int64)
        tokens[:lanes, seq_ - seq :] = batch.tokens
        fed = self._fed if batch.follows and self._fed is not None and _follows(
            self._fed, key) else None
        now = [self._table_of(g, t, columns, v)
               for g, (t, v) in enumerate(zip(tables, versions, strict=True))]
        # law 4: the host's values of each table beside it (cacheidx.plan's host-first law)
        hosts = [self._tables[g][3] for g in range(len(now))]
        if fed is not None and fed.indices is not None:  # eagerly, the plan carried (law 4)
            new_blocks = None if blocks is None else [self._blocks_of(blocks, columns)]
            # a table the last call read is declared already: advanced over it as it is
            indices = tuple(
                ix.advance() if t is ix.table and (g or new_blocks is None) else
                ix.advance(table=t, blocks=new_blocks if g == 0 else None,
                           host=[h, *(self._tables[-1][3] for _ in new_blocks or ()
                                      if g == 0)])
                for g, (ix, t, h) in enumerate(zip(fed.indices, now, hosts, strict=True)))
            if self.debug:
                self._check_fed(indices, pos, rows)
        else:
            pos_in, rows_in = self._put("pos", pos, fed and fed.pos), self._put("row", rows)
            every = [] if blocks is None else [(self._block(), self._blocks_of(blocks, columns))]
            indices = tuple(ci.make(pos_in, t, row=rows_in, every=every if g == 0 else None)
                            for g, t in enumerate(now))
            if not self.compiled:  # the values they were made from (compiled: traced)
                for g, (ix, h) in enumerate(zip(indices, hosts, strict=True)):
                    ci.plan.refilled(ix, [rows, pos, h, *(self._tables[-1][3] for _ in every
                                                          if g == 0)])
        if self.compiled and batch.kind == "decode":  # law 10
            indices = tuple(self._hinted(g, ix, rows, pos, h, v) for g, (ix, h, v) in
                            enumerate(zip(indices, hosts, versions, strict=True)))
        index = indices if self.groups is not None else indices[0]
        if self.debug:  # law 5
            for ix in indices:
                try:
                    ci.check(ix)
                except ValueError as e:
                    raise TableError(f"cacheidx.serve.Step: the {batch.kind} call breaks an "
                                     f"obligation of the table: {e}") from None
        if batch.resumes:  # law 8: a hit resumed at a junction
            self._copy(batch.resumes, "running")
        tokens_in = self._put("tokens", tokens, fed and fed.tokens)
        # eagerly, a prefill call between two decode calls leaves the decode lanes' indices
        # to their next call (law 4): a lane joining is not the others' batch changing
        waiting = self._fed if batch.kind == "prefill" and not self.compiled else None
        self._fed = fed = None  # copied: a replayed graph may now write over those outputs
        if batch.kind == "prefill":
            chosen, logits, pools = self._prefill(self.weights, tokens_in, index, self.pools)
            chosen = self._sampled(batch, chosen, logits)
            self._fed = waiting
        else:
            chosen, logits, nxt, pools = self._decode(self.weights, tokens_in, index, self.pools)
            chosen = self._sampled(batch, chosen, logits)  # law 9: fed on as the greedy are
            self._fed = _Fed(key, chosen, nxt) if self.compiled else _Fed(key, chosen, None,
                                                                          indices)
        self.pools = (tree_map(self.backend.refill, self.pools, pools) if self.compiled
                      else pools)
        if batch.keeps:  # law 8: junctions kept
            self._copy(batch.keeps, "snapshots")
        out = self._host(chosen).reshape(-1)[:lanes]
        kept = self._host(logits)[:lanes] if self.keep_logits or sampling.wants_logprobs(
            batch.lanes) else None
        return out, kept, new

    def _sampled(self, batch: Batch, chosen: Any, logits: Any) -> Any:
        """Law 9: the call's tokens, ``chosen`` (the program's argmax) where every lane is
        greedy without penalties, else :func:`cacheidx.serve.sampling.choose` of its lanes'
        draw over ``logits``, in ``chosen``'s shape and dtype."""
        d = sampling.draw(batch.lanes, int(logits.shape[0]), int(logits.shape[-1]))
        if d is None:
            return chosen
        be, xp = self.backend, self.xp
        on = Draw(*(None if a is None else be.from_host(a, getattr(xp, a.dtype.name),
                                                        self.device) for a in d))
        picked = _chooser(be, self.device)(logits, on)
        return xp.reshape(xp.astype(picked, chosen.dtype), chosen.shape)

    def _copy(self, pairs: tuple, into: str) -> None:
        """Law 8: every recurrent layer's states copied for ``(row, slot)`` ``pairs``
        (:func:`cacheidx.state.copy`), in place (compiled: into the pools' fixed buffers)."""
        def each(part: Any) -> Any:
            if isinstance(part, ci.state.Pools):
                return ci.state.copy(part, pairs, into=into, donate=not self.compiled)
            return tuple(each(p) for p in part) if isinstance(part, tuple) else part

        def copied(pools: list) -> list:
            return [each(p) if i in self.recurrent else p for i, p in enumerate(pools)]

        # as the calls run (torch: pools made under inference mode are written under it)
        got = self.backend.inference(copied)(self.pools)
        self.pools = tree_map(self.backend.refill, self.pools, got) if self.compiled else got

    def _check_fed(self, indices: tuple, pos: np.ndarray, rows: np.ndarray) -> None:
        """Law 4 with ``debug``: the advanced indices' row map is the scheduler's ``rows``, and
        their positions its ``pos`` on every lane of a request (a lane of padding advances to
        0, and reads nothing either way), as a fresh index's would be."""
        real = rows >= 0
        for ix in indices:
            if not (np.array_equal(self._host(ix.pos)[real], pos[real])
                    and np.array_equal(self._host(ix.row), rows)):
                raise TableError(f"cacheidx.serve.Step: the decode call's advanced index has "
                                 f"positions {self._host(ix.pos).tolist()} and rows "
                                 f"{self._host(ix.row).tolist()}, the scheduler's are "
                                 f"{pos.tolist()} and {rows.tolist()}")

    def _put(self, name: str, host: np.ndarray, device: Any = None) -> Any:
        """An index tensor holding ``host`` (or the device array ``device`` holding the same
        values): compiled, in this shape's fixed buffer (law 3)."""
        source = host if device is None else device
        if not self.compiled:
            if device is not None:
                return device
            return self.backend.from_host(host, self.int, self.device)
        key = (name, host.shape)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self.backend.fix(self.backend.from_host(host, self.int, self.device))
            self._buffers[key] = buffer
            if device is None:
                return buffer
        return self.backend.refill(buffer, source)

    def _hinted(self, group: int, ix: Any, rows: np.ndarray, pos: np.ndarray,
                table: np.ndarray, version: int) -> Any:
        """Law 10: ``ix`` with the hint of its lanes' longest shared prefix, found on the host's
        ``table`` (group ``group``'s, at ``version``), ``pos`` and ``rows``, its tensors in
        this shape's buffers (law 3)."""
        key = (version, table.shape, rows.tobytes())
        kept = self._hints.get(group)
        if kept is None or kept[0] != key:
            found = ci.make(pos, table, row=rows).share(1)  # NumPy: the host's own values
            kept = self._hints[group] = (key, np.asarray(found.share_lanes),
                                         np.asarray(found.share_widths))
        tensors = [*pytree.leaves(ix), self._put(f"shared.lanes {group}", kept[1]),
                   self._put(f"shared.widths {group}", kept[2])]
        return pytree.rebuild(ix.structure._replace(shared=1), tensors, backend=ix.backend)

    def _blocks_of(self, blocks: tuple[np.ndarray, int], columns: int) -> Any:
        """Law 8: the table of blocks' first ``ceil(columns / m)`` columns on the device,
        copied again only when the scheduler changed it."""
        table, version = blocks
        width = min(-(-columns // self._block()), table.shape[1])
        return self._table_of(-1, table, width, version, name="blocks")

    def _block(self) -> int:
        """Law 8: the tokens ``m`` of a block of recurrent states (a call gives blocks only
        with states)."""
        if self.states is None:
            raise ValueError("cacheidx.serve.Step.run: blocks were given to a step made "
                             "without states")
        return self.states[0]

    def _table_of(self, group: int, table: np.ndarray, columns: int, version: int,
                  name: str | None = None) -> Any:
        """Group ``group``'s table's first ``columns`` columns on the device, copied again
        only when the scheduler changed it."""
        kept = self._tables.get(group)
        if kept is not None and kept[:2] == (columns, version):
            return kept[2]
        host = np.array(table[:, :columns])  # a copy the scheduler never writes to
        array = self._put(name or ("table" if group == 0 else f"table {group}"), host)
        self._tables[group] = (columns, version, array, host)
        return array


def _pools(model: Any, weights: Any, slots: Any, kv: str | None) -> Any:
    """The model's empty pools (law 7): ``kv`` passed on only where it is given, so a model
    of float pools alone need not take it; one that takes no ``kv`` is refused by name."""
    if kv is None:
        return model.pools(weights, slots)
    try:
        given = inspect.signature(model.pools).parameters
        takes = "kv" in given or any(p.kind is p.VAR_KEYWORD for p in given.values())
    except (TypeError, ValueError):  # no signature to read: let the call say
        takes = True
    if not takes:
        raise ValueError(f"cacheidx.serve.Step: {type(model).__name__}.pools takes no kv, so "
                         f"it makes no quantized pools (kv={kv!r})")
    return model.pools(weights, slots, kv=kv)


def _follows(fed: _Fed, key: tuple) -> bool:
    """Whether a call of shape ``key`` (lanes, tokens, columns) is fed the last call's outputs:
    the same shape; eagerly (the last call's indices kept) the same lanes and tokens, its table
    maybe a page wider (``advance(table=)`` takes a wider table)."""
    if fed.indices is not None:
        return fed.key[:2] == key[:2] and fed.key[2] <= key[2]
    return fed.key == key


def _steps(model: Any, xp: Any, groups: Groups | None = None, eager: bool = False
           ) -> tuple[Any, Any]:
    """The two programs: prefill gives each lane's next token and logits; decode gives also
    the positions of the next call (law 4), or ``eager``, the index itself (the next call
    advances it, its plan with it). With ``groups`` the index is one per group, and the
    model is given each layer's (law 6)."""
    layered = groups.per_layer if groups is not None else _same

    def prefill(weights, tokens, index, pools):
        logits, pools = model.forward(weights, tokens, layered(index), pools)
        return xp.argmax(logits, axis=-1), logits, pools

    def decode(weights, tokens, index, pools):
        logits, pools = model.forward(weights, tokens, layered(index), pools)
        chosen = xp.reshape(xp.astype(xp.argmax(logits, axis=-1), tokens.dtype), (-1, 1))
        if eager:
            return chosen, logits, index, pools
        first = index[0] if groups is not None else index
        return chosen, logits, first.advance().pos, pools

    return prefill, decode


def _same(index: Any) -> Any:
    return index


_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CHOOSERS: dict = {}


def _chooser(backend: Any, device: Any) -> Any:
    """Law 9: :func:`cacheidx.serve.sampling.choose` on ``backend`` and ``device`` as one
    program of the backend's (``one_program``), made once per process."""
    key = (backend.name, repr(device))
    have = _CHOOSERS.get(key)
    if have is None:
        xp = backend.xp

        def pick(logits: Any, d: Draw) -> Any:
            return sampling.choose(xp, logits, d, device=device)

        have = _CHOOSERS[key] = backend.inference(backend.one_program(pick))
    return have


def _compiled(model: Any, backend: Any, programs: int, groups: Groups | None = None,
              compiler: str | None = None, kv: str | None = None) -> tuple[Any, Any]:
    """The model's two steps compiled for ``backend``, once per process (an engine made again
    for the same model finds its programs built), room for ``programs`` shapes each; pools of
    another ``kv`` are programs of their own."""
    kept = _PROGRAMS.setdefault(model, {})
    key = (backend.name, compiler, groups, kv)
    have = kept.get(key)
    if have is None or have[0] < programs:
        prefill, decode = _steps(model, backend.xp, groups)
        have = tuple([programs] + [backend.jit_step(step, donate_argnums=(3,), programs=programs,
                                                    compiler=compiler)
                                   for step in (prefill, decode)])
        kept[key] = have
    return have[1], have[2]


