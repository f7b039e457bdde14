"""PyTorch: static-shape scatter with drop, in place when donated; ``torch.compile``.

Every operation here keeps shapes static and never reads a tensor's value on the host (no
boolean indexing, no ``.item()``), so one compiled graph serves every position and table and
``torch.compile(fullgraph=True)`` sees no break. torch raises on an index outside a tensor and
wraps ``-1``; none of that reaches the user: traced stores go through
:func:`~cacheidx.backends.base.redirect_dropped`, reads through an index made safe first. Eager
stores and reads use plans an index keeps for every layer (the kept rows and the rows to zero,
found on the host on the CPU) and, on CUDA, one kernel each (``cacheidx::store_rows_``,
``cacheidx::gated_rows``): each way of storing or reading a plan is a class with its own
``store`` or ``read``.

The adapter is composed of one part per concern (:mod:`cacheidx.backends.base`):
:class:`TorchLibrary`, :class:`TorchArrays`, :class:`TorchCompiling`, :class:`TorchServing` and
:class:`TorchChecking`.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from ..laws import expand, inside
from . import onednn, torch_rows
from .arrays import StandardArrays, redirect_dropped
from .base import Backend, Library, Node
from .checking import HostChecking
from .compiling import Eager
from .hostmemory import zeroed
from .serving import Composed, PlainServing

__all__ = ["TorchArrays", "TorchBackend", "TorchChecking", "TorchCompiling", "TorchLibrary",
           "TorchServing"]


# -- the plans an eager index keeps for every layer: one class per way, each its own store --
class HostStore(NamedTuple):
    """On the CPU: the kept rows found once on the host, ``take`` the rows kept (``None``
    when all are) and ``target`` their slots; a store is the hand-written ``index_copy_``."""

    slots: Any
    target: Any
    take: Any = None

    def store(self, pool: Any, rows: Any, donate: bool) -> Any:
        if self.take is not None:
            rows = rows.index_select(0, self.take)
        # not donated, a clone keeps the pool's memory order (index_copy's result would be
        # row-major whatever the pool's: cacheidx.attention.layout)
        return (pool if donate else pool.clone()).index_copy_(0, self.target, rows)


class DeviceStore(NamedTuple):
    """On a device: ``target`` the slots as int64, for the ``cacheidx::store_rows_`` op, which
    skips a dropped row itself, in one kernel."""

    slots: Any
    target: Any

    def store(self, pool: Any, rows: Any, donate: bool) -> Any:
        import torch

        out = pool if donate else pool.clone()
        torch.ops.cacheidx.store_rows_(out, self.target, rows)
        return out


class TracedStore(NamedTuple):
    """Traced slots: the store stays one functional expression (:func:`_scatter_functional`)."""

    slots: Any
    xp: Any

    def store(self, pool: Any, rows: Any, donate: bool) -> Any:
        return _scatter_functional(self.xp, pool, self.slots, rows, donate)


class HostRead(NamedTuple):
    """On the CPU: ``safe`` slots to select, ``unseen`` the rows to zero (``None`` when none
    is): a select, then ``index_fill_`` of those rows only."""

    slots: Any
    ok: Any
    safe: Any
    unseen: Any = None

    def read(self, pool: Any) -> Any:
        if pool.ndim == 3 and pool.stride(1) >= pool.shape[0] * pool.stride(0) > 0:
            # a head-major pool: each head's rows gathered from its own block, kept head-major
            # (a select along the slots of the strided view runs at half the speed, and leaves
            # the tile token-major for the products that read it head by head)
            got = pool.permute(1, 0, 2).index_select(1, self.safe).permute(1, 0, 2)
        else:
            got = pool.index_select(0, self.safe)
        return got if self.unseen is None else got.index_fill_(0, self.unseen, 0)


class DeviceRead(NamedTuple):
    """On a device: ``safe`` the slots as int64 and ``ok`` contiguous, for the
    ``cacheidx::gated_rows`` op (one gated load per element)."""

    slots: Any
    ok: Any
    safe: Any

    def read(self, pool: Any) -> Any:
        import torch

        return torch.ops.cacheidx.gated_rows(pool, self.safe, self.ok)


class TracedRead(NamedTuple):
    """Traced slots: an index select under a ``where`` (:func:`_gather_functional`)."""

    slots: Any
    ok: Any
    xp: Any

    def read(self, pool: Any) -> Any:
        return _gather_functional(self.xp, pool, self.slots, self.ok)


class TorchLibrary(Library):
    """torch, through array-api-compat's namespace; the index a ``torch.utils._pytree`` node."""

    name = "torch"
    module = "torch"

    def namespace(self) -> Any:
        import array_api_compat.torch

        return array_api_compat.torch

    def register(self, node: Node) -> None:
        """``node`` as a node of ``torch.utils._pytree``: the tensors are its children (keyed by
        the spec's walk paths, which ``torch.export`` needs), the static value its context,
        which serialises as JSON so that ``torch.export.save`` takes it."""
        import torch
        import torch.utils._pytree as pytree

        from . import get

        if node.cls in pytree.SUPPORTED_NODES:
            return
        # torch.export.load unpickles example inputs weights-only: allow the node's parts
        torch.serialization.add_safe_globals([node.cls, *node.safe, get])

        def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
            leaves, static = node.flatten(obj)
            keys = [pytree.MappingKey(name) for name in node.keys(static)]
            return list(zip(keys, leaves, strict=True)), static

        pytree.register_pytree_node(
            node.cls,
            node.flatten,
            lambda leaves, static: node.unflatten(static, leaves),
            serialized_type_name="cacheidx.CacheIndex",
            to_dumpable_context=node.dump,
            from_dumpable_context=node.load,
            flatten_with_keys_fn=flatten_with_keys,
        )


