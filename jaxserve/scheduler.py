"""Who runs in the next step and with how many tokens: TensorRT-LLM's capacity and micro-batch policies.

Each step (`schedule`):
1. decode rows of running requests, one token each, in admission order (TensorRT-LLM's micro-batch
   scheduler serves generation requests before context chunks);
2. the next prompt chunk of running requests still in prefill (chunked prefill, FCFS);
3. admission of waiting requests in FCFS order, counting prefix-cache hits, while the step has room
   (max_batch_size sequences, max_num_tokens tokens) and the capacity policy allows it. A request
   whose next uncached prefix block a running request is computing waits (the requests behind it
   go on) until that block is cached, so prompts that share a prefix queued together (the choices of
   a multiple-choice question, a shared system prompt) compute it once, as a fork's samples do.
The batch lists prefill chunks first, then decode rows (TensorRT-LLM's order; docs/architecture.md, "One step").

Capacity policies (`config.CapacityPolicy`), after PyCapacityScheduler:
- GUARANTEED_NO_EVICT admits a request only if the blocks for its whole life (prompt + max_tokens,
  bounded by max_seq_len) fit beside what running requests may still claim; no request is evicted.
- MAX_UTILIZATION admits a request when its first chunk fits; when a running request needs a block
  and none is free, the most recently admitted running request is preempted (its blocks freed, its
  prompt + outputs recomputed later). No new request is admitted in a step that preempted one.

Bucket-aware admission (`SchedulerConfig.bucket_aware_admission`, GUARANTEED_NO_EVICT, given the decode
steps' measured costs): a decode step of R rows runs padded to the next compiled decode batch size, so when
the pool holds fewer requests than wait, the requests it holds may sit just above a size (401 rows in a
512-row step), and the ones left after them make a small last batch. Admission then stops at the compiled
size that serves the queue in the least estimated time (`admission_cap`); the requests left wait for the
next batch. Nothing is preempted for it.

The scheduler advances `num_computed_tokens` when it schedules, and counts a row's sampled token as
pending until `update` delivers it, so the engine may schedule step N+1 before it reads step N's
tokens (overlap). `update` ignores rows of requests that finished or were preempted since. Steps must
reach the device in the order they were scheduled: a block freed or cached by one step may be written
by the next.

Host policy: no jax here.
"""

from __future__ import annotations

import collections
import time
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from jaxserve.block_manager import BlockManager
from jaxserve.config import CapacityPolicy, EngineConfig
from jaxserve.lora import LoraSlots
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling import FinishReason
from jaxserve.stopping import token_stop


@dataclass(slots=True)
class ScheduledRow:
    """One sequence of a step: `num_tokens` tokens at positions start .. start + num_tokens - 1.

    token_ids: the inputs known on the host; when input_pending, the last input token was sampled by
        the previous step and is still on the device (the engine gathers it there), so token_ids
        holds num_tokens - 1 entries.
    block_ids: the request's block list at scheduling time; its first ceil((start + num_tokens) /
        block_size) entries hold this row's KV.
    samples: the token sampled from this row's last position becomes the sequence's next output
        token (False for a prompt chunk that does not reach the end of the prompt).
    generation_index: index among the sequence's outputs of the token this row samples (seeded RNG).
    epoch: the request's preemption count when scheduled; `update` ignores the row once it changed.
    """

    request: Request
    start: int
    num_tokens: int
    token_ids: list[int]
    block_ids: array
    samples: bool
    input_pending: bool
    generation_index: int
    epoch: int
    is_prefill: bool


@dataclass(slots=True)
class ScheduledBatch:
    """The rows of one step (prefill chunks first, then decode rows) and who was preempted for it."""

    rows: list[ScheduledRow]
    num_prefill_rows: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows

    @property
    def is_decode_only(self) -> bool:
        return bool(self.rows) and self.num_prefill_rows == 0


# A smaller decode batch size is taken only when it cuts the estimate by this share: measured costs are noisy
# by a percent or so, and of two near-equal sizes the larger serves more requests at once.
ADMISSION_CAP_GAIN = 0.05


