"""How long the law suite takes: the default `python -m cacheidx.conformance` (every backend
installed, every device, every default mode), end to end, per backend and mode; with `--pytest`
also the whole test suite (README's command: `python -m pytest -q -n auto --dist loadfile`).
Each runs in a fresh process, as a user runs it.

    python benchmarks/conformance.py [--json PATH] [--pytest] [--docs]

`--docs` writes the tables into docs/conformance.md between its `<!-- timings -->` markers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - start, done


def conformance() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "report.json"
        wall, done = timed([sys.executable, "-m", "cacheidx.conformance", "--json", str(path)])
        report = json.loads(path.read_text()) if path.exists() else {"report": []}
    rows = []
    for e in report["report"]:
        for mode, m in e.get("modes", {}).items():
            rows.append({"backend": e["backend"], "device": e["device"], "mode": mode,
                         "compiler": m["compiler"], "seconds": m["seconds"],
                         "cpu_seconds": m["cpu_seconds"],
                         "laws": sum(1 for k in e["laws"] if k.endswith(f"[{mode}]")),
                         "failed": sum(1 for k, v in e["laws"].items()
                                       if k.endswith(f"[{mode}]") and v != "pass")})
    return {"wall_seconds": round(wall, 1), "exit": done.returncode, "rows": rows,
            "status": {f"{e['backend']}/{e['device']}": e["status"] for e in report["report"]}}


#: the README's test command (its files over the cores)
PYTEST = ["-m", "pytest", "-q", "-n", "auto", "--dist", "loadfile"]


def pytest_run() -> dict:
    wall, done = timed([sys.executable, *PYTEST, "-p", "no:cacheprovider"])
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return {"wall_seconds": round(wall, 1), "exit": done.returncode, "summary": last}


def tables(figures: dict) -> str:
    c = figures["conformance"]
    lines = [f"`python -m cacheidx.conformance` on {figures['machine']}, {figures['date']}: "
             f"**{c['wall_seconds']} s** end to end (exit {c['exit']}), its jobs in "
             f"{os.cpu_count()} worker processes at once.", "",
             "| backend | device | mode (compiler) | laws | failed | time (s) | CPU time (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in c["rows"]:
        compiler = f" ({r['compiler']})" if r["compiler"] != "none" else ""
        lines.append(f"| {r['backend']} | {r['device']} | {r['mode']}{compiler} | {r['laws']} "
                     f"| {r['failed']} | {r['seconds']} | {r['cpu_seconds']} |")
    if "pytest" in figures:
        p = figures["pytest"]
        lines += ["", f"`python {' '.join(PYTEST)}`, same machine and run: "
                  f"**{p['wall_seconds']} s** "
                  f"(exit {p['exit']}): {p['summary']}"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--pytest", action="store_true", help="time the test suite too")
    parser.add_argument("--docs", action="store_true", help="write docs/conformance.md")
    parser.add_argument("--quick", action="store_true", help="accepted, and ignored: the "
                        "suite has one size")
    args = parser.parse_args()
    figures = {"date": datetime.date.today().isoformat(),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
                          f"{platform.python_version()}",
               "conformance": conformance()}
    if args.pytest:
        figures["pytest"] = pytest_run()
    text = tables(figures)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    if args.docs:
        page = ROOT / "docs" / "conformance.md"
        old = page.read_text()
        new = re.sub(r"<!-- timings -->.*<!-- /timings -->",
                     lambda _: f"<!-- timings -->\n{text}\n<!-- /timings -->", old, flags=re.S)
        page.write_text(new)
    return figures["conformance"]["exit"]


if __name__ == "__main__":
    sys.exit(main())
