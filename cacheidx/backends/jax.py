"""JAX: ``.at[].set(mode="drop")`` with -1 sent past the pool (JAX wraps -1 onto the last row
even under drop), fill-with-zero gather, ``jax.jit`` with donation, placement on a sharding.

Nothing here reads a value on the host or depends on one, so every operation traces under
``jax.jit`` and ``lax.scan``, and one program serves every position, table and row map. Index
tensors are whatever integer dtype they come in: int32 under JAX's default, int64 with x64.
Eagerly, each of the index's calls is one such program (:meth:`JaxBackend.one_program`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from typing import Any

from ..laws import inside
from .arrays import StandardArrays
from .base import Backend, Library, Node
from .checking import HostChecking
from .compiling import Eager
from .serving import Composed, PlainServing


class JaxLibrary(Library):
    """jax, whose arrays come from ``jax`` or ``jaxlib``; the index a JAX pytree node."""

    name = "jax"
    module = "jax"

    @classmethod
    def _modules(cls) -> tuple[str, ...]:
        return ("jax", "jaxlib")

    def namespace(self) -> Any:
        import jax.numpy

        return jax.numpy

    def register(self, node: Node) -> None:
        import jax

        def with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
            leaves, static = node.flatten(obj)
            keys = [jax.tree_util.GetAttrKey(n) for n in node.keys(static)]
            return list(zip(keys, leaves)), static

        try:
            jax.tree_util.register_pytree_with_keys(node.cls, with_keys, node.unflatten,
                                                    flatten_func=node.flatten)
        except ValueError:  # registered already
            pass


class JaxArrays(StandardArrays):
    """``.at[].set(mode="drop")`` stores and fill-value reads, placement by
    ``jax.device_put``; an eager call of the index is one program (:meth:`one_program`)."""

    def scatter(self, pool: Any, slots: Any, rows: Any, *, donate: bool = False) -> Any:
        """One XLA scatter of the tokens' rows; a slot outside the pool (-1, the pool's size,
        int32's or int64's largest, any negative) stores nothing. Under ``jax.jit`` the store is
        in place where the program's pool is donated or is a loop's carry; outside it, a donated
        pool goes through a compiled scatter that donates it, so its memory is reused."""

        if donate and not self.tracing(pool):
            # outside jit a donated pool is written in place by a compiled, donating scatter
            return _donating_scatter()(pool, slots, rows)
        return _scatter(pool, slots, rows)

    def gather(self, pool: Any, slots: Any, ok: Any) -> Any:
        import jax.numpy as jnp

        n = pool.shape[0]
        if n == 0:
            return jnp.zeros((slots.shape[0], *pool.shape[1:]), dtype=pool.dtype)
        # one gated load: an index past the pool reads the fill value
        return pool.at[jnp.where(ok, slots, n)].get(mode="fill", fill_value=0)

    def one_program(self, fn: Callable, *, donate_argnums: Sequence[int] = (),
                    static_argnums: Sequence[int] = ()) -> Callable:
        """``jax.jit(fn)``, made once: op by op, JAX would compile each of an index call's
        operations apart for every new shape (dozens for an ``extend``), where one program of
        the call compiles once and runs as one dispatch, as ``jax.numpy``'s own functions do."""
        return _program(fn, tuple(donate_argnums), tuple(static_argnums))

    def from_host(self, a: Any, dtype: Any = None, device: Any = None) -> Any:
        """A host array cast on the host and placed by ``jax.device_put``, which compiles
        nothing: ``jnp.asarray`` compiles two programs for each new shape (a conversion, then a
        placement), about 10 ms each, and dispatches them on every call."""
        import jax
        import numpy as np

        if not isinstance(a, np.ndarray | np.generic):
            return self.xp.asarray(a, dtype=dtype, device=device)
        host = np.asarray(a, dtype=jax.dtypes.canonicalize_dtype(a.dtype if dtype is None
                                                                 else dtype))
        return jax.device_put(host, device)

    def to_device(self, x: Any, device: Any) -> Any:
        """``x`` on a device, or whole on each device of a ``jax.sharding.Sharding`` (a sharding
        that would cut it is replaced by the replicated one over the same devices)."""
        import jax

        return jax.device_put(x, _whole(device))

    def device(self, x: Any) -> Any:
        # arrays built beside an index stay uncommitted, so they follow its placement
        return None

    def tracing(self, x: Any) -> bool:
        import jax

        return isinstance(x, jax.core.Tracer)


