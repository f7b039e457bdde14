"""What one call of the engine computes: the running requests (:class:`Lane`) and the call
made of them (:class:`Batch`), NumPy arrays on the host that whatever computes the call
(``cacheidx.serve.step``, or a simulation) reads.

Laws, for lanes in the scheduler's running order:

1. A prefill call (:func:`prefill`) is every lane still in its prompt, each computing its
   next ``min(chunk, tokens left)`` prompt tokens, left padded to the longest (position -1,
   token 0); it reads as many columns as its furthest token's position plus one. With
   ``align`` (``m``: a model whose recurrent layers store the state after a call's last
   token alone) a lane's tokens end at a block's end or at the prompt's, so every block its
   prompt closes is closed by the last token of a call.
2. A decode call (:func:`decode`) is every lane past its prompt, each fed its last generated
   token at that token's position (:attr:`Lane.position`); it reads as many columns as its
   furthest position plus one.
3. Lane ``b`` of a call is the request in row ``rows[b]`` of the scheduler's tables
   (:mod:`cacheidx.serve.tables`); :meth:`Batch.alone` is lane ``b``'s call by itself, fed
   from the host.
4. A request of ``n`` > 1 samples runs as ``n`` lanes, each with a result of its own (made
   as it starts) and the request's :class:`Samples`, which gathers them into the request's
   result once the last ended (the scheduler's law 6).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..prefix.cache import Hold
from .requests import Request, Result

__all__ = ["Batch", "Lane", "Samples", "decode", "prefill"]


@dataclasses.dataclass(eq=False)
class Samples:
    """The lanes of one request of ``n`` > 1 samples (law 4): ``result`` is the request's,
    ``results[k]`` sample ``k``'s (a result of one sample), made as sample ``k`` starts
    (:meth:`start`), never all up front; ``ended`` how many have ended (or will never
    start: :meth:`drop`)."""

    result: Result
    n: int
    results: list[Result] = dataclasses.field(default_factory=list)
    ended: int = 0

    @property
    def done(self) -> bool:
        """Whether every sample has ended."""
        return self.ended == self.n

    @property
    def started(self) -> int:
        return len(self.results)

    def start(self, request: Request) -> tuple[int, Result]:
        """Sample ``k``, the next, starts: ``(k, its result)``; the request's result lists its
        tokens (and log-probabilities) from now on, growing in place."""
        k, out = len(self.results), self.result
        part = Result(out.id, list(request.prompt), arrival=out.arrival, ticket=out.ticket)
        if out.logprobs is not None:
            part.logprobs = []
            out.logprobs.append(part.logprobs)
        out.tokens.append(part.tokens)
        self.results.append(part)
        return k, part

    def drop(self) -> None:
        """The samples not started never will (a cancelled request): they count as ended."""
        self.ended += self.n - len(self.results)

    def gather(self, now: float) -> Result:
        """The request's result, from its samples' (see :class:`Result`); an error set on it
        before (a cancellation) stays."""
        out, parts = self.result, self.results
        never: list = [[] for _ in range(out.n - len(parts))]  # cancelled, never started
        out.tokens = [r.tokens for r in parts] + never
        if out.logprobs is not None:
            out.logprobs = [r.logprobs for r in parts] + never
        out.finish_reason = [r.finish_reason for r in parts] + [None] * len(never)
        if any(r.text is not None for r in parts):
            out.text = [r.text for r in parts] + [None] * len(never)
        out.cached_tokens = sum(r.cached_tokens for r in parts)
        out.computed_tokens = sum(r.computed_tokens for r in parts)
        admitted = [r.admitted for r in parts if r.admitted is not None]
        out.admitted = min(admitted, default=None)
        first = [r.first_token for r in parts if r.first_token is not None]
        out.first_token = min(first, default=None)
        out.finished = now
        if out.error is None:
            out.error = next((f"sample {k}: {r.error}" for k, r in enumerate(parts)
                              if r.error is not None), None)
        if parts and all(r.last_logits is not None for r in parts):
            out.last_logits = np.stack([r.last_logits for r in parts])
        return out


@dataclasses.dataclass(eq=False)
class Lane:
    """A running request: its pages, its row of the table, how much of its prompt is
    computed (``done``, its cached tokens at first). A sample of a request of ``n`` > 1
    has its own ``result`` and the request's ``samples`` (law 4); ``None`` otherwise."""

    request: Request
    result: Result
    hold: Hold
    row: int
    done: int
    data: np.ndarray = dataclasses.field(repr=False)  #: the prompt, int64
    samples: Samples | None = dataclasses.field(default=None, repr=False)
    #: its number among its request's samples (0 for a request of one): what it draws by
    sample: int = 0
    #: the snapshot its first call copies into its running slot (-1: none; law 14)
    resume: int = -1
    #: its tokens' counts for penalties (the sampling's ``Counts``), made at its first
    #: penalised draw and kept as its tokens grow
    counts: Any = dataclasses.field(default=None, repr=False)
    #: its continuation's text, read as it grows (``text.Text``), where it has stop strings
    text: Any = dataclasses.field(default=None, repr=False)

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
    #: recurrent state to copy (the prefix cache's law 14): ``(row, slot)`` pairs, each row's
    #: running state from snapshot ``slot`` before the call, and into it after
    resumes: tuple[tuple[int, int], ...] = ()
    keeps: tuple[tuple[int, int], ...] = ()

    def alone(self, b: int) -> Batch:
        """The call of lane ``b`` alone, fed from the host."""
        pos, row = self.pos[b : b + 1], int(self.rows[b])
        return Batch(self.kind, (self.lanes[b],), self.rows[b : b + 1], pos,
                     self.tokens[b : b + 1], int(pos.max()) + 1,
                     resumes=tuple(c for c in self.resumes if c[0] == row),
                     keeps=tuple(c for c in self.keeps if c[0] == row))


