"""Devices by any common name, one spelling in the report; tested with made-up device lists,
since no GPU is here."""

from __future__ import annotations

import json
import types

import pytest

import cacheidx as ci
from cacheidx import devices
from cacheidx.conformance import __main__ as cli
from cacheidx.conformance import runner


@pytest.mark.parametrize("name,want", [
    ("cpu", "cpu"), ("CPU", "cpu"), ("gpu", "cuda:0"), ("cuda", "cuda:0"), ("cuda:0", "cuda:0"),
    ("gpu:0", "cuda:0"), ("gpu:3", "cuda:3"), ("cuda:3", "cuda:3"), ("tpu", "tpu:0"),
])
def test_every_common_name_has_one_spelling(name, want):
    assert devices.canonical(name) == want


@pytest.mark.parametrize("name", ["", "cuda:", "cuda:x", "gpu-0", "0"])
def test_a_name_of_no_device_form_is_a_value_error(name):
    with pytest.raises(ValueError, match="is not a device name"):
        devices.canonical(name)


def fake_jax_devices():
    return [types.SimpleNamespace(platform=p, id=i)
            for p, i in (("gpu", 0), ("gpu", 1))]


def fake_torch_devices():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    return [torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.fixture
def two_gpus(monkeypatch):
    """torch and jax each see two GPUs (jax: no CPU, as on a GPU machine by default)."""
    torch_ = ci.backends.get("torch")
    jax_ = ci.backends.get("jax")
    monkeypatch.setattr(type(torch_), "devices", lambda self: fake_torch_devices())
    monkeypatch.setattr(type(jax_), "devices", lambda self: fake_jax_devices())
    monkeypatch.setattr(ci.backends._class("cupy"), "usable",
                        classmethod(lambda cls: (False, "cupy is not installed")))
    return torch_, jax_


@pytest.mark.parametrize("name", ["gpu", "cuda", "cuda:0", "gpu:0"])
def test_gpu_and_cuda_0_select_the_same_torch_and_jax_device(two_gpus, name):
    torch_, jax_ = two_gpus
    assert devices.resolve(torch_, name) == fake_torch_devices()[1]
    assert devices.resolve(jax_, name) is not None
    assert jax_.device_label(devices.resolve(jax_, name)) == "cuda:0"
    rows = runner.targets(["torch", "jax"], name)
    assert [(r["backend"], r["device"], r["status"]) for r in rows] == [
        ("torch", "cuda:0", "run"), ("jax", "cuda:0", "run")]


def test_a_second_gpu_by_either_name(two_gpus):
    torch_, jax_ = two_gpus
    for name in ("gpu:1", "cuda:1"):
        assert torch_.device_label(devices.resolve(torch_, name)) == "cuda:1"
        assert jax_.device_label(devices.resolve(jax_, name)) == "cuda:1"


def test_without_a_device_every_device_runs_once_named_one_way(two_gpus):
    rows = runner.targets(["numpy", "torch", "jax"])
    assert [(r["backend"], r["device"]) for r in rows if r["status"] == "run"] == [
        ("numpy", "cpu"), ("torch", "cpu"), ("torch", "cuda:0"), ("torch", "cuda:1"),
        ("jax", "cuda:0"), ("jax", "cuda:1")]


def test_a_library_that_can_use_cuda_reports_the_cuda_it_does_not_see():
    """The libraries whose checking part says ``cuda`` (torch, JAX, CuPy) get a "no device"
    row for CUDA where none is visible; a host-only one (NumPy, strict) none."""
    rows = runner.targets(["numpy", "strict", "torch", "jax"], found_by=lambda name: ["cpu"])
    assert {r["backend"] for r in rows if r["device"] == "cuda"} == {"torch", "jax"}
    assert [ci.backends.get(n).cuda for n in ("numpy", "strict", "torch", "jax")] == [
        False, False, True, True]


def test_a_device_a_backend_lacks_is_reported_not_run(two_gpus):
    rows = runner.targets(["numpy", "torch"], "cuda")
    assert {r["backend"]: r["status"] for r in rows} == {
        "numpy": "no device: numpy has cpu", "torch": "run"}


def test_an_absent_device_exits_non_zero_naming_the_devices_found(capsys):
    assert cli.main(["--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert "no device 'tpu'" in err and "numpy: cpu" in err


def test_an_absent_gpu_names_the_cpu(capsys):
    assert cli.main(["--backend", "numpy", "--backend", "strict", "--device", "gpu"]) == 2
    assert "found numpy: cpu; strict: cpu" in capsys.readouterr().err


def test_a_malformed_device_name_exits_non_zero(capsys):
    assert cli.main(["--device", "cuda:x"]) == 2
    assert "is not a device name" in capsys.readouterr().err


def test_resolve_names_what_a_backend_has():
    numpy = ci.backends.get("numpy")
    assert devices.resolve(numpy, None) == numpy.devices()[0]
    assert devices.resolve(numpy, "cpu") == numpy.devices()[0]
    with pytest.raises(ValueError, match="numpy has no device 'cuda:1' .*found: cpu"):
        devices.resolve(numpy, "cuda:1")


@pytest.mark.parametrize("name, dist", [("numpy", "numpy"), ("strict", "array-api-strict"),
                                        ("torch", "torch"), ("jax", "jax")])
def test_versions_come_from_the_imported_modules(name, dist, monkeypatch):
    """A backend's version is its installed distribution's (importlib.metadata, a source of
    its own), and it is read from the module imported: a module saying another version is
    reported as it says."""
    import importlib
    import importlib.metadata

    backend = ci.backends.get(name)
    pytest.importorskip(backend.module, reason=f"{backend.module} is not installed")
    assert backend.version() == importlib.metadata.version(dist)
    monkeypatch.setattr(importlib.import_module(backend.module), "__version__", "0.0.test")
    assert backend.version() == "0.0.test"


def test_the_cli_writes_one_report_with_devices_named_one_way(tmp_path):
    path = tmp_path / "report.json"
    assert cli.main(["--backend", "numpy", "--backend", "strict", "--device", "cpu",
                     "--json", str(path), "--jobs", "2"]) == 0
    report = json.loads(path.read_text())
    rows = report["report"]
    assert [(r["backend"], r["device"], r["status"]) for r in rows] == [
        ("numpy", "cpu", "pass"), ("strict", "cpu", "pass")]
    assert report["wall_seconds"] > 0 and all(r["seconds"] >= 0 for r in rows)
    assert rows[0]["version"] and rows[0]["precision"]["policy"] == "highest"


def test_jax_on_a_gpu_machine_lists_its_gpus_then_the_host(monkeypatch):
    jax = pytest.importorskip("jax", reason="jax is not installed")
    host = types.SimpleNamespace(platform="cpu", id=0)

    def listed(platform=None):
        return [host] if platform == "cpu" else fake_jax_devices()

    monkeypatch.setattr(jax, "devices", listed)
    backend = ci.backends.get("jax")
    assert [backend.device_label(d) for d in backend.devices()] == ["cuda:0", "cuda:1", "cpu"]
    assert devices.resolve(backend, "cpu") is host
