"""NumPy: eager, and ``donate=True`` stores into the caller's array."""

from __future__ import annotations

from typing import Any

from .base import Backend, inside


class NumpyBackend(Backend):
    name = "numpy"
    module = "numpy"
    donates = True

    def namespace(self) -> Any:
        import array_api_compat.numpy

        return array_api_compat.numpy

    def scatter(self, pool: Any, slots: Any, rows: Any, *, donate: bool = False) -> Any:
        keep = inside(slots, pool.shape[0])
        out = pool if donate else pool.copy()
        out[slots[keep]] = rows[keep]
        return out

    def gather(self, pool: Any, slots: Any, ok: Any) -> Any:
        import numpy as np

        if pool.shape[0] == 0:
            return np.zeros((slots.shape[0], *pool.shape[1:]), dtype=pool.dtype)
        got = pool.take(np.where(ok, slots, 0), axis=0)
        if not ok.all():
            got[~ok] = 0
        return got

    def wrote_in_place(self, before: Any, after: Any) -> bool:
        return after is before
