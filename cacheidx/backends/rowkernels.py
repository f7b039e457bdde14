"""Two CUDA kernels over rows of bytes, shared by the torch and CuPy adapters for eager stores
and reads on a GPU, and the arithmetic of launching them.

- ``cacheidx_store_rows``: row ``r`` of ``rows`` goes to slot ``slots[r]`` of the pool; a slot
  outside the pool stores nothing (no redirect: the row is skipped).
- ``cacheidx_gated_rows``: row ``r`` of the output is slot ``slots[r]`` of the pool where
  ``ok[r]``, and exactly zero elsewhere (all bits zero: +0.0, 0, False), whatever the pool
  holds there (one gated load per element, as the spec asks of a compiled read).

Both copy words, never numbers, so one kernel serves every dtype: a word is the widest of 16, 8,
4, 2 or 1 bytes that divides a row and the alignment of every buffer. A group of threads (a
power of two, up to a warp) copies one row at a time, its threads striding over the row's
words; the groups stride over the rows. Scalars are 32-bit ``int`` (what torch's launcher
passes); :func:`launch` refuses sizes that do not fit.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["SOURCE", "WORDS", "Launch", "launch", "source"]

#: the C type of a word of each size (a 16-byte word is a struct aligned to 16)
WORDS = {
    16: "cacheidx_w16",
    8: "unsigned long long",
    4: "unsigned int",
    2: "unsigned short",
    1: "unsigned char",
}

SOURCE = r"""
struct alignas(16) cacheidx_w16 { unsigned long long lo, hi; };
typedef WORD word_t;

// rows of `words` words; a group of `group` threads per row, groups striding over rows
extern "C" __global__ void cacheidx_gated_rows(
    const word_t* __restrict__ pool, const long long* __restrict__ slots,
    const unsigned char* __restrict__ ok, word_t* __restrict__ out,
    int rows, int words, int group)
{
    const long long per_block = blockDim.x / group;
    const long long stride = (long long)gridDim.x * per_block;
    const int lane = threadIdx.x % group;
    const word_t zero = {};
    for (long long r = (long long)blockIdx.x * per_block + threadIdx.x / group; r < rows;
         r += stride) {
        word_t* dst = out + r * words;
        if (ok[r]) {
            const word_t* src = pool + slots[r] * words;
            for (int c = lane; c < words; c += group) dst[c] = src[c];
        } else {
            for (int c = lane; c < words; c += group) dst[c] = zero;
        }
    }
}

extern "C" __global__ void cacheidx_store_rows(
    word_t* __restrict__ pool, const long long* __restrict__ slots,
    const word_t* __restrict__ values, int rows, int words, int slots_in_pool, int group)
{
    const long long per_block = blockDim.x / group;
    const long long stride = (long long)gridDim.x * per_block;
    const int lane = threadIdx.x % group;
    for (long long r = (long long)blockIdx.x * per_block + threadIdx.x / group; r < rows;
         r += stride) {
        const long long t = slots[r];
        if (t < 0 || t >= slots_in_pool) continue;  // dropped: addresses nothing
        word_t* dst = pool + t * words;
        const word_t* src = values + r * words;
        for (int c = lane; c < words; c += group) dst[c] = src[c];
    }
}
"""

#: threads per block, and the most blocks one launch asks for (the groups stride past it)
BLOCK = 256
MAX_BLOCKS = 1 << 16
INT_MAX = 2**31 - 1


def source(word: int) -> str:
    """The kernels' source for words of ``word`` bytes."""
    return SOURCE.replace("typedef WORD word_t", f"typedef {WORDS[word]} word_t")


class Launch(NamedTuple):
    """How to launch a kernel over ``rows`` rows: words of ``word`` bytes, ``words`` to a row,
    ``group`` threads to a row, ``grid`` blocks of ``block`` threads."""

    word: int
    words: int
    group: int
    grid: int
    block: int


def launch(rows: int, row_bytes: int, addresses: tuple[int, ...], slots: int = 0) -> Launch | None:
    """The launch of a kernel over ``rows`` rows of ``row_bytes`` bytes whose buffers start at
    ``addresses``; ``None`` where a size does not fit the kernels' 32-bit ints (the caller
    then takes another path)."""
    if rows < 1 or row_bytes < 1:
        return None
    word = next(w for w in WORDS if row_bytes % w == 0 and all(a % w == 0 for a in addresses))
    words = row_bytes // word
    if max(rows, words, slots) > INT_MAX:
        return None
    group = 1
    while group < min(words, 32):
        group *= 2
    per_block = BLOCK // group
    grid = min(-(-rows // per_block), MAX_BLOCKS)
    return Launch(word, words, group, grid, BLOCK)
