"""Tensor parallelism: weights placed on a tp=4 CPU mesh through the rules table, the dense forward
partitioned by XLA, gives the single-device logits for every family.

jax fixes its device count when it starts, so the check runs in a fresh process with four host
devices (XLA_FLAGS=--xla_force_host_platform_device_count=4).
"""

from __future__ import annotations

import textwrap

import pytest

CHECK = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    import transformers
    from jaxserve.models import registry
    from jaxserve.models.attention import DenseAttentionMetadata, init_dense_cache
    from jaxserve.sharding.mesh import make_mesh
    from jaxserve.sharding.rules import named_shardings

    CONFIGS = {
        "llama": (transformers.LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=4,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64))),
        "mistral": (transformers.MistralConfig, dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8)),
        "qwen2": (transformers.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=1)),
        "qwen3": (transformers.Qwen3Config, dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16)),
        "gemma2": (transformers.Gemma2Config, dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                   sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
        "gemma3": (transformers.Gemma3TextConfig, dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                   sliding_window=8, sliding_window_pattern=2)),
    }
    ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM"}
    assert jax.device_count() == 4, jax.devices()
    mesh = make_mesh(tp=4)
    results = {}
    for name, (config_class, extra) in CONFIGS.items():
        hf = config_class(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          max_position_embeddings=256, **extra)
        hf.architectures = [ARCHITECTURES.get(name, config_class.__name__.replace("Config", "ForCausalLM"))]
        family, cfg = registry.resolve(hf.to_dict())
        checkpoint = family.init_weights(cfg, jax.random.key(0), jnp.float32)
        weights = family.to_serving(checkpoint, cfg)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 160, size=24), jnp.int32)
        positions = jnp.arange(24, dtype=jnp.int32)
        meta = DenseAttentionMetadata(seq_ids=jnp.zeros(24, jnp.int32))

        def logits_of(weights, cache):
            hidden, _ = family.forward(weights, tokens, positions, cache, meta, cfg)
            return family.compute_logits(weights, hidden, cfg)

        cache = init_dense_cache(cfg, 1, 32, jnp.float32)
        single = jax.jit(logits_of)(weights, cache)
        shardings = named_shardings(family.serving_specs(cfg), mesh)
        sharded_weights = family.to_serving(checkpoint, cfg, shardings)
        split = [s.spec for s in jax.tree_util.tree_leaves(shardings)]
        sharded = jax.jit(logits_of)(sharded_weights, cache)
        assert len(sharded_weights.layers[0].wqkv.sharding.device_set) == 4
        err = float(jnp.max(jnp.abs(sharded - single)) / jnp.max(jnp.abs(single)))
        results[name] = dict(err=err, num_split=sum(any(a is not None for a in s) for s in split))
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def sharded_results(run_with_host_devices) -> dict:
    return run_with_host_devices(CHECK, num_devices=4)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_tp4_logits_equal_single_device(sharded_results: dict, family: str):
    result = sharded_results[family]
    assert result["num_split"] > 0, "no weight was split over the model axis"
    assert result["err"] < 1e-5, result
