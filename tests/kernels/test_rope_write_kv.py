"""rope_write_kv (Pallas, interpret mode) against rope_write_kv_reference: the roped query rows and the
written cache slots for token counts that do and do not fill a tile, one and four query heads per kv head,
head_dim 64, 128 and 80 (padded), float32 and bfloat16, the default tiles and a prefill's; padding tokens
aimed at the reserved block 0; every other slot untouched; bad inputs refused by name; and the launch
lowered for an H200.

The reference is compared under jit, as a layer runs it: XLA:CPU then contracts x1 * cos - x2 * sin into
one fused multiply-add exactly as it does in the interpreted kernel (eagerly, op by op, it does not, and
float32 results differ from the jitted ones by an ulp).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxserve import kernels as pk
from jaxserve.models.common import RopeConfig, rope_frequencies

NUM_BLOCKS, BLOCK_SIZE = 24, 16
H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
reference = jax.jit(pk.rope_write_kv_reference)


def _inputs(rng, num_tokens, num_kv_heads, group, head_dim, dtype, *, padding=0):
    """Caches of random values, qkv, Llama-3.1 rope at random positions, and slots: `num_tokens` real tokens
    in shuffled slots past block 0, then `padding` tokens in block 0. Returns (args, the real slots)."""
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = jnp.asarray(rng.standard_normal(cache_shape), dtype)
    v_cache = jnp.asarray(rng.standard_normal(cache_shape), dtype)
    total = num_tokens + padding
    qkv = jnp.asarray(rng.standard_normal((total, num_kv_heads, group + 2, head_dim)), dtype)
    rope = RopeConfig(theta=500000.0, variant="llama3", factor=8.0, original_max_position_embeddings=8192)
    positions = jnp.asarray(rng.integers(0, 100_000, total), jnp.int32)
    cos, sin = rope_frequencies(rope, head_dim, positions)
    slots = rng.permutation(np.arange(BLOCK_SIZE, NUM_BLOCKS * BLOCK_SIZE))[:num_tokens]
    slot_mapping = np.concatenate([slots, rng.integers(0, BLOCK_SIZE, padding)]).astype(np.int32)
    return (k_cache, v_cache, qkv, cos, sin, jnp.asarray(slot_mapping)), slots


@pytest.mark.parametrize(
    "dtype,num_tokens,num_kv_heads,group,head_dim,padding,tiling",
    [
        (jnp.float32, 1, 2, 4, 64, 0, {}),  # one decode token in a tile of one
        (jnp.float32, 37, 2, 1, 128, 3, {}),  # a partial last tile, padding tokens
        (jnp.bfloat16, 3, 2, 4, 128, 1, {}),
        (jnp.bfloat16, 300, 3, 1, 64, 5, dict(block_t=64, num_warps=8)),  # a prefill's tile, a partial last one
        (jnp.bfloat16, 37, 1, 4, 80, 0, {}),  # Dh/2 = 40, padded to 64 with masked loads and stores
    ],
)
def test_matches_reference(dtype, num_tokens, num_kv_heads, group, head_dim, padding, tiling):
    rng = np.random.default_rng(num_tokens * head_dim + group)
    args, slots = _inputs(rng, num_tokens, num_kv_heads, group, head_dim, dtype, padding=padding)
    q, k_out, v_out = pk.rope_write_kv(*args, interpret=True, **tiling)
    q_ref, k_ref, v_ref = reference(*args)

    assert q.dtype == dtype and q.shape == (num_tokens + padding, num_kv_heads * group, head_dim)
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(q_ref, np.float32))
    flat = (NUM_BLOCKS * BLOCK_SIZE, num_kv_heads, head_dim)
    untouched = np.setdiff1d(np.arange(BLOCK_SIZE, flat[0]), slots)
    for out, ref, old in ((k_out, k_ref, args[0]), (v_out, v_ref, args[1])):
        assert out.dtype == dtype and out.shape == old.shape
        out, ref, old = (np.asarray(x, np.float32).reshape(flat) for x in (out, ref, old))
        # Block 0 takes the padding tokens' rows in an unspecified order; the rest is exact.
        np.testing.assert_array_equal(out[BLOCK_SIZE:], ref[BLOCK_SIZE:])
        np.testing.assert_array_equal(out[untouched], old[untouched])
    # The value rows are copied, not roped.
    value_rows = np.asarray(args[2][:num_tokens, :, group + 1].astype(dtype), np.float32)
    np.testing.assert_array_equal(np.asarray(v_out, np.float32).reshape(flat)[slots], value_rows)


def test_rejects_bad_inputs():
    rng = np.random.default_rng(0)
    (k_cache, v_cache, qkv, cos, sin, slots), _ = _inputs(rng, 8, 2, 4, 64, jnp.float32)
    call = functools.partial(pk.rope_write_kv, interpret=True)
    with pytest.raises(ValueError, match=r"T, K, G\+2, Dh"):
        call(k_cache, v_cache, qkv[:, :, 0], cos, sin, slots)
    with pytest.raises(ValueError, match="do not match the cache"):
        call(k_cache, v_cache, qkv[:, :1], cos, sin, slots)
    with pytest.raises(ValueError, match="G\\+2 >= 3"):
        call(k_cache, v_cache, qkv[:, :, :2], cos, sin, slots)
    with pytest.raises(ValueError, match=r"cos must be \[T, Dh/2\]"):
        call(k_cache, v_cache, qkv, cos[:, :16], sin, slots)
    with pytest.raises(TypeError, match="sin must be float32"):
        call(k_cache, v_cache, qkv, cos, sin.astype(jnp.bfloat16), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        call(k_cache, v_cache, qkv, cos, sin, slots[:7])
    with pytest.raises(TypeError, match="int32"):
        call(k_cache, v_cache, qkv, cos, sin, slots.astype(jnp.float32))
    with pytest.raises(ValueError, match="k_cache/v_cache"):
        call(k_cache, v_cache[:2], qkv, cos, sin, slots)
    with pytest.raises(TypeError, match="k_cache"):
        call(k_cache, v_cache.astype(jnp.bfloat16), qkv, cos, sin, slots)
    with pytest.raises(ValueError, match="block_t"):
        call(k_cache, v_cache, qkv, cos, sin, slots, block_t=12)
    with pytest.raises(ValueError, match="num_warps"):
        call(k_cache, v_cache, qkv, cos, sin, slots, num_warps=3)
    with pytest.raises(ValueError, match="T, K, G\\+2, Dh"):
        pk.rope_write_kv_reference(k_cache, v_cache, qkv[:, :, 0], cos, sin, slots)


def test_lowers_for_cuda_with_every_load_before_the_first_store(capsys, monkeypatch):
    """Cross-platform lowering for an abstract H200 (tests/kernels/test_gpu_lowering.py says why). The kernel
    issues all its loads (slots, the two halves of the G+2 head rows, cos, sin) before any store, and stores
    q, k and v in two halves each."""
    monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
    group = 4
    args, _ = _inputs(np.random.default_rng(0), 5, 2, group, 128, jnp.bfloat16)
    fn = jax.jit(lambda *a: pk.rope_write_kv(*a), donate_argnums=(0, 1))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    capsys.readouterr()
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)):
        jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args)
    ir = capsys.readouterr().out
    assert "tt.func public @rope_write_kv" in ir, "the Triton IR was not captured"
    # A store lowers as a swap, a load whose value nothing reads and the store: count the kernel's own loads.
    ops = re.findall(r"tt\.store|tt\.load .*\"masked_load:\"", ir)
    assert [op[:8] for op in ops] == ["tt.load "] * 5 + ["tt.store"] * 6
