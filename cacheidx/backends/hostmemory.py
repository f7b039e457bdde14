"""Host memory for pools the CPU reads in place (NumPy arrays, CPU tensors): zeros whose first
byte starts a memory page, and, for a pool of a huge page or more, a huge page, its memory
asked of the system in huge pages before it is first touched.

Why huge pages: the kernel reads a lane's pages in whatever order its table gives them, so
over a pool larger than the processor's address caches reach, each memory page it enters is a
walk of the page tables, and those walks miss the caches once the tables' own entries outgrow
them. One layer of 32 lanes x 16k float32 (800 MB of keys and values), the kernel alone, one
thread, 3 runs each: 55-64 ns a column and kv head over 4 KB pages, 43-46 over 2 MB ones
(8 x 16k: 39-50 against 34-44; int8 at 32 x 16k: 19.7-20.1 against 17.6-19.2). The ask is
a hint: where the system keeps no huge pages for it (``transparent_hugepage`` set to
``never``, another system) the memory is the same, on small pages."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["HUGE_BYTES", "PAGE_BYTES", "zeroed"]

#: the bytes of a memory page, where a host pool's first element lies
PAGE_BYTES = 4096
#: the bytes of a huge page (x86-64's and most arm64 systems' 2 MB), where a large pool's lies
HUGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's, on every architecture


def zeroed(n: int, empty: Callable[[int], Any], address: Callable[[Any], int],
           zero: Callable[[Any, int, int], None]) -> tuple[Any, int]:
    """``(whole, at)``: ``whole`` a byte array from ``empty`` (memory not yet touched where the
    library maps a fresh one), bytes ``at`` to ``at + n`` zeroed by ``zero(whole, at, n)``,
    ``at`` the first byte of a memory page, of a huge page where ``n >= HUGE_BYTES``; those
    asked for in huge pages first (Linux), so that the zeros' first touch maps them so."""
    align = HUGE_BYTES if n >= HUGE_BYTES else PAGE_BYTES
    whole = empty(n + align)
    at = -address(whole) % align
    if align == HUGE_BYTES:
        _huge(address(whole) + at, n)
    zero(whole, at, n)
    return whole, at


def _huge(start: int, n: int) -> None:
    """Asks Linux to back ``[start, start + n)`` (huge-page aligned) with huge pages; where the
    call is refused (no transparent huge pages) the memory stays on small pages, as without."""
    if not sys.platform.startswith("linux"):
        return
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise(start, n, _MADV_HUGEPAGE)  # a hint: its result changes no byte
