"""Tensor parallelism with the Pallas kernels: under a tp mesh each device runs write_kv and the ragged
attention on its share of the heads (shard_map). A prefill step and a decode step of a sharded model,
kernels in interpret mode, give the single-device xla backend's logits (Llama, and Gemma 2 with its window
and soft-caps); the step lowers for CUDA with
the Triton calls inside the shard_map; heads that do not divide by tp are refused with a clear error.

jax fixes its device count when it starts, so the check runs in a fresh process with four host devices.
"""

from __future__ import annotations

import textwrap

import pytest

CHECK = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    import transformers
    from jaxserve.runner import Runner
    from jaxserve.step import RunnerSpec
    from jaxserve.models import registry
    from jaxserve.models.attention import PagedAttentionMetadata, init_paged_cache, paged_cache_specs
    from jaxserve.sharding.mesh import make_mesh
    from jaxserve.sharding.rules import named_shardings

    assert jax.device_count() == 4, jax.devices()

    def model(num_heads, num_kv_heads, config_class=transformers.LlamaConfig, **extra):
        hf = config_class(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                          max_position_embeddings=256, **extra)
        hf.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
        return registry.resolve(hf.to_dict())
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    rng = np.random.default_rng(0)
    # Step 1: prompts of 20 (blocks 1, 2) and 9 tokens (block 3). Step 2: one decode token each.
    steps = [
        dict(tokens=rng.integers(0, 160, 29), positions=[*range(20), *range(9)],
             slots=[*range(16, 36), *range(48, 57)], kv_lens=[20, 9], cu=[0, 20, 29], max_q_len=None),
        dict(tokens=rng.integers(0, 160, 2), positions=[20, 9], slots=[36, 57], kv_lens=[21, 10], cu=[0, 1, 2],
             max_q_len=1),
    ]

    def run(family, cfg, weights, backend, mesh, interpret):
        w, cache = family.to_serving(weights, cfg), init_paged_cache(cfg, 8, 16, jnp.float32)
        if mesh is not None:
            w = family.to_serving(weights, cfg, named_shardings(family.serving_specs(cfg), mesh))
            cache = jax.device_put(cache, named_shardings(paged_cache_specs(cfg, 8, 16), mesh))
        logits = []
        for s in steps:
            meta = PagedAttentionMetadata(
                slot_mapping=i32(s["slots"]), block_table=i32([[1, 2], [3, 0]]), kv_lens=i32(s["kv_lens"]),
                cu_q_lens=i32(s["cu"]), num_seqs=i32(2), backend=backend, max_q_len=s["max_q_len"],
                mesh=mesh, interpret=interpret)

            @jax.jit
            def step(w, cache, tokens, positions):
                hidden, cache = family.forward(w, tokens, positions, cache, meta, cfg)
                return family.compute_logits(w, hidden, cfg), cache

            out, cache = step(w, cache, i32(s["tokens"]), i32(s["positions"]))
            logits.append(np.asarray(out))
        return logits

    results = {}
    # Gemma 2: a sliding layer (window 8, shorter than the prompt) and a full one, soft-capped logits.
    gemma2 = dict(config_class=transformers.Gemma2Config, head_dim=16, sliding_window=8, attn_logit_softcapping=1.0,
                  query_pre_attn_scalar=16)
    for name, extra in (("llama", {}), ("gemma2", gemma2)):
        family, cfg = model(8, 4, **extra)
        weights = family.init_weights(cfg, jax.random.key(0), jnp.float32)
        reference = run(family, cfg, weights, "xla", None, False)
        for tp in (2, 4):
            sharded = run(family, cfg, weights, "pallas", make_mesh(tp=tp), True)
            errors = [float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(sharded, reference)]
            results[f"{name}_tp{tp}"] = errors
    family, cfg = model(8, 4)

    # The same step lowered for CUDA (no GPU needed): the Triton kernels sit inside the shard_map body.
    # jax >= 0.11 lowers them only for a GPU the context mesh names: the mesh's axes on abstract H200s,
    # which the shard_map gets too (it must match the context mesh).
    mesh = make_mesh(tp=4)
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    gpu_mesh = mesh.abstract_mesh.update(abstract_device=h200)
    meta = PagedAttentionMetadata(
        slot_mapping=i32([36, 57]), block_table=i32([[1, 2], [3, 0]]), kv_lens=i32([21, 10]), cu_q_lens=i32([0, 1, 2]),
        num_seqs=i32(2), backend="pallas", max_q_len=1, mesh=gpu_mesh)
    w = family.to_serving(
        family.init_weights(cfg, jax.random.key(0), jnp.bfloat16), cfg, named_shardings(family.serving_specs(cfg), mesh)
    )
    cache_shardings = named_shardings(paged_cache_specs(cfg, 8, 16), mesh)
    cache = jax.device_put(init_paged_cache(cfg, 8, 16, jnp.bfloat16), cache_shardings)
    step = lambda w, cache, t, p: family.forward(w, t, p, cache, meta, cfg)
    with jax.sharding.use_abstract_mesh(gpu_mesh):
        lowered = jax.jit(step).trace(w, cache, i32([1, 2]), i32([20, 9])).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    results["cuda"] = dict(triton=text.count("xla.gpu.triton"), manual=text.count("manual"))

    family3, cfg3 = model(4, 2)
    spec = RunnerSpec(family3, cfg3, None, jnp.float32, "pallas", 0)
    try:
        Runner(spec, family3.init_weights(cfg3, jax.random.key(0), jnp.float32), make_mesh(tp=4))
        results["error"] = None
    except ValueError as e:
        results["error"] = str(e)
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def results(run_with_host_devices) -> dict:
    return run_with_host_devices(CHECK, num_devices=4)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_pallas_under_tensor_parallelism_matches_single_device(results: dict, family: str, tp: int):
    prefill_err, decode_err = results[f"{family}_tp{tp}"]
    assert prefill_err < 1e-4 and decode_err < 1e-4, results


def test_sharded_kernels_lower_for_cuda(results: dict):
    """write_kv and the decode launch, lowered for CUDA inside the shard_map (manual) region."""
    assert results["cuda"]["triton"] >= 2 and results["cuda"]["manual"] > 0, results["cuda"]


def test_heads_not_divisible_by_tp_are_refused(results: dict):
    assert results["error"] is not None and "num_kv_heads (2)" in results["error"] and "tp=4" in results["error"]
