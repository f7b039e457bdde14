"""One job of the law suite in a process of its own: ``python -m cacheidx.conformance.worker
SPEC`` runs the backend, device and modes that the JSON ``SPEC`` names and prints the job's
report as one JSON line (see :func:`cacheidx.conformance.runner.run_job`)."""

from __future__ import annotations

import json
import sys

from .runner import run_job


def main(argv: list[str] | None = None) -> int:
    spec = json.loads((argv or sys.argv[1:])[0])
    job = run_job(spec["backend"], spec["device"], spec["modes"], family=spec.get("family"),
                  precision=spec.get("precision", "highest"),
                  torch_compiler=spec.get("torch_compiler"))
    print(json.dumps(job, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
