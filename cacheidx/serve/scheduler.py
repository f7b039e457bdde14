"""Continuous batching on the host: which requests run, which tokens each call computes, and
where they sit. No arrays of a framework here: a call is a :class:`Batch` of NumPy arrays, and
whatever computes it (``cacheidx.serve.step``, or a simulation) hands back one token per lane.

The scheduler joins four rooms, each a module stating its own laws: :mod:`.admission` (who
may run), :mod:`.tables` (where the running requests' positions sit), :mod:`.batches` (what a
call computes) and :mod:`.statistics` (what is counted). Laws, for a
:class:`~cacheidx.prefix.PrefixCache` of pages of ``P`` tokens:

1. A request is admitted, oldest first, while a row of the table is free and the cache can
   give it pages for its prompt and ``max_new_tokens - 1`` more positions (the last token is
   never fed back); it reads its cached prefix and computes the rest. A request the engine
   can never serve (the admission's law 1: the whole pool, ``context``, the model's
   ``longest`` or ``vocab``) fails at once, with the reason in its result.
2. With the cache on, a request waits while a request still computing its prompt will
   cache pages it could read (more whole pages in common than the cache holds now): a
   prefix is computed once, then read, however the requests arrive.
3. Each step is at most two calls: one prefill call computing up to ``chunk`` more prompt
   tokens of every request still in its prompt, left padded; one decode call feeding every
   other running request its last token. Row ``r`` of :attr:`Scheduler.table` is the slots
   of the request in row ``r``: page ``k`` holds its positions ``k*P`` to ``k*P + P - 1``.
4. A request's prompt pages are cached once its prompt is computed; when it finishes (a stop
   token, or ``max_new_tokens``) the pages it filled while decoding are cached too and its
   hold is released, its row cleared. A request that fails while running (:meth:`fail`)
   caches nothing more: its hold is released, its row cleared, its error in its result.
5. Groups of layers (the cache's ``windows``, :mod:`cacheidx.serve.groups`): one table per
   group, :attr:`Scheduler.tables`, each row over its group's pool. Before each call, a
   sliding group's row gives back the pages wholly below the call's reach (their columns
   become -1) and takes pages for the call's positions (``PrefixCache.slide``), so a request
   holds at most ``ceil((chunk + w - 2) / P) + 1`` pages there, whatever its length. The
   chunk is cut so that a call fits each sliding group's pool (``reach.largest_call``): a
   prompt longer than the pool still runs. Law 1's pages are the full group's (none without
   one); law 2 holds a request back only for pages whose windows the computing request will
   keep: its prompt's last window, or the window where the two part, which it is then told to
   keep (``PrefixCache.keep``) where its pools have room.
6. Parallel samples (``Request(..., n=N)``): a request of ``N`` > 1 samples is queued
   once, and admitted as ``N`` requests of its prompt, one after the other, each a lane of
   its own row and pages, sample ``k``'s result made as it starts
   (:class:`~cacheidx.serve.batches.Samples`): the queue, the results and the lanes grow
   with the samples running, never with ``N`` up front. With the cache on, law 2 holds the later
   samples back while the first computes the prompt; admitted then, each reads the prompt's
   whole pages from the cache (``match``'s ``(len(prompt) - 1) // P``) and computes only
   the tokens past them, 1 to ``P``, into a page of its own: so a page is never written by
   two lanes, and a sample's own pages begin at the page where its continuation begins.
   The prompt's whole pages are computed once (``computed_tokens`` is the prompt plus those
   tokens of each later sample); a prompt of at most ``P`` tokens has no whole page to
   share, and each sample computes it. Without the cache (``reuse=False``) nothing is
   shared: each sample computes the prompt whole. The request ends when its last sample
   ends; its result gathers the samples' (:class:`~cacheidx.serve.requests.Result`), and
   it is counted once, failed if a sample failed (its other samples run to their end).
   With sliding groups the samples share as law 5 lets requests share a prefix.
7. Recurrent layers (the cache's snapshots every ``m`` positions, :mod:`cacheidx.prefix.states`):
   a request holds a snapshot slot per block of its tokens, named by row ``r`` of
   :attr:`Scheduler.blocks`; a hit resumes at a block's end whose snapshot is cached. A
   model whose recurrent kernels give the state after a call's last token alone
   (``aligned``) has its prefill chunks end at block ends (the batches' law 1), and one
   whose kernels cannot start a lane from a state behind padding (``lanes_per_prefill``)
   has that many lanes at most in a prefill call, the oldest first. A request's junction
   (the prefix cache's law 14): its prefill ends a call at its prompt's last whole page
   before its last token, and each call whose lane's last token closes a page (no block's
   end) copies that lane's running state into its junction slot (``Batch.keeps``); a hit
   that ends at a junction copies it into the lane's running slot before its first call
   (``Batch.resumes``).
8. What a token does (:mod:`cacheidx.serve.sampling`): a lane whose request asks for
   log-probabilities records one :class:`~cacheidx.serve.sampling.Logprob` per token, of
   the call's logits (the sampling's law 5). A sample ends at a stop token (kept), at the
   token after which its detokenized continuation holds a stop string (with
   ``detokenize``; the sampling's law 6), or at ``max_new_tokens``; its ``finish_reason``
   says which (``"stop"``, ``"length"``), and with ``detokenize`` its ``text`` is its
   continuation's, less a last stop token, cut before the first stop string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ..prefix.cache import PrefixCache
from ..prefix.reach import largest_call
from . import batches
from .admission import Admission
from .batches import Batch, Lane, Samples
from .requests import Request, Result
from .sampling import cut, logprobs_of
from .statistics import Statistics
from .tables import SlotTables
from .text import Text

__all__ = ["Batch", "Lane", "Scheduler"]


def _part(part: str, name: str) -> property:
    """A read-only attribute of the scheduler: ``name`` of the room ``part`` that holds it."""
    return property(lambda self: getattr(getattr(self, part), name),
                    doc=f"The scheduler's ``{part}.{name}``.")


class Scheduler:
    """Admission, calls and bookkeeping over ``cache`` for at most ``lanes`` requests at once
    (see the module's laws). ``reuse=False`` never reads nor fills the cache: every prompt
    is computed whole.

    Its rooms: ``admission`` (:class:`~cacheidx.serve.admission.Admission`), ``slots``
    (:class:`~cacheidx.serve.tables.SlotTables`), ``stats``
    (:class:`~cacheidx.serve.statistics.Statistics`); their counts and tables read through
    the scheduler's own names too (``tables``, ``version``, ``computed_tokens``, ...)."""

    def __init__(self, cache: PrefixCache, *, lanes: int, chunk: int, reuse: bool = True,
                 context: int | None = None, vocab: int | None = None,
                 longest: int | None = None, aligned: bool = False,
                 lanes_per_prefill: int | None = None,
                 detokenize: Callable[[list[int]], str] | None = None):
        if lanes < 1 or chunk < 1 or (context is not None and context < 1):
            raise ValueError(f"cacheidx.serve.Scheduler: lanes, chunk and context must be "
                             f"positive, got {lanes}, {chunk} and {context}")
        self.cache, self.lanes, self.reuse = cache, lanes, reuse
        self.P = cache.page_size
        self.windows = cache.windows  #: each group's window (law 5)
        self._sliding = [g for g, w in enumerate(self.windows) if w is not None]
        fits = {g: largest_call(self.windows[g], cache.group(g).capacity, self.P)
                for g in self._sliding}
        for g, fit in fits.items():
            if fit < 1:
                raise ValueError(f"cacheidx.serve.Scheduler: the pool of window "
                                 f"{self.windows[g]} has {cache.group(g).capacity} pages of "
                                 f"{self.P} tokens, fewer than one window reads")
        self.chunk = min([chunk, *fits.values()])  #: prompt tokens a call computes at most
        self.admission = Admission(cache, chunk=self.chunk, context=context, vocab=vocab,
                                   longest=longest, lanes=lanes, reuse=reuse)
        # as wide as ``context`` from the start where given, so the table never grows
        self.slots = SlotTables(len(self.windows), lanes, self.P,
                                1 if context is None else cache.pages_for(context),
                                every=cache.every)
        #: law 7: the block prefill chunks end at, and the most lanes of a prefill call
        self.align = cache.every if aligned else None
        self.lanes_per_prefill = lanes_per_prefill
        self.stats = Statistics(self.windows)
        self.running: list[Lane] = []
        self._last_decode: tuple[Lane, ...] = ()
        #: token ids to text, for stop strings and results' text (law 8); None: neither
        self.detokenize = detokenize

    context = _part("admission", "context")
    vocab = _part("admission", "vocab")  #: the model's limits, where it says them
    longest = _part("admission", "longest")
    tables = _part("slots", "tables")
    blocks = _part("slots", "blocks")
    blocks_version = _part("slots", "blocks_version")
    version = _part("slots", "version")
    versions = _part("slots", "versions")
    rounds = _part("stats", "rounds")
    peak = _part("stats", "peak")
    peak_used = _part("stats", "peak_used")
    peaks = _part("stats", "peaks")
    prompt_tokens = _part("stats", "prompt_tokens")
    computed_tokens = _part("stats", "computed_tokens")
    cached_tokens = _part("stats", "cached_tokens")
    generated_tokens = _part("stats", "generated_tokens")
    failed = _part("stats", "failed")
    served = _part("stats", "served")

    @property
    def busy(self) -> bool:
        return bool(len(self.admission) or self.running)

    @property
    def waiting(self) -> tuple[Result, ...]:
        """The results of the waiting requests, oldest first (a request of several samples
        once, while one of them waits)."""
        return tuple(result for _, (_, result, _) in self.admission.entries())

    @property
    def table(self) -> np.ndarray:
        """The first group's table (the only one without groups)."""
        return self.slots.tables[0]

    # -- law 1: submission and admission ------------------------------------------------------
    def refusal(self, request: Request) -> str | None:
        """Why this engine can never serve ``request`` (law 1), or ``None``."""
        return self.admission.refusal(request)

    def submit(self, request: Request, now: float, ticket: int = -1) -> Result | None:
        """Queues ``request`` (of ``n`` samples: one entry, ``n`` lanes as they start, law 6);
        returns its failed result at once if the engine can never serve it
        (:meth:`refusal`)."""
        result = Result(request.id, list(request.prompt), arrival=request.arrival, ticket=ticket,
                        n=request.n)
        result.error = self.refusal(request)  # first: nothing is made of a refused n
        if result.error is not None:
            if 1 < request.n <= self.admission.most_samples:  # n empty samples, as promised
                result.tokens = [[] for _ in range(request.n)]
            result.finished = now
            self.stats.failed += 1
            return result
        if request.sampling is not None and request.sampling.logprobs is not None:
            result.logprobs = []
        samples = Samples(result, request.n) if request.n > 1 else None
        self.admission.queue(request, result, samples)
        return None

    def admit(self, now: float) -> list[Lane]:
        """Admits waiting requests in order while rows and pages allow (law 1), passing over
        those law 2 holds back; a request of several samples admits them one at a time (law
        6). Reads the queue in place, to the first request that fits nowhere (the
        admission's law 2)."""
        admitted: list[Lane] = []
        computing = [lane for lane in self.running if lane.prefilling]
        taken: list[int] = []
        full = False
        for number, (request, result, samples) in self.admission.entries():
            data = None
            while samples is None or samples.started < samples.n:
                if not self.slots.free:
                    full = True
                    break
                if data is None:
                    data = np.asarray(request.prompt, dtype=np.int64)
                if self.reuse and self.admission.held_back(data, computing):
                    break  # its later samples are held back as well
                total = len(data) + request.max_new_tokens - 1
                hold = self.cache.admit(data, total, reuse=self.reuse,  # submit checked it
                                        call=self.chunk)
                if hold is None:
                    full = True  # the oldest request that fits nowhere yet waits; so do
                    break        # the younger
                k, part = (0, result) if samples is None else samples.start(request)
                lane = Lane(request, part, hold, self.slots.take(), hold.cached, data,
                            samples, k)
                if self.cache.every is not None:
                    lane.resume = hold.groups[-1].resume
                self._place(lane)
                part.admitted = now
                part.cached_tokens = hold.cached
                self.stats.cached_tokens += hold.cached
                self.stats.prompt_tokens += len(data)
                self.running.append(lane)
                computing.append(lane)
                admitted.append(lane)
                if samples is None:
                    taken.append(number)
                    break
            if samples is not None and samples.started == samples.n:
                taken.append(number)
            if full:
                break
        for number in taken:
            self.admission.take(number)
        if admitted:
            self.stats.rounds += 1
            self.stats.used(self.cache)
        return admitted

    def _place(self, lane: Lane) -> None:
        blocks = lane.hold.groups[-1].table if self.cache.every is not None else None
        self.slots.place(lane.row, lane.hold.tables or [lane.hold.pages], blocks)

    def _slide(self, lanes: tuple[Lane, ...], pos: np.ndarray) -> None:
        """Law 5: before a call of ``lanes`` at positions ``pos`` (-1: padding), each sliding
        group's rows give back the pages below the call's reach and take its positions'."""
        if not self._sliding:
            return
        for lane, p in zip(lanes, pos):
            fed = p[p >= 0]
            for g, low, new_low, top, new_top in self.cache.slide(lane.hold, int(fed[0]),
                                                                   int(fed[-1])):
                self.slots.slide(lane.row, g, low, new_low, top, new_top, lane.hold.tables[g])
        self.stats.used(self.cache)

    # -- law 3: the calls ---------------------------------------------------------------------
    def prefill(self) -> Batch | None:
        """The prefill call: up to ``chunk`` more prompt tokens of every request in its prompt."""
        lanes = tuple(lane for lane in self.running if lane.prefilling)
        if not lanes:
            return None
        lanes = lanes[: self.lanes_per_prefill]  # law 7 (None: every lane)
        states = self.cache.every is not None
        batch = batches.prefill(lanes, self.chunk, self.align, self.P if states else None)
        self._slide(lanes, batch.pos)
        return self._junctions(batch) if states else batch

    def decode(self) -> Batch | None:
        """The decode call: every running request past its prompt, fed its last token."""
        lanes = tuple(lane for lane in self.running if not lane.prefilling)
        if not lanes:
            self._last_decode = ()
            return None
        # the same Lane objects (one per admission), not the same rows: a row freed and
        # taken again between two calls holds another request
        follows = lanes == self._last_decode
        self._last_decode = lanes
        batch = batches.decode(lanes, follows)
        self._slide(lanes, batch.pos)
        return self._junctions(batch) if self.cache.every is not None else batch

    def _junctions(self, batch: Batch) -> Batch:
        """Law 7's copies of recurrent state: a lane's resume before its first call, and its
        junction after a call whose last token closes a page."""
        resumes, keeps = [], []
        for lane, pos in zip(batch.lanes, batch.pos):
            if lane.resume >= 0:
                resumes.append((lane.row, lane.resume))
                lane.resume = -1
            end = int(pos.max()) + 1
            if end % self.P == 0:
                slot = self.cache.mark(lane.hold, end // self.P - 1)
                if slot >= 0:
                    keeps.append((lane.row, slot))
        return dataclasses.replace(batch, resumes=tuple(resumes), keeps=tuple(keeps))

    # -- law 4: what a call's tokens do -------------------------------------------------------
    def after(self, batch: Batch, chosen: np.ndarray, logits: np.ndarray | None,
              now: float) -> list[Result]:
        """Records the token each lane of ``batch`` chose (``chosen[b]``, with its ``logits``
        where kept); returns the results of the requests that finished (a request of several
        samples once its last one did, law 6)."""
        finished = []
        for b, lane in enumerate(batch.lanes):
            if batch.kind == "prefill":
                n = int((batch.pos[b] >= 0).sum())
                lane.done += n
                lane.result.computed_tokens += n
                self.stats.computed_tokens += n
                if lane.prefilling:
                    continue
                lane.result.first_token = now
                if self.reuse:
                    self.cache.insert(lane.hold, lane.data)
            token = int(chosen[b])
            result, asks = lane.result, lane.request.sampling
            result.tokens.append(token)
            if logits is not None:
                lane.result.last_logits = np.asarray(logits[b], dtype=np.float32)
            self.stats.generated_tokens += 1
            if result.logprobs is not None:  # law 8: the sampling's law 5
                if logits is None:
                    ended = self.fail(lane, "the engine's executor gave no logits for its "
                                      "log-probabilities", now)
                    if ended is not None:
                        finished.append(ended)
                    continue
                result.logprobs.append(logprobs_of(logits[b], token, asks.logprobs))
            reason = self._ends(lane, token)
            if reason is not None:
                result.finish_reason = reason
                ended = self._finish(lane, now)
                if ended is not None:
                    finished.append(ended)
        return finished

    def _ends(self, lane: Lane, token: int) -> str | None:
        """Law 8: why ``lane`` ends with ``token`` (``"stop"``: a stop token, or its
        continuation's text holds a stop string; ``"length"``: its ``max_new_tokens``), or
        ``None``."""
        request, tokens = lane.request, lane.result.tokens
        if token in request.stop:
            return "stop"
        stops = request.sampling.stop if request.sampling is not None else ()
        if stops and self.detokenize is not None:  # read as it grows: linear, not quadratic
            if lane.text is None:
                lane.text = Text(self.detokenize, stops)
            if lane.text.extend(tokens[lane.text.fed:]):
                return "stop"
        return "length" if len(tokens) >= request.max_new_tokens else None

    def cancel(self, ticket: int, error: str, now: float) -> Result | None:
        """Law 4, for a caller: the request of ``ticket`` ends with ``error`` (its result's),
        whether it waits or runs, every sample of it. Its samples not started leave the
        queue and never start; its running lanes fail (:meth:`fail`: holds released, rows
        cleared). Returns its result, counted failed, once every sample of it has ended;
        ``None`` where the scheduler holds no such request."""
        gathered = None
        for number, (_, result, samples) in list(self.admission.entries()):
            if result.ticket != ticket:
                continue
            self.admission.take(number)
            result.error = error
            if samples is None:
                result.finished = now
                self.stats.failed += 1
                return result
            samples.drop()
            gathered = samples
            break
        out = None
        for lane in [lane for lane in self.running if lane.result.ticket == ticket]:
            if lane.samples is not None:
                lane.samples.result.error = error
            out = self.fail(lane, error, now) or out
        if out is None and gathered is not None and gathered.done:  # none of it running
            self.stats.failed += 1
            out = gathered.gather(now)
        return out

    def fail(self, lane: Lane, error: str, now: float) -> Result | None:
        """Law 4: the running request of ``lane`` fails with ``error``: what its last call
        wrote is cached for no one, its hold is released, its row cleared. Returns its
        result; ``None`` for a sample whose request has samples still to end (law 6)."""
        self.cache.release(lane.hold)
        lane.result.error = error
        self._clear(lane, now)
        return self._ended(lane, now)

    def fed_from_host(self) -> None:
        """The next decode call is fed from the host, never from a call that may have failed."""
        self._last_decode = ()

    def _finish(self, lane: Lane, now: float) -> Result | None:
        if self.detokenize is not None:  # law 8: its text, cut before a stop string
            if lane.text is not None and lane.text.found >= 0:  # cut where _ends found it
                lane.result.text = lane.text.text
            else:
                tokens, request = lane.result.tokens, lane.request
                text = self.detokenize(tokens[:-1] if tokens[-1] in request.stop else tokens)
                stops = request.sampling.stop if request.sampling is not None else ()
                lane.result.text = cut(text, stops)[0] if stops else text
        if self.reuse:  # the pages filled while decoding: every token but the last is written
            written = np.concatenate([lane.data, np.asarray(lane.result.tokens[:-1], np.int64)])
            self.cache.insert(lane.hold, written)
        self.cache.release(lane.hold)
        self._clear(lane, now)
        return self._ended(lane, now)

    def _ended(self, lane: Lane, now: float) -> Result | None:
        """The lane ended (finished or failed): its request's result, counted once, where
        the request ended with it (law 6); ``None`` while samples of it are still to end."""
        result = lane.result
        if lane.samples is not None:
            lane.samples.ended += 1
            if not lane.samples.done:
                return None
            result = lane.samples.gather(now)
        if result.error is None:
            self.stats.served += 1
        else:
            self.stats.failed += 1
        return result

    def _clear(self, lane: Lane, now: float) -> None:
        """The lane's request stops running: its row is free again."""
        self.stats.used(self.cache)
        self.running.remove(lane)
        self.slots.clear(lane.row)
        lane.result.finished = now

    def figures(self) -> dict:
        """Tokens and pages so far (with groups, also each group's pages: ``"groups"``)."""
        return self.stats.figures(self.cache, self.chunk)
