"""Attention inside a model's forward: the KV cache types, their metadata, and the dispatch functions.

A family's forward calls `attention(...)` (q, k and v apart) or `rope_attention(...)` (the fused qkv
projection's output, rope applied inside) once per layer, and `add_norm(...)` for each residual add and the
norm after it. Which implementation runs is decided by the type of the attention metadata (and of the
cache that goes with it): the dense reference path below, or the paged path over a block table, whose
`backend` picks the Pallas kernels or their jnp references. On the paged pallas backend a layer runs
`rope_write_kv` (slices, rope and the K/V write in one launch) then the attention kernel, and each
residual add is one `add_rms_norm` launch; everywhere else the same arithmetic runs as XLA ops.

Dense reference path: a contiguous cache per sequence, `DenseKVCache(k, v)`, each [L, B, S, K, Dh]
for the whole model, which every layer receives whole and indexes by its layer number. A flat batch of
T tokens is described by `DenseAttentionMetadata`: token t belongs to sequence seq_ids[t] at
absolute position positions[t]; its K/V are written at cache[seq_ids[t], positions[t]] and it
attends to the positions p' of its sequence with p' <= positions[t] (and p' > positions[t] - window
under a sliding window). Every earlier position of that sequence must already be in the cache or in
the same batch. It gathers a full [S] row of keys per token: simple and exact, not fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from jaxserve import kernels
from jaxserve.kernels.add_rms_norm import MAX_DIM as NORM_MAX_DIM
from jaxserve.kv_layout import KVLayout
from jaxserve.models.common import ParamSpec, apply_rope, split_qkv
from jaxserve.models.quant import FP8_DTYPE, FP8_MAX
from jaxserve.sharding.mesh import MODEL_AXIS
from jaxserve.sharding.rules import partition_spec


class _CacheShape(Protocol):
    num_layers: int
    num_kv_heads: int
    head_dim: int


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class DenseKVCache:
    """Contiguous K/V per sequence. [L, B, S, K, Dh] for the model; [B, S, K, Dh] for one layer."""

    k: Float[Array, "L B S K Dh"]
    v: Float[Array, "L B S K Dh"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class DenseAttentionMetadata:
    """Which sequence (row of the dense cache) each token of the flat batch belongs to."""

    seq_ids: Int[Array, " T"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class PagedKVCache:
    """The engine's block pool. [L, N, Bs, K, Dh] for the model; [N, Bs, K, Dh] for one layer.

    Block 0 is reserved: padding tokens write there and padding rows read from it.
    """

    k: Float[Array, "L N Bs K Dh"]
    v: Float[Array, "L N Bs K Dh"]


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["slot_mapping", "block_table", "kv_lens", "cu_q_lens", "num_seqs"],
    meta_fields=["backend", "max_q_len", "mesh", "interpret", "kv_layout"],
)
@dataclass(frozen=True, slots=True)
class PagedAttentionMetadata:
    """The flat token batch's attention inputs (docs/architecture.md, "One step").

    backend: "pallas" (the Triton kernels) or "xla" (their jnp references); static, so each
    compiled step is specialised to one.
    max_q_len: static bound on any sequence's query tokens when known (1: a decode-only step).
    mesh: the device mesh when the model is tensor-parallel; the Pallas kernels then run per device
        under shard_map on its share of the heads (the xla backend is partitioned by XLA itself).
    interpret: run the Pallas kernels in interpret mode (a CPU has no Triton; tests).
    kv_layout: the pool's layer groups (`jaxserve/kv_layout.py`): layer l's KV lives in slot slot_of[l] of group
        group_of[l]'s pages; block_table holds G interleaved pages per block ([B, M * G]) and slot_mapping a row
        per group ([G, T]). None: one group whose slot l is layer l (slot_mapping may then be [T]).
    """

    slot_mapping: Int[Array, "G T"]
    block_table: Int[Array, "B MG"]
    kv_lens: Int[Array, " B"]
    cu_q_lens: Int[Array, " B+1"]
    num_seqs: Int[Array, ""]
    backend: str = "xla"
    max_q_len: int | None = None
    mesh: Mesh | None = None
    interpret: bool = False
    kv_layout: KVLayout | None = None


# An FP8 KV cache (`KvCacheConfig.dtype="fp8"`) stores K and V as float8_e4m3fn (quant.FP8_DTYPE) with a scale
# of 1: each value rounded to e4m3 and clipped to its finite range (+-448; e4m3fn has no infinity, an overflow
# would be NaN), as vLLM's fp8 KV cache does without calibrated scales. Reads convert back to the compute dtype.
def is_fp8_cache(kv_cache: Any) -> bool:
    return kv_cache.k.dtype == FP8_DTYPE


def to_cache(x: Array, dtype: Any) -> Array:
    """K or V rows in the cache's dtype: for an FP8 cache clipped to e4m3's range first."""
    if jnp.dtype(dtype) == FP8_DTYPE:
        x = jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    return x.astype(dtype)


def paged_cache_specs(
    cfg: _CacheShape, num_blocks: int, block_size: int, layers_per_page: int | None = None
) -> PagedKVCache:
    """The block pool's declaration, like a weight's: shape and logical axes of `k` and `v`. The rules
    table (jaxserve/sharding/rules.py) splits it over kv heads; capacity reads its bytes per token from it.
    layers_per_page: the KV layout's slots per page (None: every layer, one group)."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
    layers = cfg.num_layers if layers_per_page is None else layers_per_page
    shape = (layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    spec = ParamSpec(shape, ("layers", None, None, "kv_heads", "head_dim"))
    return PagedKVCache(k=spec, v=spec)


def init_paged_cache(
    cfg: _CacheShape, num_blocks: int, block_size: int, dtype: jnp.dtype, layers_per_page: int | None = None
) -> PagedKVCache:
    """Zeroed block pool of `num_blocks` blocks (block 0 included) of `block_size` tokens per layer slot."""
    specs = paged_cache_specs(cfg, num_blocks, block_size, layers_per_page)
    return PagedKVCache(k=jnp.zeros(specs.k.shape, dtype), v=jnp.zeros(specs.v.shape, dtype))


def init_dense_cache(cfg: _CacheShape, batch: int, max_len: int, dtype: jnp.dtype) -> DenseKVCache:
    """Zeroed cache for `batch` sequences of up to `max_len` tokens (prompt + generated)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return DenseKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def attention(
    q: Float[Array, "T H Dh"],
    k: Float[Array, "T K Dh"],
    v: Float[Array, "T K Dh"],
    positions: Int[Array, " T"],
    kv_cache: DenseKVCache | PagedKVCache,
    layer: Int[Array, ""],
    meta: DenseAttentionMetadata | PagedAttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[Float[Array, "T H Dh"], DenseKVCache | PagedKVCache]:
    """Writes layer `layer`'s new K/V into the whole-model cache, then attends; the one dispatch on `meta`'s type.

    The cache travels whole from layer to layer rather than as per-layer slices: slicing a layer out
    and stacking it back would copy the whole KV pool every step.
    """
    if isinstance(meta, DenseAttentionMetadata) and isinstance(kv_cache, DenseKVCache):
        kv_cache = write_dense(kv_cache, layer, k, v, positions, meta)
        layer_cache = DenseKVCache(k=kv_cache.k[layer], v=kv_cache.v[layer])
        out = dense_attention(
            q, layer_cache, positions, meta, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
        return out, kv_cache
    if isinstance(meta, PagedAttentionMetadata) and isinstance(kv_cache, PagedKVCache):
        return paged_attention(
            q, k, v, kv_cache, layer, meta, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
    raise TypeError(
        f"no attention implementation for metadata {type(meta).__name__} with cache {type(kv_cache).__name__}"
    )


def rope_attention(
    qkv: Float[Array, "T K G+2 Dh"],
    cos: Float[Array, "T Dh/2"],
    sin: Float[Array, "T Dh/2"],
    positions: Int[Array, " T"],
    kv_cache: DenseKVCache | PagedKVCache,
    layer: Int[Array, ""],
    meta: DenseAttentionMetadata | PagedAttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[Float[Array, "T H Dh"], DenseKVCache | PagedKVCache]:
    """`attention` of a fused qkv projection's output (`common.split_qkv`'s layout) after rope on q and k.

    On the paged pallas backend one kernel slices, ropes and writes (`paged_rope_attention`); elsewhere, and for
    an FP8 pool, the same arithmetic as XLA ops (`split_qkv`, `apply_rope`, then `attention`).
    """
    if _runs_pallas(meta) and isinstance(kv_cache, PagedKVCache) and not is_fp8_cache(kv_cache):
        return paged_rope_attention(
            qkv, cos, sin, kv_cache, layer, meta, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
    q, k, v = split_qkv(qkv)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return attention(
        q, k, v, positions, kv_cache, layer, meta, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
    )


def _runs_pallas(meta: DenseAttentionMetadata | PagedAttentionMetadata) -> bool:
    """Whether the step runs the Pallas kernels: a paged step on the pallas backend."""
    return isinstance(meta, PagedAttentionMetadata) and meta.backend == "pallas"


def add_norm(
    x: Float[Array, "T D"],
    delta: Float[Array, "T D"],
    weight: Float[Array, " D"],
    eps: float,
    meta: DenseAttentionMetadata | PagedAttentionMetadata,
) -> tuple[Float[Array, "T D"], Float[Array, "T D"]]:
    """(x + delta, rms_norm(x + delta)): the residual add and the next block's norm, one `add_rms_norm` launch
    on the paged pallas backend (the step's kernels are chosen by its attention metadata), XLA ops elsewhere."""
    if not (_runs_pallas(meta) and x.shape[-1] <= NORM_MAX_DIM):
        return kernels.add_rms_norm_reference(x, delta, weight, eps)
    add_and_norm = partial(kernels.add_rms_norm, eps=eps, interpret=meta.interpret)
    if meta.mesh is not None and meta.mesh.size > 1:
        # The residual stream is replicated over the model axis: every device runs the kernel on all of it.
        add_and_norm = jax.shard_map(
            add_and_norm, mesh=meta.mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()), check_vma=False
        )
    return add_and_norm(x, delta, weight)


