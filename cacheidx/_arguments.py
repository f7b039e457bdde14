"""Argument checks: every bad input is a ValueError (or TypeError for a wrong type) that names
the function and the value, raised before anything is written."""

from __future__ import annotations

import operator
from typing import Any

import array_api_compat as compat


def fail(fn: str, message: str) -> ValueError:
    return ValueError(f"cacheidx.{fn}: {message}")


def integer(fn: str, name: str, value: Any, *, least: int | None = None) -> int:
    """A Python integer (NumPy integer scalars too, never a bool), at least ``least``."""
    if isinstance(value, bool):
        raise TypeError(f"cacheidx.{fn}: {name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"cacheidx.{fn}: {name} must be an integer, got {value!r}") from None
    if least is not None and value < least:
        raise fail(fn, f"{name} must be at least {least}, got {value}")
    return value


def namespace(fn: str, *arrays: Any) -> Any:
    """The one namespace all of an index's arrays share."""
    for name, x in arrays:
        if not compat.is_array_api_obj(x):
            raise TypeError(f"cacheidx.{fn}: {name} must be an array, got {type(x).__name__}")
    try:
        return compat.array_namespace(*(x for _, x in arrays))
    except TypeError:
        kinds = ", ".join(f"{name}: {type(x).__module__}.{type(x).__name__}" for name, x in arrays)
        raise TypeError(f"cacheidx.{fn}: arrays come from different libraries ({kinds})") from None


def array(fn: str, name: str, x: Any, xp: Any, shape: tuple, *, kind: str = "integral") -> Any:
    """An array of dtype ``kind`` whose shape matches ``shape`` (``None`` for any size, which
    must not be empty). Integers are signed: an index tensor holds -1 for none, which an
    unsigned dtype cannot (its -1 would be a slot, and ``extend`` would overflow)."""
    if not xp.isdtype(x.dtype, kind):
        what = "integers" if kind == "integral" else "booleans"
        raise TypeError(f"cacheidx.{fn}: {name} must hold {what}, got dtype {x.dtype}")
    if kind == "integral" and not xp.isdtype(x.dtype, "signed integer"):
        raise TypeError(f"cacheidx.{fn}: {name} must hold signed integers (-1 marks none), got "
                        f"dtype {x.dtype}")
    got = tuple(x.shape)
    if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
        want = "[" + ", ".join("?" if w is None else str(w) for w in shape) + "]"
        raise fail(fn, f"{name} must have shape {want}, got {list(got)}")
    if any(g == 0 for g in got):
        raise fail(fn, f"{name} has an empty axis: shape {list(got)}")
    return x


def lengths(fn: str, name: str, lens: Any) -> list[int]:
    """A list of non-negative Python ints from any sequence or 1-D array of integers."""
    if hasattr(lens, "tolist"):
        lens = lens.tolist()
    try:
        items = list(lens)
    except TypeError:
        raise TypeError(f"cacheidx.{fn}: {name} must be a sequence of integers, "
                        f"got {type(lens).__name__}") from None
    out = [integer(fn, f"a length of {name}", n) for n in items]
    for n in out:
        if n < 0:
            raise fail(fn, f"a length is negative: {n}")
    return out


def strides(x: Any) -> tuple[int, ...] | None:
    """``x``'s strides (torch's in elements, NumPy's and CuPy's in bytes: compare only their
    order or zeros), ``None`` where its library shows none (JAX). Traceable under dynamo."""
    if hasattr(x, "strides"):
        return tuple(x.strides)
    if hasattr(x, "stride"):
        return tuple(x.stride())
    return None


def owned(fn: str, name: str, pool: Any) -> None:
    """Raises naming ``fn`` where the donated ``pool`` does not own a row per slot: elements
    sharing memory (a stride of 0, as torch's ``expand`` and NumPy's ``broadcast_to`` make),
    which a store in place would write through at once. A library that shows no strides
    passes."""
    found = strides(pool)
    if found is not None and any(n > 1 and st == 0 for n, st in zip(pool.shape, found)):
        raise fail(fn, f"{name} is donated but its slots share memory (strides "
                       f"{list(found)} for shape {list(pool.shape)}: an expanded or broadcast "
                       "array); a donated pool must own a row per slot: pass a copy, or "
                       "donate=False")


def positive_arg(text: str) -> int:
    """An ``argparse`` type for the command lines: an integer of at least 1."""
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def one_device(fn: str, named: list[tuple[str, Any]]) -> None:
    """Raises naming ``fn`` where the arrays ``named`` (``(name, array)`` pairs) lie on more
    than one device; a tracer or a sharded array says nothing (placement is the compiler's)."""
    devices = []
    for name, x in named:
        try:
            devices.append((name, compat.device(x)))
        except Exception:
            return
    first_name, first = devices[0]
    for name, d in devices[1:]:
        if d != first:
            raise fail(fn, f"{name} lies on {d} but {first_name} on {first}")
