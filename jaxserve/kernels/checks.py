"""Trace-time validation of the attention and KV-write inputs, shared by the kernels and their references.

Shapes, dtypes and head divisibility are static and always checked. Whether the block table is wide
enough for kv_lens, and whether cu_q_lens is consistent with kv_lens, depends on values: it is checked
only when the arrays are concrete (an eager call); under `jax.jit` those inputs are tracers and the
caller (the runner's input preparation) is responsible for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# A KV pool may also hold float8_e4m3fn (an FP8 KV cache): the kernels convert its tiles to q's dtype as they load.
CACHE_DTYPES = (*FLOAT_DTYPES, jnp.dtype(jnp.float8_e4m3fn))


@dataclass(frozen=True, slots=True)
class AttentionShapes:
    """Static sizes of one attention call (legend: T H Dh Bs K B M)."""

    num_tokens: int
    num_heads: int
    head_dim: int
    block_size: int
    num_kv_heads: int
    max_seqs: int
    max_blocks: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _check_int32(name: str, x: jax.Array) -> None:
    if jnp.dtype(x.dtype) != jnp.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")


def _is_concrete(*xs: object) -> bool:
    """True for arrays with values (an eager call), False for tracers and abstract shapes."""
    return all(isinstance(x, np.ndarray | jax.Array | int) and not isinstance(x, jax.core.Tracer) for x in xs)


def check_options(sm_scale: float, sliding_window: int | None, soft_cap: float | None) -> None:
    if not (isinstance(sm_scale, int | float) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive float, got {sm_scale!r}")
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if soft_cap is not None and not (isinstance(soft_cap, int | float) and soft_cap > 0):
        raise ValueError(f"soft_cap must be None or a positive float, got {soft_cap!r}")


def check_max_q_len(max_q_len: int | None, shapes: AttentionShapes) -> None:
    if max_q_len is None:
        return
    if isinstance(max_q_len, bool) or not isinstance(max_q_len, int) or max_q_len < 1:
        raise ValueError(f"max_q_len must be a positive int or None, got {max_q_len!r}")
    if max_q_len == 1 and shapes.num_tokens > shapes.max_seqs:
        raise ValueError(
            f"max_q_len=1 (a decode-only batch) needs at most one token per sequence row: q has "
            f"{shapes.num_tokens} tokens but block_table has {shapes.max_seqs} rows"
        )


def check_attention_inputs(q, k_cache, v_cache, block_table, kv_lens, cu_q_lens, num_seqs) -> AttentionShapes:
    """Validate the flat-batch attention inputs (docs/architecture.md, "One step") and return their sizes."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, Dh], got shape {q.shape}")
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [N, Bs, K, Dh], got shape {k_cache.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache shape {k_cache.shape} and v_cache shape {v_cache.shape} differ")
    if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"q dtype must be one of float32, bfloat16, float16, got {q.dtype}")
    if v_cache.dtype != k_cache.dtype or (k_cache.dtype != q.dtype and k_cache.dtype != jnp.float8_e4m3fn):
        raise TypeError(
            f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must have q's dtype ({q.dtype}), or both be "
            "float8_e4m3fn (an FP8 KV cache)"
        )
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_head_dim = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(
            f"query heads (q.shape[1]={num_heads}) must be a multiple of kv heads (k_cache.shape[2]={num_kv_heads})"
        )
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim mismatch: q.shape[2]={head_dim}, k_cache.shape[3]={kv_head_dim}")
    if block_table.ndim != 2:
        raise ValueError(f"block_table must be [B, M], got shape {block_table.shape}")
    max_seqs, max_blocks = block_table.shape
    if kv_lens.shape != (max_seqs,):
        raise ValueError(f"kv_lens must be [B]=[{max_seqs}] like block_table's rows, got shape {kv_lens.shape}")
    if cu_q_lens.shape != (max_seqs + 1,):
        raise ValueError(f"cu_q_lens must be [B+1]=[{max_seqs + 1}], got shape {cu_q_lens.shape}")
    for name, x in (("block_table", block_table), ("kv_lens", kv_lens), ("cu_q_lens", cu_q_lens)):
        _check_int32(name, x)
    if not isinstance(num_seqs, int):
        if jnp.shape(num_seqs) not in ((), (1,)):
            raise ValueError(f"num_seqs must be a scalar, got shape {jnp.shape(num_seqs)}")
        _check_int32("num_seqs", num_seqs)
    shapes = AttentionShapes(num_tokens, num_heads, head_dim, block_size, num_kv_heads, max_seqs, max_blocks)
    if _is_concrete(block_table, kv_lens, cu_q_lens, num_seqs):
        _check_values(shapes, np.asarray(kv_lens), np.asarray(cu_q_lens), int(np.asarray(num_seqs).reshape(())))
    return shapes


