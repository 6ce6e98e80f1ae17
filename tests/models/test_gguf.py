"""GGUF loading: tiny random models written with gguf's GGUFWriter the way llama.cpp's converter writes
them (conftest's `write_gguf`: q/k rows permuted for llama, F32 and Q8_0), and the real default model
(SmolLM2-135M-Instruct, Q4_1) against transformers reading the same file."""

from __future__ import annotations

from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file

from jaxserve.models import hub
from jaxserve.models.convert import cached_conversion
from jaxserve.models.gguf import hf_config_from_metadata, hf_tensor_name, llama3_divisors, open_gguf
from jaxserve.models.loader import load_model

TOKENS = [3, 17, 42, 99, 5, 150, 8]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_hf_config, hf_model):
    config = tiny_hf_config("llama")
    model = hf_model(config)
    root = tmp_path_factory.mktemp("tiny_gguf")
    model.save_pretrained(root / "hf")
    return model, config, load_file(root / "hf" / "model.safetensors"), root


def test_hf_names():
    assert hf_tensor_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.2.attn_q_norm.weight") == "model.layers.2.self_attn.q_norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="GGUF tensor 'blk.0.ffn_gate_exps.weight' has no Hugging Face name"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_f32_llama_gguf_matches_transformers(our_logits, hf_logits, tiny, write_gguf):
    model, config, tensors, root = tiny
    path = write_gguf(root / "f32.gguf", "llama", config, tensors)
    checkpoint = open_gguf(path)
    assert checkpoint.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert checkpoint.hf_config["tie_word_embeddings"] is False and checkpoint.hf_config["vocab_size"] == 160
    loaded = load_model(path, dtype="float32")
    assert loaded.tokenizer_source == str(path)
    # q and k come back unpermuted: exactly Hugging Face's rows.
    cfg = loaded.config
    for field, proj, heads in (("wq", "q_proj", cfg.num_heads), ("wk", "k_proj", cfg.num_kv_heads)):
        expected = tensors[f"model.layers.1.self_attn.{proj}.weight"].T.reshape(cfg.hidden_size, heads, cfg.head_dim)
        np.testing.assert_array_equal(getattr(loaded.weights.layers, field)[1], expected)
    np.testing.assert_allclose(our_logits(loaded, TOKENS), hf_logits(model, TOKENS), rtol=1e-4, atol=1e-4)


