"""The mixture-of-experts decoders of the Llama family: Mixtral, Qwen2-MoE and Qwen3-MoE.

Each is its dense counterpart of `jaxserve/models/llama.py` (Mistral, Qwen2, Qwen3: the same attention, norms,
embeddings and rope, read by `LlamaConfig.from_hf` and run by `llama.attention_block`) with some or all of its
MLPs replaced by a mixture of experts (`jaxserve/models/moe.py`). What differs between the three:
- Mixtral: every layer's MLP is a mixture of `num_local_experts`, top `num_experts_per_tok` renormalised; its
  tensors are `block_sparse_moe.gate` and `block_sparse_moe.experts.N.w1` (gate), `w3` (up), `w2` (down).
- Qwen3-MoE: q/k norm; `norm_topk_prob` renormalises the top-k or not; layer i has experts when
  (i + 1) % `decoder_sparse_step` == 0 and i is not in `mlp_only_layers`, else a dense MLP of `intermediate_size`.
- Qwen2-MoE: q/k/v biases (`qkv_bias`); Qwen3-MoE's layer rule; a shared expert of
  `shared_expert_intermediate_size` on every token, scaled by sigmoid(x . w) (`shared_expert_gate`).
`MoeConfig.mlp_layers` declares each layer's MLP (`models/layers.py`); the forward reads it at trace time.

Layouts: `MoeWeights` is the checkpoint layout: every layer's attention stacked [L, ...] (`AttentionWeights`, the
fields of llama.LayerWeights without the MLP), the dense layers' MLPs stacked over those layers and the expert
layers' over theirs (`moe.DenseWeights`, `moe.ExpertWeights` [Lm, E, ...]). The loader stacks the per-expert
tensors that `save_pretrained` writes (`model.layers.L.mlp.experts.N.gate_proj.weight`, ...) into [E, ...]; a
missing one names its layer and expert. `MoeServingWeights` is what `forward` reads: one `MoeServingLayer` per
layer, q/k/v fused as in llama.ServingLayer and its MLP in the serving layout of its kind.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.models import llama, moe
from jaxserve.models.attention import AttentionMetadata, KVCache, PagedAttentionMetadata, add_norm
from jaxserve.models.common import (
    CheckpointRule,
    ConfigKey,
    check_config_keys,
    delete_arrays,
    rms_norm,
    rope_frequencies,
    take_layer,
)
from jaxserve.models.layers import LayerAttention, LayerMlp
from jaxserve.models.llama import LlamaConfig
from jaxserve.models.quant import lm_head_spec, place_or_quantize, quantize_layer, quantize_layer_specs
from jaxserve.sharding.rules import Rules, layer_shardings

# The Hugging Face architectures this family runs -> their model_type.
ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# Each model type's dense counterpart in the llama family, whose config keys describe the same attention.
_DENSE_TYPES = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}
# transformers' defaults for keys a config.json may omit, where they differ from the dense counterpart's or it
# has none.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "sliding_window": None,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": {
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "qkv_bias": True,
    },
    "qwen3_moe": {
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
}
# The number of experts where config.json gives neither num_experts nor num_local_experts (transformers writes
# either: Qwen3-MoE's config class reads num_experts and writes num_local_experts).
_DEFAULT_EXPERTS = {"mixtral": 8, "qwen2_moe": 60, "qwen3_moe": 128}
_COUNT = ConfigKey("int", at_least=1)
# The config.json keys of the experts (the attention's: `LlamaConfig.from_hf`), checked before any is used.
_MOE_KEYS = {
    **dict.fromkeys(("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size"), _COUNT),
    **dict.fromkeys(("shared_expert_intermediate_size", "decoder_sparse_step"), _COUNT),
    "norm_topk_prob": ConfigKey("bool"),
    "qkv_bias": ConfigKey("bool"),
    "use_sliding_window": ConfigKey("bool"),
    "mlp_only_layers": ConfigKey("int_list"),
    "model_type": ConfigKey("str"),
    "architectures": ConfigKey("str_list"),
}
# Hugging Face names of an MoE layer's tensors: the block's module name and each expert's gate, up and down.
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
    "qwen2_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}


def expert_tensor_name(model_type: str, layer: int, expert: int, projection: str) -> str:
    """The Hugging Face name of one expert's gate, up or down weight (`projection`), e.g. mixtral, 3, 5, "up" ->
    model.layers.3.block_sparse_moe.experts.5.w3.weight: what a loader of stacked experts splits them into."""
    block, names = _EXPERT_NAMES[model_type]
    return f"model.layers.{layer}.{block}.experts.{expert}.{names[projection]}.weight"


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Static model shape; hashable, so it can be a jit static argument.

    base: the model without its experts, as its dense counterpart's config (attention, norms, embeddings, rope, and
    `intermediate_size`, the dense layers' MLP width). mlp_layers: each layer's MLP, dense or experts; every expert
    layer declares the same experts (they are stacked into one array). model_type: the Hugging Face model type,
    which names the checkpoint's tensors.
    """

    base: LlamaConfig
    mlp_layers: tuple[LayerMlp, ...]
    model_type: str = "qwen3_moe"

    def __post_init__(self) -> None:
        if self.model_type not in _EXPERT_NAMES:
            raise ValueError(f"model_type must be one of {sorted(_EXPERT_NAMES)}, got {self.model_type!r}")
        if len(self.mlp_layers) != self.base.num_layers:
            raise ValueError(
                f"mlp_layers must declare each of the {self.base.num_layers} layers, got {len(self.mlp_layers)}"
            )
        kinds = {mlp for mlp in self.mlp_layers if mlp.kind == "moe"}
        if len(kinds) > 1:
            raise ValueError(f"every expert layer must declare the same experts, got {sorted(map(str, kinds))}")
        widths = {mlp.intermediate_size for mlp in self.mlp_layers if mlp.kind == "dense"}
        if widths - {self.base.intermediate_size}:
            raise ValueError(f"dense layers must have base.intermediate_size, got widths {sorted(widths)}")

    vocab_size = property(lambda self: self.base.vocab_size)
    hidden_size = property(lambda self: self.base.hidden_size)
    num_layers = property(lambda self: self.base.num_layers)
    num_heads = property(lambda self: self.base.num_heads)
    num_kv_heads = property(lambda self: self.base.num_kv_heads)
    head_dim = property(lambda self: self.base.head_dim)
    rms_norm_eps = property(lambda self: self.base.rms_norm_eps)
    tie_word_embeddings = property(lambda self: self.base.tie_word_embeddings)

    @property
    def attention_layers(self) -> tuple[LayerAttention, ...]:
        return self.base.attention_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers with experts, in order: slot i of `MoeWeights.experts` is layer moe_layers[i]."""
        return moe.layers_of_kind(self.mlp_layers, "moe")

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers with a dense MLP, in order: slot i of `MoeWeights.dense` is layer dense_layers[i]."""
        return moe.layers_of_kind(self.mlp_layers, "dense")

    @classmethod
    def from_hf(cls, hf: dict) -> MoeConfig:
        """From a Hugging Face config.json dict of a mixtral, qwen2_moe or qwen3_moe model; a ValueError names the
        first key whose value is missing, of the wrong type or out of range."""
        check_config_keys(hf, _MOE_KEYS)
        model_type = hf.get("model_type") or next(
            (ARCHITECTURES[a] for a in hf.get("architectures") or [] if a in ARCHITECTURES), None
        )
        if model_type not in _DEFAULTS:
            raise ValueError(
                f"model_type must be one of {sorted(_DEFAULTS)} for the MoE family, got {model_type!r} "
                f"(architectures {hf.get('architectures')})"
            )
        # null means the default, except for sliding_window, where null means full attention.
        hf = {**_DEFAULTS[model_type], **{k: v for k, v in hf.items() if v is not None or k == "sliding_window"}}
        return cls(base=_base_config(hf, model_type), mlp_layers=_mlp_layers(hf, model_type), model_type=model_type)


