"""Every lane's seen columns through its row of the table in one call of the kernel
(``kernel.c``'s ``cacheidx_paged``, called by :mod:`cacheidx.attention.paged`): lanes x kv
heads over the threads it is given, for float32, float16, bfloat16, int8, int4 and turned
4-bit pools."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import numpy as np

from ... import pools, turned
from . import found
from .memory import grad_asked, memory

__all__ = ["KINDS", "ROWS", "THREADED", "WIDEST", "paged", "threads"]

#: the most query rows a kv head a call weighs (grouped heads x queries, x lanes where the core
#: stacks those sharing a prefix: ``kernel.c``'s ``ROWS``)
ROWS = 16

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


#: ``kernel.c``'s kind of turned 4-bit codes (:mod:`cacheidx.turned`)
TURNED = 5


def _pool(pool: Any) -> tuple[int, ...] | None:
    """A pool's ``(kind, address, slot stride, head stride, scales' kind, address, slot
    stride, head stride, zero points' address, group)`` for the paged kernel (strides in
    elements; a float pool's scales, and all but a turned pool's zero points and group, zero),
    or ``None`` where it cannot read it. A kind of pool whose :class:`~cacheidx.pools.Kind`
    does not name the ``"paged"`` entry is refused here, whoever calls: its parts alone might
    pass for another kind's (turned codes for int4 ones with one scale a token)."""
    if "paged" not in pools.kind(pool).kernel:
        return None
    turned_ = isinstance(pool, turned.Turned)
    codes, scales = (pool.codes, pool.scales) if hasattr(pool, "codes") else (pool, None)
    got = memory(codes)
    kind = KINDS.get(str(codes.dtype).rsplit(".", 1)[-1])
    if got is None or kind is None or got[1][2] != 1 and int(codes.shape[2]) > 1:
        return None
    if (scales is None) != (kind < KINDS["int8"]):
        return None  # codes without scales, or floats with them
    address, (sst, hst, _) = got
    if scales is None:
        return kind, address, sst, hst, 0, 0, 0, 0, 0, 0
    at = memory(scales)
    skind = KINDS.get(str(scales.dtype).rsplit(".", 1)[-1])
    if at is None or skind is None or skind >= KINDS["int8"]:
        return None
    if not turned_:
        return kind, address, sst, hst, skind, at[0], *at[1][:2], 0, 0
    zeros = memory(pool.zeros)
    # the kernel reads a row's groups adjacent, and its zero points where its scales lie
    if zeros is None or zeros[1] != at[1] or at[1][2] != 1 and int(scales.shape[2]) > 1:
        return None
    return TURNED, address, sst, hst, skind, at[0], *at[1][:2], zeros[0], pool.group


def _turn(x: Any, pool: Any, torch: Any) -> Any:
    """``x @ (H / b)`` over its last axis where ``pool`` is turned (:mod:`cacheidx.turned`'s
    T1: ``H`` symmetric, so a score ``q . (y H / b)`` is ``(q H / b) . y`` and a weighted sum
    of ``y H / b`` is the sum of ``y`` turned back), else ``x``."""
    if not isinstance(pool, turned.Turned):
        return x
    back = turned.back_host(int(x.shape[-1]))
    return x @ (torch.tensor(back) if torch is not None else back)  # a copy: the cached
    # matrix is read-only


def paged(q: Any, table: np.ndarray, start: np.ndarray, stop: np.ndarray, kpool: Any,
          vpool: Any) -> tuple[Any, Any, Any] | None:
    """``(m, l, acc)`` of every lane and kv head over its seen columns, read through its row of the
    table by one call of the kernel (lanes x kv heads over :func:`threads`), or ``None`` where
    it does not apply: no kernel, pools it cannot read (float32, float16, bfloat16, quantized
    codes with scales of those, or turned codes with scales of those and zero points; NumPy or
    CPU tensors, a row's elements adjacent), more than :data:`ROWS` query rows a kv head, a head
    dim past :data:`WIDEST`, a gradient asked (torch's grad mode on and an input requiring grad:
    no backward), a query not finite, a score NaN or ``+inf``, or a state not finite (a value
    that is not: the core's laws weigh it). A row that weighs no column (its lane sees none, or
    its scores are all ``-inf``) has ``m = -inf``, ``l = 0``, ``acc = 0``.

    ``q`` ``[lanes, kv, g, d]`` float32 (scaled); lane ``b`` sees columns ``start[b]`` to
    ``stop[b] - 1``, column ``c`` at slot ``table[b, c]`` (int64, inside both pools: the caller
    checked); pools ``[slots, kv, d]`` as :mod:`cacheidx.quantized`, :mod:`cacheidx.turned` or
    plain. ``m`` and ``l`` ``[lanes, kv, g]``, ``acc`` ``[lanes, kv, g, dv]``, float32 of
    ``q``'s library."""
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
    q = _turn(q, kpool, torch if is_torch else None)
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
                       kp[9], vp[9], threads(q) if work >= THREADED else 1, memory(q)[0],
                       table.ctypes.data, int(table.shape[1]), start.ctypes.data, stop.ctypes.data,
                       *kp[1:4], *kp[5:8], *vp[1:4], *vp[5:8], kp[8], vp[8],
                       *(memory(x)[0] for x in (m, l, acc)))
    if lib.paged(args):
        return None
    return m, l, _turn(acc, vpool, torch if is_torch else None)
