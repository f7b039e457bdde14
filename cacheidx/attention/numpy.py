"""NumPy: the core computes every call (views of runs, or tiles); what NumPy's path adds is the
pools' memory order. Head-major pools let a lane's products read each head's keys as one
contiguous block, and the backend gathers a tile's rows a head at a time from them
(``cacheidx.backends.numpy``), so NumPy asks for them (the decode figures of both orders:
docs/performance.md, "long_context")."""

from __future__ import annotations

from typing import Any

__all__ = ["NumpyPath"]


class NumpyPath:
    def attend(self, call: Any) -> None:
        return None  # the core's views and tiles are NumPy's best

    def layout(self, pool: Any) -> str:
        return "head"
