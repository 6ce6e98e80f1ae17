"""ScheduledBatch -> what one compiled step receives: the bucket table, the step variants, and
`StepInputs`, the flat token batch of DESIGN.md with the per-row sampling arrays and the per-step
extras, as numpy arrays padded to a bucket.

    inputs, bucket, variant = make_step_inputs(batch, previous, step_config)

`make_step_inputs` is the only place that builds StepInputs (`padding_inputs` declares every array's
shape, dtype and padding value once); the runner compiles one step per `StepConfig.compiled_steps()`
entry and runs `compiled[bucket, variant]`.

Bucket rules (they stand in for TensorRT-LLM's CUDA graph batch sizes):
- decode-only steps use T = B from the decode batch sizes: `generate_decode_batch_sizes` when the user
  gives none (coarser than TensorRT-LLM's CUDA graph sizes), then TensorRT-LLM's
  _filter_cuda_graph_batch_sizes (model_engine.py): sizes above min(max_batch_size, max_num_tokens)
  are dropped, and with padding the first one above that cap is replaced by the cap itself;
- mixed / prefill steps use T from the token buckets (powers of two from 16 up to max_num_tokens, plus
  max_num_tokens) with B = max_batch_size;
- a step is padded to the smallest bucket that holds it (bisect). Without padding a decode step whose
  size is not in the table runs in a mixed bucket. A step that fits no bucket is a bug: ValueError;
- each shape is also compiled for narrower block tables (`kv_block_buckets`, from
  CompileConfig.kv_len_buckets): a step's table is as wide as the smallest of them that holds its
  longest sequence, so attention that reads the whole table (the xla backend) costs what the batch
  holds, not max_seq_len. The width is chosen on the host: no compiled step has a data-dependent shape.

Padding tokens have token 0, position 0 and write their K/V to block 0 (reserved); padding rows own
no tokens (their cu_q_lens entries repeat the real token count) and have kv_len 0.

Host policy: no jax here (the runner and the sampler register these types as pytrees).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

import numpy as np
from jaxtyping import Bool, Float32, Int32, UInt32

from jaxserve.block_manager import RESERVED_BLOCK
from jaxserve.config import CompileConfig, EngineConfig
from jaxserve.request import Request
from jaxserve.sampling import SamplingParams
from jaxserve.scheduler import ScheduledBatch, ScheduledRow

# Smallest default token bucket: a shorter mixed step costs the same padded to 16, and every bucket
# costs a compilation at warmup.
MIN_TOKEN_BUCKET = 16
# Smallest default attention width on the xla backend: below it attention is a small part of a step.
MIN_KV_LEN_BUCKET = 256


def generate_decode_batch_sizes(max_batch_size: int, enable_padding: bool) -> list[int]:
    """Default decode batch sizes. With padding: powers of two up to 128, then every 64 up to 256, then
    every 128, and max_batch_size itself. Each size is an XLA compile of seconds (a CUDA graph capture
    takes milliseconds), so the table is coarser than TensorRT-LLM's (1, 2, 4, then every 8 up to 128,
    then every 64): a decode step costs about the same for any row count up to ~128 (it reads the weights
    once), and above that padding adds at most a third. Without padding (every size exact), TensorRT-LLM's
    table: 1 to 31, 32, 64, 128 and the powers of two below max_batch_size."""
    if enable_padding:
        sizes = [1, 2, 4, 8, 16, 32, 64, 128, 192, 256]
        while sizes[-1] + 128 <= max_batch_size:
            sizes.append(sizes[-1] + 128)
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


def kv_block_buckets(
    kv_len_buckets: tuple[int, ...] | None, attention_backend: str, max_seq_len: int, block_size: int
) -> tuple[int, ...]:
    """The narrower block-table widths (in blocks, each below the full width) of CompileConfig.kv_len_buckets;
    when it is None, powers of two tokens from MIN_KV_LEN_BUCKET on the xla backend and none otherwise."""
    if kv_len_buckets is None:
        if attention_backend != "xla":
            return ()
        kv_len_buckets = tuple(MIN_KV_LEN_BUCKET << i for i in range(max_seq_len.bit_length()))
    full = -(-max_seq_len // block_size)
    widths = {-(-n // block_size) for n in kv_len_buckets}
    return tuple(sorted(w for w in widths if w < full))


@dataclass(frozen=True, slots=True)
class Bucket:
    """One compiled step shape: T flat tokens, B sequence rows; decode_only buckets (T == B, one token per
    sequence) tell the attention so, which saves it a launch. kv_blocks: the width of its block table
    when narrower than the full one (None: max_blocks_per_seq), which bounds every sequence's kv_len."""

    num_tokens: int
    num_seqs: int
    decode_only: bool = False
    kv_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class BucketTable:
    """Every step shape the runner compiles at warmup, and the lookup that pads a step into one.

    The block table width (max_blocks_per_seq) and block_size belong here because they fix the
    shape of block_table and the slot mapping of every bucket; kv_block_buckets are the narrower widths
    every shape is also compiled for (sorted, each below max_blocks_per_seq; `kv_block_buckets()`).
    """

    decode_batch_sizes: tuple[int, ...]
    token_buckets: tuple[int, ...]
    max_batch_size: int
    enable_padding: bool
    block_size: int
    max_blocks_per_seq: int
    kv_block_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.token_buckets or list(self.token_buckets) != sorted(set(self.token_buckets)):
            raise ValueError(f"token_buckets must be sorted, unique and non-empty, got {self.token_buckets}")
        if list(self.decode_batch_sizes) != sorted(set(self.decode_batch_sizes)):
            raise ValueError(f"decode_batch_sizes must be sorted and unique, got {self.decode_batch_sizes}")
        if self.decode_batch_sizes and self.decode_batch_sizes[-1] > self.max_batch_size:
            raise ValueError(f"decode_batch_sizes exceed max_batch_size={self.max_batch_size}")
        widths = self.kv_block_buckets
        if list(widths) != sorted(set(widths)) or any(not 0 < w < self.max_blocks_per_seq for w in widths):
            raise ValueError(
                f"kv_block_buckets must be sorted, unique and in [1, {self.max_blocks_per_seq}), got {widths}"
            )

    @classmethod
    def from_config(cls, config: EngineConfig, attention_backend: str | None = None) -> BucketTable:
        """The table of an engine; attention_backend is the resolved one ("pallas" or "xla": None takes
        config.attention_backend, whose "auto" compiles the full block table width only)."""
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
            kv_block_buckets=kv_block_buckets(
                compile_config.kv_len_buckets,
                attention_backend or config.attention_backend,
                config.max_seq_len,
                config.kv_cache.block_size,
            ),
        )

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """All shapes to compile (decode buckets first; each at every width, the full one last), without
        duplicates."""
        shapes = [Bucket(size, size, decode_only=True) for size in self.decode_batch_sizes]
        shapes += [Bucket(t, self.max_batch_size) for t in self.token_buckets]
        widths = (*self.kv_block_buckets, None)
        return tuple(dict.fromkeys(replace(shape, kv_blocks=w) for shape in shapes for w in widths))

    def table_width(self, bucket: Bucket) -> int:
        """The number of block-table columns of a bucket's steps."""
        return self.max_blocks_per_seq if bucket.kv_blocks is None else bucket.kv_blocks

    def lookup(self, num_tokens: int, num_seqs: int, decode_only: bool, max_kv_len: int = 0) -> Bucket:
        """The smallest bucket that holds a step of num_tokens tokens over num_seqs sequences, the longest
        of which holds max_kv_len tokens after the step (0: the full block table width)."""
        shape = self._shape(num_tokens, num_seqs, decode_only)
        needed = -(-max_kv_len // self.block_size)
        i = bisect.bisect_left(self.kv_block_buckets, needed)
        if max_kv_len <= 0 or i == len(self.kv_block_buckets):
            return shape
        return replace(shape, kv_blocks=self.kv_block_buckets[i])

    def _shape(self, num_tokens: int, num_seqs: int, decode_only: bool) -> Bucket:
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


# ---- step variants ------------------------------------------------------------------------------

# EOS and stop ids a row may ban while it has fewer than min_tokens outputs.
MAX_BANNED_TOKENS = 8
NO_TARGET = -1  # a flat token whose next token is not a prompt token (or whose request wants no prompt logprobs)


class SamplerMode(Enum):
    """How the step's sampler cuts the filters (jaxserve/sampler.py): chosen per step on the host, so
    the device never branches."""

    GREEDY = "greedy"  # every row greedy, none asks for top logprobs: an argmax (and the tokens' logprobs)
    CANDIDATES = "candidates"  # filters from each row's NUM_CANDIDATES best logits
    SORTED = "sorted"  # filters from a sort of the whole vocabulary (top-p without a small top-k)


# Logits per row the CANDIDATES mode keeps: a top-k up to this many (Hugging Face's default is 50) and
# a top-p that comes with one need no sort of the vocabulary.
NUM_CANDIDATES = 64


@dataclass(frozen=True, slots=True)
class StepVariant:
    """The static choices of a step besides its shape, chosen per step on the host (`choose_variant`).
    The runner runs a step as one or two compiled calls: the forward, per (bucket, prompt_logprobs), which
    also samples greedily, and, unless the step is `greedy_in_forward`, the sampler, per (rows, sampler,
    penalties).

    sampler: how the sampler cuts the filters (`SamplerMode`); every mode returns the sampled tokens'
        logprobs, every mode but GREEDY the top logprobs too.
    penalties: the step receives each row's token history for the repetition / presence / frequency
        penalties.
    prompt_logprobs: the step also scores every flat token's next prompt token (token buckets only).
    """

    sampler: SamplerMode = SamplerMode.CANDIDATES
    penalties: bool = False
    prompt_logprobs: bool = False

    @property
    def greedy_in_forward(self) -> bool:
        """A GREEDY step without penalties takes the forward's own greedy sample: no sampler call."""
        return self.sampler is SamplerMode.GREEDY and not self.penalties

    def __str__(self) -> str:
        extras = [name for name in ("penalties", "prompt_logprobs") if getattr(self, name)]
        return "+".join([self.sampler.value, *extras])


def has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0


@dataclass(frozen=True, slots=True)
class StepConfig:
    """What fixes the compiled steps' inputs besides the model: the buckets, the variants compiled at
    warmup, and the padding ids. `forwards` and `samplers` enumerate what warmup compiles;
    `compiled_steps` the (bucket, variant) steps they serve, `largest_step` the capacity probe's.

    vocab_size: the out-of-vocabulary id that pads banned tokens and token histories.
    max_seq_len: the width of a token history.
    """

    buckets: BucketTable
    vocab_size: int
    max_seq_len: int
    penalty_variants: bool = False
    prompt_logprob_variants: bool = False

    @classmethod
    def from_config(cls, config: EngineConfig, vocab_size: int, attention_backend: str | None = None) -> StepConfig:
        compile_config = config.compile
        return cls(
            buckets=BucketTable.from_config(config, attention_backend),
            vocab_size=vocab_size,
            max_seq_len=config.max_seq_len,
            penalty_variants=compile_config.penalty_variants,
            prompt_logprob_variants=compile_config.prompt_logprobs,
        )

    def forwards(self) -> tuple[tuple[Bucket, bool], ...]:
        """Every (bucket, prompt_logprobs) forward compiled at warmup: prompt-logprobs forwards for token
        buckets when compiled."""
        scoring = (False, True) if self.prompt_logprob_variants else (False,)
        return tuple(
            (bucket, flag) for bucket in self.buckets.buckets for flag in scoring if not (flag and bucket.decode_only)
        )

    def samplers(self) -> tuple[tuple[int, SamplerMode, bool], ...]:
        """Every (rows, sampler mode, penalties) sampler compiled at warmup: one per row count of the
        buckets, sampler mode and penalty choice, but GREEDY without penalties, which the forwards do
        (`StepVariant.greedy_in_forward`)."""
        rows = sorted({bucket.num_seqs for bucket in self.buckets.buckets})
        penalties = (False, True) if self.penalty_variants else (False,)
        return tuple(
            (r, mode, p)
            for r, mode, p in itertools.product(rows, SamplerMode, penalties)
            if not StepVariant(mode, p).greedy_in_forward
        )

    def variants(self, bucket: Bucket) -> tuple[StepVariant, ...]:
        """Every variant a step of this bucket can run as."""
        scoring = {flag for b, flag in self.forwards() if b == bucket}
        samplers = [(SamplerMode.GREEDY, False)]  # the forward's own
        samplers += [(mode, p) for rows, mode, p in self.samplers() if rows == bucket.num_seqs]
        return tuple(StepVariant(mode, p, flag) for flag in sorted(scoring) for mode, p in samplers)

    def compiled_steps(self) -> tuple[tuple[Bucket, StepVariant], ...]:
        """Every (bucket, variant) the compiled forwards and samplers serve."""
        return tuple((bucket, variant) for bucket in self.buckets.buckets for variant in self.variants(bucket))

    def largest_step(self) -> tuple[Bucket, StepVariant]:
        """The step with the largest activations, which the capacity probe runs: the most tokens, then
        rows, a token bucket over a decode one; prompt logprobs and penalties when compiled, the sorting
        sampler."""
        table = self.buckets
        bucket = max(table.buckets, key=lambda b: (b.num_tokens, b.num_seqs, not b.decode_only, table.table_width(b)))
        scoring = self.prompt_logprob_variants and not bucket.decode_only
        return bucket, StepVariant(SamplerMode.SORTED, self.penalty_variants, scoring)

    def choose_variant(self, batch: ScheduledBatch, columns: BatchColumns) -> StepVariant:
        """The variant a batch needs: penalties or prompt logprobs when a row asks, and the cheapest
        sampler mode that is exact for every row (`columns`: the batch's, `BatchColumns.of`)."""
        records, samples = columns.sampling, columns.samples  # the logits of rows that do not sample are unused
        prompt_logprobs = any(_scores_prompt(batch.rows[b]) for b in np.flatnonzero(records["scores"]))
        penalties = bool((records["penalty"] & samples).any())
        return StepVariant(self._sampler_mode(records, samples), penalties, prompt_logprobs)

    def sampler_mode(self, params: list[SamplingParams]) -> SamplerMode:
        """GREEDY when every row is greedy and none wants top logprobs (the sampled token's own logprob,
        `logprobs=0` or `token_logprobs`, comes with every mode); CANDIDATES when every sampling row's
        filters fit NUM_CANDIDATES logits; else SORTED."""
        records = np.array([_record_values(p, None) for p in params], dtype=SAMPLING_RECORD)
        return self._sampler_mode(records, np.ones(len(records), dtype=np.bool_))

    def _sampler_mode(self, records: np.ndarray, samples: np.ndarray) -> SamplerMode:
        """sampler_mode over the SAMPLING_RECORDs of the rows where `samples` (masks over the fields, not a
        copy of the records: selecting rows of a structured array costs ~0.1 ms at 1024 rows)."""
        sampling = samples & ~records["greedy"]
        if not sampling.any() and not (samples & records["top_logprobs"]).any():
            return SamplerMode.GREEDY
        top_k = records["top_k"]  # 0: no top-k; one of the vocabulary's size or more is none either
        limited = (top_k > 0) & (top_k < self.vocab_size)
        # Without a top-k, min-p alone needs only the maximum; a top-p below 1 needs the whole mass.
        fits = np.where(limited, top_k <= NUM_CANDIDATES, ~records["partial_top_p"])
        return SamplerMode.CANDIDATES if fits[sampling].all() else SamplerMode.SORTED

    def check_supported(self, params: SamplingParams, num_eos_tokens: int) -> None:
        """Raises a ValueError naming the knob when a request needs a variant this engine does not compile."""
        if params.prompt_logprobs is not None and not self.prompt_logprob_variants:
            raise ValueError("prompt_logprobs needs CompileConfig(prompt_logprobs=True) at engine start")
        if has_penalty(params) and not self.penalty_variants:
            raise ValueError(
                "repetition/presence/frequency penalties need CompileConfig(penalty_variants=True) at engine start"
            )
        if params.min_tokens and num_eos_tokens + len(params.stop_token_ids) > MAX_BANNED_TOKENS:
            raise ValueError(
                f"min_tokens can hold back at most {MAX_BANNED_TOKENS} EOS / stop token ids; "
                f"got {num_eos_tokens + len(params.stop_token_ids)}"
            )


# ---- step inputs --------------------------------------------------------------------------------


def _column(dtype: type[np.generic], neutral: float) -> Any:
    """A per-row sampling column: its dtype and the value that switches its feature off (padding rows)."""
    return field(metadata={"dtype": dtype, "neutral": neutral})


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


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Everything one compiled step receives besides the weights, the KV cache and the device state
    (DESIGN.md "Flat token batch"): numpy on the host, the same type (as a pytree) inside the step.

    carried_mask / carried_source: row b's last input token is the previous step's sample of row
        carried_source[b] (overlap); the step writes it into token_ids[logits_indices[b]].
    banned_tokens: ids row b may not sample this step (min_tokens), padded with the vocabulary size.
    history / prompt_targets: present exactly in the penalties / prompt-logprobs variants.
    """

    token_ids: Int32[np.ndarray, " T"]
    positions: Int32[np.ndarray, " T"]
    slot_mapping: Int32[np.ndarray, " T"]
    cu_q_lens: Int32[np.ndarray, " B+1"]
    kv_lens: Int32[np.ndarray, " B"]
    block_table: Int32[np.ndarray, "B M"]
    logits_indices: Int32[np.ndarray, " B"]
    num_seqs: Int32[np.ndarray, ""]
    carried_mask: Bool[np.ndarray, " B"]
    carried_source: Int32[np.ndarray, " B"]
    banned_tokens: Int32[np.ndarray, "B NB"]
    sampling: SamplingInputs
    history: TokenHistory | None = None
    prompt_targets: Int32[np.ndarray, " T"] | None = None


def padding_inputs(bucket: Bucket, variant: StepVariant, config: StepConfig) -> StepInputs:
    """An all-padding step of one compiled shape: the one declaration of every input's shape, dtype and
    padding value. make_step_inputs fills one in; the runner compiles for its shapes and the capacity
    probe runs it as it is.

    Padding tokens have token 0, position 0 and write their K/V to block 0 (reserved); padding rows
    own no tokens and have kv_len 0.
    """
    T, B, M = bucket.num_tokens, bucket.num_seqs, config.buckets.table_width(bucket)

    def ints(shape: int | tuple[int, ...], value: int = 0) -> np.ndarray:
        return np.full(shape, value, dtype=np.int32)

    S = config.max_seq_len
    history = TokenHistory(ints((B, S), config.vocab_size), ints(B), ints(B, S)) if variant.penalties else None
    return StepInputs(
        token_ids=ints(T),
        positions=ints(T),
        slot_mapping=ints(T, RESERVED_BLOCK * config.buckets.block_size),
        cu_q_lens=ints(B + 1),
        kv_lens=ints(B),
        block_table=ints((B, M), RESERVED_BLOCK),
        logits_indices=ints(B),
        num_seqs=ints(()),
        carried_mask=np.zeros(B, dtype=np.bool_),
        carried_source=ints(B),
        banned_tokens=ints((B, MAX_BANNED_TOKENS), config.vocab_size),
        sampling=SamplingInputs.neutral(B),
        history=history,
        prompt_targets=ints(T, NO_TARGET) if variant.prompt_logprobs else None,
    )


def make_step_inputs(
    batch: ScheduledBatch, previous: ScheduledBatch | None, config: StepConfig
) -> tuple[StepInputs, Bucket, StepVariant]:
    """The one place a step's inputs are built: the batch's rows packed token-major into the smallest
    bucket that holds them, for the variant they need. `previous` is the step still in flight, whose
    samples are this step's pending input tokens. The result is kept on the batch (`ScheduledBatch.step`):
    a steady decode step, the previous one's rows one token further, is built from it (`_advanced`)."""
    if not batch.rows:
        raise ValueError("cannot build step inputs for an empty batch")
    columns = BatchColumns.of(batch)
    advanced = None if previous is None or previous.step is None else _advanced(batch, columns, previous, config)
    batch.step = advanced or _built(batch, columns, previous, config)
    return batch.step


def _built(
    batch: ScheduledBatch, columns: BatchColumns, previous: ScheduledBatch | None, config: StepConfig
) -> tuple[StepInputs, Bucket, StepVariant]:
    """The step's inputs filled in over an all-padding step of its bucket."""
    kv_lens = columns.starts + columns.q_lens
    bucket = config.buckets.lookup(int(columns.q_lens.sum()), len(batch.rows), batch.is_decode_only, int(kv_lens.max()))
    variant = config.choose_variant(batch, columns)
    inputs = padding_inputs(bucket, variant, config)
    _fill_flat_batch(inputs, batch, columns, config.buckets)
    _fill_carried(inputs, columns, previous)
    _fill_banned(inputs.banned_tokens, columns)
    _fill_sampling(inputs.sampling, columns)
    if inputs.history is not None:
        _fill_history(inputs.history, columns, inputs.carried_mask)
    if inputs.prompt_targets is not None:
        _fill_prompt_targets(inputs.prompt_targets, batch, columns, inputs.cu_q_lens)
    return inputs, bucket, variant


def _advanced(
    batch: ScheduledBatch, columns: BatchColumns, previous: ScheduledBatch, config: StepConfig
) -> tuple[StepInputs, Bucket, StepVariant] | None:
    """Steady decode: every row is the previous step's row of the same request, in the same order, one
    token further, with that step's sample as its input. Then the bucket and variant are the previous
    step's (the same requests' records, every row sampling; no token history: the penalties variant is
    built in full) and so are most inputs; what moves is computed from the previous step's arrays:
    positions, kv_lens, slots, the block table's entries for rows that enter a new block, the banned ids
    and generation_index. None when the batch is anything else (then `_built` makes it, with its errors).
    tests/engine/test_inputs.py checks that both give the same inputs over a scheduler's steps."""
    previous_inputs, bucket, variant = previous.step
    before, n = BatchColumns.of(previous), len(columns.requests)
    if (
        variant.penalties
        or variant.prompt_logprobs
        or not (batch.is_decode_only and previous.is_decode_only and n == len(before.requests))
        or not ((columns.q_lens == 1).all() and (before.q_lens == 1).all())
        or not (columns.input_pending.all() and columns.samples.all() and before.samples.all())
        or not np.array_equal(columns.starts, before.starts + 1)
        or columns.requests != before.requests  # by identity (Request has no __eq__)
    ):
        return None
    starts, block_size = columns.starts, config.buckets.block_size
    if config.buckets.lookup(n, n, True, int(starts.max()) + 1) != bucket:
        return None
    table = previous_inputs.block_table
    entering = np.flatnonzero(starts % block_size == 0)  # their new token is the first of a block
    if entering.size:
        index = starts[entering] // block_size
        blocks = [batch.rows[b].block_ids for b in entering.tolist()]
        if (index >= table.shape[1]).any() or (index >= [len(ids) for ids in blocks]).any():
            return None  # a row without its next block: `_built` says which
        table = table.copy()
        table[entering, index] = [ids[k] for ids, k in zip(blocks, index.tolist(), strict=True)]
    positions, kv_lens, slots = (
        a.copy() for a in (previous_inputs.positions, previous_inputs.kv_lens, previous_inputs.slot_mapping)
    )
    positions[:n] = starts
    kv_lens[:n] = starts + 1
    slots[:n] = table[np.arange(n), starts // block_size] * block_size + starts % block_size
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
# facts its step's variant and banned ids read, as one record: packed once per request (`sampling_record`),
# so that a step gathers its rows' records with one bytes join.
SAMPLING_RECORD = np.dtype(
    [
        *((f.name, f.metadata["dtype"]) for f in fields(SamplingInputs) if f.name != "generation_index"),
        ("min_tokens", np.int32),
        ("greedy", np.bool_),
        ("penalty", np.bool_),
        ("top_logprobs", np.bool_),
        ("partial_top_p", np.bool_),  # top_p < 1, compared in double precision as SamplingParams holds it
        ("scores", np.bool_),  # asks for prompt logprobs (whether a chunk scores one is per row)
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
        params.is_greedy,
        has_penalty(params),
        bool(params.logprobs),
        params.top_p < 1.0,
        params.scored_prompt_start is not None,
    )


def sampling_record(request: Request) -> bytes:
    """The request's SAMPLING_RECORD, packed once and kept on the request."""
    if request.sampling_record is None:
        values = _record_values(request.sampling_params, request.seed)
        request.sampling_record = np.array([values], dtype=SAMPLING_RECORD).tobytes()
    return request.sampling_record


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
    def of(cls, batch: ScheduledBatch) -> BatchColumns:
        """The batch's columns, read on the first call and kept on the batch (`ScheduledBatch.columns`)."""
        if batch.columns is None:
            batch.columns = cls._read(batch)
        return batch.columns

    @classmethod
    def _read(cls, batch: ScheduledBatch) -> BatchColumns:
        rows, n = batch.rows, len(batch.rows)
        requests = [row.request for row in rows]
        records = [request.sampling_record for request in requests]
        if None in records:  # requests running for the first time
            records = list(map(sampling_record, requests))
        return cls(
            requests=requests,
            starts=np.fromiter([row.start for row in rows], dtype=np.int32, count=n),
            q_lens=np.fromiter([row.num_tokens for row in rows], dtype=np.int32, count=n),
            generation_index=np.fromiter([row.generation_index for row in rows], dtype=np.int32, count=n),
            samples=np.fromiter([row.samples for row in rows], dtype=np.bool_, count=n),
            input_pending=np.fromiter([row.input_pending for row in rows], dtype=np.bool_, count=n),
            sampling=np.frombuffer(b"".join(records), dtype=SAMPLING_RECORD),
        )


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
    _fill_block_table(inputs.block_table, batch, inputs.kv_lens, buckets)
    block_of_token = inputs.block_table[row_of_token, positions // buckets.block_size]
    inputs.slot_mapping[:num_real] = block_of_token * buckets.block_size + positions % buckets.block_size
    if num_real > np.count_nonzero(columns.input_pending):  # else every input is on the device (steady decode)
        _fill_token_ids(inputs.token_ids, batch, inputs.cu_q_lens[:n])


def _fill_token_ids(token_ids: np.ndarray, batch: ScheduledBatch, row_offsets: np.ndarray) -> None:
    """Host-known input tokens at their flat positions; pending ones (and padding) stay 0."""
    token_lists = [row.token_ids for row in batch.rows]
    known = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int32, count=int(known.sum()))
    known_offsets = np.cumsum(known) - known
    token_ids[np.repeat(row_offsets - known_offsets, known) + np.arange(flat.shape[0])] = flat


def _fill_block_table(table: np.ndarray, batch: ScheduledBatch, kv_lens: np.ndarray, buckets: BucketTable) -> None:
    """Each row holds the blocks covering its kv_len; the rest point at block 0."""
    rows = batch.rows
    n = len(rows)
    needed = -(-kv_lens[:n] // buckets.block_size)
    block_arrays = [row.block_ids for row in rows]
    held = np.array([len(blocks) for blocks in block_arrays], dtype=np.int64)
    width = table.shape[1]
    short = np.flatnonzero((needed > width) | (needed > held))
    if short.size:
        i = int(short[0])
        request = rows[i].request
        raise ValueError(
            f"request {request.request_id}[{request.index}] needs {needed[i]} blocks for "
            f"{kv_lens[i]} tokens; it holds {held[i]}, a block table row {width}"
        )
    # The rows' C-int arrays joined as bytes: no Python int is converted (~15 us for 13 k ids, against
    # ~230 us for np.fromiter over lists).
    flat = np.frombuffer(b"".join(block_arrays), dtype=np.intc)
    if (held > needed).any():  # blocks beyond a row's kv_len (held for a later step) stay out
        column = np.arange(flat.shape[0]) - np.repeat(np.cumsum(held) - held, held)
        flat = flat[column < np.repeat(needed, held)]
    # A boolean mask assigns in row-major order: each row's first `needed` columns, in list order.
    table[:n][np.arange(width) < needed[:, None]] = flat


def _fill_carried(inputs: StepInputs, columns: BatchColumns, previous: ScheduledBatch | None) -> None:
    """Which rows take their last input token from `previous`'s samples, and from which of its rows."""
    pending = np.flatnonzero(columns.input_pending)
    if not pending.size:
        return
    previous_columns = None if previous is None else BatchColumns.of(previous)
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


def _scores_prompt(row: ScheduledRow) -> bool:
    """Whether the row's chunk scores a prompt position: it holds a token at or after scored start - 1."""
    scored_start = row.request.sampling_params.scored_prompt_start
    return row.is_prefill and scored_start is not None and row.start + row.num_tokens >= scored_start


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
