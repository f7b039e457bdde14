"""Softmax attention, materialised (the spec's path) and online over tiles of columns.

The law both keep: the output of query ``i`` of lane ``b`` at head ``h`` is

    sum_j p_j v_j,   p_j = exp(z_j) / (sum_{j seen} exp(z_j) + exp(sink_h)),

over the columns ``j`` that ``i`` sees, with ``z_j = cap(scale * q . k_j)`` and
``cap(x) = softcap * tanh(x / softcap)`` (the identity without a softcap); without sinks the
sink's term is absent. A query that sees no column has an output of exactly zero.

What a query does not see never reaches its output, infinities included: weights and values
are selected, never multiplied by a zero, so no ``0 * inf`` can happen. A value that is not
finite (Inf or NaN) in a column ``i`` sees makes ``i``'s output at that kv head's query heads
NaN, every component, whatever the column's weight (a seen column whose ``p_j`` underflowed to
zero is still seen); one in a column ``i`` does not see changes nothing. A query that weighs no
column (it sees none, or only columns of score ``-inf``) has the output of its values alone:
zero, or NaN where one of them is not finite. NaN in, NaN out: a NaN key, score or sink makes
NaN the outputs it enters (a NaN sink every output of its head but those of queries weighing
no column, which stay as above).

:func:`reference` computes it over extend's whole ``seen``. :class:`Online` computes it a tile
of columns at a time, keeping per query a running maximum ``m``, a sum ``l`` of
``exp(z - m)`` and an output ``acc`` scaled alike (FlashAttention's online softmax): each tile
rescales what came before by ``exp(m_old - m_new)``, so no more than one tile's scores exist
at once. The sink is one more column, folded in last.

A tile's keys are of one of two kinds, ``keys_of``. ``"lane"``: shared by the lane's tokens,
``[batch, T, kv, d]``, and scores are ``[batch, kv, g, seq, T]``. ``"token"`` (a selection):
each token has keys of its own, ``[batch, seq, T, kv, d]``, scores ``[batch, seq, kv, g, T]``.
``g = heads // kv`` query heads share each key-value head (grouped-query attention).

A tile is read from pools of any kind (:mod:`cacheidx.pools`) and taken as its kind's
``factors``: floats and, where the kind has them, one scale per row. A quantized tile's
(:mod:`cacheidx.quantized`) scales are folded into the scores (``z = scale * (q . c) * s_k``)
and into the weights (``sum_j (p_j s_j) c_j``), as tpu-inference's ragged paged attention folds
them, and its codes are cast to floats a chunk at a time, so no float copy of a lane's context
is made. A tile whose product is not finite (a scale of NaN: a row that held one) is weighed
carefully over its decoded (dequantized) values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .. import pools

__all__ = ["Online", "group", "reference", "ungroup", "work_dtype"]


def work_dtype(xp: Any, dtype: Any) -> Any:
    """The dtype scores and sums are kept in: float32 for narrower floats (as FlashAttention
    accumulates half precision), the inputs' own otherwise."""
    if dtype in (xp.float32, xp.float64):
        return dtype
    return xp.float32


def _cap(xp: Any, z: Any, softcap: float | None) -> Any:
    """Gemma 2's soft-capping, ``softcap * tanh(z / softcap)``, after the scale."""
    return z if softcap is None else softcap * xp.tanh(z / softcap)