class TorchArrays(StandardArrays):
    """Static-shape stores with drop and gated reads; eagerly through an index's plans (one
    class per way: :class:`HostStore`, :class:`DeviceStore`, :class:`TracedStore` and their
    reads), functional wherever :meth:`_functional` says so."""

    def scatter(self, pool: Any, slots: Any, rows: Any, *, donate: bool = False) -> Any:
        """One indexed store of the tokens' rows; a store outside the pool stores nothing.
        Eagerly, through ``store_plan`` and ``store``. Where it must stay functional
        (:meth:`_functional`), a store outside the pool is sent where it repeats a store that
        happens anyway (``redirect_dropped``), so it can neither raise, wrap ``-1`` to the last
        slot, nor clobber a real write at slot 0; donated, the rows go into the caller's storage
        (``index_put_``; compiled by inductor, a store into the input buffer): the cost is in
        the tokens, never in the slots. Otherwise the pool is copied."""
        if pool.shape[0] == 0 or slots.shape[0] == 0:
            return pool
        if self._functional(pool, rows, slots):
            return _scatter_functional(self.xp, pool, slots, rows, donate)
        return self.store(pool, self.store_plan(slots, pool.shape[0]), rows, donate=donate)

    def take(self, x: Any, at: Any, axis: int = 0) -> Any:
        """``index_select``: array-api-compat's take adds a fix of negative indices (three more
        operations in every compiled graph) that the core's never need."""
        return x.index_select(axis, at)

    def gather(self, pool: Any, slots: Any, ok: Any) -> Any:
        """Rows ``pool[slots]`` where ``ok``, exactly zero elsewhere.

        Where it must stay functional (compiled, under autograd: the values of a training step
        through a whole index; a functorch transform): an index select under a ``where``, which
        inductor fuses into one gated load. Eagerly, through ``read_plan`` and ``read``."""
        if pool.shape[0] == 0:
            return pool.new_zeros((slots.shape[0], *pool.shape[1:]))
        if self._functional(pool, slots):
            return _gather_functional(self.xp, pool, slots, ok)
        return self.read(pool, self.read_plan(slots, ok, pool.shape[0]))

    # -- plans: an eager index finds, once for every layer, what its stores and reads need --
    def store_plan(self, slots: Any, n: int) -> HostStore | DeviceStore | TracedStore:
        """On the CPU the kept stores are found on the host, so a store is the hand-written one
        (``index_copy_``, after selecting the kept rows only where some are dropped); on a
        device, ``cacheidx::store_rows_`` skips the dropped ones itself, in one kernel."""
        import torch

        if self._functional(slots):
            return TracedStore(slots, self.xp)
        if _on_host(slots):
            keep = inside(slots, n)
            if bool(keep.all()):
                return HostStore(slots, slots.long())
            take = torch.nonzero(keep)[:, 0]
            return HostStore(slots, slots.index_select(0, take).long(), take)
        torch_rows.define()
        return DeviceStore(slots, slots.long().contiguous())

    def store(self, pool: Any, plan: Any, rows: Any, *, donate: bool = False) -> Any:
        if pool.shape[0] == 0 or rows.shape[0] == 0:
            return pool
        if self._functional(pool, rows):
            return _scatter_functional(self.xp, pool, plan.slots, rows, donate)
        return plan.store(pool, rows, donate)

    def read_plan(self, slots: Any, ok: Any, n: int) -> HostRead | DeviceRead | TracedRead:
        """On the CPU the rows to zero are found on the host (a select, then ``index_fill_``
        of those rows only); on a device ``cacheidx::gated_rows`` reads in one kernel."""
        import torch

        if self._functional(slots):
            return TracedRead(slots, ok, self.xp)
        if _on_host(slots, ok):
            safe = torch.where(ok, slots, 0)
            unseen = torch.nonzero(~ok)[:, 0]
            return HostRead(slots, ok, safe, unseen if unseen.numel() else None)
        torch_rows.define()
        return DeviceRead(slots, ok.contiguous(), slots.long().contiguous())

    def read(self, pool: Any, plan: Any) -> Any:
        if pool.shape[0] == 0:
            return pool.new_zeros((plan.slots.shape[0], *pool.shape[1:]))
        if self._functional(pool):
            return _gather_functional(self.xp, pool, plan.slots, plan.ok)
        return plan.read(pool)

    def to_device(self, x: Any, device: Any) -> Any:
        return x.to(device)

    def device(self, x: Any) -> Any:
        return x.device

    def tracing(self, x: Any) -> bool:
        import torch

        return torch.compiler.is_compiling() or isinstance(
            x, torch._subclasses.fake_tensor.FakeTensor)

    def zeros(self, shape: tuple[int, ...], dtype: Any, device: Any = None) -> Any:
        """Zeros whose first element starts a memory page on the CPU
        (:meth:`StandardArrays.zeros`'s reason), a huge page where they fill one
        (:mod:`~cacheidx.backends.hostmemory`): a view into a page more of bytes; elsewhere
        ``torch.zeros``."""
        import torch

        if device is not None and torch.device(device).type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        whole, at = zeroed(n, zeros=lambda m: torch.zeros(m, dtype=torch.uint8),
                           frombuffer=lambda b: torch.frombuffer(b, dtype=torch.uint8),
                           address=lambda a: a.data_ptr())
        return whole[at:at + n].view(dtype).view(shape)

    def on_host(self, x: Any) -> bool:
        """A plain CPU tensor, not traced: its memory is the host's, read with no copy (eager
        CPU work is done when the call returns)."""
        return _on_host(x) and not self.tracing(x)

    def _functional(self, *xs: Any) -> bool:
        """Whether a store or read of ``xs`` must stay one functional expression: one of them
        is traced (:meth:`tracing`, the one tracing predicate), autograd records one, or a
        functorch transform (vmap, grad) is active."""
        import torch

        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            return True  # tracing(x) for every x, and a transform: nothing more to ask
        fake, grad = torch._subclasses.fake_tensor.FakeTensor, torch.is_grad_enabled()
        for x in xs:  # tracing(x) for each (a fake tensor), or autograd recording it
            if isinstance(x, fake) or (grad and x.requires_grad):
                return True
        return False


