"""PyTorch: static-shape scatter with drop, in place when donated; ``torch.compile``.

Every operation here keeps shapes static and never reads a tensor's value on the host (no
boolean indexing, no ``.item()``), so one compiled graph serves every position and table and
``torch.compile(fullgraph=True)`` sees no break. torch raises on an index outside a tensor and
wraps ``-1``; none of that reaches the user: stores go through
:func:`~cacheidx.backends.base.redirect_dropped`, reads through an index made safe first.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .base import Backend, expand, redirect_dropped


class TorchBackend(Backend):
    name = "torch"
    module = "torch"
    compiles = True
    donates = True
    modes = ("compiled", "dynamic", "automatic")
    #: the torch.compile backend ``jit`` uses; the conformance suite sets it per run
    compiler = "inductor"

    def namespace(self) -> Any:
        import array_api_compat.torch

        return array_api_compat.torch

    def scatter(self, pool: Any, slots: Any, rows: Any, *, donate: bool = False) -> Any:
        """One indexed store of the tokens' rows. A store outside the pool is sent where it
        repeats a store that happens anyway (``redirect_dropped``), so it can neither raise,
        wrap ``-1`` to the last slot, nor clobber a real write at slot 0. Donated, the rows go
        into the caller's storage (``index_put_``; compiled by inductor, a store into the input
        buffer): the cost is in the tokens, never in the slots. Otherwise the pool is copied."""
        if pool.shape[0] == 0 or slots.shape[0] == 0:
            return pool
        target, rows = redirect_dropped(self.xp, pool, slots, rows)
        if donate:
            return pool.index_put_((target,), rows)
        return pool.index_put((target,), rows)

    def gather(self, pool: Any, slots: Any, ok: Any) -> Any:
        """Rows ``pool[slots]`` where ``ok``, exactly zero elsewhere.

        Compiled, or under autograd (the values of a training step through a whole index) or
        a functorch transform: an index select under a ``where``, which inductor fuses into
        one gated load. Eager: the select, then only the rows not read filled with zero by index
        (``index_fill_``), where a ``where`` or ``masked_fill_`` would make a second pass over
        every row. On the CPU the rows to fill are found on the host (``nonzero``: no device
        to wait for); elsewhere the select goes into a buffer with one spare row, and every
        row read names the spare instead, so that no shape depends on a value."""
        import torch

        n = slots.shape[0]
        if pool.shape[0] == 0:
            return pool.new_zeros((n, *pool.shape[1:]))
        safe = torch.where(ok, slots, 0)
        if _traced(pool):
            return torch.where(expand(self.xp, ok, pool.ndim), pool.index_select(0, safe), 0)
        if _on_host(pool, ok):
            return pool.index_select(0, safe).index_fill_(0, torch.nonzero(~ok)[:, 0], 0)
        out = pool.new_empty((n + 1, *pool.shape[1:]))
        torch.index_select(pool, 0, safe, out=out[:n])
        rows = torch.arange(n, device=slots.device)
        return out.index_fill_(0, torch.where(ok, n, rows), 0)[:n]  # rows read: the spare

    def jit(self, fn: Callable, *, donate_argnums: Sequence[int] = (),
            mode: str = "compiled") -> Callable:
        """``torch.compile(fn, fullgraph=True)`` with ``compiler`` as its backend, and shapes
        static (``mode="compiled"``: one program per shape and structure, never per value),
        symbolic (``"dynamic"``) or static until a shape changes (``"automatic"``, torch's
        default). Donation is torch's default: a compiled step mutates what it is handed, as
        eager does, so ``donate_argnums`` has nothing to add."""
        import torch

        dynamic = {"compiled": False, "dynamic": True, "automatic": None}[mode]
        return torch.compile(fn, backend=self.compiler, fullgraph=True, dynamic=dynamic)

    @contextlib.contextmanager
    def many_programs(self) -> Iterator[None]:
        import torch

        with torch._dynamo.config.patch(recompile_limit=4096,
                                        accumulated_recompile_limit=65536):
            yield

    def device_label(self, device: Any) -> str:
        from ..devices import label

        return label(device.type, device.index)

    @contextlib.contextmanager
    def highest_precision(self) -> Iterator[None]:
        import torch

        before = torch.get_float32_matmul_precision()
        cudnn = torch.backends.cudnn.allow_tf32
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)
            torch.backends.cudnn.allow_tf32 = cudnn

    def matmul_mantissa(self, device: Any) -> int:
        import torch

        if device.type == "cpu":  # the CPU kernels compute float32 in float32
            return 23
        return {"highest": 23, "high": 10, "medium": 7}[torch.get_float32_matmul_precision()]

    def jit_step(self, fn: Callable, *, donate_argnums: Sequence[int] = (),
                 programs: int = 8) -> Callable:
        """``jit``, and with inductor ``mode="reduce-overhead"``: on CUDA each shape's program
        is recorded once as a CUDA graph and replayed, reading the arrays given to ``fix`` in
        place (the others are copied into the graph's own buffers each call). Every shape
        bucket is one more program of the same code, so dynamo may keep ``programs`` of them
        (its default is 8, after which it would run eagerly)."""
        import torch
        import torch._dynamo.config as dynamo

        dynamo.recompile_limit = max(dynamo.recompile_limit, programs)
        if self.compiler != "inductor":
            return torch.compile(fn, backend=self.compiler, fullgraph=True, dynamic=False)
        compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)

        def step(*args: Any) -> Any:
            # each call is a new iteration: the previous call's outputs are read already
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*args)

        step._torchdynamo_orig_callable = fn  # where programs() counts them
        return step

    def fix(self, x: Any) -> Any:
        import torch

        torch._dynamo.mark_static_address(x)
        return x

    def refill(self, buffer: Any, values: Any) -> Any:
        """``buffer`` holding ``values``, copied in (no copy where ``values`` is ``buffer``'s
        memory, as a pool a compiled step stored into is)."""
        import torch

        if not isinstance(values, torch.Tensor):
            values = torch.from_numpy(values)
        elif values.data_ptr() == buffer.data_ptr() and values.shape == buffer.shape:
            return buffer
        return buffer.copy_(values)

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

    def tracing(self, x: Any) -> bool:
        import torch

        return torch.compiler.is_compiling() or isinstance(
            x, torch._subclasses.fake_tensor.FakeTensor)

    def programs(self, jitted: Callable) -> int | None:
        # dynamo keeps one cache entry per program on the compiled function's code
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        fn = getattr(jitted, "_torchdynamo_orig_callable", jitted)
        return len(_debug_get_cache_entry_list(fn.__code__))

    def forget(self) -> None:
        import torch
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()

    def wrote_in_place(self, before: Any, after: Any) -> bool:
        return after.data_ptr() == before.data_ptr()

    def register(self, cls: type) -> None:
        """``cls`` as a node of ``torch.utils._pytree``: the tensors are its children (keyed by
        the spec's walk paths, which ``torch.export`` needs), the structure and backend its
        context, which serialises as JSON so that ``torch.export.save`` takes it."""
        import torch
        import torch.utils._pytree as pytree

        from ..index import Structure, _flatten, _leaf_names, _unflatten
        from . import get

        if cls in pytree.SUPPORTED_NODES:
            return
        # torch.export.load unpickles example inputs weights-only: allow the index's parts
        torch.serialization.add_safe_globals([cls, Structure, get])

        def flatten_with_keys(index: Any) -> tuple[list[tuple[Any, Any]], Any]:
            leaves, static = _flatten(index)
            keys = [pytree.MappingKey(name) for name in _leaf_names(static[0])]
            return list(zip(keys, leaves, strict=True)), static

        pytree.register_pytree_node(
            cls,
            _flatten,
            lambda leaves, static: _unflatten(static, leaves),
            serialized_type_name="cacheidx.CacheIndex",
            to_dumpable_context=_dump_context,
            from_dumpable_context=_load_context,
            flatten_with_keys_fn=flatten_with_keys,
        )


def _dump_context(static: tuple[Any, Backend]) -> str:
    structure, backend = static
    return json.dumps({"structure": structure._asdict(), "backend": backend.name})


def _load_context(text: str) -> tuple[Any, Backend]:
    from ..index import Structure
    from . import get

    d = json.loads(text)
    s = d["structure"]
    return Structure(**{**s, "blocks": tuple(s["blocks"])}), get(d["backend"])


def _traced(pool: Any) -> bool:
    """Whether a read must stay one functional expression: under a compiler, where autograd
    records ``pool``, or under a functorch transform (vmap, grad)."""
    import torch

    return (torch.compiler.is_compiling() or (pool.requires_grad and torch.is_grad_enabled())
            or torch._C._are_functorch_transforms_active())


def _on_host(*tensors: Any) -> bool:
    """Whether a value-dependent shape costs nothing: plain CPU tensors (no fake or functional
    ones), read eagerly."""
    import torch

    return all(type(x) is torch.Tensor and x.device.type == "cpu" for x in tensors)
