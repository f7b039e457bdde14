"""Prefix-shared batch prefill from a plan: prompts that start alike compute their common pages
once and read them from the pages of the prompt that did.

``cacheidx.prefix.plan`` sorts the prompts and says what each reuses (SGLang's radix tree and
vLLM's prefix caching, planned offline for a known batch). A prompt's table names its
ancestors' pages for the shared columns and its own after them. Prompts run in waves, one call
each: wave d holds the prompts at depth d of the plan's tree, every lane computing only its
unshared suffix (positions ``shared`` to ``len - 1``) at its own columns, while reading the
shared ones. The waves come from ``cacheidx.prefix.schedule`` when it is installed (or are
built here from ``plan.tables()`` with ``--no-schedule``).

Checks: every prompt's last logits equal the prompt alone; the waves compute exactly the
plan's tokens, fewer than the prompts hold; greedy decoding from the shared cache equals
decoding each prompt alone.

    python examples/prefix_prefill.py --backend numpy|torch|jax [--no-schedule]
"""

from __future__ import annotations

import importlib

import numpy as np
from _common import Checks, Env, greedy_alone, paged_slots, parser

import cacheidx as ci
from cacheidx import prefix

PAGE = 4


def prompts_of(env: Env) -> list[list[int]]:
    """Two system prompts, several questions each, one exact copy and one loner."""
    a, b = env.prompt(9), env.prompt(6)
    qs = [a + env.prompt(3), a + env.prompt(5), a + env.prompt(2), b + env.prompt(4),
          b + env.prompt(4)[:2], env.prompt(7)]
    return qs + [list(qs[1])]


def waves_from_tables(plan, prompts, width: int, extra: int):
    """(table of slots by order row, waves): each wave a list of (row in order, prompt id)."""
    n = len(plan)
    table = paged_slots(plan.tables(), PAGE, width)
    # decoding room: a fresh slot for every column past each prompt's length
    fresh = plan.pages * PAGE
    for i in range(n):
        L = int(plan.lengths[i])
        table[i, L:L + extra] = np.arange(fresh, fresh + extra)
        fresh += extra
    depth = {}
    for i in range(n):
        p, parent = int(plan.order[i]), int(plan.parent[i])
        depth[p] = 0 if parent < 0 else depth[parent] + 1
    waves = [[(i, int(plan.order[i])) for i in range(n) if depth[int(plan.order[i])] == d]
             for d in range(max(depth.values()) + 1)]
    return table, waves, fresh


def main(argv=None) -> Checks:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=3, help="tokens decoded after the prefill")
    p.add_argument("--no-schedule", dest="schedule", action="store_false",
                   help="build the waves from plan.tables() instead of cacheidx.prefix.schedule")
    args = p.parse_args(argv)
    env = Env(args.backend, seed=args.seed)
    try:  # the module, not the function cacheidx.prefix may export under the same name
        sched = importlib.import_module("cacheidx.prefix.schedule")
    except ImportError:
        sched = None
    use = args.schedule and sched is not None
    checks = Checks(f"prefix-shared prefill from a plan, waves from "
                    f"{'cacheidx.prefix.schedule' if use else 'plan.tables()'} ({args.backend})")
    prompts = prompts_of(env)
    n = len(prompts)
    plan = prefix.plan(prompts, PAGE)
    print(f"  order {plan.order.tolist()}, shared {plan.shared.tolist()}, "
          f"parent {plan.parent.tolist()}")
    last = np.zeros((n, env.cfg.vocab), np.float32)
    computed = 0
    if use:
        s = sched.schedule(plan, max_new_tokens=args.steps)
        pools = env.pools(s.slots)
        outs = []
        for w, wave in enumerate(s.waves):
            logits, pools = env.forward(wave.tokens(prompts), wave.index(xp=args.backend), pools,
                                        last=True)
            outs.append(logits)
            computed += int((wave.positions >= 0).sum())
            print(f"  wave {w}: prompts {wave.prompts.tolist()}, computing positions "
                  f"{wave.start.tolist()}.. of {wave.stop.tolist()}")
        last = np.asarray(s.last(outs))
        step = s.decode_index(xp=args.backend)
    else:
        width = int(plan.lengths.max()) + args.steps
        table, waves, slots = waves_from_tables(plan, prompts, width, args.steps)
        pools = env.pools(slots)
        for w, wave in enumerate(waves):
            rows = np.array([i for i, _ in wave])
            start, stop = plan.shared[rows], plan.lengths[rows]
            seq = int((stop - start).max())
            pos = stop[:, None] + np.arange(seq)[None, :] - seq
            pos = np.where(pos >= start[:, None], pos, -1)  # left padded
            ids = np.zeros((len(wave), seq), np.int64)
            for b, (_, pid) in enumerate(wave):
                ids[b, seq - (stop[b] - start[b]):] = prompts[pid][start[b]:]
            index = ci.make(env.ints(pos), env.ints(table), row=env.ints(rows))
            logits, pools = env.forward(ids, index, pools, last=True)
            for b, (_, pid) in enumerate(wave):
                last[pid] = logits[b, -1]
            computed += int((pos >= 0).sum())
            print(f"  wave {w}: prompts {[pid for _, pid in wave]}, computing positions "
                  f"{start.tolist()}.. of {stop.tolist()}")
        by_id = np.empty_like(table)
        by_id[plan.order] = table
        lens = np.array([len(q) for q in prompts])
        step = ci.make(env.ints(lens[:, None] - 1), env.ints(by_id))

    for pid, q in enumerate(prompts):
        checks.close(f"prompt {pid} ({len(q)} tokens): last logits equal the prompt alone",
                     last[pid], env.alone(q)[-1])
    total = sum(len(q) for q in prompts)
    checks.equal("the waves compute the plan's tokens", computed, int(plan.computed.sum()))
    checks.check(f"fewer than the prompts hold ({total})", computed < total,
                 f"{computed} of {total}")

    out = [[int(np.argmax(last[pid]))] for pid in range(n)]
    for _ in range(args.steps - 1):
        step = step.advance()  # every prompt's next token at its own column
        logits, pools = env.forward(np.array([o[-1] for o in out])[:, None], step, pools)
        for pid in range(n):
            out[pid].append(int(np.argmax(logits[pid, 0])))
    for pid, q in enumerate(prompts):
        checks.equal(f"prompt {pid}: decoding from the shared cache equals decoding it alone",
                     out[pid], greedy_alone(env, q, args.steps)[0])
    checks.note("computed", computed)
    return checks.done()


if __name__ == "__main__":
    main()
