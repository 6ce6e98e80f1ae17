"""GGUF checkpoints (llama.cpp's single-file format): config, tensors and tokenizer.

A GGUF file carries no config.json and no tokenizer.json: its metadata is both. This module turns
that metadata into a Hugging Face config dict (so the registry and the family's `from_hf` apply
unchanged) and into a transformers fast tokenizer, and streams the tensors dequantised to float32
under their Hugging Face names, so `jaxserve/models/loader.py` assembles them with the family's ordinary
checkpoint rules.

Three llama.cpp conventions are undone here:
  - ggml lists a tensor's dims fastest-moving first; the memory-mapped arrays (`GGUFTensor.data`, laid out as
    gguf's `GGUFReader` lays them out) are in row-major order, i.e. a Linear weight comes back as Hugging
    Face's [out, in];
  - for the "llama" architecture, `convert_hf_to_gguf.py` permutes the rows of q_proj and k_proj
    (per head, it interleaves the two rotary halves because llama.cpp's rope rotates adjacent
    pairs); we permute them back so the Hugging Face (half-split) rope applies. It permutes no
    other architecture's rows (Gemma's included);
  - for Gemma (1, 2 and 3) it adds 1 to every RMSNorm weight (llama.cpp's norm multiplies by w, Hugging
    Face's by 1 + w); we subtract it again.

Mixture-of-experts files (qwen2moe, qwen3moe, and llama with an `expert_count`: Mixtral) hold each layer's
experts stacked, `blk.N.ffn_{gate,up,down}_exps` of [E, out, in]; we split them into the per-expert tensors of a
Hugging Face checkpoint, which the MoE family's rules stack again. A GGUF cannot say that some layers are dense
(decoder_sparse_step, mlp_only_layers): every layer has experts, and each must hold its router and stacked experts
(and Qwen2-MoE's shared expert), or the file is refused naming the tensor and layer. Nor does it say whether the
top-k routing weights are renormalised: we assume what llama.cpp's graphs hard-code, yes for qwen3moe (Qwen3-MoE
releases set norm_topk_prob) and for Mixtral, no for qwen2moe (transformers' default for Qwen2-MoE).

Gemma files keep less than a config.json says; what they leave out is what llama.cpp itself assumes
(`llama-model.cpp`): the query scale head_dim ** -0.5 (hidden / heads for the 27B models), and for
Gemma 3 the local rope base 10000 and every 6th layer full (sliding layers only when the file names a
window). `_gemma_keys` supplies them as transformers' config keys.

Llama 3.x files store their rope scaling as a `rope_freqs.weight` tensor of per-frequency divisors
instead of metadata; we recover the "llama3" scaling parameters from it and check that they
reproduce the tensor exactly, and refuse the file otherwise.

Building the tokenizer does not go through `AutoTokenizer.from_pretrained(..., gguf_file=...)`:
that path imports torch (transformers' GGUF reader needs it). We hand the metadata to transformers' torch-free
GGUF tokenizer converter instead.

The header (metadata and tensor table) is read by `jaxserve.models.files.read_gguf_header`, which checks it
too, not by gguf's `GGUFReader`: that one builds numpy views of every string of a vocabulary, 3.9 s for
SmolLM2's 49,152 tokens and 16.9 s for Gemma 3's 262,144 on a 2-core CPU, where the header read takes 0.11 s
and 0.26 s (docs/performance.md, "On a CPU"). The `gguf` package still supplies the ggml types, their block
sizes and the dequantisation. The last two files read are kept: loading a model and then its tokenizer reads the
file once.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.models.files import ModelFileError, read_gguf_header

# general.architecture -> Hugging Face `architectures` name and `model_type`. llama.cpp converts
# Mistral 7B as "llama" and runs it with full attention; we read it the same way.
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma": ("GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# A "llama" file with llama.expert_count (llama.cpp converts Mixtral so).
_MIXTRAL = ("MixtralForCausalLM", "mixtral")
_MOE_ARCHITECTURES = frozenset({"qwen2moe", "qwen3moe"})
# Architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel and subclasses, e.g. Mistral).
_PERMUTED_ARCHITECTURES = frozenset({"llama"})

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2 and 3 norm each block's input and output: llama.cpp's ffn_norm is then the pre-MLP norm, and the
# norm after attention gets a tensor of its own (Gemma 1 is named as llama: post_attention_layernorm is
# its pre-MLP norm).
_POST_NORM_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# The routers and Qwen2-MoE's shared expert (the stacked experts split into many names: `_EXPERTS`).
_QWEN_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_ARCH_LAYER_NAMES = {
    "gemma2": _LAYER_NAMES | _POST_NORM_NAMES,
    "gemma3": _LAYER_NAMES | _POST_NORM_NAMES,
    "llama": _LAYER_NAMES | {"ffn_gate_inp": "block_sparse_moe.gate"},
    "qwen2moe": _LAYER_NAMES | _QWEN_MOE_NAMES,
    "qwen3moe": _LAYER_NAMES | _QWEN_MOE_NAMES,
}
# A layer's experts stacked on a leading E axis; each MoE layer holds the router and these, Qwen2-MoE also the
# shared expert's tensors.
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_EXPERT_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_SHARED_EXPERT_TENSORS = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
# Architectures whose norm weights llama.cpp's converter stores as 1 + w (its Gemma*Model.modify_tensors).
_SHIFTED_NORM_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})
# What llama.cpp assumes for Gemma 3 files (set_swa_pattern(6), rope_freq_base_train_swa = 10000), and the
# layer counts of the Gemma 2 / Gemma 3 27B models, whose query scale is hidden / heads instead of head_dim.
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_ROPE_FREQS = "rope_freqs.weight"
# The pretraining context and band limits every Llama 3.x conversion uses (convert_hf_to_gguf.py).
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# tokenizer.* metadata key -> the key transformers' GGUF tokenizer converter reads.
_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap",
    "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id",
    "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id",
    "ggml.add_space_prefix": "add_prefix_space",
}
_SPECIAL_TOKENS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
# End-of-generation ids llama.cpp stops on besides eos (Llama 3's <|eot_id|>, <|eom_id|>).
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_GEMMA_END_OF_TURN = "<end_of_turn>"


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of an architecture, e.g. blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight."""
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name):
        layer, part, kind = m.groups()
        names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    elif m := re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name):
        part, kind = m.groups()
        if part in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[part]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face name in jaxserve/models/gguf.py")


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `LlamaModel.permute` on q/k rows (or a q/k bias): [H*Dh, ...] in both."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of a GGUF file, as gguf's reader gives it: its dims innermost first (`shape`), its ggml type,
    and its bytes memory-mapped (`data`: typed for float and integer tensors, [..., bytes of a row] of uint8 for
    quantized ones, what `gguf.quants.dequantize` takes)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """A GGUF file's metadata (key -> str, int, float, bool or a list of them) and its tensors, memory-mapped."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


# ggml types stored as plain numpy values (gguf's reader gives these typed arrays; every other type as bytes).
_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16}
_PLAIN_TYPES |= {"I32": np.int32, "I64": np.int64}


def read_metadata(file: GGUFFile, *, skip_arrays: bool = True) -> dict[str, Any]:
    """Metadata key -> value; big arrays (the vocabulary) are left out unless asked for."""
    return {
        key: value
        for key, value in file.metadata.items()
        if not (skip_arrays and isinstance(value, list) and len(value) > 64)
    }


def gguf_reader(path: str | os.PathLike) -> GGUFFile:
    """A GGUF file's metadata and tensors (`GGUFFile`); read once per file version, so loading a model and then its
    tokenizer reads the header once."""
    path = Path(path).absolute()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _cached_reader(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFFile:
    """The header as `jaxserve.models.files.read_gguf_header` reads and checks it (gguf's own `GGUFReader` takes
    17 s over Gemma 3's vocabulary on a 2-core CPU), the tensors laid out as that reader lays them out."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    del mtime_ns, size  # part of the cache key only: a rewritten file is parsed again
    header = read_gguf_header(Path(path))
    data = np.memmap(path, mode="r")
    tensors = []
    for name, dims, type_id, offset in header.tensors:
        kind = GGMLQuantizationType(type_id)
        start = header.data_start + offset
        shape = tuple(reversed(dims))
        if kind.name in _PLAIN_TYPES:
            dtype = np.dtype(_PLAIN_TYPES[kind.name]).newbyteorder(header.byteorder)
            array = data[start : start + math.prod(dims) * dtype.itemsize].view(dtype).reshape(shape)
        else:
            block, type_bytes = GGML_QUANT_SIZES[kind]
            array = data[start : start + math.prod(dims) // block * type_bytes].reshape(
                quant_shape_to_byte_shape(shape, kind)
            )
        tensors.append(GGUFTensor(name, tuple(dims), kind, array))
    return GGUFFile(header.metadata, tensors)


@dataclass(slots=True)
class GGUFCheckpoint:
    """An open GGUF file: its Hugging Face config and a stream of its tensors under Hugging Face names."""

    path: Path
    hf_config: dict
    reader: GGUFFile

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(Hugging Face name, float32 array), one tensor dequantised at a time."""
        from gguf.quants import dequantize

        from jaxserve.models.llama_moe import expert_tensor_name

        arch = self.reader.metadata["general.architecture"]
        model_type = self.hf_config["model_type"]
        permuted = arch in _PERMUTED_ARCHITECTURES
        shifted_norms = arch in _SHIFTED_NORM_ARCHITECTURES
        heads = {"q": self.hf_config["num_attention_heads"], "k": self.hf_config["num_key_value_heads"]}
        for tensor in self.reader.tensors:
            if tensor.name == _ROPE_FREQS:
                continue  # already turned into hf_config["rope_scaling"]
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            if m := _EXPERTS.fullmatch(tensor.name):
                layer, projection = int(m.group(1)), m.group(2)
                for expert, matrix in enumerate(array):
                    yield expert_tensor_name(model_type, layer, expert, projection), matrix
                continue
            name = hf_tensor_name(tensor.name, arch)
            if tensor.name.endswith(".ffn_gate_inp_shexp.weight"):
                array = array.reshape(1, -1)  # Hugging Face's Linear(D, 1); a converter may have squeezed it to [D]
            if permuted and (m := re.search(r"\.attn_([qk])\.", tensor.name)):
                array = unpermute_rotary(array, heads[m.group(1)])
            if shifted_norms and tensor.name.endswith("norm.weight"):
                array = array - np.float32(1.0)
            yield name, array


def open_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Reads a GGUF file's metadata and tensor table (tensors stay memory-mapped until iterated)."""
    path = Path(path)
    reader = gguf_reader(path)
    metadata = read_metadata(reader)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    rope_freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    rope_divisors = None
    if rope_freqs is not None:
        from gguf.quants import dequantize

        rope_divisors = dequantize(rope_freqs.data, rope_freqs.tensor_type).astype(np.float32).reshape(-1)
    try:
        hf_config = hf_config_from_metadata(metadata, shapes, rope_divisors)
    except ValueError as e:
        raise ModelFileError(path, str(e)) from e
    return GGUFCheckpoint(path=path, hf_config=hf_config, reader=reader)


def hf_config_from_metadata(
    metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], rope_divisors: np.ndarray | None = None
) -> dict:
    """A Hugging Face config.json dict from GGUF metadata and the shapes of its tensors ([out, in] order)."""
    arch = metadata.get("general.architecture")
    if arch is None:
        raise ValueError("GGUF metadata lacks general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported GGUF architectures: "
            f"{', '.join(supported_architectures())}"
        )

    def key(name: str, default: Any = None, *, number: bool = False) -> Any:
        """A count (an int >= 1) or, with `number`, any number; checked here so errors name the GGUF key."""
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        if isinstance(value, bool) or not isinstance(value, (int, float) if number else int):
            raise ValueError(f"GGUF metadata {arch}.{name} must be {'a number' if number else 'an int'}, got {value!r}")
        if not number and value < 1:
            raise ValueError(f"GGUF metadata {arch}.{name} must be >= 1, got {value}")
        return value

    if "token_embd.weight" not in tensor_shapes:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    experts = arch in _MOE_ARCHITECTURES or (arch == "llama" and bool(metadata.get("llama.expert_count")))
    architecture, model_type = _MIXTRAL if arch == "llama" and experts else _ARCHITECTURES[arch]
    # An MoE file needs no dense width (no layer is dense), and the converter writes one only if config.json has it.
    ffn_default = _expert_width(metadata, arch, tensor_shapes) if experts else None
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        # The embedding's rows are the truth; tokenizer lists and vocab_size keys can disagree with it.
        "vocab_size": tensor_shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", ffn_default),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", number=True)),
        "rope_theta": float(key("rope.freq_base", 10000.0, number=True)),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    if arch in _SHIFTED_NORM_ARCHITECTURES:
        config |= _gemma_keys(metadata, arch, config, key)
    else:
        config["hidden_act"] = "silu"
    if experts:
        config |= _moe_keys(metadata, arch, config, key, tensor_shapes)
    rope_scaling = _rope_scaling(metadata, arch, config, rope_divisors)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _gemma_keys(metadata: dict, arch: str, config: dict, key: Any) -> dict:
    """The config keys of a Gemma file that the common ones leave out (see the module docstring)."""
    head_dim = config["head_dim"]
    value_length = key("attention.value_length", head_dim)
    if value_length != head_dim:
        raise ValueError(f"GGUF {arch}.attention.value_length ({value_length}) must equal key_length ({head_dim})")
    keys: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma":
        return keys
    large = config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    keys["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if large else head_dim
    window = metadata.get(f"{arch}.attention.sliding_window")
    if window is not None:
        keys["sliding_window"] = key("attention.sliding_window")
    final_cap = metadata.get(f"{arch}.final_logit_softcapping")
    if arch == "gemma2":
        # Gemma 2's converter always writes both soft-caps; llama.cpp defaults them (50, 30) as transformers does.
        keys["attn_logit_softcapping"] = float(key("attn_logit_softcapping", 50.0, number=True))
        keys["final_logit_softcapping"] = float(key("final_logit_softcapping", 30.0, number=True))
        return keys
    if final_cap is not None:
        keys["final_logit_softcapping"] = float(key("final_logit_softcapping", number=True))
    keys["rope_local_base_freq"] = float(key("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE, number=True))
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
    if window is None:  # the converter leaves the window out when no layer slides
        keys["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    elif isinstance(pattern, list):  # one flag per layer, True where it slides
        keys["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in pattern]
    else:
        keys["sliding_window_pattern"] = key("attention.sliding_window_pattern", _GEMMA3_SLIDING_WINDOW_PATTERN)
    return keys


def _moe_keys(metadata: dict, arch: str, config: dict, key: Any, shapes: dict[str, tuple[int, ...]]) -> dict:
    """The expert keys of an MoE file's config (see the module docstring), once every layer holds its experts."""
    num_experts = key("expert_count")
    top_k = key("expert_used_count")
    scale = metadata.get(f"{arch}.expert_weights_scale", 1.0)
    if scale not in (0.0, 1.0):  # llama.cpp reads 0 as no scaling
        raise ValueError(f"GGUF {arch}.expert_weights_scale {scale} is not supported (routing weights unscaled)")
    _check_expert_tensors(arch, config["num_hidden_layers"], num_experts, shapes)
    if arch == "llama":  # llama.cpp runs a llama file's experts at feed_forward_length, renormalised, full attention
        return {"num_local_experts": num_experts, "num_experts_per_tok": top_k, "sliding_window": None}
    keys = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": key("expert_feed_forward_length", _expert_width(metadata, arch, shapes)),
        "norm_topk_prob": arch == "qwen3moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch == "qwen2moe":
        shared = shapes["blk.0.ffn_up_shexp.weight"][0]  # [Fs, D], where the metadata leaves the width out
        keys["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length", shared)
        keys["qkv_bias"] = "blk.0.attn_q.bias" in shapes
    return keys


def _expert_width(metadata: dict, arch: str, shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The experts' hidden width: the metadata's, else the stacked tensors' ([E, F, D]; older files leave it out)."""
    up = shapes.get("blk.0.ffn_up_exps.weight")
    return metadata.get(f"{arch}.expert_feed_forward_length", None if up is None or len(up) != 3 else up[1])


def _check_expert_tensors(arch: str, num_layers: int, num_experts: int, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every layer of an MoE file holds its router and stacked experts (Qwen2-MoE: its shared expert too), each
    stack of expert_count experts."""
    parts = _EXPERT_TENSORS + (_SHARED_EXPERT_TENSORS if arch == "qwen2moe" else ())
    for layer in range(num_layers):
        for part in parts:
            name = f"blk.{layer}.{part}.weight"
            if name not in shapes:
                raise ValueError(
                    f"GGUF file lacks {name}: layer {layer} of this {arch} file has no {part} "
                    f"(every layer of a GGUF mixture of experts holds {', '.join(parts)})"
                )
            shape = shapes[name]
            if part.endswith("_exps") and (len(shape) != 3 or shape[0] != num_experts):
                raise ValueError(
                    f"GGUF tensor {name} has shape {shape}, expected [{arch}.expert_count = {num_experts}, out, in]"
                )


def _rope_scaling(metadata: dict, arch: str, config: dict, rope_divisors: np.ndarray | None) -> dict | None:
    """Hugging Face rope_scaling from the rope.scaling.* keys or a Llama 3 rope_freqs tensor; None if unscaled."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if rope_divisors is not None:
        if kind not in ("none", "llama3"):
            raise ValueError(f"GGUF file has both {_ROPE_FREQS} and rope.scaling.type {kind!r}")
        return llama3_rope_scaling(rope_divisors, config["rope_theta"], config["head_dim"])
    if kind == "none":
        return None
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        scaling = {"rope_type": "yarn", "factor": factor}
        return scaling if original is None else scaling | {"original_max_position_embeddings": int(original)}
    raise ValueError(f"GGUF {arch}.rope.scaling.type must be one of none, linear, yarn; got {kind!r}")


def llama3_divisors(theta: float, head_dim: int, factor: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as rope_freqs.weight for Llama 3 rope scaling."""
    low, high = _LLAMA3_ROPE["low_freq_factor"], _LLAMA3_ROPE["high_freq_factor"]
    original = _LLAMA3_ROPE["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(divisors, np.float32)


def llama3_rope_scaling(divisors: np.ndarray, theta: float, head_dim: int) -> dict:
    """Recovers Llama 3 rope_scaling from rope_freqs.weight; refuses a tensor those parameters do not reproduce."""
    factor = float(divisors.max())
    expected = llama3_divisors(theta, head_dim, factor)
    if divisors.shape != expected.shape or not np.allclose(divisors, expected, rtol=1e-5, atol=0):
        raise ValueError(
            f"GGUF {_ROPE_FREQS} does not match Llama 3 rope scaling with factor {factor} and {_LLAMA3_ROPE}; "
            "this rope variant is not supported"
        )
    return {"rope_type": "llama3", "factor": round(factor, 6), **_LLAMA3_ROPE}


def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether the GGUF file carries a tokenizer (a token list)."""
    return "tokenizer.ggml.tokens" in gguf_reader(path).metadata


def gguf_tokenizer(path: str | os.PathLike) -> tuple[Any, tuple[int, ...]]:
    """(transformers fast tokenizer, end-of-generation token ids) built from a GGUF file's metadata, without torch."""
    from transformers import PreTrainedTokenizerFast

    metadata = read_metadata(gguf_reader(path), skip_arrays=False)
    tokenizer_dict = {
        new: metadata[f"tokenizer.{old}"] for old, new in _TOKENIZER_KEYS.items() if f"tokenizer.{old}" in metadata
    }
    if "tokens" not in tokenizer_dict:
        raise ValueError(f"GGUF file {path} has no tokenizer.ggml.tokens: it carries no tokenizer")
    backend, extra = _convert_gguf_tokenizer()(metadata["general.architecture"], tokenizer_dict)
    tokens = tokenizer_dict["tokens"]
    special = {
        name: tokens[metadata[f"tokenizer.ggml.{key}_token_id"]]
        for name, key in _SPECIAL_TOKENS.items()
        if f"tokenizer.ggml.{key}_token_id" in metadata
    }
    # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", tokenizer_dict.get("tokenizer_type") == "llama")
    # Some transformers versions' converters also return special tokens (e.g. unk_token): the
    # file's own ids take precedence, and each keyword is passed once.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=metadata.get("tokenizer.chat_template"),
        add_bos_token=add_bos,
        add_eos_token=metadata.get("tokenizer.ggml.add_eos_token", False),
        **{**extra, **special},
    )
    eos_ids = [int(metadata[k]) for k in _EOS_KEYS if k in metadata]
    if metadata["general.architecture"] in _SHIFTED_NORM_ARCHITECTURES and _GEMMA_END_OF_TURN in tokens:
        eos_ids.append(
            tokens.index(_GEMMA_END_OF_TURN)
        )  # Gemma converters write no eot id (llama.cpp finds it by text)
    return tokenizer, tuple(dict.fromkeys(eos_ids))


def _convert_gguf_tokenizer() -> Any:
    """transformers' GGUF tokenizer converter: it moved between transformers 4 and 5."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        from transformers.integrations.ggml import convert_gguf_tokenizer
    return convert_gguf_tokenizer
