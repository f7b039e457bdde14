"""Run the law suite on every backend and device of this machine, in every mode.

The work is cut into jobs, one per backend, device and law family (:func:`jobs`), each running
the backend's modes one after another in one process. Jobs run in process pools
(:class:`concurrent.futures.ProcessPoolExecutor`), one per backend and device, as many jobs at
once over all the pools as the machine has cores: a library reads its settings for checking from
the environment when it is imported (:meth:`Backend.checking_env
<cacheidx.backends.Backend.checking_env>`; XLA's differ by device), and its compiler caches stay
its own; a pool's processes import their library once for all its jobs. The pools also find each
library's devices, so this process imports none. ``workers=1`` runs every job here, one after
another.

In a pool a job runs under a watchdog (:func:`faulthandler.dump_traceback_later`): a law, or a
library's start, that runs past ``timeout`` seconds ends its process, so neither a crash nor a
hang stops the run. A job whose process ended (when one of a pool's processes dies, the pool ends
them all) runs once more, alone, in a process without the checking settings (a library may
reject one); ending again, or out of time, it is a failure that names its backend, device and
the law it was in, with the end of what its process printed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from .. import backends, devices
from .precision import Precision
from .suite import DEFAULT_MODES, LAWS, MODES, Case, Session, compiler_for

__all__ = ["targets", "jobs", "run_job", "run", "table", "machine", "DeviceMissing", "TIMEOUT"]


class DeviceMissing(ValueError):
    """``--device`` names a device no backend here has."""


def labels(name: str) -> list[str]:
    """The devices of backend ``name`` here, in :mod:`cacheidx.devices`' spelling (every host
    device is one ``cpu``)."""
    backend = backends.get(name)
    found: dict[str, Any] = {}
    for d in backend.devices():
        found.setdefault(backend.device_label(d), d)
    return list(found)


def targets(names: list[str] | None = None, device: str | None = None, *,
            found_by: Any = None) -> list[dict]:
    """Every (backend, device) to run, with the reason where one cannot run. Raises
    :class:`DeviceMissing` (listing what was found) when ``device`` names no device here.
    ``found_by(name)``: a backend's devices (:func:`labels` here by default; raises where
    the library breaks)."""
    want = devices.canonical(device) if device is not None else None
    found_by = found_by or labels
    out, found = [], {}
    for name in names or backends.names():
        try:
            cls = backends._class(name)
        except Exception as e:  # a third-party entry point that fails to load
            out.append({"backend": name, "device": "-", "status": f"broken: {e}"})
            continue
        ok, why = cls.usable()
        if not ok:
            out.append({"backend": name, "device": want or "-", "status": f"skipped: {why}"})
            continue
        try:
            here = found[name] = found_by(name)
        except Exception as e:  # the library fails to start
            out.append({"backend": name, "device": "-", "status": f"broken: {e}"})
            continue
        if want is None and not any(label.startswith("cuda") for label in here):
            if cls.cuda:
                out.append({"backend": name, "device": "cuda", "status":
                            f"no device: no CUDA device visible to {name}"})
        for label in here:
            if want is None or label == want:
                out.append({"backend": name, "device": label, "status": "run"})
        if want is not None and want not in here:
            out.append({"backend": name, "device": want,
                        "status": f"no device: {name} has {', '.join(here)}"})
    if want is not None and not any(t["status"] == "run" for t in out):
        raise DeviceMissing(f"cacheidx.conformance: no device {device!r} here; found "
                            f"{devices.found(found)}")
    return out


def jobs(target: dict, modes: list[str] | None = None) -> list[tuple[list[str], str | None]]:
    """The jobs of a target, one worker each: ``(modes, family)``, the modes run one after
    another in one process (so it imports its library once) over the laws of ``family`` (the
    index's, attention's or the model's; ``None``: all). Without ``modes``: every
    mode the backend has but ``automatic``, whose behaviour across shapes one law checks in the
    dynamic run (a whole run in it is ``--mode automatic``). A backend that compiles gets a job
    per family, so that the cores share the work evenly; the index's laws, the most, a job per
    compiled mode past the first (the eager run rides with the first)."""
    cls = backends._class(target["backend"])
    have = [m for m in MODES if m == "eager" or m in cls.modes]
    have = [m for m in have if m in (modes or DEFAULT_MODES)]
    if not have:
        return []
    if not cls.modes:
        return [(have, None)]
    first = have[:2] if len(have) > 1 and have[0] == "eager" else have[:1]
    index = [(first, "index"), *(([m], "index") for m in have[len(first):])]
    return [*index, *((have, f) for f in ("attention", "model"))]


def run_one(law: Any, case: Case) -> str | None:
    """The failure of ``law`` in ``case`` as text, ``None`` when it holds."""
    try:
        with warnings.catch_warnings():
            # dynamo notes each lru_cache it traces through inside array-api-compat
            warnings.filterwarnings("ignore", message=".*lru_cache.*")
            law(case)
    except Exception:
        return traceback.format_exc(limit=-3)
    return None


def run_job(name: str, device: str, modes: list[str], *, family: str | None = None,
            precision: str = "highest", torch_compiler: str | None = None,
            before: Callable[[str], None] | None = None) -> dict:
    """Every law (of ``family``, or all) on one backend and device in each of ``modes``:
    outcomes, facts and times. ``before(what)`` is told each law (``"name [mode]"``) before it
    runs."""
    backend = backends.get(name)
    where = devices.resolve(backend, device)
    policy = Precision.named(precision, backend, where)
    out = {"backend": name, "device": device, "version": backend.version(), "modes": {},
           "precision": policy.report(backend, where)}
    for mode in modes:
        backend.forget()
        session = Session(policy=policy, compiler=compiler_for(backend, mode, torch_compiler))
        laws, facts, took = {}, {}, {}
        start, cpu = time.perf_counter(), time.process_time()
        with backend.many_programs(), policy.applied(backend):
            for law in LAWS:
                if not law.runs(mode) or family not in (None, law.family):
                    continue
                if before is not None:
                    before(f"{law.name} [{mode}]")
                case = Case(backend, where, mode=mode, session=session)
                began = time.process_time()
                failure = run_one(law, case)
                took[law.name] = round(time.process_time() - began, 3)
                laws[law.name] = "pass" if failure is None else failure
                facts.update(case.facts)
        out["modes"][mode] = {
            "laws": laws, "facts": facts, "law_cpu_seconds": took,
            "compiler": ("none" if mode == "eager" else session.compiler or "jit"),
            "seconds": round(time.perf_counter() - start, 2),
            "cpu_seconds": round(time.process_time() - cpu, 2)}
    return out


#: seconds a law, or a library's start, may run in a pool before its process is ended
TIMEOUT = 300.0


def run(names: list[str] | None = None, device: str | None = None, *,
        modes: list[str] | None = None, precision: str = "highest",
        torch_compiler: str | None = None, workers: int | None = None,
        progress: Any = sys.stderr, timeout: float = TIMEOUT) -> list[dict]:
    """The report: one entry per backend and device, each mode's laws in it. ``workers``: jobs
    at once (one per core; 1 runs them here); ``timeout``: the seconds a law, or a library's
    start, may run in a pool."""
    workers = workers or os.cpu_count() or 1
    options = {"precision": precision, "torch_compiler": torch_compiler}
    say = (lambda msg: print(msg, file=progress, flush=True)) if progress else (lambda m: None)
    results: dict[tuple[str, str], list[dict]] = {}

    def done(t: dict, job: tuple, report: dict) -> None:
        results.setdefault((t["backend"], t["device"]), []).append(report)
        say(f"{t['backend']}/{t['device']} {'+'.join(job[0])}"
            + (f" ({job[1]} laws)" if job[1] else "") + f": {_summary(report)}")

    with contextlib.ExitStack() as stack:
        pools = None if workers == 1 else stack.enter_context(_Pools(workers, timeout))
        found_by = labels if pools is None else pools.devices(names)
        found = targets(names, device, found_by=found_by)
        for t in found:  # a backend without the modes asked for is skipped, never a failure
            if t["status"] == "run" and not jobs(t, modes):
                has = ["eager", *backends._class(t["backend"]).modes]
                t["status"] = (f"skipped: {t['backend']} has no {' or '.join(modes or [])} "
                               f"mode (it has {', '.join(has)})")
        todo = [(t, job) for t in found if t["status"] == "run" for job in jobs(t, modes)]
        # the longest first, so that the last to start are short: a job that compiles before one
        # that does not, the index's laws (the most) before the others
        todo.sort(key=lambda tj: (tj[1][0] == ["eager"], tj[1][1] != "index"))
        start = time.perf_counter()
        if pools is None:
            for t, job in todo:
                done(t, job, run_job(t["backend"], t["device"], job[0], family=job[1],
                                     **options))
        else:
            pools.run(todo, options, done)
    report = [dict(t) if t["status"] != "run"
              else _entry(t, results.get((t["backend"], t["device"]), [])) for t in found]
    say(f"all jobs: {time.perf_counter() - start:.1f} s")
    return report


#: the line a job's trail gives before each law (what the laws print is not one)
_AT = "cacheidx-conformance: in "


def _start(env: dict[str, str]) -> None:
    """A pool's process: its backend's settings, its output away from the run's until a job
    gives it a trail (:func:`_trail`)."""
    os.environ.update(env)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)


@contextlib.contextmanager
def _trail(path: str, timeout: float) -> Iterator[Callable[[str], None]]:
    """What a job prints into the file ``path``, with each step it is told (``at(what)``, a
    :data:`_AT` line) and, where its process dies or a step runs past ``timeout`` seconds (the
    watchdog then ends the process), every thread's traceback."""
    with open(path, "w") as f:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        faulthandler.enable(f)

        def at(what: str) -> None:
            print(_AT + what, flush=True)
            faulthandler.dump_traceback_later(timeout, exit=True, file=f)

        try:
            yield at
        finally:
            faulthandler.cancel_dump_traceback_later()
            faulthandler.disable()
            sys.stdout.flush()
            sys.stderr.flush()
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            os.close(quiet)


def _work(name: str, device: str, modes: list[str], family: str | None, options: dict,
          trail: str, timeout: float) -> dict:
    """:func:`run_job` in a pool's process, under :func:`_trail`; the report as JSON gives it
    (a fact that is a library's object comes back as text: this process imports no library)."""
    with _trail(trail, timeout) as at:
        at(f"the start of {name}")
        report = run_job(name, device, modes, family=family, before=at, **options)
    return json.loads(json.dumps(report, default=str))


def _devices(name: str, trail: str, timeout: float) -> list[str]:
    """:func:`labels` in a pool's process (it imports the library), under :func:`_trail`."""
    with _trail(trail, timeout) as at:
        at(f"the start of {name}")
        return labels(name)


class _Pools:
    """A run's process pools, one per backend and device (:func:`_pool`), each job's trail in a
    folder of its own, and the rule for a job whose process ended (this module's doc)."""

    def __init__(self, workers: int, timeout: float):
        self.workers, self.timeout = workers, timeout
        self.pools: dict[tuple[str, str], ProcessPoolExecutor] = {}
        self.untuned: set[tuple[str, str]] = set()  # a pool of theirs ended: none since
        self.folder = tempfile.TemporaryDirectory(prefix="cacheidx-conformance-")
        self.trails = 0

    def __enter__(self) -> _Pools:
        return self

    def __exit__(self, *exc: Any) -> None:
        for pool in self.pools.values():
            pool.shutdown(cancel_futures=True)
        self.folder.cleanup()

    def submit(self, t: dict, fn: Callable, *args: Any, alone: bool = False) -> tuple:
        """``fn(*args, trail, timeout)`` in the pool of ``t``'s backend and device (``alone``:
        in a new pool of one process, without the checking settings): its future, the pool and
        the trail."""
        key = (t["backend"], t["device"])
        if alone:
            pool = _pool(*key, 1, tuned=False)
        else:
            if key not in self.pools:
                self.pools[key] = _pool(*key, self.workers, tuned=key not in self.untuned)
            pool = self.pools[key]
        self.trails += 1
        trail = os.path.join(self.folder.name, f"{self.trails}.txt")
        return pool.submit(fn, *args, trail, self.timeout), pool, trail

    def ended(self, t: dict, pool: ProcessPoolExecutor) -> None:
        """``pool`` ended its processes: ``t``'s next jobs go to a new pool, without the
        checking settings."""
        key = (t["backend"], t["device"])
        if self.pools.get(key) is pool:
            del self.pools[key]
            self.untuned.add(key)
        pool.shutdown(wait=False)

    def devices(self, names: list[str] | None) -> Callable[[str], list[str]]:
        """A ``found_by`` for :func:`targets`: each backend whose library this process has not
        imported is asked in its CPU pool, all at once (the libraries load side by side, in the
        processes that will run their jobs); a question whose process ended is asked once more
        (in a pool without the settings)."""
        asked = {}
        for name in names or backends.names():
            try:
                cls = backends._class(name)
            except Exception:  # targets() reports it
                continue
            if cls.module is not None and cls.module not in sys.modules and cls.usable()[0]:
                asked[name] = self.submit({"backend": name, "device": "cpu"}, _devices, name)

        def answer(t: dict, future: Future, pool: ProcessPoolExecutor, trail: str, *,
                   last: bool) -> list[str] | None:
            try:
                return future.result()
            except BrokenProcessPool:
                self.ended(t, pool)
                if last or _timed_out(trail):  # its last line, for the table's cell
                    raise RuntimeError(_ended(trail, self.timeout).splitlines()[-1]) from None
                return None

        def found_by(name: str) -> list[str]:
            if name not in asked:
                return labels(name)
            t = {"backend": name, "device": "cpu"}
            got = answer(t, *asked[name], last=False)
            return got if got is not None else answer(t, *self.submit(t, _devices, name),
                                                      last=True)

        return found_by

    def run(self, todo: list[tuple[dict, tuple]], options: dict, done: Any) -> None:
        """Run ``todo`` in order, at most :attr:`workers` jobs at once over all pools, calling
        ``done(target, job, report)`` as each ends."""
        pending = [(t, job, False) for t, job in todo]
        running: dict[Future, tuple] = {}
        while pending or running:
            while pending and len(running) < self.workers:
                t, job, again = pending.pop(0)
                future, pool, trail = self.submit(t, _work, t["backend"], t["device"], *job,
                                                  options, alone=again)
                running[future] = (t, job, again, pool, trail, time.perf_counter())
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                t, job, again, pool, trail, began = running.pop(future)
                if again:
                    pool.shutdown(wait=False)
                try:
                    report = future.result()
                except BrokenProcessPool:
                    self.ended(t, pool)
                    if not again and not _timed_out(trail):
                        pending.insert(0, (t, job, True))
                        continue
                    report = _broken(t, job, _ended(trail, self.timeout))
                except Exception as e:  # the job could not start: a device gone, say
                    report = _broken(t, job, f"raised {e!r}")
                report["wall_seconds"] = round(time.perf_counter() - began, 2)
                done(t, job, report)


def _pool(name: str, device: str, workers: int, *, tuned: bool) -> ProcessPoolExecutor:
    """A pool of processes for jobs of one backend and device: spawned (this process may hold
    threads, or a library under pytest), one thread each (the processes already fill the cores,
    and every tensor is tiny), with the backend's checking settings where ``tuned``."""
    env = {"OMP_NUM_THREADS": "1"}
    if tuned:
        env.update(backends._class(name).checking_env(device))
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start, initargs=(env,))


