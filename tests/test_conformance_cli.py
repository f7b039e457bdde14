"""``python -m cacheidx.conformance``'s bad usage: each exits 2 naming the option before any law
runs, and a report that cannot be written at the end is printed rather than lost."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pytest

import cacheidx as ci
from cacheidx.conformance import LAWS, Law, runner
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


# what a pool's process runs in these tests, in place of runner._work: functions of this module,
# which the spawned processes import by name (a monkeypatch reaches only this process)

def _work_where(*args):
    """A job, and the process it ran in with the libraries it holds."""
    report = runner._work(*args)
    return {**report, "pid": os.getpid(), "strict": "array_api_strict" in sys.modules}


def _work_with(law_fn, *args):
    """A job with one law more, ``law_fn``'s, among the index's."""
    LAWS.append(Law(law_fn.__name__.removeprefix("law_"), law_fn, ""))
    return runner._work(*args)


def law_crashes_its_process(case):
    os._exit(3)


def law_hangs(case):
    time.sleep(600)


def _work_crashing(*args):
    return _work_with(law_crashes_its_process, *args)


def _work_hanging(*args):
    return _work_with(law_hangs, *args)


def _refuses(fn, *args):
    if os.environ.get("CACHEIDX_TEST_SETTING"):  # as a library that rejects a setting: gone
        os._exit(3)
    return fn(*args)


def _work_refusing(*args):
    return _refuses(runner._work, *args)


def _devices_refusing(*args):
    return _refuses(runner._devices, *args)


def _todo(name, families):
    return [({"backend": name, "device": "cpu"}, (["eager"], f)) for f in families]


def test_a_pools_process_runs_jobs_of_one_backend_only():
    """A pool per backend and device: a process imports its library once for all its jobs,
    and never holds another backend's library."""
    families = ("index", "model", "attention")
    reports = []
    with pytest.MonkeyPatch().context() as m, runner._Pools(2, runner.TIMEOUT) as pools:
        m.setattr(runner, "_work", _work_where)
        pools.run(_todo("numpy", families) + _todo("strict", families), {},
                  lambda t, job, report: reports.append(report))
    assert all(r["modes"]["eager"]["laws"] for r in reports) and len(reports) == 6
    by = {}
    for r in reports:
        by.setdefault(r["pid"], set()).add(r["backend"])
        assert r["strict"] == (r["backend"] == "strict")
    assert all(len(names) == 1 for names in by.values()) and len(by) < 6


def test_a_crashing_law_fails_naming_itself_and_its_backend(capsys):
    """A law that ends its process is a failure of its backend's row that names the law (the
    job ran once more, alone, and ended again), and the run goes on."""
    with pytest.MonkeyPatch().context() as m:
        m.setattr(runner, "_work", _work_crashing)
        assert cli.main(["--backend", "numpy", "--backend", "strict", "--jobs", "2"]) == 1
    out = capsys.readouterr().out
    assert "numpy/cpu: the job eager ended its process in crashes_its_process [eager]" in out
    assert out.count("| FAIL |") == 2


def test_a_hanging_law_fails_after_the_timeout_naming_itself():
    """A law past the timeout ends its process (faulthandler's watchdog), with its traceback,
    not run again: the run never hangs."""
    began = time.perf_counter()
    with pytest.MonkeyPatch().context() as m:
        m.setattr(runner, "_work", _work_hanging)
        report = runner.run(["numpy"], modes=["eager"], workers=2, progress=None, timeout=3)
    assert time.perf_counter() - began < 60
    (entry,) = report
    assert entry["status"] == "FAIL" and entry["passed"] == 0
    assert "the job eager ran past 3 s in hangs [eager]" in entry["error"]
    assert "in law_hangs" in entry["error"]  # the traceback faulthandler wrote


@pytest.mark.parametrize("name", ["strict", "numpy"], ids=["device question", "job"])
def test_a_process_that_ends_before_it_answers_is_started_again_without_settings(name):
    """A library that rejects a checking setting ends its process at once: the question of its
    devices (strict, not imported here) or its job (numpy) is asked again in a process without
    the settings, and the run passes."""
    cls = ci.backends._class(name)
    with pytest.MonkeyPatch().context() as m:
        m.setattr(cls, "checking_env", classmethod(lambda c, d: {"CACHEIDX_TEST_SETTING": "1"}))
        m.setattr(runner, "_work", _work_refusing)
        m.setattr(runner, "_devices", _devices_refusing)
        m.delitem(sys.modules, "array_api_strict", raising=False)  # so its devices are asked
        report = runner.run([name], modes=["eager"], workers=2, progress=None)
    assert [e["status"] for e in report] == ["pass"]


def test_a_backend_that_cannot_start_is_a_reason_not_a_crash():
    found = runner.targets(["numpy"], found_by=lambda name: (_ for _ in ()).throw(
        RuntimeError("no library")))
    assert found == [{"backend": "numpy", "device": "-", "status": "broken: no library"}]


def test_jobs_that_compile_start_first_the_index_laws_first():
    """The longest first, so that the last to start are short: a job of a compiled mode
    before an eager one, the index's laws (the most) before the others'."""
    if not ci.backends._class("torch").usable()[0]:
        pytest.skip("torch is not installed: no compiled mode to order")
    todo = []
    with pytest.MonkeyPatch().context() as m:
        m.setattr(runner._Pools, "devices", lambda self, names: lambda name: ["cpu"])
        m.setattr(runner._Pools, "run", lambda self, jobs, options, done: todo.extend(jobs))
        runner.run(["numpy", "torch"], workers=2, progress=None)
    assert [(t["backend"], job) for t, job in todo] == [
        ("torch", (["eager", "compiled"], "index")), ("torch", (["dynamic"], "index")),
        ("torch", (["eager", "compiled", "dynamic"], "attention")),
        ("torch", (["eager", "compiled", "dynamic"], "model")), ("numpy", (["eager"], None))]
