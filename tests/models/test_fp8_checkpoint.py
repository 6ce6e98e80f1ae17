"""FP8 checkpoints as published, written small by the tests: transformers' `quant_method: "fp8"` with block-wise
`weight_scale_inv` and compressed-tensors' float-quantized weights with per-channel and per-tensor `weight_scale`
(and static `input_scale`s, dropped). Loaded, each linear weight equals its FP8 values times its scales exactly;
the model's logits equal transformers' on those dequantized weights; `LLM` serves such a checkpoint in FP8. Unknown
formats and missing or mis-shaped scales are errors that name them."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from jaxserve.models.files import ModelFileError
from jaxserve.models.fp8_checkpoint import dequantize
from jaxserve.models.loader import SafetensorsCheckpoint, load_model

TOKENS = [3, 17, 42, 99, 5, 150, 8, 64, 1, 120, 33]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (16, 32)  # rows, columns: the tiny model's 96 and 64 are not all multiples (partial blocks)


def _is_linear(name: str) -> bool:
    return name.split(".")[-2] in LINEAR and name.endswith(".weight")


def _fp8(array: np.ndarray) -> np.ndarray:
    return array.astype(ml_dtypes.float8_e4m3fn)


def _quantize_block(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    bo, bi = block
    out, inp = w.shape
    scale = np.zeros((-(-out // bo), -(-inp // bi)), np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = max(np.abs(w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi]).max() / 448, 1e-12)
    full = np.repeat(np.repeat(scale, bo, 0), bi, 1)[:out, :inp]
    return _fp8(w / full), scale


def _quantize_channel(w: np.ndarray, per_tensor: bool) -> tuple[np.ndarray, np.ndarray]:
    scale = np.abs(w).max(keepdims=True) / 448 if per_tensor else np.abs(w).max(axis=1, keepdims=True) / 448
    scale = scale.astype(np.float32)
    return _fp8(w / scale), scale.reshape(1) if per_tensor else scale


def write_fp8_checkpoint(
    directory: Path,
    config: dict,
    state: dict[str, np.ndarray],
    method: str,
    kv_scales: tuple[float, float] | None = None,
) -> dict:
    """The model's state dict as an FP8 checkpoint of `method` ("fp8", "ct_channel", "ct_tensor"), compressed-tensors
    ones with every layer's (k_scale, v_scale) when given (a kv_cache_scheme); returns the dequantized state dict
    the file holds (the KV scales not folded in)."""
    tensors, dequantized = {}, {}
    for name, w in state.items():
        if not _is_linear(name):
            tensors[name] = dequantized[name] = w
            continue
        if method == "fp8":
            values, scale = _quantize_block(w, BLOCK)
            tensors[name], tensors[name + "_scale_inv"] = values, scale
            dequantized[name] = dequantize(values, scale, BLOCK)
        else:
            values, scale = _quantize_channel(w, per_tensor=method == "ct_tensor")
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale"] = values, scale
            tensors[name.removesuffix("weight") + "input_scale"] = np.ones(1, np.float32)
            if kv_scales is not None and name.endswith("k_proj.weight"):  # calibrated scales, beside k_proj
                tensors[name.removesuffix("k_proj.weight") + "k_scale"] = np.full((), kv_scales[0], np.float32)
                tensors[name.removesuffix("k_proj.weight") + "v_scale"] = np.full((), kv_scales[1], np.float32)
            dequantized[name] = dequantize(values, scale, None)
    if method == "fp8":
        quant = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic"}
    else:
        strategy = "tensor" if method == "ct_tensor" else "channel"
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
        quant = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
            "ignore": ["lm_head"],
        }
        if kv_scales is not None:
            quant["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return dequantized


@pytest.fixture(scope="module")
def tiny(tiny_hf_config, hf_model):
    config = tiny_hf_config("llama")
    model = hf_model(config)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return config, model, state


@pytest.mark.parametrize("method", ["fp8", "ct_channel", "ct_tensor"])
def test_fp8_checkpoint_loads_its_values_times_its_scales(tmp_path, tiny, method, our_logits, hf_logits):
    config, model, state = tiny
    dequantized = write_fp8_checkpoint(tmp_path / method, config, state, method)
    loaded = load_model(tmp_path / method, dtype="float32")
    cfg = loaded.config
    q = dequantized["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(loaded.weights.layers.wq[1], q.T.reshape(cfg.hidden_size, cfg.num_heads, -1))
    np.testing.assert_array_equal(loaded.weights.layers.w_down[0], dequantized["model.layers.0.mlp.down_proj.weight"].T)
    assert not np.array_equal(q, state["model.layers.1.self_attn.q_proj.weight"])  # FP8 values, not the originals
    # transformers on the weights the file holds gives the same logits.
    with torch.no_grad():
        model.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in dequantized.items()})
        np.testing.assert_allclose(our_logits(loaded, TOKENS), hf_logits(model, TOKENS), rtol=1e-4, atol=1e-4)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})


def _logits_and_cache(loaded, token_ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A loaded model's logits for one sequence and the K and V it wrote (a float32 dense cache)."""
    import jax.numpy as jnp

    from jaxserve.models.attention import DenseAttentionMetadata, init_dense_cache

    n = len(token_ids)
    cache = init_dense_cache(loaded.config, 1, n, jnp.float32)
    weights = loaded.family.to_serving(loaded.weights, loaded.config)
    ids, positions = jnp.asarray(token_ids, jnp.int32), jnp.arange(n, dtype=jnp.int32)
    meta = DenseAttentionMetadata(jnp.zeros(n, jnp.int32))
    hidden, cache = loaded.family.forward(weights, ids, positions, cache, meta, loaded.config)
    logits = loaded.family.compute_logits(weights, hidden, loaded.config)
    return np.asarray(logits), np.asarray(cache.k), np.asarray(cache.v)


