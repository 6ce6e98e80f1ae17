"""The compiled forward updates the KV pool in place: XLA aliases the whole donated pool to the output pool,
and the step's temporary memory does not grow with the pool (a step that copied the pool would need a
pool-sized temporary: an 8B model's pool is tens of GiB). The check behind the former
benchmarks/step_memory.py, on a tiny model; test_engine.py's test_no_compiled_forward_copies_the_kv_pool
checks the compiled HLO for pool-shaped copies."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from jaxserve.buckets import Bucket
from jaxserve.config import CompileConfig, EngineConfig
from jaxserve.models.common import ParamSpec
from jaxserve.runner import Runner, RunnerSpec  # RunnerSpec: re-exported by runner before and after its split
from jaxserve.step_table import cache_specs
from jaxserve.variants import StepConfig

SMALL_POOL, LARGE_POOL = 512, 4096  # blocks: 4 MiB and 32 MiB of float32 K + V for the tiny Llama


@pytest.fixture(scope="module")
def runner(tiny_model) -> Runner:
    model = tiny_model("llama")
    config = EngineConfig(
        max_batch_size=4,
        max_num_tokens=32,
        max_seq_len=64,
        compile=CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
    )
    steps = StepConfig.from_config(config, model.config.vocab_size)
    return Runner(RunnerSpec(model.family, model.config, steps, jnp.float32, "xla", num_top_logprobs=20), model.weights)


def _pool_bytes(runner: Runner, num_blocks: int) -> int:
    specs = jax.tree.leaves(cache_specs(runner.spec, num_blocks), is_leaf=lambda x: isinstance(x, ParamSpec))
    return sum(math.prod(spec.shape) * jnp.dtype(jnp.float32).itemsize for spec in specs)


@pytest.mark.parametrize("bucket", [Bucket(4, 4, decode_only=True), Bucket(32, 4)], ids=["decode", "mixed"])
def test_forward_updates_the_pool_in_place(runner: Runner, bucket: Bucket) -> None:
    small = runner.table.compile_forward(bucket, False, SMALL_POOL).memory_analysis()
    large = runner.table.compile_forward(bucket, False, LARGE_POOL).memory_analysis()
    for analysis, num_blocks in ((small, SMALL_POOL), (large, LARGE_POOL)):
        assert analysis.alias_size_in_bytes >= _pool_bytes(runner, num_blocks), "the pool is not donated in full"
    # Eight times the pool, the same temporaries: nothing of the pool's size is staged.
    assert large.temp_size_in_bytes == small.temp_size_in_bytes
    assert large.temp_size_in_bytes < _pool_bytes(runner, LARGE_POOL) // 16
