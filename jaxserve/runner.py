"""The model runner: owns the weights, the paged KV cache, the mesh, the compiled step table and the state
one step hands the next, and runs a step: `run(inputs, bucket, variant) -> StepOutput` (device arrays, not
awaited).

Lifecycle (docs/architecture.md, "KV layout and capacity"):
    runner = Runner(spec, weights, mesh)       # the serving layout of the weights, placed by jaxserve/sharding/rules.py
    profile = runner.profile()                  # the largest step compiled and run over a probe pool
    budget = capacity.kv_budget(profile, config)
    runner.start(budget.num_blocks)             # allocates the pool, compiles every forward and sampler

Its parts: the step's device functions (jaxserve/step.py), the compiled step table (jaxserve/step_table.py,
`runner.table`), the capacity probe (jaxserve/memory_probe.py), the weights and their moves
(jaxserve/serving_weights.py, `runner.weights`). Here: the KV pool's lifecycle (allocated at start, freed
and restored around sleep), running one step (and sending it to the other processes of a multi-process
run), and recovering after a failed one.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve import capacity
from jaxserve.buckets import Bucket
from jaxserve.executables import ExecutableStore
from jaxserve.memory_probe import profile_memory
from jaxserve.models.attention import PagedKVCache
from jaxserve.models.common import delete_arrays
from jaxserve.models.registry import ModelConfig
from jaxserve.serving_weights import ServingWeights
from jaxserve.sharding.mesh import MESH_AXES, MODEL_AXIS, make_mesh
from jaxserve.step import RunnerSpec, StepOutput, StepState
from jaxserve.step_inputs import StepInputs
from jaxserve.step_table import StepTable, zero_cache
from jaxserve.variants import StepConfig, StepVariant

if TYPE_CHECKING:
    from jaxserve.distributed import StepChannel
    from jaxserve.lora import LoraAdapter

logger = logging.getLogger(__name__)


class Runner:
    """The KV pool, the step state, and the weights and step table it runs them with; see the module
    docstring."""

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
        self.weights = ServingWeights(spec, weights, self.mesh)
        self.kv_cache: PagedKVCache | None = None
        self._seed, self._recoveries = seed, 0
        self.state = StepState.initial(spec.steps.buckets.max_batch_size, jax.random.PRNGKey(seed), self._replicated)
        self.table = self._new_table([])
        # Seconds of each decode-only forward on padding, by batch size (`start` on a GPU: `_time_on_padding`)
        self.decode_costs: dict[int, float] | None = None

    def _new_table(self, compile_timings: list[tuple[float, float]]) -> StepTable:
        state = self.state
        previous, key = (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._replicated) for x in (state.previous, state.key)
        )
        return StepTable(self.spec, self.mesh, self.weights.abstract, previous, key, self.store, compile_timings)

    def set_steps(self, steps: StepConfig) -> None:
        """Replaces the step table before `start` (the engine lowers max_batch_size once the pool is sized)."""
        if self.kv_cache is not None:
            raise RuntimeError("the step table is fixed once the runner is started")
        self.spec = replace(self.spec, steps=steps)
        self.state = StepState.initial(steps.buckets.max_batch_size, self.state.key, self._replicated)
        self.table = self._new_table(self.table.compile_timings)

    def profile(self) -> capacity.MemoryProfile:
        """The capacity probe's figures (`memory_probe.profile_memory`), before `start`."""
        return profile_memory(self.table, self.mesh, self.weights.step_weights, self.state)

    # ---- the KV pool, sleep and close -------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Frees the KV pool (its contents are gone) and the weights' device buffers: level 1 keeps them in
        host memory (`ServingWeights.offload`), level 2 does not (`ServingWeights.update` brings new ones)."""
        self._release_kv()
        if level == 1:
            self.weights.offload()
        else:
            self.weights.discard()

    def wake_up(self) -> None:
        """Puts back the weights `sleep(1)` moved to host memory, and a zeroed pool of the former size."""
        if self.weights.on_host:
            self.weights.reload()
        self.kv_cache = zero_cache(self.spec, self.mesh, self.table.num_blocks)

    def _release_kv(self) -> None:
        delete_arrays(self.kv_cache)
        self.kv_cache = None

    def close(self) -> None:
        """Frees every device buffer the runner holds and drops its compiled executables; the followers of
        a multi-process run stop."""
        if self.channel is not None:
            self.channel.send_stop()
            self.channel = None
        self._release_kv()
        self.weights.close()
        delete_arrays(self.state)
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
        self.kv_cache = zero_cache(self.spec, self.mesh, num_blocks)
        if lazy:
            self.table.allow_lazily(num_blocks)
            return 0.0
        hits = self.store.hits if self.store is not None else 0
        compiled_in = self.table.compile_all(num_blocks, show_progress)
        first_runs = 0.0
        if jax.default_backend() == "gpu":
            first_runs = self._time_on_padding()
        lowering, xla = self.table.compile_seconds()
        logger.info(
            "warmup: %d forwards and %d samplers in %.1fs (%d threads; %s; %d compiled: %.1fs tracing and "
            "lowering, %.1fs in XLA, summed; each run once in %.1fs)",
            len(self.table.forwards),
            len(self.table.samplers),
            compiled_in,
            self.spec.compile_threads,
            "no step store" if self.store is None else f"{self.store.hits - hits} loaded from the step store",
            len(self.table.compile_timings),
            lowering,
            xla,
            first_runs,
        )
        return time.perf_counter() - start

    def _time_on_padding(self) -> float:
        """Runs every executable once (`StepTable.run_each_once`), then times the decode steps into
        `decode_costs`; returns the seconds of the first."""
        first_runs, self.kv_cache = self.table.run_each_once(self.weights.step_weights, self.kv_cache, self.state)
        timed_from = time.perf_counter()
        self.decode_costs, self.kv_cache = self.table.time_decode_steps(
            self.weights.step_weights, self.kv_cache, self.state
        )
        logger.info(
            "decode step on padding, ms by batch size: %s (timed in %.2fs)",
            ", ".join(f"{rows}: {1e3 * cost:.2f}" for rows, cost in self.decode_costs.items()),
            time.perf_counter() - timed_from,
        )
        return first_runs

    # ---- one step -------------------------------------------------------------------------------

    def write_adapter(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Writes an adapter (None: zeros) into a LoRA slot (`ServingWeights.write_adapter`); process 0 of a
        multi-process run tells the other processes first, so that they write it before the next step too."""
        if self.channel is not None:
            self.channel.send_adapter(slot, adapter)
        self.weights.write_adapter(slot, adapter)

    def run(self, inputs: StepInputs, bucket: Bucket, variant: StepVariant) -> StepOutput:
        """Dispatches the step's forward and sampler; returns their device outputs without waiting."""
        executables = self.table.lookup(bucket, variant)
        if executables is None:
            executables = self.table.compile_on_first_use(bucket, variant)
        if executables is None:
            raise self.table.missing(bucket, variant)
        forward, sampler = executables
        if self.channel is not None:
            self.channel.send_step(self.spec.steps, bucket, variant, inputs)
        state = self.state
        out, self.kv_cache = forward(
            self.weights.step_weights, self.kv_cache, replace(inputs, history=None), state.previous, state.key
        )
        if sampler is None:  # greedy_in_forward
            tokens, logprobs, key = out.greedy_tokens, out.greedy_logprobs, out.next_key
        else:
            tokens, logprobs, key = sampler(out.logits, out.last_tokens, inputs.sampling, inputs.history, state.key)
        self.state = StepState(tokens, key)
        return StepOutput(tokens, logprobs, key, out.prompt_logprobs)

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
        key = jax.random.fold_in(jax.random.PRNGKey(self._seed), self._recoveries)
        self.state = StepState.initial(self.spec.steps.buckets.max_batch_size, key, self._replicated)
        if self.kv_cache is None:
            return
        try:  # raises for a pool donated to a call that did not return it, or computed by a failed one
            jax.block_until_ready(self.kv_cache)
        except Exception:
            logger.warning("reallocating the KV pool after a failed step", exc_info=True)
            self.kv_cache = None  # frees the old buffers before the new ones are taken
            self.kv_cache = zero_cache(self.spec, self.mesh, self.table.num_blocks)