# Without q/k norms (Llama), with q/k/v biases (Qwen2), with per-head q/k norms (Qwen3; Gemma 3's multiply by 1 + w)
# and on an MoE model's attention (its config's base model has the q/k norms).
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3_text", "qwen3_moe"])
def test_kv_cache_scales_fold_into_the_attention_weights(tmp_path, tiny_hf_config, hf_model, family, hf_logits):
    """A kv_cache_scheme's k_scale / v_scale: the model computes what transformers computes on the dequantized
    weights (which ignores the scales), and the K and V it writes to the cache (what an FP8 cache stores in e4m3)
    are those of the same checkpoint without scales divided by k_scale and v_scale."""
    import transformers
    from safetensors.numpy import load_file

    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if family == "qwen3_moe" else {}
    config = tiny_hf_config(family, **extra)
    hf_model(config).save_pretrained(tmp_path / "hf", safe_serialization=True)  # the hub's tensor names
    state = load_file(tmp_path / "hf" / "model.safetensors")
    k_scale, v_scale = 0.37, 2.9
    dequantized = write_fp8_checkpoint(tmp_path / "scaled", config, state, "ct_channel", (k_scale, v_scale))
    write_fp8_checkpoint(tmp_path / "plain", config, state, "ct_channel")
    scaled = _logits_and_cache(load_model(tmp_path / "scaled", dtype="float32"), TOKENS)
    plain = _logits_and_cache(load_model(tmp_path / "plain", dtype="float32"), TOKENS)
    save_file({k: np.asarray(v, np.float32) for k, v in dequantized.items()}, tmp_path / "hf" / "model.safetensors")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    np.testing.assert_allclose(scaled[0], hf_logits(reference, TOKENS), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(scaled[1], plain[1] / k_scale, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(scaled[2], plain[2] / v_scale, rtol=1e-4, atol=1e-4)
    assert np.abs(plain[1]).max() > 0.1 and np.abs(plain[2]).max() > 0.1  # a cache worth comparing


def test_kv_scales_without_a_kv_cache_scheme_are_dropped(tmp_path, tiny):
    """Scale tensors in a checkpoint whose config declares no kv_cache_scheme are not folded (and no attention
    tensor waits for them): the weights are those of the checkpoint without them."""
    config, _, state = tiny
    write_fp8_checkpoint(tmp_path / "scaled", config, state, "ct_channel", (0.5, 0.25))
    path = tmp_path / "scaled" / "config.json"
    written = json.loads(path.read_text())
    del written["quantization_config"]["kv_cache_scheme"]
    path.write_text(json.dumps(written))
    write_fp8_checkpoint(tmp_path / "plain", config, state, "ct_channel")
    scaled = load_model(tmp_path / "scaled", dtype="float32").weights.layers
    plain = load_model(tmp_path / "plain", dtype="float32").weights.layers
    for field in ("wq", "wk", "wv", "wo"):
        np.testing.assert_array_equal(getattr(scaled, field), getattr(plain, field))


def test_half_a_kv_scale_pair_is_named(tmp_path, tiny):
    config, _, state = tiny
    write_fp8_checkpoint(tmp_path, config, state, "ct_channel", (0.5, 0.25))
    path = tmp_path / "model.safetensors"
    tensors = dict(SafetensorsCheckpoint(tmp_path).tensors())
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_scale is missing"):
        load_model(tmp_path, dtype="float32")


def _serve(directory: Path):
    """A small LLM over the checkpoint in `directory` (its quantization as the checkpoint says)."""
    from jaxserve import LLM, CompileConfig
    from jaxserve.bench import TokenIdTokenizer

    return LLM(
        str(directory),
        tokenizer=TokenIdTokenizer(),
        max_batch_size=2,
        max_seq_len=32,
        max_num_tokens=32,
        compile_config=CompileConfig(decode_batch_sizes=(2,), token_buckets=(32,), penalty_variants=False),
        show_progress=False,
    )


def test_llm_serves_an_fp8_checkpoint_in_fp8(tmp_path, tiny):
    config, _, state = tiny
    write_fp8_checkpoint(tmp_path, config, state, "fp8")
    llm = _serve(tmp_path)
    assert llm.config.quantization == "fp8"
    llm.close()


def _write(directory: Path, config: dict, tensors: dict[str, np.ndarray], quant: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize(
    "quant, message",
    [
        ({"quant_method": "awq", "bits": 4}, r"quant_method 'awq' is not supported"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}},
            },
            r"compressed-tensors format 'int-quantized' is not supported",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "channel"}}},
            },
            r"config group 'g' has 4-bit float weights",
        ),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size must be \[rows, columns\]"),
    ],
    ids=["awq", "int8", "fp4", "block"],
)
def test_unknown_formats_are_named(tmp_path, tiny, quant, message):
    config, _, state = tiny
    path = _write(tmp_path, config, state, quant)
    with pytest.raises(ModelFileError, match=message):
        load_model(path, dtype="float32")


