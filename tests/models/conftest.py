"""Helpers for testing model families against Hugging Face transformers on tiny random configs.

Exposed as fixtures that return functions, so any test file under tests/models can use them:
  - `tiny_hf_config(family, **overrides) -> dict`: a config.json dict as transformers writes it;
  - `hf_model(hf_config) -> torch model`: float32, eager attention, every parameter random
    (norm weights and biases included, so a misplaced norm or bias changes the output);
  - `weights_from_state_dict(family_module, cfg, state_dict) -> weights`: applies the family's
    `checkpoint_rules` strictly (an unknown, duplicate or missing tensor fails the test);
  - `write_gguf(path, arch, hf_config, tensors, qtype=None, *, token_scores=False) -> path`: a GGUF file
    written with gguf's GGUFWriter the way llama.cpp's converter writes one (llama: q/k rows permuted;
    gemma, gemma2, gemma3: 1 added to every norm weight, Gemma's metadata keys);
  - `write_gguf_named(path, arch, hf_config, {gguf_name: (array, qtype)}) -> path`: the same file of tensors
    already named (and stacked, permuted) as llama.cpp names them;
  - `our_logits(loaded_model, token_ids)`, `hf_logits(torch_model, token_ids)`: one sequence's logits.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from jaxserve.models.attention import DenseAttentionMetadata, init_dense_cache
from jaxserve.models.common import ParamSpec

# hidden 64, 4 query heads sharing 2 kv heads, 2 layers, vocab 160: big enough for GQA, small to compile.
_TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "gemma": transformers.GemmaConfig,
    "gemma2": transformers.Gemma2Config,
    "gemma3_text": transformers.Gemma3TextConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "qwen2_moe": transformers.Qwen2MoeConfig,
    "mixtral": transformers.MixtralConfig,
}
_ARCHITECTURE_NAMES = {"gemma3_text": "Gemma3ForCausalLM"}


def make_tiny_hf_config(family: str, **overrides: Any) -> dict:
    config = _CONFIG_CLASSES[family](**{**_TINY, **overrides})
    config.architectures = [_ARCHITECTURE_NAMES.get(family, config.__class__.__name__.replace("Config", "ForCausalLM"))]
    return config.to_dict()


def make_hf_model(hf_config: dict, seed: int = 0) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(**hf_config)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            else:  # [out, in] or [V, D]: unit-scale outputs, so greedy argmaxes are not near-ties
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    return model


def _set_path(tree: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for name in parents:
        tree = tree.setdefault(name, {})
    tree[leaf] = value


def weights_from_hf_state_dict(family: Any, cfg: Any, state_dict: dict[str, torch.Tensor]) -> Any:
    """The family's weights from a Hugging Face state dict, through its checkpoint rules only."""
    rules = family.checkpoint_rules(cfg)
    specs = family.param_specs(cfg)
    if cfg.tie_word_embeddings:
        # torch's state_dict repeats the tied tensor; saved checkpoints leave it out.
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    pieces: dict[str, dict[int | None, np.ndarray]] = {}
    for name, tensor in state_dict.items():
        matches = [(rule, m) for rule in rules if (m := re.fullmatch(rule.pattern, name))]
        assert len(matches) == 1, f"tensor {name} matches {len(matches)} checkpoint rules"
        rule, match = matches[0]
        layer = int(match.group(1)) if match.groups() else None
        spec: ParamSpec = _get_path(specs, rule.field)
        array = tensor.detach().numpy()
        if rule.transform == "linear":
            array = array.T
        shape = spec.shape[1:] if layer is not None else spec.shape
        slot = pieces.setdefault(rule.field, {})
        assert layer not in slot, f"tensor {name} fills {rule.field} layer {layer} twice"
        slot[layer] = array.reshape(shape)
    tree: dict = {}
    for path, spec in _spec_paths(specs):
        slot = pieces.pop(path, None)
        assert slot is not None, f"no checkpoint tensor fills {path}"
        if None in slot:
            value = slot[None]
        else:
            assert sorted(slot) == list(range(spec.shape[0])), f"{path} has layers {sorted(slot)}"
            value = np.stack([slot[i] for i in range(spec.shape[0])])
        assert value.shape == spec.shape, f"{path}: {value.shape} != {spec.shape}"
        _set_path(tree, path, jnp.asarray(value))
    assert not pieces, f"rules fill fields absent from param_specs: {sorted(pieces)}"
    return _build(specs, tree)


def _get_path(tree: Any, path: str) -> Any:
    for name in path.split("."):
        tree = getattr(tree, name)
    return tree


