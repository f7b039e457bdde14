"""Continuous batching on the host: which requests run, which tokens each call computes, and
where they sit. No arrays of a framework here: a call is a :class:`Batch` of NumPy arrays, and
whatever computes it (``cacheidx.serve.step``, or a simulation) hands back one token per lane.

Laws, for a :class:`~cacheidx.prefix.PrefixCache` of pages of ``P`` tokens:

1. A request is admitted, oldest first, while a row of the table is free and the cache can
   give it pages for its prompt and ``max_new_tokens - 1`` more positions (the last token is
   never fed back); it reads its cached prefix and computes the rest. A request that the
   whole pool could not hold, longer than ``context`` tokens where that is given or than
   the model's ``longest``, or holding a token id at or past the model's ``vocab``, fails at
   once, with the reason in its result.
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
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from ..prefix.cache import Hold, PrefixCache
from ..prefix.reach import first_page, hit_pages, largest_call
from .requests import Request, Result

__all__ = ["Batch", "Lane", "Scheduler"]


@dataclasses.dataclass(eq=False)
class Lane:
    """A running request: its pages, its row of the table, how much of its prompt is
    computed (``done``, its cached tokens at first)."""

    request: Request
    result: Result
    hold: Hold
    row: int
    done: int
    data: np.ndarray = dataclasses.field(repr=False)  #: the prompt, int64

    @property
    def prefilling(self) -> bool:
        return self.done < len(self.request.prompt)

    @property
    def position(self) -> int:
        """The position of the token a decode call feeds: its last generated one."""
        return len(self.request.prompt) + len(self.result.tokens) - 1


@dataclasses.dataclass(frozen=True, eq=False)
class Batch:
    """One call: lane ``b`` is the request in row ``rows[b]`` of the table, computing
    ``tokens[b]`` at positions ``pos[b]`` (-1 for left padding). ``columns`` is how many
    columns of the table the call reads. ``follows``: a decode call over the same lanes as
    the previous decode call, each one token on, fed the tokens that call chose."""

    kind: str  #: "prefill" or "decode"
    lanes: tuple[Lane, ...]
    rows: np.ndarray
    pos: np.ndarray
    tokens: np.ndarray
    columns: int
    follows: bool = False

    def alone(self, b: int) -> Batch:
        """The call of lane ``b`` alone, fed from the host."""
        pos = self.pos[b : b + 1]
        return Batch(self.kind, (self.lanes[b],), self.rows[b : b + 1], pos,
                     self.tokens[b : b + 1], int(pos.max()) + 1)


class Scheduler:
    """Admission, calls and bookkeeping over ``cache`` for at most ``lanes`` requests at once
    (see the module's laws). ``reuse=False`` never reads nor fills the cache: every prompt
    is computed whole."""

    def __init__(self, cache: PrefixCache, *, lanes: int, chunk: int, reuse: bool = True,
                 context: int | None = None, vocab: int | None = None,
                 longest: int | None = None):
        if lanes < 1 or chunk < 1 or (context is not None and context < 1):
            raise ValueError(f"cacheidx.serve.Scheduler: lanes, chunk and context must be "
                             f"positive, got {lanes}, {chunk} and {context}")
        self.cache, self.lanes, self.reuse = cache, lanes, reuse
        self.context = context
        self.vocab, self.longest = vocab, longest  #: the model's limits, where it says them
        self.P = cache.page_size
        self.windows = cache.windows  #: each group's window (law 5)
        self._sliding = [g for g, w in enumerate(self.windows) if w is not None]
        self._full = self.windows.index(None) if None in self.windows else None
        fits = {g: largest_call(self.windows[g], cache.group(g).capacity, self.P)
                for g in self._sliding}
        for g, fit in fits.items():
            if fit < 1:
                raise ValueError(f"cacheidx.serve.Scheduler: the pool of window "
                                 f"{self.windows[g]} has {cache.group(g).capacity} pages of "
                                 f"{self.P} tokens, fewer than one window reads")
        self.chunk = min([chunk, *fits.values()])  #: prompt tokens a call computes at most
        #: per group, [lanes, width] slots of each row's positions, -1 where none: a power of
        #: two of pages, as wide as ``context`` from the start where given, else doubled
        pages = 1 if context is None else cache.pages_for(context)
        width = (1 << (pages - 1).bit_length()) * self.P
        self.tables = [np.full((lanes, width), -1, dtype=np.int64) for _ in self.windows]
        self.version = 0  #: bumped whenever a table changes
        self.versions = [0] * len(self.windows)  #: the same, per group
        self.peaks = [0] * len(self.windows)  #: the most pages in use at once, per group
        self.waiting: collections.deque[Result] = collections.deque()
        self._requests: dict[int, Request] = {}
        self.running: list[Lane] = []
        self._rows = list(range(lanes - 1, -1, -1))
        self._last_decode: tuple[Lane, ...] = ()
        self.rounds = 0  #: steps that admitted some request
        self.peak = 0  #: the most pages running requests held at once
        self.peak_used = 0  #: the most pages not free at once (an unbounded pool's need)
        self.prompt_tokens = self.computed_tokens = self.cached_tokens = 0
        self.generated_tokens = self.failed = self.served = 0

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def table(self) -> np.ndarray:
        """The first group's table (the only one without groups)."""
        return self.tables[0]

    # -- law 1: submission and admission ------------------------------------------------------
    def refusal(self, request: Request) -> str | None:
        """Why this engine can never serve ``request`` (law 1), or ``None``."""
        total = len(request.prompt) + request.max_new_tokens - 1
        need = self.cache.pages_for(total)
        what = (f"({len(request.prompt)} prompt tokens and up to {request.max_new_tokens} new "
                f"ones)")
        if self.vocab is not None and max(request.prompt) >= self.vocab:
            at = next(k for k, t in enumerate(request.prompt) if t >= self.vocab)
            return (f"request {request.id!r} holds token id {request.prompt[at]} at prompt "
                    f"position {at}; the model's vocabulary is ids 0 to {self.vocab - 1}")
        if self._full is not None and need > self.cache.group(self._full).capacity:
            pool = "pool" if len(self.windows) == 1 else "pool of the full layers"
            return (f"request {request.id!r} needs {need} pages of {self.P} tokens {what}; the "
                    f"{pool} has {self.cache.group(self._full).capacity}")
        if self.context is not None and total > self.context:
            return (f"request {request.id!r} holds {total} tokens {what}; the engine's context "
                    f"is {self.context}")
        if self.longest is not None and total > self.longest:
            return (f"request {request.id!r} holds {total} tokens {what}; the model's context "
                    f"is {self.longest}")
        return None

    def submit(self, request: Request, now: float, ticket: int = -1) -> Result | None:
        """Queues ``request``; returns its failed result at once if the engine can never
        serve it (:meth:`refusal`)."""
        result = Result(request.id, list(request.prompt), arrival=request.arrival, ticket=ticket)
        result.error = self.refusal(request)
        if result.error is not None:
            result.finished = now
            self.failed += 1
            return result
        self._requests[id(result)] = request
        self.waiting.append(result)
        return None

    def admit(self, now: float) -> list[Lane]:
        """Admits waiting requests in order while rows and pages allow (law 1), passing over
        those law 2 holds back."""
        admitted: list[Lane] = []
        computing = [lane for lane in self.running if lane.prefilling]
        for result in list(self.waiting):
            if not self._rows:
                break
            request = self._requests[id(result)]
            data = np.asarray(request.prompt, dtype=np.int64)
            if self.reuse and self._held_back(data, computing):
                continue
            total = len(data) + request.max_new_tokens - 1
            hold = self.cache.admit(data, total, reuse=self.reuse,  # submit checked the size
                                    call=self.chunk)
            if hold is None:
                break  # the oldest request that fits nowhere yet waits; so do the younger
            self.waiting.remove(result)
            del self._requests[id(result)]
            lane = Lane(request, result, hold, self._rows.pop(), hold.cached, data)
            self._place(lane)
            result.admitted = now
            result.cached_tokens = hold.cached
            self.cached_tokens += hold.cached
            self.prompt_tokens += len(data)
            self.running.append(lane)
            computing.append(lane)
            admitted.append(lane)
        if admitted:
            self.rounds += 1
            self._used()
        return admitted

    def _held_back(self, data: np.ndarray, computing: list[Lane]) -> bool:
        """Law 2: a request computing its prompt will cache more of this one's pages than the
        cache holds now."""
        if not computing:
            return False
        cached = self.cache.match(data).tokens // self.P
        most = (len(data) - 1) // self.P
        if cached >= most:
            return False
        for lane in computing:
            other = lane.data
            upto = min(most, len(other) // self.P) * self.P
            if upto <= cached * self.P:
                continue
            differ = np.flatnonzero(data[:upto] != other[:upto])
            same = int(differ[0]) if differ.size else upto
            depth = same // self.P
            if depth > cached and (self._keeps(lane, depth)
                                   or self.cache.keep(lane.hold, depth)):
                return True
        return False

    def _keeps(self, lane: Lane, depth: int) -> bool:
        """Law 5: whether ``lane``, computing its prompt, will cache the windows a hit at
        ``depth`` pages needs: those from the reach of its last chunk on."""
        if not self._sliding:
            return True
        n = len(lane.data)
        last = n - ((n - lane.done - 1) % self.chunk + 1)  # where its last chunk starts
        end = max(0, n // self.P - 1)  # insert keeps a hit's window at its end, or one short
        return all(hit_pages(w, depth, self.P).start
                   >= max(first_page(w, last, self.P), hit_pages(w, end, self.P).start)
                   for w in (self.windows[g] for g in self._sliding))

    def _place(self, lane: Lane) -> None:
        size = len(lane.hold.pages) * self.P
        if size > self.table.shape[1]:
            width = self.table.shape[1]
            while width < size:
                width *= 2
            for g, table in enumerate(self.tables):
                grown = np.full((self.lanes, width), -1, dtype=np.int64)
                grown[:, : table.shape[1]] = table
                self.tables[g] = grown
        tables = lane.hold.tables or [lane.hold.pages]
        for g, table in enumerate(self.tables):
            pages = np.asarray(tables[g], dtype=np.int64)
            slots = pages[:, None] * self.P + np.arange(self.P)
            table[lane.row] = -1
            table[lane.row, :size] = np.where(pages[:, None] >= 0, slots, -1).reshape(-1)
            self.versions[g] += 1
        self.version += 1

    def _slide(self, lanes: tuple[Lane, ...], pos: np.ndarray) -> None:
        """Law 5: before a call of ``lanes`` at positions ``pos`` (-1: padding), each sliding
        group's rows give back the pages below the call's reach and take its positions'."""
        if not self._sliding:
            return
        P, span = self.P, np.arange(self.P)
        for lane, p in zip(lanes, pos):
            fed = p[p >= 0]
            for g, low, new_low, top, new_top in self.cache.slide(lane.hold, int(fed[0]),
                                                                   int(fed[-1])):
                table = self.tables[g]
                table[lane.row, low * P : new_low * P] = -1
                start = max(top, new_low)
                pages = np.asarray(lane.hold.tables[g][start:new_top], dtype=np.int64)
                table[lane.row, start * P : new_top * P] = (pages[:, None] * P
                                                            + span).reshape(-1)
                self.versions[g] += 1
                self.version += 1
        self._used()

    # -- law 3: the calls ---------------------------------------------------------------------
    def prefill(self) -> Batch | None:
        """The prefill call: up to ``chunk`` more prompt tokens of every request in its prompt."""
        lanes = tuple(lane for lane in self.running if lane.prefilling)
        if not lanes:
            return None
        counts = [min(self.chunk, len(lane.data) - lane.done) for lane in lanes]
        seq = max(counts)
        pos = np.full((len(lanes), seq), -1, dtype=np.int64)
        tokens = np.zeros((len(lanes), seq), dtype=np.int64)
        for b, (lane, n) in enumerate(zip(lanes, counts)):
            pos[b, seq - n :] = np.arange(lane.done, lane.done + n)
            tokens[b, seq - n :] = lane.data[lane.done : lane.done + n]
        rows = np.asarray([lane.row for lane in lanes], dtype=np.int64)
        columns = max(lane.done + n for lane, n in zip(lanes, counts))
        self._slide(lanes, pos)
        return Batch("prefill", lanes, rows, pos, tokens, columns)

    def decode(self) -> Batch | None:
        """The decode call: every running request past its prompt, fed its last token."""
        lanes = tuple(lane for lane in self.running if not lane.prefilling)
        if not lanes:
            self._last_decode = ()
            return None
        pos = np.asarray([[lane.position] for lane in lanes], dtype=np.int64)
        tokens = np.asarray([[lane.result.tokens[-1]] for lane in lanes], dtype=np.int64)
        rows = np.asarray([lane.row for lane in lanes], dtype=np.int64)
        follows = lanes == self._last_decode
        self._last_decode = lanes
        self._slide(lanes, pos)
        return Batch("decode", lanes, rows, pos, tokens, int(pos.max()) + 1, follows)

    # -- law 4: what a call's tokens do -------------------------------------------------------
    def after(self, batch: Batch, chosen: np.ndarray, logits: np.ndarray | None,
              now: float) -> list[Result]:
        """Records the token each lane of ``batch`` chose (``chosen[b]``, with its ``logits``
        where kept); returns the results of the requests that finished."""
        finished = []
        for b, lane in enumerate(batch.lanes):
            if batch.kind == "prefill":
                n = int((batch.pos[b] >= 0).sum())
                lane.done += n
                lane.result.computed_tokens += n
                self.computed_tokens += n
                if lane.prefilling:
                    continue
                lane.result.first_token = now
                if self.reuse:
                    self.cache.insert(lane.hold, lane.data)
            token = int(chosen[b])
            lane.result.tokens.append(token)
            if logits is not None:
                lane.result.last_logits = np.asarray(logits[b], dtype=np.float32)
            self.generated_tokens += 1
            if token in lane.request.stop or len(lane.result.tokens) >= lane.request.max_new_tokens:
                finished.append(self._finish(lane, now))
        return finished

    def fail(self, lane: Lane, error: str, now: float) -> Result:
        """Law 4: the running request of ``lane`` fails with ``error``: what its last call
        wrote is cached for no one, its hold is released, its row cleared. Returns its
        result."""
        self.cache.release(lane.hold)
        self._clear(lane, now)
        lane.result.error = error
        self.failed += 1
        return lane.result

    def fed_from_host(self) -> None:
        """The next decode call is fed from the host, never from a call that may have failed."""
        self._last_decode = ()

    def _used(self) -> None:
        self.peak = max(self.peak, self.cache.in_use)
        self.peak_used = max(self.peak_used, self.cache.capacity - self.cache.free)
        if len(self.windows) > 1 or self._sliding:
            for g in range(len(self.windows)):
                self.peaks[g] = max(self.peaks[g], self.cache.group(g).in_use)

    def _finish(self, lane: Lane, now: float) -> Result:
        if self.reuse:  # the pages filled while decoding: every token but the last is written
            written = np.concatenate([lane.data, np.asarray(lane.result.tokens[:-1], np.int64)])
            self.cache.insert(lane.hold, written)
        self.cache.release(lane.hold)
        self._clear(lane, now)
        self.served += 1
        return lane.result

    def _clear(self, lane: Lane, now: float) -> None:
        """The lane's request stops running: its row is free again."""
        self._used()
        self.running.remove(lane)
        for g, table in enumerate(self.tables):
            table[lane.row] = -1
            self.versions[g] += 1
        self.version += 1
        self._rows.append(lane.row)
        lane.result.finished = now

    def figures(self) -> dict:
        """Tokens and pages so far (with groups, also each group's pages: ``"groups"``)."""
        prompt = self.prompt_tokens
        out = {
            "requests": self.served + self.failed,
            "failed": self.failed,
            "prompt_tokens": prompt,
            "computed_tokens": self.computed_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": round(self.cached_tokens / prompt, 4) if prompt else 0.0,
            "generated_tokens": self.generated_tokens,
            "pages": self.cache.capacity,
            "page_size": self.P,
            "peak_pages_in_use": self.peak,
            "peak_pages_used": self.peak_used,
            "pages_cached": self.cache.cached,
            "evictions": self.cache.evictions,
            "admission_rounds": self.rounds,
            "chunk": self.chunk,
        }
        if len(self.windows) > 1 or self._sliding:
            out["groups"] = [{"window": w, "pages": self.cache.group(g).capacity,
                              "peak_pages_in_use": self.peaks[g],
                              "pages_cached": self.cache.group(g).cached}
                             for g, w in enumerate(self.windows)]
        return out
