"""Run the law suite on every backend and device of this machine, in every mode.

The work is cut into jobs, one per backend, device and law family (:func:`jobs`), each running
the backend's modes one after another in one process. Jobs run in worker processes, as many at
once as the machine has cores, the longest first; a worker runs jobs of one backend and device
only (it imports its library once for all of them), so a backend's compiler caches and settings
never leak into another's, and the first worker of each library finds its devices, so this
process imports none (:func:`_scouts`); ``workers=1`` runs them here, one after another.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time
import traceback
import warnings
from typing import Any

from .. import backends, devices
from .precision import Precision
from .suite import DEFAULT_MODES, LAWS, MODES, Case, Session, compiler_for

__all__ = ["targets", "jobs", "run_job", "run", "table", "machine", "DeviceMissing"]


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
            if name in ("torch", "jax", "cupy"):
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
            precision: str = "highest", torch_compiler: str | None = None) -> dict:
    """Every law (of ``family``, or all) on one backend and device in each of ``modes``:
    outcomes, facts and times."""
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


#: the line a worker starts each job's report with (anything else a law prints is not one)
REPORT = "cacheidx-conformance-report "


def _spawn(name: str, device: str, options: dict, *, tuned: bool = True) -> subprocess.Popen:
    """A worker for jobs of backend ``name``: it reads a job a line on its standard input and
    writes each one's report as a :data:`REPORT` line, till its input closes. ``tuned``: with
    the backend's settings for checking (a library that rejects one of them fails at once, and
    the job is started again without them)."""
    # one thread a worker: the workers already fill the cores, and every tensor is tiny
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if tuned:
        env.update(backends._class(name).checking_env(device))
    return subprocess.Popen([sys.executable, "-m", "cacheidx.conformance.worker"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _spec(t: dict, job: tuple[list[str], str | None], options: dict) -> str:
    modes, family = job
    return json.dumps({"backend": t["backend"], "device": t["device"], "modes": modes,
                       "family": family, **options})


class _Worker:
    """A worker process and the job it runs; a thread reads its reports into ``inbox`` (and
    ``None`` when it ends) and another keeps its standard error, so neither pipe fills."""

    def __init__(self, t: dict, options: dict, inbox: queue.Queue, *, tuned: bool = True):
        self.t, self.tuned, self.job, self.began = t, tuned, None, 0.0
        self.inbox, self._lock = inbox, threading.Lock()
        self.proc = _spawn(t["backend"], t["device"], options, tuned=tuned)
        self.err: list[str] = []
        self.reported = 0
        threading.Thread(target=self._read, daemon=True).start()
        self._errors = threading.Thread(target=lambda: self.err.extend(self.proc.stderr),
                                        daemon=True)
        self._errors.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(REPORT):
                self._put(line[len(REPORT):])
        self._put(None)

    def _put(self, line: str | None) -> None:
        with self._lock:
            self.inbox.put((self, line))

    def redirect(self, inbox: queue.Queue) -> None:
        """Its reports go to ``inbox`` from now on, with those not yet read."""
        with self._lock:
            old, self.inbox = self.inbox, inbox
            while not old.empty():
                inbox.put(old.get())

    def ask(self) -> None:
        """Ask for its backend's devices (:func:`labels`), found in the worker, which imports
        its library to answer: the main process never imports it."""
        self._send(json.dumps({"devices": self.t["backend"]}))

    def answer(self) -> list[str] | None:
        """The answer to :meth:`ask`; ``None`` where the worker ended first (a setting its
        library rejects, say). Raises where the library fails to start."""
        _, line = self.inbox.get()
        if line is None:
            return None
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["devices"]

    def _send(self, line: str) -> None:
        with contextlib.suppress(OSError):  # it ended: its reader says so
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def give(self, job: tuple, options: dict) -> None:
        self.job, self.began = job, time.perf_counter()
        self._send(_spec(self.t, job, options))

    def restarted(self, options: dict, *, ask: bool = False) -> _Worker:
        """A worker in its place without the checking settings (this one ended before it
        answered: a setting its library rejects, say), into the same inbox, asked for its
        devices again where ``ask``, then given its job again."""
        again = _Worker(self.t, options, self.inbox, tuned=False)
        if ask:
            again.ask()  # first: the answer is the first line it writes
        if self.job is not None:
            again.give(self.job, options)
        return again

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()

    def ended(self) -> str:
        """Its standard error, whole, once it has ended."""
        self.proc.wait()
        self._errors.join()
        return "".join(self.err)


def run(names: list[str] | None = None, device: str | None = None, *,
        modes: list[str] | None = None, precision: str = "highest",
        torch_compiler: str | None = None, workers: int | None = None,
        progress: Any = sys.stderr) -> list[dict]:
    """The report: one entry per backend and device, each mode's laws in it."""
    workers = workers or os.cpu_count() or 1
    options = {"precision": precision, "torch_compiler": torch_compiler}
    scouts, started = ({}, []) if workers == 1 else _scouts(names, options, workers, device,
                                                             modes)

    def found_by(name: str) -> list[str]:
        if name not in scouts:
            return labels(name)
        w = scouts[name]
        got = w.answer()
        if got is None and w.tuned:  # ended before it answered: again, without the settings
            old, w = w, w.restarted(options, ask=True)
            scouts[name], started[started.index(old)] = w, w
            got = w.answer()
        if got is None:
            err = w.ended().strip()
            raise RuntimeError(err.splitlines()[-1] if err else
                               f"its worker ended with {w.proc.returncode}")
        return got

    try:
        found = targets(names, device, found_by=found_by)
    except BaseException:
        for w in started:
            w.close()
        raise
    for t in found:  # a backend without the modes asked for is skipped, never a failure
        if t["status"] == "run" and not jobs(t, modes):
            has = ["eager", *backends._class(t["backend"]).modes]
            t["status"] = (f"skipped: {t['backend']} has no {' or '.join(modes or [])} mode "
                           f"(it has {', '.join(has)})")
    todo = [(t, job) for t in found if t["status"] == "run" for job in jobs(t, modes)]
    todo.sort(key=lambda tj: _weight(tj[0]["backend"], *tj[1]), reverse=True)
    for w in started:  # the first jobs run already
        ran = next((i for i, (t, job) in enumerate(todo) if _same(t, w.t) and job == w.job), None)
        if ran is not None:
            w.t = todo.pop(ran)[0]
    results: dict[tuple[str, str], list[dict]] = {}
    say = (lambda msg: print(msg, file=progress, flush=True)) if progress else (lambda m: None)

    def label(t: dict, job: tuple) -> str:
        return f"{t['backend']}/{t['device']} {'+'.join(job[0])}" + (
            f" ({job[1]} laws)" if job[1] else "")

    def done(t: dict, job: tuple, report: dict) -> None:
        results.setdefault((t["backend"], t["device"]), []).append(report)
        say(f"{label(t, job)}: {_summary(report)}")

    start = time.perf_counter()
    if workers == 1:
        for t, job in todo:
            done(t, job, run_job(t["backend"], t["device"], job[0], family=job[1], **options))
    else:
        _parallel(todo, options, workers, done, idle=started)
    report = []
    for t in found:
        if t["status"] != "run":
            report.append(dict(t))
            continue
        report.append(_entry(t, results.get((t["backend"], t["device"]), [])))
    say(f"all jobs: {time.perf_counter() - start:.1f} s")
    return report


