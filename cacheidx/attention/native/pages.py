"""Every lane's seen columns through its row of the table in one call of the kernel
(``kernel.c``'s ``cacheidx_paged``, called by :mod:`cacheidx.attention.paged`): lanes x kv
heads over the threads it is given, for float32, float16, bfloat16, int8 and int4 pools."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import numpy as np

from ... import pools
from . import found
from .memory import grad_asked, memory
from .rows import ROWS

__all__ = ["KINDS", "THREADED", "WIDEST", "paged", "threads"]

#: the kinds of element the paged kernel reads (``kernel.c``'s enum), by dtype name
KINDS = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3, "uint8": 4}

#: the widest head dim the kernel reads (``kernel.c``'s ``WIDEST``)
WIDEST = 1024


def threads(q: Any) -> int:
    """The threads a paged call over ``q``'s library is given: torch's intra-op threads
    (``torch.get_num_threads()``) for a tensor; for a NumPy array ``CACHEIDX_THREADS``, else
    ``OMP_NUM_THREADS``, else the cores this process may run on."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(q, torch.Tensor):
        return max(1, int(torch.get_num_threads()))
    for name in ("CACHEIDX_THREADS", "OMP_NUM_THREADS"):
        with contextlib.suppress(ValueError):
            return max(1, int(os.environ.get(name, "")))
    with contextlib.suppress(AttributeError):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


#: the fewest elements (columns x kv heads x head dim, over the call) for which a second thread
#: pays for starting it
THREADED = 1 << 16


def _pool(pool: Any) -> tuple[int, int, int, int, int, int, int, int] | None:
    """A pool's ``(kind, address, slot stride, head stride, scales' kind, address, slot
    stride, head stride)`` for the paged kernel (strides in elements; a float pool's scales
    zero), or ``None`` where it cannot read it: a kind of pool whose :class:`~cacheidx.pools.Kind`
    does not say ``kernel`` (codes turned with zeros per group, say) is refused here, whoever
    calls, since its parts alone would pass for codes with one scale per token."""
    of = pools.kind(pool)
    if not (of is pools.FLOATS or of.kernel):
        return None
    codes, scales = (pool.codes, pool.scales) if hasattr(pool, "codes") else (pool, None)
    got = memory(codes)
    kind = KINDS.get(str(codes.dtype).rsplit(".", 1)[-1])
    if got is None or kind is None or got[1][2] != 1 and int(codes.shape[2]) > 1:
        return None
    if (scales is None) != (kind < KINDS["int8"]):
        return None  # codes without scales, or floats with them
    address, (sst, hst, _) = got
    if scales is None:
        return kind, address, sst, hst, 0, 0, 0, 0
    at = memory(scales)
    skind = KINDS.get(str(scales.dtype).rsplit(".", 1)[-1])
    if at is None or skind is None or skind >= KINDS["int8"]:
        return None
    return kind, address, sst, hst, skind, at[0], *at[1][:2]


def paged(q: Any, table: np.ndarray, start: np.ndarray, stop: np.ndarray, kpool: Any,
          vpool: Any) -> tuple[Any, Any, Any] | None:
    """``(m, l, acc)`` of every lane and kv head over its seen columns, read through its row
    of the table by one call of the kernel (lanes x kv heads over :func:`threads`), or ``None``
    where it does not apply: no kernel, pools it cannot read (float32, float16, bfloat16, or
    quantized codes with scales of those; NumPy or CPU tensors, a row's elements adjacent),
    more than :data:`ROWS` query rows a kv head, a head dim past :data:`WIDEST`, a gradient
    asked (torch's grad mode on and an input requiring grad: no backward), a query not
    finite, a score NaN or ``+inf``, or a state not finite (a value that is not: the core's
    laws weigh it). A row that weighs no column (its lane sees none, or its scores are all
    ``-inf``) has ``m = -inf``, ``l = 0``, ``acc = 0``.

    ``q`` ``[lanes, kv, g, d]`` float32 (scaled); lane ``b`` sees columns ``start[b]`` to
    ``stop[b] - 1``, column ``c`` at slot ``table[b, c]`` (int64, inside both pools: the caller
    checked); pools ``[slots, kv, d]`` as :mod:`cacheidx.quantized` or plain. ``m`` and ``l``
    ``[lanes, kv, g]``, ``acc`` ``[lanes, kv, g, dv]``, float32 of ``q``'s library."""
    lib = found.library()
    if lib is None:
        return None
    lanes, kv, g, d = (int(n) for n in q.shape)
    if g > ROWS or d > WIDEST or int(vpool.shape[2]) > WIDEST:
        return None
    kp, vp = _pool(kpool), _pool(vpool)
    if kp is None or vp is None:
        return None
    if str(q.dtype).rsplit(".", 1)[-1] != "float32":
        return None
    torch = sys.modules.get("torch")
    is_torch = torch is not None and isinstance(q, torch.Tensor)
    if grad_asked(q, *pools.parts(kpool), *pools.parts(vpool)):
        return None
    if is_torch:
        q = q.contiguous()
        m, l, acc = (torch.empty((lanes, kv, g), dtype=torch.float32),
                     torch.empty((lanes, kv, g), dtype=torch.float32),
                     torch.empty((lanes, kv, g, int(vpool.shape[2])), dtype=torch.float32))
    else:
        q = np.ascontiguousarray(q)
        m, l, acc = (np.empty((lanes, kv, g), np.float32), np.empty((lanes, kv, g), np.float32),
                     np.empty((lanes, kv, g, int(vpool.shape[2])), np.float32))
    table = np.ascontiguousarray(table, dtype=np.int64)
    start = np.ascontiguousarray(start, dtype=np.int64)
    stop = np.ascontiguousarray(stop, dtype=np.int64)
    work = int((stop - start).sum()) * kv * d
    args = found.Paged(lanes, kv, g, d, int(vpool.shape[2]), kp[0], vp[0], kp[4], vp[4],
                       threads(q) if work >= THREADED else 1, memory(q)[0],
                       table.ctypes.data, int(table.shape[1]), start.ctypes.data, stop.ctypes.data,
                 *kp[1:4], *kp[5:], *vp[1:4], *vp[5:], *(memory(x)[0] for x in (m, l, acc)))
    return None if lib.paged(args) else (m, l, acc)
