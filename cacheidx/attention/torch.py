"""PyTorch: a compiled call is one opaque operator that attends eagerly, as vLLM's layers do.

Eagerly, the core reads a lane's runs of slots as views of the pools (:mod:`.runs`); traced,
there are no values to find runs in, and the standard's tiles gather every tile's keys, which
costs a compiled decode layer about three times an eager one (8 lanes of 4,096 tokens, one
thread: 13 to 16 ms against 4.2). So under ``torch.compile`` a call is
``torch.ops.cacheidx.attend``, a custom operator the compiler keeps whole (vLLM's attention
is one too): at run time it rebuilds the index from its tensors and attends eagerly, storing
into the pools it is handed (the operator mutates them), and eager and compiled calls compute
the same thing by the same code. The index's structure travels as a string, the only static
value an operator takes beside numbers.

Under autograd (a training step through a whole index) the traced tiles stay: the operator has
no backward.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["TorchPath"]


class TorchPath:
    def attend(self, call: Any) -> tuple[Any, Any, Any] | None:
        index = call.index
        if not index.backend.tracing(index.pos):
            return None  # eagerly the core reads views itself
        arrays = [a for a in (call.q, call.k, call.v, call.kpool, call.vpool, call.sinks)
                  if a is not None]
        if torch.is_grad_enabled() and any(a.requires_grad for a in arrays):
            return None
        from ..index import _flatten

        leaves, (structure, _) = _flatten(index)
        kpool, vpool = call.kpool, call.vpool
        if not call.donate:  # the caller keeps its pools: the operator stores into copies
            kpool, vpool = kpool.clone(), vpool.clone()
        out = torch.ops.cacheidx.attend(_encode(structure), list(leaves), call.q, call.k,
                                        call.v, kpool, vpool, call.sinks, call.scale,
                                        call.softcap, call.tile)
        return out, kpool, vpool


def _encode(structure: Any) -> str:
    """An index's :class:`~cacheidx.index.Structure` as the operator's string argument."""
    blocks = ",".join(str(m) for m in structure.blocks)
    return (f"{structure.kind};{int(structure.row)};{blocks};{structure.every};"
            f"{-1 if structure.window is None else structure.window};"
            f"{int(structure.columns)};{int(structure.draft)}")


def _decode(text: str) -> Any:
    from ..index import Structure

    kind, row, blocks, every, window, columns, draft = text.split(";")
    return Structure(kind, row == "1", tuple(int(m) for m in blocks.split(",") if m),
                     int(every), None if window == "-1" else int(window), columns == "1",
                     draft == "1")


@torch.library.custom_op("cacheidx::attend", mutates_args=("kpool", "vpool"))
def _attend(structure: str, leaves: list[Tensor], q: Tensor, k: Tensor, v: Tensor,
            kpool: Tensor, vpool: Tensor, sinks: Optional[Tensor], scale: float,  # noqa: UP045
            softcap: Optional[float], tile: Optional[int]) -> Tensor:  # noqa: UP045
    """``cacheidx::attend``: the call the arguments name, eagerly, storing into ``kpool`` and
    ``vpool`` (torch's schema needs ``Optional`` spelled out)."""
    from . import attend

    index = _index(structure, leaves)
    out, kept, vkept = attend(index, q, k, v, kpool, vpool, scale=scale, softcap=softcap,
                              sinks=sinks, donate=True, tile=tile)
    for pool, got in ((kpool, kept), (vpool, vkept)):
        if got is not pool:  # stored into a copy after all: the operator's are the pools
            pool.copy_(got)
    return out.contiguous()  # as the fake's: the compiled graph views it by those strides


#: the last index the operator rebuilt, with what it was rebuilt from: every layer of a step
#: passes the same tensors, and the one index keeps the host's read plan for all of them
_LAST: list[tuple[tuple, Any]] = []


def _index(structure: str, leaves: list[Tensor]) -> Any:
    """The index of ``structure`` over ``leaves``: the last one again where its leaves are the
    same tensors, unchanged since (their version counters say so), else a new one."""
    from .. import backends
    from ..index import _unflatten

    key = (structure, *((id(t), t._version) for t in leaves))
    if _LAST and _LAST[0][0] == key:
        return _LAST[0][1]
    index = _unflatten((_decode(structure), backends.get("torch")), leaves)
    _LAST[:] = [(key, index)]  # the index holds its leaves: their ids stay theirs
    return index


@_attend.register_fake
def _(structure, leaves, q, k, v, kpool, vpool, sinks, scale, softcap, tile):
    return q.new_empty((*q.shape[:3], vpool.shape[-1]))
