"""`jaxserve serve` with the engine in a process of its own (its default), as a user runs it: concurrent
streaming clients (a third disconnecting) get the offline API's greedy texts, chat answers equal
`LLM.chat`, the metrics the front end builds from the engine process's events add up, and a dead engine
process turns into 503s (a final error event in a stream, /health) instead of a hung server, which still
exits cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
API_KEY = "test-key"
# The server fixture's engine settings (tests/server/conftest.py), so both engines load the same steps.
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
NUM_CLIENTS = 24
DISCONNECTED_MAX_TOKENS = 48


@dataclass
class ServeProcess:
    url: str
    process: subprocess.Popen
    log: queue.Queue

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0)

    def metrics(self) -> dict[str, float]:
        text = requests.get(f"{self.url}/metrics", timeout=60).text
        return {
            sample.name + "".join(f'{{{k}="{v}"}}' for k, v in sample.labels.items() if k != "model_name"): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def wait_idle(self, timeout: float) -> dict[str, float]:
        """/metrics once nothing runs or waits in the engine."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if metrics["jaxserve:num_requests_running"] == metrics["jaxserve:num_requests_waiting"] == 0:
                return metrics
            assert time.monotonic() < deadline, "the engine did not come back to idle"
            time.sleep(0.1)


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


@pytest.fixture(scope="module")
def served() -> Iterator[ServeProcess]:
    command = [sys.executable, "-m", "jaxserve.cli", "serve", "--port=0", f"--served-model-name={MODEL}"]
    command += [f"--api-key={API_KEY}", *ENGINE_FLAGS]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_lines, args=(process.stderr, log), daemon=True).start()
    try:
        seen = []
        while (line := log.get(timeout=300)) is not None:
            seen.append(line)
            if match := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line):
                break
        else:
            raise AssertionError(f"the server did not start: {''.join(seen)}")
        yield ServeProcess(match.group(1), process, log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def engine_pid(server_pid: int) -> int:
    """The engine process: the server's child started by multiprocessing's spawn (not its resource tracker)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    engines = [
        int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    ]
    assert len(engines) == 1, f"one engine process expected among {children}"
    return engines[0]


def workload(vocab_size: int) -> list[tuple[list[int], int, bool]]:
    """(prompt ids, max_tokens, disconnects) per client: random prompts of 3-16 tokens, 2-12 new tokens."""
    rng = np.random.default_rng(1)
    clients = []
    for i in range(NUM_CLIENTS):
        prompt = rng.integers(100, vocab_size, rng.integers(3, 17)).tolist()
        disconnects = i % 3 == 0
        clients.append((prompt, DISCONNECTED_MAX_TOKENS if disconnects else int(rng.integers(2, 13)), disconnects))
    return clients


async def stream_text(client, prompt: list[int], max_tokens: int, disconnects: bool) -> str:
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    )
    text, chunks = "", 0
    async for chunk in stream:
        chunks += 1
        text += "".join(choice.text for choice in chunk.choices)
        if disconnects and chunks == 2:
            await stream.close()
            break
    return text


async def run_clients(url: str, clients) -> list[str]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as client:
        return await asyncio.gather(*(stream_text(client, *c) for c in clients))


def test_concurrent_streams_with_disconnects_get_the_offline_texts_and_the_metrics_add_up(served, reference):
    clients = workload(reference.engine.vocab_size)
    complete = [(prompt, max_tokens) for prompt, max_tokens, disconnects in clients if not disconnects]
    expected = reference.generate(
        [prompt for prompt, _ in complete],
        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in complete],
        use_tqdm=False,
    )
    before = served.wait_idle(60)

    results = asyncio.run(run_clients(served.url, clients))

    texts = [text for text, (_, _, disconnects) in zip(results, clients, strict=True) if not disconnects]
    assert texts == [o.outputs[0].text for o in expected]
    after = served.wait_idle(120)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    num_disconnected = NUM_CLIENTS - len(complete)
    assert grew('jaxserve:request_success_total{finished_reason="length"}') == len(complete)
    assert grew('jaxserve:request_success_total{finished_reason="abort"}') == num_disconnected
    assert grew("jaxserve:prompt_tokens_total") == sum(len(prompt) for prompt, *_ in clients)
    generated = grew("jaxserve:generation_tokens_total") - sum(n for _, n in complete)
    assert 2 * num_disconnected <= generated < DISCONNECTED_MAX_TOKENS * num_disconnected
    assert grew("jaxserve:time_to_first_token_seconds_count") == NUM_CLIENTS
    assert after["jaxserve:kv_cache_usage_perc"] == 0.0


def test_chat_and_whole_completions_equal_the_offline_api(served, reference):
    client = served.client()
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    response = client.chat.completions.create(model=MODEL, messages=conversation, temperature=0.0, max_tokens=8)
    [expected] = reference.chat(conversation, SamplingParams(temperature=0.0, max_tokens=8))
    assert response.choices[0].message.content == expected.outputs[0].text
    prompts = ["The capital of France is", "1, 2, 3,"]
    response = client.completions.create(model=MODEL, prompt=prompts, temperature=0.0, max_tokens=6, logprobs=2)
    expected = reference.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2), use_tqdm=False)
    choices = sorted(response.choices, key=lambda choice: choice.index)
    assert [c.text for c in choices] == [o.outputs[0].text for o in expected]
    for choice, output in zip(choices, expected, strict=True):
        offline = [lp[t].logprob for lp, t in zip(output.outputs[0].logprobs, output.outputs[0].token_ids, strict=True)]
        assert choice.logprobs.token_logprobs == pytest.approx(offline, abs=1e-5)
    bad = requests.post(
        f"{served.url}/v1/completions",
        json={"model": MODEL, "prompt": [0, 10**9]},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]


def test_a_dead_engine_process_fails_the_stream_and_health_then_sigterm_exits_cleanly(served):
    """Last in this file: it ends the server."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}
    response = requests.post(
        f"{served.url}/v1/completions", json={**body, "stream": True}, headers=headers, stream=True, timeout=60
    )
    events = response.iter_lines(decode_unicode=True)
    first = next(line for line in events if line)
    assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None

    os.kill(engine_pid(served.process.pid), signal.SIGKILL)
    rest = [line.removeprefix("data: ") for line in events if line]

    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == 503 and "engine process exited" in error["message"]
    assert requests.get(f"{served.url}/health", timeout=60).status_code == 503
    after = requests.post(f"{served.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert after.status_code == 503 and "engine" in after.json()["error"]["message"]

    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=60) == 0
    remaining = []
    while (line := served.log.get(timeout=10)) is not None:
        remaining.append(line)
    assert "Finished server process" in "".join(remaining)
