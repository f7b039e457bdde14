"""Tensor parallelism of :mod:`cacheidx.models.llama`: one rank's config and weights.

Rank ``r`` of ``k`` holds query heads ``r*H/k`` to ``(r+1)*H/k - 1`` and the key-value heads
they read (``r*KV/k`` on: the groups of grouped-query attention never straddle two ranks), and
the MLP's hidden units ``r*F/k`` on. The projections into heads and hidden units are cut by
their columns (``wq``, ``wk``, ``wv``, ``w_gate``, ``w_up``), the projections out of them by
their rows (``wo``, ``w_down``); norms and the embedding are whole on every rank.

Law: with ``reduce`` summing over the ranks, ``forward(shard(params, r), split(config), ...,
reduce=reduce)`` on every rank equals ``forward(params, config, ...)``, up to the order of the
sums. Each rank's pools are ``[slots, KV/k, head_dim]``; every rank reads the same index.
"""

from __future__ import annotations

from typing import Any

from ..models.llama import Config, tree_map

__all__ = ["CUTS", "cuts", "shard", "split"]

#: the axis of each layer weight cut across ranks: 1 for columns, 0 for rows
CUTS = {"wq": 1, "wk": 1, "wv": 1, "w_gate": 1, "w_up": 1, "wo": 0, "w_down": 0}


def split(config: Config, k: int) -> Config:
    """One rank's config of ``k``: a ``k``-th of the query heads, key-value heads and hidden
    units, the same width and head size. Raises ValueError when one of them does not divide."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"cacheidx.parallel.split: the number of ranks must be a positive "
                         f"int, got {k!r}")
    for name, n in (("key-value heads", config.kv_heads), ("query heads", config.heads),
                    ("hidden units", config.hidden)):
        if n % k:
            raise ValueError(f"cacheidx.parallel.split: the model's {n} {name} do not split "
                             f"over {k} ranks (tensor parallelism needs a divisor of "
                             f"{config.kv_heads} key-value heads, {config.heads} query heads "
                             f"and {config.hidden} hidden units)")
    return Config(vocab=config.vocab, dim=config.dim, layers=config.layers,
                  heads=config.heads // k, kv_heads=config.kv_heads // k,
                  hidden=config.hidden // k, head_dim=config.head_dim,
                  rope_base=config.rope_base, eps=config.eps, tied=config.tied)


def cuts(params: dict) -> dict:
    """``params``' tree with each leaf replaced by the axis it is cut along, or None if whole."""
    return {key: ([{name: CUTS.get(name) for name in p} for p in value] if key == "layers"
                  else None) for key, value in params.items()}


def shard(params: dict, config: Config, rank: int, k: int) -> dict:
    """Rank ``rank`` of ``k``'s weights: slices (views where the library has them) of
    ``params``, an array of any library per leaf. Raises as :func:`split` does, and when the
    rank is outside ``range(k)``."""
    split(config, k)
    if not isinstance(rank, int) or not 0 <= rank < k:
        raise ValueError(f"cacheidx.parallel.shard: rank must be in range({k}), got {rank!r}")
    return tree_map(lambda w, axis: _slice(w, axis, rank, k), params, cuts(params))


def _slice(w: Any, axis: int | None, rank: int, k: int) -> Any:
    if axis is None:
        return w
    n = int(w.shape[axis])
    if n % k:  # a weight whose cut axis is not the heads' or hidden units' width
        raise ValueError(f"cacheidx.parallel.shard: a weight of shape {tuple(w.shape)} does "
                         f"not split over {k} ranks along axis {axis}")
    size = n // k
    part = slice(rank * size, (rank + 1) * size)
    return w[:, part] if axis == 1 else w[part, :]


