"""Serve a batch of chat prompts with SmolLM2-135M-Instruct through cacheidx.

    python -m cacheidx.demo [--backend NAME] [--device DEVICE] [--prompt TEXT ...]
                            [--max-new-tokens N] [--page-size P] [--chunk C] [--eager]
                            [--compile] [--json] [--kv int8|int4]

A thin shell over the serving engine (:mod:`cacheidx.serve`): the prompts arrive together;
the first computes the model's system prompt, which the engine's prefix cache then hands to
the others (their tables name its pages for those tokens and fresh pages for the rest); then
every prompt decodes greedily, one token per lane per call, the positions moved on by
``index.advance()``. The model (:mod:`cacheidx.models.llama`) sees only the index: the pages,
the sharing and the padding are all values of it. ``--device`` is ``cpu``, ``gpu``, ``cuda``,
``gpu:N`` or ``cuda:N`` on every backend.

:func:`serve` is the same engine as a function, used by the tests and
``benchmarks/decode.py`` as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from .models import llama
from .serve import Engine, LlamaModel, Request, ShardedModel

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
    pages: int  #: pages running prompts held at most at once (prompt and answer room)
    pages_unshared: int  #: pages without sharing
    page_size: int
    waves: int  #: engine steps that admitted prompts (a prompt waits for a prefix to cache)
    prefill_s: float  #: prefill, compiling included where the backend compiles
    warmup_s: float  #: decode calls of a shape not seen before, compiling included
    decode_s: float  #: the other decode calls
    decode_steps: int  #: decode calls after the warm-up ones
    backend: str
    compiled: bool
    decode_tokens: int = 0  #: tokens computed by those decode calls
    device: str = "cpu"
    figures_: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens computed per second by the decode calls after the warm-up ones."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    def figures(self) -> dict:
        return {
            "backend": self.backend,
            "device": self.device,
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
            "programs": self.figures_.get("programs"),
        }


def _quiet(*_args) -> None:
    pass


def serve(
    params,
    config: llama.Config,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 16,
    page_size: int = 16,
    backend: str = "numpy",
    device: str | None = None,
    compile: bool = False,
    share: bool = True,
    chunk: int | None = None,
    stop: bool = True,
    eos: int = EOS,
    progress: Callable[[str], None] = _quiet,
    group=None,
    kv: str | None = None,
) -> Served:
    """Greedy answers to ``prompts`` (lists of token ids), served by
    :class:`cacheidx.serve.Engine` through paged pools on ``backend`` and ``device``
    (``cpu``, ``gpu``, ``cuda``, ``gpu:N``, ``cuda:N``; the backend's default device without
    it).

    ``params`` are NumPy arrays (``cacheidx.models.gguf.load``); they are placed on the device
    in ``backend``'s namespace. ``compile`` wraps the step in the backend's ``jit`` (``jax.jit``,
    ``torch.compile``; eager where the backend has no compiler), with one shape for every
    prefill call (all prompts' lanes, ``chunk`` tokens, 16 by default) and one for every
    decode step. ``share=False`` turns the prefix cache off: every prompt computes whole.
    ``chunk`` splits each prompt's prefill into calls of at most ``chunk`` tokens. With
    ``stop`` a prompt's answer ends at ``eos`` (kept); without it every prompt gets
    ``max_new_tokens``. The pool holds every prompt's pages without sharing, so no prompt
    waits for pages. ``group`` (:func:`cacheidx.parallel.group`) runs the model
    tensor-parallel (:class:`cacheidx.serve.ShardedModel`); every rank serves the same steps.
    ``kv`` (``"int8"``, ``"int4"``) keeps the keys and values in quantized pools
    (``Engine(kv=...)``, :mod:`cacheidx.quantized`).
    """
    if max_new_tokens < 1:
        raise ValueError(f"cacheidx.demo.serve: max_new_tokens must be positive, got "
                         f"{max_new_tokens}")
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("cacheidx.demo.serve: every prompt needs at least one token")
    compile = bool(compile)
    if chunk is None:
        chunk = 16 if compile else max(map(len, prompts))
    need = sum(-(-(len(p) + max_new_tokens - 1) // page_size) for p in prompts)
    model = LlamaModel(config, params) if group is None else ShardedModel(config, params, group)
    engine = Engine(model, backend=backend, device=device,
                    compile=compile, pages=need, page_size=page_size, lanes=len(prompts),
                    chunk=chunk, cache=share, keep_logits=True, clock="steps",
                    shapes="fixed" if compile else None,
                    context=max(len(p) for p in prompts) + max_new_tokens - 1, kv=kv)
    stops = frozenset([eos]) if stop else frozenset()
    results = engine.run([Request(i, p, max_new_tokens, stop=stops)
                          for i, p in enumerate(prompts)], progress=progress)
    f = engine.figures()
    t, c = engine.timing, engine.calls
    return Served(
        prompt_ids=prompts,
        tokens=[r.tokens for r in results],
        last_logits=[r.last_logits for r in results],
        computed=f["computed_tokens"],
        unshared=sum(map(len, prompts)),
        pages=f["peak_pages_in_use"],
        pages_unshared=need,
        page_size=page_size,
        waves=f["admission_rounds"],
        prefill_s=t["prefill"] + t["prefill warmup"],
        warmup_s=t["decode warmup"],
        decode_s=t["decode"],
        decode_steps=c["decode"],
        backend=engine.executor.backend.name,
        compiled=compile,
        decode_tokens=engine.decode_tokens,
        device=_label(engine.executor),
        figures_=f,
    )


def _label(step) -> str:
    spread = getattr(step.device, "device_set", None)  # a placement over a mesh
    if spread is not None and len(spread) > 1:
        return f"{len(spread)} devices"
    try:
        return step.backend.device_label(step.device)
    except AttributeError:
        return str(step.device)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cacheidx.demo",
        description="Serve chat prompts with SmolLM2-135M-Instruct through cacheidx: "
        "prefix-shared prefill over paged pools, then greedy decoding with advance.",
    )
    parser.add_argument("--backend", default="numpy", help="numpy, torch, jax, ... "
                        "(default numpy)")
    parser.add_argument("--device", default=None,
                        help="cpu, gpu, cuda, gpu:N or cuda:N (default: the backend's own)")
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
    parser.add_argument("--kv", choices=("int8", "int4", "int4-turned"), default=None,
                        help="keep keys and values quantized: 8-bit or 4-bit codes and a "
                        "float32 scale per token and kv head, or int4-turned: rows turned by "
                        "the Hadamard matrix, a scale and zero point a group (default: float "
                        "pools)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="K",
                        help="split the heads and the MLP over K ranks: torch under torchrun "
                        "--nproc-per-node K, jax over K devices")
    args = parser.parse_args(argv)
    group = None
    if args.tensor_parallel > 1:
        from . import parallel

        group = parallel.group(args.backend, args.tensor_parallel)

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
        f"{args.backend}" + (f", {args.device}" if args.device else "")
        + (f", kv {args.kv}" if args.kv else ""))
    if group is not None:
        from .parallel import split

        split(config, group.size)  # the clear error when the heads do not divide
    try:
        served = serve(
            params, config, ids,
            max_new_tokens=args.max_new_tokens,
            page_size=args.page_size,
            backend=args.backend,
            device=args.device,
            compile=args.compile or (args.backend == "jax" and not args.eager),
            chunk=args.chunk,
            progress=say,
            group=group,
            kv=args.kv,
        )
    except ValueError as e:  # an unknown backend or device: say which exist
        say(str(e))
        return 2
    if group is not None and args.backend == "torch":
        import torch.distributed as dist

        # a process group left to the interpreter's exit can abort the rank (SIGABRT:
        # pytorch/pytorch#190489); ended here, after every rank's last collective
        dist.destroy_process_group()
    if group is not None and not group.lead:
        return 0
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
    print(f"decode: first step {served.warmup_s:.2f}s, then {served.decode_tokens} tokens in "
          f"{served.decode_steps} steps, {served.decode_s:.2f}s = "
          f"{served.decode_tokens_per_s:.1f} tokens/s "
          f"({served.backend} on {served.device}{', compiled' if served.compiled else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
