"""NumPy: eager, and ``donate=True`` stores into the caller's array."""

from __future__ import annotations

from typing import Any

from .arrays import StandardArrays
from .base import Backend, Library, inside
from .compiling import Eager
from .hostmemory import zeroed


class NumpyLibrary(Library):
    """numpy, through array-api-compat's namespace."""

    name = "numpy"
    module = "numpy"

    def namespace(self) -> Any:
        import array_api_compat.numpy

        return array_api_compat.numpy


class NumpyArrays(StandardArrays):
    """Boolean-filtered stores (in place when donated) and takes, the kept rows found once
    by an index's plans; every array lies in host memory."""

    def on_host(self, x: Any) -> bool:
        return True

    def zeros(self, shape: tuple[int, ...], dtype: Any, device: Any = None) -> Any:
        """Zeros whose first element starts a memory page (:meth:`StandardArrays.zeros`'s
        reason), a huge page where they fill one (:mod:`~cacheidx.backends.hostmemory`): a
        view into a page more of bytes."""
        import numpy as np

        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        whole, at = zeroed(n, zeros=lambda m: np.zeros(m, np.uint8),
                           frombuffer=lambda b: np.frombuffer(b, np.uint8),
                           address=lambda a: a.ctypes.data)
        return whole[at:at + n].view(dtype).reshape(shape)

    def scatter(self, pool: Any, slots: Any, rows: Any, *, donate: bool = False) -> Any:
        keep = inside(slots, pool.shape[0])
        out = pool if donate else pool.copy(order="K")  # in its memory order
        out[slots[keep]] = rows[keep]
        return out

    def gather(self, pool: Any, slots: Any, ok: Any) -> Any:
        import numpy as np

        if pool.shape[0] == 0:
            return np.zeros((slots.shape[0], *pool.shape[1:]), dtype=pool.dtype)
        got = _take(pool, np.where(ok, slots, 0))
        if not ok.all():
            got[~ok] = 0
        return got

    def store_plan(self, slots: Any, n: int) -> Any:
        """The kept stores' slots and rows (``None``: every row is kept), found once."""
        import numpy as np

        keep = inside(slots, n)
        if keep.all():
            return slots, None
        take = np.flatnonzero(keep)
        return slots[take], take

    def store(self, pool: Any, plan: Any, rows: Any, *, donate: bool = False) -> Any:
        target, take = plan
        out = pool if donate else pool.copy(order="K")  # in its memory order
        out[target] = rows if take is None else rows[take]
        return out

    def read_plan(self, slots: Any, ok: Any, n: int) -> Any:
        """The slots to take (0 where not ``ok``) and the rows to zero (``None``: none)."""
        import numpy as np

        unseen = np.flatnonzero(~ok)
        return np.where(ok, slots, 0), (unseen if unseen.size else None)

    def read(self, pool: Any, plan: Any) -> Any:
        import numpy as np

        safe, unseen = plan
        if pool.shape[0] == 0:
            return np.zeros((safe.shape[0], *pool.shape[1:]), dtype=pool.dtype)
        got = _take(pool, safe)
        if unseen is not None:
            got[unseen] = 0
        return got


class NumpyCompiling(Eager):
    """No compiler; a donated store writes into the caller's array."""

    donates = True

    def wrote_in_place(self, before: Any, after: Any) -> bool:
        return after is before


class NumpyBackend(NumpyLibrary, NumpyArrays, NumpyCompiling, Backend):
    """NumPy: the NumPy parts over the standard's serving and checking."""


def _take(pool: Any, slots: Any) -> Any:
    """``pool[slots]``. A head-major pool (``cacheidx.attention.layout``) is taken a head's
    rows at a time from its ``[kv, slots, d]`` base: ``take`` would first copy a pool that is
    not row-major whole (docs/attention.md, "Where the bytes lie", has the cost)."""
    heads = pool.transpose(1, 0, 2) if pool.ndim == 3 else None
    if heads is not None and not pool.flags.c_contiguous and heads.flags.c_contiguous:
        return heads.take(slots, axis=1).transpose(1, 0, 2)
    return pool.take(slots, axis=0)
