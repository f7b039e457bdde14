"""The engine's thread: every connection's requests join one continuous batch.

Laws:

1. One thread owns the :class:`~cacheidx.serve.Engine`: it alone submits, steps and cancels,
   so the engine is never touched from two threads. A connection hands it a :class:`Job`
   (:meth:`Loop.submit`) or a cancellation (:meth:`Loop.cancel`) through an inbox the thread
   empties before each step: every request waiting at a step boundary joins that step.
2. After each step a job's samples hold the tokens (and log-probabilities) chosen so far,
   each list only growing, and the job's event is set on the connection's event loop; once
   its request ends, :attr:`Job.result` is its engine result, set before the last event.
3. A cancelled job's pages are released before the next step's admission (the engine's law
   7), its result's error the engine's ``CANCELLED``.
4. Past its limit (``lanes + queue`` samples in flight, one request always taken where none
   is), :meth:`Loop.submit` refuses a job (:class:`Full`) rather than queue it unboundedly.
5. Draining (:meth:`Loop.drain`): no job is taken any more (:class:`Draining`); those in
   flight run to their end, or past ``grace`` seconds are cancelled; then ``on_drained`` is
   called once.
6. A step that raises (an engine bug) fails every job in flight with its error, and the loop
   refuses every later job (:attr:`Loop.broken`): a server that cannot serve says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..engine import CANCELLED, Engine
from ..requests import Request, Result

__all__ = ["Draining", "Full", "Job", "Loop", "Sample"]


class Full(Exception):
    """Law 4: the queue is full."""


class Draining(Exception):
    """Law 5: the server is shutting down (or broken, law 6)."""


@dataclasses.dataclass(eq=False)
class Sample:
    """One sample of a job as it stands (law 2): its ``tokens`` and ``logprobs`` so far and
    the prompt tokens its lane read from the cache."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    cached: int = 0


class Job:
    """One engine request of a connection, on the connection's event loop ``aloop``; its
    ``event`` (its own, or one shared by the jobs of one HTTP request) is set after each
    step that moved it."""

    def __init__(self, request: Request, aloop: asyncio.AbstractEventLoop,
                 event: asyncio.Event | None = None):
        self.request = request
        self.samples = [Sample() for _ in range(request.n)]
        self.result: Result | None = None
        self.ticket: int | None = None
        self.submitted = time.perf_counter()
        self.first_token: float | None = None
        self._aloop = aloop
        self._event = asyncio.Event() if event is None else event  # shared by a call's jobs

    @property
    def done(self) -> bool:
        return self.result is not None

    async def changed(self) -> None:
        """Waits for the next step that moved this job (or its end)."""
        await self._event.wait()
        self._event.clear()

    # -- the engine's thread ---------------------------------------------------------------
    def _notify(self) -> None:
        try:
            self._aloop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the connection's loop is closed: no one listens
            pass

    def _update(self, parts: list[Result]) -> None:
        moved = False
        for sample, part in zip(self.samples, parts):
            new = part.tokens[len(sample.tokens):]
            if new:
                sample.tokens.extend(new)
                moved = True
            lps = part.logprobs or ()
            if len(lps) > len(sample.logprobs):
                sample.logprobs.extend(lps[len(sample.logprobs):])
            sample.cached = part.cached_tokens
        if moved:
            if self.first_token is None:
                self.first_token = time.perf_counter()
            self._notify()

    def _finish(self, result: Result) -> None:
        tokens = result.samples
        lps = result.logprobs if result.logprobs is not None else None
        for k, sample in enumerate(self.samples):
            if k < len(tokens) and len(tokens[k]) > len(sample.tokens):
                sample.tokens.extend(tokens[k][len(sample.tokens):])
            if lps is not None:
                mine = lps if result.n == 1 else lps[k]
                if len(mine) > len(sample.logprobs):
                    sample.logprobs.extend(mine[len(sample.logprobs):])
        if result.n == 1 and not self.samples[0].cached:
            self.samples[0].cached = result.cached_tokens
        self.result = result
        self._notify()


