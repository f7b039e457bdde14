"""A Gated DeltaNet token mixer (Qwen3.5's linear-attention layer) on the array API standard,
its two states kept as :class:`cacheidx.state.Pools` under the index the model is given.

Per token ``t`` of a lane, with ``h`` the layer's normed input:

- ``u = h @ w_qkv`` (``conv_dim = 2 * key_heads * key_dim + value_heads * value_dim``) goes
  through a causal depthwise convolution of ``kernel`` taps and SiLU: ``y = silu(sum_j
  conv[j] * u_{t - kernel + 1 + j})``. Its state (``conv``) is the last ``kernel - 1`` inputs
  ``u``, ``[kernel - 1, conv_dim]``.
- ``y`` splits into ``q``, ``k`` (``key_heads`` heads of ``key_dim``) and ``v`` (``value_heads``
  of ``value_dim``); ``q`` and ``k`` are L2-normed (``x / sqrt(sum x^2 + 1e-6)``), each key
  head serves ``value_heads / key_heads`` consecutive value heads, and ``q`` is scaled by
  ``1 / sqrt(key_dim)``.
- ``g = -exp(A_log) * softplus(h @ w_a + dt_bias)``, ``beta = sigmoid(h @ w_b)``, per value
  head; the state (``recurrent``, ``[value_heads, key_dim, value_dim]``) follows the delta
  rule ``S <- exp(g) S;  S <- S + k (beta (v - k^T S))^T``, and the head's output is
  ``o = q^T S``.
- ``o`` goes through a gated RMSNorm, ``norm * o / sqrt(mean(o^2) + eps) * silu(z)`` with
  ``z = h @ w_z``, then ``w_out`` back to the model's width.

Laws of the layer (those of the states' pools are :mod:`cacheidx.state`'s):

1. **Sequential.** Each lane's tokens are computed one after another in the call's order,
   from the state :func:`cacheidx.state.start` gives; a padding token
   (``cacheidx.masks.valid(index)`` false) leaves both states as they were and outputs zero;
   a token at position 0 starts from zero (so the sequences packed in one lane never see
   each other).
2. **Stored.** The running slots get the states after each lane's last token, and each
   block the call closes the states after its closing token (:func:`cacheidx.state.store`),
   so a prompt fed in chunks, or resumed from a snapshot, computes what it computes whole.

The arithmetic is float32 (the pools' dtype) throughout, the same for a chunk and for the
whole prompt, one token at a time; only the projections, products over a batch of rows,
may round differently for other row counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import masks, state

__all__ = ["Shape", "empty_pools", "mix", "random_params", "state_bytes", "state_shapes"]


@dataclass(frozen=True)
class Shape:
    """The sizes of one Gated DeltaNet layer of a model of width ``dim``."""

    dim: int
    key_heads: int = 2
    value_heads: int = 4
    key_dim: int = 8
    value_dim: int = 8
    kernel: int = 4
    eps: float = 1e-6

    def __post_init__(self):
        for name in ("dim", "key_heads", "value_heads", "key_dim", "value_dim", "kernel"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
                raise ValueError(f"cacheidx.models.deltanet.Shape: {name} must be a positive "
                                 f"integer, got {n!r}")
        if self.kernel < 2:
            raise ValueError("cacheidx.models.deltanet.Shape: kernel must be at least 2 (its "
                             f"state is the last kernel - 1 inputs), got {self.kernel}")
        if self.value_heads % self.key_heads:
            raise ValueError(f"cacheidx.models.deltanet.Shape: {self.value_heads} value heads "
                             f"do not group over {self.key_heads} key heads")

    @property
    def keys(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def values(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.keys + self.values


def state_shapes(shape: Shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The row shapes of the layer's two states: ``conv`` ``[kernel - 1, conv_dim]`` and
    ``recurrent`` ``[value_heads, key_dim, value_dim]``."""
    return ((shape.kernel - 1, shape.conv_dim),
            (shape.value_heads, shape.key_dim, shape.value_dim))


def state_bytes(shape: Shape, itemsize: int = 4) -> int:
    """The bytes one sequence's states take in one layer (float32: ``itemsize`` 4)."""
    return itemsize * sum(math.prod(s) for s in state_shapes(shape))


def empty_pools(shape: Shape, rows: int, snapshots: int, *, xp: Any, dtype: Any = None,
                device: Any = None) -> tuple[state.Pools, state.Pools]:
    """``(conv, recurrent)``: zeroed :class:`cacheidx.state.Pools` of ``rows`` running slots
    (one per row of the table) and ``snapshots`` snapshot slots each."""
    return tuple(state.zeros(rows, snapshots, s, dtype=dtype, xp=xp, device=device)
                 for s in state_shapes(shape))


