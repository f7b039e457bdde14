"""The engine's choice of tokens, written once on the array API: the counter-based generator
(:func:`mix`, :func:`lane_key`, :func:`uniform`), the per-lane arrays a step is fed
(:class:`Draw`) and the choice made of them (:func:`choose`). It lies on the library's lowest
floor (NumPy alone), so that the law suite (:mod:`cacheidx.conformance`) and the engine
(:mod:`cacheidx.serve.sampling`, which says what a request asks and re-exports these names)
both read it from below.

Laws (numbered as :mod:`cacheidx.serve.sampling`'s, which states them whole):

1. **A sampled token is a function of the lane's logits, the request's seed, its sample
   number and its step alone**: the same whatever else is in the batch, on every backend and
   compile mode. The random numbers are a counter-based generator written once on the array
   API (:func:`mix`, a 32-bit integer hash in int32 arithmetic, which every library wraps
   alike; no library's own generator): vocabulary entry ``j`` of a lane draws
   ``uniform(key, j)`` from its key ``lane_key(seed, sample, step)``, and the token is the
   Gumbel-max over the filtered logits, which draws from their softmax.
2. **Temperature 0 is greedy**: the argmax of the logits (plus the penalties where asked).
3. **The filters** (``top_k``, then ``top_p`` among those, and ``min_p``) cut each lane's
   logits at the highest of their three cuts, ties at the cut all kept.
4. **Penalties** arrive as ``Draw.bias``, added to the logits before the temperature.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Draw", "choose", "lane_key", "mix", "uniform"]


# -- law 1: the counter-based generator, on the array API ------------------------------------
def _i32(c: int) -> int:
    """A 32-bit constant as the int32 holding its bits."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _shr(x: Any, s: int) -> Any:
    """A logical right shift of int32 bits (``>>`` of a negative int32 copies its sign)."""
    return (x >> s) & ((1 << (32 - s)) - 1)


def mix(x: Any) -> Any:
    """A 32-bit integer hash (Wellons' lowbias32) of int32 ``x``, elementwise, in int32: a
    product wraps modulo 2**32 on every library, and shifts are made logical, so the bits are
    those of the unsigned hash everywhere. A bijection of the 2**32 values."""
    x = x ^ _shr(x, 16)
    x = x * 0x7FEB352D
    x = x ^ _shr(x, 15)
    x = x * _i32(0x846CA68B)
    return x ^ _shr(x, 16)


