"""The model runner: owns the weights, the paged KV cache, the mesh and the compiled executables, and
runs a step: `run(inputs, bucket, variant) -> StepOutput` (device arrays, not awaited).

Lifecycle (DESIGN.md "Runner lifecycle and KV capacity"):
    runner = Runner(spec, weights, mesh)       # the serving layout of the weights, placed by jaxserve/sharding/rules.py
    profile = runner.profile()                  # the largest step compiled and run over a probe pool
    budget = capacity.kv_budget(profile, config)
    runner.start(budget.num_blocks)             # allocates the pool, compiles every forward and sampler

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
(no model in it) compiles in a fraction of a second. The greedy step, the commonest, is one call: a
call's dispatch costs the host 0.3-0.5 ms even for the sampler (docs/benchmarks.md), and the forward's
argmax over logits it has just written costs the sampling steps little. Neither call has a device-side
conditional, so the host never waits inside a call. Under tensor parallelism the weights and the cache are split over
the mesh's model axis by the rules table (the Pallas kernels run per device under shard_map,
jaxserve/models/attention.py). The executables are the JAX stand-in for captured CUDA graphs: shapes and
variants are fixed at start, and a step that was not compiled then is refused with an error naming
its shape and variant. A lazily started runner (CompileConfig.lazy, the default on CPU) compiles
nothing at start: each forward and sampler of the same table is compiled (or loaded from the step
store) the first time a step needs it, with a log line; a step outside the table is still refused.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from jaxserve import capacity
from jaxserve.buckets import Bucket
from jaxserve.executables import ExecutableStore
from jaxserve.logprobs import TokenLogprobs, no_token_logprobs, prompt_token_logprobs, token_logprobs
from jaxserve.models.attention import PagedAttentionMetadata, PagedKVCache, init_paged_cache, paged_cache_specs
from jaxserve.models.common import delete_arrays
from jaxserve.models.registry import ModelConfig, ModelFamily
from jaxserve.sampler import sample_with_logits
from jaxserve.sharding.mesh import MESH_AXES, MODEL_AXIS, make_mesh
from jaxserve.sharding.rules import named_shardings
from jaxserve.step_inputs import SamplingInputs, StepInputs, TokenHistory, padding_inputs, register_device_pytrees
from jaxserve.variants import SamplerMode, StepConfig, StepVariant

if TYPE_CHECKING:
    from jaxserve.distributed import StepChannel

logger = logging.getLogger(__name__)

register_device_pytrees()  # StepInputs is a pytree declared in the jax-free step_inputs.py


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


def forward_fn(
    weights: Any,
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


class Runner:
    """Weights, KV cache and the compiled forwards and samplers; see the module docstring."""

    def __init__(
        self,
        spec: RunnerSpec,
        weights: Any,
        mesh: Mesh | None = None,
        seed: int = 0,
        store_dir: str | os.PathLike | None = None,
        channel: StepChannel | None = None,
    ) -> None:
        self.spec = spec
        # Process 0 of a multi-process run: each step goes to the followers before it is dispatched.
        self.channel = channel
        self.mesh = mesh if mesh is not None else make_mesh(tp=1, devices=jax.devices()[:1])
        if self.mesh.axis_names != MESH_AXES:  # the rules table and the kernels name these axes
            raise ValueError(
                f"the runner's mesh has axes {self.mesh.axis_names}, expected {MESH_AXES}: "
                "jaxserve.sharding.mesh.serving_mesh maps a caller's mesh onto them"
            )
        devices = list(self.mesh.devices.flat)
        self.store = ExecutableStore(store_dir, devices) if store_dir is not None else None
        _check_heads_divide(spec, self.mesh.shape[MODEL_AXIS])
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        # The checkpoint layout in, the family's serving layout on the mesh, split by the rules table.
        shardings = named_shardings(spec.family.serving_specs(spec.cfg), self.mesh)
        self.weights = spec.family.to_serving(weights, spec.cfg, shardings, spec.dtype)
        self._weight_shardings = shardings
        self._host_weights: Any = None  # the weights while offloaded (`offload_weights`)
        self.kv_cache: PagedKVCache | None = None
        self.num_blocks = 0
        self._seed, self._recoveries = seed, 0
        self._reset_step_state(jax.random.PRNGKey(seed))
        self._forwards: dict[ForwardKey, jax.stages.Compiled] = {}
        self._samplers: dict[SamplerKey, jax.stages.Compiled] = {}
        self.lazy = False  # set by `start`
        # Seconds of each decode-only forward on padding, by batch size (`start` on a GPU; `time_decode_steps`)
        self.decode_costs: dict[int, float] | None = None
        self.lazy_compile_seconds = 0.0  # spent compiling steps on first use
        # (tracing + lowering, XLA compile) seconds of every executable compiled (not loaded from the store)
        self.compile_timings: list[tuple[float, float]] = []

    def update_weights(self, weights: Any) -> None:
        """New values for every weight (checkpoint layout, validated by the caller: same shapes), placed
        where the old ones were, with the same dtype: the compiled steps take them as they are. The old
        buffers (if any: none after `discard_weights`) are deleted layer by layer as the new ones are built."""
        old, self.weights, self._host_weights = self.weights, None, None
        family, cfg, dtype = self.spec.family, self.spec.cfg, self.spec.dtype
        self.weights = family.to_serving(weights, cfg, self._weight_shardings, dtype, replacing=old)

    # ---- releasing memory (sleep, close) -------------------------------------------------------

    def release_kv(self) -> None:
        """Frees the KV pool (its contents are gone); `restore_kv` allocates a zeroed one of the same size."""
        delete_arrays(self.kv_cache)
        self.kv_cache = None

    def restore_kv(self) -> None:
        self.kv_cache = self._zero_cache(self.num_blocks)

    def offload_weights(self) -> None:
        """Moves the weights to host memory (numpy) and frees their device buffers; `reload_weights`
        puts them back where they were."""
        self._host_weights = jax.device_get(self.weights)
        delete_arrays(self.weights)
        self.weights = None

    def reload_weights(self) -> None:
        self.weights = jax.device_put(self._host_weights, self._weight_shardings)
        self._host_weights = None

    def discard_weights(self) -> None:
        """Frees the weights' device buffers without a copy; `update_weights` brings new ones."""
        delete_arrays(self.weights)
        self.weights, self._host_weights = None, None

    @property
    def has_weights(self) -> bool:
        return self.weights is not None

    @property
    def has_host_weights(self) -> bool:
        return self._host_weights is not None

    def close(self) -> None:
        """Frees every device buffer the runner holds and drops its compiled executables; the followers of
        a multi-process run stop."""
        if self.channel is not None:
            self.channel.send_stop()
            self.channel = None
        self.release_kv()
        self.discard_weights()
        delete_arrays((self._previous, self._key))
        self._forwards.clear()
        self._samplers.clear()

    @property
    def compiled_steps(self) -> tuple[tuple[Bucket, StepVariant], ...]:
        """The (bucket, variant) steps whose forward and sampler are both compiled."""
        return tuple(step for step in self.spec.steps.compiled_steps() if self._executables(*step) is not None)

    def compile_seconds(self) -> tuple[float, float]:
        """(tracing + lowering, XLA compile) seconds summed over `compile_timings`."""
        return sum(t[0] for t in self.compile_timings), sum(t[1] for t in self.compile_timings)

    @property
    def num_executables(self) -> int:
        return len(self._forwards) + len(self._samplers)

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
        small probe pool and run once (no device statistics, as on CPU: bytes per token only). This
        process's devices only: in a multi-process run each process profiles its own, then they agree on
        the smallest pool (`distributed.agree_on_num_blocks`)."""
        per_token = capacity.kv_bytes_per_token(self.cache_specs(2), self.mesh, self.spec.dtype)
        devices = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        if any(capacity.device_memory(d) is None for d in devices):
            return capacity.MemoryProfile(per_token)
        bucket, variant = self.spec.steps.largest_step()
        probe_blocks = self.spec.steps.buckets.max_blocks_per_seq + 1
        forward = self.compile_forward(bucket, variant.prompt_logprobs, probe_blocks)
        sampler = self.compile_sampler(bucket.num_seqs, variant.sampler, variant.penalties)
        compiled_peak = max(capacity.activation_peak(forward), capacity.activation_peak(sampler))
        # The probe's pool (one max_seq_len sequence: 16 GiB at the 8B shape's 131072 tokens) is in use
        # before the step, as the real pool will be, so that only the step's own memory counts.
        probe_pool = self._zero_cache(probe_blocks)
        before = [capacity.device_memory(d) for d in devices]
        self.probe_step(forward, sampler, bucket, variant, probe_pool)
        peaks = [capacity.peak_bytes_in_use(d) for d in devices]
        # The probe step's peak above what was in use before it. peak_bytes_in_use never resets, so a
        # load-time peak can hide the step's: the compiled figure stays the floor.
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

    def probe_step(
        self,
        forward: jax.stages.Compiled,
        sampler: jax.stages.Compiled,
        bucket: Bucket,
        variant: StepVariant,
        kv_cache: Any,
    ) -> None:
        """Runs a step compiled for a small pool once on an all-padding batch (for its memory peak); the
        pool `kv_cache` is donated to it."""
        inputs = padding_inputs(bucket, variant, self.spec.steps)
        out, _ = forward(self.weights, kv_cache, replace(inputs, history=None), self._previous, self._key)
        jax.block_until_ready(sampler(out.logits, out.last_tokens, inputs.sampling, inputs.history, self._key))

    def set_steps(self, steps: StepConfig) -> None:
        """Replaces the step table before `start` (the engine lowers max_batch_size once the pool is sized)."""
        if self.kv_cache is not None:
            raise RuntimeError("the step table is fixed once the runner is started")
        self.spec = replace(self.spec, steps=steps)
        self._reset_step_state(self._key)

    # ---- compilation ----------------------------------------------------------------------------

    def start(self, num_blocks: int, show_progress: bool = True, lazy: bool = False) -> float:
        """Allocates the zeroed pool of num_blocks blocks and compiles every forward and sampler of the
        StepConfig (`forwards`, `samplers`), spec.compile_threads at a time; returns the seconds taken.
        lazy: compile nothing now; `run` compiles each of them when a step first needs it."""
        from tqdm.auto import tqdm

        if self.kv_cache is not None:
            raise RuntimeError("the runner is started once")
        self.kv_cache, self.num_blocks = self._zero_cache(num_blocks), num_blocks
        steps = self.spec.steps
        self.lazy = lazy
        if lazy:
            self._allowed = (frozenset(steps.forwards()), frozenset(steps.samplers()))
            logger.info(
                "lazy compilation: %d forwards and %d samplers allowed, each compiled when a step first needs it",
                len(self._allowed[0]),
                len(self._allowed[1]),
            )
            return 0.0
        jobs: list[tuple[str, Any, Any]] = [
            ("forward", key, partial(self.compile_forward, *key, num_blocks)) for key in steps.forwards()
        ]
        jobs += [("sampler", key, partial(self.compile_sampler, *key)) for key in steps.samplers()]
        start, hits = time.perf_counter(), self.store.hits if self.store is not None else 0

        def compile_one(job: tuple[str, Any, Any]) -> tuple[str, Any, jax.stages.Compiled, float]:
            kind, key, build = job
            t0 = time.perf_counter()
            return kind, key, build(), time.perf_counter() - t0

        with ThreadPoolExecutor(max_workers=self.spec.compile_threads) as pool:
            done = pool.map(compile_one, jobs)  # in order: forwards (the long ones) start first
            for kind, key, compiled, seconds in tqdm(
                done, total=len(jobs), desc="compiling", disable=not show_progress
            ):
                (self._forwards if kind == "forward" else self._samplers)[key] = compiled
                logger.info("compiled %s %s in %.2fs", kind, _describe(kind, key), seconds)
        compiled_in = time.perf_counter() - start
        first_runs = 0.0
        if jax.default_backend() == "gpu":
            first_runs = self._run_each_once()
            timed_from = time.perf_counter()
            self.decode_costs = self.time_decode_steps()
            logger.info(
                "decode step on padding, ms by batch size: %s (timed in %.2fs)",
                ", ".join(f"{rows}: {1e3 * cost:.2f}" for rows, cost in self.decode_costs.items()),
                time.perf_counter() - timed_from,
            )
        total = time.perf_counter() - start
        lowering, xla = self.compile_seconds()
        logger.info(
            "warmup: %d forwards and %d samplers in %.1fs (%d threads; %s; %d compiled: %.1fs tracing and "
            "lowering, %.1fs in XLA, summed; each run once in %.1fs)",
            len(self._forwards),
            len(self._samplers),
            compiled_in,
            self.spec.compile_threads,
            "no step store" if self.store is None else f"{self.store.hits - hits} loaded from the step store",
            len(self.compile_timings),
            lowering,
            xla,
            first_runs,
        )
        return total

    def _run_each_once(self) -> float:
        """Runs every compiled forward and sampler once on all-padding inputs (their K/V go to the reserved
        block); returns the seconds taken. An executable's first run on a GPU loads its kernels and
        resolves its constants (tens of ms for a forward), which would otherwise stall the first step of
        each shape the engine meets, as CUDA-graph capture does in other engines."""
        start, steps, ran = time.perf_counter(), self.spec.steps, set()
        for (bucket, prompt_logprobs), forward in self._forwards.items():
            inputs = padding_inputs(bucket, StepVariant(prompt_logprobs=prompt_logprobs), steps)
            out, self.kv_cache = forward(
                self.weights, self.kv_cache, replace(inputs, history=None), self._previous, self._key
            )
            for (rows, mode, penalties), sampler in self._samplers.items():
                if rows == bucket.num_seqs and (rows, mode, penalties) not in ran:
                    padding = padding_inputs(bucket, StepVariant(mode, penalties), steps)
                    sampler(out.logits, out.last_tokens, padding.sampling, padding.history, self._key)
                    ran.add((rows, mode, penalties))
        jax.block_until_ready(self.kv_cache)
        return time.perf_counter() - start

    def time_decode_steps(self, repeats: int = 3) -> dict[int, float]:
        """Seconds of each decode batch size's forward on all-padding rows, its narrowest block-table width (a
        padding row reads no K/V, so the width only adds launch work): the difference between 1 and 1 +
        `repeats` calls queued back to back, over `repeats`, so the figure is the device's time per step, as
        overlapped steps see it, without the first call's dispatch. What a padded row costs, for bucket-aware
        admission (`scheduler.admission_cap`). Every forward has run once before (`_run_each_once`)."""
        max_blocks = self.spec.steps.buckets.max_blocks_per_seq
        narrowest: dict[int, tuple[Bucket, jax.stages.Compiled]] = {}
        # Widest first, so the narrowest of each batch size is written last.
        decode = [(b, f) for (b, logprobs), f in self._forwards.items() if b.decode_only and not logprobs]
        for bucket, forward in sorted(decode, key=lambda item: -(item[0].kv_blocks or max_blocks)):
            narrowest[bucket.num_seqs] = (bucket, forward)
        costs: dict[int, float] = {}
        for rows in sorted(narrowest):
            bucket, forward = narrowest[rows]
            inputs = replace(padding_inputs(bucket, StepVariant(), self.spec.steps), history=None)
            seconds = []
            for count in (1, 1 + repeats):
                jax.block_until_ready(self.kv_cache)
                start = time.perf_counter()
                for _ in range(count):
                    _, self.kv_cache = forward(self.weights, self.kv_cache, inputs, self._previous, self._key)
                jax.block_until_ready(self.kv_cache)
                seconds.append(time.perf_counter() - start)
            costs[rows] = max(seconds[1] - seconds[0], 0.0) / repeats
        return costs

    def compile_forward(
        self, bucket: Bucket, prompt_logprobs: bool, num_blocks: int, compiler_options: dict[str, Any] | None = None
    ) -> jax.stages.Compiled:
        """Lowers and compiles one bucket's forward for a pool of num_blocks blocks, with XLA's
        `compiler_options` (default: `forward_compiler_options`)."""
        if compiler_options is None:
            compiler_options = forward_compiler_options(self.mesh.devices.flat[0].platform, bucket)
        tensor_parallel = self.mesh.shape[MODEL_AXIS] > 1
        fn = partial(
            forward_fn,
            spec=self.spec,
            mesh=self.mesh if tensor_parallel else None,
            bucket=bucket,
            prompt_logprobs=prompt_logprobs,
        )
        weights = jax.tree.map(lambda w: self._abstract(w, w.sharding), self.weights)
        specs = self.cache_specs(num_blocks)
        cache_shardings = named_shardings(specs, self.mesh)
        cache = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, self.spec.dtype, sharding=sh), specs, cache_shardings
        )
        inputs = padding_inputs(bucket, StepVariant(prompt_logprobs=prompt_logprobs), self.spec.steps)
        abstract_inputs = jax.tree.map(self._abstract, inputs)
        args = (weights, cache, abstract_inputs, self._abstract(self._previous), self._abstract(self._key))
        # The outputs replicated (under tensor parallelism XLA would leave the logits split over the vocabulary,
        # which the sampler, compiled for replicated logits, refuses) and the pool kept in its own layout,
        # donated: updated in place.
        out_shardings = (self._replicated, cache_shardings)
        jitted = jax.jit(fn, donate_argnames=("kv_cache",), out_shardings=out_shardings)
        compile_fn = partial(_lower_and_compile, jitted, args, self.compile_timings, compiler_options)
        options = sorted(compiler_options.items())
        return self._compiled("forward", (bucket, prompt_logprobs, tensor_parallel, options), args, compile_fn)

    def compile_sampler(self, rows: int, mode: SamplerMode, penalties: bool) -> jax.stages.Compiled:
        """Lowers and compiles the sampler for `rows` rows in one mode, with or without penalties."""
        padding = padding_inputs(Bucket(rows, rows), StepVariant(mode, penalties), self.spec.steps)
        logits = jax.ShapeDtypeStruct((rows, self.spec.cfg.vocab_size), jnp.float32, sharding=self._replicated)
        last_tokens = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=self._replicated)
        sampling, history = (jax.tree.map(self._abstract, x) for x in (padding.sampling, padding.history))
        fn = partial(sampler_fn, spec=self.spec, mode=mode)
        args = (logits, last_tokens, sampling, history, self._abstract(self._key))
        compile_fn = partial(_lower_and_compile, jax.jit(fn), args, self.compile_timings)
        return self._compiled("sampler", (rows, mode, penalties), args, compile_fn)

    def _compiled(
        self, kind: str, key: tuple, args: tuple, compile_fn: Callable[[], jax.stages.Compiled]
    ) -> jax.stages.Compiled:
        """compile_fn's executable, from the executable store when it has it (see `executables`)."""
        if self.store is None:
            return compile_fn()
        # Every field of the spec but the thread count decides the executable; the family by its name.
        statics = repr((self.spec.family.__name__, replace(self.spec, family=None, compile_threads=0)))
        return self.store.get_or_compile(kind, f"{statics} {key!r}", args, compile_fn)

    def _abstract(self, x: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding if sharding is not None else self._replicated)

    def _executables(
        self, bucket: Bucket, variant: StepVariant
    ) -> tuple[jax.stages.Compiled, jax.stages.Compiled | None] | None:
        """The step's forward and sampler (None for a `greedy_in_forward` step); None when one is missing."""
        forward = self._forwards.get((bucket, variant.prompt_logprobs))
        if variant.greedy_in_forward:
            return None if forward is None else (forward, None)
        sampler = self._samplers.get((bucket.num_seqs, variant.sampler, variant.penalties))
        return None if forward is None or sampler is None else (forward, sampler)

    # ---- one step -------------------------------------------------------------------------------

    def run(self, inputs: StepInputs, bucket: Bucket, variant: StepVariant) -> StepOutput:
        """Dispatches the step's forward and sampler; returns their device outputs without waiting."""
        executables = self._executables(bucket, variant)
        if executables is None and self.lazy:
            executables = self._compile_on_first_use(bucket, variant)
        if executables is None:
            forwards = [(b.num_tokens, b.num_seqs, b.decode_only, b.kv_blocks, s) for b, s in self._allowed_forwards()]
            samplers = [(rows, mode.value, penalties) for rows, mode, penalties in self._allowed_samplers()]
            when = "in the step table" if self.lazy else "compiled only at start"
            raise RuntimeError(
                f"no compiled step for T={bucket.num_tokens} B={bucket.num_seqs} decode_only={bucket.decode_only} "
                f"variant={variant} kv_blocks={bucket.kv_blocks}: steps are {when} (forwards (T, B, decode_only, "
                f"kv_blocks, prompt_logprobs): {forwards}; samplers (rows, mode, penalties): {samplers})"
            )
        forward, sampler = executables
        if self.channel is not None:
            self.channel.send_step(self.spec.steps, bucket, variant, inputs)
        out, self.kv_cache = forward(
            self.weights, self.kv_cache, replace(inputs, history=None), self._previous, self._key
        )
        if sampler is None:  # greedy_in_forward
            tokens, logprobs, key = out.greedy_tokens, out.greedy_logprobs, out.next_key
        else:
            tokens, logprobs, key = sampler(out.logits, out.last_tokens, inputs.sampling, inputs.history, self._key)
        self._previous, self._key = tokens, key
        return StepOutput(tokens, logprobs, key, out.prompt_logprobs)

    def _allowed_forwards(self) -> Any:
        return sorted(self._allowed[0], key=repr) if self.lazy else list(self._forwards)

    def _allowed_samplers(self) -> Any:
        return sorted(self._allowed[1], key=repr) if self.lazy else list(self._samplers)

    def _compile_on_first_use(
        self, bucket: Bucket, variant: StepVariant
    ) -> tuple[jax.stages.Compiled, jax.stages.Compiled] | None:
        """The step's forward and sampler, compiling (or loading) whichever is missing, when the step table
        has them; None when it does not (`run` refuses the step)."""
        forward_key = (bucket, variant.prompt_logprobs)
        sampler_key = None if variant.greedy_in_forward else (bucket.num_seqs, variant.sampler, variant.penalties)
        if forward_key not in self._allowed[0] or (sampler_key is not None and sampler_key not in self._allowed[1]):
            return None
        start = time.perf_counter()
        if forward_key not in self._forwards:
            self._forwards[forward_key] = self.compile_forward(*forward_key, self.num_blocks)
            logger.info("compiled on first use: forward %s", _describe("forward", forward_key))
        if sampler_key is not None and sampler_key not in self._samplers:
            self._samplers[sampler_key] = self.compile_sampler(*sampler_key)
            logger.info("compiled on first use: sampler %s", _describe("sampler", sampler_key))
        seconds = time.perf_counter() - start
        self.lazy_compile_seconds += seconds
        logger.info("first use of T=%d B=%d %s: %.2fs to compile", bucket.num_tokens, bucket.num_seqs, variant, seconds)
        return self._executables(bucket, variant)

    def _reset_step_state(self, key: Array) -> None:
        """The device state one step hands the next: its sampled tokens (zeros: none) and the PRNG key."""
        self._key = jax.device_put(key, self._replicated)
        self._previous = jax.device_put(np.zeros(self.spec.steps.buckets.max_batch_size, np.int32), self._replicated)

    def recover(self) -> None:
        """Usable again after a step failed or was interrupted: the device state a failed call may have
        consumed or poisoned (the previous step's tokens, the PRNG key, the donated KV pool) is replaced.
        The pool's contents are not kept; the engine recomputes every request. Not in a multi-process run,
        where a failed step most likely means a process died: the run must be restarted."""
        if jax.process_count() > 1:
            raise RuntimeError(
                f"a step failed in a run of {jax.process_count()} processes (process {jax.process_index()}): a peer "
                "process has most likely died or lost its connection; the engine cannot go on: restart every process"
            )
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


