"""One step on the device: the pure functions the step table compiles and their outputs.

One step is one or two compiled calls, dispatched back to back without waiting:
  1. the forward (`forward_fn`, one per (bucket, prompt_logprobs)): gathers the tokens the previous
     step sampled into this step's token_ids (overlap), runs the model over the flat token batch,
     writing K/V into the donated cache, and returns the logits at each sequence's last token with
     the min_tokens bans applied, and the GREEDY sampler's results over them (`greedy_sample`);
     prompt-logprobs forwards also score every flat token's next prompt token;
  2. unless the step is greedy without penalties (`StepVariant.greedy_in_forward`: the forward's greedy
     sample is the step's), the sampler (`sampler_fn`, one per (rows, sampler mode, penalties)):
     penalties, the sampler, the sampled tokens' logprobs, and the next PRNG key.
Splitting them keeps the compile count down: a forward serves every sampling mode, and a sampler
(no model in it) compiles quickly. The greedy step, the commonest, is one call: a call's dispatch is
host time even for the sampler (see docs/performance.md), and the forward's argmax over logits it has
just written costs the sampling steps little. Neither call has a device-side conditional, so the host
never waits inside a call. Under tensor parallelism the weights and the cache are split over the mesh's
model axis by the rules table (the Pallas kernels run per device under shard_map,
jaxserve/models/attention.py); a mixture of experts' experts are split by expert or by hidden as
`RunnerSpec.expert_parallel` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jaxserve.buckets import Bucket
from jaxserve.config import LoraConfig
from jaxserve.kv_layout import KVLayout, kv_layout
from jaxserve.logprobs import TokenLogprobs, no_token_logprobs, prompt_token_logprobs, token_logprobs
from jaxserve.models import lora
from jaxserve.models.attention import PagedAttentionMetadata, PagedKVCache
from jaxserve.models.quant import FP8_DTYPE
from jaxserve.models.registry import ModelConfig, ModelFamily
from jaxserve.sampler import sample_with_logits
from jaxserve.sharding.rules import Rules, rules_table
from jaxserve.step_inputs import SamplingInputs, StepInputs, TokenHistory, register_device_pytrees
from jaxserve.variants import SamplerMode, StepConfig

register_device_pytrees()  # the step's input types are declared pytrees in the jax-free step_inputs.py


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class StepWeights:
    """What a forward reads besides its inputs and the KV pool: the model's serving weights and, when the engine
    serves LoRA adapters, every layer's adapter tables (`jaxserve/models/lora.py`; None without adapters)."""

    model: Any
    lora: tuple[dict[str, lora.LoraTable], ...] | None = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class StepOutput:
    """One step's results on the device.

    token_ids: padded to max_batch_size rows, so the next step can gather from it whatever bucket
        either step used.
    logprobs: of each row's sampled token (the top-N zero in a GREEDY step).
    key: the PRNG key of the next step.
    prompt_logprobs: per flat token, of the prompt token after it (prompt-logprobs variants only).
    """

    token_ids: Int[Array, " Bmax"]
    logprobs: TokenLogprobs
    key: Array
    prompt_logprobs: TokenLogprobs | None = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """What the forward returns: float32 logits at each row's last token (min_tokens bans applied) and
    each row's last input token (a carried one filled in: the newest history entry), for the sampler;
    the GREEDY sampler's results over those logits (`greedy_sample`: what a `greedy_in_forward` step
    returns); the prompt logprobs of prompt-logprobs forwards."""

    logits: Float[Array, "B V"]
    last_tokens: Int[Array, " B"]
    greedy_tokens: Int[Array, " Bmax"]
    greedy_logprobs: TokenLogprobs
    next_key: Array
    prompt_logprobs: TokenLogprobs | None = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class StepState:
    """The device state one step hands the next: the tokens it sampled, padded to max_batch_size rows (zeros
    before the first step), which the next forward gathers its carried tokens from, and the PRNG key."""

    previous: Int[Array, " Bmax"]
    key: Array

    @staticmethod
    def initial(max_batch_size: int, key: Array, sharding: jax.sharding.Sharding) -> StepState:
        return StepState(jax.device_put(np.zeros(max_batch_size, np.int32), sharding), jax.device_put(key, sharding))


