"""``python -m cacheidx.conformance``: the law suite on every backend and device here."""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from .runner import machine, run, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cacheidx.conformance",
                                     description=__doc__)
    parser.add_argument("--backend", action="append", help="run only this backend (repeatable)")
    parser.add_argument("--device", help="run only devices whose name starts with this "
                        "(cpu, cuda, cuda:1, gpu)")
    parser.add_argument("--json", metavar="PATH", help="write the full report here")
    parser.add_argument("--torch-compiler", default="aot_eager",
                        help="torch.compile backend for the compiled laws (default aot_eager; "
                        "inductor generates real kernels, ~15 s a law on two cores)")
    parser.add_argument("--failures", action="store_true", help="print each failing law")
    args = parser.parse_args(argv)
    report = run(args.backend, args.device, torch_compiler=args.torch_compiler)
    print(table(report))
    failed = [e for e in report if e["status"] in ("FAIL",) or e["status"].startswith("broken")]
    if args.failures or failed:
        for e in failed:
            for name, outcome in e.get("laws", {}).items():
                if outcome != "pass":
                    print(f"\n{e['backend']}/{e['device']} {name}:\n{outcome}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "machine": machine(),
                       "report": report}, f, indent=2, default=str)
    if not any(e["status"] == "pass" for e in report):
        print("no backend ran", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
