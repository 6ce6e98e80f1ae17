"""The dense decoder family: Llama (2, 3, 3.1, 3.2, SmolLM, TinyLlama), Mistral, Qwen2/2.5 and Qwen3.

One architecture with three flags: `attention_bias` (Qwen2's q/k/v bias), `qk_norm` (Qwen3's
RMSNorm of q and k over the head dim, before rope) and `sliding_window` (Mistral). Owns the config,
the weights dataclasses, their parameter specs, the Hugging Face checkpoint names, random init and
the forward pass; shared blocks come from `jaxserve/models/common.py`, attention from `jaxserve/models/attention.py`.

Two weight layouts:
- `LlamaWeights` is the checkpoint layout: one field per Hugging Face tensor kind, stacked on a
  leading L axis. Loaders, `init_weights` and users' parameter trees speak it.
- `ServingWeights` is what `forward` reads: one `ServingLayer` per decoder layer, each its own
  buffers, with q/k/v fused into one matrix and gate/up into another (`to_serving` converts).
  Slicing a layer out of stacked arrays inside the step copies its weights every step, and one wide
  GEMM per fused projection launches less and streams better than three or two narrow ones
  (docs/log/2026-benchmarks.md, "Layer layouts").

Einsum letters: t tokens, d model dim (D), h query heads (H), k kv heads (K), g query heads per kv
head (G = H / K) plus its key and value (G + 2), e head dim (Dh), f MLP hidden (F), c the gate/up pair,
v vocab (V).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.models.attention import AttentionMetadata, KVCache, add_norm, attention, rope_attention
from jaxserve.models.common import (
    CheckpointRule,
    ConfigKey,
    ParamSpec,
    RopeConfig,
    apply_rope,
    check_config_keys,
    delete_arrays,
    gated_mlp,
    rms_norm,
    rope_frequencies,
    serving_layers,
    split_qkv,
)
from jaxserve.models.layers import LayerAttention
from jaxserve.models.quant import linear, lm_head_spec, place_or_quantize, quantize_layer, quantize_layer_specs
from jaxserve.sharding.rules import layer_shardings

# Hugging Face defaults for keys a config.json may omit, per model_type.
_HF_DEFAULTS: dict[str, dict] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28, "head_dim": 128},
}
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_COUNT = ConfigKey("int", at_least=1)
_BOOL = ConfigKey("bool")
# The config.json keys `from_hf` reads (rope keys: `RopeConfig.from_hf`), checked before any is used.
_HF_KEYS = {
    **dict.fromkeys((*_REQUIRED_KEYS, "num_key_value_heads", "head_dim", "max_position_embeddings"), _COUNT),
    "rms_norm_eps": ConfigKey("number", above=0),
    "tie_word_embeddings": _BOOL,
    "attention_bias": _BOOL,
    "mlp_bias": _BOOL,
    "hidden_act": ConfigKey("str"),
    "model_type": ConfigKey("str"),
    "architectures": ConfigKey("str_list"),
}
# What `_sliding_window` reads, for the model types that have a window.
_WINDOW_KEYS = {
    "sliding_window": _COUNT,
    "use_sliding_window": _BOOL,
    "max_window_layers": ConfigKey("int", at_least=0),
    "layer_types": ConfigKey("str_list"),
}
# The Hugging Face architectures this family runs -> their model_type (the registry reads it both ways: a
# config names its architecture, or only its model_type, as transformers' `LlamaConfig(...)` leaves it).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Static model shape and flags; hashable, so it can be a jit static argument."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    attention_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be an even number >= 2 (rope rotates pairs), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be >= 1, got {self.max_position_embeddings}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None (full attention) or >= 1, got {self.sliding_window}")

    @property
    def attention_layers(self) -> tuple[LayerAttention, ...]:
        """Every layer alike: full attention, or Mistral's window on all of them."""
        layer = LayerAttention(rope=self.rope, sm_scale=self.head_dim**-0.5, sliding_window=self.sliding_window)
        return (layer,) * self.num_layers

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        """From a Hugging Face config.json dict of a llama, mistral, qwen2 or qwen3 model; a ValueError names
        the first key whose value is missing, of the wrong type or out of range."""
        check_config_keys(hf, _HF_KEYS, required=_REQUIRED_KEYS)
        model_type = _model_type(hf)
        # A null value means "the default", except for sliding_window, where null means full attention.
        hf = {**_HF_DEFAULTS[model_type], **{k: v for k, v in hf.items() if v is not None or k == "sliding_window"}}
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' for {model_type}, got {hf['hidden_act']!r}")
        if hf.get("mlp_bias", False):
            raise ValueError(f"mlp_bias must be false for {model_type}: MLP biases are not supported")
        if model_type in ("llama", "qwen3") and hf.get("attention_bias", False):
            raise ValueError(
                f"attention_bias must be false for {model_type}: its o_proj bias has no field in LayerWeights"
            )
        missing = [k for k in _REQUIRED_KEYS if k not in hf]
        if missing:
            raise ValueError(f"Hugging Face config lacks required keys {missing}")
        num_heads = hf["num_attention_heads"]
        max_positions = hf["max_position_embeddings"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads", num_heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf, max_position_embeddings=max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(hf, model_type),
            attention_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
        )


