"""Sampling in the engine: what a request asks (:class:`Sampling`), the per-lane arrays a step
is fed (:class:`Draw`, made by :func:`draw`), and the choice made of them on any array library
(:func:`choose`). The choice and its generator (:class:`Draw`, :func:`choose`, :func:`mix`,
:func:`lane_key`, :func:`uniform`) are written in :mod:`cacheidx.sampling`, the lowest floor,
where the law suite reads them too; they are this module's names as well.

Laws:

1. **A sampled token is a function of the lane's logits, the request's seed, its sample
   number and its step alone**: the same whatever else is in the batch (its lanes, their
   order, their parameters), on every backend (NumPy, array-api-strict, PyTorch, JAX) and
   compile mode. So the random numbers are a counter-based generator written once on the
   array API (:func:`mix`, a 32-bit integer hash in int32 arithmetic, which every library
   wraps alike; no library's own generator): vocabulary entry ``j`` of a lane draws
   ``uniform(key, j)`` from its key ``lane_key(seed, sample, step)``, and the token is the
   Gumbel-max over the filtered logits (:func:`choose`), which draws from their softmax.
   ``step`` is the token's place in its sample's continuation (0 for the first), ``sample``
   its number among the request's ``n`` (0 for ``n=1``): so ``n`` samples diverge from
   their first token.
2. **Temperature 0 is greedy**: the argmax of the logits (plus the penalties where asked),
   bit for bit what the engine chose before it sampled; a lane of temperature 0 beside
   sampled lanes is chosen so in the same call. A batch of greedy lanes without penalties
   runs the engine's greedy program itself (no draw is fed).
3. **The filters** keep, of a lane's logits ``z`` (the model's, less the penalties,
   divided by the temperature), every token at or above a cut: the ``top_k`` largest
   (``0``: all), of those the fewest largest whose softmax mass among the ``top_k`` reaches
   ``top_p`` (the token that crosses it kept; ``1`` keeps all), as transformers' and vLLM's
   top-k then top-p do, and those whose probability is at least ``min_p`` times the
   largest's. The cut is the highest of the three, so ties at the cut are all kept.
   Sampled frequencies are the softmax of the kept logits (``tests/test_sampling.py``'s
   chi-square check).
4. **Penalties** are OpenAI's: ``z[j] -= frequency_penalty * c[j] + presence_penalty * (c[j]
   > 0)``, ``c[j]`` the times token ``j`` is in the sample's continuation so far (never the
   prompt), applied before the temperature and at temperature 0 too. ``c`` is kept sparse,
   as the sample's tokens grow (:class:`Counts`: the seen tokens alone, each token read
   once); the bias a call is fed is a dense row (why: :class:`Counts`).
5. **Log-probabilities** (``logprobs=k``) are those of the model's own distribution (the
   log-softmax of its logits, before penalties, temperature and filters), of the chosen
   token and of the ``k`` likeliest (ties by id), computed on the host in float64: one
   :class:`Logprob` per token.
6. **Stop strings** (``stop``) end a sample at the token whose detokenized continuation
   (the whole continuation's text, so a string spanning tokens is found) first holds one
   (only where the engine has a tokenizer, ``Engine(detokenize=...)``); that token is the
   sample's last, and its text is cut before the first stop string (:func:`cut`). A stream
   shows of a running sample's text only what :func:`safe` allows: never a tail that may
   begin a stop string, so it never shows text that is later cut. The text is read as it
   grows (:class:`cacheidx.serve.text.Text`: each token's text once, the new text and the
   tail before it searched), so finding stop strings costs the answer's length, not its
   square.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import secrets
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..sampling import Draw, choose, lane_key, mix, uniform

__all__ = ["Draw", "Logprob", "Sampling", "choose", "cut", "draw", "lane_key", "logprobs_of",
           "mix", "safe", "uniform"]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a request chooses its tokens (see the module's laws). ``temperature`` 0 is
    greedy; ``top_k`` 0 keeps every token; ``top_p`` in (0, 1]; ``min_p`` in [0, 1];
    ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (OpenAI's range); ``seed`` an
    integer in [0, 2**64) (``None`` with a temperature above 0: one drawn from the OS when the
    ``Sampling`` is made, which ``seed`` then holds, so a result can be drawn again);
    ``logprobs`` ``None`` (none) or ``k`` in 0 to 20 (the chosen token's log-probability
    and the ``k`` likeliest); ``stop`` strings that end a sample (law 6).

    Raises ``TypeError`` for a field of the wrong type and ``ValueError`` for a value out of
    range, naming the field and the value (and the request, where a
    :class:`~cacheidx.serve.Request` was given the fields)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            fields = checked(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        except (TypeError, ValueError) as e:
            raise type(e)(f"cacheidx.serve.Sampling: {e}") from None
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """Whether the lane's token is the argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def drawn(self) -> bool:
        """Whether a call needs this lane's draw: sampled, or penalised."""
        return not self.greedy or self.penalised

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def _real(name: str, x: Any, low: float, high: float, *, open_low: bool = False) -> float:
    if isinstance(x, bool | np.bool_) or not isinstance(x, int | float | np.integer | np.floating):
        raise TypeError(f"{name} must be a number, got {x!r:.40}")
    x = float(x)
    if not math.isfinite(x) or x < low or x > high or (open_low and x == low):
        bounds = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be in {bounds}, got {x!r}")
    return x


