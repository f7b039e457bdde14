"""The house imports only downward, and no module reaches into another's privates.

The floors are pyproject.toml's import-linter ``layers`` contract (laws, backends, the index,
attention, models and prefix, serve/parallel/conformance, integrations and the demo); a lower
floor lets an upper one hook in through a registration the upper one calls
(``backends.when_made``, ``plan.CARRY``); ``CacheIndex.attend``, a facade API.md pins, imports
``cacheidx.attention.attend`` in the method, an import the contract names.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import pathlib
import shutil
import subprocess

import pytest

import cacheidx
from cacheidx.index import CacheIndex

ROOT = pathlib.Path(cacheidx.__file__).parent


def test_every_layer_imports_only_the_layers_below_it():
    """``lint-imports`` keeps the layers contract (imports inside functions included)."""
    exe = shutil.which("lint-imports") or pytest.skip("import-linter is not installed")
    done = subprocess.run([exe, "--no-cache"], cwd=ROOT.parent, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def _modules() -> list[tuple[str, ast.Module]]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        found.append((name.removesuffix(".__init__"), ast.parse(path.read_text())))
    return found


_INITS = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
          for p in ROOT.rglob("__init__.py")}


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module, not a module of a package
        return False


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_a_private_name_of_another():
    """``from .x import _name`` across modules is a missing public name (a package's private
    module, ``from .. import _arguments``, is the package's own)."""
    bad = []
    for module, tree in _modules():
        package = module if module + ".__init__" in _INITS else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "")
                                                     .startswith("cacheidx")):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""),
                                                   package) if node.level else node.module
                bad += [f"{module}: from {base} import {a.name}" for a in node.names
                        if _private(a.name) and not _is_module(f"{base}.{a.name}")]
    assert not bad, "\n".join(bad)


def test_no_module_calls_the_index_s_private_members():
    """Outside ``cacheidx.index`` nothing reads a private member of an index: what attention
    needs from it has a public name."""
    private = {n for n in vars(CacheIndex) if _private(n)}
    bad = []
    for module, tree in _modules():
        if module == "cacheidx.index":
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                bad.append(f"{module}:{node.lineno}: .{node.attr}")
    assert not bad, "\n".join(bad)


#: the index's public members API.md pins (/work/shared/API.md: "Reading an index", "Derived
#: indices", attend); ``mask``, ``visible``, ``extend`` and ``attend`` are facades over
#: cacheidx.masks, cacheidx.storage and cacheidx.attention
PINNED = {"batch", "seq", "context", "structure", "positions", "extend", "mask", "visible",
          "to_device", "attend", "window", "select", "draft", "every", "advance"}
#: its fields: the spec's parts, its backend, and what the host keeps of it (``plan``, and
#: ``known``, the host's values of its tensors: issue 36's host-first plans), neither copied by
#: ``dataclasses.replace``, and the hint of shared prefixes (``share_lanes``, ``share_widths``)
FIELDS = {"kind", "pos", "table", "row", "blocks", "block", "window_size", "columns",
          "draft_slots", "draft_sees", "backend", "plan", "known", "share_lanes",
          "share_widths"}
#: nothing more: what it was asked for beside them is a function of the module holding its
#: concern. Its library and device are its backend's (``index.backend.xp``,
#: ``index.backend.device(index.pos)``); the padding law every layer reads is cacheidx.masks'
#: ``valid``; its tensors are cacheidx.pytree's ``leaves``, the index over them its
#: ``rebuild``, over tensors made of them its ``map``; the host's values of them are
#: cacheidx.plan's ``host`` and ``refilled``, the plan made of them its ``follow``/``planned``
#: beyond API.md: ``share``, the hint of shared prefixes a program traced whole reads (two
#: fields above, its tensors), a facade over cacheidx.attention.shared as ``attend`` is
KEPT: set[str] = {"share"}


def test_the_index_keeps_its_fields_and_the_members_it_names():
    """``CacheIndex`` is its fields and the members above, no more: what it computes lives in
    modules of their own (masks, storage, validation, pytree, pools, plan, attention), so a new
    public member here is a choice this test makes visible, not a helper that grew back; nor
    does one hide as a field."""
    fields = {f.name for f in dataclasses.fields(CacheIndex)}
    assert fields == FIELDS, (f"added: {sorted(fields - FIELDS)}, "
                              f"gone: {sorted(FIELDS - fields)}")
    members = {n for n in dir(CacheIndex) if not n.startswith("_")} - fields
    assert members == PINNED | KEPT, (f"added: {sorted(members - PINNED - KEPT)}, "
                                      f"gone: {sorted(PINNED | KEPT - members)}")
