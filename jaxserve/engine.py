"""The engine loop: schedule -> prepare -> run -> update, with the host work of step N+1 overlapped
with the device work of step N.

    batch = scheduler.schedule()                    # host: who runs, how many tokens
    inputs = make_step_inputs(batch, buckets)       # host numpy, padded to a bucket
    out = runner.run(inputs, ...)                   # device: one precompiled call, not awaited
    scheduler.update(previous_batch, tokens)        # host: append, stop, free blocks

Overlap (DESIGN.md): step N+1 is dispatched before step N's tokens are read; the tokens step N
sampled stay on the device and the compiled step gathers them into step N+1's inputs. A request
that finished at step N wastes at most one token of step N+1.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve import capacity
from jaxserve.block_manager import BlockManager
from jaxserve.config import EngineConfig
from jaxserve.inputs import (
    BucketTable,
    carried_tokens,
    make_prompt_targets,
    make_sampling_inputs,
    make_step_inputs,
    make_token_history,
)
from jaxserve.request import Request, make_requests
from jaxserve.runner import MAX_BANNED_TOKENS, Runner, RunnerSpec, StepOutput, enable_compilation_cache
from jaxserve.sampling import (
    MAX_LOGPROBS,
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestOutput,
    SamplingParams,
    validate_prompt_token_ids,
)
from jaxserve.scheduler import ScheduledBatch, Scheduler
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer
from sharding.mesh import MODEL_AXIS

logger = logging.getLogger(__name__)


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


@dataclass(slots=True)
class _InFlight:
    batch: ScheduledBatch
    output: StepOutput
    stats: StepStats
    row_offsets: np.ndarray | None = None  # first flat token of each row, when the step has prompt logprobs


@dataclass(slots=True)
class _Group:
    """The n samples of one request id, with their detokenizers."""

    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    logprobs: list[list[dict[int, Logprob]]] = field(default_factory=list)
    # prompt_logprobs: position 0 has none; position p + 1 is appended once the step computing p is read.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class Engine:
    """Continuous batching over a paged KV cache; see the module docstring."""

    def __init__(
        self,
        family: Any,
        cfg: Any,
        weights: Any,
        tokenizer: Tokenizer,
        config: EngineConfig,
        *,
        mesh: Mesh | None = None,
        seed: int = 0,
        show_progress: bool = True,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = cfg.vocab_size
        self.buckets = BucketTable.from_config(config)
        backend = resolve_backend(config.attention_backend)
        enable_compilation_cache(config.compile.cache_dir)
        dtype = jax.tree_util.tree_leaves(weights)[0].dtype
        spec = RunnerSpec(
            family=family,
            cfg=cfg,
            buckets=self.buckets,
            dtype=dtype,
            backend=backend,
            max_seq_len=config.max_seq_len,
            num_top_logprobs=MAX_LOGPROBS,
            penalty_variants=config.compile.penalty_variants,
            prompt_logprob_variants=config.compile.prompt_logprobs,
            greedy_variants=config.compile.greedy_variants,
        )
        self.runner = Runner(spec, weights, mesh=mesh, seed=seed)
        self.kv_budget = self._size_kv_cache(cfg, dtype)
        self.runner.allocate_kv_cache(self.kv_budget.num_blocks)
        self.warmup_seconds = self.runner.warmup(show_progress=show_progress)
        kv = config.kv_cache
        self.block_manager = BlockManager(self.kv_budget.num_blocks, kv.block_size, kv.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.stats: collections.deque[StepStats] = collections.deque(maxlen=100_000)
        self._groups: dict[str, _Group] = {}
        self._in_flight: _InFlight | None = None
        self._finished_outside_steps: list[str] = []
        self._ids = itertools.count()
        logger.info(
            "engine ready: backend=%s, buckets=%s", backend, [(b.num_tokens, b.num_seqs) for b in self.buckets.buckets]
        )

    # ---- capacity -------------------------------------------------------------------------------

    def _size_kv_cache(self, cfg: Any, dtype: Any) -> capacity.KvBudget:
        tp = self.runner.mesh.shape[MODEL_AXIS]
        per_token = capacity.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, tp)
        devices = list(self.runner.mesh.devices.flat)
        memory = [capacity.device_memory(d) for d in devices]
        if any(m is None for m in memory):
            return capacity.kv_budget(self.config, per_token, None)
        # The largest variant: the largest bucket, with penalties and prompt logprobs when they are compiled
        # (a token bucket then, as only those have prompt-logprobs variants).
        prompt_lp = self.config.compile.prompt_logprobs
        candidates = [b for b in self.buckets.buckets if not (prompt_lp and b.decode_only)]
        largest = max(candidates, key=lambda b: (b.num_tokens, b.num_seqs, not b.decode_only))
        probe_blocks = self.buckets.max_blocks_per_seq + 1
        penalties = self.config.compile.penalty_variants
        probe = self.runner.compile_step(largest, penalties, num_blocks=probe_blocks, prompt_lp=prompt_lp)
        compiled_peak = capacity.activation_peak(probe)
        before = [capacity.device_memory(d) for d in devices]
        self.runner.probe_step(probe, largest, penalties, probe_blocks, prompt_lp)
        peaks = [capacity.peak_bytes_in_use(d) for d in devices]
        # The probe step's peak above what was in use before it (its small pool included: conservative).
        # peak_bytes_in_use never resets, so a load-time peak can hide the step's: the compiled figure
        # stays the floor.
        measured = max(p - in_use for p, (_, in_use) in zip(peaks, before, strict=True))
        peak = max(compiled_peak, measured)
        logger.info(
            "activation peak of T=%d B=%d: %.2f GiB (compiled memory analysis), %.2f GiB (probe step); using %.2f GiB",
            largest.num_tokens,
            largest.num_seqs,
            compiled_peak / 2**30,
            measured / 2**30,
            peak / 2**30,
        )
        memory = [capacity.device_memory(d) for d in devices]
        profiles = [capacity.MemoryProfile(limit, in_use, peak) for limit, in_use in memory]
        return capacity.kv_budget(self.config, per_token, profiles)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queues a prompt (text or token ids); raises ValueError on bad input. Returns the request id."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        # Validated again: a frozen dataclass can still be changed through object.__setattr__, and an
        # invalid value must fail here, on its request, not inside a step shared with other requests.
        params = dataclasses.replace(params)
        self._check_supported(params)
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt) if prompt else []
        else:
            text, ids = None, list(prompt)
        validate_prompt_token_ids(ids, self.vocab_size)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        eos = frozenset(self.tokenizer.eos_token_ids)
        samples = make_requests(request_id, ids, params, eos_token_ids=eos, prompt=text)
        detok = [IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) for _ in samples]
        prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self._groups[request_id] = _Group(text, ids, samples, detok, [[] for _ in samples], prompt_logprobs)
        for request in samples:
            self.scheduler.add(request)
        if any(r.is_finished for r in samples):
            self._finished_outside_steps.append(request_id)
        return request_id

    def _check_supported(self, params: SamplingParams) -> None:
        if params.prompt_logprobs is not None and not self.config.compile.prompt_logprobs:
            raise ValueError("prompt_logprobs needs CompileConfig(prompt_logprobs=True) at engine start")
        if _has_penalty(params) and not self.config.compile.penalty_variants:
            raise ValueError(
                "repetition/presence/frequency penalties need CompileConfig(penalty_variants=True) at engine start"
            )
        if params.min_tokens and len(self.tokenizer.eos_token_ids) + len(params.stop_token_ids) > MAX_BANNED_TOKENS:
            raise ValueError(
                f"min_tokens can hold back at most {MAX_BANNED_TOKENS} EOS / stop token ids; "
                f"got {len(self.tokenizer.eos_token_ids) + len(params.stop_token_ids)}"
            )

    def abort(self, request_id: str) -> None:
        """Finishes every sample of the request (reason "abort"); its final output comes with the next step."""
        if self.scheduler.abort(request_id):
            self._finished_outside_steps.append(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._finished_outside_steps)

    # ---- one step -------------------------------------------------------------------------------

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Dispatches the next step, then reads back the previous one; returns the requests that changed.

        finished_only: return only requests that finished (batch generation needs no partial outputs,
        and building them for every running request each step is host time on the critical path).
        """
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if not batch.is_empty else None
        previous, self._in_flight = self._in_flight, launched
        changed = self._read_back(previous) if previous is not None else set()
        changed.update(self._finished_outside_steps)
        self._finished_outside_steps.clear()
        if finished_only:
            changed = {i for i in changed if all(r.is_finished for r in self._groups[i].samples)}
        return [self._output(request_id) for request_id in sorted(changed, key=_numeric_first)]

    def _launch(self, batch: ScheduledBatch) -> _InFlight:
        start = time.perf_counter()
        inputs = make_step_inputs(batch, self.buckets)
        rows = inputs.bucket.num_seqs
        previous = self._in_flight.batch if self._in_flight is not None else None
        history = None
        if any(_has_penalty(r.request.sampling_params) for r in batch.rows):  # add_request ensured the variant
            history = make_token_history(batch, rows, self.config.max_seq_len, self.vocab_size)
        prompt_targets = row_offsets = None
        if any(r.is_prefill and r.request.sampling_params.prompt_logprobs is not None for r in batch.rows):
            prompt_targets = make_prompt_targets(batch, inputs.bucket.num_tokens)
            row_offsets = inputs.cu_q_lens[: len(batch.rows)]
        want_logprobs = any(r.request.sampling_params.logprobs is not None for r in batch.rows)
        greedy = (
            self.config.compile.greedy_variants
            and history is None
            and prompt_targets is None
            and not want_logprobs
            and all(r.request.sampling_params.is_greedy for r in batch.rows)
        )
        dispatch_start = time.perf_counter()
        output = self.runner.run(
            inputs,
            make_sampling_inputs(batch, rows),
            carried_tokens(batch, previous, rows),
            self._banned_tokens(batch, rows),
            history,
            want_logprobs=want_logprobs,
            prompt_targets=prompt_targets,
            greedy=greedy,
        )
        stats = StepStats(
            num_tokens=batch.num_tokens,
            num_seqs=batch.num_seqs,
            num_prefill_rows=batch.num_prefill_rows,
            bucket_tokens=inputs.bucket.num_tokens,
            bucket_seqs=inputs.bucket.num_seqs,
            kv_usage=self.block_manager.usage,
            num_preempted=len(batch.preempted),
            prefix_hit_rate=self.block_manager.stats.hit_rate,
            host_seconds=time.perf_counter() - start,
            dispatch_seconds=time.perf_counter() - dispatch_start,
            launched_at=dispatch_start,
        )
        return _InFlight(batch, output, stats, row_offsets)

    def _banned_tokens(self, batch: ScheduledBatch, rows: int) -> np.ndarray:
        """EOS and stop ids a row may not sample yet (min_tokens); padded with the vocab size."""
        banned = np.full((rows, MAX_BANNED_TOKENS), self.vocab_size, dtype=np.int32)
        for b, row in enumerate(batch.rows):
            params = row.request.sampling_params
            if row.generation_index < params.min_tokens:
                ids = [*row.request.eos_token_ids, *params.stop_token_ids][:MAX_BANNED_TOKENS]
                banned[b, : len(ids)] = ids
        return banned

    def _read_back(self, flight: _InFlight) -> set[str]:
        """Waits for a step's tokens, updates the scheduler, detokenizes and applies stop strings."""
        batch = flight.batch
        tokens = np.asarray(flight.output.token_ids)
        wants_logprobs = any(r.request.sampling_params.logprobs is not None for r in batch.rows)
        logprobs = _host_logprobs(flight.output) if wants_logprobs else None
        if flight.row_offsets is not None:
            self._record_prompt_logprobs(flight)
        receiving = [
            (i, row.request)
            for i, row in enumerate(batch.rows)
            if row.samples and not row.request.is_finished and row.request.num_preemptions == row.epoch
        ]
        self.scheduler.update(batch, tokens[: len(batch.rows)])
        self.stats.append(flight.stats)
        changed: set[str] = set()
        for i, request in receiving:
            group = self._groups[request.request_id]
            self._append_text(group, request, request.token_ids[-1])
            if logprobs is not None and request.sampling_params.logprobs is not None:
                group.logprobs[request.index].append(_position_logprobs(logprobs, i, request))
            changed.add(request.request_id)
        return changed

    def _record_prompt_logprobs(self, flight: _InFlight) -> None:
        """Appends the prompt positions this step scored to their groups, each position once.

        A row's token at position p scores prompt position p + 1. A position already recorded (a
        preempted request recomputes its prompt) is skipped; the values are valid either way.
        """
        out = flight.output
        fields = (out.prompt_logprobs, out.prompt_ranks, out.prompt_top_logprobs, out.prompt_top_token_ids)
        chosen, ranks, top_lp, top_ids = (np.asarray(f) for f in fields)
        for row, offset in zip(flight.batch.rows, flight.row_offsets.tolist(), strict=True):
            request = row.request
            k = request.sampling_params.prompt_logprobs
            group = self._groups.get(request.request_id)
            if not row.is_prefill or k is None or group is None or group.prompt_logprobs is None:
                continue
            entries, prompt = group.prompt_logprobs, request.prompt_token_ids
            for i in range(row.num_tokens):
                position = row.start + i + 1
                if position >= len(prompt) or position != len(entries):
                    continue
                t, token = offset + i, prompt[position]
                entry = {int(top_ids[t, r]): Logprob(float(top_lp[t, r]), rank=r + 1) for r in range(k)}
                if token not in entry:
                    entry[token] = Logprob(float(chosen[t]), rank=int(ranks[t]))
                entries.append(entry)

    def _append_text(self, group: _Group, request: Request, token: int) -> None:
        detok = group.detokenizers[request.index]
        before = len(detok.text)
        detok.add(token)
        if request.is_finished:
            detok.flush()
        stops = request.sampling_params.stop
        if not stops or request.finish_reason is FinishReason.ERROR:
            return
        longest = max(len(s) for s in stops)
        hit = _first_stop(detok.text, stops, max(0, before - longest + 1))
        if hit is not None:
            index, stop = hit
            detok.text = detok.text[:index]
            if request.is_finished:  # a length stop in the same token: the stop string wins
                request.finish_reason, request.stop_reason = FinishReason.STOP, stop
            else:
                self.scheduler.finish(request, FinishReason.STOP, stop_reason=stop)

    def _output(self, request_id: str) -> RequestOutput:
        group = self._groups[request_id]
        outputs = [
            CompletionOutput(
                index=r.index,
                text=group.detokenizers[r.index].text,
                token_ids=list(r.output_token_ids),
                logprobs=list(group.logprobs[r.index]) if r.sampling_params.logprobs is not None else None,
                finish_reason=r.finish_reason.value if r.finish_reason is not None else None,
                stop_reason=r.stop_reason,
            )
            for r in group.samples
        ]
        finished = all(r.is_finished for r in group.samples)
        errors = [r.error for r in group.samples if r.error]
        output = RequestOutput(
            request_id=request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=group.samples[0].metrics,
            error=errors[0] if errors else None,
            prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
        )
        if finished:
            del self._groups[request_id]
        return output


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


def _has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0


def _first_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    hits = [(i, stop) for stop in stops if (i := text.find(stop, start)) >= 0]
    return min(hits) if hits else None


def _numeric_first(request_id: str) -> tuple[int, int | str]:
    return (0, int(request_id)) if request_id.isdigit() else (1, request_id)


def _host_logprobs(output: StepOutput) -> tuple[np.ndarray, ...]:
    fields = (output.logprobs, output.ranks, output.top_logprobs, output.top_token_ids)
    return tuple(np.asarray(f) for f in fields)


def _position_logprobs(logprobs: tuple[np.ndarray, ...], row: int, request: Request) -> dict:
    """vLLM's per-position dict: the sampled token and the top-n alternatives, with their ranks."""
    sampled_lp, ranks, top_lp, top_ids = logprobs
    token = request.token_ids[-1]
    n = request.sampling_params.logprobs or 0
    entry = {int(top_ids[row, r]): Logprob(float(top_lp[row, r]), rank=r + 1) for r in range(n)}
    if token not in entry:
        entry[token] = Logprob(float(sampled_lp[row]), rank=int(ranks[row]))
    return entry
