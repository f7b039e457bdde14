"""Where a pool's bytes lie: token-major or head-major, its shape the same.

Every law sees a pool as ``[slots, kv_heads, dim]``: a slot is a row, stored and read whole.
Where the library keeps strides (NumPy, PyTorch, CuPy), that shape can sit in memory in either
order, FlashInfer's two layouts: ``"token"`` (NHD: a slot's heads side by side, the row-major
default) or ``"head"`` (HND: each head's slots one after another, a view of ``[kv_heads, slots,
dim]`` with its first two axes swapped). Values, laws and stores are the same in both; only
what a read streams differs. An attention layer reads one head's keys of a run of slots at a
time: head-major, that is one contiguous block the prefetcher follows; token-major, a stride
of ``kv_heads * dim`` elements apart, and on the CPU it waits on memory (the figures:
docs/attention.md, "Where the bytes lie"). Not every read gains (torch's
``index_select`` runs at about half speed over a head-major pool; NumPy's ``take`` would copy
one whole, so its backend takes a head at a time), so only a library whose attention path says
so (its ``layout(pool)``: NumPy's, and PyTorch's on the CPU) gets head-major pools by default.
JAX keeps no strides: its compiler lays the pool out.
"""

from __future__ import annotations

from typing import Any

from .. import pools
from .._arguments import strides

__all__ = ["LAYOUTS", "head_major", "preferred", "zeros"]

#: the memory orders a pool may have
LAYOUTS = ("token", "head")


def zeros(xp: Any, slots: int, kv: int, dim: int, *, dtype: Any, device: Any = None,
          layout: str | None = None) -> Any:
    """A pool of zeros ``[slots, kv, dim]`` whose memory is in ``layout`` order: ``"head"``,
    ``"token"``, or ``None`` for the order the library's attention path prefers for a pool on
    that device (``layout(pool)`` of :mod:`~cacheidx.attention.paths`), token-major where it
    states none."""
    if layout not in (None, *LAYOUTS):
        raise ValueError(f"cacheidx.attention.layout.zeros: layout must be one of {LAYOUTS} "
                         f"or None, got {layout!r}")
    from .. import backends

    zeros = backends.get(xp).zeros  # the backend's pool memory (page-aligned on the host)
    if layout is None:  # asked of an empty pool on the same device, of the same dtype
        layout = preferred(zeros((0, int(kv), int(dim)), dtype, device))
    if layout == "token":
        return zeros((int(slots), int(kv), int(dim)), dtype, device)
    return xp.permute_dims(zeros((int(kv), int(slots), int(dim)), dtype, device), (1, 0, 2))


def head_major(pool: Any) -> bool:
    """Whether ``pool`` ``[slots, kv, dim]`` keeps each head's slots one after another (its
    slot stride below its head stride); ``False`` where the library shows no strides. A pool
    of several parts is as its first is (a quantized pool's codes: :mod:`cacheidx.pools`)."""
    pool = pools.parts(pool)[0]
    found = strides(pool)
    return (found is not None and len(found) == 3 and int(pool.shape[1]) > 1
            and found[0] < found[1])


def preferred(pool: Any) -> str:
    """The order the attention path of ``pool``'s library prefers for it, ``"token"`` where
    it has no path, states none, or the library keeps no strides."""
    from .. import backends
    from . import paths

    prefer = getattr(paths.fast(backends.get(pool)), "layout", None)
    if prefer is None or strides(pool) is None:
        return "token"
    return prefer(pool)
