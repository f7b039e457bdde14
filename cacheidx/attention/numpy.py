"""NumPy: the core computes every call (views of runs, or tiles) but a decode step over paged
pools, which the CPU kernel reads (:mod:`cacheidx.attention.paged`); what NumPy's path adds
beside it is the pools' memory order. Head-major pools let a lane's products read each head's
keys as one contiguous block, and the backend gathers a tile's rows a head at a time from them
(``cacheidx.backends.numpy``), so NumPy asks for them (the decode figures of both orders:
docs/performance.md, "long_context")."""

from __future__ import annotations

from typing import Any

__all__ = ["NumpyPath"]


class NumpyPath:
    def attend(self, call: Any) -> tuple[Any, Any, Any] | None:
        # a decode step is the paged kernel's where it applies (:mod:`.paged`); every other
        # call the core's views and tiles
        from . import paged

        return paged.attend(call)

    def layout(self, pool: Any) -> str:
        return "head"
