"""oneDNN's linear on the CPU: a serving step's ``a @ b``, each weight packed once.

The law: :func:`linear` is ``a @ b`` for a weight ``b`` ``[in, out]`` to float32's rounding
(oneDNN orders the sums its own way, so the last bits differ from ``@``'s); it applies
(:func:`applies`) under ``torch.inference_mode()`` alone, to plain float32 CPU tensors, with
no compiler or functorch transform: elsewhere ``@`` stays the product, bit for bit what a
compiler without fusion computes.

Why packed: oneDNN reads a plain weight through a reorder into its blocked layout on every
call. Packed once (``torch.ops.mkldnn._reorder_linear_weight``, the packing inductor's
freezing gives a bfloat16 or float16 linear layer; for float32 it packs for MKL, whose packed
product was no faster here than the plain one), a decode step's few rows stream it faster:
SmolLM2-135M's two-layer shape, its 15 products a step 2.4 -> 1.5 ms at 8 rows, 4.4 -> 3.2
at 32 (docs/performance.md).

A packed weight is a copy, kept beside the weight while the weight lives (a weak map on the
tensor that owns its memory: as many bytes again as the weights the step multiplies,
:func:`packed_bytes` says how many) and
made again when the weight changes through torch: the key is the view's address, shape and
strides, and the owner's version counter, which every in-place write bumps. Not packed
(read as stored): an inference tensor (it has no version counter to see a write by), and any
weight while :data:`PACKING` is off. A write behind torch's back (into a NumPy array sharing
the weight's memory) is not seen: write weights through torch, or turn packing off.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from functools import cache
from typing import Any

__all__ = ["PACKING", "applies", "available", "linear", "packed", "packed_bytes", "packing",
           "product"]

#: the rows oneDNN is told to expect when it packs: its layout for a few dozen rows, one for
#: every call (fixed, so a product's bits never depend on which call packed its weight)
ROWS_HINT = 32

#: whether :func:`linear` packs weights (:func:`packing` sets it for a block of code)
PACKING = True

_LOCK = threading.Lock()


@cache
def available() -> bool:
    """Whether this torch has oneDNN's linear (and its packing)."""
    import torch

    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def applies(a: Any, b: Any) -> bool:
    """Whether ``a @ b`` goes to oneDNN (the module's conditions)."""
    import torch

    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return False  # first: a compiler never traces the rest
    return (type(a) is torch.Tensor and type(b) is torch.Tensor and b.ndim == 2
            and a.ndim >= 2 and a.dtype == torch.float32 and b.dtype == torch.float32
            and a.device.type == "cpu" and b.device.type == "cpu" and available()
            and not torch._C._are_functorch_transforms_active())


def product(a: Any, b: Any, *, pack: bool = True) -> Any:
    """``a @ b``: oneDNN's :func:`linear` where it :func:`applies`, else ``@``."""
    return linear(a, b, pack=pack) if applies(a, b) else a @ b


def linear(a: Any, b: Any, *, pack: bool = True) -> Any:
    """``a @ b`` by oneDNN's linear (``applies(a, b)`` is the caller's to check), ``b`` packed
    where the module says and ``pack``: a model's weight, not rows of a pool, which change
    every step (a pack of each would be made on every call, and kept while the pool lives)."""
    import torch

    w = packed(b) if pack and PACKING else None
    return torch.ops.mkldnn._linear_pointwise(a, b.mT if w is None else w, None, "none",
                                              [None], "")


def packed(b: Any) -> Any:
    """``b``'s transpose packed for oneDNN, made once while ``b`` is unchanged; ``None`` where
    ``b`` is not packed (an inference tensor)."""
    import torch

    owner = b if b._base is None else b._base
    if owner.is_inference():
        return None
    key = (b.data_ptr(), tuple(b.shape), tuple(b.stride()))  # the view, within its owner
    kept = _kept()
    with _LOCK:
        views = kept.get(owner)
        if views is None:
            views = kept[owner] = {}
        version, w = views.get(key, (None, None))
        if version != owner._version:
            w = torch.ops.mkldnn._reorder_linear_weight(b.mT.contiguous(), ROWS_HINT)
            views[key] = owner._version, w
    return w


def packed_bytes() -> int:
    """The bytes the packed weights kept now take (the copy this module adds to a model's
    weights), so that the cost is seen."""
    with _LOCK:
        return sum(w.numel() * w.element_size() for views in _kept().values()
                   for _, w in views.values())


@contextlib.contextmanager
def packing(on: bool) -> Iterator[None]:
    """:data:`PACKING` set to ``on`` within the block (off: weights read as stored, no copy)."""
    global PACKING
    before, PACKING = PACKING, on
    try:
        yield
    finally:
        PACKING = before


@cache
def _kept() -> Any:
    """The packed weights: owner tensor -> {view's key: (owner's version, packed)}, an entry
    gone with its owner (torch's map by identity: a tensor's ``==`` is elementwise)."""
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()
