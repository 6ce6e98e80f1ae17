"""What a caller asks for and what it gets back: SamplingParams (validated with vLLM's ranges), the
finish reasons, and the output types RequestOutput, CompletionOutput, Logprob and RequestMetrics.

Host policy: no jax here. The on-device sampler reads these parameters through per-row numpy arrays
(`inputs.SamplingInputs`).
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Most logprobs a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# Seeds feed a 32-bit PRNG key on the device: any int is taken modulo this.
SEED_MODULUS = 2**32
# Every integer field is bounded by this: the engine packs them into the device's int32 arrays
# (top_k, stop ids among the banned tokens, ...), and a larger value would overflow there.
INT32_MAX = 2**31 - 1
# Float fields become float32 on the device: a larger magnitude would turn into inf there.
FLOAT32_MAX = 3.4028234663852886e38
# Most samples one request may ask for: OpenAI's limit for n. Each sample is a sequence of its own.
MAX_N = 128


class FinishReason(str, enum.Enum):
    """Why a sequence stopped; the values are the OpenAI / vLLM strings."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_seq_len reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the request can never be served (see Request.error)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int, maximum: int = INT32_MAX, *, also: str = "") -> int:
    """`value` as an int in [minimum, maximum]; `also` names the other accepted values for the message."""
    if not _is_int(value) or not minimum <= value <= maximum:
        got = f"{value!r} ({type(value).__name__})" if not _is_int(value) else str(value)
        raise ValueError(f"{name} must be {also}an int in [{minimum}, {maximum}], got {got}")
    return int(value)


def _check_optional_int(name: str, value: Any, minimum: int, maximum: int = INT32_MAX) -> int | None:
    return None if value is None else _check_int(name, value, minimum, maximum, also="None or ")


# The float fields' ranges (vLLM's): lowest, highest, whether the lowest itself is excluded. Unbounded
# fields stop at FLOAT32_MAX, and NaN is in no range.
_FLOAT_RANGES = {
    "temperature": (0.0, FLOAT32_MAX, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, FLOAT32_MAX, True),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
}


def _check_float(name: str, value: Any) -> float:
    """`value` as a float within the field's range in _FLOAT_RANGES."""
    low, high, low_excluded = _FLOAT_RANGES[name]
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not is_number or not (low < value if low_excluded else low <= value) or not value <= high:
        interval = f"{'(' if low_excluded else '['}{low:g}, {'3.4e38' if high == FLOAT32_MAX else f'{high:g}'}]"
        got = repr(value) if is_number else f"{value!r} ({type(value).__name__})"
        raise ValueError(f"{name} must be a number in {interval}, got {got}")
    return float(value)


def _as_items(name: str, value: Any, expected: str) -> tuple[Any, ...]:
    """The entries of a list-like `value` (None is empty); a string, bytes, mapping or scalar is refused."""
    if value is None:
        return ()
    if not isinstance(value, (str, bytes, bytearray, Mapping)):
        try:
            return tuple(value)
        except TypeError:
            pass
    raise ValueError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")


def _normalize_stop(stop: Any) -> tuple[str, ...]:
    """A single string or a list of non-empty strings, as a tuple (the params stay hashable)."""
    expected = "a string or a list of non-empty strings"
    items = (stop,) if isinstance(stop, str) else _as_items("stop", stop, expected)
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop must be {expected}, got stop[{i}] = {item!r}")
    return items


def _normalize_stop_token_ids(token_ids: Any) -> tuple[int, ...]:
    """A list of token ids, as a tuple of ints. A bare int is refused, as vLLM's server schema does."""
    expected = f"a list of ints in [0, {INT32_MAX}]"
    if _is_int(token_ids):
        raise ValueError(f"stop_token_ids must be {expected}, got the bare int {token_ids} (write [{token_ids}])")
    items = _as_items("stop_token_ids", token_ids, expected)
    return tuple(_check_int(f"stop_token_ids[{i}]", token_id, 0) for i, token_id in enumerate(items))


def _normalize_top_k(top_k: Any) -> int | None:
    """vLLM's "off" values 0 and -1 become None; otherwise an int >= 1 (the engine clips it to the vocabulary)."""
    if top_k is None or (_is_int(top_k) and top_k in (0, -1)):
        return None
    return _check_int("top_k", top_k, 1, also="None, 0 or -1 (disabled), or ")


