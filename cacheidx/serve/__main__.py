"""``python -m cacheidx.serve REQUESTS.jsonl``: serve chat requests with SmolLM2-135M-Instruct
through the continuous-batching engine and its prefix cache.

    python -m cacheidx.serve REQUESTS.jsonl [--backend B] [--device D] [--pages N]
                             [--page-size P] [--max-new-tokens N] [--no-cache] [--json]
                             [--lanes L] [--chunk C] [--compile | --eager]

Each line of REQUESTS.jsonl (``-`` reads stdin) is ``{"id": ..., "messages": [{"role": ...,
"content": ...}, ...]}``, optionally with ``"arrival"`` (seconds from the start) and
``"max_new_tokens"``; the engine applies the model's chat template to the messages. Answers
go to stdout (with ``--json``, one object: ``"requests"``, each with its ``id``,
``prompt_ids`` and generated ``tokens``, and ``"figures"``); progress and a summary go to
stderr. A request the pool cannot hold gets its error in its own result and the others are
served; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from .engine import Engine
from .model import LlamaModel
from .requests import read_requests

EOS = 2  # <|im_end|>, SmolLM2's end of a turn
MOST_PAGES = 1024  # the default pool's cap: 1024 pages of 16 tokens of SmolLM2 are ~750 MB


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cacheidx.serve",
                                description="Serve chat requests with SmolLM2-135M-Instruct "
                                "through cacheidx: continuous batching over paged pools, "
                                "prompts' prefixes read from an online prefix cache.")
    p.add_argument("requests", metavar="REQUESTS.jsonl", help="one request a line; - for stdin")
    p.add_argument("--backend", default="numpy", help="numpy, torch, jax, cupy, strict "
                   "(default numpy)")
    p.add_argument("--device", default=None,
                   help="cpu, gpu, cuda, gpu:N or cuda:N (default: the backend's own)")
    p.add_argument("--pages", type=int, default=None,
                   help="pages in the pool (default: every request's pages, at most "
                   f"{MOST_PAGES})")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="for each request without its own max_new_tokens")
    p.add_argument("--no-cache", action="store_true", help="compute every prompt whole")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--lanes", type=int, default=8, help="requests running at once")
    p.add_argument("--chunk", type=int, default=None,
                   help="prompt tokens a request computes per step (256 eager, 64 compiled)")
    p.add_argument("--compile", action="store_true",
                   help="compile the step with the backend's jit (jax compiles by default)")
    p.add_argument("--eager", action="store_true", help="never compile")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ..models import gguf

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    say("loading SmolLM2-135M-Instruct (GGUF, dequantised to float32) ...")
    try:
        config, params = gguf.load_smollm2()
        source = sys.stdin if args.requests == "-" else open(args.requests)
        with source:
            requests = read_requests(source, gguf.conversation_ids,
                                     max_new_tokens=args.max_new_tokens, stop=(EOS,),
                                     where=args.requests)
    except gguf.ModelMissing as e:
        say(str(e))
        return 2
    except (OSError, ValueError) as e:
        say(f"cacheidx.serve: {e}")
        return 2
    if not requests:
        say(f"cacheidx.serve: {args.requests} holds no request")
        return 2
    pages = args.pages
    if pages is None:
        pages = min(MOST_PAGES, sum(-(-(len(r.prompt) + r.max_new_tokens - 1)
                                      // args.page_size) for r in requests))
    compile = args.compile or (args.backend == "jax" and not args.eager)
    say(f"loaded in {time.perf_counter() - t0:.1f}s; {len(requests)} requests on "
        f"{args.backend}{', ' + args.device if args.device else ''}"
        f"{', compiled' if compile else ''}; {pages} pages of {args.page_size} tokens, "
        f"cache {'off' if args.no_cache else 'on'}")
    # compiled, one shape for each kind of call (two programs to build, which for 30 layers
    # is most of a short run), as wide as the longest request the pool holds
    totals = [len(r.prompt) + r.max_new_tokens - 1 for r in requests]
    fits = [t for t in totals if -(-t // args.page_size) <= pages]
    context = max(fits) if compile and fits else None
    try:
        engine = Engine(LlamaModel(config, params), backend=args.backend, device=args.device,
                        compile=compile, pages=pages, page_size=args.page_size,
                        lanes=args.lanes, chunk=args.chunk, cache=not args.no_cache,
                        shapes="fixed" if compile else None, context=context)
    except ValueError as e:  # an unknown backend or device, a bad size: say what exists
        say(str(e))
        return 2
    results = engine.run(requests, progress=say)
    figures = engine.figures()
    say(summary(figures))
    if args.json:
        out = [dict(r.as_json(), text=gguf.decode([t for t in r.tokens if t != EOS]))
               for r in results]
        print(json.dumps({"requests": out, "figures": figures}))
    else:
        for r in results:
            answer = (f"error: {r.error}" if r.error is not None
                      else gguf.decode([t for t in r.tokens if t != EOS]).strip())
            print(f"[{r.id}] {answer}")
    return 1 if figures["failed"] else 0


def summary(f: dict) -> str:
    """The figures a person reads: tokens, the hit rate, pages, speed."""
    rate = f"{f['tokens_per_second']:.1f}" if f.get("tokens_per_second") else "-"
    return (f"served {f['requests'] - f['failed']} of {f['requests']} requests: "
            f"{f['prompt_tokens']} prompt tokens, {f['computed_tokens']} computed, "
            f"{f['cached_tokens']} read from the cache (hit rate {100 * f['hit_rate']:.1f}%); "
            f"pages: {f['pages']} of {f['page_size']} tokens, at most {f['peak_pages_in_use']} "
            f"held by running requests, {f['pages_cached']} cached at the end, "
            f"{f['evictions']} evicted; {f['generated_tokens']} tokens generated in "
            f"{f.get('seconds', 0):.1f}s = {rate} tokens/s")


if __name__ == "__main__":
    sys.exit(main())
