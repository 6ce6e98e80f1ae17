"""ragged_paged_attention (Pallas, interpret mode) against its jnp reference and a float64 numpy oracle:
hypothesis-generated ragged mixes of prefill chunks (with cached prefixes) and decode rows, GQA ratios,
head dims, block sizes and dtypes. Every batch has shuffled non-contiguous block tables, partially filled
last blocks, padding rows with junk and padding tokens, and NaN in every cache slot it does not own.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import kernels as pk

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # conftest.py says why

# Relative error bounds (||out - oracle|| / ||oracle||). float32 is exact up to summation order; the
# half types round the output and, in the kernel, the probabilities before the P.V product.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
MIXED = [(37, 20), (1, 70), (5, 0), (1, 3), (16, 16), (1, 0)]


def _check(batch, numpy_attention, rel_err, dtype=jnp.float32, sm_scale=0.125, **kw):
    """Kernel and reference both match the oracle; padding tokens come out as exact zeros. The reference takes
    max_q_len too (a chunk of query rows per token when it is 1, else up to 32 rows of a sequence a chunk)."""
    options = {k: v for k, v in kw.items() if k in ("sliding_window", "soft_cap")}
    want = numpy_attention(batch, sm_scale, **options)
    out = np.asarray(pk.ragged_paged_attention(*batch.args(), sm_scale=sm_scale, interpret=True, **kw), np.float64)
    ref_options = {k: v for k, v in kw.items() if k in ("sliding_window", "soft_cap", "max_q_len")}
    ref = np.asarray(pk.ragged_paged_attention_reference(*batch.args(), sm_scale=sm_scale, **ref_options), np.float64)
    assert rel_err(out, want) < TOL[dtype]
    assert rel_err(ref, want) < TOL[dtype]
    assert rel_err(out, ref) < TOL[dtype]
    end = int(batch.cu_q_lens[batch.num_seqs])
    assert (out[end:] == 0).all() and (ref[end:] == 0).all()
    return out


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_hypothesis_ragged_batches(data, paged_batch, numpy_attention, rel_err):
    """Up to two prefill chunks (1..300 tokens after 0..500 cached) and up to four decode rows (context
    1..800), in any order, padded to one fixed shape: 9 query heads over 3 kv heads (the default model)."""
    prefill = data.draw(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 500)), max_size=2))
    decode = data.draw(st.lists(st.tuples(st.just(1), st.integers(0, 799)), min_size=0 if prefill else 1, max_size=4))
    seqs = data.draw(st.permutations(prefill + decode))
    window = data.draw(st.sampled_from([None, None, 7, 129]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    batch = paged_batch(
        rng, seqs, num_heads=9, num_kv_heads=3, num_tokens=640, max_seqs=8, max_blocks=52, num_blocks=320
    )
    _check(batch, numpy_attention, rel_err, sliding_window=window)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2), (8, 1)])
def test_gqa_ratios(num_heads, num_kv_heads, paged_batch, numpy_attention, rel_err):
    batch = paged_batch(
        np.random.default_rng(num_heads),
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        num_tokens=96,
        max_seqs=8,
    )
    _check(batch, numpy_attention, rel_err)


@pytest.mark.parametrize("head_dim", [128, 256, 80])
def test_head_dims(head_dim, paged_batch, numpy_attention, rel_err):
    """Powers of two and a padded one (80 -> 128 lanes, masked)."""
    batch = paged_batch(np.random.default_rng(head_dim), MIXED[:4], head_dim=head_dim, num_tokens=48, max_seqs=5)
    _check(batch, numpy_attention, rel_err, sm_scale=head_dim**-0.5)


@pytest.mark.parametrize("block_size", [32, 64])
def test_block_sizes(block_size, paged_batch, numpy_attention, rel_err):
    """Block size 16 is in every other test; key tiles smaller and larger than a block."""
    seqs = [(70, 90), (1, 130), (3, 0)]
    batch = paged_batch(np.random.default_rng(block_size), seqs, block_size=block_size, max_seqs=4, num_tokens=80)
    _check(batch, numpy_attention, rel_err, block_n=32, decode_block_n=64)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_dtypes(dtype, paged_batch, numpy_attention, rel_err):
    batch = paged_batch(np.random.default_rng(3), MIXED, num_heads=8, num_kv_heads=2, dtype=dtype, max_seqs=7)
    out = _check(batch, numpy_attention, rel_err, dtype=dtype)
    assert pk.ragged_paged_attention(*batch.args(), sm_scale=0.125, interpret=True).dtype == dtype
    assert np.isfinite(out).all()


@pytest.mark.parametrize("max_q_len", [None, 1], ids=["mixed", "decode"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fp8_pool_is_read_in_q_dtype(max_q_len, dtype, paged_batch, numpy_attention, rel_err):
    """An FP8 KV pool (float8_e4m3fn; NaN in the slots no sequence owns) with q in float32 or bf16: the kernel and
    the reference equal the oracle over the e4m3-rounded keys and values, to q's dtype's bound."""
    import dataclasses

    import ml_dtypes

    seqs = [(1, 40), (1, 3), (1, 90)] if max_q_len == 1 else MIXED
    batch = paged_batch(np.random.default_rng(11), seqs, num_tokens=96 if max_q_len is None else 3, max_seqs=8)
    f8 = ml_dtypes.float8_e4m3fn
    rounded = dataclasses.replace(
        batch,
        q=batch.q.astype(dtype),
        k_cache=batch.k_cache.astype(f8),
        v_cache=batch.v_cache.astype(f8),
        keys=[k.astype(f8).astype(np.float32) for k in batch.keys],
        values=[v.astype(f8).astype(np.float32) for v in batch.values],
    )
    out = _check(rounded, numpy_attention, rel_err, dtype=dtype, max_q_len=max_q_len)
    # e4m3 keeps about 2^-4 of each value: far from the unrounded cache's attention, not equal to it.
    assert rel_err(out, numpy_attention(batch, 0.125)) > 1e-3
