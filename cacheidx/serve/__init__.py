"""A continuous-batching engine over the cache index and an online prefix cache.

``python -m cacheidx.serve REQUESTS.jsonl`` serves chat requests with SmolLM2; from Python,
:class:`Engine` serves :class:`Request` objects with any :class:`Model`.
"""

from .engine import Engine
from .model import LlamaModel, Model, ShardedModel
from .requests import MOST_SAMPLES, Line, Request, Result, read_requests
from .sampling import Logprob, Sampling
from .scheduler import Batch, Lane, Scheduler
from .step import Step, TableError

__all__ = ["MOST_SAMPLES", "Batch", "Engine", "Lane", "Line", "LlamaModel", "Logprob", "Model",
           "Request", "Result", "Sampling", "Scheduler", "ShardedModel", "Step", "TableError",
           "read_requests"]
