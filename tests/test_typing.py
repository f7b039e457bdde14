"""mypy over the backends: every adapter is each protocol its floors ask for
(:mod:`cacheidx.backends.protocols`; the configuration is pyproject.toml's ``[tool.mypy]``,
tests/typing/adapters.py names each built-in adapter), and an adapter that stops matching
one fails."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mypy(cache: Path, *files: str) -> subprocess.CompletedProcess:
    """mypy as pyproject.toml configures it (its files unless ``files`` are given), with a
    cache of its own (a run from cold takes a few seconds)."""
    if shutil.which("mypy") is None:
        try:
            import mypy  # noqa: F401
        except ImportError:
            pytest.skip("mypy is not installed (the test extra has it)")
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), *files],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_adapter_is_each_protocol(tmp_path_factory):
    got = _mypy(tmp_path_factory.getbasetemp() / "mypy")
    assert got.returncode == 0, got.stdout + got.stderr


def test_an_adapter_that_stops_matching_its_protocol_fails(tmp_path_factory):
    """A torch adapter whose store lost ``donate`` and whose compiler part is gone: mypy names
    both protocols it no longer is."""
    drifted = tmp_path_factory.mktemp("drifted") / "drifted.py"
    drifted.write_text(
        "from typing import Any\n"
        "from cacheidx.backends.protocols import Arrays, Compiling\n"
        "from cacheidx.backends.torch import TorchArrays, TorchLibrary\n"
        "class Drifted(TorchLibrary, TorchArrays):\n"
        "    def store(self, pool: Any, plan: Any, rows: Any) -> Any:  # type: ignore[override]\n"
        "        return pool\n"
        "def arrays(b: Drifted) -> Arrays:\n"
        "    return b\n"
        "def compiling(b: Drifted) -> Compiling:\n"
        "    return b\n")
    got = _mypy(tmp_path_factory.getbasetemp() / "mypy", str(drifted))
    assert got.returncode == 1, got.stdout + got.stderr
    assert 'expected "Arrays"' in got.stdout and 'expected "Compiling"' in got.stdout, got.stdout
