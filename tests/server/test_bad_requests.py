"""Malformed requests each get the right status and an OpenAI error body that names the problem, and the
server serves the next good request; a step that raises fails its requests with a 500 (a final error event
in a stream) and the engine serves on."""

from __future__ import annotations

import json

import pytest
import requests

from jaxserve.sampling import SamplingParams

GOOD = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
LONG_PROMPT = list(range(1000, 1300))  # 300 token ids: over max_seq_len=256
DROP = object()  # a field left out of the body


def completion(**fields):
    body = {**GOOD, **fields}
    return {k: v for k, v in body.items() if v is not DROP}


def chat(**fields):
    body = {**CHAT, **fields}
    return {k: v for k, v in body.items() if v is not DROP}


COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"

# Each case: the path, the body, the status, a piece of the message and the field the error names.
CASES = [
    pytest.param(COMPLETIONS, completion(temperature="hot"), 400, "valid number", "temperature", id="temperature-type"),
    pytest.param(
        COMPLETIONS, completion(temperature=-1), 400, "temperature must be", "temperature", id="temperature-range"
    ),
    pytest.param(COMPLETIONS, completion(top_p=0), 400, "top_p must be a number in (0, 1]", "top_p", id="top-p-zero"),
    pytest.param(COMPLETIONS, completion(top_p=1.5), 400, "top_p must be", "top_p", id="top-p-high"),
    pytest.param(COMPLETIONS, completion(top_k=-5), 400, "top_k must be", "top_k", id="top-k-range"),
    pytest.param(COMPLETIONS, completion(min_p=2), 400, "min_p must be", "min_p", id="min-p-range"),
    pytest.param(COMPLETIONS, completion(n=0), 400, "n must be an int in [1, 128]", "n", id="n-zero"),
    pytest.param(COMPLETIONS, completion(n=1.5), 400, "valid integer", "n", id="n-fraction"),
    pytest.param(
        COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens must be", "max_tokens", id="max-tokens-negative"
    ),
    pytest.param(COMPLETIONS, completion(max_tokens=0), 400, "0 only with echo", "max_tokens", id="max-tokens-zero"),
    pytest.param(COMPLETIONS, completion(max_tokens="lots"), 400, "valid integer", "max_tokens", id="max-tokens-type"),
    pytest.param(COMPLETIONS, completion(logprobs=21), 400, "logprobs must be", "logprobs", id="logprobs-range"),
    pytest.param(COMPLETIONS, completion(seed="abc"), 400, "valid integer", "seed", id="seed-type"),
    pytest.param(COMPLETIONS, completion(echo="maybe"), 400, "valid boolean", "echo", id="echo-type"),
    pytest.param(COMPLETIONS, completion(prompt=DROP), 400, "Field required", "prompt", id="prompt-missing"),
    pytest.param(COMPLETIONS, completion(prompt=123), 400, "prompt must be a string", "prompt", id="prompt-type"),
    pytest.param(COMPLETIONS, completion(prompt=[]), 400, "prompt is empty", "prompt", id="prompt-empty"),
    pytest.param(COMPLETIONS, completion(prompt=[1, "a"]), 400, "prompt must be a string", "prompt", id="prompt-mixed"),
    pytest.param(
        COMPLETIONS, completion(prompt=[1, 10**7]), 400, "token ids must be ints", "prompt", id="prompt-ids-range"
    ),
    pytest.param(
        COMPLETIONS, completion(prompt=LONG_PROMPT), 400, "maximum context length", "prompt", id="prompt-too-long"
    ),
    pytest.param(COMPLETIONS, completion(max_tokens=255), 400, "is too large", "max_tokens", id="max-tokens-too-large"),
    pytest.param(
        COMPLETIONS, completion(stop_token_ids=5), 400, "valid list", "stop_token_ids", id="stop-ids-bare-int"
    ),
    pytest.param(COMPLETIONS, completion(stop=[""]), 400, "stop must be", "stop", id="stop-empty-string"),
    pytest.param(
        COMPLETIONS, completion(min_tokens=9), 400, "min_tokens must be", "min_tokens", id="min-tokens-over-max"
    ),
    pytest.param(COMPLETIONS, completion(suffix="!"), 400, "suffix is not supported", "suffix", id="suffix"),
    pytest.param(COMPLETIONS, completion(logit_bias={"1": 5}), 400, "logit_bias is not", "logit_bias", id="logit-bias"),
    pytest.param(COMPLETIONS, completion(best_of=3), 400, "best_of is not supported", "best_of", id="best-of"),
    pytest.param(
        COMPLETIONS, completion(use_beam_search=True), 400, "not supported", "use_beam_search", id="beam-search"
    ),
    pytest.param(COMPLETIONS, completion(presence_penalty=5), 400, "[-2, 2]", "presence_penalty", id="penalty-range"),
    pytest.param(
        COMPLETIONS,
        completion(presence_penalty=0.5),
        400,
        "--no-penalty-variants",
        "presence_penalty",
        id="penalty-not-compiled",
    ),
    pytest.param(
        COMPLETIONS, completion(stream_options={}), 400, "stream=true", "stream_options", id="stream-options-alone"
    ),
    pytest.param(
        COMPLETIONS,
        completion(stream=True, prompt_logprobs=1),
        400,
        "stream=true",
        "prompt_logprobs",
        id="prompt-logprobs-stream",
    ),
    pytest.param(
        COMPLETIONS, completion(truncate_prompt_tokens=0), 400, ">= 1", "truncate_prompt_tokens", id="truncate-zero"
    ),
    pytest.param(COMPLETIONS, completion(model="gpt-4"), 404, "`gpt-4` does not exist", "model", id="unknown-model"),
    pytest.param(CHAT_COMPLETIONS, chat(messages=[]), 400, "messages is empty", "messages", id="chat-empty"),
    pytest.param(CHAT_COMPLETIONS, chat(messages=DROP), 400, "Field required", "messages", id="chat-missing"),
    pytest.param(
        CHAT_COMPLETIONS,
        chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "role must be one of",
        "messages",
        id="chat-role",
    ),
    pytest.param(
        CHAT_COMPLETIONS, chat(messages=[{"role": "user"}]), 400, "has no 'content'", "messages", id="chat-no-content"
    ),
    pytest.param(
        CHAT_COMPLETIONS,
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        "must be a string or a list of text parts",
        "messages",
        id="chat-content-type",
    ),
    pytest.param(
        CHAT_COMPLETIONS,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "only text parts",
        "messages",
        id="chat-image",
    ),
    pytest.param(CHAT_COMPLETIONS, chat(messages=["hi"]), 400, "must be a dict", "messages", id="chat-not-a-dict"),
    pytest.param(
        CHAT_COMPLETIONS, chat(top_logprobs=2), 400, "needs logprobs=true", "top_logprobs", id="chat-top-logprobs-alone"
    ),
    pytest.param(
        CHAT_COMPLETIONS,
        chat(logprobs=True, top_logprobs=30),
        400,
        "top_logprobs must be",
        "top_logprobs",
        id="chat-top-logprobs-range",
    ),
    pytest.param(
        CHAT_COMPLETIONS,
        chat(max_completion_tokens=0),
        400,
        "max_completion_tokens must be",
        "max_completion_tokens",
        id="chat-max-completion-tokens",
    ),
    pytest.param(
        CHAT_COMPLETIONS,
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        "tools is not supported",
        "tools",
        id="chat-tools",
    ),
    pytest.param(
        CHAT_COMPLETIONS,
        chat(response_format={"type": "json_object"}),
        400,
        "response_format is not",
        "response_format",
        id="chat-json-format",
    ),
    pytest.param(CHAT_COMPLETIONS, chat(echo=True), 400, "echo is not supported", "echo", id="chat-echo"),
    pytest.param("/tokenize", {}, 400, "exactly one of", "prompt", id="tokenize-neither"),
    pytest.param("/detokenize", {"tokens": [10**7]}, 400, "tokens must be ids", "tokens", id="detokenize-range"),
]


