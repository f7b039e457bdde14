"""The adapter contract, with a fallback written only against the array API standard.

The standard has no scatter, so a backend supplies one operation the core cannot express:
``scatter`` (store rows at slot numbers, dropping every number outside the pool). Everything
else here has a standard-only default that a backend may replace with a native fast path.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import array_api_compat as compat

from ..laws import expand, inside


class Node(NamedTuple):
    """A class a library's pytree registry takes apart and puts together again: its tensors
    the leaves, the rest one static value (how the index layer hands itself to the backends,
    which never import it)."""

    cls: type
    flatten: Callable[[Any], tuple[list[Any], Any]]  #: obj -> (leaves, static)
    unflatten: Callable[[Any, list[Any]], Any]  #: (static, leaves) -> obj
    keys: Callable[[Any], list[str]]  #: static -> the leaves' names (the spec's walk paths)
    dump: Callable[[Any], str]  #: static -> JSON (torch.export saves it)
    load: Callable[[str], Any]  #: JSON -> static
    safe: tuple[Any, ...] = ()  #: what unpickling the static value needs, weights-only


class Backend:
    """One array library, as the core sees it: :mod:`~cacheidx.backends.protocols`'
    ``Arrays``, ``Compiling``, ``Serving`` and ``Checking`` in one adapter, each member with a
    standard-only default.

    Subclasses set ``name`` and ``module`` (the library's top-level module, looked up in
    ``sys.modules`` only, so that detecting an array never imports a framework).
    """

    name: str = "standard"
    module: str | None = None
    #: the compiler ``jit`` uses when given none, where the library has several to name
    #: (torch.compile's backends); ``None`` where ``jit`` takes no name
    compiler: str | None = None
    #: whether ``scatter(..., donate=True)`` writes into the caller's memory
    donates: bool = False
    #: the ways ``jit`` compiles (its ``mode``): ``"compiled"``, the library's compiler with
    #: static shapes, and any others it has (torch: ``"dynamic"``, ``"automatic"``)
    modes: tuple[str, ...] = ()
    #: whether the library computes on the host's CPU (its devices include ``cpu``)
    host: bool = True

    def __init__(self, xp: Any | None = None):
        # resolved now, never lazily inside a traced step (a compiler would guard on it)
        self.xp = xp if xp is not None else self.namespace()

    # -- detection ---------------------------------------------------------------------------
    @classmethod
    def usable(cls) -> tuple[bool, str]:
        """Whether this backend can run here, and why not."""
        import importlib.util

        if cls.module is None or importlib.util.find_spec(cls.module) is not None:
            return True, ""
        return False, f"{cls.module} is not installed"

    @classmethod
    def owns(cls, x: Any) -> bool:
        """Whether ``x`` is an array of this backend's library (never imports it)."""
        return cls.module is not None and cls.module in sys.modules and cls._made_by(x)

    @classmethod
    def _made_by(cls, x: Any) -> bool:
        """Whether ``x``'s type comes from one of the library's modules (by name alone)."""
        return type(x).__module__.split(".")[0] in cls._modules()

    @classmethod
    def _modules(cls) -> tuple[str, ...]:
        return (cls.module,)

    def namespace(self) -> Any:
        """The array-API namespace (array-api-compat's wrapper where the library needs one)."""
        raise NotImplementedError(f"backend {self.name!r} names no namespace")

    # -- the operations the core needs -----------------------------------------------------
    def scatter(self, pool: Any, slots: Any, rows: Any, *, donate: bool = False) -> Any:
        """``pool`` with ``rows[i]`` stored at slot ``slots[i]``; a slot outside the pool stores
        nothing. With ``donate`` the pool's memory may be reused; without it the caller's pool is
        never changed.

        Standard-only: sort the targets, then let each slot find the token aimed at it with
        ``searchsorted``. Static shapes, no boolean indexing; costs O(slots) as it copies.
        """
        xp = self.xp
        n = pool.shape[0]
        if n == 0 or slots.shape[0] == 0:
            return pool
        every_slot = xp.arange(n, dtype=slots.dtype, device=compat.device(pool))
        target = xp.where(inside(slots, n), slots, -1)
        order = xp.argsort(target, stable=True)
        ranked = self.take(target, order)
        last = xp.searchsorted(ranked, every_slot, side="right") - 1
        last = xp.clip(last, 0, None)
        hit = self.take(ranked, last) == every_slot
        stored = self.take(rows, self.take(order, last))
        return xp.where(expand(xp, hit, pool.ndim), stored, pool)

    def gather(self, pool: Any, slots: Any, ok: Any) -> Any:
        """Rows ``pool[slots[i]]`` where ``ok[i]``, exactly zero elsewhere (whatever the pool
        holds there, NaN included). ``ok`` already implies the slot is inside the pool."""
        xp = self.xp
        if pool.shape[0] == 0:
            return xp.zeros((slots.shape[0], *pool.shape[1:]), dtype=pool.dtype,
                            device=compat.device(pool))
        safe = xp.where(ok, slots, 0)
        got = self.take(pool, safe)
        return xp.where(expand(xp, ok, pool.ndim), got, 0)

    # -- plans: what an index keeps for every layer's pool of the same size ----------------
    def store_plan(self, slots: Any, n: int) -> Any:
        """What ``store`` needs to store at ``slots`` in a pool of ``n`` slots. An index keeps
        it (eagerly) for every layer's pool, so a backend does here, once, the work that
        depends only on the slots: finding the dropped stores, say."""
        return slots

    def store(self, pool: Any, plan: Any, rows: Any, *, donate: bool = False) -> Any:
        """``scatter`` at the slots ``plan`` (from ``store_plan``) was made from."""
        return self.scatter(pool, plan, rows, donate=donate)

    def read_plan(self, slots: Any, ok: Any, n: int) -> Any:
        """What ``read`` needs to gather ``slots`` where ``ok`` from a pool of ``n`` slots,
        kept like ``store_plan``'s."""
        return slots, ok

    def read(self, pool: Any, plan: Any) -> Any:
        """``gather`` of the slots and gate ``plan`` (from ``read_plan``) was made from."""
        return self.gather(pool, *plan)

    def one_program(self, fn: Callable, *, donate_argnums: Sequence[int] = (),
                    static_argnums: Sequence[int] = ()) -> Callable:
        """``fn`` as an eager call of the index runs it: where the library compiles each eager
        operation apart (JAX), one compiled program of the whole call, kept per structure,
        shape and value of ``static_argnums``, given up ``donate_argnums``; ``fn`` itself
        elsewhere (the library's eager operations are its fast path)."""
        return fn

    def matmul(self, a: Any, b: Any) -> Any:
        """``a @ b`` for a matrix ``b`` ``[in, out]``, a model's linear layer; a backend may
        use a faster kernel for it."""
        return a @ b

    def named(self, compiler: str | None) -> str | None:
        """The compiler ``jit`` uses for ``compiler`` (:attr:`compiler` when ``None``); raises
        where the library has one compiler, which takes no name."""
        if compiler is not None and self.compiler is None:
            raise ValueError(f"cacheidx.jit: {self.name} has one compiler, which takes no "
                             f"name; got compiler={compiler!r}")
        return compiler or self.compiler

    def inference(self, fn: Callable) -> Callable:
        """``fn`` run eagerly with nothing recorded for differentiation (a serving step never
        needs it), where the library records by default; ``fn`` itself elsewhere."""
        return fn

    def jit(self, fn: Callable, *, donate_argnums: Sequence[int] = (),
            mode: str = "compiled", compiler: str | None = None) -> Callable:
        """Compile ``fn`` where the library has a compiler (in one of its ``modes``, with the
        named ``compiler`` where it has several: :attr:`compiler` when ``None``); eager where
        it has none."""
        self.named(compiler)
        return fn

    @contextlib.contextmanager
    def many_programs(self) -> Iterator[None]:
        """A context in which one step may compile for many shapes and structures (the law
        suite feeds each step every law's cases), past the library's usual limits."""
        yield

    @classmethod
    def checking_env(cls, device_label: str) -> dict[str, str]:
        """Environment for a process that runs the law suite on this backend: settings that
        make compiling many small programs faster and never change a value. (A class
        method: the runner reads it without importing the library.)"""
        return {}

    def version(self) -> str | None:
        """The library's version, read from its imported module."""
        module = sys.modules.get(self.module or "")
        return getattr(module, "__version__", None)

    def device_label(self, device: Any) -> str:
        """``device`` in :mod:`cacheidx.devices`' one spelling: ``cpu``, ``cuda:N``, ..."""
        return "cpu"

    @contextlib.contextmanager
    def highest_precision(self) -> Iterator[None]:
        """A context in which float32 matrix products keep every bit of their inputs (no
        TF32 or bfloat16 passes), where the library can be told so."""
        yield

    def matmul_mantissa(self, device: Any) -> int:
        """Mantissa bits a float32 matrix product keeps of its inputs on ``device`` under the
        library's defaults: 23 in full precision, 10 under TF32, 7 under bfloat16."""
        return 23

    # -- an engine's step: compiled once per shape, called many times ------------------------
    def jit_step(self, fn: Callable, *, donate_argnums: Sequence[int] = (),
                 programs: int = 8, compiler: str | None = None) -> Callable:
        """``jit`` for a step called over and over with its arrays kept where they are
        (``fix``): where the library replays a recorded program (CUDA graphs) it does, and it
        keeps up to ``programs`` compiled shapes."""
        return self.jit(fn, donate_argnums=donate_argnums, compiler=compiler)

    def static_shape(self, x: Any) -> Any:
        """``x``, whose shape a compiled step may take as fixed (a model's weights), even where
        it compiles with symbolic shapes. Returns ``x``."""
        return x

    def fix(self, x: Any) -> Any:
        """``x``, promised to every call of a ``jit_step`` program at this address (its memory
        is written between calls, never replaced). Returns ``x``."""
        return x

    def refill(self, buffer: Any, values: Any) -> Any:
        """An array holding ``values`` (host NumPy, or an array of this library of
        ``buffer``'s shape and dtype) on ``buffer``'s device: ``buffer`` itself, written in
        place, where the library writes in place; otherwise a new array."""
        if self.same_library(values):
            return values
        return self.from_host(values, buffer.dtype, self.device(buffer))

    def take(self, x: Any, at: Any, axis: int = 0) -> Any:
        """``xp.take(x, at, axis=axis)`` where every index is inside ``[0, x.shape[axis])``, as
        the core's are (it clamps or masks each first), so a library's handling of negative
        indices, which the standard leaves unspecified, has nothing to do."""
        return self.xp.take(x, at, axis=axis)

    def from_host(self, a: Any, dtype: Any = None, device: Any = None) -> Any:
        """``a`` (a NumPy array, or anything ``asarray`` takes) as an array of this library,
        in ``dtype`` (the library's choice for ``a`` without one) on ``device``."""
        return self.xp.asarray(a, dtype=dtype, device=device)

    def to_device(self, x: Any, device: Any) -> Any:
        return compat.to_device(x, device)

    def device(self, x: Any) -> Any:
        """Where ``x`` lies, for building arrays beside it."""
        return compat.device(x)

    def same_library(self, x: Any) -> bool:
        """Whether ``x`` is an array this backend computes on (cheap: no namespace lookup,
        so that it traces under a compiler)."""
        if self.module is not None:
            # an instance's library is imported (its namespace is resolved): no sys.modules
            # lookup, which a compiler would realise whole (60 ms a call under torch.compile)
            return self._made_by(x)
        try:
            return compat.array_namespace(x) is self.xp
        except TypeError:
            return False

    def devices(self) -> list[Any]:
        """The devices this backend can place arrays on, for the conformance runner."""
        return [compat.device(self.xp.zeros(()))]

    def programs(self, jitted: Callable) -> int | None:
        """How many programs ``jitted`` (from ``jit``) has compiled; ``None`` without a
        compiler."""
        return None

    def tracing(self, x: Any) -> bool:
        """Whether ``x`` is a value being traced by a compiler (not a concrete array)."""
        return False

    def on_host(self, x: Any) -> bool:
        """Whether ``x`` (concrete) lies in host memory that the host reads with no copy and
        no wait for a device: there an index compares its tensors with the host values its
        plan was made from (:meth:`cacheidx.CacheIndex.host`), and a tile's product is asked
        whether it is finite. Elsewhere (a device: ``False``, the default) nothing is read
        back (:mod:`cacheidx.plan`'s law)."""
        return False

    def __reduce__(self) -> Any:
        # pickles as the registry's instance, never its namespace module
        from . import get

        return get, (self.name,)

    def forget(self) -> None:
        """Drop every compiled program, so that independent suites do not share caches."""

    def wrote_in_place(self, before: Any, after: Any) -> bool:
        """Whether ``after`` (a pool returned by a donating store) reuses ``before``'s
        memory."""
        return False

    def register(self, node: Node) -> None:
        """Register ``node`` (the index) with the library's pytree registry, if it has one."""

    def __repr__(self) -> str:
        return f"<cacheidx backend {self.name}>"


def redirect_dropped(xp: Any, pool: Any, slots: Any, rows: Any, *,
                     take: Any = None) -> tuple[Any, Any]:
    """Targets all inside the pool, and rows, whose plain indexed store equals a store with drop.

    Libraries whose indexed store wraps ``-1`` or raises on an outside index (torch, CuPy) get
    targets they cannot misread. A dropped row is sent to the slot of the first kept row and
    carries that row's values, so it repeats a store that happens anyway; with no kept row it
    rewrites slot 0 with what slot 0 holds. Sending it to slot 0 with its own values would
    clobber a real write there. Static shapes: no boolean indexing, no host sync. ``take``:
    the library's take of indices inside the array (:meth:`Backend.take`), ``xp.take`` without.
    """
    take = take or (lambda x, at: xp.take(x, at, axis=0))
    keep = inside(slots, pool.shape[0])
    first = xp.reshape(xp.argmax(xp.astype(keep, xp.int8)), (1,))
    some = xp.any(keep)
    anchor_slot = xp.where(some, take(slots, first), 0)
    anchor_row = xp.where(some, take(rows, first), pool[0:1, ...])
    target = xp.where(keep, slots, anchor_slot)
    return target, xp.where(expand(xp, keep, rows.ndim), rows, anchor_row)