def _int(name: str, x: Any, low: int, high: int) -> int:
    if isinstance(x, bool | np.bool_):
        raise TypeError(f"{name} must be an integer, got {x!r}")
    try:
        x = operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {x!r:.40}") from None
    if not low <= x <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {x}")
    return int(x)


def checked(temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0, min_p: Any = 0.0,
            presence_penalty: Any = 0.0, frequency_penalty: Any = 0.0, seed: Any = None,
            logprobs: Any = None, stop: Any = ()) -> dict:
    """:class:`Sampling`'s fields as it keeps them; ``TypeError`` or ``ValueError`` naming the
    field and the value (the caller names the request)."""
    out = {"temperature": _real("temperature", temperature, 0.0, math.inf),
           "top_k": _int("top_k", top_k, 0, 2**31 - 1),
           "top_p": _real("top_p", top_p, 0.0, 1.0, open_low=True),
           "min_p": _real("min_p", min_p, 0.0, 1.0),
           "presence_penalty": _real("presence_penalty", presence_penalty, -2.0, 2.0),
           "frequency_penalty": _real("frequency_penalty", frequency_penalty, -2.0, 2.0)}
    if seed is None and out["temperature"] > 0:
        seed = secrets.randbits(63)  # law 1 needs one; kept, so the result can be redrawn
    out["seed"] = None if seed is None else _int("seed", seed, 0, 2**64 - 1)
    out["logprobs"] = None if logprobs is None else _int("logprobs", logprobs, 0, 20)
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Iterable) or isinstance(stop, bytes | dict):
        raise TypeError(f"stop must be a string or a collection of strings, got {stop!r:.60}")
    stop = tuple(stop)
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must hold non-empty strings, got {s!r:.40}")
    out["stop"] = stop
    return out


def of(value: Any) -> Sampling | None:
    """A request's ``sampling``: a :class:`Sampling`, a mapping of its fields, or ``None``
    (greedy). ``TypeError`` for anything else, ``ValueError`` for a field out of range,
    without the class's prefix (the request adds its own name)."""
    if value is None or isinstance(value, Sampling):
        return value
    if not hasattr(value, "keys"):
        raise TypeError(f"sampling must be a Sampling or a mapping of its fields, got "
                        f"{type(value).__name__}")
    unknown = set(value) - {f.name for f in dataclasses.fields(Sampling)}
    if unknown:
        raise TypeError(f"sampling has no field {sorted(unknown)[0]!r}")
    fields = checked(**value)
    made = object.__new__(Sampling)  # checked already: no second seed drawn
    for name, v in fields.items():
        object.__setattr__(made, name, v)
    return made


GREEDY = Sampling()  #: what a request without ``sampling`` asks


