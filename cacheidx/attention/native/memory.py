"""Where an array's elements lie: the address and strides the kernel reads it by; and whether
autograd would ask the kernel for a gradient."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["grad_asked", "memory"]


def memory(x: Any) -> tuple[int, tuple[int, ...]] | None:
    """``x``'s address and strides in elements, where it is a NumPy array or a CPU tensor;
    ``None`` for any other array (the kernel reads host memory only)."""
    if isinstance(x, np.ndarray):
        return x.ctypes.data, tuple(s // x.itemsize for s in x.strides)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return x.data_ptr(), tuple(x.stride())
    return None


def grad_asked(*arrays: Any) -> bool:
    """Whether torch's autograd would follow one of ``arrays`` (grad mode on, one requiring
    grad; ``None`` and arrays of other libraries never do): the kernel has no backward, so its
    entries decline such a call and the core's products, which autograd follows, read it."""
    torch = sys.modules.get("torch")
    return (torch is not None and torch.is_grad_enabled()
            and any(getattr(x, "requires_grad", False) for x in arrays))
