"""Attention over the pools in place: ``CacheIndex.attend``.

The law. ``out, kpool', vpool' = index.attend(q, k, v, kpool, vpool)`` stores ``k`` and ``v``
exactly as ``index.extend`` stores them (bit for bit: the same scatter), and ``out`` equals
softmax attention of ``q`` over ``extend``'s seen under ``visible``::

    seen_k, kpool' = index.extend(k, kpool)
    seen_v, vpool' = index.extend(v, vpool)
    out = reference(q, seen_k, seen_v, index.mask(), scale=..., softcap=..., sinks=...)

(:func:`~cacheidx.attention.softmax.reference`) for every value of the index: rows, paged
tables, shared prefixes, lanes naming one sequence, windows, blocks of ``m``, selections,
drafts, whole and packed indices. A hole reads as a zero key with the weight of a zero score
and a zero value, a padded token's output is exactly zero, and nothing a token does not see
reaches its output, NaN included.

It never builds ``seen``: columns are read in tiles (:mod:`cacheidx.attention.tiles`) and
weighed with an online softmax (:class:`~cacheidx.attention.softmax.Online`), so a call holds
one tile's keys and scores at a time, O(batch x seq x tile) beyond its inputs and outputs.
The summation order differs from the reference's, so the two agree to a tolerance (see
docs/attention.md for its derivation), while the pools agree bit for bit.

A backend may read faster where it can (views of runs of slots, a loop the compiler keeps
rolled): :mod:`cacheidx.attention.paths` finds its fast path, and a path that does not apply
to a call leaves it to the tiles here.

``q`` is ``[batch, seq, heads, d]``, ``heads`` a multiple of the pools' ``kv_heads``; ``k``
``[batch, seq, kv_heads, d]`` and ``v`` ``[batch, seq, kv_heads, dv]``, each of its pool's
dtype; the pools ``[slots, kv_heads, d]`` and ``[slots, kv_heads, dv]``. ``scale`` multiplies
the scores (``1 / sqrt(d)`` by default), ``softcap`` caps them (``softcap * tanh(z / softcap)``,
Gemma 2), ``sinks`` ``[heads]`` is one learned logit per head in every softmax's denominator
(gpt-oss). Raises ``ValueError`` (``TypeError`` for a wrong type or dtype) naming
``cacheidx.attend`` and the value, before anything is stored.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from .. import _check as check
from . import runs, tiles
from .paths import fast
from .softmax import Online, reference

__all__ = ["Call", "attend", "reference", "standard", "stored", "tile_size"]

#: the most columns a tile reads at once, so that a tile's keys are O(batch x MOST)
MOST = 512
#: the most scores (batch x heads x seq x tile) a tile computes at once
SCORES = 1 << 22


class Call(NamedTuple):
    """One call of ``attend``, its arguments checked: what a path computes from."""

    index: Any
    q: Any
    k: Any
    v: Any
    kpool: Any
    vpool: Any
    scale: float
    softcap: float | None
    sinks: Any
    tile: int | None  #: columns a tile reads as the caller asked, None: each path chooses
    donate: bool = False

    @property
    def columns(self) -> int:
        """Columns a gathered tile reads: the caller's ``tile``, else :func:`tile_size`'s."""
        if self.tile is not None:
            return self.tile
        return tile_size(self.index.batch, self.index.seq, int(self.q.shape[2]))

    @property
    def layout(self) -> str:
        """``"token"`` under a selection (each token's own keys), ``"lane"`` otherwise."""
        return "token" if self.index.columns is not None else "lane"


def tile_size(batch: int, seq: int, heads: int) -> int:
    """Columns a tile reads: at most :data:`MOST`, and few enough that its scores stay within
    :data:`SCORES` elements (a long prefill takes narrower tiles), but at least 16."""
    return max(16, min(MOST, SCORES // max(1, batch * seq * heads)))


def attend(index: Any, q: Any, k: Any, v: Any, kpool: Any, vpool: Any, *,
           scale: float | None = None, softcap: float | None = None, sinks: Any = None,
           donate: bool = False, tile: int | None = None) -> tuple[Any, Any, Any]:
    """``index.attend``: see the module's docstring for the law. The library's fast path
    (:mod:`cacheidx.attention.paths`) computes the call where it applies; otherwise the stores,
    then views of runs of slots (:mod:`cacheidx.attention.runs`) or the tiles."""
    scale, softcap, tile = _check(index, q, k, v, kpool, vpool, scale, softcap, sinks, tile)
    call = Call(index, q, k, v, kpool, vpool, scale, softcap, sinks, tile, bool(donate))
    path = fast(index.backend)
    got = None if path is None else path.attend(call)
    if got is not None:
        return got
    call = stored(call)
    out = runs.read(call, SCORES)
    return (standard(call) if out is None else out), call.kpool, call.vpool


def stored(call: Call) -> Call:
    """``call`` with its keys and values stored in its pools, exactly as ``extend`` stores
    them (nothing on a whole index)."""
    index = call.index
    if index.kind != "tabled":
        return call
    return call._replace(kpool=index._store(call.k, call.kpool, call.donate),
                         vpool=index._store(call.v, call.vpool, call.donate))


def standard(call: Call) -> Any:
    """The output of ``call`` (its pools holding its stores), tile by tile, on the array API
    standard alone."""
    index, q = call.index, call.q
    state = Online.start(index.xp, q, call.layout, int(call.vpool.shape[-1]),
                         int(call.kpool.shape[1]), scale=call.scale, softcap=call.softcap)
    for t in tiles.read(index, call.k, call.v, call.kpool, call.vpool, call.columns):
        state.add(*t)
    return state.result(call.sinks)


def _number(name: str, x: Any, *, positive: bool) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) and not hasattr(x, "__float__"):
        raise TypeError(f"cacheidx.attend: {name} must be a real number, got {x!r}")
    if hasattr(x, "shape") and tuple(x.shape) != ():
        raise TypeError(f"cacheidx.attend: {name} must be a real number, got an array of "
                        f"shape {list(x.shape)}")
    f = float(x)
    if not math.isfinite(f) or positive and f <= 0:
        raise check.fail("attend", f"{name} must be a finite{' positive' if positive else ''} "
                         f"number, got {x!r}")
    return f


def _check(index: Any, q: Any, k: Any, v: Any, kpool: Any, vpool: Any, scale: Any,
           softcap: Any, sinks: Any, tile: Any) -> tuple[float, float | None, int | None]:
    """The call's arguments, checked: every bad one raises naming ``cacheidx.attend``."""
    backend, xp = index.backend, index.xp
    for name, x in (("q", q), ("k", k), ("v", v), ("kpool", kpool), ("vpool", vpool)):
        if not backend.same_library(x):
            raise TypeError(f"cacheidx.attend: {name} must be an array of the index's library "
                            f"({backend.name}), got {type(x).__name__}")
    for name, pool in (("kpool", kpool), ("vpool", vpool)):
        if pool.ndim != 3:
            raise check.fail("attend", f"{name} must be [slots, kv_heads, dim], got shape "
                             f"{list(pool.shape)}")
    if vpool.shape[1] != kpool.shape[1]:
        raise check.fail("attend", f"kpool has {kpool.shape[1]} kv heads but vpool "
                         f"{vpool.shape[1]}")
    index._check_extend(k, kpool, "attend", "k")
    index._check_extend(v, vpool, "attend", "v")
    kv, d = int(kpool.shape[1]), int(kpool.shape[2])
    if q.ndim != 4 or tuple(q.shape[:2]) != (index.batch, index.seq) or q.shape[3] != d:
        raise check.fail("attend", f"q must have shape [{index.batch}, {index.seq}, heads, {d}]"
                         f" (batch, seq, heads, the keys' dim), got {list(q.shape)}")
    heads = int(q.shape[2])
    if heads == 0 or heads % kv:
        raise check.fail("attend", f"q's {heads} heads are not a multiple of the pools' {kv} "
                         "kv heads")
    if not xp.isdtype(q.dtype, "real floating"):
        raise TypeError(f"cacheidx.attend: q must hold real floats, got dtype {q.dtype}")
    if sinks is not None:
        if not backend.same_library(sinks):
            raise TypeError("cacheidx.attend: sinks must be an array of the index's library "
                            f"({backend.name}), got {type(sinks).__name__}")
        if tuple(sinks.shape) != (heads,):
            raise check.fail("attend", f"sinks must have shape [{heads}] (one per head), got "
                             f"{list(sinks.shape)}")
        if not xp.isdtype(sinks.dtype, "real floating"):
            raise TypeError(f"cacheidx.attend: sinks must hold real floats, got dtype "
                            f"{sinks.dtype}")
    scale = 1.0 / math.sqrt(d) if scale is None else _number("scale", scale, positive=False)
    softcap = None if softcap is None else _number("softcap", softcap, positive=True)
    if tile is not None:
        tile = check.integer("attend", "tile", tile, least=1)
    return scale, softcap, tile