def admission_cap(
    fit: int, queued: int, decode_costs: Mapping[int, float], gain: float = ADMISSION_CAP_GAIN
) -> int | None:
    """The decode batch size to stop admitting at when the KV pool holds `fit` of the `queued` requests (running
    and waiting), or None to admit what fits.

    decode_costs: seconds of a decode-only step at each compiled decode batch size on padding rows (what a
    padded row costs: its share of the GEMMs, no attention). The queue is served in batches of at most B
    requests (B = fit without a cap); a batch of r rows decodes in steps padded to the smallest size >= r, so
    serving the queue costs about `drain_cost(queued, B)` per decoding step of a request's life. The rows'
    own attention (the K/V each reads) is the same work whatever the batches, and drops out. A size B < fit
    is taken when it cuts that estimate by more than `gain`, the largest such B first, a smaller one only if
    it cuts B's by `gain` again. With a long queue this is the size of most rows per second (B / cost(B)); with
    a short one it also weighs the last, smaller batch (512 requests where the pool holds 401: 401 + 111 rows
    pad to 512 + 128, 384 + 128 fill theirs, 256 + 256 cost less than both on an H200).
    """
    costs = {size: cost for size, cost in decode_costs.items() if cost > 0}
    sizes = sorted(costs)
    if queued <= fit or not sizes or fit > sizes[-1]:
        return None
    cap, best = None, drain_cost(queued, fit, costs)
    for size in reversed([size for size in sizes if size < fit]):
        cost = drain_cost(queued, size, costs)
        if cost < best * (1 - gain):
            cap, best = size, cost
    return cap


def drain_cost(queued: int, batch: int, decode_costs: Mapping[int, float]) -> float:
    """Seconds per decoding step of a request's life to serve `queued` requests in batches of at most `batch`
    (every batch but the last full), each step padded to the smallest size in decode_costs that holds it."""
    sizes = sorted(decode_costs)

    def step(rows: int) -> float:
        return decode_costs[next(size for size in sizes if size >= rows)]

    full, rest = divmod(queued, batch)
    return full * step(batch) + (step(rest) if rest else 0.0)


@dataclass(slots=True)
class _StepPlan:
    """Rows chosen so far in `schedule` (request -> tokens, in choice order) and the token budget left."""

    budget: int
    rows: dict[Request, int] = field(default_factory=dict)
    # GUARANTEED_NO_EVICT: blocks running requests may still take; kept current during admission.
    reserved_blocks: int = 0

    def add(self, request: Request, num_tokens: int) -> None:
        self.rows[request] = num_tokens
        self.budget -= num_tokens

    def drop(self, request: Request) -> None:
        self.budget += self.rows.pop(request, 0)


