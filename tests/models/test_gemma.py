"""The Gemma family (Gemma, Gemma 2, Gemma 3) against Hugging Face transformers in float32 on tiny random configs
whose soft-caps bind, whose windows are shorter than the prompts and whose layers mix sliding and full
attention: config parsing, checkpoint rules, each layer's attention block, whole-model logits through prefill
and decode (dense and paged, both backends) and greedy generation."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve.dense import generate_dense
from jaxserve.models import gemma
from jaxserve.models.attention import DenseAttentionMetadata, init_dense_cache
from jaxserve.models.common import RopeConfig, rope_frequencies
from jaxserve.models.layers import layer_groups
from jaxserve.models.registry import resolve

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
# name -> (Hugging Face model_type, config overrides). Head dim 16, query_pre_attn_scalar 16 (scale 0.25):
# attention logits of about 1, so a soft-cap of 1.0 binds; a final cap of 2.0 binds on logits of a few units.
FAMILIES: dict[str, tuple[str, dict]] = {
    "gemma": ("gemma", {"head_dim": 16, "num_hidden_layers": 2}),
    "gemma2_caps": (
        "gemma2",
        {
            "head_dim": 16,
            "num_hidden_layers": 3,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 2.0,
        },
    ),
    "gemma3_mixed": (
        "gemma3_text",
        {
            "head_dim": 32,  # H * Dh = 128 differs from hidden 64
            "num_hidden_layers": 3,
            "layer_types": MIXED,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "final_logit_softcapping": 3.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        },
    ),
}


@dataclass
class Case:
    name: str
    hf_config: dict
    model: torch.nn.Module
    cfg: gemma.GemmaConfig
    weights: gemma.GemmaWeights


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tiny_hf_config, hf_model, weights_from_state_dict) -> Case:
    model_type, overrides = FAMILIES[request.param]
    hf_config = tiny_hf_config(model_type, **overrides)
    model = hf_model(hf_config)
    family, cfg = resolve(hf_config)
    assert family is gemma
    return Case(request.param, hf_config, model, cfg, weights_from_state_dict(gemma, cfg, model.state_dict()))


def _assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    err = np.abs(np.asarray(ours, np.float64) - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), f"max abs error {err} vs max |value| {np.abs(ref).max()}"


# ---- Config ------------------------------------------------------------------------------------------------


def test_config_declares_each_layers_attention(case: Case) -> None:
    cfg, layers = case.cfg, case.cfg.attention_layers
    assert len(layers) == cfg.num_layers
    if case.name == "gemma":
        assert {layer.kind for layer in layers} == {"full"} and layers[0].sm_scale == 16**-0.5
        assert cfg.final_logit_soft_cap is None and not cfg.post_norms and not cfg.qk_norm
    elif case.name == "gemma2_caps":
        # Gemma 2's default pattern: sliding, full, sliding, ...; both soft-caps read.
        assert [layer.kind for layer in layers] == ["sliding", "full", "sliding"]
        assert {(layer.soft_cap, layer.sm_scale) for layer in layers} == {(1.0, 0.25)}
        assert cfg.final_logit_soft_cap == 2.0 and layers[0].sliding_window == 8
    else:
        assert [layer.kind for layer in layers] == ["sliding", "full", "sliding"]
        assert layers[1].rope == RopeConfig(theta=1e6, variant="linear", factor=4.0)
        assert layers[0].rope == RopeConfig(theta=100.0)
        assert {layer.soft_cap for layer in layers} == {None} and cfg.qk_norm and cfg.post_norms
    assert layer_groups(layers) == {
        w: tuple(i for i, layer in enumerate(layers) if layer.sliding_window == w)
        for w in {layer.sliding_window for layer in layers}
    }


def test_gemma3_default_pattern_and_legacy_rope_keys() -> None:
    hf = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 12,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
    }
    _, cfg = resolve(hf)
    kinds = [layer.kind for layer in cfg.attention_layers]
    assert kinds == (["sliding"] * 5 + ["full"]) * 2  # every sixth layer full
    assert cfg.attention_layers[5].rope == RopeConfig(theta=1e6, variant="linear", factor=8.0)
    assert cfg.attention_layers[0].rope == RopeConfig(theta=1e4)
    assert cfg.attention_layers[0].sm_scale == 256**-0.5 and cfg.head_dim == 256
    # The multimodal checkpoint's config: the language model is text_config.
    _, nested = resolve(
        {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": hf}
    )
    assert nested == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_activation": "silu"}, r"hidden_activation must be one of .* got 'silu'"),
        ({"layer_types": ["sliding_attention"]}, r"layer_types must have num_hidden_layers \(3\) entries, got 1"),
        ({"layer_types": ["sliding_attention", "chunked", "full_attention"]}, r"layer_types entries must be one of"),
        ({"sliding_window": 0}, r"sliding_window must be an int >= 1, got 0"),
        ({"attn_logit_softcapping": -1.0}, r"attn_logit_softcapping must be a number > 0, got -1.0"),
        ({"attention_bias": True}, r"attention_bias must be false"),
        ({"use_bidirectional_attention": True}, r"use_bidirectional_attention must be false"),
    ],
)
def test_bad_configs_name_the_key(overrides, message) -> None:
    hf = {
        "model_type": "gemma2",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        **overrides,
    }
    with pytest.raises(ValueError, match=message):
        gemma.GemmaConfig.from_hf(hf)


def test_multimodal_config_errors_name_the_text_config_key() -> None:
    with pytest.raises(ValueError, match=r"needs 'text_config'"):
        gemma.GemmaConfig.from_hf({"model_type": "gemma3"})
    with pytest.raises(ValueError, match=r"^text_config\.sliding_window must be an int >= 1"):
        gemma.GemmaConfig.from_hf(
            {
                "model_type": "gemma3",
                "text_config": {
                    "vocab_size": 64,
                    "hidden_size": 32,
                    "intermediate_size": 48,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 2,
                    "sliding_window": "wide",
                },
            }
        )


# ---- Numerics against Hugging Face ----------------------------------------------------------------


def test_checkpoint_rules_fill_every_field_from_exactly_the_hf_tensors(case: Case) -> None:
    loaded = {rule.field for rule in gemma.checkpoint_rules(case.cfg) if rule.transform != "skip"}
    paths = {
        ".".join(k.name for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(gemma.param_specs(case.cfg))[0]
    }
    assert loaded == paths


@pytest.mark.parametrize("layer_index", [0, 1])
def test_attention_block_matches_hf(case: Case, layer_index: int) -> None:
    num_tokens = 24  # longer than the window of 8
    torch.manual_seed(3)
    x = torch.randn(1, num_tokens, case.cfg.hidden_size)
    positions = torch.arange(num_tokens)
    spec = case.cfg.attention_layers[layer_index]
    hf_model = case.model.model
    visible = positions[None, :] <= positions[:, None]
    if spec.sliding_window is not None:
        visible &= positions[None, :] > positions[:, None] - spec.sliding_window
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]
    rotary = hf_model.rotary_emb
    kind = "sliding_attention" if spec.kind == "sliding" else "full_attention"
    embeddings = rotary(x, positions[None], kind) if case.cfg.version == 3 else rotary(x, positions[None])
    with torch.no_grad():
        ref, _ = hf_model.layers[layer_index].self_attn(x, embeddings, mask)

    layer = gemma.to_serving(case.weights, case.cfg).layers[layer_index]
    cache = init_dense_cache(case.cfg, 1, num_tokens, jnp.float32)
    cos, sin = rope_frequencies(spec.rope, case.cfg.head_dim, jnp.arange(num_tokens))
    ours, _ = gemma.attention_block(
        layer,
        jnp.asarray(x[0].numpy()),
        jnp.arange(num_tokens),
        cos,
        sin,
        cache,
        jnp.int32(layer_index),
        DenseAttentionMetadata(jnp.zeros(num_tokens, jnp.int32)),
        case.cfg,
        spec,
    )
    _assert_close(np.asarray(ours), ref[0].numpy())


@partial(jax.jit, static_argnames=("cfg",))
def _logits(weights, token_ids, positions, seq_ids, kv_cache, cfg):
    weights = gemma.to_serving(weights, cfg)
    hidden, kv_cache = gemma.forward(weights, token_ids, positions, kv_cache, DenseAttentionMetadata(seq_ids), cfg)
    return gemma.compute_logits(weights, hidden, cfg), kv_cache


def _hf_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))[None]).logits[0].double().numpy()


def test_prefill_then_decode_logits_match_hf(case: Case) -> None:
    """Two sequences (24 and 17 tokens, windows of 8) prefilled in one flat batch, then 3 batched decode steps."""
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
        ref = _hf_logits(case.model, sequence)
        _assert_close(np.concatenate(ours[b]), ref)
        if case.cfg.final_logit_soft_cap is not None:  # the cap binds: logits come within 10% of it
            assert np.abs(ref).max() > 0.9 * case.cfg.final_logit_soft_cap


_SOFT_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")


def test_gemma2_null_soft_caps_mean_no_cap(tiny_hf_config, hf_model, weights_from_state_dict) -> None:
    """A Gemma 2 config.json with both soft-caps null (transformers: no cap) gives transformers' uncapped
    logits, while a soft-cap key left out takes the version's default (attention 50.0, final 30.0). The
    queries and the final norm are scaled up so that attention logits pass 50 and output logits pass 30:
    either default cap, read in place of a null, changes the logits."""
    overrides = {"head_dim": 16, "num_hidden_layers": 2, "query_pre_attn_scalar": 16, "sliding_window": 8}
    hf_config = tiny_hf_config("gemma2", **overrides, **dict.fromkeys(_SOFT_CAPS))
    assert [hf_config[key] for key in _SOFT_CAPS] == [None, None]
    model = hf_model(hf_config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10.0)
        model.model.norm.weight.mul_(10.0)
    _, cfg = resolve(hf_config)
    assert cfg.final_logit_soft_cap is None and {layer.soft_cap for layer in cfg.attention_layers} == {None}
    weights = weights_from_state_dict(gemma, cfg, model.state_dict())
    tokens = np.random.default_rng(6).integers(0, cfg.vocab_size, 24).astype(np.int32)  # longer than the window

    def logits(config: gemma.GemmaConfig) -> np.ndarray:
        cache = init_dense_cache(config, 1, len(tokens), jnp.float32)
        positions = np.arange(len(tokens), dtype=np.int32)
        out, _ = _logits(weights, tokens, positions, np.zeros(len(tokens), np.int32), cache, config)
        return np.asarray(out)

    ref = _hf_logits(model, tokens)
    assert np.abs(ref).max() > 30.0
    _assert_close(logits(cfg), ref)
    for key in _SOFT_CAPS:  # each key left out: its default binds
        _, capped = resolve({k: v for k, v in hf_config.items() if k != key})
        if key == "attn_logit_softcapping":
            assert {layer.soft_cap for layer in capped.attention_layers} == {50.0}
        else:
            assert capped.final_logit_soft_cap == 30.0
        assert np.abs(logits(capped) - ref).max() > 0.05 * np.abs(ref).max(), key


def test_greedy_generation_matches_hf_generate(case: Case) -> None:
    rng = np.random.default_rng(5)
    lengths = (5, 13)
    prompts = [rng.integers(3, case.cfg.vocab_size, n).tolist() for n in lengths]
    ours = generate_dense(gemma, case.cfg, case.weights, prompts, 32)
    case.model.generation_config.eos_token_id = None  # 32 tokens whatever comes out
    refs = []
    for prompt in prompts:  # one at a time: no padding, so the windows see the same positions
        with torch.no_grad():
            out = case.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, pad_token_id=0)
        refs.append(out[0, len(prompt) :].tolist())
    assert ours == refs


@pytest.mark.parametrize(("name", "billions"), [("gemma-3-12b", 11.77), ("gemma-2-9b", 9.24)])
def test_random_weight_shapes_read_as_transformers_reads_them(name: str, billions: float) -> None:
    import transformers

    from jaxserve.models import shapes

    hf = shapes.shape(name)
    _, cfg = resolve(hf)
    reference = transformers.AutoConfig.for_model(**hf)
    assert [layer.kind + "_attention" for layer in cfg.attention_layers] == reference.layer_types
    assert {layer.sliding_window for layer in cfg.attention_layers} == {None, reference.sliding_window}
    assert cfg.attention_layers[0].sm_scale == reference.query_pre_attn_scalar**-0.5
    specs = jax.eval_shape(lambda: gemma.init_weights(cfg, jax.random.key(0), jnp.bfloat16))
    count = sum(np.prod(w.shape) for w in jax.tree.leaves(specs))
    assert abs(count / 1e9 - billions) < 0.01, count  # the published parameter counts (language model)


@pytest.mark.parametrize("legacy_names", [False, True])
def test_multimodal_checkpoint_serves_its_language_model(tmp_path, caplog, legacy_names: bool) -> None:
    """A Gemma3ForConditionalGeneration checkpoint as save_pretrained writes it (and with the hub's earlier
    `language_model.model.*` names): the language model loads, the vision tower is skipped with one log line,
    and the logits of a text prompt equal transformers'."""
    import logging

    import safetensors.torch
    import transformers

    from jaxserve.models.loader import load_model

    text = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        sliding_window_pattern=2,
        max_position_embeddings=256,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(0.2 * torch.randn_like(param) if "norm" in name else torch.randn_like(param) / 8)
    model.save_pretrained(tmp_path)
    if legacy_names:
        tensors = safetensors.torch.load_file(tmp_path / "model.safetensors")
        renamed = {re.sub(r"^model\.language_model\.", "language_model.model.", k): v for k, v in tensors.items()}
        safetensors.torch.save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="jaxserve.models.loader"):
        loaded = load_model(tmp_path, dtype="float32")
    assert [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()] == [
        f"skipped {sum('vision' in k or 'projector' in k for k in model.state_dict())} tensors the gemma model "
        "does not read (a multimodal checkpoint's vision tower)"
    ]
    tokens = np.random.default_rng(0).integers(3, 160, 20).astype(np.int32)
    cache = init_dense_cache(loaded.config, 1, 20, jnp.float32)
    ours, _ = _logits(
        loaded.weights, tokens, np.arange(20, dtype=np.int32), np.zeros(20, np.int32), cache, loaded.config
    )
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens.astype(np.int64))[None]).logits[0].double().numpy()
    _assert_close(np.asarray(ours), ref)
