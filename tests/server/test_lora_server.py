"""LoRA adapters through the OpenAI-compatible server, as vLLM serves them: a request's `model` picks the adapter
(completions and chat, whole or streamed, against transformers + peft's greedy tokens in float32), /v1/models lists
the adapters under the base model, /v1/load_lora_adapter and /v1/unload_lora_adapter change them at runtime (an
unload waits for the requests in flight), and the errors a client meets. One server in a thread of this process (a
tiny random Llama with a word-level tokenizer, an adapter loaded at start through `lora_modules`), and one
`jaxserve serve` process for the engine-process path."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
import transformers

peft = pytest.importorskip("peft", reason="peft is in the test extra: pip install -e '.[test]'")

from peft_reference import NEW_TOKENS, VOCAB, peft_tokens, save_adapter, save_base_model  # noqa: E402

from jaxserve.cli_args import build_parser  # noqa: E402
from jaxserve.config import CompileConfig, KvCacheConfig  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.replicas import Round  # noqa: E402
from jaxserve.sampling import SamplingParams  # noqa: E402
from jaxserve.server.config import LoraModule, ServerConfig  # noqa: E402
from jaxserve.server.driver import EngineDriver  # noqa: E402
from jaxserve.server.launch import make_server  # noqa: E402

pytestmark = pytest.mark.needs_torch

REPO = Path(__file__).resolve().parents[2]
BASE = "tiny-llama"
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
    "wide": dict(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"]),  # above --max-lora-rank 8
}
PROMPTS = [np.random.default_rng(i).integers(0, VOCAB, n).tolist() for i, n in enumerate((6, 13))]
# Every engine here, in this process or in `jaxserve serve`: the same compiled steps.
ENGINE = dict(
    dtype="float32",
    max_batch_size=4,
    max_num_tokens=32,
    max_seq_len=128,
    kv_cache_config=KvCacheConfig(max_tokens=512),
    compile_config=CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
    attention_backend="xla",
    enable_lora=True,
    max_loras=2,
    max_lora_rank=8,
    show_progress=False,
)
FLAGS = [
    "--dtype=float32",
    "--max-batch-size=4",
    "--max-num-tokens=32",
    "--max-seq-len=128",
    "--kv-cache-max-tokens=512",
    "--decode-batch-sizes=4",
    "--token-buckets=32",
    "--no-penalty-variants",
    "--attention-backend=xla",
    "--enable-lora",
    "--max-loras=2",
    "--max-lora-rank=8",
]
GREEDY = dict(max_tokens=NEW_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})


# ---- the model, its adapters and peft's tokens ------------------------------------------------------------------


def _save_base(directory: Path) -> transformers.LlamaForCausalLM:
    """The tiny random Llama, and a word-level tokenizer whose token i is "t{i}" (the chat template joins the
    messages' contents), so that texts are exact functions of the token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = save_base_model(directory)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    config_json = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t2", "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config_json))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str | None, list[list[int]]]]:
    """The base model and the adapters on disk, and peft's tokens for the base model and each servable adapter."""
    root = tmp_path_factory.mktemp("lora-server")
    base = _save_base(root / "base")
    for seed, (name, options) in enumerate(ADAPTERS.items(), start=1):
        save_adapter(base, root / name, seed, **options)
    expected: dict[str | None, list[list[int]]] = {
        name: peft_tokens(root / "base", root / name, PROMPTS) for name in ("qv", "all")
    }
    expected[None] = peft_tokens(root / "base", None, PROMPTS)
    for name in ("qv", "all"):
        assert expected[name] != expected[None], f"adapter {name} does not move the greedy tokens: a weak test"
    return root, expected


def _ids(text: str) -> list[int]:
    return [int(i) for i in re.findall(r"t(\d+)", text)]


def _words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


# ---- the server in this process -----------------------------------------------------------------------------------


class Served:
    """A running server: its URL, where the adapters lie, and its LLM (None: in another process)."""

    def __init__(self, url: str, root: Path, llm: LLM | None = None) -> None:
        self.url, self.root, self.llm = url, root, llm
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def post(self, route: str, body: dict) -> requests.Response:
        return requests.post(f"{self.url}{route}", json=body, timeout=120)

    def complete(self, model: str, prompt: list[int]) -> list[int]:
        return _ids(self.client.completions.create(model=model, prompt=prompt, **GREEDY).choices[0].text)

    def assert_serves_base(self, expected) -> None:
        assert self.complete(BASE, PROMPTS[0]) == expected[None][0]


@pytest.fixture(scope="module")
def served(saved) -> Iterator[Served]:
    """The server over the base model, with adapter qv loaded at start (`lora_modules`)."""
    root, _ = saved
    with LLM(str(root / "base"), **ENGINE) as llm:
        config = ServerConfig(BASE, lora_modules=(LoraModule("qv", str(root / "qv")),))
        server = make_server(llm, "127.0.0.1", 0, config, log_level="warning", access_log=False)
        thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
        thread.start()
        assert server.ready.wait(120), "the server did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield Served(f"http://127.0.0.1:{port}", root, llm)
        server.handle_exit(signal.SIGTERM, None)
        thread.join(60)


def test_the_model_field_picks_the_adapter_in_completions_and_chat(served, saved):
    _, expected = saved
    client = served.client
    for model, name in ((BASE, None), ("qv", "qv")):
        for i, prompt in enumerate(PROMPTS):
            response = client.completions.create(model=model, prompt=prompt, **GREEDY)
            assert _ids(response.choices[0].text) == expected[name][i], (model, i)
            assert response.model == model
        stream = client.completions.create(model=model, prompt=PROMPTS[1], stream=True, **GREEDY)
        assert _ids("".join(c.choices[0].text for c in stream if c.choices)) == expected[name][1]
        messages = [{"role": "user", "content": _words(PROMPTS[0])}]
        chat = client.chat.completions.create(model=model, messages=messages, **GREEDY)
        assert _ids(chat.choices[0].message.content) == expected[name][0]
        stream = client.chat.completions.create(model=model, messages=messages, stream=True, **GREEDY)
        deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert _ids("".join(deltas)) == expected[name][0]


def test_models_lists_the_base_model_and_its_adapters(served):
    cards = {card.id: card for card in served.client.models.list().data}
    assert list(cards) == [BASE, "qv"]
    assert cards["qv"].parent == BASE and cards["qv"].root == str(served.root / "qv")
    assert cards[BASE].parent is None


def test_load_then_unload_at_runtime(served, saved):
    root, expected = saved
    response = served.post("/v1/load_lora_adapter", {"lora_name": "all", "lora_path": str(root / "all")})
    assert response.status_code == 200 and "all" in response.text
    assert "all" in [card.id for card in served.client.models.list().data]
    # Two slots, both held by adapters (all, qv), and base rows beside them.
    outputs = [served.complete(model, PROMPTS[1]) for model in ("all", "qv", BASE)]
    assert outputs == [expected["all"][1], expected["qv"][1], expected[None][1]]

    response = served.post("/v1/unload_lora_adapter", {"lora_name": "all"})
    assert response.status_code == 200 and "all" in response.text
    with pytest.raises(openai.NotFoundError, match="The model `all` does not exist"):
        served.complete("all", PROMPTS[0])
    assert [card.id for card in served.client.models.list().data] == [BASE, "qv"]
    assert served.llm.list_loras() == ["qv"], "the LLM's bookkeeping follows the server's loads and unloads"
    served.assert_serves_base(expected)


def test_an_unload_waits_for_the_requests_in_flight(served, saved):
    """The engine unloads an adapter only when idle: the unload waits for a long stream using it to finish (the
    stream is served to its end, not aborted). What arrives meanwhile: the driver's test below."""
    root, expected = saved
    assert served.post("/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": str(root / "all")}).ok
    body = {"model": "busy", "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0.0, "ignore_eos": True}
    stream = requests.post(f"{served.url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=120)
    events = (line.removeprefix("data: ") for line in stream.iter_lines(decode_unicode=True) if line)
    first = json.loads(next(events))
    assert _ids(first["choices"][0]["text"]) == expected["all"][0][:1]
    unloaded: queue.Queue[requests.Response] = queue.Queue()
    threading.Thread(
        target=lambda: unloaded.put(served.post("/v1/unload_lora_adapter", {"lora_name": "busy"})), daemon=True
    ).start()
    chunks = list(events)
    assert chunks[-1] == "[DONE]"
    finish = [c["finish_reason"] for chunk in chunks[:-1] for c in json.loads(chunk)["choices"]]
    assert finish[-1] == "length", "the stream was served to its end"
    assert unloaded.get(timeout=120).status_code == 200
    served.assert_serves_base(expected)


def test_errors_use_the_openai_schema_and_the_server_serves_on(served, saved):
    root, expected = saved
    cases = [
        ("/v1/completions", {"model": "nobody", "prompt": PROMPTS[0], "max_tokens": 2}, 404, "model", "nobody"),
        (
            "/v1/chat/completions",
            {"model": "nobody", "messages": [{"role": "user", "content": "t1"}]},
            404,
            "model",
            "",
        ),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "missing")}, 400, "lora_path", "adapter_"),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": str(root / "wide")},
            400,
            "lora_path",
            "max_lora_rank",
        ),
        ("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(root / "qv")}, 400, "lora_name", "already"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path", "lora_path"),
        ("/v1/unload_lora_adapter", {"lora_name": "nobody"}, 400, "lora_name", "cannot be found"),
    ]
    for route, body, status, param, words in cases:
        response = served.post(route, body)
        assert response.status_code == status, (route, body, response.text)
        error = response.json()["error"]
        assert error["code"] == status and error["param"] == param and words in error["message"], (route, error)
        assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
        served.assert_serves_base(expected)
    assert [card.id for card in served.client.models.list().data] == [BASE, "qv"]
    assert served.complete("qv", PROMPTS[0]) == expected["qv"][0]


