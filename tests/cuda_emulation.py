"""The CUDA row kernels (:mod:`cacheidx.backends.rowkernels`) compiled as C++ for the host, with
a loop standing in for the grid, so that their source and the adapters' launches run here.

The kernels' threads never talk to each other (no shared memory, no barrier), so running the
threads one after another computes what the grid computes. ``Kernel`` is called as CuPy's
``RawKernel`` is (``kernel(grid, block, args)``) and as torch's NVRTC kernels are
(``kernel(grid=..., block=..., args=[...])``); arrays are NumPy arrays or CPU tensors.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

from cacheidx.backends import rowkernels

PRELUDE = r"""
struct cacheidx_dim3 { unsigned int x, y, z; };
static cacheidx_dim3 blockIdx, threadIdx, blockDim, gridDim;
#define __global__
"""

DRIVER = r"""
extern "C" void emulate_gated(const void* pool, const long long* slots, const unsigned char* ok,
                              void* out, int rows, int words, int group, int grid, int block) {
    gridDim.x = grid; blockDim.x = block;
    for (int b = 0; b < grid; ++b) for (int t = 0; t < block; ++t) {
        blockIdx.x = b; threadIdx.x = t;
        cacheidx_gated_rows((const word_t*)pool, slots, ok, (word_t*)out, rows, words, group);
    }
}
extern "C" void emulate_store(void* pool, const long long* slots, const void* values, int rows,
                              int words, int n, int group, int grid, int block) {
    gridDim.x = grid; blockDim.x = block;
    for (int b = 0; b < grid; ++b) for (int t = 0; t < block; ++t) {
        blockIdx.x = b; threadIdx.x = t;
        cacheidx_store_rows((word_t*)pool, slots, (const word_t*)values, rows, words, n, group);
    }
}
"""

COMPILER = shutil.which("g++") or shutil.which("c++")


@functools.cache
def library(word: int) -> ctypes.CDLL:
    """The kernels for words of ``word`` bytes, built for the host."""
    # the folder goes once the library is loaded (its mapping outlives the file)
    with tempfile.TemporaryDirectory(prefix="cacheidx-rowkernels-") as tmp:
        where = Path(tmp)
        src = where / "rows.cpp"
        src.write_text(PRELUDE + rowkernels.source(word) + DRIVER)
        subprocess.run([COMPILER, "-std=c++17", "-O1", "-shared", "-fPIC", str(src), "-o",
                        str(where / "rows.so")], check=True, capture_output=True)
        return ctypes.CDLL(str(where / "rows.so"))


def address(a) -> int:
    """A NumPy array's or a CPU tensor's first byte."""
    return a.data_ptr() if hasattr(a, "data_ptr") else a.__array_interface__["data"][0]


class Kernel:
    """One kernel of ``source``, run on the host; ``launches`` counts its calls."""

    def __init__(self, source: str, name: str):
        word = next(w for w, c in rowkernels.WORDS.items() if f"typedef {c} word_t" in source)
        self.run = getattr(library(word), {"cacheidx_gated_rows": "emulate_gated",
                                           "cacheidx_store_rows": "emulate_store"}[name])
        self.launches = 0

    def __call__(self, grid=(1, 1, 1), block=(1, 1, 1), args=()):
        self.launches += 1
        c = [ctypes.c_void_p(address(a)) if hasattr(a, "shape") and a.ndim > 0
             else ctypes.c_int(int(a)) for a in args]
        self.run(*c, ctypes.c_int(grid[0]), ctypes.c_int(block[0]))
