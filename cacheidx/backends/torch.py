"""PyTorch: static-shape scatter with drop, in place when donated; ``torch.compile``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .base import Backend, expand, redirect_dropped


class TorchBackend(Backend):
    name = "torch"
    module = "torch"
    compiles = True
    donates = True
    #: the torch.compile backend ``jit`` uses; the conformance suite sets it per run
    compiler = "inductor"

    def namespace(self) -> Any:
        import array_api_compat.torch

        return array_api_compat.torch

    def scatter(self, pool: Any, slots: Any, rows: Any, *, donate: bool = False) -> Any:
        # torch raises on an outside index and wraps -1: give it targets it cannot misread
        if pool.shape[0] == 0 or slots.shape[0] == 0:
            return pool
        target, rows = redirect_dropped(self.xp, pool, slots, rows)
        if donate:
            return pool.index_put_((target,), rows)
        return pool.index_put((target,), rows)

    def gather(self, pool: Any, slots: Any, ok: Any) -> Any:
        import torch

        if pool.shape[0] == 0:
            return pool.new_zeros((slots.shape[0], *pool.shape[1:]))
        got = pool.index_select(0, torch.where(ok, slots, 0))
        return torch.where(expand(self.xp, ok, pool.ndim), got, 0)

    def jit(self, fn: Callable, *, donate_argnums: Sequence[int] = ()) -> Callable:
        import torch

        # donation is torch's default: a compiled step mutates the tensors it is handed
        return torch.compile(fn, backend=self.compiler, fullgraph=True, dynamic=False)

    def to_device(self, x: Any, device: Any) -> Any:
        return x.to(device)

    def device(self, x: Any) -> Any:
        return x.device

    def devices(self) -> list[Any]:
        import torch

        found = [torch.device("cpu")]
        if torch.cuda.is_available():
            found += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return found

    def register(self, cls: type) -> None:
        import torch.utils._pytree as pytree

        from ..index import _flatten, _unflatten

        if cls in pytree.SUPPORTED_NODES:
            return
        pytree.register_pytree_node(
            cls,
            _flatten,
            lambda leaves, static: _unflatten(static, leaves),
            serialized_type_name="cacheidx.CacheIndex",
        )
