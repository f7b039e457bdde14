"""Run the law suite on every backend and device of this machine, eager and compiled."""

from __future__ import annotations

import platform
import sys
import time
import traceback
import warnings
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from .. import backends
from .suite import LAWS, Case, Law

__all__ = ["targets", "run_one", "run", "table"]

_DIST = {"numpy": "numpy", "strict": "array-api-strict", "torch": "torch", "jax": "jax",
         "cupy": "cupy-cuda12x"}


def _version(name: str) -> str | None:
    try:
        return version(_DIST.get(name, name))
    except PackageNotFoundError:
        return None


def _device_name(device: Any) -> str:
    text = str(device).lower()
    if "cpu" in text:
        return "cpu"
    return text.replace("cudadevice(id=", "gpu:").rstrip(")")


def targets(names: list[str] | None = None, device: str | None = None) -> list[dict]:
    """Every (backend, device) to run, with the reason where one cannot run."""
    out = []
    for name in names or backends.names():
        try:
            cls = backends._class(name)
        except Exception as e:  # a third-party entry point that fails to load
            out.append({"backend": name, "device": "-", "status": f"broken: {e}"})
            continue
        ok, why = cls.usable()
        if not ok:
            out.append({"backend": name, "device": "cuda" if name == "cupy" else "-",
                        "status": f"no device: {why}" if name == "cupy" else f"skipped: {why}"})
            continue
        backend = backends.get(name)
        found = backend.devices()
        if name in ("torch", "jax") and not any(
                _device_name(d).startswith(("cuda", "gpu")) for d in found):
            out.append({"backend": name, "device": "cuda" if name == "torch" else "gpu",
                        "status": "no device: no CUDA device visible to " + name})
        for d in found:
            label = _device_name(d)
            if device is None or label == device or label.startswith(device):
                out.append({"backend": name, "device": label, "status": "run", "_device": d})
    return out


def run_one(law: Law, backend: backends.Backend, device: Any, compiled: bool,
            facts: dict | None = None) -> str | None:
    """The failure of ``law`` in this case as text, ``None`` when it holds; what the law
    measured goes into ``facts``."""
    if compiled:
        backend.forget()
    case = Case(backend, device, compiled)
    try:
        with warnings.catch_warnings():
            # dynamo notes each lru_cache it traces through inside array-api-compat
            warnings.filterwarnings("ignore", message=".*lru_cache.*")
            law(case)
    except Exception:
        return traceback.format_exc(limit=-3)
    finally:
        if facts is not None:
            facts.update(case.facts)
    return None


def run(names: list[str] | None = None, device: str | None = None, *,
        torch_compiler: str = "aot_eager", progress: Any = sys.stderr) -> list[dict]:
    """The report: one entry per backend and device. ``torch_compiler`` is the backend
    ``torch.compile`` runs the compiled laws with (``inductor`` generates real kernels and
    takes about 15 s a law on two cores)."""
    report = []
    for target in targets(names, device):
        entry = {k: v for k, v in target.items() if not k.startswith("_")}
        entry["version"] = _version(target["backend"])
        if target["status"] != "run":
            report.append(entry)
            continue
        backend = backends.get(target["backend"])
        if hasattr(backend, "compiler"):
            backend.compiler = torch_compiler
        modes = [False, True] if backend.compiles else [False]
        entry.update(compiler=getattr(backend, "compiler", "jit") if backend.compiles
                     else "none (eager only)", laws={}, passed=0, failed=0)
        facts: dict = {}
        start = time.perf_counter()
        if progress:
            print(f"{backend.name}/{entry['device']}: ", end="", file=progress, flush=True)
        for law in LAWS:
            for compiled in modes:
                if not law.runs(compiled):
                    continue
                key = f"{law.name}[{'compiled' if compiled else 'eager'}]"
                failure = run_one(law, backend, target["_device"], compiled, facts)
                entry["laws"][key] = "pass" if failure is None else failure
                entry["passed" if failure is None else "failed"] += 1
                if progress:
                    print("." if failure is None else "F", end="", file=progress, flush=True)
        entry["seconds"] = round(time.perf_counter() - start, 2)
        compiled_laws = [k for k in entry["laws"] if k.endswith("[compiled]")]
        entry["eager_equals_compiled"] = (all(entry["laws"][k] == "pass" for k in compiled_laws)
                                          if compiled_laws else "no compiler")
        entry.update(facts)
        entry["status"] = "pass" if entry["failed"] == 0 else "FAIL"
        if progress:
            print(f" {entry['status']} ({entry['seconds']} s)", file=progress, flush=True)
        report.append(entry)
    return report


def table(report: list[dict]) -> str:
    """The report as a Markdown table, one row per backend and device."""
    lines = ["| backend | device | version | compiler | laws passed | failed | eager = compiled "
             "| donated in place | programs for 4 allocations | time (s) | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in report:
        cells = [e["backend"], e["device"], e.get("version") or "-", e.get("compiler", "-"),
                 e.get("passed", "-"), e.get("failed", "-"), e.get("eager_equals_compiled", "-"),
                 e.get("donation in place", "-"), e.get("programs for 4 allocations", "-"),
                 e.get("seconds", "-"), e["status"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def machine() -> dict:
    return {"python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.machine(), "cacheidx": _version("cacheidx")}
