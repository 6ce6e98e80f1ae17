"""Every way a request finishes, and the stop rules that decide it.

A sample (one of a request's n sequences) finishes with one of four reasons (`FinishReason`):

- "stop", by a token: its newest token is an EOS token (unless `ignore_eos`) or one of `stop_token_ids`
  (then its `stop_reason`), once at least `min_tokens` tokens are out: `token_stop`, which the scheduler
  applies to each token as it reaches the host.
- "stop", by a string: its detokenized text contains one of `stop` (its `stop_reason`) once more than
  `min_tokens` tokens are out: `find_stop_string`, which the output processor applies after detokenizing
  each token; the engine then finishes the request. The text ends where the stop string begins; while the
  sample runs, the tail that could still begin one is held back (`visible_text`), so a streamed text only
  grows and ends exactly where the non-streamed one does. A stop string found in the token that ended the
  sample another way (length, EOS) wins, as in vLLM (`reported_finish`).
- "length": prompt + output reached prompt + max_tokens, or max_seq_len: `token_stop`. (The scheduler
  schedules no decode for a sample whose token still on the device reaches it: `Request.reached_length_limit`.)
- "abort": the caller withdrew it (`Scheduler.abort`, through `Engine.abort`: an `LLM` call that raised, a
  stream closed or dropped, a server client gone, the other admitted requests of a server step that failed),
  or the engine closed.
- "error": it can never run within the engine's limits (`Scheduler.rejection_reason`, when it is added), or
  its step's inputs could not be built (the engine finishes those rows alone).

Host policy: no jax here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxserve.request import Request
from jaxserve.sampling import FinishReason, SamplingParams
from jaxserve.tokenizer import find_stop, stop_holdback


@dataclass(frozen=True, slots=True)
class Stop:
    """How a sample finishes: the reason, and the stop token id or stop string that ended it (else None)."""

    reason: FinishReason
    stop_reason: int | str | None = None


@dataclass(frozen=True, slots=True)
class StopString:
    """A stop string found in a sample's text, and where it begins there."""

    text: str
    index: int


def token_stop(request: Request, max_seq_len: int) -> Stop | None:
    """The token rules, on the sample's newest token: EOS (unless ignore_eos), then stop_token_ids, both only
    once min_tokens tokens are out; then length. None: it runs on."""
    params = request.sampling_params
    token = request.token_ids[-1]
    if len(request.token_ids) - request.num_prompt_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return Stop(FinishReason.STOP)
        if token in params.stop_token_ids:
            return Stop(FinishReason.STOP, stop_reason=token)
    if len(request.token_ids) >= request.max_total_tokens(max_seq_len):
        return Stop(FinishReason.LENGTH)
    return None


def find_stop_string(text: str, checked: int, params: SamplingParams, num_output_tokens: int) -> StopString | None:
    """The text rule: the earliest stop string in `text` (the sample's text after its newest token; the
    first `checked` characters were searched before), the shortest among those beginning there. As vLLM,
    stop strings count only once more than min_tokens tokens are out (the tail is held back anyway)."""
    stops = params.stop
    if not stops or num_output_tokens <= params.min_tokens:
        return None
    index = find_stop(text, stops, checked - max(len(s) for s in stops) + 1)
    if index is None:
        return None
    return StopString(min((s for s in stops if text.startswith(s, index)), key=len), index)


def visible_text(text: str, stops: Sequence[str], finished: bool, stop: StopString | None) -> str:
    """The text a sample shows: up to its stop string; while it runs, without the tail that may still begin
    one (so a streamed text only grows)."""
    if stop is not None:
        return text[: stop.index]
    if finished or not stops:
        return text
    return text[: len(text) - stop_holdback(text, stops)]


def reported_finish(request: Request, stop: StopString | None) -> Stop | None:
    """The finish a sample reports (None while it runs): a stop string wins over the rule that ended the
    sample in the same token."""
    if not request.is_finished:
        return None
    if stop is not None:
        return Stop(FinishReason.STOP, stop_reason=stop.text)
    assert request.finish_reason is not None
    return Stop(request.finish_reason, request.stop_reason)
