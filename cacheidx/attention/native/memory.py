"""Where an array's elements lie: the address and strides the kernel reads it by."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["memory"]


def memory(x: Any) -> tuple[int, tuple[int, ...]] | None:
    """``x``'s address and strides in elements, where it is a NumPy array or a CPU tensor;
    ``None`` for any other array (the kernel reads host memory only)."""
    if isinstance(x, np.ndarray):
        return x.ctypes.data, tuple(s // x.itemsize for s in x.strides)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return x.data_ptr(), tuple(x.stride())
    return None
