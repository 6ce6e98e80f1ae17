"""`write_kv`: scatter of one step's new K/V rows into their cache slots, in place.

Grid (token tiles, kv heads); a program copies `block_t` tokens' head_dim rows of one kv head from
k_new/v_new to slot_mapping[t] = block * Bs + offset of the caches. The caches are aliased to the
outputs, so under a jit that donates them the write is in place; without donation XLA copies them
first. Padding tokens point at the reserved block 0, whose contents are never read.
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

from .checks import check_write_inputs
from .common import filter_triton_deprecation
from .tuning import check_power_of_two, next_power_of_2


@dataclass(frozen=True, slots=True)
class WriteParams:
    block_t: int
    num_tokens: int
    num_blocks: int
    block_size: int
    head_dim: int

    @property
    def head_dim_padded(self) -> int:
        return next_power_of_2(self.head_dim)


def _write_kernel(k_new_ref, v_new_ref, slot_ref, _k_in, _v_in, k_out_ref, v_out_ref, *, p: WriteParams):
    h = pl.program_id(1)
    t = pl.program_id(0) * p.block_t + jnp.arange(p.block_t, dtype=jnp.int32)
    ok = t < p.num_tokens
    slot = plgpu.load(slot_ref.at[jnp.minimum(t, p.num_tokens - 1)], mask=ok, other=0)
    # Tokens past T index one block past the cache: masked on GPU, dropped by the interpreter's scatter.
    page = jnp.where(ok, lax.div(slot, p.block_size), p.num_blocks)
    offset = lax.rem(slot, p.block_size)
    d = jnp.arange(p.head_dim_padded, dtype=jnp.int32)
    mask = ok[:, None] & (d[None, :] < p.head_dim)
    src = (t[:, None], h, d[None, :])
    dst = (page[:, None], offset[:, None], h, d[None, :])
    plgpu.store(k_out_ref.at[dst], plgpu.load(k_new_ref.at[src], mask=mask, other=0.0), mask=mask)
    plgpu.store(v_out_ref.at[dst], plgpu.load(v_new_ref.at[src], mask=mask, other=0.0), mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret", "block_t"))
def _write(k_cache, v_cache, k_new, v_new, slot_mapping, *, interpret: bool, block_t: int):
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    p = WriteParams(block_t, k_new.shape[0], num_blocks, block_size, head_dim)
    cache_shapes = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),) * 2
    return pl.pallas_call(
        functools.partial(_write_kernel, p=p),
        out_shape=cache_shapes,
        grid=(pl.cdiv(p.num_tokens, block_t), num_kv_heads),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="write_kv",
    )(k_new, v_new, slot_mapping, k_cache, v_cache)


def write_kv(
    k_cache: Float[Array, "N Bs K Dh"],
    v_cache: Float[Array, "N Bs K Dh"],
    k_new: Float[Array, "T K Dh"],
    v_new: Float[Array, "T K Dh"],
    slot_mapping: Int[Array, " T"],
    *,
    interpret: bool = False,
    block_t: int = 16,
) -> tuple[Float[Array, "N Bs K Dh"], Float[Array, "N Bs K Dh"]]:
    """Write k_new[t], v_new[t] to cache slot slot_mapping[t]; returns the updated (k_cache, v_cache)."""
    check_write_inputs(k_cache, v_cache, k_new, v_new, slot_mapping)
    check_power_of_two("block_t", block_t)
    filter_triton_deprecation()
    return _write(k_cache, v_cache, k_new, v_new, slot_mapping, interpret=interpret, block_t=block_t)
