"""Ctrl-C keeps what was finished (issue 26, item 6): ``python -m cacheidx.serve`` sent SIGINT
after some answers finished prints (with ``--json``, writes) every finished answer, names the
unfinished requests and exits 130 (the shells' 128 + SIGINT), as its help says.

A real process and a real signal: the command runs the tiny Llama on NumPy (this module's
``tiny``, which the child imports: a second or so to start), two requests arrive at once and
two a minute later, and the signal is sent once the first two are reported finished. Every
wait is bounded.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

import pytest

from cacheidx.models import llama
from cacheidx.serve import LlamaModel
from cacheidx.serve import __main__ as cli

HERE = os.path.dirname(os.path.abspath(__file__))
LINES = [{"id": "a", "prompt_ids": [1, 2, 3], "max_new_tokens": 4},
         {"id": "b", "prompt_ids": [4, 5, 6, 7], "max_new_tokens": 3},
         {"id": "c", "prompt_ids": [1, 2], "arrival": 60},
         {"id": "d", "prompt_ids": [8], "arrival": 120}]
# the child: SIGINT back to KeyboardInterrupt (a shell's background job inherits it ignored)
CHILD = f"""
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {HERE!r})
from test_serve_interrupt import tiny
from cacheidx.serve import __main__ as cli
sys.exit(cli.main(sys.argv[1:], served=tiny))
"""


def tiny() -> cli.Served:
    config = llama.Config.tiny()
    return cli.Served("the tiny Llama", LlamaModel(config, llama.random_params(config, seed=3)),
                      lambda messages: [1], lambda ids: " ".join(map(str, ids)))


def interrupted(path: str, *argv: str) -> tuple[int, str, str]:
    """The command over ``path`` in a child process, sent SIGINT once requests ``a`` and
    ``b`` are reported finished: ``(status, stdout, stderr)``."""
    with subprocess.Popen([sys.executable, "-c", CHILD, path, *argv], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(x) for x in child.stderr],
                                  daemon=True)
        reader.start()
        err, finished = [], set()
        try:
            while finished != {"a", "b"}:
                err.append(lines.get(timeout=30))  # queue.Empty: the child never got there
                finished |= {r for r in "ab" if f"request '{r}': " in err[-1]}
            child.send_signal(signal.SIGINT)
            child.wait(timeout=30)
        finally:
            child.kill()
        reader.join(timeout=5)
        while not lines.empty():
            err.append(lines.get())
        out = child.stdout.read()  # a few lines: the pipe held them
    return child.returncode, out, "".join(err)


@pytest.fixture
def requests(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    return str(path)


def finished_alone(tmp_path, *argv):
    """What the command prints for lines ``a`` and ``b`` alone, uninterrupted, in process."""
    path = tmp_path / "ab.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in LINES[:2]))
    return path, cli.main([str(path), *argv], served=tiny)


def test_ctrl_c_prints_the_finished_answers_names_the_unfinished_and_exits_130(
        requests, tmp_path, capsys):
    status, out, err = interrupted(requests)
    _, rc = finished_alone(tmp_path)
    assert rc == 0
    assert out == capsys.readouterr().out, "the finished answers, as an uninterrupted run's"
    assert status == 130, err
    assert "interrupted; 2 of 4 requests unfinished: 'c' (line 3), 'd' (line 4)" in err
    assert "served 2 of 4 requests" in err and "Traceback" not in err


def test_ctrl_c_with_json_writes_the_finished_answers_and_lists_the_unfinished(
        requests, tmp_path, capsys):
    status, out, err = interrupted(requests, "--json")
    assert out, err
    got = json.loads(out)
    finished_alone(tmp_path, "--json")
    want = json.loads(capsys.readouterr().out)
    assert status == cli.INTERRUPTED == 130, err
    assert [(r["id"], r["line"], r["tokens"]) for r in got["requests"]] == \
        [(r["id"], r["line"], r["tokens"]) for r in want["requests"]]
    assert got["unfinished"] == [{"id": "c", "line": 3}, {"id": "d", "line": 4}]
    assert (got["figures"]["requests"], got["figures"]["failed"],
            got["figures"]["unfinished"]) == (4, 0, 2)


def test_the_help_states_the_status_of_an_interrupted_run(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "130 interrupted (Ctrl-C): the finished answers are printed, the unfinished " \
           "requests named" in " ".join(capsys.readouterr().out.split())
