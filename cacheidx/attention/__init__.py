"""Attention over the pools in place: ``CacheIndex.attend``.

The laws, numbered as the spec numbers the index's (other modules say which they keep):

1. **Stores.** ``out, kpool', vpool' = index.attend(q, k, v, kpool, vpool)`` stores ``k`` and
   ``v`` exactly as ``index.extend`` stores them, bit for bit: the same scatter.
2. **Output.** ``out`` equals softmax attention of ``q`` over ``extend``'s seen under
   ``visible``, for every value of the index (rows, paged tables, shared prefixes, lanes naming
   one sequence, windows, blocks of ``m``, selections, drafts, whole and packed indices)::

       seen_k, kpool' = index.extend(k, kpool)
       seen_v, vpool' = index.extend(v, vpool)
       out = reference(q, seen_k, seen_v, index.mask(), scale=..., softcap=..., sinks=...)

   (:func:`~cacheidx.attention.softmax.reference`), to the tolerance docs/attention.md
   derives: the summation order differs from the reference's.
3. **Holes.** A hole reads as a zero key with the weight of a zero score and a zero value.
4. **Padding.** A padded token's output is exactly zero.
5. **Unseen.** Nothing a token does not see reaches its output, NaN and infinities included
   (weights and values are selected, never multiplied by a zero).
6. **In place.** It never builds ``seen``: columns are read in tiles
   (:mod:`cacheidx.attention.tiles`) or as views of runs of slots
   (:mod:`cacheidx.attention.runs`) and weighed with an online softmax
   (:class:`~cacheidx.attention.softmax.Online`), so a call holds one tile's keys and scores
   at a time, O(batch x seq x tile) beyond its inputs and outputs.
7. **Paths.** A library's path (:mod:`cacheidx.attention.paths`: one compiled program, a
   compiler's rolled loop, an operator) keeps laws 1 to 6; one that does not apply to a call
   leaves it to the core here.

``q`` is ``[batch, seq, heads, d]``, ``heads`` a multiple of the pools' ``kv_heads``; ``k``
``[batch, seq, kv_heads, d]`` and ``v`` ``[batch, seq, kv_heads, dv]``, each of its pool's
dtype; the pools ``[slots, kv_heads, d]`` and ``[slots, kv_heads, dv]``. ``scale`` multiplies
the scores (``1 / sqrt(d)`` by default), ``softcap`` caps them (``softcap * tanh(z / softcap)``,
Gemma 2), ``sinks`` ``[heads]`` is one learned logit per head in every softmax's denominator
(gpt-oss). Either pool may be quantized (:class:`~cacheidx.quantized.Quantized`: codes and
scales, ``k`` or ``v`` then of any real float dtype): the call is then the call through float
pools holding its rows' round trip (:mod:`cacheidx.quantized`'s law Q2), its tiles dequantized
as they are read (their scales folded into scores and weights). Raises ``ValueError``
(``TypeError`` for a wrong type or dtype) naming ``cacheidx.attend`` and the value, before
anything is stored.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from .. import _arguments as arguments
from .. import backends, pools, storage, validation
from .. import plan as plans
from . import runs, shared, tiles
from .paths import fast
from .shared import share
from .softmax import Online, reference, work_dtype

__all__ = ["Call", "attend", "reference", "share", "standard", "stored", "tile_size"]

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
    def tile_width(self) -> int:
        """Columns a gathered tile reads: the caller's ``tile``, else :func:`tile_size`'s."""
        if self.tile is not None:
            return self.tile
        return tile_size(self.index.batch, self.index.seq, int(self.q.shape[2]))

    @property
    def keys_of(self) -> str:
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
    scale, softcap, tile = _check(index, q, k, v, kpool, vpool, scale, softcap, sinks, tile,
                                  donate)
    call = Call(index, q, k, v, kpool, vpool, scale, softcap, sinks, tile, bool(donate))
    path = fast(index.backend)
    got = None if path is None else path.attend(call)
    if got is not None:
        return got
    plans.follow(index)  # the plan every layer reads, made anew where the host's values changed
    call = stored(call)
    out = runs.read(call, SCORES)
    return (standard(call) if out is None else out), call.kpool, call.vpool


def stored(call: Call) -> Call:
    """``call`` with its keys and values stored in its pools, exactly as ``extend`` stores
    them (nothing on a whole index)."""
    index = call.index
    stored = call
    if index.kind == "tabled":
        stored = call._replace(kpool=storage.store(index, call.k, call.kpool, call.donate),
                               vpool=storage.store(index, call.v, call.vpool, call.donate))
    if index.kind != "tabled" or index.draft_slots is not None:
        # the columns read from the call's own keys and values: as the pools give them back
        stored = stored._replace(k=pools.stands_for(call.kpool, call.k, index.backend.xp),
                                 v=pools.stands_for(call.vpool, call.v, index.backend.xp))
    return stored


def standard(call: Call) -> Any:
    """The output of ``call`` (its pools holding its stores), tile by tile, on the array API
    standard alone; eagerly, a prefix lanes share read once for all of them
    (:mod:`.shared`), each lane's tiles reading its columns past it."""
    index, q = call.index, call.q
    state = Online.start(index.backend.xp, q, call.keys_of, int(call.vpool.shape[-1]),
                         int(call.kpool.shape[1]), scale=call.scale, softcap=call.softcap,
                         host=index.backend.on_host(q))
    share = shared.groups(call)
    offsets = shared.offsets(index.batch, share) if share else None
    for t in tiles.read(index, call.k, call.v, call.kpool, call.vpool, call.tile_width,
                        offsets):
        state.add(*t)
    if share:
        state.masked = True  # a lane may weigh none of its own columns, nor a prefix
        state.merge(*shared.states(call, state.q, share))
    return state.result(call.sinks)


