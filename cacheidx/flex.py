"""FlexAttention for a cache index (PyTorch only; import it as ``cacheidx.flex``).

``mask_mod(index)`` is a FlexAttention ``mask_mod``: ``(b, h, q, kv) -> bool``, true where
token ``q`` of lane ``b`` sees column ``kv`` of ``extend``'s seen, exactly as ``index.mask()``
says, whatever the head. It reads the tokens' positions ([batch, seq]) and the pair's
coordinates, never a stored [batch, seq, context] mask; under a draft it also reads the
draft's own ``sees`` [batch, seq, seq]. ``block_mask(index)`` is the ``BlockMask`` that
``flex_attention`` takes, for queries of ``seq`` tokens and keys ``context`` wide::

    from torch.nn.attention.flex_attention import flex_attention
    from cacheidx import flex

    k_seen, k_pool = index.extend(k, k_pool, donate=True)   # [batch, context, heads, dim]
    out = flex_attention(q, k_seen.transpose(1, 2), v_seen.transpose(1, 2),
                         block_mask=flex.block_mask(index))

A selection gives each token keys of its own ([batch, seq, k, ...]), which attention over
shared keys cannot take: both functions raise on one. A token that sees nothing (padding)
gets an output FlexAttention leaves at zero; the spec leaves it unspecified.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import masks
from .index import CacheIndex
from .laws import inside, sees, stands

__all__ = ["mask_mod", "block_mask"]


def mask_mod(index: CacheIndex) -> Callable[[Any, Any, Any, Any], Any]:
    """The ``mask_mod`` of ``index``: ``mask_mod(b, h, q, kv)`` equals ``index.mask()[b, q, kv]``
    for every head ``h``, and is false for a ``q`` or ``kv`` past the index's ``seq`` or
    ``context`` (FlexAttention may ask about its blocks' padding). Built from ``index``'s
    tensors once; static shapes and no host reads, so it traces under ``torch.compile`` and
    ``vmap``.

    Raises ``ValueError`` if ``index`` selects columns, ``TypeError`` if its tensors are not
    torch's."""
    if not isinstance(index.pos, torch.Tensor):
        raise TypeError(f"cacheidx.flex.mask_mod: the index's tensors must be torch tensors, "
                        f"got {type(index.pos).__name__}")
    if index.columns is not None:
        raise ValueError("cacheidx.flex.mask_mod: the index selects columns, so each token "
                         "has keys of its own; attend over them with mask() instead")
    # [batch, seq]: positions, -1 for padding (padding sees nothing)
    t = masks.valid_positions(index)
    seq, context, w, m = index.seq, index.context, index.window_size, index.block

    def token(q: Any) -> Any:
        return q.clamp(0, seq - 1)

    if index.draft_slots is not None:
        return _draft_mod(index, t, token)

    if index.kind == "tabled" or m != 1:

        def tabled(b: Any, h: Any, q: Any, kv: Any) -> Any:
            # column kv stands at its position (or its block's last), seen at or before the
            # token's position, within the window; a whole lane has closed every block at or
            # before any of its tokens, so no other condition applies there
            tq = t[b, token(q)]
            return ((q < seq) & (tq >= 0) & inside(kv, context)
                    & sees(stands(kv, m), tq, w))

        return tabled

    def whole(b: Any, h: Any, q: Any, kv: Any) -> Any:
        # column kv is token kv of the lane, seen from the same sequence: kv - p == q - t
        tq, p = t[b, token(q)], t[b, kv.clamp(0, seq - 1)]
        return ((q < seq) & (tq >= 0) & inside(kv, seq) & (p >= 0)
                & (kv - p == q - tq) & sees(p, tq, w))

    return whole


def _draft_mod(index: CacheIndex, t: Any, token: Callable[[Any], Any]) -> Callable:
    """Under a draft: the table's columns before the lane's least position, then the call's
    tokens as ``sees`` says; of both only those at or before the token and within the window."""
    seq, w = index.seq, index.window_size
    width = int(index.table.shape[1])
    big = torch.iinfo(t.dtype).max
    least = torch.where(t >= 0, t, big).amin(dim=1)  # [batch]
    draft_sees = index.draft_sees

    def draft(b: Any, h: Any, q: Any, kv: Any) -> Any:
        tq = t[b, token(q)]
        j = (kv - width).clamp(0, seq - 1)
        tj = t[b, j]
        in_table = inside(kv, width) & (kv < least[b]) & sees(kv, tq, w)
        in_call = (inside(kv - width, seq) & (tj >= 0) & draft_sees[b, token(q), j]
                   & sees(tj, tq, w))
        return (q < seq) & (tq >= 0) & (in_table | in_call)

    return draft


def block_mask(index: CacheIndex, *, heads: int | None = None, **kwargs: Any) -> Any:
    """``create_block_mask(mask_mod(index), batch, heads, seq, context)`` on the index's device:
    the ``BlockMask`` for ``flex_attention`` over queries of the call's tokens and keys of
    ``extend``'s seen. ``heads=None`` broadcasts over heads; ``kwargs`` go to
    ``create_block_mask`` (``BLOCK_SIZE``, ``_compile``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod(index), index.batch, heads, index.seq, index.context,
                             device=index.backend.device(index.pos), **kwargs)