def reference(q: Any, seen_k: Any, seen_v: Any, mask: Any, *, scale: float | None = None,
              softcap: float | None = None, sinks: Any = None, product: Any = None,
              xp: Any = None) -> Any:
    """Softmax attention of ``q`` ``[batch, seq, heads, d]`` over ``extend``'s ``seen`` keys and
    values under ``mask`` (``index.mask()``), every score materialised: the law's right-hand
    side, and the spec's path. ``seen_*`` are ``[batch, context, kv, d]``, or
    ``[batch, seq, k, kv, d]`` under a selection. Returns ``[batch, seq, heads, dv]``.
    ``product(a, b)`` is the matrix product (``@`` by default)."""
    from array_api_compat import array_namespace

    xp = xp or array_namespace(q, seen_k, seen_v, mask)
    mm = product or (lambda a, b: a @ b)
    b, s, heads, d = q.shape
    kv = seen_k.shape[-2]
    g = heads // kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if seen_k.ndim == 4:
        # [b, kv, g * s, d] @ [b, kv, d, c] -> [b, kv, g, s, c]
        qh = xp.reshape(xp.permute_dims(xp.reshape(q, (b, s, kv, g, d)), (0, 2, 3, 1, 4)),
                        (b, kv, g * s, d))
        c = seen_k.shape[1]
        z = xp.reshape(mm(qh, xp.permute_dims(seen_k, (0, 2, 3, 1))), (b, kv, g, s, c))
        m = mask[:, None, None, :, :]
        sink_shape = (1, kv, g, 1, 1)
    else:
        # per token: [b, s, kv, g, d] @ [b, s, kv, d, k] -> [b, s, kv, g, k]
        z = mm(xp.reshape(q, (b, s, kv, g, d)), xp.permute_dims(seen_k, (0, 1, 3, 4, 2)))
        m = mask[:, :, None, None, :]
        sink_shape = (1, 1, kv, g, 1)
    z = _cap(xp, z * scale, softcap)
    top = xp.max(xp.where(m, z, -xp.inf), axis=-1, keepdims=True)
    sink = None if sinks is None else xp.reshape(xp.astype(sinks, z.dtype), sink_shape)
    if sink is not None:
        top = xp.maximum(top, sink)
    top = xp.where(xp.isfinite(top), top, 0.0)
    e = xp.where(m, xp.exp(z - top), 0.0)
    weighed = xp.sum(e, axis=-1, keepdims=True)  # zero: the query weighs no column
    total = weighed if sink is None else weighed + xp.exp(sink - top)
    # selected, not divided, where nothing is weighed: a NaN sink stays out of those
    w = xp.where(weighed == 0, 0.0, e / xp.where(weighed == 0, 1.0, total))
    # a value that is not finite weighs as zero, and poisons (below) only who sees it
    bad = ~xp.isfinite(seen_v)
    clean = xp.where(bad, xp.zeros((), dtype=seen_v.dtype), seen_v)
    bad = xp.astype(xp.any(bad, axis=-1), w.dtype)  # [b, c, kv] or [b, s, k, kv]
    sees = xp.astype(mask, w.dtype)
    if seen_k.ndim == 4:
        vh = xp.permute_dims(clean, (0, 2, 1, 3))
        out = xp.reshape(mm(xp.reshape(w, (b, kv, g * s, c)), vh), (b, kv, g, s, -1))
        out = xp.permute_dims(out, (0, 3, 1, 2, 4))  # [b, s, kv, g, dv]
        hits = sees @ bad  # [b, s, c] @ [b, c, kv]: seen columns holding a bad value
    else:
        out = mm(w, xp.permute_dims(clean, (0, 1, 3, 2, 4)))  # [b, s, kv, g, dv]
        hits = xp.sum(sees[..., None] * bad, axis=2)  # [b, s, kv]
    out = xp.where(hits[:, :, :, None, None] > 0, xp.nan, out)
    return xp.reshape(out, (b, s, heads, out.shape[-1]))


