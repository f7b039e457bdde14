"""Serve a batch of chat prompts with SmolLM2-135M-Instruct through cacheidx.

    python -m cacheidx.demo [--backend NAME] [--prompt TEXT ...] [--max-new-tokens N]
                            [--page-size P] [--chunk C] [--eager] [--json]

The prompts share the model's system prompt. ``cacheidx.prefix.plan`` sorts them and says how
many tokens each reuses from which parent; each prompt's table names its parent's pages for
those tokens and fresh pages for the rest (and for its answer). Prefill runs in waves, one call
per depth of the plan's tree (a parent's pages are written before its children read them),
each lane computing only the tokens past what it shares; then every prompt decodes greedily,
one token per lane per call, with ``index.advance()``. The model
(:mod:`cacheidx.models.llama`) sees only the index: the pages, the sharing and the padding are
all values of it.

:func:`serve` is the engine, used by the tests and ``benchmarks/decode.py`` as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

import cacheidx as ci

from .models import llama

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "What is the capital of Japan?",
]
EOS = 2  # <|im_end|>, SmolLM2's end of a turn


@dataclasses.dataclass
class Served:
    """What :func:`serve` did: per prompt (in the order given) its ids, generated tokens and the
    logits that chose its last token; and the figures."""

    prompt_ids: list[list[int]]
    tokens: list[list[int]]
    last_logits: list[np.ndarray]
    computed: int  #: prompt tokens computed in prefill
    unshared: int  #: prompt tokens a prefill without sharing computes
    pages: int  #: pages used (prompt and answer room)
    pages_unshared: int  #: pages used without sharing
    page_size: int
    waves: int
    prefill_s: float  #: prefill, compiling included where the backend compiles
    warmup_s: float  #: the first decode step, compiling included
    decode_s: float  #: the decode steps after the first
    decode_steps: int  #: decode steps after the first
    backend: str
    compiled: bool

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens computed per second in decode after the first step: one per lane per step."""
        lanes = len(self.prompt_ids)
        return lanes * self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")

    def figures(self) -> dict:
        return {
            "backend": self.backend,
            "compiled": self.compiled,
            "prompts": len(self.prompt_ids),
            "page_size": self.page_size,
            "prefill_waves": self.waves,
            "prefill_tokens_computed": self.computed,
            "prefill_tokens_without_sharing": self.unshared,
            "pages_used": self.pages,
            "pages_without_sharing": self.pages_unshared,
            "prefill_seconds": round(self.prefill_s, 3),
            "first_decode_step_seconds": round(self.warmup_s, 3),
            "decode_steps": self.decode_steps,
            "decode_seconds": round(self.decode_s, 3),
            "decode_tokens_per_second": round(self.decode_tokens_per_s, 1),
        }


def _quiet(*_args) -> None:
    pass


def _host(x) -> np.ndarray:
    """A small array as NumPy, from any backend."""
    if hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        return x.get()
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _plan(prompts, page_size: int, share: bool):
    """``(order, shared, parent)`` as NumPy int arrays aligned with order."""
    n = len(prompts)
    if not share:
        return np.arange(n), np.zeros(n, dtype=np.int64), np.full(n, -1)
    from . import prefix

    p = prefix.plan(prompts, page_size)
    return np.asarray(p.order), np.asarray(p.shared), np.asarray(p.parent)


