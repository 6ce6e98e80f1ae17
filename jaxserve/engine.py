"""The engine loop: schedule -> prepare -> run -> process outputs, with the host work of step N+1
overlapped with the device work of step N.

    batch = scheduler.schedule()                                         # host: who runs, how many tokens
    inputs, bucket, variant = make_step_inputs(batch, previous, steps, cache)  # host numpy, padded to a bucket
    output = runner.run(inputs, bucket, variant)                         # device: one precompiled call, not awaited
    scheduler.update(previous_batch, tokens); outputs.add_token(...)     # host: append, stop, free, detokenize

Overlap (docs/architecture.md): step N+1 is dispatched before step N's tokens are read; the tokens step N
sampled stay on the device and the compiled step gathers them into step N+1's inputs. A request
that finished at step N wastes at most one token of step N+1.

Failures: a request whose step inputs cannot be built finishes with an error and the others run on.
An exception that escapes a step (a device error, a KeyboardInterrupt) leaves a defined state before
it propagates: the steps in flight are dropped, every unfinished request waits to be recomputed from
the tokens the host has, and the prefix cache is emptied; the next step serves them again.

One thread steps the engine; other threads submit and abort through `submit` / `submit_abort`, which
the engine applies at the start of its next step.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve import capacity, distributed
from jaxserve.block_manager import BlockManager
from jaxserve.buckets import Bucket, BucketTable
from jaxserve.config import EngineConfig, LoraConfig
from jaxserve.kv_layout import KVLayout, kv_layout
from jaxserve.lora import LoraAdapter
from jaxserve.models.loader import load_from_pytree
from jaxserve.models.registry import ModelConfig, ModelFamily
from jaxserve.outputs import OutputProcessor
from jaxserve.request import Request, make_requests
from jaxserve.runner import Runner, resolve_backend, resolve_expert_parallel
from jaxserve.sampling import MAX_LOGPROBS, FinishReason, RequestOutput, SamplingParams, validate_prompt_token_ids
from jaxserve.scheduler import ScheduledBatch, ScheduledRow, Scheduler
from jaxserve.sharding.mesh import MODEL_AXIS
from jaxserve.step import RunnerSpec, StepOutput
from jaxserve.step_inputs import StepInputsCache, make_step_inputs
from jaxserve.step_table import default_executable_store_dir, enable_compilation_cache, resolve_lazy
from jaxserve.tokenizer import Tokenizer
from jaxserve.variants import StepConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one step did (reported when its tokens are read back)."""

    num_tokens: int
    num_seqs: int
    num_prefill_rows: int
    bucket_tokens: int
    bucket_seqs: int
    kv_usage: float
    num_preempted: int
    prefix_hit_rate: float
    host_seconds: float  # input preparation + dispatch
    dispatch_seconds: float  # of which the runner's call of the compiled step
    launched_at: float  # time.perf_counter() when the step was dispatched


@dataclass(frozen=True, slots=True)
class StartedRunner:
    """`start_runner`'s results. config: the engine's, with max_batch_size lowered to what the pool holds
    when it was "auto"; steps: the step table's StepConfig for it; step_channel: set in a multi-process run."""

    runner: Runner
    config: EngineConfig
    steps: StepConfig
    kv_budget: capacity.KvBudget
    warmup_seconds: float
    step_channel: distributed.StepChannel | None


@dataclass(slots=True)
class _InFlight:
    batch: ScheduledBatch
    output: StepOutput
    stats: StepStats


