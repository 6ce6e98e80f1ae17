"""Pure-jnp references of the kernels: `ragged_paged_attention_reference`, `write_kv_reference` and
`rope_write_kv_reference`.

They have the kernels' signatures and semantics (docs/architecture.md, "One step" and "KV layout and
capacity") and serve as the `attention_backend="xla"` path and as the tests' oracle. Attention is
computed in float32 per query token over the whole block-table width of its sequence, masked to the causal (and window)
range; tokens are processed in chunks so the gathered keys stay within a fixed memory budget. The
rope reference is the model's own code (`jaxserve.models.common.split_qkv` and `apply_rope`), so the kernel is
held to what a layer computed before it existed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from jaxserve.models.common import apply_rope, split_qkv

from .checks import check_attention_inputs, check_options, check_rope_write_inputs, check_write_inputs
from .tuning import check_tuning_keys


def _elements_per_chunk() -> int:
    """Gathered K elements per chunk of query tokens: bounds the reference's memory (small on CPU)."""
    return 1 << (26 if jax.default_backend() == "gpu" else 22)


def token_metadata(
    kv_lens: Int[Array, " B"], cu_q_lens: Int[Array, " B+1"], num_seqs: Int[Array, ""], num_tokens: int
) -> tuple[Int[Array, " T"], Int[Array, " T"], jax.Array]:
    """Sequence index, absolute position and validity of every flat token.

    A token is valid when it lies before cu_q_lens[num_seqs] and its sequence has a non-empty cache.
    """
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    live = jnp.arange(kv_lens.shape[0]) < num_seqs
    ends_before = (cu_q_lens[1:][None, :] <= tok[:, None]) & live[None, :]
    seq = jnp.minimum(ends_before.sum(axis=1, dtype=jnp.int32), kv_lens.shape[0] - 1)
    q_start = cu_q_lens[seq]
    q_len = cu_q_lens[seq + 1] - q_start
    kv_len = kv_lens[seq]
    valid = (tok < cu_q_lens[num_seqs]) & (kv_len > 0)
    pos = kv_len - q_len + tok - q_start
    return seq, pos, valid


def _attend_token(q_t, seq, pos, valid, k_cache, v_cache, block_table, kv_lens, *, sm_scale, sliding_window, soft_cap):
    """Attention of one query token [H, Dh] over its sequence's cached keys, in float32."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    width = block_table.shape[1] * block_size
    key_pos = jnp.arange(width)
    stored = ((key_pos < kv_lens[seq]) & valid)[:, None, None]
    # Slots past kv_len (and all of a padding token's row) hold whatever the pool had, even NaN: zero
    # them so that 0 * garbage cannot leak into the output.
    # An FP8 pool's values in q's dtype first, as the kernels convert them.
    k = jnp.where(stored, k_cache[block_table[seq]].reshape(width, num_kv_heads, head_dim).astype(q_t.dtype), 0)
    v = jnp.where(stored, v_cache[block_table[seq]].reshape(width, num_kv_heads, head_dim).astype(q_t.dtype), 0)
    qg = q_t.reshape(num_kv_heads, -1, head_dim)
    hi = lax.Precision.HIGHEST
    s = jnp.einsum("kgd,skd->kgs", qg, k, preferred_element_type=jnp.float32, precision=hi) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    allowed = (key_pos <= pos) & (key_pos < kv_lens[seq]) & valid
    if sliding_window is not None:
        allowed &= key_pos > pos - sliding_window
    s = jnp.where(allowed, s, -jnp.inf)
    m = s.max(axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l_sum = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("kgs,skd->kgd", p, v.astype(jnp.float32), precision=hi)
    # Rows with no visible key (padding) come out as zeros rather than 0/0.
    o = o / jnp.where(l_sum > 0, l_sum, 1.0)
    return o.reshape(q_t.shape).astype(q_t.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def _reference(q, k_cache, v_cache, block_table, kv_lens, cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap):
    seq, pos, valid = token_metadata(kv_lens, cu_q_lens, num_seqs, q.shape[0])
    attend = functools.partial(
        _attend_token,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        kv_lens=kv_lens,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    per_token = block_table.shape[1] * block_size * num_kv_heads * head_dim
    chunk = max(1, min(q.shape[0], _elements_per_chunk() // per_token))
    return lax.map(lambda xs: attend(*xs), (q, seq, pos, valid), batch_size=chunk)


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
    """jnp ragged paged attention with `ragged_paged_attention`'s signature; `max_q_len`, `interpret` and
    `tuning` are ignored (the reference has no launch to skip)."""
    del interpret, max_q_len
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