def random_params(shape: Shape, rng: np.random.Generator) -> dict:
    """Random NumPy weights of one layer (for tests), linear weights ``[in, out]``. ``A_log``
    and ``dt_bias`` as Qwen3.5 starts them (``A`` uniform in [1, 16], ``dt_bias`` near 1)."""
    c = shape

    def linear(n_in, n_out):
        return rng.standard_normal((n_in, n_out), dtype=np.float32) / np.float32(math.sqrt(n_in))

    return {
        "w_qkv": linear(c.dim, c.conv_dim),
        "w_z": linear(c.dim, c.values),
        "w_b": linear(c.dim, c.value_heads),
        "w_a": linear(c.dim, c.value_heads),
        # conv[j, c]: tap j of channel c, tap kernel - 1 on the current token
        "conv": (rng.standard_normal((c.kernel, c.conv_dim)) / math.sqrt(c.kernel)).astype(
            np.float32),
        "A_log": np.log(rng.uniform(1.0, 16.0, c.value_heads)).astype(np.float32),
        "dt_bias": (1.0 + 0.1 * rng.standard_normal(c.value_heads)).astype(np.float32),
        "norm": (1.0 + 0.1 * rng.standard_normal(c.value_dim)).astype(np.float32),
        "w_out": linear(c.values, c.dim),
    }


def _sigmoid(x, xp):
    # the clip keeps exp finite (llama's _silu says why no ``where``)
    return 1.0 / (1.0 + xp.exp(-xp.clip(x, min=-88.0)))


def _softplus(x, xp):
    return xp.maximum(x, 0.0) + xp.log1p(xp.exp(-xp.abs(x)))


def _l2norm(x, xp):
    return x / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _at(a, b):
    return a @ b


def mix(p: dict, shape: Shape, h: Any, index: Any, pools: tuple, *, mm: Any = None,
        donate: bool = False) -> tuple[Any, tuple]:
    """The layer's output ``[batch * seq, dim]`` for its normed input ``h`` ``[batch * seq,
    dim]`` (tokens flattened, as :func:`cacheidx.models.llama.layer` passes them) placed by
    ``index``, and its pools ``(conv, recurrent)`` after the call (laws 1 and 2). ``mm`` is
    the linear layers' product (``a @ b`` by default); with ``donate`` the pools are given up.
    On a library that compiles each eager operation apart (JAX) the layer is one program a
    shape, as the index's own calls are.

    Raises ``TypeError`` for ``pools`` that are no pair of :class:`cacheidx.state.Pools`, and
    ``ValueError`` naming the kind for a pool whose rows are not the layer's state
    (:func:`state_shapes`) or an ``h`` of another shape than ``[batch * seq, dim]``."""
    _check("models.deltanet.mix", shape, h, index, pools)
    be = index.backend
    mm = mm or _at
    run = be.one_program(_mix, static_argnums=(1, 5, 6),
                         donate_argnums=(4,) if donate else ())
    if run is _mix or be.tracing(h) or be.tracing(index.pos):
        return _mix(p, shape, h, index, pools, mm, donate)
    return run(p, shape, h, index, pools, mm, donate)


def _check(fn: str, shape: Shape, h: Any, index: Any, pools: Any) -> None:
    if not (isinstance(pools, tuple) and len(pools) == 2
            and all(isinstance(q, tuple) and len(q) == 2 for q in pools)):
        raise TypeError(f"cacheidx.{fn}: pools must be a pair of state.Pools (conv, "
                        f"recurrent), got {type(pools).__name__}")
    for kind, q, want in zip(("conv", "recurrent"), pools, state_shapes(shape), strict=True):
        for name, pool in zip(("running", "snapshots"), q, strict=True):
            got = tuple(getattr(pool, "shape", ()))[1:]
            if got != want:
                raise ValueError(f"cacheidx.{fn}: the {kind} {name} pool holds rows of "
                                 f"{list(got)}; the layer's {kind} state is {list(want)}")
    want = (index.batch * index.seq, shape.dim)
    if tuple(h.shape) != want:
        raise ValueError(f"cacheidx.{fn}: h must have shape {list(want)} (batch * seq, dim), "
                         f"got {list(h.shape)}")


