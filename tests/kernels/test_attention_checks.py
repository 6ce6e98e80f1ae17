"""Trace-time validation of ragged_paged_attention's inputs (the kernel and the reference share it) and of
the tuning keywords and tables."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxserve import kernels as pk
from jaxserve.kernels.tuning import DECODE_TABLE, MIXED_TABLE, DecodeTiling, MixedTiling


def _args(num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.float32, max_blocks=4):
    q = jnp.zeros((8, num_heads, head_dim), dtype)
    cache = jnp.zeros((9, 16, num_kv_heads, head_dim), dtype)
    block_table = jnp.ones((2, max_blocks), jnp.int32)
    kv_lens = jnp.array([40, 30], jnp.int32)
    cu_q_lens = jnp.array([0, 5, 8], jnp.int32)
    return [q, cache, cache, block_table, kv_lens, cu_q_lens, jnp.int32(2)]


@pytest.mark.parametrize("fn", [pk.ragged_paged_attention, pk.ragged_paged_attention_reference])
@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: a.__setitem__(0, jnp.zeros((8, 5, 64))), ValueError, r"multiple of kv heads"),
        (lambda a: a.__setitem__(0, jnp.zeros((8, 4, 32))), ValueError, r"head_dim mismatch"),
        (lambda a: a.__setitem__(0, a[0].astype(jnp.bfloat16)), TypeError, r"must have q's dtype"),
        (lambda a: a.__setitem__(0, a[0].astype(jnp.int32)), TypeError, r"q dtype"),
        (lambda a: a.__setitem__(4, a[4].astype(jnp.int16)), TypeError, "int32"),
        (lambda a: a.__setitem__(5, a[5][:2]), ValueError, r"cu_q_lens must be \[B\+1\]"),
        (lambda a: a.__setitem__(3, a[3][:, :2]), ValueError, r"2 blocks wide \(32 tokens\) but kv_lens needs 40"),
        (lambda a: a.__setitem__(4, jnp.array([3, 30], jnp.int32)), ValueError, r"5 query tokens but kv_lens"),
        (lambda a: a.__setitem__(5, jnp.array([0, 5, 9], jnp.int32)), ValueError, r"at most T=8"),
        (lambda a: a.__setitem__(2, a[2][:, :8]), ValueError, r"k_cache shape .* v_cache shape"),
    ],
)
def test_input_errors_name_the_mismatch(fn, change, error, match):
    args = _args()
    change(args)
    with pytest.raises(error, match=match):
        fn(*args, sm_scale=0.125, interpret=True)


def test_valid_inputs_pass_the_checks():
    out = pk.ragged_paged_attention(*_args(), sm_scale=0.125, interpret=True)
    assert out.shape == (8, 4, 64)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sm_scale=0.0), "sm_scale"),
        (dict(sm_scale=0.1, sliding_window=0), "sliding_window"),
        (dict(sm_scale=0.1, soft_cap=-1.0), "soft_cap"),
        (dict(sm_scale=0.1, block_m=48), r"block_m must be a power of two in \[16, 256\]"),
        (dict(sm_scale=0.1, num_splits=3), "num_splits"),
        (dict(sm_scale=0.1, num_stages=0), "num_stages"),
        (dict(sm_scale=0.1, max_q_len=0), "max_q_len must be a positive int"),
        (dict(sm_scale=0.1, max_q_len=1), r"decode-only.*8 tokens but block_table has 2 rows"),
    ],
)
def test_option_and_tiling_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pk.ragged_paged_attention(*_args(), interpret=True, **kwargs)


def test_unknown_tuning_keyword_lists_the_allowed_ones():
    with pytest.raises(TypeError, match="unknown tuning keyword.*block_q.*allowed.*block_m"):
        pk.ragged_paged_attention(*_args(), sm_scale=0.1, interpret=True, block_q=8)


def test_tuning_tables_hold_valid_tilings():
    assert all(isinstance(t, MixedTiling) for t in MIXED_TABLE.values())
    assert all(isinstance(t, DecodeTiling) for t in DECODE_TABLE.values())
    assert {d for d, _ in MIXED_TABLE} == {64, 128, 256}
