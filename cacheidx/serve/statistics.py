"""The scheduler's counts: the tokens and requests it has seen, the most pages in use at once,
and the figures it reports (``Scheduler.figures``, which ``Engine.figures`` extends).

Laws, each count kept by the scheduler at one event and nowhere else:

1. A request is counted once, when it ends: ``served`` when it finishes, ``failed`` when it
   fails, when it is refused on submission included; ``requests`` is their sum. A request
   of ``n`` > 1 samples ends with its last sample, ``failed`` if one of them failed (the
   scheduler's law 6).
2. ``prompt_tokens`` and ``cached_tokens`` are counted when a request is admitted (its prompt,
   and what it read from the cache), a request of ``n`` > 1 samples once per sample, as
   each is admitted (its prompt ``n`` times, what its later samples read among the cached
   tokens); ``computed_tokens`` as each prefill call computes them;
   ``generated_tokens`` one per token a lane chooses; ``rounds`` one per step that admitted
   some request. ``hit_rate`` is ``cached_tokens / prompt_tokens`` (rounded to 4 places; 0.0
   before any prompt).
3. The peaks are the most pages seen at the moments pages are taken or change hands: after a
   step's admissions, after a call's sliding groups moved (:meth:`SlotTables.slide
   <cacheidx.serve.tables.SlotTables.slide>`) and when a request stops running. ``peak``:
   pages running requests hold; ``peak_used``: pages not free (what an unbounded pool would
   need); ``peaks[g]``: group ``g``'s pages in use, counted (and reported, ``"groups"``) only
   with several groups or a sliding one.
"""

from __future__ import annotations

import dataclasses

from ..prefix.cache import PrefixCache

__all__ = ["Statistics"]


@dataclasses.dataclass(eq=False)
class Statistics:
    """The counts of a scheduler over groups of ``windows`` (see the module's laws)."""

    windows: tuple[int | None, ...]
    rounds: int = 0  #: steps that admitted some request
    peak: int = 0  #: the most pages running requests held at once
    peak_used: int = 0  #: the most pages not free at once (an unbounded pool's need)
    peaks: list[int] = dataclasses.field(init=False)  #: pages in use at most, per group
    prompt_tokens: int = 0
    computed_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    failed: int = 0
    served: int = 0

    def __post_init__(self) -> None:
        self.peaks = [0] * len(self.windows)

    @property
    def grouped(self) -> bool:
        """Whether pages are counted per group too (law 3): several groups, or a sliding one."""
        return len(self.windows) > 1 or any(w is not None for w in self.windows)

    def used(self, cache: PrefixCache) -> None:
        """The peaks, now (law 3)."""
        self.peak = max(self.peak, cache.in_use)
        self.peak_used = max(self.peak_used, cache.capacity - cache.free)
        if self.grouped:
            for g in range(len(self.windows)):
                self.peaks[g] = max(self.peaks[g], cache.group(g).in_use)

    def figures(self, cache: PrefixCache, chunk: int) -> dict:
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
            "pages": cache.capacity,
            "page_size": cache.page_size,
            "peak_pages_in_use": self.peak,
            "peak_pages_used": self.peak_used,
            "pages_cached": cache.cached,
            "evictions": cache.evictions,
            "admission_rounds": self.rounds,
            "chunk": chunk,
        }
        if self.grouped:
            out["groups"] = [{"window": w, "pages": cache.group(g).capacity,
                              "peak_pages_in_use": self.peaks[g],
                              "pages_cached": cache.group(g).cached}
                             for g, w in enumerate(self.windows)]
        return out
