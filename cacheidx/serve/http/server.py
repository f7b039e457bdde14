"""The server on uvicorn: in the foreground (``python -m cacheidx.serve --http``), or on a
thread of its own (:class:`Running`, what the tests and the benchmark start).

Laws:

1. SIGTERM (and a first Ctrl-C) drains (the loop's law 5): ``/health`` and every new request
   get 503 while the requests in flight run to their end (their streams end with their last
   chunk and ``[DONE]``), or past ``grace`` seconds are cancelled; then the server stops
   and the command exits 0. A second signal stops it at once.
2. :class:`Running` binds its socket before it returns (``port=0``: a free port the system
   picks, :attr:`Running.port`), serves until :meth:`Running.stop`, and stops its engine's
   thread with it.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from typing import Any

import uvicorn

from ..engine import Engine
from .app import app
from .loop import Loop

__all__ = ["Running", "Server", "serve"]


class Server(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT drains ``loop`` (law 1)."""

    def __init__(self, config: uvicorn.Config, loop: Loop):
        super().__init__(config)
        self.loop = loop
        loop.on_drained = self._drained

    def _drained(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT) and not self.loop.draining:
            self.loop.drain()
            return
        self.should_exit = True  # a second signal: now
        if sig == signal.SIGINT and self.loop.draining:
            self.force_exit = True


def _socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _parts(engine: Engine, served: dict[str, Any], queue: int, grace: float,
           log_level: str) -> tuple[Loop, Server]:
    loop = Loop(engine, queue=queue, grace=grace)
    config = uvicorn.Config(app(loop, **served), log_level=log_level, access_log=False,
                            lifespan="off", timeout_graceful_shutdown=5)
    return loop, Server(config, loop)


def serve(engine: Engine, host: str, port: int, *, queue: int = 256, grace: float = 30.0,
          say: Any = print, **served: Any) -> int:
    """Serves ``engine`` on ``host:port`` in the foreground until drained (law 1); ``served``
    is :func:`~cacheidx.serve.http.app.app`'s model arguments. Returns the exit status."""
    sock = _socket(host, port)
    loop, server = _parts(engine, served, queue, grace, "info")
    loop.start()
    shown = f"[{host}]" if ":" in host else host
    say(f"serving {served['name']} on http://{shown}:{sock.getsockname()[1]}/v1 "
        "(SIGTERM drains)")
    try:
        server.run(sockets=[sock])
    finally:
        loop.stop()
    return 0


class Running:
    """The server of ``engine`` on a thread (law 2), at :attr:`url`."""

    def __init__(self, engine: Engine, *, host: str = "127.0.0.1", port: int = 0,
                 queue: int = 256, grace: float = 30.0, **served: Any):
        self._sock = _socket(host, port)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.loop, self.server = _parts(engine, served, queue, grace, "warning")
        self.loop.start()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self._sock])),
            name="cacheidx-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("cacheidx.serve.http.Running: the server did not start")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.loop.stop(timeout)
        self._sock.close()

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()
