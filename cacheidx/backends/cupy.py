"""CuPy: eager stores and reads in one kernel each (:mod:`cacheidx.backends.rowkernels`): the
store skips every slot outside the pool (CuPy's own indexed store would wrap ``-1`` silently),
the read is one gated load per element; in place when donated. No compiler, so ``jit`` runs
eagerly."""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from . import rowkernels
from .arrays import StandardArrays
from .base import Backend, Library, expand, redirect_dropped
from .checking import HostChecking
from .compiling import Eager


class CupyLibrary(Library):
    """CuPy, usable where a CUDA device answers."""

    name = "cupy"
    module = "cupy"

    @classmethod
    def usable(cls) -> tuple[bool, str]:
        ok, why = super().usable()
        if not ok:
            return ok, why
        try:
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # no driver, no runtime
            return False, f"no CUDA device: {type(e).__name__}: {e}"
        return (True, "") if count else (False, "no CUDA device")

    def namespace(self) -> Any:
        import array_api_compat.cupy

        return array_api_compat.cupy


class CupyArrays(StandardArrays):
    """One row kernel to store (skipping dropped rows), one to read; placement on a device."""

    # an index keeps the slots as contiguous int64 (and the gate contiguous) for every layer
    def store_plan(self, slots: Any, n: int) -> Any:
        import cupy

        return cupy.ascontiguousarray(slots, dtype=cupy.int64)

    def read_plan(self, slots: Any, ok: Any, n: int) -> Any:
        import cupy

        return cupy.ascontiguousarray(slots, dtype=cupy.int64), cupy.ascontiguousarray(ok)

    def scatter(self, pool: Any, slots: Any, rows: Any, *, donate: bool = False) -> Any:
        """One kernel storing each row at its slot, skipping a slot outside the pool (no
        redirect); the pool is copied first unless donated."""
        import cupy

        if pool.shape[0] == 0 or slots.shape[0] == 0:
            return pool
        out = pool if donate else pool.copy()
        slots = cupy.ascontiguousarray(slots, dtype=cupy.int64)
        rows = cupy.ascontiguousarray(rows)
        if not _run("cacheidx_store_rows", out, rows, (out, slots, rows),
                    extra=(out.shape[0],)):
            # a layout or size the kernel does not take: a redirected indexed store
            target, rows = redirect_dropped(self.xp, out, slots, rows)
            out[target] = rows
        return out

    def gather(self, pool: Any, slots: Any, ok: Any) -> Any:
        """One kernel: rows ``pool[slots]`` where ``ok``, all bits zero elsewhere."""
        import cupy

        out = cupy.empty((slots.shape[0], *pool.shape[1:]), dtype=pool.dtype)
        if pool.shape[0] == 0 or slots.shape[0] == 0:
            out[...] = 0
            return out
        slots = cupy.ascontiguousarray(slots, dtype=cupy.int64)
        ok = cupy.ascontiguousarray(ok)
        if _run("cacheidx_gated_rows", pool, out, (pool, slots, ok, out)):
            return out
        got = cupy.take(pool, cupy.where(ok, slots, 0), axis=0)
        return cupy.where(expand(self.xp, ok, pool.ndim), got, 0).astype(pool.dtype)

    def to_device(self, x: Any, device: Any) -> Any:
        import cupy

        with cupy.cuda.Device(getattr(device, "id", device)):
            return cupy.asarray(x)


class CupyCompiling(Eager):
    """No compiler; a donated store writes into the caller's array."""

    donates = True

    def wrote_in_place(self, before: Any, after: Any) -> bool:
        return after.data.ptr == before.data.ptr


class CupyChecking(HostChecking):
    """CUDA devices only; float32 products in full precision unless ``CUPY_TF32``."""

    host = False
    cuda = True

    def devices(self) -> list[Any]:
        import cupy

        return [cupy.cuda.Device(i) for i in range(cupy.cuda.runtime.getDeviceCount())]

    def device_label(self, device: Any) -> str:
        from ..devices import label

        return label("cuda", getattr(device, "id", device))

    def matmul_mantissa(self, device: Any) -> int:
        import os

        # CuPy multiplies float32 in full precision unless CUPY_TF32 asks for TF32
        return 10 if os.environ.get("CUPY_TF32", "0") not in ("", "0") else 23


class CupyBackend(CupyLibrary, CupyArrays, CupyCompiling, CupyChecking, Backend):
    """CuPy: the CuPy parts, one per concern."""


def _address(a: Any) -> int:
    return a.data.ptr


def _run(name: str, pool: Any, rows: Any, arrays: tuple, extra: tuple = ()) -> bool:
    """Launch the kernel ``name`` over the rows of ``rows`` (stored or read) where it takes
    them (C-contiguous pool, sizes within its ints); whether it ran."""
    import numpy as np

    if not (pool.flags.c_contiguous and rows.flags.c_contiguous):
        return False
    row_bytes = pool.itemsize * math.prod(pool.shape[1:])
    how = rowkernels.launch(rows.shape[0], row_bytes, (_address(pool), _address(rows)),
                            slots=pool.shape[0])
    if how is None:
        return False
    scalars = (rows.shape[0], how.words, *extra, how.group)
    _kernel(name, how.word)((how.grid,), (how.block,),
                            (*arrays, *(np.int32(s) for s in scalars)))
    return True


@cache
def _kernel(name: str, word: int) -> Any:
    import cupy

    return cupy.RawKernel(rowkernels.source(word), name)
