"""Engine configuration: the frozen, validated knobs of the KV cache, the scheduler, the compiled step
buckets and the engine itself, plus the pure rules that infer `max_seq_len` and `max_num_tokens`.

Host policy: no jax here. Every config validates itself on construction and names the field and the
allowed range when a value is out of bounds.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)

# TensorRT-LLM's BaseLlmArgs default for max_num_tokens.
DEFAULT_MAX_NUM_TOKENS = 8192
# Used when a model config names no max_position_embeddings (DecoderModelForCausalLM.infer_max_seq_len).
FALLBACK_MAX_SEQ_LEN = 2048
# These rope types already state their extended length in max_position_embeddings, so their factor
# must not scale it again (DecoderModelForCausalLM.infer_max_seq_len).
ROPE_TYPES_WITHOUT_LENGTH_SCALING = frozenset({"su", "longrope", "llama3", "yarn"})

AttentionBackend = Literal["auto", "pallas", "xla"]
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "pallas", "xla")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
# Weight quantizations (`jaxserve/models/quant.py`): "fp8" is float8_e4m3fn with a scale per output channel.
QUANTIZATIONS = ("fp8",)
# KV cache element types (`KvCacheConfig.dtype`): the engine's dtype, or float8_e4m3fn.
KV_CACHE_DTYPES = ("auto", "fp8")

# What sampled tokens' logprobs are taken over (vLLM's logprobs_mode names): the model's logits, or the
# logits the token is drawn from (after penalties, temperature and the top-k / top-p / min-p filters).
LOGPROBS_MODES: tuple[str, ...] = ("raw_logprobs", "processed_logprobs")


def _require_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    """Raises a ValueError naming `name` unless `value` is an int in [minimum, maximum]."""
    allowed = f"[{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int {allowed}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _normalize_sizes(name: str, values: Sequence[int] | None) -> tuple[int, ...] | None:
    """Sorted, deduplicated tuple of positive ints, or None; a ValueError names `name` otherwise."""
    if values is None:
        return None
    sizes = tuple(values)
    if not sizes:
        raise ValueError(f"{name} must be None or a non-empty sequence of ints >= 1, got an empty sequence")
    for size in sizes:
        _require_int(f"{name} entries", size, 1)
    return tuple(sorted(set(sizes)))


class CapacityPolicy(enum.Enum):
    """How the scheduler decides which requests fit in the KV cache (TensorRT-LLM's CapacitySchedulerPolicy).

    GUARANTEED_NO_EVICT: admit a request only when blocks for its whole prompt + max_tokens (bounded
        by max_seq_len) can be reserved; a running request never runs out of blocks.
    MAX_UTILIZATION: admit greedily; when a running request needs a block and none is free, preempt
        the most recently admitted request (free its blocks, recompute it later).
    """

    GUARANTEED_NO_EVICT = "guaranteed_no_evict"
    MAX_UTILIZATION = "max_utilization"


@dataclass(frozen=True, slots=True)
class KvCacheConfig:
    """Paged KV cache: block size, how much free device memory it may take, and prefix caching.

    block_size: tokens per KV block, a power of two in [1, 1024].
    free_memory_fraction: share of the memory left after weights and activations given to the KV
        cache, in (0, 1].
    max_tokens: optional cap on the pool size in tokens (>= 1).
    max_gpu_total_bytes: optional cap on the pool size in bytes (>= 1).
    enable_prefix_caching: reuse the KV of full blocks whose token prefix was computed before.
    sliding_window_kv: sliding-window layers keep only their window of each sequence's KV (blocks below it are
        released as the sequence runs, `jaxserve/kv_layout.py`); False keeps every token in every layer, for
        comparison.
    dtype: "auto" (the engine's dtype) or "fp8": K and V stored as float8_e4m3fn, one byte a value (capacity
        counts it), each value clipped to e4m3's +-448 with a scale of 1 (vLLM's default without calibrated
        scales), read back to the engine's dtype inside the attention kernels (`models/attention.py`).
    """

    block_size: int = 16
    free_memory_fraction: float = 0.9
    max_tokens: int | None = None
    max_gpu_total_bytes: int | None = None
    enable_prefix_caching: bool = True
    sliding_window_kv: bool = True
    dtype: str = "auto"

    def __post_init__(self) -> None:
        _require_int("block_size", self.block_size, 1, 1024)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 1024], got {self.block_size}")
        fraction = self.free_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"free_memory_fraction must be a float in (0, 1], got {fraction!r}")
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens, 1)
        if self.max_gpu_total_bytes is not None:
            _require_int("max_gpu_total_bytes", self.max_gpu_total_bytes, 1)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if not isinstance(self.sliding_window_kv, bool):
            raise ValueError(f"sliding_window_kv must be a bool, got {self.sliding_window_kv!r}")
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv cache dtype must be one of {KV_CACHE_DTYPES}, got {self.dtype!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Capacity policy and whether long prompts may be split across steps (chunked prefill).

    Without chunked prefill, a prompt longer than max_num_tokens can never be scheduled and is
    rejected with an error on that request.
    bucket_aware_admission: under GUARANTEED_NO_EVICT, when the KV pool holds fewer of the waiting
        requests than wait, stop admitting at a compiled decode batch size below what the pool holds if
        batches of that size serve the queue sooner than padded batches of everything the pool holds (by
        the decode steps' costs measured at a GPU warmup; without them nothing changes). Stands aside when
        the first waiting request shares blocks with running ones. See `scheduler.admission_cap`.
    """

    capacity_policy: CapacityPolicy = CapacityPolicy.GUARANTEED_NO_EVICT
    enable_chunked_prefill: bool = True
    bucket_aware_admission: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_policy, CapacityPolicy):
            allowed = ", ".join(p.name for p in CapacityPolicy)
            raise ValueError(f"capacity_policy must be one of {allowed}, got {self.capacity_policy!r}")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}")
        if not isinstance(self.bucket_aware_admission, bool):
            raise ValueError(f"bucket_aware_admission must be a bool, got {self.bucket_aware_admission!r}")


