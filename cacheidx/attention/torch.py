"""PyTorch: a compiled call is one opaque operator that attends eagerly, as vLLM's layers do;
and over head-major pools on the CPU, a lane's products shaped as torch streams them fastest.

Eagerly, a decode step over CPU pools is read by the CPU kernel, which walks each lane's page
table itself (:mod:`.paged`); other calls the core reads as views of runs of slots
(:mod:`.runs`); traced,
there are no values to find runs in, and the standard's tiles gather every tile's keys, which
costs a compiled decode layer several times an eager one (docs/attention.md has the figures).
So under ``torch.compile`` a call is
``torch.ops.cacheidx.attend``, a custom operator the compiler keeps whole (vLLM's attention
is one too): at run time it rebuilds the index from its tensors and attends as an eager
serving step does (under inference mode), storing into the pools it is handed (the operator
mutates them): eager and compiled calls compute the same thing by the same code (attention's
laws 1 and 2, kept by the eager code). The index travels as :func:`operands`: its structure's
constant part as a string, its numbers as ints, its tensors; the plan every layer shares is the
recent one that fits the tensors' values (:class:`~cacheidx.plan.Recent`).

Under autograd (a training step through a whole index) the traced tiles stay: the operator has
no backward. On a GPU they stay too: the operator plans its reads on the host, and a CUDA graph
(the engine's compiled steps there) cannot capture a copy to the host.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import torch
from torch import Tensor

from .. import pools, pytree
from ..backends import onednn
from ..plan import Recent
from . import layout, paged

__all__ = ["HeadMajor", "TorchPath", "operands"]


class TorchPath:
    def attend(self, call: Any) -> tuple[Any, Any, Any] | None:
        index = call.index
        if not index.backend.tracing(index.pos):
            # eagerly a decode step over CPU pools is the paged kernel's where it applies;
            # otherwise the core reads views itself
            return paged.attend(call)
        if call.q.device.type != "cpu":
            # the operator plans its reads on the host, which a CUDA graph cannot capture
            # (the engine replays its steps as ones): on a GPU the traced tiles stay
            return None
        arrays = [a for a in (call.q, call.k, call.v, *pools.parts(call.kpool),
                              *pools.parts(call.vpool), call.sinks) if a is not None]
        if torch.is_grad_enabled() and any(a.requires_grad for a in arrays):
            return None
        kpool, vpool = call.kpool, call.vpool
        kind = pools.kind(kpool)
        if pools.kind(vpool) is not kind:
            return None  # one pool quantized, the other not: the traced tiles
        if not call.donate:  # the caller keeps its pools: the operator stores into copies
            kpool, vpool = pools.map(kpool, torch.clone), pools.map(vpool, torch.clone)
        parts = [*pools.parts(kpool), *pools.parts(vpool)]
        out = torch.ops.cacheidx.attend(*operands(index, kind.name), call.q, call.k, call.v,
                                        parts, call.sinks, call.scale, call.softcap, call.tile)
        return out, kpool, vpool

    def layout(self, pool: Tensor) -> str:
        """Head-major on the CPU, where views and :class:`HeadMajor` pay; token-major on a
        GPU, whose row kernels want contiguous pools."""
        return "head" if pool.device.type == "cpu" else "token"

    def products(self, backend: Any, kpool: Any, vpool: Any) -> Any:
        """One lane's products over head-major pools on the CPU (:class:`HeadMajor`), or
        ``None``."""
        if (pools.parts(kpool)[0].device.type != "cpu" or not layout.head_major(kpool)
                or not layout.head_major(vpool)):
            return None
        return HeadMajor()


#: the most query rows per kv head (grouped heads x tokens) whose scores are computed keys
#: first: a decode step's few (a long prefill's are faster plain: docs/attention.md)
FEW = 16
#: the fewest columns for which the products of their own pay for their extra calls: below,
#: one product over all heads (a served chat's short pieces lose to the extra calls)
SHORT = 512


class HeadMajor:
    """A lane's products where each head's slots are contiguous rows (a head-major pool), each
    shaped as the library streams fastest (a decode layer's figures against the standard's
    products: docs/attention.md, "Where the bytes lie")."""

    def scores(self, q: Tensor, keys: Tensor) -> Tensor:
        if q.shape[2] > FEW or keys.shape[1] < SHORT:  # a prefill's block (a transposed
            # product's softmax would run over strided scores), or too few keys to pay
            return q @ keys.permute(0, 2, 3, 1)
        # K_h q_h^T, long rows of keys against the few queries (MKL's q K^T with a few rows
        # streams the keys slower); the transpose back is a view
        z = torch.bmm(keys[0].transpose(0, 1), q[0].transpose(1, 2))
        return z.transpose(1, 2)[None]

    def run(self, q: Tensor, keys: Tensor, values: Tensor
            ) -> tuple[Tensor, Tensor, Tensor] | None:
        if (keys.shape[1] < SHORT or keys.dtype != q.dtype or values.dtype != q.dtype
                or not q.shape[-1] == keys.shape[-1] == values.shape[-1]  # one head size
                or torch.is_grad_enabled() and any(
                    x.requires_grad for x in (q, keys, values))):
            return None  # short: the products pay; its backward has no log-sum-exp's
        if stacks_by_onednn() and onednn.applies(q[0, 0], keys[0, :, 0, :].mT):
            m, l, acc = _stacked(q, keys, values)
        else:
            # torch's fused CPU attention (FlashAttention's blocking over MKL's products),
            # which returns each row's log-sum-exp
            acc, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, keys[0].transpose(0, 1)[None], values[0].transpose(0, 1)[None], 0.0,
                False, scale=1.0)
            m = m[..., None]
            l = torch.ones_like(m)
        if not math.isfinite(float(acc.sum())):
            return None  # a value or score that is not finite: the law's careful product
        return m, l, acc

    def weigh(self, p: Tensor, values: Tensor) -> Tensor:
        # oneDNN's linear under inference mode, which streams V_h faster than MKL's P V_h
        # there, head by head; unpacked: a pool's rows are no weight (backends/onednn.py)
        if values.shape[1] < SHORT:
            return p @ values.permute(0, 2, 1, 3)
        v = values[0]
        return torch.stack([onednn.product(p[0, h], v[:, h, :], pack=False)
                            for h in range(v.shape[1])])[None]


@functools.cache
def stacks_by_onednn() -> bool:
    """Whether stacked rows are weighed by oneDNN's products (:func:`_stacked`, under inference
    mode) rather than torch's fused CPU attention: where torch runs its AVX-512 kernels. There
    oneDNN's products ran at twice the fused attention's, whose MKL takes its AVX2 path on an
    AMD processor (Zen 5: 32 lanes x 9 heads over a 4,096-column prefix, 1.9 ms a layer against
    3.6); on AVX2 alone the fused attention is the faster (Zen 3, over the same prefix: 24 rows
    a kv head 1.6 ms against 2.5, 96 rows 7.1 against 7.9)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