def _number(name: str, x: Any, info: Any, *, positive: bool) -> float:
    """``x`` as a float, finite in the scores' dtype (``info``, its ``finfo``). A softcap
    must also keep ``z / softcap`` among that dtype's normal numbers wherever it matters:
    at least the smallest normal, at most ``eps / smallest_normal`` (float32: about 1e31),
    past which a score below ``eps`` divided by it is subnormal, which XLA flushes to zero (a
    cap of 1e38 was then off by 1.6 on JAX) and others round coarsely. Without a cap, pass
    ``softcap=None``."""
    if isinstance(x, bool) or not isinstance(x, int | float) and not hasattr(x, "__float__"):
        raise TypeError(f"cacheidx.attend: {name} must be a real number, got {x!r}")
    if hasattr(x, "shape") and tuple(x.shape) != ():
        raise TypeError(f"cacheidx.attend: {name} must be a real number, got an array of "
                        f"shape {list(x.shape)}")
    f = float(x)
    if not math.isfinite(f) or positive and f <= 0:
        raise arguments.fail("attend", f"{name} must be a finite{' positive' if positive else ''} "
                         f"number, got {x!r}")
    dtype = getattr(info, "dtype", None) or f"{info.bits}-bit float"
    if abs(f) > float(info.max):
        raise arguments.fail("attend", f"{name} must be finite in the scores' dtype ({dtype}, at "
                         f"most {float(info.max):.4g}), got {x!r}")
    if positive:
        least, most = float(info.smallest_normal), float(info.eps / info.smallest_normal)
        if not least <= f <= most:
            raise arguments.fail("attend", f"{name} must be from {least:.4g} to {most:.4g} for "
                             f"{dtype} scores (past it, scores divided by it fall below "
                             f"{dtype}'s normal numbers; no cap is {name}=None), got {x!r}")
    return f


