"""Maps Hugging Face `architectures` names (or, where a config has none, its `model_type`) to the family
module that implements them, and the protocol every family satisfies.

A family module (`jaxserve/models/llama.py`) exposes `ModelFamily`: `param_specs` (the checkpoint layout),
`serving_specs` and `to_serving` (the layout `forward` reads), `checkpoint_rules`, `init_weights`,
`forward`, `compute_logits`, over a frozen config class with `from_hf` that satisfies
`ModelConfig`; `resolve` returns the module and its config built from the checkpoint's config.json.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
from jaxtyping import Array, Float, Int

from jaxserve.models import gemma, llama, llama_moe
from jaxserve.models.attention import AttentionMetadata, KVCache
from jaxserve.models.common import CheckpointRule, ConfigKey, check_config_keys
from jaxserve.models.layers import LayerAttention


class ModelConfig(Protocol):
    """What the engine reads of a family's config; configs are frozen and hashable (jit static arguments)."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_layers: tuple[LayerAttention, ...]  # each layer's window, rope, query scale, soft-cap


@runtime_checkable
class ModelFamily(Protocol):
    """A model family: a module whose functions build, load and run one architecture's weights tree."""

    ARCHITECTURES: dict[str, str]  # the Hugging Face architectures it runs -> their model_type

    def param_specs(self, cfg: Any) -> Any:
        """The weights tree with a ParamSpec (shape, logical axes) at every leaf."""

    def serving_specs(self, cfg: Any, quantization: str | None = None, quantize_lm_head: bool = False) -> Any:
        """The serving layout (what `forward` reads) with a ParamSpec at every leaf; the linear weights' specs
        as `quantization` stores them (`models/quant.py`), an untied lm_head's too with quantize_lm_head."""

    def to_serving(
        self,
        weights: Any,
        cfg: Any,
        shardings: Any = None,
        dtype: Any = None,
        replacing: Any = None,
        quantization: str | None = None,
        quantize_lm_head: bool = False,
    ) -> Any:
        """Checkpoint-layout weights in the serving layout, placed with `shardings`, cast to `dtype`, the linear
        weights (and with quantize_lm_head an untied lm_head) quantized to `quantization`; `replacing`'s buffers
        (serving weights being updated) are deleted as the new ones are built."""

    def checkpoint_rules(self, cfg: Any) -> list[CheckpointRule]:
        """Hugging Face tensor names -> weight fields."""

    def init_weights(self, cfg: Any, key: jax.Array, dtype: Any = ...) -> Any:
        """Random weights for tests and benchmarks."""

    def forward(
        self,
        weights: Any,
        token_ids: Int[Array, " T"],
        positions: Int[Array, " T"],
        kv_cache: KVCache,
        attn_meta: AttentionMetadata,
        cfg: Any,
    ) -> tuple[Float[Array, "T D"], KVCache]:
        """Final-normed hidden states of a flat token batch (serving-layout weights), and the cache with its
        K/V written."""

    def compute_logits(self, weights: Any, hidden: Float[Array, "T D"], cfg: Any) -> Float[Array, "T V"]:
        """float32 logits of hidden states."""


# Each family module with its config class; the family's ARCHITECTURES maps the Hugging Face architectures
# it runs to their model_type.
_FAMILIES: tuple[tuple[ModelFamily, Any], ...] = (
    (llama, llama.LlamaConfig),
    (gemma, gemma.GemmaConfig),
    (llama_moe, llama_moe.MoeConfig),
)
# Architecture name -> (family module, its config class), and model_type -> architecture name.
_ARCHITECTURES: dict[str, tuple[ModelFamily, Any]] = {
    name: (family, config_cls) for family, config_cls in _FAMILIES for name in family.ARCHITECTURES
}
_MODEL_TYPES: dict[str, str] = {
    model_type: name for family, _ in _FAMILIES for name, model_type in family.ARCHITECTURES.items()
}
_KEYS = {"architectures": ConfigKey("str_list"), "model_type": ConfigKey("str")}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def supported_model_types() -> list[str]:
    return sorted(_MODEL_TYPES)


def resolve(hf_config: dict) -> tuple[ModelFamily, Any]:
    """(family module, family config) for a Hugging Face config.json dict; a ValueError says what is wrong
    with it (the caller adds which file it came from)."""
    check_config_keys(hf_config, _KEYS)
    family, config_cls = _ARCHITECTURES[_architecture(hf_config)]
    return family, config_cls.from_hf(hf_config)


def _architecture(hf_config: dict) -> str:
    """The first supported name in `architectures`; where that key is absent, null or empty (a config built
    with transformers' `LlamaConfig(...)` has none), the architecture of `model_type`, as transformers' auto
    classes pick the model class."""
    architectures = hf_config.get("architectures") or []
    if architectures:
        found = next((name for name in architectures if name in _ARCHITECTURES), None)
        if found is None:
            raise ValueError(f"unsupported architecture {', '.join(architectures)}; {_supported()}")
        return found
    model_type = hf_config.get("model_type")
    if model_type not in _MODEL_TYPES:
        found = "no 'model_type'" if model_type is None else f"model_type {model_type!r}, which is not supported"
        raise ValueError(f"config has no 'architectures' entry and {found}; {_supported()}")
    return _MODEL_TYPES[model_type]


def _supported() -> str:
    return (
        f"supported architectures: {', '.join(supported_architectures())}; "
        f"supported model types: {', '.join(supported_model_types())}"
    )