@dataclass(frozen=True, slots=True)
class RunnerSpec:
    """What fixes the compiled steps: the model, the step shapes and variants, dtype, backend."""

    family: ModelFamily
    cfg: ModelConfig
    steps: StepConfig
    dtype: jnp.dtype  # weights, activations and KV cache
    backend: str  # "pallas" | "xla"
    num_top_logprobs: int
    compile_threads: int = 1
    logprobs_mode: str = "raw_logprobs"  # EngineConfig.logprobs_mode
    kv_layout: KVLayout | None = None  # the KV pool's layer groups; None: one group of every layer
    expert_parallel: bool = False  # EngineConfig.enable_expert_parallel as resolved: whole experts a device
    quantization: str | None = None  # EngineConfig.quantization: the linear weights' storage ("fp8")
    quantize_lm_head: bool = False  # EngineConfig.quantize_lm_head
    kv_cache_dtype: str = "auto"  # KvCacheConfig.dtype: "auto" (the dtype above) or "fp8"
    lora: LoraConfig | None = None  # EngineConfig.lora: the adapter tables' slots and rank (None: no adapters)

    @property
    def cache_dtype(self) -> jnp.dtype:
        """The KV pool's element type: float8_e4m3fn for an FP8 cache, else the serving dtype."""
        return jnp.dtype(FP8_DTYPE) if self.kv_cache_dtype == "fp8" else jnp.dtype(self.dtype)

    @property
    def layout(self) -> KVLayout:
        return self.kv_layout if self.kv_layout is not None else kv_layout([None] * self.cfg.num_layers)

    @property
    def rules(self) -> Rules:
        """The rules table the weights, the KV pool and the step's experts are split by."""
        return rules_table(self.expert_parallel)


def forward_fn(
    step_weights: StepWeights,
    kv_cache: PagedKVCache,
    inputs: StepInputs,
    previous_tokens: Int[Array, " Bmax"],
    key: Array,
    *,
    spec: RunnerSpec,
    mesh: Mesh | None,
    bucket: Bucket,
    prompt_logprobs: bool,
) -> tuple[ForwardOutput, PagedKVCache]:
    """The model part of one step on the device (see the module docstring); `mesh` when tensor-parallel."""
    family, cfg = spec.family, spec.cfg
    weights = step_weights.model
    if step_weights.lora is not None:  # each targeted linear with its adapter slots and the tokens' own slots
        weights = lora.bind(weights, step_weights.lora, inputs.lora_slots)
    token_ids = _gather_carried(inputs, previous_tokens)
    meta = PagedAttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        block_table=inputs.block_table,
        kv_lens=inputs.kv_lens,
        cu_q_lens=inputs.cu_q_lens,
        num_seqs=inputs.num_seqs,
        backend=spec.backend,
        max_q_len=1 if bucket.decode_only else None,
        mesh=mesh,
        kv_layout=spec.kv_layout,
    )
    # Only a mixture of experts is ever expert-parallel (`runner.resolve_expert_parallel`), and only its forward
    # takes the table, whose split its Pallas grouped GEMMs run per device under (XLA partitions the rest).
    table = {"rules": spec.rules} if spec.expert_parallel else {}
    hidden, kv_cache = family.forward(weights, token_ids, inputs.positions, kv_cache, meta, cfg, **table)
    logits = family.compute_logits(weights, hidden[inputs.logits_indices], cfg)
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, inputs.banned_tokens].set(-jnp.inf, mode="drop")
    prompt = None
    if prompt_logprobs:
        score = partial(_raw_logits, weights, family=family, cfg=cfg)
        prompt = prompt_token_logprobs(score, hidden, inputs.prompt_targets, spec.num_top_logprobs)
    tokens, logprobs, next_key = greedy_sample(logits, key, spec=spec)
    return ForwardOutput(logits, token_ids[inputs.logits_indices], tokens, logprobs, next_key, prompt), kv_cache