def _check(index: Any, q: Any, k: Any, v: Any, kpool: Any, vpool: Any, scale: Any,
           softcap: Any, sinks: Any, tile: Any, donate: bool = False
           ) -> tuple[float, float | None, int | None]:
    """The call's arguments, checked: every bad one raises naming ``cacheidx.attend``.

    One array for both pools is a call like any other when not donated (keys and values are
    each stored into a copy of it, and read from their own: ``extend`` on each). Donated, the
    values would be stored over the keys: refused, as is a donated pool of which several
    elements share memory (a stride of 0, as ``expand`` and ``broadcast_to`` make), into
    which a store would write one row into several slots."""
    backend, xp = index.backend, index.backend.xp
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not backend.same_library(x):
            raise TypeError(f"cacheidx.attend: {name} must be an array of the index's library "
                            f"({backend.name}), got {type(x).__name__}")
    for name, pool in (("kpool", kpool), ("vpool", vpool)):
        pools.kind(pool).check("attend", name, pool, backend)
    for name, pool in (("kpool", kpool), ("vpool", vpool)):
        if pool.ndim != 3:
            raise arguments.fail("attend", f"{name} must be [slots, kv_heads, dim], got shape "
                             f"{list(pool.shape)}")
    if vpool.shape[1] != kpool.shape[1]:
        raise arguments.fail("attend", f"kpool has {kpool.shape[1]} kv heads but vpool "
                         f"{vpool.shape[1]}")
    if 0 in (int(kpool.shape[1]), int(kpool.shape[2]), int(vpool.shape[2])):
        raise arguments.fail("attend", "pools must have at least one kv head and a head dim of at "
                         f"least 1, got kpool {list(kpool.shape)} and vpool "
                         f"{list(vpool.shape)}")
    if donate:
        if kpool is vpool:
            raise arguments.fail("attend", "kpool and vpool are one array: donated, the values "
                             "would be stored over the keys; pass a pool of its own for each, "
                             "or donate=False")
        for name, pool in (("kpool", kpool), ("vpool", vpool)):
            for part in pools.parts(pool):
                arguments.owned("attend", name, part)
    validation.values(index, k, kpool, "attend", "k")
    validation.values(index, v, vpool, "attend", "v")
    kv, d = int(kpool.shape[1]), int(kpool.shape[2])
    if q.ndim != 4 or tuple(q.shape[:2]) != (index.batch, index.seq) or q.shape[3] != d:
        raise arguments.fail("attend", f"q must have shape [{index.batch}, {index.seq}, heads, {d}]"
                         f" (batch, seq, heads, the keys' dim), got {list(q.shape)}")
    heads = int(q.shape[2])
    if heads == 0 or heads % kv:
        raise arguments.fail("attend", f"q's {heads} heads are not a multiple of the pools' {kv} "
                         "kv heads")
    if not xp.isdtype(q.dtype, "real floating"):
        raise TypeError(f"cacheidx.attend: q must hold real floats, got dtype {q.dtype}")
    if sinks is not None:
        if not backend.same_library(sinks):
            raise TypeError("cacheidx.attend: sinks must be an array of the index's library "
                            f"({backend.name}), got {type(sinks).__name__}")
        if tuple(sinks.shape) != (heads,):
            raise arguments.fail("attend", f"sinks must have shape [{heads}] (one per head), got "
                             f"{list(sinks.shape)}")
        if not xp.isdtype(sinks.dtype, "real floating"):
            raise TypeError(f"cacheidx.attend: sinks must hold real floats, got dtype "
                            f"{sinks.dtype}")
    # scale and softcap meet the scores in the dtype they are kept in (float32 for halves)
    info = xp.finfo(work_dtype(xp, q.dtype))
    scale = 1.0 / math.sqrt(d) if scale is None else _number("scale", scale, info,
                                                            positive=False)
    softcap = None if softcap is None else _number("softcap", softcap, info, positive=True)
    if tile is not None:
        tile = arguments.integer("attend", "tile", tile, least=1)
    return scale, softcap, tile


# a library's path made with its backend: a compiler tracing a call could not import it
backends.when_made(fast)
