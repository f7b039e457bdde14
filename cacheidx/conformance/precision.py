"""The numerical policy of the model laws.

Index laws move data: they hold bit for bit on every backend, device and mode, whatever the
policy. Model laws multiply matrices, and a device may compute a float32 product from inputs cut
to fewer mantissa bits (TF32 keeps 10, bfloat16 7; XLA does so by default on NVIDIA GPUs). A
policy says how the tiny model's products run and how close two of its outputs must be:

- ``highest`` (the default): the library's highest precision while the laws run
  (``jax.default_matmul_precision("highest")``, ``torch.set_float32_matmul_precision
  ("highest")``), so outputs agree within float32's tolerance on any device.
- ``default``: the library's own defaults on the device, and the tolerance of the mantissa bits
  its products keep there (:meth:`~cacheidx.backends.Backend.matmul_mantissa`).
- ``emulated(bits)``: the model rounds every product's inputs to ``bits`` mantissa bits itself
  (:func:`cacheidx.models.llama.matmul`), a stand-in on the CPU for a device's TF32.

Two outputs of products keeping ``p`` mantissa bits agree when ``|a - b| <= tol * (1 + |b|)``
with ``tol = GROWTH * 2**-p``. ``GROWTH`` bounds how far one rounding of the inputs travels
through the tiny model (two layers, a softmax, a 64-way head): float32 ``128 * 2**-23 =
1.5e-5``, TF32 ``128 * 2**-10 = 0.125``. Run with TF32-rounded inputs every model law stays
within 0.0032 of its reference; a wrong slot moves a logit by 4 or more
(``tests/test_precision.py`` plants one).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from ..backends.protocols import Checking

__all__ = ["Precision", "GROWTH"]

GROWTH = 128.0


@dataclasses.dataclass(frozen=True)
class Precision:
    """How the model laws multiply, and how close their outputs must be."""

    name: str  #: "highest", "default" or "emulated"
    mantissa: int  #: mantissa bits each product keeps of its inputs
    #: bits the model rounds its inputs to itself (``emulated``), else ``None``
    emulate: int | None = None

    @property
    def tol(self) -> float:
        """Relative and absolute tolerance of two model outputs."""
        return GROWTH * 2.0 ** -self.mantissa

    @classmethod
    def highest(cls) -> Precision:
        return cls("highest", 23)

    @classmethod
    def default(cls, backend: Checking, device: Any) -> Precision:
        return cls("default", backend.matmul_mantissa(device))

    @classmethod
    def emulated(cls, bits: int) -> Precision:
        return cls("emulated", bits, emulate=bits)

    @classmethod
    def named(cls, name: str, backend: Checking, device: Any) -> Precision:
        """The policy ``name`` (``highest``, ``default``, ``tf32``: TF32 emulated) on a device."""
        if name == "highest":
            return cls.highest()
        if name == "default":
            return cls.default(backend, device)
        if name == "tf32":
            return cls.emulated(10)
        raise ValueError(f"cacheidx.conformance: no precision policy {name!r} (highest, "
                         "default, tf32)")

    @contextlib.contextmanager
    def applied(self, backend: Checking) -> Iterator[None]:
        """The library set as the policy says while the laws run."""
        if self.name == "default":
            yield
        else:
            with backend.highest_precision():
                yield

    def report(self, backend: Checking, device: Any) -> dict:
        """What the JSON report records of the policy on a device."""
        return {"policy": self.name, "matmul_mantissa": self.mantissa,
                "model_tolerance": self.tol,
                "device_default_mantissa": backend.matmul_mantissa(device),
                "index_laws": "bit for bit"}