#: the most stacked rows a product of :func:`_stacked` weighs at once: their scores, ``ROWS``
#: by the columns, stay in the core's caches between the two products
ROWS = 128
_LOG2E, _LN2 = math.log2(math.e), math.log(2.0)


def _stacked(q: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The online softmax's state ``(m, l, acc)`` of ``q`` ``[1, kv, rows, d]`` over one
    lane's float32 views every row sees whole, by oneDNN's products: a shared prefix's stacked
    rows, or a prefill's earlier columns. Twice the speed of torch's fused CPU attention, which
    multiplies by MKL's (32 lanes x 9 heads over a 4,096-column prefix: 1.9 ms a layer against
    3.6; docs/attention.md). Scores in base 2 (``q log2 e`` against the keys), since torch's
    ``exp2`` runs at four times its ``exp`` here and is as close (1.2 ulp); ``m`` is returned
    in natural logs, as the state keeps it."""
    kv, rows = q.shape[1], q.shape[2]
    q2 = q[0] * _LOG2E
    ms, ls, accs = [], [], []
    for h in range(kv):
        k, v = keys[0, :, h, :], values[0, :, h, :]
        for r in range(0, rows, ROWS):
            s = onednn.linear(q2[h, r:r + ROWS], k.mT, pack=False)
            m = torch.amax(s, dim=-1, keepdim=True)
            p = s.sub_(m).exp2_()
            ms.append(m)
            ls.append(p.sum(dim=-1, keepdim=True))
            accs.append(onednn.linear(p, v, pack=False))
    shape = (1, kv, rows, -1)
    return (torch.cat(ms).mul_(_LN2).reshape(shape), torch.cat(ls).reshape(shape),
            torch.cat(accs).reshape(shape))


def operands(index: Any, kind: str = "floats") -> tuple[str, list[int], int, int, list[Tensor]]:
    """``index`` as the operator's first arguments: its structure's constant part and the
    name of its pools' kind (:func:`cacheidx.pools.named`) as a string (the only static value
    an operator takes beside numbers), its numbers as ints (under ``dynamic=True`` they may be
    symbolic; the operator sees them concrete), its tensors."""
    s = index.structure
    return (f"{_encode(s)};{kind}", list(s.blocks), s.every,
            -1 if s.window is None else s.window, pytree.leaves(index))


def _encode(structure: Any) -> str:
    """The constant part of an index's :class:`~cacheidx.index.Structure`, as a string."""
    return (f"{structure.kind};{int(structure.row)};{int(structure.columns)};"
            f"{int(structure.draft)};{structure.shared}")


