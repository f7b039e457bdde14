"""``within(seconds)``: a block that runs longer fails with ``TimeoutError`` (a hang is a failure,
not a stuck suite). SIGALRM: the main thread of a POSIX process, as pytest runs tests."""

from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def within(seconds: float):
    def alarm(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