def _pages(prompts, order, shared, parent, page_size: int, room: int):
    """Each prompt's list of pages: its parent's for the shared tokens, then fresh pages for its
    own tokens and ``room`` more positions. Returns ``(pages per prompt, pages used)``."""
    pages: dict[int, list[int]] = {}
    fresh = 0
    for p, s, par in zip(order.tolist(), shared.tolist(), parent.tolist(), strict=True):
        borrowed = pages[par][: s // page_size] if par >= 0 else []
        need = -(-(len(prompts[p]) + room) // page_size) - len(borrowed)
        pages[p] = borrowed + list(range(fresh, fresh + need))
        fresh += need
    return [pages[p] for p in range(len(prompts))], fresh


def _table(pages: list[list[int]], page_size: int) -> np.ndarray:
    """Slot of each position of each prompt: page ``k`` holds positions ``k*P`` to ``k*P+P-1``
    at slots ``page*P`` on; -1 past a prompt's pages."""
    context = max(len(p) for p in pages) * page_size
    table = np.full((len(pages), context), -1, dtype=np.int64)
    offsets = np.arange(page_size)
    for r, ps in enumerate(pages):
        if ps:
            table[r, : len(ps) * page_size] = (np.asarray(ps)[:, None] * page_size
                                               + offsets).reshape(-1)
    return table


def _depths(order, parent) -> dict[int, int]:
    depth: dict[int, int] = {}
    for p, par in zip(order.tolist(), parent.tolist(), strict=True):
        depth[p] = 0 if par < 0 else depth[par] + 1
    return depth


def serve(
    params,
    config: llama.Config,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 16,
    page_size: int = 16,
    backend: str = "numpy",
    compile: bool = False,
    share: bool = True,
    chunk: int | None = None,
    stop: bool = True,
    eos: int = EOS,
    progress: Callable[[str], None] = _quiet,
) -> Served:
    """Greedy answers to ``prompts`` (lists of token ids), served through paged pools.

    ``params`` are NumPy arrays (``cacheidx.models.gguf.load``); they are converted to
    ``backend``'s namespace. ``compile`` wraps the step in the backend's ``jit`` (``jax.jit``,
    ``torch.compile``; eager where the backend has no compiler). ``share=False`` computes
    every prompt whole, with no prefix planning; ``chunk`` splits each prefill wave into calls
    of at most ``chunk`` tokens per lane. Compiled, every prefill call has one shape, all
    prompts' lanes (those not in the wave are padding) of ``chunk`` tokens (16 by default), so
    one program serves every prefill call and one every decode step: positions, tables and
    rows are values of the index. With ``stop`` a prompt's answer ends at ``eos`` (kept) and
    decoding ends once every answer has; without it every prompt gets ``max_new_tokens``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"cacheidx.demo.serve: max_new_tokens must be positive, got "
                         f"{max_new_tokens}")
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("cacheidx.demo.serve: every prompt needs at least one token")
    be = ci.backends.get(backend)
    xp = be.xp
    compile = bool(compile)
    if compile and chunk is None:
        chunk = 16
    info = getattr(xp, "__array_namespace_info__", None)
    int_dtype = info().default_dtypes()["integral"] if info else xp.int64

    def ints(a):
        return xp.asarray(np.asarray(a), dtype=int_dtype)

    weights = llama.convert(params, xp=xp)
    donate = True  # the engine owns its pools

    def step(weights, tokens, index, pools):
        return llama.forward(weights, config, tokens, index, pools, donate=donate, last=True)

    run = be.jit(step, donate_argnums=(3,)) if compile else be.inference(step)

    n = len(prompts)
    lens = [len(p) for p in prompts]
    order, shared, parent = _plan(prompts, page_size, share)
    pages, used = _pages(prompts, order, shared, parent, page_size, max_new_tokens)
    _, unshared_pages = _pages(prompts, np.arange(n), np.zeros(n, dtype=np.int64),
                               np.full(n, -1), page_size, max_new_tokens)
    table_np = _table(pages, page_size)
    table = ints(table_np)
    pools = llama.empty_pools(config, used * page_size, like=weights["embed"])
    shared_of = dict(zip(order.tolist(), shared.tolist(), strict=True))
    depth = _depths(order, parent)
    waves = [[p for p in range(n) if depth[p] == d] for d in range(max(depth.values()) + 1)]

    # -- prefill, wave by wave: each lane computes its tokens past what it shares --------------
    first = np.zeros(n, dtype=np.int64)
    first_logits: list[np.ndarray | None] = [None] * n
    t0 = time.perf_counter()
    for w, lanes in enumerate(waves):
        width = max(lens[p] - shared_of[p] for p in lanes)
        if chunk is not None and compile:
            # one shape for every prefill call: n lanes (padding lanes have row -1) of chunk
            # tokens, the wave left-padded to whole chunks
            width = -(-width // chunk) * chunk
            rows_ = lanes + [-1] * (n - len(lanes))
        else:
            rows_ = lanes
        pos = np.full((len(rows_), width), -1, dtype=np.int64)
        tok = np.zeros((len(rows_), width), dtype=np.int64)
        for b, p in enumerate(lanes):
            s = shared_of[p]
            pos[b, width - (lens[p] - s):] = np.arange(s, lens[p])
            tok[b, width - (lens[p] - s):] = prompts[p][s:]
        row = ints(rows_)
        step_cols = width if chunk is None else chunk
        for a in range(0, width, step_cols):
            cols = slice(a, min(a + step_cols, width))
            index = ci.make(ints(pos[:, cols]), table, row=row)
            logits, pools = run(weights, ints(tok[:, cols]), index, pools)
        last = _host(logits[:, -1, :])
        for b, p in enumerate(lanes):
            first[p] = int(np.argmax(last[b]))
            first_logits[p] = last[b].astype(np.float32)
        progress(f"prefill wave {w + 1}/{len(waves)}: {len(lanes)} prompts, "
                 f"{sum(lens[p] - shared_of[p] for p in lanes)} tokens computed")
    prefill_s = time.perf_counter() - t0

    # -- decode: one token per lane per call, positions advanced by the index ----------------
    tokens = [[int(first[p])] for p in range(n)]
    last_logits = list(first_logits)
    done = [stop and first[p] == eos for p in range(n)]
    index = ci.make(ints(np.asarray(lens)[:, None]), table)
    current = first.copy()
    steps = 0
    warmup_s = 0.0
    t0 = time.perf_counter()
    for k in range(1, max_new_tokens):
        if all(done):
            break
        logits, pools = run(weights, ints(current[:, None]), index, pools)
        last = _host(logits[:, -1, :])
        current = np.argmax(last, axis=-1)
        if k == 1:  # the first step compiles where the backend does: timed apart
            warmup_s = time.perf_counter() - t0
            t0 = time.perf_counter()
        else:
            steps += 1
        for p in range(n):
            if not done[p]:
                tokens[p].append(int(current[p]))
                last_logits[p] = last[p].astype(np.float32)
                done[p] = stop and current[p] == eos
        index = index.advance()
        if k % 8 == 0 or k == max_new_tokens - 1:
            rate = n * steps / max(time.perf_counter() - t0, 1e-9)
            progress(f"decode step {k}/{max_new_tokens - 1}: {rate:.1f} tokens/s")
    decode_s = time.perf_counter() - t0

    return Served(
        prompt_ids=prompts,
        tokens=tokens,
        last_logits=last_logits,
        computed=int(sum(lens[p] - shared_of[p] for p in range(n))),
        unshared=int(sum(lens)),
        pages=used,
        pages_unshared=unshared_pages,
        page_size=page_size,
        waves=len(waves),
        prefill_s=prefill_s,
        warmup_s=warmup_s,
        decode_s=decode_s,
        decode_steps=steps,
        backend=be.name,
        compiled=bool(compile),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cacheidx.demo",
        description="Serve chat prompts with SmolLM2-135M-Instruct through cacheidx: "
        "prefix-shared prefill over paged pools, then greedy decoding with advance.",
    )
    parser.add_argument("--backend", default="numpy", help="numpy, torch, jax, ... "
                        "(default numpy)")
    parser.add_argument("--prompt", action="append", help="a user message (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=None,
                        help="prefill in calls of at most this many tokens per prompt")
    parser.add_argument("--eager", action="store_true",
                        help="never compile (the step is compiled by default on jax)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the step with the backend's jit (torch.compile is slow "
                        "to build for 30 layers)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    from .models import gguf

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    prompts = args.prompt or DEFAULT_PROMPTS
    t0 = time.perf_counter()
    say("loading SmolLM2-135M-Instruct (GGUF, dequantised to float32) ...")
    try:
        config, params = gguf.load_smollm2()
        ids = [gguf.chat_ids(p) for p in prompts]
    except gguf.ModelMissing as e:
        say(str(e))
        return 2
    say(f"loaded in {time.perf_counter() - t0:.1f}s; serving {len(ids)} prompts on "
        f"{args.backend}")
    served = serve(
        params, config, ids,
        max_new_tokens=args.max_new_tokens,
        page_size=args.page_size,
        backend=args.backend,
        compile=args.compile or (args.backend == "jax" and not args.eager),
        chunk=args.chunk,
        progress=say,
    )
    figures = served.figures()
    if args.json:
        out = {
            "prompts": [
                {"prompt": p, "prompt_ids": i, "tokens": t, "text": gguf.decode(t)}
                for p, i, t in zip(prompts, served.prompt_ids, served.tokens, strict=True)
            ],
            "figures": figures,
        }
        print(json.dumps(out))
        return 0
    for p, t in zip(prompts, served.tokens, strict=True):
        answer = gguf.decode([x for x in t if x != EOS]).strip()
        print(f"> {p}\n{answer}\n")
    print(f"prefill: {served.computed} tokens computed, {served.unshared} without sharing, "
          f"in {served.waves} waves, {served.prefill_s:.2f}s")
    print(f"pages of {served.page_size} slots: {served.pages} used, {served.pages_unshared} "
          f"without sharing")
    print(f"decode: first step {served.warmup_s:.2f}s, then {served.decode_steps} steps x "
          f"{len(prompts)} prompts in "
          f"{served.decode_s:.2f}s = {served.decode_tokens_per_s:.1f} tokens/s "
          f"({served.backend}{', compiled' if served.compiled else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
