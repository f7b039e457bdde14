"""Start ``n`` ranks of one command on this host, under a deadline.

Each rank gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` a free port), so the same
command serves ``torch.distributed`` (``init_method="env://"``) and ``jax.distributed`` (the
coordinator at ``MASTER_ADDR:MASTER_PORT``), and one thread each (``OMP_NUM_THREADS=1``, as
torchrun sets, unless the environment names another). Laws: :func:`launch` returns only when
every rank exited 0; as soon as one rank fails, or at the deadline, it kills every rank (and
whatever each started) and raises :class:`RankFailed`, naming the first rank that failed, how,
and the end of its stderr. A collective never outlives its launcher.

    python -m cacheidx.parallel.launch -n 3 --deadline 600 -- python -m cacheidx.parallel.greedy
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

__all__ = ["RankFailed", "RankResult", "free_port", "launch"]


@dataclasses.dataclass
class RankResult:
    """One rank's end: its exit code (``None`` if killed before it ended), stdout, and the end
    of its stderr."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str


class RankFailed(RuntimeError):
    """A rank exited non-zero, or the deadline passed; ``results`` holds every rank's end."""

    def __init__(self, message: str, results: list[RankResult], rank: int | None):
        super().__init__(message)
        self.results = results
        self.rank = rank  #: the rank that failed first; None when the deadline ended them all


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at ``host`` now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def launch(
    argv: Sequence[str],
    ranks: int,
    *,
    deadline: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    tail: int = 3000,
) -> list[RankResult]:
    """Run ``argv`` as ``ranks`` processes and wait for all of them, at most ``deadline``
    seconds. Returns each rank's :class:`RankResult` when all exited 0; raises
    :class:`RankFailed` otherwise, after killing every rank still running."""
    if isinstance(argv, str) or not argv:
        raise TypeError(f"cacheidx.parallel.launch: argv must be a non-empty list of strings, "
                        f"got {argv!r}")
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"cacheidx.parallel.launch: ranks must be a positive int, got {ranks!r}")
    if deadline <= 0:
        raise ValueError(f"cacheidx.parallel.launch: deadline must be positive, got {deadline}")
    base = dict(os.environ if env is None else env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(ranks),
                LOCAL_WORLD_SIZE=str(ranks), PYTHONUNBUFFERED="1")
    if ranks > 1:  # as torchrun does: ranks sharing the cores must not each take all of them
        base.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="cacheidx-launch-") as tmp:
        procs, files = [], []
        try:
            for r in range(ranks):
                out = open(os.path.join(tmp, f"{r}.out"), "w+")  # noqa: SIM115
                err = open(os.path.join(tmp, f"{r}.err"), "w+")  # noqa: SIM115
                files.append((out, err))
                rank_env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
                # a session of its own: killing it kills whatever the rank started as well
                procs.append(subprocess.Popen(list(argv), env=rank_env, cwd=cwd, stdout=out,
                                              stderr=err, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
            failed, why = _wait(procs, time.monotonic() + deadline)
        finally:
            alive = [p.poll() is None for p in procs]
            for p in procs:
                _kill(p)
        results = []
        for r, (p, (out, err)) in enumerate(zip(procs, files, strict=True)):
            out.seek(0)
            err.seek(0)
            code = None if alive[r] else p.returncode
            results.append(RankResult(r, code, out.read(), err.read()[-tail:]))
            out.close()
            err.close()
    if why is None:
        return results
    if why == "deadline":
        late = [r.rank for r in results if r.returncode is None]
        ends = "".join(f"\n--- rank {r} stderr (end) ---\n{results[r].stderr}" for r in late)
        raise RankFailed(f"cacheidx.parallel.launch: ranks {late} of {ranks} were still running "
                         f"at the deadline of {deadline:g}s and were killed{ends}", results, None)
    res = results[failed]
    raise RankFailed(f"cacheidx.parallel.launch: rank {failed} of {ranks} failed ({why}); the "
                     f"other ranks were ended\n--- rank {failed} stderr (end) ---\n{res.stderr}",
                     results, failed)


def _wait(procs: list[subprocess.Popen], until: float) -> tuple[int | None, str | None]:
    """``(rank, why)`` of the first rank to fail, ``(None, "deadline")``, or ``(None, None)``
    once every rank exited 0. One thread per rank waits for it, so the first rank to end is
    the first one seen, even when its failure ends the others a moment later."""
    ended: queue.Queue[tuple[int, int]] = queue.Queue()
    for r, p in enumerate(procs):
        threading.Thread(target=lambda r=r, p=p: ended.put((r, p.wait())), daemon=True).start()
    for _ in procs:
        try:
            r, code = ended.get(timeout=max(until - time.monotonic(), 0.0))
        except queue.Empty:
            return None, "deadline"
        if code != 0:
            return r, _describe(code)
    return None, None


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _kill(p: subprocess.Popen) -> None:
    """End ``p``'s session (the rank and any children it left), then reap the rank."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cacheidx.parallel.launch",
        description="Run a command as N ranks on this host (torchrun's environment, a free port) "
        "under a deadline; print rank 0's stdout.")
    parser.add_argument("-n", "--nproc", type=int, required=True)
    parser.add_argument("--deadline", type=float, default=600.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        results = launch(command, args.nproc, deadline=args.deadline, tail=20000)
    except RankFailed as e:
        print(e, file=sys.stderr)
        return 1
    sys.stdout.write(results[0].stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
