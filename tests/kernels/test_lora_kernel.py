"""The LoRA kernels (`jaxserve.kernels.lora`, interpret mode) against their reference and the engine's jnp product
(`jaxserve.models.lora.lora_delta`): rows of several slots and of the base slot, widths that are not whole tiles,
K split into several partial sums or none; and lowered for an NVIDIA GPU (no GPU needed)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import lora as lk
from jaxserve.models.lora import LoraLinear, add_lora, add_lora_shrink_kernel, lora_delta


def _case(seed: int, rows: int, dim_in: int, slots: int, cols: int, dim_out: int, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, dim_in)), dtype)
    a = jnp.asarray(rng.standard_normal((dim_in, slots * cols)) / np.sqrt(dim_in), dtype)
    b = jnp.asarray(rng.standard_normal((slots * cols, dim_out)), dtype)
    row_slots = jnp.asarray(rng.integers(0, slots, rows), jnp.int32)
    base = jnp.asarray(rng.standard_normal((rows, dim_out)), dtype)
    return x, a, b, row_slots, base


# (rows, K, S, C, N): decode rows with K split many ways; a K that is no whole tile; a prefill's row tiles.
SHAPES = [(1, 512, 5, 48, 192), (5, 200, 3, 16, 70), (20, 384, 4, 24, 64), (70, 256, 2, 40, 130)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_the_kernels_equal_the_reference(shape, dtype):
    rows, dim_in, slots, cols, dim_out = shape
    x, a, b, row_slots, base = _case(sum(shape), rows, dim_in, slots, cols, dim_out, dtype)
    got = lk.lora_add(x, a, b, row_slots, base, cols_per_slot=cols, interpret=True)
    want = lk.lora_reference(x, a, b, row_slots, base, cols)
    assert got.dtype == base.dtype and got.shape == base.shape
    # float32: the partial sums' order only; bf16: x @ a rounded to bf16 before the mask, then one bf16 rounding
    # of the delta and one of the sum, where a rounding of x @ a may fall the other way.
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_the_reference_is_the_engines_product():
    """lora_reference in float32 equals base + lora_delta over the tables laid out as the engine keeps them
    (a [K, S, C], b [S, C, N], a one-hot of the rows' slots)."""
    rows, dim_in, slots, cols, dim_out = 9, 96, 3, 8, 40
    x, a, b, row_slots, base = _case(0, rows, dim_in, slots, cols, dim_out, jnp.float32)
    onehot = jax.nn.one_hot(row_slots, slots, dtype=jnp.float32)
    tables = LoraLinear(None, a.reshape(dim_in, slots, cols), b.reshape(slots, cols, dim_out), onehot)
    with jax.default_matmul_precision("highest"):
        engine = base + lora_delta(x, tables)
    want = lk.lora_reference(x, a, b, row_slots, base, cols)
    np.testing.assert_allclose(np.asarray(want), np.asarray(engine), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_the_shrink_alone_is_x_at_a_and_serves_the_engines_product(shape):
    """lora_shrink (its partial sums over K added by XLA) is x @ a; with XLA's expand (add_lora_shrink_kernel) it
    gives add_lora's product on the engine's table layout, here with wqkv's two input axes."""
    rows, dim_in, slots, cols, dim_out = shape
    x, a, b, row_slots, base = _case(sum(shape), rows, dim_in, slots, cols, dim_out, jnp.float32)
    want = jnp.dot(x, a, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(lk.lora_shrink(x, a, interpret=True)), np.asarray(want), rtol=1e-5, atol=1e-5)

    onehot = jax.nn.one_hot(row_slots, slots, dtype=jnp.float32)
    tables = LoraLinear(None, a.reshape(2, dim_in // 2, slots, cols), b.reshape(slots, cols, dim_out), onehot)
    x2 = x.reshape(rows, 2, dim_in // 2)
    got = add_lora_shrink_kernel(base, x2, tables, interpret=True)
    with jax.default_matmul_precision("highest"):
        engine = add_lora(base, x2, tables)
    np.testing.assert_allclose(np.asarray(got), np.asarray(engine), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="must chain"):
        lk.lora_shrink(x, a[:-1], interpret=True)
    with pytest.raises(TypeError, match="share a float dtype"):
        lk.lora_shrink(x, a.astype(jnp.bfloat16), interpret=True)


def test_the_engines_products_write_the_steps_dtype():
    """lora_delta's two GEMMs write bf16 for bf16 rows (float32 results, cast after, cost an H100 0.45 ms a
    batch-1 step), float32 when asked."""
    rows, dim_in, slots, cols, dim_out = 2, 64, 3, 8, 32
    x, a, b, row_slots, _ = _case(1, rows, dim_in, slots, cols, dim_out, jnp.bfloat16)
    onehot = jax.nn.one_hot(row_slots, slots, dtype=jnp.bfloat16)
    tables = LoraLinear(None, a.reshape(dim_in, slots, cols), b.reshape(slots, cols, dim_out), onehot)

    def dot_outputs(**kwargs):
        text = jax.jit(lambda x, t: lora_delta(x, t, **kwargs)).lower(x, tables).as_text()
        return [line.split("->")[-1] for line in text.splitlines() if "dot_general" in line]

    assert len(dot_outputs()) == 2 and all("bf16" in out for out in dot_outputs())
    assert all("f32" in out for out in dot_outputs(result_dtype=jnp.float32))


def test_the_split_of_k_keeps_a_decode_batchs_programs_busy():
    decode = lk.lora_params(1, 4096, 240, 6144, 48)
    assert decode.splits * (240 // 64 + 1) >= 64 and decode.chunk % decode.block_k == 0
    assert decode.splits * decode.chunk >= 4096 > (decode.splits - 1) * decode.chunk
    assert lk.lora_params(2048, 4096, 240, 6144, 48).splits == 1  # many row tiles: no split


def test_bad_inputs_are_refused():
    x, a, b, row_slots, base = _case(0, 4, 32, 2, 8, 16, jnp.float32)
    with pytest.raises(ValueError, match="whole slots of 6"):
        lk.lora_add(x, a, b, row_slots, base, cols_per_slot=6, interpret=True)
    with pytest.raises(TypeError, match="slots must be int32"):
        lk.lora_add(x, a, b, row_slots.astype(jnp.float32), base, cols_per_slot=8, interpret=True)
    with pytest.raises(ValueError, match="shapes do not chain"):
        lk.lora_add(x, a, b[:, :8], row_slots, base, cols_per_slot=8, interpret=True)
    with pytest.raises(TypeError, match="must share a dtype"):
        lk.lora_add(x, a.astype(jnp.bfloat16), b, row_slots, base, cols_per_slot=8, interpret=True)


def test_the_kernels_lower_for_a_gpu(capsys, monkeypatch):
    """Both kernels lower to Triton for an H200 (cross-platform export), and their bf16 dots take bf16 operands."""
    from jax.experimental import pallas as pl

    monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    args = (
        jnp.zeros((1, 4096), jnp.bfloat16),
        jnp.zeros((4096, 240), jnp.bfloat16),
        jnp.zeros((240, 6144), jnp.bfloat16),
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((1, 6144), jnp.bfloat16),
    )
    fn = jax.jit(lambda *args: lk.lora_add(*args, cols_per_slot=48))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    capsys.readouterr()
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
        jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args)
    ir = capsys.readouterr().out
    # The shrink's dot, and the expand's unrolled one for each 64 of the 240 slot columns.
    assert ir.count("tt.dot") == 1 + 4, "the Triton IR of both kernels was not captured"
    assert "lora_shrink" in ir and "lora_expand" in ir


@pytest.mark.parametrize(
    ("x_shape", "a_shape", "b_shape"),
    [
        ((3, 32), (32, 4, 12), (4, 12, 6, 8)),  # wqkv-like: in [D], out [heads, Dh]
        ((7, 4, 8), (4, 8, 4, 4), (4, 4, 32)),  # wo-like: in [H, Dh], out [D]
    ],
    ids=["fused-out", "two-in-axes"],
)
def test_add_lora_kernels_equal_add_lora(x_shape, a_shape, b_shape):
    """The engine's linear with the kernels in place of XLA's products: the same output over multi-axis inputs
    and outputs (interpret mode, float32)."""
    from jaxserve.models.lora import add_lora, add_lora_kernels

    rng = np.random.default_rng(1)
    x, a, b = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in (x_shape, a_shape, b_shape))
    rows, num_slots = x_shape[0], a_shape[-2]
    onehot = jax.nn.one_hot(jnp.asarray(rng.integers(0, num_slots, rows)), num_slots, dtype=jnp.float32)
    base = jnp.asarray(rng.standard_normal((rows, *b_shape[2:])), jnp.float32)
    tables = LoraLinear(None, a, b, onehot)
    with jax.default_matmul_precision("highest"):
        want = add_lora(base, x, tables)
    got = add_lora_kernels(base, x, tables, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
