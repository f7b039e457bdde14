"""cacheidx: where a transformer call's tokens sit in a KV cache, on any array API library.

A cache is any record of pools; a pool is one tensor whose axis 0 is the slot axis. A
:class:`CacheIndex` says, for one call, which position each token holds and which slots hold
the positions of its sequence. A model passes the index it was given to every layer; a layer
calls ``extend`` on each of its pools and attends under ``mask`` (or ``visible``). A pool may
be quantized (:class:`Quantized`: 8- or 4-bit codes and a scale per token and kv head,
:mod:`cacheidx.quantized`; or turned 4-bit codes, a scale and zero point a group of channels,
:mod:`cacheidx.turned`), under the same laws.
"""

# attention registers attend; quantized and turned register their kinds of pool
from . import attention, backends, quantized, state, turned  # noqa: F401
from .backends import use
from .build import make, packed, rows, whole
from .index import CacheIndex, Structure
from .obligations import check
from .quantized import Quantized

__all__ = ["CacheIndex", "Quantized", "Structure", "backends", "check", "make", "packed",
           "quantized", "rows", "state", "turned", "use", "whole"]
__version__ = "0.1.0"
