"""Bucket-aware admission: the cap `admission_cap` picks from decode steps' costs, how the scheduler applies
it (only when the KV pool is what limits the batch), and the runner's measurement of those costs."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.block_manager import BlockManager
from jaxserve.config import CapacityPolicy, CompileConfig, EngineConfig, KvCacheConfig, SchedulerConfig
from jaxserve.request import make_requests
from jaxserve.sampling import SamplingParams
from jaxserve.scheduler import ADMISSION_CAP_GAIN, Scheduler, admission_cap, drain_cost

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

# Decode-step costs on padding (ms), as measured at an H200 warmup for the 8B shape: weight-bound to ~128 rows.
COSTS = {1: 4.15, 32: 4.41, 128: 5.10, 192: 6.00, 256: 6.63, 384: 9.27, 512: 11.44, 640: 13.67, 1024: 22.12}


def test_drain_cost_pads_every_batch_and_the_last_one():
    assert drain_cost(512, 401, COSTS) == pytest.approx(11.44 + 5.10)  # 401 -> 512, the 111 left -> 128
    assert drain_cost(512, 256, COSTS) == pytest.approx(2 * 6.63)
    assert drain_cost(800, 384, COSTS) == pytest.approx(2 * 9.27 + 4.41)  # 32 left
    assert drain_cost(100, 128, COSTS) == pytest.approx(5.10)


@pytest.mark.parametrize(
    ("fit", "queued", "expected"),
    [
        (401, 512, 256),  # 401 + 111 rows (11.44 + 5.10 ms a step) against 256 + 256 (13.26): capped
        (368, 512, 256),  # 384 + 192 buckets (15.27) against 13.26
        (384, 512, 256),  # a compiled size, but 384 + 128 (14.37) still costs more than 256 + 256
        (401, 5000, 384),  # a long queue: the size of most rows per second, 384 (41.4 rows/ms; 401 at 512: 35.1)
        (401, 800, None),  # 401 + 399 (22.88) against 384 + 384 + 32 (22.95): no cap
        (401, 401, None),  # the pool holds the whole queue
        (300, 200, None),
        (1100, 2000, None),  # above every decode size: the step is a mixed one, not this comparison
        (100, 1000, None),  # 10 batches of 100 (51.0) against 32 rows at a time (142)
    ],
)
def test_the_cap_is_the_size_that_serves_the_queue_soonest(fit, queued, expected):
    assert admission_cap(fit, queued, COSTS) == expected


def test_a_smaller_size_replaces_a_larger_cap_only_when_it_beats_it_by_the_gain():
    near = {256: 9.0, 384: 12.4, 512: 15.5}  # 5000 requests: 384 (161.4) beats 401 (202), 256 (180) does not
    assert admission_cap(401, 5000, near) == 384
    far = {256: 6.0, 384: 12.4, 512: 15.5}  # 256: 120, 22% under 384's 161
    assert admission_cap(401, 5000, far) == 256


def test_the_gain_gates_the_cap():
    # 5000 requests: 384 at a time 13 x 12.0 + 1.0 (8 left) = 157; 401 at a time 12 x 12.35 + 12.0 (188) = 160.2
    costs = {8: 1.0, 384: 12.0, 512: 12.35}
    assert admission_cap(401, 5000, costs) is None  # 2% less: within the gain
    assert admission_cap(401, 5000, costs, gain=0.0) == 384
    flat = {128: 5.0, 256: 5.0, 384: 5.0, 512: 5.0}  # weight-bound: the padded step costs what a full one does
    assert admission_cap(401, 512, flat) is None
    assert 0 < ADMISSION_CAP_GAIN < 0.1


def test_non_positive_costs_are_ignored():
    assert admission_cap(401, 512, {384: 0.0, 512: 11.44}) is None
    assert admission_cap(401, 5000, {256: -1.0, 384: 9.27, 512: 11.44, 1: 4.0}) == 384


# ---- the scheduler --------------------------------------------------------------------------------------

# Block size 4; a request of 4 prompt tokens and 4 new ones keeps 7 tokens of K/V: 2 blocks for its life.
# 21 blocks: 20 usable, 10 such requests at once. Decode sizes 8 and 16: 10 rows pad to 16.
CAP_COSTS = {8: 1.0, 16: 2.5}


def make_scheduler(
    *,
    costs=CAP_COSTS,
    num_blocks=21,
    policy=CapacityPolicy.GUARANTEED_NO_EVICT,
    bucket_aware=True,
    prefix_caching=False,
):
    config = EngineConfig(
        max_batch_size=16,
        max_num_tokens=64,
        max_seq_len=64,
        kv_cache=KvCacheConfig(block_size=4, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(capacity_policy=policy, bucket_aware_admission=bucket_aware),
        compile=CompileConfig(decode_batch_sizes=(8, 16)),
    )
    manager = BlockManager(num_blocks, 4, enable_prefix_caching=prefix_caching)
    return Scheduler(config, manager, clock=lambda: 0.0, decode_costs=costs)


def run_to_completion(scheduler: Scheduler, num_requests: int, prompt_len: int = 4, n: int = 1) -> list[int]:
    """Serves num_requests distinct requests of prompt_len tokens and n samples each; returns the running count
    after every step."""
    for i in range(num_requests):
        prompt = [1 + (i + j) % 9 for j in range(prompt_len)]
        for request in make_requests(str(i), prompt, SamplingParams(n=n, max_tokens=4, ignore_eos=True)):
            scheduler.add(request)
    running = []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        assert not batch.is_empty
        running.append(scheduler.num_running)
        scheduler.update(batch, np.full(batch.num_seqs, 5))
    return running


def test_a_kv_bound_queue_is_admitted_up_to_the_cheaper_size():
    running = run_to_completion(make_scheduler(), 30)
    assert max(running) == 8  # the pool holds 10, which pad to 16: 8 rows do 8 / 1.0 rows/ms against 10 / 2.5
    assert sum(running) > 0


@pytest.mark.parametrize(
    "scheduler",
    [
        pytest.param(lambda: make_scheduler(costs=None), id="no-costs"),
        pytest.param(lambda: make_scheduler(bucket_aware=False), id="switched-off"),
        pytest.param(lambda: make_scheduler(costs={8: 1.0, 16: 1.0}), id="flat-costs"),
        pytest.param(lambda: make_scheduler(policy=CapacityPolicy.MAX_UTILIZATION), id="max-utilization"),
    ],
)
def test_without_a_cheaper_size_the_pool_fills(scheduler):
    running = run_to_completion(scheduler(), 30)
    assert max(running) >= 10


def test_a_queue_the_pool_holds_whole_is_not_capped():
    assert max(run_to_completion(make_scheduler(), 10)) == 10  # nothing would be left for a later batch
    assert max(run_to_completion(make_scheduler(), 11)) == 8


def test_a_pool_that_holds_the_whole_batch_size_is_not_capped():
    running = run_to_completion(make_scheduler(num_blocks=1 + 2 * 16), 40)
    assert max(running) == 16


def run_one_prompt(scheduler: Scheduler, num_requests: int) -> list[int]:
    """Serves num_requests requests of the same 8-token prompt; returns the running count after every step."""
    for i in range(num_requests):
        scheduler.add(make_requests(str(i), [5] * 8, SamplingParams(max_tokens=4, ignore_eos=True))[0])
    running = []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        running.append(scheduler.num_running)
        scheduler.update(batch, np.full(batch.num_seqs, 5))
    return running


def test_requests_that_share_blocks_with_running_ones_are_not_capped():
    # 30 requests of one 8-token prompt (2 full blocks) and 4 new tokens: 3 blocks each for its life, 10 of them
    # in 30 usable blocks without sharing, which the cap would hold to 8. Sharing the prompt's blocks, the pool
    # holds more than 10 of them: admission is what it is without costs.
    uncapped = max(run_one_prompt(make_scheduler(num_blocks=31, prefix_caching=True, costs=None), 30))
    assert uncapped > 10
    assert max(run_one_prompt(make_scheduler(num_blocks=31, prefix_caching=True), 30)) == uncapped
    # The same through n = 4 samples of one prompt, which share its blocks with sample 0 (no prefix caching).
    uncapped = max(run_to_completion(make_scheduler(num_blocks=31, costs=None), 8, prompt_len=8, n=4))
    assert uncapped > 10
    assert max(run_to_completion(make_scheduler(num_blocks=31), 8, prompt_len=8, n=4)) == uncapped


def test_the_cap_never_preempts():
    scheduler = make_scheduler()
    run_to_completion(scheduler, 30)
    assert scheduler.num_preemptions == 0


# ---- the runner's measurement ----------------------------------------------------------------------------


def test_time_decode_steps_measures_every_decode_size_and_leaves_the_engine_serving(tiny_model, make_llm):
    config = CompileConfig(
        decode_batch_sizes=(2, 4), token_buckets=(16,), kv_len_buckets=(32,), penalty_variants=False, lazy=False
    )
    llm = make_llm(tiny_model("llama"), compile_config=config, max_num_tokens=16)
    prompts = [[3 + i % 90 for i in range(40)], [7 + i % 80 for i in range(37)]]  # full blocks: cached
    params = SamplingParams(max_tokens=6, temperature=0.0)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.engine.runner
    costs, runner.kv_cache = runner.table.time_decode_steps(
        runner.weights.step_weights, runner.kv_cache, runner.state, repeats=2
    )
    assert sorted(costs) == [2, 4] and all(cost >= 0 for cost in costs.values())
    assert llm.engine.scheduler.decode_costs is None  # measured at start on a GPU only
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before  # the padding runs wrote only the reserved block
    llm.close()
