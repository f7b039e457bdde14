"""``python -m cacheidx.conformance``: the law suite on every backend, device and mode here."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from .. import _arguments as arguments
from .. import backends
from .runner import DeviceMissing, machine, run, table
from .suite import MODES


def _writable(path: str) -> str | None:
    """Why the report cannot be written at ``path``, or ``None``: checked before the suite
    runs, so that a long run never ends in a report that cannot be kept."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a folder"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{path} is not writable"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cacheidx.conformance",
                                     description=__doc__,
                                     epilog="Exit status: 0 every law passed, 1 some law failed "
                                     "or no backend ran, 2 bad usage (an unknown backend, an "
                                     "absent device, a report that cannot be written, a bad "
                                     "option).")
    parser.add_argument("--backend", action="append", help="run only this backend (repeatable)")
    parser.add_argument("--device", help="run only this device: cpu, gpu, cuda, cuda:N, gpu:N "
                        "(the same names for every backend; gpu and cuda are the first GPU)")
    parser.add_argument("--mode", action="append", choices=MODES,
                        help="run only this mode (repeatable; default: every mode a backend has)")
    parser.add_argument("--precision", default="highest", choices=["highest", "default", "tf32"],
                        help="the model laws' matrix products: the library's highest precision "
                        "(default), its defaults on the device with the tolerance they allow, "
                        "or TF32 emulated by rounding (see docs/conformance.md)")
    parser.add_argument("--json", metavar="PATH", help="write the full report here")
    parser.add_argument("--torch-compiler", default=None,
                        help="torch.compile backend for every compiled mode (default: aot_eager "
                        "for compiled, eager for dynamic and automatic; inductor generates "
                        "real kernels, ~15 s a program on two cores)")
    parser.add_argument("--jobs", type=arguments.positive_arg, default=None,
                        help="worker processes at once (default: one per core; 1 runs here)")
    parser.add_argument("--failures", action="store_true", help="print each failing law")
    args = parser.parse_args(argv)
    unknown = [b for b in args.backend or [] if b not in backends.names()]
    if unknown:
        parser.error(f"argument --backend: no backend named {unknown[0]!r}; registered: "
                     f"{', '.join(backends.names())}")
    if args.json and (why := _writable(args.json)):
        parser.error(f"argument --json: {why}")
    start = time.perf_counter()
    try:
        report = run(args.backend, args.device, modes=args.mode, precision=args.precision,
                     torch_compiler=args.torch_compiler, workers=args.jobs)
    except (DeviceMissing, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    wall = round(time.perf_counter() - start, 2)
    print(table(report))
    failed = [e for e in report if e["status"] == "FAIL" or e["status"].startswith("broken")]
    for e in failed if (args.failures or failed) else []:
        if "error" in e:
            print(f"\n{e['backend']}/{e['device']}: {e['error']}")
        for name, outcome in e.get("laws", {}).items():
            if outcome != "pass":
                print(f"\n{e['backend']}/{e['device']} {name}:\n{outcome}")
    if args.json:
        full = {"date": datetime.date.today().isoformat(), "machine": machine(),
                "wall_seconds": wall, "report": report}
        try:
            with open(args.json, "w") as f:
                json.dump(full, f, indent=2, default=str)
        except OSError as e:  # gone since the start: the report goes to stdout, not lost
            print(f"cacheidx.conformance: cannot write {args.json} ({e}); the report follows",
                  file=sys.stderr)
            print(json.dumps(full, indent=2, default=str))
            return 2
    if failed:
        return 1
    if not any(e["status"] == "pass" for e in report):
        print("no backend ran", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
