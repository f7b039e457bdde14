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
   next turn follows an answer). A request of ``n`` > 1 samples (``Request(..., n=N)``)
   runs as ``N`` lanes and comes back once, when its last sample ends, its ``tokens`` ``N``
   lists (the scheduler's law 6: its prompt's whole pages computed once, read by the other
   samples from the prefix cache; with ``cache=False`` each sample computes it whole).
3. Nothing leaks: once :meth:`Engine.run` returns, every page is free or cached with no
   reader.
4. A request fails alone. One the engine can never serve (a token id past the model's
   vocabulary, more tokens than the model's context or the pool, see the scheduler's law 1)
   fails when it is submitted. A call that raises is tried again lane by lane; a lane that
   raises alone fails, its pages released, and the others go on. Either way its result
   carries the error, the others are served, and the engine serves the next ``run``.
   (A call whose index breaks an obligation of the table under ``debug`` is the engine's
   own bug: :class:`~cacheidx.serve.step.TableError` is raised.)
5. Groups of layers (:mod:`cacheidx.serve.groups`): the layers of one window share a table
   and a pool of pages; a sliding group frees what no call still to come reads (the
   scheduler's law 5), so a request holds about ``(w + chunk) / page_size + 1`` pages there
   whatever its length. The tokens are those of one table for every layer (``windows=[None]
   * layers``). A window that never frees a page of a request the engine holds (of at most
   the model's ``context`` and the engine's tokens) is kept as a full one (the groups' law
   4). A pool that cannot hold one window of its group, or one request where that is fewer
   pages, is refused when the engine is made.
7. A caller that steps the engine itself (a server) may :meth:`Engine.cancel` a request
   between steps: a request still to arrive or waiting is taken out of the queue; a running
   one's lanes (every sample's) release their holds as a failing lane does (their pages free
   or cached with no reader, before the next step's admission), and the request is answered
   once, by the next step, its error :data:`CANCELLED`. :meth:`Engine.progress` says, after
   each step, each request whose lanes ran in it and its samples' results as they stand (a
   stream's tokens so far); :meth:`Engine.collect` takes a finished result that :meth:`run`
   would otherwise keep for its caller.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from .. import _arguments as arguments
from ..models import llama
from ..prefix.cache import PrefixCache, lru
from ..prefix.reach import window_pages
from .groups import Groups, windows_told
from .requests import Request, Result
from .scheduler import Batch, Scheduler
from .step import Step, TableError

__all__ = ["CANCELLED", "Engine", "state_every"]


_KINDS = ("prefill", "decode", "prefill warmup", "decode warmup")
_WHERE = "serve.Engine"
CANCELLED = "cancelled by its client"  #: a cancelled request's error (law 7)


def _quiet(_: str) -> None:
    pass


class Engine:
    """Serves requests with ``model`` (a :class:`~cacheidx.serve.model.Model`, computed by a
    :class:`~cacheidx.serve.step.Step` on ``backend`` and ``device``, compiled with
    ``compile``: ``True``, or the name of the library's compiler, torch.compile's
    ``"aot_eager"`` say) or with ``executor`` (anything with ``Step.run``'s signature: a
    simulation).

    ``pages`` pages of ``page_size`` tokens hold every request's keys and values and the
    cache; ``lanes`` requests run at once (each sample of a request of ``n`` > 1 is one,
    law 2); prefill computes at most ``chunk`` tokens per request per step (256 eager, 64
    compiled, by default). ``cache=False`` computes every prompt whole (every sample's).
    ``policy`` orders evictions (:func:`cacheidx.prefix.lru`). With ``keep_logits`` each
    result keeps the logits that chose its last token. ``shapes``
    (``"exact"``, ``"buckets"``, ``"fixed"``) says how calls are shaped
    (:mod:`cacheidx.serve.step`; exact eager, buckets compiled by default). ``context``
    caps the tokens a request holds (prompt and new ones; a longer one fails) and sizes the
    table once: with fixed shapes, one program for each kind of call. ``debug`` checks every
    call's index (:func:`cacheidx.check`) before the model reads it (an ``executor`` makes
    its own calls, and checks what it will).

    ``windows`` is each layer's window as the engine keeps its pages (``None``: every
    position), the model's own ``windows`` by default (a model without them: one full
    layer); the layers of one window are a group with its own table and pool of pages (law
    5). ``pages`` is then each group's pool, or a mapping from each group's window to its
    pool's pages; ``[None] * layers`` keeps one table for every layer.

    ``kv`` is how the pools hold keys and values: ``None``, the model's float pools;
    ``"int8"`` or ``"int4"``, quantized pools (8-bit or 4-bit codes and one float32 scale per
    token and kv head, :mod:`cacheidx.quantized`), made by ``model.pools(weights, slots,
    kv=kv)``. Every law holds of them unchanged (a prefix hit reads the codes and scales its
    first request stored); the tokens are those of float pools holding each stored value's
    round trip (:func:`cacheidx.quantized.roundtrip`). A row of ``d`` elements then takes
    ``d + 4`` bytes (int8) or ``d / 2 + 4`` (int4) against float32's ``4 * d``
    (:func:`cacheidx.serve.model.token_bytes`). ``"int4-turned"``: 4-bit codes of rows turned by
    the Hadamard matrix, a float16 scale and int8 zero point a group of channels
    (:mod:`cacheidx.turned`; a tenth of int4's error on SmolLM2, read by the array-API path).

    Raises ``ValueError`` (``TypeError`` for a wrong type) naming the argument for a size
    that is not a positive integer (``pages`` may be 0), a window below the model's own, a
    pool that cannot hold one window of its sliding group (nor one request of the most
    tokens a request holds, where that is fewer pages), a ``kv`` other than those three, or
    a ``kv`` with an ``executor`` (which makes its own pools).

    A model with recurrent layers (``recurrent_layers``, law 6) keeps their states beside the
    pages: ``state_every`` is ``m``, the positions between two snapshots (by default
    :func:`state_every` of the model's ``state_bytes()`` against its ``token_bytes``), and
    ``snapshots`` the snapshot pool's slots (by default one per block of the full group's
    pages, one per lane, and a request's two junctions). An ``executor`` that computes
    recurrent layers is told ``state_every``, and its ``run`` is given the table of blocks
    (``blocks=``).

    ``detokenize`` (token ids to text, a tokenizer's ``decode``) lets requests stop on
    strings (``Sampling(stop=...)``) and gives each result its ``text`` (the scheduler's law
    8); a request's sampling (``Request(..., sampling=...)``) is chosen by the laws of
    :mod:`cacheidx.serve.sampling` on every backend and compile mode."""

    def __init__(self, model: Any = None, *, executor: Any = None, backend: str = "numpy",
                 device: str | None = None, compile: bool | str = False, pages: int = 256,
                 page_size: int = 16, lanes: int = 8, chunk: int | None = None,
                 cache: bool = True, policy: Callable = lru, keep_logits: bool = False,
                 clock: str = "seconds", shapes: str | None = None,
                 context: int | None = None, debug: bool = False,
                 windows: Any = None, kv: str | None = None,
                 state_every: int | None = None, snapshots: int | None = None,
                 detokenize: Callable[[list[int]], str] | None = None):
        if (model is None) == (executor is None):
            raise ValueError("cacheidx.serve.Engine: give a model or an executor (one)")
        llama.kv_bits(_WHERE, kv)
        if kv is not None and executor is not None:
            raise ValueError(f"cacheidx.serve.Engine: kv={kv!r} is for the engine's own step; "
                             "an executor makes its own pools")
        if clock not in ("seconds", "steps"):
            raise ValueError(f"cacheidx.serve.Engine: clock must be 'seconds' or 'steps', got "
                             f"{clock!r}")
        page_size = arguments.integer(_WHERE, "page_size", page_size, least=1)
        if context is not None:
            context = arguments.integer(_WHERE, "context", context, least=1)
        # the most tokens a request holds: what a window must reach past to free a page
        longest = min([c for c in (context, getattr(model, "context", None)) if c is not None],
                      default=None)
        told = windows_told(f"cacheidx.{_WHERE}", windows, getattr(model, "windows", None))
        self.groups = Groups.of(told, longest, page_size)
        counts = _pools(Groups.of(told), self.groups, pages, page_size, longest)
        lanes = arguments.integer(_WHERE, "lanes", lanes, least=1)
        chunk = (64 if compile else 256) if chunk is None else \
            arguments.integer(_WHERE, "chunk", chunk, least=1)
        self.states = _states(model, kv, page_size, counts[0], lanes, state_every, snapshots)
        self.cache = PrefixCache(counts, page_size, policy=policy, windows=self.groups.windows,
                                 states=self.states)
        self.scheduler = Scheduler(self.cache, lanes=lanes, chunk=chunk, reuse=cache,
                                   context=context, vocab=getattr(model, "vocab", None),
                                   longest=getattr(model, "context", None),
                                   aligned=bool(getattr(model, "final_states_only", False))
                                   and self.states is not None,
                                   lanes_per_prefill=getattr(model, "lanes_per_prefill", None)
                                   if self.states is not None else None,
                                   detokenize=detokenize)
        #: why reuse could not happen, each said once (law 6)
        self.notes: list[str] = []
        #: one sequence's state in every recurrent layer (law 6), 0 without
        self.state_bytes = int(model.state_bytes()) if self.states is not None and hasattr(
            model, "state_bytes") else 0
        if self.states is not None and not cache:
            self._note("the prefix cache is off: every prompt is computed whole")
        several = len(self.groups.windows) > 1
        if executor is None:
            executor = Step(model, backend=backend, device=device, compile=compile,
                            slots=[c * page_size for c in counts] if several
                            else counts[0] * page_size,
                            lanes=lanes, chunk=self.scheduler.chunk, page_size=page_size,
                            keep_logits=keep_logits, shapes=shapes, debug=debug,
                            groups=self.groups if several else None, kv=kv,
                            states=self.states)
        self.executor = executor
        self.kv = kv
        self.clock = clock
        self._pending: list[tuple[float, int, Request]] = []
        self._refused: list[Result] = []  # failed when submitted, reported by the next step
        self._order = itertools.count()
        self._open: list[int] = []  # tickets submitted since the last run
        self._finished: dict[int, Result] = {}
        self._start: float | None = None
        self.steps = 0
        #: seconds and calls of each kind of call; "... warmup": those of a new shape (a compile)
        self.timing = dict.fromkeys(_KINDS, 0.0)
        self.calls = dict.fromkeys(_KINDS, 0)
        self.decode_tokens = 0  #: tokens decoded in calls that compiled nothing
        self.cancelled = 0  #: requests cancelled (law 7)
        self._ran: list[Any] = []  # the lanes of the last step's calls (law 7)

    # -- time ---------------------------------------------------------------------------------
    def now(self) -> float:
        if self.clock == "steps":
            return float(self.steps)
        if self._start is None:
            self._start = time.perf_counter()
        return time.perf_counter() - self._start

    # -- requests -------------------------------------------------------------------------------
    def submit(self, request: Request) -> int:
        """Queues ``request`` until its arrival; returns its ticket (its result's ``ticket``).
        A request the engine can never serve fails now (law 4): its result, error set, comes
        back from the next step."""
        if not isinstance(request, Request):
            raise TypeError(f"cacheidx.serve.Engine.submit: expected a Request, got "
                            f"{type(request).__name__}")
        ticket = next(self._order)
        self._open.append(ticket)
        m = None if self.states is None else self.states[0]
        if m is not None and self.scheduler.reuse and 0 < len(request.prompt) <= m:
            self._note(f"a prompt of at most {m} tokens (the snapshots' block) closes no block "
                       "before its last token: it resumes from the cache only at a junction "
                       "an earlier request kept at a whole page (while the snapshot pool "
                       "holds it), never at a block's end")
        if self.scheduler.refusal(request) is not None:
            self._refused.append(self.scheduler.submit(request, 0.0, ticket))
        else:
            heapq.heappush(self._pending, (request.arrival, ticket, request))
        return ticket

    def _note(self, why: str) -> None:
        """Law 6: why a reuse did not happen, said once (a warning, and the figures')."""
        if why not in self.notes:
            self.notes.append(why)
            warnings.warn(f"cacheidx.serve.Engine: {why}", stacklevel=3)

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._refused) or self.scheduler.busy

    def step(self) -> list[Result]:
        """One step (see the module's laws): arrivals, admission, a prefill call, a decode
        call. Returns the results that finished in it."""
        now = self.now()
        done, self._refused = self._refused, []
        self._ran = []
        for result in done:
            result.finished = now
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
                else:  # in slices: a far arrival never overflows a sleep
                    time.sleep(min(max(0.0, wait), 1.0))
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
        self._ran.extend(batch.lanes)
        s = self.scheduler
        table, version = ((s.table, s.version) if len(s.tables) == 1
                          else (tuple(s.tables), tuple(s.versions)))
        try:
            if self.states is None:
                chosen, logits, new = self.executor.run(batch, table, version)
            else:
                chosen, logits, new = self.executor.run(batch, table, version,
                                                        blocks=(s.blocks, s.blocks_version))
        except TableError:
            raise
        except Exception as e:  # law 4: whatever the model raised, it fails its lanes alone
            return self._failed(batch, e)
        spent = time.perf_counter() - t0
        kind = f"{batch.kind} warmup" if new else batch.kind
        self.timing[kind] += spent
        self.calls[kind] += 1
        if batch.kind == "decode" and not new:
            self.decode_tokens += len(batch.lanes)
        return self.scheduler.after(batch, chosen, logits, self.now())

    def _failed(self, batch: Batch, error: Exception) -> list[Result]:
        """Law 4: a call that raised, tried again lane by lane; a lane that raises alone
        fails."""
        self.scheduler.fed_from_host()
        if len(batch.lanes) > 1:
            return [r for b in range(len(batch.lanes)) for r in self._call(batch.alone(b))]
        message = f"the model's {batch.kind} call failed: {type(error).__name__}: {error}"
        result = self.scheduler.fail(batch.lanes[0], message, self.now())
        return [] if result is None else [result]  # None: a sample, its request runs on

    # -- law 7: a caller that steps the engine itself -----------------------------------------
    def cancel(self, ticket: int) -> bool:
        """Law 7: cancels the request of ``ticket`` (arrived or not, waiting or running, every
        sample of it); its result, error :data:`CANCELLED`, comes back from the next step.
        Returns whether the engine held it (``False`` for one that finished or was never
        submitted)."""
        now, s = self.now(), self.scheduler
        found = False
        kept = [entry for entry in self._pending if entry[1] != ticket]
        if len(kept) < len(self._pending):
            (_, _, request), = (entry for entry in self._pending if entry[1] == ticket)
            self._pending = kept
            heapq.heapify(self._pending)
            result = Result(request.id, list(request.prompt), arrival=request.arrival,
                            ticket=ticket, n=request.n,
                            tokens=[[] for _ in range(request.n)] if request.n > 1 else [])
            result.error = CANCELLED
            s.stats.failed += 1
            self._refused.append(result)
            found = True
        ended = s.cancel(ticket, CANCELLED, now)  # waiting or running, every sample of it
        if ended is not None:
            self._refused.append(ended)
            found = True
        if found:
            self.cancelled += 1
            s.stats.used(self.cache)
        return found

    def progress(self) -> dict[int, list[Result]]:
        """Law 7: each request whose lanes ran in the last step, by ticket: its samples'
        results (one for a request of one sample) as they stand, the tokens chosen so far
        included. The results are the engine's own: read them before the next step."""
        out: dict[int, list[Result]] = {}
        for lane in self._ran:
            parts = [lane.result] if lane.samples is None else lane.samples.results
            out.setdefault(lane.result.ticket, parts)
        return out

    def collect(self, ticket: int) -> Result:
        """Law 7: the finished result of ``ticket``, taken from those :meth:`run` returns
        (``KeyError`` where none finished)."""
        result = self._finished.pop(ticket)
        try:
            self._open.remove(ticket)
        except ValueError:
            pass
        return result

    def run(self, requests: Iterable[Request] = (), *,
            on_finish: Callable[[Result], None] | None = None,
            progress: Callable[[str], None] = _quiet) -> list[Result]:
        """Serves ``requests`` (and any submitted before, or by ``on_finish``) to the end;
        returns their results in the order they were submitted. Raises ``TypeError`` naming
        the item, submitting none, when one of ``requests`` is no :class:`Request`."""
        requests = list(requests)
        for k, r in enumerate(requests):
            if not isinstance(r, Request):
                raise TypeError(f"cacheidx.serve.Engine.run: item {k} of requests is a "
                                f"{type(r).__name__}, not a Request; nothing was submitted")
        for r in requests:
            self.submit(r)
        while self.busy:
            for result in self.step():
                if result.error is not None:
                    progress(f"request {result.id!r} failed: {result.error}")
                else:
                    progress(f"request {result.id!r}: {result.describe()}")
                if on_finish is not None:
                    on_finish(result)
        tickets, self._open = self._open, []
        return [self._finished.pop(t) for t in tickets]

    def figures(self) -> dict:
        """The scheduler's token and page figures, the pools' kind (``kv``: ``"float"``, or
        ``"int8"``/``"int4"``), and time."""
        f = self.scheduler.figures()
        f["kv"] = self.kv or "float"
        if self.states is not None:
            snaps = self.cache.snapshots
            f["snapshots"] = {"every": self.states[0], "slots": snaps.capacity,
                              "cached": snaps.cached, "in_use": snaps.in_use,
                              "evictions": self.cache.snapshot_evictions,
                              "bytes": self.state_bytes}
            f["notes"] = list(self.notes)
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


