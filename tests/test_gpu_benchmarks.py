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


@pytest.mark.parametrize("name", ["gpu_extend", "gpu_decode"])
def test_without_a_gpu_it_says_so_and_exits_0(name, tmp_path, capsys, monkeypatch):
    bench = script(name)
    monkeypatch.setattr(bench, "gpu_name", lambda: None)
    assert bench.main(["--json", str(tmp_path / "out.json")]) == 0
    assert "no GPU is present" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == []


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
