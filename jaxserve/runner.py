"""The model runner: owns the weights, the paged KV cache, the mesh, the compiled step table and the state
one step hands the next, and runs a step: `run(inputs, bucket, variant) -> StepOutput` (device arrays, not
awaited).

Lifecycle (DESIGN.md "Runner lifecycle and KV capacity"):
    runner = Runner(spec, weights, mesh)       # the serving layout of the weights, placed by jaxserve/sharding/rules.py
    profile = runner.profile()                  # the largest step compiled and run over a probe pool
    budget = capacity.kv_budget(profile, config)
    runner.start(budget.num_blocks)             # allocates the pool, compiles every forward and sampler

Its parts: the step's device functions (jaxserve/step.py), the compiled step table (jaxserve/step_table.py),
the capacity probe (jaxserve/memory_probe.py). Here: the weights' and the pool's lifecycle (placing,
sleeping, releasing, new weights), running one step (and sending it to the other processes of a
multi-process run), and recovering after a failed one.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array

from jaxserve import capacity
from jaxserve.buckets import Bucket
from jaxserve.executables import ExecutableStore
from jaxserve.memory_probe import profile_memory
from jaxserve.models.attention import PagedKVCache, init_paged_cache
from jaxserve.models.common import delete_arrays
from jaxserve.sharding.mesh import MESH_AXES, MODEL_AXIS, make_mesh
from jaxserve.sharding.rules import named_shardings
from jaxserve.step import RunnerSpec, StepOutput
from jaxserve.step_inputs import StepInputs, padding_inputs
from jaxserve.step_table import Executables, StepTable, cache_specs
from jaxserve.variants import SamplerMode, StepConfig, StepVariant

if TYPE_CHECKING:
    from jaxserve.distributed import StepChannel

logger = logging.getLogger(__name__)


class Runner:
    """Weights, KV cache, the step table and the step state; see the module docstring."""

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
        self._abstract_weights = jax.tree.map(
            lambda w: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding), self.weights
        )
        self._host_weights: Any = None  # the weights while offloaded (`offload_weights`)
        self.kv_cache: PagedKVCache | None = None
        self._seed, self._recoveries = seed, 0
        self._reset_step_state(jax.random.PRNGKey(seed))
        self.table = self._new_table([])
        # Seconds of each decode-only forward on padding, by batch size (`start` on a GPU; `time_decode_steps`)
        self.decode_costs: dict[int, float] | None = None

    def _new_table(self, compile_timings: list[tuple[float, float]]) -> StepTable:
        abstract = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._replicated) for x in self._step_state)
        return StepTable(self.spec, self.mesh, self._abstract_weights, *abstract, self.store, compile_timings)

    def set_steps(self, steps: StepConfig) -> None:
        """Replaces the step table before `start` (the engine lowers max_batch_size once the pool is sized)."""
        if self.kv_cache is not None:
            raise RuntimeError("the step table is fixed once the runner is started")
        self.spec = replace(self.spec, steps=steps)
        self._reset_step_state(self._key)
        self.table = self._new_table(self.table.compile_timings)

    def profile(self) -> capacity.MemoryProfile:
        """The capacity probe's figures (`memory_probe.profile_memory`), before `start`."""
        return profile_memory(self.table, self.mesh, self._zero_cache, self.probe_step)

    def probe_step(
        self,
        forward: jax.stages.Compiled,
        sampler: jax.stages.Compiled,
        bucket: Bucket,
        variant: StepVariant,
        kv_cache: PagedKVCache,
    ) -> None:
        """Runs a step compiled for a small pool once on an all-padding batch (for its memory peak); the
        pool `kv_cache` is donated to it."""
        inputs = padding_inputs(bucket, variant, self.spec.steps)
        out, _ = forward(self.weights, kv_cache, replace(inputs, history=None), self._previous, self._key)
        jax.block_until_ready(sampler(out.logits, out.last_tokens, inputs.sampling, inputs.history, self._key))

    # ---- weights and the KV pool --------------------------------------------------------------

    def update_weights(self, weights: Any) -> None:
        """New values for every weight (checkpoint layout, validated by the caller: same shapes), placed
        where the old ones were, with the same dtype: the compiled steps take them as they are. The old
        buffers (if any: none after `discard_weights`) are deleted layer by layer as the new ones are built."""
        old, self.weights, self._host_weights = self.weights, None, None
        family, cfg, dtype = self.spec.family, self.spec.cfg, self.spec.dtype
        self.weights = family.to_serving(weights, cfg, self._weight_shardings, dtype, replacing=old)

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

    def cache_specs(self, num_blocks: int) -> PagedKVCache:
        return cache_specs(self.spec, num_blocks)

    def _zero_cache(self, num_blocks: int) -> PagedKVCache:
        shardings = named_shardings(self.cache_specs(num_blocks), self.mesh)
        build = partial(
            init_paged_cache, self.spec.cfg, num_blocks, self.spec.steps.buckets.block_size, self.spec.dtype
        )
        return jax.jit(build, out_shardings=shardings)()

    def close(self) -> None:
        """Frees every device buffer the runner holds and drops its compiled executables; the followers of
        a multi-process run stop."""
        if self.channel is not None:
            self.channel.send_stop()
            self.channel = None
        self.release_kv()
        self.discard_weights()
        delete_arrays(self._step_state)
        self.table.forwards.clear()
        self.table.samplers.clear()

    # ---- start ------------------------------------------------------------------------------------

    def start(self, num_blocks: int, show_progress: bool = True, lazy: bool = False) -> float:
        """Allocates the zeroed pool of num_blocks blocks and compiles every forward and sampler of the
        StepConfig (`StepTable.compile_all`); returns the seconds taken. On a GPU each then runs once and the
        decode steps are timed (`decode_costs`). lazy: compile nothing now; `run` compiles each of them when
        a step first needs it."""
        if self.kv_cache is not None:
            raise RuntimeError("the runner is started once")
        start = time.perf_counter()
        self.kv_cache = self._zero_cache(num_blocks)
        if lazy:
            self.table.allow_lazily(num_blocks)
            return 0.0
        hits = self.store.hits if self.store is not None else 0
        compiled_in = self.table.compile_all(num_blocks, show_progress)
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
        lowering, xla = self.table.compile_seconds()
        logger.info(
            "warmup: %d forwards and %d samplers in %.1fs (%d threads; %s; %d compiled: %.1fs tracing and "
            "lowering, %.1fs in XLA, summed; each run once in %.1fs)",
            len(self.table.forwards),
            len(self.table.samplers),
            compiled_in,
            self.spec.compile_threads,
            "no step store" if self.store is None else f"{self.store.hits - hits} loaded from the step store",
            len(self.compile_timings),
            lowering,
            xla,
            first_runs,
        )
        return time.perf_counter() - start

    def _run_each_once(self) -> float:
        """`StepTable.run_each_once` on this runner's weights, pool and step state."""
        seconds, self.kv_cache = self.table.run_each_once(self.weights, self.kv_cache, self._previous, self._key)
        return seconds

    def time_decode_steps(self, repeats: int = 3) -> dict[int, float]:
        """`StepTable.time_decode_steps` on this runner's weights, pool and step state."""
        args = (self.weights, self.kv_cache, self._previous, self._key)
        costs, self.kv_cache = self.table.time_decode_steps(*args, repeats=repeats)
        return costs

    # ---- one step -------------------------------------------------------------------------------

    def run(self, inputs: StepInputs, bucket: Bucket, variant: StepVariant) -> StepOutput:
        """Dispatches the step's forward and sampler; returns their device outputs without waiting."""
        executables = self._executables(bucket, variant)
        if executables is None:
            executables = self.table.compile_on_first_use(bucket, variant)
        if executables is None:
            raise self.table.missing(bucket, variant)
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

    def _executables(self, bucket: Bucket, variant: StepVariant) -> Executables | None:
        return self.table.lookup(bucket, variant)

    @property
    def _step_state(self) -> tuple[Array, Array]:
        return self._previous, self._key

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

    # ---- the step table, as the engine, tests and benchmarks read it ---------------------------------

    @property
    def num_blocks(self) -> int:
        return self.table.num_blocks

    @property
    def lazy(self) -> bool:
        return self.table.lazy

    @property
    def compiled_steps(self) -> tuple[tuple[Bucket, StepVariant], ...]:
        return self.table.compiled_steps

    @property
    def num_executables(self) -> int:
        return self.table.num_executables

    @property
    def compile_timings(self) -> list[tuple[float, float]]:
        return self.table.compile_timings

    @property
    def lazy_compile_seconds(self) -> float:
        return self.table.lazy_compile_seconds

    @property
    def _forwards(self) -> dict:
        return self.table.forwards

    @property
    def _samplers(self) -> dict:
        return self.table.samplers

    def compile_seconds(self) -> tuple[float, float]:
        return self.table.compile_seconds()

    def compile_forward(
        self, bucket: Bucket, prompt_logprobs: bool, num_blocks: int, compiler_options: dict[str, Any] | None = None
    ) -> jax.stages.Compiled:
        return self.table.compile_forward(bucket, prompt_logprobs, num_blocks, compiler_options)

    def compile_sampler(self, rows: int, mode: SamplerMode, penalties: bool) -> jax.stages.Compiled:
        return self.table.compile_sampler(rows, mode, penalties)


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
