"""The checking part of a backend (the protocol :class:`~cacheidx.backends.protocols.Checking`):
what the law suite reports and controls of a library (its version, devices, matrix precision,
the environment of a process that checks it). Here: one host device, full precision.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, Protocol

import array_api_compat as compat

__all__ = ["HostChecking"]


class _Library(Protocol):
    """What the checking part asks of the library part it is composed with."""

    @property
    def module(self) -> str | None: ...
    @property
    def xp(self) -> Any: ...


class HostChecking:
    """A library on the host's CPU alone, in full float32 precision."""

    #: whether the library computes on the host's CPU (its devices include ``cpu``)
    host: bool = True
    #: whether the library can compute on CUDA devices (the law suite reports one it does not
    #: see: a class attribute, read without importing the library)
    cuda: bool = False

    def version(self: _Library) -> str | None:
        """The library's version, read from its imported module."""
        module = sys.modules.get(self.module or "")
        return getattr(module, "__version__", None)

    def devices(self: _Library) -> list[Any]:
        """The devices this backend can place arrays on, for the conformance runner."""
        return [compat.device(self.xp.zeros(()))]

    def device_label(self, device: Any) -> str:
        """``device`` in :mod:`cacheidx.devices`' one spelling: ``cpu``, ``cuda:N``, ..."""
        return "cpu"

    @contextlib.contextmanager
    def highest_precision(self) -> Iterator[None]:
        """A context in which float32 matrix products keep every bit of their inputs (no
        TF32 or bfloat16 passes), where the library can be told so."""
        yield

    def matmul_mantissa(self, device: Any) -> int:
        """Mantissa bits a float32 matrix product keeps of its inputs on ``device`` under the
        library's defaults: 23 in full precision, 10 under TF32, 7 under bfloat16."""
        return 23

    @classmethod
    def checking_env(cls, device_label: str) -> dict[str, str]:
        """Environment for a process that runs the law suite on this backend: settings that
        make compiling many small programs faster and never change a value. (A class
        method: the runner reads it without importing the library.)"""
        return {}