def _read(trail: str) -> str:
    try:
        with open(trail, errors="replace") as f:
            return f.read()
    except FileNotFoundError:  # it ended before the job began
        return ""


def _timed_out(trail: str) -> bool:
    return "Timeout (" in _read(trail)  # faulthandler's watchdog begins its dump so


def _ended(trail: str, timeout: float) -> str:
    """Why a job's process ended, from its trail: the step it was in, and the trail's end."""
    lines = _read(trail).splitlines()
    steps = [line[len(_AT):] for line in lines if line.startswith(_AT)]
    said = "\n".join(line for line in lines if not line.startswith(_AT)).strip()
    how = f"ran past {timeout:g} s" if "Timeout (" in said else "ended its process"
    return f"{how} in {steps[-1] if steps else 'its start'}:\n{said[-2000:]}"


def _broken(t: dict, job: tuple, why: str) -> dict:
    """The report of a job that gave none: ``why`` its error."""
    name = "+".join(job[0]) + (f" ({job[1]} laws)" if job[1] else "")
    return {"backend": t["backend"], "device": t["device"], "modes": {},
            "error": f"the job {name} {why}"}


def _summary(job: dict) -> str:
    if "error" in job:
        return "BROKEN"
    laws = [o for m in job["modes"].values() for o in m["laws"].values()]
    bad = sum(o != "pass" for o in laws)
    took = sum(m["seconds"] for m in job["modes"].values())
    return f"{len(laws) - bad}/{len(laws)} {'pass' if not bad else 'FAIL'} ({took:.1f} s)"