def _mix(p, shape, h, index, pools, mm, donate):
    xp, be = index.backend.xp, index.backend
    c = shape
    b, s = index.batch, index.seq
    conv_pools, rec_pools = (state.Pools(*q) for q in pools)
    u = xp.reshape(mm(h, p["w_qkv"]), (b, s, c.conv_dim))
    z = xp.reshape(mm(h, p["w_z"]), (b, s, c.value_heads, c.value_dim))
    beta = _sigmoid(xp.reshape(mm(h, p["w_b"]), (b, s, c.value_heads)), xp)
    g = -xp.exp(p["A_log"]) * _softplus(
        xp.reshape(mm(h, p["w_a"]), (b, s, c.value_heads)) + p["dt_bias"], xp)
    decay = xp.exp(g)
    conv_s = state.start(index, conv_pools)  # [b, kernel - 1, conv_dim]
    rec_s = state.start(index, rec_pools)  # [b, value_heads, key_dim, value_dim]
    tokens, closes = state.closing(index)
    kc = int(tokens.shape[1])
    conv_closed = xp.zeros((b, kc, *conv_s.shape[1:]), dtype=conv_s.dtype, device=be.device(h))
    rec_closed = xp.zeros((b, kc, *rec_s.shape[1:]), dtype=rec_s.dtype, device=be.device(h))
    valid, first = masks.valid(index), index.pos == 0
    group = c.value_heads // c.key_heads
    outs = []
    for i in range(s):
        # a token at position 0 starts a sequence (packed lanes hold several)
        conv_s = xp.where(xp.reshape(first[:, i], (b, 1, 1)), 0.0, conv_s)
        rec_s = xp.where(xp.reshape(first[:, i], (b, 1, 1, 1)), 0.0, rec_s)
        window = xp.concat([conv_s, u[:, i:i + 1, :]], axis=1)  # [b, kernel, conv_dim]
        y = xp.sum(window * p["conv"], axis=1)
        y = y * _sigmoid(y, xp)  # SiLU
        q = _l2norm(xp.reshape(y[:, :c.keys], (b, c.key_heads, c.key_dim)), xp)
        k = _l2norm(xp.reshape(y[:, c.keys:2 * c.keys], (b, c.key_heads, c.key_dim)), xp)
        v = xp.reshape(y[:, 2 * c.keys:], (b, c.value_heads, c.value_dim))
        # each key head serves `group` consecutive value heads
        q = xp.reshape(xp.broadcast_to(q[:, :, None, :], (b, c.key_heads, group, c.key_dim)),
                       (b, c.value_heads, c.key_dim)) * (1.0 / math.sqrt(c.key_dim))
        k = xp.reshape(xp.broadcast_to(k[:, :, None, :], (b, c.key_heads, group, c.key_dim)),
                       (b, c.value_heads, c.key_dim))
        S = rec_s * decay[:, i, :, None, None]
        remembered = xp.sum(S * k[..., None], axis=-2)  # k^T S: [b, heads, value_dim]
        delta = (v - remembered) * beta[:, i, :, None]
        S = S + k[..., None] * delta[:, :, None, :]
        o = xp.sum(S * q[..., None], axis=-2)
        ok = valid[:, i]
        # padding keeps both states and outputs zero
        rec_s = xp.where(xp.reshape(ok, (b, 1, 1, 1)), S, rec_s)
        conv_s = xp.where(xp.reshape(ok, (b, 1, 1)), window[:, 1:, :], conv_s)
        outs.append(xp.where(xp.reshape(ok, (b, 1, 1)), o, 0.0))
        if kc:  # the states after a closing token are its block's snapshot
            hit = closes & (tokens == i)
            rec_closed = xp.where(xp.reshape(hit, (b, kc, 1, 1, 1)), rec_s[:, None, ...],
                                  rec_closed)
            conv_closed = xp.where(xp.reshape(hit, (b, kc, 1, 1)), conv_s[:, None, ...],
                                   conv_closed)
    o = xp.stack(outs, axis=1)  # [b, s, value_heads, value_dim]
    o = o / xp.sqrt(xp.mean(o * o, axis=-1, keepdims=True) + c.eps) * p["norm"]
    o = o * (z * _sigmoid(z, xp))
    out = mm(xp.reshape(o, (b * s, c.values)), p["w_out"])
    conv_pools = state.store(index, conv_s, conv_pools, conv_closed if kc else None,
                             donate=donate)
    rec_pools = state.store(index, rec_s, rec_pools, rec_closed if kc else None, donate=donate)
    return out, (conv_pools, rec_pools)
