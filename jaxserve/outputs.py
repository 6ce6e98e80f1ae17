"""Host output processing: detokenizing, stop strings, logprob dictionaries and arrays, n-sample groups
and RequestOutput building (vLLM's OutputProcessor; the engine loop stays free of it).

The engine feeds each sample's new token once the scheduler has applied the token stop rules (EOS,
stop ids, length): `add_token` detokenizes it, records its logprobs and returns the stop string it
completed, if any, for the engine to finish the request with. The stop rules themselves, text ones
included (where a stop string ends the text, what a running sample holds back), are `jaxserve.stopping`'s.

Host policy: no jax here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.request import Request
from jaxserve.sampling import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from jaxserve.scheduler import ScheduledBatch
from jaxserve.stopping import StopString, find_stop_string, reported_finish, visible_text
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from jaxserve.logprobs import TokenLogprobs


@dataclass(slots=True)
class _Sample:
    """One of a request's n samples, as the user sees it."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    stop: StopString | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        """The text so far (`jaxserve.stopping.visible_text`)."""
        request = self.request
        return visible_text(self.detokenizer.text, request.sampling_params.stop, request.is_finished, self.stop)

    def completion(self) -> CompletionOutput:
        request, params = self.request, self.request.sampling_params
        finish = reported_finish(request, self.stop)
        return CompletionOutput(
            index=request.index,
            text=self.text,
            token_ids=list(request.output_token_ids),
            logprobs=list(self.logprobs) if params.logprobs is not None else None,
            finish_reason=finish.reason.value if finish is not None else None,
            stop_reason=finish.stop_reason if finish is not None else None,
            token_logprobs=np.array(self.token_logprobs, np.float32) if params.token_logprobs else None,
        )


@dataclass(slots=True)
class _Group:
    """The n samples of one request id."""

    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    # Position 0 and those before SamplingParams.prompt_logprobs_start have none; position p + 1 is
    # appended once the step computing position p is read.
    prompt_logprobs: list[PositionLogprobs | None] | None
    stream: bool  # the caller wants partial outputs, not only the final one ...
    stream_interval: int = 1  # ... once this many new tokens (over the samples) are there, and the first one
    reported_tokens: int = 0  # tokens in the last output built

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.request.output_token_ids) for s in self.samples)


class OutputProcessor:
    """The user-facing state of every unfinished request; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}
        # A logprob entry's text: the token decoded alone, special tokens kept (as vLLM's decoded_token).
        self._token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda token: tokenizer.decode([token], skip_special_tokens=False)
        )

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        samples: list[Request],
        stream: bool = False,
        stream_interval: int = 1,
    ) -> None:
        """Starts tracking a request's samples (they share its prompt and parameters); `stream`: the caller
        wants an output after a step that changes it (after its first token, then once stream_interval more
        tokens are there), else only the final one."""
        params = samples[0].sampling_params
        self._groups[request_id] = _Group(
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            samples=[
                _Sample(r, IncrementalDetokenizer(self._tokenizer, prompt_token_ids, params.skip_special_tokens))
                for r in samples
            ],
            # Positions before the scored start are None (position 0 always is).
            prompt_logprobs=[None] * params.scored_prompt_start if params.scored_prompt_start is not None else None,
            stream=stream,
            stream_interval=stream_interval,
        )

    def wants_output(self, request_id: str) -> bool:
        """Whether a change of the request is reported now: it has finished, or it streams and this is its
        first token or stream_interval tokens came since the last output."""
        group = self._groups[request_id]
        if group.finished or (group.stream and group.stream_interval == 1):
            return True
        if not group.stream:
            return False
        return group.reported_tokens == 0 or group.num_tokens - group.reported_tokens >= group.stream_interval

    def add_token(
        self,
        request: Request,
        logprobs: TokenLogprobs | None,
        row: int,
        sampled_logprobs: np.ndarray | None = None,
    ) -> str | None:
        """Takes the sample's newest token and, at `row` of the step, its logprobs (host TokenLogprobs,
        when a row asked for top logprobs) and its own logprob (`sampled_logprobs`, when a row asked for
        any); returns the stop string its text now contains, for the caller to finish the request with,
        or None."""
        sample = self._groups[request.request_id].samples[request.index]
        if sample.stop is not None:
            return None
        token, params = request.token_ids[-1], request.sampling_params
        if logprobs is not None and params.logprobs is not None:
            sample.logprobs.append(position_logprobs(logprobs, row, token, params.logprobs, self._token_text))
        if sampled_logprobs is not None and params.token_logprobs:
            sample.token_logprobs.append(float(sampled_logprobs[row]))
        detokenizer = sample.detokenizer
        checked = len(detokenizer.text)
        detokenizer.add(token)
        if request.is_finished:
            detokenizer.flush()
        sample.stop = find_stop_string(detokenizer.text, checked, params, len(request.output_token_ids))
        return sample.stop.text if sample.stop is not None else None

    def add_prompt_logprobs(self, batch: ScheduledBatch, logprobs: TokenLogprobs) -> None:
        """Records the prompt positions a step scored (flat token t of a row at position p scores prompt
        position p + 1), each position once, from the scored start on: a recomputed prompt (preemption)
        and positions before the start are skipped."""
        offsets = np.cumsum([0] + [row.num_tokens for row in batch.rows[:-1]])
        for row, offset in zip(batch.rows, offsets.tolist(), strict=True):
            request = row.request
            k = request.sampling_params.prompt_logprobs
            group = self._groups.get(request.request_id)
            if not row.is_prefill or k is None or group is None or group.prompt_logprobs is None:
                continue
            entries, prompt = group.prompt_logprobs, request.prompt_token_ids
            for i in range(row.num_tokens):
                position = row.start + i + 1
                if position < len(prompt) and position == len(entries):
                    entries.append(position_logprobs(logprobs, offset + i, prompt[position], k, self._token_text))

    def output(self, request_id: str) -> RequestOutput:
        """The request's output now; a finished request is forgotten once its output is built."""
        group = self._groups[request_id]
        if group.stream_interval > 1:
            group.reported_tokens = group.num_tokens
        first = group.samples[0].request
        errors = [s.request.error for s in group.samples if s.request.error]
        output = RequestOutput(
            request_id=request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=[s.completion() for s in group.samples],
            finished=group.finished,
            metrics=first.metrics,
            error=errors[0] if errors else None,
            prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
            num_cached_tokens=first.num_cached_tokens,
        )
        if output.finished:
            del self._groups[request_id]
        return output


def position_logprobs(
    logprobs: TokenLogprobs,
    row: int,
    token: int,
    num_top: int,
    token_text: Callable[[int], str] | None = None,
) -> PositionLogprobs:
    """vLLM's per-position dict from one row of (host) TokenLogprobs: the top `num_top` tokens with their
    ranks, and `token` (the sampled or prompt token) with its own rank when it is not among them; each
    entry's decoded_token is token_text(id) when given."""
    top = zip(logprobs.top_ids[row, :num_top].tolist(), logprobs.top_logprobs[row, :num_top].tolist(), strict=True)
    entry = {token_id: Logprob(lp, rank=r + 1) for r, (token_id, lp) in enumerate(top)}
    if token not in entry:
        entry[token] = Logprob(float(logprobs.logprob[row]), rank=int(logprobs.rank[row]))
    if token_text is not None:
        for token_id, logprob in entry.items():
            logprob.decoded_token = token_text(token_id)
    return entry