class _Replicas:
    """A ReplicaSet's routing and stepping without engines: `busy_steps` steps left in flight, each taken only
    when the test releases `gate`; what reaches the replicas is logged in `sent`."""

    engines: list = []

    def __init__(self, busy_steps: int) -> None:
        self.busy_steps, self.sent = busy_steps, []
        self.gate, self.stepping = threading.Semaphore(0), threading.Event()

    def has_unfinished(self) -> bool:
        return self.busy_steps > 0

    def submit(self, prompt, params, request_id, **options) -> Future:
        self.sent.append(("submit", request_id))
        future: Future = Future()
        future.set_result(request_id)
        return future

    def submit_abort(self, request_id: str) -> None:
        self.sent.append(("abort", request_id))

    def step(self) -> Round:
        if self.busy_steps:
            self.stepping.set()
            assert self.gate.acquire(timeout=60)
            self.busy_steps -= 1
        return Round([], [])

    def stats(self) -> list:
        return []


def test_a_call_refused_while_requests_run_waits_for_them_and_holds_new_submissions_back():
    replicas = _Replicas(busy_steps=2)
    driver = EngineDriver(replicas, lambda *event: None)  # type: ignore[arg-type]

    def unload() -> str:
        if replicas.has_unfinished():
            raise RuntimeError("refused while requests are unfinished")
        return "unloaded"

    called = driver.call(unload)
    thread = threading.Thread(target=driver.run, daemon=True)
    thread.start()
    assert replicas.stepping.wait(60)  # tried first, refused, and the replicas step on
    submitted = driver.submit([1], SamplingParams(), "a", stream=False, stream_interval=1)
    driver.abort("a")
    assert replicas.sent == [] and not called.done() and not submitted.done()
    replicas.gate.release()
    replicas.gate.release()
    assert called.result(timeout=60) == "unloaded"
    assert submitted.result(timeout=60) == "a"
    assert replicas.sent == [("submit", "a"), ("abort", "a")], "held back, then sent in order"
    failing = driver.call(lambda: 1 / 0)  # idle: an error is the caller's at once
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=60)
    driver.request_stop()
    thread.join(60)
    assert not thread.is_alive()


