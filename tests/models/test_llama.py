"""The dense decoder family (Llama, Mistral, Qwen2, Qwen3) against Hugging Face transformers, float32:
config parsing, registry, parameter specs, checkpoint rules, the attention block, whole-model
logits through prefill and decode, and greedy generation with the dense reference generator."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve.dense import generate_dense
from jaxserve.models import llama
from jaxserve.models.attention import DenseAttentionMetadata, init_dense_cache
from jaxserve.models.common import ParamSpec, rope_frequencies
from jaxserve.models.registry import resolve

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # short, so the tiny head dims fall in every llama3 band
}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}

# family -> (Hugging Face model_type, config overrides, expected LlamaConfig fields)
FAMILIES: dict[str, tuple[str, dict, dict]] = {
    "llama3_tied": (
        "llama",
        {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE},
        {"tie_word_embeddings": True, "sliding_window": None, "attention_bias": False, "qk_norm": False},
    ),
    "mistral_window": (
        "mistral",
        {"sliding_window": 8},
        {"tie_word_embeddings": False, "sliding_window": 8, "attention_bias": False, "qk_norm": False},
    ),
    "qwen2_bias_yarn": (
        "qwen2",
        {"rope_parameters": YARN_ROPE},
        {"tie_word_embeddings": False, "sliding_window": None, "attention_bias": True, "qk_norm": False},
    ),
    "qwen3_qk_norm": (
        "qwen3",
        {"head_dim": 32, "tie_word_embeddings": True},  # H * Dh = 128 differs from hidden 64
        {"tie_word_embeddings": True, "sliding_window": None, "attention_bias": False, "qk_norm": True},
    ),
}


@dataclass
class Case:
    name: str
    hf_config: dict
    model: torch.nn.Module
    cfg: llama.LlamaConfig
    weights: llama.LlamaWeights


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tiny_hf_config, hf_model, weights_from_state_dict) -> Case:
    model_type, overrides, _ = FAMILIES[request.param]
    hf_config = tiny_hf_config(model_type, **overrides)
    model = hf_model(hf_config)
    cfg = llama.LlamaConfig.from_hf(hf_config)
    return Case(request.param, hf_config, model, cfg, weights_from_state_dict(llama, cfg, model.state_dict()))


def _assert_logits_close(ours: np.ndarray, ref: np.ndarray) -> None:
    err = np.abs(np.asarray(ours, np.float64) - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), f"max abs error {err} vs max |logit| {np.abs(ref).max()}"


# ---- Config, registry, specs, rules ---------------------------------------------------------------


def test_config_from_hf_reads_each_family(case: Case) -> None:
    _, overrides, expected = FAMILIES[case.name]
    cfg = case.cfg
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (160, 64, 96)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2, 4, 2)
    assert cfg.head_dim == overrides.get("head_dim", 16)
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 256
    assert cfg.rope.variant == overrides.get("rope_parameters", {}).get("rope_type", "default")
    hash(cfg)  # a jit static argument


def test_registry_resolves_each_architecture_to_the_llama_family(case: Case) -> None:
    family, cfg = resolve(case.hf_config)
    assert family is llama
    assert cfg == case.cfg


def test_registry_rejects_unknown_architectures_listing_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        resolve({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="no 'architectures'.*MistralForCausalLM"):
        resolve({"model_type": "gpt2"})  # without architectures, by model_type (tests/models/test_model_type.py)


def test_from_hf_applies_hugging_face_defaults_for_absent_keys(tiny_hf_config) -> None:
    base = {k: v for k, v in tiny_hf_config("llama").items() if k not in ("head_dim", "model_type")}
    mistral = llama.LlamaConfig.from_hf({**base, "model_type": "mistral"})
    assert mistral.sliding_window == 4096 and mistral.head_dim == 16
    qwen3 = llama.LlamaConfig.from_hf({**base, "model_type": "qwen3"})
    assert qwen3.head_dim == 128 and qwen3.sliding_window is None
    no_kv = llama.LlamaConfig.from_hf({k: v for k, v in base.items() if k != "num_key_value_heads"})
    assert no_kv.num_kv_heads == no_kv.num_heads == 4
    all_sliding = tiny_hf_config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert llama.LlamaConfig.from_hf(all_sliding).sliding_window == 16
    none_sliding = tiny_hf_config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert llama.LlamaConfig.from_hf(none_sliding).sliding_window is None


@pytest.mark.parametrize(
    ("model_type", "overrides", "message"),
    [
        ("llama", {"attention_bias": True}, "attention_bias must be false for llama"),
        ("llama", {"mlp_bias": True}, "mlp_bias must be false"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "same attention"),
        ("llama", {"num_key_value_heads": 3}, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    ],
)
def test_from_hf_rejects_what_the_family_cannot_run(tiny_hf_config, model_type, overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        llama.LlamaConfig.from_hf(tiny_hf_config(model_type, **overrides))


def test_from_hf_names_unknown_model_types_and_missing_keys(tiny_hf_config) -> None:
    hf = tiny_hf_config("llama")
    with pytest.raises(ValueError, match="model_type must be one of .* got 'gemma'"):
        llama.LlamaConfig.from_hf({**hf, "model_type": "gemma", "architectures": ["GemmaForCausalLM"]})
    with pytest.raises(ValueError, match=r"lacks required keys \['vocab_size'\]"):
        llama.LlamaConfig.from_hf({k: v for k, v in hf.items() if k != "vocab_size"})


def test_config_validation_names_the_field() -> None:
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="head_dim must be an even number"):
        llama.LlamaConfig(**base, head_dim=3)
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        llama.LlamaConfig(**{**base, "num_layers": 0}, head_dim=4)
    with pytest.raises(ValueError, match="sliding_window must be None"):
        llama.LlamaConfig(**base, head_dim=4, sliding_window=0)


def test_param_specs_describe_init_weights_leaf_for_leaf(case: Case) -> None:
    specs = llama.param_specs(case.cfg)
    weights = jax.eval_shape(partial(llama.init_weights, case.cfg, dtype=jnp.bfloat16), jax.random.key(0))
    spec_leaves, spec_tree = jax.tree_util.tree_flatten(specs)
    weight_leaves, weight_tree = jax.tree_util.tree_flatten(weights)
    assert spec_tree == weight_tree
    for spec, leaf in zip(spec_leaves, weight_leaves, strict=True):
        assert isinstance(spec, ParamSpec) and spec.shape == leaf.shape and leaf.dtype == jnp.bfloat16
    assert (specs.layers.bq is None) == (not case.cfg.attention_bias)
    assert (specs.layers.q_norm is None) == (not case.cfg.qk_norm)
    assert (specs.lm_head is None) == case.cfg.tie_word_embeddings
    assert specs.layers.wk.logical_axes == ("layers", "embed", "kv_heads", "head_dim")


def test_serving_specs_describe_to_serving_leaf_for_leaf(case: Case) -> None:
    specs = llama.serving_specs(case.cfg)
    serving = llama.to_serving(case.weights, case.cfg, dtype=jnp.bfloat16)
    spec_leaves, spec_tree = jax.tree_util.tree_flatten(specs)
    leaves, tree = jax.tree_util.tree_flatten(serving)
    assert spec_tree == tree and len(serving.layers) == case.cfg.num_layers
    for spec, leaf in zip(spec_leaves, leaves, strict=True):
        assert isinstance(spec, ParamSpec) and spec.shape == leaf.shape and leaf.dtype == jnp.bfloat16
    # Layer 1's fused matrices hold its own q/k/v and gate/up, grouped by kv head.
    cfg, source, layer = case.cfg, case.weights.layers, serving.layers[1]
    groups = cfg.num_heads // cfg.num_kv_heads
    wqkv = np.asarray(layer.wqkv, np.float32)
    wq = np.asarray(source.wq[1].astype(jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(wqkv[:, :, :groups].reshape(wq.shape), wq)
    np.testing.assert_array_equal(wqkv[:, :, groups], np.asarray(source.wk[1].astype(jnp.bfloat16), np.float32))
    np.testing.assert_array_equal(wqkv[:, :, groups + 1], np.asarray(source.wv[1].astype(jnp.bfloat16), np.float32))
    gate_up = np.asarray(layer.w_gate_up, np.float32)
    np.testing.assert_array_equal(gate_up[:, 1], np.asarray(source.w_up[1].astype(jnp.bfloat16), np.float32))
    assert (layer.bqkv is None) == (not cfg.attention_bias)
    assert specs.layers[0].wqkv.logical_axes == ("embed", "kv_heads", None, "head_dim")


def test_checkpoint_rules_fill_every_field_from_exactly_the_hf_tensors(case: Case) -> None:
    # The fixture already loaded the model through the rules (strictly); here the two sides match up.
    rules = llama.checkpoint_rules(case.cfg)
    paths = {
        ".".join(k.name for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(llama.param_specs(case.cfg))[0]
    }
    assert {rule.field for rule in rules} == paths
    layer_rules = sum(rule.field.startswith("layers.") for rule in rules)
    expected = len(rules) - layer_rules + case.cfg.num_layers * layer_rules
    tied_duplicate = 1 if case.cfg.tie_word_embeddings else 0  # torch lists the tied lm_head.weight again
    assert len(case.model.state_dict()) - tied_duplicate == expected


# ---- Numerics against Hugging Face ----------------------------------------------------------------


def test_attention_block_matches_hf(case: Case) -> None:
    num_tokens = 24  # longer than Mistral's window of 8
    torch.manual_seed(3)
    x = torch.randn(1, num_tokens, case.cfg.hidden_size)
    positions = torch.arange(num_tokens)
    hf_model = case.model.model
    visible = positions[None, :] <= positions[:, None]
    if case.cfg.sliding_window is not None:
        visible &= positions[None, :] > positions[:, None] - case.cfg.sliding_window
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        ref, _ = hf_model.layers[0].self_attn(x, hf_model.rotary_emb(x, positions[None]), mask)

    layer0 = llama.to_serving(case.weights, case.cfg).layers[0]
    cache = init_dense_cache(case.cfg, 1, num_tokens, jnp.float32)
    cos, sin = rope_frequencies(case.cfg.rope, case.cfg.head_dim, jnp.arange(num_tokens))
    ours, layer_cache = llama.attention_block(
        layer0,
        jnp.asarray(x[0].numpy()),
        jnp.arange(num_tokens),
        cos,
        sin,
        cache,
        jnp.int32(0),
        DenseAttentionMetadata(jnp.zeros(num_tokens, jnp.int32)),
        case.cfg,
    )
    _assert_logits_close(np.asarray(ours), ref[0].numpy())
    assert layer_cache.k.shape == cache.k.shape


@partial(jax.jit, static_argnames=("cfg",))
def _logits(weights, token_ids, positions, seq_ids, kv_cache, cfg):
    weights = llama.to_serving(weights, cfg)
    hidden, kv_cache = llama.forward(weights, token_ids, positions, kv_cache, DenseAttentionMetadata(seq_ids), cfg)
    return llama.compute_logits(weights, hidden, cfg), kv_cache


def _hf_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))[None]).logits[0].double().numpy()


def test_prefill_then_decode_logits_match_hf(case: Case) -> None:
    """Two sequences (24 and 17 tokens) prefilled in one flat batch, then 3 batched decode steps."""
    rng = np.random.default_rng(4)
    lengths, decode_steps = (24, 17), 3
    sequences = [rng.integers(0, case.cfg.vocab_size, n + decode_steps).astype(np.int32) for n in lengths]
    cache = init_dense_cache(case.cfg, 2, max(lengths) + decode_steps, jnp.float32)
    tokens = np.concatenate([s[:n] for s, n in zip(sequences, lengths, strict=True)])
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    seq_ids = np.repeat([0, 1], lengths).astype(np.int32)
    logits, cache = _logits(case.weights, tokens, positions, seq_ids, cache, case.cfg)
    ours = [[np.asarray(logits)[: lengths[0]]], [np.asarray(logits)[lengths[0] :]]]
    for step in range(decode_steps):
        step_positions = np.array(lengths, np.int32) + step
        step_tokens = np.array([s[p] for s, p in zip(sequences, step_positions, strict=True)], np.int32)
        logits, cache = _logits(case.weights, step_tokens, step_positions, np.array([0, 1], np.int32), cache, case.cfg)
        for b in range(2):
            ours[b].append(np.asarray(logits)[b : b + 1])
    for b, sequence in enumerate(sequences):
        _assert_logits_close(np.concatenate(ours[b]), _hf_logits(case.model, sequence))


def test_greedy_generation_matches_hf_generate(case: Case) -> None:
    rng = np.random.default_rng(5)
    lengths = (5, 13)
    prompts = [rng.integers(3, case.cfg.vocab_size, n).tolist() for n in lengths]
    ours = generate_dense(llama, case.cfg, case.weights, prompts, 32)
    # Hugging Face batches the two prompts left-padded; positions follow the attention mask.
    width = max(lengths)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    case.model.generation_config.eos_token_id = None  # 32 tokens whatever comes out
    with torch.no_grad():
        ref = case.model.generate(
            input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=32, pad_token_id=0
        )
    assert ours == ref[:, width:].tolist()


# ---- Dense generator behaviour ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def small() -> tuple[llama.LlamaConfig, Any]:
    cfg = llama.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16
    )
    return cfg, llama.init_weights(cfg, jax.random.key(1))


def test_generation_stops_after_an_eos_token(small) -> None:
    cfg, weights = small
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    free = generate_dense(llama, cfg, weights, prompts, 12)
    eos = free[0][4]
    stopped = generate_dense(llama, cfg, weights, prompts, 12, eos_token_ids=(eos,))
    for full, cut in zip(free, stopped, strict=True):
        end = full.index(eos) + 1 if eos in full else len(full)
        assert cut == full[:end]


def test_sampling_is_reproducible_and_top_p_near_zero_is_greedy(small) -> None:
    cfg, weights = small
    prompts = [[1, 2, 3], [4, 5]]
    greedy = generate_dense(llama, cfg, weights, prompts, 10)
    sampled = generate_dense(llama, cfg, weights, prompts, 10, temperature=1.0, seed=7)
    assert sampled == generate_dense(llama, cfg, weights, prompts, 10, temperature=1.0, seed=7)
    assert sampled != greedy  # 20 draws from a 64-token vocabulary at temperature 1
    assert generate_dense(llama, cfg, weights, prompts, 10, temperature=1.0, top_p=1e-6, seed=7) == greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompts": []}, "at least one prompt"),
        ({"prompts": [[1], []]}, "at least one token"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_generate_dense_rejects_bad_arguments(small, kwargs, message) -> None:
    cfg, weights = small
    args = {"prompts": [[1, 2]], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate_dense(llama, cfg, weights, **args)