def _spec_paths(specs: Any) -> list[tuple[str, ParamSpec]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(specs)
    return [(".".join(k.name for k in path), spec) for path, spec in leaves]


def _build(specs: Any, tree: dict) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(specs)
    values = [_get_dict_path(tree, [k.name for k in path]) for path, _ in leaves]
    return jax.tree_util.tree_unflatten(treedef, values)


def _get_dict_path(tree: dict, names: list[str]) -> Any:
    for name in names:
        tree = tree[name]
    return tree


# Hugging Face layer module -> llama.cpp tensor name part, as convert_hf_to_gguf.py names them.
_LAYER_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
# Gemma 2 and 3 (gguf's tensor_mapping): ffn_norm is the pre-MLP norm, each block's output norm has its own name.
_POST_NORM_PARTS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in fixed or hf_name == "lm_head.weight":
        return fixed.get(hf_name, "output.weight")
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    parts = _LAYER_PARTS | _POST_NORM_PARTS if arch in ("gemma2", "gemma3") else _LAYER_PARTS
    return f"blk.{layer}.{parts[part]}.{kind}"


def _rope(config: dict) -> dict:
    """The (full layers') rope of a config dict: `rope_parameters` (transformers 5) or rope_theta + rope_scaling."""
    params = config.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    return params or {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {})}


def _add_gemma_keys(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    """What convert_hf_to_gguf.py's Gemma*Model.set_gguf_parameters writes besides the common keys."""
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "gemma3" and config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config["sliding_window"])
    rope = _rope(config)
    if rope.get("rope_type", "default") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleaves each head's two rotary halves."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf_tensors(
    path: Path,
    arch: str,
    config: dict,
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]],
    *,
    token_scores: bool = False,
) -> Path:
    """A GGUF file of llama.cpp-named tensors, each stored as its qtype (None: F32), with the metadata
    llama.cpp's converter writes for `config` (the expert keys where it has experts, Gemma's keys for
    Gemma). token_scores: also write a score per token, from which transformers can build the tokenizer."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(_rope(config)["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch in _GEMMA_ARCHS:
        _add_gemma_keys(writer, arch, config)
    elif config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if config.get("num_experts") or config.get("num_local_experts"):
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in config:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(0x100 + i) for i in range(config["vocab_size"])])
    if token_scores:
        writer.add_token_scores([0.0] * config["vocab_size"])
    for name, (array, qtype) in tensors.items():
        array = np.ascontiguousarray(array, np.float32)
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_gguf(
    path: Path, arch: str, config: dict, tensors: dict[str, np.ndarray], qtype=None, *, token_scores: bool = False
) -> Path:
    """A GGUF file of Hugging Face-named tensors as llama.cpp's converter writes it (see the module docstring):
    matrices stored as `qtype`, the rest F32."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    named = {}
    for name, array in tensors.items():
        array = array.astype(np.float32)
        proj = name.split(".")[-2]
        if arch == "llama" and proj in heads:
            array = llama_cpp_permute(array, heads[proj])
        if arch in _GEMMA_ARCHS and name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # llama.cpp's norm multiplies by w, Gemma's by 1 + w
        named[gguf_name(name, arch)] = (array, qtype if array.ndim == 2 else None)
    return write_gguf_tensors(path, arch, config, named, token_scores=token_scores)


def dense_logits(loaded: Any, token_ids: list[int]) -> np.ndarray:
    """A loaded model's logits for one sequence, by the family's dense forward."""
    n = len(token_ids)
    cache = init_dense_cache(loaded.config, 1, n, loaded.weights.embed.dtype)
    meta = DenseAttentionMetadata(jnp.zeros(n, jnp.int32))
    weights = loaded.family.to_serving(loaded.weights, loaded.config)
    hidden, _ = loaded.family.forward(
        weights, jnp.asarray(token_ids, jnp.int32), jnp.arange(n, dtype=jnp.int32), cache, meta, loaded.config
    )
    return np.asarray(loaded.family.compute_logits(weights, hidden, loaded.config))


def torch_logits(model: torch.nn.Module, token_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def single_threaded_torch():
    """Tiny models gain nothing from torch's thread pool, and on shared CI cores its spinning threads
    slow Hugging Face generation tenfold; restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_hf_config() -> Callable[..., dict]:
    return make_tiny_hf_config


@pytest.fixture(scope="session")
def hf_model() -> Callable[..., torch.nn.Module]:
    return make_hf_model


@pytest.fixture(scope="session")
def weights_from_state_dict() -> Callable[..., Any]:
    return weights_from_hf_state_dict


@pytest.fixture(scope="session")
def write_gguf() -> Callable[..., Path]:
    return make_gguf


@pytest.fixture(scope="session")
def write_gguf_named() -> Callable[..., Path]:
    return write_gguf_tensors


@pytest.fixture(scope="session")
def our_logits() -> Callable[..., np.ndarray]:
    return dense_logits


@pytest.fixture(scope="session")
def hf_logits() -> Callable[..., np.ndarray]:
    return torch_logits