def _rows(lanes: tuple[Lane, ...]) -> np.ndarray:
    return np.asarray([lane.row for lane in lanes], dtype=np.int64)


def prefill(lanes: tuple[Lane, ...], chunk: int, align: int | None = None,
            cut: int | None = None) -> Batch:
    """Law 1: the prefill call of ``lanes`` (each still in its prompt), ``chunk`` tokens
    each at most, ending at a block of ``align`` positions where given, and with ``cut``
    (a page's tokens) at the prompt's last whole page before its last token (its
    junction: the prefix cache's law 14)."""
    counts = [min(chunk, len(lane.data) - lane.done) for lane in lanes]
    if align is not None:
        counts = [min(n, (lane.done // align + 1) * align - lane.done)
                  for lane, n in zip(lanes, counts)]
    if cut is not None:
        ends = [(len(lane.data) - 1) // cut * cut for lane in lanes]
        counts = [min(n, end - lane.done) if lane.done < end else n
                  for lane, n, end in zip(lanes, counts, ends)]
    seq = max(counts)
    pos = np.full((len(lanes), seq), -1, dtype=np.int64)
    tokens = np.zeros((len(lanes), seq), dtype=np.int64)
    for b, (lane, n) in enumerate(zip(lanes, counts)):
        pos[b, seq - n :] = np.arange(lane.done, lane.done + n)
        tokens[b, seq - n :] = lane.data[lane.done : lane.done + n]
    columns = max(lane.done + n for lane, n in zip(lanes, counts))
    return Batch("prefill", lanes, _rows(lanes), pos, tokens, columns)


def decode(lanes: tuple[Lane, ...], follows: bool) -> Batch:
    """Law 2: the decode call of ``lanes`` (each past its prompt); ``follows`` as
    :class:`Batch` says."""
    pos = np.asarray([[lane.position] for lane in lanes], dtype=np.int64)
    tokens = np.asarray([[lane.result.tokens[-1]] for lane in lanes], dtype=np.int64)
    return Batch("decode", lanes, _rows(lanes), pos, tokens, int(pos.max()) + 1, follows)
