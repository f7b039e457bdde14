"""Ranks of the multi-process tests, each run under a timeout: :func:`torchrun` starts a
``torch.distributed`` run with ``torchrun --standalone``; :func:`processes` starts the ranks of a
``jax.distributed`` run, which must not need torch, with the environment torchrun would give
them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` a free port).

Law: each returns every rank's output once every rank exited 0. When a rank fails (the others
are ended at once) or the timeout passes (every rank is ended), it raises :class:`RanksFailed`,
an ``AssertionError`` whose message says how the run ended and gives the end of each rank's
stdout and stderr. No rank outlives the call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["Ranks", "RanksFailed", "processes", "torchrun"]

#: torchrun, sent SIGTERM, ends its ranks (SIGTERM, then SIGKILL after 30 s) before it exits
GRACE = 45.0


@dataclasses.dataclass
class Ranks:
    """How a run ended: its exit code (``None``: ended at the timeout), and each rank's output."""

    returncode: int | None
    stdout: list[str]
    stderr: list[str]
    log: str = ""  #: torchrun's own output (its summary of the failed ranks); "" otherwise

    def json(self, rank: int) -> dict:
        """The last line rank ``rank`` printed, read as JSON."""
        return json.loads(self.stdout[rank].strip().splitlines()[-1])

    def report(self, tail: int = 3000) -> str:
        parts = [f"--- torchrun ---\n{self.log[-tail:]}"] if self.log else []
        for r, (out, err) in enumerate(zip(self.stdout, self.stderr, strict=True)):
            parts.append(f"--- rank {r} stdout (end) ---\n{out[-tail:]}\n"
                         f"--- rank {r} stderr (end) ---\n{err[-tail:]}")
        return "\n".join(parts)


class RanksFailed(AssertionError):
    def __init__(self, how: str, ranks: Ranks):
        super().__init__(f"{how}\n{ranks.report()}")
        self.ranks = ranks


def torchrun(args: Sequence[str], n: int, *, timeout: float,
             env: Mapping[str, str] | None = None) -> Ranks:
    """``torchrun --standalone --nproc-per-node n ARGS`` (``ARGS``: a script and its arguments,
    or ``-m`` and a module), each rank's output in a file of its own."""
    with tempfile.TemporaryDirectory(prefix="cacheidx-ranks-") as tmp:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={n}", f"--log-dir={tmp}/ranks", "--redirects=3", *args]
        with open(f"{tmp}/torchrun.log", "w+") as log:
            p = subprocess.Popen(argv, env=None if env is None else dict(env), stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            try:
                code = p.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
                _end_torchrun(p)
            log.seek(0)
            own = log.read()
        logs = [_rank_logs(Path(tmp) / "ranks", r) for r in range(n)]
    return _checked(Ranks(code, [o for o, _ in logs], [e for _, e in logs], own), n, timeout)


def processes(argv: Sequence[str], n: int, *, timeout: float,
              env: Mapping[str, str] | None = None) -> Ranks:
    """``n`` processes of ``argv`` with torchrun's environment and a free port, one thread
    each unless ``env`` names another (as torchrun does)."""
    base = dict(os.environ if env is None else env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(n),
                LOCAL_WORLD_SIZE=str(n), PYTHONUNBUFFERED="1")
    base.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="cacheidx-ranks-") as tmp:
        files = [(open(f"{tmp}/{r}.out", "w+"), open(f"{tmp}/{r}.err", "w+"))  # noqa: SIM115
                 for r in range(n)]
        procs: list[subprocess.Popen] = []
        try:
            for r, (out, err) in enumerate(files):
                # a session of its own: ending it ends whatever the rank started too
                procs.append(subprocess.Popen(
                    list(argv), env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), stdout=out,
                    stderr=err, stdin=subprocess.DEVNULL, start_new_session=True))
            code = _first_failure(procs, time.monotonic() + timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    _kill_session(p.pid)
                p.wait()
        outputs = [(_read(out), _read(err)) for out, err in files]
    return _checked(Ranks(code, [o for o, _ in outputs], [e for _, e in outputs]), n, timeout)


def _checked(ranks: Ranks, n: int, timeout: float) -> Ranks:
    if ranks.returncode is None:
        raise RanksFailed(f"{n} ranks were still running after the timeout of {timeout:g} s "
                          f"and were ended", ranks)
    if ranks.returncode != 0:
        raise RanksFailed(f"the run of {n} ranks failed (exit code {ranks.returncode})", ranks)
    return ranks


def _first_failure(procs: list[subprocess.Popen], until: float) -> int | None:
    """The exit code of the first rank to fail, 0 once every rank exited 0, or None at
    ``until``."""
    while time.monotonic() < until:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)
    return None


def _end_torchrun(p: subprocess.Popen) -> None:
    ranks = _children(p.pid)  # each in a session of its own, which torchrun's death would orphan
    p.terminate()
    try:
        p.wait(GRACE)
    except subprocess.TimeoutExpired:
        for pid in ranks:
            _kill_session(pid)
        p.kill()
        p.wait()


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # the fields after the name: state, then the parent's id
            found.append(int(stat.parent.name))
    return found


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _rank_logs(logs: Path, rank: int) -> tuple[str, str]:
    """Rank ``rank``'s stdout and stderr, from torchrun's ``LOG_DIR/RUN/attempt_N/RANK/``."""
    found = sorted(logs.glob(f"*/attempt_*/{rank}"))
    if not found:
        return "", "(no log: torchrun did not start this rank)"
    return tuple((found[-1] / name).read_text(errors="replace")
                 if (found[-1] / name).exists() else "" for name in ("stdout.log", "stderr.log"))


def _read(f) -> str:
    f.seek(0)
    text = f.read()
    f.close()
    return text


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