class Engine:
    """Continuous batching over a paged KV cache; see the module docstring.

    The weights are cast to `config.dtype` unless it is "auto"; the KV cache takes their dtype.
    """

    def __init__(
        self,
        family: ModelFamily,
        cfg: ModelConfig,
        weights: Any,
        tokenizer: Tokenizer,
        config: EngineConfig,
        *,
        mesh: Mesh | None = None,
        seed: int = 0,
        show_progress: bool = True,
    ) -> None:
        self.tokenizer, self.vocab_size = tokenizer, cfg.vocab_size
        started = start_runner(family, cfg, weights, config, mesh, seed, show_progress)
        self.runner, self.step_channel, self.kv_budget = started.runner, started.step_channel, started.kv_budget
        self.config = config = started.config  # max_batch_size lowered to what the pool holds when it was "auto"
        self.steps, self.warmup_seconds = started.steps, started.warmup_seconds
        kv = config.kv_cache
        self.block_manager = BlockManager(
            self.kv_budget.num_blocks, kv.block_size, kv.enable_prefix_caching, layout=self.runner.spec.layout
        )
        self.scheduler = Scheduler(config, self.block_manager, decode_costs=self.runner.decode_costs)
        self.outputs = OutputProcessor(tokenizer)
        self._inputs_cache = StepInputsCache()  # what a step's inputs reuse from the step before
        self.stats: collections.deque[StepStats] = collections.deque(maxlen=100_000)
        self._in_flight: collections.deque[_InFlight] = collections.deque()  # oldest first; at most two
        self._finished_outside_steps: list[str] = []
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stepping = False  # inside step(): an abort from a finaliser waits for the next one
        self._ids = itertools.count()
        # LoRA adapters this engine may serve, by name; `load_adapter` adds them.
        self.adapters: dict[str, LoraAdapter] = {}
        self.asleep = False  # sleep() .. wake_up()
        self.closed = False
        _log_ready(self.runner.spec, self.buckets)

    @property
    def buckets(self) -> BucketTable:
        return self.steps.buckets

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        stream: bool = False,
        stream_interval: int = 1,
        lora_name: str | None = None,
    ) -> str:
        """Queues a prompt (text or token ids); raises ValueError on bad input. Returns the request id.
        lora_name: a loaded adapter's name (`load_adapter`) to serve it with; None: the base model.

        stream: `step` reports the request after a step that gives it its first token, then after one that
        brings stream_interval new tokens (over its n samples) since the last report, and once finished;
        else only once finished (vLLM's stream interval: fewer, larger deltas cost a front end less).
        """
        self._check_serving()
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an int >= 1, got {stream_interval!r}")
        params = _checked_params(params, self.steps, len(self.tokenizer.eos_token_ids))
        adapter = self._adapter(lora_name)
        text, ids = _prompt_ids(prompt, params, self.tokenizer, self.vocab_size)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.outputs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        eos = frozenset(self.tokenizer.eos_token_ids)
        samples = make_requests(request_id, ids, params, eos_token_ids=eos, prompt=text)
        for request in samples:
            if adapter is not None:
                request.lora_name, request.cache_root = adapter.name, adapter.cache_root
        self.outputs.add(request_id, text, ids, samples, stream=stream, stream_interval=stream_interval)
        for request in samples:
            self.scheduler.add(request)
        if any(r.is_finished for r in samples):
            self._finished_outside_steps.append(request_id)
        return request_id

    def abort(self, request_id: str) -> None:
        """Finishes every sample of the request (reason "abort") and frees its blocks; its final output comes
        with the next step. Called from inside a step (a stream's finaliser), it waits for the next one."""
        if self._stepping:
            self._inbox.put(lambda: self.abort(request_id))
            return
        if self.scheduler.abort(request_id):
            self._finished_outside_steps.append(request_id)

    def update_weights(self, params: Any) -> None:
        """New values for every weight, in place and without compiling anything.

        `params`: what `jaxserve.models.loader.load_from_pytree` takes (the family's weights dataclass, or a nested
        dict keyed by our field names or Hugging Face names), checked against the model's shapes before
        anything changes and cast to the serving dtype layer by layer as it is placed (no cast copy of the
        whole tree). Every cached prefix is dropped (its K/V came from the old weights). Refused while a
        request is unfinished: let them finish or abort them first."""
        self._check_open("update_weights")
        _check_one_process("update_weights")
        family, cfg = self.runner.spec.family, self.runner.spec.cfg
        weights = load_from_pytree(family, cfg, params, np.dtype(self.runner.spec.dtype).name, cast=False)
        self._refuse_while_busy("update_weights")
        self.runner.weights.update(weights)
        self.block_manager.reset([])

    # ---- LoRA adapters ----------------------------------------------------------------------------

    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Makes an adapter servable by name (checked against the model's shapes: a ValueError changes nothing), or
        replaces the weights of the one of that name: its prefix-cache blocks are never reused (its cache root
        changes with its version) and, if it holds a slot, the slot is rewritten now. Nothing compiles. Replacing
        is refused while a request is unfinished."""
        self._check_open("load_adapter")
        self._lora_config("load_adapter")
        if distributed.is_multiprocess():
            distributed.check_adapter_source(adapter)
        self.runner.weights.check_adapter(adapter)
        self.runner.weights.prepare_adapter(adapter)
        if adapter.name in self.adapters:
            self._refuse_while_busy("replacing an adapter")
            slot = self.scheduler.lora_slots.slot_of(adapter.name)
            if slot is not None:
                self.runner.write_adapter(slot, adapter)
        self.adapters[adapter.name] = adapter

    def unload_adapter(self, name: str) -> None:
        """Forgets an adapter (its slot zeroed and freed). Refused while a request is unfinished."""
        self._check_open("unload_adapter")
        self._adapter(name)
        self._refuse_while_busy("unloading an adapter")
        slot = self.scheduler.lora_slots.forget(name)
        if slot is not None:
            self.runner.write_adapter(slot, None)
        del self.adapters[name]

    def _adapter(self, name: str | None) -> LoraAdapter | None:
        if name is None:
            return None
        self._lora_config("a request with a LoRA adapter")
        if name not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.adapters)}")
        return self.adapters[name]

    def _lora_config(self, what: str) -> LoraConfig:
        if self.config.lora is None:
            raise ValueError(f"{what} needs an engine that serves LoRA adapters: LLM(enable_lora=True, ...)")
        return self.config.lora

    def _write_adapter_slots(self) -> None:
        """Writes the slots the scheduler gave to adapters not in them yet (before the step that reads them)."""
        pending = self.scheduler.lora_slots.pending
        for slot, name in pending.items():
            self.runner.write_adapter(slot, self.adapters[name])
        pending.clear()

    # ---- device memory between uses: sleep, wake_up, close -----------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Frees device memory for something else (a trainer) until `wake_up` (vLLM's sleep mode).

        level 1: the weights move to host memory and the KV pool is freed; level 2: both are freed, and
        `update_weights` brings the next weights (before or after `wake_up`). The prefix cache is
        dropped. Refused while a request is unfinished; new requests are refused while asleep."""
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"level must be 1 (weights to host memory) or 2 (weights freed), got {level!r}")
        self._check_open("sleep")
        _check_one_process("sleep")
        if self.asleep:
            raise RuntimeError("the engine is already asleep: call wake_up() first")
        self._refuse_while_busy("sleep")
        self.runner.sleep(level)
        self.block_manager.reset([])
        self.asleep = True

    def wake_up(self) -> None:
        """Takes the device memory back: the KV pool (zeroed, its former size) and the weights sleep(1)
        moved to host memory. Nothing is recompiled."""
        self._check_open("wake_up")
        if not self.asleep:
            raise RuntimeError("the engine is not asleep")
        self.runner.wake_up()
        self.asleep = False

    def close(self) -> None:
        """Aborts what is unfinished and frees every device buffer of the engine; it serves no more."""
        if self.closed:
            return
        for request in [*self.scheduler.waiting, *self.scheduler.running]:
            self.scheduler.finish(request, FinishReason.ABORT)
        self._in_flight.clear()
        self.runner.close()
        self.closed = True

    def _check_open(self, action: str) -> None:
        if self.closed:
            raise RuntimeError(f"{action}: the engine is closed")

    def _check_serving(self) -> None:
        self._check_open("add_request")
        if not distributed.is_leader():
            raise RuntimeError(
                f"process {jax.process_index()} follows process 0, which takes the requests: call follow() "
                "on every process but process 0"
            )
        if self.asleep:
            raise RuntimeError("the engine is asleep: call wake_up() before adding requests")
        if not self.runner.weights.on_device:
            raise RuntimeError("the engine has no weights since sleep(level=2): call update_weights(params)")

    def _refuse_while_busy(self, action: str) -> None:
        if self.has_unfinished():
            unfinished = self.scheduler.num_waiting + self.scheduler.num_running
            raise RuntimeError(
                f"{action} while {unfinished} requests are unfinished (or steps in flight): "
                "let them finish or abort them first"
            )

    def has_unfinished(self) -> bool:
        pending = self._in_flight or self._finished_outside_steps or not self._inbox.empty()
        return self.scheduler.has_unfinished() or bool(pending)

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        stream: bool = True,
        stream_interval: int = 1,
        lora_name: str | None = None,
    ) -> Future[str]:
        """Thread-safe `add_request`: applied at the engine's next step; the future holds the request id, or
        the error that refused the request. A future cancelled before that step adds nothing."""
        future, add = _deferred(
            lambda: self.add_request(
                prompt, params, request_id, stream=stream, stream_interval=stream_interval, lora_name=lora_name
            )
        )
        self._inbox.put(add)
        return future

    def submit_abort(self, request_id: str) -> None:
        """Thread-safe `abort`: applied at the engine's next step."""
        self._inbox.put(lambda: self.abort(request_id))

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Dispatches the next step, then processes the previous one; returns the outputs of the requests
        that changed and are streamed or finished (batch generation needs no partial outputs, and building
        them for every running request each step is host time on the critical path)."""
        while not self._inbox.empty():
            self._inbox.get_nowait()()
        self._stepping = True
        try:
            changed = self._step()
        except BaseException:
            self._recover()
            raise
        finally:
            self._stepping = False
        changed.update(self._finished_outside_steps)
        self._finished_outside_steps.clear()
        changed = {i for i in changed if self.outputs.wants_output(i)}
        return [self.outputs.output(request_id) for request_id in sorted(changed, key=_numeric_first)]

    def _step(self) -> set[str]:
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if not batch.is_empty else None
        if launched is not None:
            self._in_flight.append(launched)
        changed: set[str] = set()
        # Every step in flight but the one just launched; each leaves the queue once processed.
        while len(self._in_flight) > (launched is not None):
            changed |= self._process(self._in_flight[0])
            self._in_flight.popleft()
        return changed

    def _launch(self, batch: ScheduledBatch) -> _InFlight | None:
        start = time.perf_counter()
        if self.scheduler.lora_slots is not None and self.scheduler.lora_slots.pending:
            self._write_adapter_slots()
        previous = self._in_flight[-1].batch if self._in_flight else None
        try:
            inputs, bucket, variant = make_step_inputs(batch, previous, self.steps, self._inputs_cache)
        except Exception as error:
            self._fail_rows(batch, previous, error)
            return None
        dispatch_start = time.perf_counter()
        output = self.runner.run(inputs, bucket, variant)
        return _InFlight(batch, output, _step_stats(batch, bucket, self.block_manager, start, dispatch_start))

    def _fail_rows(self, batch: ScheduledBatch, previous: ScheduledBatch | None, error: Exception) -> None:
        """The rows whose inputs cannot be built alone finish with the error (all rows, when none can be
        singled out); the others are recomputed in a later step."""
        logger.exception("building a step's inputs failed")
        culprits = _failing_rows(batch, previous, self.steps)
        message = f"this request's step inputs could not be built: {type(error).__name__}: {error}"
        for request in culprits:
            self.scheduler.finish(request, FinishReason.ERROR, error=message)
            self._finished_outside_steps.append(request.request_id)
        for row in batch.rows:
            if not row.request.is_finished:
                self.scheduler.preempt(row.request)

    def _recover(self) -> None:
        """The defined state after an exception escaped a step (see the module docstring)."""
        logger.warning(
            "a step failed or was interrupted: %d steps in flight dropped, requests requeued", len(self._in_flight)
        )
        self._in_flight.clear()
        self.scheduler.requeue_all()
        self.runner.recover()

    def _process(self, flight: _InFlight) -> set[str]:
        """Waits for a step's tokens, updates the scheduler, then the outputs; a stop string finishes its
        request. Returns the ids of the requests that got a token."""
        batch, out = flight.batch, flight.output
        tokens = np.asarray(out.token_ids)[: len(batch.rows)]
        prompt_logprobs = jax.device_get(out.prompt_logprobs) if out.prompt_logprobs is not None else None
        logprobs, sampled_logprobs = _read_logprobs(batch, out)
        if prompt_logprobs is not None:
            self.outputs.add_prompt_logprobs(batch, prompt_logprobs)
        received = self.scheduler.update(batch, tokens)
        self.stats.append(flight.stats)
        for request, row in zip(received, _rows_of(batch, received), strict=True):
            stop = self.outputs.add_token(request, logprobs, row, sampled_logprobs)
            if stop is not None:
                self.scheduler.finish(request, FinishReason.STOP, stop_reason=stop)
        return {request.request_id for request in received}


def _rows_of(batch: ScheduledBatch, received: list[Request]) -> Sequence[int]:
    """The batch row of each received request (`Scheduler.update` returns them in row order, at most one per
    row): when every row got a token, row i is the i-th, and no dict of 1024 rows is built per step."""
    if len(received) == len(batch.rows):
        return range(len(received))
    row_of = {id(row.request): i for i, row in enumerate(batch.rows)}
    return [row_of[id(request)] for request in received]


def _read_logprobs(batch: ScheduledBatch, out: StepOutput) -> tuple[Any, np.ndarray | None]:
    """What the step's rows asked for, read back: every TokenLogprobs leaf when a row wants top logprobs
    (dicts), else only the sampled tokens' logprobs when a row wants those, else nothing (no transfer)."""
    params = [row.request.sampling_params for row in batch.rows]
    if any(p.logprobs is not None for p in params):
        logprobs = jax.device_get(out.logprobs)
        return logprobs, logprobs.logprob
    if any(p.token_logprobs for p in params):
        return None, jax.device_get(out.logprobs.logprob)
    return None, None