# ---- the command line, and `jaxserve serve` with its engine process -------------------------------------------------


def test_lora_flags_parse_and_lora_modules_need_enable_lora(capsys):
    from jaxserve.cli import main

    args = build_parser().parse_args(
        ["serve", "m", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}']
    )
    assert args.lora_modules == [LoraModule("a", "/x"), LoraModule("b", "/y")]
    assert (args.max_loras, args.max_lora_rank) == (1, 16)
    for argv, message in (
        (["serve", "m", "--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["serve", "m", "--enable-lora", "--lora-modules", "a=/x", "a=/y"], "must be unique"),
        (["serve", "m", "--enable-lora", "--lora-modules", "nopath"], "NAME=PATH"),
        (["serve", "m", "--enable-lora", "--max-lora-rank", "0"], "--max-lora-rank"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err, argv


def test_serve_command_serves_adapters_through_its_engine_process(saved):
    root, expected = saved
    command = [sys.executable, "-m", "jaxserve.cli", "serve", str(root / "base"), "--port=0", *FLAGS]
    command += ["--served-model-name", BASE, "--lora-modules", f"qv={root / 'qv'}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [*map(log.put, process.stderr), log.put(None)], daemon=True).start()
    try:
        seen = []
        while (line := log.get(timeout=300)) is not None:
            seen.append(line)
            if match := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line):
                served = Served(match.group(1), root)
                break
        else:
            raise AssertionError(f"the server did not start: {''.join(seen)}")
        assert served.complete("qv", PROMPTS[0]) == expected["qv"][0]
        assert served.post("/v1/load_lora_adapter", {"lora_name": "all", "lora_path": str(root / "all")}).ok
        assert served.complete("all", PROMPTS[1]) == expected["all"][1]
        bad = served.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "wide")})
        assert bad.status_code == 400 and "max_lora_rank" in bad.json()["error"]["message"]
        assert served.post("/v1/unload_lora_adapter", {"lora_name": "all"}).ok
        with pytest.raises(openai.NotFoundError):
            served.complete("all", PROMPTS[1])
        assert [card.id for card in served.client.models.list().data] == [BASE, "qv"]
        served.assert_serves_base(expected)
        process.terminate()
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