class Scheduler:
    """Continuous batching over the block pool; see the module docstring for the policy.

    clock: time source for request metrics (time.monotonic by default; tests may pass a fake).
    decode_costs: seconds of a decode-only step at each compiled decode batch size, on padding (the runner
        measures them at a GPU warmup), for bucket-aware admission; None admits up to max_batch_size.
    """

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
        decode_costs: Mapping[int, float] | None = None,
    ) -> None:
        if block_manager.block_size != config.kv_cache.block_size:
            raise ValueError(
                f"block manager block_size {block_manager.block_size} differs from "
                f"kv_cache.block_size {config.kv_cache.block_size}"
            )
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        bucket_aware = config.scheduler.bucket_aware_admission
        bucket_aware &= config.scheduler.capacity_policy is CapacityPolicy.GUARANTEED_NO_EVICT
        self.decode_costs = dict(decode_costs) if decode_costs and bucket_aware else None
        # An engine that serves LoRA adapters: a request is admitted once its adapter holds a slot, which it pins
        # while it runs.
        self.lora_slots = None if config.lora is None else LoraSlots(config.lora.max_loras)

    # ---- queue ---------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        """Queues a new request; one that can never be served is finished at once with an error.

        The caller checks `request.is_finished` after the call and reports `request.error`.
        """
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id}[{request.index}] was already scheduled")
        error = self.rejection_reason(request)
        if error is not None:
            request.finish(FinishReason.ERROR, self.clock(), error=error)
            return
        self.waiting.append(request)

    def rejection_reason(self, request: Request) -> str | None:
        """Why `request` can never run with this engine's limits, or None if it can."""
        cfg = self.config
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            return "prompt is empty: a prompt needs at least one token"
        if num_prompt + 1 > cfg.max_seq_len:
            return (
                f"prompt has {num_prompt} tokens but max_seq_len is {cfg.max_seq_len}: the prompt and one new "
                "token must fit; shorten the prompt or raise max_seq_len"
            )
        if not cfg.scheduler.enable_chunked_prefill and num_prompt > cfg.max_num_tokens:
            return (
                f"prompt has {num_prompt} tokens, more than max_num_tokens={cfg.max_num_tokens} with chunked "
                "prefill disabled; enable chunked prefill or raise max_num_tokens"
            )
        needed = self._lifetime_blocks(request)
        if needed > self.block_manager.num_usable_blocks:
            return (
                f"request needs {needed} KV blocks for {request.max_total_tokens(cfg.max_seq_len)} tokens but the "
                f"KV cache holds {self.block_manager.num_usable_blocks}; lower max_tokens or max_seq_len, or give "
                "the KV cache more memory"
            )
        return None

    def _lifetime_blocks(self, request: Request) -> int:
        """The most KV pages `request` holds at once from its next step to its end. A full-attention group holds
        every block of the longest length; a sliding group its window plus one step's new tokens: a chunk of
        up to max_num_tokens while prompt (or a preempted sequence's output) is left to compute, then one token.
        So a sequence past its prompt reserves its window, not its prompt's chunk."""
        # KV of every token but the last one sampled, which is never fed back.
        max_len = request.max_total_tokens(self.config.max_seq_len) - 1
        to_compute = request.num_tokens - request.num_computed_tokens
        chunk = min(self.config.max_num_tokens, to_compute) if to_compute > 1 else 1
        return self.block_manager.lifetime_pages(max_len, chunk)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Chooses the next step's rows, takes their KV blocks and advances their computed tokens."""
        plan = _StepPlan(budget=self.config.max_num_tokens)
        preempted: list[Request] = []
        self._schedule_decodes(plan, preempted)
        self._schedule_prefill_chunks(plan, preempted)
        if not preempted:
            self._admit_waiting(plan)
        return self._finalize(plan, preempted)

    def _schedule_decodes(self, plan: _StepPlan, preempted: list[Request]) -> None:
        max_seq_len = self.config.max_seq_len
        for request in list(self.running):
            if len(plan.rows) >= self.config.max_batch_size or plan.budget < 1:
                return
            if request.status is not RequestStatus.DECODE:
                continue  # in prefill, or preempted earlier in this step
            # Its last sampled token is still on the device and ends it: update() will finish it.
            if request.reached_length_limit(max_seq_len):
                continue
            if self._take_blocks(request, 1, plan, preempted):
                plan.add(request, 1)

    def _schedule_prefill_chunks(self, plan: _StepPlan, preempted: list[Request]) -> None:
        for request in list(self.running):
            if len(plan.rows) >= self.config.max_batch_size:
                return
            if request.status is not RequestStatus.PREFILL:
                continue  # decoding, or preempted earlier in this step
            num_tokens = self._chunk_size(request, request.num_computed_tokens, plan.budget)
            if num_tokens == 0:
                return  # FCFS: a later prompt does not overtake this one
            if self._take_blocks(request, num_tokens, plan, preempted):
                plan.add(request, num_tokens)

    def _chunk_size(self, request: Request, start: int, budget: int) -> int:
        """Tokens of the request's remaining prompt to compute this step, within the token budget.

        Mirrors PyMicroBatchScheduler._chunk_fcfs: a truncated chunk ends on a block boundary when it
        can. A preempted request's recompute may be chunked even without chunked prefill: its
        prompt + outputs can exceed max_num_tokens.
        """
        remaining = request.num_tokens - start
        if remaining <= budget:
            return remaining
        if not (self.config.scheduler.enable_chunked_prefill or request.num_preemptions):
            return 0
        end = start + budget
        aligned_end = end - end % self.block_manager.block_size
        return aligned_end - start if aligned_end > start else budget

    def _take_blocks(self, request: Request, num_tokens: int, plan: _StepPlan, preempted: list[Request]) -> bool:
        """Gives `request` blocks for num_tokens more tokens, preempting under MAX_UTILIZATION.

        Returns False when `request` itself had to be preempted.
        """
        while not self.block_manager.append_slots(request, num_tokens):
            if self.config.scheduler.capacity_policy is CapacityPolicy.GUARANTEED_NO_EVICT:
                raise RuntimeError(
                    f"GUARANTEED_NO_EVICT: running request {request.request_id}[{request.index}] found no free "
                    "KV block although its blocks were reserved at admission"
                )
            victim = self.running[-1]
            self._preempt(victim)
            plan.drop(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: Request) -> None:
        """Frees a running request's blocks and queues it first for recompute (its host tokens are kept)."""
        self._preempt(request)

    def requeue_all(self) -> None:
        """Back to a known state after a step failed or was interrupted, whatever this step's scheduling
        had done: the pool is emptied (no cached prefix survives) and every unfinished request waits, those
        that ran first, to be recomputed from the tokens the host has. Tokens still on the device are lost
        and sampled again (the same ones for greedy and seeded requests)."""
        requests = [r for r in dict.fromkeys([*self.running, *self.waiting]) if not r.is_finished]
        for request in requests:
            self._release_adapter_slot(request)
        self.block_manager.reset(requests)
        self.running.clear()
        self.waiting.clear()
        for request in requests:
            if request.status in (RequestStatus.PREFILL, RequestStatus.DECODE):
                request.preempt()
                self.num_preemptions += 1
            self.waiting.append(request)

    def _preempt(self, request: Request) -> None:
        self._release_adapter_slot(request)
        self.block_manager.free(request)
        request.preempt()
        self.running.remove(request)
        # Back to the front of the queue: it was admitted before everything still waiting.
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _reserved_blocks(self) -> int:
        """Blocks running requests may still take before they finish (GUARANTEED_NO_EVICT)."""
        held = self.block_manager.pages_held
        return sum(max(0, self._lifetime_blocks(r) - held(r)) for r in self.running)

    def _admit_waiting(self, plan: _StepPlan) -> None:
        cfg = self.config
        if not self.waiting:
            return  # nothing to admit: skip the O(running) reservation count
        if cfg.scheduler.capacity_policy is CapacityPolicy.GUARANTEED_NO_EVICT:
            plan.reserved_blocks = self._reserved_blocks()
        costs = self.decode_costs
        max_running = cfg.max_batch_size if costs is None else self._max_running(plan.reserved_blocks, costs)
        index = 0
        computing: set[bytes] | None = None  # prompt blocks running requests compute, hashed when first needed
        while index < len(self.waiting):
            if len(plan.rows) >= cfg.max_batch_size or len(self.running) >= max_running or plan.budget < 1:
                return
            request = self.waiting[index]
            parent = request.parent
            fork_parent = None
            if parent is not None and not parent.is_finished:
                if parent.status is not RequestStatus.DECODE or not parent.block_ids:
                    index += 1  # waits until sample 0 has computed the prompt it will share
                    continue
                fork_parent = parent
            elif self.block_manager.enable_prefix_caching:
                next_hash = self.block_manager.probe(request).next_block_hash
                if next_hash is not None:
                    if computing is None:
                        computing = {h for r in self.running for h in self.block_manager.uncached_prompt_hashes(r)}
                    if next_hash in computing:
                        index += 1  # waits until a running request has computed the prefix block it will reuse
                        continue
            if request.lora_name is not None and not self._take_adapter_slot(request):
                index += 1  # waits until a slot is free of running requests' adapters
                continue
            if not self._try_admit(request, fork_parent, plan):
                self._release_adapter_slot(request)
                return  # FCFS: head-of-line blocking, as TensorRT-LLM's capacity scheduler
            del self.waiting[index]
            if computing is not None:
                computing.update(self.block_manager.uncached_prompt_hashes(request))

    def _take_adapter_slot(self, request: Request) -> bool:
        slot = None if self.lora_slots is None else self.lora_slots.acquire(request.lora_name)
        request.lora_slot = slot
        return slot is not None

    def _release_adapter_slot(self, request: Request) -> None:
        if request.lora_slot is not None:
            self.lora_slots.release(request.lora_name)
            request.lora_slot = None

    def _max_running(self, reserved_blocks: int, decode_costs: Mapping[int, float]) -> int:
        """Bucket-aware admission: how many requests may run, max_batch_size or `admission_cap` of the number
        the pool holds (running + the waiting ones, in order, whose lifetime blocks fit beside those running
        requests may still claim). No cap when every waiting request fits (nothing would be left for a later
        batch), nor when the first waiting request shares blocks with running ones (a prefix in use, or a
        running parent's prompt): the count takes no such credit, so it would undercount what the pool holds."""
        limit = self.config.max_batch_size
        fit, free = len(self.running), self.block_manager.num_free_blocks - reserved_blocks
        for request in self.waiting:
            if fit >= limit:
                return limit
            needed = self._lifetime_blocks(request)
            if needed > free:
                break
            free -= needed
            fit += 1
        else:
            return limit
        cap = admission_cap(fit, len(self.running) + len(self.waiting), decode_costs)
        if cap is None or self._shares_running_blocks(self.waiting[0]):
            return limit
        return min(cap, limit)

    def _shares_running_blocks(self, request: Request) -> bool:
        """Whether a waiting request would take blocks running requests hold (a running parent's prompt, or a
        cached prefix in use). Hashes its prompt blocks: called only when a cap is on the table."""
        if request.parent is not None and not request.parent.is_finished:
            return True
        return self.block_manager.probe(request).num_in_use > 0

    def _try_admit(self, request: Request, fork_parent: Request | None, plan: _StepPlan) -> bool:
        """Admits `request` with its first chunk if the capacity policy allows; False changes nothing."""
        manager = self.block_manager
        if fork_parent is not None:
            num_cached_blocks = manager.num_shareable_blocks(fork_parent, request)
            num_in_use = manager.live_pages(
                num_cached_blocks * manager.block_size, num_cached_blocks * manager.block_size
            )
        else:
            probe = manager.probe(request)
            num_cached_blocks, num_in_use = probe.num_cached_blocks, probe.num_in_use
        start = num_cached_blocks * manager.block_size
        num_tokens = self._chunk_size(request, start, plan.budget)
        if num_tokens == 0:
            return False
        # Reused blocks that nobody holds now still leave the free pool, so only in-use hits are free.
        if self.config.scheduler.capacity_policy is CapacityPolicy.GUARANTEED_NO_EVICT:
            needed = self._lifetime_blocks(request) - num_in_use
            if plan.reserved_blocks + needed > manager.num_free_blocks:
                return False
        elif manager.live_pages(start, start + num_tokens) - num_in_use > manager.num_free_blocks:
            return False
        if fork_parent is not None:
            manager.fork(fork_parent, request)
        else:
            manager.allocate(request)
        if not manager.append_slots(request, num_tokens):
            raise RuntimeError(f"request {request.request_id}[{request.index}]: admitted without room for its chunk")
        request.admit(self.clock())
        self.running.append(request)
        plan.add(request, num_tokens)
        plan.reserved_blocks += max(0, self._lifetime_blocks(request) - manager.pages_held(request))
        return True

    def _finalize(self, plan: _StepPlan, preempted: list[Request]) -> ScheduledBatch:
        prefill_rows: list[ScheduledRow] = []
        decode_rows: list[ScheduledRow] = []
        for request, num_tokens in plan.rows.items():
            # Request.num_tokens and num_output_tokens, read once per row (this loop runs over every row).
            start, known = request.num_computed_tokens, len(request.token_ids)
            end, total = start + num_tokens, known + request.num_pending_tokens
            row = ScheduledRow(
                request=request,
                start=start,
                num_tokens=num_tokens,
                token_ids=request.token_ids[start:end],  # up to the known ones
                block_ids=request.block_ids,
                samples=end == total,
                input_pending=end > known,
                generation_index=total - len(request.prompt_token_ids),
                epoch=request.num_preemptions,
                is_prefill=request.status is RequestStatus.PREFILL,
            )
            request.num_computed_tokens = end
            if row.samples:
                request.num_pending_tokens += 1
                if request.status is RequestStatus.PREFILL:
                    request.start_decode()
            (prefill_rows if row.is_prefill else decode_rows).append(row)
        return ScheduledBatch(rows=prefill_rows + decode_rows, num_prefill_rows=len(prefill_rows), preempted=preempted)

    # ---- results -------------------------------------------------------------------------------

    def update(self, batch: ScheduledBatch, sampled: np.ndarray) -> list[Request]:
        """Appends each sampling row's token, applies the token stop rules (`jaxserve.stopping.token_stop`),
        frees finished requests.

        sampled: one token id per row of the step (padding rows beyond the batch are ignored).
        Returns the requests that got a token (finished ones included), in row order.
        """
        tokens = np.asarray(sampled).reshape(-1)
        if tokens.shape[0] < len(batch.rows):
            raise ValueError(f"update got {tokens.shape[0]} sampled tokens for {len(batch.rows)} rows")
        now = self.clock()
        changed: list[Request] = []
        for row, token in zip(batch.rows, tokens.tolist(), strict=False):
            request = row.request
            if request.is_finished or request.num_preemptions != row.epoch:
                continue  # finished or preempted after this step was scheduled
            if row.samples:
                request.append_token(token, now)
                changed.append(request)
                stop = token_stop(request, self.config.max_seq_len)
                if stop is not None:
                    self.finish(request, stop.reason, stop_reason=stop.stop_reason)
            if not request.is_finished:
                self.block_manager.cache_full_blocks(request)
        return changed

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        *,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> None:
        """Ends a request (stop strings, aborts, errors found by the engine) and frees its blocks."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release_adapter_slot(request)
        self.block_manager.free(request)
        request.finish(reason, self.clock(), stop_reason=stop_reason, error=error)

    def abort(self, request_id: str) -> list[Request]:
        """Finishes every sample of `request_id` with reason "abort"; returns them."""
        found = [r for r in (*self.running, *self.waiting) if r.request_id == request_id]
        for request in found:
            self.finish(request, FinishReason.ABORT)
        return found
