"""KV-cache capacity from measured memory: bytes per token (from the pool's declaration and the rules
table), the memory profile the runner measures once the weights and the largest compiled step are in
place (`Runner.profile`), and the resulting number of KV blocks (`kv_budget`).

docs/architecture.md, "KV layout and capacity": on an accelerator,
    kv_bytes = (bytes_limit - bytes_in_use - activation_peak) * free_memory_fraction
then capped by `KvCacheConfig.max_tokens` / `max_gpu_total_bytes`, and
    num_blocks = kv_bytes // bytes_per_block   (the smallest over the devices).
Every term is logged. On CPU, where devices report no memory statistics, the budget is a fraction of
the available RAM, capped at what max_batch_size sequences of max_seq_len tokens need.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve import compat
from jaxserve.config import EngineConfig
from jaxserve.kv_layout import KVLayout, kv_layout
from jaxserve.models.attention import PagedKVCache
from jaxserve.sharding.rules import shard_bytes

logger = logging.getLogger(__name__)

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# JAX's GPU allocator takes 75% of the card by default; a serving engine wants most of it.
DEFAULT_MEM_FRACTION = "0.92"
_raised_by_engine = False  # this process already raised it (CLI, then LLM): say so once


def raise_memory_fraction_default(fraction: str = DEFAULT_MEM_FRACTION) -> bool:
    """Sets XLA_PYTHON_CLIENT_MEM_FRACTION when the user has not and jax has not started a backend yet.

    Returns whether it was set. Once a backend exists the allocator is sized and the variable is moot.
    """
    global _raised_by_engine
    if _raised_by_engine:
        return False
    outcome = env_default_before_jax(MEM_FRACTION_ENV, fraction, logger)
    if outcome == "started":
        logger.info("jax is already initialised; %s stays at its default (0.75 of the GPU)", MEM_FRACTION_ENV)
    if outcome != "set":
        return False
    _raised_by_engine = True
    if gpu_backend_possible():
        logger.info("set %s=%s so the KV cache can use most of the GPU", MEM_FRACTION_ENV, fraction)
    else:
        logger.info("set %s=%s (read by jax's GPU allocator only: no effect on CPU)", MEM_FRACTION_ENV, fraction)
    return True


def env_default_before_jax(name: str, value: str, log: logging.Logger) -> Literal["user", "started", "set"]:
    """Sets the environment variable `name` to `value` for jax's backend to read when it starts, unless the user
    has set it ("user": said on `log`) or jax has a backend already ("started": the variable would be moot);
    "set" when it did. The engine's process defaults (this module's memory fraction, gpu_client's client) go
    through here."""
    if name in os.environ:
        log.info("%s=%s (set by the user)", name, os.environ[name])
        return "user"
    if backends_started():
        return "started"
    os.environ[name] = value
    return "set"


def gpu_backend_possible() -> bool:
    """Whether jax may start a GPU backend in this process, known without starting one: JAX_PLATFORMS
    allows it and a CUDA or ROCm plugin is installed."""
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(name in platforms for name in ("cuda", "gpu", "rocm")):
        return False
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")
    return any(importlib.util.find_spec(name) is not None for name in plugins)


def backends_started() -> bool:
    """Whether jax has created a backend in this process (a client reads its environment variables then)."""
    return compat.backends_initialized()


def kv_bytes_per_token(cache_specs: PagedKVCache, mesh: Mesh | Mapping[str, int], dtype: np.dtype) -> int:
    """K and V of one token over all layers on one device, from the pool's declaration
    (`models.attention.paged_cache_specs`) split by the rules table: 2 x L x kv heads per device x Dh x bytes."""
    itemsize = np.dtype(dtype).itemsize
    num_slots = cache_specs.k.shape[1] * cache_specs.k.shape[2]  # blocks x block size
    return sum(shard_bytes(spec, mesh, itemsize) for spec in (cache_specs.k, cache_specs.v)) // num_slots


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One device once the weights are placed and the largest step is compiled and probed (bytes)."""

    bytes_limit: int
    bytes_in_use: int
    activation_peak: int


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What the KV budget is computed from (`Runner.profile`).

    devices: one entry per device of the mesh; empty where the platform reports no memory statistics
    (CPU), in which case the budget comes from host memory.
    """

    kv_bytes_per_token: int
    devices: tuple[DeviceMemory, ...] = ()


@dataclass(frozen=True, slots=True)
class KvBudget:
    """The KV pool's size and how it was reached (every term is logged)."""

    num_blocks: int
    kv_bytes: int
    bytes_per_block: int
    source: str  # "device memory" or "host memory"

    def tokens(self, block_size: int) -> int:
        return (self.num_blocks - 1) * block_size  # block 0 is reserved


# The sizes the GPU default of max_batch_size picks from, and the tokens per sequence the pool must hold
# for one to be picked: 1024 sequences (what vLLM runs on large GPUs) when the pool holds 1024 x 256
# tokens, else 512, else 256 (TensorRT-LLM's default).
AUTO_BATCH_SIZES = (1024, 512, 256)
AUTO_TOKENS_PER_SEQUENCE = 256


def auto_max_batch_size(kv_tokens: int, upper: int) -> int:
    """The largest of AUTO_BATCH_SIZES, at most `upper`, whose sequences of AUTO_TOKENS_PER_SEQUENCE
    tokens a pool of kv_tokens holds; the smallest that is at most `upper` when none is (or `upper`)."""
    sizes = [size for size in AUTO_BATCH_SIZES if size <= upper] or [upper]
    return next((size for size in sizes if size * AUTO_TOKENS_PER_SEQUENCE <= kv_tokens), sizes[-1])


