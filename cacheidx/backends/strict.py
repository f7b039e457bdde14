"""array-api-strict: proves the core uses the standard alone.

Boolean indexing and data-dependent shapes are switched off, and the adapter adds nothing to
the standard-only base: the scatter is the base's ``sort`` + ``searchsorted``.
"""

from __future__ import annotations

from typing import Any

from .base import Backend, Library
from .checking import HostChecking


class StrictLibrary(Library):
    """array-api-strict, boolean indexing and data-dependent shapes switched off."""

    name = "strict"
    module = "array_api_strict"

    def namespace(self) -> Any:
        import array_api_strict

        array_api_strict.set_array_api_strict_flags(
            boolean_indexing=False, data_dependent_shapes=False
        )
        return array_api_strict


class StrictChecking(HostChecking):
    """array-api-strict's one device."""

    xp: Any

    def devices(self) -> list[Any]:
        return [self.xp.Device()]


class StrictBackend(StrictLibrary, StrictChecking, Backend):
    """array-api-strict: the standard's parts alone, over its library and device."""
