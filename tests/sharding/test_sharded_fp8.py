"""FP8 weights, an FP8 KV cache and LoRA adapters under tensor parallelism: an engine on a tp=2 CPU mesh (each FP8
weight's values and its per-channel scales split with their output channels by the rules table, the FP8 lm_head and
its scale over the vocabulary, the FP8 pool split over kv heads, each adapter table split as the weight it sits
beside: wqkv's B over kv heads, wo's A over heads, gate/up's B and down's A over the MLP hidden) gives the
single-device engine's greedy tokens for base rows and two adapters' rows, with preemption and prefix hits in the
batch.

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
    from jaxserve.bench import TokenIdTokenizer, random_adapter_tensors
    from jaxserve.config import SchedulerConfig, CapacityPolicy
    from jaxserve.models import quant, registry
    from jaxserve.models.loader import LoadedModel

    assert jax.device_count() == 2, jax.devices()
    hf = transformers.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    hf.architectures = ["LlamaForCausalLM"]
    family, cfg = registry.resolve(hf.to_dict())
    model = LoadedModel(family, cfg, family.init_weights(cfg, jax.random.key(0), jnp.float32), hf.to_dict(), None, "t")

    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 160, 40).tolist()
    prompts = [prefix + rng.integers(0, 160, 9).tolist() for _ in range(3)]
    prompts += [rng.integers(0, 160, int(n)).tolist() for n in (5, 50, 23)]
    adapters = [LoRARequest("all", 1)] * 3 + [None, LoRARequest("qko", 2), None]  # the prefix rows share one
    tokens, shards = {}, {}
    for tp in (1, 2):
        llm = LLM(model, tokenizer=TokenIdTokenizer(), tensor_parallel_size=tp, max_batch_size=4, max_seq_len=80,
                  max_num_tokens=32, kv_cache_config=KvCacheConfig(max_tokens=96, dtype="fp8"),
                  scheduler_config=SchedulerConfig(capacity_policy=CapacityPolicy.MAX_UTILIZATION),
                  compile_config=CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
                  attention_backend="xla", quantization="fp8", quantize_lm_head=True, enable_lora=True, max_loras=2,
                  max_lora_rank=8, show_progress=False)
        # B large enough to move the tokens
        llm.load_lora("all", random_adapter_tensors(llm, 8, 1, b_std=0.5), {"r": 8, "lora_alpha": 8})
        qko = random_adapter_tensors(llm, 4, 2, modules=("q_proj", "k_proj", "o_proj"), b_std=0.5)
        llm.load_lora("qko", qko, {"r": 4, "lora_alpha": 4})
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = llm.generate(prompts, greedy, use_tqdm=False, lora_request=adapters)
        tokens[tp] = [o.outputs[0].token_ids for o in out]
        base = llm.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
        wqkv = llm.engine.runner.weights.arrays.layers[0].wqkv
        assert isinstance(wqkv, quant.Fp8Weight)
        shards[tp] = [list(wqkv.values.sharding.shard_shape(wqkv.values.shape)),
                      list(wqkv.scale.sharding.shard_shape(wqkv.scale.shape)),
                      str(llm.engine.runner.kv_cache.k.dtype),
                      sum(s.num_preempted for s in llm.step_stats)]
        head = llm.engine.runner.weights.arrays.lm_head
        shards[tp].append([list(head.values.sharding.shard_shape(head.values.shape)),
                           list(head.scale.sharding.shard_shape(head.scale.shape))])
        tables = llm.engine.runner.weights.lora[0]
        shape = lambda x: list(x.sharding.shard_shape(x.shape))
        shards[tp].append([shape(tables["wqkv"].b), shape(tables["wo"].a), shape(tables["w_gate_up"].b),
                           shape(tables["w_down"].a)])
        shards[tp].append(base != tokens[tp][0])
        llm.close()
    print(json.dumps({"tokens": tokens, "shards": shards}))
    """
)


def test_fp8_engine_with_adapters_on_a_tp2_mesh_gives_one_devices_tokens(run_with_host_devices):
    result = run_with_host_devices(CHECK, num_devices=2)
    assert result["tokens"]["1"] == result["tokens"]["2"]
    # wqkv's values (stored [K, G+2, Dh, D]) split over its 4 kv heads, its scale [K, G+2, Dh] with them; the
    # pool in e4m3.
    assert result["shards"]["2"][:3] == [[2, 4, 8, 64], [2, 4, 8], "float8_e4m3fn"]
    assert result["shards"]["1"][:2] == [[4, 4, 8, 64], [4, 4, 8]]
    assert result["shards"]["2"][3] > 0, "the pool was meant to force preemption"
    # The FP8 lm_head (values [V, D], scale [V]) split over the vocabulary, its scale with its rows.
    assert result["shards"]["2"][4] == [[80, 64], [80]] and result["shards"]["1"][4] == [[160, 64], [160]]
    # 3 slots; wqkv's b [S, 3R, K, G+2, Dh] over its 4 kv heads, wo's a [H, Dh, S, R] over its 8 heads, gate/up's b
    # [S, 2R, 2, F] and down's a [F, S, R] over the MLP hidden; the adapter moves the first prompt's tokens.
    assert result["shards"]["2"][5] == [[3, 24, 2, 4, 8], [4, 8, 3, 8], [3, 16, 2, 64], [64, 3, 8]]
    assert result["shards"]["1"][5] == [[3, 24, 4, 4, 8], [8, 8, 3, 8], [3, 16, 2, 128], [128, 3, 8]]
    assert result["shards"]["1"][6] and result["shards"]["2"][6]