class Logprob(NamedTuple):
    """Law 5, of one chosen token: its id, its log-probability, and ``top``, the ``k``
    likeliest tokens' ``(id, log-probability)``, likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Counts:
    """Law 4's counts of one sample's tokens, sparse and kept as they grow: ``times[t]`` the
    times token ``t`` is in the continuation, for the tokens seen alone (one entry per
    distinct token, never a row of the vocabulary), and ``seen`` how many of the sample's
    tokens are counted. :meth:`update` reads only the tokens past ``seen``, so a sample's
    counts cost its tokens once, not once a step.

    Why the bias a call is fed stays a dense ``[lanes, vocab]`` row (made from these counts
    each call, zero but at the seen tokens): the logits it is added to are a dense
    ``[lanes, vocab]`` array on the device already, and the array API has no scatter, so a
    sparse ``(ids, values)`` input would need each library's own scatter (``index_add_``,
    ``.at[].add``) in a choice written once, or a one-hot of ``[lanes, seen, vocab]``, more
    work than the row. The row costs a fill and a copy of ``vocab`` floats a penalised lane,
    the size of the logits row it shifts."""

    def __init__(self) -> None:
        self.times: dict[int, int] = {}
        self.seen = 0

    def update(self, tokens: Sequence[int], vocab: int) -> tuple[np.ndarray, np.ndarray]:
        """Counts ``tokens[seen:]`` (the sample's tokens so far, of which the first ``seen``
        are counted); returns the seen ids below ``vocab`` and their times (int64,
        float32)."""
        if len(tokens) < self.seen:  # tokens taken back (never by the engine): count anew
            self.times, self.seen = {}, 0
        times = self.times
        for t in tokens[self.seen:]:
            t = int(t)
            times[t] = times.get(t, 0) + 1
        self.seen = len(tokens)
        ids = np.fromiter(times, np.int64, len(times))
        counts = np.fromiter(times.values(), np.float32, len(times))
        inside = ids < vocab
        return ids[inside], counts[inside]


def draw(lanes: Sequence[Any], size: int, vocab: int) -> Draw | None:
    """The host arrays (NumPy) of a call of ``lanes`` (the scheduler's, each with its
    ``request``, ``result`` and ``sample``) padded to ``size`` lanes, over ``vocab`` tokens;
    ``None`` where no lane needs a draw (law 2: the greedy program's choice stands). The
    penalties' counts are each penalised lane's own tokens (:class:`Counts`, kept on the lane
    as its tokens grow); ``bias`` (``[lanes, vocab]``) is made only where a lane is
    penalised, each row written at its seen tokens alone."""
    asks = [getattr(lane.request, "sampling", None) or GREEDY for lane in lanes]
    if not any(s.drawn for s in asks):
        return None
    temperature = np.zeros(size, np.float32)
    top_k = np.zeros(size, np.int32)
    top_p = np.ones(size, np.float32)
    min_p = np.zeros(size, np.float32)
    seeds = np.zeros(size, np.uint64)
    samples = np.zeros(size, np.int32)
    steps = np.zeros(size, np.int32)
    bias = np.zeros((size, vocab), np.float32) if any(s.penalised for s in asks) else None
    for b, (lane, s) in enumerate(zip(lanes, asks)):
        temperature[b], top_k[b], top_p[b], min_p[b] = s.temperature, s.top_k, s.top_p, s.min_p
        seeds[b] = s.seed or 0
        samples[b] = getattr(lane, "sample", 0)
        steps[b] = len(lane.result.tokens)
        if s.penalised and lane.result.tokens:
            counts = getattr(lane, "counts", None)
            if counts is None:  # a lane that keeps none (the scheduler's keep theirs)
                counts = Counts()
                if hasattr(lane, "counts"):
                    lane.counts = counts
            ids, times = counts.update(lane.result.tokens, vocab)
            bias[b, ids] = -(np.float32(s.frequency_penalty) * times
                             + np.float32(s.presence_penalty))
    if not (top_k.any() or (top_p < 1).any()):  # no lane filters by rank: no sort (choose)
        top_k = top_p = None
    return Draw(temperature, top_k, top_p, min_p, lane_key(seeds, samples, steps), bias)


# -- law 5: log-probabilities, on the host ------------------------------------------------------
def logprobs_of(logits: Any, token: int, k: int) -> Logprob:
    """Law 5: the :class:`Logprob` of ``token`` and the ``k`` likeliest ids (first, ties by
    id) of one lane's logits (host, any shape of ``vocab`` values), in float64."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    top = x.max()
    lp = x - (top + np.log(np.exp(x - top).sum()))
    best: Any = ()
    if k:
        k = min(k, lp.size)
        at = np.flatnonzero(lp >= np.partition(lp, lp.size - k)[lp.size - k])  # ties kept
        best = at[np.lexsort((at, -lp[at]))][:k]  # likeliest first, ties by id
    return Logprob(int(token), float(lp[token]), tuple((int(i), float(lp[i])) for i in best))


def wants_logprobs(lanes: Sequence[Any]) -> bool:
    """Whether a lane of a call asks for log-probabilities (its logits then come to the
    host)."""
    return any(getattr(getattr(lane.request, "sampling", None), "logprobs", None) is not None
               for lane in lanes)


# -- law 6: stop strings ------------------------------------------------------------------------
def cut(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``(text before the first stop string, whether one was found)``: cut at the earliest
    place any of ``stops`` begins."""
    at = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not at:
        return text, False
    return text[: min(i for i, _ in at)], True


def safe(text: str, stops: Sequence[str]) -> int:
    """How many characters of ``text`` (with no stop string in it yet) a stream may show:
    all but a tail that begins some stop string, and a last replacement character (half a
    UTF-8 character the next token may complete)."""
    n = len(text)
    for s in stops:
        for m in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:m]):
                n = min(n, len(text) - m)
                break
    while n and text[n - 1] == "\ufffd":
        n -= 1
    return n