def _check_heads_divide(spec: RunnerSpec, tp: int) -> None:
    cfg = spec.cfg
    if spec.backend == "pallas" and tp > 1 and (cfg.num_kv_heads % tp or cfg.num_heads % tp):
        raise ValueError(
            f"attention_backend='pallas' with tp={tp} runs the kernels per device on a share of the heads: "
            f"num_kv_heads ({cfg.num_kv_heads}) and num_heads ({cfg.num_heads}) must be divisible "
            "by tp; use a tp that divides them or attention_backend='xla'"
        )


# The experts' layout when EngineConfig.enable_expert_parallel is None: expert parallel (where the experts divide
# over tp). On a CPU mesh (`benchmarks/moe_parallel.py`, docs/performance.md "MoE: expert layout") it ties with
# tensor-parallel experts at tp=2 and is faster at tp=4; no GPU has measured it yet.
EXPERT_PARALLEL_DEFAULT = True


def resolve_expert_parallel(choice: bool | None, cfg: ModelConfig, tp: int) -> bool:
    """Whether the experts of `cfg` are split by expert over tp devices (`EngineConfig.enable_expert_parallel`):
    never for a dense model (True is ignored with a warning, as vLLM ignores it) or on one device (both layouts are
    the whole weights); None: EXPERT_PARALLEL_DEFAULT where the experts divide over tp. True with experts that do
    not divide over tp is refused."""
    experts = sorted({mlp.num_experts for mlp in getattr(cfg, "mlp_layers", ()) if mlp.num_experts is not None})
    if not experts:
        if choice:
            logger.warning("enable_expert_parallel=True is ignored: the model (%s) has no experts", type(cfg).__name__)
        return False
    indivisible = [count for count in experts if count % tp]
    if choice and indivisible:
        raise ValueError(
            f"enable_expert_parallel=True puts E / tp whole experts on each device, but the model's {indivisible[0]} "
            f"experts do not divide over tensor_parallel_size={tp}: use a tensor_parallel_size that divides "
            f"{indivisible[0]}, or enable_expert_parallel=False (each expert's hidden split over the devices)"
        )
    if choice is None:
        choice = EXPERT_PARALLEL_DEFAULT and not indivisible
    resolved = choice and tp > 1
    if tp > 1:
        layout = "expert parallel (E / tp experts a device)" if resolved else "tensor-parallel (hidden split)"
        logger.info("experts: %s over tp=%d", layout, tp)
    return resolved


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
