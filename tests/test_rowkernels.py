"""The CUDA row kernels the torch and CuPy adapters launch eagerly on a GPU.

No GPU here: their source is compiled by ``nvcc`` where it is installed (a syntax and type
check for every word size), and run on the host as C++ with a loop standing in for the grid
(tests/cuda_emulation.py), through the adapters' own launch code.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from cuda_emulation import COMPILER, Kernel

import cacheidx as ci
from cacheidx.backends import rowkernels

needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler for the host")


@pytest.mark.parametrize("word", list(rowkernels.WORDS))
def test_nvcc_compiles_the_kernels(word, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed: the CUDA source is checked on the host only")
    src = tmp_path / "rows.cu"
    src.write_text(rowkernels.source(word))
    r = subprocess.run([nvcc, "-arch=sm_80", "--ptx", str(src), "-o", str(tmp_path / "r.ptx")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ptx = (tmp_path / "r.ptx").read_text()
    assert ".entry cacheidx_gated_rows" in ptx and ".entry cacheidx_store_rows" in ptx


def test_the_word_is_the_widest_that_divides_rows_and_addresses():
    assert rowkernels.launch(10, 512, (0, 1024)).word == 16
    assert rowkernels.launch(10, 512, (0, 1028)).word == 4  # a buffer 4-aligned only
    assert rowkernels.launch(10, 12, (0, 0)).word == 4
    assert rowkernels.launch(10, 6, (0, 0)).word == 2
    assert rowkernels.launch(10, 3, (0, 0)).word == 1
    how = rowkernels.launch(10, 4096, (0, 0))
    assert (how.words, how.group) == (256, 32)
    assert rowkernels.launch(10, 8, (0, 0)).group == 1
    assert rowkernels.launch(0, 8, (0, 0)) is None
    assert rowkernels.launch(2**31, 8, (0, 0)) is None


def run_gated(pool, slots, ok):
    out = np.empty((len(slots), *pool.shape[1:]), pool.dtype)
    how = rowkernels.launch(len(slots), pool[0].nbytes, (addr(pool), addr(out)))
    Kernel(rowkernels.source(how.word), "cacheidx_gated_rows")(
        (how.grid,), (how.block,), (pool, slots, ok, out, len(slots), how.words, how.group))
    return out


def run_store(pool, slots, rows):
    how = rowkernels.launch(len(slots), pool[0].nbytes, (addr(pool), addr(rows)))
    Kernel(rowkernels.source(how.word), "cacheidx_store_rows")(
        (how.grid,), (how.block,),
        (pool, slots, rows, len(slots), how.words, len(pool), how.group))


def addr(a):
    return a.__array_interface__["data"][0]


@needs_compiler
@pytest.mark.parametrize("dtype, row", [
    (np.float32, (3,)), (np.float32, (2, 4)), (np.float16, (3,)), (np.int8, (5,)),
    (np.float64, (1,)), (np.float64, (2,)), (np.bool_, (7,)), (np.float32, (2, 64)),
])
@pytest.mark.parametrize("blocks", [rowkernels.MAX_BLOCKS, 1])
def test_the_kernels_store_and_read_as_the_laws_say(dtype, row, blocks, monkeypatch):
    """A store outside the pool is skipped, every kept one lands; a read is the slot's row
    where ok and all bits zero elsewhere, NaN in the pool included; with one block, the
    groups stride over every row."""
    monkeypatch.setattr(rowkernels, "MAX_BLOCKS", blocks)
    rng = np.random.default_rng(0)
    n = 40
    pool = (rng.standard_normal((n, *row)) * 10).astype(dtype)
    if np.issubdtype(dtype, np.floating):
        pool[3] = np.nan
    slots = rng.permutation(n + 20) - 10  # distinct, 20 outside the pool
    slots = np.concatenate([slots, [-1, n, 2**40]]).astype(np.int64)
    rows = (rng.standard_normal((len(slots), *row)) * 10).astype(dtype)
    want = pool.copy()
    keep = (slots >= 0) & (slots < n)
    want[slots[keep]] = rows[keep]
    got = pool.copy()
    run_store(got, slots, rows)
    np.testing.assert_array_equal(got, want)

    read = rng.integers(-5, n + 5, 500).astype(np.int64)
    ok = (rng.random(500) < 0.6) & (read >= 0) & (read < n)
    ok[read == 3] = False  # the NaN slot is read only where unseen
    out = run_gated(got, read, ok.astype(np.bool_))
    expect = np.where(ok.reshape(-1, *[1] * len(row)), got[np.where(ok, read, 0)], 0)
    np.testing.assert_array_equal(out, expect.astype(dtype))
    assert not np.isnan(out.astype(np.float64)).any()


@needs_compiler
def test_torch_eager_through_the_kernels(monkeypatch):
    """The torch adapter's CUDA path, its launches and arguments, with the kernels run on the
    host: one launch to store, one to read, exact against NumPy."""
    torch = pytest.importorskip("torch", reason="the torch adapter needs PyTorch")
    from cacheidx.backends import torch as torch_backend
    from cacheidx.backends import torch_rows

    kernels: list[Kernel] = []

    def kernel(name, word, device):
        kernels.append(Kernel(rowkernels.source(word), name))
        return kernels[-1]

    monkeypatch.setattr(torch_backend, "_on_host", lambda *_: False)
    monkeypatch.setattr(torch_rows, "kernels_on", lambda x: True)
    monkeypatch.setattr(torch_rows, "kernel", kernel)
    rng = np.random.default_rng(1)
    table = rng.permutation(64)[:3 * 10].reshape(3, 10)
    table[2, 6:] = -1
    pos = np.array([[3, 4, 5], [-1, 0, 1], [7, 8, 9]])  # lane 2's last token is past its pages
    pool = rng.standard_normal((64, 2, 4)).astype(np.float32)
    pool[table[0, 8]] = np.nan
    values = rng.standard_normal((3, 3, 2, 4)).astype(np.float32)
    want_seen, want_pool = ci.make(pos, table).extend(values, pool.copy())
    index = ci.make(torch.from_numpy(pos), torch.from_numpy(table))
    mine = torch.from_numpy(pool.copy())
    seen, after = index.extend(torch.from_numpy(values), mine, donate=True)
    assert after.data_ptr() == mine.data_ptr()
    assert [k.launches for k in kernels] == [1, 1]
    np.testing.assert_array_equal(seen.numpy(), want_seen)
    np.testing.assert_array_equal(after.numpy(), want_pool)


def test_a_kernel_that_cannot_compile_warns_once_and_leaves_plain_torch():
    """Without NVRTC (here: a CPU build of torch) the kernel is None, with a warning, and the
    CUDA toolkit setting torch's NVRTC wrapper reads is left as it was."""
    pytest.importorskip("torch", reason="the torch adapter needs PyTorch")
    import torch.utils.cpp_extension as ext

    from cacheidx.backends import torch_rows

    before = ext.CUDA_HOME
    torch_rows.kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="did not compile"):
            assert torch_rows.kernel("cacheidx_gated_rows", 4, None) is None
    finally:
        torch_rows.kernel.cache_clear()
    assert ext.CUDA_HOME == before
