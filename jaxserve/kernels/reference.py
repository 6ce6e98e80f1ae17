"""Pure-jnp references of the kernels: `ragged_paged_attention_reference`, `write_kv_reference` and
`rope_write_kv_reference`.

They have the kernels' signatures and semantics (docs/architecture.md, "One step" and "KV layout and
capacity") and serve as the `attention_backend="xla"` path and as the tests' oracle. Attention is
computed in float32 for each chunk of one sequence's query rows over the whole block-table width of that sequence
(one gather of its K/V a chunk), masked to each row's causal (and window) range; the chunks are processed in
batches so the gathered keys stay within a fixed memory budget. The
rope reference is the model's own code (`jaxserve.models.common.split_qkv` and `apply_rope`), so the kernel is
held to what a layer computed before it existed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from jaxserve.models.common import apply_rope, split_qkv

from .checks import check_attention_inputs, check_options, check_rope_write_inputs, check_write_inputs
from .tuning import check_tuning_keys


def _elements_per_batch() -> int:
    """Gathered K elements per batch of query chunks: bounds the reference's memory (small on CPU)."""
    return 1 << (26 if jax.default_backend() == "gpu" else 22)


def _query_chunk(num_tokens: int, max_seqs: int, max_q_len: int | None) -> int:
    """Query rows per chunk (static): each chunk's rows belong to one sequence and share one gather of its K/V.

    A power of two near the mean query length (num_tokens / max_seqs), at most 32; 1 (a chunk per token) for
    a decode-only batch or a mean under 4 rows, where a sequence's rows would mostly be padding."""
    mean = num_tokens // max_seqs
    if max_q_len == 1 or mean < 4:
        return 1
    return min(32, 1 << (mean.bit_length() - 1))