def sampler_fn(
    logits: Float[Array, "B V"],
    last_tokens: Int[Array, " B"],
    sampling: SamplingInputs,
    history: TokenHistory | None,
    key: Array,
    *,
    spec: RunnerSpec,
    mode: SamplerMode,
) -> tuple[Int[Array, " Bmax"], TokenLogprobs, Array]:
    """The sampling part of one step: the tokens padded to max_batch_size rows (so the next step can
    gather from them whatever bucket either used), their logprobs, the next key. A history (penalties)
    gets each carried token written in first.

    Every mode scores the sampled tokens (logprob and rank) over the raw or the processed logits
    (`spec.logprobs_mode`); the GREEDY mode, which serves no row that asks for top logprobs, leaves the
    top-N zero. The host reads them back only when a row asks."""
    if history is not None:
        rows = jnp.arange(last_tokens.shape[0])
        filled = history.token_ids.at[rows, history.carried_column].set(last_tokens, mode="drop")
        history = TokenHistory(filled, history.num_prompt_tokens, history.carried_column)
    key, next_key = jax.random.split(key)
    sampled, processed = sample_with_logits(logits, sampling, key, mode=mode, history=history)
    scored = processed if spec.logprobs_mode == "processed_logprobs" else logits
    if mode is SamplerMode.GREEDY:
        logprobs = _greedy_logprobs(scored, sampled, spec)
    else:
        logprobs = token_logprobs(scored, sampled, spec.num_top_logprobs)
    return _padded(sampled, spec), logprobs, next_key


def greedy_sample(
    logits: Float[Array, "B V"], key: Array, *, spec: RunnerSpec
) -> tuple[Int[Array, " Bmax"], TokenLogprobs, Array]:
    """`sampler_fn`'s results in the GREEDY mode without penalties (the same tokens, logprobs and next
    key), computed in the forward: the argmax of each row's logits, its logprob and rank (raw and processed
    logits are the same here), the top-N zero."""
    logits = logits.astype(jnp.float32)
    sampled = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return _padded(sampled, spec), _greedy_logprobs(logits, sampled, spec), jax.random.split(key)[1]


def _greedy_logprobs(scored: Float[Array, "B V"], sampled: Int[Array, " B"], spec: RunnerSpec) -> TokenLogprobs:
    chosen = token_logprobs(scored, sampled, 0)
    empty = no_token_logprobs(scored.shape[0], spec.num_top_logprobs)
    return TokenLogprobs(chosen.logprob, chosen.rank, empty.top_logprobs, empty.top_ids)


def _padded(sampled: Int[Array, " B"], spec: RunnerSpec) -> Int[Array, " Bmax"]:
    """The tokens padded to max_batch_size rows (the next step gathers from them whatever its bucket)."""
    return jnp.zeros(spec.steps.buckets.max_batch_size, jnp.int32).at[: sampled.shape[0]].set(sampled)


def _gather_carried(inputs: StepInputs, previous_tokens: Int[Array, " Bmax"]) -> Int[Array, " T"]:
    """token_ids with each carried row's last input replaced by the previous step's sample."""
    num_tokens = inputs.token_ids.shape[0]
    # Rows without a carried token scatter out of bounds (dropped): padding rows share index 0.
    target = jnp.where(inputs.carried_mask, inputs.logits_indices, num_tokens)
    return inputs.token_ids.at[target].set(previous_tokens[inputs.carried_source], mode="drop")


def _raw_logits(weights: Any, hidden: Float[Array, "S D"], *, family: ModelFamily, cfg: ModelConfig) -> Array:
    return family.compute_logits(weights, hidden, cfg)


ForwardKey = tuple[Bucket, bool]  # (bucket, prompt_logprobs)
SamplerKey = tuple[int, SamplerMode, bool]  # (rows, sampler mode, penalties)


def describe(kind: str, key: Any) -> str:
    """A forward's (ForwardKey) or a sampler's (SamplerKey) name in log lines."""
    if kind == "forward":
        bucket, scoring = key
        decode = " (decode)" if bucket.decode_only else ""
        width = "" if bucket.kv_blocks is None else f" kv_blocks={bucket.kv_blocks}"
        return f"T={bucket.num_tokens} B={bucket.num_seqs}{decode}{width}{' +prompt_logprobs' if scoring else ''}"
    rows, mode, penalties = key
    return f"B={rows} {mode.value}{' +penalties' if penalties else ''}"
