"""The stop rules as plain functions: token rules in their order (EOS, stop ids, length, min_tokens first),
the text rule (earliest stop string, the shortest there, counted after min_tokens), what a running sample
shows, and the finish it reports (a stop string wins)."""

from __future__ import annotations

from jaxserve.request import make_requests
from jaxserve.sampling import FinishReason, SamplingParams
from jaxserve.stopping import Stop, StopString, find_stop_string, reported_finish, token_stop, visible_text

EOS = 2


def sample(generated, **params):
    [request] = make_requests("r", [5, 6, 7], SamplingParams(**params), eos_token_ids=frozenset({EOS}))
    request.token_ids.extend(generated)
    return request


def test_token_rules_in_order():
    assert token_stop(sample([9]), max_seq_len=64) is None
    assert token_stop(sample([EOS]), max_seq_len=64) == Stop(FinishReason.STOP)
    assert token_stop(sample([EOS], ignore_eos=True), max_seq_len=64) is None
    assert token_stop(sample([11], stop_token_ids=[11]), max_seq_len=64) == Stop(FinishReason.STOP, 11)
    # EOS and stop ids before length, in the same token
    assert token_stop(sample([EOS], max_tokens=1), max_seq_len=64) == Stop(FinishReason.STOP)
    assert token_stop(sample([9], max_tokens=1), max_seq_len=64) == Stop(FinishReason.LENGTH)
    assert token_stop(sample([9]), max_seq_len=4) == Stop(FinishReason.LENGTH)


def test_min_tokens_hold_eos_and_stop_ids_but_not_length():
    assert token_stop(sample([EOS], min_tokens=2, max_tokens=4), max_seq_len=64) is None
    assert token_stop(sample([9, EOS], min_tokens=2, max_tokens=4), max_seq_len=64) == Stop(FinishReason.STOP)
    assert token_stop(sample([11], min_tokens=1, max_tokens=1, stop_token_ids=[11]), 64) == Stop(FinishReason.STOP, 11)
    assert token_stop(sample([9, 9], min_tokens=2, max_tokens=2), max_seq_len=64) == Stop(FinishReason.LENGTH)


def test_the_earliest_stop_string_the_shortest_there_after_min_tokens():
    params = SamplingParams(stop=["END", "EN", "x"])
    assert find_stop_string("a b ENDx", 0, params, 3) == StopString("EN", 4)
    assert find_stop_string("a b c", 0, params, 3) is None
    assert find_stop_string("a x", 0, SamplingParams(stop=["x"], min_tokens=3), 3) is None
    assert find_stop_string("a x", 0, SamplingParams(stop=["x"], min_tokens=3), 4) == StopString("x", 2)


def test_a_running_sample_holds_back_what_may_begin_a_stop_string():
    assert visible_text("Hello <|e", ["<|end|>"], finished=False, stop=None) == "Hello "
    assert visible_text("Hello <|e", ["<|end|>"], finished=True, stop=None) == "Hello <|e"
    assert visible_text("Hi<|end|> more", ["<|end|>"], finished=True, stop=StopString("<|end|>", 2)) == "Hi"


def test_a_stop_string_wins_over_the_rule_that_ended_the_same_token():
    request = sample([9], stop=["x"])
    assert reported_finish(request, None) is None
    request.finish(FinishReason.LENGTH, 0.0)
    assert reported_finish(request, None) == Stop(FinishReason.LENGTH)
    assert reported_finish(request, StopString("x", 0)) == Stop(FinishReason.STOP, "x")
