"""Scheduler: capacity policies, micro-batch limits, chunked prefill, prefix hits, forks, stops, overlap.

The property test drives the scheduler with a fake device that keeps a fake KV cache: every written
slot holds a fingerprint of the token prefix it belongs to, and every step checks that each sequence
reads exactly its own prefix from its block table. Sampled tokens are a fixed function of (request,
sample index, generation index), so the final outputs are known whatever batching, preemption or
overlap happened.
"""

from __future__ import annotations

import dataclasses
import zlib
from array import array
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxserve.block_manager import RESERVED_BLOCK, BlockManager
from jaxserve.config import CapacityPolicy, CompileConfig, EngineConfig, KvCacheConfig, SchedulerConfig
from jaxserve.request import IllegalTransition, Request, RequestStatus, make_requests
from jaxserve.sampling import FinishReason, SamplingParams
from jaxserve.scheduler import ScheduledBatch, Scheduler
from jaxserve.step_inputs import make_step_inputs
from jaxserve.variants import StepConfig

GUARANTEED = CapacityPolicy.GUARANTEED_NO_EVICT
MAX_UTIL = CapacityPolicy.MAX_UTILIZATION
EOS = 0
VOCAB = 12


def make_scheduler(
    *,
    num_blocks=64,
    block_size=4,
    max_batch_size=4,
    max_num_tokens=32,
    max_seq_len=64,
    policy=GUARANTEED,
    chunked=True,
    prefix_caching=True,
):
    config = EngineConfig(
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len,
        kv_cache=KvCacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(capacity_policy=policy, enable_chunked_prefill=chunked),
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching), clock=lambda: 0.0)


def add(scheduler, request_id, prompt, **params):
    requests = make_requests(request_id, prompt, SamplingParams(**params), eos_token_ids=frozenset({EOS}))
    for request in requests:
        scheduler.add(request)
    return requests


def true_token(request: Request, generation_index: int) -> int:
    """The token the fake model samples: fixed per (request, sample, generation index), never EOS."""
    key = f"{request.request_id}/{request.index}/{generation_index}".encode()
    return 1 + zlib.crc32(key) % (VOCAB - 1)


def step(scheduler, tokens_for=true_token):
    """One non-overlapped engine step; returns the batch."""
    batch = scheduler.schedule()
    sampled = np.array([tokens_for(row.request, row.generation_index) for row in batch.rows], dtype=np.int32)
    scheduler.update(batch, sampled)
    return batch


def run_to_completion(scheduler, max_steps=500):
    batches = []
    while scheduler.has_unfinished():
        batches.append(step(scheduler))
        assert len(batches) < max_steps, "scheduler made no progress"
    return batches


# ---- request state machine ----------------------------------------------------------------------


def test_request_state_machine_rejects_illegal_transitions():
    samples = make_requests("a", [1, 2], SamplingParams(seed=-1, n=3), arrival_time=0.0)
    assert [s.index for s in samples] == [0, 1, 2] and all(s.parent is samples[0] for s in samples[1:])
    assert samples[0].seed == 2**32 - 1 and len({s.seed for s in samples}) == 3
    request = samples[0]
    with pytest.raises(IllegalTransition, match="WAITING -> DECODE"):
        request.start_decode()
    request.admit(0.0)
    with pytest.raises(IllegalTransition, match="without a pending sample"):
        request.append_token(3, 0.0)
    request.block_ids = array("i", [4])
    with pytest.raises(IllegalTransition, match="holding blocks"):
        request.preempt()
    request.block_ids = array("i")
    request.finish(FinishReason.ABORT, 1.0)
    with pytest.raises(IllegalTransition, match="FINISHED -> PREFILL"):
        request.admit(2.0)
    assert request.metrics.latency == 1.0


