"""write_kv (Pallas, interpret mode) against write_kv_reference: a round trip through shuffled slots, padding
tokens aimed at the reserved block 0, token counts that do not fill the last tile, every dtype (an FP8 pool's
float8_e4m3fn too), and a
padded head_dim with a non-power-of-two kv head count."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import kernels as pk


def _cache_and_rows(rng, num_blocks, block_size, num_kv_heads, head_dim, num_tokens, dtype):
    """Random rows in `dtype` (float8_e4m3fn: an FP8 KV pool's, values already rounded to e4m3)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = jnp.asarray(rng.standard_normal(shape), dtype)
    v_cache = jnp.asarray(rng.standard_normal(shape), dtype)
    k_new = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype)
    v_new = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype)
    return k_cache, v_cache, k_new, v_new


@pytest.mark.parametrize(
    "dtype,num_kv_heads,head_dim,block_t",
    [(jnp.float32, 2, 64, 16), (jnp.bfloat16, 3, 80, 8), (jnp.float16, 1, 128, 32), (jnp.float8_e4m3fn, 2, 64, 16)],
)
def test_round_trip(dtype, num_kv_heads, head_dim, block_t):
    rng = np.random.default_rng(head_dim)
    num_blocks, block_size, real, padding = 12, 16, 37, 5
    k_cache, v_cache, k_new, v_new = _cache_and_rows(
        rng, num_blocks, block_size, num_kv_heads, head_dim, real + padding, dtype
    )
    slots = rng.permutation(np.arange(block_size, num_blocks * block_size))[:real]  # never block 0
    slot_mapping = jnp.asarray(np.concatenate([slots, rng.integers(0, block_size, padding)]).astype(np.int32))

    k_out, v_out = pk.write_kv(k_cache, v_cache, k_new, v_new, slot_mapping, interpret=True, block_t=block_t)
    k_ref, v_ref = pk.write_kv_reference(k_cache, v_cache, k_new, v_new, slot_mapping)

    flat = (num_blocks * block_size, num_kv_heads, head_dim)
    for out, ref, new, old in ((k_out, k_ref, k_new, k_cache), (v_out, v_ref, v_new, v_cache)):
        assert out.dtype == dtype and out.shape == old.shape
        out, ref, old = (np.asarray(x).reshape(flat) for x in (out, ref, old))
        # Block 0 takes the padding tokens' rows in an unspecified order; the rest is exact.
        np.testing.assert_array_equal(out[block_size:], ref[block_size:])
        np.testing.assert_array_equal(out[slots], np.asarray(new)[:real])
        untouched = np.setdiff1d(np.arange(block_size, flat[0]), slots)
        np.testing.assert_array_equal(out[untouched], old[untouched])


def test_rejects_mismatched_inputs():
    rng = np.random.default_rng(0)
    k_cache, v_cache, k_new, v_new = _cache_and_rows(rng, 4, 16, 2, 64, 8, jnp.float32)
    slots = jnp.arange(8, dtype=jnp.int32)
    with pytest.raises(ValueError, match="K, Dh"):
        pk.write_kv(k_cache, v_cache, k_new[:, :1], v_new[:, :1], slots, interpret=True)
    with pytest.raises(ValueError, match="slot_mapping"):
        pk.write_kv(k_cache, v_cache, k_new, v_new, slots[:7], interpret=True)
    with pytest.raises(TypeError, match="int32"):
        pk.write_kv(k_cache, v_cache, k_new, v_new, slots.astype(jnp.float32), interpret=True)
    with pytest.raises(TypeError, match="cache's dtype"):
        pk.write_kv(k_cache, v_cache, k_new.astype(jnp.bfloat16), v_new.astype(jnp.bfloat16), slots, interpret=True)