def lane_key(seed: Any, sample: Any, step: Any) -> np.ndarray:
    """Law 1: each lane's key (int32) from its ``seed`` (below 2**64), ``sample`` and
    ``step`` (each below 2**31), on the host: the hash chained over the seed's two halves,
    the sample and the step."""
    seed = np.asarray(seed, dtype=np.uint64)
    lo = (seed & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
    hi = (seed >> np.uint64(32)).astype(np.uint32).view(np.int32)
    h = mix(lo ^ np.int32(_i32(0x9E3779B9)))
    for word in (hi, np.asarray(sample, np.int32), np.asarray(step, np.int32)):
        h = mix(h ^ word)
    return h


def uniform(xp: Any, key: Any, vocab: int, device: Any = None) -> Any:
    """Law 1: ``[lanes, vocab]`` float32 uniforms in (0, 1), entry ``j`` of lane ``b`` a hash
    of ``key[b]`` and ``j`` alone: 23 bits, ``(2m + 1) / 2**24``, exact in float32, never 0
    or 1."""
    j = xp.arange(vocab, dtype=xp.int32, device=device)
    h = mix(mix(j ^ _i32(0x85EBCA6B))[None, :] ^ key[:, None])
    h = mix(h + key[:, None])
    m = xp.astype(_shr(h, 9), xp.float32)
    return (2.0 * m + 1.0) * (2.0 ** -24)


class Draw(NamedTuple):
    """The per-lane arrays a sampled call is fed (inputs, so a compiled step never recompiles
    for a request): ``temperature``, ``top_p``, ``min_p`` float32 ``[lanes]``; ``top_k``
    int32 ``[lanes]`` (0: every token; ``top_k`` and ``top_p`` both ``None`` where no lane
    filters by rank, which spares the sort and chooses the same tokens); ``key`` int32
    ``[lanes]`` (:func:`lane_key`);
    ``bias`` float32 ``[lanes, vocab]``, the penalties (law 4), or ``None`` where no lane
    has any. A lane of padding is greedy."""

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    key: Any
    bias: Any = None


def choose(xp: Any, logits: Any, d: Draw, device: Any = None) -> Any:
    """Laws 1 to 4: each lane's token (``[lanes]``, the index dtype of ``xp.argmax``) of
    ``logits`` (``[lanes, vocab]`` or ``[lanes, 1, vocab]``) under its draw ``d`` (arrays of
    ``xp`` on ``device``), written once on the array API: ``xp`` is the caller's namespace,
    nothing looked up from an array, so it runs eagerly or traced (``jax.jit``,
    ``torch.compile``) alike."""
    lanes, vocab = logits.shape[0], logits.shape[-1]
    z = xp.reshape(xp.astype(logits, xp.float32), (lanes, vocab))
    if d.bias is not None:
        z = z + d.bias
    greedy = xp.argmax(z, axis=-1)  # law 2: temperature 0
    hot = d.temperature > 0
    one = xp.ones_like(d.temperature)  # where's branches as arrays (torch.compile asks)
    # shifted to the lane's largest before the division, so a small temperature sends the
    # others to -inf, never inf - inf
    top = xp.max(z, axis=-1, keepdims=True)
    s = (z - top) / xp.where(hot, d.temperature, one)[:, None]
    floor = xp.where(d.min_p > 0, xp.log(xp.where(d.min_p > 0, d.min_p, one)),
                     -xp.full_like(one, math.inf))  # min_p: s_j >= log(min_p), s's max 0
    if d.top_k is None:  # no rank filters: a cut at the lowest kept, which every s passes
        return _gumbel(xp, s, floor, hot, greedy, d.key, vocab, device)
    ranked = xp.sort(s, axis=-1, descending=True)
    place = xp.arange(vocab, dtype=xp.int32, device=device)[None, :]
    whole = xp.full_like(d.top_k, vocab)
    k = xp.where((d.top_k > 0) & (d.top_k < whole), d.top_k, whole)
    in_k = place < k[:, None]
    p = xp.where(in_k, xp.exp(ranked - ranked[:, :1]), xp.zeros_like(ranked))
    p = p / xp.sum(p, axis=-1, keepdims=True)  # the softmax among the top k
    before = xp.cumulative_sum(p, axis=-1) - p  # the mass above each ranked token
    kept = in_k & ((before < d.top_p[:, None]) | (d.top_p[:, None] >= 1.0))
    never = xp.full_like(ranked, -math.inf)
    cutoff = -xp.max(xp.where(kept, -ranked, never), axis=-1)
    return _gumbel(xp, s, xp.maximum(cutoff, floor), hot, greedy, d.key, vocab, device)


def _gumbel(xp: Any, s: Any, cutoff: Any, hot: Any, greedy: Any, key: Any, vocab: int,
            device: Any) -> Any:
    """Law 1's Gumbel-max over the logits ``s`` at or above each lane's ``cutoff``; the
    greedy token where the lane is not ``hot``. (``s``'s largest is 0: the min_p floor,
    ``p_j >= min_p * p_max``, is ``s_j >= log(min_p)``, no log of 0 taken.)"""
    g = -xp.log(-xp.log(uniform(xp, key, vocab, device=device)))
    drawn = xp.argmax(xp.where(s >= cutoff[:, None], s + g, xp.full_like(s, -math.inf)),
                      axis=-1)
    return xp.where(hot, drawn, greedy)