class Loop:
    """The thread that serves ``engine`` (see the module's laws); ``queue`` samples may wait
    beyond the engine's lanes."""

    def __init__(self, engine: Engine, *, queue: int = 256, grace: float = 30.0,
                 on_drained: Callable[[], None] | None = None):
        self.engine = engine
        self.limit = engine.scheduler.lanes + int(queue)
        self.grace = float(grace)
        self.on_drained = on_drained
        self.broken: str | None = None
        self.draining = False
        self._drain_deadline: float | None = None
        self._drained = False
        self._lock = threading.Lock()
        self._inbox: list[tuple[str, Job]] = []
        self._wake = threading.Event()
        self._jobs: dict[int, Job] = {}  # the engine's ticket -> its job
        self._flight = 0  # samples submitted and not ended (law 4)
        self._stop = False
        #: the engine's counts after the last step (read by /metrics from any thread)
        self.snapshot: dict[str, Any] = self._counts()
        self.thread = threading.Thread(target=self._run, name="cacheidx-engine", daemon=True)

    def start(self) -> Loop:
        self.thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the thread (in-flight jobs are cancelled)."""
        self._stop = True
        self._wake.set()
        self.thread.join(timeout)

    # -- any thread ------------------------------------------------------------------------
    def refusal(self, request: Request) -> str | None:
        """Why the engine can never serve ``request`` (its limits are fixed when it is made:
        safe to read from any thread)."""
        return self.engine.scheduler.refusal(request)

    def submit(self, job: Job) -> None:
        """Law 1 and 4: hands ``job`` to the engine's thread, or raises :class:`Full` or
        :class:`Draining`."""
        with self._lock:
            if self.broken is not None or self.draining or self._stop:
                raise Draining(self.broken or "the server is shutting down")
            n = job.request.n
            if self._flight and self._flight + n > self.limit:
                raise Full(f"{self._flight} samples are in flight; the server takes at most "
                           f"{self.limit} (its lanes and its queue)")
            self._flight += n
            self._inbox.append(("submit", job))
        self._wake.set()

    def cancel(self, job: Job) -> None:
        """Law 3: cancels ``job`` (nothing where it ended)."""
        if job.done:
            return
        with self._lock:
            self._inbox.append(("cancel", job))
        self._wake.set()

    def drain(self) -> None:
        """Law 5: takes no more jobs; ``on_drained`` once those in flight ended."""
        with self._lock:
            self.draining = True
            self._drain_deadline = time.monotonic() + self.grace
        self._wake.set()

    @property
    def in_flight(self) -> int:
        """Samples submitted and not yet ended."""
        return self._flight

    # -- the engine's thread ---------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                inbox, self._inbox = self._inbox, []
            for kind, job in inbox:
                if kind == "submit":
                    if self._stop:
                        self._end(job, _failed(job.request, CANCELLED))
                        continue
                    job.ticket = engine.submit(job.request)
                    self._jobs[job.ticket] = job
                elif job.ticket in self._jobs:
                    engine.cancel(job.ticket)
            if self._stop or (self.draining and self._drain_deadline is not None
                              and time.monotonic() > self._drain_deadline):
                for ticket in list(self._jobs):
                    engine.cancel(ticket)
            if not engine.busy:
                self.snapshot = self._counts()
                if self.draining and not self._jobs and not self._drained:
                    self._drained = True
                    if self.on_drained is not None:
                        self.on_drained()
                if self._stop:
                    return
                self._wake.wait(0.25)
                self._wake.clear()
                continue
            try:
                done = engine.step()
            except Exception as e:  # law 6: the engine's own bug
                self._broke(e)
                continue
            for ticket, parts in engine.progress().items():
                job = self._jobs.get(ticket)
                if job is not None:
                    job._update(parts)
            for result in done:
                job = self._jobs.pop(result.ticket, None)
                engine.collect(result.ticket)
                if job is not None:
                    self._end(job, result)
            self.snapshot = self._counts()

    def _end(self, job: Job, result: Result) -> None:
        with self._lock:
            self._flight -= job.request.n
        job._finish(result)

    def _broke(self, e: Exception) -> None:
        why = f"the engine failed: {type(e).__name__}: {e}"
        traceback.print_exc()
        with self._lock:
            self.broken = why
        for job in list(self._jobs.values()):
            self._end(job, _failed(job.request, why))
        self._jobs.clear()
        # the engine's queue is dropped with it: nothing it holds is answered again
        self.engine._pending.clear()
        self.engine._refused.clear()

    def _counts(self) -> dict[str, Any]:
        e = self.engine
        s, cache = e.scheduler, e.cache
        running = {lane.result.ticket for lane in s.running}
        return {
            "prompt_tokens": s.prompt_tokens, "computed_tokens": s.computed_tokens,
            "cached_tokens": s.cached_tokens, "generated_tokens": s.generated_tokens,
            "served": s.served, "failed": s.failed, "cancelled": e.cancelled,
            "steps": e.steps, "pages": cache.capacity, "pages_in_use": cache.in_use,
            "pages_cached": cache.cached, "pages_free": cache.free,
            "evictions": cache.evictions, "lanes": s.lanes, "lanes_running": len(s.running),
            "requests_running": len(running),
            "requests_waiting": len(self._jobs) - len(running),
            "samples_in_flight": self._flight,
        }


def _failed(request: Request, why: str) -> Result:
    n = request.n
    return Result(request.id, list(request.prompt), error=why, n=n,
                  tokens=[[] for _ in range(n)] if n > 1 else [])