def _base_config(hf: dict, model_type: str) -> LlamaConfig:
    """The dense counterpart's config of the attention, norms and embeddings."""
    dense = {k: v for k, v in hf.items() if k != "architectures"}
    dense["model_type"] = _DENSE_TYPES[model_type]
    if model_type == "qwen3_moe":
        # Qwen3-MoE has no head_dim default of its own (transformers: hidden_size // num_attention_heads), and its
        # window, when on, applies to every layer (it has no max_window_layers).
        if "head_dim" not in dense and "hidden_size" in dense and "num_attention_heads" in dense:
            dense["head_dim"] = dense["hidden_size"] // dense["num_attention_heads"]
        dense.pop("layer_types", None)
        dense["max_window_layers"] = 0
    if model_type == "qwen2_moe" and dense.get("sliding_window") == 0:
        del dense["sliding_window"]  # transformers writes 0 where use_sliding_window is off
    base = LlamaConfig.from_hf(dense)
    if model_type == "qwen2_moe":
        base = dataclasses.replace(base, attention_bias=hf["qkv_bias"])
    return base


def _mlp_layers(hf: dict, model_type: str) -> tuple[LayerMlp, ...]:
    """Each layer's MLP, as transformers builds the model's decoder layers."""
    num_layers = hf["num_hidden_layers"]
    counts = {hf[k] for k in ("num_experts", "num_local_experts") if k in hf} or {_DEFAULT_EXPERTS[model_type]}
    if len(counts) > 1:
        raise ValueError(f"num_experts and num_local_experts differ: {hf['num_experts']} and {hf['num_local_experts']}")
    (num_experts,) = counts
    top_k = hf["num_experts_per_tok"]
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok must be <= the number of experts ({num_experts}), got {top_k}")
    if model_type == "mixtral":
        return (LayerMlp(hf["intermediate_size"], num_experts, top_k, normalize_top_k=True),) * num_layers
    shared = hf["shared_expert_intermediate_size"] if model_type == "qwen2_moe" else None
    experts = LayerMlp(hf["moe_intermediate_size"], num_experts, top_k, hf["norm_topk_prob"], shared)
    dense_only = hf.get("mlp_only_layers", [])
    outside = [i for i in dense_only if not 0 <= i < num_layers]
    if outside:
        raise ValueError(f"mlp_only_layers must hold layer indices in [0, {num_layers}), got {outside}")
    step = hf["decoder_sparse_step"]
    dense = LayerMlp(hf["intermediate_size"])
    return tuple(experts if i not in dense_only and (i + 1) % step == 0 else dense for i in range(num_layers))


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class AttentionWeights:
    """Every layer's attention and norms in the checkpoint layout, stacked on a leading L axis: llama.LayerWeights
    without its MLP (declared there: `param_specs` copies those fields' specs)."""

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


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class MoeWeights:
    """The whole model in the checkpoint layout. dense: the dense layers' MLPs (None when every layer has experts);
    experts: the expert layers' (None when none has); lm_head None means tied to embed."""

    embed: Float[Array, "V D"]
    layers: AttentionWeights
    dense: moe.DenseWeights | None
    experts: moe.ExpertWeights | None
    final_norm: Float[Array, " D"]
    lm_head: Float[Array, "D V"] | None


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class MoeServingLayer:
    """One decoder layer as `forward` reads it: llama.ServingLayer's attention fields, and its MLP (its kind's
    serving layout)."""

    attn_norm: Float[Array, " D"]
    wqkv: Float[Array, "D K G+2 Dh"]
    bqkv: Float[Array, "K G+2 Dh"] | None
    q_norm: Float[Array, " Dh"] | None
    k_norm: Float[Array, " Dh"] | None
    wo: Float[Array, "H Dh D"]
    mlp_norm: Float[Array, " D"]
    mlp: moe.DenseMlp | moe.ExpertMlp

    LINEARS: ClassVar[dict[str, int]] = {"wqkv": 1, "wo": 2}  # and the MLP's own (quant.quantize_linears)
    # Adapters target the attention's projections (models/lora.py); an MLP's (a dense layer's, the experts') are not
    # served with adapters.
    LORA_MODULES: ClassVar[dict[str, tuple[str, ...]]] = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",)}


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class MoeServingWeights:
    """The whole model in the serving layout; lm_head None means tied to embed."""

    embed: Float[Array, "V D"]
    layers: tuple[MoeServingLayer, ...]
    final_norm: Float[Array, " D"]
    lm_head: Float[Array, "D V"] | None


