"""Benchmark of the prefix planner on the shared-prefix workload of serving benchmarks.

Groups of prompts share a system prompt, then each asks a distinct question (by default 64
groups x 16 prompts, 2,048-token system prompts, 128-token questions). One run reports:

* planning time for 100,000 such prompts (``--many``);
* for the default 1,024 prompts, the plan's time against a plain Python token trie finding
  the same order, sharing and parents (checked equal);
* tokens computed planned, each prompt alone and at the page-rounded minimum, with pages at
  peak under both strategies;
* on a many-samples workload (every prompt repeated ``--per-group`` times), what
  ``dedupe=True`` saves.

Usage: ``python benchmarks/prefix.py [--random-lengths] [--json PATH]``; prints a Markdown
table.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from cacheidx import prefix


def workload(
    groups, per_group, system, question, *, vocab=32_000, random_lengths=False, seed=0, limit=None
):
    """Prompts (int32 arrays, shuffled): ``groups`` system prompts, each followed by
    ``per_group`` distinct questions. With ``random_lengths``, each system prompt's and each
    question's length is uniform in [half, 1.5 x] of the given one. ``limit`` keeps the first
    ``limit`` prompts before shuffling."""
    rng = np.random.default_rng(seed)
    n = groups * per_group if limit is None else min(limit, groups * per_group)
    group = np.arange(n) // per_group
    sys_len = np.full(groups, system)
    q_len = np.full(n, question)
    if random_lengths:
        sys_len = rng.integers(system // 2, system * 3 // 2 + 1, groups)
        q_len = rng.integers(max(1, question // 2), question * 3 // 2 + 1, n)
    systems = rng.integers(0, vocab, (groups, int(sys_len.max())), dtype=np.int32)
    questions = rng.integers(0, vocab, (n, int(q_len.max())), dtype=np.int32)
    prompts = [
        np.concatenate([systems[g, : sys_len[g]], questions[r, : q_len[r]]])
        for r, g in enumerate(group)
    ]
    return [prompts[r] for r in rng.permutation(n)]


def trie_plan(prompts, page_size):
    """The plan found the plain way: a trie of dicts, one node per token, walked depth-first
    with a prompt before its extensions and children by token. Returns order, shared, parent."""
    root, end = {}, -1  # tokens are >= 0, so -1 marks the prompts ending at a node
    for i, t in enumerate(prompts):
        node = root
        for x in t.tolist():
            node = node.setdefault(x, {})
        node.setdefault(end, []).append(i)
    order, lcp = [], []
    stack, low = [(root, 0)], 1  # low: the shallowest depth visited since the last prompt
    while stack:
        node, depth = stack.pop()
        low = min(low, depth)
        for i in node.get(end, ()):
            order.append(i)
            lcp.append(max(low - 1, 0))
            low = depth + 1
        stack.extend((node[x], depth + 1) for x in sorted(node, reverse=True) if x != end)
    shared = [min(c, len(prompts[i]) - 1) // page_size * page_size for c, i in zip(lcp, order)]
    parent, above = [], []  # above: positions of a strictly increasing run of shared
    for k, s in enumerate(shared):
        while above and shared[above[-1]] >= s:
            above.pop()
        parent.append(order[above[-1]] if above else -1)
        above.append(k)
    return order, shared, parent


def timed(fn, *args, repeat=1, **kwargs):
    """The best of ``repeat`` wall times in seconds, and the last result."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best, out


def run(args) -> dict:
    shape = dict(
        system=args.system,
        question=args.question,
        vocab=args.vocab,
        random_lengths=args.random_lengths,
        seed=args.seed,
    )
    P = args.page_size
    out = {"config": vars(args).copy()}
    out["config"].pop("json", None)

    many = workload(-(-args.many // args.per_group), args.per_group, limit=args.many, **shape)
    out["many_prompts"] = len(many)
    out["many_tokens"] = int(sum(map(len, many)))
    out["many_plan_s"], _ = timed(prefix.plan, many, P)
    del many

    prompts = workload(args.groups, args.per_group, **shape)
    out["plan_s"], p = timed(prefix.plan, prompts, P, repeat=3)
    out["trie_s"], want = timed(trie_plan, prompts, P)
    out["trie_agrees"] = [p.order.tolist(), p.shared.tolist(), p.parent.tolist()] == list(want)
    out["report"] = prefix.report(p).as_dict()

    copies = workload(args.groups, 1, **shape)
    samples = [t for t in copies for _ in range(args.per_group)]
    out["samples_report"] = prefix.report(prefix.plan(samples, P, dedupe=True)).as_dict()
    return out


def table(out: dict) -> str:
    r, s, c = out["report"], out["samples_report"], out["config"]
    n = r["prompts"]
    rows = [
        (
            f"plan {out['many_prompts']:,} prompts ({out['many_tokens']:,} tokens)",
            f"{out['many_plan_s']:.2f} s",
        ),
        (f"plan {n:,} prompts", f"{out['plan_s'] * 1e3:.1f} ms"),
        (
            f"Python token trie, {n:,} prompts",
            f"{out['trie_s'] * 1e3:.0f} ms ({out['trie_s'] / out['plan_s']:.0f}x the plan; "
            f"{'same' if out['trie_agrees'] else 'DIFFERENT'} plan)",
        ),
        ("tokens, each prompt alone", f"{r['tokens']:,}"),
        ("tokens, planned", f"{r['computed']:,} ({r['computed'] / r['tokens']:.1%})"),
        (
            "tokens, page-rounded minimum",
            f"{r['minimum']:,} (planned / minimum = {r['computed'] / r['minimum']:.3f})",
        ),
        ("pages alone / planned", f"{r['pages_alone']:,} / {r['pages']:,}"),
        ("pages at peak, keep / count", f"{r['peak_keep']:,} / {r['peak_count']:,}"),
        (
            f"samples: {s['distinct']} prompts x {c['per_group']}, tokens planned with dedupe",
            f"{s['computed']:,} (saves {s['dedupe_saves']:,} of "
            f"{s['computed'] + s['dedupe_saves']:,})",
        ),
    ]
    head = (
        f"Workload: {c['groups']} groups x {c['per_group']} prompts, {c['system']}-token "
        f"system prompts, {c['question']}-token questions"
        f"{' (random lengths)' if c['random_lengths'] else ''}, page size {c['page_size']}."
    )
    return "\n".join(
        [head, "", "| measure | value |", "|---|---:|"] + [f"| {a} | {b} |" for a, b in rows]
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--system", type=int, default=2048, help="system prompt tokens")
    parser.add_argument("--question", type=int, default=128, help="question tokens")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--many", type=int, default=100_000, help="prompts for the planning time")
    parser.add_argument("--random-lengths", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    out = run(args)
    print(table(out))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
