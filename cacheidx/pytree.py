"""The index as a pytree: its tensors are the leaves, in the spec's walk order, and its
:class:`~cacheidx.index.Structure` (with its backend) is the static part, so ``jax.jit`` and
``torch.compile`` take an index as an ordinary argument and compile once for every value of
its positions and tables. :func:`leaves` takes an index apart and :func:`rebuild` puts it
together (over :func:`fields`), and :func:`map` over tensors made of its own; :func:`node` is
what each library's registry is given."""

from __future__ import annotations

import json
from typing import Any

from . import backends

__all__ = ["fields", "leaf_names", "leaves", "map", "node", "rebuild"]


def leaves(index: Any) -> list[Any]:
    """The index's tensors in the spec's walk order: row, positions, table, tables of blocks,
    selection, draft slots, draft sees, the hint of shared prefixes (each where present)."""
    found = [index.row] if index.row is not None else []
    found.append(index.pos)
    if index.table is not None:
        found.append(index.table)
    found.extend(b for _, b in index.blocks)
    for part in (index.columns, index.draft_slots, index.draft_sees, index.share_lanes,
                 index.share_widths):
        if part is not None:
            found.append(part)
    return found


def fields(structure: Any, tensors: Any) -> dict[str, Any]:
    """The index's fields (the constructor's keywords, its backend aside) of ``structure``
    over ``tensors`` in :func:`leaves`' order."""
    it = iter(tensors)
    row = next(it) if structure.row else None
    pos = next(it)
    table = next(it) if structure.kind == "tabled" else None
    blocks = tuple((m, next(it)) for m in structure.blocks)
    columns = next(it) if structure.columns else None
    slots, sees = (next(it), next(it)) if structure.draft else (None, None)
    lanes, widths = (next(it), next(it)) if structure.shared else (None, None)
    return dict(kind=structure.kind, pos=pos, table=table, row=row, blocks=blocks,
                block=structure.every, window_size=structure.window, columns=columns,
                draft_slots=slots, draft_sees=sees, share_lanes=lanes, share_widths=widths)


def rebuild(structure: Any, tensors: Any, *, backend: Any = None, plan: Any = None) -> Any:
    """The index of ``structure`` over ``tensors`` (in :func:`leaves`' order):
    ``rebuild(ix.structure, leaves(ix))`` is ``ix`` again. ``backend``: the tensors' library's
    adapter, found from them when ``None``. ``plan``: a :class:`~cacheidx.plan.Plan` the index
    keeps (shared with the index it came from; it follows the values, so a plan of other
    values is only ever remade, never misread)."""
    # imported here: cacheidx.index imports this module at its top
    from .index import CacheIndex

    index = CacheIndex(**fields(structure, tensors), backend=backend)
    if plan is not None:
        object.__setattr__(index, "plan", plan)
        values, names = plan.values, leaf_names(structure)
        if values is not None and len(values) == len(names):
            # candidates only where they are compared (cacheidx.plan.host): a plan handed out
            # for other values is then made anew, never misread
            on_host = index.backend.on_host
            index.known.values.update((name, v) for name, v, t in zip(
                names, values, leaves(index), strict=True) if on_host(t))
    return index


def map(index: Any, fn: Any) -> Any:
    """The index whose every tensor is ``fn`` of ``index``'s (placed elsewhere, copied to
    another library: the backend is the results' library's)."""
    return rebuild(index.structure, [fn(t) for t in leaves(index)])


def leaf_names(structure: Any) -> list[str]:
    """The walk's paths of the leaves, in :func:`leaves`' order."""
    names = ["tokens.row"] if structure.row else []
    names.append("tokens.pos")
    if structure.kind == "tabled":
        names.append("tokens.table")
    names += [f"tokens.blocks.{i}" for i in range(len(structure.blocks))]
    if structure.columns:
        names.append("columns")
    if structure.draft:
        names += ["draft.slots", "draft.sees"]
    if structure.shared:
        names += ["shared.lanes", "shared.widths"]
    return names


def node(cls: type, structure: type) -> backends.Node:
    """The index class ``cls`` (whose static part is a ``structure``) as a pytree node, for
    every library with a pytree registry."""

    def flatten(index: Any) -> tuple[list[Any], tuple[Any, Any]]:
        return leaves(index), (index.structure, index.backend)

    def unflatten(static: tuple[Any, Any], tensors: Any) -> Any:
        s, backend = static
        return cls(**fields(s, tensors), backend=backend)

    def dump(static: tuple[Any, Any]) -> str:
        s, backend = static
        return json.dumps({"structure": s._asdict(), "backend": backend.name})

    def load(text: str) -> tuple[Any, Any]:
        d = json.loads(text)
        s = d["structure"]
        return structure(**{**s, "blocks": tuple(s["blocks"])}), backends.get(d["backend"])

    return backends.Node(cls, flatten, unflatten, lambda static: leaf_names(static[0]), dump,
                         load, safe=(structure,))
