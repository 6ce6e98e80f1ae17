"""Tile shapes of the attention kernels: the validated tiling records and the tuning tables.

The tables map a shape class to the tiling the H200 benchmark (`benchmarks/attention.py`) chose;
`docs/kernels.md` records the sweep behind each entry. A caller's `**tuning` keywords override
single fields of the looked-up entry. Host-only: no jax import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The split count aims at about 512 programs (~4 per multiprocessor of the H200's 132): the per-kernel
# device times at 1 x 16384, 16 x 1024 and 64 x 1024 were best or level there (docs/kernels.md, v4).
_TARGET_PROGRAMS = 512


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_power_of_two(name: str, value: int, low: int = 1, high: int | None = None) -> None:
    """ValueError naming `name` unless value is an int power of two in [low, high] (no upper bound: None)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1 and value & (value - 1) == 0
    if not (ok and low <= value and (high is None or value <= high)):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be a power of two {bounds}, got {value!r}")


def _check_launch(prefix: str, block_n: int, num_warps: int, num_stages: int) -> None:
    """The fields both tilings have; `prefix` makes the names those of the tuning keywords."""
    check_power_of_two(f"{prefix}block_n", block_n, 16, 256)
    check_power_of_two(f"{prefix}num_warps", num_warps, 1, 16)
    if not 1 <= num_stages <= 6:
        raise ValueError(f"{prefix}num_stages must be in [1, 6], got {num_stages}")


@dataclass(frozen=True, slots=True)
class MixedTiling:
    """Tiling of the mixed (prefill + decode) kernel.

    block_m: rows of a query tile; a tile packs block_m // group tokens times the group's query heads.
    block_n: keys per inner-loop step.
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        check_power_of_two("block_m", self.block_m, 16, 256)
        _check_launch("", self.block_n, self.num_warps, self.num_stages)


@dataclass(frozen=True, slots=True)
class DecodeTiling:
    """Tiling of the split-KV decode kernel.

    num_splits: programs per (sequence, kv head), each reading an equal share of that sequence's keys.
    block_n: keys per inner-loop step.
    """

    num_splits: int = 1
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    eager_pages: bool = True  # one-tile splits read their page ids before kv_len arrives (see DecodeParams)

    def __post_init__(self) -> None:
        check_power_of_two("num_splits", self.num_splits, 1, 256)
        _check_launch("decode_", self.block_n, self.num_warps, self.num_stages)


# (padded head_dim, token class) -> MixedTiling; token class = the smallest key >= T. Measured on the H200:
# head_dim 128 with T > 512 (the 8192-token prefill sweeps: 3 stages ahead of 2 by 0.3-0.8% in two runs).
# The other entries are set by analogy.
MIXED_TABLE: dict[tuple[int, int], MixedTiling] = {
    (64, 512): MixedTiling(block_m=64, block_n=64, num_warps=4, num_stages=2),
    (64, 1 << 30): MixedTiling(block_m=128, block_n=64, num_warps=4, num_stages=2),
    (128, 512): MixedTiling(block_m=64, block_n=64, num_warps=4, num_stages=2),
    (128, 1 << 30): MixedTiling(block_m=128, block_n=64, num_warps=4, num_stages=3),
    (256, 512): MixedTiling(block_m=64, block_n=32, num_warps=4, num_stages=2),
    (256, 1 << 30): MixedTiling(block_m=64, block_n=64, num_warps=8, num_stages=2),
}

# (padded head_dim, programs class, context class) -> DecodeTiling, where programs class is the next power
# of two >= B * K and context class the next power of two >= the block-table width in tokens. Missing
# classes fall back to `_decode_heuristic`, which picks these same split counts at the measured shapes.
DECODE_TABLE: dict[tuple[int, int, int], DecodeTiling] = {
    (128, 128, 1024): DecodeTiling(num_splits=4, block_n=64, num_warps=4, num_stages=2),
    (128, 512, 1024): DecodeTiling(num_splits=1, block_n=64, num_warps=4, num_stages=3),
    (128, 2048, 4096): DecodeTiling(num_splits=1, block_n=128, num_warps=4, num_stages=3),
    (128, 2048, 16384): DecodeTiling(num_splits=1, block_n=128, num_warps=4, num_stages=3),
}

MIXED_KEYS = {"block_m": "block_m", "block_n": "block_n", "num_warps": "num_warps", "num_stages": "num_stages"}
DECODE_KEYS = {
    "num_splits": "num_splits",
    "decode_block_n": "block_n",
    "decode_num_warps": "num_warps",
    "decode_num_stages": "num_stages",
    "decode_eager_pages": "eager_pages",
}
SWITCH_KEYS = ("decode_kernel",)
TUNING_KEYS = tuple(MIXED_KEYS) + tuple(DECODE_KEYS) + SWITCH_KEYS


def _class_of(value: int, classes: list[int]) -> int:
    return next((c for c in sorted(classes) if value <= c), max(classes))


def _decode_heuristic(programs: int, context: int) -> DecodeTiling:
    """Enough splits to give every multiprocessor a few programs, but at least one key tile per split
    (one-tile splits measured faster than two-tile ones at B = 1; docs/kernels.md)."""
    block_n = 64
    wanted = next_power_of_2(max(1, -(-_TARGET_PROGRAMS // max(programs, 1))))
    most = max(1, next_power_of_2(context // block_n + 1) // 2)
    return DecodeTiling(num_splits=min(wanted, most, 64), block_n=block_n)


def mixed_tiling(head_dim_padded: int, num_tokens: int, overrides: dict[str, int]) -> MixedTiling:
    """Table entry for this shape class, with the caller's overrides applied."""
    keys = [t for (d, t) in MIXED_TABLE if d == head_dim_padded]
    base = MIXED_TABLE[(head_dim_padded, _class_of(num_tokens, keys))] if keys else MixedTiling()
    fields = {MIXED_KEYS[k]: v for k, v in overrides.items() if k in MIXED_KEYS}
    return dataclasses.replace(base, **fields)


def decode_tiling(
    head_dim_padded: int, num_seqs: int, num_kv_heads: int, context: int, overrides: dict[str, int]
) -> DecodeTiling:
    """Table entry (or heuristic) for B * K programs over block tables `context` tokens wide."""
    programs = num_seqs * num_kv_heads
    key = (head_dim_padded, next_power_of_2(programs), next_power_of_2(context))
    base = DECODE_TABLE.get(key) or _decode_heuristic(programs, context)
    fields = {DECODE_KEYS[k]: v for k, v in overrides.items() if k in DECODE_KEYS}
    return dataclasses.replace(base, **fields)


def check_tuning_keys(tuning: dict[str, object]) -> None:
    unknown = sorted(set(tuning) - set(TUNING_KEYS))
    if unknown:
        raise TypeError(f"unknown tuning keyword(s) {unknown}; allowed: {list(TUNING_KEYS)}")