# On a GPU, forwards of at least this many tokens (the GEMMs' M) compile with XLA's Triton GEMMs off, so
# cuBLAS runs them: as fast from 64 rows up (8B shape on an H200: decode 64 rows 5.14 ms against 5.34 with
# Triton, 1024 rows 28.6 against 29.1), and a decode forward compiles 2-3x quicker, Triton's autotuning
# being most of a cold warmup's XLA time. Fewer rows keep XLA's choice: its Triton GEMMs are faster there
# (1 row 4.41 ms against 5.91). `python benchmarks/gemm_options.py`; docs/benchmarks.md.
CUBLAS_MIN_TOKENS = 64
TRITON_GEMM_OPTION = "xla_gpu_enable_triton_gemm"


def forward_compiler_options(platform: str, bucket: Bucket) -> dict[str, Any]:
    """XLA options of one bucket's forward compile: Triton GEMMs off for GPU buckets of
    >= CUBLAS_MIN_TOKENS tokens, none otherwise, and none when XLA_FLAGS sets the option itself."""
    if platform not in ("gpu", "cuda"):
        return {}
    if TRITON_GEMM_OPTION in os.environ.get("XLA_FLAGS", ""):
        return {}
    return {TRITON_GEMM_OPTION: False} if bucket.num_tokens >= CUBLAS_MIN_TOKENS else {}


