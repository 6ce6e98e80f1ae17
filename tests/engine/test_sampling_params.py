"""SamplingParams validation (vLLM's ranges, messages naming the field) and the output types."""

import numpy as np
import pytest

from jaxserve.sampling import (
    CompletionOutput,
    FinishReason,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    validate_prompt_token_ids,
)


def test_defaults_are_valid():
    params = SamplingParams()
    assert params.n == 1 and params.max_tokens == 16 and params.top_k is None
    assert params.stop == () and params.stop_token_ids == ()
    assert not params.is_greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, r"n must be >= 1"),
        ({"n": 1.5}, r"n must be an int"),
        ({"temperature": -0.1}, r"temperature must be >= 0"),
        ({"temperature": float("nan")}, r"temperature must be a finite number"),
        ({"top_k": 0}, r"top_k must be >= 1"),
        ({"top_k": -1}, r"top_k must be >= 1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"seed": 1.5}, r"seed must be None or an int"),
        ({"seed": True}, r"seed must be None or an int"),
        ({"max_tokens": 0}, r"max_tokens must be >= 1"),
        ({"min_tokens": -1}, r"min_tokens must be \[0, 16\]"),
        ({"min_tokens": 17}, r"min_tokens must be \[0, 16\]"),
        ({"stop": ["ok", ""]}, r"stop must be a string or a list of non-empty strings"),
        ({"stop_token_ids": [3, -2]}, r"stop_token_ids entries must be >= 0"),
        ({"ignore_eos": "yes"}, r"ignore_eos must be a bool"),
        ({"logprobs": 21}, r"logprobs must be \[0, 20\]"),
        ({"prompt_logprobs": -1}, r"prompt_logprobs must be \[0, 20\]"),
        ({"skip_special_tokens": None}, r"skip_special_tokens must be a bool"),
    ],
)
def test_each_invalid_field_names_itself_and_its_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_normalization_and_limits():
    params = SamplingParams(stop="###", stop_token_ids=[5, 7], max_tokens=None, min_tokens=100, seed=0)
    assert params.stop == ("###",) and params.stop_token_ids == (5, 7)
    assert params.min_tokens == 100  # no max_tokens: min_tokens is only bounded below
    assert SamplingParams(seed=np.int64(3)).seed == 3  # numpy ints are accepted
    hash(params)  # frozen and hashable


def test_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy


def test_prompt_token_ids_validation():
    validate_prompt_token_ids([0, 5, 9], vocab_size=10)
    validate_prompt_token_ids(np.array([1, 2]), vocab_size=10)
    with pytest.raises(ValueError, match="prompt is empty"):
        validate_prompt_token_ids([], vocab_size=10)
    with pytest.raises(ValueError, match=r"\[0, 9\].*\[10, -1\]"):
        validate_prompt_token_ids([1, 10, -1], vocab_size=10)


def test_metrics_and_outputs():
    metrics = RequestMetrics(arrival_time=10.0)
    assert metrics.time_to_first_token is None and metrics.latency is None
    metrics.first_token_time = 10.25
    metrics.finished_time = 11.5
    assert metrics.time_to_first_token == pytest.approx(0.25)
    assert metrics.latency == pytest.approx(1.5)
    completion = CompletionOutput(index=0, text="hi", token_ids=[1, 2], finish_reason=FinishReason.LENGTH)
    assert completion.finished and completion.finish_reason == "length"
    output = RequestOutput("r", "p", [3], [completion], finished=True, metrics=metrics)
    assert output.error is None and output.outputs[0].token_ids == [1, 2]
