"""The GPU benchmarks run here too: without a GPU they say so and exit 0, and ``--cpu`` measures
their rows on the CPU (tiny sizes under ``--quick``), writing the JSON the GPU run writes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def script(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpus(monkeypatch, torch_gpu=None, jax_gpu=None):
    """Every library the scripts ask for a GPU reports ``torch_gpu`` (torch's CUDA) or
    ``jax_gpu`` (a JAX device of platform "gpu"), none by default, and CuPy is absent, whatever
    this machine holds: the scripts' own detection then runs."""
    import sys
    from types import SimpleNamespace

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    try:
        import torch
    except ImportError:
        pass
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: torch_gpu is not None)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: torch_gpu)
    try:
        import jax
    except ImportError:
        return
    cpu = jax.devices("cpu")
    found = [SimpleNamespace(platform="gpu", device_kind=jax_gpu)] if jax_gpu else []
    monkeypatch.setattr(jax, "devices", lambda *a: [*found, *cpu])


@pytest.mark.parametrize("name", ["gpu_extend", "gpu_decode"])
def test_without_a_gpu_it_says_so_and_exits_0(name, tmp_path, capsys, monkeypatch):
    """torch, JAX and CuPy each report no GPU: the script finds none, says so and exits 0."""
    bench = script(name)
    gpus(monkeypatch)
    assert bench.gpu_name() is None
    assert bench.main(["--json", str(tmp_path / "out.json")]) == 0
    assert "no GPU is present" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == []


@pytest.mark.parametrize("name", ["gpu_extend", "gpu_decode"])
@pytest.mark.parametrize("library", ["torch", "jax"])
def test_a_gpu_any_library_reports_is_found(name, library, monkeypatch):
    """A GPU torch's CUDA or JAX's devices report is the one the script names (so the branch
    above is reached by finding none, not by being told)."""
    pytest.importorskip(library, reason=f"{library} is not installed")
    bench = script(name)
    gpus(monkeypatch, **{f"{library}_gpu": f"a {library} GPU"})
    assert bench.gpu_name() == f"a {library} GPU"


def test_gpu_extend_measures_the_cpu_rows(tmp_path):
    pytest.importorskip("torch", reason="the torch rows need PyTorch")
    bench = script("gpu_extend")
    assert bench.main(["--cpu", "--quick", "--backend", "torch",
                       "--json", str(tmp_path / "out.json")]) == 0
    data = json.loads((tmp_path / "out.json").read_text())
    assert {r["backend"] for r in data["rows"]} == {"torch eager"}
    assert len(data["rows"]) == len(bench.QUICK)
    for r in data["rows"]:
        assert r["extend_ms"] > 0 and r["baseline_ms"] > 0 and r["copy_ms"] > 0
    assert data["donated"][0]["ratio"] > 0


def test_gpu_decode_measures_the_cpu_rows(tmp_path):
    pytest.importorskip("torch", reason="the torch rows need PyTorch")
    bench = script("gpu_decode")
    assert bench.main(["--cpu", "--quick", "--skip", "serve-torch-compiled", "--skip",
                       "serve-jax", "--json", str(tmp_path / "out.json")]) == 0
    data = json.loads((tmp_path / "out.json").read_text())
    engines = {r["engine"] for r in data["rows"]}
    assert {"cacheidx.demo.serve", "llama.forward loop"} <= engines
    assert all(r["tokens_per_s"] > 0 for r in data["rows"])
