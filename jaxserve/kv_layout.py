"""How the KV pool holds each layer group's KV: the layout the block manager, the step inputs and the attention share.

A model's layers are grouped by KV policy (`models.layers.LayerAttention.sliding_window`): a full-attention layer
reads every earlier token of a sequence, a sliding layer with window W only the last W. Each group keeps what
its layers read: a sliding group releases the blocks that fall below every future query's window while the
sequence runs (TensorRT-LLM's variable sliding-window KV, vLLM's hybrid allocator).

The pool is one set of pages shared by every group: a page holds `block_size` tokens of `layers_per_page` layers
(the pool is [layers_per_page, num_pages, block_size, kv heads, head dim]). Each layer kind with n layers is cut
into ceil(n / layers_per_page) groups of at most layers_per_page layers, and layers_per_page is the smallest
kind's layer count, so a page is the same size in every group and one free list serves them all (Gemma 3 12B:
8 full and 40 sliding layers -> 6 groups of 8; Llama: one group of every layer). Each sequence has one page per
logical block per group: `Request.block_ids` interleaves them, entry `block * num_groups + group`, and an entry
0 (the reserved block) is a released one. Layer l's KV lives in page slot `slot_of[l]` of its group's pages.

Host policy: no jax here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVLayout:
    """windows: each group's window (None: the group keeps every token). group_of / slot_of: each model layer's
    group and its slot in that group's pages. layers_per_page: slots per page (the pool's leading axis)."""

    windows: tuple[int | None, ...]
    group_of: tuple[int, ...]
    slot_of: tuple[int, ...]
    layers_per_page: int

    def __post_init__(self) -> None:
        if not self.windows:
            raise ValueError("a KV layout needs at least one group")
        if len(self.group_of) != len(self.slot_of) or not self.group_of:
            raise ValueError(f"group_of and slot_of must name every layer, got {self.group_of} and {self.slot_of}")
        if any(not 0 <= g < len(self.windows) for g in self.group_of):
            raise ValueError(f"group_of must index windows ({len(self.windows)} groups), got {self.group_of}")
        if any(not 0 <= s < self.layers_per_page for s in self.slot_of):
            raise ValueError(f"slot_of must be in [0, {self.layers_per_page}), got {self.slot_of}")
        if len(set(zip(self.group_of, self.slot_of, strict=True))) != len(self.group_of):
            raise ValueError("two layers share one (group, slot)")
        if any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"windows must be None or >= 1, got {self.windows}")

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.group_of)

    @property
    def releases(self) -> bool:
        """Whether any group releases blocks as its sequences run."""
        return any(w is not None for w in self.windows)

    def first_live_block(self, group: int, next_position: int, block_size: int) -> int:
        """The lowest block group `group` still needs once a sequence's next query is at `next_position`: queries
        from there on see keys > position - window, so blocks wholly below next_position - window + 1 are done."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, next_position - window + 1) // block_size

    def live_blocks(self, start: int, end: int, block_size: int) -> int:
        """Pages a sequence holds, summed over groups, while it computes positions [start, end): every block
        below end except those a sliding group has released (below its window of `start`)."""
        total = -(-end // block_size)
        return sum(total - min(total, self.first_live_block(g, start, block_size)) for g in range(self.num_groups))

    def max_live_blocks(self, max_len: int, max_chunk: int, block_size: int) -> int:
        """The most pages one sequence of up to max_len tokens, computed max_chunk tokens a step at most, holds
        at any time, summed over groups: a full group every block of max_len; a sliding group the blocks of
        its window plus a step's chunk."""
        total = -(-max_len // block_size)
        held = 0
        for window in self.windows:
            if window is None:
                held += total
            else:
                held += min(total, -(-(window - 1 + max_chunk) // block_size) + 1)
        return held


def kv_layout(windows_by_layer: Sequence[int | None], keep_window_only: bool = True) -> KVLayout:
    """The layout of a model whose layer l has window windows_by_layer[l] (None: full attention). Without
    `keep_window_only` (or when every layer has the same window and it is None) one group holds every layer's
    KV for every token, as a pool without sliding-window savings."""
    num_layers = len(windows_by_layer)
    if num_layers < 1:
        raise ValueError("a KV layout needs at least one layer")
    if not keep_window_only:
        return KVLayout((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows_by_layer):
        kinds.setdefault(window, []).append(layer)
    per_page = min(len(layers) for layers in kinds.values())
    windows: list[int | None] = []
    group_of = [0] * num_layers
    slot_of = [0] * num_layers
    for window, layers in kinds.items():
        for start in range(0, len(layers), per_page):
            for slot, layer in enumerate(layers[start : start + per_page]):
                group_of[layer], slot_of[layer] = len(windows), slot
            windows.append(window)
    return KVLayout(tuple(windows), tuple(group_of), tuple(slot_of), per_page)
