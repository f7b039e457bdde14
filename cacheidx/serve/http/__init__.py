"""An OpenAI-compatible HTTP server over the engine: ``python -m cacheidx.serve --http
HOST:PORT [--model PATH]`` (FastAPI on uvicorn; ``pip install "cacheidx[serve]"``).

Its rooms, each stating its laws: :mod:`.schema` (the requests, pydantic models of OpenAI's),
:mod:`.loop` (the engine's thread, where every connection's requests join one continuous
batch), :mod:`.app` (the routes and the answers), :mod:`.metrics` (``/metrics``) and
:mod:`.server` (uvicorn, draining on SIGTERM).
"""

from .app import app
from .loop import Job, Loop
from .server import Running, serve

__all__ = ["Job", "Loop", "Running", "app", "serve"]
