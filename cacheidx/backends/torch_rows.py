"""torch's eager device operations, one kernel each on CUDA: ``cacheidx::store_rows_`` (rows
into their slots, a slot outside the pool storing nothing) and ``cacheidx::gated_rows`` (the
rows at slots, exactly zero where not ``ok``), torch operators with the kernels of
:mod:`cacheidx.backends.rowkernels` on CUDA (compiled by NVRTC once per device) and plain torch
elsewhere. :class:`~cacheidx.backends.torch.TorchBackend`'s eager stores and reads call them."""

from __future__ import annotations

import math
import warnings
from functools import cache
from typing import Any

from ..laws import expand
from . import rowkernels
from .base import redirect_dropped

__all__ = ["define", "kernel", "kernels_on"]


def define() -> None:
    """``cacheidx::store_rows_`` and ``cacheidx::gated_rows``, torch operators (so that a
    dispatch mode or the profiler counts each as one) with the kernels of
    :mod:`cacheidx.backends.rowkernels` on CUDA and plain torch elsewhere."""
    import torch

    if hasattr(torch.ops.cacheidx, "gated_rows"):
        return
    lib = torch.library.Library("cacheidx", "FRAGMENT")  # other modules may add their own
    lib.define("store_rows_(Tensor(a!) pool, Tensor slots, Tensor rows) -> ()")
    lib.define("gated_rows(Tensor pool, Tensor slots, Tensor ok) -> Tensor")
    lib.impl("store_rows_", _store_rows, "CompositeExplicitAutograd")
    lib.impl("gated_rows", _gated_rows, "CompositeExplicitAutograd")
    torch.library.register_fake("cacheidx::store_rows_", lambda pool, slots, rows: None,
                                lib=lib)
    torch.library.register_fake(
        "cacheidx::gated_rows",
        lambda pool, slots, ok: pool.new_empty((slots.shape[0], *pool.shape[1:])), lib=lib)
    _LIBRARY.append(lib)  # a Library unregisters its operators when collected


_LIBRARY: list[Any] = []


def _store_rows(pool: Any, slots: Any, rows: Any) -> None:
    """Row ``i`` of ``rows`` into slot ``slots[i]`` of ``pool`` (int64 slots); a slot outside
    the pool stores nothing."""
    rows = rows.contiguous()
    n = pool.shape[0]
    if _rows("cacheidx_store_rows", pool, rows, (pool, slots, rows), extra=(n,)):
        return
    # elsewhere: the dropped rows repeat a store that happens anyway (``redirect_dropped``)
    import array_api_compat.torch as xp

    target, rows = redirect_dropped(xp, pool, slots, rows)
    pool.index_put_((target,), rows)


def _gated_rows(pool: Any, slots: Any, ok: Any) -> Any:
    """Rows ``pool[slots]`` where ``ok``, exactly zero elsewhere (int64 slots, bool ``ok``)."""
    import torch

    out = pool.new_empty((slots.shape[0], *pool.shape[1:]))
    if _rows("cacheidx_gated_rows", pool, out, (pool, slots, ok, out)):
        return out
    got = pool.index_select(0, torch.where(ok, slots, 0))
    return torch.where(expand(torch, ok, pool.ndim), got, pool.new_zeros(()))


def _rows(name: str, pool: Any, rows: Any, args: tuple, extra: tuple = ()) -> bool:
    """Run the kernel ``name`` over the rows of ``rows`` (the values stored, or the rows
    read) where it can: CUDA, contiguous buffers, sizes that fit its ints. Whether it ran."""
    if not (kernels_on(pool) and pool.is_contiguous() and rows.is_contiguous()):
        return False
    row_bytes = pool.element_size() * math.prod(pool.shape[1:])
    how = rowkernels.launch(rows.shape[0], row_bytes, (pool.data_ptr(), rows.data_ptr()),
                            slots=pool.shape[0])
    if how is None:
        return False
    run = kernel(name, how.word, pool.device.index)
    if run is None:
        return False
    run(grid=(how.grid, 1, 1), block=(how.block, 1, 1),
           args=[*args, rows.shape[0], how.words, *extra, how.group])
    return True


def kernels_on(x: Any) -> bool:
    """Whether the row kernels run where ``x`` lies: CUDA (not ROCm, where NVRTC is not)."""
    import torch

    return x.is_cuda and torch.version.hip is None


@cache
def kernel(name: str, word: int, device: int | None) -> Any:
    """The kernel ``name`` for words of ``word`` bytes, compiled by NVRTC once per device;
    ``None`` (with a warning, once) where it cannot be compiled."""
    import tempfile

    import torch
    import torch.utils.cpp_extension as ext

    home = ext.CUDA_HOME
    try:
        # torch's NVRTC wrapper adds $CUDA_HOME/include, and raises without a toolkit; the
        # kernels include no header, so any folder serves (NVRTC itself comes with the wheel)
        if home is None:
            ext.CUDA_HOME = tempfile.gettempdir()
        with torch.cuda.device(device):
            return torch.cuda._compile_kernel(rowkernels.source(word), name)
    except Exception as e:  # no NVRTC, an old torch: plain torch then
        warnings.warn(f"cacheidx: the CUDA kernel {name} did not compile ({type(e).__name__}: "
                      f"{e}); eager stores and reads use plain torch operations", stacklevel=3)
        return None
    finally:
        ext.CUDA_HOME = home
