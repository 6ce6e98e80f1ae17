"""`jaxserve serve` as a user runs it: a process that answers, and on SIGTERM aborts the stream in flight
(a final error event, then [DONE]) and exits with status 0 after uvicorn's shutdown; and the warning when
it binds beyond this machine without an API key."""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

from jaxserve.server import launch
from jaxserve.server.config import ServerConfig

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

REPO = Path(__file__).resolve().parents[2]
# The server fixture's engine settings, so the process loads the steps that fixture compiled.
ENGINE_FLAGS = [
    "--dtype=float32",
    "--max-seq-len=256",
    "--max-batch-size=16",
    "--max-num-tokens=32",
    "--decode-batch-sizes=16",
    "--token-buckets=32",
    "--enable-prompt-logprobs",
    "--no-penalty-variants",
]


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def test_serve_answers_and_exits_cleanly_on_sigterm_aborting_the_stream():
    command = [sys.executable, "-m", "jaxserve.cli", "serve", "--port=0", "--served-model-name=smollm2", "-v"]
    command += ENGINE_FLAGS
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_lines, args=(process.stderr, log), daemon=True).start()
    try:
        seen = []
        while (line := log.get(timeout=180)) is not None:
            seen.append(line)
            if match := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line):
                url = match.group(1)
                break
        else:
            raise AssertionError(f"the server did not start: {''.join(seen)}")

        body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0.0}
        response = requests.post(
            f"{url}/v1/completions", json={**body, "ignore_eos": True, "stream": True}, stream=True
        )
        events = response.iter_lines(decode_unicode=True)
        first = next(line for line in events if line)
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None
        process.send_signal(signal.SIGTERM)
        rest = [line.removeprefix("data: ") for line in events if line]

        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
        assert len(rest) - 2 < 199, "the stream was aborted, not finished"
        assert process.wait(timeout=60) == 0
        remaining = []
        while (line := log.get(timeout=10)) is not None:
            remaining.append(line)
        assert "Finished server process" in "".join(remaining)
        # -v: the engine loop's summary when it ended (the rounds it stepped, the engine's steps)
        assert re.search(r"engine loop: [1-9]\d* rounds, .*; replica 0: [1-9]\d* steps", "".join(remaining))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_binding_beyond_this_machine_without_an_api_key_warns(monkeypatch, caplog):
    class NotStarted:
        def run(self) -> None:
            pass

    monkeypatch.setattr(launch, "make_server", lambda *args, **kwargs: NotStarted())
    with caplog.at_level(logging.WARNING, logger=launch.__name__):
        launch.serve(None, "127.0.0.1", 8000, ServerConfig("m"))  # type: ignore[arg-type]
        launch.serve(None, "0.0.0.0", 8000, ServerConfig("m", api_key="k"))  # type: ignore[arg-type]
        assert not caplog.records
        launch.serve(None, "0.0.0.0", 8000, ServerConfig("m"))  # type: ignore[arg-type]
    [record] = caplog.records
    assert "without an API key" in record.getMessage() and "0.0.0.0" in record.getMessage()
