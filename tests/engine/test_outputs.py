"""The output processor on the host: stop strings held back so a streamed text only grows, across tokens
and across the bytes of one multi-byte character; the stop string ends the text where it begins; n
samples grouped in one RequestOutput; logprob dicts from TokenLogprobs rows."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.outputs import OutputProcessor, position_logprobs
from jaxserve.request import make_requests
from jaxserve.sampling import FinishReason, Logprob, SamplingParams


def stream(tokenizer, prompt_ids, generated, params, finish=FinishReason.LENGTH):
    """Feeds `generated` one token per step as the engine does; returns every step's output and the stop hit."""
    processor = OutputProcessor(tokenizer)
    [request] = make_requests("r", prompt_ids, params)
    processor.add("r", None, list(prompt_ids), [request])
    outputs, stop = [], None
    for i, token in enumerate(generated):
        request.token_ids.append(token)
        if i == len(generated) - 1:
            request.finish(finish, 0.0)
        stop = processor.add_token(request, None, row=0)
        if stop is not None and not request.is_finished:
            request.finish(FinishReason.STOP, 0.0, stop_reason=stop)
        outputs.append(processor.output("r").outputs[0])
        if request.is_finished:
            break
    assert "r" not in processor, "a finished request is forgotten once its output is built"
    return outputs, stop


def assert_only_grows(outputs):
    texts = [o.text for o in outputs]
    for earlier, later in zip(texts[:-1], texts[1:], strict=True):
        assert later.startswith(earlier), texts


def test_a_stop_string_over_several_tokens_is_held_back_then_cut(char_tokenizer):
    tokenizer = char_tokenizer()
    ids = tokenizer.encode("abXYZcd")
    text = tokenizer.decode(ids)  # one character per token
    xyz = text[2:5]
    outputs, stop = stream(tokenizer, [1], ids, SamplingParams(stop=(xyz,), max_tokens=16))
    assert_only_grows(outputs)
    assert [o.text for o in outputs] == [text[:1], text[:2], text[:2], text[:2], text[:2]]  # X, XY held back
    assert stop == xyz and (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", xyz)
    assert outputs[-1].token_ids == ids[:5]


def test_a_prefix_that_turns_out_not_to_be_a_stop_is_released(char_tokenizer):
    tokenizer = char_tokenizer()
    ids = tokenizer.encode("abXYq")
    text = tokenizer.decode(ids)
    xyz = tokenizer.decode(tokenizer.encode("XYZ"))
    outputs, stop = stream(tokenizer, [1], ids, SamplingParams(stop=(xyz,), max_tokens=5))
    assert_only_grows(outputs)
    assert stop is None and outputs[-1].text == text and outputs[-1].finish_reason == "length"
    assert outputs[3].text == text[:2], "'XY' may begin the stop string"


def test_a_stop_string_in_the_last_token_wins_over_the_length_stop(char_tokenizer):
    tokenizer = char_tokenizer()
    ids = tokenizer.encode("abXY")
    text = tokenizer.decode(ids)
    outputs, stop = stream(tokenizer, [1], ids, SamplingParams(stop=(text[2:],), max_tokens=4))
    assert stop == text[2:] and outputs[-1].text == text[:2]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", text[2:])


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["🌍 and", "日本", "ö"])
def test_stop_strings_across_the_bytes_of_multi_byte_characters(smollm2, stop):
    """Byte-level tokens: a character of several bytes spans tokens, and so may the stop string."""
    _, tokenizer = smollm2
    full = "Hello wörld, the 🌍 and 日本語 text goes on"
    ids = tokenizer.encode(full, add_special_tokens=False)
    assert len(ids) > len(full.encode()) // 3, "the text was meant to split characters over tokens"
    outputs, hit = stream(tokenizer, tokenizer.encode("Say:"), ids, SamplingParams(stop=(stop,), max_tokens=64))
    assert_only_grows(outputs)
    assert all("\ufffd" not in o.text for o in outputs)
    assert hit == stop and outputs[-1].text == full[: full.index(stop)]
    unstopped, _ = stream(tokenizer, tokenizer.encode("Say:"), ids, SamplingParams(max_tokens=64))
    assert_only_grows(unstopped)
    assert unstopped[-1].text == full


def test_n_samples_come_back_in_one_output_once_all_finish(char_tokenizer):
    tokenizer = char_tokenizer()
    processor = OutputProcessor(tokenizer)
    samples = make_requests("g", [1, 2], SamplingParams(n=2, max_tokens=2))
    processor.add("g", "prompt", [1, 2], samples)
    for request, token in zip(samples, (5, 6), strict=True):
        request.token_ids.append(token)
        processor.add_token(request, None, row=request.index)
    samples[0].finish(FinishReason.LENGTH, 0.0)
    partial = processor.output("g")
    assert not partial.finished and [c.finish_reason for c in partial.outputs] == ["length", None]
    samples[1].finish(FinishReason.ABORT, 0.0)
    done = processor.output("g")
    assert done.finished and [c.text for c in done.outputs] == [tokenizer.decode([5]), tokenizer.decode([6])]
    assert (done.prompt, done.prompt_token_ids) == ("prompt", [1, 2]) and "g" not in processor


def test_position_logprobs_is_the_top_n_plus_the_chosen_token():
    logprobs = SimpleNamespace(
        logprob=np.array([-0.5, -3.0], np.float32),
        rank=np.array([1, 7], np.int32),
        top_logprobs=np.array([[-0.5, -1.0, -2.0], [-0.125, -0.875, -2.5]], np.float32),
        top_ids=np.array([[4, 2, 9], [3, 8, 1]], np.int32),
    )
    assert position_logprobs(logprobs, 0, token=4, num_top=2) == {4: Logprob(-0.5, rank=1), 2: Logprob(-1.0, rank=2)}
    assert position_logprobs(logprobs, 1, token=11, num_top=1) == {
        3: Logprob(-0.125, rank=1),
        11: Logprob(-3.0, rank=7),
    }
    assert position_logprobs(logprobs, 1, token=11, num_top=0) == {11: Logprob(-3.0, rank=7)}
    named = position_logprobs(logprobs, 1, token=11, num_top=1, token_text=lambda t: f"<{t}>")
    assert named == {3: Logprob(-0.125, rank=1, decoded_token="<3>"), 11: Logprob(-3.0, rank=7, decoded_token="<11>")}
