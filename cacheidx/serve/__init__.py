"""A continuous-batching engine over the cache index and an online prefix cache.

``python -m cacheidx.serve REQUESTS.jsonl`` serves chat requests with SmolLM2; from Python,
:class:`Engine` serves :class:`Request` objects with any :class:`Model`.
"""

from .engine import Engine
from .model import LlamaModel, Model, ShardedModel
from .requests import Request, Result, read_requests
from .scheduler import Batch, Lane, Scheduler
from .step import Step

__all__ = ["Batch", "Engine", "Lane", "LlamaModel", "Model", "Request", "Result", "Scheduler",
           "ShardedModel", "Step", "read_requests"]