def query_chunks(
    kv_lens: Int[Array, " B"], cu_q_lens: Int[Array, " B+1"], num_seqs: Int[Array, ""], num_tokens: int, chunk: int
) -> tuple[Int[Array, " n"], Int[Array, " n"], Int[Array, "n C"], Bool[Array, "n C"], Int[Array, "n C"]]:
    """The step's query tokens in chunks of `chunk` rows of one sequence each: every sequence's rows split in
    order, a sequence's last chunk short. Returns per chunk its sequence and first row, and per chunk row its
    flat token index, whether it is a token of that sequence, and its absolute position. There are
    min(num_tokens // chunk + max_seqs, num_tokens) chunks (a static bound on sum ceil(q_len / chunk)); the
    ones past the last are all invalid."""
    max_seqs = kv_lens.shape[0]
    live = jnp.arange(max_seqs) < num_seqs
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    per_seq = (q_lens + chunk - 1) // chunk
    ends = jnp.cumsum(per_seq)
    index = jnp.arange(min(num_tokens // chunk + max_seqs, num_tokens))
    seq = jnp.minimum(jnp.searchsorted(ends, index, side="right"), max_seqs - 1).astype(jnp.int32)
    first = cu_q_lens[seq] + (index - (ends[seq] - per_seq[seq])) * chunk
    rows = first[:, None] + jnp.arange(chunk)[None, :]
    valid = (index < ends[-1])[:, None] & (rows < cu_q_lens[seq + 1][:, None])
    positions = (kv_lens[seq] - q_lens[seq] - cu_q_lens[seq])[:, None] + rows
    return seq, first, rows, valid, positions


def _attend_chunk(
    q_c, seq, positions, valid, k_cache, v_cache, block_table, kv_lens, *, sm_scale, sliding_window, soft_cap
):
    """Attention of one chunk's query rows [C, H, Dh] (one sequence's) over that sequence's cached keys, in
    float32; rows not `valid` come out as zeros."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    width = block_table.shape[1] * block_size
    key_pos = jnp.arange(width)
    stored = key_pos < kv_lens[seq]
    # Slots past kv_len hold whatever the pool had, even NaN: zero them so that 0 * garbage cannot leak into
    # the output. An FP8 pool's values in q's dtype first, as the kernels convert them.
    k = k_cache[block_table[seq]].reshape(width, num_kv_heads, head_dim).astype(q_c.dtype)
    v = v_cache[block_table[seq]].reshape(width, num_kv_heads, head_dim).astype(q_c.dtype)
    k = jnp.where(stored[:, None, None], k, 0)
    v = jnp.where(stored[:, None, None], v, 0)
    qg = q_c.reshape(q_c.shape[0], num_kv_heads, -1, head_dim)
    hi = lax.Precision.HIGHEST
    s = jnp.einsum("ckgd,skd->ckgs", qg, k, preferred_element_type=jnp.float32, precision=hi) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    allowed = (key_pos[None, :] <= positions[:, None]) & stored[None, :] & valid[:, None]
    if sliding_window is not None:
        allowed &= key_pos[None, :] > positions[:, None] - sliding_window
    s = jnp.where(allowed[:, None, None, :], s, -jnp.inf)
    m = s.max(axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l_sum = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("ckgs,skd->ckgd", p, v.astype(jnp.float32), precision=hi)
    # Rows with no visible key (padding) come out as zeros rather than 0/0.
    o = o / jnp.where(l_sum > 0, l_sum, 1.0)
    return o.reshape(q_c.shape).astype(q_c.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "max_q_len"))
def _reference(
    q, k_cache, v_cache, block_table, kv_lens, cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap, max_q_len
):
    num_tokens, num_heads, head_dim = q.shape
    chunk = _query_chunk(num_tokens, block_table.shape[0], max_q_len)
    seq, first, rows, valid, positions = query_chunks(kv_lens, cu_q_lens, num_seqs, num_tokens, chunk)
    padded = jnp.concatenate([q, jnp.zeros((chunk, num_heads, head_dim), q.dtype)])  # a last chunk's slice fits
    attend = functools.partial(
        _attend_chunk,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        kv_lens=kv_lens,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    _, block_size, num_kv_heads, _ = k_cache.shape
    width = block_table.shape[1] * block_size
    per_chunk = width * (num_kv_heads * head_dim + chunk * num_heads)  # gathered K and the chunk's scores
    batch = max(1, min(seq.shape[0], _elements_per_batch() // per_chunk))
    out = lax.map(
        lambda xs: attend(lax.dynamic_slice_in_dim(padded, xs[0], chunk), *xs[1:]),
        (first, seq, positions, valid),
        batch_size=batch,
    )
    # Each token is a valid row of exactly one chunk; the other rows (padding tokens too) land in a dropped row.
    dest = jnp.where(valid, rows, num_tokens).reshape(-1)
    flat = out.reshape(-1, num_heads, head_dim)
    return jnp.zeros((num_tokens + 1, num_heads, head_dim), q.dtype).at[dest].set(flat)[:num_tokens]


def ragged_paged_attention_reference(
    q: Float[Array, "T H Dh"],
    k_cache: Float[Array, "N Bs K Dh"],
    v_cache: Float[Array, "N Bs K Dh"],
    block_table: Int[Array, "B M"],
    kv_lens: Int[Array, " B"],
    cu_q_lens: Int[Array, " B+1"],
    num_seqs: Int[Array, ""] | int,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_q_len: int | None = None,
    interpret: bool = False,
    **tuning: int | bool,
) -> Float[Array, "T H Dh"]:
    """jnp ragged paged attention with `ragged_paged_attention`'s signature, in chunks of query rows of one
    sequence that share one gather of its K/V (`max_q_len=1`: a chunk per token); `interpret` and `tuning` are
    ignored (the reference has no launch to tune)."""
    del interpret
    check_tuning_keys(tuning)
    check_options(sm_scale, sliding_window, soft_cap)
    check_attention_inputs(q, k_cache, v_cache, block_table, kv_lens, cu_q_lens, num_seqs)
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    return _reference(
        q,
        k_cache,
        v_cache,
        block_table,
        kv_lens,
        cu_q_lens,
        num_seqs,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
        max_q_len=max_q_len,
    )


@jax.jit
def _write(k_cache, v_cache, k_new, v_new, slot_mapping):
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if slot_mapping.shape[0] == 1:
        # XLA rewrites a one-row scatter as select(in bounds, dynamic-update-slice, cache), which XLA:CPU
        # cannot run in place: every batch-1 decode step then copied the (donated) K and V caches twice
        # each, seconds per step for a pool of a few GiB. The same row written twice stays a scatter, in place.
        k_new, v_new, slot_mapping = (jnp.concatenate([x, x]) for x in (k_new, v_new, slot_mapping))
    flat = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = k_cache.reshape(flat).at[slot_mapping].set(k_new).reshape(k_cache.shape)
    v_cache = v_cache.reshape(flat).at[slot_mapping].set(v_new).reshape(v_cache.shape)
    return k_cache, v_cache


def write_kv_reference(
    k_cache: Float[Array, "N Bs K Dh"],
    v_cache: Float[Array, "N Bs K Dh"],
    k_new: Float[Array, "T K Dh"],
    v_new: Float[Array, "T K Dh"],
    slot_mapping: Int[Array, " T"],
) -> tuple[Float[Array, "N Bs K Dh"], Float[Array, "N Bs K Dh"]]:
    """Scatter the step's new K/V rows to cache slot `slot_mapping[t]` (= block * Bs + offset)."""
    check_write_inputs(k_cache, v_cache, k_new, v_new, slot_mapping)
    return _write(k_cache, v_cache, k_new, v_new, slot_mapping)


def rope_write_kv_reference(
    k_cache: Float[Array, "N Bs K Dh"],
    v_cache: Float[Array, "N Bs K Dh"],
    qkv: Float[Array, "T K G+2 Dh"],
    cos: Float[Array, "T Dh/2"],
    sin: Float[Array, "T Dh/2"],
    slot_mapping: Int[Array, " T"],
) -> tuple[Float[Array, "T H Dh"], Float[Array, "N Bs K Dh"], Float[Array, "N Bs K Dh"]]:
    """q, k and v sliced out of qkv, rope on q and k (in float32, rounded to qkv's dtype), every row cast to
    the cache's dtype and k, v written to slot `slot_mapping[t]`; returns (q, k_cache, v_cache)."""
    check_rope_write_inputs(k_cache, v_cache, qkv, cos, sin, slot_mapping)
    q, k, v = split_qkv(qkv)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    dtype = k_cache.dtype
    k_cache, v_cache = write_kv_reference(k_cache, v_cache, k.astype(dtype), v.astype(dtype), slot_mapping)
    return q.astype(dtype), k_cache, v_cache
