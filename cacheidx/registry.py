"""Registries of plug-ins found by name: the built-in ones, then an entry-point group's.

One loader serves every registry of the library (backends, ``cacheidx.backends``; attention's
paths, ``cacheidx.attention``): a name maps to ``"module:attribute"``, its module imported
only when the name is first loaded, so that listing names never imports a framework. A third
party adds an entry of its own (or replaces a built-in one of the same name) under the group
in its package's metadata. Law: ``targets()`` is the built-in entries updated by the group's,
in that order; ``load(name)`` is the attribute the name's target names, imported once.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

__all__ = ["Registry"]


class Registry:
    """The plug-ins of one entry-point ``group``, over the ``builtin`` ones (name ->
    ``"module:attribute"``), which a source checkout that was never installed still has."""

    def __init__(self, group: str, builtin: Mapping[str, str]):
        self.group = group
        self.builtin = dict(builtin)
        self._targets: dict[str, str] | None = None
        self._loaded: dict[str, Any] = {}
        self._lock = threading.Lock()

    def targets(self) -> dict[str, str]:
        """Every name and its ``"module:attribute"``, the group's entry points read once."""
        if self._targets is None:
            found = dict(self.builtin)
            for ep in entry_points(group=self.group):
                found[ep.name] = ep.value
            self._targets = found
        return self._targets

    def names(self) -> list[str]:
        """Every registered name, loadable here or not."""
        return list(self.targets())

    def load(self, name: str) -> Any:
        """The attribute ``name``'s target names, its module imported the first time. Raises
        ``KeyError`` for a name not registered."""
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
        module, _, attr = self.targets()[name].partition(":")
        got = getattr(importlib.import_module(module), attr)
        with self._lock:
            return self._loaded.setdefault(name, got)
