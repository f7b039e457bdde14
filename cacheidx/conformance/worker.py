"""Jobs of the law suite in a process of their own: ``python -m cacheidx.conformance.worker``
reads one JSON job a line on its standard input (the backend, device and modes it names, see
:func:`cacheidx.conformance.runner.run_job`; or ``{"devices": name}``, the backend's devices)
and writes each job's report as one JSON line after
:data:`~cacheidx.conformance.runner.REPORT`, till its input closes; ``worker SPEC`` runs the
one job ``SPEC``."""

from __future__ import annotations

import json
import sys

from .runner import REPORT, labels, run_job


def _run(spec: dict) -> str:
    if "devices" in spec:  # a scout's question: which devices the backend has here
        try:
            return REPORT + json.dumps({"devices": labels(spec["devices"])})
        except Exception as e:  # the library fails to start: the main process says so
            return REPORT + json.dumps({"error": f"{type(e).__name__}: {e}"})
    job = run_job(spec["backend"], spec["device"], spec["modes"], family=spec.get("family"),
                  precision=spec.get("precision", "highest"),
                  torch_compiler=spec.get("torch_compiler"))
    return REPORT + json.dumps(job, default=str)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for line in args or sys.stdin:
        if line.strip():
            print(_run(json.loads(line)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