_ATTENTION_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionWeights))
_SERVING_ATTENTION_FIELDS = tuple(f.name for f in dataclasses.fields(MoeServingLayer) if f.name != "mlp")


def param_specs(cfg: MoeConfig) -> MoeWeights:
    """The weights tree with a ParamSpec (shape, logical axes) at every leaf, None where a field is absent."""
    dense = llama.param_specs(cfg.base)
    d, moe_layers, dense_layers = cfg.hidden_size, cfg.moe_layers, cfg.dense_layers
    return MoeWeights(
        embed=dense.embed,
        layers=AttentionWeights(**{name: getattr(dense.layers, name) for name in _ATTENTION_FIELDS}),
        dense=moe.dense_specs(len(dense_layers), d, cfg.base.intermediate_size) if dense_layers else None,
        experts=moe.expert_specs(len(moe_layers), d, cfg.mlp_layers[moe_layers[0]]) if moe_layers else None,
        final_norm=dense.final_norm,
        lm_head=dense.lm_head,
    )


def serving_specs(cfg: MoeConfig, quantization: str | None = None, quantize_lm_head: bool = False) -> MoeServingWeights:
    """The serving layout with a ParamSpec at every leaf (the rules table splits kv_heads, mlp, experts, vocab); the
    linear weights and expert stacks as `quantization` stores them."""
    dense = llama.serving_specs(cfg.base)
    attention = {name: getattr(dense.layers[0], name) for name in _SERVING_ATTENTION_FIELDS}
    layers = tuple(
        quantize_layer_specs(MoeServingLayer(**attention, mlp=moe.mlp_specs(cfg.hidden_size, mlp)), quantization)
        for mlp in cfg.mlp_layers
    )
    lm_head = lm_head_spec(dense.lm_head, quantization, quantize_lm_head)
    return MoeServingWeights(dense.embed, layers, dense.final_norm, lm_head)