def _same(a: dict, b: dict) -> bool:
    return (a["backend"], a["device"]) == (b["backend"], b["device"])


def _scouts(names: list[str] | None, options: dict, workers: int, device: str | None,
            modes: list[str] | None) -> tuple[dict[str, _Worker], list[_Worker]]:
    """The first workers, started at once: one for each backend whose library the main process
    has not imported (those that compile first), asked for its backend's devices
    (:meth:`_Worker.ask`), and, where the run takes the host, the ``workers`` longest of those
    backends' jobs on it (where the library computes there: :attr:`Backend.host
    <cacheidx.backends.Backend.host>`), each given to its backend's first worker, or to one more
    of that backend, before any answer comes. The libraries load side by side, in the processes
    that use them; none waits for another's devices, and the longest jobs start first whatever
    their backend. Returns the first worker of each backend, and every worker started."""
    found = []
    for name in names or backends.names():
        try:
            cls = backends._class(name)
        except Exception:  # targets() reports it
            continue
        if cls.module is not None and cls.module not in sys.modules and cls.usable()[0]:
            found.append((not cls.modes, name, cls))
    first, host = {}, []
    for _, name, cls in sorted(found, key=lambda f: f[:2])[:workers]:
        t = {"backend": name, "device": "cpu"}
        w = first[name] = _Worker(t, options, queue.Queue())
        w.ask()
        if cls.host and device in (None, "cpu"):
            host += [(t, job) for job in jobs(t, modes)]
    started = list(first.values())
    for t, job in sorted(host, key=lambda tj: _weight(tj[0]["backend"], *tj[1]),
                         reverse=True)[:workers]:
        w = first[t["backend"]]
        if w.job is not None:
            w = _Worker(t, options, queue.Queue())
            started.append(w)
        w.give(job, options)
    return first, started


