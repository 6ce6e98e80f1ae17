"""Maps Hugging Face `architectures` names to the family module that implements them, and the protocol
every family satisfies.

A family module (`jaxserve/models/llama.py`) exposes `ModelFamily`: `param_specs` (the checkpoint layout),
`serving_specs` and `to_serving` (the layout `forward` reads), `checkpoint_rules`, `init_weights`,
`forward`, `compute_logits`, over a frozen config class with `from_hf` that satisfies
`ModelConfig`; `resolve` returns the module and its config built from the checkpoint's config.json.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
from jaxtyping import Array, Float, Int

from jaxserve.models import llama
from jaxserve.models.attention import AttentionMetadata, KVCache
from jaxserve.models.common import CheckpointRule, ConfigKey, check_config_keys


class ModelConfig(Protocol):
    """What the engine reads of a family's config; configs are frozen and hashable (jit static arguments)."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@runtime_checkable
class ModelFamily(Protocol):
    """A model family: a module whose functions build, load and run one architecture's weights tree."""

    def param_specs(self, cfg: Any) -> Any:
        """The weights tree with a ParamSpec (shape, logical axes) at every leaf."""

    def serving_specs(self, cfg: Any) -> Any:
        """The serving layout (what `forward` reads) with a ParamSpec at every leaf."""

    def to_serving(
        self, weights: Any, cfg: Any, shardings: Any = None, dtype: Any = None, replacing: Any = None
    ) -> Any:
        """Checkpoint-layout weights in the serving layout, placed with `shardings`, cast to `dtype`;
        `replacing`'s buffers (serving weights being updated) are deleted as the new ones are built."""

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


# Architecture name -> (family module, its config class).
_ARCHITECTURES: dict[str, tuple[ModelFamily, Any]] = {
    "LlamaForCausalLM": (llama, llama.LlamaConfig),
    "MistralForCausalLM": (llama, llama.LlamaConfig),
    "Qwen2ForCausalLM": (llama, llama.LlamaConfig),
    "Qwen3ForCausalLM": (llama, llama.LlamaConfig),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve(hf_config: dict) -> tuple[ModelFamily, Any]:
    """(family module, family config) for a Hugging Face config.json dict; a ValueError says what is wrong
    with it (the caller adds which file it came from)."""
    check_config_keys(hf_config, {"architectures": ConfigKey("str_list")})
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ValueError(
            f"config has no 'architectures' entry; supported architectures: {', '.join(supported_architectures())}"
        )
    for name in architectures:
        if name in _ARCHITECTURES:
            family, config_cls = _ARCHITECTURES[name]
            return family, config_cls.from_hf(hf_config)
    raise ValueError(
        f"unsupported architecture {', '.join(architectures)}; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )
