"""The CPU kernel is built as the ecosystem builds native code (issue 36, item 5): an optional
extension module compiled at install time (setup.py), with one set of numerics on every machine,
checked before it is called, and the array-API path, said once, where it was not built; on
torch it is also the operator ``cacheidx::paged``, which ``torch.library.opcheck`` checks."""

from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

import cacheidx as ci
from cacheidx import quantized
from cacheidx.attention import native
from cacheidx.attention.native import found

ROOT = Path(__file__).resolve().parents[1]


def kernel_or_skip():
    if native.kernel() is None:
        pytest.skip("the CPU kernel is not built here (no C compiler at install time)")


def setup_flags() -> list[str]:
    namespace: dict = {}
    text = (ROOT / "setup.py").read_text()
    exec(compile(text.split("\n\nclass ")[0], "setup.py", "exec"), namespace)
    return namespace["UNIX"]


def test_the_build_keeps_one_set_of_numerics_on_every_machine():
    """No flag that makes the sums depend on the machine: no -march=native, no fast math or
    reassociation; contraction into fused multiply-adds off."""
    flags = setup_flags()
    assert "-ffp-contract=off" in flags
    for bad in ("-march=native", "-ffast-math", "-fassociative-math", "-Ofast",
                "-funsafe-math-optimizations"):
        assert bad not in flags


def test_with_no_compiler_the_build_goes_on_without_the_kernel(tmp_path):
    """``CC=/nonexistent``: setup.py's build of the optional extension says it failed and
    exits 0 (``pip install`` goes on), building nothing."""
    env = {**os.environ, "CC": "/nonexistent", "LDSHARED": "/nonexistent -shared"}
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib",
                           str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'building extension "cacheidx.attention.native._kernel" failed' in (
        done.stdout + done.stderr)
    assert not list(tmp_path.rglob("_kernel*")), "nothing built"


def paged_step():
    """A decode step over a paged int8 pool (3 lanes, pages in a shuffled order) and its
    reference output."""
    rng = np.random.default_rng(0)
    lens, width, kv, g, d = [40, 17, 33], 48, 2, 2, 64
    n = 3 * width
    table = rng.permutation(n).reshape(3, width)
    index = ci.make(np.asarray(lens)[:, None] - 1, table)
    everyone = ci.make(np.arange(n)[None, :], np.arange(n)[None, :])
    kp, vp = (everyone.extend(rng.standard_normal((1, n, kv, d)).astype(np.float32),
                              quantized.zeros(n, kv, d), donate=True)[1] for _ in range(2))
    q = rng.standard_normal((3, 1, kv * g, d)).astype(np.float32)
    k, v = (rng.standard_normal((3, 1, kv, d)).astype(np.float32) for _ in range(2))
    return index, q, k, v, kp, vp


def attend_twice() -> list:
    outs = []
    for _ in range(2):
        index, q, k, v, kp, vp = paged_step()
        outs.append(index.attend(q, k, v, kp, vp)[0])
    return outs


@pytest.fixture
def fresh(monkeypatch):
    """The kernel looked for anew, at the module name the test sets."""
    monkeypatch.setattr(found, "_FOUND", [])
    monkeypatch.delenv("CACHEIDX_NATIVE", raising=False)
    return monkeypatch


def warned(caught) -> list[str]:
    return [str(w.message) for w in caught if "CPU kernel" in str(w.message)]


