"""What mypy checks of the adapters (tests/test_typing.py runs it; nothing here runs): every
built-in backend, and the standard-only ``Backend``, is each of the four protocols of
:mod:`cacheidx.backends.protocols`, and each part class is its own protocol's, given the
library part it is composed over. An adapter whose member stops matching (a renamed method, a
keyword gone, a wrong return) fails the type check."""

from __future__ import annotations

from cacheidx.backends.base import Backend
from cacheidx.backends.cupy import CupyBackend
from cacheidx.backends.jax import JaxBackend
from cacheidx.backends.numpy import NumpyBackend
from cacheidx.backends.protocols import Arrays, Checking, Compiling, Serving
from cacheidx.backends.strict import StrictBackend
from cacheidx.backends.torch import TorchBackend

Four = tuple[Arrays, Compiling, Serving, Checking]


def standard(b: Backend) -> Four:
    return b, b, b, b


def numpy(b: NumpyBackend) -> Four:
    return b, b, b, b


def strict(b: StrictBackend) -> Four:
    return b, b, b, b


def torch(b: TorchBackend) -> Four:
    return b, b, b, b


def jax(b: JaxBackend) -> Four:
    return b, b, b, b


def cupy(b: CupyBackend) -> Four:
    return b, b, b, b