def test_q8_0_llama_gguf_is_dequantised(our_logits, hf_logits, tiny, write_gguf):
    model, config, tensors, root = tiny
    path = write_gguf(root / "q8.gguf", "llama", config, tensors, qtype=GGMLQuantizationType.Q8_0)
    loaded = load_model(path, dtype="float32")
    # Q8_0 blocks run along a row, so permuting rows commutes with quantising them.
    q_proj = tensors["model.layers.0.self_attn.q_proj.weight"]
    roundtrip = gguf.quants.dequantize(
        gguf.quants.quantize(q_proj, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    )
    np.testing.assert_array_equal(loaded.weights.layers.wq[0], roundtrip.T.reshape(64, 4, 16))
    assert not np.array_equal(roundtrip, q_proj)
    np.testing.assert_allclose(our_logits(loaded, TOKENS), hf_logits(model, TOKENS), atol=0.1)


def test_qwen2_gguf_keeps_rows_and_biases(our_logits, hf_logits, tmp_path, tiny_hf_config, hf_model, write_gguf):
    config = tiny_hf_config("qwen2", tie_word_embeddings=True)
    model = hf_model(config)
    model.save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    loaded = load_model(write_gguf(tmp_path / "qwen2.gguf", "qwen2", config, tensors), dtype="float32")
    assert loaded.config.attention_bias and loaded.config.tie_word_embeddings and loaded.weights.lm_head is None
    np.testing.assert_array_equal(
        loaded.weights.layers.bk[1], tensors["model.layers.1.self_attn.k_proj.bias"].reshape(2, 16)
    )
    np.testing.assert_allclose(our_logits(loaded, TOKENS), hf_logits(model, TOKENS), rtol=1e-4, atol=1e-4)


_METADATA = {
    "general.architecture": "llama",
    "llama.block_count": 2,
    "llama.context_length": 131072,
    "llama.embedding_length": 512,
    "llama.feed_forward_length": 1024,
    "llama.attention.head_count": 8,
    "llama.attention.head_count_kv": 2,
    "llama.rope.freq_base": 500000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
}
_SHAPES = {"token_embd.weight": (1000, 512)}


def test_unsupported_architecture_is_named():
    with pytest.raises(
        ValueError,
        match="GGUF architecture 'falcon' is not supported; supported GGUF architectures: gemma, gemma2, gemma3, llama",
    ):
        hf_config_from_metadata(_METADATA | {"general.architecture": "falcon"}, _SHAPES)


def test_rope_scaling_metadata():
    assert "rope_scaling" not in hf_config_from_metadata(_METADATA, _SHAPES)
    linear = hf_config_from_metadata(
        _METADATA | {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, _SHAPES
    )
    assert linear["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    yarn = _METADATA | {
        "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 32768,
    }
    expected = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert hf_config_from_metadata(yarn, _SHAPES)["rope_scaling"] == expected


def test_llama3_rope_freqs_tensor_becomes_rope_scaling():
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    # Hugging Face's llama3 inverse frequencies, divided into the unscaled ones: what llama.cpp stores.
    hf = transformers.LlamaConfig(
        hidden_size=512,
        num_attention_heads=8,
        rope_theta=500000.0,
        rope_scaling=dict(rope),
        max_position_embeddings=131072,
    )
    scaled, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    default = 1.0 / 500000.0 ** (torch.arange(0, 64, 2).float() / 64)
    divisors = (default / scaled).numpy().astype(np.float32)
    np.testing.assert_allclose(llama3_divisors(500000.0, 64, 8.0), divisors, rtol=1e-6)
    config = hf_config_from_metadata(_METADATA, _SHAPES, divisors)
    assert config["rope_scaling"] == rope
    corrupted = divisors.copy()
    corrupted[16] *= 1.1
    with pytest.raises(ValueError, match="rope_freqs.weight does not match Llama 3 rope scaling"):
        hf_config_from_metadata(_METADATA, _SHAPES, corrupted)


# --- the real default model (93 MB download on a clean machine) --------------------------------


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return hub.resolve_model_source(hub.DEFAULT_MODEL).path


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(default_gguf):
    from jaxserve.dense import generate_dense
    from jaxserve.tokenizer import Tokenizer

    loaded = load_model(
        hub.DEFAULT_MODEL, dtype="float32"
    )  # from its conversion in the cache (jaxserve/models/convert.py)
    assert loaded.weights.embed.dtype == jnp.float32
    assert loaded.tokenizer_source == str(cached_conversion(default_gguf))
    tokenizer = Tokenizer.from_source(loaded.tokenizer_source)
    prompt = tokenizer.encode("The capital of France is")
    ours = generate_dense(loaded.family, loaded.config, loaded.weights, [prompt], 16)[0]

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert ours == theirs[0, len(prompt) :].tolist()
    assert "Paris" in tokenizer.decode(ours)


def _reader_value(field: gguf.ReaderField):
    """A metadata value as gguf's own reader gives it, as Python."""
    kind, parts = field.types, field.parts

    def scalar(part: np.ndarray, item: gguf.GGUFValueType):
        return bytes(part).decode("utf-8") if item == gguf.GGUFValueType.STRING else part.tolist()[0]

    if kind[0] == gguf.GGUFValueType.ARRAY:
        return [scalar(parts[i], kind[-1]) for i in field.data]
    return scalar(parts[field.data[0]], kind[0])


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_the_header_read_equals_ggufs_own_reader(tmp_path, endianess):
    """jaxserve reads GGUF headers itself (gguf's GGUFReader takes seconds over a vocabulary): every value type,
    arrays of them, strings that are not ASCII, and tensors of float, integer and quantized types in either byte
    order come out as gguf's reader gives them, values, types, shapes and bytes."""
    from jaxserve.models.gguf import gguf_reader

    path = tmp_path / f"{endianess.name.lower()}.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    writer.add_uint8("k.u8", 200)
    writer.add_int8("k.i8", -7)
    writer.add_uint16("k.u16", 60000)
    writer.add_int16("k.i16", -30000)
    writer.add_uint32("k.u32", 4_000_000_000)
    writer.add_int32("k.i32", -2_000_000_000)
    writer.add_float32("k.f32", 0.1)
    writer.add_uint64("k.u64", 2**63 + 5)
    writer.add_int64("k.i64", -(2**62))
    writer.add_float64("k.f64", 1e-300)
    writer.add_bool("k.bool", True)
    writer.add_string("k.str", "Grüße, 世界")
    writer.add_array("k.ints", [1, -2, 3])
    writer.add_array("k.floats", [0.5, -1.25])
    writer.add_array("k.bools", [True, False, True])
    writer.add_array("k.strs", ["a", "", "ß" * 300, "\n"])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.normal(size=(3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.normal(size=(2, 4, 6)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.normal(size=(4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8_0", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = gguf_reader(path), gguf.GGUFReader(path)
    expected = {key: _reader_value(field) for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert ours.metadata == expected
    for key, value in expected.items():  # ints stay ints, floats floats, bools bools
        got = ours.metadata[key]
        assert [type(v) for v in (got if isinstance(got, list) else [got])] == [
            type(v) for v in (value if isinstance(value, list) else [value])
        ], key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] == ["f32", "f16", "i32", "q8_0"]
    for got, want in zip(ours.tensors, theirs.tensors, strict=True):
        assert got.shape == tuple(want.shape.tolist()) and got.tensor_type == want.tensor_type, got.name
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape, got.name
        np.testing.assert_array_equal(got.data, want.data)