def test_missing_and_misshapen_scales_are_named(tmp_path, tiny):
    config, _, state = tiny
    write_fp8_checkpoint(tmp_path / "ok", config, state, "fp8")
    tensors = dict(SafetensorsCheckpoint(tmp_path / "ok").tensors())  # the file's tensors, FP8 values as stored
    quant = json.loads((tmp_path / "ok" / "config.json").read_text())["quantization_config"]
    missing = dict(tensors)
    del missing["model.layers.0.mlp.up_proj.weight_scale_inv"]
    path = _write(tmp_path / "missing", config, missing, quant)
    with pytest.raises(ValueError, match=r"FP8 weight 'model.layers.0.mlp.up_proj.weight' has no .*weight_scale_inv"):
        load_model(path, dtype="float32")
    wrong = dict(tensors)
    wrong["model.layers.1.self_attn.o_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
    path = _write(tmp_path / "wrong", config, wrong, quant)
    with pytest.raises(
        ValueError, match=r"o_proj.weight: a \[64, 64\] weight with 16 x 32 blocks needs a \[4, 2\] scale"
    ):
        load_model(path, dtype="float32")


def test_a_scale_without_its_fp8_weight_is_named():
    from jaxserve.models.fp8_checkpoint import Fp8CheckpointFormat, dequantized_tensors

    stream = iter([("model.layers.0.mlp.up_proj.weight_scale_inv", np.ones((1, 1), np.float32))])
    with pytest.raises(ValueError, match=r"scale model.layers.0.mlp.up_proj.weight_scale_inv has no FP8 weight"):
        list(dequantized_tensors(stream, Fp8CheckpointFormat("fp8", (16, 32))))


def test_an_fp8_mixture_of_experts_checkpoint_loads_and_serves_its_experts_in_fp8(tmp_path, tiny_hf_config, hf_model):
    """A Qwen3-MoE FP8 checkpoint as the hub's FP8 releases are (every expert's projections block-quantized under
    their per-expert names, the router kept): its stacked expert weights equal those of the dequantized checkpoint
    written plainly, and `LLM` serves it with the linears and the expert stacks in FP8."""
    from safetensors.numpy import load_file

    from jaxserve.models import quant

    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
    config = tiny_hf_config("qwen3_moe", **extra)
    hf_model(config).save_pretrained(tmp_path / "hf", safe_serialization=True)
    state = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in state  # per-expert names, as published
    dequantized = write_fp8_checkpoint(tmp_path / "fp8", config, state, "fp8")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    save_file({k: np.asarray(v, np.float32) for k, v in dequantized.items()}, tmp_path / "plain" / "model.safetensors")
    fp8, plain = load_model(tmp_path / "fp8", dtype="float32"), load_model(tmp_path / "plain", dtype="float32")
    np.testing.assert_array_equal(fp8.weights.experts.w_down, plain.weights.experts.w_down)
    np.testing.assert_array_equal(fp8.weights.experts.w_gate, plain.weights.experts.w_gate)
    assert not np.array_equal(
        fp8.weights.experts.w_down[1, 3], state["model.layers.1.mlp.experts.3.down_proj.weight"].T
    )  # the FP8 values, not the originals
    llm = _serve(tmp_path / "fp8")
    try:
        assert llm.config.quantization == "fp8"
        mlp = llm.engine.runner.weights.arrays.layers[0].mlp
        assert isinstance(mlp.w_gate_up, quant.Fp8Experts) and isinstance(mlp.w_down, quant.Fp8Experts)
        assert len(llm.generate([TOKENS], use_tqdm=False)[0].outputs[0].token_ids) > 0
    finally:
        llm.close()
