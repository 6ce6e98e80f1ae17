"""What a family declares about each decoder layer (its attention and its MLP), for the code that reads it without
knowing the family.

A family's config has `attention_layers`: one `LayerAttention` per decoder layer (its window, rope, query
scale and logit soft-cap). The forward passes each layer's options to the attention kernels at trace time
(they are static: a model whose layers differ still compiles one step per bucket), and `layer_groups`
partitions the layers by KV policy: layers with the same window keep the same span of each sequence's KV.
Gemma 2 alternates sliding and full layers; Gemma 3 has five sliding layers to one full; Mistral's are all
sliding; Llama's and Qwen's all full.

A mixture-of-experts family also has `mlp_layers`: one `LayerMlp` per layer, a dense gated MLP or a mixture of
experts (Qwen2-MoE and Qwen3-MoE mix both kinds through `decoder_sparse_step` and `mlp_only_layers`). The
forward reads each layer's declaration at trace time, as it reads the attention's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxserve.models.common import RopeConfig


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """One layer's attention: window (None: full attention; W: each query sees the last W positions, itself
    included), rope, sm_scale (the factor on q.k) and soft_cap (logits become soft_cap * tanh(logit / soft_cap)).
    Frozen and hashable: a jit static argument."""

    rope: RopeConfig
    sm_scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None

    def __post_init__(self) -> None:
        if not self.sm_scale > 0:
            raise ValueError(f"sm_scale must be > 0, got {self.sm_scale}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None (full attention) or >= 1, got {self.sliding_window}")
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ValueError(f"soft_cap must be None or > 0, got {self.soft_cap}")

    @property
    def kind(self) -> Literal["full", "sliding"]:
        return "full" if self.sliding_window is None else "sliding"


def layer_groups(layers: tuple[LayerAttention, ...]) -> dict[int | None, tuple[int, ...]]:
    """Layer indices by KV policy: window (None for full attention) -> the layers with it, in order."""
    groups: dict[int | None, list[int]] = {}
    for index, layer in enumerate(layers):
        groups.setdefault(layer.sliding_window, []).append(index)
    return {window: tuple(indices) for window, indices in groups.items()}


@dataclass(frozen=True, slots=True)
class LayerMlp:
    """One layer's MLP: dense (num_experts None: a SwiGLU MLP of width intermediate_size) or a mixture of
    experts (num_experts routed experts of width intermediate_size, each token takes the top_k by router
    softmax, their weights renormalised to sum 1 when normalize_top_k, plus an always-on shared expert of width
    shared_intermediate_size scaled by a sigmoid gate when that is given: Qwen2-MoE's). Frozen and hashable: a
    jit static argument."""

    intermediate_size: int
    num_experts: int | None = None
    top_k: int = 1
    normalize_top_k: bool = False
    shared_intermediate_size: int | None = None

    def __post_init__(self) -> None:
        if self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")
        if self.num_experts is None:
            if self.shared_intermediate_size is not None:
                raise ValueError("shared_intermediate_size is for a mixture of experts; a dense MLP has none")
            return
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be None (a dense MLP) or >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.shared_intermediate_size is not None and self.shared_intermediate_size < 1:
            raise ValueError(f"shared_intermediate_size must be None or >= 1, got {self.shared_intermediate_size}")

    @property
    def kind(self) -> Literal["dense", "moe"]:
        return "dense" if self.num_experts is None else "moe"
