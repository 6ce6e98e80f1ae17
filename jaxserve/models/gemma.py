"""The Gemma family: Gemma, Gemma 2 and Gemma 3 (text), as Hugging Face transformers computes them.

What sets it apart from the Llama family (`jaxserve/models/llama.py`, whose serving layout it shares in spirit):
- layers of two attention kinds, declared per layer (`GemmaConfig.attention_layers`): sliding-window layers
  and full layers, each kind with its own rope (Gemma 3: the global base with its scaling on full layers, the
  local base on sliding ones), from `layer_types` or each version's default pattern;
- the query scale `query_pre_attn_scalar ** -0.5`; Gemma 2's attention logit soft-cap (inside the kernels)
  and final logit soft-cap (in `compute_logits`, so before sampling and every logprob), each transformers'
  default when config.json omits it and none when it is null;
- RMSNorm times (1 + w), in float32; Gemma 2 and 3 norm each block's output too (four norms a layer);
- Gemma 3's q/k norm over the head dim before rope; the GELU-tanh gated MLP;
- the embedding multiplied by sqrt(hidden_size) rounded to the weights' dtype; tied embeddings.

Hugging Face ignores `attn_logit_softcapping` in Gemma 3 (its attention never passes it on); so does this.
Einsum letters as in llama.py: t tokens, d model dim, k kv heads, g query heads per kv head (+2: its key and
value), e head dim, h query heads, f MLP hidden, c the gate/up pair, v vocab.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.models.attention import AttentionMetadata, KVCache, attention, rope_attention
from jaxserve.models.common import (
    CheckpointRule,
    ConfigKey,
    ParamSpec,
    RopeConfig,
    apply_rope,
    check_config_keys,
    delete_arrays,
    rope_frequencies,
    serving_layers,
    split_qkv,
)
from jaxserve.models.layers import LayerAttention
from jaxserve.models.quant import linear, lm_head_spec, place_or_quantize, quantize_layer, quantize_layer_specs
from jaxserve.sharding.rules import layer_shardings

# The Hugging Face architectures this family runs -> their model_type. Gemma3ForConditionalGeneration is the
# multimodal checkpoint: its language model runs, its vision tower is skipped.
ARCHITECTURES = {
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
}
_VERSIONS = {"gemma": 1, "gemma2": 2, "gemma3_text": 3, "gemma3": 3}
# Every norm multiplies by (1 + w): what folding a factor into a norm weight must keep (fp8_checkpoint.py).
RMS_NORM_OFFSET = 1.0
# transformers' defaults for keys a config.json may omit, per version.
_DEFAULTS: dict[int, dict[str, Any]] = {
    1: {"max_position_embeddings": 8192, "head_dim": 256, "rope_theta": 10000.0},
    2: {
        "max_position_embeddings": 8192,
        "head_dim": 256,
        "rope_theta": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    3: {
        "max_position_embeddings": 131072,
        "head_dim": 256,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    },
}
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_COUNT = ConfigKey("int", at_least=1)
_BOOL = ConfigKey("bool")
_CAP = ConfigKey("number", above=0)
_HF_KEYS = {
    **dict.fromkeys((*_REQUIRED_KEYS, "num_key_value_heads", "head_dim", "max_position_embeddings"), _COUNT),
    **dict.fromkeys(("sliding_window", "sliding_window_pattern"), _COUNT),
    "rms_norm_eps": ConfigKey("number", above=0),
    "query_pre_attn_scalar": ConfigKey("number", above=0),
    "final_logit_softcapping": _CAP,
    "attn_logit_softcapping": _CAP,
    "rope_local_base_freq": ConfigKey("number", above=0),
    "layer_types": ConfigKey("str_list"),
    "tie_word_embeddings": _BOOL,
    "attention_bias": _BOOL,
    "use_bidirectional_attention": _BOOL,
    "hidden_act": ConfigKey("str"),
    "hidden_activation": ConfigKey("str"),
    "model_type": ConfigKey("str"),
    "text_config": ConfigKey("object"),
}
# Keys whose null is no cap rather than the version's default: transformers caps only when they are not None.
_NULL_MEANS_NONE = ("attn_logit_softcapping", "final_logit_softcapping")
_LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers maps the legacy "gelu" of Gemma configs to the tanh approximation, as the models were trained.
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    """Static model shape and per-layer attention; hashable, so it can be a jit static argument.

    version: 1, 2 or 3. attention_layers: one declaration per layer (window, rope, query scale, soft-cap).
    post_norms: the norms of the attention and MLP outputs (Gemma 2 and 3). qk_norm: Gemma 3's q/k norm.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_layers: tuple[LayerAttention, ...]
    version: int = 3
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    final_logit_soft_cap: float | None = None
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.version not in (1, 2, 3):
            raise ValueError(f"version must be 1, 2 or 3, got {self.version}")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be an even number >= 2 (rope rotates pairs), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if len(self.attention_layers) != self.num_layers:
            raise ValueError(
                f"attention_layers must declare each of the {self.num_layers} layers, got {len(self.attention_layers)}"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.final_logit_soft_cap is not None and not self.final_logit_soft_cap > 0:
            raise ValueError(f"final_logit_soft_cap must be None or > 0, got {self.final_logit_soft_cap}")

    @property
    def post_norms(self) -> bool:
        return self.version >= 2

    @property
    def qk_norm(self) -> bool:
        return self.version == 3

    @classmethod
    def from_hf(cls, hf: dict) -> GemmaConfig:
        """From a Hugging Face config.json dict of a gemma, gemma2, gemma3_text or gemma3 (multimodal: its
        `text_config`) model; a ValueError names the first key that is missing, of the wrong type or out of
        range."""
        check_config_keys(hf, {"model_type": _HF_KEYS["model_type"], "text_config": _HF_KEYS["text_config"]})
        model_type = hf.get("model_type") or next(
            (ARCHITECTURES[a] for a in hf.get("architectures") or [] if a in ARCHITECTURES), None
        )
        if model_type not in _VERSIONS:
            raise ValueError(f"model_type must be one of {sorted(_VERSIONS)} for the gemma family, got {model_type!r}")
        if model_type == "gemma3":
            text = hf.get("text_config")
            if text is None:
                raise ValueError("a gemma3 (multimodal) config needs 'text_config', the language model's config")
            hf, prefix = text, "text_config."
        else:
            prefix = ""
        version = _VERSIONS[model_type]
        try:
            return _from_hf(hf, version)
        except ValueError as e:
            raise ValueError(f"{prefix}{e}" if prefix and not str(e).startswith(prefix) else str(e)) from None


def _from_hf(hf: dict, version: int) -> GemmaConfig:
    check_config_keys(hf, _HF_KEYS, required=_REQUIRED_KEYS)
    # null means the version's default, except for the soft-caps (_NULL_MEANS_NONE).
    hf = {**_DEFAULTS[version], **{k: v for k, v in hf.items() if v is not None or k in _NULL_MEANS_NONE}}
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _ACTIVATIONS:
        raise ValueError(f"hidden_activation must be one of {_ACTIVATIONS} for Gemma, got {activation!r}")
    if hf.get("attention_bias", False):
        raise ValueError("attention_bias must be false for Gemma: attention biases are not supported")
    if hf.get("use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention must be false: bidirectional (embedding) models are not served")
    head_dim = hf["head_dim"]
    # Gemma 1 scales by head_dim ** -0.5; Gemma 2 and 3 by query_pre_attn_scalar ** -0.5.
    sm_scale = (hf["query_pre_attn_scalar"] if version >= 2 else head_dim) ** -0.5
    max_positions = hf["max_position_embeddings"]
    soft_cap = hf.get("attn_logit_softcapping") if version == 2 else None
    kinds = _layer_types(hf, version)
    ropes = _ropes(hf, version, max_positions)
    layers = tuple(
        LayerAttention(
            rope=ropes[kind],
            sm_scale=sm_scale,
            sliding_window=hf["sliding_window"] if kind == "sliding_attention" else None,
            soft_cap=soft_cap,
        )
        for kind in kinds
    )
    num_heads = hf["num_attention_heads"]
    return GemmaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads", num_heads),
        head_dim=head_dim,
        attention_layers=layers,
        version=version,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        final_logit_soft_cap=hf.get("final_logit_softcapping") if version >= 2 else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _layer_types(hf: dict, version: int) -> list[str]:
    """Each layer's kind: `layer_types` when given, else the version's pattern (Gemma: all full; Gemma 2:
    sliding, full, sliding, ...; Gemma 3: every `sliding_window_pattern`-th layer full, the others sliding)."""
    num_layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is not None:
        if len(kinds) != num_layers:
            raise ValueError(f"layer_types must have num_hidden_layers ({num_layers}) entries, got {len(kinds)}")
        unknown = sorted(set(kinds) - set(_LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types entries must be one of {_LAYER_TYPES}, got {unknown}")
        return list(kinds)
    if version == 1:
        return ["full_attention"] * num_layers
    pattern = 2 if version == 2 else hf["sliding_window_pattern"]
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _ropes(hf: dict, version: int, max_positions: int) -> dict[str, RopeConfig]:
    """The rope of each layer kind. Gemma 3: `rope_parameters` per kind (transformers >= 5), or the older
    `rope_theta` + `rope_scaling` for full layers and `rope_local_base_freq` for sliding ones."""
    params = hf.get("rope_parameters")
    if version == 3 and isinstance(params, dict) and set(params) & set(_LAYER_TYPES):
        ropes = {}
        for kind in _LAYER_TYPES:
            own = params.get(kind)
            if own is None:
                theta = hf["rope_theta"] if kind == "full_attention" else hf["rope_local_base_freq"]
                own = {"rope_type": "default", "rope_theta": theta}
            ropes[kind] = _rope({"rope_parameters": own}, f"rope_parameters.{kind}.", max_positions)
        return ropes
    full = _rope(hf, "", max_positions)
    if version < 3:
        return dict.fromkeys(_LAYER_TYPES, full)
    local = RopeConfig(theta=float(hf["rope_local_base_freq"]))
    return {"full_attention": full, "sliding_attention": local}


def _rope(hf: dict, prefix: str, max_positions: int) -> RopeConfig:
    keys = {k: hf[k] for k in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor") if k in hf}
    try:
        return RopeConfig.from_hf(keys, max_position_embeddings=max_positions)
    except ValueError as e:
        raise ValueError(f"{prefix}{e}") from None


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class GemmaLayerWeights:
    """Every decoder layer's weights in the checkpoint layout, stacked on a leading L axis. Norm weights are
    stored as checkpoints hold them (the norm multiplies by 1 + w). mlp_norm is the norm before the MLP
    (Gemma's post_attention_layernorm, Gemma 2/3's pre_feedforward_layernorm)."""

    attn_norm: Float[Array, "L D"]
    wq: Float[Array, "L D H Dh"]
    wk: Float[Array, "L D K Dh"]
    wv: Float[Array, "L D K Dh"]
    wo: Float[Array, "L H Dh D"]
    q_norm: Float[Array, "L Dh"] | None
    k_norm: Float[Array, "L Dh"] | None
    post_attn_norm: Float[Array, "L D"] | None
    mlp_norm: Float[Array, "L D"]
    post_mlp_norm: Float[Array, "L D"] | None
    w_gate: Float[Array, "L D F"]
    w_up: Float[Array, "L D F"]
    w_down: Float[Array, "L F D"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class GemmaWeights:
    """The whole model in the checkpoint layout; lm_head None means tied to embed (every released Gemma)."""

    embed: Float[Array, "V D"]
    layers: GemmaLayerWeights
    final_norm: Float[Array, " D"]
    lm_head: Float[Array, "D V"] | None


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class GemmaServingLayer:
    """One decoder layer as `forward` reads it: q/k/v fused and grouped by kv head (llama.ServingLayer's
    layout), gate/up fused."""

    attn_norm: Float[Array, " D"]
    wqkv: Float[Array, "D K G+2 Dh"]
    q_norm: Float[Array, " Dh"] | None
    k_norm: Float[Array, " Dh"] | None
    wo: Float[Array, "H Dh D"]
    post_attn_norm: Float[Array, " D"] | None
    mlp_norm: Float[Array, " D"]
    post_mlp_norm: Float[Array, " D"] | None
    w_gate_up: Float[Array, "D 2 F"]
    w_down: Float[Array, "F D"]

    LINEARS: ClassVar[dict[str, int]] = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}  # quant.quantize_linears
    LORA_MODULES: ClassVar[dict[str, tuple[str, ...]]] = {  # the modules each holds, for adapters (models/lora.py)
        "wqkv": ("q_proj", "k_proj", "v_proj"),
        "wo": ("o_proj",),
        "w_gate_up": ("gate_proj", "up_proj"),
        "w_down": ("down_proj",),
    }


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class GemmaServingWeights:
    embed: Float[Array, "V D"]
    layers: tuple[GemmaServingLayer, ...]
    final_norm: Float[Array, " D"]
    lm_head: Float[Array, "D V"] | None


def param_specs(cfg: GemmaConfig) -> GemmaWeights:
    """The weights tree with a ParamSpec (shape, logical axes) at every leaf, None where a field is absent."""
    n, d, f, v = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    norm = ParamSpec((n, d), ("layers", "embed"))
    head_norm = ParamSpec((n, dh), ("layers", "head_dim")) if cfg.qk_norm else None
    layers = GemmaLayerWeights(
        attn_norm=norm,
        wq=ParamSpec((n, d, h, dh), ("layers", "embed", "heads", "head_dim")),
        wk=ParamSpec((n, d, k, dh), ("layers", "embed", "kv_heads", "head_dim")),
        wv=ParamSpec((n, d, k, dh), ("layers", "embed", "kv_heads", "head_dim")),
        wo=ParamSpec((n, h, dh, d), ("layers", "heads", "head_dim", "embed")),
        q_norm=head_norm,
        k_norm=head_norm,
        post_attn_norm=norm if cfg.post_norms else None,
        mlp_norm=norm,
        post_mlp_norm=norm if cfg.post_norms else None,
        w_gate=ParamSpec((n, d, f), ("layers", "embed", "mlp")),
        w_up=ParamSpec((n, d, f), ("layers", "embed", "mlp")),
        w_down=ParamSpec((n, f, d), ("layers", "mlp", "embed")),
    )
    return GemmaWeights(
        embed=ParamSpec((v, d), ("vocab", "embed")),
        layers=layers,
        final_norm=ParamSpec((d,), ("embed",)),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((d, v), ("embed", "vocab")),
    )


def serving_specs(
    cfg: GemmaConfig, quantization: str | None = None, quantize_lm_head: bool = False
) -> GemmaServingWeights:
    """The serving layout with a ParamSpec at every leaf (the sharding rules split kv_heads, mlp, vocab); the
    linear weights as `quantization` stores them."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    norm = ParamSpec((d,), ("embed",))
    head_norm = ParamSpec((dh,), ("head_dim",)) if cfg.qk_norm else None
    layer = GemmaServingLayer(
        attn_norm=norm,
        wqkv=ParamSpec((d, k, h // k + 2, dh), ("embed", "kv_heads", None, "head_dim")),
        q_norm=head_norm,
        k_norm=head_norm,
        wo=ParamSpec((h, dh, d), ("heads", "head_dim", "embed")),
        post_attn_norm=norm if cfg.post_norms else None,
        mlp_norm=norm,
        post_mlp_norm=norm if cfg.post_norms else None,
        w_gate_up=ParamSpec((d, 2, f), ("embed", None, "mlp")),
        w_down=ParamSpec((f, d), ("mlp", "embed")),
    )
    return GemmaServingWeights(
        embed=ParamSpec((v, d), ("vocab", "embed")),
        layers=(quantize_layer_specs(layer, quantization),) * cfg.num_layers,
        final_norm=norm,
        lm_head=lm_head_spec(
            None if cfg.tie_word_embeddings else ParamSpec((d, v), ("embed", "vocab")), quantization, quantize_lm_head
        ),
    )


def to_serving(
    weights: GemmaWeights,
    cfg: GemmaConfig,
    shardings: GemmaServingWeights | None = None,
    dtype: Any = None,
    replacing: GemmaServingWeights | None = None,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> GemmaServingWeights:
    """The serving layout of checkpoint-layout weights, placed with `shardings` and cast to `dtype`, one layer
    at a time (`common.serving_layers`), the linear weights quantized to `quantization`; `replacing`: serving
    weights updated in place, as in llama.to_serving."""
    dtype = None if dtype is None else jnp.dtype(dtype)
    fuse = _layer_fuser(cfg, dtype, None if shardings is None else shardings.layers[0], quantization)
    source = None if shardings is None else layer_shardings(param_specs(cfg).layers, shardings.layers[0].attn_norm.mesh)
    layers = serving_layers(
        weights.layers, cfg.num_layers, fuse, source, None if replacing is None else replacing.layers
    )

    def top(name: str) -> Any:
        value, sharding = getattr(weights, name), getattr(shardings, name, None)
        placed = place_or_quantize(value, sharding, dtype, quantize_lm_head and name == "lm_head")
        if replacing is not None:
            delete_arrays(getattr(replacing, name))
        return placed

    return GemmaServingWeights(top("embed"), layers, top("final_norm"), top("lm_head"))


@functools.lru_cache(maxsize=64)
def _layer_fuser(cfg: GemmaConfig, dtype: Any, shardings: GemmaServingLayer | None, quantization: str | None) -> Any:
    return jax.jit(partial(_serving_layer, cfg=cfg, dtype=dtype, quantization=quantization), out_shardings=shardings)


def _serving_layer(
    layer: GemmaLayerWeights, cfg: GemmaConfig, dtype: Any, quantization: str | None
) -> GemmaServingLayer:
    """One layer's checkpoint-layout weights (no L axis) fused into a GemmaServingLayer, its linear weights then
    quantized when `quantization` says (llama._serving_layer)."""
    d, k, dh = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // k

    keep = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    q = layer.wq.reshape(d, k, g, dh)
    wqkv = jnp.concatenate([q, layer.wk[..., None, :], layer.wv[..., None, :]], axis=-2)
    fused = GemmaServingLayer(
        attn_norm=keep(layer.attn_norm),
        wqkv=keep(wqkv),
        q_norm=None if layer.q_norm is None else keep(layer.q_norm),
        k_norm=None if layer.k_norm is None else keep(layer.k_norm),
        wo=keep(layer.wo),
        post_attn_norm=None if layer.post_attn_norm is None else keep(layer.post_attn_norm),
        mlp_norm=keep(layer.mlp_norm),
        post_mlp_norm=None if layer.post_mlp_norm is None else keep(layer.post_mlp_norm),
        w_gate_up=keep(jnp.stack([layer.w_gate, layer.w_up], axis=1)),
        w_down=keep(layer.w_down),
    )
    return quantize_layer(fused, quantization)


# Hugging Face name prefixes of the language model: Gemma*ForCausalLM's, and Gemma3ForConditionalGeneration's
# as transformers >= 5 saves it and as the hub's earlier checkpoints have it.
_PREFIXES = {
    1: r"model\.",
    2: r"model\.",
    3: r"(?:model\.|model\.language_model\.|language_model\.model\.)",
}
# Tensors of a multimodal checkpoint that a text model does not read (the loader logs how many it skipped).
VISION_TENSORS = r"(?:model\.)?(?:vision_tower|multi_modal_projector)\..*"


def checkpoint_rules(cfg: GemmaConfig) -> list[CheckpointRule]:
    """Hugging Face tensor names -> weight fields; exactly the tensors this config's checkpoint holds."""
    top = _PREFIXES[cfg.version]
    layer = top + r"layers\.(\d+)\."
    rules = [
        CheckpointRule(top + r"embed_tokens\.weight", "embed"),
        CheckpointRule(top + r"norm\.weight", "final_norm"),
        CheckpointRule(layer + r"input_layernorm\.weight", "layers.attn_norm"),
        CheckpointRule(layer + r"self_attn\.q_proj\.weight", "layers.wq", "linear"),
        CheckpointRule(layer + r"self_attn\.k_proj\.weight", "layers.wk", "linear"),
        CheckpointRule(layer + r"self_attn\.v_proj\.weight", "layers.wv", "linear"),
        CheckpointRule(layer + r"self_attn\.o_proj\.weight", "layers.wo", "linear"),
        CheckpointRule(layer + r"mlp\.gate_proj\.weight", "layers.w_gate", "linear"),
        CheckpointRule(layer + r"mlp\.up_proj\.weight", "layers.w_up", "linear"),
        CheckpointRule(layer + r"mlp\.down_proj\.weight", "layers.w_down", "linear"),
    ]
    if cfg.post_norms:
        rules += [
            CheckpointRule(layer + r"post_attention_layernorm\.weight", "layers.post_attn_norm"),
            CheckpointRule(layer + r"pre_feedforward_layernorm\.weight", "layers.mlp_norm"),
            CheckpointRule(layer + r"post_feedforward_layernorm\.weight", "layers.post_mlp_norm"),
        ]
    else:
        rules.append(CheckpointRule(layer + r"post_attention_layernorm\.weight", "layers.mlp_norm"))
    if cfg.qk_norm:
        rules += [CheckpointRule(layer + rf"self_attn\.{p}_norm\.weight", f"layers.{p}_norm") for p in "qk"]
    if not cfg.tie_word_embeddings:
        rules.append(CheckpointRule(r"lm_head\.weight", "lm_head", "linear"))
    if cfg.version == 3:
        rules.append(CheckpointRule(VISION_TENSORS, "", "skip"))
    return rules


def _fan_in(cfg: GemmaConfig, name: str) -> int:
    return {"wo": cfg.num_heads * cfg.head_dim, "w_down": cfg.intermediate_size}.get(name, cfg.hidden_size)


@partial(jax.jit, static_argnames=("cfg", "dtype"))
def init_weights(cfg: GemmaConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> GemmaWeights:
    """Random weights for tests and benchmarks: norm weights N(0, 0.1) (the norm scales by 1 + w), matrices
    N(0, 1/fan_in), the embedding N(0, 1/D) (the forward scales it by sqrt(D))."""
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(param_specs(cfg))
    keys = jax.random.split(key, len(leaves_with_paths))
    leaves = []
    for (path, spec), leaf_key in zip(leaves_with_paths, keys, strict=True):
        name = path[-1].name
        scale = 0.1 if name.endswith("norm") else _fan_in(cfg, name) ** -0.5
        leaves.append((jax.random.normal(leaf_key, spec.shape, jnp.float32) * scale).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def rms_norm(x: Float[Array, "... D"], weight: Float[Array, " D"], eps: float) -> Float[Array, "... D"]:
    """Gemma's RMSNorm: float32 statistics, times (1 + w) in float32, then cast to x's dtype (where Llama casts
    before the weight)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _norm(x: Array, weight: Array | None, eps: float) -> Array:
    return x if weight is None else rms_norm(x, weight, eps)


def gelu_mlp(
    x: Float[Array, "T D"], w_gate_up: Float[Array, "D 2 F"], w_down: Float[Array, "F D"]
) -> Float[Array, "T D"]:
    """down(gelu_tanh(gate(x)) * up(x)), gate and up in one GEMM."""
    gate_up = linear("td,dcf->tcf", x, w_gate_up)
    return linear("tf,fd->td", jax.nn.gelu(gate_up[:, 0], approximate=True) * gate_up[:, 1], w_down)


def attention_block(
    layer: GemmaServingLayer,
    x: Float[Array, "T D"],
    positions: Int[Array, " T"],
    cos: Float[Array, "T Dh/2"],
    sin: Float[Array, "T Dh/2"],
    kv_cache: KVCache,
    layer_index: Int[Array, ""],
    attn_meta: AttentionMetadata,
    cfg: GemmaConfig,
    spec: LayerAttention,
) -> tuple[Float[Array, "T D"], KVCache]:
    """Self-attention of one layer on the normed input x, with the layer's declared options."""
    qkv = linear("td,dkge->tkge", x, layer.wqkv)
    options = dict(sm_scale=spec.sm_scale, sliding_window=spec.sliding_window, soft_cap=spec.soft_cap)
    if layer.q_norm is None:
        out, kv_cache = rope_attention(qkv, cos, sin, positions, kv_cache, layer_index, attn_meta, **options)
    else:
        q, k, v = split_qkv(qkv)
        q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, kv_cache = attention(q, k, v, positions, kv_cache, layer_index, attn_meta, **options)
    return linear("the,hed->td", out, layer.wo), kv_cache


def forward(
    weights: GemmaServingWeights,
    token_ids: Int[Array, " T"],
    positions: Int[Array, " T"],
    kv_cache: KVCache,
    attn_meta: AttentionMetadata,
    cfg: GemmaConfig,
) -> tuple[Float[Array, "T D"], KVCache]:
    """Final-normed hidden states of a flat token batch, and the cache with this batch's K/V written. A loop
    over the layers' own buffers, one jitted `decoder_layer` call each (llama.forward says why); layers of
    one attention kind share its trace."""
    embed = weights.embed
    # transformers multiplies by sqrt(D) rounded to the weights' dtype, in that dtype.
    x = jnp.take(embed, token_ids, axis=0) * jnp.asarray(math.sqrt(cfg.hidden_size), embed.dtype)
    rotations = {spec.rope: rope_frequencies(spec.rope, cfg.head_dim, positions) for spec in cfg.attention_layers}
    for index, (layer, spec) in enumerate(zip(weights.layers, cfg.attention_layers, strict=True)):
        cos, sin = rotations[spec.rope]
        x, kv_cache = decoder_layer(layer, x, positions, cos, sin, kv_cache, jnp.int32(index), attn_meta, cfg, spec)
    return rms_norm(x, weights.final_norm, cfg.rms_norm_eps), kv_cache


@partial(jax.jit, static_argnames=("cfg", "spec"))
def decoder_layer(
    layer: GemmaServingLayer,
    x: Float[Array, "T D"],
    positions: Int[Array, " T"],
    cos: Float[Array, "T Dh/2"],
    sin: Float[Array, "T Dh/2"],
    kv_cache: KVCache,
    layer_index: Int[Array, ""],
    attn_meta: AttentionMetadata,
    cfg: GemmaConfig,
    spec: LayerAttention,
) -> tuple[Float[Array, "T D"], KVCache]:
    """One layer on the residual stream: x + post_norm(attention(norm(x))), then the same with the MLP."""
    eps = cfg.rms_norm_eps
    normed = rms_norm(x, layer.attn_norm, eps)
    attn_out, kv_cache = attention_block(
        layer, normed, positions, cos, sin, kv_cache, layer_index, attn_meta, cfg, spec
    )
    x = x + _norm(attn_out, layer.post_attn_norm, eps)
    mlp_out = gelu_mlp(rms_norm(x, layer.mlp_norm, eps), layer.w_gate_up, layer.w_down)
    return x + _norm(mlp_out, layer.post_mlp_norm, eps), kv_cache


def compute_logits(weights: GemmaServingWeights, hidden: Float[Array, "T D"], cfg: GemmaConfig) -> Float[Array, "T V"]:
    """float32 logits (tied: the embedding matrix projects), soft-capped as cap * tanh(logits / cap) when the
    config has a final_logit_soft_cap, so sampling and every logprob see the capped values."""
    if weights.lm_head is None:
        logits = jnp.einsum("td,vd->tv", hidden, weights.embed, preferred_element_type=jnp.float32)
    else:
        logits = linear("td,dv->tv", hidden, weights.lm_head, out_dtype=jnp.float32)  # an Fp8Weight too
    cap = cfg.final_logit_soft_cap
    return logits if cap is None else jnp.tanh(logits / cap) * cap