class JaxCompiling(Eager):
    """``jax.jit`` with donation, its traces counted."""

    donates = True
    modes = ("compiled",)

    def jit(self, fn: Callable, *, donate_argnums: Sequence[int] = (),
            mode: str = "compiled", compiler: str | None = None) -> Callable:
        """``jax.jit``: one program per shape and structure (JAX has no other mode), its traces
        counted (:meth:`programs`)."""
        import functools

        import jax

        self.named(compiler)
        if mode != "compiled":
            raise ValueError(f"cacheidx.jit: jax compiles only with static shapes, not {mode!r}")
        traces = [0]

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            traces[0] += 1  # Python runs only while JAX traces: once per program
            return fn(*args, **kwargs)

        jitted = jax.jit(traced, donate_argnums=tuple(donate_argnums))
        jitted.traces = traces
        return jitted

    def programs(self, jitted: Callable) -> int | None:
        """The programs ``jitted`` (from :meth:`jit`) traced so far: its traces, counted."""
        traces = getattr(jitted, "traces", None)
        return None if traces is None else traces[0]

    def wrote_in_place(self, before: Any, after: Any) -> bool:
        # a donated buffer is deleted and its memory handed to the result
        return before.is_deleted()


class JaxServing(PlainServing):
    """A step's arrays refilled as new arrays (JAX writes in place only inside a program)."""

    def refill(self: Composed, buffer: Any, values: Any) -> Any:
        """``values`` as a new array on ``buffer``'s devices (JAX never writes in place outside
        a program; a program given donated arrays reuses their memory)."""
        import jax
        import numpy as np

        if isinstance(values, jax.Array):
            return values
        return self.from_host(np.asarray(values), buffer.dtype, buffer.sharding)


class JaxChecking(HostChecking):
    """JAX's devices (its default platform's, then the host's), its matmul precision, and XLA's
    flags for a process that compiles the law suite's many small programs."""

    cuda = True

    @classmethod
    def checking_env(cls, device_label: str) -> dict[str, str]:
        if device_label != "cpu":
            return {}
        # the law suite compiles hundreds of tiny programs, eagerly one per operation and shape:
        # XLA's CPU compiler spends most of that time optimising code that runs once; and each
        # in one piece, on one thread (the workers already fill the cores, and splitting a
        # program's code over threads costs more than it saves: docs/conformance.md)
        fast = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
        return {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {fast}".strip()}

    def device_label(self, device: Any) -> str:
        from ..devices import label

        return label(device.platform, device.id)

    @contextlib.contextmanager
    def highest_precision(self) -> Iterator[None]:
        import jax

        with jax.default_matmul_precision("highest"):
            yield

    def matmul_mantissa(self, device: Any) -> int:
        import jax

        if device.platform == "cpu":
            return 23
        chosen = str(jax.config.jax_default_matmul_precision or "default").lower()
        if chosen in ("highest", "float32", "f32_f32_f32"):
            return 23
        if chosen in ("high", "tensorfloat32", "bfloat16_3x"):
            return 10 if device.platform != "tpu" else 16
        # DEFAULT: TF32 on CUDA GPUs, one bfloat16 pass on TPUs
        return 7 if device.platform == "tpu" else 10

    def devices(self) -> list[Any]:
        """The default platform's devices, then the host's: on a GPU machine JAX's default is
        its GPUs, and the CPU is there too."""
        import jax

        found = list(jax.devices())
        try:
            host = jax.devices("cpu")
        except RuntimeError:  # a JAX built without its CPU platform
            host = []
        return found + [d for d in host if d not in found]


class JaxBackend(JaxLibrary, JaxArrays, JaxCompiling, JaxServing, JaxChecking, Backend):
    """JAX: the JAX parts, one per concern (the module says each)."""


def _scatter(pool: Any, slots: Any, rows: Any) -> Any:
    import jax.numpy as jnp

    n = pool.shape[0]
    if n == 0 or slots.shape[0] == 0:
        return pool
    # mode="drop" drops indices past the pool but wraps negative ones: send them past it too
    target = jnp.where(inside(slots, n), slots, n)
    return pool.at[target].set(rows, mode="drop")


def _whole(where: Any) -> Any:
    """``where`` as a placement that holds a tensor whole on each of its devices: an index's
    tensors have different leading axes (tokens, rows, slots), so no cut applies to all."""
    import jax

    if not isinstance(where, jax.sharding.Sharding) or where.is_fully_replicated:
        return where
    from jax.sharding import NamedSharding, PartitionSpec

    if isinstance(where, NamedSharding):
        return NamedSharding(where.mesh, PartitionSpec(), memory_kind=where.memory_kind)
    import numpy as np

    devices = np.array(sorted(where.device_set, key=lambda d: d.id))
    return NamedSharding(jax.sharding.Mesh(devices, ("devices",)), PartitionSpec(),
                         memory_kind=where.memory_kind)


@cache
def _donating_scatter() -> Callable:
    import jax

    return jax.jit(_scatter, donate_argnums=0)


@cache
def _program(fn: Callable, donate: tuple[int, ...], static: tuple[int, ...]) -> Callable:
    import jax

    return jax.jit(fn, donate_argnums=donate, static_argnums=static)