def _checked_params(params: SamplingParams | None, steps: StepConfig, num_eos_tokens: int) -> SamplingParams:
    """A request's parameters validated against this engine: compiled variants, vocabulary."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    # Validated again: a frozen dataclass can still be changed through object.__setattr__, and an
    # invalid value must fail here, on its request, not inside a step shared with other requests.
    params = dataclasses.replace(params)
    steps.check_supported(params, num_eos_tokens)
    outside = [t for t in params.stop_token_ids if t >= steps.vocab_size]
    if outside:
        raise ValueError(f"stop_token_ids must be in [0, {steps.vocab_size - 1}] (the vocabulary), got {outside}")
    return params


def _prompt_ids(
    prompt: str | list[int], params: SamplingParams, tokenizer: Tokenizer, vocab_size: int
) -> tuple[str | None, list[int]]:
    """A prompt's text (None when given as token ids) and token ids, validated against the vocabulary and
    the request's prompt_logprobs_start."""
    if isinstance(prompt, str):
        text, ids = prompt, tokenizer.encode(prompt) if prompt else []
    else:
        text, ids = None, list(prompt)
    validate_prompt_token_ids(ids, vocab_size)
    if params.prompt_logprobs_start and params.prompt_logprobs_start >= len(ids):
        raise ValueError(
            f"prompt_logprobs_start={params.prompt_logprobs_start} scores no position of a prompt of {len(ids)} "
            "tokens: it must be below the prompt's length"
        )
    return text, ids


