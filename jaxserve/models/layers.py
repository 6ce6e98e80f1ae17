"""What a family declares about each decoder layer's attention, for the code that reads it without knowing the family.

A family's config has `attention_layers`: one `LayerAttention` per decoder layer (its window, rope, query
scale and logit soft-cap). The forward passes each layer's options to the attention kernels at trace time
(they are static: a model whose layers differ still compiles one step per bucket), and `layer_groups`
partitions the layers by KV policy: layers with the same window keep the same span of each sequence's KV.
Gemma 2 alternates sliding and full layers; Gemma 3 has five sliding layers to one full; Mistral's are all
sliding; Llama's and Qwen's all full.
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
