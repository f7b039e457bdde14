"""``python -m cacheidx.prefix PROMPTS.jsonl --page-size 16``: plan a file of prompts and print
the report, and the tree when there are few prompts.

Each line of the file is one prompt: a JSON list of token ids, or an object holding one under
``"tokens"``, ``"prompt_ids"`` or ``"input_ids"``. Blank lines are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys

from .plan import Plan, plan
from .report import report

_KEYS = ("tokens", "prompt_ids", "input_ids")


def read_prompts(path: str) -> list[list[int]]:
    """The prompts of a JSONL file; ``ValueError`` naming the file and the line (counted
    from 1) for one that is no prompt: not UTF-8, not JSON, no list of token ids, an empty
    list, or an id that is no integer from 0 to 2**63 - 1."""
    prompts = []
    with open(path, "rb") as f:
        data = f.read()
    for n, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON ({getattr(e, 'msg', e)} at column "
                             f"{getattr(e, 'colno', '?')})") from None
        if isinstance(item, dict):
            item = next((item[k] for k in _KEYS if k in item), None)
        if not isinstance(item, list):
            raise ValueError(
                f"{path}:{n}: expected a list of token ids or an object with one of {_KEYS}"
            )
        if not item:
            raise ValueError(f"{path}:{n}: the prompt is empty")
        for k, t in enumerate(item):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 63:
                raise ValueError(f"{path}:{n}: token {k} must be an integer from 0 to 2**63 - 1, "
                                 f"got {json.dumps(t)[:40]}")
        prompts.append(item)
    return prompts


def tree(p: Plan, prompts=None, *, shown: int = 8) -> str:
    """The plan as a tree, one line per prompt in order: its id, its first ``shown`` tokens
    (its length without ``prompts``) and what it shares. Sorted order is a depth-first walk,
    so each line only needs to know which of its ancestors still have children to come."""
    n = len(p)
    at = {int(i): k for k, i in enumerate(p.order)}
    up = [at[int(q)] if q >= 0 else -1 for q in p.parent]
    last = [True] * n  # whether a prompt is its parent's last child
    seen: dict[int, int] = {}
    for k in range(n - 1, -1, -1):
        last[k] = up[k] not in seen
        seen.setdefault(up[k], k)
    lines = []
    for k in range(n):
        chain, a = [], up[k]
        while a >= 0:  # the rails of the ancestors, innermost first
            chain.append("    " if last[a] else "│   ")
            a = up[a]
        rails = "".join(reversed(chain[:-1])) if chain else ""
        branch = ("└── " if last[k] else "├── ") if up[k] >= 0 else ""
        i = int(p.order[k])
        text = _tokens(prompts[i], shown) if prompts is not None else f"{int(p.lengths[k])} tokens"
        share = f"shares {int(p.shared[k])} from {int(p.parent[k])}" if up[k] >= 0 else "root"
        lines.append(f"{rails}{branch}{i} {text}  ({share})")
    return "\n".join(lines)


def _tokens(t, shown: int) -> str:
    head = " ".join(str(x) for x in t[:shown])
    return f"[{head}]" if len(t) <= shown else f"[{head} …] ({len(t)} tokens)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cacheidx.prefix", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit status: 0 planned; 2 bad usage (a bad option, a file that cannot be read, "
        "a line that is no prompt, named as FILE:LINE counting from 1)")
    parser.add_argument("prompts", help="a JSONL file, one prompt a line")
    parser.add_argument("--page-size", type=int, default=16, help="tokens a page (16)")
    parser.add_argument("--dedupe", action="store_true", help="exact copies compute nothing")
    parser.add_argument(
        "--tree",
        type=int,
        default=64,
        metavar="N",
        help="print the tree for at most N prompts (64; 0: never)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        prompts = read_prompts(args.prompts)
        p = plan(prompts, args.page_size, dedupe=args.dedupe)
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    r = report(p)
    if args.json:
        print(json.dumps(r.as_dict()))
        return 0
    print(r.to_markdown())
    if 0 < len(p) <= args.tree:
        print()
        print(tree(p, prompts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
