"""The step's inputs: ScheduledBatch -> `StepInputs`, the flat token batch of docs/architecture.md with the per-row
sampling arrays and the per-step extras, as numpy arrays padded to a bucket (jaxserve/buckets.py) for the
variant the batch needs (jaxserve/variants.py).

    inputs, bucket, variant = make_step_inputs(batch, previous, step_config, cache)

`make_step_inputs` is the only place that builds StepInputs (`padding_inputs` declares every array's
shape, dtype and padding value once); the runner compiles one step per `StepConfig.compiled_steps()`
entry and runs `compiled[bucket, variant]`. What it reuses from one step to the next (each request's
packed sampling record, the last step built) lives in a `StepInputsCache` that the engine holds.

Padding tokens have token 0, position 0 and write their K/V to block 0 (reserved); padding rows own
no tokens (their cu_q_lens entries repeat the real token count) and have kv_len 0.

Host policy: no jax here. The types that cross to the device declare it (`device_pytree`).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

import numpy as np
from jaxtyping import Bool, Float32, Int32, UInt32

from jaxserve.block_manager import RESERVED_BLOCK
from jaxserve.buckets import Bucket, BucketTable
from jaxserve.request import Request
from jaxserve.sampling import SamplingParams
from jaxserve.scheduler import ScheduledBatch
from jaxserve.variants import MAX_BANNED_TOKENS, VARIANT_FACTS, StepConfig, StepVariant, variant_facts

NO_TARGET = -1  # a flat token whose next token is not a prompt token (or whose request wants no prompt logprobs)
# The fewest sampling records a StepInputsCache holds before it first drops those of finished requests.
MIN_RECORD_SWEEP = 256

_Type = TypeVar("_Type", bound=type)
_UNREGISTERED: list[type] = []


def device_pytree(cls: _Type) -> _Type:
    """Declares a dataclass whose values cross to the device: a jax pytree, every field a child. This module
    imports no jax, so the type is registered at once when jax is loaded, else by `register_device_pytrees`,
    which the device side calls before it traces a step (jaxserve/step.py, jaxserve/sampler.py)."""
    _UNREGISTERED.append(cls)
    if "jax" in sys.modules:
        register_device_pytrees()
    return cls


def register_device_pytrees() -> None:
    """Registers every `device_pytree` type not registered yet with jax.tree_util."""
    import jax  # the device side's call: jax is loaded there

    while _UNREGISTERED:
        jax.tree_util.register_dataclass(_UNREGISTERED.pop(0))


def _column(dtype: type[np.generic], neutral: float) -> Any:
    """A per-row sampling column: its dtype and the value that switches its feature off (padding rows)."""
    return field(metadata={"dtype": dtype, "neutral": neutral})


@device_pytree
@dataclass(frozen=True, slots=True)
class SamplingInputs:
    """Per-row sampling parameters of one step, padded to B rows with neutral (greedy) values.

    A row is greedy when its temperature is below 1e-5 or its top_k is 1; top_k 0 means no top-k
    limit. seed is meaningful where has_seed. generation_index is the index among its sequence's
    outputs of the token the row samples: with the seed it keys the row's PRNG, so a seeded sequence
    samples the same tokens whatever else shares its batch (and again after a preemption).
    """

    temperature: Float32[np.ndarray, " B"] = _column(np.float32, 0.0)
    top_k: Int32[np.ndarray, " B"] = _column(np.int32, 0)
    top_p: Float32[np.ndarray, " B"] = _column(np.float32, 1.0)
    min_p: Float32[np.ndarray, " B"] = _column(np.float32, 0.0)
    repetition_penalty: Float32[np.ndarray, " B"] = _column(np.float32, 1.0)
    presence_penalty: Float32[np.ndarray, " B"] = _column(np.float32, 0.0)
    frequency_penalty: Float32[np.ndarray, " B"] = _column(np.float32, 0.0)
    seed: UInt32[np.ndarray, " B"] = _column(np.uint32, 0)
    has_seed: Bool[np.ndarray, " B"] = _column(np.bool_, False)
    generation_index: Int32[np.ndarray, " B"] = _column(np.int32, 0)

    @classmethod
    def neutral(cls, num_rows: int) -> SamplingInputs:
        """num_rows greedy rows with every feature off."""
        if num_rows < 1:
            raise ValueError(f"SamplingInputs.neutral: num_rows must be >= 1, got {num_rows}")
        return cls(**{f.name: np.full(num_rows, f.metadata["neutral"], f.metadata["dtype"]) for f in fields(cls)})

    @classmethod
    def from_columns(cls, **columns: Any) -> SamplingInputs:
        """From one array-like per field, cast to the field's dtype; every column must have shape (B,).

        Seeds are taken modulo 2**32 (the device PRNG's seed width), as `Request.seed` does.
        """
        names = [f.name for f in fields(cls)]
        if sorted(columns) != sorted(names):
            missing, extra = sorted(set(names) - set(columns)), sorted(set(columns) - set(names))
            raise ValueError(f"SamplingInputs: missing columns {missing}, unknown columns {extra}")
        columns = {**columns, "seed": np.asarray(columns["seed"]).astype(np.int64) % 2**32}
        arrays = {f.name: np.asarray(columns[f.name], dtype=f.metadata["dtype"]) for f in fields(cls)}
        shape = arrays["temperature"].shape
        for name, array in arrays.items():
            if array.shape != shape or len(shape) != 1:
                raise ValueError(f"SamplingInputs column {name} has shape {array.shape}; expected (B,) = {shape}")
        return cls(**arrays)


@device_pytree
@dataclass(frozen=True, slots=True)
class TokenHistory:
    """Each row's prompt then output tokens, for the repetition / presence / frequency penalties.

    token_ids is padded with the vocabulary size (out of range: the sampler's scatters drop it). A row
    whose last input token is still on the device (overlap) has padding at that position,
    carried_column (S for other rows); the sampler fills it with the carried token, like token_ids.
    """

    token_ids: Int32[np.ndarray, "B S"]
    num_prompt_tokens: Int32[np.ndarray, " B"]
    carried_column: Int32[np.ndarray, " B"]


@device_pytree
@dataclass(frozen=True, slots=True)
class StepInputs:
    """Everything one compiled step receives besides the weights, the KV cache and the device state
    (docs/architecture.md, "One step"): numpy on the host, the same type (a pytree) inside the step.

    carried_mask / carried_source: row b's last input token is the previous step's sample of row
        carried_source[b] (overlap); the step writes it into token_ids[logits_indices[b]].
    banned_tokens: ids row b may not sample this step (min_tokens), padded with the vocabulary size.
    history / prompt_targets: present exactly in the penalties / prompt-logprobs variants.
    lora_slots: each token's adapter slot (0: the base model; padding too), in an engine that serves LoRA adapters
        (`StepConfig.lora`) only.
    block_table / slot_mapping: with G KV layer groups (`jaxserve/kv_layout.py`), a row's entry m * G + g is the
        page of its block m in group g (0: released or padding), and slot_mapping[g] each token's slot in group
        g's pages.
    """

    token_ids: Int32[np.ndarray, " T"]
    positions: Int32[np.ndarray, " T"]
    slot_mapping: Int32[np.ndarray, "G T"]
    cu_q_lens: Int32[np.ndarray, " B+1"]
    kv_lens: Int32[np.ndarray, " B"]
    block_table: Int32[np.ndarray, "B MG"]
    logits_indices: Int32[np.ndarray, " B"]
    num_seqs: Int32[np.ndarray, ""]
    carried_mask: Bool[np.ndarray, " B"]
    carried_source: Int32[np.ndarray, " B"]
    banned_tokens: Int32[np.ndarray, "B NB"]
    sampling: SamplingInputs
    history: TokenHistory | None = None
    prompt_targets: Int32[np.ndarray, " T"] | None = None
    lora_slots: Int32[np.ndarray, " T"] | None = None


def padding_inputs(bucket: Bucket, variant: StepVariant, config: StepConfig) -> StepInputs:
    """An all-padding step of one compiled shape: the one declaration of every input's shape, dtype and
    padding value. make_step_inputs fills one in; the runner compiles for its shapes and the capacity
    probe runs it as it is.

    Padding tokens have token 0, position 0 and write their K/V to block 0 (reserved); padding rows
    own no tokens and have kv_len 0.
    """
    T, B, M, G = bucket.num_tokens, bucket.num_seqs, config.buckets.table_width(bucket), config.kv_groups

    def ints(shape: int | tuple[int, ...], value: int = 0) -> np.ndarray:
        return np.full(shape, value, dtype=np.int32)

    S = config.max_seq_len
    history = TokenHistory(ints((B, S), config.vocab_size), ints(B), ints(B, S)) if variant.penalties else None
    return StepInputs(
        token_ids=ints(T),
        positions=ints(T),
        slot_mapping=ints((G, T), RESERVED_BLOCK * config.buckets.block_size),
        cu_q_lens=ints(B + 1),
        kv_lens=ints(B),
        block_table=ints((B, M * G), RESERVED_BLOCK),
        logits_indices=ints(B),
        num_seqs=ints(()),
        carried_mask=np.zeros(B, dtype=np.bool_),
        carried_source=ints(B),
        banned_tokens=ints((B, MAX_BANNED_TOKENS), config.vocab_size),
        sampling=SamplingInputs.neutral(B),
        history=history,
        prompt_targets=ints(T, NO_TARGET) if variant.prompt_logprobs else None,
        lora_slots=ints(T) if config.lora else None,
    )


def make_step_inputs(
    batch: ScheduledBatch, previous: ScheduledBatch | None, config: StepConfig, cache: StepInputsCache | None = None
) -> tuple[StepInputs, Bucket, StepVariant]:
    """The one place a step's inputs are built: the batch's rows packed token-major into the smallest
    bucket that holds them, for the variant they need. `previous` is the step still in flight, whose
    samples are this step's pending input tokens. `cache`: what the caller keeps between its steps; when it
    holds `previous` as the last step built and this batch is its rows one token further (steady decode),
    the step is built from that one's inputs (`_advanced`). Without a cache every step is built in full."""
    if not batch.rows:
        raise ValueError("cannot build step inputs for an empty batch")
    cache = StepInputsCache() if cache is None else cache
    columns = BatchColumns.read(batch, cache)
    last = cache.last if previous is not None and cache.last is not None and cache.last.batch is previous else None
    if last is not None:
        previous_columns = last.columns
    else:
        previous_columns = None if previous is None else BatchColumns.read(previous, cache)
    advanced = None if last is None else _advanced(batch, columns, last, config)
    step = advanced or _built(batch, columns, previous_columns, config)
    cache.last = BuiltStep(batch, columns, *step)
    return step


def _built(
    batch: ScheduledBatch, columns: BatchColumns, previous: BatchColumns | None, config: StepConfig
) -> tuple[StepInputs, Bucket, StepVariant]:
    """The step's inputs filled in over an all-padding step of its bucket (`previous`: the columns of the step
    in flight)."""
    kv_lens = columns.starts + columns.q_lens
    bucket = config.buckets.lookup(int(columns.q_lens.sum()), len(batch.rows), batch.is_decode_only, int(kv_lens.max()))
    variant = config.choose_variant(batch, columns.sampling, columns.samples)
    inputs = padding_inputs(bucket, variant, config)
    _fill_flat_batch(inputs, batch, columns, config.buckets)
    if inputs.lora_slots is not None:
        slots = np.fromiter([r.lora_slot or 0 for r in columns.requests], dtype=np.int32, count=len(columns.requests))
        inputs.lora_slots[: int(columns.q_lens.sum())] = np.repeat(slots, columns.q_lens)
    _fill_carried(inputs, columns, previous)
    _fill_banned(inputs.banned_tokens, columns)
    _fill_sampling(inputs.sampling, columns)
    if inputs.history is not None:
        _fill_history(inputs.history, columns, inputs.carried_mask)
    if inputs.prompt_targets is not None:
        _fill_prompt_targets(inputs.prompt_targets, batch, columns, inputs.cu_q_lens)
    return inputs, bucket, variant


def _advanced(
    batch: ScheduledBatch, columns: BatchColumns, previous: BuiltStep, config: StepConfig
) -> tuple[StepInputs, Bucket, StepVariant] | None:
    """Steady decode: every row is the previous step's row of the same request, in the same order, one
    token further, with that step's sample as its input. Then the bucket and variant are the previous
    step's (the same requests' records, every row sampling; no token history: the penalties variant is
    built in full) and so are most inputs; what moves is computed from the previous step's arrays:
    positions, kv_lens, slots, the block table's entries for rows that enter a new block, the banned ids
    and generation_index. None when the batch is anything else (then `_built` makes it, with its errors).
    tests/engine/test_inputs.py checks that both give the same inputs over a scheduler's steps."""
    previous_inputs, bucket, variant = previous.inputs, previous.bucket, previous.variant
    before, n = previous.columns, len(columns.requests)
    if (
        variant.penalties
        or variant.prompt_logprobs
        or not (batch.is_decode_only and previous.batch.is_decode_only and n == len(before.requests))
        or not ((columns.q_lens == 1).all() and (before.q_lens == 1).all())
        or not (columns.input_pending.all() and columns.samples.all() and before.samples.all())
        or not np.array_equal(columns.starts, before.starts + 1)
        or columns.requests != before.requests  # by identity (Request has no __eq__)
    ):
        return None
    starts, block_size = columns.starts, config.buckets.block_size
    if config.buckets.lookup(n, n, True, int(starts.max()) + 1) != bucket:
        return None
    table, groups = previous_inputs.block_table, config.kv_groups
    entering = np.flatnonzero(starts % block_size == 0)  # their new token is the first of a block
    if entering.size:
        index = starts[entering] // block_size
        blocks = [batch.rows[b].block_ids for b in entering.tolist()]
        held = np.array([len(ids) for ids in blocks]) // groups
        if (index >= table.shape[1] // groups).any() or (index >= held).any():
            return None  # a row without its next block: `_built` says which
        table = table.copy()
        for g in range(groups):  # a sliding group's released entries stay as the previous step had them
            table[entering, index * groups + g] = [
                ids[k * groups + g] for ids, k in zip(blocks, index.tolist(), strict=True)
            ]
    positions, kv_lens, slots = (
        a.copy() for a in (previous_inputs.positions, previous_inputs.kv_lens, previous_inputs.slot_mapping)
    )
    positions[:n] = starts
    kv_lens[:n] = starts + 1
    entry = (starts // block_size)[None, :] * groups + np.arange(groups)[:, None]
    slots[:, :n] = table[np.arange(n)[None, :], entry] * block_size + starts % block_size
    banned = np.full_like(previous_inputs.banned_tokens, config.vocab_size)
    _fill_banned(banned, columns)
    generation_index = previous_inputs.sampling.generation_index.copy()
    generation_index[:n] = columns.generation_index
    carried_mask, carried_source = (
        np.zeros_like(previous_inputs.carried_mask),
        np.zeros_like(previous_inputs.carried_source),
    )
    carried_mask[:n], carried_source[:n] = True, np.arange(n)  # every input the same row's sample
    inputs = replace(
        previous_inputs,
        token_ids=np.zeros_like(previous_inputs.token_ids),
        carried_mask=carried_mask,
        carried_source=carried_source,
        positions=positions,
        slot_mapping=slots,
        kv_lens=kv_lens,
        block_table=table,
        banned_tokens=banned,
        sampling=replace(previous_inputs.sampling, generation_index=generation_index),
    )
    return inputs, bucket, variant


# One request's sampling inputs (SamplingInputs' columns, with their dtypes, but generation_index) and the


# ---- what the steps reuse ------------------------------------------------------------------------

# One request's sampling inputs (SamplingInputs' columns, with their dtypes, but generation_index) and the
# facts its step's variant and banned ids read, as one record: packed once per request (`StepInputsCache`),
# so that a step gathers its rows' records with one bytes join.
SAMPLING_RECORD = np.dtype(
    [
        *((f.name, f.metadata["dtype"]) for f in fields(SamplingInputs) if f.name != "generation_index"),
        ("min_tokens", np.int32),
        *VARIANT_FACTS.descr,
    ]
)


def _record_values(params: SamplingParams, seed: int | None) -> tuple[Any, ...]:
    return (
        params.temperature,
        params.top_k or 0,
        params.top_p,
        params.min_p,
        params.repetition_penalty,
        params.presence_penalty,
        params.frequency_penalty,
        seed or 0,
        seed is not None,
        params.min_tokens,
        *variant_facts(params),
    )


@dataclass(frozen=True, slots=True)
class BatchColumns:
    """What make_step_inputs reads from a batch's rows, read once per step (one pass of attribute reads
    per column), so that every fill is numpy over rows. sampling: the rows' SAMPLING_RECORDs."""

    requests: list[Request]
    starts: Int32[np.ndarray, " B"]
    q_lens: Int32[np.ndarray, " B"]
    generation_index: Int32[np.ndarray, " B"]
    samples: Bool[np.ndarray, " B"]
    input_pending: Bool[np.ndarray, " B"]
    sampling: np.ndarray

    @classmethod
    def read(cls, batch: ScheduledBatch, cache: StepInputsCache) -> BatchColumns:
        """The batch's columns, with the records `cache` keeps for its requests."""
        rows, n = batch.rows, len(batch.rows)
        requests = [row.request for row in rows]
        return cls(
            requests=requests,
            starts=np.fromiter([row.start for row in rows], dtype=np.int32, count=n),
            q_lens=np.fromiter([row.num_tokens for row in rows], dtype=np.int32, count=n),
            generation_index=np.fromiter([row.generation_index for row in rows], dtype=np.int32, count=n),
            samples=np.fromiter([row.samples for row in rows], dtype=np.bool_, count=n),
            input_pending=np.fromiter([row.input_pending for row in rows], dtype=np.bool_, count=n),
            sampling=np.frombuffer(b"".join(cache.sampling_records(requests)), dtype=SAMPLING_RECORD),
        )


@dataclass(frozen=True, slots=True)
class BuiltStep:
    """A step make_step_inputs built: its batch, the columns read from it, and its inputs, bucket and variant."""

    batch: ScheduledBatch
    columns: BatchColumns
    inputs: StepInputs
    bucket: Bucket
    variant: StepVariant


@dataclass(slots=True)
class StepInputsCache:
    """What make_step_inputs reuses from one step to the next; the engine holds one and only
    make_step_inputs writes it.

    records: each request's SAMPLING_RECORD, packed the first time it runs (its parameters and seed never
        change); those of finished requests are dropped when the table has doubled since the last sweep, so
        the work is constant per request, with no pass over every request in a step.
    last: the last step built, kept until the next one: the one in flight when the next is built.
    """

    records: dict[Request, bytes] = field(default_factory=dict)
    last: BuiltStep | None = None
    sweep_at: int = MIN_RECORD_SWEEP

    def sampling_records(self, requests: list[Request]) -> list[bytes]:
        """The requests' SAMPLING_RECORDs, packing those of requests that run for the first time."""
        records = list(map(self.records.get, requests))
        if None in records:
            records = [self._pack(r) if rec is None else rec for r, rec in zip(requests, records, strict=True)]
        return records

    def _pack(self, request: Request) -> bytes:
        if len(self.records) >= self.sweep_at:
            self.records = {r: record for r, record in self.records.items() if not r.is_finished}
            self.sweep_at = max(MIN_RECORD_SWEEP, 2 * len(self.records))
        values = _record_values(request.sampling_params, request.seed)
        self.records[request] = record = np.array([values], dtype=SAMPLING_RECORD).tobytes()
        return record


# ---- filling the arrays --------------------------------------------------------------------------


def _fill_flat_batch(inputs: StepInputs, batch: ScheduledBatch, columns: BatchColumns, buckets: BucketTable) -> None:
    """Tokens, positions, slots, sequence boundaries and block tables of the batch's rows."""
    q_lens, starts, n = columns.q_lens, columns.starts, len(columns.requests)
    num_real = int(q_lens.sum())
    inputs.cu_q_lens[1 : n + 1] = np.cumsum(q_lens)
    inputs.cu_q_lens[n + 1 :] = num_real
    inputs.kv_lens[:n] = starts + q_lens
    inputs.logits_indices[:n] = inputs.cu_q_lens[1 : n + 1] - 1
    inputs.num_seqs[()] = n

    row_of_token = np.repeat(np.arange(n), q_lens)
    positions = np.repeat(starts - inputs.cu_q_lens[:n], q_lens) + np.arange(num_real, dtype=np.int32)
    inputs.positions[:num_real] = positions
    groups = inputs.slot_mapping.shape[0]
    _fill_block_table(inputs.block_table, batch, inputs.kv_lens, buckets, groups)
    if groups == 1:
        block_of_token = inputs.block_table[row_of_token, positions // buckets.block_size][None]
    else:  # [G, T]: each group's page of each token's block
        entry = (positions // buckets.block_size)[None, :] * groups + np.arange(groups)[:, None]
        block_of_token = inputs.block_table[row_of_token[None, :], entry]
    inputs.slot_mapping[:, :num_real] = block_of_token * buckets.block_size + positions % buckets.block_size
    if num_real > np.count_nonzero(columns.input_pending):  # else every input is on the device (steady decode)
        _fill_token_ids(inputs.token_ids, batch, inputs.cu_q_lens[:n])


def _fill_token_ids(token_ids: np.ndarray, batch: ScheduledBatch, row_offsets: np.ndarray) -> None:
    """Host-known input tokens at their flat positions; pending ones (and padding) stay 0."""
    token_lists = [row.token_ids for row in batch.rows]
    known = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int32, count=int(known.sum()))
    known_offsets = np.cumsum(known) - known
    token_ids[np.repeat(row_offsets - known_offsets, known) + np.arange(flat.shape[0])] = flat


def _fill_block_table(
    table: np.ndarray, batch: ScheduledBatch, kv_lens: np.ndarray, buckets: BucketTable, groups: int = 1
) -> None:
    """Each row holds the pages (one per group) of the blocks covering its kv_len; the rest point at block 0."""
    rows = batch.rows
    n = len(rows)
    needed = -(-kv_lens[:n] // buckets.block_size) * groups
    block_arrays = [row.block_ids for row in rows]
    held = np.array([len(blocks) for blocks in block_arrays], dtype=np.int64)
    width = table.shape[1]
    short = np.flatnonzero((needed > width) | (needed > held))
    if short.size:
        i = int(short[0])
        request = rows[i].request
        raise ValueError(
            f"request {request.request_id}[{request.index}] needs {needed[i] // groups} blocks for "
            f"{kv_lens[i]} tokens; it holds {held[i] // groups}, a block table row {width // groups}"
        )
    # The rows' C-int arrays joined as bytes: no Python int is converted (np.fromiter over lists is an order
    # of magnitude slower; see docs/performance.md).
    flat = np.frombuffer(b"".join(block_arrays), dtype=np.intc)
    if (held > needed).any():  # blocks beyond a row's kv_len (held for a later step) stay out
        column = np.arange(flat.shape[0]) - np.repeat(np.cumsum(held) - held, held)
        flat = flat[column < np.repeat(needed, held)]
    # A boolean mask assigns in row-major order: each row's first `needed` columns, in list order.
    table[:n][np.arange(width) < needed[:, None]] = flat


def _fill_carried(inputs: StepInputs, columns: BatchColumns, previous_columns: BatchColumns | None) -> None:
    """Which rows take their last input token from the previous step's samples, and from which of its rows."""
    pending = np.flatnonzero(columns.input_pending)
    if not pending.size:
        return
    previous_requests = [] if previous_columns is None else previous_columns.requests
    requests = columns.requests
    waiting = requests if pending.size == len(requests) else [requests[b] for b in pending.tolist()]
    if waiting == previous_requests:  # steady decode: the previous step's rows, in order (compared by identity)
        sources = np.arange(len(waiting))
    else:
        row_of = dict(zip(previous_requests, range(len(previous_requests)), strict=False))
        found = list(map(row_of.get, waiting))
        sources = np.fromiter([-1 if s is None else s for s in found], dtype=np.int64, count=len(found))
    sampled = np.zeros(0, dtype=np.bool_) if previous_columns is None else previous_columns.samples
    missing = np.flatnonzero(~np.append(sampled, False)[sources])  # source -1 (not a previous row) reads False
    if missing.size:
        request = waiting[missing[0]]
        raise ValueError(
            f"request {request.request_id}[{request.index}] waits for a token the previous step did not sample"
        )
    inputs.carried_mask[pending] = True
    inputs.carried_source[pending] = sources


def _fill_banned(banned_tokens: np.ndarray, columns: BatchColumns) -> None:
    """EOS and stop ids a row may not sample yet (min_tokens)."""
    for b in np.flatnonzero(columns.generation_index < columns.sampling["min_tokens"]).tolist():
        request = columns.requests[b]
        ids = [*request.eos_token_ids, *request.sampling_params.stop_token_ids][:MAX_BANNED_TOKENS]
        banned_tokens[b, : len(ids)] = ids


def _fill_sampling(sampling: SamplingInputs, columns: BatchColumns) -> None:
    """The rows' sampling parameters over the neutral padding."""
    n = len(columns.requests)
    for f in fields(sampling):
        column = columns.generation_index if f.name == "generation_index" else columns.sampling[f.name]
        getattr(sampling, f.name)[:n] = column


def _fill_history(history: TokenHistory, columns: BatchColumns, carried_mask: np.ndarray) -> None:
    """Each row's known prompt and output tokens; a carried (pending) one's column, filled on the device."""
    n, history_len = len(columns.requests), history.token_ids.shape[1]
    token_lists = [request.token_ids for request in columns.requests]
    lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=n)
    known = np.minimum(columns.starts + columns.q_lens, lengths)
    too_long = np.flatnonzero(known > history_len)
    if too_long.size:
        raise ValueError(f"a token history of {history_len} cannot hold {known[too_long[0]]} tokens")
    if (known < lengths).any():  # a prompt chunk: its later prompt tokens are not inputs yet
        token_lists = [tokens[:k] for tokens, k in zip(token_lists, known.tolist(), strict=True)]
    # A boolean mask assigns in row-major order: each row's first `known` columns, in list order.
    history.token_ids[:n][np.arange(history_len) < known[:, None]] = np.fromiter(
        itertools.chain.from_iterable(token_lists), dtype=np.int32, count=int(known.sum())
    )
    history.num_prompt_tokens[:n] = [request.num_prompt_tokens for request in columns.requests]
    last_input = columns.starts + columns.q_lens - 1
    history.carried_column[:n] = np.where(carried_mask[:n], last_input, history.carried_column[:n])


def _fill_prompt_targets(
    targets: np.ndarray, batch: ScheduledBatch, columns: BatchColumns, cu_q_lens: np.ndarray
) -> None:
    """For each flat token of a scoring row, the prompt token after it (the logprob of prompt position
    p + 1 is read at position p) when that position is scored; NO_TARGET elsewhere."""
    for b in np.flatnonzero(columns.sampling["scores"]).tolist():
        row = batch.rows[b]
        if not row.is_prefill:
            continue
        request = row.request
        scored_start = request.sampling_params.scored_prompt_start
        positions = np.arange(row.start, row.start + row.num_tokens)
        follows = (positions + 1 < request.num_prompt_tokens) & (positions + 1 >= scored_start)
        prompt = np.asarray(request.prompt_token_ids, dtype=np.int32)
        offset = int(cu_q_lens[b])
        targets[offset : offset + row.num_tokens] = np.where(
            follows, prompt[np.minimum(positions + 1, len(prompt) - 1)], NO_TARGET
        )
