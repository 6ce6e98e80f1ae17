"""lm-evaluation-harness's `local-completions` model against the server (tokenized requests, the remote
tokenizer that tokenizer_backend=auto finds through /tokenizer_info) scores a local multiple-choice task
as the offline API does through `JaxserveLM`: the same log-likelihoods, greedy flags and accuracy."""

from __future__ import annotations

import json

import pytest

QUESTIONS = [
    ("The capital of France is", [" Paris", " Rome", " Berlin", " Madrid"], 0),
    ("The capital of Italy is", [" Paris", " Rome", " Berlin", " Madrid"], 1),
    ("The capital of Germany is", [" Paris", " Rome", " Berlin", " Madrid"], 2),
    ("The capital of Spain is", [" Paris", " Rome", " Berlin", " Madrid"], 3),
    ("Two plus two equals", [" four", " five", " six", " seven"], 0),
    ("The opposite of hot is", [" cold", " warm", " red", " fast"], 0),
    ("The sky on a clear day is", [" blue", " green", " purple", " loud"], 0),
    ("A week has seven", [" days", " cats", " apples", " rivers"], 0),
]
TASK = "capitals_mc"


@pytest.fixture
def task_manager(tmp_path):
    from lm_eval.tasks import TaskManager

    data = tmp_path / f"{TASK}.jsonl"
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc"}],
    }
    (tmp_path / f"{TASK}.yaml").write_text(json.dumps(config))  # JSON is YAML
    return TaskManager(include_path=str(tmp_path))


def test_local_completions_scores_like_the_offline_api(served, reference, task_manager, monkeypatch):
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from jaxserve.integrations.lm_eval import JaxserveLM

    monkeypatch.setenv("OPENAI_API_KEY", served.api_key)  # local-completions' bearer token
    remote = LocalCompletionsAPI(
        base_url=f"{served.url}/v1/completions",
        model=served.model,
        tokenizer_backend="auto",
        tokenized_requests=True,
        max_length=served.llm.config.max_seq_len,
        batch_size=4,  # lists of token-id prompts in one request
        num_concurrent=2,
        max_retries=1,
    )
    assert remote.tokenizer_backend == "remote", "tokenizer_backend=auto found /tokenizer_info"
    common = {"tasks": [TASK], "task_manager": task_manager, "log_samples": True}
    served_run = lm_eval.simple_evaluate(model=remote, **common)
    offline_run = lm_eval.simple_evaluate(model=JaxserveLM(reference), **common)

    mine = [sample["resps"] for sample in served_run["samples"][TASK]]
    theirs = [sample["resps"] for sample in offline_run["samples"][TASK]]
    assert len(mine) == len(QUESTIONS)
    for question, expected in zip(mine, theirs, strict=True):
        for [(logprob, greedy)], [(expected_logprob, expected_greedy)] in zip(question, expected, strict=True):
            assert logprob == pytest.approx(expected_logprob, abs=1e-4) and greedy == expected_greedy
    accuracy = served_run["results"][TASK]["acc,none"]
    assert accuracy == offline_run["results"][TASK]["acc,none"]
    assert accuracy >= 0.5, "the default model answers most of these"