def _deferred(call: Callable[[], T]) -> tuple[Future[T], Callable[[], None]]:
    """A future for call's result (or its error), and what runs call and fills the future in, unless the
    future was cancelled before."""
    future: Future[T] = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(call())
            except Exception as error:
                future.set_exception(error)

    return future, run


def _failing_rows(batch: ScheduledBatch, previous: ScheduledBatch | None, steps: StepConfig) -> list[Request]:
    """The requests whose row's inputs cannot be built alone (all of the batch's, when none can)."""

    def fails(row: ScheduledRow) -> bool:
        try:
            make_step_inputs(ScheduledBatch([row], num_prefill_rows=int(row.is_prefill)), previous, steps)
        except Exception:
            return True
        return False

    return [row.request for row in batch.rows if fails(row)] or [row.request for row in batch.rows]


def _step_stats(
    batch: ScheduledBatch, bucket: Bucket, blocks: BlockManager, start: float, dispatch_start: float
) -> StepStats:
    return StepStats(
        num_tokens=batch.num_tokens,
        num_seqs=batch.num_seqs,
        num_prefill_rows=batch.num_prefill_rows,
        bucket_tokens=bucket.num_tokens,
        bucket_seqs=bucket.num_seqs,
        kv_usage=blocks.usage,
        num_preempted=len(batch.preempted),
        prefix_hit_rate=blocks.stats.hit_rate,
        host_seconds=time.perf_counter() - start,
        dispatch_seconds=time.perf_counter() - dispatch_start,
        launched_at=dispatch_start,
    )


