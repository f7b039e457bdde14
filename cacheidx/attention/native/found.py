"""The built kernel: the extension module ``_kernel`` that ``pip install`` compiles from
``kernel.c`` (setup.py), found beside this file by Python's own import and checked before
anything calls it; or ``None``, said once as a warning, where it was not built.

Nothing is compiled at run time (so no lock and no cache folder: the module lies in the
installed package, where Python's import takes it from). The check: the module's
``layout()`` gives each argument struct's size and its fields' offsets as its C compiler laid
them out, which must equal those of :class:`Paged` here (the ``ctypes`` mirror this side
fills), and its ABI number this side's; a module that differs (a stale
build beside newer sources) is refused, with the warning, rather than called with a struct
it reads otherwise. ``CACHEIDX_NATIVE=0`` keeps it out without a warning."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["ABI", "Paged", "kernel", "library", "off"]

#: the struct layouts' version, the module's ``layout()["abi"]``
ABI = 4

_p, _i, _l = ctypes.c_void_p, ctypes.c_int, ctypes.c_long


class Paged(ctypes.Structure):
    """``cacheidx_paged_args`` of ``kernel.c``, field for field."""

    _fields_ = [("lanes", _i), ("kv", _i), ("g", _i), ("d", _i), ("dv", _i),
                ("kkind", _i), ("vkind", _i), ("kskind", _i), ("vskind", _i), ("kgroup", _i),
                ("vgroup", _i), ("threads", _i),
                ("q", _p), ("table", _p), ("table_stride", _l), ("start", _p), ("stop", _p),
                ("k", _p), ("kst", _l), ("khs", _l), ("ks", _p), ("kss", _l), ("kshs", _l),
                ("v", _p), ("vst", _l), ("vhs", _l), ("vs", _p), ("vss", _l), ("vshs", _l),
                ("kz", _p), ("vz", _p), ("m", _p), ("l", _p), ("acc", _p)]


#: where the module is imported from (the tests point it at a build of their own)
MODULE = "cacheidx.attention.native._kernel"

_LOCK = threading.Lock()
_FOUND: list[Any] = []


def library() -> Any:
    """The checked module (its ``paged(Paged)``), or ``None``; found at the
    first call, then kept."""
    if _FOUND:
        return _FOUND[0]
    with _LOCK:
        if not _FOUND:
            _FOUND.append(_load())
    return _FOUND[0]


def kernel() -> Any:
    """The built kernel's paged entry, or ``None`` where it was not built, failed its check, or
    ``CACHEIDX_NATIVE=0`` (what callers ask before offering it a call)."""
    lib = library()
    return None if lib is None else lib.paged


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Within it :func:`kernel` is ``None`` (in every thread): the libraries' products
    read quantized runs and paged pools (what the figures compare the kernel with)."""
    with _LOCK:
        kept = list(_FOUND)
        _FOUND[:] = [None]
    try:
        yield
    finally:
        with _LOCK:
            _FOUND[:] = kept


def layout(struct: type[ctypes.Structure]) -> tuple[int, list[tuple[str, int]]]:
    """``struct``'s size and its fields' offsets, as the module's ``layout()`` says them."""
    return ctypes.sizeof(struct), [(name, getattr(struct, name).offset)
                                   for name, _ in struct._fields_]


def _load() -> Any:
    if os.environ.get("CACHEIDX_NATIVE", "1") == "0":
        return None
    try:
        lib = importlib.import_module(MODULE)
    except ImportError as e:
        _say(f"it was not built when cacheidx was installed ({e}); a C compiler at "
             "`pip install` time builds it")
        return None
    said = lib.layout()
    want = {"paged": layout(Paged)}
    got = {name: (said[name][0], [tuple(f) for f in said[name][1]]) for name in want}
    if said.get("abi") != ABI or got != want:
        _say(f"its build at {getattr(lib, '__file__', MODULE)} lays out its arguments "
             f"otherwise (ABI {said.get('abi')}, this side's {ABI}; a build older than its "
             "sources): reinstall cacheidx to rebuild it")
        return None
    return lib


def _say(why: str) -> None:
    warnings.warn(f"cacheidx: the CPU kernel is not used: {why}. Quantized and paged pools "
                  "are read through the array libraries' products instead", RuntimeWarning,
                  stacklevel=4)
