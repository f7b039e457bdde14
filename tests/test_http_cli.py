"""``python -m cacheidx.serve --http HOST:PORT``: the command serves until SIGTERM, which
drains it (the server's law 1): the stream in flight ends whole, a new request and
``/health`` get 503, and the command returns 0. The command runs here in the test's own
main thread (where signals land); a thread plays the client and sends the signal. It serves
the tiny model of ``test_http``, and with ``--model PATH --kv int8`` a transformers folder, the
tokens the file-of-requests command gives."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from deadline import within
from test_http import MODEL, NAME, Held, chat, decode, encode, offline, template, wait_for

from cacheidx.serve import __main__ as cli

openai = pytest.importorskip("openai", reason="the server's tests need the openai client "
                             "(pip install -e \".[test]\")")
pytest.importorskip("cacheidx.serve.http", reason="the server needs fastapi and uvicorn "
                    "(pip install -e \".[serve]\")")


def served(model=MODEL):
    return cli.Served(NAME, model, template, decode, (), encode)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(argv, talk, seconds=40, **options):
    """The command's exit status, run with ``argv`` and ``--http`` on a free port, while
    ``talk(url)`` (on a thread, once ``/health`` answers) plays the client and then sends
    SIGTERM; and what ``talk`` returned."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    seen: dict = {}

    def client():
        try:
            deadline = time.monotonic() + seconds
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.05)
            seen["out"] = talk(url)
        except BaseException as e:  # the main thread asserts
            seen["error"] = e
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    with within(seconds):
        status = cli.main(["--http", f"127.0.0.1:{port}", *argv], **options)
        thread.join(10)
    assert "error" not in seen, seen.get("error")
    return status, seen["out"]


def test_sigterm_drains_the_command_and_it_exits_0():
    messages = chat("until the signal")
    want = offline(template(messages), 48, temperature=0)

    held = Held(calls=4)  # the stream stays in flight until the drain has been seen

    def talk(url):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)
        stream = c.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                           max_tokens=48, stream=True,
                                           extra_body={"return_token_ids": True})
        chunks = [next(stream), next(stream)]
        assert wait_for(lambda: held.calls < 0)  # a call waits: the stream is in flight
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while httpx.get(f"{url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "no drain after SIGTERM"
            time.sleep(0.01)
        late = httpx.post(f"{url}/v1/chat/completions", timeout=5, json={
            "model": NAME, "messages": chat("late"), "max_tokens": 2})
        held.go.set()
        chunks += list(stream)
        ids = [t for ch in chunks for x in ch.choices
               for t in (x.model_extra.get("token_ids") or [])]
        return late.status_code, late.json()["error"]["code"], ids, \
            chunks[-1].choices[0].finish_reason

    status, (late, code, ids, finish) = command(
        ["--page-size", "4", "--pages", "256", "--grace", "20"], talk,
        served=lambda: served(held))
    assert status == 0
    assert (late, code) == (503, "unavailable")
    assert ids == want and finish == "length"


def test_a_transformers_folder_with_kv_int8_answers_as_the_file_command(tmp_path):
    for module in ("torch", "transformers"):
        pytest.importorskip(module, reason=f"--model needs `{module}`")
    from hf_models import tiny

    folder = tmp_path / "llama"
    tiny("llama").save_pretrained(folder)
    prompt = [5, 9, 2, 7, 11, 3]
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"id": "r", "prompt_ids": prompt, "max_new_tokens": 6}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([str(requests), "--model", str(folder), "--kv", "int8", "--json"]) == 0
    want = json.loads(out.getvalue())["requests"][0]["tokens"]

    def talk(url):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)
        (model,) = c.models.list().data
        r = c.completions.create(model=model.id, prompt=prompt, max_tokens=6, temperature=0,
                                 extra_body={"return_token_ids": True})
        with pytest.raises(openai.BadRequestError, match="tokenizer"):
            c.completions.create(model=model.id, prompt="text", max_tokens=2)
        os.kill(os.getpid(), signal.SIGTERM)
        return model.id, r.choices[0].model_extra["token_ids"]

    status, (name, ids) = command(["--model", str(folder), "--kv", "int8", "--pages", "16"], talk)
    assert status == 0 and name == "llama"
    assert ids == want


def test_http_and_a_file_of_requests_are_refused_together(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["requests.jsonl", "--http", "127.0.0.1:0"], served=served)
    assert e.value.code == 2
    assert "not both" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["--http", "nowhere"], served=served)
    assert e.value.code == 2
    assert "HOST:PORT" in capsys.readouterr().err
