"""`rope_write_kv`: rope on q and k and the K/V cache write of one step, straight from the fused qkv projection.

qkv is the projection's output [T, K, G+2, Dh]: for each kv head its G query heads, then its key, then
its value (jaxserve/models/llama.py, `ServingLayer.wqkv`). One launch replaces what XLA runs as four or five small
kernels per layer (slicing q, k and v out, rope on q, rope on k) plus `write_kv`; at decode batch sizes
each of those is a launch-bound kernel of 1-2 µs.

Grid (token tiles, kv heads), as `write_kv`'s: a program reads its tokens' G+2 head rows of one kv head
once, as two [tokens, G+2 padded to a power of two, Dh/2] tiles (the rows' halves), rotates them all,
and stores each role from them under its own mask: the G query rows to q [T, K*G, Dh] (query head
k * G + g), the roped key and the plain value to cache slot slot_mapping[t] = block * Bs + offset. (One
tile per half rather than one per head: five loads and six stores a program instead of a few dozen,
which also keeps the interpreter's compile, and the CPU tests, short.) The caches are
aliased to the outputs (in place under a jit that donates them). Padding tokens point at the reserved
block 0, whose contents are never read.

Rope is the rotate-half convention of `jaxserve.models.common.apply_rope`: dims i and i + Dh/2 form a pair, the
rotation is computed in float32 and rounded to qkv's dtype, then (like every row) cast to the cache's
dtype, the same roundings in the same order as that function followed by `write_kv`. Loading the halves
separately means no tile is ever concatenated or rolled.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from .checks import check_rope_write_inputs
from .common import and_mask, filter_triton_deprecation
from .tuning import check_power_of_two, next_power_of_2

# Elements of qkv a program reads per warp: the launch's num_warps grows with the tile (block_t * (G+2)
# * Dh) so that each thread holds about this many, not hundreds, in registers.
_ELEMENTS_PER_WARP = 32 * 16


@dataclass(frozen=True, slots=True)
class RopeWriteParams:
    block_t: int
    num_tokens: int
    num_blocks: int
    block_size: int
    group: int  # G: query heads per kv head
    head_dim: int
    qkv_dtype: jnp.dtype
    cache_dtype: jnp.dtype

    @property
    def half(self) -> int:
        return self.head_dim // 2

    @property
    def half_padded(self) -> int:
        return next_power_of_2(self.half)

    @property
    def heads_padded(self) -> int:
        return next_power_of_2(self.group + 2)


def default_block_t(num_tokens: int) -> int:
    """Tokens per program: every token its own program row at decode sizes, 16 from 16 tokens on."""
    return min(16, next_power_of_2(num_tokens))


def default_num_warps(block_t: int, group: int, head_dim: int) -> int:
    elements = block_t * next_power_of_2(group + 2) * next_power_of_2(head_dim // 2) * 2
    return max(1, min(8, next_power_of_2(elements // _ELEMENTS_PER_WARP)))


def _rope_write_kernel(qkv_ref, cos_ref, sin_ref, slot_ref, _k_in, _v_in, q_ref, k_out_ref, v_out_ref, *, p):
    h = pl.program_id(1)
    t = pl.program_id(0) * p.block_t + jnp.arange(p.block_t, dtype=jnp.int32)
    ok = t < p.num_tokens
    slot = plgpu.load(slot_ref.at[jnp.minimum(t, p.num_tokens - 1)], mask=ok, other=0)
    # Tiles are [tokens, heads, Dh/2]: every index and mask full rank, as the Triton lowering wants.
    t, ok = t[:, None, None], ok[:, None, None]
    page = lax.div(slot, p.block_size)[:, None, None]
    offset = lax.rem(slot, p.block_size)[:, None, None]
    j = jnp.arange(p.heads_padded, dtype=jnp.int32)[None, :, None]  # G query heads, the key, the value
    lo = jnp.arange(p.half_padded, dtype=jnp.int32)[None, None, :]
    hi = lo + p.half
    # Masks on the head_dim axis only where Dh/2 is padded: an unmasked axis keeps the accesses vectorised.
    dims = None if p.half == p.half_padded else lo < p.half
    # Two loads read all G+2 rows of the kv head (their halves), issued with cos and sin before any store.
    loaded = and_mask(ok & (j < p.group + 2), dims)
    x1, x2 = (plgpu.load(qkv_ref.at[t, h, j, d], mask=loaded, other=0.0) for d in (lo, hi))
    cos = plgpu.load(cos_ref.at[t, lo], mask=and_mask(ok, dims), other=0.0)
    sin = plgpu.load(sin_ref.at[t, lo], mask=and_mask(ok, dims), other=0.0)
    a1, a2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    rotated = (a1 * cos - a2 * sin, a2 * cos + a1 * sin)  # apply_rope's expressions
    rotated = [y.astype(p.qkv_dtype).astype(p.cache_dtype) for y in rotated]
    plain = [x.astype(p.cache_dtype) for x in (x1, x2)]

    # Each store keeps the lanes of one role. Lanes masked off also index past the end of their array
    # (masked on GPU, dropped by the interpreter's scatter), so none can land on another lane's address.
    def store(ref, index, mask, values):
        for d, y in zip((lo, hi), values, strict=True):
            plgpu.store(ref.at[index(d)], y, mask=mask)

    is_q = and_mask(ok & (j < p.group), dims)
    store(q_ref, lambda d: (jnp.where(is_q, t, p.num_tokens), h * p.group + j, d), is_q, rotated)
    for ref, role, values in ((k_out_ref, p.group, rotated), (v_out_ref, p.group + 1, plain)):
        is_kv = and_mask(ok & (j == role), dims)
        store(ref, lambda d, m=is_kv: (jnp.where(m, page, p.num_blocks), offset, h, d), is_kv, values)


@functools.partial(jax.jit, static_argnames=("interpret", "block_t", "num_warps"))
def _rope_write(k_cache, v_cache, qkv, cos, sin, slot_mapping, *, interpret: bool, block_t: int, num_warps: int):
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens, _, group_and_kv, _ = qkv.shape
    group = group_and_kv - 2
    p = RopeWriteParams(
        block_t, num_tokens, num_blocks, block_size, group, head_dim, jnp.dtype(qkv.dtype), jnp.dtype(k_cache.dtype)
    )
    cache_shape = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    q_shape = jax.ShapeDtypeStruct((num_tokens, num_kv_heads * group, head_dim), k_cache.dtype)
    return pl.pallas_call(
        functools.partial(_rope_write_kernel, p=p),
        out_shape=(q_shape, cache_shape, cache_shape),
        grid=(pl.cdiv(num_tokens, block_t), num_kv_heads),
        input_output_aliases={4: 1, 5: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="rope_write_kv",
    )(qkv, cos, sin, slot_mapping, k_cache, v_cache)


def rope_write_kv(
    k_cache: Float[Array, "N Bs K Dh"],
    v_cache: Float[Array, "N Bs K Dh"],
    qkv: Float[Array, "T K G+2 Dh"],
    cos: Float[Array, "T Dh/2"],
    sin: Float[Array, "T Dh/2"],
    slot_mapping: Int[Array, " T"],
    *,
    interpret: bool = False,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> tuple[Float[Array, "T H Dh"], Float[Array, "N Bs K Dh"], Float[Array, "N Bs K Dh"]]:
    """Rope on the query and key rows of qkv, the roped key and the value of token t written to cache slot
    slot_mapping[t]; returns (q [T, K*G, Dh] in the cache's dtype, k_cache, v_cache).

    cos and sin are float32 [T, Dh/2] (`jaxserve.models.common.rope_frequencies`). block_t (tokens per program, a
    power of two) and num_warps default to `default_block_t` and `default_num_warps`.
    """
    check_rope_write_inputs(k_cache, v_cache, qkv, cos, sin, slot_mapping)
    block_t = default_block_t(qkv.shape[0]) if block_t is None else block_t
    check_power_of_two("block_t", block_t)
    if num_warps is None:
        num_warps = default_num_warps(block_t, qkv.shape[2] - 2, qkv.shape[3])
    check_power_of_two("num_warps", num_warps, 1, 16)
    filter_triton_deprecation()
    return _rope_write(
        k_cache, v_cache, qkv, cos, sin, slot_mapping, interpret=interpret, block_t=block_t, num_warps=num_warps
    )