class TorchCompiling(Eager):
    """``torch.compile(fullgraph=True)``: inductor by default, any compiler it takes by name;
    static, symbolic or automatic shapes; its programs counted on dynamo's cache."""

    donates = True
    modes = ("compiled", "dynamic", "automatic")
    compiler = "inductor"

    def jit(self, fn: Callable, *, donate_argnums: Sequence[int] = (),
            mode: str = "compiled", compiler: str | None = None) -> Callable:
        """``torch.compile(fn, fullgraph=True)`` with ``compiler`` as its backend (inductor
        when ``None``; ``"aot_eager"``, any name or callable torch.compile takes), and shapes
        static (``mode="compiled"``: one program per shape and structure, never per value),
        symbolic (``"dynamic"``) or static until a shape changes (``"automatic"``, torch's
        default). Donation is torch's default: a compiled step mutates what it is handed, as
        eager does, so ``donate_argnums`` has nothing to add."""
        import torch

        dynamic = {"compiled": False, "dynamic": True, "automatic": None}[mode]
        return torch.compile(fn, backend=self.named(compiler), fullgraph=True,
                             dynamic=dynamic)

    @contextlib.contextmanager
    def many_programs(self) -> Iterator[None]:
        """Past dynamo's recompile limits; and Python integers a step reads (a model's head
        counts, an index's window) specialised, so that symbolic shapes are the tensors' alone,
        as a served model compiles (its hyperparameters constant): made symbolic, they cost
        symbolic reasoning on every layer and prove nothing of the index. And no fake-tensor
        cache: it pays where a program repeats an operation on the same shapes (a model's
        layers); the law suite's hundreds of small programs seldom do, and under symbolic
        shapes making its entries cost more than it saved (the dynamic index laws: 55 to 58 s
        with it, 38 to 39 s without, two alternating pairs on one core). Neither changes a
        value."""
        import torch

        with torch._dynamo.config.patch(recompile_limit=4096, accumulated_recompile_limit=65536,
                                        specialize_int=True, fake_tensor_cache_enabled=False):
            yield

    def programs(self, jitted: Callable) -> int | None:
        # dynamo keeps one cache entry per program on the compiled function's code
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        fn = getattr(jitted, "_torchdynamo_orig_callable", jitted)
        return len(_debug_get_cache_entry_list(fn.__code__))

    def forget(self) -> None:
        import torch

        torch.compiler.reset()

    def wrote_in_place(self, before: Any, after: Any) -> bool:
        return after.data_ptr() == before.data_ptr()


