"""Token keys of the online prefix cache: a prompt as little-endian int64 bytes, so that a
page's key is a slice of ``8 * page_size`` bytes and two keys are equal exactly when their
tokens are (law 2 of :mod:`.cache` compares pages by these keys, never by a hash).

Only integers that int64 holds are tokens: a float is never truncated into another prompt's
key, a bool or a string is never taken for a token, and an id past int64 is never wrapped
to a negative one. Each refusal names the operation and the token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["LARGEST", "WHERE", "token_bytes"]

WHERE = "cacheidx.prefix.PrefixCache"  #: what every error of the cache names first
LARGEST = np.iinfo(np.int64).max


def token_bytes(op: str, tokens: Any) -> bytes:
    """Tokens as little-endian int64 bytes, equal exactly when the tokens are. Raises
    ``TypeError`` for anything but a sequence or 1-D array of integers, ``ValueError`` for
    an array of another shape or a token past int64, naming ``op``."""
    if not isinstance(tokens, np.ndarray):
        if isinstance(tokens, str | bytes | dict) or not hasattr(tokens, "__iter__"):
            raise TypeError(f"{WHERE}.{op}: tokens must be a sequence of integers, got "
                            f"{tokens!r:.80}")
        items = tokens if hasattr(tokens, "__len__") else list(tokens)
        # one pass in C over the items' types: a bool or a float among ints would convert
        if not all(k is not bool and issubclass(k, int | np.integer)
                   for k in set(map(type, items))):
            _name_the_bad_token(op, items)
        try:
            tokens = np.asarray(items, dtype=np.int64)
        except OverflowError:
            _name_the_bad_token(op, items)
    if tokens.ndim != 1:
        raise ValueError(f"{WHERE}.{op}: tokens must be a 1-D array of integers, got "
                         f"{tokens.dtype} of shape {tokens.shape}")
    if tokens.size and tokens.dtype.kind not in "iu":
        raise TypeError(f"{WHERE}.{op}: tokens must be integers, got dtype {tokens.dtype}")
    if tokens.dtype.kind == "u" and tokens.size and tokens.max() > LARGEST:
        raise ValueError(f"{WHERE}.{op}: token {int(tokens.max())} is past the largest id a "
                         f"key holds, {LARGEST}")
    return tokens.astype("<i8", copy=False).tobytes()


def _name_the_bad_token(op: str, items: list) -> None:
    """Raises naming the first item of ``items`` that is no integer int64 holds."""
    for k, t in enumerate(items):
        if isinstance(t, bool | np.bool_) or not isinstance(t, int | np.integer):
            raise TypeError(f"{WHERE}.{op}: token {k} must be an integer, got {t!r:.40}")
        if not -LARGEST - 1 <= int(t) <= LARGEST:
            raise ValueError(f"{WHERE}.{op}: token {k} is {int(t)}, past the int64 a key "
                             f"holds")
