"""The laws every operation of an index reads, each stated once.

These helpers work on arrays of any array API library through their operators alone, so the
same line serves an eager NumPy call, a traced JAX step and a compiled torch graph. When a
law changes, one helper changes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["stands", "sees", "inside", "closes", "block_of", "expand"]


def inside(i: Any, n: int) -> Any:
    """Law: ``i`` addresses one of ``n`` rows when ``0 <= i < n``; anything else addresses
    nothing (``-1``, ``n`` and beyond, any other negative)."""
    return (i >= 0) & (i < n)


def expand(xp: Any, gate: Any, ndim: int) -> Any:
    """``gate`` [N] broadcast against rows [N, ...] of ``ndim`` axes: a row's gate is its
    every element's."""
    return xp.reshape(gate, (gate.shape[0],) + (1,) * (ndim - 1))


def stands(column: Any, m: int) -> Any:
    """Column is position: column ``j`` stands at position ``j``, and a column of a table of
    blocks of ``m`` positions at its block's last position, ``j * m + m - 1``."""
    return column if m == 1 else column * m + (m - 1)


def sees(stand: Any, t: Any, window: int | None) -> Any:
    """A token at position ``t`` sees a column standing at ``stand`` when the column stands at
    or before it and, under a window ``w``, within the last ``w`` positions: ``t - stand < w``."""
    ok = stand <= t
    # t - stand, never t - window: a window as wide as the dtype must not overflow
    return ok if window is None else ok & (t - stand < window)


def closes(t: Any, m: int) -> Any:
    """In blocks of ``m`` positions only the token that closes a block stores: ``t = j*m + m-1``."""
    return (t + 1) % m == 0


def block_of(t: Any, m: int) -> Any:
    """The block (column) a position belongs to."""
    return t if m == 1 else t // m
