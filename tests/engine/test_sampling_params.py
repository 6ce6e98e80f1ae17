"""SamplingParams validation (vLLM's ranges, messages naming the field) and the output types."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.prompts import normalize_prompt
from jaxserve.sampling import (
    INT32_MAX,
    MAX_N,
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
        ({"n": 0}, r"n must be an int in \[1, 128\], got 0"),
        ({"n": 1.5}, r"n must be an int"),
        ({"temperature": -0.1}, r"temperature must be a number in \[0, 3.4e38\], got -0.1"),
        ({"temperature": float("nan")}, r"temperature must be a number in \[0, 3.4e38\], got nan"),
        ({"top_k": -2}, r"top_k must be None, 0 or -1 \(disabled\), or an int in \[1, 2147483647\], got -2"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\], got 0.0"),
        ({"top_p": 1.01}, r"top_p must be a number in \(0, 1\], got 1.01"),
        ({"min_p": -0.1}, r"min_p must be a number in \[0, 1\], got -0.1"),
        ({"min_p": 1.5}, r"min_p must be a number in \[0, 1\], got 1.5"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a number in \(0, 3.4e38\], got 0.0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty must be a number in \[-2, 2\], got -2.5"),
        ({"seed": 1.5}, r"seed must be None or an int"),
        ({"seed": True}, r"seed must be None or an int"),
        ({"max_tokens": 0}, r"max_tokens must be None or an int in \[1, 2147483647\], got 0"),
        ({"min_tokens": -1}, r"min_tokens must be an int in \[0, 16\], got -1"),
        ({"min_tokens": 17}, r"min_tokens must be an int in \[0, 16\], got 17"),
        ({"stop": ["ok", ""]}, r"stop must be a string or a list of non-empty strings"),
        ({"stop_token_ids": [3, -2]}, r"stop_token_ids\[1\] must be an int in \[0, 2147483647\], got -2"),
        ({"ignore_eos": "yes"}, r"ignore_eos must be a bool"),
        ({"logprobs": 21}, r"logprobs must be None or an int in \[0, 20\], got 21"),
        ({"prompt_logprobs": -1}, r"prompt_logprobs must be None or an int in \[0, 20\], got -1"),
        ({"skip_special_tokens": None}, r"skip_special_tokens must be a bool"),
    ],
)
def test_each_invalid_field_names_itself_and_its_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


NAN, INF = float("nan"), float("inf")
# (field, value, other kwargs): every one is a ValueError whose message begins with the field's name.
BAD_PARAMS = [
    ("n", -1, {}),
    ("n", MAX_N + 1, {}),
    ("n", 10**6, {}),
    ("n", 2**40, {}),
    ("n", True, {}),
    ("n", "2", {}),
    ("n", None, {}),
    ("temperature", -INF, {}),
    ("temperature", INF, {}),
    ("temperature", 1e39, {}),  # finite in Python, inf in float32
    ("temperature", "0.7", {}),
    ("temperature", True, {}),
    ("temperature", None, {}),
    ("temperature", 1j, {}),
    ("top_k", -100, {}),
    ("top_k", INT32_MAX + 1, {}),
    ("top_k", 2**40, {}),
    ("top_k", 1.5, {}),
    ("top_k", 5.0, {}),
    ("top_k", "5", {}),
    ("top_k", True, {}),
    ("top_k", False, {}),  # False == 0, but a bool is not "off"
    ("top_k", [5], {}),
    ("top_p", -0.5, {}),
    ("top_p", NAN, {}),
    ("top_p", "1", {}),
    ("min_p", INF, {}),
    ("min_p", None, {}),
    ("repetition_penalty", -1.0, {}),
    ("repetition_penalty", NAN, {}),
    ("repetition_penalty", 1e39, {}),
    ("presence_penalty", -INF, {}),
    ("presence_penalty", "0", {}),
    ("frequency_penalty", NAN, {}),
    ("frequency_penalty", 2.01, {}),
    ("seed", "x", {}),
    ("seed", 1.0, {}),
    ("seed", False, {}),
    ("seed", [1], {}),
    ("seed", NAN, {}),
    ("max_tokens", -1, {}),
    ("max_tokens", INT32_MAX + 1, {}),
    ("max_tokens", 2**40, {}),
    ("max_tokens", 16.0, {}),
    ("max_tokens", INF, {}),
    ("max_tokens", "16", {}),
    ("max_tokens", True, {}),
    ("min_tokens", INT32_MAX + 1, {"max_tokens": None}),
    ("min_tokens", 5, {"max_tokens": 4}),
    ("min_tokens", None, {}),
    ("min_tokens", 1.5, {}),
    ("min_tokens", True, {}),
    ("stop", 5, {}),
    ("stop", 1.5, {}),
    ("stop", "", {}),
    ("stop", [""], {}),
    ("stop", [3], {}),
    ("stop", ["ok", None], {}),
    ("stop", [["nested"]], {}),
    ("stop", b"bytes", {}),
    ("stop", {"a": 1}, {}),
    ("stop_token_ids", 5, {}),
    ("stop_token_ids", 3.0, {}),
    ("stop_token_ids", "5", {}),
    ("stop_token_ids", {"a": 1}, {}),
    ("stop_token_ids", [INT32_MAX + 1], {}),
    ("stop_token_ids", [2**40], {}),
    ("stop_token_ids", [-1], {}),
    ("stop_token_ids", [1.5], {}),
    ("stop_token_ids", [True], {}),
    ("stop_token_ids", [[3]], {}),
    ("stop_token_ids", [[1, 2], [3]], {}),
    ("stop_token_ids", ["5"], {}),
    ("stop_token_ids", [None], {}),
    ("stop_token_ids", np.array(5), {}),  # 0-d: not iterable
    ("ignore_eos", 1, {}),
    ("ignore_eos", 0, {}),
    ("ignore_eos", None, {}),
    ("skip_special_tokens", 1, {}),
    ("skip_special_tokens", "false", {}),
    ("logprobs", -1, {}),
    ("logprobs", 2**40, {}),
    ("logprobs", 1.5, {}),
    ("logprobs", True, {}),
    ("logprobs", "5", {}),
    ("prompt_logprobs", 21, {}),
    ("prompt_logprobs", False, {}),
]


@pytest.mark.parametrize(("field", "value", "others"), BAD_PARAMS, ids=[f"{f}={v!r}" for f, v, _ in BAD_PARAMS])
def test_bad_params_are_value_errors_naming_the_field(field, value, others):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value}, **others)
    assert str(excinfo.value).startswith(field), str(excinfo.value)


def test_messages_name_the_value_and_what_is_accepted():
    def message(**kwargs) -> str:
        with pytest.raises(ValueError) as excinfo:
            SamplingParams(**kwargs)
        return str(excinfo.value)

    assert message(top_k=2**40) == (
        f"top_k must be None, 0 or -1 (disabled), or an int in [1, {INT32_MAX}], got {2**40}"
    )
    assert message(n=True) == "n must be an int in [1, 128], got True (bool)"
    assert message(stop=5) == "stop must be a string or a list of non-empty strings, got 5 (int)"
    assert message(stop_token_ids=5) == (
        f"stop_token_ids must be a list of ints in [0, {INT32_MAX}], got the bare int 5 (write [5])"
    )
    assert message(stop_token_ids=[7, [3]]) == f"stop_token_ids[1] must be an int in [0, {INT32_MAX}], got [3] (list)"
    assert message(seed="x") == "seed must be None or an int (taken modulo 2**32), got 'x' (str)"
    assert message(temperature=1e39) == "temperature must be a number in [0, 3.4e38], got 1e+39"
    assert message(top_p="1") == "top_p must be a number in (0, 1], got '1' (str)"


def test_accepted_edges_are_stored_as_documented():
    assert SamplingParams(top_k=0).top_k is None and SamplingParams(top_k=-1).top_k is None
    assert SamplingParams(top_k=0) == SamplingParams()  # "off" is one value
    assert SamplingParams(top_k=INT32_MAX).top_k == INT32_MAX  # above the vocabulary: the engine clips it
    assert SamplingParams(n=MAX_N).n == MAX_N
    big = SamplingParams(max_tokens=INT32_MAX, min_tokens=INT32_MAX, stop_token_ids=[0, INT32_MAX])
    assert big.max_tokens == big.min_tokens == INT32_MAX and big.stop_token_ids == (0, INT32_MAX)
    assert SamplingParams(max_tokens=None, min_tokens=INT32_MAX).min_tokens == INT32_MAX
    assert SamplingParams(seed=2**70 + 5).seed == 5
    assert SamplingParams(seed=-1).seed == 2**32 - 1
    assert SamplingParams(seed=np.uint64(2**40 + 7)).seed == 7
    assert SamplingParams(temperature=0, repetition_penalty=3.0e38).temperature == 0.0
    assert SamplingParams(stop=None, stop_token_ids=None).stop == () == SamplingParams().stop_token_ids
    assert SamplingParams(stop=("a", "b"), stop_token_ids=range(3)).stop_token_ids == (0, 1, 2)


def test_numpy_values_are_stored_as_python_numbers():
    params = SamplingParams(n=np.int32(2), top_k=np.int64(5), temperature=np.float32(0.5), stop_token_ids=np.arange(2))
    assert (params.n, params.top_k, params.stop_token_ids, params.temperature) == (2, 5, (0, 1), 0.5)
    assert all(type(v) is int for v in (params.n, params.top_k, *params.stop_token_ids))
    assert type(params.temperature) is float


def test_revalidation_is_idempotent():
    # The engine re-validates with dataclasses.replace: normalized values must come out unchanged.
    params = SamplingParams(top_k=-1, seed=2**70 + 5, stop="x", stop_token_ids=[3], max_tokens=None, min_tokens=2)
    assert dataclasses.replace(params) == params


@settings(max_examples=50, deadline=None)
@given(st.integers())
def test_any_int_seed_is_stored_modulo_2_to_the_32(seed):
    assert SamplingParams(seed=seed).seed == seed % 2**32


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
    validate_prompt_token_ids([np.int64(3), 4], vocab_size=10)  # numpy ints take the per-token path
    with pytest.raises(ValueError, match=r"\[np.int64\(10\)\]|\[10\]"):
        validate_prompt_token_ids([1, np.int64(10)], vocab_size=10)
    with pytest.raises(ValueError, match=r"got \[True\]"):
        validate_prompt_token_ids([1, True], vocab_size=10)  # a bool is no token id, even in range


def test_normalized_token_ids_are_python_ints_in_a_new_list():
    ids = [3, 4]
    normalized = normalize_prompt(ids)
    assert normalized == ids and normalized is not ids
    from_numpy = normalize_prompt([np.int32(3), np.uint16(4)])
    assert from_numpy == [3, 4] and {type(t) for t in from_numpy} == {int}
    assert {type(t) for t in normalize_prompt(np.array([5, 6], np.int16))} == {int}


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
