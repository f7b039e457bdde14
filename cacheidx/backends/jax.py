"""JAX: ``.at[].set(mode="drop")`` with -1 sent past the pool (JAX wraps -1 onto the last row
even under drop), fill-with-zero gather, ``jax.jit`` with donation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

from .base import Backend, inside


class JaxBackend(Backend):
    name = "jax"
    module = "jax"
    compiles = True
    donates = True

    @classmethod
    def _modules(cls) -> tuple[str, ...]:
        return ("jax", "jaxlib")

    def namespace(self) -> Any:
        import jax.numpy

        return jax.numpy

    def scatter(self, pool: Any, slots: Any, rows: Any, *, donate: bool = False) -> Any:
        import jax

        if donate and not isinstance(pool, jax.core.Tracer):
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

    def jit(self, fn: Callable, *, donate_argnums: Sequence[int] = ()) -> Callable:
        import jax

        return jax.jit(fn, donate_argnums=tuple(donate_argnums))

    def to_device(self, x: Any, device: Any) -> Any:
        import jax

        return jax.device_put(x, device)

    def device(self, x: Any) -> Any:
        # arrays built beside an index stay uncommitted, so they follow its placement
        return None

    def devices(self) -> list[Any]:
        import jax

        return list(jax.devices())

    def programs(self, jitted: Callable) -> int | None:
        return jitted._cache_size()

    def wrote_in_place(self, before: Any, after: Any) -> bool:
        # a donated buffer is deleted and its memory handed to the result
        return before.is_deleted()

    def register(self, cls: type) -> None:
        import jax

        from ..index import _flatten, _leaf_names, _unflatten

        def with_keys(index: Any) -> tuple[list[tuple[Any, Any]], Any]:
            leaves, static = _flatten(index)
            keys = [jax.tree_util.GetAttrKey(n) for n in _leaf_names(static[0])]
            return list(zip(keys, leaves)), static

        try:
            jax.tree_util.register_pytree_with_keys(
                cls, with_keys, lambda static, leaves: _unflatten(static, leaves),
                flatten_func=_flatten,
            )
        except ValueError:  # registered already
            pass


def _scatter(pool: Any, slots: Any, rows: Any) -> Any:
    import jax.numpy as jnp

    n = pool.shape[0]
    if n == 0 or slots.shape[0] == 0:
        return pool
    # mode="drop" drops indices past the pool but wraps negative ones: send them past it too
    target = jnp.where(inside(slots, n), slots, n)
    return pool.at[target].set(rows, mode="drop")


@cache
def _donating_scatter() -> Callable:
    import jax

    return jax.jit(_scatter, donate_argnums=0)
