"""Device names: one spelling for every backend.

A device is named ``cpu``, ``cuda:N`` for the N-th GPU, or ``KIND:N`` for another kind
(``tpu:0``). ``gpu`` and ``gpu:N`` are other names of ``cuda`` and ``cuda:N``, and a name without
a number is the kind's first device, as ``torch.device("cuda")`` is: ``cuda``, ``gpu``,
``cuda:0`` and ``gpu:0`` name one device. Each backend lists its devices and labels them
(:meth:`cacheidx.backends.Backend.device_label`); these functions only compare labels, so they
never import a framework and are tested with made-up device lists.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["canonical", "label", "resolve", "found", "to_host"]

_ALIASES = {"gpu": "cuda"}
_NAME = re.compile(r"^([a-z]+)(?::(\d+))?$")


def canonical(name: str) -> str:
    """``name`` in the one spelling labels use: ``cpu``, ``cuda:N``, ``tpu:N``. A GPU or
    other accelerator without a number is its first device. Raises ``ValueError`` for a name
    of no such form."""
    m = _NAME.match(str(name).strip().lower())
    if not m:
        raise ValueError(f"cacheidx.devices: {name!r} is not a device name (cpu, gpu, cuda, "
                         "cuda:N, gpu:N, tpu:N)")
    kind, number = _ALIASES.get(m[1], m[1]), m[2]
    if kind == "cpu":
        return "cpu"
    return f"{kind}:{int(number or 0)}"


def label(kind: str, number: int | None = None) -> str:
    """The label of device ``number`` of ``kind`` (a library's own name: ``gpu``, ``cuda``,
    ``rocm``, ``cpu``, ``tpu``). Every CPU is ``cpu``: the host is one device to the laws."""
    kind = {"gpu": "cuda", "rocm": "cuda"}.get(kind.lower(), kind.lower())
    return "cpu" if kind == "cpu" else f"{kind}:{int(number or 0)}"


def found(devices: dict[str, list[str]]) -> str:
    """``{backend: [labels]}`` as one line for an error message."""
    parts = [f"{name}: {', '.join(labels) or 'none'}" for name, labels in devices.items()]
    return "; ".join(parts) or "no backend"


def resolve(backend: Any, name: str | None) -> Any:
    """The device of ``backend`` that ``name`` names (its first device when ``name`` is
    ``None``). Raises ``ValueError`` naming the devices the backend has."""
    devices = backend.devices()
    if name is None:
        return devices[0]
    want = canonical(name)
    for d in devices:
        if backend.device_label(d) == want:
            return d
    labels = [backend.device_label(d) for d in devices]
    raise ValueError(f"cacheidx: {backend.name} has no device {name!r} ({want}); found: "
                     f"{', '.join(dict.fromkeys(labels))}")


def to_host(x: Any) -> np.ndarray:
    """A small array of any backend as NumPy, copied off its device where it lies on one."""
    try:
        return np.asarray(x)
    except (TypeError, RuntimeError):  # device memory that will not convert implicitly
        import array_api_compat as compat

        return np.asarray(compat.to_device(x, "cpu"))
