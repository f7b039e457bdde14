"""``within(seconds)``: a block that runs longer fails with ``TimeoutError`` (a hang is a failure,
not a stuck suite). SIGALRM: the main thread of a POSIX process, as pytest runs tests.
``memory(extra)``: a block that asks for more memory than that gets a ``MemoryError``."""

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


@contextlib.contextmanager
def memory(extra: int):
    """At most ``extra`` more bytes of private memory within the block (Linux's data limit,
    beyond what the process maps now): a call that asks for more gets a ``MemoryError`` where
    the system's overcommit would otherwise let it fill memory until the process is killed.
    Elsewhere (no ``/proc``, another system) the block runs unbounded."""
    import resource

    try:
        with open("/proc/self/status") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f
                          if line.startswith("VmData:"))
    except (OSError, StopIteration):
        yield
        return
    old = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (mapped + extra, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, old)
