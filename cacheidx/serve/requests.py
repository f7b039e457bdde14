"""What a client hands the engine (:class:`Request`) and what it gets back (:class:`Result`),
and the JSON-lines file of requests the CLI reads."""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = ["Request", "Result", "read_requests"]


@dataclasses.dataclass(frozen=True)
class Request:
    """Generate up to ``max_new_tokens`` greedy tokens after ``prompt`` (token ids), stopping
    after a token of ``stop`` (kept). ``arrival`` is when the engine may first see it (its
    clock's unit: seconds, or steps)."""

    id: Any
    prompt: tuple[int, ...]
    max_new_tokens: int = 16
    arrival: float = 0.0
    stop: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        where = f"cacheidx.serve.Request {self.id!r}"
        try:
            prompt = tuple(operator.index(t) for t in self.prompt)
        except TypeError:
            raise TypeError(f"{where}: the prompt must hold integer token ids, got "
                            f"{self.prompt!r:.80}") from None
        if not prompt:
            raise ValueError(f"{where}: the prompt is empty")
        if min(prompt) < 0:
            raise ValueError(f"{where}: a token id is negative: {min(prompt)}")
        object.__setattr__(self, "prompt", prompt)
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{where}: max_new_tokens must be a positive integer, got {n!r}")
        object.__setattr__(self, "max_new_tokens", int(n))
        object.__setattr__(self, "stop", frozenset(int(t) for t in self.stop))
        object.__setattr__(self, "arrival", float(self.arrival))


@dataclasses.dataclass
class Result:
    """One request's answer: its generated ``tokens`` (or its ``error``), how many of its
    prompt tokens were read from the cache and how many computed, and when (the engine's
    clock) it arrived, was admitted, got its first token and finished."""

    id: Any
    prompt_ids: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    error: str | None = None
    cached_tokens: int = 0
    computed_tokens: int = 0
    arrival: float = 0.0
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    #: the logits that chose the last token (float32), where the engine keeps them
    last_logits: np.ndarray | None = dataclasses.field(default=None, repr=False)
    #: the engine's number for the submission this result answers
    ticket: int = dataclasses.field(default=-1, repr=False)

    def as_json(self) -> dict:
        out = {"id": self.id, "prompt_ids": self.prompt_ids, "tokens": self.tokens,
               "cached_tokens": self.cached_tokens, "computed_tokens": self.computed_tokens}
        if self.error is not None:
            out["error"] = self.error
        return out


def read_requests(lines: Iterable[str], template: Callable[[list[dict]], list[int]], *,
                  max_new_tokens: int, stop: Iterable[int] = (), where: str = "requests"
                  ) -> list[Request]:
    """Requests from JSON lines ``{"id": ..., "messages": [{"role", "content"}, ...]}``, with
    an optional ``"arrival"`` (seconds) and ``"max_new_tokens"``; ``template`` turns the
    messages into prompt ids (the model's chat template). Blank lines are skipped. Raises
    ``ValueError`` naming the line that is not such an object."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ValueError(f"cacheidx.serve: {where} line {n} is not JSON: {e}") from None
        messages = item.get("messages") if isinstance(item, dict) else None
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and {"role", "content"} <= set(m)
                           for m in messages)):
            raise ValueError(f"cacheidx.serve: {where} line {n} needs \"messages\": a list of "
                             f"{{\"role\": ..., \"content\": ...}}, got {line.strip()[:80]!r}")
        out.append(Request(id=item.get("id", n), prompt=tuple(template(messages)),
                           max_new_tokens=int(item.get("max_new_tokens", max_new_tokens)),
                           arrival=float(item.get("arrival", 0.0)), stop=frozenset(stop)))
    return out
