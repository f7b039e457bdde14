"""``python -m cacheidx.conformance``'s bad usage: each exits 2 naming the option before any law
runs, and a report that cannot be written at the end is printed rather than lost."""

from __future__ import annotations

import json
import shutil

import pytest

from cacheidx.conformance import __main__ as cli


@pytest.mark.parametrize("argv, words", [
    (["--json", "/no/such/dir/r.json"], "argument --json: the folder /no/such/dir does not exist"),
    (["--jobs", "-1"], "argument --jobs: expected a positive integer, got -1"),
    (["--jobs", "0"], "argument --jobs: expected a positive integer, got 0"),
    (["--backend", "nosuch"], "argument --backend: no backend named 'nosuch'; registered: numpy"),
])
def test_bad_usage_exits_2_before_any_law_runs(argv, words, capsys, monkeypatch):
    """Issue 20, repro 5: --json into a missing folder once ran the whole suite and lost the
    report in a traceback; --jobs -1 never returned; an unknown backend was 'broken', status 1."""
    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("the suite ran"))
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_a_backend_without_the_mode_asked_for_is_skipped_not_failed(capsys):
    assert cli.main(["--backend", "numpy", "--mode", "compiled", "--jobs", "1"]) == 1
    out = capsys.readouterr()
    assert "skipped: numpy has no compiled mode (it has eager)" in out.out
    assert "FAIL" not in out.out and "no backend ran" in out.err


def test_a_report_that_cannot_be_written_at_the_end_is_printed(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "reports"
    folder.mkdir()

    def run(*args, **kwargs):  # the folder goes away while the suite runs
        shutil.rmtree(folder)
        return [{"backend": "numpy", "device": "cpu", "status": "pass", "laws": {"a": "pass"}}]

    monkeypatch.setattr(cli, "run", run)
    monkeypatch.setattr(cli, "table", lambda report: "the table")
    assert cli.main(["--json", str(folder / "r.json")]) == 2
    out = capsys.readouterr()
    assert "cannot write" in out.err and "the report follows" in out.err
    assert json.loads(out.out.split("the table", 1)[1])["report"][0]["status"] == "pass"


def test_the_help_states_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "Exit status: 0 every law passed, 1 some law failed or no backend ran, 2 bad usage" \
        in " ".join(capsys.readouterr().out.split())


def test_one_worker_runs_the_jobs_of_its_backend_one_after_another():
    """A worker reads a job a line and reports each, so a backend's library is imported once
    for all its jobs; the runner hands a worker the jobs of its own backend only."""
    import subprocess
    import sys

    from cacheidx.conformance import runner

    job = {"backend": "numpy", "device": "cpu", "modes": ["eager"], "family": None}
    lines = "".join(json.dumps({**job, "family": f}) + "\n" for f in ("model", "index"))
    done = subprocess.run([sys.executable, "-m", "cacheidx.conformance.worker"], input=lines,
                          capture_output=True, text=True, timeout=120, check=True)
    reports = [json.loads(x[len(runner.REPORT):]) for x in done.stdout.splitlines()
               if x.startswith(runner.REPORT)]
    assert [sorted(r["modes"]["eager"]["laws"]) for r in reports] == [
        sorted(law.name for law in runner.LAWS if law.family == f and law.runs("eager"))
        for f in ("model", "index")]
    ran = []
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as m:
        real = runner._Worker.give
        m.setattr(runner._Worker, "give",
                  lambda w, j, o: (ran.append((w.proc.pid, w.t["backend"])), real(w, j, o)))
        report = runner.run(["numpy", "strict"], modes=["eager"], workers=2, progress=None)
    assert all(e["status"] == "pass" for e in report)
    by = {}
    for pid, name in ran:
        by.setdefault(pid, set()).add(name)
    assert all(len(names) == 1 for names in by.values())


def test_a_worker_finds_its_backends_devices_and_says_why_not():
    """The runner asks each library's first worker for its devices (the main process never
    imports the library); a backend that cannot start is a reason, not a crash."""
    import queue

    from cacheidx.conformance import runner

    w = runner._Worker({"backend": "numpy", "device": "cpu"}, {}, queue.Queue())
    try:
        w.ask()
        assert w.answer() == ["cpu"]
        w.t = {"backend": "no-such-backend", "device": "cpu"}
        w.ask()
        with pytest.raises(RuntimeError, match="no-such-backend"):
            w.answer()
    finally:
        w.close()
    assert w.ended() == "" and w.proc.returncode == 0
    found = runner.targets(["numpy"], found_by=lambda name: (_ for _ in ()).throw(
        RuntimeError("no library")))
    assert found == [{"backend": "numpy", "device": "-", "status": "broken: no library"}]


@pytest.mark.parametrize("name", ["strict", "numpy"], ids=["first worker", "later worker"])
def test_a_worker_that_ends_before_it_answers_is_started_again_without_settings(name):
    """A library that rejects a checking setting ends its worker before it answers: the
    runner starts it again without the settings, with the job it had, and the run passes;
    so for a library's first worker (asked for its devices: strict, not imported here) and
    for a worker started for a job (numpy, imported)."""
    import subprocess
    import sys

    from cacheidx.conformance import runner

    real = runner._spawn
    started = []

    def spawn(name, device, options, *, tuned=True):
        started.append(tuned)
        if tuned:  # as a library refusing a setting: gone before a word
            return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        return real(name, device, options, tuned=tuned)

    with pytest.MonkeyPatch().context() as m:
        m.setattr(runner, "_spawn", spawn)
        m.delitem(sys.modules, "array_api_strict", raising=False)  # so it gets a first worker
        report = runner.run([name], modes=["eager"], workers=2, progress=None)
    assert started[:2] == [True, False]
    assert [e["status"] for e in report] == ["pass"]


def test_the_longest_job_left_starts_whenever_a_worker_frees():
    """Whenever a worker frees, the longest job left starts (the jobs come longest first), in
    a free worker of its backend where there is one, else in a new one; a free worker none of
    whose jobs are left ends."""
    from cacheidx.conformance import runner

    made, started = [], []

    class Worker:  # a worker whose every job reports at once
        def __init__(self, t, options, inbox, *, tuned=True):
            self.t, self.inbox, self.tuned = t, inbox, tuned
            self.job, self.reported, self.began, self.closed = None, 0, 0.0, False
            made.append(self)

        def give(self, job, options):
            self.job = job
            started.append((job[1], made.index(self)))
            self.inbox.put((self, json.dumps({"backend": self.t["backend"], "modes": {}})))

        def close(self):
            self.closed = True

    def on(name):
        return {"backend": name, "device": "cpu"}

    todo = [(on("torch"), (["compiled"], "longest")), (on("jax"), (["eager"], "second")),
            (on("jax"), (["compiled"], "third")), (on("torch"), (["eager"], "last"))]
    finished = []
    with pytest.MonkeyPatch().context() as m:
        m.setattr(runner, "_Worker", Worker)
        runner._parallel(todo, {}, 2, lambda t, job, report: finished.append(job[1]))
    # the torch worker frees first: the third job, JAX's, starts in a new worker (JAX's first
    # is busy), and the torch worker waits for the last, torch's, which it takes next
    assert started == [("longest", 0), ("second", 1), ("third", 2), ("last", 0)]
    assert sorted(finished) == sorted(j[1] for _, j in todo)
    assert [w.closed for w in made] == [True, True, True]
