"""Who may run: the requests an engine can never serve, the queue of those waiting, and which
of them wait for a request still computing a prefix they share.

Laws, for a :class:`~cacheidx.prefix.PrefixCache` of pages of ``P`` tokens:

1. A request is refused when it is submitted, never queued, where it asks for more samples
   than :attr:`Admission.most_samples` (``MOST_SAMPLES``, 128: OpenAI's cap), holds a token id at or
   past the model's ``vocab``, needs more pages (its prompt and ``max_new_tokens - 1`` more
   positions) than the full group's pool has, more snapshot slots than the snapshot pool
   has (a hybrid's: its blocks of ``m`` and two junctions), or more tokens than the
   engine's ``context`` or the model's ``longest``: the first of these that holds is its
   reason. A request of ``n`` > 1 samples is refused too where the full group's pool
   cannot hold as many of its samples as run at once (``min(n, lanes)``), the prompt's
   whole pages (at most ``(len(prompt) - 1) // P``) counted once with the cache on (the
   scheduler's law 6), once per sample without.
2. The queue is in submission order, each waiting request under its number in the queue (a
   count), never under the identity of an object: taking one out takes exactly that one. A
   request of ``n`` samples is one entry, whatever ``n``, its
   :class:`~cacheidx.serve.batches.Samples` counting those started; it leaves the queue
   when its last sample starts. Admission reads the queue in place, oldest first, and stops
   at the first request that fits nowhere: a step's admission costs the entries it reads,
   never a copy of the queue.
3. A request is held back (the scheduler's law 2) while a request still computing its
   prompt shares more whole pages with it than the cache holds of it now (counting at most
   ``(len(prompt) - 1) // P``, as ``match`` caps) and will cache them. With sliding groups
   (the scheduler's law 5) it will only where it keeps those pages' windows
   (:meth:`Admission.keeps`: they start at or past the reach of its last chunk), or where,
   told to keep them (``PrefixCache.keep``), its pools have room.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ..prefix.cache import PrefixCache
from ..prefix.reach import first_page, hit_pages
from .batches import Lane, Samples
from .requests import MOST_SAMPLES, Request, Result

__all__ = ["Admission"]


class Admission:
    """The waiting requests of a scheduler over ``cache`` whose calls compute at most
    ``chunk`` prompt tokens, and the limits it refuses requests by: the engine's
    ``context`` and the model's ``vocab`` and ``longest``, where given, and (for a request
    of several samples) its ``lanes`` and whether it reads the cache (``reuse``)."""

    #: the most samples a request may ask for (law 1)
    most_samples: int = MOST_SAMPLES

    def __init__(self, cache: PrefixCache, *, chunk: int, context: int | None = None,
                 vocab: int | None = None, longest: int | None = None, lanes: int = 1,
                 reuse: bool = True):
        self.cache, self.chunk, self.P = cache, chunk, cache.page_size
        self.context, self.vocab, self.longest = context, vocab, longest
        self.lanes, self.reuse = lanes, reuse
        windows = cache.windows
        self._sliding = [w for w in windows if w is not None]
        self._full = windows.index(None) if None in windows else None
        self._several = len(windows) > 1
        # law 2: in submission order
        self._queue: dict[int, tuple[Request, Result, Samples | None]] = {}
        self._numbers = itertools.count()

    # -- law 1 --------------------------------------------------------------------------------
    def refusal(self, request: Request) -> str | None:
        """Why this engine can never serve ``request`` (law 1), or ``None``."""
        if request.n > self.most_samples:
            return (f"request {request.id!r} asks for n={request.n} samples; the engine serves "
                    f"at most {self.most_samples} a request")
        total = len(request.prompt) + request.max_new_tokens - 1
        need = self.cache.pages_for(total)
        what = (f"({len(request.prompt)} prompt tokens and up to {request.max_new_tokens} new "
                f"ones)")
        if self.vocab is not None and max(request.prompt) >= self.vocab:
            at = next(k for k, t in enumerate(request.prompt) if t >= self.vocab)
            return (f"request {request.id!r} holds token id {request.prompt[at]} at prompt "
                    f"position {at}; the model's vocabulary is ids 0 to {self.vocab - 1}")
        if self._full is not None and need > self.cache.group(self._full).capacity:
            pool = "pool of the full layers" if self._several else "pool"
            return (f"request {request.id!r} needs {need} pages of {self.P} tokens {what}; the "
                    f"{pool} has {self.cache.group(self._full).capacity}")
        if self.cache.every is not None:  # the snapshot slots it holds (prefix law 11, 14)
            why = self.cache.too_large(total)
            if why is not None:
                return f"request {request.id!r} {what}: {why}"
        if self.context is not None and total > self.context:
            return (f"request {request.id!r} holds {total} tokens {what}; the engine's context "
                    f"is {self.context}")
        if self.longest is not None and total > self.longest:
            return (f"request {request.id!r} holds {total} tokens {what}; the model's context "
                    f"is {self.longest}")
        at_once = min(request.n, self.lanes)
        if self._full is not None and at_once > 1:
            shared = (len(request.prompt) - 1) // self.P if self.reuse else 0
            most = need + (at_once - 1) * (need - shared)
            capacity = self.cache.group(self._full).capacity
            if most > capacity:
                pool = "pool of the full layers" if self._several else "pool"
                runs = f"{at_once} of its {request.n}" if at_once < request.n else f"its {at_once}"
                how = (f"{shared} of them the prompt's whole pages, shared" if self.reuse
                       else "none shared (the cache is off)")
                return (f"request {request.id!r} needs {most} pages of {self.P} tokens for "
                        f"{runs} samples at once: {need} each {what}, {how}; the {pool} has "
                        f"{capacity}")
        return None

    # -- law 2 --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._queue)

    def queue(self, request: Request, result: Result, samples: Samples | None = None) -> int:
        """``request``, answered by ``result`` (its samples counted by ``samples``, for
        ``n`` > 1), waits behind every request queued before it; returns its number."""
        number = next(self._numbers)
        self._queue[number] = (request, result, samples)
        return number

    def entries(self) -> Any:
        """The queue itself, read in place, oldest first: ``number -> (request, result,
        samples)`` (take none out while reading it)."""
        return self._queue.items()

    def waiting(self) -> list[tuple[int, Request, Result]]:
        """The waiting requests, oldest first, each with its number and its result (a copy:
        taking one out while reading it is safe)."""
        return [(n, request, result) for n, (request, result, _) in self._queue.items()]

    def take(self, number: int) -> None:
        """Request ``number`` is admitted (its last sample): it waits no more."""
        del self._queue[number]

    # -- law 3 --------------------------------------------------------------------------------
    def held_back(self, data: np.ndarray, computing: list[Lane]) -> bool:
        """Law 3: whether the request of prompt ``data`` waits for one of ``computing`` (the
        running requests still computing their prompts)."""
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
            if depth > cached and (self.keeps(lane, depth)
                                   or self.cache.keep(lane.hold, depth)):
                return True
        return False

    def keeps(self, lane: Lane, depth: int) -> bool:
        """Law 3: whether ``lane``, computing its prompt, will cache the windows a hit at
        ``depth`` pages needs: those from the reach of its last chunk on."""
        if not self._sliding:
            return True
        n = len(lane.data)
        last = n - ((n - lane.done - 1) % self.chunk + 1)  # where its last chunk starts
        end = max(0, n // self.P - 1)  # insert keeps a hit's window at its end, or one short
        return all(hit_pages(w, depth, self.P).start
                   >= max(first_page(w, last, self.P), hit_pages(w, end, self.P).start)
                   for w in self._sliding)
