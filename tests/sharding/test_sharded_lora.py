"""LoRA adapters under tensor parallelism: an engine on a tp=2 CPU mesh (each adapter table split as the weight it
sits beside: wqkv's B over kv heads, wo's A over heads, gate/up's B and down's A over the MLP hidden) gives the
single-device engine's greedy tokens for base rows and two adapters' rows in one batch, and the adapters move the
tokens.

jax fixes its device count when it starts, so the check runs in a fresh process with two host devices.
"""

from __future__ import annotations

import textwrap

CHECK = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    import transformers
    from jaxserve import LLM, CompileConfig, KvCacheConfig, LoRARequest, SamplingParams
    from jaxserve.bench import TokenIdTokenizer
    from jaxserve.models import lora, registry
    from jaxserve.models.loader import LoadedModel

    assert jax.device_count() == 2, jax.devices()
    hf = transformers.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    hf.architectures = ["LlamaForCausalLM"]
    family, cfg = registry.resolve(hf.to_dict())
    model = LoadedModel(family, cfg, family.init_weights(cfg, jax.random.key(0), jnp.float32), hf.to_dict(), None, "t")

    def adapter(seed, rank, modules):
        rng = np.random.default_rng(seed)
        tensors = {}
        for (layer, module), site in lora.module_sites(family.serving_specs(cfg)).items():
            if module in modules:
                parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
                inputs = int(np.prod(site.in_shape))
                tensors[name + ".lora_A.weight"] = rng.standard_normal((rank, inputs), np.float32) * inputs**-0.5
                tensors[name + ".lora_B.weight"] = rng.standard_normal((site.out_width, rank), np.float32) * 0.5
        return tensors, {"r": rank, "lora_alpha": rank}

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 160, int(n)).tolist() for n in (5, 30, 23, 12, 40, 9)]
    adapters = [None, LoRARequest("all", 1), LoRARequest("qko", 2)] * 2
    tokens, shards = {}, {}
    for tp in (1, 2):
        llm = LLM(model, tokenizer=TokenIdTokenizer(), tensor_parallel_size=tp, max_batch_size=4, max_seq_len=80,
                  max_num_tokens=32, kv_cache_config=KvCacheConfig(max_tokens=256),
                  compile_config=CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
                  attention_backend="xla", enable_lora=True, max_loras=2, max_lora_rank=8, show_progress=False)
        llm.load_lora("all", *adapter(1, 8, lora.MODULES))
        llm.load_lora("qko", *adapter(2, 4, ("q_proj", "k_proj", "o_proj")))
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = llm.generate(prompts, greedy, use_tqdm=False, lora_request=adapters)
        tokens[tp] = [o.outputs[0].token_ids for o in out]
        tables = llm.engine.runner.weights.lora[0]
        shape = lambda x: list(x.sharding.shard_shape(x.shape))
        shards[tp] = [shape(tables["wqkv"].b), shape(tables["wo"].a)]
        shards[tp] += [shape(tables["w_gate_up"].b), shape(tables["w_down"].a)]
        llm.close()
    print(json.dumps({"tokens": tokens, "shards": shards}))
    """
)


def test_lora_engine_on_a_tp2_mesh_gives_one_devices_tokens(run_with_host_devices):
    result = run_with_host_devices(CHECK, num_devices=2)
    one, two = result["tokens"]["1"], result["tokens"]["2"]
    assert one == two
    assert one[1] != one[0] or one[2] != one[0], "the adapters were meant to move the tokens"
    # 3 slots; wqkv's b [S, 3R, K, G+2, Dh] over its 4 kv heads, wo's a [S, H, Dh, R] over its 8 heads, gate/up's b
    # [S, 2R, 2, F] and down's a [S, F, R] over the MLP hidden.
    assert result["shards"]["2"] == [[3, 24, 2, 4, 8], [3, 4, 8, 8], [3, 16, 2, 64], [3, 64, 8]]
    assert result["shards"]["1"] == [[3, 24, 4, 4, 8], [3, 8, 8, 8], [3, 16, 2, 128], [3, 128, 8]]
