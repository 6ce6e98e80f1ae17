"""The KV pool is split by the rules table like every weight: over kv heads when tp divides them, replicated
(and logged) when it does not; capacity's bytes per token are one device's shard of that same declaration.

Checked on tp=2 and tp=4 meshes of host devices, in a fresh process (jax fixes its device count at start).
"""

from __future__ import annotations

import textwrap

import pytest

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

CHECK = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp
    import transformers
    from jaxserve import capacity
    from jaxserve.config import CompileConfig, EngineConfig
    from jaxserve.variants import StepConfig
    from jaxserve.runner import Runner
    from jaxserve.step import RunnerSpec
    from jaxserve.step_table import cache_specs
    from jaxserve.models import registry
    from jaxserve.sharding.mesh import make_mesh
    from jaxserve.sharding.rules import partition_spec

    results = []
    for num_kv_heads in (4, 2, 3):
        hf = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=12, num_key_value_heads=num_kv_heads, head_dim=8,
                                      max_position_embeddings=64)
        hf.architectures = ["LlamaForCausalLM"]
        family, cfg = registry.resolve(hf.to_dict())
        weights = family.init_weights(cfg, jax.random.key(0), jnp.float32)
        buckets = CompileConfig(decode_batch_sizes=(2,), token_buckets=(2,), penalty_variants=False)
        config = EngineConfig(max_batch_size=2, max_num_tokens=2, max_seq_len=32, compile=buckets)
        steps = StepConfig.from_config(config, cfg.vocab_size)
        for tp in (2, 4):
            runner = Runner(RunnerSpec(family, cfg, steps, jnp.float32, "xla", 0), weights, make_mesh(tp=tp))
            profile = runner.profile()
            runner.start(num_blocks=6, show_progress=False, lazy=True)  # the pool only: no step is compiled
            k = runner.kv_cache.k
            shard = k.addressable_shards[0].data
            results.append(dict(
                kv_heads=num_kv_heads, tp=tp, spec=str(k.sharding.spec),
                rules=str(partition_spec(cache_specs(runner.spec, 6).k, runner.mesh)),
                shard_kv_heads=shard.shape[3],
                per_token=profile.kv_bytes_per_token,
                shard_per_token=2 * shard.nbytes // (shard.shape[1] * shard.shape[2]),
            ))
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def results(run_with_host_devices) -> list[dict]:
    return run_with_host_devices(CHECK, num_devices=4)


@pytest.mark.parametrize(
    ("kv_heads", "tp", "per_device"),
    [(4, 2, 2), (4, 4, 1), (2, 2, 1), (2, 4, 2), (3, 2, 3), (3, 4, 3)],
    ids=["4-over-2", "4-over-4", "2-over-2", "2-over-4-replicated", "3-over-2-replicated", "3-over-4-replicated"],
)
def test_the_pool_follows_the_rules_table_and_capacity_counts_one_shard(results, kv_heads, tp, per_device):
    [case] = [r for r in results if (r["kv_heads"], r["tp"]) == (kv_heads, tp)]
    assert case["spec"] == case["rules"], case
    assert case["shard_kv_heads"] == per_device, case
    assert case["per_token"] == case["shard_per_token"] == 2 * 2 * per_device * 8 * 4, case  # 2 x L x K x Dh x f32
