"""The bucket table: every step shape the runner compiles (T flat tokens, B sequence rows, the block table's
width) and the lookup that pads a step into the smallest one that holds it.

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

Host policy: no jax here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from jaxserve.config import CompileConfig, EngineConfig

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