def _decode(text: str, blocks: list[int], every: int, window: int) -> Any:
    from ..index import Structure

    kind, row, columns, draft, shared = text.split(";")
    return Structure(kind, row == "1", tuple(int(m) for m in blocks), int(every),
                     None if window == -1 else int(window), columns == "1", draft == "1",
                     int(shared))


#: a pool's parts (the operator's argument ``pools`` hides the module's name)
_parts = pools.parts


def _pair(kind: str, parts: list[Tensor]) -> tuple[Any, Any]:
    """The operator's ``pools`` as ``(kpool, vpool)``, two pools of the kind named ``kind``
    (:func:`cacheidx.pools.named`), each half of the parts: two float pools, or the codes
    and scales of two quantized ones."""
    of, half = pools.named(kind), len(parts) // 2
    return of.remade(parts[:half]), of.remade(parts[half:])


@torch.library.custom_op("cacheidx::attend", mutates_args=("pools",))
def _attend(structure: str, blocks: list[int], every: int, window: int, leaves: list[Tensor],
            q: Tensor, k: Tensor, v: Tensor, pools: list[Tensor],
            sinks: Optional[Tensor], scale: float,  # noqa: UP045
            softcap: Optional[float], tile: Optional[int]) -> Tensor:  # noqa: UP045
    """``cacheidx::attend``: the call the arguments name, eagerly, storing into ``pools``
    (``[kpool, vpool]``, or a quantized pair's ``[kcodes, kscales, vcodes, vscales]``; torch's
    schema needs ``Optional`` spelled out)."""
    from . import attend

    structure, kind = structure.rsplit(";", 1)
    index = _index(_decode(structure, blocks, every, window), leaves)
    kpool, vpool = _pair(kind, pools)
    # no input wants a gradient (else the tiles compute the call): it attends as an eager
    # serving step does, under inference mode (the backend's products then take oneDNN)
    with torch.inference_mode():
        out, kept, vkept = attend(index, q, k, v, kpool, vpool, scale=scale, softcap=softcap,
                                  sinks=sinks, donate=True, tile=tile)
        for pool, got in zip(pools, [*_parts(kept), *_parts(vkept)], strict=True):
            if got is not pool:  # stored into a copy after all: the operator's are the pools
                pool.copy_(got)
    # a tensor of its own, outside inference mode, with the fake's strides: the compiled
    # graph views it by those
    return out.clone(memory_format=torch.contiguous_format)


#: the plans of the indices the operator rebuilt lately: every layer of a step passes tensors
#: of the same values, and shares the one plan that fits them (checked by value: an inference
#: tensor keeps no version counter, and a write through NumPy bumps none)
_RECENT = Recent()


def _index(structure: Any, leaves: list[Tensor]) -> Any:
    """The index of ``structure`` over ``leaves``, with the recent plan that fits their
    values (a new one where none does)."""
    return pytree.rebuild(structure, leaves, plan=_RECENT.plan(structure, leaves))


@_attend.register_fake
def _(structure, blocks, every, window, leaves, q, k, v, pools, sinks, scale, softcap, tile):
    return q.new_empty((*q.shape[:3], _pair(structure.rsplit(";", 1)[1], pools)[1].shape[-1]))
