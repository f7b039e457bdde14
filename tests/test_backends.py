"""The registry and the adapters' one operation: scatter with drop, on every backend."""

import dataclasses
import subprocess
import sys
import types
from importlib.metadata import entry_points

import numpy as np
import pytest

import cacheidx as ci
from cacheidx.backends import Backend
from cacheidx.backends.cupy import CupyBackend


def huge(backend) -> int:
    info = backend.xp.__array_namespace_info__().default_dtypes()["integral"]
    return 2**40 if backend.xp.iinfo(info).bits == 64 else 2**31 - 1


def test_every_builtin_adapter_is_registered_and_entry_points_add_to_them():
    """The built-in list is written once (``backends.BUILTIN``); the group's entry points are
    added over it (a third party's adapter, or an installed copy of the built-in ones)."""
    assert list(ci.backends.BUILTIN) == ["numpy", "strict", "torch", "jax", "cupy"]
    for name, target in ci.backends.BUILTIN.items():
        assert target.startswith(f"cacheidx.backends.{name}:")
    eps = {ep.name: ep.value for ep in entry_points(group="cacheidx.backends")}
    assert ci.backends.names()[:len(ci.backends.BUILTIN)] == list(ci.backends.BUILTIN)
    assert set(ci.backends.names()) == set(ci.backends.BUILTIN) | set(eps)


def test_a_registry_imports_a_target_only_when_its_name_is_loaded(monkeypatch):
    """``cacheidx.registry.Registry``, the one loader of backends and attention's paths:
    built-in targets, then the group's entry points over them, each module imported only
    when its name is first loaded, once."""
    import sys

    from cacheidx.registry import Registry

    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    plug = Registry("cacheidx.no-such-group", {"hsv": "colorsys:rgb_to_hsv"})
    assert plug.names() == ["hsv"] and "colorsys" not in sys.modules
    assert plug.load("hsv") is plug.load("hsv") is sys.modules["colorsys"].rgb_to_hsv
    with pytest.raises(KeyError):
        plug.load("nothing")


def test_get_finds_the_adapter_an_array_needs():
    import array_api_strict

    assert ci.backends.get(np.zeros(2)).name == "numpy"
    assert ci.backends.get(array_api_strict.zeros(2)).name == "strict"
    assert ci.backends.get(np).name == "numpy"
    assert ci.backends.get("array_api_strict").name == "strict"
    assert set(ci.backends.available()) >= {"numpy", "strict"}


@pytest.mark.parametrize("lib, name", [("torch", "torch"), ("jax.numpy", "jax")])
def test_get_dispatches_framework_arrays(lib, name):
    mod = pytest.importorskip(lib, reason=f"{lib} is not installed")
    assert ci.backends.get(mod.zeros(2)).name == name
    assert ci.backends.get(mod).name == name
    assert ci.rows(4, [2], xp=mod).backend.name == name


def test_the_standard_base_is_a_complete_backend():
    """Any namespace array-api-compat knows runs on the standard-only base adapter."""
    import array_api_strict as xp

    base = Backend(xp)
    ix = ci.make(xp.asarray([[0, 1]]), xp.asarray([[3, 0, 1]]))
    ix = type(ix)(kind=ix.kind, pos=ix.pos, table=ix.table, backend=base)
    seen, pool = ix.extend(xp.asarray([[[5.0], [6.0]]]), xp.zeros((4, 1)))
    assert np.array_equal(np.asarray(xp.reshape(pool, (-1,))), [6.0, 0, 0, 5.0])
    assert np.array_equal(np.asarray(xp.reshape(seen, (-1,))), [5.0, 6.0, 0])


def test_use_and_the_environment_pick_the_default_backend():
    try:
        ci.use("strict")
        assert ci.rows(4, [2]).backend.name == "strict"
    finally:
        ci.use("numpy")
    code = "import cacheidx as ci; print(ci.rows(4, [2]).backend.name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "CACHEIDX_BACKEND": "strict"})
    assert out.stdout.strip() == "strict"


# -- CuPy without a device: everything that can be checked here ------------------------------
def test_cupy_without_a_device_says_why():
    ok, why = CupyBackend.usable()
    if ok:
        pytest.skip("a CUDA device is present: the conformance suite covers cupy")
    assert why, "cupy is unusable but gives no reason"
    assert not CupyBackend.owns(np.zeros(2))


def test_cupy_adapter_logic_with_numpy_standing_in(monkeypatch):
    """The adapter's store and read, run with NumPy in CuPy's place and its kernels compiled
    for the host (tests/cuda_emulation.py): a store outside the pool is skipped (CuPy would
    wrap -1), a kept one at slot 0 lands, an unseen row is zero over NaN, each one launch."""
    cuda_emulation = pytest.importorskip("cuda_emulation")
    if cuda_emulation.COMPILER is None:
        pytest.skip("no C++ compiler to build the row kernels for the host")
    import array_api_compat.numpy as cnp

    from cacheidx.backends import cupy as cupy_backend

    kernels = []

    def raw_kernel(source, name):
        kernels.append(cuda_emulation.Kernel(source, name))
        return kernels[-1]

    fake = types.ModuleType("cupy")
    fake.ascontiguousarray, fake.empty, fake.int64 = np.ascontiguousarray, np.empty, np.int64
    fake.take, fake.where, fake.RawKernel = np.take, np.where, raw_kernel
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cupy_backend, "_address", cuda_emulation.address)
    cupy_backend._kernel.cache_clear()
    try:
        backend = CupyBackend(xp=cnp)
        backend.same_library = lambda x: isinstance(x, np.ndarray)
        pool = np.arange(8, dtype=np.float32).reshape(4, 2)
        out = backend.scatter(pool, np.array([-1, 4, 2**40, 0]), np.full((4, 2), 9, np.float32))
        want = pool.copy()
        want[0] = 9
        assert np.array_equal(out, want) and np.array_equal(pool, np.arange(8).reshape(4, 2))
        donated = backend.scatter(pool, np.array([1]), np.full((1, 2), 7, np.float32),
                                  donate=True)
        assert donated is pool and pool[1, 0] == 7
        pool[3] = np.nan
        got = backend.gather(pool, np.array([0, 3]), np.array([True, False]))
        assert np.array_equal(got, [[0, 1], [0, 0]])
        assert sum(k.launches for k in kernels) == 3
        index = ci.make(np.array([[1], [0]]), np.array([[2, 0, 3], [1, -1, 3]]))
        index = dataclasses.replace(index, backend=backend)
        seen, after = index.extend(np.ones((2, 1, 2), np.float32), pool.copy())
        want_seen, want_after = ci.make(np.array([[1], [0]]), np.array(
            [[2, 0, 3], [1, -1, 3]])).extend(np.ones((2, 1, 2), np.float32), pool.copy())
        assert np.array_equal(seen, want_seen)
        assert np.array_equal(after, want_after, equal_nan=True)
    finally:
        cupy_backend._kernel.cache_clear()


