"""GGUF files of the mixture-of-experts families: tiny random Qwen3-MoE, Qwen2-MoE (a shared expert) and Mixtral
models written the way llama.cpp's converter writes them (each layer's experts stacked into
`blk.N.ffn_{gate,up,down}_exps` [E, out, in], the router `ffn_gate_inp`, Qwen2-MoE's `*_shexp` tensors, Mixtral as
arch "llama" with q/k rows permuted and `llama.expert_count`), loaded by `load_model` and checked against
transformers' float32 logits to float32 rounding: of the model itself for F32 files, of the values the file holds
(each quantised tensor dequantised) for Q8_0, F16 and BF16 files. Also the config the metadata implies (every layer
sparse, the routing renormalisation llama.cpp assumes) and the errors for a missing or mis-shaped expert tensor."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file, save_file

from jaxserve.models import llama_moe
from jaxserve.models.files import ModelFileError
from jaxserve.models.gguf import hf_config_from_metadata, open_gguf
from jaxserve.models.loader import load_model

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

TOKENS = [3, 17, 42, 99, 5, 150, 8, 64, 1, 120, 33]
ROUTER_SCALE = 3.0  # router logits of a few units: decisive choices that differ from token to token

# GGUF arch -> (Hugging Face model_type, config overrides). Every layer sparse (GGUF cannot say otherwise); odd
# expert counts; Qwen3-MoE renormalises its top-k (what llama.cpp assumes), Qwen2-MoE does not.
FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen3moe": (
        "qwen3_moe",
        {
            "head_dim": 16,
            "num_experts": 7,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    "qwen2moe": (
        "qwen2_moe",
        {
            "num_experts": 5,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
        },
    ),
    "llama": ("mixtral", {"num_local_experts": 5, "num_experts_per_tok": 2, "intermediate_size": 40}),
}

# Hugging Face module -> llama.cpp tensor name part (gguf's tensor_mapping), besides the stacked experts.
_LAYER_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_GLOBAL_NAMES["lm_head.weight"] = "output.weight"


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute of q/k rows (each head's rotary halves interleaved)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


# Routers stay F32 in a quantised file, as llama.cpp keeps ffn_gate_inp (Hugging Face and GGUF names).
_ROUTERS = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".ffn_gate_inp.weight")


def quantised(name: str, array: np.ndarray, qtype: GGMLQuantizationType | None) -> bool:
    """Whether a tensor is stored as `qtype`: matrices whose rows divide into its blocks (the converter falls back to
    F32 for the others likewise), routers never."""
    if qtype is None or array.ndim < 2 or name.endswith(_ROUTERS):
        return False
    return array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0


def roundtrip(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)


def gguf_tensors(arch: str, config: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The GGUF tensors of a Hugging Face checkpoint of per-expert tensors, as llama.cpp's converter names them."""
    tensors, model_type = dict(tensors), FAMILIES[arch][0]
    num_experts = config.get("num_experts") or config["num_local_experts"]
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    out = {}
    for layer in range(config["num_hidden_layers"]):
        for projection in ("gate", "up", "down"):
            names = [llama_moe.expert_tensor_name(model_type, layer, e, projection) for e in range(num_experts)]
            out[f"blk.{layer}.ffn_{projection}_exps.weight"] = np.stack([tensors.pop(name) for name in names])
    for name, array in tensors.items():
        if name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[name]] = array
            continue
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if arch == "llama" and module.split(".")[-1] in heads:
            array = _permute(array, heads[module.split(".")[-1]])
        out[f"blk.{layer}.{_LAYER_PARTS[module]}.{kind}"] = array
    return out


@dataclass
class Case:
    arch: str
    hf_config: dict
    model: torch.nn.Module
    hf_tensors: dict[str, np.ndarray]  # what save_pretrained wrote, float32
    directory: Path
    write_gguf_named: Callable[..., Path]

    def dequantised(self, qtype: GGMLQuantizationType | None) -> dict[str, np.ndarray]:
        """The Hugging Face tensors as a `qtype` file holds them (rounding twice rounds as once)."""
        return {n: roundtrip(a, qtype) if quantised(n, a, qtype) else a for n, a in self.hf_tensors.items()}

    def write(self, name: str, qtype=None, *, drop: tuple[str, ...] = ()) -> Path:
        tensors = gguf_tensors(self.arch, self.hf_config, self.dequantised(qtype))
        stored = {k: (v, qtype if quantised(k, v, qtype) else None) for k, v in tensors.items() if k not in drop}
        return self.write_gguf_named(self.directory / name, self.arch, self.hf_config, stored)

    def dequantised_model(self, qtype: GGMLQuantizationType) -> torch.nn.Module:
        """transformers' model of the weights a `qtype` file holds."""
        directory = self.directory / f"hf_{qtype.name}"
        directory.mkdir()
        shutil.copy(self.directory / "hf" / "config.json", directory)
        save_file(self.dequantised(qtype), directory / "model.safetensors", metadata={"format": "pt"})
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager"
        )
        return model.eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory, tiny_hf_config, hf_model, write_gguf_named) -> Case:
    model_type, overrides = FAMILIES[request.param]
    config = tiny_hf_config(model_type, **overrides)
    model = hf_model(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(ROUTER_SCALE)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory / "hf")
    tensors = load_file(directory / "hf" / "model.safetensors")
    return Case(request.param, config, model, tensors, directory, write_gguf_named)


