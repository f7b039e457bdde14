"""CuPy: indexed store on sanitised targets (CuPy wraps an outside index silently), in place
when donated; no compiler, so ``jit`` runs eagerly."""

from __future__ import annotations

from typing import Any

from .base import Backend, expand, redirect_dropped


class CupyBackend(Backend):
    name = "cupy"
    module = "cupy"
    donates = True

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

    def scatter(self, pool: Any, slots: Any, rows: Any, *, donate: bool = False) -> Any:
        if pool.shape[0] == 0 or slots.shape[0] == 0:
            return pool
        target, rows = redirect_dropped(self.xp, pool, slots, rows)
        out = pool if donate else pool.copy()
        out[target] = rows
        return out

    def gather(self, pool: Any, slots: Any, ok: Any) -> Any:
        import cupy

        if pool.shape[0] == 0:
            return cupy.zeros((slots.shape[0], *pool.shape[1:]), dtype=pool.dtype)
        got = cupy.take(pool, cupy.where(ok, slots, 0), axis=0)
        return cupy.where(expand(self.xp, ok, pool.ndim), got, 0)

    def to_device(self, x: Any, device: Any) -> Any:
        import cupy

        with cupy.cuda.Device(getattr(device, "id", device)):
            return cupy.asarray(x)

    def devices(self) -> list[Any]:
        import cupy

        return [cupy.cuda.Device(i) for i in range(cupy.cuda.runtime.getDeviceCount())]

    def device_label(self, device: Any) -> str:
        return f"cuda:{int(getattr(device, 'id', device))}"

    def matmul_mantissa(self, device: Any) -> int:
        import os

        # CuPy multiplies float32 in full precision unless CUPY_TF32 asks for TF32
        return 10 if os.environ.get("CUPY_TF32", "0") not in ("", "0") else 23

    def wrote_in_place(self, before: Any, after: Any) -> bool:
        return after.data.ptr == before.data.ptr
