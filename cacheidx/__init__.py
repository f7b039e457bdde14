"""cacheidx: where a transformer call's tokens sit in a KV cache, on any array API library.

A cache is any record of pools; a pool is one tensor whose axis 0 is the slot axis. A
:class:`CacheIndex` says, for one call, which position each token holds and which slots hold
the positions of its sequence. A model passes the index it was given to every layer; a layer
calls ``extend`` on each of its pools and attends under ``mask`` (or ``visible``).
"""

from . import attention, backends  # noqa: F401  (attention registers CacheIndex.attend)
from .backends import use
from .build import make, packed, rows, whole
from .index import CacheIndex, Structure
from .obligations import check

__all__ = ["CacheIndex", "Structure", "backends", "check", "make", "packed", "rows", "use",
           "whole"]
__version__ = "0.1.0"
