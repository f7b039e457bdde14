"""array-api-strict: proves the core uses the standard alone.

Boolean indexing and data-dependent shapes are switched off, and the adapter adds nothing to
the standard-only base: the scatter is the base's ``sort`` + ``searchsorted``.
"""

from __future__ import annotations

from typing import Any

from .base import Backend


class StrictBackend(Backend):
    name = "strict"
    module = "array_api_strict"

    def namespace(self) -> Any:
        import array_api_strict

        array_api_strict.set_array_api_strict_flags(
            boolean_indexing=False, data_dependent_shapes=False
        )
        return array_api_strict

    def devices(self) -> list[Any]:
        return [self.xp.Device()]
