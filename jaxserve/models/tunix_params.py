"""google-tunix's parameter names -> our weights' fields, without importing tunix: `load_from_pytree` (so
`LLM.from_params` and `update_weights`) takes a tunix model's parameters as they are, and
`jaxserve.integrations.tunix` serves them with the Hugging Face config it derives from tunix's.

- Llama3 / Qwen3: the per-layer layouts are ours; only the names differ.
- Gemma, Gemma 2, Gemma 3: q / k / v are einsum weights, `q_einsum` [H, D, Dh] and `kv_einsum` [2, K, D, Dh],
  or `qkv_einsum` [3, H, D, Dh] when H == K, each moved to our [D, heads, Dh]; `attn_vec_einsum` [H, Dh, D] is
  our `wo`. Norm `scale`s multiply by (1 + scale), as Hugging Face's Gemma weights do, so they are taken as
  they are; the embedding is tied. A multimodal Gemma 3's vision encoder and projection are not served (text
  only), so their parameters are skipped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

_TOP_FIELDS = {
    "embedder.input_embedding": "embed",
    "final_norm.w": "final_norm",  # Llama3 / Qwen3
    "final_norm.scale": "final_norm",  # Gemma
    "lm_head.w": "lm_head",
}
_LAYER_FIELDS = {
    # Llama3 / Qwen3
    "input_layernorm.w": "attn_norm",
    "attn.q_proj.w": "wq",
    "attn.k_proj.w": "wk",
    "attn.v_proj.w": "wv",
    "attn.o_proj.w": "wo",
    "attn.q_norm.w": "q_norm",
    "attn.k_norm.w": "k_norm",
    "post_attention_layernorm.w": "mlp_norm",
    # Gemma, Gemma 2, Gemma 3
    "pre_attention_norm.scale": "attn_norm",
    "attn.attn_vec_einsum.w": "wo",
    "attn._query_norm.scale": "q_norm",
    "attn._key_norm.scale": "k_norm",
    "post_attn_norm.scale": "post_attn_norm",  # Gemma 2
    "post_attention_norm.scale": "post_attn_norm",  # Gemma 3
    "pre_ffw_norm.scale": "mlp_norm",
    "post_ffw_norm.scale": "post_mlp_norm",
    # all of them
    "mlp.gate_proj.kernel": "w_gate",
    "mlp.up_proj.kernel": "w_up",
    "mlp.down_proj.kernel": "w_down",
}
# Gemma's einsum weights: name -> (the fields it holds, its layout); each field's part is [heads, D, Dh].
_EINSUMS = {
    "attn.q_einsum.w": (("wq",), "[H, D, Dh]"),
    "attn.kv_einsum.w": (("wk", "wv"), "[2, K, D, Dh]"),
    "attn.qkv_einsum.w": (("wq", "wk", "wv"), "[3, H, D, Dh]"),
}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
_SKIPPED = re.compile(r"vision_encoder\..*|embedder\.mm_.*")  # a multimodal Gemma 3's vision side


def _einsum_parts(name: str, value: Any, fields: tuple[str, ...], layout: str) -> dict[str, jax.Array]:
    """One einsum weight as our fields' per-layer [D, heads, Dh] arrays (static slices: no host transfer)."""
    rank = 3 if len(fields) == 1 else 4
    if value.ndim != rank or (rank == 4 and value.shape[0] != len(fields)):
        raise ValueError(f"tunix parameter {name}: shape {tuple(value.shape)}, expected {layout}")
    parts = [value] if rank == 3 else [jax.lax.index_in_dim(value, i, keepdims=False) for i in range(len(fields))]
    return {field: jnp.swapaxes(part, 0, 1) for field, part in zip(fields, parts, strict=True)}


def is_tunix_tree(flat: Mapping[str, Any]) -> bool:
    """Whether dotted parameter names are tunix's (its models' embedding is `embedder.input_embedding`)."""
    return any(name.startswith("embedder.") for name in flat)


def to_jaxserve_params(flat: Mapping[str, Any]) -> dict[str, Any]:
    """tunix's dotted parameter names -> our field-named tree (layers stacked [L, ...]), with device arrays
    only: tunix syncs weights under a transfer guard.

    Raises ValueError naming the parameter that has no place (LoRA parameters included), that has the
    wrong layout, or that fills a field another parameter of its layer already filled."""
    top: dict[str, Any] = {}
    layers: dict[str, dict[int, tuple[str, Any]]] = {}
    skipped = 0
    for name, value in flat.items():
        if "lora" in name:
            raise ValueError(
                f"LoRA parameter {name}: serve it as an adapter (LLM.from_params(..., lora_alpha=...), "
                "LLM.load_lora / update_lora) or merge the adapters into the weights"
            )
        match = _LAYER_NAME.fullmatch(name)
        rest = match.group(2) if match is not None else None
        if name in _TOP_FIELDS:
            top[_TOP_FIELDS[name]] = value
            continue
        if _SKIPPED.fullmatch(name):
            skipped += 1
            continue
        if rest in _LAYER_FIELDS:
            parts = {_LAYER_FIELDS[rest]: value}
        elif rest in _EINSUMS:
            parts = _einsum_parts(name, value, *_EINSUMS[rest])
        else:
            raise ValueError(
                f"tunix parameter {name} has no counterpart in jaxserve's weights "
                f"(known: {sorted(_TOP_FIELDS)} and layers.N.{{{', '.join(sorted([*_LAYER_FIELDS, *_EINSUMS]))}}})"
            )
        layer = int(match.group(1))
        for field, part in parts.items():
            filled = layers.setdefault(field, {})
            if layer in filled:
                raise ValueError(f"tunix parameters {filled[layer][0]} and {name} both hold {field} of layer {layer}")
            filled[layer] = (name, part)
    if skipped:
        log.debug("skipped %d vision parameters (the language model does not read them)", skipped)
    num_layers = 1 + max((i for per_layer in layers.values() for i in per_layer), default=-1)
    return {**top, "layers": {field: _stacked(field, per_layer, num_layers) for field, per_layer in layers.items()}}


def _stacked(field: str, per_layer: dict[int, tuple[str, Any]], num_layers: int) -> jax.Array:
    """One field's layers stacked [L, ...]; a ValueError names a missing layer's parameter (as another
    layer names it) or the parameters whose shapes differ."""
    missing = [i for i in range(num_layers) if i not in per_layer]
    if missing:
        example = _LAYER_NAME.fullmatch(next(iter(per_layer.values()))[0])
        name = f"layers.{missing[0]}.{example.group(2)}"
        raise ValueError(
            f"missing tunix parameter {name} ({field} of layer {missing[0]}; the tree has {num_layers} layers)"
        )
    shapes = {tuple(value.shape): name for name, value in per_layer.values()}
    if len(shapes) > 1:
        raise ValueError(f"layers of {field} differ in shape: " + ", ".join(f"{n} {s}" for s, n in shapes.items()))
    return jnp.stack([per_layer[i][1] for i in range(num_layers)])