# ---- micro-batch policy -------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_on_block_boundaries():
    scheduler = make_scheduler(max_num_tokens=10, block_size=4)
    (request,) = add(scheduler, "a", list(range(1, 24)), max_tokens=2)
    chunks = [step(scheduler).rows[0] for _ in range(4)]
    # 10-token budget: chunks end on block boundaries (8, 16), the last one finishes the prompt.
    assert [(row.start, row.num_tokens, row.samples) for row in chunks[:3]] == [
        (0, 8, False),
        (8, 8, False),
        (16, 7, True),
    ]
    assert chunks[3].num_tokens == 1 and not chunks[3].is_prefill
    assert request.is_finished and request.output_token_ids == [true_token(request, 0), true_token(request, 1)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    scheduler = make_scheduler(max_num_tokens=10, chunked=False)
    (a,) = add(scheduler, "a", [1] * 7, max_tokens=3)
    (b,) = add(scheduler, "b", [2] * 6, max_tokens=3)
    first = step(scheduler)
    assert [row.request for row in first.rows] == [a]  # b's 6 tokens do not fit beside a's 7
    second = step(scheduler)
    assert [(row.request, row.num_tokens) for row in second.rows] == [(b, 6), (a, 1)]


def test_decode_rows_take_the_budget_first_but_prefill_rows_come_first_in_the_batch():
    scheduler = make_scheduler(max_num_tokens=8, block_size=4)
    (a,) = add(scheduler, "a", [1, 2, 3], max_tokens=5)
    step(scheduler)
    (b,) = add(scheduler, "b", list(range(1, 21)), max_tokens=5)
    batch = step(scheduler)
    assert [row.request for row in batch.rows] == [b, a] and batch.num_prefill_rows == 1
    # 7 tokens of budget are left after the decode row; the truncated chunk ends on a block boundary.
    assert batch.rows[0].num_tokens == 4 and batch.rows[1].num_tokens == 1


def test_max_batch_size_and_fcfs_admission():
    scheduler = make_scheduler(max_batch_size=2)
    requests = [add(scheduler, f"r{i}", [i + 1] * 3, max_tokens=2)[0] for i in range(4)]
    first = step(scheduler)
    assert [row.request for row in first.rows] == requests[:2]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 2
    batches = run_to_completion(scheduler)
    assert all(batch.num_seqs <= 2 for batch in batches)
    admitted = [r.metrics.first_scheduled_time is not None for r in requests]
    assert all(admitted) and all(r.finish_reason is FinishReason.LENGTH for r in requests)


# ---- capacity policies --------------------------------------------------------------------------


def test_guaranteed_no_evict_reserves_whole_lifetimes():
    # 8 usable blocks of 4 tokens; each request needs ceil((4 + 12 - 1) / 4) = 4 blocks for its life.
    scheduler = make_scheduler(num_blocks=9, policy=GUARANTEED)
    requests = [add(scheduler, f"r{i}", [i + 1] * 4, max_tokens=12)[0] for i in range(3)]
    step(scheduler)
    assert [r.status for r in requests] == [RequestStatus.DECODE, RequestStatus.DECODE, RequestStatus.WAITING]
    run_to_completion(scheduler)
    assert scheduler.num_preemptions == 0
    assert all(len(r.output_token_ids) == 12 for r in requests)


def test_max_utilization_preempts_the_latest_admitted_and_recomputes_it():
    scheduler = make_scheduler(num_blocks=9, policy=MAX_UTIL)
    requests = [add(scheduler, f"r{i}", [i + 1] * 4, max_tokens=12)[0] for i in range(3)]
    batches = run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0
    first_victim = next(batch.preempted[0] for batch in batches if batch.preempted)
    assert first_victim is requests[2]
    for request in requests:
        assert request.output_token_ids == [true_token(request, k) for k in range(12)]
    # A preempted request comes back as a prefill of its prompt and the outputs it had.
    assert any(row.is_prefill and row.epoch > 0 and row.samples for batch in batches for row in batch.rows)


def test_requests_that_can_never_fit_are_rejected_and_others_keep_running():
    scheduler = make_scheduler(num_blocks=5, max_seq_len=20, max_num_tokens=8, chunked=False)
    (too_long,) = add(scheduler, "long", [1] * 20)
    (too_big,) = add(scheduler, "big", [1] * 3, max_tokens=16)  # 18 tokens of KV: 5 blocks > 4
    (unchunked,) = add(scheduler, "unchunked", [1] * 9, max_tokens=1)
    (empty,) = add(scheduler, "empty", [])
    (fine,) = add(scheduler, "fine", [1, 2, 3], max_tokens=4)
    for request, message in [
        (too_long, "prompt has 20 tokens but max_seq_len is 20"),
        (too_big, "needs 5 KV blocks"),
        (unchunked, "chunked prefill disabled"),
        (empty, "prompt is empty"),
    ]:
        assert request.is_finished and request.finish_reason is FinishReason.ERROR
        assert message in request.error
    run_to_completion(scheduler)
    assert fine.finish_reason is FinishReason.LENGTH and len(fine.output_token_ids) == 4


# ---- stops, aborts ------------------------------------------------------------------------------


def fixed_tokens(tokens):
    return lambda request, generation_index: tokens[generation_index]


@pytest.mark.parametrize(
    ("params", "reason", "num_outputs", "stop_reason"),
    [
        ({}, FinishReason.STOP, 3, None),  # EOS
        ({"ignore_eos": True, "stop_token_ids": []}, FinishReason.LENGTH, 8, None),
        ({"min_tokens": 4}, FinishReason.STOP, 5, 7),  # EOS ignored before min_tokens, then stop token 7
        ({"stop_token_ids": [5]}, FinishReason.STOP, 2, 5),
        ({"max_tokens": 2}, FinishReason.LENGTH, 2, None),
    ],
)
def test_token_stop_conditions(params, reason, num_outputs, stop_reason):
    tokens = [4, 5, EOS, 3, 7, 9, 9, 9]
    scheduler = make_scheduler()
    (request,) = add(scheduler, "a", [1, 2], **({"max_tokens": 8, "stop_token_ids": [7]} | params))
    while scheduler.has_unfinished():
        step(scheduler, fixed_tokens(tokens))
    assert request.finish_reason is reason and request.stop_reason == stop_reason
    assert request.output_token_ids == tokens[:num_outputs]
    assert scheduler.block_manager.num_used_blocks == 0


def test_max_seq_len_stops_a_request_without_max_tokens():
    scheduler = make_scheduler(max_seq_len=10)
    (request,) = add(scheduler, "a", [1, 2, 3], max_tokens=None)
    run_to_completion(scheduler)
    assert request.finish_reason is FinishReason.LENGTH and request.num_tokens == 10


def test_abort_and_finish_free_blocks_and_leave_the_others_running():
    scheduler = make_scheduler()
    a_samples = add(scheduler, "a", [1, 2, 3], max_tokens=10, n=2)
    (b,) = add(scheduler, "b", [4, 5], max_tokens=10)
    (c,) = add(scheduler, "c", [6], max_tokens=10)
    step(scheduler)
    assert scheduler.abort("a") == a_samples
    assert all(r.finish_reason is FinishReason.ABORT for r in a_samples)
    scheduler.finish(b, FinishReason.STOP, stop_reason="###")
    assert b.stop_reason == "###" and b.block_ids == array("i")
    run_to_completion(scheduler)
    assert c.finish_reason is FinishReason.LENGTH
    assert scheduler.block_manager.num_used_blocks == 0


# ---- sharing ------------------------------------------------------------------------------------


def test_second_identical_prompt_computes_only_its_last_partial_block():
    scheduler = make_scheduler(block_size=4, max_num_tokens=64)
    prompt = list(range(1, 31))  # 30 tokens: 7 full blocks, the last one partial
    (first,) = add(scheduler, "a", prompt, max_tokens=3)
    run_to_completion(scheduler)
    (second,) = add(scheduler, "b", prompt, max_tokens=3)
    batch = step(scheduler)
    assert (batch.rows[0].start, batch.rows[0].num_tokens) == (28, 2)
    assert second.num_cached_tokens == 28
    stats = scheduler.block_manager.stats
    assert stats.hit_tokens == 28 and stats.queried_tokens == 60 and stats.hit_rate == pytest.approx(28 / 60)
    run_to_completion(scheduler)
    assert len(second.output_token_ids) == len(first.output_token_ids) == 3


def test_samples_of_one_request_fork_the_prompt_blocks():
    scheduler = make_scheduler(block_size=4, prefix_caching=False)
    samples = add(scheduler, "a", list(range(1, 11)), max_tokens=3, n=3, seed=7)
    first = step(scheduler)
    assert [row.request for row in first.rows] == [samples[0]]  # the others wait for its prompt
    second = step(scheduler)
    forked = [row for row in second.rows if row.request.index > 0]
    assert [(row.start, row.num_tokens) for row in forked] == [(8, 2), (8, 2)]
    assert all(s.block_ids[:2] == samples[0].block_ids[:2] for s in samples[1:])
    assert scheduler.block_manager.ref_count(samples[0].block_ids[0]) == 3
    run_to_completion(scheduler)
    assert len({s.seed for s in samples}) == 3
    for sample in samples:
        assert sample.output_token_ids == [true_token(sample, k) for k in range(3)]
    assert scheduler.block_manager.num_used_blocks == 0


# ---- overlap ------------------------------------------------------------------------------------


def test_overlap_schedules_the_next_step_before_the_previous_update():
    scheduler = make_scheduler()
    (request,) = add(scheduler, "a", [1, 2, 3], max_tokens=3, stop_token_ids=[9])
    tokens = [4, 9, 6]
    first = scheduler.schedule()
    second = scheduler.schedule()  # step 1's token is still on the device
    (row,) = second.rows
    assert row.input_pending and row.token_ids == [] and (row.start, row.generation_index) == (3, 1)
    carried = make_step_inputs(second, first, steps_of(scheduler))[0].carried_mask
    assert carried[0] and not carried[1:].any()
    scheduler.update(first, np.array([tokens[0]]))
    third = scheduler.schedule()
    scheduler.update(second, np.array([tokens[1]]))  # stop token: finished while step 3 is in flight
    assert request.finish_reason is FinishReason.STOP and request.output_token_ids == [4, 9]
    assert scheduler.update(third, np.array([tokens[2]])) == []  # the stale row is ignored
    assert request.output_token_ids == [4, 9] and not scheduler.has_unfinished()


def test_update_rejects_too_few_tokens_and_add_rejects_a_scheduled_request():
    scheduler = make_scheduler()
    (request,) = add(scheduler, "a", [1, 2], max_tokens=2)
    batch = scheduler.schedule()
    with pytest.raises(ValueError, match="1 rows"):
        scheduler.update(batch, np.array([], dtype=np.int32))
    with pytest.raises(ValueError, match="already scheduled"):
        scheduler.add(request)


# ---- property test: random workloads through a fake device --------------------------------------


@dataclass
class FakeDevice:
    """A KV cache of prefix fingerprints; checks every step's inputs against each sequence's true tokens."""

    scheduler: Scheduler
    steps: StepConfig
    kv: np.ndarray = field(init=False)

    def __post_init__(self):
        self.kv = np.full(self.scheduler.block_manager.num_blocks * self.steps.buckets.block_size, -1, dtype=np.int64)

    @staticmethod
    def true_tokens(request: Request, length: int) -> list[int]:
        outputs = [true_token(request, k) for k in range(max(0, length - request.num_prompt_tokens))]
        return (request.prompt_token_ids + outputs)[:length]

    @staticmethod
    def fingerprint(tokens: list[int]) -> int:
        return zlib.crc32(np.asarray(tokens, dtype=np.int32).tobytes())

    def run(self, batch: ScheduledBatch, previous: ScheduledBatch | None, previous_sampled) -> np.ndarray:
        inputs, bucket, variant = make_step_inputs(batch, previous, self.steps)
        assert (bucket, variant) in self.steps.compiled_steps()
        carried = inputs.carried_mask
        token_ids = inputs.token_ids.copy()
        if carried.any():
            token_ids[inputs.logits_indices[carried]] = previous_sampled[inputs.carried_source[carried]]
        bs = self.steps.buckets.block_size
        assert np.all(inputs.slot_mapping[:, inputs.cu_q_lens[-1] :] // bs == RESERVED_BLOCK)
        for b, row in enumerate(batch.rows):
            lo, hi = inputs.cu_q_lens[b], inputs.cu_q_lens[b + 1]
            end = row.start + row.num_tokens
            truth = self.true_tokens(row.request, end)
            assert token_ids[lo:hi].tolist() == truth[row.start :]
            assert inputs.positions[lo:hi].tolist() == list(range(row.start, end))
            for offset, position in enumerate(range(row.start, end)):
                self.kv[inputs.slot_mapping[0, lo + offset]] = self.fingerprint(truth[: position + 1])
        for b, row in enumerate(batch.rows):  # attention reads after every write of the step
            end = row.start + row.num_tokens
            truth = self.true_tokens(row.request, end)
            assert RESERVED_BLOCK not in inputs.block_table[b, : -(-end // bs)]
            for position in range(end):
                slot = inputs.block_table[b, position // bs] * bs + position % bs
                assert self.kv[slot] == self.fingerprint(truth[: position + 1]), (row.request.request_id, position)
        sampled = np.zeros(bucket.num_seqs, dtype=np.int32)
        for b, row in enumerate(batch.rows):
            assert row.generation_index == row.start + row.num_tokens - row.request.num_prompt_tokens or not row.samples
            sampled[b] = true_token(row.request, row.generation_index)
        return sampled


def steps_of(scheduler: Scheduler) -> StepConfig:
    """The step configuration of an engine with the scheduler's limits (every variant compiled)."""
    config = scheduler.config
    return StepConfig.from_config(dataclasses.replace(config, compile=CompileConfig(penalty_variants=True)), 10**6)


def drive(scheduler: Scheduler, overlap: bool, aborts: dict[int, str], max_steps: int = 2000):
    """The engine loop (optionally overlapped: step N+1 scheduled before step N's update) over a fake device."""
    device = FakeDevice(scheduler, steps_of(scheduler))
    config = scheduler.config
    in_flight = None  # (batch, sampled) awaiting update
    for step_index in range(max_steps):
        if step_index in aborts:
            scheduler.abort(aborts[step_index])
        if not scheduler.has_unfinished() and in_flight is None:
            return
        batch = scheduler.schedule()
        assert batch.num_seqs <= config.max_batch_size and batch.num_tokens <= config.max_num_tokens
        assert all(row.is_prefill for row in batch.rows[: batch.num_prefill_rows])
        assert not any(row.is_prefill for row in batch.rows[batch.num_prefill_rows :])
        result = None
        if not batch.is_empty:
            previous = in_flight[0] if in_flight else None
            previous_sampled = in_flight[1] if in_flight else None
            result = (batch, device.run(batch, previous, previous_sampled))
        if not overlap and result is not None:
            scheduler.update(*result)
            result = None
        if in_flight is not None:
            scheduler.update(*in_flight)
        assert not batch.is_empty or in_flight is not None or not scheduler.has_unfinished(), "no progress"
        in_flight = result
    raise AssertionError("workload did not finish")


def check_outputs(request: Request, max_seq_len: int):
    """Outputs are exactly the fake model's tokens, and the request stopped for the right reason."""
    if request.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
        return
    outputs = request.output_token_ids
    assert outputs == [true_token(request, k) for k in range(len(outputs))]
    params = request.sampling_params
    stops = [k for k, t in enumerate(outputs) if k + 1 >= params.min_tokens and t in params.stop_token_ids]
    limit = request.max_total_tokens(max_seq_len) - request.num_prompt_tokens
    if request.finish_reason is FinishReason.STOP:
        assert stops == [len(outputs) - 1]
    else:
        assert request.finish_reason is FinishReason.LENGTH and not stops and len(outputs) == limit


request_strategy = st.fixed_dictionaries(
    {
        "prefix": st.integers(0, 2),
        "suffix": st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=8),
        "max_tokens": st.integers(0, 12).map(lambda m: m or None),  # None: up to max_seq_len
        "min_tokens": st.integers(0, 3),
        "n": st.integers(1, 2),
        "stop_token_ids": st.lists(st.integers(1, VOCAB - 1), max_size=1),
    }
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([2, 4]),
    pool_scale=st.floats(0.8, 3.0),
    max_batch_size=st.integers(1, 5),
    max_num_tokens=st.one_of(st.integers(1, 4), st.integers(8, 24)),
    max_seq_len=st.integers(12, 40),
    policy=st.sampled_from([GUARANTEED, MAX_UTIL]),
    chunked=st.sampled_from([True, True, False]),
    prefix_caching=st.booleans(),
    overlap=st.booleans(),
    prefixes=st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=10), min_size=3, max_size=3),
    specs=st.lists(request_strategy, min_size=1, max_size=12),
    aborts=st.dictionaries(st.integers(0, 30), st.integers(0, 9), max_size=2),
)
def test_random_workloads_finish_without_leaks(
    block_size,
    pool_scale,
    max_batch_size,
    max_num_tokens,
    max_seq_len,
    policy,
    chunked,
    prefix_caching,
    overlap,
    prefixes,
    specs,
    aborts,
):
    # The pool is a multiple of the longest request's lifetime: below 1 some requests can never fit,
    # a little above 1 the requests compete for blocks (preemptions, admission waits).
    prompts = [prefixes[spec["prefix"]] + spec["suffix"] for spec in specs]
    longest = max(
        min(len(p) + (spec["max_tokens"] or max_seq_len), max_seq_len) for p, spec in zip(prompts, specs, strict=True)
    )
    scheduler = make_scheduler(
        num_blocks=1 + max(1, int(pool_scale * longest) // block_size),
        block_size=block_size,
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len,
        policy=policy,
        chunked=chunked,
        prefix_caching=prefix_caching,
    )
    requests = []
    for i, (prompt, spec) in enumerate(zip(prompts, specs, strict=True)):
        min_tokens = min(spec["min_tokens"], spec["max_tokens"] or spec["min_tokens"])
        requests += add(
            scheduler,
            f"r{i}",
            prompt,
            max_tokens=spec["max_tokens"],
            min_tokens=min_tokens,
            n=spec["n"],
            stop_token_ids=spec["stop_token_ids"],
            ignore_eos=True,
        )
    drive(scheduler, overlap, {step: f"r{i}" for step, i in aborts.items()})

    manager = scheduler.block_manager
    assert all(r.is_finished for r in requests)
    for request in requests:
        assert request.block_ids == array("i")
        assert (request.finish_reason is FinishReason.ERROR) == (scheduler.rejection_reason(request) is not None)
        check_outputs(request, max_seq_len)
    assert manager.num_free_blocks == manager.num_usable_blocks  # never-used + cached-reusable == total - 1
    assert all(manager.ref_count(block) == 0 for block in range(manager.num_blocks))
    if policy is GUARANTEED:
        assert scheduler.num_preemptions == 0
    # Shown by --hypothesis-show-statistics: how often the interesting paths ran.
    if policy is MAX_UTIL:
        event(f"max-utilization preempted: {scheduler.num_preemptions > 0}")
    event(f"prefix hit: {manager.stats.hit_tokens > 0}")
    event(f"all rejected: {all(r.finish_reason is FinishReason.ERROR for r in requests)}")
    event(f"forked: {any(r.parent is not None and r.num_cached_tokens > 0 for r in requests)}")


def test_a_prompt_sharing_a_prefix_being_computed_waits_for_it_and_then_reuses_it():
    scheduler = make_scheduler(block_size=4, max_num_tokens=32)
    context = [3, 4, 5, 6, 7, 8, 9, 10, 3]  # two full blocks and one token
    [first] = add(scheduler, "a", context + [1, 2], max_tokens=1)
    [second] = add(scheduler, "b", context + [2, 1, 5], max_tokens=1)
    [other] = add(scheduler, "c", [5, 5, 5, 5, 5], max_tokens=1)

    batch = scheduler.schedule()  # the request behind the waiting one is admitted
    assert [row.request for row in batch.rows] == [first, other]
    scheduler.update(batch, np.ones(len(batch.rows), np.int32))
    batch = step(scheduler)

    [row] = [row for row in batch.rows if row.request is second]
    assert row.start == 8 and second.num_cached_tokens == 8
    run_to_completion(scheduler)
    assert scheduler.block_manager.stats.hit_tokens == 8
