"""The continuous-batching engine: requests arrive over time, share what the prefix cache
holds, and run together, each step one prefill call and one decode call through the index.

    engine = Engine(LlamaModel(config, params), backend="torch", device="cuda", pages=512)
    results = engine.run(requests)          # Request objects; results in the same order
    engine.figures()["computed_tokens"]     # prompt tokens computed: the rest were cached

Laws (the scheduler's, :mod:`cacheidx.serve.scheduler`, plus):

1. Time is the engine's ``clock``: ``"seconds"`` since the first step (requests wait for
   their ``arrival``; an idle engine sleeps until the next one) or ``"steps"`` (arrival is a
   step number; an idle engine skips to it).
2. A result comes back once per request, in :meth:`Engine.run`'s order, its error set where
   it failed; ``on_finish`` hears each as it finishes and may submit more (a client whose
   next turn follows an answer).
3. Nothing leaks: once :meth:`Engine.run` returns, every page is free or cached with no
   reader.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..prefix.cache import PrefixCache, lru
from .requests import Request, Result
from .scheduler import Batch, Scheduler
from .step import Step

__all__ = ["Engine"]


_KINDS = ("prefill", "decode", "prefill warmup", "decode warmup")


def _quiet(_: str) -> None:
    pass


class Engine:
    """Serves requests with ``model`` (a :class:`~cacheidx.serve.model.Model`, computed by a
    :class:`~cacheidx.serve.step.Step` on ``backend`` and ``device``, compiled with
    ``compile``) or with ``executor`` (anything with ``Step.run``'s signature: a simulation).

    ``pages`` pages of ``page_size`` tokens hold every request's keys and values and the
    cache; ``lanes`` requests run at once; prefill computes at most ``chunk`` tokens per
    request per step (256 eager, 64 compiled, by default). ``cache=False`` computes every
    prompt whole. ``policy`` orders evictions (:func:`cacheidx.prefix.lru`). With
    ``keep_logits`` each result keeps the logits that chose its last token. ``shapes``
    (``"exact"``, ``"buckets"``, ``"fixed"``) says how calls are shaped
    (:mod:`cacheidx.serve.step`; exact eager, buckets compiled by default). ``context``
    caps the tokens a request holds (prompt and new ones; a longer one fails) and sizes the
    table once: with fixed shapes, one program for each kind of call."""

    def __init__(self, model: Any = None, *, executor: Any = None, backend: str = "numpy",
                 device: str | None = None, compile: bool = False, pages: int = 256,
                 page_size: int = 16, lanes: int = 8, chunk: int | None = None,
                 cache: bool = True, policy: Callable = lru, keep_logits: bool = False,
                 clock: str = "seconds", shapes: str | None = None,
                 context: int | None = None):
        if (model is None) == (executor is None):
            raise ValueError("cacheidx.serve.Engine: give a model or an executor (one)")
        if clock not in ("seconds", "steps"):
            raise ValueError(f"cacheidx.serve.Engine: clock must be 'seconds' or 'steps', got "
                             f"{clock!r}")
        chunk = (64 if compile else 256) if chunk is None else int(chunk)
        self.cache = PrefixCache(pages, page_size, policy=policy)
        self.scheduler = Scheduler(self.cache, lanes=lanes, chunk=chunk, reuse=cache,
                                   context=context)
        if executor is None:
            executor = Step(model, backend=backend, device=device, compile=compile,
                            slots=pages * page_size, lanes=lanes, chunk=chunk,
                            page_size=page_size, keep_logits=keep_logits, shapes=shapes)
        self.executor = executor
        self.clock = clock
        self._pending: list[tuple[float, int, Request]] = []
        self._order = itertools.count()
        self._open: list[int] = []  # tickets submitted since the last run
        self._finished: dict[int, Result] = {}
        self._start: float | None = None
        self.steps = 0
        #: seconds and calls of each kind of call; "... warmup": those of a new shape (a compile)
        self.timing = dict.fromkeys(_KINDS, 0.0)
        self.calls = dict.fromkeys(_KINDS, 0)
        self.decode_tokens = 0  #: tokens decoded in calls that compiled nothing

    # -- time ---------------------------------------------------------------------------------
    def now(self) -> float:
        if self.clock == "steps":
            return float(self.steps)
        if self._start is None:
            self._start = time.perf_counter()
        return time.perf_counter() - self._start

    # -- requests -------------------------------------------------------------------------------
    def submit(self, request: Request) -> int:
        """Queues ``request`` until its arrival; returns its ticket (its result's ``ticket``)."""
        if not isinstance(request, Request):
            raise TypeError(f"cacheidx.serve.Engine.submit: expected a Request, got "
                            f"{type(request).__name__}")
        ticket = next(self._order)
        heapq.heappush(self._pending, (request.arrival, ticket, request))
        self._open.append(ticket)
        return ticket

    @property
    def busy(self) -> bool:
        return bool(self._pending) or self.scheduler.busy

    def step(self) -> list[Result]:
        """One step (see the module's laws): arrivals, admission, a prefill call, a decode
        call. Returns the results that finished in it."""
        now = self.now()
        done: list[Result] = []
        while self._pending and self._pending[0][0] <= now:
            _, ticket, request = heapq.heappop(self._pending)
            failed = self.scheduler.submit(request, now, ticket)
            if failed is not None:
                done.append(failed)
        if not self.scheduler.busy:
            if self._pending:  # idle until the next arrival
                wait = self._pending[0][0] - now
                if self.clock == "steps":
                    self.steps += max(1, int(np.ceil(wait)))
                else:
                    time.sleep(max(0.0, wait))
        else:
            self.scheduler.admit(now)
            ran = False
            for batch in (self.scheduler.prefill(), self.scheduler.decode()):
                if batch is not None:
                    done += self._call(batch)
                    ran = True
            if not ran:
                raise RuntimeError("cacheidx.serve.Engine.step: requests wait but none can run "
                                   "(a scheduler bug)")
            self.steps += 1
        for result in done:
            self._finished[result.ticket] = result
        return done

    def _call(self, batch: Batch) -> list[Result]:
        t0 = time.perf_counter()
        chosen, logits, new = self.executor.run(batch, self.scheduler.table,
                                                self.scheduler.version)
        spent = time.perf_counter() - t0
        kind = f"{batch.kind} warmup" if new else batch.kind
        self.timing[kind] += spent
        self.calls[kind] += 1
        if batch.kind == "decode" and not new:
            self.decode_tokens += len(batch.lanes)
        return self.scheduler.after(batch, chosen, logits, self.now())

    def run(self, requests: Iterable[Request] = (), *,
            on_finish: Callable[[Result], None] | None = None,
            progress: Callable[[str], None] = _quiet) -> list[Result]:
        """Serves ``requests`` (and any submitted before, or by ``on_finish``) to the end;
        returns their results in the order they were submitted."""
        for r in requests:
            self.submit(r)
        while self.busy:
            for result in self.step():
                if result.error is not None:
                    progress(f"request {result.id!r} failed: {result.error}")
                else:
                    progress(f"request {result.id!r}: {len(result.prompt_ids)} prompt tokens "
                             f"({result.cached_tokens} cached), {len(result.tokens)} new")
                if on_finish is not None:
                    on_finish(result)
        tickets, self._open = self._open, []
        return [self._finished.pop(t) for t in tickets]

    def figures(self) -> dict:
        """The scheduler's token and page figures, and time."""
        f = self.scheduler.figures()
        seconds = self.now() if self.clock == "seconds" else None
        decode_s = self.timing["decode"]
        f.update({
            "steps": self.steps,
            "prefill_calls": self.calls["prefill"] + self.calls["prefill warmup"],
            "decode_calls": self.calls["decode"] + self.calls["decode warmup"],
            "warmup_calls": self.calls["prefill warmup"] + self.calls["decode warmup"],
            "prefill_seconds": round(self.timing["prefill"] + self.timing["prefill warmup"], 3),
            "decode_seconds": round(decode_s + self.timing["decode warmup"], 3),
            "warmup_seconds": round(self.timing["prefill warmup"]
                                    + self.timing["decode warmup"], 3),
            # decode calls that compiled nothing: the steady rate
            "decode_tokens_per_second": round(self.decode_tokens / decode_s, 1)
            if decode_s > 0 else None,
        })
        if seconds is not None:
            f["seconds"] = round(seconds, 3)
            f["tokens_per_second"] = round(f["generated_tokens"] / seconds, 1) if seconds else None
        programs = getattr(self.executor, "programs", None)
        if programs is not None:
            f["programs"] = programs
        return f
