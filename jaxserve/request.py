"""One sequence being served and its state machine.

    WAITING --admit--> PREFILL (one or more chunks) --prompt computed--> DECODE --stop--> FINISHED
    PREFILL / DECODE --preempt--> PREEMPTED --admit--> PREFILL (recompute: prompt + outputs so far)
    any state but FINISHED --finish--> FINISHED (stop, length, abort, error)

A request with n > 1 samples is n Request objects (`make_requests`) with the same request_id and
indices 0..n-1; samples 1..n-1 name sample 0 as their `parent` and fork its prompt blocks.

Token bookkeeping, valid with the engine's overlap of steps: `token_ids` holds the prompt and the
output tokens known on the host; `num_pending_tokens` counts tokens already sampled on the device
whose value the host has not read yet; `num_computed_tokens` counts tokens whose KV is written (or
is being written by a step already scheduled). The scheduler advances it when it schedules a step.

Host policy: no jax here.
"""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxserve.sampling import SEED_MODULUS, FinishReason, RequestMetrics, SamplingParams

# Odd 32-bit constant (the golden ratio) spreading the seeds of a request's samples apart.
_SAMPLE_SEED_STRIDE = 0x9E3779B9


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    PREEMPTED = "preempted"
    FINISHED = "finished"


_LEGAL_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.PREFILL, RequestStatus.FINISHED}),
    RequestStatus.PREEMPTED: frozenset({RequestStatus.PREFILL, RequestStatus.FINISHED}),
    RequestStatus.PREFILL: frozenset({RequestStatus.DECODE, RequestStatus.PREEMPTED, RequestStatus.FINISHED}),
    RequestStatus.DECODE: frozenset({RequestStatus.PREEMPTED, RequestStatus.FINISHED}),
    RequestStatus.FINISHED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A request was asked to move between states its state machine does not connect: a bug."""


@dataclass(slots=True, eq=False)
class Request:
    """One sequence: its prompt, sampling parameters, generated tokens, KV blocks and state.

    Compared by identity (eq=False), so requests can key dicts and sets.
    eos_token_ids: tokens that end the sequence unless sampling_params.ignore_eos (from the tokenizer).
    index / parent: sample index within the request's n samples; samples > 0 point at sample 0.
    block_ids / block_hashes: owned by the BlockManager; hashes of the full blocks computed so far.
        block_ids is a C-int array (`array("i")`, packed int32): a step joins its rows' block lists
        into the block table as bytes (`step_inputs._fill_block_table`), without converting Python ints.
    num_cached_tokens: prompt tokens served from the prefix cache (or a fork) at the last admission.
    lora_name / cache_root: the LoRA adapter it is served with and the root of its prefix-cache hashes (the
        adapter's `LoraAdapter.cache_root`); None: the base model. lora_slot: the adapter's slot while it runs.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    index: int = 0
    parent: Request | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    block_ids: array = field(default_factory=lambda: array("i"))
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0
    lora_name: str | None = None
    cache_root: bytes | None = None
    lora_slot: int | None = None
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    # ---- derived sizes -------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, those still on the device included."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, those still on the device included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens known on the host."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def seed(self) -> int | None:
        """This sample's PRNG seed in [0, 2**32): the request's seed, spread apart for samples 1..n-1."""
        seed = self.sampling_params.seed
        if seed is None:
            return None
        return (int(seed) + self.index * _SAMPLE_SEED_STRIDE) % SEED_MODULUS

    def max_total_tokens(self, max_seq_len: int) -> int:
        """Tokens (prompt + output) this sequence may reach: prompt + max_tokens, at most max_seq_len."""
        max_tokens = self.sampling_params.max_tokens
        if max_tokens is None:
            return max_seq_len
        return min(self.num_prompt_tokens + max_tokens, max_seq_len)

    def reached_length_limit(self, max_seq_len: int) -> bool:
        """Whether the tokens sampled so far (pending ones included) already hit max_tokens / max_seq_len."""
        return self.num_tokens >= self.max_total_tokens(max_seq_len)

    # ---- transitions ---------------------------------------------------------------------------

    def _move(self, new: RequestStatus) -> None:
        if new not in _LEGAL_TRANSITIONS[self.status]:
            raise IllegalTransition(f"request {self.request_id}[{self.index}]: {self.status.name} -> {new.name}")
        self.status = new

    def admit(self, now: float) -> None:
        """WAITING / PREEMPTED -> PREFILL: the scheduler gave it KV blocks."""
        self._move(RequestStatus.PREFILL)
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now

    def start_decode(self) -> None:
        """PREFILL -> DECODE: every known token is computed; one new token per step from now on."""
        self._move(RequestStatus.DECODE)

    def preempt(self) -> None:
        """PREFILL / DECODE -> PREEMPTED: its blocks were freed; prompt + outputs will be recomputed.

        Tokens still on the device are dropped (the step that samples them is ignored on update).
        """
        if self.block_ids:
            raise IllegalTransition(f"request {self.request_id}[{self.index}]: preempted while holding blocks")
        self._move(RequestStatus.PREEMPTED)
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        self.num_preemptions += 1

    def append_token(self, token_id: int, now: float) -> None:
        """A token sampled on the device reached the host."""
        if self.num_pending_tokens <= 0 or self.status not in (RequestStatus.PREFILL, RequestStatus.DECODE):
            raise IllegalTransition(f"request {self.request_id}[{self.index}]: token without a pending sample")
        self.num_pending_tokens -= 1
        self.token_ids.append(int(token_id))
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now

    def finish(
        self, reason: FinishReason, now: float, *, stop_reason: int | str | None = None, error: str | None = None
    ) -> None:
        """Any state but FINISHED -> FINISHED. The caller frees its blocks first."""
        self._move(RequestStatus.FINISHED)
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.num_pending_tokens = 0
        self.metrics.finished_time = now


def make_requests(
    request_id: str,
    prompt_token_ids: Sequence[int],
    sampling_params: SamplingParams,
    *,
    eos_token_ids: frozenset[int] = frozenset(),
    prompt: str | None = None,
    arrival_time: float | None = None,
) -> list[Request]:
    """The n sequences of one request: sample 0, then samples 1..n-1 that fork sample 0's prompt."""
    metrics_time = time.monotonic() if arrival_time is None else arrival_time
    first = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling_params,
        eos_token_ids=eos_token_ids,
        prompt=prompt,
        metrics=RequestMetrics(arrival_time=metrics_time),
    )
    samples = [first]
    for index in range(1, sampling_params.n):
        samples.append(
            Request(
                request_id=request_id,
                prompt_token_ids=first.prompt_token_ids,
                sampling_params=sampling_params,
                eos_token_ids=eos_token_ids,
                prompt=prompt,
                index=index,
                parent=first,
                metrics=RequestMetrics(arrival_time=metrics_time),
            )
        )
    return samples
