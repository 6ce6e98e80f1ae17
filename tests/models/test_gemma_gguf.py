"""Gemma, Gemma 2 and Gemma 3 GGUF files (conftest's `write_gguf`: written the way llama.cpp's converter writes
them, 1 added to every norm weight, no q/k permutation, no local rope base or layer pattern for Gemma 3) load
into the Gemma family and give transformers' float32 logits; the metadata llama.cpp leaves out is what it
assumes itself."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file

from jaxserve.models import gemma
from jaxserve.models.gguf import hf_config_from_metadata, hf_tensor_name, open_gguf
from jaxserve.models.loader import load_model

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

# 20 tokens: longer than the windows of 8 below, so sliding layers differ from full ones.
TOKENS = [3, 17, 42, 99, 5, 150, 8, 77, 23, 61, 140, 9, 88, 31, 120, 4, 55, 101, 12, 66]
# Query scale head_dim ** -0.5 (query_pre_attn_scalar = head_dim: what llama.cpp assumes below 27B).
CASES = {
    "gemma": ("gemma", "gemma", {"head_dim": 16, "num_hidden_layers": 2}),
    "gemma2": (
        "gemma2",
        "gemma2",
        {
            "head_dim": 16,
            "num_hidden_layers": 3,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 2.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
        },
    ),
    # 7 layers of transformers' default pattern (every 6th full): sliding 0-4 and 6, full 5; the local rope
    # base is transformers' default 10000, which the file does not store.
    "gemma3": (
        "gemma3_text",
        "gemma3",
        {
            "head_dim": 16,
            "num_hidden_layers": 7,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "final_logit_softcapping": 3.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, tiny_hf_config, hf_model):
    model_type, arch, overrides = CASES[request.param]
    config = tiny_hf_config(model_type, **overrides)
    model = hf_model(config)
    root = tmp_path_factory.mktemp(f"{arch}_gguf")
    model.save_pretrained(root / "hf")
    return arch, config, model, load_file(root / "hf" / "model.safetensors"), root


def test_f32_gemma_gguf_matches_transformers(our_logits, hf_logits, case, write_gguf):
    arch, config, model, tensors, root = case
    path = write_gguf(root / "f32.gguf", arch, config, tensors)
    hf = open_gguf(path).hf_config
    assert hf["model_type"] == config["model_type"] and hf["tie_word_embeddings"] is True
    loaded = load_model(path, dtype="float32")
    assert loaded.family is gemma
    cfg = loaded.config
    hf_cfg = gemma.GemmaConfig.from_hf(config)
    assert cfg.attention_layers == hf_cfg.attention_layers and cfg.final_logit_soft_cap == hf_cfg.final_logit_soft_cap
    # Norms come back as Hugging Face stores them (w, not llama.cpp's 1 + w); q/k rows are not permuted.
    np.testing.assert_allclose(
        loaded.weights.layers.attn_norm[1], tensors["model.layers.1.input_layernorm.weight"], atol=1e-6
    )
    np.testing.assert_allclose(loaded.weights.final_norm, tensors["model.norm.weight"], atol=1e-6)
    q_proj = tensors["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(loaded.weights.layers.wq[1], q_proj.T.reshape(cfg.hidden_size, cfg.num_heads, 16))
    np.testing.assert_allclose(our_logits(loaded, TOKENS), hf_logits(model, TOKENS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["gemma3"], indirect=True)
def test_q8_0_gemma3_gguf_is_dequantised(our_logits, hf_logits, case, write_gguf, hf_model):
    arch, config, model, tensors, root = case
    path = write_gguf(root / "q8.gguf", arch, config, tensors, qtype=GGMLQuantizationType.Q8_0)
    loaded = load_model(path, dtype="float32")
    # transformers on the same dequantised values: every matrix through Q8_0 and back, the norms as they were.
    q8 = GGMLQuantizationType.Q8_0
    roundtrip = {
        name: gguf.quants.dequantize(gguf.quants.quantize(array, q8), q8) if array.ndim == 2 else array
        for name, array in tensors.items()
    }
    assert not np.array_equal(
        roundtrip["model.layers.0.mlp.up_proj.weight"], tensors["model.layers.0.mlp.up_proj.weight"]
    )
    reference = hf_model(config)
    result = reference.load_state_dict({k: torch.from_numpy(v) for k, v in roundtrip.items()}, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied to the embedding
    np.testing.assert_allclose(our_logits(loaded, TOKENS), hf_logits(reference, TOKENS), rtol=1e-4, atol=1e-4)


def test_gemma_tensor_names():
    # Gemma 1 is named as llama: ffn_norm is post_attention_layernorm, the norm before the MLP.
    assert hf_tensor_name("blk.0.ffn_norm.weight", "gemma") == "model.layers.0.post_attention_layernorm.weight"
    for arch in ("gemma2", "gemma3"):
        assert hf_tensor_name("blk.2.ffn_norm.weight", arch) == "model.layers.2.pre_feedforward_layernorm.weight"
        assert hf_tensor_name("blk.2.post_attention_norm.weight", arch) == (
            "model.layers.2.post_attention_layernorm.weight"
        )
        assert hf_tensor_name("blk.2.post_ffw_norm.weight", arch) == "model.layers.2.post_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.4.attn_k_norm.weight", "gemma3") == "model.layers.4.self_attn.k_norm.weight"


_GEMMA3_METADATA = {
    "general.architecture": "gemma3",
    "gemma3.block_count": 62,
    "gemma3.context_length": 131072,
    "gemma3.embedding_length": 5376,
    "gemma3.feed_forward_length": 21504,
    "gemma3.attention.head_count": 32,
    "gemma3.attention.head_count_kv": 16,
    "gemma3.attention.key_length": 128,
    "gemma3.attention.value_length": 128,
    "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
    "gemma3.rope.freq_base": 1_000_000.0,
    "gemma3.rope.scaling.type": "linear",
    "gemma3.rope.scaling.factor": 8.0,
    "gemma3.attention.sliding_window": 1024,
}
_SHAPES = {"token_embd.weight": (262208, 5376)}


def test_gemma3_27b_metadata_gives_its_hugging_face_config():
    """Gemma 3 27B's GGUF keys: the query scale hidden / heads = 168 (as its config.json), linear rope scaling
    on full layers only, the local base and the pattern llama.cpp assumes."""
    cfg = gemma.GemmaConfig.from_hf(hf_config_from_metadata(_GEMMA3_METADATA, _SHAPES))
    assert cfg.num_layers == 62 and cfg.head_dim == 128 and cfg.vocab_size == 262208
    kinds = [layer.sliding_window for layer in cfg.attention_layers]
    assert kinds[:6] == [1024] * 5 + [None] and kinds.count(None) == 10
    full, local = cfg.attention_layers[5], cfg.attention_layers[0]
    assert full.rope.variant == "linear" and full.rope.factor == 8.0 and full.rope.theta == 1_000_000.0
    assert local.rope.variant == "default" and local.rope.theta == 10_000.0
    assert full.sm_scale == local.sm_scale == pytest.approx(168**-0.5)
    assert cfg.final_logit_soft_cap is None


def test_gemma3_metadata_without_a_window_is_all_full_attention():
    metadata = {k: v for k, v in _GEMMA3_METADATA.items() if k != "gemma3.attention.sliding_window"}
    cfg = gemma.GemmaConfig.from_hf(hf_config_from_metadata(metadata | {"gemma3.block_count": 4}, _SHAPES))
    assert [layer.sliding_window for layer in cfg.attention_layers] == [None] * 4
    assert cfg.attention_layers[0].sm_scale == pytest.approx(128**-0.5)  # not the 27B's layer count


def test_gemma_value_length_must_equal_key_length():
    with pytest.raises(ValueError, match=r"gemma3.attention.value_length \(256\) must equal key_length \(128\)"):
        hf_config_from_metadata(_GEMMA3_METADATA | {"gemma3.attention.value_length": 256}, _SHAPES)