def _normalize_seed(seed: Any) -> int | None:
    if seed is None:
        return None
    if not _is_int(seed):
        raise ValueError(f"seed must be None or an int (taken modulo 2**32), got {seed!r} ({type(seed).__name__})")
    return int(seed) % SEED_MODULUS


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop; validated (and normalized) on construction.

    Integer fields take ints (numpy ints too, never bools) of at most INT32_MAX = 2**31 - 1, the
    device's int32 arrays; float fields take finite numbers within float32's range. A bad value
    raises ValueError naming the field, the value and what is accepted.

    n: independent samples of the prompt, in [1, MAX_N = 128]; they share the prompt's KV blocks.
    temperature: >= 0; below 1e-5 sampling is greedy.
    top_k: None, 0 or -1 (disabled, as in vLLM; stored as None) or >= 1; a top_k above the
        vocabulary keeps every token (the engine clips it).
    top_p: in (0, 1]; 1 disables it.
    min_p: in [0, 1]; 0 disables it.
    repetition_penalty: > 0; 1 disables it. presence_penalty, frequency_penalty: in [-2, 2].
    seed: None or any int, stored modulo 2**32 (the device PRNG's seed width), as vLLM accepts any
        int; a seeded request samples the same tokens whatever its batch.
    max_tokens: None (up to max_seq_len) or >= 1 (vLLM's server allows 0 only to echo the prompt,
        which this engine does not do). min_tokens: in [0, max_tokens]; EOS and stop token ids do
        not stop the request before it.
    stop: a string or a list of non-empty strings that end the output (checked by the detokenizer;
        not part of the output); stored as a tuple.
    stop_token_ids: a list of token ids (>= 0) that end the output; a bare int is refused, as vLLM's
        server schema refuses it; stored as a tuple. ignore_eos: keep generating after EOS.
    logprobs: None or [0, 20]: logprobs of the sampled token and this many alternatives, as one
        {token_id: Logprob} dict per token (`CompletionOutput.logprobs`).
    prompt_logprobs: None or [0, 20], for the prompt tokens.
    prompt_logprobs_start: the first prompt position scored (>= 0; with prompt_logprobs only, and below
        the prompt's length): e.g. the length of a context whose continuation is scored. Positions before
        it come back None, and the context's full KV blocks may come from the prefix cache, so only the
        rest of the prompt is computed. 0 (the default) scores every position, as vLLM's prompt_logprobs.
    skip_special_tokens: drop special tokens when detokenizing.
    token_logprobs: also return the logprob of every sampled token as one float32 numpy array
        (`CompletionOutput.token_logprobs`), without building any dict: what RL needs, cheaply. Both
        kinds of logprob follow the engine's `logprobs_mode` (raw by default, as vLLM's).
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
    prompt_logprobs_start: int = 0
    skip_special_tokens: bool = True
    token_logprobs: bool = False

    def __post_init__(self) -> None:
        normalized = {
            "stop": _normalize_stop(self.stop),
            "stop_token_ids": _normalize_stop_token_ids(self.stop_token_ids),
            **self._sampling_fields(),
            **self._length_fields(),
        }
        for name, value in normalized.items():  # frozen: normalized values go in through object.__setattr__
            object.__setattr__(self, name, value)
        for name in ("ignore_eos", "skip_special_tokens", "token_logprobs"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")

    def _sampling_fields(self) -> dict[str, Any]:
        return {
            "n": _check_int("n", self.n, 1, MAX_N),
            "top_k": _normalize_top_k(self.top_k),
            "seed": _normalize_seed(self.seed),
            **{name: _check_float(name, getattr(self, name)) for name in _FLOAT_RANGES},
        }

    def _length_fields(self) -> dict[str, Any]:
        max_tokens = _check_optional_int("max_tokens", self.max_tokens, 1)
        return {
            "max_tokens": max_tokens,
            "min_tokens": _check_int("min_tokens", self.min_tokens, 0, INT32_MAX if max_tokens is None else max_tokens),
            "logprobs": _check_optional_int("logprobs", self.logprobs, 0, MAX_LOGPROBS),
            "prompt_logprobs": _check_optional_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS),
            "prompt_logprobs_start": self._checked_prompt_logprobs_start(),
        }

    def _checked_prompt_logprobs_start(self) -> int:
        start = _check_int("prompt_logprobs_start", self.prompt_logprobs_start, 0)
        if start and self.prompt_logprobs is None:
            raise ValueError(f"prompt_logprobs_start={start} needs prompt_logprobs (None scores no prompt position)")
        return start

    @property
    def scored_prompt_start(self) -> int | None:
        """The first prompt position scored (position 0 never is: nothing precedes it); None: none asked."""
        return max(1, self.prompt_logprobs_start) if self.prompt_logprobs is not None else None

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
    token_logprobs: with `SamplingParams(token_logprobs=True)`, the logprob of each of token_ids
        (float32, shape [len(token_ids)]); else None.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_logprobs: np.ndarray | None = None

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
    num_cached_tokens: prompt tokens whose KV came from the prefix cache at the request's (latest)
        admission, as vLLM's field of that name; 0 before it is admitted.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0


def is_exact_ints(values: Iterable[Any]) -> bool:
    """True when every value's type is exactly int (a bool or a numpy integer is not)."""
    return set(map(type, values)) <= {int}


def validate_prompt_token_ids(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    """Raises a ValueError when a prompt is empty or holds token ids outside [0, vocab_size)."""
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt is empty: a prompt needs at least one token")
    # The common case, checked in C: Python ints (not bools) in range, an order of magnitude faster than the
    # per-token isinstance checks below, which name the bad ids (docs/log/2026-benchmarks.md, "Figures
    # moved out of the code").
    if is_exact_ints(prompt_token_ids) and min(prompt_token_ids) >= 0 and max(prompt_token_ids) < vocab_size:
        return
    bad = [
        t
        for t in prompt_token_ids
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size
    ]
    if bad:
        raise ValueError(f"prompt token ids must be ints in [0, {vocab_size - 1}]; got {bad[:5]}")
