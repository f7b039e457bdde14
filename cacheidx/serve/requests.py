"""What a client hands the engine (:class:`Request`) and what it gets back (:class:`Result`),
and the JSON-lines file of requests the CLI reads."""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from . import sampling as sampling_
from .sampling import Logprob, Sampling

__all__ = ["MOST_SAMPLES", "Line", "Request", "Result", "read_requests"]


_LARGEST = (1 << 63) - 1  # token ids are int64 on their way to the model
#: the fields of a request line that are its sampling's (:func:`read_requests`)
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(Sampling))
#: the most samples a request may ask for (``n``): OpenAI's API caps it at 128 too
MOST_SAMPLES = 128


@dataclasses.dataclass(frozen=True)
class Request:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` (token ids), stopping
    after a token of ``stop`` (kept). ``arrival`` is when the engine may first see it (its
    clock's unit: seconds, or steps).

    ``sampling`` says how each token is chosen (:class:`~cacheidx.serve.sampling.Sampling`,
    or a mapping of its fields): its temperature (0, the default, and ``sampling=None``:
    greedy), filters, penalties, seed, log-probabilities and stop strings, under the laws of
    :mod:`cacheidx.serve.sampling` (a sampled token is a function of the seed, the sample
    number and the step alone, whatever else is in the batch).

    ``n`` asks for ``n`` parallel samples of the prompt: ``n`` lanes, whose prompt is computed
    once (the scheduler's law 6: the samples after the first read its whole pages from the
    prefix cache, each computing only the tokens past the prompt's last whole page, into a
    page of its own). Its :class:`Result` then holds ``n`` lists of tokens. Sample ``k`` draws
    with sample number ``k``, so sampled continuations differ from their first token; greedy
    ones are equal, each the continuation of the same request with ``n=1``. The engine
    serves at most :data:`MOST_SAMPLES` (128, OpenAI's cap): a request asking more is
    refused when submitted, alone, its result naming it (the admission's law 1).

    Raises ``TypeError`` naming the request for a field of the wrong type (a token id that is
    no integer, a bool included; a float ``max_new_tokens`` or ``n``; an ``arrival`` that is
    no number; a ``stop`` that is no collection of ids; a ``sampling`` that is no
    ``Sampling`` or mapping of its fields), and ``ValueError`` for a value out of range (an
    empty prompt, a negative id or one past int64, ``max_new_tokens`` or ``n`` below 1, an
    arrival that is negative or not finite, a sampling field out of its range). Nothing is
    truncated or clamped."""

    id: Any
    prompt: tuple[int, ...]
    max_new_tokens: int = 16
    arrival: float = 0.0
    stop: frozenset[int] = frozenset()
    n: int = 1
    sampling: Sampling | None = None

    def __post_init__(self) -> None:
        try:
            fields = checked(self.prompt, self.max_new_tokens, self.arrival, self.stop,
                             self.n, self.sampling)
        except (TypeError, ValueError) as e:
            raise type(e)(f"cacheidx.serve.Request {self.id!r}: {e}") from None
        for name, value in fields.items():
            object.__setattr__(self, name, value)


def checked(prompt: Any, max_new_tokens: Any, arrival: Any, stop: Any, n: Any = 1,
            sampling: Any = None) -> dict:
    """A request's fields as :class:`Request` keeps them; ``TypeError`` or ``ValueError``
    saying which field is wrong and how (the caller names the request)."""
    return {"prompt": _ids("the prompt", prompt, least=1),
            "max_new_tokens": _count("max_new_tokens", max_new_tokens),
            "arrival": _time(arrival), "stop": frozenset(_ids("stop", stop)),
            "n": _count("n", n), "sampling": sampling_.of(sampling)}


def _ids(what: str, ids: Any, least: int = 0) -> tuple[int, ...]:
    if isinstance(ids, str | bytes | dict) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{what} must be a collection of integer token ids, got {ids!r:.80}")
    out = []
    for t in ids:
        if isinstance(t, bool | np.bool_):  # True is no token id, though Python counts it 1
            raise TypeError(f"{what} holds {t!r}, not an integer token id")
        try:
            t = operator.index(t)
        except TypeError:
            raise TypeError(f"{what} must hold integer token ids, got {t!r:.40}") from None
        if not 0 <= t <= _LARGEST:
            raise ValueError(f"{what} holds token id {t}, outside 0 to 2**63 - 1")
        out.append(t)
    if len(out) < least:
        raise ValueError(f"{what} is empty")
    return tuple(out)


def _count(name: str, n: Any) -> int:
    if isinstance(n, bool | np.bool_) or not isinstance(n, int | np.integer):
        raise TypeError(f"{name} must be a positive integer, got {n!r:.40}")
    if n < 1:
        raise ValueError(f"{name} must be a positive integer, got {n!r}")
    return int(n)


def _time(t: Any) -> float:
    if isinstance(t, bool | np.bool_) or not isinstance(t, int | float | np.integer | np.floating):
        raise TypeError(f"arrival must be a number, got {t!r:.40}")
    try:
        t = float(t)
    except OverflowError:  # an int past a float's range
        t = math.inf
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"arrival must be a finite number at or after 0, got {t!r}")
    return t


@dataclasses.dataclass
class Result:
    """One request's answer: its generated ``tokens`` (or its ``error``), how many of its
    prompt tokens were read from the cache and how many computed, and when (the engine's
    clock) it arrived, was admitted, got its first token and finished.

    A request of ``n`` > 1 samples has one result, for all of them: ``tokens`` is a list of
    ``n`` lists, sample ``k``'s at ``k`` (:attr:`samples` reads both shapes as that list);
    ``cached_tokens`` and ``computed_tokens`` are its samples' sums; ``admitted`` and
    ``first_token`` its first sample's, ``finished`` its last's; ``error`` the first failing
    sample's (``"sample k: ..."``: the others run to their end); ``last_logits``, where kept,
    one row per sample.

    Where the request asks (its :class:`~cacheidx.serve.sampling.Sampling`), ``logprobs``
    holds one :class:`~cacheidx.serve.sampling.Logprob` per token (its log-probability and
    the ``k`` likeliest tokens', the sampling's law 5). Where the engine has a detokenizer
    (``Engine(detokenize=...)``), ``text`` is the continuation's text, cut before the first
    stop string (law 6; a stop token id is not in it). ``finish_reason`` is ``"stop"`` (a
    stop token or string ended it), ``"length"`` (``max_new_tokens``), or ``None`` (failed,
    or not yet ended). For ``n`` > 1 samples each of the three is a list, sample ``k``'s at
    ``k``, as ``tokens`` is; a sample's own lists grow in place as it runs."""

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
    #: the request's samples: ``tokens`` is ``n`` lists of ids where ``n`` > 1
    n: int = 1
    #: each token's log-probabilities where asked (``n`` > 1: a list per sample)
    logprobs: list[Logprob] | list[list[Logprob]] | None = None
    #: the continuation's text, cut before a stop string, where the engine detokenizes
    text: str | list[str | None] | None = None
    #: ``"stop"`` or ``"length"`` once ended (``None``: failed or running)
    finish_reason: str | list[str | None] | None = None

    @property
    def samples(self) -> list[list[int]]:
        """Each sample's tokens: ``[tokens]`` for one sample, ``tokens`` for several."""
        return self.tokens if self.n > 1 else [self.tokens]

    def describe(self) -> str:
        """What a progress line says of a served request: its prompt, cached and new tokens."""
        least, most = min(map(len, self.samples)), max(map(len, self.samples))
        each = f"{least}" if least == most else f"{least} to {most}"
        new = f"{each} new" if self.n == 1 else f"{self.n} samples of {each} new"
        return f"{len(self.prompt_ids)} prompt tokens ({self.cached_tokens} cached), {new}"

    def as_json(self) -> dict:
        out = {"id": self.id, "prompt_ids": self.prompt_ids, "tokens": self.tokens,
               "cached_tokens": self.cached_tokens, "computed_tokens": self.computed_tokens}
        if self.n > 1:
            out["n"] = self.n
        if self.finish_reason is not None:
            out["finish_reason"] = self.finish_reason
        if self.logprobs is not None:
            out["logprobs"] = _logprobs_json(self.logprobs, self.n > 1)
        if self.error is not None:
            out["error"] = self.error
        return out


def _logprobs_json(lps: list, several: bool = False) -> list:
    """Log-probabilities as JSON: ``{"token", "logprob", "top": [[id, logprob], ...]}`` each
    (``several``: a list of them per sample)."""
    if several:
        return [_logprobs_json(x) for x in lps]
    return [{"token": x.token, "logprob": x.logprob, "top": [list(t) for t in x.top]}
            for x in lps]


@dataclasses.dataclass(frozen=True)
class Line:
    """One request line of a file: its ``number`` (from 1) and the ``request`` it holds, or
    the ``error`` that makes it none. ``id`` is the line's ``"id"``, or its number."""

    number: int
    id: Any
    request: Request | None = None
    error: str | None = None


def read_requests(lines: Iterable[str], template: Callable[[list[dict]], list[int]], *,
                  max_new_tokens: int, stop: Iterable[int] = (), latest: float | None = None
                  ) -> list[Line]:
    """Requests from JSON lines ``{"id": ..., "messages": [{"role": ..., "content": ...},
    ...]}`` or ``{"id": ..., "prompt_ids": [...]}``, with an optional ``"arrival"`` (seconds,
    at most ``latest`` where given), ``"max_new_tokens"``, ``"n"`` (parallel samples,
    :class:`Request`) and :class:`~cacheidx.serve.sampling.Sampling`'s fields by its names
    (``"temperature"``, ``"top_k"``, ``"top_p"``, ``"min_p"``, ``"presence_penalty"``,
    ``"frequency_penalty"``, ``"seed"``, ``"logprobs"``, ``"stop"``: strings); ``template``
    turns the messages into prompt ids (the model's chat template). Blank lines are skipped,
    and a UTF-8 byte order mark before the first line.

    Each other line gives a :class:`Line`: its request, or why it is none (not JSON, not an
    object, a field of the wrong type or out of range, a message that is no Unicode text, a
    template that failed), so that one bad line fails alone."""
    stop = frozenset(stop)
    out = []
    for n, text in enumerate(lines, 1):
        if n == 1:
            text = text.removeprefix("\ufeff")  # what an editor's "UTF-8 with BOM" writes
        if not text.strip():
            continue
        try:
            item = json.loads(text)
        except ValueError as e:
            out.append(Line(n, n, error=f"not JSON ({getattr(e, 'msg', e)} at column "
                                        f"{getattr(e, 'colno', '?')})"))
            continue
        if not isinstance(item, dict):
            out.append(Line(n, n, error=f"not a JSON object: {text.strip()[:60]}"))
            continue
        rid = item.get("id", n)
        try:
            prompt = _prompt(item, template)
            asks = {k: item[k] for k in SAMPLING_FIELDS if k in item}
            fields = checked(prompt, item.get("max_new_tokens", max_new_tokens),
                             item.get("arrival", 0.0), stop, item.get("n", 1), asks or None)
            if latest is not None and fields["arrival"] > latest:
                raise ValueError(f"arrival must be at most {latest:g} seconds, got "
                                 f"{fields['arrival']:g}")
        except (TypeError, ValueError) as e:
            out.append(Line(n, rid, error=str(e)))
            continue
        out.append(Line(n, rid, Request(rid, **fields)))
    return out


def _prompt(item: dict, template: Callable[[list[dict]], list[int]]) -> Any:
    """The prompt ids of a request line: its ``"prompt_ids"``, or its ``"messages"`` under
    the chat template (checked first: a template given a number for text fails obscurely)."""
    if ("messages" in item) == ("prompt_ids" in item):
        raise ValueError('a request needs "messages" or "prompt_ids" (one of them)')
    if "prompt_ids" in item:
        return item["prompt_ids"]
    messages = item["messages"]
    if not isinstance(messages, list) or not messages:
        raise TypeError(f'"messages" must be a non-empty list of {{"role": ..., "content": '
                        f'...}}, got {json.dumps(messages)[:60]}')
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not {"role", "content"} <= set(m):
            raise TypeError(f'message {k} must be {{"role": ..., "content": ...}}, got '
                            f'{json.dumps(m)[:60]}')
        for field in ("role", "content"):
            if not isinstance(m[field], str):
                raise TypeError(f'message {k}\'s "{field}" must be a string, got '
                                f'{json.dumps(m[field])[:60]}')
            try:  # JSON's escapes can write half a UTF-16 pair, which no tokenizer takes
                m[field].encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f'message {k}\'s "{field}" holds a lone surrogate '
                                 f'{json.dumps(e.object[e.start])} at character {e.start}: '
                                 "no Unicode text") from None
    try:
        return template(messages)
    except Exception as e:  # the template's own failure, whatever its library raises
        raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from None