@dataclass(frozen=True, slots=True)
class CompileConfig:
    """Which step shapes are compiled ahead of time (the buckets that stand in for CUDA graphs).

    decode_batch_sizes: batch sizes of decode-only steps; None derives them from max_batch_size with
        TensorRT-LLM's rules (see `inputs.BucketTable`). Stored sorted and deduplicated.
    token_buckets: token counts of mixed / prefill steps; None means powers of two up to
        max_num_tokens. Stored sorted and deduplicated; max_num_tokens is always added.
    enable_padding: pad a decode step up to the next decode batch size; without it a decode step
        whose size is not in the table runs in a mixed bucket.
    cache_dir: directory of the compiled-step store (or of jax's persistent compilation cache without the
        store); None uses the default under the user cache dir ($JAXSERVE_CACHE or ~/.cache/jaxserve).
    penalty_variants: also compile every sampler with a token history, which the repetition / presence /
        frequency penalties need; without it a request that asks for a penalty is refused.
    prompt_logprobs: also compile every token bucket with logprobs at every prompt position, which
        SamplingParams.prompt_logprobs needs (like TensorRT-LLM's gather_context_logits); without it such a
        request is refused.
    compile_threads: executables compiled at once at warmup (XLA compiles outside the GIL); None uses
        min(8, the CPU count).
    store_executables: keep every compiled step in a `steps` folder of cache_dir, so that a restart with
        the same model, table, devices and jaxserve/jax versions loads them instead of tracing and
        compiling them (`jaxserve.executables`; at most 8 GiB, least recently used removed first). It
        stands in for jax's persistent compilation cache, which is turned on only when this is False.
    lazy: compile each step shape (and sampler, penalty and prompt-logprobs variants included) when a step
        first needs it, with a log line, instead of every one at start. None means True on CPU, where
        nobody needs the serving guarantee and start-up time is what a user waits for, and False on an
        accelerator, where every step is compiled ahead of time and a step never waits for a compile.
        The table of allowed shapes and variants is the same either way: a step outside it is refused.
    kv_len_buckets: the attention widths (in tokens) a step is also compiled for, so that its attention
        reads the blocks up to the batch's longest sequence rather than max_seq_len's: a step runs at the
        smallest width that holds its longest sequence (rounded up to whole blocks; max_seq_len is always
        a width). None means powers of two from 256 below max_seq_len on the xla backend, whose attention
        costs what it reads, and none on the Pallas backend, whose kernels already stop at each
        sequence's length. Stored sorted and deduplicated.
    """

    decode_batch_sizes: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    enable_padding: bool = True
    cache_dir: str | None = None
    penalty_variants: bool = True
    prompt_logprobs: bool = False
    compile_threads: int | None = None
    store_executables: bool = True
    lazy: bool | None = None
    kv_len_buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Frozen dataclass: normalising a field needs object.__setattr__.
        object.__setattr__(self, "decode_batch_sizes", _normalize_sizes("decode_batch_sizes", self.decode_batch_sizes))
        object.__setattr__(self, "token_buckets", _normalize_sizes("token_buckets", self.token_buckets))
        object.__setattr__(self, "kv_len_buckets", _normalize_sizes("kv_len_buckets", self.kv_len_buckets))
        if self.lazy is not None and not isinstance(self.lazy, bool):
            raise ValueError(f"lazy must be None or a bool, got {self.lazy!r}")
        if not isinstance(self.enable_padding, bool):
            raise ValueError(f"enable_padding must be a bool, got {self.enable_padding!r}")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir):
            raise ValueError(f"cache_dir must be None or a non-empty path string, got {self.cache_dir!r}")
        if not isinstance(self.penalty_variants, bool):
            raise ValueError(f"penalty_variants must be a bool, got {self.penalty_variants!r}")
        if not isinstance(self.prompt_logprobs, bool):
            raise ValueError(f"prompt_logprobs must be a bool, got {self.prompt_logprobs!r}")
        if not isinstance(self.store_executables, bool):
            raise ValueError(f"store_executables must be a bool, got {self.store_executables!r}")
        threads = self.compile_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"compile_threads must be None or an int >= 1, got {threads!r}")


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """LoRA adapters served beside the base model (vLLM's enable_lora options): max_loras adapters on the device at
    once (each a slot of every targeted linear's table, `jaxserve/models/lora.py`), of rank up to max_lora_rank.
    fold: the tables' A stored as extra output columns of each targeted weight where the weights are unquantized on
    one device (one GEMM gives x @ w and x @ A; `lora.fold`); False: separate tables everywhere (how tensor
    parallelism and FP8 weights hold them)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    fold: bool = True

    def __post_init__(self) -> None:
        _require_int("max_loras", self.max_loras, 1)
        _require_int("max_lora_rank", self.max_lora_rank, 1)
        if not isinstance(self.fold, bool):
            raise ValueError(f"fold must be True or False, got {self.fold!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Resolved limits of one engine; build it with `make_engine_config` to get TensorRT-LLM's defaults.

    max_batch_size: sequences per step (>= 1); with auto_max_batch_size an upper bound the engine
        lowers, once the KV pool is sized, to what the pool holds (`capacity.auto_max_batch_size`).
    max_num_tokens: tokens per step (>= 1).
    max_seq_len: prompt + generated tokens of one sequence (>= 2: one prompt token and one new token).
    attention_backend: "pallas", "xla", or "auto" (pallas on GPU, xla elsewhere).
    dtype: weights / activations / KV dtype: "auto" (the weights' as given), "float32", "bfloat16",
        "float16" (the weights are cast to it when placed on the devices).
    logprobs_mode: what the sampled tokens' logprobs (`SamplingParams.logprobs`, `token_logprobs`)
        are taken over, as vLLM's option of that name: "raw_logprobs" (the default, vLLM's: the model's
        distribution, min_tokens bans applied, before penalties and temperature) or
        "processed_logprobs" (the distribution the token is drawn from: after penalties, temperature
        and the top-k / top-p / min-p filters; a greedy row's after penalties only). Prompt logprobs
        are always raw.
    enable_expert_parallel: the experts' layout of a mixture-of-experts model under tensor parallelism, as
        vLLM's option of that name: True puts E / tp whole experts on each device (E must divide by tp), False
        splits every expert's hidden over the devices (tensor-parallel experts), None takes the default
        (`runner.resolve_expert_parallel`: expert parallel where E divides by tp, as measured in docs/performance.md,
        "MoE: expert layout").
        A dense model has no experts: True is ignored there with a warning, as vLLM ignores it.
    quantization: None (weights in `dtype`) or "fp8": every linear layer's weight in float8_e4m3fn with a scale
        per output channel, quantized as it is placed, and activations quantized per token
        (`jaxserve/models/quant.py`), and a mixture of experts' expert stacks in float8_e4m3fn with a scale per
        expert and output channel (the grouped GEMMs read them as FP8 bytes, the rows unquantized); embeddings,
        lm_head and norms stay in `dtype`.
    quantize_lm_head: with quantization, an untied lm_head quantized too (a scale per vocabulary entry; the
        logits' GEMM reads half the bytes). Off by default, as TensorRT-LLM and vLLM leave the lm_head unquantized;
        a tied lm_head (the embedding) is an error.
    lora: None (no adapters: the steps carry no adapter tables) or the adapters' `LoraConfig`.
    """

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    kv_cache: KvCacheConfig = field(default_factory=KvCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    attention_backend: AttentionBackend = "auto"
    dtype: str = "auto"
    auto_max_batch_size: bool = False
    logprobs_mode: str = "raw_logprobs"
    enable_expert_parallel: bool | None = None
    quantization: str | None = None
    quantize_lm_head: bool = False
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        _require_int("max_batch_size", self.max_batch_size, 1)
        if not isinstance(self.auto_max_batch_size, bool):
            raise ValueError(f"auto_max_batch_size must be a bool, got {self.auto_max_batch_size!r}")
        _require_int("max_num_tokens", self.max_num_tokens, 1)
        _require_int("max_seq_len", self.max_seq_len, 2)
        for name, kind in (("kv_cache", KvCacheConfig), ("scheduler", SchedulerConfig), ("compile", CompileConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.enable_expert_parallel is not None and not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be None or a bool, got {self.enable_expert_parallel!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}")
        if not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"quantize_lm_head must be a bool, got {self.quantize_lm_head!r}")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head=True needs quantization='fp8' (the lm_head is quantized as the linears)")
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(f"lora must be None or a LoraConfig, got {self.lora!r}")

    @property
    def max_blocks_per_seq(self) -> int:
        """M, the width of a block table: blocks that hold max_seq_len tokens."""
        return math.ceil(self.max_seq_len / self.kv_cache.block_size)


def _rope_scaling(hf_config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    # transformers 5 renamed rope_scaling to rope_parameters; read either.
    scaling = hf_config.get("rope_scaling") or hf_config.get("rope_parameters")
    return scaling if isinstance(scaling, Mapping) else None


def model_max_seq_len(hf_config: Mapping[str, Any]) -> int:
    """The longest sequence the model supports: max_position_embeddings times the rope factor.

    Mirrors DecoderModelForCausalLM.infer_max_seq_len: 2048 without max_position_embeddings; the rope
    factor scales the length except for the rope types ("su", "longrope", "llama3", "yarn") whose
    max_position_embeddings already is the extended length.
    """
    rope_factor = 1.0
    scaling = _rope_scaling(hf_config)
    if scaling is not None:
        rope_type = scaling.get("type", scaling.get("rope_type"))
        if rope_type not in ROPE_TYPES_WITHOUT_LENGTH_SCALING:
            rope_factor = float(scaling.get("factor", 1.0) or 1.0)
    max_positions = hf_config.get("max_position_embeddings")
    inferred = FALLBACK_MAX_SEQ_LEN if max_positions is None else int(max_positions)
    if rope_factor != 1.0:
        inferred = int(math.ceil(inferred * rope_factor))
        logger.info("max_seq_len scaled to %d by rope scaling factor %g", inferred, rope_factor)
    return inferred


def infer_max_seq_len(hf_config: Mapping[str, Any], user_value: int | None) -> int:
    """max_seq_len for an engine: the model's limit, or the user's value clamped to it with a warning.

    Mirrors PyTorchModelEngine._init_max_seq_len: a user value larger than what the model supports is
    lowered to the model's limit.
    """
    inferred = model_max_seq_len(hf_config)
    if user_value is None:
        logger.info("max_seq_len not given; using the model's %d", inferred)
        return inferred
    _require_int("max_seq_len", user_value, 2)
    if user_value > inferred:
        logger.warning(
            "max_seq_len %d is larger than what the model supports (%d); using %d", user_value, inferred, inferred
        )
        return inferred
    return user_value


def default_max_num_tokens(max_batch_size: int, max_seq_len: int, user_value: int | None = None) -> int:
    """max_num_tokens: the user's value or 8192, never more than max_batch_size * max_seq_len.

    Mirrors TensorRT-LLM's default (BaseLlmArgs.max_num_tokens = 8192) and check_max_num_tokens, which
    lowers max_num_tokens to max_seq_len * max_batch_size when it is larger: no step can hold more.
    """
    _require_int("max_batch_size", max_batch_size, 1)
    _require_int("max_seq_len", max_seq_len, 2)
    if user_value is not None:
        _require_int("max_num_tokens", user_value, 1)
    value = DEFAULT_MAX_NUM_TOKENS if user_value is None else user_value
    cap = max_batch_size * max_seq_len
    if value > cap:
        log = logger.warning if user_value is not None else logger.info
        log("max_num_tokens %d is larger than max_batch_size * max_seq_len; using %d", value, cap)
        return cap
    return value


def make_engine_config(
    hf_config: Mapping[str, Any],
    *,
    max_batch_size: int,
    max_num_tokens: int | None = None,
    max_seq_len: int | None = None,
    kv_cache: KvCacheConfig | None = None,
    scheduler: SchedulerConfig | None = None,
    compile: CompileConfig | None = None,
    attention_backend: AttentionBackend = "auto",
    dtype: str = "auto",
    auto_max_batch_size: bool = False,
    logprobs_mode: str = "raw_logprobs",
    enable_expert_parallel: bool | None = None,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
    lora: LoraConfig | None = None,
) -> EngineConfig:
    """An EngineConfig whose max_seq_len and max_num_tokens follow TensorRT-LLM's inference rules."""
    seq_len = infer_max_seq_len(hf_config, max_seq_len)
    return EngineConfig(
        max_batch_size=max_batch_size,
        max_num_tokens=default_max_num_tokens(max_batch_size, seq_len, max_num_tokens),
        max_seq_len=seq_len,
        kv_cache=kv_cache if kv_cache is not None else KvCacheConfig(),
        scheduler=scheduler if scheduler is not None else SchedulerConfig(),
        compile=compile if compile is not None else CompileConfig(),
        attention_backend=attention_backend,
        dtype=dtype,
        auto_max_batch_size=auto_max_batch_size,
        logprobs_mode=logprobs_mode,
        enable_expert_parallel=enable_expert_parallel,
        quantization=quantization,
        quantize_lm_head=quantize_lm_head,
        lora=lora,
    )
