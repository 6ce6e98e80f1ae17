"""Model shapes by name: the Hugging Face config.json of well-known models, for random-weight runs that need
no checkpoint (`jaxserve bench --random-weights NAME`, the scripts in benchmarks/), and a tiny one for tests.

A shape is a plain dict, what `jaxserve.models.registry.resolve` takes; `shape(name)` returns a copy of it.
"""

from __future__ import annotations

import copy
from typing import Any

LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "eos_token_id": 128001,
}

SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}

# Not a real model: 2 layers of width 64 over 160 token ids, so that a CPU test compiles and runs it in seconds.
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

# google/gemma-3-12b-it's language model: 48 layers, five sliding (window 1024, local rope base 1e4) to one full
# (rope base 1e6, linear scaling 8), head dim 256, tied 262k vocabulary.
GEMMA_3_12B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262208,
    "hidden_size": 3840,
    "intermediate_size": 15360,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
    "eos_token_id": 1,
}

# google/gemma-2-9b: 42 layers alternating sliding (window 4096) and full, attention soft-cap 50, final 30.
GEMMA_2_9B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "vocab_size": 256000,
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "eos_token_id": 1,
}

# Qwen/Qwen3-30B-A3B: 48 layers, each a mixture of 128 experts of width 768 (top 8, renormalised), q/k norm,
# head dim 128 with 32 query and 4 kv heads.
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_scaling": None,
    "sliding_window": None,
    "use_sliding_window": False,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

# mistralai/Mixtral-8x7B-v0.1: 32 layers, each a mixture of 8 experts of width 14336 (top 2), no window.
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": LLAMA_3_1_8B,
    "gemma-3-12b": GEMMA_3_12B,
    "gemma-2-9b": GEMMA_2_9B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "mixtral-8x7b": MIXTRAL_8X7B,
    "smollm2-135m": SMOLLM2_135M,
    "tiny-llama": TINY_LLAMA,
}


def shape(name: str) -> dict[str, Any]:
    """A copy of the named shape's config dict; a ValueError lists the names for an unknown one."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known shapes: {', '.join(SHAPES)}")
    return copy.deepcopy(SHAPES[name])