class TorchServing(PlainServing):
    """A step compiled once per shape and replayed as a CUDA graph where inductor can; a
    linear layer through oneDNN on the CPU; eager serving under inference mode."""

    def jit_step(self: Composed, fn: Callable, *, donate_argnums: Sequence[int] = (),
                 programs: int = 8, compiler: str | None = None) -> Callable:
        """``jit``, and with inductor ``mode="reduce-overhead"``: on CUDA each shape's program
        is recorded once as a CUDA graph and replayed, reading the arrays given to ``fix`` in
        place (the others are copied into the graph's own buffers each call). Every shape
        bucket is one more program of the same code, so dynamo may keep ``programs`` of them
        (its default is 8, after which it would run eagerly)."""
        import torch

        compiler = self.named(compiler)
        fn = _own_code(fn)
        if compiler != "inductor":
            compiled = torch.compile(fn, backend=compiler, fullgraph=True, dynamic=False)
        else:
            compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)

        def step(*args: Any) -> Any:
            # each call is a new iteration: the previous call's outputs are read already;
            # room for ``programs`` shapes, for this step's calls alone (never process-wide)
            torch.compiler.cudagraph_mark_step_begin()
            with torch._dynamo.config.patch(recompile_limit=max(8, programs)):
                return compiled(*args)

        step._torchdynamo_orig_callable = fn  # type: ignore[attr-defined]  # programs() counts them
        return step

    def static_shape(self, x: Any) -> Any:
        import torch

        torch._dynamo.mark_static(x)
        return x

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

    def inference(self, fn: Callable) -> Callable:
        """``fn`` under ``torch.inference_mode()``: no autograd bookkeeping per operation."""
        import functools

        import torch

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.inference_mode():
                return fn(*args, **kwargs)

        return run

    def matmul(self, a: Any, b: Any) -> Any:
        """``a @ b`` for a weight ``b`` ``[in, out]``. On the CPU in float32 under inference
        mode: oneDNN's linear, each weight packed once (:mod:`cacheidx.backends.onednn`: its
        sums run in another order, the last bits differ)."""
        return onednn.product(a, b)


class TorchChecking(HostChecking):
    """torch's devices (the CPU, each CUDA device), its float32 matmul precision."""

    cuda = True

    def devices(self) -> list[Any]:
        import torch

        found = [torch.device("cpu")]
        if torch.cuda.is_available():
            found += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return found

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


class TorchBackend(TorchLibrary, TorchArrays, TorchCompiling, TorchServing, TorchChecking,
                   Backend):
    """PyTorch: the torch parts, one per concern (the module says each)."""


def _scatter_functional(xp: Any, pool: Any, slots: Any, rows: Any, donate: bool) -> Any:
    """The store as one functional expression over targets ``redirect_dropped`` made all
    inside the pool; donated, into the caller's storage (``index_put_``)."""
    target, rows = redirect_dropped(xp, pool, slots, rows,
                                    take=lambda x, at: x.index_select(0, at))
    if donate:
        return pool.index_put_((target,), rows)
    return pool.index_put((target,), rows)


def _gather_functional(xp: Any, pool: Any, slots: Any, ok: Any) -> Any:
    """The read as one functional expression: an index select under a ``where``."""
    import torch

    got = pool.index_select(0, torch.where(ok, slots, 0))
    return torch.where(expand(xp, ok, pool.ndim), got, pool.new_zeros(()))


def _on_host(*tensors: Any) -> bool:
    """Whether a value-dependent shape costs nothing: plain CPU tensors (no fake or functional
    ones), read eagerly."""
    import torch

    return all(type(x) is torch.Tensor and x.device.type == "cpu" for x in tensors)


def _own_code(fn: Callable) -> Callable:
    """``fn`` over a code object of its own. Dynamo keeps a function's programs, and counts
    them against its recompile limit, on the code object: the steps made of one nested
    function (one per served model) would otherwise share one count across the process, so
    a step's room for ``programs`` shapes would be spent by other engines' steps (the
    fullgraph step then fails, FailOnRecompileLimitHit)."""
    if not isinstance(fn, types.FunctionType):
        return fn
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    own.__dict__.update(fn.__dict__)
    own.__qualname__ = fn.__qualname__
    return own
