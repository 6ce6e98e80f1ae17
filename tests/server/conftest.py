"""One server for every server test: the default model in float32 behind a real uvicorn on a free localhost
port (in a thread of the test process, so the tests can look at its engine), with an API key; and the
offline reference, an `LLM` built from the same loaded model with the same engine settings, so greedy
tokens and logprobs are comparable. Small limits keep the compiled steps few: one prefill and one decode
shape, compiled on first use (CPU), stored on disk and loaded by the second engine."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.config import CompileConfig
from jaxserve.llm import LLM
from jaxserve.server.config import ServerConfig
from jaxserve.server.frontend import AsyncEngine
from jaxserve.server.launch import Server, make_server

MODEL_NAME = "smollm2"
API_KEY = "test-key"
MAX_SEQ_LEN = 256
MAX_REQUEST_BYTES = 1 << 20
ENGINE: dict[str, Any] = dict(
    dtype="float32",
    max_seq_len=MAX_SEQ_LEN,
    max_batch_size=16,
    max_num_tokens=32,
    compile_config=CompileConfig(
        decode_batch_sizes=(16,), token_buckets=(32,), prompt_logprobs=True, penalty_variants=False
    ),
    show_progress=False,
)


@dataclass
class RunningServer:
    """A started server: its URL, its engine (through the LLM it was built on) and its front end."""

    url: str
    llm: LLM
    server: Server
    model: str = MODEL_NAME
    api_key: str = API_KEY

    @property
    def frontend(self) -> AsyncEngine:
        return self.server.frontend

    def client(self, **kwargs: Any) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def async_client(self, **kwargs: Any) -> Any:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{label="value",...}': value}, the labels sorted, model_name left out."""
        text = requests.get(f"{self.url}/metrics", timeout=60).text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return values


def start_server(llm: LLM, config: ServerConfig) -> tuple[RunningServer, threading.Thread]:
    server = make_server(llm, "127.0.0.1", 0, config, log_level="warning", access_log=False)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    if not server.ready.wait(120):
        raise RuntimeError("the server did not start")
    port = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(f"http://127.0.0.1:{port}", llm, server), thread


def stop_server(running: RunningServer, thread: threading.Thread) -> None:
    running.server.handle_exit(signal.SIGTERM, None)
    thread.join(60)
    assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="session")
def smollm2_model() -> Any:
    """The default model, loaded once in float32."""
    from jaxserve.models.hub import DEFAULT_MODEL
    from jaxserve.models.loader import load_model

    return load_model(DEFAULT_MODEL, dtype="float32")


@pytest.fixture(scope="session")
def reference(smollm2_model) -> Iterator[LLM]:
    """The offline API with the server's engine settings."""
    with LLM(smollm2_model, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="session")
def served(smollm2_model) -> Iterator[RunningServer]:
    with LLM(smollm2_model, **ENGINE) as llm:
        running, thread = start_server(llm, ServerConfig(MODEL_NAME, API_KEY, MAX_REQUEST_BYTES))
        yield running
        stop_server(running, thread)


@pytest.fixture(scope="session")
def client(served) -> Any:
    return served.client()


@pytest.fixture(scope="session")
def model(served) -> str:
    """The served model name, which requests send as `model`."""
    return served.model


@pytest.fixture
def serve_llm() -> Iterator[Any]:
    """Starts a server over an LLM for one test (`serve_llm(llm, config)` -> RunningServer); stopped after it."""
    started: list[tuple[RunningServer, threading.Thread]] = []

    def start(llm: LLM, config: ServerConfig) -> RunningServer:
        started.append(start_server(llm, config))
        return started[-1][0]

    yield start
    for running, thread in started:
        stop_server(running, thread)
