"""On torch, the paged kernel (:func:`~cacheidx.attention.native.paged`) as the operator
``cacheidx::paged``, registered through ``torch.library`` with a fake implementation, so that
``torch.compile`` traces a call of it as one node of known shapes and
``torch.library.opcheck`` checks it. Importing this module registers it (it imports torch).

``torch.ops.cacheidx.paged(q, table, start, stop, kpool, vpool)`` gives
``(m, l, acc, refused)``: the online softmax's state of every lane and kv head over its seen
columns (:func:`~cacheidx.attention.native.paged`'s law), and a 0-d bool that is true where the
kernel refused the call (its values, a pool it does not read, or no kernel built), whose
state is then zeros. ``kpool`` and ``vpool`` are a float pool's ``[pool]`` or a quantized
pool's ``[codes, scales]``; ``table``, ``start`` and ``stop`` int64 tensors.

The eager decode step (:mod:`cacheidx.attention.paged`) calls the kernel directly rather than
through the operator: it must know a refusal on the host, to leave the call to the core,
and reading ``refused`` back would be a read of a tensor's value in every layer. Under
``torch.compile`` the whole attention call is the operator ``cacheidx::attend``
(:mod:`cacheidx.attention.torch`), which runs that eager step inside."""

from __future__ import annotations

import torch
from torch import Tensor

from ... import quantized
from . import pages

__all__ = ["paged"]


def _pool(parts: list[Tensor]):
    if len(parts) == 2:
        return quantized.Quantized(parts[0], parts[1])
    if len(parts) == 1:
        return parts[0]
    raise ValueError("cacheidx::paged: a pool is [pool] or [codes, scales], got "
                     f"{len(parts)} tensors")


def _width(parts: list[Tensor]) -> int:
    """The head dim a pool's values have (4-bit codes hold two a byte)."""
    codes = parts[0]
    return int(codes.shape[2]) * (2 if len(parts) == 2 and codes.dtype == torch.uint8 else 1)


@torch.library.custom_op("cacheidx::paged", mutates_args=())
def paged(q: Tensor, table: Tensor, start: Tensor, stop: Tensor, kpool: list[Tensor],
          vpool: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(m, l, acc, refused)`` of the module's law: ``q`` ``[lanes, kv, g, d]`` float32
    (scaled), lane ``b`` seeing columns ``start[b]`` to ``stop[b] - 1`` at slots
    ``table[b, c]`` (inside both pools)."""
    lanes, kv, g, _ = (int(n) for n in q.shape)
    got = pages.paged(q, table.numpy(), start.numpy(), stop.numpy(), _pool(kpool),
                      _pool(vpool))
    if got is None:
        dv = _width(vpool)
        return (torch.zeros((lanes, kv, g), dtype=torch.float32),
                torch.zeros((lanes, kv, g), dtype=torch.float32),
                torch.zeros((lanes, kv, g, dv), dtype=torch.float32),
                torch.ones((), dtype=torch.bool))
    m, l, acc = got
    return m, l, acc, torch.zeros((), dtype=torch.bool)


@paged.register_fake
def _(q, table, start, stop, kpool, vpool):
    lanes, kv, g, _ = q.shape
    dv = _width(vpool)
    return (q.new_empty((lanes, kv, g), dtype=torch.float32),
            q.new_empty((lanes, kv, g), dtype=torch.float32),
            q.new_empty((lanes, kv, g, dv), dtype=torch.float32),
            q.new_empty((), dtype=torch.bool))
