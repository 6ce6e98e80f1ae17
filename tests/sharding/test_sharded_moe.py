"""Mixture-of-experts models on tp=2 and tp=4 CPU meshes, with tensor-parallel experts (the default rules table:
each expert's hidden split over the model axis) and with expert parallelism (EXPERT_PARALLEL_RULES: whole experts
split over it), the dense forward partitioned by XLA, give the single-device logits. Qwen2-MoE (dense and expert
layers, a shared expert, 8 experts) on 2 devices and Mixtral (4 experts: one a device, a window of 8) on 4. The
paged pallas backend too, its grouped GEMM kernels per device under shard_map as each table splits the experts (a
prefill step against one device's xla backend).

jax fixes its device count when it starts, so the check runs in a fresh process with four host devices.
"""

from __future__ import annotations

import textwrap

import pytest

# The meshes, each under both rules tables, for the XLA-partitioned forward and the paged pallas backend (each
# interpret-compiled: a few seconds on a 2-core CPU): Qwen2-MoE's 8 experts on 2 devices, Mixtral's 4 on 4 (one
# expert a device under expert parallelism). Each family on one mesh size: both sizes and both families covered.
MESHES = (("qwen2_moe", 2), ("mixtral", 4))
CHECK = f"MESHES = {MESHES!r}\n" + textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    import transformers
    from jaxserve.models import registry
    from jaxserve.models.attention import (
        DenseAttentionMetadata, PagedAttentionMetadata, init_dense_cache, init_paged_cache, paged_cache_specs)
    from jaxserve.sharding.mesh import make_mesh
    from jaxserve.sharding.rules import EXPERT_PARALLEL_RULES, LOGICAL_AXIS_RULES, named_shardings

    CONFIGS = {
        "qwen2_moe": (transformers.Qwen2MoeConfig, dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64, mlp_only_layers=[1])),
        "mixtral": (transformers.MixtralConfig, dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8)),
    }
    RULES = {"tensor_parallel": LOGICAL_AXIS_RULES, "expert_parallel": EXPERT_PARALLEL_RULES}
    assert jax.device_count() == 4, jax.devices()
    results, models = {}, {}
    for name, (config_class, extra) in CONFIGS.items():
        hf = config_class(vocab_size=160, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                          num_key_value_heads=4, max_position_embeddings=256, **extra)
        hf.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
        family, cfg = registry.resolve(hf.to_dict())
        checkpoint = family.init_weights(cfg, jax.random.key(0), jnp.float32)
        models[name] = (family, cfg, checkpoint)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 160, size=24), jnp.int32)
        positions = jnp.arange(24, dtype=jnp.int32)
        meta = DenseAttentionMetadata(seq_ids=jnp.zeros(24, jnp.int32))

        def logits_of(weights, cache):
            hidden, _ = family.forward(weights, tokens, positions, cache, meta, cfg)
            return family.compute_logits(weights, hidden, cfg)

        cache = init_dense_cache(cfg, 1, 32, jnp.float32)
        single = jax.jit(logits_of)(family.to_serving(checkpoint, cfg), cache)
        expert_layer = cfg.moe_layers[0]
        for tp in [tp for mesh_name, tp in MESHES if mesh_name == name]:
            mesh = make_mesh(tp=tp)
            for rules_name, rules in RULES.items():
                shardings = named_shardings(family.serving_specs(cfg), mesh, rules)
                weights = family.to_serving(checkpoint, cfg, shardings)
                sharded = jax.jit(logits_of)(weights, cache)
                experts = weights.layers[expert_layer].mlp
                results[f"{name} tp={tp} {rules_name}"] = dict(
                    err=float(jnp.max(jnp.abs(sharded - single)) / jnp.max(jnp.abs(single))),
                    gate_up=[str(a) for a in experts.w_gate_up.sharding.spec],
                    down=[str(a) for a in experts.w_down.sharding.spec],
                    shard=list(experts.w_gate_up.addressable_shards[0].data.shape),
                    full=list(experts.w_gate_up.shape),
                )

    # The paged pallas backend (kernels in interpret mode, per device under shard_map): a prefill step of two
    # sequences (58 routed rows) on each mesh and rules table against one device's xla backend. A decode step
    # takes the same path through the experts (tests/models/test_backends.py runs one on a device).
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    steps = [
        dict(positions=[*range(20), *range(9)], slots=[*range(16, 36), *range(48, 57)], kv_lens=[20, 9],
             cu=[0, 20, 29], max_q_len=None),
    ]

    def paged_logits(family, cfg, weights, backend, mesh, rules):
        cache = init_paged_cache(cfg, 8, 16, jnp.float32)
        if mesh is not None:
            cache = jax.device_put(cache, named_shardings(paged_cache_specs(cfg, 8, 16), mesh))
        token_ids = np.random.default_rng(1).integers(0, 160, 31)
        logits, start, jaxprs = [], 0, []
        for s in steps:
            meta = PagedAttentionMetadata(
                slot_mapping=i32(s["slots"]), block_table=i32([[1, 2], [3, 0]]), kv_lens=i32(s["kv_lens"]),
                cu_q_lens=i32(s["cu"]), num_seqs=i32(2), backend=backend, max_q_len=s["max_q_len"], mesh=mesh,
                interpret=backend == "pallas")

            @jax.jit
            def step(weights, cache, tokens, positions):
                hidden, cache = family.forward(weights, tokens, positions, cache, meta, cfg, rules=rules)
                return family.compute_logits(weights, hidden, cfg), cache

            count = len(s["positions"])
            args = (weights, cache, i32(token_ids[start : start + count]), i32(s["positions"]))
            traced = step.trace(*args)
            jaxprs.append(str(traced.jaxpr))
            out, cache = traced.lower().compile()(*args)
            logits.append(np.asarray(out))
            start += count
        return logits, jaxprs

    for name, tp in MESHES:
        family, cfg, checkpoint = models[name]
        single, _ = paged_logits(family, cfg, family.to_serving(checkpoint, cfg), "xla", None, None)
        mesh = make_mesh(tp=tp)
        for rules_name, rules in RULES.items():
            weights = family.to_serving(checkpoint, cfg, named_shardings(family.serving_specs(cfg), mesh, rules))
            sharded, jaxprs = paged_logits(family, cfg, weights, "pallas", mesh, rules)
            results[f"{name} tp={tp} {rules_name} pallas"] = dict(
                errors=[float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(sharded, single)],
                kernels=[text.count("name=moe_gate_up") + text.count("name=moe_matmul") for text in jaxprs],
                shard_maps=[text.count("shard_map") for text in jaxprs],
            )

    # FP8 weights (quantization="fp8": the linears' FP8 products and the expert stacks in e4m3 with their scales,
    # which the kernels read as FP8 tiles and the xla backend dequantizes): the kernels on one device and on
    # Qwen2-MoE's tp=2 mesh under each table against one device's xla backend on the same FP8 weights.
    family, cfg, checkpoint = models["qwen2_moe"]
    errors = lambda got, want: [float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(got, want)]
    plain, _ = paged_logits(family, cfg, family.to_serving(checkpoint, cfg), "xla", None, None)
    fp8 = family.to_serving(checkpoint, cfg, quantization="fp8")
    single, _ = paged_logits(family, cfg, fp8, "xla", None, None)
    one_device, _ = paged_logits(family, cfg, fp8, "pallas", None, None)
    results["fp8 plain"] = dict(errors=errors(single, plain))
    results["fp8 one device pallas"] = dict(errors=errors(one_device, single))
    mesh = make_mesh(tp=2)
    for rules_name, rules in RULES.items():
        shardings = named_shardings(family.serving_specs(cfg, quantization="fp8"), mesh, rules)
        weights = family.to_serving(checkpoint, cfg, shardings, quantization="fp8")
        sharded, _ = paged_logits(family, cfg, weights, "pallas", mesh, rules)
        experts = weights.layers[cfg.moe_layers[0]].mlp.w_gate_up
        results[f"fp8 tp=2 {rules_name} pallas"] = dict(
            errors=errors(sharded, single), dtype=str(experts.values.dtype),
            values=[str(a) for a in experts.values.sharding.spec], scale=[str(a) for a in experts.scale.sharding.spec],
        )
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def sharded_results(run_with_host_devices) -> dict:
    return run_with_host_devices(CHECK, num_devices=4)