def test_f32_gguf_logits_equal_transformers(our_logits, hf_logits, case: Case) -> None:
    loaded = load_model(case.write("f32.gguf"), dtype="float32")
    cfg, hf = loaded.config, case.hf_config
    assert loaded.family is llama_moe and cfg.model_type == FAMILIES[case.arch][0]
    assert cfg.moe_layers == tuple(range(hf["num_hidden_layers"])) and not cfg.dense_layers
    experts = cfg.mlp_layers[0]
    assert experts.num_experts == (hf.get("num_experts") or hf["num_local_experts"])
    assert experts.top_k == hf["num_experts_per_tok"]
    assert experts.normalize_top_k == (case.arch != "qwen2moe")
    assert experts.shared_intermediate_size == hf.get("shared_expert_intermediate_size")
    assert_close(our_logits(loaded, TOKENS), hf_logits(case.model, TOKENS))


def assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    err = np.abs(ours.astype(np.float64) - ref).max()
    assert err <= 1e-5 * np.abs(ref).max(), f"max abs error {err} vs max |value| {np.abs(ref).max()}"


@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.F16, GGMLQuantizationType.BF16], ids=lambda q: q.name
)
def test_quantised_gguf_equals_transformers_on_its_values(
    our_logits, hf_logits, case: Case, qtype: GGMLQuantizationType
) -> None:
    loaded = load_model(case.write(f"{qtype.name}.gguf", qtype), dtype="float32")
    # The stacked experts come back as their per-expert rows, exactly as dequantised.
    up = case.hf_tensors[llama_moe.expert_tensor_name(FAMILIES[case.arch][0], 1, 2, "up")]
    assert not np.array_equal(roundtrip(up, qtype), up)
    np.testing.assert_array_equal(loaded.weights.experts.w_up[1, 2], roundtrip(up, qtype).T)
    # transformers running the values the file holds gives the same logits, to float32 rounding.
    assert_close(our_logits(loaded, TOKENS), hf_logits(case.dequantised_model(qtype), TOKENS))


def test_config_from_metadata(case: Case) -> None:
    checkpoint = open_gguf(case.write("config.gguf"))
    hf = checkpoint.hf_config
    assert hf["architectures"] == case.hf_config["architectures"]
    if case.arch == "llama":
        assert hf["num_local_experts"] == 5 and hf["intermediate_size"] == 40 and hf["sliding_window"] is None
    else:
        assert (hf["decoder_sparse_step"], hf["mlp_only_layers"]) == (1, [])
        assert hf["norm_topk_prob"] == (case.arch == "qwen3moe")
        assert hf["moe_intermediate_size"] == 32
    if case.arch == "qwen2moe":
        assert hf["shared_expert_intermediate_size"] == 48 and hf["qkv_bias"] is True


def test_missing_expert_tensor_is_named(case: Case) -> None:
    path = case.write("missing.gguf", drop=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(ModelFileError, match=r"lacks blk\.1\.ffn_up_exps\.weight: layer 1 of this \w+ file has no"):
        load_model(path, dtype="float32")


_QWEN3MOE = {
    "general.architecture": "qwen3moe",
    "qwen3moe.block_count": 2,
    "qwen3moe.context_length": 256,
    "qwen3moe.embedding_length": 64,
    "qwen3moe.attention.head_count": 4,
    "qwen3moe.attention.layer_norm_rms_epsilon": 1e-6,
    "qwen3moe.expert_count": 3,
    "qwen3moe.expert_used_count": 2,
}
_SHAPES = {"token_embd.weight": (160, 64)} | {
    f"blk.{i}.{part}.weight": shape
    for i in range(2)
    for part, shape in (
        ("ffn_gate_inp", (3, 64)),
        ("ffn_gate_exps", (3, 24, 64)),
        ("ffn_up_exps", (3, 24, 64)),
        ("ffn_down_exps", (3, 64, 24)),
    )
}


def test_expert_widths_default_to_the_tensors() -> None:
    hf = hf_config_from_metadata(_QWEN3MOE, _SHAPES)
    assert hf["moe_intermediate_size"] == 24 and hf["intermediate_size"] == 24 and hf["num_experts"] == 3
    assert llama_moe.MoeConfig.from_hf(hf).mlp_layers[1].intermediate_size == 24


def test_expert_count_must_match_the_stacked_tensors() -> None:
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_exps\.weight has shape \(3, 24, 64\), expected \[qwen3moe"):
        hf_config_from_metadata(_QWEN3MOE | {"qwen3moe.expert_count": 4}, _SHAPES)


def test_llama_with_experts_is_mixtral() -> None:
    metadata = {k.replace("qwen3moe", "llama"): v for k, v in _QWEN3MOE.items()} | {"general.architecture": "llama"}
    mixtral = hf_config_from_metadata(metadata, _SHAPES)
    assert mixtral["architectures"] == ["MixtralForCausalLM"] and mixtral["intermediate_size"] == 24
    dense = hf_config_from_metadata(metadata | {"llama.expert_count": 0, "llama.feed_forward_length": 96}, _SHAPES)
    assert dense["architectures"] == ["LlamaForCausalLM"] and dense["intermediate_size"] == 96
