"""The compiled step table: every forward and sampler of a StepConfig, compiled at start (or on first use
when lazy) or loaded from the executable store, looked up per step, and timed on padding.

The executables are the JAX stand-in for captured CUDA graphs: shapes and variants are fixed at start,
and a step that was not compiled then is refused with an error naming its shape and variant. A lazy
table (CompileConfig.lazy, the default on CPU) compiles nothing at start: each forward and sampler of
the same table is compiled (or loaded from the step store) the first time a step needs it, with a log
line; a step outside the table is still refused.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.buckets import Bucket
from jaxserve.executables import ExecutableStore
from jaxserve.models.attention import PagedKVCache, init_paged_cache, paged_cache_specs
from jaxserve.sharding.mesh import MODEL_AXIS
from jaxserve.sharding.rules import named_shardings
from jaxserve.step import ForwardKey, RunnerSpec, SamplerKey, StepState, describe, forward_fn, sampler_fn
from jaxserve.step_inputs import padding_inputs
from jaxserve.variants import SamplerMode, StepVariant

# A child of the runner's logger: compile lines are the runner's to a user filtering "jaxserve.runner".
logger = logging.getLogger("jaxserve.runner").getChild("step_table")

Executables = tuple[jax.stages.Compiled, jax.stages.Compiled | None]  # forward, sampler (None: greedy_in_forward)


class StepTable:
    """The forwards and samplers of `spec.steps` for the weights' layout on `mesh`; see the module docstring.

    abstract_weights / abstract_previous / abstract_key: the shapes, dtypes and shardings of what each call
    receives besides its inputs (the weights, the previous step's tokens, the PRNG key).
    compile_timings: (tracing + lowering, XLA compile) seconds of every executable compiled (not loaded).
    """

    def __init__(
        self,
        spec: RunnerSpec,
        mesh: Mesh,
        abstract_weights: Any,
        abstract_previous: jax.ShapeDtypeStruct,
        abstract_key: jax.ShapeDtypeStruct,
        store: ExecutableStore | None = None,
        compile_timings: list[tuple[float, float]] | None = None,
    ) -> None:
        self.spec, self.mesh, self.store = spec, mesh, store
        self._weights, self._previous, self._key = abstract_weights, abstract_previous, abstract_key
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self.forwards: dict[ForwardKey, jax.stages.Compiled] = {}
        self.samplers: dict[SamplerKey, jax.stages.Compiled] = {}
        self.num_blocks = 0  # of the pool every forward is compiled for
        self.allowed: tuple[frozenset[ForwardKey], frozenset[SamplerKey]] | None = None  # lazy: the table
        self.lazy_compile_seconds = 0.0  # spent compiling steps on first use
        self.compile_timings = [] if compile_timings is None else compile_timings

    @property
    def lazy(self) -> bool:
        return self.allowed is not None

    @property
    def num_executables(self) -> int:
        return len(self.forwards) + len(self.samplers)

    @property
    def compiled_steps(self) -> tuple[tuple[Bucket, StepVariant], ...]:
        """The (bucket, variant) steps whose forward and sampler are both compiled."""
        return tuple(step for step in self.spec.steps.compiled_steps() if self.lookup(*step) is not None)

    def compile_seconds(self) -> tuple[float, float]:
        """(tracing + lowering, XLA compile) seconds summed over `compile_timings`."""
        return sum(t[0] for t in self.compile_timings), sum(t[1] for t in self.compile_timings)

    # ---- building the table ---------------------------------------------------------------------

    def compile_all(self, num_blocks: int, show_progress: bool = True) -> float:
        """Compiles every forward (for a pool of num_blocks blocks) and sampler of the StepConfig (`forwards`,
        `samplers`), spec.compile_threads at a time; returns the seconds taken."""
        from tqdm.auto import tqdm

        steps, self.num_blocks = self.spec.steps, num_blocks
        jobs: list[tuple[str, Any, Any]] = [
            ("forward", key, partial(self.compile_forward, *key, num_blocks)) for key in steps.forwards()
        ]
        jobs += [("sampler", key, partial(self.compile_sampler, *key)) for key in steps.samplers()]
        start = time.perf_counter()

        def compile_one(job: tuple[str, Any, Any]) -> tuple[str, Any, jax.stages.Compiled, float]:
            kind, key, build = job
            t0 = time.perf_counter()
            return kind, key, build(), time.perf_counter() - t0

        with ThreadPoolExecutor(max_workers=self.spec.compile_threads) as pool:
            done = pool.map(compile_one, jobs)  # in order: forwards (the long ones) start first
            for kind, key, compiled, seconds in tqdm(
                done, total=len(jobs), desc="compiling", disable=not show_progress
            ):
                (self.forwards if kind == "forward" else self.samplers)[key] = compiled
                logger.info("compiled %s %s in %.2fs", kind, describe(kind, key), seconds)
        return time.perf_counter() - start

    def allow_lazily(self, num_blocks: int) -> None:
        """Compiles nothing now: each forward (for a pool of num_blocks blocks) and sampler of the StepConfig is
        compiled when a step first needs it (`compile_on_first_use`)."""
        steps, self.num_blocks = self.spec.steps, num_blocks
        self.allowed = (frozenset(steps.forwards()), frozenset(steps.samplers()))
        logger.info(
            "lazy compilation: %d forwards and %d samplers allowed, each compiled when a step first needs it",
            len(self.allowed[0]),
            len(self.allowed[1]),
        )

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
        specs = cache_specs(self.spec, num_blocks)
        cache_shardings = named_shardings(specs, self.mesh, self.spec.rules)
        cache = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, self.spec.cache_dtype, sharding=sh), specs, cache_shardings
        )
        inputs = padding_inputs(bucket, StepVariant(prompt_logprobs=prompt_logprobs), self.spec.steps)
        abstract_inputs = jax.tree.map(self._abstract, inputs)
        args = (self._weights, cache, abstract_inputs, self._previous, self._key)
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
        args = (logits, last_tokens, sampling, history, self._key)
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

    def _abstract(self, x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._replicated)

    # ---- one step's executables -----------------------------------------------------------------

    def lookup(self, bucket: Bucket, variant: StepVariant) -> Executables | None:
        """The step's forward and sampler (None for a `greedy_in_forward` step); None when one is missing."""
        forward = self.forwards.get((bucket, variant.prompt_logprobs))
        if variant.greedy_in_forward:
            return None if forward is None else (forward, None)
        sampler = self.samplers.get((bucket.num_seqs, variant.sampler, variant.penalties))
        return None if forward is None or sampler is None else (forward, sampler)

    def compile_on_first_use(self, bucket: Bucket, variant: StepVariant) -> Executables | None:
        """The step's forward and sampler, compiling (or loading) whichever is missing, when the lazy table has
        them; None when it does not (the step is refused)."""
        forward_key = (bucket, variant.prompt_logprobs)
        sampler_key = None if variant.greedy_in_forward else (bucket.num_seqs, variant.sampler, variant.penalties)
        if self.allowed is None:
            return None
        if forward_key not in self.allowed[0] or (sampler_key is not None and sampler_key not in self.allowed[1]):
            return None
        start = time.perf_counter()
        if forward_key not in self.forwards:
            self.forwards[forward_key] = self.compile_forward(*forward_key, self.num_blocks)
            logger.info("compiled on first use: forward %s", describe("forward", forward_key))
        if sampler_key is not None and sampler_key not in self.samplers:
            self.samplers[sampler_key] = self.compile_sampler(*sampler_key)
            logger.info("compiled on first use: sampler %s", describe("sampler", sampler_key))
        seconds = time.perf_counter() - start
        self.lazy_compile_seconds += seconds
        logger.info("first use of T=%d B=%d %s: %.2fs to compile", bucket.num_tokens, bucket.num_seqs, variant, seconds)
        return self.lookup(bucket, variant)

    def missing(self, bucket: Bucket, variant: StepVariant) -> RuntimeError:
        """The error that refuses a step outside the table, listing what the table holds."""
        allowed = self.allowed
        forward_keys = sorted(allowed[0], key=repr) if allowed is not None else list(self.forwards)
        sampler_keys = sorted(allowed[1], key=repr) if allowed is not None else list(self.samplers)
        forwards = [(b.num_tokens, b.num_seqs, b.decode_only, b.kv_blocks, s) for b, s in forward_keys]
        samplers = [(rows, mode.value, penalties) for rows, mode, penalties in sampler_keys]
        when = "in the step table" if self.lazy else "compiled only at start"
        return RuntimeError(
            f"no compiled step for T={bucket.num_tokens} B={bucket.num_seqs} decode_only={bucket.decode_only} "
            f"variant={variant} kv_blocks={bucket.kv_blocks}: steps are {when} (forwards (T, B, decode_only, "
            f"kv_blocks, prompt_logprobs): {forwards}; samplers (rows, mode, penalties): {samplers})"
        )

    # ---- running the table on padding -----------------------------------------------------------

    def run_each_once(self, weights: Any, kv_cache: PagedKVCache, state: StepState) -> tuple[float, PagedKVCache]:
        """Runs every compiled forward and sampler once on all-padding inputs (their K/V go to the reserved
        block); returns the seconds taken and the pool (donated to each forward). An executable's first run on
        a GPU loads its kernels and resolves its constants, which would otherwise stall the first step of each
        shape the engine meets, as CUDA-graph capture does in other engines."""
        start, steps, ran = time.perf_counter(), self.spec.steps, set()
        previous, key = state.previous, state.key
        for (bucket, prompt_logprobs), forward in self.forwards.items():
            inputs = padding_inputs(bucket, StepVariant(prompt_logprobs=prompt_logprobs), steps)
            out, kv_cache = forward(weights, kv_cache, replace(inputs, history=None), previous, key)
            for (rows, mode, penalties), sampler in self.samplers.items():
                if rows == bucket.num_seqs and (rows, mode, penalties) not in ran:
                    padding = padding_inputs(bucket, StepVariant(mode, penalties), steps)
                    sampler(out.logits, out.last_tokens, padding.sampling, padding.history, key)
                    ran.add((rows, mode, penalties))
        jax.block_until_ready(kv_cache)
        return time.perf_counter() - start, kv_cache

    def time_decode_steps(
        self, weights: Any, kv_cache: PagedKVCache, state: StepState, repeats: int = 3
    ) -> tuple[dict[int, float], PagedKVCache]:
        """Seconds of each decode batch size's forward on all-padding rows, its narrowest block-table width (a
        padding row reads no K/V, so the width only adds launch work): the difference between 1 and 1 +
        `repeats` calls queued back to back, over `repeats`, so the figure is the device's time per step, as
        overlapped steps see it, without the first call's dispatch. What a padded row costs, for bucket-aware
        admission (`scheduler.admission_cap`). Every forward has run once before (`run_each_once`). Returns the
        pool too (donated to each call)."""
        max_blocks = self.spec.steps.buckets.max_blocks_per_seq
        narrowest: dict[int, tuple[Bucket, jax.stages.Compiled]] = {}
        # Widest first, so the narrowest of each batch size is written last.
        decode = [(b, f) for (b, logprobs), f in self.forwards.items() if b.decode_only and not logprobs]
        for bucket, forward in sorted(decode, key=lambda item: -(item[0].kv_blocks or max_blocks)):
            narrowest[bucket.num_seqs] = (bucket, forward)
        costs: dict[int, float] = {}
        for rows in sorted(narrowest):
            bucket, forward = narrowest[rows]
            inputs = replace(padding_inputs(bucket, StepVariant(), self.spec.steps), history=None)
            seconds = []
            for count in (1, 1 + repeats):
                jax.block_until_ready(kv_cache)
                start = time.perf_counter()
                for _ in range(count):
                    _, kv_cache = forward(weights, kv_cache, inputs, state.previous, state.key)
                jax.block_until_ready(kv_cache)
                seconds.append(time.perf_counter() - start)
            costs[rows] = max(seconds[1] - seconds[0], 0.0) / repeats
        return costs, kv_cache


def cache_specs(spec: RunnerSpec, num_blocks: int) -> PagedKVCache:
    """The ParamSpecs of a KV pool of num_blocks blocks for the spec's model."""
    return paged_cache_specs(spec.cfg, num_blocks, spec.steps.buckets.block_size, spec.layout.layers_per_page)


def zero_cache(spec: RunnerSpec, mesh: Mesh, num_blocks: int) -> PagedKVCache:
    """A zeroed KV pool of num_blocks blocks, allocated on the mesh in the spec's rules table's layout."""
    shardings = named_shardings(cache_specs(spec, num_blocks), mesh, spec.rules)
    build = partial(
        init_paged_cache,
        spec.cfg,
        num_blocks,
        spec.steps.buckets.block_size,
        spec.cache_dtype,
        spec.layout.layers_per_page,
    )
    return jax.jit(build, out_shardings=shardings)()


# On a GPU, forwards of at least this many tokens (the GEMMs' M) compile with XLA's Triton GEMMs off, so
# cuBLAS runs them: as fast from there up, and a decode forward compiles several times quicker, Triton's
# autotuning being most of a cold warmup's XLA time. Fewer rows keep XLA's choice: its Triton GEMMs are
# faster there. `python benchmarks/experiments/gemm_options.py`; see docs/performance.md.
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


def resolve_lazy(lazy: bool | None) -> bool:
    """CompileConfig.lazy: None -> True on CPU (compile each step on first use), False on an accelerator and in a
    multi-process run. There every step is compiled at start: a step compiled on first use while the one before it
    ran deadlocked the processes' collectives (two CPU processes under jax 0.12.1, every time with nothing in the
    step store; loading stored steps did not), so lazy=True is refused there."""
    multiprocess = jax.process_count() > 1
    if lazy and multiprocess:
        raise ValueError(
            "CompileConfig.lazy=True in a multi-process run: every process compiles every step at start there "
            "(a step compiled while another runs can deadlock the processes' collectives); leave lazy None or False"
        )
    if lazy is not None:
        return lazy
    resolved = jax.default_backend() == "cpu" and not multiprocess
    logger.info("lazy compilation %s (%s)", "on" if resolved else "off", jax.default_backend())
    return resolved


def default_executable_store_dir(cache_dir: str | None) -> str:
    """Where the step table keeps its compiled steps: a `steps` folder in the persistent compilation cache."""
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
    # samplers in about a second each.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    logger.info("persistent compilation cache: %s", path)