def _lower_and_compile(
    jitted: Any, args: tuple, timings: list[tuple[float, float]], compiler_options: dict[str, Any] | None = None
) -> jax.stages.Compiled:
    """jitted's executable for args, compiled with XLA's compiler_options; appends (seconds tracing and
    lowering, seconds in XLA's compile) to timings. The first holds the GIL, the second releases it, so the
    warmup's threads overlap only the second."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile(compiler_options=compiler_options or None)
    timings.append((t1 - t0, time.perf_counter() - t1))
    return compiled


def _describe(kind: str, key: Any) -> str:
    if kind == "forward":
        bucket, scoring = key
        decode = " (decode)" if bucket.decode_only else ""
        width = "" if bucket.kv_blocks is None else f" kv_blocks={bucket.kv_blocks}"
        return f"T={bucket.num_tokens} B={bucket.num_seqs}{decode}{width}{' +prompt_logprobs' if scoring else ''}"
    rows, mode, penalties = key
    return f"B={rows} {mode.value}{' +penalties' if penalties else ''}"


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


def resolve_lazy(lazy: bool | None) -> bool:
    """CompileConfig.lazy: None -> True on CPU (compile each step on first use), False on an accelerator."""
    if lazy is not None:
        return lazy
    resolved = jax.default_backend() == "cpu"
    logger.info("lazy compilation %s (%s)", "on" if resolved else "off", jax.default_backend())
    return resolved


def default_executable_store_dir(cache_dir: str | None) -> str:
    """Where the runner keeps its compiled steps: a `steps` folder in the persistent compilation cache."""
    return os.path.join(cache_dir or default_compilation_cache_dir(), "steps")


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
    # Every executable, not only those that took over a second to compile: a restart compiles dozens of
    # samplers of about a second each.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    logger.info("persistent compilation cache: %s", path)