def _check_values(shapes: AttentionShapes, kv_lens: np.ndarray, cu_q_lens: np.ndarray, num_seqs: int) -> None:
    """Value checks for eager calls; rows >= num_seqs are padding and never read."""
    if not 0 <= num_seqs <= shapes.max_seqs:
        raise ValueError(f"num_seqs must be in [0, B={shapes.max_seqs}], got {num_seqs}")
    cu = cu_q_lens[: num_seqs + 1]
    q_lens = np.diff(cu)
    if cu[0] != 0 or (q_lens < 0).any() or cu[-1] > shapes.num_tokens:
        raise ValueError(f"cu_q_lens must rise from 0 to at most T={shapes.num_tokens}, got {cu.tolist()}")
    lens = kv_lens[:num_seqs]
    capacity = shapes.max_blocks * shapes.block_size
    if num_seqs and lens.max() > capacity:
        raise ValueError(
            f"block_table is {shapes.max_blocks} blocks wide ({capacity} tokens) but kv_lens needs {lens.max()}"
        )
    short = np.nonzero((q_lens > lens) & (lens > 0))[0]
    if short.size:
        b = int(short[0])
        raise ValueError(f"sequence {b} has {q_lens[b]} query tokens but kv_lens[{b}]={lens[b]} (must be >= them)")


def check_write_inputs(k_cache, v_cache, k_new, v_new, slot_mapping) -> None:
    """Validate write_kv's inputs: new K/V rows [T, K, Dh] in the cache's dtype, int32 slots [T]."""
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must be equal [N, Bs, K, Dh], got {k_cache.shape} and {v_cache.shape}")
    if k_new.shape != v_new.shape or k_new.ndim != 3:
        raise ValueError(f"k_new/v_new must be equal [T, K, Dh], got {k_new.shape} and {v_new.shape}")
    if k_new.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k_new rows {k_new.shape[1:]} do not match the cache's [K, Dh]={k_cache.shape[2:]}")
    if slot_mapping.shape != k_new.shape[:1]:
        raise ValueError(f"slot_mapping must be [T]=[{k_new.shape[0]}], got shape {slot_mapping.shape}")
    _check_int32("slot_mapping", slot_mapping)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if jnp.dtype(x.dtype) not in CACHE_DTYPES:
            raise TypeError(f"{name} dtype must be one of float32, bfloat16, float16, float8_e4m3fn, got {x.dtype}")
    if k_new.dtype != k_cache.dtype or v_new.dtype != v_cache.dtype:
        raise TypeError(f"k_new/v_new ({k_new.dtype}/{v_new.dtype}) must have the cache's dtype ({k_cache.dtype})")


def check_rope_write_inputs(k_cache, v_cache, qkv, cos, sin, slot_mapping) -> None:
    """Validate rope_write_kv's inputs: qkv [T, K, G+2, Dh] with the cache's K and Dh (Dh even), float32
    cos and sin [T, Dh/2], int32 slots [T]."""
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must be equal [N, Bs, K, Dh], got {k_cache.shape} and {v_cache.shape}")
    if qkv.ndim != 4:
        raise ValueError(f"qkv must be [T, K, G+2, Dh], got shape {qkv.shape}")
    num_tokens, num_kv_heads, group_and_kv, head_dim = qkv.shape
    if (num_kv_heads, head_dim) != k_cache.shape[2:]:
        raise ValueError(f"qkv's [K, Dh]=[{num_kv_heads}, {head_dim}] do not match the cache's {k_cache.shape[2:]}")
    if group_and_kv < 3:
        raise ValueError(f"qkv.shape[2] must be G+2 >= 3 (G query heads, a key, a value), got {group_and_kv}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (rope rotates pairs), got {head_dim}")
    for name, x in (("cos", cos), ("sin", sin)):
        if x.shape != (num_tokens, head_dim // 2):
            raise ValueError(f"{name} must be [T, Dh/2]=[{num_tokens}, {head_dim // 2}], got shape {x.shape}")
        if jnp.dtype(x.dtype) != jnp.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [T]=[{num_tokens}], got shape {slot_mapping.shape}")
    _check_int32("slot_mapping", slot_mapping)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("qkv", qkv)):
        if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{name} dtype must be one of float32, bfloat16, float16, got {x.dtype}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must have one dtype")