@pytest.mark.parametrize(("family", "tp"), MESHES)
@pytest.mark.parametrize("rules", ["tensor_parallel", "expert_parallel"])
def test_sharded_moe_logits_equal_single_device(sharded_results: dict, family: str, tp: int, rules: str) -> None:
    result = sharded_results[f"{family} tp={tp} {rules}"]
    num_experts, _, _, width = result["full"]
    if rules == "tensor_parallel":  # every expert on every device, its hidden split
        assert result["gate_up"] == ["None", "None", "None", "model"] and result["down"] == ["None", "model", "None"]
        assert result["shard"] == [num_experts, 64, 2, width // tp]
    else:  # E / tp whole experts a device
        assert result["gate_up"] == ["model", "None", "None", "None"] and result["down"] == ["model", "None", "None"]
        assert result["shard"] == [num_experts // tp, 64, 2, width]
    assert result["err"] < 1e-5, result


@pytest.mark.parametrize(("family", "tp"), MESHES)
@pytest.mark.parametrize("rules", ["tensor_parallel", "expert_parallel"])
def test_sharded_pallas_moe_logits_equal_single_device(sharded_results: dict, family: str, tp: int, rules: str) -> None:
    """The grouped GEMM kernels per device (each device's F slice of every expert, or its E / tp whole experts
    over its run of the sorted rows), then the psum: a prefill step's logits are one device's."""
    result = sharded_results[f"{family} tp={tp} {rules} pallas"]
    assert max(result["errors"]) < 1e-5, result
    # Both grouped GEMMs traced once per step (the expert layers share decoder_layer's trace), inside a shard_map.
    assert result["kernels"] == [2] and min(result["shard_maps"]) > 0, result


@pytest.mark.parametrize("rules", ["tensor_parallel", "expert_parallel"])
def test_fp8_experts_through_the_kernels_equal_the_dequantized_stacks(sharded_results: dict, rules: str) -> None:
    """FP8 expert stacks read by the grouped GEMMs (one device, and per device on a tp=2 mesh with each table's
    split of values and scales) give the xla backend's logits on the same FP8 weights; FP8 is not the plain model."""
    assert min(sharded_results["fp8 plain"]["errors"]) > 1e-3, "the FP8 weights were meant to change the logits"
    assert max(sharded_results["fp8 one device pallas"]["errors"]) < 1e-5, sharded_results["fp8 one device pallas"]
    result = sharded_results[f"fp8 tp=2 {rules} pallas"]
    assert max(result["errors"]) < 1e-5, result
    assert result["dtype"] == "float8_e4m3fn"
    if rules == "tensor_parallel":  # the scale [E, 2, F] split with its F columns
        assert result["values"] == ["None", "None", "None", "model"] and result["scale"] == ["None", "None", "model"]
    else:
        assert result["values"] == ["model", "None", "None", "None"] and result["scale"] == ["model", "None", "None"]
