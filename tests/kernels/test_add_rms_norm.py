"""add_rms_norm (Pallas, interpret mode) against add_rms_norm_reference: row counts that fill one tile, a
partial tile and several tiles, D a power of two and D padded (576 -> 1024), float32 within 1e-6 and
bfloat16 bit for bit; bad inputs are clear errors; the kernel lowers for an H200 (cross-platform lowering,
no GPU needed) as one Triton launch that rounds where the reference rounds.

Both sides are compiled with xla_allow_excess_precision off. With it on (XLA's default) the CPU compiler
keeps x + delta and the normed rows in float32 instead of rounding them to bfloat16 as the code says, in
the reference and in the interpreted kernel alike; the Triton kernel on a GPU rounds where the code
rounds. float32 differs from the reference in the last bit of a few values: the two sum the squares in
different orders.
"""

from __future__ import annotations

import contextlib
import io
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxserve import kernels as pk

EPS = 1e-5
AS_WRITTEN = {"xla_allow_excess_precision": False}


def _inputs(rows: int, dim: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x, delta = (jnp.asarray(rng.standard_normal((rows, dim)), dtype) for _ in range(2))
    return x, delta, jnp.asarray(1.0 + 0.5 * rng.standard_normal(dim), dtype)


def _run(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=AS_WRITTEN)(*args)


@pytest.mark.parametrize(
    "dtype,rows,dim,tiling",
    [
        (jnp.float32, 1, 4096, {}),
        (jnp.float32, 5, 576, {}),
        (jnp.float32, 33, 64, {}),  # 64 rows a tile: one partial tile
        (jnp.float32, 300, 576, {}),  # four rows a tile: 75 tiles
        (jnp.bfloat16, 1, 64, {}),
        (jnp.bfloat16, 5, 4096, {}),
        (jnp.bfloat16, 33, 576, {}),
        (jnp.bfloat16, 300, 64, dict(block_rows=16, num_warps=2)),  # 19 tiles, the last one partial
    ],
)
def test_matches_reference(dtype, rows, dim, tiling):
    x, delta, weight = _inputs(rows, dim, dtype, seed=rows + dim)
    residual, normed = _run(partial(pk.add_rms_norm, eps=EPS, interpret=True, **tiling), x, delta, weight)
    want_residual, want_normed = _run(partial(pk.add_rms_norm_reference, eps=EPS), x, delta, weight)
    assert residual.dtype == normed.dtype == dtype and residual.shape == normed.shape == x.shape
    np.testing.assert_array_equal(np.asarray(residual), np.asarray(want_residual))
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(normed), np.asarray(want_normed), rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(np.asarray(normed), np.asarray(want_normed))


@pytest.mark.parametrize(
    "change,error,message",
    [
        (dict(x=jnp.zeros((2, 3, 64))), ValueError, r"x must be \[T, D\]"),
        (dict(x=jnp.zeros((2, 8193)), delta=jnp.zeros((2, 8193)), weight=jnp.ones(8193)), ValueError, "D <= 8192"),
        (dict(delta=jnp.zeros((3, 64))), ValueError, "delta must have x's shape"),
        (dict(weight=jnp.ones(32)), ValueError, r"weight must be \[D\]=\[64\]"),
        (dict(weight=jnp.ones(64, jnp.bfloat16)), TypeError, "must have x's dtype"),
        (dict(x=jnp.zeros((2, 64), jnp.int32), delta=jnp.zeros((2, 64), jnp.int32)), TypeError, "x dtype"),
        (dict(eps=-1.0), ValueError, "eps must be a finite float >= 0"),
        (dict(block_rows=3), ValueError, "block_rows must be a power of two"),
        (dict(num_warps=3), ValueError, "num_warps must be one of"),
    ],
)
def test_bad_inputs_are_clear_errors(change, error, message):
    args = dict(x=jnp.zeros((2, 64)), delta=jnp.zeros((2, 64)), weight=jnp.ones(64), eps=EPS)
    args.update(change)
    with pytest.raises(error, match=message):
        pk.add_rms_norm(**args, interpret=True)


H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")


def test_lowers_for_cuda_as_one_launch_rounding_as_the_reference(monkeypatch):
    """bfloat16, D=576 (padded to 1024, four rows a tile): the residual is added in bfloat16 and widened for
    the statistics, which reduce once per row; the normed rows are narrowed before the weight multiplies."""
    monkeypatch.setattr(pl, "pallas_call", partial(pl.pallas_call, debug=True))  # prints the Triton IR
    x, weight = jnp.zeros((32, 576), jnp.bfloat16), jnp.ones(576, jnp.bfloat16)
    fn = jax.jit(partial(pk.add_rms_norm, eps=EPS))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)):
            exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(x, x, weight)
    assert exported.mlir_module().count("xla.gpu.triton") == 1
    ir = "\n".join(line for line in printed.getvalue().splitlines() if "tt.func" in line or "arith." in line)
    assert "tt.func public @add_rms_norm" in ir
    tile = "tensor<4x1024x"
    residual = re.search(rf"(%\d+) = arith.addf %\d+, %\d+ : {tile}bf16>", ir)
    assert residual, "no bfloat16 residual add"
    assert re.search(rf"arith.extf {residual[1]} : {tile}bf16> to {tile}f32>", ir), "statistics not of the rounded sum"
    normed = re.search(rf"(%\d+) = arith.truncf %\d+ : {tile}f32> to {tile}bf16>\s.*convert_element_type", ir)
    assert normed and re.search(rf"arith.mulf {normed[1]}, %\d+ : {tile}bf16>", ir), "weight not after the cast"
    assert "__nv_rsqrtf" in printed.getvalue() and printed.getvalue().count('"tt.reduce"') == 1
