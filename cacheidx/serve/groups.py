"""Groups of layers: layers that read back alike share one table and one pool of pages.

A layer's reach through a table is the furthest back any of its reads looks (the spec): every
position for a full layer, the last ``w`` positions for a sliding layer of window ``w``
(:mod:`cacheidx.prefix.reach`). The engine keeps one table and one pool of pages per group, so
that a sliding group frees its columns below the reach still to be fed.

Laws:

1. The layers of one window are one group, the full layers (window ``None``) another; the
   full group comes first, then the sliding ones by window.
2. The engine may keep more of a layer than it reads, never less: a window it is told for a
   layer is ``None`` or at least the layer's own. ``None`` for every layer is one table for
   every layer, which keeps every position (what the engine did before groups).
3. With one group the model is called with one index, as without groups. With several the
   call has one index per group, made over one row map and one tensor of positions, and
   layer ``i`` reads ``indices[of_layer[i]]`` (:meth:`Groups.per_layer`) over pools of its
   group's slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..prefix.reach import window_pages

__all__ = ["Groups", "frees", "windows_told"]


@dataclasses.dataclass(frozen=True)
class Groups:
    """The groups of a model's layers (law 1): each group's window, each layer's group."""

    windows: tuple[int | None, ...]
    of_layer: tuple[int, ...]

    @classmethod
    def of(cls, layer_windows: Sequence[int | None], context: int | None = None,
           page_size: int = 1) -> Groups:
        """The groups of layers whose windows are ``layer_windows`` (``None``: full), a window
        that never frees a page of a request of at most ``context`` tokens (where given)
        kept as a full one (law 4)."""
        layer_windows = [w if frees(w, context, page_size) else None for w in layer_windows]
        kinds = sorted(set(layer_windows), key=lambda w: -1 if w is None else w)
        at = {w: g for g, w in enumerate(kinds)}
        return cls(tuple(kinds), tuple(at[w] for w in layer_windows))

    @property
    def layers(self) -> list[int]:
        """How many layers each group holds."""
        return [self.of_layer.count(g) for g in range(len(self.windows))]

    @property
    def sliding(self) -> bool:
        """Whether some group frees what its layers no longer read."""
        return any(w is not None for w in self.windows)

    def pools(self, pages: int, page_size: int, context: int | None = None
              ) -> dict[int | None, int]:
        """A default pool of ``pages`` pages for each group (``Engine(pages=...)``), a sliding
        group's raised to the pages one window reads, which its pool must hold (unless it
        never frees a page of a request of ``context`` tokens, law 4)."""
        return {w: max(pages, window_pages(w, page_size)) if frees(w, context, page_size)
                else pages for w in self.windows}

    def per_layer(self, indices: Any) -> Any:
        """Law 3: the index each layer reads, from one index per group (a tuple), or the one
        index every layer reads."""
        if not isinstance(indices, tuple):
            return indices
        return [indices[g] for g in self.of_layer]


def frees(window: int | None, context: int | None, page_size: int) -> bool:
    """Law 4: whether a group of ``window`` ever frees a page of a request of at most
    ``context`` tokens (any request where ``context`` is ``None``): whether the reach of its
    last position, ``context - window``, gets past page 0."""
    if window is None:
        return False
    return context is None or context - window >= page_size


def windows_told(where: str, told: Any, model: Sequence[int | None] | None
                 ) -> tuple[int | None, ...]:
    """Law 2: each layer's window as the engine keeps it: ``told`` (a sequence of ``None`` and
    positive integers, one per layer), else the model's own; one full layer when neither
    says. Raises ``ValueError`` naming ``where`` and the layer for a window below the
    model's, a count of layers other than the model's, or a window that is no positive
    integer (``TypeError`` for one that is no integer)."""
    if told is None:
        return tuple(model) if model is not None else (None,)
    if isinstance(told, str | bytes) or not hasattr(told, "__iter__"):
        raise TypeError(f"{where}: windows must be a sequence of None and positive integers, "
                        f"one per layer, got {told!r:.60}")
    told = tuple(told)
    for i, w in enumerate(told):
        if w is not None and (isinstance(w, bool) or not hasattr(w, "__index__")):
            raise TypeError(f"{where}: windows[{i}] must be None or a positive integer, got "
                            f"{w!r:.40}")
        if w is not None and w < 1:
            raise ValueError(f"{where}: windows[{i}] must be None or a positive integer, got "
                             f"{w}")
    told = tuple(None if w is None else int(w) for w in told)
    if model is None:
        return told
    if len(told) != len(model):
        raise ValueError(f"{where}: windows names {len(told)} layers; the model has "
                         f"{len(model)}")
    for i, (t, m) in enumerate(zip(told, model, strict=True)):
        if t is not None and (m is None or t < m):
            reads = "every position" if m is None else f"a window of {m}"
            raise ValueError(f"{where}: layer {i} reads {reads}; the engine cannot keep only "
                             f"a window of {t} for it")
    return told