def start_runner(
    family: ModelFamily,
    cfg: ModelConfig,
    weights: Any,
    config: EngineConfig,
    mesh: Mesh | None,
    seed: int,
    show_progress: bool,
) -> StartedRunner:
    """The runner, its KV pool sized by the capacity probe (agreed by every process of a multi-process run),
    and its step table compiled (or allowed lazily)."""
    backend = resolve_backend(config.attention_backend)
    windows = [layer.sliding_window for layer in cfg.attention_layers]
    layout = kv_layout(windows, keep_window_only=config.kv_cache.sliding_window_kv)
    steps = StepConfig.from_config(config, cfg.vocab_size, backend, layout.num_groups)
    if not config.compile.store_executables:  # the step store stands in for jax's cache
        enable_compilation_cache(config.compile.cache_dir)
    dtype = model_dtype(config.dtype, weights)
    threads = config.compile.compile_threads or default_compile_threads()
    tp = mesh.shape[MODEL_AXIS] if mesh is not None else 1
    spec = RunnerSpec(
        family,
        cfg,
        steps,
        dtype,
        backend,
        MAX_LOGPROBS,
        threads,
        logprobs_mode=config.logprobs_mode,
        kv_layout=layout,
        expert_parallel=resolve_expert_parallel(config.enable_expert_parallel, cfg, tp),
        quantization=config.quantization,
        quantize_lm_head=config.quantize_lm_head,
        kv_cache_dtype=config.kv_cache.dtype,
        lora=config.lora,
    )
    store = default_executable_store_dir(config.compile.cache_dir) if config.compile.store_executables else None
    # A multi-process run (jaxserve.distributed): every process builds this engine; process 0's runner sends
    # its steps, the others receive them (`LLM.follow`).
    step_channel = distributed.StepChannel() if distributed.is_multiprocess() else None
    channel = step_channel if distributed.is_leader() else None
    runner = Runner(spec, weights, mesh=mesh, seed=seed, store_dir=store, channel=channel)
    kv_budget = capacity.kv_budget(runner.profile(), config, layout=layout)
    if distributed.is_multiprocess():
        agreed = distributed.agree_on_num_blocks(kv_budget.num_blocks)
        kv_budget = dataclasses.replace(kv_budget, num_blocks=agreed, kv_bytes=agreed * kv_budget.bytes_per_block)
    if config.auto_max_batch_size:  # profiled at the upper bound: conservative for any smaller size
        config = _with_max_batch_size(config, kv_budget, layout)
        steps = StepConfig.from_config(config, cfg.vocab_size, backend, layout.num_groups)
        runner.set_steps(steps)
    lazy = resolve_lazy(config.compile.lazy)
    warmup_seconds = runner.start(kv_budget.num_blocks, show_progress=show_progress, lazy=lazy)
    return StartedRunner(runner, config, steps, kv_budget, warmup_seconds, step_channel)