def test_without_the_kernel_the_core_reads_and_says_so_once(fresh):
    """No module built: :func:`~cacheidx.attention.native.kernel` is ``None``, exactly one
    warning says why, however many calls follow, and the core's outputs are the kernel's
    (within the attention law's tolerance)."""
    with native.off():
        want = attend_twice()
    fresh.setattr(found, "MODULE", "cacheidx.attention.native._not_built")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = attend_twice()
        assert native.kernel() is None
    [said] = warned(caught)
    assert "not built" in said and "C compiler" in said
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_cacheidx_native_0_keeps_the_kernel_out_silently(fresh):
    fresh.setenv("CACHEIDX_NATIVE", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.kernel() is None
    assert warned(caught) == []


def test_a_build_that_lays_out_its_arguments_otherwise_is_never_called(fresh):
    """A module whose structs differ from this side's mirrors (a stale build): refused with
    the one warning, and never called."""
    calls = []
    stale = types.ModuleType("stale_kernel")
    size, fields = found.layout(found.Paged)
    stale.layout = lambda: {"abi": found.ABI, "paged": (size, [(n, o + 8) for n, o in fields])}
    stale.paged = lambda args: calls.append(args) or 0
    fresh.setitem(sys.modules, "stale_kernel", stale)
    fresh.setattr(found, "MODULE", "stale_kernel")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attend_twice()
    [said] = warned(caught)
    assert "lays out its arguments otherwise" in said
    assert calls == [] and native.kernel() is None


def test_the_built_kernel_lays_out_its_arguments_as_its_mirrors():
    kernel_or_skip()
    said = found.library().layout()
    assert said["abi"] == found.ABI and said["rows"] == native.ROWS
    size, fields = found.layout(found.Paged)
    assert said["paged"][0] == size and [tuple(f) for f in said["paged"][1]] == fields


def test_the_entry_given_other_bytes_than_its_struct_is_a_type_error():
    kernel_or_skip()
    with pytest.raises(TypeError, match="_kernel.paged: takes the"):
        found.library().paged(b"\0" * 8)


# -- on torch: the operator cacheidx::paged ---------------------------------------------------
def op_args(kind: str):
    torch = pytest.importorskip("torch")
    from cacheidx.attention.native import op  # noqa: F401  (registers cacheidx::paged)

    rng = np.random.default_rng(1)
    lanes, kv, g, d, n = 3, 2, 3, 64, 96
    table = torch.as_tensor(rng.permutation(n).reshape(lanes, 32))
    start = torch.tensor([0, 3, 0])
    stop = torch.tensor([32, 20, 0])  # the last lane sees nothing

    def pool():
        x = torch.as_tensor(rng.standard_normal((n, kv, d)).astype(np.float32))
        return list(quantized.quantize(x, 8)) if kind == "int8" else [x]

    q = torch.as_tensor(rng.standard_normal((lanes, kv, g, d)).astype(np.float32)) * 0.125
    return q, table, start, stop, pool(), pool()


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_the_paged_operator_passes_opcheck(kind):
    kernel_or_skip()
    torch = pytest.importorskip("torch")
    args = op_args(kind)
    m, l, acc, refused = torch.ops.cacheidx.paged(*args)
    assert not bool(refused)
    want = native.paged(args[0], args[1].numpy(), args[2].numpy(), args[3].numpy(),
                        *(quantized.Quantized(*p) if len(p) == 2 else p[0] for p in args[4:]))
    for a, b in zip((m, l, acc), want):
        assert torch.equal(a, b)
    torch.library.opcheck(torch.ops.cacheidx.paged.default, args)


def test_the_paged_operator_compiles_as_one_node_and_says_a_refusal():
    """Under ``torch.compile(fullgraph=True)`` the operator is one node of the fake's shapes
    and gives eager's bits; a query that is not finite is refused (``refused`` true, the state
    zeros)."""
    kernel_or_skip()
    torch = pytest.importorskip("torch")
    args = op_args("float32")

    def state(*a):
        m, l, acc, refused = torch.ops.cacheidx.paged(*a)
        return acc / l.clamp_min(1e-30)[..., None], refused

    eager = state(*args)
    compiled = torch.compile(state, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(eager[0], compiled[0]) and not bool(compiled[1])
    bad = (args[0].clone().index_fill_(0, torch.tensor([1]), float("nan")), *args[1:])
    m, l, acc, refused = torch.ops.cacheidx.paged(*bad)
    assert bool(refused) and not acc.any() and not l.any()


def calls(seed: int = 0) -> list:
    """The paged entry's and the runs' entry's outputs on random calls: float32, bfloat16,
    int8, int4 and turned 4-bit pools (the engine's groups, 16 channels for keys and 64 for
    values: the whole-vector path), runs of columns that end inside a vector's width, head dims
    of 64 and 40 (the padded path)."""
    import torch

    from cacheidx import turned

    rng = np.random.default_rng(seed)
    out = []
    for kind, d in (("float32", 64), ("bfloat16", 64), ("int8", 64), ("int4", 64),
                    ("turned", 64), ("float32", 40), ("int8", 40)):
        lanes, kv, g, width = 3, 2, 3, 75
        n = lanes * width
        table = rng.permutation(n).reshape(lanes, width).astype(np.int64)
        start = np.asarray([0, 5, 0], np.int64)
        stop = np.asarray([75, 61, 17], np.int64)
        q = torch.as_tensor(rng.standard_normal((lanes, kv, g, d), dtype=np.float32) / 8)
        pools = []
        for group in (16, 64):
            x = torch.as_tensor(rng.standard_normal((n, kv, d), dtype=np.float32))
            if kind == "float32":
                pools.append(x)
            elif kind == "bfloat16":
                pools.append(x.to(torch.bfloat16))
            elif kind == "turned":
                pools.append(turned.Turned(*turned.quantize(x, group)))
            else:
                bits = 8 if kind == "int8" else 4
                pools.append(quantized.Quantized(*quantized.quantize(x, bits)))
        got = native.paged(q, table, start, stop, *pools)
        assert got is not None, kind
        out += [t.numpy().copy() for t in got]
        if kind != "float32":  # a run of slots in order, as the core's runs call it
            order = np.arange(40, dtype=np.int64)[None, :]
            got = native.paged(q[:1], order, np.zeros(1, np.int64), np.full(1, 40, np.int64),
                               *pools)
            assert got is not None, kind
            out += [t.numpy().copy() for t in got]
    return out


def widest_here() -> int:
    """The floats a vector of the widest x86-64 level this processor runs (its flags in
    /proc/cpuinfo): 16 with x86-64-v4's AVX-512, 8 with x86-64-v3's AVX2 and FMA, else 4."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    v3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave", "abm"}
    v4 = v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    return 16 if v4 <= flags else 8 if v3 <= flags else 4


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                    reason="the kernel's widths are built for x86-64 Linux")
def test_the_installed_kernel_takes_the_widest_vectors_this_processor_runs():
    """The body the kernel runs is the widest the processor has registers for: a vector of 16
    floats on a processor without AVX-512 lives in memory (2.3 to 4.6 times the time on AVX2),
    one of 4 leaves AVX2's registers half empty."""
    kernel_or_skip()
    assert found.library().layout()["width"] == widest_here()


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                    reason="the kernel's widths are built for x86-64 Linux")
def test_a_build_for_the_oldest_x86_64_gives_the_installed_kernels_bits(tmp_path, fresh):
    """The same bits on every machine (``kernel.c``'s law): the kernel built for the baseline
    x86-64 alone (SSE2: one body, 4 floats a vector) gives exactly the installed build's
    outputs (the widest body this processor runs: 8 floats on AVX2, 16 on AVX-512) on random
    paged calls over every kind of pool, and on runs of slots in order."""
    import importlib.util

    pytest.importorskip("torch")
    kernel_or_skip()
    env = {**os.environ, "CFLAGS": "-march=x86-64 -DCACHEIDX_ONE_TARGET"}
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib",
                           str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    installed = calls()
    path = next((tmp_path / "lib").rglob("_kernel*"))
    spec = importlib.util.spec_from_file_location("baseline._kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh.setitem(sys.modules, "baseline._kernel", module)
    fresh.setattr(found, "MODULE", "baseline._kernel")
    fresh.setattr(found, "_FOUND", [])
    assert found.library() is module and module.layout()["width"] == 4
    baseline = calls()
    assert len(baseline) == len(installed)
    for a, b in zip(installed, baseline, strict=True):
        assert a.tobytes() == b.tobytes()
