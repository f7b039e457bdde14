"""Device names, the same for every backend: ``cpu``, ``gpu``, ``cuda``, ``gpu:N``, ``cuda:N``.

``gpu`` and ``cuda`` are one kind; ``:N`` is the ``N``-th device of that kind the backend
sees, in its own order (``gpu`` alone is ``gpu:0``). :func:`resolve` turns a name into the
backend's own device object, and :func:`label` turns any backend's device into a name. Nothing
here imports a framework: the devices come from the backend (``Backend.devices``) or are
given, so the rules are tested with fake lists.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

__all__ = ["label", "parse", "resolve"]

_NAME = re.compile(r"^(cpu|gpu|cuda)(?::(\d+))?$")


def parse(name: str) -> tuple[str, int]:
    """``(kind, ordinal)`` of a device name: kind ``"cpu"`` or ``"gpu"`` (``cuda`` is ``gpu``).
    Raises ``ValueError`` naming the accepted forms."""
    if not isinstance(name, str):
        raise TypeError(f"cacheidx.devices.parse: a device name is a string, got {name!r}")
    m = _NAME.match(name.strip().lower())
    if m is None:
        raise ValueError(f"cacheidx.devices.parse: no device named {name!r}; names are cpu, gpu, "
                         f"cuda, gpu:N, cuda:N")
    kind = "cpu" if m.group(1) == "cpu" else "gpu"
    return kind, int(m.group(2) or 0)


def kind_of(device: Any) -> str:
    """``"cpu"``, ``"gpu"`` or another platform's name, read from what the device object says
    of itself: ``platform`` (JAX), ``type`` (PyTorch), the class's library (CuPy), its text."""
    for attr in ("platform", "type"):
        value = getattr(device, attr, None)
        if isinstance(value, str):
            value = value.lower()
            return "gpu" if value in ("cuda", "gpu", "rocm", "hip") else value
    if type(device).__module__.split(".")[0] == "cupy":
        return "gpu"
    text = str(device).lower()
    if "cpu" in text:
        return "cpu"
    if "cuda" in text or "gpu" in text:
        return "gpu"
    return text


def label(device: Any, found: Sequence[Any] | None = None) -> str:
    """The name of ``device``: its kind, and for a GPU ``:N``, its place among the GPUs in
    ``found`` (its own index where it has one and ``found`` is not given)."""
    kind = kind_of(device)
    if kind == "cpu":
        return "cpu"
    if found is not None:
        same = [d for d in found if kind_of(d) == kind]
        for i, d in enumerate(same):
            if d is device or d == device:
                return f"{kind}:{i}"
    for attr in ("index", "id"):
        n = getattr(device, attr, None)
        if isinstance(n, int):
            return f"{kind}:{n}"
    return f"{kind}:0"


def found(backend: Any) -> list[Any]:
    """The devices ``backend`` can place arrays on. A JAX process lists only its default
    platform's devices (the GPUs, where there are some): its CPU is added, so ``cpu`` is
    always a name it answers."""
    devices = list(backend.devices())
    if getattr(backend, "name", None) == "jax" and not any(kind_of(d) == "cpu" for d in devices):
        import jax

        try:
            devices += list(jax.devices("cpu"))
        except RuntimeError:  # a JAX built without its CPU platform
            pass
    return devices


def resolve(backend: Any, name: str | None, *, devices: Sequence[Any] | None = None) -> Any:
    """The device object of ``backend`` that ``name`` names (see the module's names), among
    ``devices`` (by default the backend's own, :func:`found`). ``None`` is the first device
    listed: the backend's default.

    Raises ``ValueError`` naming the backend and the devices found when none matches."""
    devices = found(backend) if devices is None else list(devices)
    who = getattr(backend, "name", backend)
    if not devices:
        raise ValueError(f"cacheidx.devices.resolve: backend {who} lists no device")
    if name is None:
        return devices[0]
    kind, n = parse(name)
    same = [d for d in devices if kind_of(d) == kind]
    if n < len(same):
        return same[n]
    names = ", ".join(dict.fromkeys(label(d, devices) for d in devices))
    raise ValueError(f"cacheidx.devices.resolve: backend {who} has no device {name!r}; devices "
                     f"found: {names}")
