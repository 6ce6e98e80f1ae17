"""`add_rms_norm`: a residual add and the RMSNorm after it (jaxserve/models/common.py `rms_norm`) in one launch,
with its jnp reference.

A decoder layer adds each block's output to the residual stream and normalises the sum for the next
block. In a decode step both are small kernels bound by launch latency, so one kernel does both: it
reads x and delta once and writes the residual x + delta and its norm, with the reference's numerics:
the sum rounded to x's dtype (as XLA's add rounds it), float32 statistics of the rounded sum, the
normed rows cast back to x's dtype, then times the weight. Compiled by XLA with its default
xla_allow_excess_precision, the jnp pair may skip those bfloat16 roundings inside a fusion and keep
float32 intermediates, so in bfloat16 the kernel can differ from a jitted pair by one ulp in a few values
while matching the pair as written (the tests compile both with excess precision off).

Grid (row tiles,); a program owns `block_rows` whole rows (the statistics need the whole row), D padded
to a power of two and masked, up to `MAX_DIM` values a row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from jaxserve.models.common import rms_norm

from .checks import FLOAT_DTYPES
from .common import filter_triton_deprecation
from .tuning import check_power_of_two, next_power_of_2

MAX_DIM = 8192
# Values per tile the default tiling aims at: one row of an 8B model (D=4096) per program, several rows
# of a small model's (SmolLM2's D=576 pads to 1024: four rows).
_TILE_VALUES = 4096


def add_rms_norm_reference(
    x: Float[Array, "... D"], delta: Float[Array, "... D"], weight: Float[Array, " D"], eps: float
) -> tuple[Float[Array, "... D"], Float[Array, "... D"]]:
    """(residual, normed) = (x + delta, rms_norm(x + delta)): the XLA ops the kernel replaces."""
    residual = x + delta
    return residual, rms_norm(residual, weight, eps)


def check_add_norm_inputs(x, delta, weight, eps) -> None:
    """Validate add_rms_norm's inputs: x and delta [T, D], weight [D], one float dtype, eps >= 0."""
    if x.ndim != 2 or not 1 <= x.shape[1] <= MAX_DIM:
        raise ValueError(f"x must be [T, D] with 1 <= D <= {MAX_DIM}, got shape {x.shape}")
    if delta.shape != x.shape:
        raise ValueError(f"delta must have x's shape {x.shape}, got {delta.shape}")
    if weight.shape != x.shape[1:]:
        raise ValueError(f"weight must be [D]=[{x.shape[1]}], got shape {weight.shape}")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"x dtype must be one of float32, bfloat16, float16, got {x.dtype}")
    if delta.dtype != x.dtype or weight.dtype != x.dtype:
        raise TypeError(f"delta ({delta.dtype}) and weight ({weight.dtype}) must have x's dtype ({x.dtype})")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")


@dataclass(frozen=True, slots=True)
class NormParams:
    num_rows: int
    dim: int
    block_rows: int
    eps: float

    @property
    def dim_padded(self) -> int:
        return next_power_of_2(self.dim)


def default_block_rows(dim: int) -> int:
    return max(1, _TILE_VALUES // next_power_of_2(dim))


def default_num_warps(block_rows: int, dim: int) -> int:
    """About 8 float32 values per thread, between 1 and 8 warps of 32 threads."""
    return min(8, max(1, block_rows * next_power_of_2(dim) // 256))


def _add_norm_kernel(x_ref, delta_ref, weight_ref, residual_ref, normed_ref, *, p: NormParams):
    rows = pl.program_id(0) * p.block_rows + jnp.arange(p.block_rows, dtype=jnp.int32)
    d = jnp.arange(p.dim_padded, dtype=jnp.int32)
    mask = (rows < p.num_rows)[:, None] & (d < p.dim)[None, :]
    idx = (rows[:, None], d[None, :])
    x = plgpu.load(x_ref.at[idx], mask=mask, other=0.0)
    residual = x + plgpu.load(delta_ref.at[idx], mask=mask, other=0.0)  # rounded to x's dtype, as XLA's add
    plgpu.store(residual_ref.at[idx], residual, mask=mask)
    r32 = residual.astype(jnp.float32)
    # The padding is 0 and adds nothing to the sum; the mean divides by the real D.
    mean_square = jnp.sum(r32 * r32, axis=1) / p.dim
    normed = (r32 * jax.lax.rsqrt(mean_square + p.eps)[:, None]).astype(x.dtype)
    weight = plgpu.load(weight_ref.at[d], mask=d < p.dim, other=0.0)
    plgpu.store(normed_ref.at[idx], (normed * weight[None, :]).astype(x.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_rows", "num_warps"))
def _add_norm(x, delta, weight, *, eps: float, interpret: bool, block_rows: int, num_warps: int):
    p = NormParams(x.shape[0], x.shape[1], block_rows, eps)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(
        functools.partial(_add_norm_kernel, p=p),
        out_shape=(out, out),
        grid=(pl.cdiv(p.num_rows, block_rows),),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(x, delta, weight)


def add_rms_norm(
    x: Float[Array, "T D"],
    delta: Float[Array, "T D"],
    weight: Float[Array, " D"],
    eps: float,
    *,
    interpret: bool = False,
    block_rows: int | None = None,
    num_warps: int | None = None,
) -> tuple[Float[Array, "T D"], Float[Array, "T D"]]:
    """(residual, normed): residual = x + delta and normed = rms_norm(residual, weight, eps), in x's dtype.

    block_rows (a power of two) and num_warps override the default tiling (`default_block_rows`,
    `default_num_warps`)."""
    check_add_norm_inputs(x, delta, weight, eps)
    block_rows = default_block_rows(x.shape[1]) if block_rows is None else block_rows
    check_power_of_two("block_rows", block_rows)
    num_warps = default_num_warps(block_rows, x.shape[1]) if num_warps is None else num_warps
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {num_warps!r}")
    filter_triton_deprecation()
    return _add_norm(x, delta, weight, eps=float(eps), interpret=interpret, block_rows=block_rows, num_warps=num_warps)