def _parallel(todo: list[tuple[dict, tuple]], options: dict, workers: int, done: Any, *,
              idle: list[_Worker] = ()) -> None:
    """Run ``todo`` (longest first) in at most ``workers`` busy processes at once: whenever one
    frees, the longest job left starts (the last to start are short), in a free worker of its
    backend and device where there is one (its library imported already; a backend's compiler
    caches never meet another's), else in a new one; a free worker none of whose jobs are left
    ends. ``idle``: workers started already (:func:`_scouts`), each running its job or free."""
    pending, inbox = list(todo), queue.Queue()
    busy, free = [], []

    def fill() -> None:
        while pending and len(busy) < workers:
            t, job = pending.pop(0)
            w = next((w for w in free if _same(w.t, t)), None)
            if w is None:
                w = _Worker(t, options, inbox)
            else:
                free.remove(w)
            w.t = t
            w.give(job, options)
            busy.append(w)
        for w in [w for w in free if not any(_same(t, w.t) for t, _ in pending)]:
            free.remove(w)
            w.close()

    def finish(w: _Worker, out: str, err: str, code: int) -> None:
        report = _read(out, err, w.t, w.job, code)
        report["wall_seconds"] = round(time.perf_counter() - w.began, 2)
        job, w.job = w.job, None
        done(w.t, job, report)

    for w in idle:
        w.redirect(inbox)
        (busy if w.job is not None else free).append(w)
    fill()
    while busy:
        w, line = inbox.get()
        if line is not None:  # a job's report
            w.reported += 1
            finish(w, line, "", 0)
            busy.remove(w)
            free.append(w)
            fill()
            continue
        err = w.ended()  # the worker ended: closed when free, or in the middle of a job
        if w in free:
            free.remove(w)
        if w not in busy:
            continue
        busy.remove(w)
        if w.tuned and not w.reported:  # rejected a setting before it began: again
            busy.append(w.restarted(options))
            continue
        finish(w, "", err, w.proc.returncode)
        fill()


#: a job's rough CPU seconds per backend, family and mode, from a run on a 2-core machine
#: (docs/conformance.md), to start the longest first so that the last to start are short: JAX's
#: eager laws compile a program per call's structure and shape, torch's dynamic mode traces
#: with symbolic shapes; another backend is taken to cost as torch does
_COST = {
    "torch": {"index": {"eager": 0.2, "compiled": 18, "dynamic": 24},
              "model": {"eager": 0.3, "compiled": 7.5, "dynamic": 6.5},
              "attention": {"eager": 0.3, "compiled": 2}},
    "jax": {"index": {"eager": 5.5, "compiled": 3},
            "model": {"eager": 7, "compiled": 2}, "attention": {"eager": 9, "compiled": 1.7}},
}


def _weight(backend: str, modes: list[str], family: str | None) -> float:
    """A job's rough cost (:data:`_COST`); a backend without a compiler (one job of every
    law, eager) costs about a second."""
    if family is None:
        return 1.0
    costs = _COST.get(backend, _COST["torch"])[family]
    return sum(costs.get(m, 1.0) for m in modes)


def _read(out: str, err: str, t: dict, job: tuple, code: int) -> dict:
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        tail = (err or out or "").strip()[-2000:]
        return {"backend": t["backend"], "device": t["device"], "modes": {},
                "error": f"the worker for {'+'.join(job[0])} ended with {code}:\n{tail}"}


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
