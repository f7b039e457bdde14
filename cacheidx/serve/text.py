"""A sample's detokenized text, read as it grows, and the stop strings found in it
(:class:`Text`): what the scheduler ends a sample by and what a stream may show (the
sampling's law 6), at a cost linear in the answer's length.

Laws:

1. **Each token's text is read once.** The text of the tokens past ``read`` is
   ``detokenize(ids[prefix:])`` less ``detokenize(ids[prefix:read])``, ``prefix`` the first
   token of the last piece of text taken (vLLM's incremental detokenization), so a tokenizer
   whose text of a token depends on the token before it (SentencePiece's leading space, a
   UTF-8 character split over byte-level tokens) gives what detokenizing the whole gives. A
   window whose text ends in a replacement character (half a character the next token may
   complete) waits for the next token. A step detokenizes its window, never the whole
   continuation.
2. **A new stop string ends in the new text**, so only the new text and the
   ``len(longest stop) - 1`` characters before it are searched; ``found`` is where the first
   stop string begins in the text (the earliest of those found in the first step that finds
   any), what :func:`~cacheidx.serve.sampling.cut` of the whole text gives.
3. **What a stream may show** (:attr:`Text.shown`): the text before ``found`` once a stop
   string is found; before that, all but a tail that may begin a stop string and a last
   replacement character (:func:`~cacheidx.serve.sampling.safe` of the tail), so a stream
   never shows text that is later cut.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from .sampling import safe

__all__ = ["Text"]


class Text:
    """The text of a sample's tokens, fed as they come (:meth:`extend`), ``drop`` (the model's
    stop tokens) left out of it; ``stops`` the strings that end it (law 2); ``streamed``
    where a stream reads it by :meth:`take`. ``searched`` and ``detokenized`` count the
    characters searched and the tokens detokenized so far (the work, which the tests
    bound)."""

    def __init__(self, detokenize: Callable[[list[int]], str], stops: Sequence[str] = (),
                 drop: Iterable[int] = (), *, streamed: bool = False):
        self.detokenize = detokenize
        self.stops = tuple(stops)
        self.keep = max((len(s) for s in self.stops), default=1) - 1  # law 2's look-behind
        self.drop = frozenset(drop)
        self.ids: list[int] = []
        self.prefix = self.read = 0  # law 1's window: ids[prefix:read] is text already taken
        self.pieces: list[str] = []
        self.length = 0  # characters taken
        self.tail = ""  # the last ``keep`` characters taken (law 2)
        self.found = -1  # where the first stop string begins; -1 while none is
        self.searched = self.detokenized = 0
        self.fed = 0  # tokens given to extend, dropped ones too
        self.given = 0  # characters handed out by take()
        self.unshown = ""  # text taken but not handed out yet (law 3 holds it back)
        self.streamed = streamed  # whether take() is called (else nothing is kept for it)

    def extend(self, tokens: Iterable[int]) -> bool:
        """Law 1 and 2: reads the text of ``tokens``, the sample's next ones; whether a stop
        string is found (now or before)."""
        before = len(self.ids)
        tokens = [int(t) for t in tokens]
        self.fed += len(tokens)
        self.ids.extend(t for t in tokens if t not in self.drop)
        if len(self.ids) == before or self.found >= 0:
            return self.found >= 0
        taken = self.detokenize(self.ids[self.prefix:self.read]) if self.read > self.prefix \
            else ""
        whole = self.detokenize(self.ids[self.prefix:])
        self.detokenized += (self.read - self.prefix) + (len(self.ids) - self.prefix)
        if whole.endswith("\ufffd") or len(whole) <= len(taken):
            return False  # half a character (or no text yet): the next token completes it
        new = whole[len(taken):]
        self.prefix, self.read = self.read, len(self.ids)
        window = self.tail + new
        self.searched += len(window)
        at = [i for s in self.stops if (i := window.find(s)) >= 0]
        if at:
            self.found = self.length - len(self.tail) + min(at)
        self.pieces.append(new)
        if self.streamed:
            self.unshown += new
        self.length += len(new)
        self.tail = window[-self.keep:] if self.keep else ""
        return self.found >= 0

    @property
    def text(self) -> str:
        """The text read so far, cut before the first stop string where one is found."""
        whole = "".join(self.pieces)
        return whole[: self.found] if self.found >= 0 else whole

    @property
    def shown(self) -> int:
        """Law 3: how many characters of :attr:`text` a stream may show now."""
        if self.found >= 0:
            return self.found
        return self.length - len(self.tail) + safe(self.tail, self.stops)

    def take(self) -> str:
        """Law 3: the text a stream may show that :meth:`take` has not handed out yet (a
        stream's next delta)."""
        k = max(0, self.shown - self.given)
        out, self.unshown = self.unshown[:k], self.unshown[k:]
        self.given += len(out)
        return out
