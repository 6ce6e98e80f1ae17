"""The routes besides completions and chat: models, health, version, the tokenizer endpoints (what
lm-evaluation-harness's remote tokenizer reads) and the Prometheus metrics."""

from __future__ import annotations

import importlib.metadata
import sys

import requests
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.gil import SHORT_SWITCH_INTERVAL_S

CONVERSATION = [{"role": "user", "content": "Hello!"}]


def test_models_health_and_version(served, client, model):
    [card] = client.models.list().data
    assert card.id == model and card.owned_by == "jaxserve"
    assert card.model_extra["max_model_len"] == served.llm.config.max_seq_len
    assert requests.get(f"{served.url}/health").status_code == 200
    assert requests.get(f"{served.url}/version").json() == {"version": importlib.metadata.version("jaxserve")}


def test_tokenize_and_detokenize_use_the_models_tokenizer(served, reference):
    tokenizer = reference.tokenizer
    text = "Hello world, this is jaxserve."
    plain = requests.post(f"{served.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == served.llm.config.max_seq_len
    chat = requests.post(f"{served.url}/tokenize", json={"messages": CONVERSATION, "return_token_strs": True}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert "".join(chat["token_strs"]) == tokenizer.decode(chat["tokens"], skip_special_tokens=False)
    back = requests.post(f"{served.url}/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": text}


def test_tokenizer_info_gives_lm_eval_the_remote_tokenizer(served, reference):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    tokenizer = reference.tokenizer
    info = requests.get(f"{served.url}/tokenizer_info").json()
    [eos] = tokenizer.encode(info["eos_token"], add_special_tokens=False)
    [bos] = tokenizer.encode(info["bos_token"], add_special_tokens=False)
    assert (eos, bos) == (tokenizer.eos_token_ids[0], tokenizer.bos_token_id)
    assert info["eos_token_ids"] == list(tokenizer.eos_token_ids) and info["bos_token_id"] == bos
    assert info["chat_template"] == tokenizer.hf_tokenizer.chat_template
    base_url = f"{served.url}/v1/completions"
    assert check_remote_tokenizer_support(base_url, auth_token=served.api_key)
    remote = RemoteTokenizer(base_url, auth_token=served.api_key)
    assert remote.eos_token_id == reference.tokenizer.eos_token_ids[0]
    assert remote.encode("The capital of France") == reference.tokenizer.encode("The capital of France")
    assert remote.decode(remote.encode("a b c")) == "a b c"


def test_metrics_are_prometheus_text_with_vllm_like_names(served, client, model):
    client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0.0)
    response = requests.get(f"{served.url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    names = {family.name for family in text_string_to_metric_families(response.text)}
    expected = {
        "jaxserve:num_requests_running",
        "jaxserve:num_requests_waiting",
        "jaxserve:kv_cache_usage_perc",
        "jaxserve:prefix_cache_hit_rate",
        "jaxserve:prefix_cache_queries",
        "jaxserve:prefix_cache_hits",
        "jaxserve:num_preemptions",
        "jaxserve:prompt_tokens",
        "jaxserve:generation_tokens",
        "jaxserve:request_success",
        "jaxserve:time_to_first_token_seconds",
        "jaxserve:time_per_output_token_seconds",
        "jaxserve:e2e_request_latency_seconds",
    }
    assert expected <= names


def test_the_gil_switch_interval_is_short_while_the_engine_thread_runs(served):
    """The engine thread takes the GIL back from the streaming event loop several times a step; at CPython's
    default 5 ms interval each can cost 5 ms (jaxserve.gil)."""
    assert served.frontend.is_running
    # At most the short interval (`short_switch_interval` keeps a shorter one; CPython holds it in whole
    # microseconds, so 0.0002 may read back as 0.000199).
    assert sys.getswitchinterval() <= SHORT_SWITCH_INTERVAL_S + 1e-9
