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
import mmap
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["HUGE_BYTES", "PAGE_BYTES", "zeroed"]

#: the bytes of a memory page, where a host pool's first element lies
PAGE_BYTES = 4096
#: the bytes of a huge page (x86-64's and most arm64 systems' 2 MB), where a large pool's lies
HUGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's, on every architecture


def zeroed(n: int, *, zeros: Callable[[int], Any], frombuffer: Callable[[Any], Any],
           address: Callable[[Any], int]) -> tuple[Any, int]:
    """``(whole, at)``: bytes ``at`` to ``at + n`` of the byte array ``whole`` are zeros, ``at``
    the first byte of a memory page. Where ``n >= HUGE_BYTES`` (on Linux), ``whole`` is
    ``frombuffer`` of a fresh anonymous map (zeros none has touched: an allocator's reused
    memory would keep the small pages it was first touched in), ``at`` starts a huge page, and
    the bytes are asked for in huge pages, which their first write maps; else ``whole`` is
    ``zeros(n + PAGE_BYTES)``."""
    if n < HUGE_BYTES or not sys.platform.startswith("linux"):
        whole = zeros(n + PAGE_BYTES)
        return whole, -address(whole) % PAGE_BYTES
    # private: Python's default anonymous map is shared memory, which Linux maps in huge
    # pages only by its own switch (shmem_enabled); the array keeps the map alive
    region = mmap.mmap(-1, n + HUGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = frombuffer(region)
    at = -address(whole) % HUGE_BYTES
    _huge(address(whole) + at, n)
    return whole, at


def _huge(start: int, n: int) -> None:
    """Asks Linux to back ``[start, start + n)`` (huge-page aligned) with huge pages; where the
    call is refused (no transparent huge pages) the memory stays on small pages, as without."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise(start, n, _MADV_HUGEPAGE)  # a hint: its result changes no byte