def state_every(state_bytes: int, token_bytes: int, page_size: int, chunk: int = 1) -> int:
    """Law 6's ``m``: the smallest multiple of ``page_size`` and ``chunk`` whose tokens' keys
    and values (``token_bytes`` each, every attention layer's) weigh at least one snapshot
    (``state_bytes``, every recurrent layer's state of one sequence). A model without
    attention layers (``token_bytes`` 0) takes 16 pages: there the snapshots are all the
    cache holds, and a block of 16 pages bounds what a hit recomputes."""
    unit = math.lcm(int(page_size), int(chunk))
    if token_bytes <= 0:
        return unit * max(1, -(-16 * page_size // unit))
    return unit * max(1, -(-int(state_bytes) // (unit * int(token_bytes))))


def _states(model: Any, kv: str | None, page_size: int, pages: int, lanes: int,
            every: int | None, slots: int | None) -> tuple[int, int] | None:
    """Law 6: ``(m, snapshot slots)`` for a model with recurrent layers, ``None`` without.
    Raises naming the argument for an ``m`` that is no multiple of the page size and the
    model's chunk, or a pool of snapshots smaller than one request's blocks."""
    if model is None and every is not None:  # an executor's recurrent layers: told m
        pass
    elif not tuple(getattr(model, "recurrent_layers", ()) or ()):
        if every is not None or slots is not None:
            raise ValueError(f"cacheidx.{_WHERE}: state_every and snapshots are for a model "
                             "with recurrent layers; this one has none")
        return None
    chunk = int(getattr(model, "state_chunk", 1) or 1)
    if every is None:
        tokens = model.token_bytes(kv) if hasattr(model, "token_bytes") else 0
        every = state_every(model.state_bytes(), tokens, page_size, chunk)
    every = arguments.integer(_WHERE, "state_every", every, least=1)
    unit = math.lcm(page_size, chunk)
    if every % unit:
        raise ValueError(f"cacheidx.{_WHERE}: state_every must be a multiple of the page size "
                         f"({page_size}) and of the model's state_chunk ({chunk}), got {every}")
    if slots is None:  # every block of a full pool of pages, a block begun per lane, and
        # the two junctions a request holds (the prefix cache's law 14): a request of the
        # whole pool fits
        slots = -(-pages * page_size // every) + lanes + 2
    slots = arguments.integer(_WHERE, "snapshots", slots, least=1)
    return every, slots


def _pools(told: Groups, groups: Groups, pages: Any, page_size: int, longest: int | None
           ) -> list[int]:
    """Each group's pool (law 5): ``pages`` for each, or ``pages[window]`` for each window
    ``told``; refused where a sliding window's pool cannot hold one window, or one request of
    ``longest`` tokens where that is fewer pages. A window kept as full (the groups' law 4)
    holds what the full group holds, and takes the smallest pool of those it joins."""
    if isinstance(pages, Mapping):
        if set(pages) != set(told.windows):
            raise ValueError(f"cacheidx.{_WHERE}: pages names the windows "
                             f"{sorted(pages, key=str)}; the groups' are "
                             f"{list(told.windows)}")
        counts = {w: arguments.integer(_WHERE, f"pages[{w}]", pages[w], least=0)
                  for w in told.windows}
    else:
        counts = dict.fromkeys(told.windows, arguments.integer(_WHERE, "pages", pages, least=0))
    for w, n in zip(told.windows, told.layers, strict=True):
        if w is None:
            continue
        need = window_pages(w, page_size)
        why = f"one window needs {need} (a token reads itself and the {w - 1} positions before it)"
        if longest is not None and -(-longest // page_size) < need:  # no request holds more
            need = -(-longest // page_size)
            why = f"a request of {longest} tokens, the most the engine holds, needs {need}"
        if counts[w] < need:
            layers = f"{n} layer{'s' * (n != 1)}"
            raise ValueError(f"cacheidx.{_WHERE}: the pool of the {layers} of window {w} has "
                             f"{counts[w]} pages of {page_size} tokens; {why}")
    return [min(c for w, c in counts.items()
                if w == g or (g is None and w not in groups.windows))
            for g in groups.windows]
