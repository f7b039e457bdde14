"""The law suite: every law of the index, written once, run on any backend and device.

``python -m cacheidx.conformance`` runs it here; :data:`LAWS` and :class:`Case` let a test
suite (or a third-party adapter's) run the same laws under its own test runner.
"""

from . import attention as _attention  # noqa: F401  (registers attend's laws)
from . import laws as _laws  # noqa: F401  (registers the laws)
from . import model as _model  # noqa: F401  (registers the model-level laws)
from . import quantized as _quantized  # noqa: F401  (registers the quantized pools' laws)
from . import sampling as _sampling  # noqa: F401  (registers the engine's sampling law)
from . import state as _state  # noqa: F401  (registers the laws of recurrent state)
from . import turned as _turned  # noqa: F401  (registers the turned pools' laws)
from .suite import LAWS, Case, Law, agree, law

__all__ = ["LAWS", "Case", "Law", "agree", "law"]
