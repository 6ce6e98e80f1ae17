"""What a caller asks for and what it gets back: SamplingParams (validated with vLLM's ranges), the
finish reasons, and the output types RequestOutput, CompletionOutput, Logprob and RequestMetrics.

Host policy: no jax here. The on-device sampler reads these parameters through per-row numpy arrays
(`inputs.SamplingInputs`).
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Most logprobs a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# Seeds feed a 32-bit PRNG key on the device: any int is taken modulo this.
SEED_MODULUS = 2**32


class FinishReason(str, enum.Enum):
    """Why a sequence stopped; the values are the OpenAI / vLLM strings."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_seq_len reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the request can never be served (see Request.error)


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    allowed = f"[{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int {allowed}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop; validated on construction.

    n: independent samples of the prompt (>= 1); they share the prompt's KV blocks.
    temperature: >= 0; below 1e-5 sampling is greedy.
    top_k: None (disabled) or >= 1.
    top_p: in (0, 1]; 1 disables it.
    min_p: in [0, 1]; 0 disables it.
    repetition_penalty: > 0; 1 disables it. presence_penalty, frequency_penalty: in [-2, 2].
    seed: None or any int, taken modulo 2**32 (the device PRNG's seed width), as vLLM accepts any
        int; a seeded request samples the same tokens whatever its batch.
    max_tokens: None (up to max_seq_len) or >= 1. min_tokens: in [0, max_tokens]; EOS and stop
        token ids do not stop the request before it.
    stop: strings that end the output (checked by the detokenizer; not part of the output).
    stop_token_ids: token ids that end the output. ignore_eos: keep generating after EOS.
    logprobs: None or [0, 20]: logprobs of the sampled token and this many alternatives.
    prompt_logprobs: None or [0, 20], for the prompt tokens.
    skip_special_tokens: drop special tokens when detokenizing.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._normalize_stops()
        self._validate_sampling()
        self._validate_lengths()
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _normalize_stops(self) -> None:
        # Accept a single string or any sequence; store tuples so the params stay hashable and frozen.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        token_ids = tuple(self.stop_token_ids or ())
        for token_id in token_ids:
            _check_int("stop_token_ids entries", token_id, 0)
        object.__setattr__(self, "stop_token_ids", token_ids)

    def _validate_sampling(self) -> None:
        _check_int("n", self.n, 1)
        if _check_float("temperature", self.temperature) < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, 1)
        if not 0.0 < _check_float("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= _check_float("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if _check_float("repetition_penalty", self.repetition_penalty) <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _check_float(name, getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)

    @property
    def is_greedy(self) -> bool:
        """Greedy decoding: temperature below 1e-5 or top_k == 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1


@dataclass(slots=True)
class Logprob:
    """Log probability of one token, its rank in the distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One generated (or prompt) position: token id -> its Logprob, the sampled token included.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One of the n samples of a request.

    finish_reason: None while running, else a FinishReason value ("stop", "length", "abort", "error").
    stop_reason: the stop token id or stop string that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times of one request (time.monotonic seconds) and the durations derived from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """What `generate` / the stream yields for one request: its prompt, its n completions and metrics.

    error: set when the request could not be served (finish_reason "error" on every output).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None


def validate_prompt_token_ids(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    """Raises a ValueError when a prompt is empty or holds token ids outside [0, vocab_size)."""
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt is empty: a prompt needs at least one token")
    bad = [
        t
        for t in prompt_token_ids
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size
    ]
    if bad:
        raise ValueError(f"prompt token ids must be ints in [0, {vocab_size - 1}]; got {bad[:5]}")