def paged_attention(
    q: Float[Array, "T H Dh"],
    k: Float[Array, "T K Dh"],
    v: Float[Array, "T K Dh"],
    kv_cache: PagedKVCache,
    layer: Int[Array, ""],
    meta: PagedAttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[Float[Array, "T H Dh"], PagedKVCache]:
    """Scatters the step's K/V into their slots, then ragged attention over the block tables."""
    if meta.backend == "pallas":
        write = partial(kernels.write_kv, interpret=meta.interpret)
    elif meta.backend == "xla":
        write = kernels.write_kv_reference
    else:
        raise ValueError(f"attention backend must be 'pallas' or 'xla', got {meta.backend!r}")
    attend = _attend(meta, sm_scale, sliding_window, soft_cap)

    def write_and_attend(k_pool, v_pool, tables, q, k, v):
        k_pool, v_pool = write(k_pool, v_pool, k, v, tables[0])
        return attend(q, k_pool, v_pool, *tables[1:]), k_pool, v_pool

    dtype = kv_cache.k.dtype
    new = (q.astype(q.dtype if is_fp8_cache(kv_cache) else dtype), to_cache(k, dtype), to_cache(v, dtype))
    axes = (("heads", "head_dim"), ("kv_heads", "head_dim"), ("kv_heads", "head_dim"))
    out, cache = _on_layer_pool(write_and_attend, kv_cache, layer, meta, new, axes, q.shape)
    return out.astype(q.dtype), cache


def paged_rope_attention(
    qkv: Float[Array, "T K G+2 Dh"],
    cos: Float[Array, "T Dh/2"],
    sin: Float[Array, "T Dh/2"],
    kv_cache: PagedKVCache,
    layer: Int[Array, ""],
    meta: PagedAttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[Float[Array, "T H Dh"], PagedKVCache]:
    """`paged_attention` of the fused projection's output on the pallas backend: one `rope_write_kv` launch
    (q, k and v sliced out, rope on q and k, the K/V write) then the attention kernel, where the unfused
    path runs four or five small XLA kernels and `write_kv`. q comes out in the cache's dtype."""
    if meta.backend != "pallas":
        raise ValueError(f"paged_rope_attention runs the pallas backend's kernels, got backend {meta.backend!r}")
    attend = _attend(meta, sm_scale, sliding_window, soft_cap)

    def rope_write_and_attend(k_pool, v_pool, tables, qkv, cos, sin):
        q, k_pool, v_pool = kernels.rope_write_kv(k_pool, v_pool, qkv, cos, sin, tables[0], interpret=meta.interpret)
        return attend(q, k_pool, v_pool, *tables[1:]), k_pool, v_pool

    num_tokens, num_kv_heads, group_and_kv, head_dim = qkv.shape
    out_shape = (num_tokens, num_kv_heads * (group_and_kv - 2), head_dim)
    axes = (("kv_heads", None, "head_dim"), (None,), (None,))
    inputs = (qkv.astype(kv_cache.k.dtype), cos, sin)
    out, cache = _on_layer_pool(rope_write_and_attend, kv_cache, layer, meta, inputs, axes, out_shape)
    return out.astype(qkv.dtype), cache


def _attend(meta: PagedAttentionMetadata, sm_scale: float, sliding_window: int | None, soft_cap: float | None):
    """The backend's ragged attention with the step's static options bound."""
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, max_q_len=meta.max_q_len)
    if meta.backend == "pallas":
        return partial(kernels.ragged_paged_attention, interpret=meta.interpret, **options)
    return partial(kernels.ragged_paged_attention_reference, **options)


def _on_layer_pool(body, kv_cache: PagedKVCache, layer, meta: PagedAttentionMetadata, inputs, input_axes, out_shape):
    """Runs `body(k_pool, v_pool, tables, *inputs) -> (out, k_pool, v_pool)` on layer `layer`'s part of the pool.

    The kernels see the pool of all layers as one [L*N, Bs, K, Dh] pool (a free reshape) in which
    layer l owns blocks l*N .. l*N + N-1, so block ids and slots are offset by l*N instead of slicing
    the layer out. `tables` = (slot_mapping, block_table, kv_lens, cu_q_lens, num_seqs); positions are
    implied by kv_lens and cu_q_lens (the kernel's contract). `input_axes`: each input's logical axes after
    its token axis; out is [T, H, Dh] of `out_shape`.
    """
    num_layers, num_blocks, block_size = kv_cache.k.shape[:3]
    pool_shape = (num_layers * num_blocks, *kv_cache.k.shape[2:])
    if meta.backend == "pallas" and meta.mesh is not None and meta.mesh.shape[MODEL_AXIS] > 1:
        # Attention is independent per kv head: each device runs the kernels on its heads (the inputs and
        # the pool split on their head axes by the rules table, the batch's tables replicated). Needs
        # H % tp == K % tp == 0, which keeps every device's query heads with their kv head (the runner
        # checks it).
        mesh = meta.mesh
        specs = [
            partition_spec(ParamSpec(x.shape, (None, *axes)), mesh) for x, axes in zip(inputs, input_axes, strict=True)
        ]
        out_spec = partition_spec(ParamSpec(out_shape, (None, "heads", "head_dim")), mesh)
        pool = partition_spec(ParamSpec(pool_shape, (None, None, "kv_heads", "head_dim")), mesh)
        body = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(pool, pool, (P(),) * 5, *specs),
            out_specs=(out_spec, pool, pool),
            check_vma=False,
        )
    slot_mapping, block_table, slot = _group_tables(meta, layer)
    offset = slot * num_blocks
    k_pool, v_pool = kv_cache.k.reshape(pool_shape), kv_cache.v.reshape(pool_shape)
    tables = (
        slot_mapping + offset * block_size,
        block_table + offset,
        meta.kv_lens,
        meta.cu_q_lens,
        meta.num_seqs,
    )
    out, k_pool, v_pool = body(k_pool, v_pool, tables, *inputs)
    return out, PagedKVCache(k=k_pool.reshape(kv_cache.k.shape), v=v_pool.reshape(kv_cache.v.shape))