def test_the_runner_reports_cuda_rows_as_no_device():
    from cacheidx.conformance.runner import targets

    rows = targets()
    cuda = [r for r in rows if r["device"] in ("cuda", "gpu")]
    for r in cuda:
        assert r["status"].startswith("no device"), r
    assert any(r["backend"] == "numpy" and r["status"] == "run" for r in rows)


def test_an_index_closed_over_by_a_jitted_step_keeps_no_tracer():
    """An index keeps its slots for the next layer only when they are concrete: one closed
    over by a traced step must not leak the trace's values."""
    jax = pytest.importorskip("jax", reason="jax is not installed")
    ix = ci.rows(8, [3, 5], xp="jax")
    pool, v = jax.numpy.zeros((16, 2)), jax.numpy.ones((2, 5, 2))
    traced, _ = jax.jit(lambda v, p: ix.extend(v, p))(v, pool)
    eager, _ = ix.extend(v, pool)
    assert np.array_equal(np.asarray(traced), np.asarray(eager))


def test_a_pickled_index_leaves_the_plans_it_keeps_for_the_next_layer_behind():
    """An index keeps its store and read plans (this process's arrays, a backend's own types)
    for every layer's pool; pickled (torch.export saves its example inputs so), it carries its
    tensors and structure alone, and computes the plans again."""
    import pickle

    ix = ci.rows(8, [3, 5])
    values, pool = np.ones((2, 5, 2), np.float32), np.zeros((16, 2), np.float32)
    seen, _ = ix.extend(values, pool)
    assert ix.plan.made, "extend kept no plan"
    back = pickle.loads(pickle.dumps(ix))
    assert back.plan.made == 0 and back.structure == ix.structure
    again, _ = back.extend(values, pool)
    assert np.array_equal(again, seen)


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_a_pool_on_the_host_starts_at_a_memory_page(name):
    """``zeros`` (a pool's memory): on the host its first element starts a memory page, for
    the float pools of ``layout.zeros`` in either order and a quantized pool's codes and scales
    alike; zeros of the shape and dtype asked, which a store writes as any array."""
    from cacheidx import quantized
    from cacheidx.attention import layout
    from cacheidx.attention.native.memory import memory
    from cacheidx.backends.arrays import PAGE_BYTES

    if name == "torch":
        pytest.importorskip("torch")
    be = ci.backends.get(name)
    xp = be.xp
    assert be.zeros((0, 3), xp.int8).shape == (0, 3)
    made = [be.zeros((7, 3, 5), xp.float16)]
    for order in ("token", "head"):
        made.append(layout.zeros(xp, 33, 3, 64, dtype=xp.float32, layout=order))
        q = quantized.zeros(33, 3, 64, bits=4, xp=name, layout=order)
        made += [q.codes, q.scales]
    assert made[0].shape == (7, 3, 5) and made[0].dtype == xp.float16
    for x in made:
        assert memory(x)[0] % PAGE_BYTES == 0, (x.shape, memory(x))
        assert not bool(xp.any(x != 0))
    pool = made[1]  # the token-major float pool
    pool[1, 2, 3] = 1.5
    assert float(xp.sum(pool)) == 1.5


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_a_large_pool_on_the_host_lies_on_huge_pages(name):
    """A pool of a huge page or more starts a huge page and is zeros; where Linux keeps
    transparent huge pages for those who ask (``madvise`` or ``always``), the memory it was
    written to is mapped in them (its mapping's ``AnonHugePages`` in ``/proc/self/smaps``)."""
    from pathlib import Path

    from cacheidx.attention import layout
    from cacheidx.attention.native.memory import memory
    from cacheidx.backends.hostmemory import HUGE_BYTES

    if name == "torch":
        pytest.importorskip("torch")
    xp = ci.backends.get(name).xp
    pool = layout.zeros(xp, 8 * HUGE_BYTES // (3 * 64 * 4), 3, 64, dtype=xp.float32,
                        layout="head")
    start = memory(pool)[0]
    assert start % HUGE_BYTES == 0 and not bool(xp.any(pool != 0))
    smaps, thp = Path("/proc/self/smaps"), Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not (smaps.exists() and thp.exists() and "[never]" not in thp.read_text()):
        print("no transparent huge pages here: the pool's alignment alone checked")
        return
    pool[...] = 1  # the first write maps the pages
    huge, inside = None, False
    for line in smaps.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= start < hi
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1]) * 1024
    assert huge is not None and huge >= 4 * HUGE_BYTES, huge