def group(xp: Any, q: Any, keys_of: str, kv: int, scale: float) -> Any:
    """``q`` ``[batch, seq, heads, d]`` in the work dtype, scaled, and grouped for ``keys_of``:
    ``[batch, kv, g, seq, d]`` (``"lane"``) or ``[batch, seq, kv, g, d]`` (``"token"``)."""
    b, s, heads, d = q.shape
    qg = xp.reshape(_as(xp, q, work_dtype(xp, q.dtype)), (b, s, kv, heads // kv, d)) * scale
    return xp.permute_dims(qg, (0, 2, 3, 1, 4)) if keys_of == "lane" else qg


def ungroup(xp: Any, out: Any, keys_of: str, dtype: Any) -> Any:
    """An output of ``keys_of`` (:meth:`Online.normalised`'s) as ``[batch, seq, heads, dv]`` in
    ``dtype``."""
    if keys_of == "lane":
        out = xp.permute_dims(out, (0, 3, 1, 2, 4))
    b, s, kv, g, dv = out.shape
    return _as(xp, xp.reshape(out, (b, s, kv * g, dv)), dtype)


def _as(xp: Any, x: Any, dtype: Any) -> Any:
    return x if x.dtype == dtype else xp.astype(x, dtype)


@dataclasses.dataclass
class Online:
    """The running state of one call's online softmax: queries grouped for ``keys_of``
    (:func:`group`), and per query ``m`` (the largest score so far), ``l`` and ``acc``, all
    ``None`` until a tile comes (the first tile then needs no rescaling, and a decode step's
    one tile is a plain softmax).

    ``Online.start(xp, q, keys_of, dv, kv)`` begins; ``add(keys, values, mask)`` folds in one
    tile; ``result(sinks)`` gives ``[batch, seq, heads, dv]`` in ``q``'s dtype. A caller that
    attends for several parts of a batch apart (a lane, a block of queries) groups the queries
    once, makes an ``Online`` per part from its slice, and ungroups the parts' ``normalised``
    outputs once."""

    xp: Any
    keys_of: str
    q: Any  #: the queries, grouped for ``keys_of`` (:func:`group`)
    dv: int
    softcap: float | None
    out_dtype: Any
    m: Any = None
    l: Any = None
    acc: Any = None
    #: whether some query may have seen no column (a mask came): ``l`` may then be zero
    masked: bool = False
    #: one product per kv head where a tile's lanes and heads do not fold into one batch: a
    #: library (or torch's compiler) would copy the tile to fold them, where a product per
    #: head reads it in place (docs/attention.md, "How it reads")
    split: bool = True
    #: columns a product reads at once within a tile (``None``: the whole tile): a lane's
    #: long run read a cache-sized chunk at a time, every kv head's product over one chunk
    #: before the next, reads each key from memory once (docs/attention.md, "How it reads")
    chunk: int | None = None
    #: a library's own products for one lane's views (:class:`~.paths.Products`), or None
    products: Any = None
    #: whether the tiles lie in host memory, concrete (``Backend.on_host``, false for a compiler's
    #: tracer: the backend's one tracing predicate, ``Backend.tracing``), where a tile's product is
    #: asked whether it is finite (one sum read, no wait) and weighed carefully only where it is
    #: not. Elsewhere (a device; traced) every tile is weighed carefully, its non-finite values
    #: selected out on the device (:meth:`_weigh_selected`): the host never waits on the device for
    #: the answer (:mod:`cacheidx.plan`'s host-first law). Both give one value where every value is
    #: finite: the careful product then multiplies the values unchanged
    host: bool = False

    @classmethod
    def start(cls, xp: Any, q: Any, keys_of: str, dv: int, kv: int, *, scale: float,
              softcap: float | None, host: bool = False) -> Online:
        return cls(xp, keys_of, group(xp, q, keys_of, kv, scale), dv, softcap, q.dtype,
                   host=host)

    def scores(self, keys: Any) -> Any:
        """``cap(scale * q . k)`` of every query against one tile's keys, as ``keys_of`` has them:
        ``[batch, kv, g, seq, T]`` or ``[batch, seq, kv, g, T]``."""
        xp = self.xp
        keys = _floats_as(xp, keys, self.q.dtype)
        if self.keys_of == "lane":
            b, kv, g, s, d = self.q.shape
            qh = xp.reshape(self.q, (b, kv, g * s, d))
            z = xp.concat([self._lane_scores(qh, part) for part in self._chunks(keys)],
                          axis=-1)
            z = xp.reshape(z, (b, kv, g, s, z.shape[-1]))
        else:
            floats, scales = pools.kind(keys).factors(keys, self.q.dtype, xp)
            z = self.q @ xp.permute_dims(floats, (0, 1, 3, 4, 2))
            if scales is not None:
                z = z * self._folded(scales)
        return _cap(xp, z, self.softcap)

    def _folded(self, scales: Any) -> Any:
        """A quantized tile's scales, shaped against its scores or weights: ``[batch, kv, 1, T]``
        (``"lane"``, from ``[batch, T, kv]``) or ``[batch, seq, kv, 1, T]`` (``"token"``)."""
        xp = self.xp
        s = _as(xp, scales, self.q.dtype)
        if self.keys_of == "lane":
            return xp.permute_dims(s, (0, 2, 1))[:, :, None, :]
        return xp.permute_dims(s, (0, 1, 3, 2))[:, :, :, None, :]

    def _chunks(self, x: Any) -> list[Any]:
        """``x`` ``[batch, T, ...]`` (or a quantized tile's codes and scales) cut along ``T``
        into :attr:`chunk` columns, or whole."""
        t = _columns(x)
        if self.chunk is None or t <= self.chunk:
            return [x]
        return [_cut(x, c, c + self.chunk) for c in range(0, t, self.chunk)]

    def _lane_scores(self, qh: Any, keys: Any) -> Any:
        xp = self.xp
        keys, scales = pools.kind(keys).factors(keys, qh.dtype, xp)
        if scales is not None:
            return self._lane_scores(qh, keys) * self._folded(scales)
        if self.products is not None and keys.shape[0] == 1:
            return self.products.scores(qh, keys)
        if keys.shape[0] == 1 or not self.split:  # one lane: its heads are the batch
            return qh @ xp.permute_dims(keys, (0, 2, 3, 1))
        # lanes and heads would not fold into one batch: a product per kv head
        return xp.stack([qh[:, h, ...] @ xp.permute_dims(keys[:, :, h, :], (0, 2, 1))
                         for h in range(keys.shape[2])], axis=1)

    def add(self, keys: Any, values: Any, mask: Any) -> None:
        """Fold in one tile: ``keys`` and ``values`` as ``keys_of`` has them, ``mask``
        ``[batch, seq, T]`` (``None``: every query sees every column of the tile)."""
        xp = self.xp
        if mask is None and self._fused(keys, values):
            return
        z = self.scores(keys)
        if mask is not None:
            lane = self.keys_of == "lane"
            gate = mask[:, None, None, :, :] if lane else mask[:, :, None, None, :]
            z = xp.where(gate, z, -xp.inf)
            self.masked = True
        top = xp.max(z, axis=-1, keepdims=True)
        if self.m is not None:
            top = xp.maximum(self.m, top)
        # a query that has seen nothing yet keeps -inf; exp(-inf - 0) is exactly 0
        base = top if not self.masked else xp.where(
            top == -xp.inf, xp.zeros((), dtype=top.dtype), top)
        p = xp.exp(z - base)
        total = xp.sum(p, axis=-1, keepdims=True)
        values = _floats_as(xp, values, p.dtype)
        weighed = None if not self.host else self._weigh(p, values)
        # IEEE products: a value that is not finite makes its whole column of the product
        # non-finite, whatever it is multiplied by, so a finite product had none to select
        if weighed is None or not _finite(xp, weighed):
            weighed = self._weigh_selected(p, values, mask)
        if self.m is None:
            self.l, self.acc = total, weighed
        else:
            fade = xp.exp(self.m - base)
            self.l, self.acc = self.l * fade + total, self.acc * fade + weighed
        self.m = top

    def _fused(self, keys: Any, values: Any) -> bool:
        """Fold in a tile every query sees whole by the library's fused attention over one
        lane's float views (:meth:`~.paths.Products.run`, which declines a short or not finite
        one): False, nothing done, where it does not apply. Its state is the same softmax's,
        ``l`` counted from ``exp(lse)`` (``m = lse``, ``l = 1``); only the order of the sums
        differs."""
        if (self.products is None or self.keys_of != "lane" or self.softcap is not None
                or not self.host or pools.kind(keys).cast or pools.kind(values).cast
                or pools.parts(keys)[0].shape[0] != 1):
            return False
        xp = self.xp
        b, kv, g, s, d = self.q.shape
        got = self.products.run(xp.reshape(self.q, (b, kv, g * s, d)), keys, values)
        if got is None:
            return False
        m, l, acc = got
        self.merge(xp.reshape(m, (b, kv, g, s, 1)), xp.reshape(l, (b, kv, g, s, 1)),
                   xp.reshape(acc, (b, kv, g, s, self.dv)))
        return True

    def merge(self, m: Any, l: Any, acc: Any) -> None:
        """Fold in the state ``(m, l, acc)`` of columns of their own, shaped as this state's
        (FlashInfer's ``merge_state``, in natural logs: each sum rescaled to the larger
        maximum, ``l = l_a e^(m_a - m) + l_b e^(m_b - m)``, ``acc`` alike)."""
        xp = self.xp
        if self.m is None:
            self.m, self.l, self.acc = m, l, acc
            return
        top = xp.maximum(self.m, m)
        base = top if not self.masked else xp.where(
            top == -xp.inf, xp.zeros((), dtype=top.dtype), top)
        mine, theirs = xp.exp(self.m - base), xp.exp(m - base)
        self.l, self.acc = self.l * mine + l * theirs, self.acc * mine + acc * theirs
        self.m = top

    def _weigh_selected(self, p: Any, values: Any, mask: Any) -> Any:
        """``p`` times ``values`` with every value that is not finite weighing as zero (no
        ``0 * inf``), then NaN at each query and kv head that sees a column holding one (a
        quantized tile's values dequantized first: their scales hold the NaN)."""
        xp = self.xp
        values = _as(xp, pools.decode(values, xp), p.dtype)
        bad = ~xp.isfinite(values)
        weighed = self._weigh(p, xp.where(bad, xp.zeros((), dtype=values.dtype), values))
        bad = xp.any(bad, axis=-1)  # per column and kv head: [b, T, kv] or [b, s, T, kv]
        if self.keys_of == "lane":
            if mask is None:  # every query sees every column
                hits = xp.any(bad, axis=1)[:, :, None, None, None]
            else:  # [b, s, T] @ [b, T, kv]: the bad columns each query sees
                hits = xp.astype(mask, p.dtype) @ xp.astype(bad, p.dtype) > 0
                hits = xp.permute_dims(hits, (0, 2, 1))[:, :, None, :, None]
        else:
            if mask is not None:
                bad = bad & mask[..., None]
            hits = xp.any(bad, axis=2)[..., None, None]  # [b, s, kv, 1, 1]
        return xp.where(hits, xp.full((), xp.nan, dtype=weighed.dtype, device=_device(p)),
                        weighed)

    def _weigh(self, p: Any, values: Any) -> Any:
        xp = self.xp
        if self.keys_of == "lane":
            b, kv, g, s, t = p.shape
            ph = xp.reshape(p, (b, kv, g * s, t))
            out, c = None, 0
            for part in self._chunks(values):
                w = _columns(part)
                got = self._lane_weigh(ph[..., c:c + w], part)
                out, c = got if out is None else out + got, c + w
            return xp.reshape(out, (b, kv, g, s, self.dv))
        values, scales = pools.kind(values).factors(values, p.dtype, xp)
        if scales is not None:
            p = p * self._folded(scales)
        return p @ xp.permute_dims(values, (0, 1, 3, 2, 4))

    def _lane_weigh(self, ph: Any, values: Any) -> Any:
        xp = self.xp
        values, scales = pools.kind(values).factors(values, ph.dtype, xp)
        if scales is not None:
            return self._lane_weigh(ph * self._folded(scales), values)
        if self.products is not None and values.shape[0] == 1:
            return self.products.weigh(ph, values)
        if values.shape[0] == 1 or not self.split:
            return ph @ xp.permute_dims(values, (0, 2, 1, 3))
        return xp.stack([ph[:, h, ...] @ values[:, :, h, :] for h in range(values.shape[2])],
                        axis=1)

    def normalised(self, sinks: Any = None) -> Any:
        """``acc / l`` as ``keys_of`` has them, with the sinks' column folded in; zero for a
        query that saw nothing (and for every query when no tile came)."""
        xp = self.xp
        if self.m is None:
            return xp.zeros((*self.q.shape[:-1], self.dv), dtype=self.q.dtype,
                            device=_device(self.q))
        m, l, acc = self.m, self.l, self.acc
        one = xp.ones((), dtype=l.dtype)
        if sinks is None:
            # without a mask every query saw a column of the first tile: its sum is positive
            return acc / (xp.where(l > 0, l, one) if self.masked else l)
        kv, g = self.q.shape[1:3] if self.keys_of == "lane" else self.q.shape[2:4]
        shape = (1, kv, g, 1, 1) if self.keys_of == "lane" else (1, 1, kv, g, 1)
        sink = xp.reshape(_as(xp, sinks, m.dtype), shape)
        top = xp.maximum(m, sink)
        base = xp.where(top == -xp.inf, xp.zeros((), dtype=top.dtype), top)
        fade = xp.exp(m - base)
        total = l * fade + xp.exp(sink - base)
        # a query that weighed no column keeps its values' output (selected: a NaN sink's
        # fade would reach it through 0 * nan)
        none = l == 0
        return xp.where(none, acc, acc * fade / xp.where(none, one, total))

    def result(self, sinks: Any = None) -> Any:
        """``[batch, seq, heads, dv]`` in ``q``'s dtype: :meth:`normalised`, ungrouped."""
        return ungroup(self.xp, self.normalised(sinks), self.keys_of, self.out_dtype)


def _cut(x: Any, c0: int, c1: int) -> Any:
    """Columns ``c0:c1`` of a tile's keys or values ``[batch, T, ...]``, of any kind of pool."""
    return pools.map(x, lambda a: a[:, c0:c1, ...])


def _floats_as(xp: Any, x: Any, dtype: Any) -> Any:
    """A tile of floats in ``dtype``, cast once for the whole tile; a tile of codes as it is
    (a product casts them a chunk at a time: the kind's ``cast``)."""
    return x if pools.kind(x).cast else pools.map(x, lambda a: _as(xp, a, dtype))


def _columns(x: Any) -> int:
    """The columns ``T`` of a tile's keys or values ``[batch, T, ...]`` (each part's axis 1)."""
    return int(pools.parts(x)[0].shape[1])


def _finite(xp: Any, x: Any) -> bool:
    """Whether every element of ``x`` is finite: its sum is (one reduction, a third of torch's
    isfinite-and-all on a decode step's tile; a sum that overflows only costs the careful
    product). A tensor that wants a gradient is asked without a scalar of its own, which torch
    warns about."""
    if getattr(x, "requires_grad", False):
        return bool(xp.all(xp.isfinite(x)))
    return math.isfinite(float(xp.sum(x)))


def _device(x: Any) -> Any:
    from array_api_compat import device

    return device(x)
