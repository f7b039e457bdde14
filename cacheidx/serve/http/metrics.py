"""``GET /metrics``: the server's counts in Prometheus' text format (version 0.0.4).

Laws:

1. Every HTTP answer is counted once, by its endpoint (a path the server does not serve
   counts as ``"other"``) and status code (``cacheidx_http_requests_total``), when its
   headers go out (a stream's at its start).
2. The engine's counts are those of its last step (:attr:`~cacheidx.serve.http.loop.Loop.snapshot`):
   tokens as counters (``prompt``, ``computed``, ``cached``: the prefix cache's hits,
   ``generated``), requests as counters by how they ended, and pages and queues as gauges.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, type, help, the snapshot's key)
_ENGINE = [
    ("cacheidx_prompt_tokens_total", "counter", "Prompt tokens admitted (a request of n "
     "samples n times).", "prompt_tokens"),
    ("cacheidx_computed_tokens_total", "counter", "Prompt tokens computed by prefill calls.",
     "computed_tokens"),
    ("cacheidx_cached_tokens_total", "counter", "Prompt tokens read from the prefix cache "
     "(its hits).", "cached_tokens"),
    ("cacheidx_generated_tokens_total", "counter", "Tokens generated.", "generated_tokens"),
    ("cacheidx_engine_steps_total", "counter", "Engine steps.", "steps"),
    ("cacheidx_pages", "gauge", "Pages in the pool.", "pages"),
    ("cacheidx_pages_in_use", "gauge", "Pages held by running requests.", "pages_in_use"),
    ("cacheidx_pages_cached", "gauge", "Pages the prefix cache holds.", "pages_cached"),
    ("cacheidx_pages_free", "gauge", "Pages free.", "pages_free"),
    ("cacheidx_evictions_total", "counter", "Cached pages evicted.", "evictions"),
    ("cacheidx_lanes", "gauge", "Lanes the engine runs at once.", "lanes"),
    ("cacheidx_lanes_running", "gauge", "Lanes running (a sample each).", "lanes_running"),
    ("cacheidx_requests_running", "gauge", "Requests with a lane running.", "requests_running"),
    ("cacheidx_requests_waiting", "gauge", "Requests queued, no lane running yet.",
     "requests_waiting"),
    ("cacheidx_samples_in_flight", "gauge", "Samples submitted and not ended.",
     "samples_in_flight"),
]


class Metrics:
    """The HTTP counts (law 1), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.http: Counter[tuple[str, int]] = Counter()

    def answered(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.http[endpoint, int(status)] += 1

    def text(self, snapshot: dict[str, Any]) -> str:
        """Law 2: the exposition of the HTTP counts and the engine's ``snapshot``."""
        lines = ["# HELP cacheidx_http_requests_total HTTP requests answered, by endpoint and "
                 "status code.", "# TYPE cacheidx_http_requests_total counter"]
        with self._lock:
            http = sorted(self.http.items())
        for (endpoint, status), n in http:
            lines.append(f'cacheidx_http_requests_total{{endpoint="{endpoint}",'
                         f'status="{status}"}} {n}')
        lines += ["# HELP cacheidx_requests_total Engine requests ended, by how.",
                  "# TYPE cacheidx_requests_total counter"]
        served, failed, cancelled = (snapshot["served"], snapshot["failed"],
                                     snapshot["cancelled"])
        for how, n in (("served", served), ("failed", failed - cancelled),
                       ("cancelled", cancelled)):
            lines.append(f'cacheidx_requests_total{{outcome="{how}"}} {n}')
        for name, kind, help_, key in _ENGINE:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}",
                      f"{name} {snapshot[key]}"]
        prompt = snapshot["prompt_tokens"]
        rate = snapshot["cached_tokens"] / prompt if prompt else 0.0
        lines += ["# HELP cacheidx_prefix_hit_rate Cached over prompt tokens.",
                  "# TYPE cacheidx_prefix_hit_rate gauge", f"cacheidx_prefix_hit_rate {rate}"]
        return "\n".join(lines) + "\n"
