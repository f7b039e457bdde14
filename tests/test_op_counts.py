"""How many operations one eager ``extend`` launches, against the store and gather a
static-cache decoder writes by hand (``index_copy_`` + ``index_select``): at most two more.

Counted with a ``TorchDispatchMode`` on an index that an earlier layer already used (the index
keeps its store and read plans for every layer's pool), views left out (they launch nothing).
Two paths: the CPU's (the kept stores and the rows to zero found once on the host) and a
device's (``cacheidx::store_rows_`` and ``cacheidx::gated_rows``, one kernel each on CUDA; here
they run their plain-torch stand-ins, inside the one operation the mode sees; the device path's
laws run through the kernels too, as C++ on the host).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="counting torch operations needs PyTorch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import cacheidx as ci  # noqa: E402
from cacheidx.backends import torch as torch_backend  # noqa: E402
from cacheidx.backends import torch_rows  # noqa: E402

B, CTX, W, SLOTS = 4, 32, 8, 256


class Count(TorchDispatchMode):
    """The names of the operations dispatched, views left out."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def counted(fn) -> list[str]:
    with Count() as c:
        fn()
    return c.ops


def paged(seq: int, *, window: int | None = None, seed: int = 0):
    """A paged index of ``B`` lanes of ``seq`` tokens (lane 0 left-padded, lane 3 running
    past its table), its values and a pool holding NaN."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(SLOTS, generator=g)[: B * CTX].reshape(B, CTX)
    table[1, -4:] = -1  # unallocated
    last = torch.tensor([9, 20, 5, CTX + seq - 2])
    pos = last[:, None] - seq + 1 + torch.arange(seq)[None, :]
    pos[0, : seq // 2] = -1
    index = ci.make(pos, table)
    if window is not None:
        index = index.window(window)
    pool = torch.randn(SLOTS, 2, W, generator=g)
    pool[table[2, 7]] = torch.nan  # unseen by lane 2 (past its position)
    return index, torch.randn(B, seq, 2, W, generator=g), pool


def hand_written(index, values, pool) -> list[str]:
    """What a static-cache decoder does: store every row, gather the whole table."""
    writes = torch.arange(values.shape[0] * values.shape[1]) % pool.shape[0]
    rows = values.reshape(-1, *values.shape[2:])
    table = index.table.reshape(-1).clamp(min=0)
    return counted(lambda: (pool.index_copy_(0, writes, rows), pool.index_select(0, table)))


CASES = {
    "decode": dict(seq=1),
    "prefill": dict(seq=12),
    "windowed decode": dict(seq=1, window=6),
    "windowed prefill": dict(seq=12, window=5),
}


@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_extend_launches_at_most_two_more_than_hand_written(case, path, monkeypatch):
    if path == "device":
        monkeypatch.setattr(torch_backend, "_on_host", lambda *_: False)
    index, values, pool = paged(**CASES[case])
    base = hand_written(index, values, pool.clone())
    assert base == ["index_copy_", "index_select"]
    want, _ = ci.make(index.pos.numpy(), index.table.numpy()).window(
        index.window_size or 2**40).extend(values.numpy(), pool.numpy().copy())
    index.extend(values, pool.clone(), donate=True)  # an earlier layer: the plans are kept
    out = {}
    ops = counted(lambda: out.update(r=index.extend(values, pool, donate=True)))
    assert len(ops) <= len(base) + 2, ops
    seen, after = out["r"]
    assert after.data_ptr() == pool.data_ptr()
    np.testing.assert_array_equal(seen.numpy(), want)  # the NaN unseen reads as zero


def test_the_plans_are_kept_per_pool_size():
    """A pool of another size gets plans of its own: a slot inside one pool is outside a
    smaller one, where it must be dropped."""
    index = ci.make(torch.tensor([[0]]), torch.tensor([[5, 1]]))
    values = torch.ones(1, 1, 1)
    seen, big = index.extend(values, torch.zeros(8, 1))
    assert big[5, 0] == 1 and seen[0, 0, 0] == 1
    seen, small = index.extend(values, torch.zeros(4, 1))
    assert small.sum() == 0 and seen.sum() == 0


@pytest.mark.parametrize("kernels", [True, False], ids=["CUDA kernels", "plain torch"])
@pytest.mark.parametrize("donate", [False, True])
def test_the_device_path_keeps_every_law(donate, kernels, monkeypatch):
    """Through the device plans and operations, their CUDA kernels (run on the host as C++,
    tests/cuda_emulation.py: no GPU here) and their plain-torch stand-ins (ROCm, kernels that
    did not compile): drops drop (slot 0 kept, no -1 wrap), unseen columns are zero over NaN,
    the caller's pool is untouched unless donated; each kernel launched once."""
    monkeypatch.setattr(torch_backend, "_on_host", lambda *_: False)
    launched = []
    if kernels:
        from cuda_emulation import COMPILER, Kernel

        from cacheidx.backends import rowkernels

        if COMPILER is None:
            pytest.skip("no C++ compiler for the host to run the CUDA kernels on")

        def kernel(name, word, device):
            launched.append(Kernel(rowkernels.source(word), name))
            return launched[-1]

        monkeypatch.setattr(torch_rows, "kernels_on", lambda x: True)
        monkeypatch.setattr(torch_rows, "kernel", kernel)
    table = torch.tensor([[0, 3, -1, 9], [5, 2, 1, 4]])
    index = ci.make(torch.tensor([[1], [4]]), table)  # lane 1 runs past its table: dropped
    pool = torch.arange(10 * 2, dtype=torch.float32).reshape(10, 2)
    pool[9] = torch.nan  # lane 0's column 3, which it does not see
    before = pool.clone()
    values = torch.tensor([[[7.0, 8.0]], [[9.0, 10.0]]])
    seen, after = index.extend(values, pool, donate=donate)
    want = before.clone()
    want[3] = values[0, 0]
    torch.testing.assert_close(after, want, equal_nan=True, rtol=0, atol=0)
    assert (after.data_ptr() == pool.data_ptr()) == donate
    if not donate:
        torch.testing.assert_close(pool, before, equal_nan=True, rtol=0, atol=0)
    zero = torch.zeros(2)
    torch.testing.assert_close(seen[0], torch.stack([before[0], values[0, 0], zero, zero]))
    torch.testing.assert_close(seen[1], torch.stack([before[5], before[2], before[1], before[4]]))
    assert [k.launches for k in launched] == ([1, 1] if kernels else []), "kernel launches"


def test_the_operations_have_fake_kernels():
    """Under a FakeTensorMode (export, shape propagation) the operations give shapes only."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch_rows.define()
    with FakeTensorMode():
        pool, slots = torch.empty(6, 2, 3), torch.zeros(4, dtype=torch.long)
        got = torch.ops.cacheidx.gated_rows(pool, slots, torch.ones(4, dtype=torch.bool))
        torch.ops.cacheidx.store_rows_(pool, slots, torch.empty(4, 2, 3))
    assert tuple(got.shape) == (4, 2, 3)
