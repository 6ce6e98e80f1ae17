"""The model runner: owns the weights, the paged KV cache, the mesh and the compiled steps, one per
(bucket, StepVariant), and runs a step: `run(inputs, bucket, variant) -> StepOutput` (device arrays,
not awaited).

Lifecycle (DESIGN.md "Runner lifecycle and KV capacity"):
    runner = Runner(spec, weights, mesh)       # the serving layout of the weights, placed by sharding/rules.py
    profile = runner.profile()                  # the largest step compiled and run over a probe pool
    budget = capacity.kv_budget(profile, config)
    runner.start(budget.num_blocks)             # allocates the pool, compiles every (bucket, variant)

One compiled step (`step_fn`) does, on the device:
  1. gathers the tokens the previous step sampled into this step's token_ids (overlap);
  2. the model's forward over the flat token batch, writing K/V into the donated cache;
  3. logits at each sequence's last token, min_tokens bans, the sampler, and the logprobs rows ask
     for; prompt-logprobs variants also score every flat token's next prompt token.
Under tensor parallelism the weights and the cache are split over the mesh's model axis by the rules
table (the Pallas kernels run per device under shard_map, models/attention.py). It is the JAX
stand-in for a captured CUDA graph: shapes and variants are fixed at start, and a step that was not
compiled then is refused with an error naming its shape and variant.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from jaxserve import capacity
from jaxserve.inputs import Bucket, StepConfig, StepInputs, StepVariant, TokenHistory, padding_inputs
from jaxserve.logprobs import TokenLogprobs, no_token_logprobs, prompt_token_logprobs, token_logprobs
from jaxserve.sampler import sample
from models.attention import PagedAttentionMetadata, PagedKVCache, init_paged_cache, paged_cache_specs
from models.registry import ModelConfig, ModelFamily
from sharding.mesh import MODEL_AXIS, make_mesh
from sharding.rules import named_shardings

logger = logging.getLogger(__name__)

# inputs.py stays free of jax; the step receives its StepInputs as a pytree.
jax.tree_util.register_dataclass(StepInputs)


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class StepOutput:
    """One step's results on the device.

    token_ids: padded to max_batch_size rows, so the next step can gather from it whatever bucket
        either step used.
    logprobs: of each row's sampled token (zeros in a step where no row asked for logprobs).
    key: the PRNG key of the next step.
    prompt_logprobs: per flat token, of the prompt token after it (prompt-logprobs variants only).
    """

    token_ids: Int[Array, " Bmax"]
    logprobs: TokenLogprobs
    key: Array
    prompt_logprobs: TokenLogprobs | None = None


@dataclass(frozen=True, slots=True)
class RunnerSpec:
    """What fixes the compiled steps: the model, the step shapes and variants, dtype, backend."""

    family: ModelFamily
    cfg: ModelConfig
    steps: StepConfig
    dtype: jnp.dtype  # weights, activations and KV cache
    backend: str  # "pallas" | "xla"
    num_top_logprobs: int


def step_fn(
    weights: Any,
    kv_cache: PagedKVCache,
    inputs: StepInputs,
    previous_tokens: Int[Array, " Bmax"],
    key: Array,
    *,
    spec: RunnerSpec,
    mesh: Mesh | None,
    bucket: Bucket,
    variant: StepVariant,
) -> tuple[StepOutput, PagedKVCache]:
    """One engine step on the device (see the module docstring); `mesh` when tensor-parallel."""
    family, cfg = spec.family, spec.cfg
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
    )
    hidden, kv_cache = family.forward(weights, token_ids, inputs.positions, kv_cache, meta, cfg)
    logits = family.compute_logits(weights, hidden[inputs.logits_indices], cfg)
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, inputs.banned_tokens].set(-jnp.inf, mode="drop")
    history = _with_carried_history(inputs, token_ids) if variant.penalties else None
    key, next_key = jax.random.split(key)
    sampled = sample(logits, inputs.sampling, key, history=history, greedy_only=variant.greedy)
    logprobs = _sampled_logprobs(logits, sampled, inputs.want_logprobs, spec.num_top_logprobs, variant)
    prompt = None
    if variant.prompt_logprobs:
        score = partial(_raw_logits, weights, family=family, cfg=cfg)
        prompt = prompt_token_logprobs(score, hidden, inputs.prompt_targets, spec.num_top_logprobs)
    padded = jnp.zeros_like(previous_tokens).at[: sampled.shape[0]].set(sampled)
    return StepOutput(padded, logprobs, next_key, prompt), kv_cache


def _gather_carried(inputs: StepInputs, previous_tokens: Int[Array, " Bmax"]) -> Int[Array, " T"]:
    """token_ids with each carried row's last input replaced by the previous step's sample."""
    num_tokens = inputs.token_ids.shape[0]
    # Rows without a carried token scatter out of bounds (dropped): padding rows share index 0.
    target = jnp.where(inputs.carried_mask, inputs.logits_indices, num_tokens)
    return inputs.token_ids.at[target].set(previous_tokens[inputs.carried_source], mode="drop")


def _with_carried_history(inputs: StepInputs, token_ids: Int[Array, " T"]) -> TokenHistory:
    """The token history with each carried token, the newest entry of its row, written in."""
    history = inputs.history
    carried = token_ids[inputs.logits_indices]
    column = jnp.where(inputs.carried_mask, inputs.positions[inputs.logits_indices], history.token_ids.shape[1])
    rows = jnp.arange(column.shape[0])
    return TokenHistory(history.token_ids.at[rows, column].set(carried, mode="drop"), history.num_prompt_tokens)


def _sampled_logprobs(
    logits: Float[Array, "B V"], sampled: Int[Array, " B"], wanted: Array, num_top: int, variant: StepVariant
) -> TokenLogprobs:
    """The sampled tokens' logprobs, computed only in steps where a row asked for them.

    top_k over the vocabulary costs 2.2 ms for 256 x 128256 on an H200 (an argmax 0.05 ms). The general
    variants decide on the device; greedy variants have no row that asks.
    """
    rows = logits.shape[0]
    if variant.greedy:
        return no_token_logprobs(rows, num_top)
    return jax.lax.cond(
        wanted,
        lambda lg, t: token_logprobs(lg, t, num_top),
        lambda lg, t: no_token_logprobs(rows, num_top),
        logits,
        sampled,
    )


def _raw_logits(weights: Any, hidden: Float[Array, "S D"], *, family: ModelFamily, cfg: ModelConfig) -> Array:
    return family.compute_logits(weights, hidden, cfg)


class Runner:
    """Weights, KV cache and the compiled step per (bucket, variant); see the module docstring."""

    def __init__(self, spec: RunnerSpec, weights: Any, mesh: Mesh | None = None, seed: int = 0) -> None:
        self.spec = spec
        self.mesh = mesh if mesh is not None else make_mesh(tp=1, devices=jax.devices()[:1])
        _check_heads_divide(spec, self.mesh.shape[MODEL_AXIS])
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        # The checkpoint layout in, the family's serving layout on the mesh, split by the rules table.
        shardings = named_shardings(spec.family.serving_specs(spec.cfg), self.mesh)
        self.weights = spec.family.to_serving(weights, spec.cfg, shardings, spec.dtype)
        self.kv_cache: PagedKVCache | None = None
        self.num_blocks = 0
        self._seed, self._recoveries = seed, 0
        self._reset_step_state(jax.random.PRNGKey(seed))
        self._compiled: dict[tuple[Bucket, StepVariant], jax.stages.Compiled] = {}

    @property
    def compiled_steps(self) -> tuple[tuple[Bucket, StepVariant], ...]:
        """The (bucket, variant) keys compiled so far."""
        return tuple(self._compiled)

    # ---- memory ---------------------------------------------------------------------------------

    def cache_specs(self, num_blocks: int) -> PagedKVCache:
        return paged_cache_specs(self.spec.cfg, num_blocks, self.spec.steps.buckets.block_size)

    def _zero_cache(self, num_blocks: int) -> PagedKVCache:
        shardings = named_shardings(self.cache_specs(num_blocks), self.mesh)
        build = partial(
            init_paged_cache, self.spec.cfg, num_blocks, self.spec.steps.buckets.block_size, self.spec.dtype
        )
        return jax.jit(build, out_shardings=shardings)()

    def profile(self) -> capacity.MemoryProfile:
        """Bytes per KV token, and per device the memory left once the largest step is compiled over a
        small probe pool and run once (no device statistics, as on CPU: bytes per token only)."""
        per_token = capacity.kv_bytes_per_token(self.cache_specs(2), self.mesh, self.spec.dtype)
        devices = list(self.mesh.devices.flat)
        if any(capacity.device_memory(d) is None for d in devices):
            return capacity.MemoryProfile(per_token)
        bucket, variant = self.spec.steps.largest_step()
        probe_blocks = self.spec.steps.buckets.max_blocks_per_seq + 1
        compiled = self.compile_step(bucket, variant, probe_blocks)
        compiled_peak = capacity.activation_peak(compiled)
        before = [capacity.device_memory(d) for d in devices]
        self.probe_step(compiled, bucket, variant, probe_blocks)
        peaks = [capacity.peak_bytes_in_use(d) for d in devices]
        # The probe step's peak above what was in use before it (its small pool included: conservative).
        # peak_bytes_in_use never resets, so a load-time peak can hide the step's: the compiled figure
        # stays the floor.
        measured = max(p - in_use for p, (_, in_use) in zip(peaks, before, strict=True))
        peak = max(compiled_peak, measured)
        logger.info(
            "activation peak of T=%d B=%d %s: %.2f GiB (compiled memory analysis), %.2f GiB (probe step); "
            "using %.2f GiB",
            bucket.num_tokens,
            bucket.num_seqs,
            variant,
            compiled_peak / 2**30,
            measured / 2**30,
            peak / 2**30,
        )
        memory = [capacity.device_memory(d) for d in devices]
        return capacity.MemoryProfile(per_token, tuple(capacity.DeviceMemory(lim, use, peak) for lim, use in memory))

    def probe_step(self, compiled: jax.stages.Compiled, bucket: Bucket, variant: StepVariant, num_blocks: int) -> None:
        """Runs a step compiled for a small pool once on an all-padding batch (for its memory peak)."""
        inputs = padding_inputs(bucket, variant, self.spec.steps)
        out, _ = compiled(self.weights, self._zero_cache(num_blocks), inputs, self._previous, self._key)
        jax.block_until_ready(out)

    # ---- compilation ----------------------------------------------------------------------------

    def start(self, num_blocks: int, show_progress: bool = True) -> float:
        """Allocates the zeroed pool of num_blocks blocks and compiles every (bucket, variant) of
        `StepConfig.compiled_steps`; returns the seconds compiling took."""
        from tqdm.auto import tqdm

        if self.kv_cache is not None:
            raise RuntimeError("the runner is started once")
        self.kv_cache, self.num_blocks = self._zero_cache(num_blocks), num_blocks
        steps = self.spec.steps.compiled_steps()
        start = time.perf_counter()
        for bucket, variant in tqdm(steps, desc="compiling step buckets", disable=not show_progress):
            t0 = time.perf_counter()
            self._compiled[bucket, variant] = self.compile_step(bucket, variant, num_blocks)
            logger.info(
                "compiled T=%d B=%d%s %s in %.2fs",
                bucket.num_tokens,
                bucket.num_seqs,
                " (decode)" if bucket.decode_only else "",
                variant,
                time.perf_counter() - t0,
            )
        total = time.perf_counter() - start
        logger.info("warmup: %d step variants in %.1fs", len(steps), total)
        return total

    def compile_step(self, bucket: Bucket, variant: StepVariant, num_blocks: int) -> jax.stages.Compiled:
        """Lowers and compiles one step for a pool of num_blocks blocks (`start` keeps the results)."""
        tensor_parallel = self.mesh.shape[MODEL_AXIS] > 1
        fn = partial(
            step_fn, spec=self.spec, mesh=self.mesh if tensor_parallel else None, bucket=bucket, variant=variant
        )
        jitted = jax.jit(fn, donate_argnames=("kv_cache",))  # updated in place
        return jitted.lower(*self._abstract_args(bucket, variant, num_blocks)).compile()

    def _abstract_args(self, bucket: Bucket, variant: StepVariant, num_blocks: int) -> tuple:
        def abstract(x: Any, sharding: Any = self._replicated) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        weights = jax.tree.map(lambda w: abstract(w, w.sharding), self.weights)
        specs = self.cache_specs(num_blocks)
        shardings = named_shardings(specs, self.mesh)
        cache = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, self.spec.dtype, sharding=sh), specs, shardings
        )
        inputs = jax.tree.map(abstract, padding_inputs(bucket, variant, self.spec.steps))
        return weights, cache, inputs, abstract(self._previous), abstract(self._key)

    # ---- one step -------------------------------------------------------------------------------

    def run(self, inputs: StepInputs, bucket: Bucket, variant: StepVariant) -> StepOutput:
        """Dispatches the step compiled for (bucket, variant); returns its device outputs without waiting."""
        compiled = self._compiled.get((bucket, variant))
        if compiled is None:
            shapes = [(b.num_tokens, b.num_seqs, b.decode_only, str(v)) for b, v in self._compiled]
            raise RuntimeError(
                f"no compiled step for T={bucket.num_tokens} B={bucket.num_seqs} decode_only={bucket.decode_only} "
                f"variant={variant}: steps are compiled only at start (compiled (T, B, decode_only, variant): "
                f"{shapes})"
            )
        out, self.kv_cache = compiled(self.weights, self.kv_cache, inputs, self._previous, self._key)
        self._previous, self._key = out.token_ids, out.key
        return out

    def _reset_step_state(self, key: Array) -> None:
        """The device state one step hands the next: its sampled tokens (zeros: none) and the PRNG key."""
        self._key = jax.device_put(key, self._replicated)
        self._previous = jax.device_put(np.zeros(self.spec.steps.buckets.max_batch_size, np.int32), self._replicated)

    def recover(self) -> None:
        """Usable again after a step failed or was interrupted: the device state a failed call may have
        consumed or poisoned (the previous step's tokens, the PRNG key, the donated KV pool) is replaced.
        The pool's contents are not kept; the engine recomputes every request."""
        self._recoveries += 1
        self._reset_step_state(jax.random.fold_in(jax.random.PRNGKey(self._seed), self._recoveries))
        if self.kv_cache is None:
            return
        try:  # raises for a pool donated to a call that did not return it, or computed by a failed one
            jax.block_until_ready(self.kv_cache)
        except Exception:
            logger.warning("reallocating the KV pool after a failed step", exc_info=True)
            self.kv_cache = None  # frees the old buffers before the new ones are taken
            self.kv_cache = self._zero_cache(self.num_blocks)


def _check_heads_divide(spec: RunnerSpec, tp: int) -> None:
    cfg = spec.cfg
    if spec.backend == "pallas" and tp > 1 and (cfg.num_kv_heads % tp or cfg.num_heads % tp):
        raise ValueError(
            f"attention_backend='pallas' with tp={tp} runs the kernels per device on a share of the heads: "
            f"num_kv_heads ({cfg.num_kv_heads}) and num_heads ({cfg.num_heads}) must be divisible "
            "by tp; use a tp that divides them or attention_backend='xla'"
        )


def resolve_backend(backend: str) -> str:
    """ "auto" -> "pallas" on GPU, "xla" elsewhere; "pallas" off GPU is refused with the reason."""
    platform = jax.default_backend()
    if backend == "auto":
        resolved = "pallas" if platform == "gpu" else "xla"
        logger.info("attention_backend auto -> %s (%s)", resolved, platform)
        return resolved
    if backend == "pallas" and platform != "gpu":
        raise ValueError(f"attention_backend='pallas' needs a GPU (jax runs on {platform}); use 'xla' or 'auto'")
    return backend


def default_compilation_cache_dir() -> str:
    base = os.environ.get("JAXSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
    return os.path.join(base, "xla")


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Turns on jax's persistent compilation cache (unless the user configured one), so a restart is fast."""
    if jax.config.jax_compilation_cache_dir:
        return
    path = cache_dir or default_compilation_cache_dir()
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    logger.info("persistent compilation cache: %s", path)