def to_serving(
    weights: MoeWeights,
    cfg: MoeConfig,
    shardings: MoeServingWeights | None = None,
    dtype: Any = None,
    replacing: MoeServingWeights | None = None,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> MoeServingWeights:
    """The serving layout of checkpoint-layout weights, placed with `shardings` and cast to `dtype`, one layer at a
    time, the linear weights quantized to `quantization` (llama.to_serving says why and how; `replacing`: serving
    weights updated in place)."""
    dtype = None if dtype is None else jnp.dtype(dtype)
    specs = param_specs(cfg)
    on_device = all(isinstance(w, jax.Array) for w in jax.tree.leaves(weights))
    mesh = None if shardings is None else shardings.layers[0].attn_norm.mesh
    # Each layer's source: its attention, and its MLP's slot in its kind's stack (`source`: their shardings in the
    # checkpoint layout on the serving mesh, as llama.to_serving moves each layer to first).
    stacks = {"moe": ("experts", cfg.moe_layers), "dense": ("dense", cfg.dense_layers)}
    present = [name for name in ("layers", "experts", "dense") if getattr(specs, name) is not None]
    source = None if mesh is None else {name: layer_shardings(getattr(specs, name), mesh) for name in present}
    layers = []
    for i, mlp in enumerate(cfg.mlp_layers):
        name, indices = stacks[mlp.kind]
        part = (_layer(weights.layers, i, on_device), _layer(getattr(weights, name), indices.index(i), on_device))
        if source is not None:
            part = jax.device_put(part, (source["layers"], source[name]))
        fuse = _layer_fuser(cfg.base, dtype, None if shardings is None else shardings.layers[i], quantization)
        layers.append(jax.block_until_ready(fuse(*part)))  # one layer in flight at a time: common.serving_layers
        if replacing is not None:
            delete_arrays(replacing.layers[i])

    def top(name: str) -> Any:
        value, sharding = getattr(weights, name), getattr(shardings, name, None)
        placed = place_or_quantize(value, sharding, dtype, quantize_lm_head and name == "lm_head")
        if replacing is not None:
            delete_arrays(getattr(replacing, name))
        return placed

    return MoeServingWeights(top("embed"), tuple(layers), top("final_norm"), top("lm_head"))


def _layer(stacked: Any, i: int, on_device: bool) -> Any:
    """Slot i of stacked weights: one compiled slice of device arrays, numpy views of host ones."""
    return take_layer(stacked, i) if on_device else jax.tree.map(lambda w: w[i], stacked)


@functools.lru_cache(maxsize=64)
def _layer_fuser(base: LlamaConfig, dtype: Any, shardings: MoeServingLayer | None, quantization: str | None) -> Any:
    """`_serving_layer` jitted once per (config, dtype, shardings, quantization): the layers of one kind share an
    executable."""
    fuse = partial(_serving_layer, base=base, dtype=dtype, quantization=quantization)
    return jax.jit(fuse, out_shardings=shardings)


def _serving_layer(
    attention: AttentionWeights,
    mlp: moe.DenseWeights | moe.ExpertWeights,
    base: LlamaConfig,
    dtype: Any,
    quantization: str | None,
) -> MoeServingLayer:
    """One layer's checkpoint-layout attention and MLP weights (no leading axis) fused into a MoeServingLayer, its
    linear weights then quantized when `quantization` says."""
    cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    wqkv, bqkv = llama.fuse_qkv(attention, base, cast)
    fused = MoeServingLayer(
        attn_norm=cast(attention.attn_norm),
        wqkv=wqkv,
        bqkv=bqkv,
        q_norm=None if attention.q_norm is None else cast(attention.q_norm),
        k_norm=None if attention.k_norm is None else cast(attention.k_norm),
        wo=cast(attention.wo),
        mlp_norm=cast(attention.mlp_norm),
        mlp=moe.fuse_mlp(mlp, cast),
    )
    return quantize_layer(fused, quantization)


def checkpoint_rules(cfg: MoeConfig) -> list[CheckpointRule]:
    """Hugging Face tensor names -> weight fields; exactly the tensors this config's checkpoint holds (the
    per-expert names `save_pretrained` writes)."""
    layer = r"model\.layers\.(\d+)\."
    mlp_fields = {"layers.w_gate", "layers.w_up", "layers.w_down"}
    rules = [rule for rule in llama.checkpoint_rules(cfg.base) if rule.field not in mlp_fields]
    if cfg.dense_layers:
        rules += [
            CheckpointRule(layer + rf"mlp\.{p}_proj\.weight", f"dense.w_{p}", "linear", layers=cfg.dense_layers)
            for p in ("gate", "up", "down")
        ]
    if not cfg.moe_layers:
        return rules
    block, names = _EXPERT_NAMES[cfg.model_type]
    experts = cfg.moe_layers
    rules.append(CheckpointRule(layer + rf"{block}\.gate\.weight", "experts.router", "linear", layers=experts))
    rules += [
        CheckpointRule(layer + rf"{block}\.experts\.(\d+)\.{name}\.weight", f"experts.w_{p}", "linear", layers=experts)
        for p, name in names.items()
    ]
    if cfg.mlp_layers[experts[0]].shared_intermediate_size is not None:
        rules += [
            CheckpointRule(layer + rf"mlp\.shared_expert\.{p}_proj\.weight", f"experts.shared_w_{p}", "linear", experts)
            for p in ("gate", "up", "down")
        ]
        # A Linear(D, 1): [1, D], transposed to [D, 1], the field's [D].
        rules.append(
            CheckpointRule(layer + r"mlp\.shared_expert_gate\.weight", "experts.shared_gate", "linear", experts)
        )
    return rules


def _fan_in(cfg: MoeConfig, stack: str, name: str) -> int:
    """Each matrix's fan-in: weights start at N(0, 1 / fan_in), so activations keep unit scale at any size."""
    if name == "wo":
        return cfg.num_heads * cfg.head_dim
    if name == "shared_w_down":
        return cfg.mlp_layers[cfg.moe_layers[0]].shared_intermediate_size
    if name == "w_down":
        return cfg.base.intermediate_size if stack == "dense" else cfg.mlp_layers[cfg.moe_layers[0]].intermediate_size
    return cfg.hidden_size


@partial(jax.jit, static_argnames=("cfg", "dtype"))
def init_weights(cfg: MoeConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> MoeWeights:
    """Random weights for tests and benchmarks: norms 1, biases 0, matrices (the routers too) N(0, 1/fan_in), so
    router logits are of unit scale and tokens spread over the experts. Jitted, as llama.init_weights."""
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(param_specs(cfg))
    keys = jax.random.split(key, len(leaves_with_paths))
    leaves = []
    for (path, spec), leaf_key in zip(leaves_with_paths, keys, strict=True):
        stack, name = path[0].name, path[-1].name
        if name.endswith("norm"):
            leaves.append(jnp.ones(spec.shape, dtype))
        elif name in ("bq", "bk", "bv"):
            leaves.append(jnp.zeros(spec.shape, dtype))
        else:
            scale = _fan_in(cfg, stack, name) ** -0.5
            leaves.append((jax.random.normal(leaf_key, spec.shape, jnp.float32) * scale).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def forward(
    weights: MoeServingWeights,
    token_ids: Int[Array, " T"],
    positions: Int[Array, " T"],
    kv_cache: KVCache,
    attn_meta: AttentionMetadata,
    cfg: MoeConfig,
    rules: Rules | None = None,
) -> tuple[Float[Array, "T D"], KVCache]:
    """Final-normed hidden states of a flat token batch, and the cache with this batch's K/V written: a loop over
    the layers' own buffers, one jitted `decoder_layer` call each (llama.forward says why); the layers of one MLP
    kind share its trace. rules: the rules table the weights were placed with (None: LOGICAL_AXIS_RULES), which
    says how the Pallas grouped GEMMs split the experts under a mesh."""
    base = cfg.base
    mesh = attn_meta.mesh if isinstance(attn_meta, PagedAttentionMetadata) else None
    tensor_parallel = mesh is not None and mesh.size > 1
    x = jnp.take(weights.embed, token_ids, axis=0)
    cos, sin = rope_frequencies(base.rope, base.head_dim, positions)
    next_norms = [layer.attn_norm for layer in weights.layers[1:]] + [weights.final_norm]
    normed = rms_norm(x, weights.layers[0].attn_norm, base.rms_norm_eps)
    layers = zip(weights.layers, next_norms, cfg.mlp_layers, strict=True)
    for index, (layer, next_norm, mlp) in enumerate(layers):
        split = moe.expert_split(cfg.hidden_size, mlp, mesh, rules) if tensor_parallel and mlp.kind == "moe" else None
        x, normed, kv_cache = decoder_layer(
            layer, next_norm, x, normed, positions, cos, sin, kv_cache, jnp.int32(index), attn_meta, base, mlp, split
        )
    return normed, kv_cache


@partial(jax.jit, static_argnames=("cfg", "mlp", "split"))
def decoder_layer(
    layer: MoeServingLayer,
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
    mlp: LayerMlp,
    split: moe.ExpertSplit | None = None,
) -> tuple[Float[Array, "T D"], Float[Array, "T D"], KVCache]:
    """One layer on the residual stream x and its normed copy (llama.decoder_layer's contract), its MLP as `mlp`
    declares it (its experts split over the mesh as `split` says): h = x + attention(norm(x)); x = h + mlp(norm(h))."""
    eps = cfg.rms_norm_eps
    attn_out, kv_cache = llama.attention_block(
        layer, normed, positions, cos, sin, kv_cache, layer_index, attn_meta, cfg
    )
    h, normed = add_norm(x, attn_out, layer.mlp_norm, eps, attn_meta)
    x, normed = add_norm(h, moe.mlp_block(normed, layer.mlp, mlp, attn_meta, split), next_norm, eps, attn_meta)
    return x, normed, kv_cache


def compute_logits(weights: MoeServingWeights, hidden: Float[Array, "T D"], cfg: MoeConfig) -> Float[Array, "T V"]:
    """float32 logits, as the dense counterpart's."""
    return llama.compute_logits(weights, hidden, cfg.base)