def device_memory(device: jax.Device) -> tuple[int, int] | None:
    """(bytes_limit, bytes_in_use) of a device, or None where the platform reports no statistics (CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats["bytes_in_use"])


def peak_bytes_in_use(device: jax.Device) -> int:
    """The device's peak allocation since the process started (0 where not reported)."""
    stats = device.memory_stats() or {}
    return int(stats.get("peak_bytes_in_use", 0))


def activation_peak(compiled: jax.stages.Compiled) -> int:
    """Scratch memory of a compiled step beyond its arguments and outputs (XLA's temp allocation)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return 0
    return int(analysis.temp_size_in_bytes)


def host_available_bytes() -> int:
    """Available RAM (Linux /proc/meminfo MemAvailable; else physical pages)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def stable_num_blocks(num_blocks: int) -> int:
    """num_blocks rounded down to its leading six bits (at most ~3% less, ~1.5% on average), so that runs
    whose measured free memory differs a little get the same pool and hit the same cached executables."""
    if num_blocks < 64:
        return num_blocks
    granularity = 2 ** (num_blocks.bit_length() - 6)
    return num_blocks // granularity * granularity


def kv_budget(
    profile: MemoryProfile, config: EngineConfig, host_bytes: int | None = None, layout: KVLayout | None = None
) -> KvBudget:
    """The number of KV blocks (pages of the layout's groups) from measured memory; raises a ValueError naming the
    knobs when too small. layout: the model's KV groups (None: one group of every layer), whose pages one
    sequence holds (`KVLayout.max_live_blocks`) the host budget and the checks count."""
    kv_config, block_size = config.kv_cache, config.kv_cache.block_size
    layout = layout if layout is not None else kv_layout([None])
    # Pages one sequence of max_seq_len tokens holds at most, and per block of max_tokens.
    seq_pages = layout.max_live_blocks(config.max_seq_len, config.max_num_tokens, block_size)
    bytes_per_token, profiles = profile.kv_bytes_per_token, profile.devices
    bytes_per_block = bytes_per_token * block_size
    if profiles:
        free = [p.bytes_limit - p.bytes_in_use - p.activation_peak for p in profiles]
        for i, (p, f) in enumerate(zip(profiles, free, strict=True)):
            logger.info(
                "device %d: bytes_limit %s - in use after weights %s - activation peak %s = %s free",
                i,
                _gib(p.bytes_limit),
                _gib(p.bytes_in_use),
                _gib(p.activation_peak),
                _gib(f),
            )
        kv_bytes = int(max(min(free), 0) * kv_config.free_memory_fraction)
        # Measured free memory moves by a fraction of a percent between runs; the pool's size is part of
        # every compiled step's shapes, so an unrounded pool would miss the persistent compilation cache.
        kv_bytes = stable_num_blocks(kv_bytes // bytes_per_block) * bytes_per_block
        source = "device memory"
    else:
        available = host_available_bytes() if host_bytes is None else host_bytes
        # Enough for every sequence at full length, plus the reserved block: more can never be used.
        needed = (config.max_batch_size * seq_pages + 1) * bytes_per_block
        kv_bytes = min(int(available * kv_config.free_memory_fraction), needed)
        source = "host memory"
        logger.info("no device memory statistics: %s available on the host, %s needed", _gib(available), _gib(needed))
    logger.info("free_memory_fraction %.2f -> %s for the KV cache", kv_config.free_memory_fraction, _gib(kv_bytes))
    if kv_config.max_tokens is not None:
        pages = math.ceil(kv_config.max_tokens / block_size) * layout.num_groups  # max_tokens in every group
        kv_bytes = min(kv_bytes, (pages + 1) * bytes_per_block)
        logger.info("capped by kv_cache.max_tokens=%d -> %s", kv_config.max_tokens, _gib(kv_bytes))
    if kv_config.max_gpu_total_bytes is not None:
        kv_bytes = min(kv_bytes, kv_config.max_gpu_total_bytes)
        logger.info("capped by kv_cache.max_gpu_total_bytes -> %s", _gib(kv_bytes))
    num_blocks = kv_bytes // bytes_per_block
    logger.info(
        "KV cache: %d blocks of %d tokens x %d layers (%d bytes per token) = %d tokens, %s (from %s); %d layer "
        "groups, %d blocks for one sequence of max_seq_len",
        num_blocks,
        block_size,
        layout.layers_per_page,
        bytes_per_token,
        max(num_blocks - 1, 0) * block_size,
        _gib(num_blocks * bytes_per_block),
        source,
        layout.num_groups,
        seq_pages,
    )
    needed_blocks = seq_pages + 1
    if num_blocks < needed_blocks:
        raise ValueError(
            f"the KV cache holds {max(num_blocks - 1, 0) * block_size} tokens ({num_blocks} blocks, block 0 reserved) "
            f"but one request of max_seq_len={config.max_seq_len} needs {needed_blocks - 1} blocks: lower "
            "max_seq_len or max_batch_size / max_num_tokens (smaller activations), raise "
            "kv_cache.free_memory_fraction or kv_cache.max_tokens, or use a smaller dtype"
        )
    return KvBudget(num_blocks=num_blocks, kv_bytes=kv_bytes, bytes_per_block=bytes_per_block, source=source)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