def post(served, path, body=None, *, data=None, headers=None):
    auth = {"Authorization": f"Bearer {served.api_key}"}
    return requests.post(f"{served.url}{path}", json=body, data=data, headers={**auth, **(headers or {})}, timeout=60)


def assert_error(response, status, message, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert message in error["message"], error["message"]
    assert error["param"] == param


def assert_serves_a_good_request(served, reference):
    response = post(served, "/v1/completions", {**GOOD, "model": served.model})
    assert response.status_code == 200, response.text
    params = SamplingParams(max_tokens=GOOD["max_tokens"], temperature=0.0)
    [expected] = reference.generate([GOOD["prompt"]], params, use_tqdm=False)
    assert response.json()["choices"][0]["text"] == expected.outputs[0].text


@pytest.mark.parametrize(("path", "body", "status", "message", "param"), CASES)
def test_a_malformed_field_is_named_in_the_error(served, path, body, status, message, param):
    assert_error(post(served, path, body), status, message, param)


def test_malformed_bodies_auth_and_routes(served, reference):
    url, model = served.url, served.model
    headers = {"Content-Type": "application/json"}
    assert_error(post(served, "/v1/completions", data="{not json", headers=headers), 400, "not valid JSON")
    assert_error(post(served, "/v1/completions", data=json.dumps([GOOD]), headers=headers), 400, "JSON object")
    assert_error(post(served, "/v1/completions", data=b"\xff\xfe", headers=headers), 400, "not valid JSON")
    huge = json.dumps({**GOOD, "prompt": "a " * (1 << 20)})
    assert_error(post(served, "/v1/completions", data=huge, headers=headers), 413, "limit of")
    anonymous = requests.post(f"{url}/v1/completions", json=GOOD, timeout=60)
    assert_error(anonymous, 401, "API key")
    wrong = requests.post(f"{url}/v1/completions", json=GOOD, headers={"Authorization": "Bearer nope"}, timeout=60)
    assert_error(wrong, 401, "API key")
    assert_error(requests.get(f"{url}/v1/models", timeout=60), 401, "API key")
    assert_error(requests.get(f"{url}/v1/nothing", timeout=60), 404, "Not Found")
    assert_error(
        requests.get(f"{url}/v1/completions", headers={"Authorization": f"Bearer {served.api_key}"}),
        405,
        "Method Not Allowed",
    )
    assert post(served, "/v1/completions", {**GOOD, "model": model}).status_code == 200
    assert_serves_a_good_request(served, reference)
    assert served.frontend.wait_idle(60)


def test_the_server_serves_on_after_the_malformed_requests(served, reference):
    for case in CASES:
        path, body, *_ = case.values
        post(served, path, body)
    assert_serves_a_good_request(served, reference)
    assert served.frontend.wait_idle(60)
    engine = served.llm.engine
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(served, reference, monkeypatch):
    runner = served.llm.engine.runner
    failures = iter(range(2))
    run = runner.run

    def failing_run(*args, **kwargs):
        if next(failures, None) is not None:
            raise RuntimeError("injected step failure")
        return run(*args, **kwargs)

    monkeypatch.setattr(runner, "run", failing_run)
    before = served.metrics()
    whole = post(served, "/v1/completions", GOOD)
    assert_error(whole, 500, "an engine step failed: RuntimeError: injected step failure")
    streamed = post(served, "/v1/chat/completions", {**CHAT, "stream": True})
    assert streamed.status_code == 200
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 500 and "injected step failure" in error["message"]
    assert_serves_a_good_request(served, reference)
    assert served.frontend.wait_idle(60)
    failed = 'jaxserve:request_success_total{finished_reason="error"}'
    assert served.metrics()[failed] - before.get(failed, 0.0) == 2