def _group_tables(meta: PagedAttentionMetadata, layer: Int[Array, ""]) -> tuple[Array, Array, Array]:
    """(slot_mapping [T], block_table [B, M], slot) of layer `layer`'s group: its row of the slot mapping, its
    pages of the interleaved block table, and the layer's slot in them."""
    layout = meta.kv_layout
    slot_mapping, block_table = meta.slot_mapping, meta.block_table
    if layout is None:
        return (slot_mapping if slot_mapping.ndim == 1 else slot_mapping[0]), block_table, layer
    group = jnp.asarray(layout.group_of, jnp.int32)[layer]
    slot = jnp.asarray(layout.slot_of, jnp.int32)[layer]
    if layout.num_groups == 1:
        return slot_mapping[0], block_table, slot
    rows, width = block_table.shape
    pages = block_table.reshape(rows, width // layout.num_groups, layout.num_groups)
    return slot_mapping[group], jnp.take(pages, group, axis=2), slot


def write_dense(
    kv_cache: DenseKVCache,
    layer: Int[Array, ""],
    k: Float[Array, "T K Dh"],
    v: Float[Array, "T K Dh"],
    positions: Int[Array, " T"],
    meta: DenseAttentionMetadata,
) -> DenseKVCache:
    """Scatters each token's K/V to cache[layer, seq_ids[t], positions[t]]."""
    dtype = kv_cache.k.dtype
    new_k = kv_cache.k.at[layer, meta.seq_ids, positions].set(to_cache(k, dtype))
    new_v = kv_cache.v.at[layer, meta.seq_ids, positions].set(to_cache(v, dtype))
    return DenseKVCache(k=new_k, v=new_v)


def dense_attention(
    q: Float[Array, "T H Dh"],
    layer_cache: DenseKVCache,
    positions: Int[Array, " T"],
    meta: DenseAttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> Float[Array, "T H Dh"]:
    """Causal (optionally windowed) GQA attention of each token over its own sequence's cache row; logits
    sm_scale * q.k, soft-capped as soft_cap * tanh(logit / soft_cap) when soft_cap is set (Gemma 2).

    Scores and softmax in float32 (a bfloat16 softmax loses the small probabilities); the
    probabilities are cast to the value dtype before the weighted sum, as Hugging Face does.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = layer_cache.k.shape[2]
    group = num_heads // num_kv_heads
    compute = q.dtype if is_fp8_cache(layer_cache) else layer_cache.k.dtype  # an FP8 cache's values in q's dtype
    keys = layer_cache.k[meta.seq_ids].astype(compute)  # [T, S, K, Dh]
    values = layer_cache.v[meta.seq_ids].astype(compute)
    # Query head h reads kv head h // group (Hugging Face's repeat_kv order).
    q_grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,tskd->tkgs", q_grouped, keys, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        scores = jnp.tanh(scores / soft_cap) * soft_cap
    key_pos = jnp.arange(keys.shape[1])[None, :]
    visible = key_pos <= positions[:, None]
    if sliding_window is not None:
        visible &= key_pos > positions[:, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("tkgs,tskd->tkgd", probs, values)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


KVCache = DenseKVCache | PagedKVCache
AttentionMetadata = DenseAttentionMetadata | PagedAttentionMetadata