def _entry(target: dict, results: list[dict]) -> dict:
    """One row of the report from a target's jobs."""
    entry = {"backend": target["backend"], "device": target["device"], "laws": {},
             "passed": 0, "failed": 0, "modes": {}}
    for job in results:
        entry.setdefault("version", job.get("version"))
        entry.setdefault("precision", job.get("precision"))
        if "error" in job:
            entry["error"] = entry.get("error", "") + job["error"]
            entry["failed"] += 1
        for mode, m in job["modes"].items():
            for name, outcome in m["laws"].items():
                entry["laws"][f"{name}[{mode}]"] = outcome
                entry["passed" if outcome == "pass" else "failed"] += 1
            # a mode's laws may come from several jobs (one per family): add them up
            have = entry["modes"].setdefault(mode, {"compiler": m["compiler"], "seconds": 0.0,
                                                    "cpu_seconds": 0.0, "facts": {},
                                                    "law_cpu_seconds": {}})
            have["seconds"] = round(have["seconds"] + m["seconds"], 2)
            have["cpu_seconds"] = round(have["cpu_seconds"] + m["cpu_seconds"], 2)
            have["facts"].update(m["facts"])
            have["law_cpu_seconds"].update(m.get("law_cpu_seconds", {}))
    # in the order a run takes them, whichever job reported first
    entry["modes"] = {m: entry["modes"][m] for m in MODES if m in entry["modes"]}
    entry["seconds"] = round(sum(m["seconds"] for m in entry["modes"].values()), 2)
    compiled = {k: v for k, v in entry["laws"].items() if not k.endswith("[eager]")}
    entry["eager_equals_compiled"] = (all(v == "pass" for v in compiled.values())
                                      if compiled else "no compiler")
    entry["status"] = "pass" if entry["failed"] == 0 and entry["laws"] else "FAIL"
    return entry


def table(report: list[dict]) -> str:
    """The report as a Markdown table, one row per backend and device."""
    lines = ["| backend | device | version | modes (compiler) | laws passed | failed "
             "| eager = compiled | donated in place | programs for 4 allocations | time (s) "
             "| status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in report:
        modes = e.get("modes", {})
        named = ", ".join(m + (f" ({v['compiler']})" if v["compiler"] != "none" else "")
                          for m, v in modes.items()) or "-"
        donation = modes.get("eager", {}).get("facts", {}).get("donation in place", "-")
        programs = [str(v["facts"]["programs for 4 allocations"]) for v in modes.values()
                    if "programs for 4 allocations" in v["facts"]]
        cells = [e["backend"], e["device"], e.get("version") or "-", named,
                 e.get("passed", "-"), e.get("failed", "-"), e.get("eager_equals_compiled", "-"),
                 donation, ", ".join(programs) or "-", e.get("seconds", "-"), e["status"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        mine = version("cacheidx")
    except PackageNotFoundError:
        mine = None
    return {"python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.machine(), "cores": os.cpu_count(), "cacheidx": mine}