def _log_ready(spec: RunnerSpec, buckets: BucketTable) -> None:
    shapes = list(dict.fromkeys((b.num_tokens, b.num_seqs) for b in buckets.buckets))
    widths = [w * buckets.block_size for w in buckets.kv_block_buckets]
    logger.info(
        "engine ready: backend=%s, dtype=%s, buckets=%s, attention widths below max_seq_len=%s",
        spec.backend,
        np.dtype(spec.dtype).name,
        shapes,
        widths,
    )


def _check_one_process(action: str) -> None:
    if distributed.is_multiprocess():
        raise RuntimeError(f"{action} is not supported in a run of {jax.process_count()} processes")


def default_compile_threads() -> int:
    """min(8, the CPU count): XLA compiles outside the GIL; tracing the next executable overlaps it."""
    return min(8, os.cpu_count() or 1)


def _with_max_batch_size(config: EngineConfig, budget: capacity.KvBudget, layout: KVLayout) -> EngineConfig:
    """The config with max_batch_size lowered to what the KV pool holds (`capacity.auto_max_batch_size`). A
    sequence's token takes a page slot in each layer group while it is within every window: the pool's tokens
    count once per group."""
    kv_tokens = budget.tokens(config.kv_cache.block_size) // layout.num_groups
    size = capacity.auto_max_batch_size(kv_tokens, config.max_batch_size)
    logger.info(
        "max_batch_size %d (a pool of %d tokens holds %d sequences of %d tokens; upper bound %d)",
        size,
        kv_tokens,
        kv_tokens // capacity.AUTO_TOKENS_PER_SEQUENCE,
        capacity.AUTO_TOKENS_PER_SEQUENCE,
        config.max_batch_size,
    )
    tokens = min(config.max_num_tokens, size * config.max_seq_len)  # no step holds more
    return dataclasses.replace(config, max_batch_size=size, max_num_tokens=tokens, auto_max_batch_size=False)


def model_dtype(dtype: str, weights: Any) -> np.dtype:
    """The serving dtype: EngineConfig.dtype, or "auto": the weights' (their first floating-point leaf's)."""
    if dtype != "auto":
        return jnp.dtype(dtype)
    floating = [w.dtype for w in jax.tree_util.tree_leaves(weights) if jnp.issubdtype(w.dtype, jnp.floating)]
    return floating[0]


def _numeric_first(request_id: str) -> tuple[int, int | str]:
    return (0, int(request_id)) if request_id.isdigit() else (1, request_id)
