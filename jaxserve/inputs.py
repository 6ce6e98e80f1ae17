"""ScheduledBatch -> the step function's inputs: the flat token batch of DESIGN.md as numpy int32
arrays padded to a bucket, the per-row sampling arrays, and the bucket table itself.

Bucket rules (they stand in for the seed's CUDA graph batch sizes):
- decode-only steps use T = B from the decode batch sizes: CudaGraphConfig._generate_cuda_graph_batch_sizes
  when the user gives none, then _filter_cuda_graph_batch_sizes (model_engine.py): sizes above
  min(max_batch_size, max_num_tokens) are dropped, and with padding the first one above that cap is
  replaced by the cap itself;
- mixed / prefill steps use T from the token buckets (powers of two from 16 up to max_num_tokens, plus
  max_num_tokens) with B = max_batch_size;
- a step is padded to the smallest bucket that holds it (bisect). Without padding a decode step whose
  size is not in the table runs in a mixed bucket. A step that fits no bucket is a bug: ValueError.

Padding tokens have token 0, position 0 and write their K/V to block 0 (reserved); padding rows own
no tokens (their cu_q_lens entries repeat the real token count) and have kv_len 0.

Host policy: no jax here.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import numpy as np
from jaxtyping import Bool, Float32, Int32, UInt32

from jaxserve.block_manager import RESERVED_BLOCK
from jaxserve.config import CompileConfig, EngineConfig
from jaxserve.scheduler import ScheduledBatch

# Smallest default token bucket: a shorter mixed step costs the same padded to 16, and every bucket
# costs a compilation at warmup.
MIN_TOKEN_BUCKET = 16


def generate_decode_batch_sizes(max_batch_size: int, enable_padding: bool) -> list[int]:
    """Default decode batch sizes; mirrors CudaGraphConfig._generate_cuda_graph_batch_sizes."""
    if enable_padding:
        sizes = [1, 2, 4] + [8 * i for i in range(1, 17)]
        while sizes[-1] + 64 <= max_batch_size:
            sizes.append(sizes[-1] + 64)
    else:
        ceil_log2 = (max_batch_size - 1).bit_length()
        sizes = list(range(1, 32)) + [32, 64, 128] + [2**i for i in range(8, ceil_log2)]
    sizes = sorted(size for size in set(sizes) if size <= max_batch_size)
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def filter_decode_batch_sizes(
    sizes: tuple[int, ...] | list[int], max_batch_size: int, max_num_tokens: int, enable_padding: bool
) -> list[int]:
    """Caps sorted decode batch sizes at what a decode step can hold; mirrors _filter_cuda_graph_batch_sizes.

    With padding, the first size above the cap is replaced by the cap: a user who accepts padding to a
    size B accepts padding to a smaller one.
    """
    cap = min(max_batch_size, max_num_tokens)
    kept: list[int] = []
    for size in sorted(sizes):
        if size <= cap:
            kept.append(size)
            continue
        if enable_padding and (not kept or kept[-1] != cap):
            kept.append(cap)
        break
    return kept


def default_token_buckets(max_num_tokens: int) -> list[int]:
    """Powers of two from MIN_TOKEN_BUCKET below max_num_tokens, then max_num_tokens itself."""
    buckets = []
    size = MIN_TOKEN_BUCKET
    while size < max_num_tokens:
        buckets.append(size)
        size *= 2
    return buckets + [max_num_tokens]


@dataclass(frozen=True, slots=True)
class Bucket:
    """One compiled step shape: T flat tokens, B sequence rows; decode_only buckets (T == B, one token per
    sequence) tell the attention so, which saves it a launch."""

    num_tokens: int
    num_seqs: int
    decode_only: bool = False


@dataclass(frozen=True, slots=True)
class BucketTable:
    """Every step shape the runner compiles at warmup, and the lookup that pads a step into one.

    The block table width (max_blocks_per_seq) and block_size belong here because they fix the
    shape of block_table and the slot mapping of every bucket.
    """

    decode_batch_sizes: tuple[int, ...]
    token_buckets: tuple[int, ...]
    max_batch_size: int
    enable_padding: bool
    block_size: int
    max_blocks_per_seq: int

    def __post_init__(self) -> None:
        if not self.token_buckets or list(self.token_buckets) != sorted(set(self.token_buckets)):
            raise ValueError(f"token_buckets must be sorted, unique and non-empty, got {self.token_buckets}")
        if list(self.decode_batch_sizes) != sorted(set(self.decode_batch_sizes)):
            raise ValueError(f"decode_batch_sizes must be sorted and unique, got {self.decode_batch_sizes}")
        if self.decode_batch_sizes and self.decode_batch_sizes[-1] > self.max_batch_size:
            raise ValueError(f"decode_batch_sizes exceed max_batch_size={self.max_batch_size}")

    @classmethod
    def from_config(cls, config: EngineConfig) -> BucketTable:
        compile_config: CompileConfig = config.compile
        padding = compile_config.enable_padding
        decode = compile_config.decode_batch_sizes
        if decode is None:
            decode = tuple(generate_decode_batch_sizes(config.max_batch_size, padding))
        decode = filter_decode_batch_sizes(decode, config.max_batch_size, config.max_num_tokens, padding)
        tokens = compile_config.token_buckets
        if tokens is None:
            tokens = tuple(default_token_buckets(config.max_num_tokens))
        tokens = sorted({t for t in tokens if t < config.max_num_tokens} | {config.max_num_tokens})
        return cls(
            decode_batch_sizes=tuple(decode),
            token_buckets=tuple(tokens),
            max_batch_size=config.max_batch_size,
            enable_padding=padding,
            block_size=config.kv_cache.block_size,
            max_blocks_per_seq=config.max_blocks_per_seq,
        )

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """All shapes to compile at warmup (decode buckets first), without duplicates."""
        shapes = [Bucket(size, size, decode_only=True) for size in self.decode_batch_sizes]
        shapes += [Bucket(t, self.max_batch_size) for t in self.token_buckets]
        return tuple(dict.fromkeys(shapes))

    def lookup(self, num_tokens: int, num_seqs: int, decode_only: bool) -> Bucket:
        """The smallest bucket that holds a step of num_tokens tokens over num_seqs sequences."""
        if (
            num_seqs < 1
            or num_seqs > self.max_batch_size
            or num_tokens < num_seqs
            or num_tokens > self.token_buckets[-1]
        ):
            raise ValueError(
                f"a step of {num_tokens} tokens over {num_seqs} sequences fits no compiled bucket "
                f"(max_num_tokens={self.token_buckets[-1]}, max_batch_size={self.max_batch_size})"
            )
        if decode_only and num_tokens == num_seqs:
            i = bisect.bisect_left(self.decode_batch_sizes, num_seqs)
            if i < len(self.decode_batch_sizes):
                size = self.decode_batch_sizes[i]
                if self.enable_padding or size == num_seqs:
                    return Bucket(size, size, decode_only=True)
        return Bucket(self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)], self.max_batch_size)


@dataclass(frozen=True, slots=True)
class StepInputs:
    """The flat token batch of one step (DESIGN.md "Flat token batch"), numpy int32, padded to a bucket."""

    token_ids: Int32[np.ndarray, " T"]
    positions: Int32[np.ndarray, " T"]
    slot_mapping: Int32[np.ndarray, " T"]
    cu_q_lens: Int32[np.ndarray, " B+1"]
    kv_lens: Int32[np.ndarray, " B"]
    block_table: Int32[np.ndarray, "B M"]
    logits_indices: Int32[np.ndarray, " B"]
    num_seqs: Int32[np.ndarray, ""]
    bucket: Bucket  # the compiled shape these arrays are padded to

    def arrays(self) -> dict[str, np.ndarray]:
        """Field name -> array, in declaration order (for moving them to the device)."""
        return {name: getattr(self, name) for name in self.__slots__ if name != "bucket"}


def make_step_inputs(batch: ScheduledBatch, buckets: BucketTable) -> StepInputs:
    """Packs the batch's rows token-major into the smallest bucket that holds them."""
    rows = batch.rows
    if not rows:
        raise ValueError("cannot build step inputs for an empty batch")
    n = len(rows)
    q_lens = np.fromiter((row.num_tokens for row in rows), dtype=np.int32, count=n)
    starts = np.fromiter((row.start for row in rows), dtype=np.int32, count=n)
    num_real = int(q_lens.sum())
    bucket = buckets.lookup(num_real, n, batch.is_decode_only)

    cu_q_lens = np.full(bucket.num_seqs + 1, num_real, dtype=np.int32)
    cu_q_lens[0] = 0
    cu_q_lens[1 : n + 1] = np.cumsum(q_lens)
    kv_lens = np.zeros(bucket.num_seqs, dtype=np.int32)
    kv_lens[:n] = starts + q_lens
    logits_indices = np.zeros(bucket.num_seqs, dtype=np.int32)
    logits_indices[:n] = cu_q_lens[1 : n + 1] - 1

    row_of_token = np.repeat(np.arange(n), q_lens)
    real_positions = np.repeat(starts - cu_q_lens[:n], q_lens) + np.arange(num_real, dtype=np.int32)
    positions = np.zeros(bucket.num_tokens, dtype=np.int32)
    positions[:num_real] = real_positions

    block_table = _block_table(batch, buckets, bucket.num_seqs, kv_lens)
    slot_mapping = np.full(bucket.num_tokens, RESERVED_BLOCK * buckets.block_size, dtype=np.int32)
    block_of_token = block_table[row_of_token, real_positions // buckets.block_size]
    slot_mapping[:num_real] = block_of_token * buckets.block_size + real_positions % buckets.block_size

    return StepInputs(
        token_ids=_token_ids(batch, bucket.num_tokens, cu_q_lens[:n]),
        positions=positions,
        slot_mapping=slot_mapping,
        cu_q_lens=cu_q_lens,
        kv_lens=kv_lens,
        block_table=block_table,
        logits_indices=logits_indices,
        num_seqs=np.array(n, dtype=np.int32),
        bucket=bucket,
    )


NO_TARGET = -1  # a flat token whose next token is not a prompt token (or whose request wants no prompt logprobs)


def make_prompt_targets(batch: ScheduledBatch, num_tokens: int) -> np.ndarray:
    """For each flat token of the step, the prompt token that follows it when its request asked for prompt
    logprobs (the logprob of prompt position p + 1 is read at position p), else NO_TARGET."""
    targets = np.full(num_tokens, NO_TARGET, dtype=np.int32)
    offset = 0
    for row in batch.rows:
        request = row.request
        if row.is_prefill and request.sampling_params.prompt_logprobs is not None:
            positions = np.arange(row.start, row.start + row.num_tokens)
            follows = positions + 1 < request.num_prompt_tokens
            prompt = np.asarray(request.prompt_token_ids, dtype=np.int32)
            targets[offset : offset + row.num_tokens] = np.where(
                follows, prompt[np.minimum(positions + 1, len(prompt) - 1)], NO_TARGET
            )
        offset += row.num_tokens
    return targets


def _token_ids(batch: ScheduledBatch, num_tokens: int, row_offsets: np.ndarray) -> np.ndarray:
    """Host-known input tokens at their flat positions; pending ones (and padding) stay 0."""
    rows = batch.rows
    known = np.fromiter((len(row.token_ids) for row in rows), dtype=np.int32, count=len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(row.token_ids for row in rows), dtype=np.int32)
    known_offsets = np.cumsum(known) - known
    destinations = np.repeat(row_offsets - known_offsets, known) + np.arange(flat.shape[0], dtype=np.int32)
    token_ids = np.zeros(num_tokens, dtype=np.int32)
    token_ids[destinations] = flat
    return token_ids


def _block_table(batch: ScheduledBatch, buckets: BucketTable, num_rows: int, kv_lens: np.ndarray) -> np.ndarray:
    """[B, M] block ids; each row holds the blocks covering its kv_len, the rest point at block 0."""
    table = np.full((num_rows, buckets.max_blocks_per_seq), RESERVED_BLOCK, dtype=np.int32)
    for i, row in enumerate(batch.rows):
        num_blocks = -(-int(kv_lens[i]) // buckets.block_size)
        if num_blocks > buckets.max_blocks_per_seq or num_blocks > len(row.block_ids):
            raise ValueError(
                f"request {row.request.request_id}[{row.request.index}] needs {num_blocks} blocks for "
                f"{kv_lens[i]} tokens; it holds {len(row.block_ids)}, a block table row {buckets.max_blocks_per_seq}"
            )
        table[i, :num_blocks] = row.block_ids[:num_blocks]
    return table


@dataclass(frozen=True, slots=True)
class SamplingInputs:
    """Per-row sampling parameters of one step, padded to B rows with neutral (greedy) values.

    The fields are those of `sampler.SamplingTensors` (build it with
    `SamplingTensors.from_arrays(**inputs.arrays())`). A row is greedy when its temperature is below
    1e-5 or its top_k is 1; top_k 0 means no top-k limit. seed is meaningful where has_seed.
    generation_index is the index among its sequence's outputs of the token the row samples: with
    the seed it keys the row's PRNG, so a seeded sequence samples the same tokens whatever else
    shares its batch (and again after a preemption).
    """

    temperature: Float32[np.ndarray, " B"]
    top_k: Int32[np.ndarray, " B"]
    top_p: Float32[np.ndarray, " B"]
    min_p: Float32[np.ndarray, " B"]
    repetition_penalty: Float32[np.ndarray, " B"]
    presence_penalty: Float32[np.ndarray, " B"]
    frequency_penalty: Float32[np.ndarray, " B"]
    seed: UInt32[np.ndarray, " B"]
    has_seed: Bool[np.ndarray, " B"]
    generation_index: Int32[np.ndarray, " B"]

    def arrays(self) -> dict[str, np.ndarray]:
        """Field name -> array, in declaration order."""
        return {name: getattr(self, name) for name in self.__slots__}


def make_sampling_inputs(batch: ScheduledBatch, num_rows: int) -> SamplingInputs:
    """The sampling arrays of the batch's rows, padded to num_rows (the bucket's B) with neutral rows."""
    n = len(batch.rows)
    if n > num_rows:
        raise ValueError(f"{n} rows do not fit in {num_rows}")
    params = [row.request.sampling_params for row in batch.rows]
    seeds = [row.request.seed for row in batch.rows]

    def column(values: list, dtype: type, pad: float | int | bool) -> np.ndarray:
        out = np.full(num_rows, pad, dtype=dtype)
        out[:n] = values
        return out

    return SamplingInputs(
        temperature=column([p.temperature for p in params], np.float32, 0.0),
        top_k=column([p.top_k or 0 for p in params], np.int32, 0),
        top_p=column([p.top_p for p in params], np.float32, 1.0),
        min_p=column([p.min_p for p in params], np.float32, 0.0),
        repetition_penalty=column([p.repetition_penalty for p in params], np.float32, 1.0),
        presence_penalty=column([p.presence_penalty for p in params], np.float32, 0.0),
        frequency_penalty=column([p.frequency_penalty for p in params], np.float32, 0.0),
        seed=column([s or 0 for s in seeds], np.uint32, 0),
        has_seed=column([s is not None for s in seeds], np.bool_, False),
        generation_index=column([row.generation_index for row in batch.rows], np.int32, 0),
    )


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """Each row's prompt then output tokens, for the repetition / presence / frequency penalties.

    token_ids is padded with pad_id (the sampler's out-of-vocabulary sentinel). A row whose last input
    token is still on the device (overlap) has pad_id at that position, positions[logits_indices[b]];
    the engine fills it with the carried token like token_ids.
    """

    token_ids: Int32[np.ndarray, "B S"]
    num_prompt_tokens: Int32[np.ndarray, " B"]


def make_token_history(batch: ScheduledBatch, num_rows: int, history_len: int, pad_id: int) -> TokenHistory:
    """The [num_rows, history_len] token history of the batch's rows (history_len >= max_seq_len)."""
    token_ids = np.full((num_rows, history_len), pad_id, dtype=np.int32)
    num_prompt_tokens = np.zeros(num_rows, dtype=np.int32)
    for b, row in enumerate(batch.rows):
        request = row.request
        known = request.token_ids[: min(row.start + row.num_tokens, len(request.token_ids))]
        if len(known) > history_len:
            raise ValueError(f"a token history of {history_len} cannot hold {len(known)} tokens")
        token_ids[b, : len(known)] = known
        num_prompt_tokens[b] = request.num_prompt_tokens
    return TokenHistory(token_ids=token_ids, num_prompt_tokens=num_prompt_tokens)


@dataclass(frozen=True, slots=True)
class CarriedTokens:
    """Input tokens still on the device (overlap): row b's last input is the previous step's sample.

    Where mask[b], the engine writes previous_sampled[source_row[b]] into token_ids[logits_indices[b]]
    on the device; elsewhere source_row is 0 and ignored.
    """

    mask: Bool[np.ndarray, " B"]
    source_row: Int32[np.ndarray, " B"]


def carried_tokens(batch: ScheduledBatch, previous: ScheduledBatch | None, num_rows: int) -> CarriedTokens:
    """Which rows of `batch` take their last input token from `previous`'s sampled tokens, and from which row."""
    mask = np.zeros(num_rows, dtype=np.bool_)
    source_row = np.zeros(num_rows, dtype=np.int32)
    sampling_rows = {} if previous is None else {id(r.request): i for i, r in enumerate(previous.rows) if r.samples}
    for b, row in enumerate(batch.rows):
        if not row.input_pending:
            continue
        source = sampling_rows.get(id(row.request))
        if source is None:
            raise ValueError(
                f"request {row.request.request_id}[{row.request.index}] waits for a token the previous step "
                "did not sample"
            )
        mask[b] = True
        source_row[b] = source
    return CarriedTokens(mask=mask, source_row=source_row)
