"""One lane's run of quantized slots through the kernel (``kernel.c``'s ``cacheidx_run``):
the online softmax's state over a run every query of the block sees (:mod:`.runs` merges
it into the lane's)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import found
from .memory import grad_asked, memory

__all__ = ["ROWS", "states"]

#: the most query rows (grouped heads x queries of a block, x lanes where they share a
#: prefix) the kernel keeps scores for (``kernel.c``'s ``ROWS``)
ROWS = 16


def states(q: Any, keys: Any, values: Any) -> tuple[Any, Any, Any] | None:
    """``(m, l, acc)`` of one run, or ``None`` where the kernel does not apply: no kernel, not
    NumPy or a CPU tensor, not float32 queries and scales, a row's elements not adjacent, too
    many query rows, a scale, a query or a score not finite but ``-inf``, or a gradient asked
    (torch's grad mode on and ``q`` or a pool's scales requiring grad: the kernel has no
    backward). A query row whose scores are all ``-inf`` has ``m = -inf``, ``l = 0`` and
    ``acc = 0``.

    ``q`` ``[kv, rows, d]`` (scaled); ``keys`` and ``values`` quantized views
    ``(codes [T, kv, w], scales [T, kv])``. ``m`` and ``l`` are ``[kv, rows]``, ``acc``
    ``[kv, rows, dv]``, float32 of ``q``'s library."""
    lib = found.library()
    if lib is None:
        return None
    kv, rows, d = (int(n) for n in q.shape)
    if rows > ROWS:
        return None
    torch = sys.modules.get("torch")
    is_torch = torch is not None and isinstance(q, torch.Tensor)
    (kc, ks), (vc, vs) = keys, values
    if grad_asked(q, kc, ks, vc, vs):
        return None
    if is_torch:
        q = q.contiguous()
        if q.dtype != torch.float32:
            return None
    else:
        q = np.ascontiguousarray(q)
        if q.dtype != np.float32:
            return None
    parts = [memory(a) for a in (kc, ks, vc, vs)]
    if any(p is None for p in parts) or str(ks.dtype)[-7:] != "float32" or str(
            vs.dtype)[-7:] != "float32":
        return None
    (ka, kst), (sa, sst), (va, vst), (ta, tst) = parts
    if kst[2] != 1 or vst[2] != 1:
        return None
    kbits = 4 if str(kc.dtype).endswith("uint8") else 8
    vbits = 4 if str(vc.dtype).endswith("uint8") else 8
    dv = int(vc.shape[2]) * (2 if vbits == 4 else 1)
    if is_torch:
        m, l, acc = (torch.empty((kv, rows), dtype=torch.float32),
                     torch.empty((kv, rows), dtype=torch.float32),
                     torch.empty((kv, rows, dv), dtype=torch.float32))
    else:
        m, l, acc = (np.empty((kv, rows), np.float32), np.empty((kv, rows), np.float32),
                     np.empty((kv, rows, dv), np.float32))
    args = found.Run(int(kc.shape[0]), kv, rows, d, dv, kbits, vbits, memory(q)[0],
                     ka, kst[0], kst[1], sa, sst[0], sst[1], va, vst[0], vst[1], ta, tst[0],
                     tst[1], *(memory(x)[0] for x in (m, l, acc)))
    return None if lib.run(args) else (m, l, acc)