def _model_type(hf: dict) -> str:
    model_type = hf.get("model_type")
    if model_type is None:
        architectures = hf.get("architectures") or []
        model_type = next((ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None)
    if model_type not in _HF_DEFAULTS:
        raise ValueError(
            f"model_type must be one of {sorted(_HF_DEFAULTS)} for the llama family, "
            f"got {model_type!r} (architectures {hf.get('architectures')})"
        )
    return model_type


def _sliding_window(hf: dict, model_type: str) -> int | None:
    """One window for every layer, or None; per-layer mixes (Qwen2's max_window_layers) are rejected."""
    if model_type == "llama":
        return None  # Hugging Face Llama ignores any sliding_window key
    check_config_keys(hf, _WINDOW_KEYS)
    if model_type == "mistral":
        return hf.get("sliding_window")
    num_layers = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        kinds = set(hf["layer_types"])
    elif not hf.get("use_sliding_window", False):
        kinds = {"full_attention"}
    else:
        kinds = {"sliding_attention" if i >= hf["max_window_layers"] else "full_attention" for i in range(num_layers)}
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and hf.get("sliding_window"):
        return hf["sliding_window"]
    raise ValueError(
        f"layer_types / use_sliding_window / max_window_layers must give the same attention to every layer "
        f"(all full or all sliding with a sliding_window), got {sorted(kinds)} with sliding_window "
        f"{hf.get('sliding_window')}"
    )


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class LayerWeights:
    """Every decoder layer's weights in the checkpoint layout, stacked on a leading L axis."""

    attn_norm: Float[Array, "L D"]
    wq: Float[Array, "L D H Dh"]
    wk: Float[Array, "L D K Dh"]
    wv: Float[Array, "L D K Dh"]
    wo: Float[Array, "L H Dh D"]
    bq: Float[Array, "L H Dh"] | None
    bk: Float[Array, "L K Dh"] | None
    bv: Float[Array, "L K Dh"] | None
    q_norm: Float[Array, "L Dh"] | None
    k_norm: Float[Array, "L Dh"] | None
    mlp_norm: Float[Array, "L D"]
    w_gate: Float[Array, "L D F"]
    w_up: Float[Array, "L D F"]
    w_down: Float[Array, "L F D"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class LlamaWeights:
    """The whole model in the checkpoint layout; lm_head None means tied to embed."""

    embed: Float[Array, "V D"]
    layers: LayerWeights
    final_norm: Float[Array, " D"]
    lm_head: Float[Array, "D V"] | None


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class ServingLayer:
    """One decoder layer as `forward` reads it. wqkv groups by kv head: for each of the K kv heads its
    G query heads, then its key, then its value, so splitting K over devices gives each device whole
    groups (query head k * G + g reads kv head k, as in Hugging Face's repeat_kv)."""

    attn_norm: Float[Array, " D"]
    wqkv: Float[Array, "D K G+2 Dh"]
    bqkv: Float[Array, "K G+2 Dh"] | None
    q_norm: Float[Array, " Dh"] | None
    k_norm: Float[Array, " Dh"] | None
    wo: Float[Array, "H Dh D"]
    mlp_norm: Float[Array, " D"]
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
class ServingWeights:
    """The whole model in the serving layout; lm_head None means tied to embed."""

    embed: Float[Array, "V D"]
    layers: tuple[ServingLayer, ...]
    final_norm: Float[Array, " D"]
    lm_head: Float[Array, "D V"] | None


def param_specs(cfg: LlamaConfig) -> LlamaWeights:
    """The weights tree with a ParamSpec (shape, logical axes) at every leaf, None where a field is absent."""
    n_layers, d, f, v = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bias, qk_norm = cfg.attention_bias, cfg.qk_norm
    layers = LayerWeights(
        attn_norm=ParamSpec((n_layers, d), ("layers", "embed")),
        wq=ParamSpec((n_layers, d, h, dh), ("layers", "embed", "heads", "head_dim")),
        wk=ParamSpec((n_layers, d, k, dh), ("layers", "embed", "kv_heads", "head_dim")),
        wv=ParamSpec((n_layers, d, k, dh), ("layers", "embed", "kv_heads", "head_dim")),
        wo=ParamSpec((n_layers, h, dh, d), ("layers", "heads", "head_dim", "embed")),
        bq=ParamSpec((n_layers, h, dh), ("layers", "heads", "head_dim")) if bias else None,
        bk=ParamSpec((n_layers, k, dh), ("layers", "kv_heads", "head_dim")) if bias else None,
        bv=ParamSpec((n_layers, k, dh), ("layers", "kv_heads", "head_dim")) if bias else None,
        q_norm=ParamSpec((n_layers, dh), ("layers", "head_dim")) if qk_norm else None,
        k_norm=ParamSpec((n_layers, dh), ("layers", "head_dim")) if qk_norm else None,
        mlp_norm=ParamSpec((n_layers, d), ("layers", "embed")),
        w_gate=ParamSpec((n_layers, d, f), ("layers", "embed", "mlp")),
        w_up=ParamSpec((n_layers, d, f), ("layers", "embed", "mlp")),
        w_down=ParamSpec((n_layers, f, d), ("layers", "mlp", "embed")),
    )
    return LlamaWeights(
        embed=ParamSpec((v, d), ("vocab", "embed")),
        layers=layers,
        final_norm=ParamSpec((d,), ("embed",)),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((d, v), ("embed", "vocab")),
    )


def serving_specs(cfg: LlamaConfig, quantization: str | None = None, quantize_lm_head: bool = False) -> ServingWeights:
    """The serving layout with a ParamSpec at every leaf (the sharding rules split kv_heads, mlp, vocab); the
    linear weights as `quantization` stores them (`quant.Fp8Weight` of values and scale specs)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    groups = h // k + 2
    qk_norm = ParamSpec((dh,), ("head_dim",)) if cfg.qk_norm else None
    layer = ServingLayer(
        attn_norm=ParamSpec((d,), ("embed",)),
        wqkv=ParamSpec((d, k, groups, dh), ("embed", "kv_heads", None, "head_dim")),
        bqkv=ParamSpec((k, groups, dh), ("kv_heads", None, "head_dim")) if cfg.attention_bias else None,
        q_norm=qk_norm,
        k_norm=qk_norm,
        wo=ParamSpec((h, dh, d), ("heads", "head_dim", "embed")),
        mlp_norm=ParamSpec((d,), ("embed",)),
        w_gate_up=ParamSpec((d, 2, f), ("embed", None, "mlp")),
        w_down=ParamSpec((f, d), ("mlp", "embed")),
    )
    return ServingWeights(
        embed=ParamSpec((v, d), ("vocab", "embed")),
        layers=(quantize_layer_specs(layer, quantization),) * cfg.num_layers,
        final_norm=ParamSpec((d,), ("embed",)),
        lm_head=lm_head_spec(
            None if cfg.tie_word_embeddings else ParamSpec((d, v), ("embed", "vocab")), quantization, quantize_lm_head
        ),
    )


def to_serving(
    weights: LlamaWeights,
    cfg: LlamaConfig,
    shardings: ServingWeights | None = None,
    dtype: Any = None,
    replacing: ServingWeights | None = None,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> ServingWeights:
    """The serving layout of checkpoint-layout weights (numpy or jax arrays), placed with `shardings`
    (a tree of NamedSharding, or None for the default device) and cast to `dtype` (None: as they are), the
    linear weights quantized to `quantization` from their source values (None: not quantized).

    One layer at a time: host weights cross to the device layer by layer, and the device holds the
    serving copy plus one layer of the source at most (besides the source itself when it is on the
    device). Device weights may be laid out in any way, on any devices (a trainer's FSDP or tensor-
    parallel layout): each layer is first moved to the checkpoint layout the rules table gives on the
    serving mesh, so the fuser sees one input layout whatever the source's. `replacing`: serving weights
    whose buffers are deleted as their replacements are built (an update in place), so old and new
    copies coexist for one layer at a time."""
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

    return ServingWeights(top("embed"), layers, top("final_norm"), top("lm_head"))


@functools.lru_cache(maxsize=64)
def _layer_fuser(cfg: LlamaConfig, dtype: Any, shardings: ServingLayer | None, quantization: str | None) -> Any:
    """`_serving_layer` jitted once per (config, dtype, shardings, quantization): every layer and every later model
    of the same shape reuse one executable."""
    return jax.jit(partial(_serving_layer, cfg=cfg, dtype=dtype, quantization=quantization), out_shardings=shardings)


def fuse_qkv(
    layer: Any, cfg: LlamaConfig, cast: Any
) -> tuple[Float[Array, "D K G+2 Dh"], Float[Array, "K G+2 Dh"] | None]:
    """wqkv and bqkv (None without biases) of one layer's wq, wk, wv, bq, bk, bv (checkpoint layout, no L axis;
    `layer`: LayerWeights or another family's layer with those fields), grouped by kv head, through `cast`."""
    d, k, dh = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // k

    def grouped(q: Array, key: Array, value: Array, lead: tuple[int, ...]) -> Array:
        q = q.reshape(*lead, k, g, dh)
        return cast(jnp.concatenate([q, key[..., None, :], value[..., None, :]], axis=-2))

    bias = None if layer.bq is None else grouped(layer.bq, layer.bk, layer.bv, ())
    return grouped(layer.wq, layer.wk, layer.wv, (d,)), bias


def _serving_layer(layer: LayerWeights, cfg: LlamaConfig, dtype: Any, quantization: str | None) -> ServingLayer:
    """One layer's checkpoint-layout weights (no L axis) fused into a ServingLayer in `dtype`, its linear weights
    then quantized when `quantization` says (an 8-bit format from bf16 values: the bf16 rounding is far below
    e4m3's)."""
    cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    wqkv, bqkv = fuse_qkv(layer, cfg, cast)
    fused = ServingLayer(
        attn_norm=cast(layer.attn_norm),
        wqkv=wqkv,
        bqkv=bqkv,
        q_norm=None if layer.q_norm is None else cast(layer.q_norm),
        k_norm=None if layer.k_norm is None else cast(layer.k_norm),
        wo=cast(layer.wo),
        mlp_norm=cast(layer.mlp_norm),
        w_gate_up=cast(jnp.stack([layer.w_gate, layer.w_up], axis=1)),
        w_down=cast(layer.w_down),
    )
    return quantize_layer(fused, quantization)


def checkpoint_rules(cfg: LlamaConfig) -> list[CheckpointRule]:
    """Hugging Face tensor names -> weight fields; exactly the tensors this config's checkpoint holds."""
    layer = r"model\.layers\.(\d+)\."
    rules = [
        CheckpointRule(r"model\.embed_tokens\.weight", "embed"),
        CheckpointRule(r"model\.norm\.weight", "final_norm"),
        CheckpointRule(layer + r"input_layernorm\.weight", "layers.attn_norm"),
        CheckpointRule(layer + r"self_attn\.q_proj\.weight", "layers.wq", "linear"),
        CheckpointRule(layer + r"self_attn\.k_proj\.weight", "layers.wk", "linear"),
        CheckpointRule(layer + r"self_attn\.v_proj\.weight", "layers.wv", "linear"),
        CheckpointRule(layer + r"self_attn\.o_proj\.weight", "layers.wo", "linear"),
        CheckpointRule(layer + r"post_attention_layernorm\.weight", "layers.mlp_norm"),
        CheckpointRule(layer + r"mlp\.gate_proj\.weight", "layers.w_gate", "linear"),
        CheckpointRule(layer + r"mlp\.up_proj\.weight", "layers.w_up", "linear"),
        CheckpointRule(layer + r"mlp\.down_proj\.weight", "layers.w_down", "linear"),
    ]
    if cfg.attention_bias:
        rules += [CheckpointRule(layer + rf"self_attn\.{p}_proj\.bias", f"layers.b{p}") for p in "qkv"]
    if cfg.qk_norm:
        rules += [CheckpointRule(layer + rf"self_attn\.{p}_norm\.weight", f"layers.{p}_norm") for p in "qk"]
    if not cfg.tie_word_embeddings:
        rules.append(CheckpointRule(r"lm_head\.weight", "lm_head", "linear"))
    return rules


# Fan-in of each matrix: weights start at N(0, 1 / fan_in) so activations keep unit scale at any size.
def _fan_in(cfg: LlamaConfig, name: str) -> int:
    return {"wo": cfg.num_heads * cfg.head_dim, "w_down": cfg.intermediate_size}.get(name, cfg.hidden_size)


@partial(jax.jit, static_argnames=("cfg", "dtype"))
def init_weights(cfg: LlamaConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> LlamaWeights:
    """Random weights for tests and benchmarks: norms 1, biases 0, matrices N(0, 1/fan_in).

    Jitted, so each matrix is drawn straight into `dtype` without a float32 copy of the whole model.
    """
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(param_specs(cfg))
    keys = jax.random.split(key, len(leaves_with_paths))
    leaves = []
    for (path, spec), leaf_key in zip(leaves_with_paths, keys, strict=True):
        name = path[-1].name
        if name.endswith("norm"):
            leaves.append(jnp.ones(spec.shape, dtype))
        elif name in ("bq", "bk", "bv"):
            leaves.append(jnp.zeros(spec.shape, dtype))
        else:
            scale = _fan_in(cfg, name) ** -0.5
            leaves.append((jax.random.normal(leaf_key, spec.shape, jnp.float32) * scale).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def attention_block(
    layer: ServingLayer,
    x: Float[Array, "T D"],
    positions: Int[Array, " T"],
    cos: Float[Array, "T Dh/2"],
    sin: Float[Array, "T Dh/2"],
    kv_cache: KVCache,
    layer_index: Int[Array, ""],
    attn_meta: AttentionMetadata,
    cfg: LlamaConfig,
) -> tuple[Float[Array, "T D"], KVCache]:
    """Self-attention of one layer on the normed input x. `layer`: a ServingLayer, or another family's serving
    layer with its attention fields (wqkv, bqkv, q_norm, k_norm, wo: the MoE families' `MoeServingLayer`)."""
    qkv = linear("td,dkge->tkge", x, layer.wqkv)  # one GEMM for q, k and v
    if layer.bqkv is not None:
        qkv = qkv + layer.bqkv
    spec = cfg.attention_layers[0]
    options = dict(sm_scale=spec.sm_scale, sliding_window=spec.sliding_window)
    if layer.q_norm is None:
        out, kv_cache = rope_attention(qkv, cos, sin, positions, kv_cache, layer_index, attn_meta, **options)
    else:
        # Qwen3 normalises each head before rope, so rope sees unit-scale vectors.
        q, k, v = split_qkv(qkv)
        q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, kv_cache = attention(q, k, v, positions, kv_cache, layer_index, attn_meta, **options)
    return linear("the,hed->td", out, layer.wo), kv_cache


def forward(
    weights: ServingWeights,
    token_ids: Int[Array, " T"],
    positions: Int[Array, " T"],
    kv_cache: KVCache,
    attn_meta: AttentionMetadata,
    cfg: LlamaConfig,
) -> tuple[Float[Array, "T D"], KVCache]:
    """Final-normed hidden states of a flat token batch, and the cache with this batch's K/V written.

    A Python loop over the layers' own buffers: XLA reads each weight in place, and the identical
    layers share their compiled kernels and autotuning, so compile time stays close to a scan's. Each
    layer is one call of the jitted `decoder_layer`: jax traces and lowers it once per forward instead of
    once per layer (the layers' arguments have the same shapes), and XLA inlines the calls, so the
    executable is the one the layers' ops written out one after another would give."""
    x = jnp.take(weights.embed, token_ids, axis=0)
    cos, sin = rope_frequencies(cfg.rope, cfg.head_dim, positions)
    # Each residual add is fused with the norm that follows it: the MLP's, then the next layer's attention
    # norm (the final norm after the last layer).
    next_norms = [layer.attn_norm for layer in weights.layers[1:]] + [weights.final_norm]
    normed = rms_norm(x, weights.layers[0].attn_norm, cfg.rms_norm_eps)
    # The whole cache is threaded through (updated in place); each layer finds its part by index.
    for index, (layer, next_norm) in enumerate(zip(weights.layers, next_norms, strict=True)):
        x, normed, kv_cache = decoder_layer(
            layer, next_norm, x, normed, positions, cos, sin, kv_cache, jnp.int32(index), attn_meta, cfg
        )
    return normed, kv_cache


@partial(jax.jit, static_argnames=("cfg",))
def decoder_layer(
    layer: ServingLayer,
    next_norm: Float[Array, " D"],
    x: Float[Array, "T D"],
    normed: Float[Array, "T D"],
    positions: Int[Array, " T"],
    cos: Float[Array, "T Dh/2"],
    sin: Float[Array, "T Dh/2"],
    kv_cache: KVCache,
    layer_index: Int[Array, ""],
    attn_meta: AttentionMetadata,
    cfg: LlamaConfig,
) -> tuple[Float[Array, "T D"], Float[Array, "T D"], KVCache]:
    """One layer on the residual stream x and its normed copy: (x after the layer, x normed with
    next_norm, the cache with this layer's K/V written)."""
    eps = cfg.rms_norm_eps
    attn_out, kv_cache = attention_block(layer, normed, positions, cos, sin, kv_cache, layer_index, attn_meta, cfg)
    h, normed = add_norm(x, attn_out, layer.mlp_norm, eps, attn_meta)
    x, normed = add_norm(h, gated_mlp(normed, layer.w_gate_up, layer.w_down), next_norm, eps, attn_meta)
    return x, normed, kv_cache


def compute_logits(weights: ServingWeights, hidden: Float[Array, "T D"], cfg: LlamaConfig) -> Float[Array, "T V"]:
    """float32 logits; a tied model projects with the embedding matrix."""
    del cfg  # same signature as families that soft-cap their logits
    if weights.lm_head is None:
        return jnp.einsum("td,vd->tv", hidden, weights.embed, preferred_element_type=jnp.float32)
    return linear("td,dv->tv", hidden, weights.lm_head, out_dtype=jnp.float32)  # an Fp8Weight too
